// Over 800 lines: the soft HCA's `Hca` implementation, one call per verb.
//! The verbs calls of the soft HCA: object creation and destruction, the QP state machine,
//! posting and polling.

use super::*;

impl Hca for SoftHca {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    fn gid(&self) -> Gid {
        self.seg.gid()
    }

    fn alloc_pd(&self) -> Result<Pd> {
        let mut g = self.lock();
        let id = g.next_pd;
        g.next_pd += 1;
        g.pds.push(id);
        Ok(Pd(id))
    }

    fn dealloc_pd(&self, pd: Pd) -> Result<()> {
        let mut g = self.lock();
        let used = g.mrs.iter().flatten().any(|m| m.pd == pd.0)
            || g.qps.iter().flatten().any(|q| q.pd == pd.0)
            || g.srqs.iter().flatten().any(|s| s.pd == pd.0);
        if used {
            return Err(inval(
                "dealloc_pd: the PD still has MRs, QPs or SRQs (EBUSY)",
            ));
        }
        let i = g
            .pds
            .iter()
            .position(|p| *p == pd.0)
            .ok_or_else(|| inval("no such PD"))?;
        g.pds.swap_remove(i);
        Ok(())
    }

    unsafe fn reg_mr(&self, pd: Pd, addr: *mut u8, len: usize, access: Access) -> Result<Mr> {
        let mut g = self.lock();
        if !g.pds.contains(&pd.0) {
            return Err(inval("reg_mr: no such PD"));
        }
        if (access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC))
            && !access.contains(Access::LOCAL_WRITE)
        {
            // ibv_reg_mr: remote write or atomic rights need local write (EINVAL).
            return Err(inval(
                "reg_mr: REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE",
            ));
        }
        let a = addr as u64;
        if len == 0 || a.checked_add(len as u64).is_none() {
            return Err(inval("reg_mr: empty or wrapping range"));
        }
        // Device memory: the region lies in our heap, and peers write it directly.
        let hb = self.seg.heap_base() as u64;
        let dm = g.dms.iter().enumerate().find_map(|(i, d)| {
            d.and_then(|(off, l)| {
                let b = hb + off;
                (a >= b && a + len as u64 <= b + l as u64).then(|| (i as u32, off + (a - b)))
            })
        });
        let i = g.mrs.slot(self.cfg.max_mr as usize).ok_or_else(|| {
            inval(format!(
                "soft HCA: no MR left: {} registered, {} retired after 65,535 registrations \
                 each (raise WEFT_VERBS_SOFT_MAX_MR)",
                g.acct.mrs,
                g.mrs.retired.len()
            ))
        })?;
        if g.mr_gen.len() <= i {
            g.mr_gen.resize(i + 1, 0);
        }
        // Generations 1..=65535; an entry whose last one was used is retired at deregistration
        // (below), so a key once given out never names another registration.
        g.mr_gen[i] += 1;
        let key = (g.mr_gen[i] as u32) << 16 | i as u32;
        let e = self.seg.mr(i).ok_or_else(|| exhausted("MRs"))?;
        e.pd.store(pd.0, RLX);
        e.access.store(access.0, RLX);
        e.addr.store(a, RLX);
        e.len.store(len as u64, RLX);
        e.kind.store(
            if dm.is_some() {
                seg::MR_DM
            } else {
                seg::MR_USER
            },
            RLX,
        );
        e.off.store(dm.map_or(0, |d| d.1), RLX);
        e.key.store(key, SC);
        g.mrs[i] = Some(MrLocal {
            key,
            pd: pd.0,
            access,
            addr: a,
            len,
            dm: dm.map(|d| d.0),
        });
        g.acct.mrs += 1;
        g.acct.mr_bytes += model::mr_bytes(a, len);
        Ok(Mr {
            handle: i as u32,
            lkey: key,
            rkey: key,
            addr: a,
            len,
        })
    }

    fn dereg_mr(&self, mr: Mr) -> Result<()> {
        let g = self.lock();
        let i = mr.handle as usize;
        match g.mrs.get(i) {
            Some(Some(m)) if m.key == mr.lkey => {}
            _ => return Err(inval("dereg_mr: no such MR")),
        }
        if let Some(e) = self.seg.mr(i) {
            e.key.store(0, SC);
        }
        // Remote copies under way into the region finish before we return.
        let mut g = self.wait_unused(g, mr.lkey as u64);
        let spent = g.mr_gen.get(i) == Some(&u16::MAX);
        let m = if spent {
            g.mrs.retire(i)
        } else {
            g.mrs.free(i)
        };
        if let Some(m) = m {
            g.acct.mrs -= 1;
            g.acct.mr_bytes -= model::mr_bytes(m.addr, m.len);
        }
        Ok(())
    }

    fn alloc_dm(&self, len: usize) -> Result<Dm> {
        let mut g = self.lock();
        if len == 0 {
            return Err(inval("alloc_dm: zero length"));
        }
        let off = g
            .heap
            .as_mut()
            .and_then(|h| h.alloc(len as u64, 4096))
            .ok_or_else(|| exhausted("device memory"))?;
        let p = self
            .seg
            .heap(off, len)
            .ok_or_else(|| exhausted("device memory"))?;
        // SAFETY: fresh heap memory nobody else can reach yet (no MR covers it).
        unsafe { std::ptr::write_bytes(p, 0, len) };
        let i = g.dms.slot(usize::MAX).unwrap_or(0);
        g.dms[i] = Some((off, len));
        g.acct.dm_bytes += len as u64;
        Ok(Dm {
            handle: i as u32,
            ptr: p,
            len,
        })
    }

    fn free_dm(&self, dm: Dm) -> Result<()> {
        let mut g = self.lock();
        if g.mrs.iter().flatten().any(|m| m.dm == Some(dm.handle)) {
            return Err(inval("free_dm: an MR still covers it (EBUSY)"));
        }
        let (off, len) = g
            .dms
            .free(dm.handle as usize)
            .ok_or_else(|| inval("free_dm: no such device memory"))?;
        if let Some(h) = g.heap.as_mut() {
            h.free(off, len as u64);
        }
        g.acct.dm_bytes -= len as u64;
        Ok(())
    }

    fn create_cq(&self, cqe: u32) -> Result<Cq> {
        let mut g = self.lock();
        if cqe == 0 || cqe > self.attr.max_cqe {
            return Err(inval(format!(
                "create_cq: cqe must be 1..={}",
                self.attr.max_cqe
            )));
        }
        let cap = (cqe + 1).next_power_of_two();
        let i = g
            .cqs
            .slot(self.cfg.max_cq as usize)
            .ok_or_else(|| exhausted("CQs"))?;
        let bytes = ring::ring_bytes::<CQE_WORDS>(cap as usize) as u64;
        let off = match g.spare_cqs.iter().position(|&(_, c)| c == cap) {
            Some(k) => g.spare_cqs.swap_remove(k).0,
            None => g
                .heap
                .as_mut()
                .and_then(|h| h.alloc(bytes, 128))
                .ok_or_else(|| exhausted("heap"))?,
        };
        let r = self
            .seg
            .ring::<CQE_WORDS>(off, cap)
            .ok_or_else(|| exhausted("heap"))?;
        r.init();
        let e = self.seg.cq(i).ok_or_else(|| exhausted("CQs"))?;
        e.cap.store(cap, RLX);
        e.off.store(off, RLX);
        e.overrun.store(0, RLX);
        e.live.store(1, SC);
        g.cqs[i] = Some(CqLocal {
            cap,
            off,
            asked: cqe,
            stall: None,
        });
        self.cq_at[i].store(
            off << 8 | (cap.trailing_zeros() as u64 + 1),
            Ordering::Release,
        );
        g.acct.cqs += 1;
        g.acct.cq_bytes += model::cq_bytes(cqe);
        Ok(Cq(i as u32))
    }

    fn destroy_cq(&self, cq: Cq) -> Result<()> {
        let g = self.lock();
        if g.cqs.get(cq.0 as usize).is_none_or(|c| c.is_none()) {
            return Err(inval("destroy_cq: no such CQ"));
        }
        if g.qps
            .iter()
            .flatten()
            .any(|q| q.send_cq == cq.0 || q.recv_cq == cq.0)
        {
            return Err(inval("destroy_cq: QPs still use it (EBUSY)"));
        }
        if let Some(e) = self.seg.cq(cq.0 as usize) {
            e.live.store(0, SC);
        }
        self.cq_at[cq.0 as usize].store(0, Ordering::Release);
        let mut g = self.wait_unused(g, seg::TAG_CQ | cq.0 as u64);
        if let Some(c) = g.cqs.free(cq.0 as usize) {
            // Kept for the next CQ of this capacity, not given back to the heap: a poll that
            // read `cq_at` before the store above may still look at its sequence words.
            g.spare_cqs.push((c.off, c.cap));
            g.acct.cqs -= 1;
            g.acct.cq_bytes -= model::cq_bytes(c.asked);
        }
        Ok(())
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        // Most polls find nothing: then the look needs no lock (two atomic stores saved).
        if self.cq_idle(cq.0 as usize) {
            return Ok(0);
        }
        let mut g = self.lock();
        self.progress_all(&mut g);
        let c = g
            .cqs
            .get_mut(cq.0 as usize)
            .and_then(|c| c.as_mut())
            .ok_or_else(|| inval("poll_cq: no such CQ"))?;
        let e = self
            .seg
            .cq(cq.0 as usize)
            .ok_or_else(|| inval("poll_cq: no such CQ"))?;
        if e.overrun.load(SC) != 0 {
            return Err(inval(format!(
                "CQ {} overrun: more completions than its {} entries (IBV_EVENT_CQ_ERR)",
                cq.0, c.asked
            )));
        }
        let r = self
            .seg
            .ring::<CQE_WORDS>(c.off, c.cap)
            .ok_or_else(|| inval("CQ ring"))?;
        let mut n = 0;
        let mut rec = [0u64; CQE_WORDS];
        loop {
            while n < out.len() && r.pop(&mut rec) {
                // A void record (a dead producer's, see below) parses as nothing.
                if let Some(wc) = seg::cqe_parse(&rec) {
                    out[n] = wc;
                    n += 1;
                }
            }
            // Held up by a producer that claimed a slot and did not publish it: a dead one's
            // slot is voided, a stalled one fenced out.
            match r.unpublished() {
                Some(pos) if n == 0 => {
                    let tag = ring::claim_tag(c.off >> 7, pos);
                    if !self.settle(&mut c.stall, tag, || r.void(pos)) {
                        break;
                    }
                }
                _ => break,
            }
        }
        Ok(n)
    }

    fn create_srq(&self, pd: Pd, max_wr: u32, max_sge: u32) -> Result<Srq> {
        let mut g = self.lock();
        if !g.pds.contains(&pd.0) {
            return Err(inval("create_srq: no such PD"));
        }
        if max_wr == 0 || max_wr > self.attr.max_srq_wr || max_sge == 0 || max_sge > MAX_SGE as u32
        {
            return Err(inval(format!(
                "create_srq: max_wr must be 1..={} and max_sge 1..={MAX_SGE}",
                self.attr.max_srq_wr
            )));
        }
        // Twice the limit: a consumer claims a record before it hands its slot back, so a
        // ring exactly as large as the limit could refuse a post the limit allows (a peer
        // between the two steps while the owner posts).
        let cap = (2 * max_wr).next_power_of_two();
        let i = g
            .srqs
            .slot(self.cfg.max_srq as usize)
            .ok_or_else(|| exhausted("SRQs"))?;
        let bytes = ring::ring_bytes::<WQE_WORDS>(cap as usize) as u64;
        let off = g
            .heap
            .as_mut()
            .and_then(|h| h.alloc(bytes, 128))
            .ok_or_else(|| exhausted("heap"))?;
        self.seg
            .ring::<WQE_WORDS>(off, cap)
            .ok_or_else(|| exhausted("heap"))?
            .init();
        let e = self.seg.srq(i).ok_or_else(|| exhausted("SRQs"))?;
        e.cap.store(cap, RLX);
        e.off.store(off, RLX);
        e.pd.store(pd.0, RLX);
        e.limit.store(0, RLX);
        e.event.store(0, RLX);
        e.taken.store(0, RLX);
        e.live.store(1, SC);
        g.srqs[i] = Some(SrqLocal {
            pd: pd.0,
            cap,
            off,
            max_sge,
            asked: max_wr,
            posted: 0,
            stall: None,
        });
        g.acct.srqs += 1;
        g.acct.srq_bytes += model::srq_bytes(max_wr, max_sge);
        Ok(Srq(i as u32))
    }

    fn destroy_srq(&self, srq: Srq) -> Result<()> {
        let g = self.lock();
        if g.srqs.get(srq.0 as usize).is_none_or(|s| s.is_none()) {
            return Err(inval("destroy_srq: no such SRQ"));
        }
        if g.qps.iter().flatten().any(|q| q.srq == Some(srq.0)) {
            return Err(inval("destroy_srq: QPs still use it (EBUSY)"));
        }
        if let Some(e) = self.seg.srq(srq.0 as usize) {
            e.live.store(0, SC);
        }
        let mut g = self.wait_unused(g, seg::TAG_SRQ | srq.0 as u64);
        if let Some(s) = g.srqs.free(srq.0 as usize) {
            let bytes = ring::ring_bytes::<WQE_WORDS>(s.cap as usize) as u64;
            if let Some(h) = g.heap.as_mut() {
                h.free(s.off, bytes);
            }
            g.acct.srqs -= 1;
            g.acct.srq_bytes -= model::srq_bytes(s.asked, s.max_sge);
        }
        Ok(())
    }

    fn arm_srq_limit(&self, srq: Srq, limit: u32) -> Result<()> {
        let g = self.lock();
        let s = g
            .srqs
            .get(srq.0 as usize)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| inval("no such SRQ"))?;
        if limit > s.cap {
            return Err(inval("arm_srq_limit: limit above the SRQ's size"));
        }
        let e = self
            .seg
            .srq(srq.0 as usize)
            .ok_or_else(|| inval("no such SRQ"))?;
        e.event.store(0, RLX);
        e.limit.store(limit, SC);
        Ok(())
    }

    fn srq_limit_reached(&self, srq: Srq) -> Result<bool> {
        let e = self
            .seg
            .srq(srq.0 as usize)
            .filter(|e| e.live.load(RLX) != 0)
            .ok_or_else(|| inval("no such SRQ"))?;
        Ok(e.event.swap(0, SC) != 0)
    }

    fn post_srq_recv(&self, srq: Srq, wrs: &[RecvWr]) -> Result<()> {
        let mut g = self.lock();
        // Where a receive a dead initiator took is completed: a QP of the SRQ, as one took it.
        let owner = g
            .qps
            .iter()
            .flatten()
            .find(|q| q.srq == Some(srq.0))
            .map(|q| (q.recv_cq, q.qpn));
        let s = g
            .srqs
            .get_mut(srq.0 as usize)
            .and_then(|s| s.as_mut())
            .ok_or_else(|| inval("no such SRQ"))?;
        let r = self
            .seg
            .ring::<WQE_WORDS>(s.off, s.cap)
            .ok_or_else(|| inval("SRQ ring"))?;
        for (k, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > s.max_sge as usize {
                return Err(inval(format!(
                    "post_srq_recv: request {k} has more than {} SGEs",
                    s.max_sge
                )));
            }
            let rec = seg::wqe_record(wr.wr_id, &wr.sg_list);
            let mut pushed = r.len() < s.asked as usize && r.push(seg::wqe_used(&rec));
            // Full where it should not be: an initiator took a receive and never handed its
            // slot back. A dead one's receive completes with a flush error, its slot freed.
            if !pushed && r.len() < s.asked as usize {
                if let Some(q) = r.unreleased() {
                    let tag = ring::claim_tag(s.off >> 7, q);
                    let mut w = [0u64; WQE_WORDS];
                    if self.settle(&mut s.stall, tag, || r.release(q, &mut w)) {
                        if let (Some(e), Some((cq, qpn))) = (self.seg.srq(srq.0 as usize), owner) {
                            self.flush_taken(cq, qpn, &w, &e.taken);
                        }
                        pushed = r.push(seg::wqe_used(&rec));
                    }
                }
            }
            if !pushed {
                return Err(inval(format!(
                    "post_srq_recv: request {k}: the SRQ is full (ENOMEM)"
                )));
            }
            s.posted += wr.sg_list.iter().map(|x| x.length as u64).sum::<u64>();
        }
        Ok(())
    }

    fn create_qp(&self, pd: Pd, init: &QpInitAttr) -> Result<Qp> {
        let mut g = self.lock();
        if !g.pds.contains(&pd.0) {
            return Err(inval("create_qp: no such PD"));
        }
        let has =
            |v: &Vec<Option<CqLocal>>, c: Cq| v.get(c.0 as usize).is_some_and(|x| x.is_some());
        if !has(&g.cqs, init.send_cq) || !has(&g.cqs, init.recv_cq) {
            return Err(inval("create_qp: no such CQ"));
        }
        if let Some(s) = init.srq {
            if g.srqs.get(s.0 as usize).is_none_or(|x| x.is_none()) {
                return Err(inval("create_qp: no such SRQ"));
            }
        }
        let c = init.cap;
        let a = &self.attr;
        if c.max_send_wr == 0
            || c.max_send_wr > a.max_qp_wr
            || c.max_recv_wr > a.max_qp_wr
            || (init.srq.is_none() && c.max_recv_wr == 0)
            || c.max_send_sge > a.max_sge
            || c.max_recv_sge > a.max_sge
            || c.max_inline_data > a.max_inline_data
        {
            return Err(inval(format!(
                "create_qp: capabilities {c:?} exceed the device's (wr {}, sge {}, inline {})",
                a.max_qp_wr, a.max_sge, a.max_inline_data
            )));
        }
        let i = g
            .qps
            .slot(self.cfg.max_qp as usize)
            .ok_or_else(|| exhausted("QPs"))?;
        if g.qp_gen.len() <= i {
            g.qp_gen.resize(i + 1, 0);
        }
        g.qp_gen[i] = g.qp_gen[i].wrapping_add(1).max(1);
        let qpn = (g.qp_gen[i] as u32) << 16 | i as u32;
        let (rq_off, rq_cap) = if init.srq.is_none() {
            // Twice the limit, as for an SRQ (`create_srq`).
            let cap = (2 * c.max_recv_wr).next_power_of_two();
            let bytes = ring::ring_bytes::<WQE_WORDS>(cap as usize) as u64;
            let off = g
                .heap
                .as_mut()
                .and_then(|h| h.alloc(bytes, 128))
                .ok_or_else(|| exhausted("heap"))?;
            self.seg
                .ring::<WQE_WORDS>(off, cap)
                .ok_or_else(|| exhausted("heap"))?
                .init();
            (off, cap)
        } else {
            (0, 0)
        };
        let e = self.seg.qp(i).ok_or_else(|| exhausted("QPs"))?;
        e.state.store(QpState::Reset as u32, RLX);
        e.qp_type.store(init.qp_type as u32, RLX);
        e.pd.store(pd.0, RLX);
        e.recv_cq.store(init.recv_cq.0, RLX);
        e.srq.store(init.srq.map_or(0, |s| s.0 + 1), RLX);
        e.rq_off.store(rq_off, RLX);
        e.rq_cap.store(rq_cap, RLX);
        e.rq_taken.store(0, RLX);
        e.fault.store(0, RLX);
        e.dest_qpn.store(0, RLX);
        e.access.store(0, RLX);
        for k in 0..seg::REPLAY {
            e.replay_psn[k].store(0, RLX);
        }
        e.qpn.store(qpn, SC);
        let ud = init.qp_type == QpType::Ud;
        let bytes = model::qp_bytes(ud, &c, init.srq.is_some());
        if ud {
            g.acct.ud_qps += 1;
            g.acct.ud_qp_bytes += bytes;
        } else {
            g.acct.rc_qps += 1;
            g.acct.rc_qp_bytes += bytes;
        }
        g.qps[i] = Some(Box::new(QpLocal {
            qpn,
            ty: init.qp_type,
            pd: pd.0,
            send_cq: init.send_cq.0,
            recv_cq: init.recv_cq.0,
            srq: init.srq.map(|s| s.0),
            cap: c,
            sig_all: init.sq_sig_all,
            state: QpState::Reset,
            mtu: self.cfg.mtu,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: 0,
            dest: None,
            rq_off,
            rq_cap,
            rq_posted: 0,
            sq: VecDeque::new(),
            wait_until: None,
            rnr_tries: 0,
            retries: 0,
            held: None,
            ex: None,
            rq_stall: None,
        }));
        Ok(Qp {
            handle: i as u32,
            qpn,
        })
    }

    fn modify_qp(&self, qp: Qp, at: &QpAttr) -> Result<()> {
        let mut g = self.lock();
        let (cur, ty) = {
            let q = Core::qp_mut(&mut g, qp)?;
            self.sync_state(q);
            (q.state, q.ty)
        };
        let to = at.qp_state.unwrap_or(cur);
        if !cur.can_go(to) {
            return Err(inval(format!(
                "modify_qp: {cur:?} -> {to:?} is not a legal transition"
            )));
        }
        let need = |ok: bool, what: &str| -> Result<()> {
            if ok {
                Ok(())
            } else {
                Err(inval(format!(
                    "modify_qp: {cur:?} -> {to:?} on a {ty:?} QP needs {what}"
                )))
            }
        };
        let rc = ty == QpType::Rc;
        let entering = cur != to;
        match to {
            QpState::Init if entering => {
                if rc {
                    need(at.qp_access_flags.is_some(), "qp_access_flags")?;
                } else {
                    need(at.qkey.is_some(), "qkey")?;
                }
            }
            QpState::Rtr if entering && rc => {
                need(at.ah_attr.is_some(), "ah_attr")?;
                need(at.path_mtu.is_some(), "path_mtu")?;
                need(at.dest_qp_num.is_some(), "dest_qp_num")?;
                need(at.rq_psn.is_some(), "rq_psn")?;
                need(at.max_dest_rd_atomic.is_some(), "max_dest_rd_atomic")?;
                need(at.min_rnr_timer.is_some(), "min_rnr_timer")?;
            }
            QpState::Rts if entering => {
                need(at.sq_psn.is_some(), "sq_psn")?;
                if rc {
                    need(at.timeout.is_some(), "timeout")?;
                    need(at.retry_cnt.is_some(), "retry_cnt")?;
                    need(at.rnr_retry.is_some(), "rnr_retry")?;
                    need(at.max_rd_atomic.is_some(), "max_rd_atomic")?;
                }
            }
            _ => {}
        }
        if at.retry_cnt.is_some_and(|v| v > 7) || at.rnr_retry.is_some_and(|v| v > 7) {
            return Err(inval("modify_qp: retry_cnt and rnr_retry are 0..=7"));
        }
        if at.timeout.is_some_and(|v| v > 31) || at.min_rnr_timer.is_some_and(|v| v > 31) {
            return Err(inval("modify_qp: timeout and min_rnr_timer are 0..=31"));
        }
        if at
            .max_dest_rd_atomic
            .is_some_and(|v| v as u32 > self.attr.max_qp_rd_atom)
            || at
                .max_rd_atomic
                .is_some_and(|v| v as u32 > self.attr.max_qp_rd_atom)
        {
            return Err(inval(format!(
                "modify_qp: read/atomic depth above {}",
                self.attr.max_qp_rd_atom
            )));
        }
        if at
            .path_mtu
            .is_some_and(|m| m.bytes() > self.attr.active_mtu.bytes())
        {
            return Err(inval("modify_qp: path_mtu above the port's active MTU"));
        }
        let peer = match (&at.ah_attr, rc) {
            (Some(ah), true) => Some(self.peer(&mut g, &ah.dgid)?),
            _ => None,
        };
        let qi = qp.handle as usize;
        let e = self.seg.qp(qi).ok_or_else(|| inval("no such QP"))?;
        let q = Core::qp_mut(&mut g, qp)?;
        if let Some(a) = at.qp_access_flags {
            e.access.store(a.0, RLX);
        }
        if let Some(k) = at.qkey {
            e.qkey.store(k, RLX);
        }
        if let Some(m) = at.path_mtu {
            q.mtu = m;
        }
        if let Some(t) = at.min_rnr_timer {
            e.min_rnr_timer.store(t as u32, RLX);
        }
        if let Some(v) = at.max_dest_rd_atomic {
            e.max_dest_rd_atomic.store(v as u32, RLX);
        }
        if let Some(p) = at.rq_psn {
            e.epsn.store(p & 0xff_ffff, RLX);
        }
        if let Some(p) = at.sq_psn {
            q.sq_psn = p & 0xff_ffff;
        }
        if let Some(t) = at.timeout {
            q.timeout = t;
        }
        if let Some(t) = at.retry_cnt {
            q.retry_cnt = t;
        }
        if let Some(t) = at.rnr_retry {
            q.rnr_retry = t;
        }
        if let (Some(peer), Some(ah), Some(dq)) = (peer, at.ah_attr, at.dest_qp_num) {
            let w = gid_words(&ah.dgid);
            e.dest_gid[0].store(w[0], RLX);
            e.dest_gid[1].store(w[1], RLX);
            e.dest_qpn.store(dq, RLX);
            q.dest = Some((peer, dq, ah.dgid));
        }
        match to {
            QpState::Err if entering => self.to_error(q),
            QpState::Reset if entering => {
                // Back to a fresh QP: queues emptied without completions.
                q.sq.clear();
                q.held = None;
                q.ex = None;
                q.dest = None;
                e.dest_qpn.store(0, RLX);
                if let Some(r) = self.seg.ring::<WQE_WORDS>(q.rq_off, q.rq_cap) {
                    let mut w = [0u64; WQE_WORDS];
                    while r.pop_by(&mut w, seg::wqe_words) {}
                }
                e.rq_taken.store(0, RLX);
                e.fault.store(0, RLX);
                q.rq_posted = 0;
                q.state = QpState::Reset;
                e.state.store(QpState::Reset as u32, SC);
            }
            _ => {
                q.state = to;
                e.state.store(to as u32, SC);
            }
        }
        Ok(())
    }

    fn query_qp_state(&self, qp: Qp) -> Result<QpState> {
        let mut g = self.lock();
        let q = Core::qp_mut(&mut g, qp)?;
        self.sync_state(q);
        Ok(q.state)
    }

    fn query_qp_cap(&self, qp: Qp) -> Result<QpCap> {
        let mut g = self.lock();
        Ok(Core::qp_mut(&mut g, qp)?.cap)
    }

    fn destroy_qp(&self, qp: Qp) -> Result<()> {
        let mut g = self.lock();
        Core::qp_mut(&mut g, qp)?;
        let qi = qp.handle as usize;
        if let Some(e) = self.seg.qp(qi) {
            e.state.store(QpState::Err as u32, SC);
            e.qpn.store(0, SC);
        }
        let mut g = self.wait_unused(g, seg::TAG_QP | qp.qpn as u64);
        if let Some(q) = g.qps.free(qi) {
            if q.rq_cap > 0 {
                let bytes = ring::ring_bytes::<WQE_WORDS>(q.rq_cap as usize) as u64;
                if let Some(h) = g.heap.as_mut() {
                    h.free(q.rq_off, bytes);
                }
            }
            let bytes = model::qp_bytes(q.ty == QpType::Ud, &q.cap, q.srq.is_some());
            if q.ty == QpType::Ud {
                g.acct.ud_qps -= 1;
                g.acct.ud_qp_bytes -= bytes;
            } else {
                g.acct.rc_qps -= 1;
                g.acct.rc_qp_bytes -= bytes;
            }
        }
        Ok(())
    }

    fn create_ah(&self, pd: Pd, attr: &AhAttr) -> Result<Ah> {
        let mut g = self.lock();
        if !g.pds.contains(&pd.0) {
            return Err(inval("create_ah: no such PD"));
        }
        let peer = self.peer(&mut g, &attr.dgid)?;
        let i = g.ahs.slot(usize::MAX).unwrap_or(0);
        g.ahs[i] = Some((peer, *attr));
        Ok(Ah(i as u32))
    }

    fn destroy_ah(&self, ah: Ah) -> Result<()> {
        let mut g = self.lock();
        g.ahs
            .free(ah.0 as usize)
            .map(|_| ())
            .ok_or_else(|| inval("destroy_ah: no such AH"))
    }

    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> Result<()> {
        let mut g = self.lock();
        let q = Core::qp_mut(&mut g, qp)?;
        self.sync_state(q);
        if q.state == QpState::Err {
            // Posting to a QP in error is allowed; the requests complete flushed.
            for wr in wrs {
                self.push_own(q.send_cq, &flush_wc(wr, q.qpn));
            }
            return Ok(());
        }
        if q.state != QpState::Rts {
            return Err(inval(format!(
                "post_send: QP {:#x} is in {:?}, not RTS",
                q.qpn, q.state
            )));
        }
        let mut bad = None;
        for (k, wr) in wrs.iter().enumerate() {
            let why = if q.sq.len() >= q.cap.max_send_wr as usize {
                Some(format!(
                    "the send queue is full ({} requests, ENOMEM)",
                    q.cap.max_send_wr
                ))
            } else if wr.sg_list.len() > q.cap.max_send_sge as usize {
                Some(format!(
                    "{} SGEs, the QP allows {}",
                    wr.sg_list.len(),
                    q.cap.max_send_sge
                ))
            } else if wr.is_inline()
                && (wr.len() > q.cap.max_inline_data as usize
                    || !matches!(
                        wr.opcode,
                        WrOpcode::Send
                            | WrOpcode::SendWithImm
                            | WrOpcode::RdmaWrite
                            | WrOpcode::RdmaWriteWithImm
                    ))
            {
                Some(format!(
                    "inline data of {} bytes (QP allows {}, sends and writes only)",
                    wr.len(),
                    q.cap.max_inline_data
                ))
            } else if q.ty == QpType::Ud
                && (!matches!(wr.opcode, WrOpcode::Send | WrOpcode::SendWithImm) || wr.ud.is_none())
            {
                Some("a UD QP takes sends with a destination (SendWr::to) only".to_string())
            } else if wr.opcode.is_atomic() && (wr.sg_list.len() != 1 || wr.sg_list[0].length != 8)
            {
                Some("an atomic needs one 8-byte SGE".to_string())
            } else if wr.len() > u32::MAX as usize {
                Some("message longer than 4 GiB".to_string())
            } else {
                None
            };
            if let Some(w) = why {
                bad = Some(format!("post_send: request {k} (wr_id {}): {w}", wr.wr_id));
                break;
            }
            let data = wr.is_inline().then(|| {
                let mut d = Vec::with_capacity(wr.len());
                // A zero-length SGE adds nothing, whatever its address (NULL, as UCX posts).
                for s in wr.sg_list.iter().filter(|s| s.length > 0) {
                    // SAFETY: an inline request is made only by the unsafe `SendWr::inlined`,
                    // whose caller promised that its SGEs are readable memory of this process
                    // for the duration of this call.
                    d.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(s.addr as *const u8, s.length as usize)
                    });
                }
                d
            });
            let psn = q.sq_psn;
            q.sq_psn = (q.sq_psn + 1) & 0xff_ffff;
            self.sq_busy();
            q.sq.push_back(Pending {
                wr: wr.clone(),
                data,
                psn,
                due: None,
                acked_lost: false,
                counted: false,
            });
        }
        self.drive(&mut g, qp.handle as usize);
        match bad {
            Some(b) => Err(inval(b)),
            None => Ok(()),
        }
    }

    fn post_recv(&self, qp: Qp, wrs: &[RecvWr]) -> Result<()> {
        let mut g = self.lock();
        let q = Core::qp_mut(&mut g, qp)?;
        self.sync_state(q);
        if q.srq.is_some() {
            return Err(inval("post_recv: the QP receives through its SRQ"));
        }
        if q.state == QpState::Reset {
            return Err(inval("post_recv: QP in RESET"));
        }
        let e = self
            .seg
            .qp(qp.handle as usize)
            .ok_or_else(|| inval("no such QP"))?;
        let r = self
            .seg
            .ring::<WQE_WORDS>(q.rq_off, q.rq_cap)
            .ok_or_else(|| inval("RQ ring"))?;
        for (k, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > q.cap.max_recv_sge as usize {
                return Err(inval(format!(
                    "post_recv: request {k} has more than {} SGEs",
                    q.cap.max_recv_sge
                )));
            }
            let rec = seg::wqe_record(wr.wr_id, &wr.sg_list);
            let room = r.len() < q.cap.max_recv_wr as usize;
            let mut pushed = room && r.push(seg::wqe_used(&rec));
            // As in `post_srq_recv`: a slot a dead initiator never handed back.
            if !pushed && room {
                if let Some(p) = r.unreleased() {
                    let tag = ring::claim_tag(q.rq_off >> 7, p);
                    let mut w = [0u64; WQE_WORDS];
                    if self.settle(&mut q.rq_stall, tag, || r.release(p, &mut w)) {
                        self.flush_taken(q.recv_cq, q.qpn, &w, &e.rq_taken);
                        pushed = r.push(seg::wqe_used(&rec));
                    }
                }
            }
            if !pushed {
                return Err(inval(format!(
                    "post_recv: request {k}: the receive queue is full (ENOMEM)"
                )));
            }
            q.rq_posted += wr.sg_list.iter().map(|x| x.length as u64).sum::<u64>();
        }
        // A peer may have failed the QP meanwhile: what we queued is flushed too.
        if q.state == QpState::Err || e.state.load(SC) == QpState::Err as u32 {
            let qi = qp.handle as usize;
            exec::flush_rq(&self.seg, qi, None, |cq, wc| self.push_own(cq, wc));
        }
        Ok(())
    }

    fn progress(&self) {
        let mut g = self.lock();
        self.progress_all(&mut g);
    }

    fn accounting(&self) -> Accounting {
        let g = self.lock();
        let mut a = g.acct;
        for (i, q) in g.qps.iter().enumerate() {
            if let (Some(q), Some(e)) = (q, self.seg.qp(i)) {
                if let Some(r) = self.seg.ring::<WQE_WORDS>(q.rq_off, q.rq_cap) {
                    a.posted_recvs += r.len() as u64;
                    a.posted_recv_bytes += q.rq_posted.saturating_sub(e.rq_taken.load(RLX));
                }
            }
        }
        for (i, s) in g.srqs.iter().enumerate() {
            if let (Some(s), Some(e)) = (s, self.seg.srq(i)) {
                if let Some(r) = self.seg.ring::<WQE_WORDS>(s.off, s.cap) {
                    a.posted_recvs += r.len() as u64;
                    a.posted_recv_bytes += s.posted.saturating_sub(e.taken.load(RLX));
                }
            }
        }
        a
    }

    fn counters(&self) -> Counters {
        let mut c = self.lock().ctr.clone();
        c.ud_dropped += self.wire.ud_dropped();
        c.remote_served = self.wire.served();
        c
    }
}

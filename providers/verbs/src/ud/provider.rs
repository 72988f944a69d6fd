//! verbs-ud as a weft provider: the contract's entry points, opening by name and the teardown.

use super::*;

impl Provider for VerbsUd {
    fn name(&self) -> &str {
        "verbs-ud"
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let i = self.check_rank(dest)?;
        if header.len() > MAX_HDR {
            return Err(Error::invalid(format!(
                "verbs-ud: header of {} bytes (at most {MAX_HDR})",
                header.len()
            )));
        }
        let total: usize = payload.iter().map(|p| p.len()).sum();
        if total > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "verbs-ud: payload of {total} bytes (at most {}: the packets of one message \
                 must fit WEFT_VERBS_UD_WINDOW and WEFT_VERBS_UD_SEND_BUFS)",
                self.caps.max_am_payload
            )));
        }
        if self.peers[i].failed {
            return Err(self.peer_gone(dest));
        }
        let room = self.cfg.mtu - PKT;
        let bytes = header.len() + total;
        let packets = bytes.div_ceil(room).max(1);
        let link = Self::link_of(
            &mut self.peers[i],
            dest,
            &self.cfg,
            &mut self.active,
            &mut self.busy,
        );
        if link.room() < packets || self.send.free.len() < packets {
            return Ok(SendOutcome::Busy);
        }
        // Header and payload, cut into packets: slices copied whole (not byte by byte).
        let parts: smallvec::SmallVec<[&[u8]; 8]> = std::iter::once(header)
            .chain(payload.iter().map(|p| &**p))
            .filter(|p| !p.is_empty())
            .collect();
        let (mut part, mut at) = (0usize, 0usize);
        for k in 0..packets {
            let slot = self.send.free.pop().expect("counted above");
            let n = room.min(bytes - k * room);
            // SAFETY: a free send slot: no send of it is outstanding.
            let b = unsafe { self.send.buf(slot) };
            let flags =
                if k == 0 { F_FIRST } else { 0 } | if k + 1 == packets { F_LAST } else { 0 };
            wire::put_data(b, flags, header.len() as u16, self.rank, total as u32);
            let mut filled = 0;
            while filled < n {
                let src = &parts[part][at..];
                let c = src.len().min(n - filled);
                b[PKT + filled..PKT + filled + c].copy_from_slice(&src[..c]);
                filled += c;
                at += c;
                if at == parts[part].len() {
                    part += 1;
                    at = 0;
                }
            }
            self.send_len[slot as usize] = (PKT + n) as u32;
            if link.send(slot).is_err() {
                // Counted above: the window had room.
                self.send.free.push(slot);
                return Err(Error::invalid("verbs-ud: send window accounting"));
            }
        }
        self.stats.am_sent += 1;
        self.transmit(dest, reliable::now())?;
        Ok(SendOutcome::Sent)
    }

    /// First contact (the core calls this once, before the first operation towards `peer`):
    /// read its address, make the address handle and the link now, so that the first send
    /// finds them; a peer that published no address fails here.
    fn connect(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if self.peers[i].failed {
            return Err(self.peer_gone(peer));
        }
        self.ah_of(peer)?;
        self.link(peer);
        Ok(())
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut events = 0;
        // An idle call (nothing completed, nothing waiting here) only polls: timers
        // (retransmission, delayed acknowledgements, keepalives) run on every IDLE_CHECK-th
        // idle call, which keeps the clock and the links out of the spin loop.
        let n = self.hca.poll_cq(self.cq, &mut self.wcs)?;
        if n == 0
            && self.zin.is_empty()
            && self.failures.is_empty()
            && self.zsends.iter().all(Option::is_none)
        {
            self.idle = self.idle.wrapping_add(1);
            if self.idle % IDLE_CHECK != 0 {
                return Ok(0);
            }
        }
        if n == 0 {
            // Timers' turn: nothing is arriving, so the buffers consumed so far go back now.
            self.repost()?;
        }
        self.idle = 0;
        let now = reliable::now();
        let mut first = Some(n);
        loop {
            let mut wcs = std::mem::take(&mut self.wcs);
            let n = match first.take() {
                Some(n) => n,
                None => self.hca.poll_cq(self.cq, &mut wcs)?,
            };
            for wc in &wcs[..n] {
                let idx = (wc.wr_id & 0xffff_ffff) as u32;
                match wc.wr_id & K_MASK {
                    K_RECV => {
                        if wc.status == WcStatus::Success {
                            let len = (wc.byte_len as usize).saturating_sub(GRH);
                            let from = (wc.src_qp, wc.grh);
                            events += self.on_recv(idx, len, from, now, sink);
                        }
                        self.repost.push(idx);
                    }
                    K_SEND => {
                        self.sq_used -= 1;
                        let s = idx as usize;
                        self.send_refs[s] = self.send_refs[s].saturating_sub(1);
                        self.maybe_free(idx);
                    }
                    K_CTL => {
                        self.sq_used -= 1;
                        self.ctl.free.push(idx);
                    }
                    K_ZRX => {
                        let q = ((wc.wr_id >> 48) & 0xff) as usize;
                        let gen = ((wc.wr_id >> 32) & 0xffff) as u32;
                        let Some(zq) = self.zqps.get(q) else {
                            continue;
                        };
                        // A completion of receives taken back earlier is not this transfer's.
                        if zq.gen & 0xffff != gen {
                            continue;
                        }
                        let Some(zr) = zq.user.and_then(|u| self.zrecvs.get_mut(u)?.as_mut())
                        else {
                            continue;
                        };
                        let got = match (wc.status, wc.imm) {
                            (WcStatus::Success, Some(imm)) => {
                                let (x, k) = zcopy::split_imm(imm);
                                Some((x, k, (wc.byte_len as usize).saturating_sub(GRH)))
                            }
                            _ => None,
                        };
                        zr.r.on_landed(got);
                    }
                    K_ZTX => {
                        self.sq_used -= 1;
                        if let Some(z) = self.zsends.get_mut(idx as usize).and_then(Option::as_mut)
                        {
                            z.outstanding = z.outstanding.saturating_sub(1);
                            if wc.status != WcStatus::Success && z.result.is_none() {
                                z.result = Some(Err(Error::invalid(format!(
                                    "verbs-ud: a zero-copy piece failed: {}",
                                    wc.status.as_str()
                                ))));
                            }
                        }
                    }
                    _ => {}
                }
            }
            self.wcs = wcs;
            // Consumed receive buffers go back in batches (one post for several).
            if self.repost.len() >= REPOST {
                self.repost()?;
            }
            if n < POLL {
                break;
            }
        }
        if let Some(every) = self.cfg.keepalive {
            if now >= self.next_keepalive {
                self.next_keepalive = now + every;
                self.keepalives();
            }
        }
        let busy = std::mem::take(&mut self.busy);
        for &r in &busy {
            events += self.drain(r, sink);
            let link = self.peers[r as usize].link.as_mut().expect("busy");
            // Checks its own timers (cheaper than asking for the next one first).
            link.on_timeout(now);
            if link.failed() && !self.peers[r as usize].failed {
                let why = format!(
                    "no acknowledgement for {} s",
                    self.cfg.timeout.as_secs_f64()
                );
                self.fail_peer(r, why);
            }
        }
        for (src, body) in std::mem::take(&mut self.zin) {
            self.zctl(src, &body)?;
        }
        self.zpump()?;
        events += self.zcomplete(sink);
        // Links that became busy meanwhile (a first packet from a new peer) joined
        // `self.busy`; they transmit on the next call.
        let mut busy = busy;
        let old = busy.len();
        busy.append(&mut self.busy);
        self.busy = busy;
        for k in 0..old {
            let r = self.busy[k];
            if !self.peers[r as usize].ctl_out.is_empty() {
                self.flush_ctl(r);
            }
            self.transmit(r, now)?;
        }
        // Idle links leave (a failed peer's too: it was failed above and sends nothing more).
        let peers = &mut self.peers;
        self.busy.retain(|&r| {
            let p = &mut peers[r as usize];
            let keep =
                !p.failed && (!p.ctl_out.is_empty() || p.link.as_ref().is_some_and(|l| !l.idle()));
            p.busy = keep;
            keep
        });
        while let Some((r, why)) = self.failures.pop_front() {
            sink.peer_failed(r, &why);
            events += 1;
        }
        Ok(events)
    }

    fn peer_caps(&self, _peer: Rank) -> Option<PeerCaps> {
        // Written (UD zero-copy), never read: the core's write rendezvous.
        let mut p = PeerCaps::from(&self.caps);
        p.rma_read = false;
        Some(p)
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if access.remote_read || access.remote_atomic {
            return Err(Error::from(ErrorDetail::Unsupported(
                "verbs-ud: no RDMA reads or atomics over unreliable datagrams".into(),
            )));
        }
        if self.zqps.is_empty() {
            return Err(Error::from(ErrorDetail::Unsupported(
                "verbs-ud: zero-copy is off (WEFT_VERBS_UD_ZCOPY_QPS=0)".into(),
            )));
        }
        if len == 0 {
            return Ok(MemRegion {
                key: 0,
                addr: base as u64,
                len: 0,
                handle: u64::MAX,
                desc: 0,
            });
        }
        if access.remote_write {
            return self.zrecv_open(base, len, access.shared);
        }
        let va = if access.local_write {
            verbs::Access::LOCAL_WRITE
        } else {
            verbs::Access(0)
        };
        // SAFETY: the caller keeps the memory valid until `mr_deregister` (this function's
        // contract), which is the HCA's registration contract.
        let mr = unsafe { self.hca.reg_mr(self.pd, base, len, va) }?;
        self.locals.insert(mr.handle, mr);
        Ok(MemRegion {
            key: 0,
            addr: base as u64,
            len,
            handle: mr.handle as u64,
            desc: mr.lkey as u64,
        })
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        if mr.handle == u64::MAX {
            return Ok(());
        }
        if mr.handle & Z_HANDLE != 0 {
            return self.zrecv_close((mr.handle & !Z_HANDLE) as usize);
        }
        let m = u32::try_from(mr.handle)
            .ok()
            .and_then(|h| self.locals.remove(&h))
            .ok_or_else(|| Error::invalid("verbs-ud: deregistering an unknown region"))?;
        self.hca.dereg_mr(m)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let i = self.check_rank(dest)?;
        if self.peers[i].failed {
            return Err(self.peer_gone(dest));
        }
        let bad = |what: &str| {
            Error::from(ErrorDetail::RemoteAccess {
                rank: dest,
                what: what.into(),
            })
        };
        let key = zcopy::Key::decode(remote.key)
            .filter(|k| k.piece == self.cfg.mtu)
            .ok_or_else(|| {
                bad("not a UD zero-copy key of this MTU (WEFT_VERBS_UD_MTU must agree)")
            })?;
        if remote.addr != 0 {
            return Err(bad("a zero-copy write starts at its region's start"));
        }
        let [one] = local else {
            return Err(Error::invalid(
                "verbs-ud: a zero-copy write takes one local piece",
            ));
        };
        let n = one.len.div_ceil(key.piece);
        if one.len == 0 || n > zcopy::MAX_PIECES as usize || one.desc == 0 {
            return Err(Error::invalid(format!(
                "verbs-ud: a zero-copy write of {} bytes from a registered buffer (at most {} pieces)",
                one.len,
                zcopy::MAX_PIECES
            )));
        }
        let z = ZSend {
            dest,
            key,
            ptr: one.ptr,
            len: one.len,
            lkey: one.desc as u32,
            queue: (0..key.first.min(n as u32)).collect(),
            round: 0,
            done_due: true,
            outstanding: 0,
            result: None,
            token: done.cq,
        };
        match self.zsends.iter().position(Option::is_none) {
            Some(s) => self.zsends[s] = Some(z),
            None => self.zsends.push(Some(z)),
        }
        self.stats.zsends += 1;
        self.link(dest);
        self.zpump()?;
        self.transmit(dest, reliable::now())
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let mut st = reliable::Stats::default();
        for (_, p) in self.peers.iter() {
            if let Some(l) = &p.link {
                let x = l.stats();
                st.resent += x.resent;
                st.timeouts += x.timeouts;
                st.fast_resends += x.fast_resends;
                st.pure_acks += x.pure_acks;
                st.duplicates += x.duplicates;
                st.kept += x.kept;
            }
        }
        let hc = self.hca.counters();
        let mem = self.memory();
        vec![
            ("am_sent", s.am_sent),
            ("am_received", s.am_recv),
            ("packets_sent", s.packets_sent),
            ("packets_received", s.packets_recv),
            ("resent", st.resent),
            ("timeouts", st.timeouts),
            ("fast_resends", st.fast_resends),
            ("pure_acks", st.pure_acks),
            ("duplicates", st.duplicates),
            ("out_of_order_kept", st.kept),
            ("malformed", s.malformed),
            ("spoofed", s.spoofed),
            ("links", self.active.len() as u64),
            ("busy_links", self.busy.len() as u64),
            ("zcopy_sends", s.zsends),
            ("zcopy_recvs", s.zrecvs),
            ("zcopy_pieces", s.zpieces),
            ("zcopy_rounds", s.zrounds),
            ("zcopy_moved", s.zmoved),
            ("zcopy_regranted", s.zregranted),
            ("zcopy_refused", s.zrefused),
            ("hca_ud_dropped", hc.ud_dropped),
            ("hca_ud_duplicated", hc.ud_duplicated),
            ("hca_qp_cache_misses", hc.qp_cache_misses),
            ("mem_hca_bytes", mem.0),
            ("mem_buffer_bytes", mem.1),
            ("mem_peer_bytes", mem.2),
        ]
    }

    fn close(&mut self) -> Result<()> {
        // After the final barrier: let the last packets be acknowledged (a peer may still
        // need them), bounded — a peer that already left never acknowledges.
        let deadline = reliable::now() + Duration::from_millis(250);
        // Empty rounds yield, then sleep: the acknowledgements come from peers' processes,
        // which on an oversubscribed host need the CPU this loop would otherwise keep.
        let mut pause = Backoff::new();
        loop {
            // Acknowledgements we owe go now, not after their delay: once we are gone nothing
            // would send them, and the peer's own close would wait for them in vain.
            let now = reliable::now();
            let mut waiting = false;
            for k in 0..self.peers.touched() {
                let r = self.peers.touched_rank(k);
                let p = &mut self.peers[r];
                let Some(l) = p.link.as_mut().filter(|_| !p.failed) else {
                    continue;
                };
                if l.owes_ack() {
                    l.ack_at_once();
                    self.transmit(r as Rank, now)?;
                }
                // (A peer that `transmit` found gone is waited for no more.)
                let p = &self.peers[r];
                if let Some(l) = p.link.as_ref().filter(|_| !p.failed) {
                    waiting |= l.in_flight() > 0 || l.owes_ack();
                }
            }
            // ... and must have left the send queue before `Drop` destroys the QP.
            if !(waiting || self.sq_used > 0) || now >= deadline {
                break;
            }
            let n = self.progress(&mut Discard::default())?;
            pause.round(n > 0);
        }
        Ok(())
    }
}

impl Drop for VerbsUd {
    fn drop(&mut self) {
        let _ = self.hca.destroy_qp(self.qp);
        for z in &self.zqps {
            let _ = self.hca.destroy_qp(z.qp);
        }
        for z in self.zrecvs.iter().flatten() {
            let _ = self.hca.dereg_mr(z.mr);
        }
        for m in self.locals.values() {
            let _ = self.hca.dereg_mr(*m);
        }
        self.scratch.release(&*self.hca);
        for ah in self.book.handles() {
            let _ = self.hca.destroy_ah(ah);
        }
        for pool in [&self.recv, &self.send, &self.ctl] {
            pool.release(&*self.hca);
        }
        let _ = self.hca.destroy_cq(self.cq);
        let _ = self.hca.dealloc_pd(self.pd);
    }
}

impl StaticProvider for VerbsUd {
    const NAME: &'static str = "verbs-ud";

    fn probe(_ctx: &ProbeContext) -> std::result::Result<(), String> {
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, Config::from_env()?, verbs::open_default()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(Config::from_env()?.caps())
    }
}

//! `Ofi` as a weft provider: the contract's entry points, opening by name and the teardown.

use super::*;

impl Provider for Ofi {
    fn name(&self) -> &str {
        "ofi"
    }

    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn peer_caps(&self, _peer: Rank) -> Option<PeerCaps> {
        // Written, never read: the core's write rendezvous.
        self.wrndv.then(|| PeerCaps::from(&self.caps))
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        self.peer_ok(dest)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > MAX_HDR || plen > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "active message of {} + {plen} bytes exceeds {MAX_HDR} + {}",
                header.len(),
                self.caps.max_am_payload
            )));
        }
        if !self.acks.is_empty() || !self.cts.is_empty() {
            return Ok(SendOutcome::Busy);
        }
        self.am_post(dest, K_AM, header, payload)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        if !self.rx_idle.is_empty() {
            self.repost()?;
        }
        let mut n = self.retry_deferred()?;
        while let Some(&(r, op)) = self.acks.front() {
            match self.am_post(r, K_SYNC_ACK, &op.to_le_bytes(), &[])? {
                SendOutcome::Sent => {
                    self.acks.pop_front();
                    self.n_ack += 1;
                    n += 1;
                }
                SendOutcome::Busy => break,
            }
        }
        while let Some(&(r, op, id, take)) = self.cts.front() {
            let h = wire::put_cts(op, id, take);
            match self.am_post(r, K_CTS, &h, &[])? {
                SendOutcome::Sent => {
                    self.cts.pop_front();
                    n += 1;
                }
                SendOutcome::Busy => break,
            }
        }
        while let Some(m) = self.selfq.pop_front() {
            self.on_am(&m, false, sink);
            n += 1;
        }
        while let Some(ev) = self.early.pop_front() {
            self.handle(ev, sink)?;
            n += 1;
        }
        while let Some((t, r)) = self.done.pop_front() {
            sink.complete(t, r);
            n += 1;
        }
        // A bounded number of batches, so that one progress call cannot starve the caller.
        for _ in 0..4 {
            let mut evs: SmallVec<[Ev; 16]> = SmallVec::new();
            self.read_batch(&mut evs)?;
            let full = evs.len() == 16;
            n += evs.len();
            for ev in evs {
                self.handle(ev, sink)?;
            }
            if !full {
                break;
            }
        }
        // Peers' processes, every WATCH_EVERY idle calls (one poll for all of them): a rank
        // waiting on a dead peer is idle, a busy one pays nothing.
        if n == 0 {
            self.ticks = self.ticks.wrapping_add(1);
            if self.ticks % WATCH_EVERY == 0 {
                for r in self.watch.exited(|i| self.dead[i]) {
                    self.dead[r] = true;
                    sink.peer_failed(r as Rank, "process died");
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        // Let the sends in flight leave before the endpoint goes (closed in Drop, after the
        // bootstrap's finalize).
        let deadline = Instant::now() + Duration::from_secs(5);
        while (self.tx_free.len() * self.slot < self.tx_mem.len()
            || !self.deferred.is_empty()
            || !self.acks.is_empty()
            || !self.cts.is_empty())
            && Instant::now() < deadline
        {
            let mut sink = Drain;
            self.progress(&mut sink)?;
        }
        Ok(())
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("am_inject", self.n_inject),
            ("am_copy", self.n_am_copy),
            ("tagged_send", self.n_tsend),
            ("tagged_inject", self.n_tinject),
            ("tagged_recv", self.n_trecv),
            ("sync_acks", self.n_ack),
            ("rma_read", self.n_read),
            ("rma_write", self.n_write),
            ("atomics", self.n_atomic),
            ("rndv_write", self.n_wrndv),
        ]
    }

    unsafe fn tagged_send(
        &mut self,
        dest: Rank,
        ctx_id: u32,
        tag: i32,
        data: &[RawIov],
        sync: bool,
        token: Token,
    ) -> Result<()> {
        self.peer_ok(dest)?;
        let bits = self.layout.pack(ctx_id, self.rank, tag)?;
        let total: usize = data.iter().map(|d| d.len).sum();
        let addr = self.addrs[dest as usize];
        if !sync && total <= self.caps.inject_size && self.deferred.is_empty() {
            let (p, rc) = match data {
                [one] => (one.ptr, 0),
                _ => {
                    self.scratch.clear();
                    for d in data {
                        // SAFETY: the caller's pieces are valid for reads of their length.
                        self.scratch
                            .extend_from_slice(std::slice::from_raw_parts(d.ptr, d.len));
                    }
                    (self.scratch.as_ptr(), 0)
                }
            };
            let _ = rc;
            // SAFETY: `total` readable bytes at `p`; fi_tinject copies them before returning.
            let rc = fi_tinject(self.ep, p.cast(), total, addr, bits);
            if rc == 0 {
                self.n_tinject += 1;
                self.done.push_back((token, Ok(Completed::Done)));
                return Ok(());
            }
            if rc != EAGAIN {
                return Err(fi_err("fi_tinject", rc));
            }
        }
        if total > self.rndv {
            if total >> LEN_BITS != 0 {
                return Err(Error::invalid(format!(
                    "a {total}-byte message exceeds the ofi provider's 2^{LEN_BITS} bytes"
                )));
            }
            let op = self.new_op(Op::LSend {
                token,
                dest,
                owed: 0,
                data: false,
                failed: false,
            });
            if op >= ANNOUNCE_OPS {
                self.free_op(op);
                return Err(Error::invalid("too many operations outstanding"));
            }
            self.iovs[op] = raw(data);
            self.n_tsend += 1;
            let cq_data = D_ANNOUNCE | (op as u64) << LEN_BITS | total as u64;
            // The announcement carries the message's first byte (which lands where the data
            // will): libfabric 1.17's shm loses empty messages that arrive unexpected, and its
            // tcp;ofi_rxm mishandles an empty injected one.
            self.ops[op] = Op::LSend {
                token,
                dest,
                owed: 1,
                data: false,
                failed: false,
            };
            return self.post(Deferred {
                recv: false,
                iov: truncate(&self.iovs[op], 1),
                peer: addr,
                tag: bits,
                ignore: 0,
                data: cq_data,
                flags: FI_REMOTE_CQ_DATA,
                op,
            });
        }
        let op = self.new_op(Op::Send {
            token,
            dest,
            ack: sync,
            sent: false,
        });
        self.n_tsend += 1;
        self.post(Deferred {
            recv: false,
            iov: raw(data),
            peer: addr,
            tag: bits,
            ignore: 0,
            data: D_SYNC | op as u64,
            flags: if sync { FI_REMOTE_CQ_DATA } else { 0 },
            op,
        })
    }

    unsafe fn tagged_recv(
        &mut self,
        src: Option<Rank>,
        ctx_id: u32,
        tag: Option<i32>,
        buf: &[RawIovMut],
        token: Token,
    ) -> Result<()> {
        if let Some(s) = src {
            self.peer_ok(s)?;
        }
        let (bits, ignore) = self.layout.matcher(ctx_id, src, tag)?;
        let cap = buf.iter().map(|b| b.len).sum();
        // A receive smaller than the largest eager message is posted into a bounce buffer of
        // that size: libfabric then never truncates (larger messages are announced, and an
        // announcement fits any buffer), and weft delivers the prefix and the exact length.
        let (bounce, iov) = if cap < self.rndv {
            let b = self.take_bounce()?;
            let (p, d) = self.bounce_at(b);
            (
                b,
                SmallVec::from_slice(&[(p as usize, self.rndv, d as u64)]),
            )
        } else {
            (NO_BOUNCE, raw_mut(buf))
        };
        let op = self.new_op(Op::Recv { token, cap, bounce });
        self.iovs[op] = raw_mut(buf);
        self.post(Deferred {
            recv: true,
            iov,
            peer: FI_ADDR_UNSPEC,
            tag: bits,
            ignore,
            data: 0,
            flags: 0,
            op,
        })
    }

    fn tagged_probe(
        &mut self,
        src: Option<Rank>,
        ctx_id: u32,
        tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        if let Some(s) = src {
            self.peer_ok(s)?;
        }
        let (bits, ignore) = self.layout.matcher(ctx_id, src, tag)?;
        let op = self.new_op(Op::Peek(None));
        let msg = fi_msg_tagged {
            msg_iov: null(),
            desc: null_mut(),
            iov_count: 0,
            addr: FI_ADDR_UNSPEC,
            tag: bits,
            ignore,
            context: ctx(op),
            data: 0,
        };
        // SAFETY: a peek names no buffer; `msg` is read during the call.
        let rc = unsafe { fi_trecvmsg(self.ep, &msg, FI_PEEK) };
        if rc != 0 {
            self.free_op(op);
            return if rc == EAGAIN {
                Ok(None)
            } else {
                Err(fi_err("fi_trecvmsg(FI_PEEK)", rc))
            };
        }
        let deadline = Instant::now() + SYNC_POLL;
        loop {
            if let Op::Peek(Some(ans)) = self.ops[op] {
                self.free_op(op);
                return Ok(ans);
            }
            if Instant::now() > deadline {
                // The answer will come; whoever reads it drops it.
                self.ops[op] = Op::Orphan;
                return Ok(None);
            }
            self.drive()?;
        }
    }

    fn tagged_cancel(&mut self, token: Token) -> Result<bool> {
        let mine = |o: &Op| matches!(o, Op::Recv { token: t, .. } if *t == token);
        let Some(i) = self.ops.iter().position(mine) else {
            if let Some(d) = self.deferred.iter().position(|d| mine(&self.ops[d.op])) {
                // Never reached libfabric.
                let d = self.deferred.remove(d).expect("index from position");
                if let Op::Recv { bounce, .. } = self.ops[d.op] {
                    self.release_bounce(bounce);
                }
                self.free_op(d.op);
                return Ok(true);
            }
            return Ok(false);
        };
        // SAFETY: `ep` is open; the context names one of its posted receives.
        let rc = unsafe { fi_cancel(&mut (*self.ep).fid, ctx(i)) };
        if rc != 0 {
            return Ok(false);
        }
        let Op::Recv { cap, bounce, .. } = self.ops[i] else {
            return Ok(false);
        };
        self.ops[i] = Op::Cancelling(token, cap, bounce);
        let deadline = Instant::now() + SYNC_POLL;
        loop {
            match self.ops[i] {
                Op::Cancelled(b) => {
                    self.release_bounce(b);
                    self.free_op(i);
                    return Ok(true);
                }
                Op::Cancelling(..) if Instant::now() < deadline => {}
                // Matched after all, or not answered yet: the completion (data or
                // cancellation) is reported through progress.
                _ => return Ok(false),
            }
            // A normal completion of this receive lands in `early` and is handled as a receive.
            if self.early.iter().any(|e| e.ctx == i + 1) {
                return Ok(false);
            }
            self.drive()?;
        }
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if self.wrndv {
            return self.wrecv_open(base, len, access);
        }
        self.register(base, len, access, None)
    }

    unsafe fn mr_register_keyed(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
    ) -> Result<MemRegion> {
        if self.wrndv {
            return Err(am_mode("windows go by active messages"));
        }
        self.register(base, len, access, Some(key))
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        if mr.handle & W_HANDLE != 0 {
            return self.wrecv_close((mr.handle & !W_HANDLE) as usize);
        }
        let p = mr.handle as *mut fid_mr;
        if p.is_null() {
            return Err(Error::invalid(
                "ofi: deregistering a region it never registered",
            ));
        }
        // SAFETY: `handle` is the fid_mr this provider opened in `register` (the core hands back
        // the MemRegion it was given, once).
        check("closing a registration", unsafe { fi_close(&mut (*p).fid) })
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        if self.wrndv {
            return Err(am_mode("there are no reads"));
        }
        self.rma(src, false, &raw_mut(local), remote, done)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        if self.wrndv {
            return self.wsend(dest, local, remote, done);
        }
        self.rma(dest, true, &raw(local), remote, done)
    }

    unsafe fn atomic(
        &mut self,
        dest: Rank,
        a: &AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.peer_ok(dest)?;
        if a.op == WOp::NoOp && a.result.is_null() {
            // An accumulate of NO_OP changes nothing and returns nothing: done at once
            // (libfabric has no non-fetching form of FI_ATOMIC_READ).
            return self.finish_now(&done);
        }
        let ep = self.rma_ep(&done)?;
        let (context, mut flags, op) = self.rma_ctx(dest, &done);
        if self.delivery {
            flags |= FI_DELIVERY_COMPLETE;
        }
        let (o, t) = fi_types(a.op, a.ty);
        // FI_ATOMIC_READ ignores its origin buffer, but some providers want one named.
        let origin = if a.origin.is_null() {
            a.result as *const u8
        } else {
            a.origin
        };
        let oi = fi_ioc {
            addr: origin as *mut c_void,
            count: a.count,
        };
        let ci = fi_ioc {
            addr: a.compare as *mut c_void,
            count: a.count,
        };
        let mut ri = fi_ioc {
            addr: a.result as *mut c_void,
            count: a.count,
        };
        let mut d = a.desc.map(|x| x as *mut c_void);
        let rio = fi_rma_ioc {
            addr: remote.addr,
            count: a.count,
            key: remote.key,
        };
        let msg = fi_msg_atomic {
            msg_iov: &oi,
            desc: &mut d[0],
            iov_count: 1,
            addr: self.addrs[dest as usize],
            rma_iov: &rio,
            rma_iov_count: 1,
            datatype: t,
            op: o,
            context,
            data: 0,
        };
        self.n_atomic += 1;
        let (d1, d2) = (&mut d[1] as *mut *mut c_void, &mut d[2] as *mut *mut c_void);
        let fetch = !a.result.is_null();
        let cswap = a.op == WOp::Cswap;
        // SAFETY: origin, compare and result are valid for `count` elements until completion
        // (the caller's contract); `msg` and the ioc structs live across the call.
        self.retry("fi_atomic", op, || {
            if cswap {
                fi_compare_atomicmsg(ep, &msg, &ci, d1, 1, &mut ri, d2, 1, flags)
            } else if fetch {
                fi_fetch_atomicmsg(ep, &msg, &mut ri, d2, 1, flags)
            } else {
                fi_atomicmsg(ep, &msg, flags)
            }
        })
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        if let Some(w) = self.spare_cntrs.pop() {
            return Ok(self.keep_cntr(w));
        }
        let mut attr = fi_cntr_attr {
            events: FI_CNTR_EVENTS_COMP,
            wait_obj: FI_WAIT_NONE,
            ..Default::default()
        };
        let mut c = null_mut();
        // SAFETY: the domain is open; `attr` is read during the call.
        check("fi_cntr_open", unsafe {
            fi_cntr_open(self.dom, &mut attr, &mut c, null_mut())
        })?;
        let ep = match self.endpoint(Some(c)) {
            Ok(ep) => ep,
            Err(e) => {
                // SAFETY: the counter was just opened and is bound to nothing.
                unsafe { fi_close(&mut (*c).fid) };
                return Err(e);
            }
        };
        Ok(self.keep_cntr(WinCntr { cntr: c, ep }))
    }

    fn cntr_read(&mut self, c: CntrId) -> Result<CntrValue> {
        let w = self.win_cntr(c)?;
        // SAFETY: an open counter.
        Ok(unsafe {
            CntrValue {
                ok: fi_cntr_read(w.cntr),
                err: fi_cntr_readerr(w.cntr),
            }
        })
    }

    fn cntr_close(&mut self, c: CntrId) -> Result<()> {
        self.win_cntr(c)?;
        let w = self.cntrs[c as usize - 1]
            .take()
            .expect("win_cntr found it open");
        // SAFETY: an open counter with nothing outstanding on it (the contract); it and its
        // endpoint are kept for the next window, from zero.
        unsafe {
            check("resetting a counter", fi_cntr_set(w.cntr, 0))?;
            check("resetting a counter", fi_cntr_seterr(w.cntr, 0))?;
        }
        self.spare_cntrs.push(w);
        Ok(())
    }
}

/// A sink for `close`: the job is over, arrivals are dropped.
pub(super) struct Drain;

impl Sink for Drain {
    fn am(&mut self, _: Rank, _: &[u8], _: &[u8]) {}
    fn complete(&mut self, _: Token, _: Result<Completed>) {}
    fn peer_failed(&mut self, _: Rank, _: &str) {}
}

impl Drop for Ofi {
    fn drop(&mut self) {
        // SAFETY: every object was opened by `open_with` (or is null) and is closed once, children
        // before parents; the buffers they used are freed only after this body.
        unsafe {
            let spare = std::mem::take(&mut self.spare_cntrs);
            for w in self.cntrs.drain(..).flatten().chain(spare) {
                fi_close(&mut (*w.ep).fid);
                fi_close(&mut (*w.cntr).fid);
            }
            if !self.ep.is_null() {
                fi_close(&mut (*self.ep).fid);
            }
            for m in self.own_mr.drain(..) {
                let _ = m.desc;
                fi_close(&mut (*m.mr).fid);
            }
            if !self.av.is_null() {
                fi_close(&mut (*self.av).fid);
            }
            if !self.cq.is_null() {
                fi_close(&mut (*self.cq).fid);
            }
            if !self.dom.is_null() {
                fi_close(&mut (*self.dom).fid);
            }
            if !self.fab.is_null() {
                fi_close(&mut (*self.fab).fid);
            }
            if !self.info.is_null() {
                (self.lib.fi_freeinfo)(self.info);
            }
        }
    }
}

impl StaticProvider for Ofi {
    const NAME: &'static str = "ofi";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        let ch = choose(&PROVIDER.get_str(), &DOMAIN.get_str()).map_err(|e| e.to_string())?;
        let one_host = !caps_of(&ch, None, None).spans_hosts;
        // SAFETY: `info` came from fi_getinfo (through fi_dupinfo) and is freed once.
        unsafe { (fabric()?.fi_freeinfo)(ch.info) };
        if one_host && ctx.hosts > 1 {
            return Err(
                "the libfabric provider reaches one host only; the job spans several".into(),
            );
        }
        Ok(())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_on(boot, &PROVIDER.get_str(), &DOMAIN.get_str())
    }

    fn static_caps() -> Result<Caps> {
        let ch = choose(&PROVIDER.get_str(), &DOMAIN.get_str())?;
        // Native atomics are a domain's answer: open one for the question, then close it.
        let lib = fabric().map_err(Error::invalid)?;
        let (mut fab, mut dom) = (null_mut(), null_mut());
        // SAFETY: `info` is live; the objects opened here are closed below, children first.
        let c = unsafe {
            let ok = ch.caps & FI_ATOMIC != 0
                && (lib.fi_fabric)((*ch.info).fabric_attr, &mut fab, null_mut()) == 0
                && fi_domain(fab, ch.info, &mut dom, null_mut()) == 0;
            let c = caps_of(&ch, ok.then_some(dom), None);
            if !dom.is_null() {
                fi_close(&mut (*dom).fid);
            }
            if !fab.is_null() {
                fi_close(&mut (*fab).fid);
            }
            c
        };
        // SAFETY: as in `probe`.
        unsafe { (fabric().map_err(Error::invalid)?.fi_freeinfo)(ch.info) };
        Ok(c)
    }
}

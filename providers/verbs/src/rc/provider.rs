//! verbs-rc as a weft provider: the contract's entry points (`Provider`: active messages,
//! progress, connections, counters, registration, RMA, atomics and counters), opening by name
//! (`StaticProvider`) and the teardown (`Drop`).

use super::*;

impl Provider for VerbsRc {
    fn name(&self) -> &str {
        "verbs-rc"
    }

    fn caps(&self) -> &Caps {
        &self.caps
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
        self.send_via(dest, header, payload, true)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = 0;
        loop {
            let k = self.hca.poll_cq(self.cq, &mut self.wcs)?;
            for j in 0..k {
                let wc = self.wcs[j];
                self.on_wc(&wc, sink)?;
            }
            n += k;
            if k < POLL {
                break;
            }
        }
        let mut k = 0;
        while k < self.polling.len() {
            let r = self.polling[k];
            n += self.poll_ring(r, sink)?;
            k += 1;
        }
        self.polls = self.polls.wrapping_add(1);
        if self.polls % 256 == 0 {
            self.cm_timers()?;
            self.keepalives()?;
        }
        let mut i = 0;
        while i < self.backlog.len() {
            let r = self.backlog[i];
            self.flush_queued(r)?;
            let p = &mut self.peers[r as usize];
            if p.queued.is_empty() {
                p.backlogged = false;
                self.backlog.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if !self.events.is_empty() || !self.failures.is_empty() {
            n += self.report_events(sink);
        }
        n += self.table.deliver(sink);
        Ok(n)
    }

    fn connect(&mut self, peer: Rank) -> Result<()> {
        self.start(peer)
    }

    /// After the final barrier: let what is still on its way out (the barrier's last
    /// messages, acknowledgements) complete before `Drop` destroys the QPs, which would drop
    /// it — the peer would then wait for a message that never comes. Bounded: a peer that has
    /// already gone never acknowledges (nothing it needs is lost then).
    fn close(&mut self) -> Result<()> {
        let deadline = Instant::now() + CLOSE_DRAIN;
        // Empty rounds yield, then sleep, leaving the CPU to the peers being waited for.
        let mut pause = Backoff::new();
        while self
            .peers
            .iter()
            .any(|(_, p)| p.inflight > 0 && matches!(p.conn, Conn::Up | Conn::Accepted))
        {
            if Instant::now() > deadline {
                tracing::debug!("verbs-rc: closing with requests still in flight");
                break;
            }
            let n = self.progress(&mut Discard::default())?;
            pause.round(n > 0);
        }
        Ok(())
    }

    fn peer_caps(&self, _peer: Rank) -> Option<PeerCaps> {
        // Only the rendezvous reads these: RMA windows stay native in every mode.
        let mut p = PeerCaps::from(&self.caps);
        match self.rndv {
            Rndv::Read => return None,
            Rndv::Write => p.rma_read = false,
            Rndv::Copy => {
                p.rma_read = false;
                p.rma_write = false;
            }
        }
        Some(p)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let up = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p.conn, Conn::Up | Conn::Accepted))
            .count() as u64;
        let hc = self.hca.counters();
        let mem = self.memory();
        vec![
            ("am_sent", s.am_sent),
            ("am_received", s.am_recv),
            ("rma_writes", s.rma_write),
            ("rma_reads", s.rma_read),
            ("atomics", s.atomics),
            ("write_data", s.write_data),
            ("connections_asked", s.connects),
            ("connections_closed", s.disconnects),
            ("cm_stale", s.cm_stale),
            ("cm_forged", s.cm_forged),
            ("connections_up", up),
            ("cm_resends", s.cm_resends),
            ("cm_checked", s.cm_checked),
            ("keepalives", s.keepalives),
            ("busy", s.busy),
            ("eager_ring", s.eager_ring),
            ("eager_send_recv", s.eager_sr),
            ("ring_full", s.ring_full),
            ("ring_offers", s.offers),
            ("credit_msgs", s.credits),
            ("pointer_writes", s.pointer_writes),
            ("overtaken", s.overtaken),
            ("send_pool_grows", s.send_grows),
            ("send_pool_slots", self.send.slots() as u64),
            ("rings_polled", self.polling.len() as u64),
            // What the HCA executed for this process (work requests by kind, packets): the
            // verbs operations each design costs per message.
            ("hca_writes", hc.op(WrOpcode::RdmaWrite)),
            ("hca_writes_imm", hc.op(WrOpcode::RdmaWriteWithImm)),
            (
                "hca_sends",
                hc.op(WrOpcode::Send) + hc.op(WrOpcode::SendWithImm),
            ),
            ("hca_reads", hc.op(WrOpcode::RdmaRead)),
            (
                "hca_atomics",
                hc.op(WrOpcode::AtomicCmpAndSwp) + hc.op(WrOpcode::AtomicFetchAndAdd),
            ),
            ("hca_packets", hc.packets),
            ("hca_wire_bytes", hc.wire_bytes),
            ("hca_qp_cache_misses", hc.qp_cache_misses),
            // Sends this process's HCA found no posted receive for at the peer (each waited
            // out the RNR timer): a shared receive queue too shallow for the traffic.
            ("hca_rnr_naks", hc.rnr_naks),
            ("mem_hca_bytes", mem.0),
            ("mem_buffer_bytes", mem.1),
            ("mem_peer_bytes", mem.2),
        ]
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if len == 0 {
            return Ok(MemRegion {
                key: 0,
                addr: base as u64,
                len: 0,
                handle: u64::MAX,
                desc: 0,
            });
        }
        // SAFETY: the caller keeps the memory valid until `mr_deregister` (this function's
        // contract), which is the HCA's registration contract.
        let mr = unsafe { self.hca.reg_mr(self.pd, base, len, vaccess(access)) }?;
        self.mrs.insert(mr.handle as u64, mr);
        Ok(MemRegion {
            key: mr.rkey as u64,
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
        let m = self
            .mrs
            .remove(&mr.handle)
            .ok_or_else(|| Error::invalid("verbs-rc: deregistering an unknown region"))?;
        self.hca.dereg_mr(m)
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let sg = self.sges(local.iter().map(|v| (v.ptr as u64, v.len, v.desc)))?;
        self.rdma(src, WrOpcode::RdmaRead, sg, remote, 0, done)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let sg = self.sges(local.iter().map(|v| (v.ptr as u64, v.len, v.desc)))?;
        self.rdma(dest, WrOpcode::RdmaWrite, sg, remote, 0, done)
    }

    unsafe fn rma_write_data(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        data: u64,
        done: Completion,
    ) -> Result<()> {
        let imm = u32::try_from(data).map_err(|_| {
            Error::invalid(format!(
                "verbs-rc: remote completion data {data:#x} is over the 4 bytes of an immediate"
            ))
        })?;
        let sg = self.sges(local.iter().map(|v| (v.ptr as u64, v.len, v.desc)))?;
        self.rdma(dest, WrOpcode::RdmaWriteWithImm, sg, remote, imm, done)
    }

    unsafe fn atomic(
        &mut self,
        dest: Rank,
        a: &AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        if !self.caps.atomics.query(a.op, a.ty) {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "verbs-rc: the HCA does 8-byte fetch-and-add and compare-and-swap, not {:?} on {:?}",
                a.op, a.ty
            ))));
        }
        if a.count != 1 {
            return Err(Error::invalid(format!(
                "verbs-rc: HCA atomics take one element, not {}",
                a.count
            )));
        }
        if remote.addr % 8 != 0 {
            return Err(Error::invalid(format!(
                "verbs-rc: HCA atomics need an 8-byte aligned target, not {:#x}",
                remote.addr
            )));
        }
        // SAFETY: `origin` (and `compare` for CSWAP) point at one element (this function's
        // contract); read now, they travel in the work request.
        let origin = unsafe { (a.origin as *const i64).read_unaligned() } as u64;
        let sge = if a.result.is_null() {
            // Nobody wants the old value: every such atomic lands it in the same scratch word.
            self.scratch.sge(0, 8)
        } else {
            verbs::Sge {
                addr: a.result as u64,
                length: 8,
                lkey: u32::try_from(a.desc[2])
                    .map_err(|_| Error::invalid("verbs-rc: a foreign descriptor"))?,
            }
        };
        let key = Self::rkey(remote)?;
        let wr = if a.op == Op::Cswap {
            // SAFETY: as above.
            let cmp = unsafe { (a.compare as *const i64).read_unaligned() } as u64;
            SendWr::cas(0, sge, remote.addr, key, cmp, origin)
        } else {
            SendWr::fetch_add(0, sge, remote.addr, key, origin)
        };
        self.stats.atomics += 1;
        self.submit(dest, wr, done)
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        Ok(self.table.open())
    }

    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        self.table.read(cntr)
    }

    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        self.table.close(cntr)
    }
}

impl Drop for VerbsRc {
    fn drop(&mut self) {
        // QPs first: after them the HCA touches none of our memory; then the registrations.
        let qps: Vec<verbs::Qp> = self
            .peers
            .iter()
            .filter_map(|(_, p)| p.qp)
            .chain(self.self_back.take())
            .chain(std::iter::once(self.ud_qp))
            .collect();
        for q in qps {
            let _ = self.hca.destroy_qp(q);
        }
        for ah in self.book.handles() {
            let _ = self.hca.destroy_ah(ah);
        }
        let _ = self.hca.destroy_srq(self.srq);
        for m in self.mrs.drain().map(|(_, m)| m).collect::<Vec<_>>() {
            let _ = self.hca.dereg_mr(m);
        }
        self.send.release(&*self.hca);
        for pool in [&self.recv, &self.ud_recv, &self.ud_send, &self.scratch] {
            pool.release(&*self.hca);
        }
        for (_, p) in self.peers.iter() {
            if let Some(e) = &p.erx {
                e.block.release(&*self.hca);
            }
            if let Some(e) = &p.etx {
                e.staging.release(&*self.hca);
            }
        }
        let _ = self.hca.destroy_cq(self.cq);
        let _ = self.hca.dealloc_pd(self.pd);
    }
}

impl StaticProvider for VerbsRc {
    const NAME: &'static str = "verbs-rc";

    fn probe(_ctx: &ProbeContext) -> std::result::Result<(), String> {
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, &Config::from_env()?, verbs::open_default()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(Config::from_env()?.caps())
    }
}

//! `Hybrid` as a weft provider: the contract's entry points (a channel chosen per message,
//! registrations routed by access, the rendezvous per peer) and opening by name.

use super::*;

impl Provider for Hybrid {
    fn name(&self) -> &str {
        "hybrid"
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
        self.check_rank(dest)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > self.caps.max_am_header || plen > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "hybrid: active message of {} + {plen} bytes exceeds {} + {}",
                header.len(),
                self.caps.max_am_header,
                self.caps.max_am_payload
            )));
        }
        // One look at each table on the way: our record (order and budget), held while the
        // channels send, and verbs-rc's for the channels open.
        let Some(st) = self.budget.peer_mut(dest) else {
            return Err(Error::invalid("hybrid: rank past the job"));
        };
        let open = open_with(&self.rc, st.link.state(), dest);
        if st.failed {
            return Err(Error::peer_failed(dest, "failed earlier"));
        }
        // Rule sizes count the payload, as MVAPICH counts a message's size: the core's header
        // (at most `max_am_header` bytes) rides on top in every channel's buffers.
        let size = plen as u64;
        let want = self.chain.pick(size, open).unwrap_or(Channel::UdSr);
        // The prefix and the core's header, on the stack: `max_am_header` leaves room for the
        // prefix within the channels' largest header (checked above).
        let mut buf = [0u8; HDR_ROOM];
        let hdr = buf
            .get_mut(..PREFIX + header.len())
            .ok_or_else(|| Error::invalid("hybrid: header longer than the channels take"))?;
        wire::put_data(hdr, st.seq.peek());
        hdr[PREFIX..].copy_from_slice(header);
        let hdr = &*hdr;
        let mut used = want;
        let mut out = match want {
            Channel::RcSr | Channel::RcFp => {
                self.rc
                    .am_send_via(dest, hdr, payload, want == Channel::RcFp)?
            }
            _ => SendOutcome::Busy,
        };
        if out != SendOutcome::Sent {
            if want != Channel::UdSr && want != Channel::UdZcopy {
                self.totals.rc_fallback += 1;
            }
            used = Channel::UdSr;
            self.ud_quiet = 0;
            out = self.ud.am_send(dest, hdr, payload)?;
        }
        if out == SendOutcome::Sent {
            st.seq.take();
            self.count(dest, used, size);
            // A connected peer's count decides nothing unless rebalancing: skip the budget.
            if !open.has(Channel::RcSr) || self.budget.limits().rebalance {
                let chain = &self.chain;
                self.budget
                    .note_if(dest, || rc_worthy(chain, size), &mut self.actions);
            }
            if !self.actions.is_empty() {
                self.run_actions()?;
            }
        }
        Ok(out)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut held = 0;
        let n = {
            let mut up = Recv {
                core: sink,
                chain: &self.chain,
                budget: &mut self.budget,
                holding: &mut self.holding,
                actions: &mut self.actions,
                ctrl_in: &mut self.ctrl_in,
                held: &mut held,
            };
            // Once RC carries the busy peers, UD mostly carries nothing: polling it on every
            // call added a second completion-queue poll to every idle progress call, which
            // showed in RC's small-message latency. A UD that delivered nothing and was given
            // nothing for UD_QUIET calls is polled on every UD_EVERY-th call, which delays a
            // first message over UD by at most that many calls; its timers (retransmission,
            // acknowledgements, keepalives) run on its polls, with their margins in time.
            let poll_ud = poll_ud_now(self.rc_active, self.ud_quiet);
            let n = if poll_ud {
                self.ud.progress(&mut up)?
            } else {
                0
            };
            self.ud_quiet = next_quiet(self.ud_quiet, n);
            // RC carries nothing until the budget has connected some peer (every agreement
            // goes over UD first): until then its queues are not polled.
            n + if self.rc_active {
                self.rc.progress(&mut up)?
            } else {
                0
            }
        };
        self.totals.held += held;
        if !self.ctrl_in.is_empty()
            || !self.draining.is_empty()
            || !self.teardown.is_empty()
            || !self.actions.is_empty()
            || !self.ctrl_out.is_empty()
            || !self.caps_changed.is_empty()
        {
            self.after_progress(sink)?;
        }
        Ok(n)
    }

    /// The rendezvous channel towards `peer`: the chain's pick for a large message among the
    /// channels open to it — RC-RDMA (the core reads the sender's buffer) while the budget
    /// has the pair connected, else UD-ZCOPY (the core's write rendezvous into the
    /// receiver's buffer posted on a zero-copy QP). Read again at connection events.
    fn peer_caps(&self, peer: Rank) -> Option<PeerCaps> {
        let rma = self.caps.rma?;
        let mut c = PeerCaps::from(&self.caps);
        let pick = self
            .chain
            .pick(LARGE, open_to(&self.rc, &self.budget, peer));
        c.rma_read = rma.read && pick == Some(Channel::RcRdma);
        c.rma_write = rma.write && pick == Some(Channel::UdZcopy);
        Some(c)
    }

    /// Remote reads: verbs-rc (RC-RDMA). Remote writes: verbs-ud (UD-ZCOPY's posted buffer).
    /// Local use only: both, the descriptor carrying both local keys.
    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if access.remote_atomic || (access.remote_read && access.remote_write) {
            return Err(Error::invalid(
                "hybrid: registrations serve one rendezvous: remote reads or remote writes",
            ));
        }
        if access.remote_read {
            // SAFETY: the caller's contract (memory valid until `mr_deregister`) is passed on
            // unchanged.
            let m = unsafe { self.rc.mr_register(base, len, access) }?;
            let (addr, key, desc) = (m.addr, m.key, m.desc & 0xffff_ffff);
            return Ok(self.new_mr(
                HMr {
                    rc: Some(m),
                    ud: None,
                },
                addr,
                len,
                key,
                desc,
            ));
        }
        if access.remote_write {
            // SAFETY: as above.
            let m = unsafe { self.ud.mr_register(base, len, access) }?;
            // A zero-copy receive is posted: its pieces arrive over UD.
            self.ud_quiet = 0;
            let (addr, key, desc) = (m.addr, m.key, m.desc << 32);
            return Ok(self.new_mr(
                HMr {
                    rc: None,
                    ud: Some(m),
                },
                addr,
                len,
                key,
                desc,
            ));
        }
        // SAFETY: as above, for each channel's registration.
        let r = unsafe { self.rc.mr_register(base, len, access) }?;
        // verbs-ud needs a local key only to send UD-ZCOPY pieces; without its zero-copy
        // QPs (`WEFT_VERBS_UD_ZCOPY_QPS=0`) it has no registrations at all.
        let u = if self.ud.caps().rma.is_some() {
            // SAFETY: as above.
            match unsafe { self.ud.mr_register(base, len, access) } {
                Ok(u) => Some(u),
                Err(e) => {
                    let _ = self.rc.mr_deregister(&r);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let desc = u.as_ref().map_or(0, |u| u.desc << 32) | (r.desc & 0xffff_ffff);
        Ok(self.new_mr(HMr { rc: Some(r), ud: u }, base as u64, len, 0, desc))
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        let m = self
            .mrs
            .remove(&mr.handle)
            .ok_or_else(|| Error::invalid("hybrid: deregistering an unknown region"))?;
        let a = m.rc.map_or(Ok(()), |r| self.rc.mr_deregister(&r));
        let b = m.ud.map_or(Ok(()), |u| self.ud.mr_deregister(&u));
        a.and(b)
    }

    /// RC-RDMA: a read of the sender's buffer over the pair's RC connection (up, or closing
    /// with its queue pair still there: the close waits for the read).
    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.check_rank(src)?;
        if !self.rc.rdma_open(src) {
            return Err(Error::invalid(format!(
                "hybrid: a rendezvous read from rank {src} without an RC connection to it"
            )));
        }
        let pieces: SmallVec<[RawIovMut; 4]> = local
            .iter()
            .map(|p| RawIovMut {
                desc: p.desc & 0xffff_ffff,
                ..*p
            })
            .collect();
        let bytes: usize = pieces.iter().map(|p| p.len).sum();
        // SAFETY: the caller's contract for `local` (valid and not otherwise accessed until
        // `done` is reported) is passed on; only the descriptors are narrowed to verbs-rc's.
        unsafe { self.rc.rma_read(src, &pieces, remote, done) }?;
        self.count(src, Channel::RcRdma, bytes as u64);
        Ok(())
    }

    /// UD-ZCOPY: a write rendezvous into the receiver's posted buffer (a key verbs-ud made);
    /// a key of verbs-rc's (an RC registration) goes by RC-RDMA write.
    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.check_rank(dest)?;
        let ud_key = u32::try_from(remote.key).is_err();
        let shift = if ud_key { 32 } else { 0 };
        let pieces: SmallVec<[RawIov; 4]> = local
            .iter()
            .map(|p| RawIov {
                desc: (p.desc >> shift) & 0xffff_ffff,
                ..*p
            })
            .collect();
        let bytes: usize = pieces.iter().map(|p| p.len).sum();
        if ud_key {
            // SAFETY: the caller's contract for `local` is passed on; only the descriptors
            // are narrowed to verbs-ud's.
            unsafe { self.ud.rma_write(dest, &pieces, remote, done) }?;
            self.ud_quiet = 0;
            self.count(dest, Channel::UdZcopy, bytes as u64);
        } else {
            if !self.rc.rdma_open(dest) {
                return Err(Error::invalid(format!(
                    "hybrid: an RDMA write to rank {dest} without an RC connection to it"
                )));
            }
            // SAFETY: as above, verbs-rc's descriptors.
            unsafe { self.rc.rma_write(dest, &pieces, remote, done) }?;
            self.count(dest, Channel::RcRdma, bytes as u64);
        }
        Ok(())
    }

    /// First contact: UD's address handle and link, our order record and the budget's count
    /// (what the first message would make).
    fn connect(&mut self, peer: Rank) -> Result<()> {
        self.check_rank(peer)?;
        self.ud.connect(peer)?;
        self.ud_quiet = 0;
        self.budget.touch(peer);
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if self.stats {
            self.print_stats();
        }
        let a = self.ud.close();
        let b = self.rc.close();
        a.and(b)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let sum = |k: usize, f: fn(&(u64, u64)) -> u64| -> u64 { f(&self.totals.sent[k]) };
        let s = self.budget.stats();
        let hc = self.hca.counters();
        let mut v = vec![
            ("ud_sr_msgs", sum(0, |c| c.0)),
            ("ud_sr_bytes", sum(0, |c| c.1)),
            ("rc_sr_msgs", sum(1, |c| c.0)),
            ("rc_sr_bytes", sum(1, |c| c.1)),
            ("rc_fp_msgs", sum(2, |c| c.0)),
            ("rc_fp_bytes", sum(2, |c| c.1)),
            ("rc_asked", s.asked),
            ("rc_refused", s.refused),
            ("rc_opened", s.opened),
            ("rc_closed", s.closed),
            ("rc_yields_asked", s.yields_asked),
            ("rc_yielded", s.yielded),
            ("fp_opened", s.fp_opened),
            ("fp_closed", s.fp_closed),
            ("rc_fallback_ud", self.totals.rc_fallback),
            ("ctrl_sent", self.totals.ctrl_sent),
            ("held_for_order", self.totals.held),
            // The one device both channels share (timing model: QP contexts not cached).
            ("hca_qp_cache_misses", hc.qp_cache_misses),
            ("hca_rnr_naks", hc.rnr_naks),
        ];
        // Memory (`weft bench mem`): the device's accounting once (both channels report the
        // whole shared device, queues and device memory), the channels' host buffers and
        // per-peer records added up, and our own per-peer tables.
        let (u, r) = (self.ud.counters(), self.rc.counters());
        let get = |c: &[(&'static str, u64)], key: &str| {
            c.iter().find(|(k, _)| *k == key).map_or(0, |(_, x)| *x)
        };
        // UD's packets beside the messages: what its reliability costs (a pure
        // acknowledgement is a datagram sent and received that carries no data).
        for (key, from) in [
            ("ud_packets_sent", "packets_sent"),
            ("ud_pure_acks", "pure_acks"),
            ("ud_resent", "resent"),
            ("ud_duplicates", "duplicates"),
            ("ud_timeouts", "timeouts"),
            ("hca_ud_dropped", "hca_ud_dropped"),
            ("ud_busy_links", "busy_links"),
        ] {
            v.push((key, get(&u, from)));
        }
        let a = self.hca.accounting();
        let own = self.holding.bytes()
            + self.sent_by_peer.as_ref().map_or(0, |t| t.bytes())
            + self.budget.bytes();
        let buffers = get(&u, "mem_buffer_bytes") + get(&r, "mem_buffer_bytes");
        v.push(("mem_hca_bytes", a.queues()));
        v.push(("mem_buffer_bytes", buffers.saturating_sub(a.dm_bytes)));
        v.push((
            "mem_peer_bytes",
            get(&u, "mem_peer_bytes") + get(&r, "mem_peer_bytes") + own as u64,
        ));
        v
    }
}

impl StaticProvider for Hybrid {
    const NAME: &'static str = "hybrid";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        VerbsUd::probe(ctx).map_err(|e| format!("verbs-ud: {e}"))?;
        VerbsRc::probe(ctx).map_err(|e| format!("verbs-rc: {e}"))?;
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, Config::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        let cfg = Config::from_env()?;
        let (_, upto) = cfg.job(2)?;
        let (uc, rcc) = (VerbsUd::static_caps()?, VerbsRc::static_caps()?);
        let max_hdr = uc.max_am_header.min(rcc.max_am_header) - PREFIX;
        let max_payload = usize::try_from(upto)
            .unwrap_or(usize::MAX)
            .min(uc.max_am_payload)
            .min(rcc.max_am_payload)
            .min(64 << 10);
        let mut caps = Caps::am_only(max_hdr, max_payload, uc.max_iov.min(rcc.max_iov));
        caps.eager_limit = max_payload;
        caps.spans_hosts = uc.spans_hosts && rcc.spans_hosts;
        caps.lazy_connect = uc.lazy_connect;
        caps.rma = rndv_caps(
            &cfg.chain
                .for_job(2)
                .map_err(|e| Error::invalid(e.to_string()))?,
            &uc,
        );
        if caps.rma.is_some() {
            caps.mr_local = true;
            caps.per_peer = true;
        }
        Ok(caps)
    }
}

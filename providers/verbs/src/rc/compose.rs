//! verbs-rc as a channel of a composition ([`crate::channel::RcChannel`], declared there): open
//! on a shared HCA with a `Sizing`, and per peer: its route and fast path, quiescing and
//! disconnecting it (connection generations), sending an active message by a chosen channel
//! (`send_via`, in `am.rs`).

use super::*;

impl RcChannel for VerbsRc {
    /// Open as one channel of a composition (the hybrid provider): the parameters of the
    /// environment, but RC-FP slots for at most `fp_peers` peers, and the slots' threshold, the
    /// eager buffer size and the shared pools' sizes given in `sizing` where the environment
    /// does not set them (the hybrid connects a few peers, not all, and only those that earned
    /// it).
    /// `hca` is the device the composition's other channels use too (one per process, as on
    /// hardware: one QP-context cache, one set of service threads).
    fn open_sized(boot: &mut dyn Bootstrap, sizing: Sizing, hca: Arc<dyn Hca>) -> Result<VerbsRc> {
        let mut cfg = Config::from_env()?;
        cfg.fp_peers = sizing.fp_peers;
        // One more than the budget: the connection to ourselves.
        cfg.conns = Some(sizing.conns.saturating_add(1));
        // The composition's RC carries active messages only (its RMA goes elsewhere), and
        // rings for at most `fp_peers` peers: the completion queue need not hold verbs-rc's
        // own in-flight limits.
        cfg.ops_in_flight = 64;
        cfg.ring_in_flight = (sizing.fp_peers * 32).clamp(64, RING_IN_FLIGHT);
        cfg.lazy_pools = true;
        cfg.ordered = false;
        if !FP_THRESHOLD.is_set() {
            cfg.fp_threshold = sizing.fp_threshold;
        }
        if !BUF.is_set() {
            cfg.buf = sizing.buf.clamp(1024, 1 << 20);
        }
        if !SRQ.is_set() {
            cfg.srq = sizing.pool.clamp(16, 16384);
        }
        if !SEND_BUFS.is_set() {
            cfg.send_bufs = sizing.pool.clamp(16, 16384);
        }
        if !SQ.is_set() && sizing.sq > 0 {
            cfg.sq = sizing.sq.clamp(16, 16384);
        }
        if sizing.sges > 0 {
            cfg.sges = sizing.sges.min(16);
        }
        if !FP_BUFS.is_set() && sizing.fp_bufs > 0 {
            cfg.fp_bufs = sizing.fp_bufs.clamp(2, 1024);
        }
        if !FP_SIZE.is_set() && sizing.fp_payload > 0 {
            // A frame (its header, the largest active-message header, the payload) per slot.
            let body = FRAME_HDR + MAX_HDR + sizing.fp_payload;
            cfg.fp_size = Shape::fastpath_slot_for(body).min(1 << 20);
            if !cfg.shape_of(Design::Fastpath).valid() {
                return Err(Error::invalid(format!(
                    "verbs-rc: RC-FP slots for payloads of {} bytes ({} bytes each) times \
                     WEFT_VERBS_RC_FP_BUFS={} exceed the 8 MiB a ring may take: fewer slots, \
                     or a smaller RC-FP reach",
                    sizing.fp_payload, cfg.fp_size, cfg.fp_bufs
                )));
            }
        }
        Self::open_with(boot, &cfg, hca)
    }

    /// This process writes into an eager ring (RC-FP slots) in `peer`'s memory: RC-FP is open
    /// towards it.
    fn fast_path_to(&self, peer: Rank) -> bool {
        self.peers
            .get(peer as usize)
            .is_some_and(|p| p.etx.is_some())
    }

    /// Eager-ring memory of one peer, both directions (the ring it writes into here and the
    /// mirror of ours), with the geometry in force (see [`Sizing::fp_payload`]).
    fn ring_bytes_per_peer(&self) -> u64 {
        ring_pair_bytes(self.shape) as u64
    }

    /// Stop posting anything to `peer` (a composition is closing the connection): sends to
    /// it are refused (`Busy`), no ring write, credit, offer or keepalive goes out, and an
    /// error completion no longer fails the peer. What the peer already wrote is still taken
    /// in. Then wait for [`RcChannel::quiet`] and [`RcChannel::disconnect`].
    fn quiesce(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if peer == self.rank {
            return Err(Error::invalid(
                "verbs-rc: the connection to ourselves is not closed",
            ));
        }
        if !matches!(self.peers[i].conn, Conn::Idle | Conn::Failed) {
            self.peers[i].conn = Conn::Draining;
        }
        Ok(())
    }

    /// RDMA operations towards `peer` can be posted: its connection is up, or closing with
    /// its queue pair still there (they complete before [`RcChannel::quiet`] holds).
    fn rdma_open(&self, peer: Rank) -> bool {
        self.peers
            .get(peer as usize)
            .is_some_and(|p| matches!(p.conn, Conn::Up | Conn::Draining))
    }

    /// Nothing of ours towards `peer` is in flight or queued.
    fn quiet(&self, peer: Rank) -> bool {
        self.peers
            .get(peer as usize)
            .is_none_or(|p| p.inflight == 0 && p.queued.is_empty())
    }

    /// Tear down the connection to `peer` (after [`RcChannel::quiesce`] and once
    /// [`RcChannel::quiet`]): destroy its QP, release both eager rings, forget the connection's
    /// sequence numbers, and count a new generation so that requests of this connection still
    /// in the network are not answered. A later `connect` makes a fresh connection. The caller
    /// (the hybrid's budget) makes sure the peer has taken in everything we sent and we
    /// everything it sent.
    fn disconnect(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if peer == self.rank {
            return Err(Error::invalid(
                "verbs-rc: the connection to ourselves is not closed",
            ));
        }
        if matches!(self.peers[i].conn, Conn::Idle | Conn::Failed) {
            return Ok(());
        }
        if !self.quiet(peer) {
            return Err(Error::invalid(format!(
                "verbs-rc: closing the connection to rank {peer} with work requests in flight"
            )));
        }
        let p = &mut self.peers[i];
        let (qp, erx, etx) = (p.qp.take(), p.erx.take(), p.etx.take());
        p.conn = Conn::Idle;
        p.gen = p.gen.wrapping_add(1);
        p.psn = 0;
        p.rep = None;
        p.remote_qpn = None;
        p.seq_out = Sequencer::default();
        p.expect = Reorder::default();
        self.holding.forget(peer);
        p.got = 0;
        p.offer_pending = false;
        self.polling.retain(|&x| x != peer);
        if let Some(q) = qp {
            self.by_qpn.remove(&q.qpn);
            // Completions of it still in the CQ no longer find a peer (its number is gone,
            // and a new QP gets a new number): they are dropped.
            self.hca.destroy_qp(q)?;
        }
        // The QP is gone: the HCA reaches neither ring any more.
        if let Some(e) = erx {
            e.block.release(&*self.hca);
        }
        if let Some(e) = etx {
            e.staging.release(&*self.hca);
        }
        self.stats.disconnects += 1;
        Ok(())
    }

    /// Set up RC-FP slots for the connected `peer` if it has none and fewer than
    /// `fp_peers` peers have (a slot freed by a teardown goes to another connection).
    fn open_fast_path(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if self.shape.design == Design::Fastpath
            && self.peers[i].conn == Conn::Up
            && self.peers[i].erx.is_none()
            && self.polling.len() < self.fp_peers
        {
            self.open_rx(peer)?;
        }
        Ok(())
    }

    /// The largest active message (header and payload) the eager slots take in one record;
    /// larger ones go by send/receive. 0 without slots in this design.
    fn ring_max(&self) -> usize {
        self.shape.max_body().saturating_sub(FRAME_HDR)
    }

    /// [`RcChannel::connected`] and [`RcChannel::fast_path_to`] in one look at the peer's record:
    /// `None` while not connected, else whether its eager slots are set up (a composition
    /// asks on every send).
    #[inline]
    fn route(&self, peer: Rank) -> Option<bool> {
        self.peers
            .get(peer as usize)
            .filter(|p| p.conn == Conn::Up)
            .map(|p| p.etx.is_some())
    }

    fn am_send_via(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
        ring: bool,
    ) -> Result<SendOutcome> {
        self.send_via(dest, header, payload, ring)
    }
}

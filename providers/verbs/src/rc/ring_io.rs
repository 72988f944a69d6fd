//! The eager rings' I/O: the memory a ring lives in, offers, writing records into a peer's ring
//! (`ring_send`), polling ours (`poll_ring`, in sequence with send/receive frames), and the
//! acknowledgements, pointers and offers owed (`ring_control`). The rings themselves, without
//! I/O, are `eager.rs`.

use super::*;

/// Our side of the ring in a peer's memory.
pub(super) struct EagerTx {
    pub(super) tx: eager::Tx,
    /// The mirror of the ring, the source of the writes, and the head-pointer source word.
    pub(super) staging: Pool,
    /// The peer's block: the ring, its head word, our tail word.
    pub(super) addr: u64,
    pub(super) rkey: u32,
}

/// The ring a peer writes into: our block ([`Shape::mem_len`] + [`BLOCK_EXTRA`] bytes).
pub(super) struct EagerRx {
    pub(super) rx: eager::Rx,
    pub(super) block: Pool,
}

/// The receiver's view of its block for the sans-IO ring: loads and flag stores through raw
/// pointers, since the peer's HCA writes this memory while we read it.
pub(super) struct BlockView {
    pub(super) base: *mut u8,
    pub(super) len: usize,
}

impl RingMem for BlockView {
    fn load(&self, off: usize) -> u64 {
        assert!(
            off % 8 == 0 && off + 8 <= self.len,
            "ring word out of the block"
        );
        // SAFETY: in bounds and 8-aligned (checked above; blocks are page- or word-aligned).
        // An atomic load because the peer's HCA stores into these bytes concurrently; acquire,
        // so that once a record's last byte (released last by the HCA) is seen, the rest is.
        unsafe { AtomicU64::from_ptr(self.base.add(off) as *mut u64) }.load(Ordering::Acquire)
    }

    fn clear_flag(&mut self, off: usize) {
        assert!(
            off % 8 == 0 && off + 8 <= self.len,
            "ring word out of the block"
        );
        // SAFETY: in bounds (checked above); a single-byte atomic store.
        unsafe { AtomicU8::from_ptr(self.base.add(off + 7)) }.store(0, Ordering::Release);
    }
}

impl BlockView {
    /// Store a word of ours in the block (the source of the tail pointers we write): through
    /// the pointer, since a reference to the block would cover bytes peers write.
    pub(super) fn store(&mut self, off: usize, v: u64) {
        assert!(off % 8 == 0 && off + 8 <= self.len, "word out of the block");
        // SAFETY: in bounds and 8-aligned (checked above).
        unsafe { AtomicU64::from_ptr(self.base.add(off) as *mut u64) }.store(v, Ordering::Release);
    }
}

impl VerbsRc {
    /// The connection to `r` is up: the ring designs offer their ring at once.
    pub(super) fn on_up(&mut self, r: Rank) -> Result<()> {
        let now = match self.shape.design {
            // The fast path waits for its threshold (in `delivered`), unless that is 0.
            Design::Fastpath => self.fp_threshold == 0 && self.polling.len() < self.fp_peers,
            _ => true,
        };
        if now && self.peers[r as usize].erx.is_none() {
            self.open_rx(r)?;
        }
        Ok(())
    }

    /// Make a ring for `r` to write into, and offer it. Without the memory or registrations
    /// for it, the peer stays on send/receive.
    pub(super) fn open_rx(&mut self, r: Rank) -> Result<()> {
        let len = self.shape.mem_len() + BLOCK_EXTRA;
        // Device memory where there is enough: a peer's writes into it are plain stores.
        let block = match Pool::remote(&*self.hca, self.pd, len, true) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!("verbs-rc: no eager ring for rank {r}: {e}");
                return Ok(());
            }
        };
        let p = &mut self.peers[r as usize];
        p.erx = Some(EagerRx {
            rx: eager::Rx::new(self.shape),
            block,
        });
        p.offer_pending = true;
        self.polling.push(r);
        self.send_offer(r)
    }

    pub(super) fn send_offer(&mut self, r: Rank) -> Result<()> {
        let Some(e) = self.peers[r as usize].erx.as_ref() else {
            return Ok(());
        };
        let o = Offer {
            addr: e.block.mr().addr,
            rkey: e.block.mr().rkey,
            design: self.shape.design as u8,
            size: self.shape.size as u32,
            slot: self.shape.slot as u32,
        }
        .encode();
        if self.send_frame(r, FrameKind::Offer, 0, &[], &[IoSlice::new(&o)])? == SendOutcome::Sent {
            self.stats.offers += 1;
            self.peers[r as usize].offer_pending = false;
        }
        Ok(())
    }

    /// `src` offers a ring: check it is ours in shape, and make the mirror to write from.
    pub(super) fn on_offer(&mut self, src: Rank, o: Offer) -> std::result::Result<(), String> {
        let mine = self.shape;
        if o.design != mine.design as u8
            || o.size as usize != mine.size
            || o.slot as usize != mine.slot
        {
            return Err(format!(
                "verbs-rc: rank {src} runs another eager design or geometry (WEFT_VERBS_RC_EAGER, _RING, _FP_BUFS and _FP_SIZE must agree across the job)"
            ));
        }
        if self.peers[src as usize].etx.is_some() {
            return Err("verbs-rc: a second ring offer".into());
        }
        let staging = Pool::new(&*self.hca, self.pd, 1, mine.mem_len() + 8, false)
            .map_err(|e| format!("verbs-rc: no memory for the eager mirror: {e}"))?;
        self.peers[src as usize].etx = Some(EagerTx {
            tx: eager::Tx::new(mine),
            staging,
            addr: o.addr,
            rkey: o.rkey,
        });
        Ok(())
    }

    /// Try to send an active message through `r`'s ring: `false` if it cannot go that way
    /// now (no ring yet, too large, full, or the send queue is).
    pub(super) fn ring_send(
        &mut self,
        r: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<bool> {
        let i = r as usize;
        if self.peers[i].conn != Conn::Up {
            return Ok(false);
        }
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        let len = FRAME_HDR + header.len() + plen;
        let (sq, inflight) = (self.sq_depth as usize, self.peers[i].inflight as usize);
        let ring_posted = self.ring_posted;
        let basic = self.shape.design == Design::Basic;
        let p = &mut self.peers[i];
        // The acknowledgement this record carries (reported below, once it has gone).
        let ack = match (&p.erx, basic) {
            (Some(e), false) => e.rx.position() as u32,
            _ => 0,
        };
        let Some(e) = p.etx.as_mut() else {
            return Ok(false);
        };
        let n = e.tx.writes_for(len);
        if len > e.tx.shape().max_body()
            || inflight + n > sq
            || ring_posted + n > self.ring_in_flight
        {
            return Ok(false);
        }
        // SAFETY: the staging buffer is only ever read by the HCA (the writes that carry its
        // records), and `place` writes only bytes of the ring no write in flight reads: the
        // ring's free space (the eager engine's invariant).
        let Some(placed) = e.tx.place(unsafe { e.staging.buf(0) }, len) else {
            self.stats.ring_full += 1;
            return Ok(false);
        };
        let mut fh = [0u8; FRAME_HDR];
        Frame {
            kind: FrameKind::Am,
            hlen: header.len(),
            plen,
            seq: p.seq_out.take(),
            ack,
        }
        .write(&mut fh);
        let qp = p.qp.expect("connected peers have a QP");
        let (addr, rkey) = (e.addr, e.rkey);
        let mut parts: SmallVec<[&[u8]; 4]> = SmallVec::new();
        parts.push(&fh);
        parts.push(header);
        parts.extend(payload.iter().map(|s| &**s));
        // Copy what each write carries just before posting it: with pipeline's pieces the
        // HCA moves one while the next is copied.
        let mut wrs: SmallVec<[SendWr; 4]> = SmallVec::new();
        for w in &placed.writes {
            let from = w.off.max(placed.body) - placed.body;
            let to = (w.off + w.len)
                .min(placed.body + len)
                .saturating_sub(placed.body);
            if to > from {
                // SAFETY: the record just placed, not yet posted (as for `place` above).
                let dst = &mut unsafe { e.staging.buf(0) }[placed.body + from..placed.body + to];
                copy_range(dst, &parts, from);
            }
            let sge = e.staging.mr().sge(w.off, w.len);
            let wr = SendWr::write(K_RING | r as u64, &[sge], addr + w.off as u64, rkey);
            if self.shape.design == Design::Pipeline {
                self.hca.post_send(qp, std::slice::from_ref(&wr))?;
            } else {
                wrs.push(wr);
            }
        }
        let mut posted = placed.writes.len();
        if let Some(h) = placed.head {
            let at = self.shape.mem_len();
            // SAFETY: the head word past the ring's memory; the write that reads it is
            // posted below, and a new head is written only once that one completed
            // (`head_due`).
            let b = unsafe { e.staging.buf(0) };
            b[at..at + 8].copy_from_slice(&h.to_le_bytes());
            let sge = e.staging.mr().sge(at, 8);
            let head = addr + self.shape.head_at() as u64;
            wrs.push(SendWr::write(K_RING | r as u64, &[sge], head, rkey));
            posted += 1;
            self.stats.pointer_writes += 1;
        }
        if !wrs.is_empty() {
            self.hca.post_send(qp, &wrs)?;
        }
        p.inflight += posted as u32;
        if let (Some(e), false) = (p.erx.as_mut(), basic) {
            e.rx.report();
        }
        self.ring_posted += posted;
        self.stats.eager_ring += 1;
        Ok(true)
    }

    /// Poll `r`'s ring in our memory: deliver the records that are next in sequence, answer
    /// with acknowledgements when due, and (basic) take the peer's tail pointer and send the
    /// head pointer that waited for it.
    pub(super) fn poll_ring(&mut self, r: Rank, sink: &mut dyn Sink) -> Result<usize> {
        let i = r as usize;
        let mut n = 0;
        loop {
            let p = &mut self.peers[i];
            if p.conn == Conn::Failed {
                return Ok(n);
            }
            let Some(e) = p.erx.as_mut() else {
                return Ok(n);
            };
            let mut view = BlockView {
                base: e.block.base(),
                len: e.block.slot(),
            };
            match e.rx.peek(&mut view) {
                Peek::Empty => break,
                Peek::Bad => {
                    self.malformed(r, "verbs-rc: malformed eager record", sink);
                    return Ok(n);
                }
                Peek::Body { off, len } => {
                    // SAFETY: `peek` returned a record inside the block; the peer does not
                    // write it again before we acknowledge it (after `consume`). A peer that
                    // broke the protocol could change bytes while we read them, which only
                    // garbles what it sends us: the block is ours and stays allocated.
                    let b = unsafe { std::slice::from_raw_parts(e.block.base().add(off), len) };
                    let f = match Frame::read(b, MAX_HDR) {
                        Some(f) if f.kind == FrameKind::Am => f,
                        _ => {
                            self.malformed(r, "verbs-rc: malformed eager record", sink);
                            return Ok(n);
                        }
                    };
                    match p.expect.check(f.seq, HOLD.window) {
                        _ if !self.ordered => {}
                        Ok(0) => {}
                        // A send/receive frame before it is still in the completion queue.
                        Ok(_) => break,
                        Err(e) => {
                            let why = format!("verbs-rc: an eager record out of sequence: {e}");
                            self.holding.forget(r);
                            self.malformed(r, &why, sink);
                            return Ok(n);
                        }
                    }
                    p.expect.advance();
                    self.stats.am_recv += 1;
                    sink.am(
                        r,
                        &b[FRAME_HDR..FRAME_HDR + f.hlen],
                        &b[FRAME_HDR + f.hlen..],
                    );
                    e.rx.consume(&view, len);
                    let ack = f.ack;
                    self.take_ack(r, ack);
                    self.delivered(r)?;
                    n += 1;
                }
            }
            if self.drain_held(r, sink)? {
                n += 1;
            }
        }
        if self.drain_held(r, sink)? {
            n += 1;
        }
        self.ring_control(r)?;
        Ok(n)
    }

    /// Acknowledgements, pointers and offers owed to `r`.
    pub(super) fn ring_control(&mut self, r: Rank) -> Result<()> {
        let i = r as usize;
        if self.peers[i].conn == Conn::Draining {
            return Ok(());
        }
        if self.peers[i].offer_pending {
            self.send_offer(r)?;
        }
        let due = self.peers[i].erx.as_ref().is_some_and(|e| e.rx.ack_due());
        if self.shape.design != Design::Basic {
            if due && self.send_frame(r, FrameKind::Credit, 0, &[], &[])? == SendOutcome::Sent {
                self.stats.credits += 1;
            }
            return Ok(());
        }
        let basic_room =
            self.peers[i].inflight < self.sq_depth && self.ring_posted < self.ring_in_flight;
        let mem = self.shape.mem_len();
        let p = &mut self.peers[i];
        let (Some(qp), Some(rx), Some(tx)) = (p.qp, p.erx.as_mut(), p.etx.as_mut()) else {
            return Ok(());
        };
        // Our tail word (the peer's acknowledgement of our ring) is beside its ring here.
        let mut view = BlockView {
            base: rx.block.base(),
            len: rx.block.slot(),
        };
        if tx.tx.tail_word(view.load(mem)) {
            view.clear_flag(mem);
        }
        let mut wrs: SmallVec<[SendWr; 2]> = SmallVec::new();
        if due && basic_room {
            view.store(mem + 8, eager::pointer_word(rx.rx.report()));
            let sge = rx.block.mr().sge(mem + 8, 8);
            wrs.push(SendWr::write(
                K_RING | r as u64,
                &[sge],
                tx.addr + mem as u64,
                tx.rkey,
            ));
        }
        if basic_room {
            if let Some(h) = tx.tx.head_due() {
                // SAFETY: the head word, as in `ring_send`: no write of it is in flight.
                let b = unsafe { tx.staging.buf(0) };
                b[mem..mem + 8].copy_from_slice(&h.to_le_bytes());
                let sge = tx.staging.mr().sge(mem, 8);
                let at = tx.addr + self.shape.head_at() as u64;
                wrs.push(SendWr::write(K_RING | r as u64, &[sge], at, tx.rkey));
            }
        }
        if !wrs.is_empty() {
            self.hca.post_send(qp, &wrs)?;
            p.inflight += wrs.len() as u32;
            self.ring_posted += wrs.len();
            self.stats.pointer_writes += wrs.len() as u64;
        }
        Ok(())
    }
}

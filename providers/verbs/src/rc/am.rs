//! Active messages over RC send/receive: frames into the shared send pool, arrivals from the
//! shared receive queue delivered in sequence with the eager rings' records (what overtook
//! them held, `weft_proto::order`), and the channel choice per message (`send_via`).

use super::*;

impl VerbsRc {
    /// Put a frame on `r`'s connection: `Busy` when its send queue or the send buffers are
    /// full.
    pub(super) fn send_frame(
        &mut self,
        r: Rank,
        kind: FrameKind,
        seq: u32,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let i = r as usize;
        let Some(qp) = self.peers[i].qp else {
            return Ok(SendOutcome::Busy);
        };
        if self.peers[i].conn == Conn::Draining || self.peers[i].inflight >= self.sq_depth {
            return Ok(SendOutcome::Busy);
        }
        let Some(b) = self.send.free.pop().or_else(|| self.grow_send()) else {
            return Ok(SendOutcome::Busy);
        };
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        let ack = self.ack_for(r);
        // SAFETY: a free send slot: no send of it is outstanding until the post below.
        let buf = unsafe { self.send.buf(b) };
        Frame {
            kind,
            hlen: header.len(),
            plen,
            seq,
            ack,
        }
        .write(&mut buf[..FRAME_HDR]);
        let mut o = FRAME_HDR;
        buf[o..o + header.len()].copy_from_slice(header);
        o += header.len();
        for p in payload {
            buf[o..o + p.len()].copy_from_slice(p);
            o += p.len();
        }
        let wr = SendWr::send(K_SEND | b as u64, &[self.send.sge(b, o)]);
        if let Err(e) = self.hca.post_send(qp, &[wr]) {
            self.send.free.push(b);
            return Err(e);
        }
        self.peers[i].inflight += 1;
        Ok(SendOutcome::Sent)
    }

    pub(super) fn on_recv(
        &mut self,
        src: Rank,
        idx: u32,
        wc: &verbs::Wc,
        sink: &mut dyn Sink,
    ) -> Result<()> {
        if self.peers[src as usize].conn == Conn::Failed {
            // What a failed peer still sends is dropped: the core was told it is gone, and
            // nothing of it may be held again.
            return Ok(());
        }
        if wc.opcode == WcOpcode::RecvRdmaWithImm {
            self.stats.write_data += 1;
            sink.rma_data(src, wc.imm.unwrap_or(0) as u64);
            return Ok(());
        }
        let i = src as usize;
        // SAFETY: the receive of slot `idx` completed; the slot is reposted only once its
        // bytes have been handed on (below).
        let b = unsafe { self.recv.bytes(idx, wc.byte_len as usize) };
        let Some(f) = Frame::read(b, MAX_HDR) else {
            self.malformed(src, "malformed verbs-rc frame", sink);
            return Ok(());
        };
        if self.shape.design != Design::Basic {
            // (`take_ack`, spelled out: `b` borrows the receive pool.)
            if let Some(e) = self.peers[i].etx.as_mut() {
                e.tx.ack(f.ack);
            }
        }
        match f.kind {
            FrameKind::Am => {
                // Eager records written before this send may still be in our ring: then a copy
                // of this frame waits until they have been delivered.
                let body = &b[FRAME_HDR..];
                if !self.ordered {
                    // A composition's channel: its sequencer orders what every channel delivers.
                    self.stats.am_recv += 1;
                    sink.am(src, &body[..f.hlen], &body[f.hlen..]);
                    return self.delivered(src);
                }
                let hold = || (f.hlen, body.to_vec());
                match self.peers[i]
                    .expect
                    .arrive(&mut self.holding, src, f.seq, body.len(), hold)
                {
                    Ok(Arrival::Deliver) => {
                        self.stats.am_recv += 1;
                        sink.am(src, &body[..f.hlen], &body[f.hlen..]);
                        self.delivered(src)?;
                    }
                    Ok(Arrival::Held) => {
                        self.stats.overtaken += 1;
                        self.poll_ring(src, sink)?;
                    }
                    Err(e) => {
                        self.holding.forget(src);
                        let why = format!("verbs-rc: active messages out of sequence: {e}");
                        self.malformed(src, &why, sink);
                    }
                }
            }
            FrameKind::Rtu => {
                let p = &mut self.peers[i];
                if cm_state::on_rtu(p.conn) {
                    p.conn = Conn::Up;
                    sink.connection(src, ConnEvent::Connected);
                    self.on_up(src)?;
                }
            }
            FrameKind::Offer => {
                let o = Offer::decode(&b[FRAME_HDR..]);
                match o.map(|o| self.on_offer(src, o)) {
                    Some(Ok(())) => {}
                    Some(Err(why)) => self.malformed(src, &why, sink),
                    None => self.malformed(src, "verbs-rc: malformed ring offer", sink),
                }
            }
            FrameKind::Credit => {}
        }
        Ok(())
    }

    /// The peer sent what no verbs-rc peer sends: it is failed.
    pub(super) fn malformed(&mut self, src: Rank, why: &str, sink: &mut dyn Sink) {
        let p = &mut self.peers[src as usize];
        if p.conn != Conn::Failed {
            p.conn = Conn::Failed;
            self.polling.retain(|&r| r != src);
            sink.peer_failed(src, why);
        }
    }

    /// An acknowledgement of our ring in `src`'s memory arrived in a frame header.
    pub(super) fn take_ack(&mut self, src: Rank, ack: u32) {
        if self.shape.design == Design::Basic {
            return;
        }
        if let Some(e) = self.peers[src as usize].etx.as_mut() {
            e.tx.ack(ack);
        }
    }

    /// What to acknowledge to `r` in the header of a frame going there (not basic: it has its
    /// tail pointer).
    pub(super) fn ack_for(&mut self, r: Rank) -> u32 {
        if self.shape.design == Design::Basic {
            return 0;
        }
        self.peers[r as usize]
            .erx
            .as_mut()
            .map_or(0, |e| e.rx.report() as u32)
    }

    /// One more active message from `src` delivered in order: deliver what waited behind it,
    /// and set up the fast path once the peer has earned it.
    pub(super) fn delivered(&mut self, src: Rank) -> Result<()> {
        let p = &mut self.peers[src as usize];
        p.got += 1;
        if self.shape.design == Design::Fastpath
            && p.erx.is_none()
            && p.got >= self.fp_threshold
            && p.conn == Conn::Up
            && self.polling.len() < self.fp_peers
        {
            self.open_rx(src)?;
        }
        Ok(())
    }

    /// Deliver held send/receive frames from `src` that are next in sequence.
    pub(super) fn drain_held(&mut self, src: Rank, sink: &mut dyn Sink) -> Result<bool> {
        let mut any = false;
        loop {
            if self.holding.is_empty() {
                return Ok(any);
            }
            let p = &mut self.peers[src as usize];
            let Some((hlen, v)) = p.expect.pop(&mut self.holding, src) else {
                return Ok(any);
            };
            self.stats.am_recv += 1;
            sink.am(src, &v[..hlen], &v[hlen..]);
            self.delivered(src)?;
            any = true;
        }
    }

    /// Send an active message, through the peer's eager ring where `ring` allows and the ring
    /// takes it, else by RC send/receive (the hybrid provider picks RC-FP or RC-SR per message;
    /// order between the two is kept by the frames' sequence numbers either way).
    pub(super) fn send_via(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
        ring: bool,
    ) -> Result<SendOutcome> {
        let i = self.check_rank(dest)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > MAX_HDR || plen > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "verbs-rc: active message of {} + {plen} bytes exceeds {MAX_HDR} + {}",
                header.len(),
                self.caps.max_am_payload
            )));
        }
        match self.peers[i].conn {
            Conn::Up => {}
            Conn::Failed => return Err(self.peer_gone(dest)),
            Conn::Idle => {
                self.start(dest)?;
                if self.peers[i].conn != Conn::Up {
                    self.stats.busy += 1;
                    return Ok(SendOutcome::Busy);
                }
            }
            _ => {
                self.stats.busy += 1;
                return Ok(SendOutcome::Busy);
            }
        }
        if !self.peers[i].queued.is_empty() {
            self.flush_queued(dest)?;
            if !self.peers[i].queued.is_empty() {
                self.stats.busy += 1;
                return Ok(SendOutcome::Busy);
            }
        }
        if ring && self.ring_send(dest, header, payload)? {
            self.stats.am_sent += 1;
            return Ok(SendOutcome::Sent);
        }
        if FRAME_HDR + header.len() + plen > self.slot {
            // Only the ring takes it (a ring design's larger messages): wait for room.
            self.stats.busy += 1;
            return Ok(SendOutcome::Busy);
        }
        let seq = self.peers[i].seq_out.peek();
        let o = self.send_frame(dest, FrameKind::Am, seq, header, payload)?;
        match o {
            SendOutcome::Sent => {
                self.peers[i].seq_out.take();
                self.stats.am_sent += 1;
                self.stats.eager_sr += 1;
            }
            _ => self.stats.busy += 1,
        }
        Ok(o)
    }
}

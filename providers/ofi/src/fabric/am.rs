//! Active messages over `FI_MSG`: the receive buffers posted and reposted in batches, sends
//! (inject, or a send buffer), and arrivals delivered in per-pair order (`weft_proto::order`).

use super::*;

impl Ofi {
    pub(super) fn post_am_buffers(&mut self) -> Result<()> {
        self.slot = PREFIX + MAX_HDR + self.caps.max_am_payload;
        let n = AM_RX.get_u64()? as usize;
        self.rx_mem = vec![0; n * self.slot];
        self.tx_mem = vec![0; n * self.slot];
        self.tx_free = (0..n as u32).rev().collect();
        self.rx_desc = self.own_registration(self.rx_mem.as_ptr(), self.rx_mem.len())?;
        self.tx_desc = self.own_registration(self.tx_mem.as_ptr(), self.tx_mem.len())?;
        for i in 0..n as u32 {
            self.post_rx(i)?;
        }
        Ok(())
    }

    /// Post the receive buffers `handle` set aside.
    pub(super) fn repost(&mut self) -> Result<()> {
        while let Some(b) = self.rx_idle.pop() {
            self.post_rx(b)?;
        }
        Ok(())
    }

    pub(super) fn post_rx(&mut self, i: u32) -> Result<()> {
        let op = self.new_op(Op::AmRx(i));
        let base = i as usize * self.slot;
        loop {
            // SAFETY: buffer `i` is `slot` bytes inside `rx_mem`, which is never resized and
            // outlives the endpoint; it is not read again until its completion.
            let rc = unsafe {
                fi_recv(
                    self.ep,
                    self.rx_mem.as_mut_ptr().add(base).cast(),
                    self.slot,
                    self.rx_desc,
                    FI_ADDR_UNSPEC,
                    ctx(op),
                )
            };
            if rc == EAGAIN {
                self.drive()?;
                continue;
            }
            if rc != 0 {
                self.free_op(op);
            }
            return check("posting an active-message buffer", rc);
        }
    }

    /// Send an active message (or an acknowledgement) over `FI_MSG`.
    pub(super) fn am_post(
        &mut self,
        dest: Rank,
        kind: u8,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        let total = PREFIX + header.len() + plen;
        let fill = |buf: &mut [u8], rank: Rank, seq: u32| {
            wire::put_prefix(buf, kind, header.len() as u16, rank, seq);
            buf[PREFIX..PREFIX + header.len()].copy_from_slice(header);
            let mut o = PREFIX + header.len();
            for p in payload {
                buf[o..o + p.len()].copy_from_slice(p);
                o += p.len();
            }
        };
        if dest == self.rank {
            let mut m = vec![0; total];
            fill(&mut m, self.rank, 0);
            self.selfq.push_back(m);
            return Ok(SendOutcome::Sent);
        }
        let seq = self.seq_out[dest as usize].peek();
        let addr = self.addrs[dest as usize];
        if total <= self.caps.inject_size {
            self.scratch.resize(total, 0);
            fill(&mut self.scratch, self.rank, seq);
            for attempt in 0..2 {
                // SAFETY: `scratch` holds `total` bytes; fi_inject copies them before returning.
                let rc = unsafe { fi_inject(self.ep, self.scratch.as_ptr().cast(), total, addr) };
                if rc == 0 {
                    self.seq_out[dest as usize].take();
                    self.n_inject += 1;
                    return Ok(SendOutcome::Sent);
                }
                if rc != EAGAIN {
                    return Err(fi_err("fi_inject", rc));
                }
                if attempt == 0 {
                    self.drive()?;
                }
            }
            return Ok(SendOutcome::Busy);
        }
        let Some(i) = self.tx_free.pop() else {
            self.drive()?;
            return Ok(SendOutcome::Busy);
        };
        let base = i as usize * self.slot;
        let rank = self.rank;
        fill(&mut self.tx_mem[base..base + total], rank, seq);
        let op = self.new_op(Op::AmTx(i, dest));
        // SAFETY: send buffer `i` lies in `tx_mem` (never resized, outlives the endpoint) and is
        // not written again until its completion returns it to `tx_free`.
        let rc = unsafe {
            fi_send(
                self.ep,
                self.tx_mem.as_ptr().add(base).cast(),
                total,
                self.tx_desc,
                addr,
                ctx(op),
            )
        };
        if rc != 0 {
            self.free_op(op);
            self.tx_free.push(i);
            if rc == EAGAIN {
                self.drive()?;
                return Ok(SendOutcome::Busy);
            }
            return Err(fi_err("fi_send", rc));
        }
        self.seq_out[dest as usize].take();
        self.n_am_copy += 1;
        Ok(SendOutcome::Sent)
    }

    /// An arrived active message in `m` (prefix included): deliver it in per-pair order, or
    /// hold a copy when it overtook others (`in_order`: it was held and its turn came). The
    /// peer whose message was delivered, so that what waited behind it goes next.
    pub(super) fn on_am(&mut self, m: &[u8], in_order: bool, sink: &mut dyn Sink) -> Option<Rank> {
        let wire::Prefix {
            kind,
            hlen,
            src,
            seq,
        } = match wire::decode(m, self.size) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("ofi: {}; dropped", e.why);
                if let Some(src) = e.src {
                    sink.peer_failed(src, "malformed active message");
                }
                return None;
            }
        };
        if self.refused.contains(&src) {
            return None;
        }
        if src != self.rank && !in_order {
            let r = &mut self.seq_in[src as usize];
            let behind = seq.wrapping_sub(r.expected()) >= u32::MAX / 2;
            match r.arrive(&mut self.holding, src, seq, m.len(), || m.to_vec()) {
                Ok(Arrival::Deliver) => {}
                Ok(Arrival::Held) => return None,
                Err(OrderError::Duplicate { .. }) if behind => {
                    tracing::warn!("ofi: duplicate active message {seq} from rank {src}; dropped");
                    return None;
                }
                Err(e) => {
                    self.holding.forget(src);
                    self.refused.insert(src);
                    sink.peer_failed(src, &format!("active messages out of order: {e}"));
                    return None;
                }
            }
        }
        let (h, p) = m[PREFIX..].split_at(hlen);
        match kind {
            K_AM => sink.am(src, h, p),
            K_SYNC_ACK if wire::sync_ack(h).is_some() => {
                let i = wire::sync_ack(h).unwrap_or_default() as usize;
                match self.ops.get(i).copied() {
                    Some(Op::Send {
                        token,
                        dest,
                        ack: true,
                        sent,
                    }) if dest == src => {
                        if sent {
                            self.free_op(i);
                            sink.complete(token, Ok(Completed::Done));
                        } else {
                            self.ops[i] = Op::Send {
                                token,
                                dest,
                                ack: false,
                                sent,
                            };
                        }
                    }
                    _ => sink.peer_failed(src, "acknowledged a synchronous send it was not sent"),
                }
            }
            K_CTS if wire::cts(h).is_some() => {
                let (op, id, take) = wire::cts(h).unwrap_or_default();
                if let Err(e) = self.send_data(src, op as usize, id, take as usize) {
                    sink.peer_failed(src, &format!("large message: {e}"));
                }
            }
            _ => sink.peer_failed(src, "unknown active-message kind"),
        }
        (src != self.rank).then_some(src)
    }

    /// Deliver held messages from `src` that are now next in order.
    pub(super) fn drain_held(&mut self, src: Rank, sink: &mut dyn Sink) {
        while let Some(m) = self.seq_in[src as usize].pop(&mut self.holding, src) {
            self.on_am(&m, true, sink);
        }
    }
}

//! The send side: what each peer's link has to send posted while the send queue has room,
//! send buffers reused once acknowledged and no longer read by the HCA, keepalive probes.

use super::*;

impl VerbsUd {
    /// The address handle of `r`; a peer whose process is gone is failed (`None`), not an
    /// error of this call: a rank that finished may exit before a slower one first answers it.
    pub(super) fn reach(&mut self, r: Rank) -> Result<Option<(verbs::Ah, u32)>> {
        match self.ah_of(r) {
            Ok(a) => Ok(Some(a)),
            Err(e) if e.kind() == weft_provider::ErrorKind::PeerFailed => {
                if !self.peers[r as usize].failed {
                    let why = match e.detail() {
                        weft_provider::ErrorDetail::PeerFailed { reason, .. } => reason.clone(),
                        _ => e.to_string(),
                    };
                    self.fail_peer(r, why);
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Post what `r`'s link has to send, while the send queue has room.
    pub(super) fn transmit(&mut self, r: Rank, now: Instant) -> Result<()> {
        let i = r as usize;
        let p = &self.peers[i];
        if p.link.is_none() || p.failed {
            return Ok(());
        }
        let Some((ah, qpn)) = self.reach(r)? else {
            return Ok(());
        };
        let Some(link) = self.peers[i].link.as_mut() else {
            return Ok(());
        };
        while self.sq_used < SQ {
            let Some(tx) = link.poll_transmit(now) else {
                break;
            };
            let h = tx.header;
            let wr = match tx.payload {
                Some(&slot) => {
                    // A copy of this packet still in the HCA's hands keeps the header it had
                    // (same sequence number, an older acknowledgement, still true): the HCA
                    // may be reading those bytes.
                    if self.send_refs[slot as usize] == 0 {
                        // SAFETY: no send of the slot is in the HCA's hands (no reference).
                        let b = unsafe { self.send.buf(slot) };
                        wire::put_seq(b, h.psn.unwrap_or(0), h.ack);
                    }
                    self.send_refs[slot as usize] += 1;
                    let len = self.send_len[slot as usize] as usize;
                    SendWr::send(K_SEND | slot as u64, &[self.send.sge(slot, len)])
                }
                None => {
                    // A pure acknowledgement; with no buffer free it is dropped (the peer's
                    // timer or its next packet brings another).
                    let Some(c) = self.ctl.free.pop() else {
                        continue;
                    };
                    // SAFETY: a free control slot: no send of it is outstanding.
                    let b = unsafe { self.ctl.buf(c) };
                    wire::put_ack(b, self.rank, h.ack);
                    SendWr::send(K_CTL | c as u64, &[self.ctl.sge(c, PKT)])
                }
            };
            self.hca.post_send(self.qp, &[wr.to(ah, qpn, self.qkey)])?;
            self.sq_used += 1;
            self.stats.packets_sent += 1;
        }
        Ok(())
    }

    /// Probe the peers we have a link to and nothing unacknowledged with: a dead one then
    /// owes an acknowledgement and is failed after `WEFT_VERBS_UD_TIMEOUT` (a rank that only
    /// waits to receive would otherwise never notice). A round looks at the next
    /// `WEFT_VERBS_UD_KEEPALIVE_PEERS` links in turn, not at all of them, and probes hold at
    /// most half the send buffers (a probe keeps its buffer until acknowledged): a process that
    /// had talked to 16K peers probed until no send buffer was left, every 2 s, and its own
    /// messages waited for the acknowledgements of a thousand probes.
    pub(super) fn keepalives(&mut self) {
        let n = self.active.len();
        for _ in 0..self.cfg.keepalive_peers.min(n) {
            let k = self.ka_next % n;
            let r = self.active[k];
            let p = &mut self.peers[r as usize];
            if r == self.rank || p.failed || p.link.as_ref().is_none_or(|l| l.in_flight() > 0) {
                self.ka_next = k + 1;
                continue;
            }
            // The other half of the send buffers stays for data: this peer is the first of the
            // next round.
            if self.send.free.len() <= self.cfg.send_bufs / 2 {
                return;
            }
            let Some(slot) = self.send.free.pop() else {
                return;
            };
            self.ka_next = k + 1;
            // SAFETY: a free send slot: no send of it is outstanding.
            let b = unsafe { self.send.buf(slot) };
            wire::put_data(b, F_FIRST | F_LAST | F_PING, 0, self.rank, 0);
            self.send_len[slot as usize] = PKT as u32;
            let link = self.peers[r as usize].link.as_mut().expect("checked above");
            if link.send(slot).is_err() {
                self.send.free.push(slot);
            } else {
                self.mark_busy(r);
            }
        }
    }

    /// A send slot is free once acknowledged and no longer read by the HCA.
    pub(super) fn maybe_free(&mut self, slot: u32) {
        let s = slot as usize;
        if self.send_acked[s] && self.send_refs[s] == 0 {
            self.send_acked[s] = false;
            self.send.free.push(slot);
        }
    }
}

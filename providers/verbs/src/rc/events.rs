//! Completions and failures: every work completion by its kind (`on_wc`), a connection that
//! failed (its queued operations completed with the reason), and the events owed to the core.

use super::*;

impl VerbsRc {
    /// Hand the core the connection events and peer failures noted since the last progress
    /// call (out of line: most calls have none).
    #[inline(never)]
    pub(super) fn report_events(&mut self, sink: &mut dyn Sink) -> usize {
        let mut n = 0;
        for (r, e) in self.events.drain(..) {
            sink.connection(r, e);
            n += 1;
        }
        for (r, why) in std::mem::take(&mut self.failures) {
            sink.peer_failed(r, &why);
            n += 1;
        }
        n
    }

    /// The connection to `r` is gone (`st` is why): fail the peer once, and every operation
    /// queued for it; those in flight fail as the HCA flushes them.
    pub(super) fn conn_failed(&mut self, r: Rank, st: WcStatus) {
        // Failed already, or closed on purpose (draining, or torn down: no QP left to fail).
        if matches!(
            self.peers[r as usize].conn,
            Conn::Failed | Conn::Draining | Conn::Idle
        ) {
            return;
        }
        let reason = match st {
            WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr => {
                format!(
                    "transport retry exceeded ({}): the peer does not answer",
                    st.as_str()
                )
            }
            WcStatus::Success => "no answer to the connection request".to_string(),
            _ => format!("its RC connection broke with {}", st.as_str()),
        };
        self.fail_peer(r, reason);
    }

    /// Answering `r`'s connection-manager datagram failed (its process is gone, say, before
    /// our QP could be connected to its): that peer is failed, no other.
    pub(super) fn cm_failed(&mut self, r: Rank, e: &Error) {
        if matches!(self.peers[r as usize].conn, Conn::Failed | Conn::Draining) {
            return;
        }
        self.fail_peer(
            r,
            format!("its connection request could not be answered: {e}"),
        );
    }

    pub(super) fn fail_peer(&mut self, r: Rank, reason: String) {
        let i = r as usize;
        self.peers[i].conn = Conn::Failed;
        self.polling.retain(|&p| p != r);
        tracing::debug!("verbs-rc: rank {r}: {reason}");
        let queued: Vec<_> = self.peers[i].queued.drain(..).collect();
        for (_, op) in queued {
            if let Some(rec) = self.ops.remove(op) {
                self.table
                    .finish(rec.done, Err(Error::peer_failed(r, reason.clone())));
            }
        }
        self.failures.push((r, reason));
    }

    pub(super) fn on_wc(&mut self, wc: &verbs::Wc, sink: &mut dyn Sink) -> Result<()> {
        let idx = (wc.wr_id & 0xffff_ffff) as u32;
        let ok = wc.status == WcStatus::Success;
        match wc.wr_id & K_MASK {
            K_SRQ => {
                let src = self.by_qpn.get(&wc.qp_num).copied();
                if let (true, Some(src)) = (ok, src) {
                    self.on_recv(src, idx, wc, sink)?;
                }
                self.post_srq(idx)?;
            }
            K_SEND => {
                self.send.free.push(idx);
                if let Some(&r) = self.by_qpn.get(&wc.qp_num) {
                    let p = &mut self.peers[r as usize];
                    p.inflight = p.inflight.saturating_sub(1);
                    if !ok && wc.status != WcStatus::WrFlushErr {
                        self.conn_failed(r, wc.status);
                    }
                }
            }
            K_OP => {
                let Some(rec) = self.ops.remove(wc.wr_id & !K_MASK) else {
                    return Ok(());
                };
                self.ops_posted = self.ops_posted.saturating_sub(1);
                let r = rec.peer;
                let p = &mut self.peers[r as usize];
                p.inflight = p.inflight.saturating_sub(1);
                let res = match wc.status {
                    WcStatus::Success => Ok(()),
                    WcStatus::RemAccessErr => Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: r,
                        what:
                            "the remote key does not cover the address range with the needed rights"
                                .into(),
                    })),
                    WcStatus::WrFlushErr => Err(self.peer_gone(r)),
                    st => Err(verr("RMA operation", st)),
                };
                self.table.finish(rec.done, res);
                if !ok && wc.status != WcStatus::WrFlushErr {
                    self.conn_failed(r, wc.status);
                }
            }
            K_UDR => {
                if ok {
                    let n = (wc.byte_len as usize).min(UD_SLOT);
                    let skip = if wc.grh { verbs::GRH_LEN } else { 0 };
                    // SAFETY: the receive of slot `idx` just completed; it is reposted only
                    // after this read.
                    let b = unsafe { self.ud_recv.buf(idx) };
                    let m = b.get(skip..n).and_then(CmMsg::decode);
                    let grh: Option<[u8; verbs::GRH_LEN]> = wc
                        .grh
                        .then(|| b.get(..verbs::GRH_LEN)?.try_into().ok())
                        .flatten();
                    if let Some(m) = m {
                        if !self.cm_from_published(&m, wc.src_qp, grh.as_ref().map(|g| &g[..])) {
                            self.stats.cm_forged += 1;
                        } else if let Err(e) = self.on_cm(m) {
                            self.cm_failed(m.src, &e);
                        }
                    }
                }
                // Whatever the datagram was, its buffer is posted again.
                self.post_ud_recv(idx)?;
            }
            K_UDS => self.ud_send.free.push(idx),
            K_RING => {
                self.ring_posted = self.ring_posted.saturating_sub(1);
                if let Some(p) = self.peers.touched_mut(idx as usize) {
                    p.inflight = p.inflight.saturating_sub(1);
                    if !ok && wc.status != WcStatus::WrFlushErr {
                        self.conn_failed(idx, wc.status);
                    }
                }
            }
            K_KA => {
                let r = idx;
                self.ka_posted = self.ka_posted.saturating_sub(1);
                if let Some(p) = self.peers.touched_mut(r as usize) {
                    p.inflight = p.inflight.saturating_sub(1);
                    if !ok && wc.status != WcStatus::WrFlushErr {
                        self.conn_failed(r, wc.status);
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

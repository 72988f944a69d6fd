//! UD zero-copy's I/O (the protocol without I/O is `zcopy.rs`): pool QPs whose receives are a
//! registered buffer's pieces, the control messages, and the pump that moves pieces.

use super::*;

impl VerbsUd {
    /// Post receives for `pieces` of zero-copy receive `z` (recorded as posted by its
    /// [`zcopy::Recv`] already), in this order.
    pub(super) fn zpost(&mut self, z: usize, pieces: &[u32]) -> Result<()> {
        let Some(zr) = self.zrecvs[z].as_ref() else {
            return Ok(());
        };
        let zq = &self.zqps[zr.qp];
        let grh = self.scratch.sge(0, GRH);
        let wrs: Vec<verbs::RecvWr> = pieces
            .iter()
            .map(|&k| {
                let (off, len) = zr.r.region(k);
                let user = verbs::Sge {
                    addr: zr.mr.addr + off as u64,
                    length: len as u32,
                    lkey: zr.mr.lkey,
                };
                let id = K_ZRX | (zr.qp as u64) << 48 | ((zq.gen & 0xffff) as u64) << 32 | k as u64;
                verbs::RecvWr::new(id, &[grh, user])
            })
            .collect();
        self.hca.post_recv(zq.qp, &wrs)
    }

    /// Register `[base, base + len)` for one zero-copy transfer into it: a pool QP, the
    /// first round's receives posted.
    pub(super) fn zrecv_open(
        &mut self,
        base: *mut u8,
        len: usize,
        shared: bool,
    ) -> Result<MemRegion> {
        let piece = self.cfg.mtu;
        if len < self.cfg.zcopy_min || len.div_ceil(piece) > zcopy::MAX_PIECES as usize {
            return Err(Error::invalid(format!(
                "verbs-ud: {len} bytes go by copy (WEFT_VERBS_UD_ZCOPY_MIN={}, at most {} pieces)",
                self.cfg.zcopy_min,
                zcopy::MAX_PIECES
            )));
        }
        let Some(q) = self.zqps.iter().position(|z| z.user.is_none()) else {
            self.stats.zrefused += 1;
            return Err(Error::invalid(
                "verbs-ud: every zero-copy QP is busy (WEFT_VERBS_UD_ZCOPY_QPS)",
            ));
        };
        // SAFETY: the caller (the core's write rendezvous) keeps the buffer borrowed until
        // `mr_deregister`, which takes the posted receives back and deregisters first.
        let mr = unsafe {
            self.hca
                .reg_mr(self.pd, base, len, verbs::Access::LOCAL_WRITE)
        }?;
        let xfer = self.next_xfer;
        self.next_xfer = (xfer + 1) & zcopy::XFER_MASK;
        let mut r = zcopy::Recv::new(
            xfer,
            len,
            piece,
            ZDEPTH as usize,
            zcopy::max_ranges(self.cfg.mtu - PKT),
            !shared,
        );
        let first = r.first();
        let z = match self.zrecvs.iter().position(Option::is_none) {
            Some(z) => z,
            None => {
                self.zrecvs.push(None);
                self.zrecvs.len() - 1
            }
        };
        self.zrecvs[z] = Some(ZRecv {
            r,
            qp: q,
            mr,
            base,
            sender: None,
            fin: false,
        });
        self.zqps[q].user = Some(z);
        if let Err(e) = self.zpost(z, &first) {
            let _ = self.zrecv_close(z);
            return Err(e);
        }
        let key = zcopy::Key {
            qpn: self.zqps[q].qp.qpn,
            xfer,
            first: first.len() as u32,
            piece,
        };
        Ok(MemRegion {
            key: key.encode(),
            // Writes address the region by offset.
            addr: 0,
            len,
            handle: Z_HANDLE | z as u64,
            desc: mr.lkey as u64,
        })
    }

    /// End zero-copy receive `z`: receives still posted over the buffer are taken back (QP
    /// reset) and the buffer deregistered (waiting out a landing under way) before this
    /// returns; a sender not yet told the transfer ended is told it was given up.
    pub(super) fn zrecv_close(&mut self, z: usize) -> Result<()> {
        let zr = self
            .zrecvs
            .get_mut(z)
            .and_then(Option::take)
            .ok_or_else(|| Error::invalid("verbs-ud: deregistering an unknown region"))?;
        let zq = &mut self.zqps[zr.qp];
        zq.gen = zq.gen.wrapping_add(1);
        zq.user = None;
        let qp = zq.qp;
        let reset = if zr.r.has_posted() {
            self.hca
                .modify_qp(
                    qp,
                    &verbs::QpAttr {
                        qp_state: Some(verbs::QpState::Reset),
                        ..verbs::QpAttr::default()
                    },
                )
                .and_then(|()| verbs::activate_ud(&*self.hca, qp, self.qkey))
        } else {
            Ok(())
        };
        let dereg = self.hca.dereg_mr(zr.mr);
        if !zr.fin {
            if let Some(s) = zr.sender {
                self.send_ctl(s, &zcopy::Ctl::Abort { xfer: zr.r.xfer });
            }
        }
        if let Err(e) = &reset {
            // The QP could not be reset: keep it out of the pool (its receives point at a
            // deregistered buffer and would only fail).
            tracing::warn!("verbs-ud: a zero-copy QP could not be reset: {e}");
            self.zqps[zr.qp].user = Some(usize::MAX);
        }
        dereg.and(reset)
    }

    /// Queue control message `c` to `r` and send what the link has room for.
    pub(super) fn send_ctl(&mut self, r: Rank, c: &zcopy::Ctl) {
        self.peers[r as usize].ctl_out.push_back(c.encode());
        self.flush_ctl(r);
    }

    pub(super) fn flush_ctl(&mut self, r: Rank) {
        let i = r as usize;
        while !self.peers[i].ctl_out.is_empty() && !self.peers[i].failed {
            if self.link(r).room() < 1 {
                return;
            }
            let Some(slot) = self.send.free.pop() else {
                return;
            };
            let body = self.peers[i].ctl_out.pop_front().expect("checked above");
            let rank = self.rank;
            // SAFETY: a free send slot: no send of it is outstanding.
            let b = unsafe { self.send.buf(slot) };
            wire::put_data(b, F_FIRST | F_LAST | F_CTRL, 0, rank, body.len() as u32);
            b[PKT..PKT + body.len()].copy_from_slice(&body);
            self.send_len[slot as usize] = (PKT + body.len()) as u32;
            if self.link(r).send(slot).is_err() {
                self.send.free.push(slot);
                return;
            }
        }
    }

    /// Post the pieces zero-copy sends have due, while the send queue has room; announce a
    /// round's end once all its pieces are posted.
    pub(super) fn zpump(&mut self) -> Result<()> {
        for s in 0..self.zsends.len() {
            let Some(z) = self.zsends[s].as_ref() else {
                continue;
            };
            if z.result.is_some() || (z.queue.is_empty() && !z.done_due) {
                continue;
            }
            let dest = z.dest;
            let Some((ah, _)) = self.reach(dest)? else {
                continue;
            };
            let z = self.zsends[s].as_mut().expect("checked above");
            let room = (SQ - SQ_RESERVE).saturating_sub(self.sq_used) as usize;
            let n = room.min(z.queue.len());
            if n > 0 {
                let wrs: Vec<SendWr> = z
                    .queue
                    .drain(..n)
                    .map(|k| {
                        let off = k as usize * z.key.piece;
                        let sge = verbs::Sge {
                            // SAFETY (address arithmetic only): `k` < pieces, so `off` < len.
                            addr: z.ptr as u64 + off as u64,
                            length: z.key.piece.min(z.len - off) as u32,
                            lkey: z.lkey,
                        };
                        SendWr::send_imm(K_ZTX | s as u64, &[sge], zcopy::imm(z.key.xfer, k))
                            .to(ah, z.key.qpn, self.qkey)
                    })
                    .collect();
                self.hca.post_send(self.qp, &wrs)?;
                z.outstanding += n as u32;
                self.sq_used += n as u32;
                self.stats.zpieces += n as u64;
            }
            if z.queue.is_empty() && z.done_due {
                z.done_due = false;
                let c = zcopy::Ctl::Done {
                    xfer: z.key.xfer,
                    round: z.round,
                };
                self.send_ctl(dest, &c);
            }
        }
        Ok(())
    }

    /// A zero-copy control message from `src`.
    pub(super) fn zctl(&mut self, src: Rank, body: &[u8]) -> Result<()> {
        use zcopy::Ctl;
        let Some(c) = Ctl::decode(body) else {
            self.stats.malformed += 1;
            return Ok(());
        };
        match c {
            Ctl::Done { xfer, round } => {
                let z = self.zrecvs.iter().position(|z| {
                    z.as_ref()
                        .is_some_and(|z| z.r.xfer == xfer && z.sender.is_none_or(|s| s == src))
                });
                let Some(z) = z else {
                    // The receive is gone (or never was): the sender must not wait.
                    self.send_ctl(src, &Ctl::Abort { xfer });
                    return Ok(());
                };
                let zr = self.zrecvs[z].as_mut().expect("found above");
                zr.sender = Some(src);
                let Some((moves, next)) = zr.r.on_done(round) else {
                    return Ok(());
                };
                for &(from, to, len) in &moves {
                    let (f, _) = zr.r.region(from);
                    let (t, _) = zr.r.region(to);
                    // SAFETY: both places lie in the buffer registered for this receive
                    // (alive until `mr_deregister`); they are different pieces, so they do not
                    // overlap; neither has a receive posted (`Recv::on_done` moves only into
                    // places without one, and `from`'s receive completed), so the HCA does not
                    // write either meanwhile; `len` is at most a piece.
                    unsafe { std::ptr::copy_nonoverlapping(zr.base.add(f), zr.base.add(t), len) };
                }
                self.stats.zmoved += moves.len() as u64;
                match next {
                    zcopy::Next::Finished => {
                        zr.fin = true;
                        self.stats.zrecvs += 1;
                        self.stats.zregranted += zr.r.regranted;
                        self.send_ctl(src, &Ctl::Fin { xfer });
                    }
                    zcopy::Next::Stuck => {
                        zr.fin = true;
                        self.send_ctl(src, &Ctl::Abort { xfer });
                    }
                    zcopy::Next::Grant { round, new, pieces } => {
                        self.stats.zrounds += 1;
                        self.zpost(z, &new)?;
                        self.send_ctl(
                            src,
                            &Ctl::Grant {
                                xfer,
                                round,
                                pieces,
                            },
                        );
                    }
                }
            }
            Ctl::Grant {
                xfer,
                round,
                pieces,
            } => {
                if let Some(z) = self.zsend_of(src, xfer) {
                    let n = z.len.div_ceil(z.key.piece) as u32;
                    if pieces.iter().any(|&k| k >= n) {
                        self.stats.malformed += 1;
                    } else if round == z.round + 1 {
                        z.round = round;
                        z.queue = pieces.into();
                        z.done_due = true;
                    }
                }
            }
            Ctl::Fin { xfer } => {
                if let Some(z) = self.zsend_of(src, xfer) {
                    z.result = Some(Ok(()));
                }
            }
            Ctl::Abort { xfer } => {
                if let Some(z) = self.zsend_of(src, xfer) {
                    z.result = Some(Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: src,
                        what: "the receiver gave the zero-copy transfer up".into(),
                    })));
                }
            }
        }
        Ok(())
    }

    pub(super) fn zsend_of(&mut self, dest: Rank, xfer: u32) -> Option<&mut ZSend> {
        self.zsends
            .iter_mut()
            .flatten()
            .find(|z| z.dest == dest && z.key.xfer == xfer && z.result.is_none())
    }

    /// Report zero-copy sends that are over and whose pieces the HCA no longer reads.
    pub(super) fn zcomplete(&mut self, sink: &mut dyn Sink) -> usize {
        let mut n = 0;
        for slot in &mut self.zsends {
            if slot
                .as_ref()
                .is_some_and(|z| z.result.is_some() && z.outstanding == 0)
            {
                let z = slot.take().expect("checked above");
                if let Some(t) = z.token {
                    sink.complete(
                        t,
                        z.result.expect("checked above").map(|()| Completed::Done),
                    );
                }
                n += 1;
            }
        }
        n
    }
}

//! Sends and receives through the descriptor slots in shared memory: matching against the
//! peer's posted receives or unexpected sends, operations deferred while the slots are full and
//! retried, and completed slots reaped.

use super::*;

impl Limic {
    /// Send: match `dest`'s posted receives, else queue a descriptor in its unexpected queue.
    pub(crate) fn do_send(
        &mut self,
        dest: usize,
        ctx: u32,
        tag: i32,
        iov: &[Range],
        sync: bool,
        token: Token,
    ) -> Result<bool> {
        let len = total(iov);
        let small = len <= self.seg.lay.inline_max;
        let me = self.me;
        let g = lock_area(&self.seg, &self.watch, dest, me);
        let hit = self.seg.take_first(dest, Q::Posted, |r| {
            r.ctx.load(Ordering::Relaxed) == ctx
                && {
                    let s = r.src.load(Ordering::Relaxed);
                    s == ANY_SRC || s == me as u32
                }
                && tag_matches(r.tag.load(Ordering::Relaxed), tag as i64)
        });
        if let Some(r) = hit {
            let (_, ri) = sref_parts(r);
            let rs = self.seg.slot(dest, ri);
            rs.claimer.store(me as u32, Ordering::Relaxed);
            rs.state.store(CLAIMED, Ordering::Relaxed);
            drop(g);
            if !small && self.pull {
                if let Some(slot) = self.free.pop() {
                    // Leave the copy to the receiver: it writes its own buffer from its own
                    // core, where it will read it (no cache lines bouncing between cores).
                    let s = self.seg.slot(me, slot);
                    self.fill_send(s, ctx, tag, len, sync, iov);
                    s.claimer.store(dest as u32, Ordering::Relaxed);
                    s.state.store(CLAIMED, Ordering::Relaxed);
                    rs.matched.store(sref(me, slot), Ordering::Relaxed);
                    rs.state.store(MATCHED, Ordering::Release);
                    self.seg.area(dest).done.v.fetch_add(1, Ordering::AcqRel);
                    self.out.push(Out {
                        slot,
                        token: Some(token),
                        kind: SEND,
                        peer: Some(dest),
                        iov: SmallVec::new(),
                    });
                    return Ok(true);
                }
            }
            // We arrived second: push the data into the posted receive.
            let cap = rs.len.load(Ordering::Relaxed) as usize;
            let res = if small {
                let n = len.min(cap);
                let dst = [Range {
                    base: self.seg.slot_inline(dest, ri) as u64,
                    len: n,
                }];
                // SAFETY: the inline area belongs to the claimed slot, which nobody else
                // touches until DONE; the source is the caller's buffer.
                unsafe { copy_local(&dst, iov, n) };
                rs.inline_len.store(n as u64, Ordering::Relaxed);
                Ok(n)
            } else {
                rs.inline_len.store(0, Ordering::Relaxed);
                let remote = Self::read_iov(rs);
                self.xfer(dest, Dir::Push, iov, &remote, len.min(cap))
            };
            let (err, r) = self.copy_outcome(dest, res, "pushing a message", Completed::Done);
            self.finish_slot(dest, ri, me as u32, tag as i64, len as u64, err);
            self.done.push(token, r);
            return Ok(true);
        }
        // We arrived first: leave a descriptor for the receiver, in a slot of ours.
        let Some(slot) = self.free.pop() else {
            return Ok(false);
        };
        let s = self.seg.slot(me, slot);
        self.fill_send(s, ctx, tag, len, sync, iov);
        s.claimer.store(NIL, Ordering::Relaxed);
        if small {
            let dst = [Range {
                base: self.seg.slot_inline(me, slot) as u64,
                len,
            }];
            // SAFETY: our own free slot's inline area; the source is the caller's buffer.
            unsafe { copy_local(&dst, iov, len) };
            s.inline_len.store(len as u64, Ordering::Relaxed);
            s.niov.store(0, Ordering::Relaxed);
        }
        self.seg.append(dest, Q::Unexp, sref(me, slot));
        drop(g);
        let buffered = small && !sync;
        if buffered {
            // The data is in the descriptor: the user has the buffer back.
            self.done.push(token, Ok(Completed::Done));
        }
        self.out.push(Out {
            slot,
            token: (!buffered).then_some(token),
            kind: SEND,
            peer: Some(dest),
            iov: SmallVec::new(),
        });
        Ok(true)
    }

    /// Receive: match our unexpected sends, else post a descriptor.
    pub(crate) fn do_recv(
        &mut self,
        src: Option<usize>,
        ctx: u32,
        tag: Option<i32>,
        iov: &[Range],
        token: Token,
    ) -> Result<bool> {
        let cap = total(iov);
        let me = self.me;
        let g = lock_area(&self.seg, &self.watch, me, me);
        let want_tag = tag.map_or(ANY_TAG, |t| t as i64);
        let hit = self.seg.take_first(me, Q::Unexp, |s| {
            s.ctx.load(Ordering::Relaxed) == ctx
                && src.is_none_or(|w| s.src.load(Ordering::Relaxed) == w as u32)
                && tag_matches(want_tag, s.tag.load(Ordering::Relaxed))
        });
        if let Some(sr) = hit {
            let (sender, si) = sref_parts(sr);
            let ss = self.seg.slot(sender, si);
            ss.claimer.store(me as u32, Ordering::Relaxed);
            ss.state.store(CLAIMED, Ordering::Relaxed);
            drop(g);
            // We arrived second: pull the data.
            let len = ss.len.load(Ordering::Relaxed) as usize;
            let stag = ss.tag.load(Ordering::Relaxed);
            let res = if ss.inline_len.load(Ordering::Relaxed) as usize == len
                && len <= self.seg.lay.inline_max
                && ss.niov.load(Ordering::Relaxed) == 0
            {
                let srcr = [Range {
                    base: self.seg.slot_inline(sender, si) as u64,
                    len,
                }];
                // SAFETY: the claimed slot's inline bytes (written before it was queued) and
                // the caller's receive buffer.
                Ok(unsafe { copy_local(iov, &srcr, len.min(cap)) })
            } else {
                let remote = Self::read_iov(ss);
                self.xfer(sender, Dir::Pull, iov, &remote, len.min(cap))
            };
            let status = Completed::Received(TaggedStatus {
                source: sender as Rank,
                tag: stag as i32,
                bytes: len,
            });
            let (err, r) = self.copy_outcome(sender, res, "pulling a message", status);
            self.finish_slot(sender, si, me as u32, stag, len as u64, err);
            self.done.push(token, r);
            return Ok(true);
        }
        // We arrived first: post a descriptor, in a slot of ours.
        let Some(slot) = self.free.pop() else {
            return Ok(false);
        };
        let s = self.seg.slot(me, slot);
        s.kind.store(RECV, Ordering::Relaxed);
        s.src
            .store(src.map_or(ANY_SRC, |x| x as u32), Ordering::Relaxed);
        s.ctx.store(ctx, Ordering::Relaxed);
        s.tag.store(want_tag, Ordering::Relaxed);
        s.len.store(cap as u64, Ordering::Relaxed);
        s.inline_len.store(0, Ordering::Relaxed);
        s.claimer.store(NIL, Ordering::Relaxed);
        self.write_iov(s, iov);
        self.seg.append(me, Q::Posted, sref(me, slot));
        drop(g);
        self.out.push(Out {
            slot,
            token: Some(token),
            kind: RECV,
            peer: src,
            iov: iov.into(),
        });
        Ok(true)
    }

    /// Try a send or receive; `Ok(false)`: it needs a slot and none is free.
    pub(crate) fn attempt(&mut self, d: &Deferred) -> Result<bool> {
        match d {
            Deferred::Send {
                dest,
                ctx,
                tag,
                iov,
                sync,
                token,
            } => self.do_send(*dest, *ctx, *tag, iov, *sync, *token),
            Deferred::Recv {
                src,
                ctx,
                tag,
                iov,
                token,
            } => self.do_recv(*src, *ctx, *tag, iov, *token),
        }
    }

    /// Post a send or receive now, or queue it behind earlier ones of its kind (sends keep
    /// their order, and so do receives; the two kinds never wait for each other).
    pub(crate) fn post(&mut self, d: Deferred) -> Result<()> {
        let q = match d {
            Deferred::Send { .. } => &self.deferred_sends,
            Deferred::Recv { .. } => &self.deferred_recvs,
        };
        if q.is_empty() && self.attempt(&d)? {
            return Ok(());
        }
        match d {
            Deferred::Send { .. } => self.deferred_sends.push_back(d),
            Deferred::Recv { .. } => self.deferred_recvs.push_back(d),
        }
        Ok(())
    }

    /// Retry deferred operations, in order within each kind.
    pub(crate) fn run_deferred(&mut self) -> Result<usize> {
        let mut n = 0;
        for sends in [true, false] {
            loop {
                let q = if sends {
                    &mut self.deferred_sends
                } else {
                    &mut self.deferred_recvs
                };
                let Some(d) = q.pop_front() else {
                    break;
                };
                if self.attempt(&d)? {
                    n += 1;
                } else {
                    let q = if sends {
                        &mut self.deferred_sends
                    } else {
                        &mut self.deferred_recvs
                    };
                    q.push_front(d);
                    break;
                }
            }
        }
        Ok(n)
    }

    /// Complete our descriptors that others finished.
    pub(crate) fn reap(&mut self) -> usize {
        let seq = self.seg.area(self.me).done.v.load(Ordering::Acquire);
        if seq == self.seen_done {
            return 0;
        }
        self.seen_done = seq;
        let mut n = 0;
        let mut k = 0;
        while k < self.out.len() {
            let o = &self.out[k];
            let s = self.seg.slot(self.me, o.slot);
            let st = s.state.load(Ordering::Acquire);
            if st == MATCHED {
                let o = self.out.swap_remove(k);
                let r = self.pull_matched(&o);
                if let Some(t) = o.token {
                    self.done.push(t, r);
                }
                s.state.store(FREE, Ordering::Relaxed);
                self.free.push(o.slot);
                n += 1;
                continue;
            }
            if st != DONE {
                k += 1;
                continue;
            }
            let o = self.out.swap_remove(k);
            let err = s.st_err.load(Ordering::Relaxed);
            let peer = s.st_src.load(Ordering::Relaxed) as usize;
            if let Some(t) = o.token {
                let r = match (err, o.kind) {
                    (E_OK, SEND) => Ok(Completed::Done),
                    (E_OK, _) => {
                        let bytes = s.st_bytes.load(Ordering::Relaxed) as usize;
                        // Written by the peer: at most what the inline area and our buffer
                        // hold, whatever it says.
                        let il = (s.inline_len.load(Ordering::Relaxed) as usize)
                            .min(self.seg.lay.inline_max)
                            .min(total(&o.iov));
                        if il > 0 {
                            let srcr = [Range {
                                base: self.seg.slot_inline(self.me, o.slot) as u64,
                                len: il,
                            }];
                            // SAFETY: our DONE slot's inline bytes (ordered by the acquire
                            // above, `il` within the inline area) into the receive buffer the
                            // request still borrows (our own record of it, not the slot's).
                            unsafe { copy_local(&o.iov, &srcr, il) };
                        }
                        Ok(Completed::Received(TaggedStatus {
                            source: peer as Rank,
                            tag: s.st_tag.load(Ordering::Relaxed) as i32,
                            bytes,
                        }))
                    }
                    (E_PEER, _) => Err(self.peer_err(peer, "process died during the copy")),
                    _ => Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: peer as Rank,
                        what: "the message could not be copied (bad address)".into(),
                    })),
                };
                self.done.push(t, r);
            }
            s.state.store(FREE, Ordering::Relaxed);
            self.free.push(o.slot);
            n += 1;
        }
        n
    }
}

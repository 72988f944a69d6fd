//! Posting sends (eager, rendezvous, speculative, native), streaming rendezvous data, and the
//! eager credits that bound what a peer can make this rank hold.

use super::buf::{gather, Layout, SendBuf};
use super::{
    eager_hdr, plain_eager_bytes, status, Kind, P2pState, Posted, Req, SendMr, SendPhase, SendReq,
    EAGER_OVERHEAD, F_REMOTE, F_SYNC, H_CREDIT, H_DATA, H_RTS, H_SDATA, H_SPEC, H_WFIN,
    WFIN_FAILED,
};
use crate::am::outbox::failure_reason;
use crate::am::{AmState, Hdr, Out, Rd, ReqId};
use crate::provider::{Access, Completion, Provider, RawIov, RemoteAddr, SendOutcome};
use crate::types::Rank;
use crate::{Error, ErrorKind, Result};
use smallvec::SmallVec;
use std::io::IoSlice;

/// What the lean send did ([`P2pState::send_lean`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lean {
    /// The provider took the message.
    Sent,
    /// It was a lean message, and the provider said `Busy`.
    Busy,
    /// Not a lean message: nothing was tried.
    Skipped,
}

impl P2pState {
    /// The lean send: a small contiguous non-synchronous message to a connected, healthy peer
    /// with nothing queued ahead, within its eager credit and the peer's limits
    /// ([`AmState::lean_below`]: payload, eager and, where larger messages go zero-copy, inject
    /// size, also when the provider narrows them per peer), handed to the provider in the call
    /// (no request, no iovec vectors, no header builder). [`Lean::Sent`]: the provider took it
    /// and the caller's buffer is free; otherwise nothing was done and the general path
    /// decides ([`Lean::Busy`]: told so, the provider need not be asked again at once). Touches
    /// no state but the peer's eager credit, so no peer can have failed meanwhile and nothing
    /// needs settling after it.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn send_lean<P: Provider>(
        &mut self,
        p: &mut P,
        am: &AmState,
        dest: Rank,
        ctx: u32,
        tag: i32,
        data: &[u8],
    ) -> Result<Lean> {
        let len = data.len();
        if len <= self.eager_limit
            && len < am.lean_below(dest)
            && am.out.is_empty_to(dest)
            && self.eager_out[dest as usize] + len + EAGER_OVERHEAD <= self.eager_window
        {
            let h = plain_eager_bytes(ctx, tag);
            if p.am_send(dest, &h, &[IoSlice::new(data)])? == SendOutcome::Sent {
                self.eager_out[dest as usize] += len + EAGER_OVERHEAD;
                return Ok(Lean::Sent);
            }
            return Ok(Lean::Busy);
        }
        Ok(Lean::Skipped)
    }

    /// Post a send the lean path did not take or was not tried for (`Comm::post_plain` is the
    /// one place that tries it first). `busy`: the provider just refused this very message,
    /// so an eager one is queued without asking again.
    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    pub(crate) fn isend_general<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        dest: Rank,
        ctx: u32,
        tag: i32,
        buf: SendBuf,
        sync: bool,
        scope: u64,
        busy: bool,
    ) -> Result<Posted> {
        am.touch(p, dest)?;
        if am.caps.tagged {
            return self.native_send(p, am, dest, ctx, tag, buf, sync, scope);
        }
        let eager = match am.narrow(dest) {
            None => self.eager_limit,
            Some(n) => self.eager_limit.min(n.eager_limit).min(n.max_am_payload),
        };
        if buf.len <= eager && self.eager_credit(dest, buf.len) {
            // Fast path: straight to the provider when nothing is queued ahead for `dest`; a
            // plain send then needs no request at all.
            if !busy && !sync && am.out.is_empty_to(dest) && !zcopy(am, dest, buf.len) {
                let h = eager_hdr(0, ctx, tag);
                if send_now(p, am, dest, &h, &buf)? == SendOutcome::Sent {
                    return Ok(Posted::Done(Ok(status(dest, tag, buf.len))));
                }
            }
            let id = self.new_send(scope, dest, ctx, tag, buf, sync, SendPhase::Queued, None);
            am.push_out(dest, Out::Req(id));
            if sync {
                self.flush(p, am)?;
            }
            return Ok(Posted::Pending(id));
        }
        // Not for `ssend`: a staged message is acknowledged before it matches.
        if buf.len <= self.spec_limit && !sync && (self.spec_behind || self.idle(am, dest)) {
            let phase = SendPhase::Spec {
                off: 0,
                acked: false,
            };
            let id = self.new_send(scope, dest, ctx, tag, buf, sync, phase, None);
            am.push_out(dest, Out::Req(id));
            self.flush(p, am)?;
            return Ok(Posted::Pending(id));
        }
        // Rendezvous.
        let mut mr = None;
        let peer_reads = am.narrow(dest).is_none_or(|n| n.rma_read);
        if self.rma_read && peer_reads && matches!(buf.layout, Layout::Contig) {
            // Registration is costly where the provider needs descriptors or pins pages: the
            // cache keeps the buffer registered (readable by the job's peers) for the next send.
            let reg = if am.caps.mr_local || am.caps.mr_pins {
                am.mr
                    .acquire_remote(p, buf.base, buf.len, Access::READ)
                    .map(|(ra, r)| (ra, SendMr::Cached(r)))
            } else {
                // SAFETY: the send request borrows `buf` until it completes, and completion
                // waits for FIN, sent only after the peer's read finished; the registration is
                // dropped before the request completes (or revoked if it is quarantined).
                unsafe { p.mr_register(buf.base as *mut u8, buf.len, Access::READ) }.map(|m| {
                    let ra = RemoteAddr {
                        addr: m.addr,
                        key: m.key,
                    };
                    (ra, SendMr::Own(Box::new(m)))
                })
            };
            match reg {
                Ok((ra, m)) => mr = Some((ra, m)),
                // Providers whose RMA reaches only memory they placed (shm windows) cannot
                // register user buffers: stop asking (each refusal costs an error value).
                Err(e) if e.kind() == ErrorKind::Unsupported => {
                    tracing::debug!("rendezvous streams from now on: {e}");
                    self.rma_read = false;
                }
                Err(e) => tracing::debug!("registration failed, streaming instead: {e}"),
            }
        }
        let remote = mr.as_ref().map(|(ra, _)| (ra.addr, ra.key));
        let mr = mr.map(|(_, m)| m);
        let phase = if mr.is_some() {
            SendPhase::WaitFin
        } else {
            SendPhase::WaitCts
        };
        let len = buf.len;
        let id = self.new_send(scope, dest, ctx, tag, buf, sync, phase, mr);
        let mut h = Hdr::new(H_RTS);
        h.u8(if remote.is_some() { F_REMOTE } else { 0 })
            .u32(ctx)
            .u32(tag as u32)
            .u64(len as u64)
            .u64(id);
        if let Some((addr, key)) = remote {
            h.u64(addr).u64(key);
        }
        am.push_ctrl(dest, h);
        self.flush(p, am)?;
        Ok(Posted::Pending(id))
    }

    /// Try to hand the `SPEC` frame of speculative send `id` to the provider; once it is taken
    /// the rest of the data streams as `SDATA`.
    pub(super) fn send_spec_head<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        id: ReqId,
    ) -> Result<SendOutcome> {
        let Some(Req {
            kind: Kind::Send(r),
            done: None,
            ..
        }) = self.reqs.get(id)
        else {
            // Failed meanwhile: drop it.
            return Ok(SendOutcome::Sent);
        };
        let (dest, len) = (r.dest, r.buf.len);
        let n = len.min(am.chunk(dest));
        let mut h = Hdr::new(H_SPEC);
        h.u8(0).u32(r.ctx).u32(r.tag as u32).u64(len as u64).u64(id);
        let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
        r.buf.pieces(0, n, &mut pieces);
        let o = self.send_req_pieces(p, am, id, dest, &h, &pieces)?;
        if o == SendOutcome::Sent {
            self.set_send_phase(
                id,
                SendPhase::Spec {
                    off: n,
                    acked: false,
                },
            );
            if n < len {
                self.streams.push(id);
                self.work = true;
            }
        }
        Ok(o)
    }

    /// Try to send queued eager message `id` (its turn in the outbox came).
    #[inline]
    pub(super) fn send_queued_eager<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        id: ReqId,
    ) -> Result<SendOutcome> {
        let Some(Req {
            kind: Kind::Send(r),
            done: None,
            ..
        }) = self.reqs.get(id)
        else {
            return Ok(SendOutcome::Sent);
        };
        let mut h = eager_hdr(if r.sync() { F_SYNC } else { 0 }, r.ctx, r.tag);
        if r.sync() {
            h.u64(id);
        }
        let (sync, dest, tag, len) = (r.sync(), r.dest, r.tag, r.buf.len);
        let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
        r.buf.pieces(0, len, &mut pieces);
        let o = self.send_req_pieces(p, am, id, dest, &h, &pieces);
        if o.as_ref().is_ok_and(|o| *o == SendOutcome::Sent) {
            if sync {
                self.set_send_phase(id, SendPhase::WaitAck);
            } else {
                self.finish(id, Ok(status(dest, tag, len)));
            }
        }
        o
    }

    #[allow(clippy::too_many_arguments)]
    fn native_send<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        dest: Rank,
        ctx: u32,
        tag: i32,
        buf: SendBuf,
        sync: bool,
        scope: u64,
    ) -> Result<Posted> {
        let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
        let mut tmp = None;
        if buf.piece_count(am.caps.max_iov) > am.caps.max_iov {
            let mut v = vec![0u8; buf.len];
            gather(&buf, &mut v);
            pieces.push(RawIov {
                desc: 0,
                ptr: v.as_ptr(),
                len: v.len(),
            });
            tmp = Some(v);
        } else {
            buf.pieces(0, buf.len, &mut pieces);
        }
        let span = match &tmp {
            Some(v) => (v.as_ptr(), v.len()),
            None => buf.span(),
        };
        let id = self
            .reqs
            .insert(Req::new(scope, Kind::NSend { dest, _tmp: tmp }));
        let posted = self.describe(p, am, id, span, Access::LOCAL).and_then(|d| {
            pieces.iter_mut().for_each(|x| x.desc = d);
            // SAFETY: the pieces point into the user's buffer (borrowed by the request
            // until it completes) or into `tmp`, owned by the request; both outlive the
            // provider's use.
            unsafe { p.tagged_send(dest, ctx, tag, &pieces, sync, id) }
        });
        if let Err(e) = posted {
            self.forget(am, id);
            return Err(e);
        }
        Ok(Posted::Pending(id))
    }

    /// Advance the data of rendezvous sends: `DATA` after a `CTS`, `SDATA` of speculative ones.
    pub(super) fn pump_streams<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
    ) -> Result<usize> {
        let mut sent = 0;
        let mut i = 0;
        while i < self.streams.len() {
            let id = self.streams[i];
            // `rreq`: the receive a CTS named; `None` while speculating.
            let (dest, rreq, mut off, len, buf) = match self.reqs.get(id) {
                Some(Req {
                    kind: Kind::Send(s),
                    done: None,
                    ..
                }) => match s.phase {
                    SendPhase::Stream { rreq, off, len } => {
                        (s.dest, Some(rreq), off, len, s.buf.clone())
                    }
                    SendPhase::Spec { off, .. } if off > 0 && off < s.buf.len => {
                        (s.dest, None, off, s.buf.len, s.buf.clone())
                    }
                    _ => {
                        self.streams.swap_remove(i);
                        continue;
                    }
                },
                _ => {
                    self.streams.swap_remove(i);
                    continue;
                }
            };
            let chunk = am.chunk(dest);
            while off < len {
                let n = (len - off).min(chunk);
                let mut h = match rreq {
                    Some(r) => {
                        let mut h = Hdr::new(H_DATA);
                        h.u64(r);
                        h
                    }
                    None => {
                        let mut h = Hdr::new(H_SDATA);
                        h.u64(id);
                        h
                    }
                };
                h.u64(off as u64);
                let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
                buf.pieces(off, n, &mut pieces);
                match self.send_req_pieces(p, am, id, dest, &h, &pieces) {
                    Ok(SendOutcome::Sent) => {
                        off += n;
                        sent += 1;
                    }
                    Ok(SendOutcome::Busy) => break,
                    Err(e) => {
                        // The stream cannot go on: its send fails (and with it the peer, whose
                        // receive would otherwise wait for the rest).
                        self.finish(id, Err(e.clone()));
                        am.fail_peer(dest, &failure_reason(&e));
                        break;
                    }
                }
            }
            let mut finished = false;
            if let Some(Req {
                kind: Kind::Send(s),
                ..
            }) = self.reqs.get_mut(id)
            {
                match &mut s.phase {
                    SendPhase::Stream { off: o, .. } => {
                        *o = off;
                        finished = off >= len;
                    }
                    SendPhase::Spec { off: o, acked } => {
                        *o = off;
                        // Written, but the buffer is still needed if a CTS comes instead.
                        finished = off >= len && *acked;
                    }
                    _ => {}
                }
            }
            if finished {
                let tag = match self.reqs.get(id) {
                    Some(Req {
                        kind: Kind::Send(s),
                        ..
                    }) => s.tag,
                    _ => 0,
                };
                self.finish(id, Ok(status(dest, tag, len)));
            }
            if off >= len {
                self.streams.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(sent)
    }

    /// Take `len` bytes of eager credit towards `dest`, if its window has room.
    #[inline]
    fn eager_credit(&mut self, dest: Rank, len: usize) -> bool {
        let out = &mut self.eager_out[dest as usize];
        let cost = len + EAGER_OVERHEAD;
        if *out + cost > self.eager_window {
            return false;
        }
        *out += cost;
        true
    }

    /// An eager message of `len` bytes from `src` was matched: return the credit once half a
    /// window has gathered (one small message per half window).
    #[inline(always)]
    pub(super) fn eager_consumed(&mut self, am: &mut AmState, src: Rank, len: usize) {
        let got = &mut self.eager_in[src as usize];
        *got += len + EAGER_OVERHEAD;
        if *got >= self.eager_window / 2 {
            self.return_credit(am, src);
        }
    }

    /// Half a window gathered from `src`: give it back.
    #[cold]
    #[inline(never)]
    pub(crate) fn return_credit(&mut self, am: &mut AmState, src: Rank) {
        let got = &mut self.eager_in[src as usize];
        let mut h = Hdr::new(H_CREDIT);
        h.u64(*got as u64);
        *got = 0;
        am.push_ctrl(src, h);
    }

    pub(super) fn on_credit(&mut self, am: &mut AmState, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let n = usize::try_from(rd.u64()?).ok()?;
        let out = &mut self.eager_out[src as usize];
        if n > *out {
            am.malformed(src, "credit for more eager bytes than were sent");
            return Some(());
        }
        *out -= n;
        Some(())
    }
}

impl P2pState {
    /// Issue the RMA writes of write-rendezvous sends whose receiver sent its `WCTS`. A buffer
    /// of more pieces than one write takes streams `DATA` instead (the receiver takes both).
    pub(super) fn issue_writes<P: Provider>(&mut self, p: &mut P, am: &mut AmState) -> usize {
        let mut n = 0;
        let max_iov = am.caps.rma.map_or(0, |r| r.max_iov);
        for id in std::mem::take(&mut self.writes) {
            let Some(Req {
                kind: Kind::Send(s),
                done: None,
                ..
            }) = self.reqs.get_mut(id)
            else {
                continue;
            };
            let SendPhase::Writing {
                rreq,
                len,
                remote,
                issued: false,
            } = s.phase
            else {
                continue;
            };
            let dest = s.dest;
            let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
            s.buf.pieces(0, len, &mut pieces);
            if pieces.len() > max_iov {
                s.phase = SendPhase::Stream { rreq, off: 0, len };
                self.streams.push(id);
                self.work = true;
                continue;
            }
            let span = s.buf.span();
            match self.describe(p, am, id, span, Access::LOCAL) {
                Ok(d) => pieces.iter_mut().for_each(|x| x.desc = d),
                Err(e) => {
                    self.write_failed(am, id, dest, rreq, e);
                    continue;
                }
            }
            // SAFETY: the pieces lie in the buffer send request `id` borrows. The write counts
            // as a piece in flight (set just below, before anything can end the request), so
            // the request neither ends nor is quarantined without ending the process until the
            // provider reports this token.
            match unsafe { p.rma_write(dest, &pieces, remote, Completion::cq(id)) } {
                Ok(()) => {
                    if let Some(Req {
                        kind: Kind::Send(s),
                        ..
                    }) = self.reqs.get_mut(id)
                    {
                        s.flags += 1;
                        s.phase = SendPhase::Writing {
                            rreq,
                            len,
                            remote,
                            issued: true,
                        };
                    }
                    n += 1;
                }
                Err(e) => self.write_failed(am, id, dest, rreq, e),
            }
        }
        n
    }

    /// The write of send `id` could not be posted: the send fails with `e`, and the receiver
    /// learns it (`WFIN` with no length) instead of waiting.
    fn write_failed(&mut self, am: &mut AmState, id: ReqId, dest: Rank, rreq: u64, e: Error) {
        let mut f = Hdr::new(H_WFIN);
        f.u64(rreq).u64(WFIN_FAILED);
        am.push_ctrl(dest, f);
        self.finish(id, Err(e));
    }

    /// Send `h` with `pieces` of send request `id`'s buffer: zero-copy (`am_isend`, counted in
    /// the request's `inflight` until the provider reports it) where the provider offers it
    /// towards `dest` and the payload is above its inject size, else buffered.
    #[inline]
    fn send_req_pieces<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        id: ReqId,
        dest: Rank,
        h: &Hdr,
        pieces: &[RawIov],
    ) -> Result<SendOutcome> {
        let len: usize = pieces.iter().map(|x| x.len).sum();
        if !zcopy(am, dest, len) || pieces.len() > am.caps.max_iov {
            return am.send_pieces(p, dest, h.bytes(), pieces);
        }
        let mut described: SmallVec<[RawIov; 8]> = SmallVec::from_slice(pieces);
        if am.caps.mr_local {
            let span = match self.reqs.get(id) {
                Some(Req {
                    kind: Kind::Send(s),
                    ..
                }) => s.buf.span(),
                _ => return Ok(SendOutcome::Sent),
            };
            let d = self.describe(p, am, id, span, Access::LOCAL)?;
            described.iter_mut().for_each(|x| x.desc = d);
        }
        // SAFETY: the pieces lie in the buffer send request `id` borrows; the request cannot
        // end (nor be quarantined without ending the process) while `inflight > 0`, which
        // drops only when the provider reports the token.
        let o = unsafe { p.am_isend(dest, h.bytes(), &described, id)? };
        if o == SendOutcome::Sent {
            if let Some(Req {
                kind: Kind::Send(s),
                ..
            }) = self.reqs.get_mut(id)
            {
                // 2^31 - 1 pieces in flight at most (far beyond any provider's queue).
                debug_assert!(s.inflight() < !SendReq::SYNC);
                s.flags += 1;
            }
        }
        Ok(o)
    }
}

/// Does a `len`-byte payload to `dest` go zero-copy?
#[inline]
fn zcopy(am: &AmState, dest: Rank, len: usize) -> bool {
    am.caps.am_isend && len > am.caps.inject_size && am.narrow(dest).is_none_or(|n| n.am_isend)
}

/// Try to hand a message with the packed bytes of `buf` as payload to the provider now.
#[inline]
fn send_now<P: Provider>(
    p: &mut P,
    am: &mut AmState,
    dest: Rank,
    h: &Hdr,
    buf: &SendBuf,
) -> Result<SendOutcome> {
    if let Some(data) = buf.contig_bytes() {
        // One piece: no iovec vectors.
        return p.am_send(dest, h.bytes(), &[IoSlice::new(data)]);
    }
    let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
    buf.pieces(0, buf.len, &mut pieces);
    am.send_pieces(p, dest, h.bytes(), &pieces)
}

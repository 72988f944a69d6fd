//! Handlers of the eager and rendezvous messages (`EAGER`, `RTS`, `CTS`, `DATA`, `FIN`,
//! `SACK`). Each reads its fixed fields and returns `None` if they do not parse; anything that
//! contradicts the protocol fails the sending peer through `AmState::malformed`.

use super::{
    parse_plain_eager, recv_result, status, Kind, P2pState, RecvPhase, Req, SendPhase, Unexp,
    F_REMOTE, F_SYNC, H_SACK, WFIN_FAILED,
};
use crate::am::{AmState, Hdr, Rd};
use crate::provider::RemoteAddr;
use crate::types::Rank;

impl P2pState {
    #[inline]
    pub(super) fn on_eager(
        &mut self,
        am: &mut AmState,
        src: Rank,
        rd: &mut Rd<'_>,
        payload: &[u8],
    ) -> Option<()> {
        let flags = rd.u8()?;
        let ctx = rd.u32()?;
        let tag = rd.u32()? as i32;
        let sreq = if flags & F_SYNC != 0 {
            Some(rd.u64()?)
        } else {
            None
        };
        self.eager_arrived(am, src, ctx, tag, sreq, payload);
        Some(())
    }

    /// The lean arrival path: a plain (not synchronous) `EAGER` header, `kind` included, from
    /// a rank inside the world whose payload is within the provider's limit, parsed here from
    /// its fixed layout without the generic admission and dispatch. `false` if `header` is not
    /// such a header (the caller takes the general path).
    #[inline]
    pub(crate) fn on_plain_eager(
        &mut self,
        am: &mut AmState,
        src: Rank,
        header: &[u8],
        payload: &[u8],
    ) -> bool {
        let Some((ctx, tag)) = parse_plain_eager(header) else {
            return false;
        };
        if !am.admits_plain(src, payload.len()) {
            return false;
        }
        // With nothing posted in the matcher, the slot is all a message can match first.
        if self.matcher.posted_len() == 0 && self.eager_into_slot(am, src, ctx, tag, None, payload)
        {
            return true;
        }
        self.eager_arrived(am, src, ctx, tag, None, payload);
        true
    }

    /// An eager message `(ctx, tag)` from `src`: into the receive it matches, or queued as
    /// unexpected. `sreq`: the sender's request of a synchronous send, acknowledged at match.
    #[inline]
    fn eager_arrived(
        &mut self,
        am: &mut AmState,
        src: Rank,
        ctx: u32,
        tag: i32,
        sreq: Option<u64>,
        payload: &[u8],
    ) {
        let posted = if self.matcher.posted_len() == 0 {
            None
        } else {
            self.matcher.take_posted(ctx, src, tag)
        };
        if let Some(id) = posted {
            let no_wkeys = self.wkeys.is_empty();
            if let Some(Req {
                kind: Kind::Recv(r),
                done,
                ..
            }) = self.reqs.get_mut(id)
            {
                let n = payload.len().min(r.buf.cap);
                r.buf.write(0, &payload[..n]);
                let res = recv_result(status(src, tag, payload.len()), r.buf.cap);
                if no_wkeys && done.is_none() {
                    // A posted receive without a write key: done here (what `finish` does).
                    *done = Some(res);
                } else {
                    self.finish(id, res);
                }
            }
            self.eager_matched(am, src, payload.len(), sreq);
        } else if !self.eager_into_slot(am, src, ctx, tag, sreq, payload) {
            let mut data = am.spare_buf();
            data.extend_from_slice(payload);
            self.unexpected_bytes += data.len();
            self.matcher
                .add_unexpected(ctx, src, tag, Unexp::Eager { data, sreq });
        }
    }

    /// An eager message of `len` bytes from `src` was matched: its credit goes back to the
    /// sender's account, and a synchronous send (`sreq`) is acknowledged. (Always inline: out
    /// of line it cost the lean receive path nine instructions.)
    #[inline(always)]
    pub(super) fn eager_matched(
        &mut self,
        am: &mut AmState,
        src: Rank,
        len: usize,
        sreq: Option<u64>,
    ) {
        self.eager_consumed(am, src, len);
        if let Some(s) = sreq {
            let mut h = Hdr::new(H_SACK);
            h.u64(s);
            am.push_ctrl(src, h);
        }
    }

    pub(super) fn on_rts(&mut self, am: &mut AmState, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let flags = rd.u8()?;
        let ctx = rd.u32()?;
        let tag = rd.u32()? as i32;
        let total = usize::try_from(rd.u64()?).ok()?;
        let sreq = rd.u64()?;
        let remote = if flags & F_REMOTE != 0 {
            Some(RemoteAddr {
                addr: rd.u64()?,
                key: rd.u64()?,
            })
        } else {
            None
        };
        let id = self
            .matcher
            .take_posted(ctx, src, tag)
            .or_else(|| self.slot_for_match(ctx, src, tag));
        if let Some(id) = id {
            self.start_rndv(am, id, src, tag, total, sreq, remote);
        } else {
            self.matcher.add_unexpected(
                ctx,
                src,
                tag,
                Unexp::Rts {
                    total,
                    sreq,
                    remote,
                },
            );
        }
        Some(())
    }

    pub(super) fn on_cts(&mut self, am: &mut AmState, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let sreq = rd.u64()?;
        let rreq = rd.u64()?;
        let len = usize::try_from(rd.u64()?).ok()?;
        let Some(Req {
            kind: Kind::Send(s),
            done: None,
            ..
        }) = self.reqs.get_mut(sreq)
        else {
            am.stale(src, sreq, "CTS");
            return Some(());
        };
        if s.dest != src
            || !matches!(
                s.phase,
                SendPhase::WaitCts | SendPhase::WaitFin | SendPhase::Spec { .. }
            )
            || len > s.buf.len
        {
            am.malformed(src, "CTS does not fit its send");
            return Some(());
        }
        let tag = s.tag;
        if let Some(m) = s.mr.take() {
            self.deregs.push(*m);
            self.work = true;
        }
        // A speculative send still pumping `SDATA` is in `streams` already; it switches to
        // `DATA` (the receiver dropped what it got before its receive matched).
        let streaming =
            matches!(s.phase, SendPhase::Spec { off, .. } if off > 0 && off < s.buf.len);
        if len == 0 {
            self.finish(sreq, Ok(status(src, tag, 0)));
        } else {
            s.phase = SendPhase::Stream { rreq, off: 0, len };
            if !streaming {
                self.streams.push(sreq);
                self.work = true;
            }
        }
        Some(())
    }

    /// `WCTS`: the receiver registered its buffer for our write. Towards a peer we can write
    /// to, the send writes `len` bytes there; otherwise (or if this send was speculating) it
    /// streams `DATA` as after a `CTS`, which the receiver takes as well.
    pub(super) fn on_wcts(&mut self, am: &mut AmState, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let sreq = rd.u64()?;
        let rreq = rd.u64()?;
        let len = usize::try_from(rd.u64()?).ok()?;
        let remote = RemoteAddr {
            addr: rd.u64()?,
            key: rd.u64()?,
        };
        let write = self.rma_write && am.narrow(src).is_none_or(|n| n.rma_write);
        let Some(Req {
            kind: Kind::Send(s),
            done: None,
            ..
        }) = self.reqs.get_mut(sreq)
        else {
            am.stale(src, sreq, "WCTS");
            return Some(());
        };
        if s.dest != src
            || !matches!(
                s.phase,
                SendPhase::WaitCts | SendPhase::WaitFin | SendPhase::Spec { .. }
            )
            || len > s.buf.len
            || len == 0
        {
            am.malformed(src, "WCTS does not fit its send");
            return Some(());
        }
        if let Some(m) = s.mr.take() {
            self.deregs.push(*m);
            self.work = true;
        }
        let streaming =
            matches!(s.phase, SendPhase::Spec { off, .. } if off > 0 && off < s.buf.len);
        if write && matches!(s.phase, SendPhase::WaitCts | SendPhase::WaitFin) {
            s.phase = SendPhase::Writing {
                rreq,
                len,
                remote,
                issued: false,
            };
            self.writes.push(sreq);
            self.work = true;
        } else {
            s.phase = SendPhase::Stream { rreq, off: 0, len };
            if !streaming {
                self.streams.push(sreq);
                self.work = true;
            }
        }
        Some(())
    }

    /// `WFIN`: the sender's write of `len` bytes into receive `rreq` is complete (or failed).
    pub(super) fn on_wfin(&mut self, am: &mut AmState, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let rreq = rd.u64()?;
        let len = rd.u64()?;
        let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get(rreq)
        else {
            am.stale(src, rreq, "WFIN");
            return Some(());
        };
        let RecvPhase::Stream {
            got,
            expect,
            src: from,
            ..
        } = r.phase
        else {
            am.malformed(src, "WFIN for a receive that is not waiting for a write");
            return Some(());
        };
        if from != src {
            am.malformed(src, "WFIN from the wrong peer");
            return Some(());
        }
        if len == WFIN_FAILED {
            let e = crate::Error::from(crate::ErrorDetail::RemoteAccess {
                rank: src,
                what: "its RMA write into this receive failed".into(),
            });
            self.finish(rreq, Err(e));
            return Some(());
        }
        match usize::try_from(len) {
            Ok(n) if n <= expect - got => self.data_arrived(rreq, src, n),
            _ => am.malformed(src, "WFIN beyond the announced length"),
        }
        Some(())
    }

    pub(super) fn on_data(
        &mut self,
        am: &mut AmState,
        src: Rank,
        rd: &mut Rd<'_>,
        payload: &[u8],
    ) -> Option<()> {
        let rreq = rd.u64()?;
        let off = usize::try_from(rd.u64()?).ok()?;
        let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get_mut(rreq)
        else {
            am.stale(src, rreq, "DATA");
            return Some(());
        };
        let RecvPhase::Stream {
            expect, src: from, ..
        } = &r.phase
        else {
            am.malformed(src, "DATA for a receive that is not streaming");
            return Some(());
        };
        if *from != src || off.checked_add(payload.len()).is_none_or(|e| e > *expect) {
            am.malformed(src, "DATA outside the announced range");
            return Some(());
        }
        if *expect >= self.nt_copy_min {
            r.buf.write_nt(off, payload);
        } else {
            r.buf.write(off, payload);
        }
        self.data_arrived(rreq, src, payload.len());
        Some(())
    }

    /// `k` more bytes of streaming receive `rreq` are in its buffer (copied by `on_data` or
    /// placed by the provider); finish it when all have arrived.
    #[inline]
    pub(super) fn data_arrived(&mut self, rreq: u64, src: Rank, k: usize) {
        let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get_mut(rreq)
        else {
            self.spec_done(rreq);
            return;
        };
        let RecvPhase::Stream {
            got,
            expect,
            total,
            tag,
            ..
        } = &mut r.phase
        else {
            return;
        };
        *got += k;
        if *got >= *expect {
            let st = status(src, *tag, *total);
            let cap = r.buf.cap;
            self.finish(rreq, recv_result(st, cap));
            self.spec_done(rreq);
        }
    }

    pub(super) fn on_fin(&mut self, am: &mut AmState, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let sreq = rd.u64()?;
        let Some(Req {
            kind: Kind::Send(s),
            done: None,
            ..
        }) = self.reqs.get_mut(sreq)
        else {
            am.stale(src, sreq, "FIN");
            return Some(());
        };
        if s.dest != src {
            am.malformed(src, "FIN from the wrong peer");
            return Some(());
        }
        if let Some(m) = s.mr.take() {
            self.deregs.push(*m);
            self.work = true;
        }
        let (tag, len) = (s.tag, s.buf.len);
        self.finish(sreq, Ok(status(src, tag, len)));
        Some(())
    }

    #[inline]
    pub(super) fn on_sack(&mut self, am: &mut AmState, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let sreq = rd.u64()?;
        match self.reqs.get_mut(sreq) {
            Some(Req {
                kind: Kind::Send(s),
                done: None,
                ..
            }) if s.dest == src => {
                let (tag, len) = (s.tag, s.buf.len);
                match &mut s.phase {
                    // Speculative: matched; done once all of it is written.
                    SendPhase::Spec { off, acked } if *off < len => *acked = true,
                    _ => self.finish(sreq, Ok(status(src, tag, len))),
                }
            }
            _ => am.stale(src, sreq, "SACK"),
        }
        Some(())
    }
}

//! Speculative rendezvous (`SPEC`, `SDATA`) and direct placement: where a provider that reads
//! payloads off a stream may write `DATA`/`SPEC`/`SDATA` bytes straight into the matched
//! receive buffer instead of staging them.

use super::buf::Layout;
use super::{Kind, P2pState, RecvPhase, Req, Staged, Unexp, H_DATA, H_SACK, H_SDATA, H_SPEC};
use crate::am::{AmState, Hdr, Rd, ReqId};
use crate::types::Rank;

impl P2pState {
    /// A speculative message from `src` announces itself: match it now (data follows), stage
    /// it within the budget, or keep only the announcement, as an unexpected `RTS` (its data is
    /// dropped and a `CTS` asks for it again when a receive matches).
    pub(super) fn on_spec(
        &mut self,
        am: &mut AmState,
        src: Rank,
        rd: &mut Rd<'_>,
        payload: &[u8],
    ) -> Option<()> {
        let _flags = rd.u8()?;
        let ctx = rd.u32()?;
        let tag = rd.u32()? as i32;
        let total = usize::try_from(rd.u64()?).ok()?;
        let sreq = rd.u64()?;
        // Already matched when the provider asked where to place this payload.
        if self.spec_rreq(src, sreq).is_none() && !self.spec_match(am, src, ctx, tag, total, sreq) {
            if self.spec_staged_bytes.saturating_add(total) <= self.spec_buffer {
                self.spec_staged_bytes += total;
                let data = self.staging_buf(total);
                self.spec_staged.push(Staged {
                    src,
                    sreq,
                    total,
                    data,
                });
                self.matcher
                    .add_unexpected(ctx, src, tag, Unexp::Spec { total, sreq });
                spec_ack(am, src, sreq);
            } else {
                // Over the budget: like an RTS, the data is asked for when a receive matches.
                let rts = Unexp::Rts {
                    total,
                    sreq,
                    remote: None,
                };
                self.matcher.add_unexpected(ctx, src, tag, rts);
                return Some(());
            }
        }
        self.spec_data(src, sreq, 0, payload);
        Some(())
    }

    /// Match speculative message `sreq` from `src` to a posted receive, which its data then
    /// fills; `false` if none is posted.
    fn spec_match(
        &mut self,
        am: &mut AmState,
        src: Rank,
        ctx: u32,
        tag: i32,
        total: usize,
        sreq: u64,
    ) -> bool {
        let Some(id) = self
            .matcher
            .take_posted(ctx, src, tag)
            .or_else(|| self.slot_for_match(ctx, src, tag))
        else {
            return false;
        };
        if let Some(Req {
            kind: Kind::Recv(r),
            ..
        }) = self.reqs.get_mut(id)
        {
            r.phase = RecvPhase::Stream {
                got: 0,
                expect: total.min(r.buf.cap),
                total,
                src,
                tag,
            };
        }
        self.spec_rx.push((src, sreq, id));
        spec_ack(am, src, sreq);
        true
    }

    /// Bytes `[off, off + payload.len())` of speculative message `sreq` from `src`: into its
    /// receive if it matched (clipped to the receive's length), into its staging buffer if it
    /// was staged, else dropped.
    fn spec_data(&mut self, src: Rank, sreq: u64, off: usize, payload: &[u8]) {
        let Some(rreq) = self.spec_rreq(src, sreq) else {
            // Staged (the stream delivers in order: `off` is what it holds), or dropped.
            if let Some(st) = self
                .spec_staged
                .iter_mut()
                .find(|e| e.src == src && e.sreq == sreq)
            {
                let room = st.total - st.data.len();
                if off == st.data.len() && payload.len() <= room {
                    st.data.extend_from_slice(payload);
                } else {
                    tracing::warn!(peer = src, "speculative data out of order or too long");
                }
            }
            return;
        };
        let mut k = 0;
        if let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get_mut(rreq)
        {
            if let RecvPhase::Stream { expect, .. } = r.phase {
                k = payload.len().min(expect.saturating_sub(off));
                if expect >= self.nt_copy_min {
                    r.buf.write_nt(off, &payload[..k]);
                } else {
                    r.buf.write(off, &payload[..k]);
                }
            }
        }
        // Finishes the receive when everything expected is in (also when that is nothing).
        self.data_arrived(rreq, src, k);
    }

    pub(super) fn on_sdata(
        &mut self,
        _am: &mut AmState,
        src: Rank,
        rd: &mut Rd<'_>,
        payload: &[u8],
    ) -> Option<()> {
        let sreq = rd.u64()?;
        let off = usize::try_from(rd.u64()?).ok()?;
        self.spec_data(src, sreq, off, payload);
        Some(())
    }

    /// Receive `rreq` needs no more speculative data (what still comes for it is dropped).
    pub(super) fn spec_done(&mut self, rreq: ReqId) {
        if !self.spec_rx.is_empty() {
            self.spec_rx.retain(|e| e.2 != rreq);
        }
    }

    /// The receive matched to speculative message `sreq` from `src`, while data is due.
    fn spec_rreq(&self, src: Rank, sreq: u64) -> Option<ReqId> {
        self.spec_rx
            .iter()
            .find(|e| e.0 == src && e.1 == sreq)
            .map(|e| e.2)
    }

    /// An empty buffer for `total` bytes of staged speculative data, reusing one a received
    /// staged message gave back: whether a speculative message finds its receive posted is a
    /// matter of timing, and a loaded machine would otherwise allocate one per message.
    fn staging_buf(&mut self, total: usize) -> Vec<u8> {
        let mut v = match self
            .staging_spare
            .iter()
            .position(|b| b.capacity() >= total)
        {
            Some(i) => self.staging_spare.swap_remove(i),
            None => self.staging_spare.pop().unwrap_or_default(),
        };
        v.clear();
        v.reserve(total);
        v
    }

    /// Keep a staging buffer for reuse (a few, together within `WEFT_SPEC_BUFFER`).
    pub(super) fn staging_give(&mut self, v: Vec<u8>) {
        let kept: usize = self.staging_spare.iter().map(Vec::capacity).sum();
        if self.staging_spare.len() < 4 && kept + v.capacity() <= self.spec_buffer {
            self.staging_spare.push(v);
        }
    }

    // ---------------------------------------------------------------------- direct placement

    /// For direct placement of a DATA payload: the streaming receive that bytes `[poff,
    /// poff + n)` of this DATA message's payload belong to, and their offset in its buffer;
    /// `None` when that is not a contiguous receive still expecting exactly those bytes.
    fn data_slot(&self, src: Rank, header: &[u8], poff: usize, n: usize) -> Option<(u64, usize)> {
        let mut rd = Rd::new(header);
        let (rreq, off) = match rd.u8()? {
            H_DATA => (rd.u64()?, usize::try_from(rd.u64()?).ok()?),
            H_SPEC => {
                rd.bytes(1 + 4 + 4 + 8)?;
                (self.spec_rreq(src, rd.u64()?)?, 0)
            }
            H_SDATA => {
                let sreq = rd.u64()?;
                (self.spec_rreq(src, sreq)?, usize::try_from(rd.u64()?).ok()?)
            }
            _ => return None,
        };
        let off = off.checked_add(poff)?;
        let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get(rreq)
        else {
            return None;
        };
        let RecvPhase::Stream {
            expect, src: from, ..
        } = &r.phase
        else {
            return None;
        };
        let fits = off.checked_add(n).is_some_and(|e| e <= *expect);
        (*from == src && fits && matches!(r.buf.layout, Layout::Contig)).then_some((rreq, off))
    }

    /// `Sink::am_target` for our messages: where bytes `[off, off + n)` of this message's
    /// payload go, if straight into a receive buffer.
    pub(crate) fn am_target(
        &mut self,
        am: &mut AmState,
        src: Rank,
        header: &[u8],
        off: usize,
        n: usize,
    ) -> Option<std::ptr::NonNull<u8>> {
        if off == 0 && header.first() == Some(&H_SPEC) {
            // Match now so the payload can go straight into the receive. Unmatched: `None`,
            // and `am` delivers the frame, which queues the announcement and drops the data.
            let mut rd = Rd::new(&header[1..]);
            let (_, ctx, tag, total, sreq) = (rd.u8()?, rd.u32()?, rd.u32()?, rd.u64()?, rd.u64()?);
            let total = usize::try_from(total).ok()?;
            if self.spec_rreq(src, sreq).is_none()
                && !self.spec_match(am, src, ctx, tag as i32, total, sreq)
            {
                return None;
            }
        }
        let (rreq, at) = self.data_slot(src, header, off, n)?;
        let Kind::Recv(r) = &self.reqs.get(rreq)?.kind else {
            return None;
        };
        // SAFETY: `data_slot` checked at + n <= expect <= cap, the length of the buffer the
        // receive borrows for its scope; the request stays live until its bytes are all placed
        // or its peer fails, and the provider writes before its next call into this sink.
        std::ptr::NonNull::new(unsafe { r.buf.base.add(at) })
    }

    /// `Sink::am_placed` for our messages.
    pub(crate) fn am_placed(
        &mut self,
        am: &mut AmState,
        src: Rank,
        header: &[u8],
        off: usize,
        k: usize,
    ) {
        match self.data_slot(src, header, off, k) {
            Some((rreq, _)) => self.data_arrived(rreq, src, k),
            None => am.malformed(src, "placed DATA outside a streaming receive"),
        }
    }
}

/// Tell the sender of speculative message `sreq` that its data is taken (matched or staged).
fn spec_ack(am: &mut AmState, src: Rank, sreq: u64) {
    let mut h = Hdr::new(H_SACK);
    h.u64(sreq);
    am.push_ctrl(src, h);
}

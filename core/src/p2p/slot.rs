//! The lean receive path: a blocking receive posted without a request.
//!
//! `Comm::recv` of a contiguous buffer that no unexpected message matches arms the *slot*
//! instead of building a request in the slab and a node in the matching structures. A plain
//! eager message that arrives for it is copied into the buffer by the arrival handler and the
//! slot holds the result; the wait takes it from there. The slot is the newest posted receive
//! (everything in the matcher was posted before it), so an arrival consults the matcher first
//! and the slot second, and MPI's order holds.
//!
//! Anything the slot cannot do itself turns it into an ordinary request first (*demotion*):
//! another receive being posted (so that the order of postings stays the matcher's to keep),
//! a rendezvous or speculative message that matches it, a peer failing. From then on the
//! receive is a request like any other, and its wait, quarantine and failure rules apply.
//!
//! Soundness: the slot holds a raw pointer into the caller's buffer only while it is armed,
//! and it is armed only inside `Engine::recv_now`, which every path leaves with the slot
//! disarmed (done, demoted into a request the engine waits for or quarantines, or cleared) —
//! a panic unwinding out of the wait included (the engine's own `SlotGuard` withdraws the slot
//! in its drop) — while `Comm::recv` holds the buffer's unique borrow for the whole call.
//! (Nothing can leak that borrow midway: the guard never leaves `recv_now`, so no caller can
//! forget it.) An arrival writes into the buffer only from a progress call inside that wait,
//! while the slot is armed.

use super::{
    parse_plain_eager, recv_result, status, Kind, P2pState, RecvBuf, RecvPhase, RecvReq, Req,
    EAGER_OVERHEAD,
};
use crate::am::{AmState, ReqId};
use crate::matching::PostedHandle;
use crate::p2p::Layout;
use crate::types::Rank;
use crate::{Result, Status};

/// The posting of one blocking receive.
pub(crate) struct Armed {
    ctx: u32,
    src: Option<Rank>,
    tag: Option<i32>,
    base: *mut u8,
    cap: usize,
}

impl Armed {
    #[inline]
    fn matches(&self, ctx: u32, src: Rank, tag: i32) -> bool {
        self.ctx == ctx && self.src.is_none_or(|s| s == src) && self.tag.is_none_or(|t| t == tag)
    }

    fn buf(&self) -> RecvBuf {
        RecvBuf {
            base: self.base,
            cap: self.cap,
            layout: Layout::Contig,
            shared: false,
        }
    }
}

/// What [`P2pState::slot_arrival`] did with a message.
pub(crate) enum Leaf {
    /// Not its case: nothing was changed; the general arrival takes the message.
    No,
    /// Taken into the slot.
    Taken,
    /// Taken, and half the eager window from this peer is now consumed: its credit is due.
    CreditDue,
}

/// Where the blocking receive stands.
#[derive(Default)]
pub(crate) enum Slot {
    #[default]
    Idle,
    Armed(Armed),
    /// Matched by an eager message: the receive's result (data already in the buffer).
    Done(Result<Status>),
    /// Became request `.0`.
    Demoted(ReqId),
}

impl P2pState {
    /// Can a blocking receive of `(ctx, src, tag)` take the lean path? Not when an unexpected
    /// message matches it (the general path takes that one) nor when another one is armed.
    #[inline]
    pub(crate) fn slot_usable(&self, ctx: u32, src: Option<Rank>, tag: Option<i32>) -> bool {
        matches!(self.slot, Slot::Idle)
            && (self.matcher.unexpected_len() == 0
                || self.matcher.peek_unexpected(ctx, src, tag).is_none())
    }

    /// Post a blocking receive into `base[..cap]` as the slot.
    ///
    /// # Safety
    /// `base..base + cap` must stay valid for writes, and not be accessed otherwise, until the
    /// slot is disarmed (`take_slot` returns something other than `Slot::Armed`).
    #[inline]
    pub(crate) unsafe fn arm(
        &mut self,
        ctx: u32,
        src: Option<Rank>,
        tag: Option<i32>,
        base: *mut u8,
        cap: usize,
    ) {
        debug_assert!(matches!(self.slot, Slot::Idle));
        // The slot is idle (`slot_usable`), so there is nothing to drop: `forget` spares the
        // drop test an assignment would make (at worst it would leak a result, never free one).
        std::mem::forget(std::mem::replace(
            &mut self.slot,
            Slot::Armed(Armed {
                ctx,
                src,
                tag,
                base,
                cap,
            }),
        ));
    }

    /// Is the slot still waiting for its message?
    #[inline]
    pub(crate) fn slot_armed(&self) -> bool {
        matches!(self.slot, Slot::Armed(_))
    }

    /// Nothing is in the slot: no receive armed, no outcome or demoted request left in it.
    #[inline]
    pub(crate) fn slot_idle(&self) -> bool {
        matches!(self.slot, Slot::Idle)
    }

    /// The slot's state, leaving it idle. A receive still armed is thereby withdrawn: nothing
    /// refers to its buffer afterwards.
    #[inline]
    pub(crate) fn take_slot(&mut self) -> Slot {
        std::mem::take(&mut self.slot)
    }

    /// A plain or synchronous eager message that no posted request took: into the slot if it
    /// matches. `false` if it does not. (Always inline: it is the lean arrival's last step.)
    #[inline(always)]
    pub(super) fn eager_into_slot(
        &mut self,
        am: &mut AmState,
        src: Rank,
        ctx: u32,
        tag: i32,
        sreq: Option<u64>,
        payload: &[u8],
    ) -> bool {
        let Slot::Armed(a) = &self.slot else {
            return false;
        };
        if !a.matches(ctx, src, tag) {
            return false;
        }
        let n = payload.len().min(a.cap);
        // SAFETY: `arm`'s contract: the buffer is valid for `cap` bytes while armed (`n` is at
        // most `cap`), which `recv_now` guarantees by withdrawing the slot on every way out —
        // a timeout, a failed peer, a panic (its guard is its own, not the caller's to leak);
        // `payload` (provider or unexpected memory) cannot overlap the caller's buffer, so the
        // slice is the only reference to those bytes while it lives.
        let dst = unsafe { std::slice::from_raw_parts_mut(a.base, n) };
        weft_provider::bytes::copy_small(dst, &payload[..n]);
        self.slot = Slot::Done(recv_result(status(src, tag, payload.len()), a.cap));
        self.slot_done += 1;
        self.eager_matched(am, src, payload.len(), sreq);
        true
    }

    /// The arrival that needs no call: a plain eager message of at most 16 bytes, nothing
    /// posted in the matcher (so nothing older than the slot can match it), matching the armed
    /// slot and fitting its buffer. Changes nothing unless it takes the message; everything
    /// else is [`Leaf::No`], for the general arrival (which repeats these checks). Kept free of
    /// calls, so that the arrival handler around it needs no stack frame on this path.
    #[inline(always)]
    pub(crate) fn slot_arrival(
        &mut self,
        am: &AmState,
        src: Rank,
        header: &[u8],
        payload: &[u8],
    ) -> Leaf {
        // First what tells a receive waiting in the slot from one posted as a request.
        if self.matcher.posted_len() != 0 {
            return Leaf::No;
        }
        let Slot::Armed(a) = &self.slot else {
            return Leaf::No;
        };
        let Some((ctx, tag)) = parse_plain_eager(header) else {
            return Leaf::No;
        };
        let n = payload.len();
        if n > 16 || !am.admits_plain(src, n) {
            return Leaf::No;
        }
        if !a.matches(ctx, src, tag) || n > a.cap || src as usize >= self.eager_in.len() {
            return Leaf::No;
        }
        let base = a.base;
        // The slot first, while it is known to hold `Armed` (no drop of an old outcome).
        self.slot = Slot::Done(Ok(status(src, tag, n)));
        self.slot_done += 1;
        // SAFETY: as in `eager_into_slot`: the buffer the slot was armed with is valid for `cap`
        // bytes (`n` is at most `cap`) until `recv_now` takes the outcome, which it cannot do
        // before this returns; the payload cannot overlap it.
        let dst = unsafe { std::slice::from_raw_parts_mut(base, n) };
        weft_provider::bytes::copy_small(dst, payload);
        let got = &mut self.eager_in[src as usize];
        *got += n + EAGER_OVERHEAD;
        if *got >= self.eager_window / 2 {
            Leaf::CreditDue
        } else {
            Leaf::Taken
        }
    }

    /// A message other than an eager one matched nothing in the matcher: the slot's request if
    /// the slot matches it (the slot becomes that request, already matched, not posted).
    pub(super) fn slot_for_match(&mut self, ctx: u32, src: Rank, tag: i32) -> Option<ReqId> {
        let Slot::Armed(a) = &self.slot else {
            return None;
        };
        if !a.matches(ctx, src, tag) {
            return None;
        }
        let req = RecvReq {
            src: a.src,
            buf: a.buf(),
            phase: RecvPhase::Posted(PostedHandle::dangling()),
        };
        let id = self.reqs.insert(Req::new(0, Kind::Recv(req)));
        self.slot = Slot::Demoted(id);
        self.slot_demoted += 1;
        Some(id)
    }

    /// Turn an armed slot into a request posted in the matcher (it keeps its place: it was the
    /// newest posted receive, and becomes the matcher's last).
    pub(crate) fn demote_slot(&mut self) {
        let Slot::Armed(a) = std::mem::take(&mut self.slot) else {
            return;
        };
        let matcher = &mut self.matcher;
        let id = self.reqs.insert_with(|id| {
            let h = matcher.post(a.ctx, a.src, a.tag, id);
            Req::new(
                0,
                Kind::Recv(RecvReq {
                    src: a.src,
                    buf: a.buf(),
                    phase: RecvPhase::Posted(h),
                }),
            )
        });
        self.slot = Slot::Demoted(id);
        self.slot_demoted += 1;
    }

    /// Blocking receives completed in the slot, and slots that became requests.
    pub(crate) fn slot_counts(&self) -> (u64, u64) {
        (self.slot_done, self.slot_demoted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_matches_as_a_posted_receive_would() {
        let a = Armed {
            ctx: 4,
            src: Some(1),
            tag: None,
            base: std::ptr::null_mut(),
            cap: 0,
        };
        assert!(a.matches(4, 1, 7));
        assert!(!a.matches(4, 2, 7), "another source");
        assert!(!a.matches(6, 1, 7), "another context");
        let b = Armed {
            ctx: 4,
            src: None,
            tag: Some(3),
            base: std::ptr::null_mut(),
            cap: 0,
        };
        assert!(b.matches(4, 9, 3));
        assert!(!b.matches(4, 9, 4), "another tag");
    }
}

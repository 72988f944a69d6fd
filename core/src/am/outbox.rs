//! The outbox: messages waiting for the provider, one FIFO per destination.
//!
//! Handlers never call the provider (they run inside its `progress`); what they need sent goes
//! here and is flushed, in per-destination order, once `progress` returns. A provider that
//! answers `Busy` blocks only its destination's queue.

use super::{AmState, Hdr, ReqId};
use crate::provider::{Provider, RawIov, SendOutcome};
use crate::types::Rank;
use crate::{Error, ErrorDetail, ErrorKind, Result};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::io::IoSlice;

/// A queued message.
pub(crate) enum Out {
    Ctrl(Hdr),
    /// Header and an owned payload (RMA replies, aggregated batches).
    Owned(Hdr, Vec<u8>),
    /// Header and a payload in memory that stays valid until the message is sent: RMA origin
    /// buffers, borrowed by their epoch, which drains the outbox before it ends; and window
    /// memory that a GET reply is read from as the outbox drains (so a large get costs no
    /// copy of the window at the target). Whoever ends that validity first turns the
    /// payloads into copies ([`AmState::own_raw_payloads`], [`AmState::own_raw_to`]).
    Raw(Hdr, RawIov),
    /// A message a protocol builds from its request when its turn comes (an eager send
    /// queued behind others, the first frame of a speculative send): see [`Deferred`].
    Req(ReqId),
}

/// A protocol whose requests queue messages as [`Out::Req`]: it sends them when they reach
/// the head of their queue.
pub(crate) trait Deferred<P: Provider> {
    /// Try to hand request `id`'s message for `dest` to the provider (a request that finished
    /// meanwhile has nothing to send: `Sent`).
    fn send_deferred(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        dest: Rank,
        id: ReqId,
    ) -> Result<SendOutcome>;
    /// The provider refused request `id`'s message with `e` (not a peer failure): the request
    /// fails.
    fn deferred_failed(&mut self, id: ReqId, e: Error);
}

/// Per-destination queues, and the destinations with something queued.
pub(crate) struct Outbox {
    q: Vec<VecDeque<Out>>,
    pending: Vec<Rank>,
    flag: Vec<bool>,
}

impl Outbox {
    pub(crate) fn new(size: u32) -> Self {
        Outbox {
            q: (0..size).map(|_| VecDeque::new()).collect(),
            pending: Vec::new(),
            flag: vec![false; size as usize],
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, dest: Rank, o: Out) {
        self.q[dest as usize].push_back(o);
        if !self.flag[dest as usize] {
            self.flag[dest as usize] = true;
            self.pending.push(dest);
        }
    }

    /// Nothing queued for any destination.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Nothing queued for `dest`.
    #[inline]
    pub(crate) fn is_empty_to(&self, dest: Rank) -> bool {
        self.q[dest as usize].is_empty()
    }

    /// Take everything queued for `dest` (which failed).
    #[inline]
    pub(crate) fn drop_queue(&mut self, dest: Rank) -> VecDeque<Out> {
        std::mem::take(&mut self.q[dest as usize])
    }

    /// Bytes of payload copies waiting (diagnostics).
    pub(crate) fn queued_copies(&self) -> usize {
        self.q
            .iter()
            .flatten()
            .map(|o| match o {
                Out::Owned(_, d) => d.len(),
                _ => 0,
            })
            .sum()
    }
}

impl AmState {
    /// Turn every queued message whose payload points into user or window memory (`Out::Raw`)
    /// into one that owns a copy: before an epoch gives up its buffers, and before a window
    /// goes away.
    pub(crate) fn own_raw_payloads(&mut self) {
        for d in 0..self.size {
            self.own_raw_to(d);
        }
    }

    /// Like `own_raw_payloads`, for the messages queued to `dest` only: before `dest`'s access
    /// epoch on one of our windows ends (UNLOCK, COMPLETE), the GET replies still queued for it
    /// must hold the data the window had during the epoch.
    pub(crate) fn own_raw_to(&mut self, dest: Rank) {
        let Some(q) = self.out.q.get_mut(dest as usize) else {
            return;
        };
        for o in q.iter_mut() {
            if let Out::Raw(h, r) = o {
                // Pooled buffers: a batch that carries a get and its epoch's end does this
                // every epoch (they return to the pool once sent).
                let mut data = self.spare.take();
                // SAFETY: see `Out::Raw`: the memory is valid until the message is sent or
                // this conversion runs, whichever comes first.
                data.extend_from_slice(unsafe { raw_slice(r) });
                *o = Out::Owned(*h, data);
            }
        }
    }

    /// Send queued messages in per-destination order; `client` builds the [`Out::Req`] ones.
    ///
    /// A send the provider refuses with an error fails what it belongs to, never the queue: a
    /// user's message fails its request; a protocol message (a reply, a handshake), whose loss
    /// would leave this rank or the peer waiting, fails the peer. Either way the queue moves on.
    pub(crate) fn flush<P: Provider>(&mut self, p: &mut P, client: &mut impl Deferred<P>) -> usize {
        let mut sent = 0;
        let mut i = 0;
        while i < self.out.pending.len() {
            let dest = self.out.pending[i];
            if self.touch(p, dest).is_err() {
                // Failed now: its queue was dropped.
                self.out.flag[dest as usize] = false;
                self.out.pending.swap_remove(i);
                continue;
            }
            let mut blocked = false;
            while let Some(item) = self.out.q[dest as usize].front() {
                let tried = match item {
                    Out::Ctrl(h) => {
                        let h = *h;
                        p.am_send(dest, h.bytes(), &[])
                    }
                    Out::Owned(h, data) => p.am_send(dest, h.bytes(), &[IoSlice::new(data)]),
                    Out::Raw(h, r) => {
                        // SAFETY: see `Out::Raw`: the memory outlives the queued message.
                        let data = unsafe { raw_slice(r) };
                        p.am_send(dest, h.bytes(), &[IoSlice::new(data)])
                    }
                    Out::Req(id) => {
                        let id = *id;
                        client.send_deferred(p, self, dest, id)
                    }
                };
                let outcome = match tried {
                    Ok(o) => o,
                    Err(e) => {
                        self.send_failed(dest, e, client);
                        if self.out.q[dest as usize].is_empty() {
                            break;
                        }
                        continue;
                    }
                };
                if outcome == SendOutcome::Busy {
                    blocked = true;
                    break;
                }
                if let Some(Out::Owned(_, data)) = self.out.q[dest as usize].pop_front() {
                    self.spare.give(data);
                }
                sent += 1;
            }
            if blocked {
                i += 1;
            } else {
                self.out.flag[dest as usize] = false;
                self.out.pending.swap_remove(i);
            }
        }
        sent
    }

    /// The provider refused the message at the head of `dest`'s queue with `e`: drop it and
    /// fail what it belongs to (see `flush`).
    fn send_failed<P: Provider>(&mut self, dest: Rank, e: Error, client: &mut impl Deferred<P>) {
        let Some(item) = self.out.q[dest as usize].pop_front() else {
            return;
        };
        match item {
            Out::Req(id) if e.kind() != ErrorKind::PeerFailed => {
                tracing::debug!(peer = dest, "a send failed: {e}");
                client.deferred_failed(id, e);
            }
            other => {
                if let Out::Owned(_, data) = other {
                    self.spare.give(data);
                }
                let why = failure_reason(&e);
                self.fail_peer(dest, &why);
            }
        }
    }

    /// Send `hdr` with `pieces` as payload, packed into scratch space when there are more
    /// pieces than the provider takes.
    #[inline]
    pub(crate) fn send_pieces<P: Provider>(
        &mut self,
        p: &mut P,
        dest: Rank,
        hdr: &[u8],
        pieces: &[RawIov],
    ) -> Result<SendOutcome> {
        let max_iov = self.caps.max_iov;
        if pieces.len() <= max_iov && pieces.len() <= 8 {
            let mut iov: SmallVec<[IoSlice<'_>; 8]> = SmallVec::new();
            for pc in pieces {
                // SAFETY: each piece lies within a buffer borrowed by a live request (or is
                // empty).
                iov.push(IoSlice::new(unsafe { raw_slice(pc) }));
            }
            return p.am_send(dest, hdr, &iov);
        }
        if pieces.len() <= max_iov {
            let iov: Vec<IoSlice<'_>> = pieces
                .iter()
                // SAFETY: as above.
                .map(|pc| IoSlice::new(unsafe { raw_slice(pc) }))
                .collect();
            return p.am_send(dest, hdr, &iov);
        }
        self.scratch.clear();
        for pc in pieces {
            // SAFETY: as above.
            self.scratch.extend_from_slice(unsafe { raw_slice(pc) });
        }
        p.am_send(dest, hdr, &[IoSlice::new(&self.scratch)])
    }
}

/// The reason to record when sending to a peer failed with `e`.
pub(crate) fn failure_reason(e: &Error) -> String {
    match e.detail() {
        ErrorDetail::PeerFailed { reason, .. } => reason.clone(),
        _ => format!("sending to it failed: {e}"),
    }
}

/// # Safety
/// `pc` must describe readable memory that stays valid for the returned lifetime.
#[inline]
pub(crate) unsafe fn raw_slice<'a>(pc: &RawIov) -> &'a [u8] {
    if pc.len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(pc.ptr, pc.len)
    }
}

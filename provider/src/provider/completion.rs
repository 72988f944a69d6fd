//! Completions: tokens and counters, what completed, and the outcome of a buffered send.

use super::Sink;
use crate::types::Rank;
use crate::{Error, Result};

/// Identifies an operation whose completion a provider reports later through [`Sink::complete`].
pub type Token = u64;

/// A completion counter opened with [`Provider::cntr_open`] (never 0).
pub type CntrId = u64;

/// Where an RMA or atomic operation reports that it finished: a completion-queue entry
/// ([`Sink::complete`] with the token), an increment of a counter, or both. The core asks for a
/// counter only from providers whose [`super::Caps::counters`] is set; MPICH-OFI's bulk
/// completion of window operations (counters) and request completion (CQ entries) in one type.
///
/// What "finished" means is the provider's declared [`super::CompletionLevel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion {
    /// Report through `Sink::complete(token, ..)`.
    pub cq: Option<Token>,
    /// Increment this counter (its success or its error count).
    pub cntr: Option<CntrId>,
    /// Ordering (`FI_FENCE`, `IBV_SEND_FENCE`): the operation starts only once every RMA and
    /// atomic operation posted earlier to the same target has completed there. Asked only of
    /// providers whose [`super::RmaCaps::fence`] is set.
    pub fence: bool,
}

impl Completion {
    /// A completion-queue entry only.
    pub const fn cq(token: Token) -> Self {
        Completion {
            cq: Some(token),
            cntr: None,
            fence: false,
        }
    }

    /// A counter increment only.
    pub const fn cntr(c: CntrId) -> Self {
        Completion {
            cq: None,
            cntr: Some(c),
            fence: false,
        }
    }

    /// The same, ordered after every earlier operation to the target (see [`Completion::fence`]).
    pub const fn fenced(self) -> Self {
        Completion {
            fence: true,
            ..self
        }
    }
}

/// The value of a completion counter: operations that finished, and those that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CntrValue {
    pub ok: u64,
    pub err: u64,
}

impl CntrValue {
    /// Every operation counted, successful or not.
    pub fn total(&self) -> u64 {
        self.ok + self.err
    }
}

/// Counters and completion entries for a provider whose operations finish when they are
/// issued (memory copies, CPU atomics): `finish` records an outcome where [`Completion`] says;
/// `progress` hands the CQ entries to the sink with [`CompletionTable::deliver`].
#[derive(Debug, Default)]
pub struct CompletionTable {
    counters: Vec<Option<CntrValue>>,
    cq: Vec<(Token, Result<Completed>)>,
}

impl CompletionTable {
    /// Open a counter.
    pub fn open(&mut self) -> CntrId {
        let i = match self.counters.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.counters.push(None);
                self.counters.len() - 1
            }
        };
        self.counters[i] = Some(CntrValue::default());
        i as CntrId + 1
    }

    fn slot(&mut self, c: CntrId) -> Result<&mut CntrValue> {
        c.checked_sub(1)
            .and_then(|i| self.counters.get_mut(i as usize))
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::invalid(format!("no open completion counter {c}")))
    }

    /// Read a counter.
    pub fn read(&mut self, c: CntrId) -> Result<CntrValue> {
        self.slot(c).map(|v| *v)
    }

    /// Close a counter.
    pub fn close(&mut self, c: CntrId) -> Result<()> {
        self.slot(c)?;
        self.counters[c as usize - 1] = None;
        Ok(())
    }

    /// Record that an operation finished with `r`.
    pub fn finish(&mut self, done: Completion, r: Result<()>) {
        if let Some(c) = done.cntr {
            if let Ok(v) = self.slot(c) {
                if r.is_ok() {
                    v.ok += 1;
                } else {
                    v.err += 1;
                }
            }
        }
        if let Some(t) = done.cq {
            self.cq.push((t, r.map(|_| Completed::Done)));
        }
    }

    /// Pending CQ entries, for a provider's own completions.
    pub fn push(&mut self, t: Token, r: Result<Completed>) {
        self.cq.push((t, r));
    }

    /// Deliver every pending CQ entry; returns how many.
    ///
    /// Inlined for the empty case, which every idle progress call of a provider meets: a
    /// length test instead of a call that builds and drops a `Drain` (measured at 15 % of a
    /// polling shm rank's samples).
    #[inline]
    pub fn deliver(&mut self, sink: &mut dyn Sink) -> usize {
        if self.cq.is_empty() {
            return 0;
        }
        self.deliver_all(sink)
    }

    #[inline(never)]
    fn deliver_all(&mut self, sink: &mut dyn Sink) -> usize {
        let n = self.cq.len();
        for (t, r) in self.cq.drain(..) {
            sink.complete(t, r);
        }
        n
    }
}

/// Result of a buffered active-message send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOutcome {
    /// The provider took the message; header and payload may be reused.
    Sent,
    /// No resources now (ring full, socket buffer full); nothing was taken. Retry after progress.
    Busy,
}

/// Status of a natively matched tagged receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaggedStatus {
    /// World rank of the sender.
    pub source: Rank,
    pub tag: i32,
    /// Length of the message as sent (may exceed the receive buffer: then it was truncated).
    pub bytes: usize,
}

/// What completed, reported through [`Sink::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completed {
    /// A send, RMA or atomic operation finished.
    Done,
    /// A tagged receive matched and its data is in place.
    Received(TaggedStatus),
    /// A tagged receive was cancelled before it matched.
    Cancelled,
}

/// A change in a provider's connection to a peer, reported through [`Sink::connection`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnEvent {
    /// A connection to the peer is established (after [`super::Provider::connect`], or because
    /// the peer connected first).
    Connected,
    /// The peer's channels changed (a faster path came up or went away): its
    /// [`super::Provider::peer_caps`] may differ now.
    CapsChanged,
}

//! Per-peer order, without I/O: sequence numbers on the sending side ([`Sequencer`]) and, on
//! the receiving side, one that overtook its predecessors held back ([`Reorder`], [`Holding`])
//! until the gap is filled. For a provider whose messages to one peer can arrive out of the
//! order they were sent in: several channels to one peer (hybrid's UD-SR and RC, paper 001's
//! "generalized framework to re-order messages from all message channels"), a fabric that does
//! not order completions (ofi), or two paths of one channel (verbs-rc's eager ring beside its
//! send/receive frames). Held messages are copies (the channel's receive buffer goes back to
//! its pool), which only happens around a change of path; in the steady state every message
//! arrives in order and is delivered in place.
//!
//! Sequence numbers are 32-bit and wrap. A message more than [`Bounds::window`] ahead of the
//! next expected one, or behind it (a duplicate: the channels below are reliable and deliver
//! once), is a protocol violation by the peer. So is holding more than
//! [`Bounds::per_peer`] messages or [`Bounds::per_peer_bytes`] of one peer, or more than
//! [`Bounds::total_bytes`] of all peers together: what overtook a gap is bounded by what the
//! channels can have in flight, and a peer that skips a number (or never sends it) cannot pin
//! the receiver's memory; the provider fails it instead ([`Holding::forget`]).

use std::collections::hash_map::{Entry, HashMap};

/// What a receiver holds at most, and how far ahead a message may be. Each provider states its
/// own from what its channels can have in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// How far ahead of the next expected message one may arrive.
    pub window: u32,
    /// Messages of one peer held at most.
    pub per_peer: u32,
    /// Bytes of one peer's held messages at most.
    pub per_peer_bytes: usize,
    /// Bytes held at most for all peers together; the peer whose message would go past it fails.
    pub total_bytes: usize,
}

impl Default for Bounds {
    /// A sender never has more than 2^20 messages to one peer in flight across its channels;
    /// 2^14 held of one peer, 64 MiB of one peer, 512 MiB in all.
    fn default() -> Self {
        Bounds {
            window: 1 << 20,
            per_peer: 1 << 14,
            per_peer_bytes: 64 << 20,
            total_bytes: 512 << 20,
        }
    }
}

/// The sending side: the next sequence number towards one peer.
#[derive(Debug, Default, Clone)]
pub struct Sequencer {
    next: u32,
}

impl Sequencer {
    /// Start from `seq` (tests: the behaviour across a wrap).
    pub fn starting_at(seq: u32) -> Self {
        Sequencer { next: seq }
    }

    /// The number the next message will carry.
    pub fn peek(&self) -> u32 {
        self.next
    }

    /// The number of the next message, which is then taken.
    pub fn take(&mut self) -> u32 {
        let s = self.next;
        self.next = self.next.wrapping_add(1);
        s
    }
}

/// What became of an arriving message.
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival {
    /// It is the next expected one: deliver it now, then [`Reorder::pop`] until `None` (it may
    /// have filled a gap).
    Deliver,
    /// It overtook others and is held (copied) until they arrive.
    Held,
}

/// A message from the peer that breaks the protocol.
#[derive(Debug, PartialEq, Eq)]
pub enum OrderError {
    /// Behind the next expected number or already held: delivered twice.
    Duplicate { seq: u32, expected: u32 },
    /// Further ahead than the window.
    TooFarAhead {
        seq: u32,
        expected: u32,
        window: u32,
    },
    /// Holding it would go past one of the [`Bounds`]: `held` messages of `bytes` bytes of this
    /// peer wait for `expected`.
    TooMuchHeld {
        expected: u32,
        held: u32,
        bytes: usize,
    },
}

impl std::fmt::Display for OrderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OrderError::Duplicate { seq, expected } => {
                write!(f, "message {seq} arrived twice (expecting {expected})")
            }
            OrderError::TooFarAhead {
                seq,
                expected,
                window,
            } => {
                write!(f, "message {seq} is more than {window} ahead of {expected}")
            }
            OrderError::TooMuchHeld {
                expected,
                held,
                bytes,
            } => write!(
                f,
                "{held} messages ({bytes} bytes) wait for message {expected}, which never \
                 came: more than the channels can have in flight"
            ),
        }
    }
}

/// The receiving side towards one peer: the next expected number, 4 bytes (a job has one of
/// these per peer). The messages that overtook others wait in the process's [`Holding`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Reorder {
    expected: u32,
}

/// The messages that overtook others, of every peer, by (peer, number): messages are held only
/// around a change of channel, so a peer whose messages always come in order costs nothing here.
#[derive(Debug)]
pub struct Holding<T> {
    map: HashMap<(u32, u32), (T, usize)>,
    /// Per peer with messages held: how many, and their bytes.
    per: HashMap<u32, (u32, usize)>,
    /// Bytes held, all peers together.
    bytes: usize,
    /// The most messages held at once (statistics).
    max: usize,
    bounds: Bounds,
}

impl<T> Default for Holding<T> {
    /// Within the [`Bounds::default`] bounds.
    fn default() -> Self {
        Holding::new(Bounds::default())
    }
}

impl<T> Holding<T> {
    /// Nothing held yet; what is held and how far ahead a message may be within `bounds`.
    pub fn new(bounds: Bounds) -> Self {
        Holding {
            map: HashMap::new(),
            per: HashMap::new(),
            bytes: 0,
            max: 0,
            bounds,
        }
    }

    /// The bounds it holds within.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// Messages held now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The most messages held at once so far, all peers together (statistics).
    pub fn max(&self) -> usize {
        self.max
    }

    /// Drop what is held from `src` (a failed peer: the gap will never be filled).
    pub fn forget(&mut self, src: u32) {
        self.map.retain(|&(r, _), _| r != src);
        if let Some((_, b)) = self.per.remove(&src) {
            self.bytes -= b;
        }
    }

    /// Bytes of the maps' tables (the messages' own copies not counted).
    pub fn bytes(&self) -> usize {
        self.map.capacity() * std::mem::size_of::<((u32, u32), (T, usize))>()
            + self.per.capacity() * std::mem::size_of::<(u32, (u32, usize))>()
    }

    /// Bytes of the messages held (as their senders counted them at [`Reorder::arrive`]).
    pub fn held_bytes(&self) -> usize {
        self.bytes
    }
}

impl Reorder {
    /// Distance of `seq` ahead of the next expected number (0: it is the one), or why a
    /// message numbered so breaks the protocol (behind: a duplicate; more than `window` ahead).
    /// Nothing changes: for a path that leaves a message where it lies until its turn (an
    /// eager ring), with [`Reorder::advance`] once it is delivered.
    #[inline]
    pub fn check(&self, seq: u32, window: u32) -> Result<u32, OrderError> {
        let d = seq.wrapping_sub(self.expected);
        if d >= u32::MAX / 2 {
            return Err(OrderError::Duplicate {
                seq,
                expected: self.expected,
            });
        }
        if d >= window {
            return Err(OrderError::TooFarAhead {
                seq,
                expected: self.expected,
                window,
            });
        }
        Ok(d)
    }

    /// The expected message was delivered without [`Reorder::arrive`] (after a
    /// [`Reorder::check`] of 0).
    #[inline]
    pub fn advance(&mut self) {
        self.expected = self.expected.wrapping_add(1);
    }

    /// A message numbered `seq` of `len` bytes arrived from `src` (whose record this is).
    /// `hold` makes the owned copy kept in `held` when it overtook others (called only then,
    /// and only within the bounds).
    #[inline]
    pub fn arrive<T>(
        &mut self,
        held: &mut Holding<T>,
        src: u32,
        seq: u32,
        len: usize,
        hold: impl FnOnce() -> T,
    ) -> Result<Arrival, OrderError> {
        let bounds = held.bounds;
        if self.check(seq, bounds.window)? == 0 {
            self.expected = self.expected.wrapping_add(1);
            return Ok(Arrival::Deliver);
        }
        let (n, b) = held.per.get(&src).copied().unwrap_or((0, 0));
        if n + 1 > bounds.per_peer
            || b + len > bounds.per_peer_bytes
            || held.bytes + len > bounds.total_bytes
        {
            return Err(OrderError::TooMuchHeld {
                expected: self.expected,
                held: n,
                bytes: b,
            });
        }
        match held.map.entry((src, seq)) {
            Entry::Occupied(_) => Err(OrderError::Duplicate {
                seq,
                expected: self.expected,
            }),
            Entry::Vacant(v) => {
                v.insert((hold(), len));
                held.per.insert(src, (n + 1, b + len));
                held.bytes += len;
                held.max = held.max.max(held.map.len());
                Ok(Arrival::Held)
            }
        }
    }

    /// `src`'s next held message, if it is now the expected one.
    #[inline]
    pub fn pop<T>(&mut self, held: &mut Holding<T>, src: u32) -> Option<T> {
        if held.map.is_empty() {
            return None;
        }
        let (m, len) = held.map.remove(&(src, self.expected))?;
        self.expected = self.expected.wrapping_add(1);
        held.bytes -= len;
        if let Entry::Occupied(mut e) = held.per.entry(src) {
            let (n, b) = e.get_mut();
            *n -= 1;
            *b -= len;
            if *n == 0 {
                e.remove();
            }
        }
        Some(m)
    }

    /// The next expected number.
    pub fn expected(&self) -> u32 {
        self.expected
    }

    /// Start from `seq` (tests: the behaviour across a wrap).
    pub fn starting_at(seq: u32) -> Self {
        Reorder { expected: seq }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const WINDOW: u32 = 1 << 20;
    const HOLD_PEER: u32 = 1 << 14;
    const HOLD_PEER_BYTES: usize = 64 << 20;

    /// Deliver `order` (a permutation of message numbers from `start`) and return what the
    /// receiver handed on, in order.
    fn run(start: u32, order: &[u32]) -> Vec<u32> {
        let mut r = Reorder::starting_at(start);
        let mut held = Holding::default();
        let mut out = vec![];
        for &s in order {
            match r.arrive(&mut held, 3, s, 1, || s).unwrap() {
                Arrival::Deliver => {
                    out.push(s);
                    while let Some(m) = r.pop(&mut held, 3) {
                        out.push(m);
                    }
                }
                Arrival::Held => {}
            }
        }
        assert!(held.is_empty());
        out
    }

    #[test]
    fn a_peer_costs_4_bytes() {
        assert_eq!(std::mem::size_of::<Reorder>(), 4);
    }

    #[test]
    fn in_order_is_delivered_in_place() {
        let mut r = Reorder::default();
        let mut held = Holding::<u32>::default();
        for s in 0..100 {
            assert_eq!(
                r.arrive(&mut held, 0, s, 1, || unreachable!()).unwrap(),
                Arrival::Deliver
            );
            assert_eq!(r.pop(&mut held, 0), None);
        }
        assert_eq!(held.max(), 0);
        assert_eq!(held.bytes(), 0);
    }

    /// Peers' held messages do not mix: each waits for its own peer's gap.
    #[test]
    fn peers_hold_apart() {
        let (mut a, mut b) = (Reorder::default(), Reorder::default());
        let mut held = Holding::default();
        assert_eq!(a.arrive(&mut held, 1, 1, 1, || "a1"), Ok(Arrival::Held));
        assert_eq!(b.arrive(&mut held, 2, 1, 1, || "b1"), Ok(Arrival::Held));
        assert_eq!(b.arrive(&mut held, 2, 2, 1, || "b2"), Ok(Arrival::Held));
        assert_eq!(held.max(), 3);
        assert_eq!(a.arrive(&mut held, 1, 0, 1, || "a0"), Ok(Arrival::Deliver));
        assert_eq!(a.pop(&mut held, 1), Some("a1"));
        assert_eq!(a.pop(&mut held, 1), None);
        assert_eq!(held.len(), 2);
        held.forget(2);
        assert!(held.is_empty());
        assert_eq!(b.arrive(&mut held, 2, 0, 1, || "b0"), Ok(Arrival::Deliver));
        assert_eq!(b.pop(&mut held, 2), None);
    }

    #[test]
    fn a_message_that_overtook_waits_for_the_gap() {
        // Two on UD-SR, the third over a new RC connection arrives first.
        assert_eq!(run(0, &[2, 0, 1]), vec![0, 1, 2]);
        assert_eq!(run(0, &[3, 2, 1, 0, 4]), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn across_the_wrap() {
        let s = u32::MAX - 2;
        let order = [s.wrapping_add(4), s, s.wrapping_add(3), s + 2, s + 1];
        let want: Vec<u32> = (0..5).map(|i| s.wrapping_add(i)).collect();
        assert_eq!(run(s, &order), want);
    }

    #[test]
    fn duplicates_and_runaways_are_errors() {
        let mut r = Reorder::default();
        let mut h = Holding::default();
        r.arrive(&mut h, 0, 0, 1, || ()).unwrap();
        assert_eq!(
            r.arrive(&mut h, 0, 0, 1, || ()),
            Err(OrderError::Duplicate {
                seq: 0,
                expected: 1
            })
        );
        assert_eq!(r.arrive(&mut h, 0, 5, 1, || ()), Ok(Arrival::Held));
        assert!(matches!(
            r.arrive(&mut h, 0, 5, 1, || ()),
            Err(OrderError::Duplicate { .. })
        ));
        assert!(matches!(
            r.arrive(&mut h, 0, 1 + WINDOW, 1, || ()),
            Err(OrderError::TooFarAhead { .. })
        ));
        assert!(r.arrive(&mut h, 0, WINDOW, 1, || ()).is_ok());
    }

    /// A provider's own bounds are the ones held to (ofi's and verbs-rc's are smaller than
    /// hybrid's): the window, the count and bytes of one peer, the bytes of all.
    #[test]
    fn a_provider_s_own_bounds_hold() {
        let b = Bounds {
            window: 8,
            per_peer: 3,
            per_peer_bytes: 100,
            total_bytes: 150,
        };
        let mut h = Holding::new(b);
        assert_eq!(h.bounds(), b);
        let mut r = Reorder::default();
        assert!(matches!(
            r.arrive(&mut h, 0, 8, 1, || ()),
            Err(OrderError::TooFarAhead { window: 8, .. })
        ));
        for s in 1..=3 {
            assert_eq!(r.arrive(&mut h, 0, s, 10, || ()), Ok(Arrival::Held));
        }
        assert!(matches!(
            r.arrive(&mut h, 0, 4, 10, || ()),
            Err(OrderError::TooMuchHeld {
                held: 3,
                bytes: 30,
                ..
            })
        ));
        let mut r1 = Reorder::default();
        assert!(
            r1.arrive(&mut h, 1, 1, 101, || ()).is_err(),
            "bytes of one peer"
        );
        assert!(r1.arrive(&mut h, 1, 1, 100, || ()).is_ok());
        let mut r2 = Reorder::default();
        assert!(
            r2.arrive(&mut h, 2, 1, 21, || ()).is_err(),
            "bytes of all: 130 held"
        );
        assert!(r2.arrive(&mut h, 2, 1, 20, || ()).is_ok());
        // check/advance: a path that leaves the message where it lies until its turn.
        let mut q = Reorder::starting_at(u32::MAX);
        assert_eq!(q.check(u32::MAX, 8), Ok(0));
        assert_eq!(q.check(1, 8), Ok(2));
        q.advance();
        assert_eq!(q.expected(), 0);
        assert!(matches!(
            q.check(u32::MAX, 8),
            Err(OrderError::Duplicate { .. })
        ));
        let mut s = Sequencer::starting_at(u32::MAX);
        assert_eq!((s.peek(), s.take(), s.take()), (u32::MAX, u32::MAX, 0));
    }

    #[test]
    fn sequencer_wraps() {
        let mut s = Sequencer { next: u32::MAX };
        assert_eq!(s.take(), u32::MAX);
        assert_eq!(s.take(), 0);
    }

    proptest! {
        /// Two channels, each in order by itself, merged in any interleaving (what the hybrid
        /// provider's receiver sees): delivered exactly once, in send order, from any start.
        #[test]
        fn any_interleaving_of_ordered_channels(
            start in any::<u32>(),
            lane in prop::collection::vec(any::<bool>(), 1..300),
            pick in prop::collection::vec(any::<bool>(), 600),
        ) {
            let n = lane.len() as u32;
            let (mut a, mut b): (Vec<u32>, Vec<u32>) = (vec![], vec![]);
            for (i, &l) in lane.iter().enumerate() {
                let s = start.wrapping_add(i as u32);
                if l { a.push(s) } else { b.push(s) }
            }
            let (mut ia, mut ib, mut order) = (0, 0, vec![]);
            for &p in &pick {
                if p && ia < a.len() { order.push(a[ia]); ia += 1 }
                else if ib < b.len() { order.push(b[ib]); ib += 1 }
            }
            order.extend(&a[ia..]);
            order.extend(&b[ib..]);
            let want: Vec<u32> = (0..n).map(|i| start.wrapping_add(i)).collect();
            prop_assert_eq!(run(start, &order), want);
        }
    }

    /// A peer that skips a number cannot pin the receiver's memory: it may have at most
    /// `per_peer` messages and `per_peer_bytes` held, all peers `total_bytes`; past that the
    /// message is refused (the provider fails the peer) and nothing more is copied. Before
    /// these bounds a peer that skipped 0 could have 2^20 messages of any size held.
    #[test]
    fn what_is_held_is_bounded_per_peer_and_in_all() {
        let mut r = Reorder::default();
        let mut h = Holding::<()>::default();
        for s in 1..=HOLD_PEER {
            assert_eq!(r.arrive(&mut h, 0, s, 1, || ()), Ok(Arrival::Held));
        }
        let e = r.arrive(&mut h, 0, HOLD_PEER + 1, 1, || unreachable!());
        assert!(matches!(e, Err(OrderError::TooMuchHeld { held, .. }) if held == HOLD_PEER));
        // Bytes of one peer.
        let mut r1 = Reorder::default();
        assert!(r1.arrive(&mut h, 1, 1, HOLD_PEER_BYTES, || ()).is_ok());
        assert!(r1.arrive(&mut h, 1, 2, 1, || unreachable!()).is_err());
        // Bytes of all peers together: seven more peers of 64 MiB fill the 512 MiB.
        for p in 2..8 {
            let mut rp = Reorder::default();
            assert!(
                rp.arrive(&mut h, p, 1, HOLD_PEER_BYTES, || ()).is_ok(),
                "peer {p}"
            );
        }
        let mut r9 = Reorder::default();
        assert!(r9
            .arrive(&mut h, 9, 1, HOLD_PEER_BYTES, || unreachable!())
            .is_err());
        // A failed peer's messages are forgotten, bytes and all; the gap filled, they go.
        let before = h.held_bytes();
        h.forget(1);
        assert_eq!(h.held_bytes(), before - HOLD_PEER_BYTES);
        assert_eq!(r.arrive(&mut h, 0, 0, 1, || ()), Ok(Arrival::Deliver));
        let mut n = 0;
        while r.pop(&mut h, 0).is_some() {
            n += 1;
        }
        assert_eq!(n, HOLD_PEER);
        assert!(r9.arrive(&mut h, 9, 1, HOLD_PEER_BYTES, || ()).is_ok());
    }
}

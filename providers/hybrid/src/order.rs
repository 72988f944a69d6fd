//! Order across channels, without I/O (paper 001's "generalized framework to re-order messages
//! from all message channels").
//!
//! Each channel keeps its own order (RC by the wire, UD-SR by the reliability engine), but two
//! messages to one peer that take different channels — a small one over UD-SR, then a medium
//! one over a freshly opened RC-SR — may arrive the other way round. The core needs the
//! messages of one source in send order, so every active message of the hybrid provider
//! carries a per-peer sequence number ([`Sequencer`]) and the receiver holds back one that
//! overtook its predecessors ([`Reorder`]) until the gap is filled. Held messages are copied
//! (the channel's receive buffer goes back to its pool), which only happens around a change
//! of channel; in the steady state every message arrives in order and is delivered in place.
//!
//! Sequence numbers are 32-bit and wrap; a message more than [`WINDOW`] ahead of the next
//! expected one, or behind it (a duplicate: every channel below is reliable and delivers once),
//! is a protocol violation by the peer. So is holding more than [`HOLD_PEER`] messages or
//! [`HOLD_PEER_BYTES`] of one peer, or more than [`HOLD_BYTES`] of all peers together: what
//! overtook a gap is bounded by what the channels can have in flight, and a peer that skips a
//! number (or never sends it) cannot pin the receiver's memory; it is failed instead.

use std::collections::hash_map::{Entry, HashMap};

/// How far ahead of the next expected message one may arrive. A sender never has more than
/// this many messages to one peer in flight across its channels (each channel's own window is
/// far smaller).
pub const WINDOW: u32 = 1 << 20;
/// Messages of one peer held at most (every channel's window together is far smaller).
pub const HOLD_PEER: u32 = 1 << 14;
/// Bytes of one peer's held messages at most.
pub const HOLD_PEER_BYTES: usize = 64 << 20;
/// Bytes held at most for all peers together; the peer whose message would go past it fails.
pub const HOLD_BYTES: usize = 512 << 20;

/// The sending side: the next sequence number towards one peer.
#[derive(Debug, Default, Clone)]
pub struct Sequencer {
    next: u32,
}

impl Sequencer {
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
    /// Further ahead than [`WINDOW`].
    TooFarAhead { seq: u32, expected: u32 },
    /// Holding it would go past [`HOLD_PEER`], [`HOLD_PEER_BYTES`] or [`HOLD_BYTES`]:
    /// `held` messages of `bytes` bytes of this peer wait for `expected`.
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
            OrderError::TooFarAhead { seq, expected } => {
                write!(f, "message {seq} is more than {WINDOW} ahead of {expected}")
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
}

impl<T> Default for Holding<T> {
    fn default() -> Self {
        Holding {
            map: HashMap::new(),
            per: HashMap::new(),
            bytes: 0,
            max: 0,
        }
    }
}

impl<T> Holding<T> {
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
    /// Distance of `seq` ahead of the next expected number (0: it is the one), or an error.
    fn ahead(&self, seq: u32) -> Result<u32, OrderError> {
        let d = seq.wrapping_sub(self.expected);
        if d >= u32::MAX / 2 {
            return Err(OrderError::Duplicate {
                seq,
                expected: self.expected,
            });
        }
        if d >= WINDOW {
            return Err(OrderError::TooFarAhead {
                seq,
                expected: self.expected,
            });
        }
        Ok(d)
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
        if self.ahead(seq)? == 0 {
            self.expected = self.expected.wrapping_add(1);
            return Ok(Arrival::Deliver);
        }
        let (n, b) = held.per.get(&src).copied().unwrap_or((0, 0));
        if n + 1 > HOLD_PEER || b + len > HOLD_PEER_BYTES || held.bytes + len > HOLD_BYTES {
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
    #[cfg(test)]
    fn starting_at(seq: u32) -> Self {
        Reorder { expected: seq }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    /// `HOLD_PEER` messages and `HOLD_PEER_BYTES` held, all peers `HOLD_BYTES`; past that the
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

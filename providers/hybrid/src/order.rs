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
//! is a protocol violation by the peer.

use std::collections::hash_map::{Entry, HashMap};

/// How far ahead of the next expected message one may arrive. A sender never has more than
/// this many messages to one peer in flight across its channels (each channel's own window is
/// far smaller).
pub const WINDOW: u32 = 1 << 20;

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
    map: HashMap<(u32, u32), T>,
    /// The most messages held at once (statistics).
    max: usize,
}

impl<T> Default for Holding<T> {
    fn default() -> Self {
        Holding {
            map: HashMap::new(),
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
    }

    /// Bytes of the map's table (the messages' own copies not counted).
    pub fn bytes(&self) -> usize {
        self.map.capacity() * std::mem::size_of::<((u32, u32), T)>()
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

    /// A message numbered `seq` arrived from `src` (whose record this is). `hold` makes the
    /// owned copy kept in `held` when it overtook others (called only then).
    #[inline]
    pub fn arrive<T>(
        &mut self,
        held: &mut Holding<T>,
        src: u32,
        seq: u32,
        hold: impl FnOnce() -> T,
    ) -> Result<Arrival, OrderError> {
        if self.ahead(seq)? == 0 {
            self.expected = self.expected.wrapping_add(1);
            return Ok(Arrival::Deliver);
        }
        match held.map.entry((src, seq)) {
            Entry::Occupied(_) => Err(OrderError::Duplicate {
                seq,
                expected: self.expected,
            }),
            Entry::Vacant(v) => {
                v.insert(hold());
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
        let m = held.map.remove(&(src, self.expected))?;
        self.expected = self.expected.wrapping_add(1);
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
            match r.arrive(&mut held, 3, s, || s).unwrap() {
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
                r.arrive(&mut held, 0, s, || unreachable!()).unwrap(),
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
        assert_eq!(a.arrive(&mut held, 1, 1, || "a1"), Ok(Arrival::Held));
        assert_eq!(b.arrive(&mut held, 2, 1, || "b1"), Ok(Arrival::Held));
        assert_eq!(b.arrive(&mut held, 2, 2, || "b2"), Ok(Arrival::Held));
        assert_eq!(held.max(), 3);
        assert_eq!(a.arrive(&mut held, 1, 0, || "a0"), Ok(Arrival::Deliver));
        assert_eq!(a.pop(&mut held, 1), Some("a1"));
        assert_eq!(a.pop(&mut held, 1), None);
        assert_eq!(held.len(), 2);
        held.forget(2);
        assert!(held.is_empty());
        assert_eq!(b.arrive(&mut held, 2, 0, || "b0"), Ok(Arrival::Deliver));
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
        r.arrive(&mut h, 0, 0, || ()).unwrap();
        assert_eq!(
            r.arrive(&mut h, 0, 0, || ()),
            Err(OrderError::Duplicate {
                seq: 0,
                expected: 1
            })
        );
        assert_eq!(r.arrive(&mut h, 0, 5, || ()), Ok(Arrival::Held));
        assert!(matches!(
            r.arrive(&mut h, 0, 5, || ()),
            Err(OrderError::Duplicate { .. })
        ));
        assert!(matches!(
            r.arrive(&mut h, 0, 1 + WINDOW, || ()),
            Err(OrderError::TooFarAhead { .. })
        ));
        assert!(r.arrive(&mut h, 0, WINDOW, || ()).is_ok());
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
}

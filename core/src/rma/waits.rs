//! What origins wait for, by token ([`Waits`]).
//!
//! Tokens are handed out in sequence (`am::TOKEN_RMA | n`, n = 1, 2, ...) and most are
//! finished in about the order they were given — a fence epoch's gets, a flush's
//! acknowledgement — so they live in a ring indexed by sequence number: a lookup is a
//! subtraction and a bounds test, an insertion a push, a removal a store (and popping the
//! finished entries at the front). A hash map cost two inserts and two removes of about 80
//! instructions each per get (callgrind, `epoch_mix` on shm: a quarter of an aggregated epoch's
//! instructions went to token bookkeeping). A wait that stays unfinished while `RING_MAX` later
//! ones are given out moves to a map, so one forgotten token never makes the ring grow.

use crate::am::TOKEN_RMA;
use crate::types::Rank;
use hashbrown::HashMap;
use std::collections::VecDeque;

/// Longest the ring gets before its oldest unfinished entry moves to the map.
const RING_MAX: usize = 4096;

/// Waits by token, each with the rank it depends on (failed when that rank dies).
#[derive(Debug)]
pub(crate) struct Waits<W> {
    /// Sequence number of `ring[0]`; `base + ring.len()` is the next one handed out.
    base: u64,
    ring: VecDeque<Option<(W, Rank)>>,
    /// Unfinished waits that fell out of the ring's front, by sequence number.
    old: HashMap<u64, (W, Rank)>,
    /// `RING_MAX`, smaller in tests.
    ring_max: usize,
}

impl<W> Default for Waits<W> {
    fn default() -> Self {
        Waits {
            base: 1,
            ring: VecDeque::new(),
            old: HashMap::new(),
            ring_max: RING_MAX,
        }
    }
}

/// The sequence number inside an RMA token (`None` for anything else, e.g. a peer's garbage).
#[inline]
fn seq(t: u64) -> Option<u64> {
    (t & TOKEN_RMA != 0).then_some(t & !TOKEN_RMA)
}

impl<W> Waits<W> {
    /// Register `w`, which depends on `peer`, under a fresh token.
    pub(crate) fn add(&mut self, w: W, peer: Rank) -> u64 {
        if self.ring.len() >= self.ring_max {
            if let Some(Some(e)) = self.ring.pop_front() {
                self.old.insert(self.base, e);
            }
            self.base += 1;
            self.trim();
        }
        let t = TOKEN_RMA | (self.base + self.ring.len() as u64);
        self.ring.push_back(Some((w, peer)));
        t
    }

    /// Where token `t`'s entry is in the ring, if it is there.
    #[inline]
    fn index(&self, t: u64) -> Option<usize> {
        let i = seq(t)?.checked_sub(self.base)?;
        (i < self.ring.len() as u64).then_some(i as usize)
    }

    #[inline]
    pub(crate) fn get(&self, t: &u64) -> Option<&W> {
        let e = match self.index(*t) {
            Some(i) => self.ring[i].as_ref(),
            None => self.old.get(&seq(*t)?),
        };
        e.map(|(w, _)| w)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, t: &u64) -> Option<&mut W> {
        let e = match self.index(*t) {
            Some(i) => self.ring[i].as_mut(),
            None => self.old.get_mut(&seq(*t)?),
        };
        e.map(|(w, _)| w)
    }

    /// Forget token `t`, returning its wait.
    pub(crate) fn remove(&mut self, t: &u64) -> Option<W> {
        match self.index(*t) {
            Some(i) => {
                let w = self.ring[i].take().map(|(w, _)| w);
                if i == 0 {
                    self.trim();
                }
                w
            }
            None => self.old.remove(&seq(*t)?).map(|(w, _)| w),
        }
    }

    /// Drop the finished entries at the ring's front.
    fn trim(&mut self) {
        while let Some(None) = self.ring.front() {
            self.ring.pop_front();
            self.base += 1;
        }
    }

    /// Every wait that depends on `peer`.
    pub(crate) fn on_peer_mut(&mut self, peer: Rank) -> impl Iterator<Item = &mut W> {
        self.ring
            .iter_mut()
            .flatten()
            .chain(self.old.values_mut())
            .filter(move |(_, r)| *r == peer)
            .map(|(w, _)| w)
    }

    /// Every wait registered.
    #[cfg(test)]
    pub(crate) fn values(&self) -> impl Iterator<Item = &W> {
        self.ring
            .iter()
            .flatten()
            .chain(self.old.values())
            .map(|(w, _)| w)
    }

    /// Entries the ring holds, finished ones between unfinished ones included.
    #[cfg(test)]
    fn ring_len(&self) -> usize {
        self.ring.len()
    }

    /// A ring of at most `n` entries (tests: to move entries to the map often).
    #[cfg(test)]
    fn with_ring_max(n: usize) -> Self {
        Waits {
            ring_max: n,
            ..Waits::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tokens_are_rma_tokens_in_sequence_and_foreign_ones_are_unknown() {
        let mut w = Waits::default();
        let a = w.add('a', 1);
        let b = w.add('b', 2);
        assert_eq!((a, b), (TOKEN_RMA | 1, TOKEN_RMA | 2));
        assert_eq!(w.get(&a), Some(&'a'));
        for t in [
            0,
            1,
            2,
            u64::MAX,
            TOKEN_RMA,
            TOKEN_RMA | 3,
            TOKEN_RMA | u64::MAX >> 1,
        ] {
            assert_eq!(w.get(&t), None, "{t:#x}");
            assert_eq!(w.remove(&t), None, "{t:#x}");
        }
        assert_eq!(w.remove(&a), Some('a'));
        assert_eq!(w.remove(&a), None);
        assert_eq!(w.get(&b), Some(&'b'));
        *w.get_mut(&b).unwrap() = 'B';
        assert_eq!(w.on_peer_mut(2).map(|c| *c).collect::<Vec<_>>(), ['B']);
        assert_eq!(w.on_peer_mut(1).count(), 0);
    }

    /// One wait never finished while many later ones come and go: the ring stays bounded, and
    /// the old wait is still found (then removed) by its token.
    #[test]
    fn a_wait_left_behind_does_not_grow_the_ring() {
        let mut w = Waits::default();
        let stuck = w.add(0u32, 7);
        for i in 0..3 * RING_MAX as u32 {
            let t = w.add(i, 1);
            assert_eq!(w.remove(&t), Some(i));
            assert!(w.ring_len() <= RING_MAX);
        }
        assert!(w.ring_len() <= 1);
        assert_eq!(w.on_peer_mut(7).count(), 1);
        assert_eq!(w.get(&stuck), Some(&0));
        assert_eq!(w.remove(&stuck), Some(0));
        assert_eq!(w.values().count(), 0);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Add(Rank),
        /// Remove the k-th live token (modulo how many are live), or a token never given.
        Remove(usize),
        Bogus(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => (0u32..4).prop_map(Step::Add),
            3 => any::<usize>().prop_map(Step::Remove),
            1 => any::<u64>().prop_map(Step::Bogus),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Against a hash map, with a ring small enough that entries move to the map often.
        #[test]
        fn behaves_as_a_map(
            steps in proptest::collection::vec(step(), 0..2_000),
            ring_max in 1usize..64,
        ) {
            let mut w = Waits::with_ring_max(ring_max);
            let mut model: HashMap<u64, (u32, Rank)> = HashMap::new();
            let mut live: Vec<u64> = Vec::new();
            for (n, s) in steps.into_iter().enumerate() {
                match s {
                    Step::Add(peer) => {
                        let t = w.add(n as u32, peer);
                        prop_assert!(model.insert(t, (n as u32, peer)).is_none());
                        live.push(t);
                    }
                    Step::Remove(k) if !live.is_empty() => {
                        let t = live.swap_remove(k % live.len());
                        prop_assert_eq!(w.remove(&t), model.remove(&t).map(|e| e.0));
                    }
                    Step::Remove(_) => {}
                    Step::Bogus(t) => {
                        prop_assert_eq!(w.get(&t), model.get(&t).map(|e| &e.0));
                    }
                }
                prop_assert!(w.ring_len() <= ring_max);
            }
            for t in &live {
                prop_assert_eq!(w.get(t), model.get(t).map(|e| &e.0));
            }
            for peer in 0..4 {
                let mut a: Vec<u32> = w.on_peer_mut(peer).map(|x| *x).collect();
                let mut b: Vec<u32> =
                    model.values().filter(|e| e.1 == peer).map(|e| e.0).collect();
                a.sort_unstable();
                b.sort_unstable();
                prop_assert_eq!(a, b);
            }
        }
    }
}

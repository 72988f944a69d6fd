//! Per-peer state that costs four bytes for a rank this process never talks to.
//!
//! A provider of a 16K-rank job that keeps a full record for every rank pays for all of them
//! at start-up, although a connection-oriented channel under a budget (the hybrid's RC) talks
//! to a few. [`PeerTable`] indexes like a `Vec` — reading a rank never touched yields a shared
//! idle record (`T::default()`), writing one allocates its record — so code written against a
//! dense table keeps its shape and only touched peers cost their size.

use std::ops::{Index, IndexMut};

/// Per-rank records, allocated at the first mutable access.
///
/// Layout: a 4-byte slot per rank of the job (0: never touched; else 1 + the record's
/// number), and the records in the order their ranks were first touched, in chunks of about
/// 4 KiB that are filled in turn and never move (no allocation per record, no pointer per
/// rank); a list gives each record's rank.
#[derive(Debug)]
pub struct PeerTable<T> {
    slots: Vec<u32>,
    chunks: Vec<Vec<T>>,
    /// The touched ranks, in the order they were first touched (record `k` is `ranks[k]`'s).
    ranks: Vec<u32>,
    /// What an untouched rank reads as; never handed out mutably.
    idle: T,
}

impl<T> PeerTable<T> {
    /// log2 of the records a chunk holds: as many as fit in 4 KiB, a power of two, at least 1.
    const SHIFT: u32 = {
        let size = std::mem::size_of::<T>();
        let per = match 4096usize.checked_div(size) {
            Some(per) => per,
            None => 64,
        };
        if per <= 1 {
            0
        } else {
            usize::BITS - 1 - per.leading_zeros()
        }
    };
    const MASK: usize = (1 << Self::SHIFT) - 1;

    /// Rank `i`'s record number: `Some(None)` if never touched, `None` past the end.
    #[inline]
    fn number(&self, i: usize) -> Option<Option<usize>> {
        self.slots.get(i).map(|&s| (s as usize).checked_sub(1))
    }

    #[inline]
    fn record(&self, k: usize) -> &T {
        &self.chunks[k >> Self::SHIFT][k & Self::MASK]
    }

    #[inline]
    fn record_mut(&mut self, k: usize) -> &mut T {
        &mut self.chunks[k >> Self::SHIFT][k & Self::MASK]
    }
}

impl<T: Default> PeerTable<T> {
    /// A table for ranks `0..size`, none allocated.
    pub fn new(size: usize) -> PeerTable<T> {
        PeerTable {
            slots: vec![0; size],
            chunks: Vec::new(),
            ranks: Vec::new(),
            idle: T::default(),
        }
    }

    /// Ranks the table covers.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the table covers no rank.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Rank `i`'s record (the idle one if never touched); `None` past the end.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&T> {
        Some(match self.number(i)? {
            Some(k) => self.record(k),
            None => &self.idle,
        })
    }

    /// Rank `i`'s record, allocated if it was never touched; `None` past the end.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        (i < self.slots.len()).then(|| &mut self[i])
    }

    /// Rank `i`'s record only if it was touched (no allocation).
    pub fn touched_mut(&mut self, i: usize) -> Option<&mut T> {
        let k = self.number(i)??;
        Some(self.record_mut(k))
    }

    /// The touched records with their ranks, in the order they were first touched (time in
    /// the number touched, not in the job's size).
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.ranks
            .iter()
            .zip(self.chunks.iter().flatten())
            .map(|(&r, p)| (r as usize, p))
    }

    /// The `k`-th touched rank (`k < touched()`), for loops that mutate the table as they go.
    pub fn touched_rank(&self, k: usize) -> usize {
        self.ranks[k] as usize
    }

    /// The touched records with their ranks, mutably, in the order they were first touched.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.ranks
            .iter()
            .zip(self.chunks.iter_mut().flatten())
            .map(|(&r, p)| (r as usize, p))
    }

    /// Records allocated so far.
    pub fn touched(&self) -> usize {
        self.ranks.len()
    }

    /// Bytes the table holds: a slot per rank, the chunks (whole, filled or not) and their
    /// list, the list of ranks, and the idle record (the records' own heap allocations are not
    /// counted).
    pub fn bytes(&self) -> usize {
        self.slots.len() * 4
            + self.chunks.iter().map(Vec::capacity).sum::<usize>() * std::mem::size_of::<T>()
            + self.chunks.capacity() * std::mem::size_of::<Vec<T>>()
            + self.ranks.capacity() * 4
            + std::mem::size_of::<T>()
    }

    /// Make rank `i`'s record (it has none) and note it touched.
    #[cold]
    #[inline(never)]
    fn first_touch(&mut self, i: usize) -> usize {
        let k = self.ranks.len();
        if k & Self::MASK == 0 {
            self.chunks.push(Vec::with_capacity(1 << Self::SHIFT));
        }
        // The last chunk has room (a new one is made when the previous is full), so it never
        // reallocates and the records already handed out stay where they are.
        let last = self.chunks.last_mut().expect("a chunk was just ensured");
        last.push(T::default());
        self.ranks.push(i as u32);
        self.slots[i] = k as u32 + 1;
        k
    }
}

impl<T: Default> Index<usize> for PeerTable<T> {
    type Output = T;

    /// Rank `i`'s record, the idle one if never touched. Panics past the end, as a `Vec`
    /// does: callers check ranks first.
    #[inline]
    fn index(&self, i: usize) -> &T {
        self.get(i).unwrap_or_else(|| {
            panic!(
                "rank {i} is past the end of a table of {} ranks",
                self.slots.len()
            )
        })
    }
}

impl<T: Default> IndexMut<usize> for PeerTable<T> {
    /// Rank `i`'s record, made if never touched. Panics past the end, as a `Vec` does.
    /// (Inlined, the first touch out of line: providers index their peers on every message.)
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        let k = match self.slots[i] {
            0 => self.first_touch(i),
            s => s as usize - 1,
        };
        self.record_mut(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default, Debug, PartialEq)]
    struct P {
        n: u64,
        v: Vec<u8>,
    }

    #[test]
    fn reads_do_not_allocate_and_writes_do() {
        let mut t: PeerTable<P> = PeerTable::new(1000);
        assert_eq!(t.len(), 1000);
        assert_eq!(t[5], P::default());
        assert_eq!(t.get(999), Some(&P::default()));
        assert_eq!(t.get(1000), None);
        assert_eq!(t.touched(), 0);
        t[7].n = 3;
        t[7].n += 1;
        t.get_mut(9).unwrap().v.push(1);
        assert!(t.get_mut(1000).is_none());
        assert!(t.touched_mut(10).is_none());
        assert_eq!(t.touched(), 2);
        assert_eq!(t[7].n, 4);
        assert_eq!(t[5].n, 0);
        let seen: Vec<usize> = t.iter().map(|(i, _)| i).collect();
        assert_eq!(seen, [7, 9]);
        for (_, p) in t.iter_mut() {
            p.n = 1;
        }
        assert_eq!(t[9].n, 1);
        assert_eq!(t.touched_rank(1), 9);
        assert!(t.bytes() >= 1000 * 4 + 3 * std::mem::size_of::<P>() + 8);
    }

    #[test]
    fn records_stay_put_across_chunks_and_cost_their_size() {
        // 32-byte records: 128 to a 4 KiB chunk.
        #[derive(Default)]
        struct R([u64; 4]);
        let mut t: PeerTable<R> = PeerTable::new(100_000);
        assert_eq!(t.bytes(), 100_000 * 4 + 32);
        t[99_999].0[0] = 7;
        let first = &t[99_999] as *const R;
        // Touch 300 more ranks, backwards: three chunks, the first record never moves.
        for r in (0..300).rev() {
            t[r * 3].0[1] = r as u64;
        }
        assert_eq!(&t[99_999] as *const R, first);
        assert_eq!(t[99_999].0[0], 7);
        assert_eq!(t.touched(), 301);
        for r in 0..300 {
            assert_eq!(t[r * 3].0[1], r as u64);
            assert_eq!(t.get(r * 3 + 1).map(|p| p.0[1]), Some(0));
        }
        // Touched order, mutably too.
        let order: Vec<usize> = t.iter_mut().map(|(r, _)| r).take(3).collect();
        assert_eq!(order, [99_999, 897, 894]);
        assert_eq!(t.touched_rank(300), 0);
        assert_eq!(
            t.bytes(),
            100_000 * 4
                + 3 * 128 * 32
                + t.chunks.capacity() * std::mem::size_of::<Vec<R>>()
                + t.ranks.capacity() * 4
                + 32
        );
    }

    #[test]
    #[should_panic]
    fn past_the_end_panics_like_a_vec() {
        let t: PeerTable<P> = PeerTable::new(2);
        let _ = &t[2];
    }
}

//! Per-peer state that costs one pointer for a rank this process never talks to.
//!
//! A provider of a 16K-rank job that keeps a full record for every rank pays for all of them
//! at start-up, although a connection-oriented channel under a budget (the hybrid's RC) talks
//! to a few. [`PeerTable`] indexes like a `Vec` — reading a rank never touched yields a shared
//! idle record (`T::default()`), writing one allocates its record — so code written against a
//! dense table keeps its shape and only touched peers cost their size.

use std::ops::{Index, IndexMut};

/// Per-rank records, allocated at the first mutable access.
#[derive(Debug)]
pub struct PeerTable<T> {
    slots: Vec<Option<Box<T>>>,
    /// What an untouched rank reads as; never handed out mutably.
    idle: T,
    /// The touched ranks, in the order they were first touched.
    live: Vec<u32>,
}

impl<T: Default> PeerTable<T> {
    /// A table for ranks `0..size`, none allocated.
    pub fn new(size: usize) -> PeerTable<T> {
        PeerTable {
            slots: (0..size).map(|_| None).collect(),
            idle: T::default(),
            live: Vec::new(),
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
        self.slots
            .get(i)
            .map(|s| s.as_deref().unwrap_or(&self.idle))
    }

    /// Rank `i`'s record, allocated if it was never touched; `None` past the end.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        let s = self.slots.get_mut(i)?;
        if s.is_none() {
            self.live.push(i as u32);
        }
        Some(s.get_or_insert_with(Box::default))
    }

    /// Rank `i`'s record only if it was touched (no allocation).
    pub fn touched_mut(&mut self, i: usize) -> Option<&mut T> {
        self.slots.get_mut(i)?.as_deref_mut()
    }

    /// The touched records with their ranks, in the order they were first touched (time in
    /// the number touched, not in the job's size).
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.live.iter().map(|&i| {
            let i = i as usize;
            (i, self.slots[i].as_deref().unwrap_or(&self.idle))
        })
    }

    /// The `k`-th touched rank (`k < touched()`), for loops that mutate the table as they go.
    pub fn touched_rank(&self, k: usize) -> usize {
        self.live[k] as usize
    }

    /// The touched records with their ranks, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| s.as_deref_mut().map(|p| (i, p)))
    }

    /// Records allocated so far.
    pub fn touched(&self) -> usize {
        self.live.len()
    }

    /// Bytes the table holds: a pointer per rank, and a record per touched rank (the records'
    /// own heap allocations are not counted).
    pub fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Option<Box<T>>>()
            + (self.live.len() + 1) * std::mem::size_of::<T>()
            + self.live.capacity() * 4
    }
}

impl<T: Default> Index<usize> for PeerTable<T> {
    type Output = T;

    /// Rank `i`'s record, the idle one if never touched. Panics past the end, as a `Vec`
    /// does: callers check ranks first.
    #[inline]
    fn index(&self, i: usize) -> &T {
        self.slots[i].as_deref().unwrap_or(&self.idle)
    }
}

impl<T: Default> IndexMut<usize> for PeerTable<T> {
    /// Rank `i`'s record, allocated if never touched. Panics past the end, as a `Vec` does.
    /// (Inlined, the allocation out of line: providers index their peers on every message.)
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        let s = &mut self.slots[i];
        match *s {
            Some(ref mut b) => b,
            None => first_touch(&mut self.live, s, i),
        }
    }
}

/// Allocate rank `i`'s record in its slot `s` and note it touched.
#[cold]
#[inline(never)]
fn first_touch<'a, T: Default>(
    live: &mut Vec<u32>,
    s: &'a mut Option<Box<T>>,
    i: usize,
) -> &'a mut T {
    live.push(i as u32);
    s.insert(Box::default())
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
        let ptr = std::mem::size_of::<Option<Box<P>>>();
        assert_eq!(t.touched_rank(1), 9);
        assert!(t.bytes() >= 1000 * ptr + 3 * std::mem::size_of::<P>() + 8);
    }

    #[test]
    #[should_panic]
    fn past_the_end_panics_like_a_vec() {
        let t: PeerTable<P> = PeerTable::new(2);
        let _ = &t[2];
    }
}

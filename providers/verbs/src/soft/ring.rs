//! The soft HCA's queues in shared memory — receive queues, shared receive queues and
//! completion queues — are one bounded multi-producer multi-consumer ring of fixed-size records
//! (D. Vyukov's sequence-numbered array): a receive queue is filled by its owner and emptied by
//! the initiators that send to it; a completion queue is filled by the owner's requester and by
//! remote initiators delivering receives, and emptied by its owner.
//!
//! Each slot has a sequence word. A producer that finds `seq == pos` claims position `pos` by
//! advancing the enqueue counter, writes the record, then publishes it with `seq = pos + 1`
//! (release); a consumer that finds `seq == pos + 1` claims it through the dequeue counter,
//! reads, and frees the slot for the next lap with `seq = pos + cap`. A full ring refuses a
//! producer, an empty one a consumer; nobody waits on anybody. Model-checked with loom below.

use crate::sync::{AtomicU64, Ordering, UnsafeCell};

/// The two counters, each on its own pair of cache lines.
#[repr(C, align(128))]
pub struct RingHead {
    pub enq: AtomicU64,
    _pad: [u64; 15],
    pub deq: AtomicU64,
    _pad2: [u64; 15],
}

/// Bytes of a ring of `cap` records of `words` u64 each, as laid out in shared memory.
pub fn ring_bytes(cap: usize, words: usize) -> usize {
    std::mem::size_of::<RingHead>() + cap * 8 * (1 + words)
}

/// A ring seen through references into wherever it lives.
pub struct Ring<'a> {
    head: &'a RingHead,
    seq: &'a [AtomicU64],
    data: &'a [UnsafeCell<u64>],
    words: usize,
    mask: u64,
}

impl<'a> Ring<'a> {
    /// A view of the parts. `seq.len()` is the capacity, a power of two; `data` holds
    /// `words` per slot.
    pub fn new(
        head: &'a RingHead,
        seq: &'a [AtomicU64],
        data: &'a [UnsafeCell<u64>],
        words: usize,
    ) -> Ring<'a> {
        debug_assert!(seq.len().is_power_of_two() && data.len() == seq.len() * words);
        Ring {
            head,
            seq,
            data,
            words,
            mask: seq.len() as u64 - 1,
        }
    }

    /// A view of the ring laid out at `base` by [`Ring::init`].
    ///
    /// # Safety
    /// `base` must point at `ring_bytes(cap, words)` bytes of memory that stays mapped for
    /// `'a`, 128-byte aligned, holding a ring initialised with the same `cap` and `words`, and
    /// accessed by everyone only through this protocol.
    pub unsafe fn at(base: *mut u8, cap: usize, words: usize) -> Ring<'a> {
        let head = &*(base as *const RingHead);
        let seq_p = base.add(std::mem::size_of::<RingHead>()) as *const AtomicU64;
        let seq = std::slice::from_raw_parts(seq_p, cap);
        let data_p = seq_p.add(cap) as *const UnsafeCell<u64>;
        let data = std::slice::from_raw_parts(data_p, cap * words);
        Ring::new(head, seq, data, words)
    }

    /// Set the sequence words of a fresh (zeroed) ring; only its creator calls this, before
    /// anyone else can see it.
    pub fn init(&self) {
        for (i, s) in self.seq.iter().enumerate() {
            s.store(i as u64, Ordering::Relaxed);
        }
        self.head.enq.store(0, Ordering::Relaxed);
        self.head.deq.store(0, Ordering::Release);
    }

    /// Records currently queued (a snapshot).
    pub fn len(&self) -> usize {
        let e = self.head.enq.load(Ordering::Acquire);
        let d = self.head.deq.load(Ordering::Acquire);
        e.saturating_sub(d) as usize
    }

    /// Whether the oldest record is published and could be popped now (a look: loads only).
    pub fn ready(&self) -> bool {
        let pos = self.head.deq.load(Ordering::Relaxed);
        let slot = (pos & self.mask) as usize;
        self.seq[slot].load(Ordering::Acquire) == pos + 1
    }

    #[cfg(all(test, not(loom)))]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Append `rec` (`words` long); `false` when the ring is full.
    pub fn push(&self, rec: &[u64]) -> bool {
        debug_assert_eq!(rec.len(), self.words);
        let mut pos = self.head.enq.load(Ordering::Relaxed);
        loop {
            let slot = (pos & self.mask) as usize;
            let seq = self.seq[slot].load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos) as i64;
            if dif == 0 {
                match self.head.enq.compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        for (w, v) in rec.iter().enumerate() {
                            // SAFETY: the slot is ours between the claim and the publishing
                            // store below; no consumer reads it before seq = pos + 1.
                            self.data[slot * self.words + w].with_mut(|p| unsafe { *p = *v });
                        }
                        self.seq[slot].store(pos + 1, Ordering::Release);
                        return true;
                    }
                    Err(p) => pos = p,
                }
            } else if dif < 0 {
                return false;
            } else {
                pos = self.head.enq.load(Ordering::Relaxed);
            }
        }
    }

    /// Take the oldest record into `out` (`words` long); `false` when the ring is empty.
    pub fn pop(&self, out: &mut [u64]) -> bool {
        debug_assert_eq!(out.len(), self.words);
        let mut pos = self.head.deq.load(Ordering::Relaxed);
        loop {
            let slot = (pos & self.mask) as usize;
            let seq = self.seq[slot].load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos + 1) as i64;
            if dif == 0 {
                match self.head.deq.compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        for (w, o) in out.iter_mut().enumerate() {
                            // SAFETY: published by the producer's release store (acquired
                            // above) and ours until we hand the slot back below.
                            *o = self.data[slot * self.words + w].with(|p| unsafe { *p });
                        }
                        self.seq[slot].store(pos + self.mask + 1, Ordering::Release);
                        return true;
                    }
                    Err(p) => pos = p,
                }
            } else if dif < 0 {
                return false;
            } else {
                pos = self.head.deq.load(Ordering::Relaxed);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn heap_ring(cap: usize, words: usize) -> (Vec<u128>, usize) {
        let bytes = ring_bytes(cap, words);
        (vec![0u128; bytes.div_ceil(16) + 8], bytes)
    }

    #[test]
    fn fifo_full_and_empty() {
        let (mut mem, _) = heap_ring(4, 3);
        let base = ((mem.as_mut_ptr() as usize + 127) & !127) as *mut u8;
        // SAFETY: `mem` holds ring_bytes(4, 3) bytes past the 128-aligned base and outlives r.
        let r = unsafe { Ring::at(base, 4, 3) };
        r.init();
        let mut out = [0u64; 3];
        assert!(!r.pop(&mut out));
        for lap in 0..5u64 {
            for i in 0..4 {
                assert!(r.push(&[lap, i, 7]));
            }
            assert!(!r.push(&[9, 9, 9]), "full");
            assert_eq!(r.len(), 4);
            for i in 0..4 {
                assert!(r.pop(&mut out));
                assert_eq!(out, [lap, i, 7]);
            }
            assert!(r.is_empty());
        }
    }

    #[test]
    fn threads_lose_and_duplicate_nothing() {
        let (mut mem, _) = heap_ring(64, 2);
        let base = (mem.as_mut_ptr() as usize + 127) & !127;
        // SAFETY: as above; the threads end before `mem` is dropped.
        unsafe { Ring::at(base as *mut u8, 64, 2) }.init();
        let per = 20_000u64;
        let got = std::thread::scope(|s| {
            for t in 0..2u64 {
                s.spawn(move || {
                    // SAFETY: as above.
                    let r = unsafe { Ring::at(base as *mut u8, 64, 2) };
                    for i in 0..per {
                        while !r.push(&[t, i]) {
                            std::hint::spin_loop();
                        }
                    }
                });
            }
            let h: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(move || {
                        // SAFETY: as above.
                        let r = unsafe { Ring::at(base as *mut u8, 64, 2) };
                        let mut seen = vec![];
                        let mut o = [0u64; 2];
                        let t0 = std::time::Instant::now();
                        while seen.len() < per as usize {
                            if r.pop(&mut o) {
                                seen.push((o[0], o[1]));
                            }
                            assert!(t0.elapsed().as_secs() < 60, "stalled");
                        }
                        seen
                    })
                })
                .collect();
            h.into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        let mut by = [vec![], vec![]];
        for (t, i) in got {
            by[t as usize].push(i);
        }
        for v in &mut by {
            v.sort();
            assert_eq!(*v, (0..per).collect::<Vec<_>>());
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    struct Owned {
        head: RingHead,
        seq: Vec<AtomicU64>,
        data: Vec<UnsafeCell<u64>>,
    }

    fn owned(cap: usize, words: usize) -> Arc<Owned> {
        Arc::new(Owned {
            head: RingHead {
                enq: AtomicU64::new(0),
                _pad: [0; 15],
                deq: AtomicU64::new(0),
                _pad2: [0; 15],
            },
            seq: (0..cap).map(|i| AtomicU64::new(i as u64)).collect(),
            data: (0..cap * words).map(|_| UnsafeCell::new(0)).collect(),
        })
    }

    /// Two producers and two consumers on a ring of two slots: every record arrives once, whole.
    #[test]
    fn loom_ring_mpmc() {
        loom::model(|| {
            let o = owned(2, 2);
            let prods: Vec<_> = (1..=2u64)
                .map(|t| {
                    let o = o.clone();
                    loom::thread::spawn(move || {
                        let r = Ring::new(&o.head, &o.seq, &o.data, 2);
                        while !r.push(&[t, t * 10]) {
                            loom::thread::yield_now();
                        }
                    })
                })
                .collect();
            let o2 = o.clone();
            let c = loom::thread::spawn(move || {
                let r = Ring::new(&o2.head, &o2.seq, &o2.data, 2);
                let mut out = [0u64; 2];
                if r.pop(&mut out) {
                    assert_eq!(out[1], out[0] * 10);
                    out[0]
                } else {
                    0
                }
            });
            for p in prods {
                p.join().unwrap();
            }
            let first = c.join().unwrap();
            let r = Ring::new(&o.head, &o.seq, &o.data, 2);
            let mut rest = vec![];
            let mut out = [0u64; 2];
            while r.pop(&mut out) {
                assert_eq!(out[1], out[0] * 10);
                rest.push(out[0]);
            }
            if first != 0 {
                rest.push(first);
            }
            rest.sort();
            assert_eq!(rest, vec![1, 2]);
        });
    }
}

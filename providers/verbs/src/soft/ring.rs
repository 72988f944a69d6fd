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
//!
//! Layout: each slot keeps its sequence word in front of its record, on cache lines of its
//! own, and a record may be shorter than the slot (a receive WQE carries its SGE count, and
//! only the SGEs it has are written and read). A completion or a receive of one or two SGEs is
//! one cache line moved between processes per push and per pop; with the sequence words in an
//! array of their own and records read whole, a WQE pop touched four lines and neighbouring
//! slots' sequence words shared one.
//!
//! **Claims that die.** A producer killed between claiming a position and publishing it would
//! leave the ring empty forever (its consumer waits at that position), a consumer killed
//! between claiming and handing the slot back would leave it full forever. So a process that is
//! not the ring's owner announces, before it claims, the position it is about to claim in a
//! hazard word of its own ([`claim_tag`], through the `claim` of [`Ring::push_as`] and
//! [`Ring::pop_by_as`]), and clears it once done. The owner finds a position held up
//! ([`Ring::unpublished`], [`Ring::unreleased`]); if no live process announces it, its claimer
//! is dead and the owner finishes for it — a void record in place of the one never written
//! ([`Ring::void`]), the slot handed back for the next lap ([`Ring::release`]).

use crate::sync::{AtomicU64, Ordering, UnsafeCell};

/// The mark of a ring claim in a hazard word (no key or object tag has this bit).
pub const CLAIM: u64 = 1 << 63;
/// Second word of a void record (`Ring::void`): no record has it.
pub const VOID: u64 = u64::MAX;

/// A hazard word announcing a claim of position `pos` in the ring `id` (its heap offset / 128;
/// ids and positions are cut to 23 and 40 bits: a collision only makes the owner wait longer).
pub fn claim_tag(id: u64, pos: u64) -> u64 {
    CLAIM | (id & 0x7f_ffff) << 40 | (pos & 0xff_ffff_ffff)
}

/// The two counters, each on its own pair of cache lines.
#[repr(C, align(128))]
pub struct RingHead {
    pub enq: AtomicU64,
    _pad: [u64; 15],
    pub deq: AtomicU64,
    _pad2: [u64; 15],
}

impl RingHead {
    #[cfg(all(test, loom))]
    fn new() -> RingHead {
        RingHead {
            enq: AtomicU64::new(0),
            _pad: [0; 15],
            deq: AtomicU64::new(0),
            _pad2: [0; 15],
        }
    }
}

/// One slot: its sequence word and up to `W` words of record, on whole cache lines of their
/// own. A push or a pop of a record that fits the first line (a completion, a receive of one
/// or two SGEs) moves that one line between the processes, and neighbouring slots never share
/// a line (a producer filling slot `i` does not take the line a consumer is reading slot `i - 1`
/// from; with the sequence words in an array of their own, eight slots shared one).
#[repr(C, align(64))]
pub struct Slot<const W: usize> {
    seq: AtomicU64,
    data: [UnsafeCell<u64>; W],
}

impl<const W: usize> Slot<W> {
    #[cfg(all(test, loom))]
    fn new(i: u64) -> Slot<W> {
        Slot {
            seq: AtomicU64::new(i),
            data: std::array::from_fn(|_| UnsafeCell::new(0)),
        }
    }
}

/// Bytes of a ring of `cap` records of `W` words each, as laid out in shared memory.
pub fn ring_bytes<const W: usize>(cap: usize) -> usize {
    std::mem::size_of::<RingHead>() + cap * std::mem::size_of::<Slot<W>>()
}

/// A ring of records of at most `W` words, seen through references into wherever it lives.
pub struct Ring<'a, const W: usize> {
    head: &'a RingHead,
    slots: &'a [Slot<W>],
    mask: u64,
}

impl<'a, const W: usize> Ring<'a, W> {
    /// A view of the parts. `slots.len()` is the capacity, a power of two.
    pub fn new(head: &'a RingHead, slots: &'a [Slot<W>]) -> Ring<'a, W> {
        debug_assert!(slots.len().is_power_of_two());
        Ring {
            head,
            slots,
            mask: slots.len() as u64 - 1,
        }
    }

    /// A view of the ring laid out at `base` by [`Ring::init`].
    ///
    /// # Safety
    /// `base` must point at `ring_bytes::<W>(cap)` bytes of memory that stays mapped for `'a`,
    /// 128-byte aligned, holding a ring initialised with the same `cap` and `W`, and accessed
    /// by everyone only through this protocol.
    pub unsafe fn at(base: *mut u8, cap: usize) -> Ring<'a, W> {
        let head = &*(base as *const RingHead);
        // The head is 256 bytes, so the slots start 64-byte aligned as `Slot` needs.
        let slots_p = base.add(std::mem::size_of::<RingHead>()) as *const Slot<W>;
        Ring::new(head, std::slice::from_raw_parts(slots_p, cap))
    }

    /// Set the sequence words of a fresh (zeroed) ring; only its creator calls this, before
    /// anyone else can see it.
    pub fn init(&self) {
        for (i, s) in self.slots.iter().enumerate() {
            s.seq.store(i as u64, Ordering::Relaxed);
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
        self.slots[slot].seq.load(Ordering::Acquire) == pos + 1
    }

    /// Nothing queued (a snapshot; a record claimed but not yet published counts).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Append `rec` (at most `W` words: a shorter record leaves the rest of the slot as it
    /// was, for a reader that knows its length, see [`Ring::pop_by`]); `false` when the ring
    /// is full. For the ring's owner; others use [`Ring::push_as`].
    pub fn push(&self, rec: &[u64]) -> bool {
        self.push_as(rec, None::<(u64, fn(u64))>)
    }

    /// [`Ring::push`] by a process that is not the ring's owner: `claim` is the ring's id and
    /// a store (sequentially consistent) into the caller's hazard word, given [`claim_tag`]
    /// before the claim and 0 once the record is published (or the ring found full).
    pub fn push_as(&self, rec: &[u64], claim: Option<(u64, impl Fn(u64))>) -> bool {
        debug_assert!(rec.len() <= W);
        let mut pos = self.head.enq.load(Ordering::Relaxed);
        loop {
            let s = &self.slots[(pos & self.mask) as usize];
            let seq = s.seq.load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos) as i64;
            if dif == 0 {
                // Announced before the claim, the claim sequentially consistent after it: an
                // owner that sees the claim sees the announcement.
                let order = match &claim {
                    Some((id, set)) => {
                        set(claim_tag(*id, pos));
                        Ordering::SeqCst
                    }
                    None => Ordering::Relaxed,
                };
                match self
                    .head
                    .enq
                    .compare_exchange_weak(pos, pos + 1, order, Ordering::Relaxed)
                {
                    Ok(_) => {
                        if claim.is_some() {
                            #[cfg(not(loom))]
                            crate::soft::model::stall_point(crate::soft::model::Stall::StopInPush);
                            #[cfg(not(loom))]
                            crate::soft::model::stall_point(crate::soft::model::Stall::ExitInPush);
                        }
                        for (d, v) in s.data.iter().zip(rec) {
                            // SAFETY: the slot is ours between the claim and the publishing
                            // store below; no consumer reads it before seq = pos + 1.
                            d.with_mut(|p| unsafe { *p = *v });
                        }
                        s.seq.store(pos + 1, Ordering::Release);
                        if let Some((_, set)) = &claim {
                            set(0);
                        }
                        return true;
                    }
                    Err(p) => pos = p,
                }
            } else if dif < 0 {
                if let Some((_, set)) = &claim {
                    set(0);
                }
                return false;
            } else {
                pos = self.head.enq.load(Ordering::Relaxed);
            }
        }
    }

    /// Take the oldest record into `out` (its first `out.len()` words, at most `W`); `false`
    /// when the ring is empty.
    pub fn pop(&self, out: &mut [u64]) -> bool {
        let n = out.len();
        self.pop_by(out, |_| n)
    }

    /// Take the oldest record into `out`, reading its first two words and then as many as
    /// `words(second word)` says (at most `out.len()` and `W`): a record whose length it
    /// carries is read without the words it does not use. `false` when the ring is empty.
    pub fn pop_by(&self, out: &mut [u64], words: impl FnOnce(u64) -> usize) -> bool {
        self.pop_by_as(out, words, None::<(u64, fn(u64))>)
    }

    /// [`Ring::pop_by`] by a process that is not the ring's owner, announcing its claim as
    /// [`Ring::push_as`] does.
    pub fn pop_by_as(
        &self,
        out: &mut [u64],
        words: impl FnOnce(u64) -> usize,
        claim: Option<(u64, impl Fn(u64))>,
    ) -> bool {
        let mut pos = self.head.deq.load(Ordering::Relaxed);
        loop {
            let s = &self.slots[(pos & self.mask) as usize];
            let seq = s.seq.load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos + 1) as i64;
            if dif == 0 {
                let order = match &claim {
                    Some((id, set)) => {
                        set(claim_tag(*id, pos));
                        Ordering::SeqCst
                    }
                    None => Ordering::Relaxed,
                };
                match self
                    .head
                    .deq
                    .compare_exchange_weak(pos, pos + 1, order, Ordering::Relaxed)
                {
                    Ok(_) => {
                        // SAFETY (both reads): published by the producer's release store
                        // (acquired above) and ours until we hand the slot back below.
                        let read = |i: usize| s.data[i].with(|p| unsafe { *p });
                        let first = out.len().min(W).min(2);
                        for (i, o) in out[..first].iter_mut().enumerate() {
                            *o = read(i);
                        }
                        let n = if first == 2 { words(out[1]) } else { first };
                        let n = n.clamp(first, out.len().min(W));
                        for (i, o) in out[..n].iter_mut().enumerate().skip(first) {
                            *o = read(i);
                        }
                        if claim.is_some() {
                            #[cfg(not(loom))]
                            crate::soft::model::stall_point(crate::soft::model::Stall::ExitInPop);
                        }
                        s.seq.store(pos + self.mask + 1, Ordering::Release);
                        if let Some((_, set)) = &claim {
                            set(0);
                        }
                        return true;
                    }
                    Err(p) => pos = p,
                }
            } else if dif < 0 {
                if let Some((_, set)) = &claim {
                    set(0);
                }
                return false;
            } else {
                pos = self.head.deq.load(Ordering::Relaxed);
            }
        }
    }

    /// The oldest position, if a producer claimed it and has not published it (a look:
    /// loads only). The owner, as consumer, then asks whether a live process announces it.
    pub fn unpublished(&self) -> Option<u64> {
        let pos = self.head.deq.load(Ordering::SeqCst);
        let s = &self.slots[(pos & self.mask) as usize];
        (s.seq.load(Ordering::SeqCst) == pos && self.head.enq.load(Ordering::SeqCst) > pos)
            .then_some(pos)
    }

    /// The position a consumer claimed a lap ago where the next push goes, if it has not
    /// handed the slot back (a look). The owner, as producer, then asks as above.
    pub fn unreleased(&self) -> Option<u64> {
        let pos = self.head.enq.load(Ordering::SeqCst);
        let q = pos.checked_sub(self.mask + 1)?;
        let s = &self.slots[(pos & self.mask) as usize];
        (s.seq.load(Ordering::SeqCst) == q + 1 && self.head.deq.load(Ordering::SeqCst) > q)
            .then_some(q)
    }

    /// Publish a void record (second word [`VOID`]) at `pos`, which [`Ring::unpublished`]
    /// named and whose claimer the caller found dead (no live process announces the claim):
    /// consumers move past it. `false` if the position was published meanwhile.
    pub fn void(&self, pos: u64) -> bool {
        let s = &self.slots[(pos & self.mask) as usize];
        if s.seq.load(Ordering::SeqCst) != pos {
            return false;
        }
        for (i, d) in s.data.iter().enumerate().take(2) {
            // SAFETY: claimed by a process that is dead (the caller's check, made after the
            // claim was seen) and so never writes it; no consumer reads it before the store
            // below publishes it.
            d.with_mut(|p| unsafe { *p = if i == 1 { VOID } else { 0 } });
        }
        s.seq
            .compare_exchange(pos, pos + 1, Ordering::Release, Ordering::Relaxed)
            .is_ok()
    }

    /// The record at `q`, which [`Ring::unreleased`] named and whose consumer the caller found
    /// dead, into `out`; then hand its slot back for the next lap. `false` if it was handed
    /// back meanwhile.
    pub fn release(&self, q: u64, out: &mut [u64]) -> bool {
        let s = &self.slots[(q & self.mask) as usize];
        if s.seq.load(Ordering::SeqCst) != q + 1 {
            return false;
        }
        for (o, d) in out.iter_mut().zip(&s.data) {
            // SAFETY: published (seq = q + 1, read above) and claimed by a consumer that is
            // dead: nobody writes it before the store below hands it back.
            *o = d.with(|p| unsafe { *p });
        }
        s.seq
            .compare_exchange(
                q + 1,
                q + self.mask + 1,
                Ordering::Release,
                Ordering::Relaxed,
            )
            .is_ok()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn heap_ring<const W: usize>(cap: usize) -> Vec<u128> {
        vec![0u128; ring_bytes::<W>(cap).div_ceil(16) + 8]
    }

    /// A fresh ring of `cap` slots in `mem` (from `heap_ring::<W>(cap)`).
    fn ring_in<const W: usize>(mem: &mut [u128], cap: usize) -> Ring<'_, W> {
        assert!(mem.len() * 16 >= ring_bytes::<W>(cap) + 127);
        let base = ((mem.as_mut_ptr() as usize + 127) & !127) as *mut u8;
        // SAFETY: `mem` holds ring_bytes::<W>(cap) bytes past the 128-aligned base (checked
        // above) and is borrowed for as long as the ring.
        let r = unsafe { Ring::<W>::at(base, cap) };
        r.init();
        r
    }

    #[test]
    fn a_slot_is_whole_cache_lines_with_its_sequence_word_first() {
        use crate::soft::seg::{CQE_WORDS, WQE_WORDS};
        assert_eq!(std::mem::size_of::<Slot<CQE_WORDS>>(), 64);
        // Sequence word, wr_id, SGE count and two SGEs fit the first line.
        assert_eq!(std::mem::size_of::<Slot<WQE_WORDS>>(), 192);
        assert_eq!(std::mem::offset_of!(Slot<WQE_WORDS>, seq), 0);
        assert_eq!(ring_bytes::<CQE_WORDS>(8), 256 + 8 * 64);
    }

    #[test]
    fn pop_by_reads_the_words_a_record_says_it_has() {
        let mut mem = heap_ring::<6>(4);
        let r = ring_in::<6>(&mut mem, 4);
        assert!(r.push(&[1, 2, 3, 4, 5, 6]));
        let mut out = [0u64; 6];
        assert!(r.pop(&mut out));
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        // A shorter record in the same slot's next lap (and the three others): read as long
        // as it says, the rest of `out` untouched.
        for lap in 0..4u64 {
            assert!(r.push(&[lap, 3, 30 + lap]));
        }
        for lap in 0..4u64 {
            let mut out = [9u64; 6];
            assert!(r.pop_by(&mut out, |n| n as usize));
            assert_eq!(out, [lap, 3, 30 + lap, 9, 9, 9]);
        }
        // A length past `out` or the slot is cut to them; one under two words reads two.
        assert!(r.push(&[7, 100, 1, 2, 3, 4]));
        let mut out = [0u64; 4];
        assert!(r.pop_by(&mut out, |n| n as usize));
        assert_eq!(out, [7, 100, 1, 2]);
        assert!(r.push(&[8, 0, 5]));
        let mut out = [0u64; 3];
        assert!(r.pop_by(&mut out, |n| n as usize));
        assert_eq!(out, [8, 0, 0]);
        assert!(r.is_empty());
    }

    /// A producer that claimed a position and died before publishing it left the ring empty
    /// to its consumer for good; a consumer that died before handing a slot back left it full
    /// for good. The owner finishes for them: a void record, a slot handed back (and the
    /// record the dead consumer had taken, for its owner to complete in error).
    #[test]
    fn claims_of_the_dead_are_finished_by_the_owner() {
        let mut mem = heap_ring::<3>(4);
        let r = ring_in::<3>(&mut mem, 4);
        let hz = std::sync::atomic::AtomicU64::new(0);
        let set = |v| hz.store(v, std::sync::atomic::Ordering::SeqCst);
        // A producer announces position 0, claims it and dies.
        set(claim_tag(5, 0));
        r.head.enq.fetch_add(1, Ordering::SeqCst);
        assert!(r.push_as(&[1, 2, 3], Some((5, set))), "position 1");
        assert_eq!(
            hz.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "cleared once done"
        );
        let mut out = [0u64; 3];
        assert!(!r.pop(&mut out), "stuck behind the dead claim");
        assert_eq!(r.unpublished(), Some(0));
        assert!(r.void(0));
        assert!(!r.void(0), "once");
        assert!(r.pop(&mut out) && out[1] == VOID, "the void record");
        assert!(r.pop(&mut out) && out == [1, 2, 3]);
        assert_eq!(r.unpublished(), None);
        // A consumer takes position 2's record and dies before handing the slot back.
        for i in 0..4u64 {
            assert!(r.push(&[10 + i, 0, 0]));
        }
        r.head.deq.fetch_add(1, Ordering::SeqCst);
        for _ in 0..3 {
            assert!(r.pop(&mut out));
        }
        assert!(
            !r.push(&[99, 0, 0]),
            "full for good behind the dead consumer"
        );
        assert_eq!(r.unreleased(), Some(2));
        assert!(
            r.release(2, &mut out) && out[0] == 10,
            "its record, for a flush error"
        );
        assert!(!r.release(2, &mut out), "once");
        assert!(r.push(&[99, 0, 0]));
        assert!(r.pop(&mut out) && out[0] == 99);
        assert_eq!((r.unreleased(), r.unpublished()), (None, None));
    }

    #[test]
    fn fifo_full_and_empty() {
        let mut mem = heap_ring::<3>(4);
        let r = ring_in::<3>(&mut mem, 4);
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
        let mut mem = heap_ring::<2>(64);
        let base = (mem.as_mut_ptr() as usize + 127) & !127;
        // SAFETY: as above; the threads end before `mem` is dropped.
        unsafe { Ring::<2>::at(base as *mut u8, 64) }.init();
        let per = 20_000u64;
        let got = std::thread::scope(|s| {
            for t in 0..2u64 {
                s.spawn(move || {
                    // SAFETY: as above.
                    let r = unsafe { Ring::<2>::at(base as *mut u8, 64) };
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
                        let r = unsafe { Ring::<2>::at(base as *mut u8, 64) };
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
        slots: Vec<Slot<3>>,
    }

    fn owned(cap: usize) -> Arc<Owned> {
        Arc::new(Owned {
            head: RingHead::new(),
            slots: (0..cap as u64).map(Slot::new).collect(),
        })
    }

    /// A record as producer `t` of `loom_ring_mpmc` wrote it, nothing past its length read.
    fn check(out: &[u64; 3]) {
        match out[0] {
            1 => assert_eq!(*out, [1, 2, 0]),
            2 => assert_eq!(*out, [2, 3, 20]),
            t => panic!("record of producer {t}"),
        }
    }

    /// A producer that announces its claims publishes concurrently with an owner that looks
    /// for dead claims and takes the announcement as the sign of a live claimer: the owner
    /// never voids a record that is being published, and the record arrives whole.
    #[test]
    fn loom_owner_never_voids_a_live_claim() {
        loom::model(|| {
            let o = owned(2);
            let hz = Arc::new(loom::sync::atomic::AtomicU64::new(0));
            let (o2, hz2) = (o.clone(), hz.clone());
            let p = loom::thread::spawn(move || {
                let r = Ring::new(&o2.head, &o2.slots);
                let set = |v| hz2.store(v, Ordering::SeqCst);
                assert!(r.push_as(&[7, 8, 9], Some((1, set))));
            });
            let r = Ring::new(&o.head, &o.slots);
            // The owner's check, as the HCA makes it: a held-up position, no live process
            // announcing it, the position still unpublished: void.
            if let Some(pos) = r.unpublished() {
                if hz.load(Ordering::SeqCst) != claim_tag(1, pos) {
                    r.void(pos);
                }
            }
            p.join().unwrap();
            let mut out = [0u64; 3];
            assert!(r.pop(&mut out));
            assert_eq!(out, [7, 8, 9], "never voided");
        });
    }

    /// Two producers and two consumers on a ring of two slots: every record arrives once, whole
    /// (producer 1's two words, producer 2's three, read as long as the record says).
    #[test]
    fn loom_ring_mpmc() {
        loom::model(|| {
            let o = owned(2);
            let prods: Vec<_> = (1..=2u64)
                .map(|t| {
                    let o = o.clone();
                    loom::thread::spawn(move || {
                        let r = Ring::new(&o.head, &o.slots);
                        let rec = [t, 1 + t, t * 10];
                        while !r.push(&rec[..1 + t as usize]) {
                            loom::thread::yield_now();
                        }
                    })
                })
                .collect();
            let o2 = o.clone();
            let c = loom::thread::spawn(move || {
                let r = Ring::new(&o2.head, &o2.slots);
                let mut out = [0u64; 3];
                if r.pop_by(&mut out, |n| n as usize) {
                    check(&out);
                    out[0]
                } else {
                    0
                }
            });
            for p in prods {
                p.join().unwrap();
            }
            let first = c.join().unwrap();
            let r = Ring::new(&o.head, &o.slots);
            let mut rest = vec![];
            let mut out = [0u64; 3];
            while r.pop_by(&mut out, |n| n as usize) {
                check(&out);
                rest.push(out[0]);
                out = [0; 3];
            }
            if first != 0 {
                rest.push(first);
            }
            rest.sort();
            assert_eq!(rest, vec![1, 2]);
        });
    }
}

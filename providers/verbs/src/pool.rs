//! A registered array of equal slots: the receive and send buffers, eager rings and mirrors the
//! verbs providers post from. The memory is device memory (`alloc_dm`) where asked for and the
//! HCA has enough — on the soft HCA a peer's requester then writes it with plain stores instead
//! of Cross-Memory Attach — else host words (8-byte aligned, so eager-ring flags are).

use crate::{Access, Dm, Hca, Mr, Pd, Sge};
use weft_provider::Result;

/// Where a pool's memory comes from.
enum Backing {
    Host(#[allow(dead_code)] Box<[u64]>),
    Device(Dm),
}

/// A registered array of equal slots. Must be [`Pool::release`]d on the HCA it came from
/// (after the QPs that use it are gone); dropping it without frees host memory only.
pub struct Pool {
    base: *mut u8,
    len: usize,
    backing: Backing,
    mr: Mr,
    slot: usize,
    /// Slots not in use; the owner hands them out.
    pub free: Vec<u32>,
}

impl Pool {
    /// `n` slots of `slot` bytes for local use (receives and sends); in device memory when
    /// `device` and the HCA has enough.
    pub fn new(hca: &dyn Hca, pd: Pd, n: usize, slot: usize, device: bool) -> Result<Pool> {
        Self::with_access(hca, pd, n, slot, device, Access::LOCAL_WRITE)
    }

    /// One region of `len` bytes peers may write (an eager ring). Such a pool is reached
    /// through raw pointers only ([`Pool::base`]), never [`Pool::buf`].
    pub fn remote(hca: &dyn Hca, pd: Pd, len: usize, device: bool) -> Result<Pool> {
        let a = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        Self::with_access(hca, pd, 1, len, device, a)
    }

    fn with_access(
        hca: &dyn Hca,
        pd: Pd,
        n: usize,
        slot: usize,
        device: bool,
        access: Access,
    ) -> Result<Pool> {
        let len = n * slot;
        let backing = match device.then(|| hca.alloc_dm(len)) {
            Some(Ok(dm)) => Backing::Device(dm),
            _ => Backing::Host(vec![0u64; len.div_ceil(8)].into_boxed_slice()),
        };
        let base = match &backing {
            Backing::Host(b) => b.as_ptr() as *mut u8,
            Backing::Device(d) => d.ptr,
        };
        // SAFETY: the memory lives in the pool and never moves; the pool is deregistered
        // (`release`, called by its owner after the QPs using it are destroyed) before the
        // memory is freed.
        let mr = match unsafe { hca.reg_mr(pd, base, len, access) } {
            Ok(mr) => mr,
            Err(e) => {
                if let Backing::Device(d) = backing {
                    let _ = hca.free_dm(d);
                }
                return Err(e);
            }
        };
        Ok(Pool {
            base,
            len,
            backing,
            mr,
            slot,
            free: (0..n as u32).rev().collect(),
        })
    }

    /// The registration.
    pub fn mr(&self) -> Mr {
        self.mr
    }

    /// First byte (for pools peers write, which are read through raw pointers only).
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Bytes of the whole pool.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of one slot.
    pub fn slot(&self) -> usize {
        self.slot
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of host memory the pool holds (device memory is in the HCA's accounting).
    pub fn host_bytes(&self) -> usize {
        match self.backing {
            Backing::Host(_) => self.len,
            Backing::Device(_) => 0,
        }
    }

    /// The scatter entry of `len` bytes at the start of slot `i`.
    pub fn sge(&self, i: u32, len: usize) -> Sge {
        self.mr.sge(i as usize * self.slot, len)
    }

    /// Slot `i`, to fill or read. Panics if the pool has no slot `i`.
    ///
    /// # Safety
    /// While the slice lives, the HCA must not write the slot (a posted receive, a peer's
    /// write into a pool registered for one, [`Pool::remote`]) nor read it (a posted send not
    /// yet completed): the caller owns the slot, between its completion and its next post.
    pub unsafe fn buf(&mut self, i: u32) -> &mut [u8] {
        let s = self.slot;
        assert!(
            (i as usize + 1) * s <= self.len,
            "slot {i} outside its pool"
        );
        // SAFETY: bytes of the pool's memory (host words or device memory, mapped for as long
        // as the pool lives); the slot lies within it (checked above) and only it is borrowed
        // (the `&mut self` receiver excludes other borrows of the pool). Other slots may be in
        // the HCA's hands; this one is not (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.base.add(i as usize * s), s) }
    }

    /// The first `n` bytes of slot `i` (at most the slot), read-only. Panics if the pool has
    /// no slot `i`.
    ///
    /// # Safety
    /// While the slice lives, the HCA must not write the slot (as for [`Pool::buf`]; a send
    /// in flight may read it).
    pub unsafe fn bytes(&self, i: u32, n: usize) -> &[u8] {
        let s = self.slot;
        assert!(
            (i as usize + 1) * s <= self.len,
            "slot {i} outside its pool"
        );
        // SAFETY: as in `buf`, shared and read-only.
        unsafe { std::slice::from_raw_parts(self.base.add(i as usize * s), n.min(s)) }
    }

    /// Deregister and give device memory back (the owner's Drop, its QPs already gone).
    pub fn release(&self, hca: &dyn Hca) {
        let _ = hca.dereg_mr(self.mr);
        if let Backing::Device(d) = &self.backing {
            let _ = hca.free_dm(*d);
        }
    }
}

/// Equal slots in chunks made as they are needed, up to a limit: the send pool of a channel
/// that only a few peers use (verbs-rc in the hybrid), which grows as sends need buffers, as
/// MVAPICH's buffer pools grow by secondary pools. Slot `i` lives in chunk `i >> shift`; every
/// chunk but a [`Chunked::fixed`] pool's only one holds `1 << shift` slots. Must be
/// [`Chunked::release`]d as a [`Pool`] is.
pub struct Chunked {
    chunks: Vec<Pool>,
    shift: u32,
    /// Slots there may be at most.
    max: usize,
    slot: usize,
    device: bool,
    /// Slots not in use; the owner hands them out (a new chunk's are not added: see
    /// [`Chunked::grow`]).
    pub free: Vec<u32>,
}

impl Chunked {
    /// `n` slots at once, never more (one chunk).
    pub fn fixed(hca: &dyn Hca, pd: Pd, n: usize, slot: usize, device: bool) -> Result<Chunked> {
        let mut p = Pool::new(hca, pd, n, slot, device)?;
        let free = std::mem::take(&mut p.free);
        Ok(Chunked {
            chunks: vec![p],
            shift: n.max(1).next_power_of_two().trailing_zeros(),
            max: n,
            slot,
            device,
            free,
        })
    }

    /// One chunk of `chunk` slots now (rounded down to a power of two, at most `max`), more
    /// by [`Chunked::grow`] up to `max` slots (rounded down to whole chunks: a queue sized
    /// for `max` takes them all).
    pub fn growing(
        hca: &dyn Hca,
        pd: Pd,
        chunk: usize,
        max: usize,
        slot: usize,
        device: bool,
    ) -> Result<Chunked> {
        let floor2 = |n: usize| 1usize << (usize::BITS - 1 - n.max(1).leading_zeros());
        let chunk = floor2(chunk.min(max));
        let mut p = Pool::new(hca, pd, chunk, slot, device)?;
        let free = std::mem::take(&mut p.free);
        Ok(Chunked {
            chunks: vec![p],
            shift: chunk.trailing_zeros(),
            max: max.max(chunk) / chunk * chunk,
            slot,
            device,
            free,
        })
    }

    /// Slots made so far.
    pub fn slots(&self) -> usize {
        match self.chunks.as_slice() {
            [one] => one.len() / self.slot,
            c => c.len() << self.shift,
        }
    }

    /// Slots there may be at most.
    pub fn max_slots(&self) -> usize {
        self.max
    }

    /// Chunks made so far.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Whether [`Chunked::grow`] may add a chunk.
    pub fn can_grow(&self) -> bool {
        self.slots() < self.max
    }

    /// Bytes of one slot.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Grow no more (the memory for a chunk could not be had).
    pub fn stop_growing(&mut self) {
        self.max = self.slots();
    }

    /// Make one more chunk (if [`Chunked::can_grow`]) and return its slots, which the owner
    /// posts (receives) or adds to [`Chunked::free`] (sends). An empty range at the limit.
    pub fn grow(&mut self, hca: &dyn Hca, pd: Pd) -> Result<std::ops::Range<u32>> {
        if !self.can_grow() {
            return Ok(0..0);
        }
        let first = self.slots() as u32;
        let p = Pool::new(hca, pd, 1 << self.shift, self.slot, self.device)?;
        self.chunks.push(p);
        Ok(first..self.slots() as u32)
    }

    /// Slot `i`'s chunk and its index there.
    #[inline]
    fn at(&self, i: u32) -> (usize, u32) {
        ((i >> self.shift) as usize, i & ((1u32 << self.shift) - 1))
    }

    /// Bytes of host memory the chunks hold (device memory is in the HCA's accounting).
    pub fn host_bytes(&self) -> usize {
        self.chunks.iter().map(Pool::host_bytes).sum()
    }

    /// The scatter entry of `len` bytes at the start of slot `i`.
    #[inline]
    pub fn sge(&self, i: u32, len: usize) -> Sge {
        let (c, j) = self.at(i);
        self.chunks[c].sge(j, len)
    }

    /// Slot `i`, as [`Pool::buf`].
    ///
    /// # Safety
    /// As for [`Pool::buf`].
    #[inline]
    pub unsafe fn buf(&mut self, i: u32) -> &mut [u8] {
        let (c, j) = self.at(i);
        // SAFETY: slot `i` is slot `j` of chunk `c`; the caller's contract carries over.
        unsafe { self.chunks[c].buf(j) }
    }

    /// The first `n` bytes of slot `i`, as [`Pool::bytes`].
    ///
    /// # Safety
    /// As for [`Pool::bytes`].
    #[inline]
    pub unsafe fn bytes(&self, i: u32, n: usize) -> &[u8] {
        let (c, j) = self.at(i);
        // SAFETY: as in `buf`.
        unsafe { self.chunks[c].bytes(j, n) }
    }

    /// Deregister every chunk and give device memory back, as [`Pool::release`].
    pub fn release(&self, hca: &dyn Hca) {
        for c in &self.chunks {
            c.release(hca);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_and_accounted() {
        let hca = crate::open_device("soft").unwrap();
        let pd = hca.alloc_pd().unwrap();
        let before = hca.accounting();
        let mut host = Pool::new(&*hca, pd, 4, 64, false).unwrap();
        let dev = Pool::new(&*hca, pd, 2, 4096, true).unwrap();
        assert_eq!(host.host_bytes(), 256);
        assert_eq!(host.len(), 256);
        assert_eq!(dev.host_bytes(), 0, "device pool in HCA memory");
        assert_eq!(hca.accounting().dm_bytes - before.dm_bytes, 8192);
        // SAFETY (the three): no slot of the pool is posted in this test.
        unsafe { host.buf(1) }.fill(7);
        assert!(unsafe { host.bytes(0, 64) }.iter().all(|&b| b == 0));
        let one = unsafe { host.bytes(1, 100) };
        assert!(one.len() == 64 && one.iter().all(|&b| b == 7));
        assert_eq!(host.sge(3, 8).addr, host.mr().sge(192, 8).addr);
        assert_eq!(host.free, vec![3, 2, 1, 0]);
        host.release(&*hca);
        dev.release(&*hca);
        assert_eq!(hca.accounting(), before);
    }

    #[test]
    fn a_chunked_pool_grows_to_its_limit_and_keeps_slots_apart() {
        let hca = crate::open_device("soft").unwrap();
        let pd = hca.alloc_pd().unwrap();
        let before = hca.accounting();
        // Asked for 5 and at most 14: chunks of 4, at most 12.
        let mut p = Chunked::growing(&*hca, pd, 5, 14, 64, false).unwrap();
        assert_eq!((p.slots(), p.max_slots(), p.chunks()), (4, 12, 1));
        assert_eq!(p.free, vec![3, 2, 1, 0]);
        assert_eq!(p.host_bytes(), 256);
        assert_eq!(p.grow(&*hca, pd).unwrap(), 4..8);
        assert_eq!(p.grow(&*hca, pd).unwrap(), 8..12);
        assert!(!p.can_grow());
        assert_eq!(p.grow(&*hca, pd).unwrap(), 0..0, "no chunk past the limit");
        assert_eq!((p.slots(), p.chunks(), p.host_bytes()), (12, 3, 768));
        assert_eq!(
            p.free.len(),
            4,
            "a new chunk's slots are the owner's to hand out"
        );
        for i in 0..12u32 {
            // SAFETY: no slot of the pool is posted in this test.
            unsafe { p.buf(i) }.fill(i as u8 + 1);
        }
        for i in 0..12u32 {
            // SAFETY: as above.
            let b = unsafe { p.bytes(i, 64) };
            assert!(b.iter().all(|&b| b == i as u8 + 1), "slot {i}");
            assert_eq!(p.sge(i, 8).length, 8);
        }
        // Slots of different chunks are in different registrations; within one, adjacent.
        assert_eq!(p.sge(5, 8).addr, p.sge(4, 8).addr + 64);
        assert_ne!(p.sge(4, 8).lkey, p.sge(3, 8).lkey);
        p.release(&*hca);
        assert_eq!(hca.accounting(), before);
        // Chunks no larger than the limit.
        let q = Chunked::growing(&*hca, pd, 16, 6, 8, false).unwrap();
        assert_eq!((q.slots(), q.max_slots()), (4, 4));
        q.release(&*hca);
        // A fixed pool: exactly what was asked for, never more.
        let mut f = Chunked::fixed(&*hca, pd, 5, 32, false).unwrap();
        assert_eq!((f.slots(), f.max_slots(), f.host_bytes()), (5, 5, 160));
        assert!(!f.can_grow());
        assert_eq!(f.grow(&*hca, pd).unwrap(), 0..0);
        // SAFETY (both): nothing is posted in this test.
        unsafe { f.buf(4) }.fill(9);
        assert!(unsafe { f.bytes(4, 32) }.iter().all(|&b| b == 9));
        f.release(&*hca);
        assert_eq!(hca.accounting(), before);
    }
}

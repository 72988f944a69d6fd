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

    /// Slot `i`, which must not be posted (receive) or read by the HCA (send) meanwhile.
    /// Not for a pool peers write ([`Pool::remote`]).
    pub fn buf(&mut self, i: u32) -> &mut [u8] {
        let s = self.slot;
        assert!(
            (i as usize + 1) * s <= self.len,
            "slot {i} outside its pool"
        );
        // SAFETY: bytes of the pool's memory (host words or device memory, mapped for as long
        // as the pool lives); the slot lies within it (checked above) and only it is borrowed
        // (the `&mut self` receiver excludes other borrows of the pool). Other slots may be in
        // the HCA's hands; the owner touches a receive slot only between its completion and
        // its repost, and a send slot only while no post of it is outstanding. Pools peers may
        // write are registered with remote rights and never read through here.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(i as usize * s), s) }
    }

    /// The first `n` bytes of slot `i` (at most the slot), read-only; as [`Pool::buf`].
    pub fn bytes(&self, i: u32, n: usize) -> &[u8] {
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
        host.buf(1).fill(7);
        assert!(host.bytes(0, 64).iter().all(|&b| b == 0));
        assert!(host.bytes(1, 100).len() == 64 && host.bytes(1, 64).iter().all(|&b| b == 7));
        assert_eq!(host.sge(3, 8).addr, host.mr().sge(192, 8).addr);
        assert_eq!(host.free, vec![3, 2, 1, 0]);
        host.release(&*hca);
        dev.release(&*hca);
        assert_eq!(hca.accounting(), before);
    }
}

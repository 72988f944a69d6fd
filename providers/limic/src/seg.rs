//! The limic segment: one per host and job, created by local rank 0 (mode 0600, named after the
//! job), mapped by the others and unlinked before `open` returns. It holds, per local rank, an
//! *area*: liveness, the matching lock and the two queues of the LiMIC design (posted receives
//! and unexpected sends, linked lists of descriptor slots), a completion sequence number, the
//! active-message ring, the table of registered memory regions, and the rank's own descriptor
//! slots. Every field other ranks read is an atomic; inline payload bytes are ordered by the
//! slot state (written before a release store, read after an acquire load).

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use weft::shmem::{Mapping, RankSlot};
use weft::{Error, ErrorDetail, Result};

pub const MAGIC: u64 = 0x5745_4654_4c49_4d31; // "WEFTLIM1"

/// Iovec entries a descriptor carries (more are packed by the core).
pub const MAX_IOV: usize = 16;
/// Registered regions per rank.
pub const MAX_REGIONS: usize = 256;
/// No slot / end of a list.
pub const NIL: u32 = u32::MAX;
/// Wildcard source in a posted receive.
pub const ANY_SRC: u32 = u32::MAX;
/// Wildcard tag in a posted receive.
pub const ANY_TAG: i64 = -1;

/// Slot states.
pub const FREE: u32 = 0;
pub const POSTED: u32 = 1;
pub const CLAIMED: u32 = 2;
pub const DONE: u32 = 3;
/// A posted receive that a sender matched and left for the receiver to pull: `matched` names
/// the sender's descriptor.
pub const MATCHED: u32 = 4;

/// Slot kinds.
pub const SEND: u32 = 1;
pub const RECV: u32 = 2;

/// Completion errors written into `st_err`.
pub const E_OK: u32 = 0;
/// The copy failed because the owner's memory was not accessible (EFAULT).
pub const E_FAULT: u32 = 1;
/// The other side died during the copy.
pub const E_PEER: u32 = 2;

#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: u64,
    pub nlocal: u64,
    pub nslots: u64,
    pub inline_max: u64,
    pub am_cells: u64,
    pub am_payload: u64,
    pub total: u64,
    pub mapped: AtomicU64,
}

/// A spin lock word in shared memory: 0 free, else the holder's local rank + 1.
#[repr(C, align(64))]
pub struct Lock {
    pub word: AtomicU32,
}

#[repr(C, align(64))]
pub struct Queues {
    pub posted_head: AtomicU32,
    pub posted_tail: AtomicU32,
    pub unexp_head: AtomicU32,
    pub unexp_tail: AtomicU32,
}

#[repr(C, align(64))]
pub struct Seq {
    pub v: AtomicU64,
}

/// Producers' side of the active-message ring (under `am_lock`).
#[repr(C, align(64))]
pub struct AmTail {
    pub tail: AtomicU64,
}

/// Where a rank's CMA probe word lives, and what it holds.
#[repr(C, align(64))]
pub struct Probe {
    pub addr: AtomicU64,
    pub cookie: AtomicU64,
}

#[repr(C)]
pub struct Region {
    /// 0: free.
    pub key: AtomicU64,
    pub base: AtomicU64,
    pub len: AtomicU64,
    /// Bit 0 remote read, bit 1 remote write, bit 2 keyed (addresses are offsets).
    pub flags: AtomicU64,
}

pub const R_READ: u64 = 1;
pub const R_WRITE: u64 = 2;
pub const R_KEYED: u64 = 4;

#[repr(C)]
pub struct Area {
    pub live: RankSlot,
    pub lock: Lock,
    pub queues: Queues,
    /// Bumped whenever another rank completes one of this rank's slots.
    pub done: Seq,
    pub am_lock: Lock,
    pub am_tail: AmTail,
    /// Consumer's side of the active-message ring.
    pub am_head: Seq,
    pub probe: Probe,
    pub regions: [Region; MAX_REGIONS],
}

/// A descriptor: a send or a posted receive, owned by the rank whose area holds it.
#[repr(C, align(64))]
pub struct Slot {
    pub state: AtomicU32,
    pub kind: AtomicU32,
    /// Next slot in the queue this one is linked into.
    pub next: AtomicU32,
    /// Local rank copying for this slot while it is CLAIMED.
    pub claimer: AtomicU32,
    /// SEND: the sender's local rank; RECV: the wanted source or ANY_SRC.
    pub src: AtomicU32,
    pub ctx: AtomicU32,
    pub sync: AtomicU32,
    pub niov: AtomicU32,
    /// SEND: the tag; RECV: the wanted tag or ANY_TAG.
    pub tag: AtomicI64,
    /// SEND: message length; RECV: capacity.
    pub len: AtomicU64,
    /// Completion, written by the copier before DONE.
    pub st_src: AtomicU32,
    pub st_err: AtomicU32,
    pub st_tag: AtomicI64,
    pub st_bytes: AtomicU64,
    /// Bytes of `inline` holding data (a small message, in either direction).
    pub inline_len: AtomicU64,
    /// MATCHED receives: the sender's descriptor.
    pub matched: AtomicU32,
    pub _pad: AtomicU32,
    pub iov: [[AtomicU64; 2]; MAX_IOV],
}

pub const SLOT_HDR: usize = std::mem::size_of::<Slot>();

/// Byte offsets of everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub nlocal: usize,
    pub nslots: usize,
    pub inline_max: usize,
    pub am_cells: usize,
    pub am_payload: usize,
    pub slot_size: usize,
    pub cell_size: usize,
    area_stride: usize,
    off_slots: usize,
    off_cells: usize,
    pub total: usize,
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Bytes before the payload in an active-message cell: source, header and payload lengths.
pub const CELL_HDR: usize = 16;
/// Largest active-message header.
pub const AM_HEADER_MAX: usize = 64;

impl Layout {
    pub fn new(
        nlocal: usize,
        nslots: usize,
        inline_max: usize,
        am_cells: usize,
        am_payload: usize,
    ) -> Layout {
        let slot_size = align(SLOT_HDR + inline_max, 64);
        let cell_size = align(CELL_HDR + AM_HEADER_MAX + am_payload, 64);
        let off_slots = align(std::mem::size_of::<Area>(), 4096);
        let off_cells = align(off_slots + nslots * slot_size, 4096);
        let area_stride = align(off_cells + am_cells * cell_size, 4096);
        Layout {
            nlocal,
            nslots,
            inline_max,
            am_cells,
            am_payload,
            slot_size,
            cell_size,
            area_stride,
            off_slots,
            off_cells,
            total: 4096 + area_stride * nlocal,
        }
    }
}

/// The mapped segment with its layout.
pub struct Seg {
    map: Mapping,
    pub lay: Layout,
}

impl Seg {
    pub fn create(name: &str, lay: Layout) -> Result<Seg> {
        let map = Mapping::create(name, lay.total, false)?;
        let s = Seg { map, lay };
        let h = s.header();
        // SAFETY: nobody else maps the object before the bootstrap fence that follows; the
        // header fields other than the atomics are written once, here.
        unsafe {
            let hp = s.map.base() as *mut Header;
            (*hp).version = 1;
            (*hp).nlocal = lay.nlocal as u64;
            (*hp).nslots = lay.nslots as u64;
            (*hp).inline_max = lay.inline_max as u64;
            (*hp).am_cells = lay.am_cells as u64;
            (*hp).am_payload = lay.am_payload as u64;
            (*hp).total = lay.total as u64;
        }
        for r in 0..lay.nlocal {
            let q = &s.area(r).queues;
            for w in [&q.posted_head, &q.posted_tail, &q.unexp_head, &q.unexp_tail] {
                w.store(NIL, Ordering::Relaxed);
            }
        }
        h.magic.store(MAGIC, Ordering::Release);
        Ok(s)
    }

    /// Map the segment local rank 0 created; the layout comes from its header.
    pub fn open(name: &str) -> Result<Seg> {
        let map = Mapping::open(name, 4096, false)?;
        // SAFETY: the header is at offset 0 of a mapping of at least 4096 bytes.
        let h = unsafe { &*(map.base() as *const Header) };
        if h.magic.load(Ordering::Acquire) != MAGIC || h.version != 1 {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "{name} is not a limic segment of this version"
            ))));
        }
        let lay = Layout::new(
            h.nlocal as usize,
            h.nslots as usize,
            h.inline_max as usize,
            h.am_cells as usize,
            h.am_payload as usize,
        );
        if lay.total != h.total as usize || lay.total > map.len() {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "{name}: layout mismatch (another weft version?)"
            ))));
        }
        Ok(Seg { map, lay })
    }

    pub fn header(&self) -> &Header {
        // SAFETY: the header is at offset 0 and lives as long as the mapping.
        unsafe { &*(self.map.base() as *const Header) }
    }

    fn area_base(&self, r: usize) -> *mut u8 {
        debug_assert!(r < self.lay.nlocal);
        // SAFETY: in bounds of the mapping by the layout.
        unsafe { self.map.base().add(4096 + r * self.lay.area_stride) }
    }

    pub fn area(&self, r: usize) -> &Area {
        // SAFETY: each area starts page-aligned inside the mapping; all its fields are atomics
        // (or arrays of them), valid for any bit pattern, zero-initialised by ftruncate.
        unsafe { &*(self.area_base(r) as *const Area) }
    }

    pub fn slot(&self, r: usize, i: usize) -> &Slot {
        debug_assert!(i < self.lay.nslots);
        // SAFETY: slot `i` of area `r` lies inside the mapping (layout); atomics only.
        unsafe {
            &*(self
                .area_base(r)
                .add(self.lay.off_slots + i * self.lay.slot_size) as *const Slot)
        }
    }

    /// The inline payload area of a slot (`inline_max` bytes).
    pub fn slot_inline(&self, r: usize, i: usize) -> *mut u8 {
        // SAFETY: as in `slot`; the inline bytes follow the slot header.
        unsafe {
            self.area_base(r)
                .add(self.lay.off_slots + i * self.lay.slot_size + SLOT_HDR)
        }
    }

    /// Active-message cell `k` of area `r` (`cell_size` bytes).
    pub fn cell(&self, r: usize, k: usize) -> *mut u8 {
        // SAFETY: in bounds by the layout.
        unsafe {
            self.area_base(r)
                .add(self.lay.off_cells + (k % self.lay.am_cells) * self.lay.cell_size)
        }
    }

    /// Count this rank as mapped; the last one removes the name.
    pub fn mark_mapped(&mut self) {
        let n = self.header().mapped.fetch_add(1, Ordering::AcqRel) + 1;
        if n as usize >= self.lay.nlocal {
            self.map.unlink();
        }
    }
}

/// A slot reference: (local rank, slot index).
pub fn sref(rank: usize, slot: usize) -> u32 {
    ((rank as u32) << 16) | slot as u32
}

pub fn sref_parts(r: u32) -> (usize, usize) {
    ((r >> 16) as usize, (r & 0xffff) as usize)
}

/// Hold `lock` (spinning, then yielding). A holder that died is detected through `alive` and
/// its lock taken over, so a crash inside a critical section cannot hang the others.
pub fn lock<'a>(lock: &'a Lock, me: usize, alive: impl Fn(usize) -> bool) -> Guard<'a> {
    let mine = me as u32 + 1;
    let mut spins = 0u32;
    loop {
        match lock
            .word
            .compare_exchange_weak(0, mine, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => return Guard { lock },
            Err(h) => {
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                    if spins % 1024 == 0 && h != 0 && !alive(h as usize - 1) {
                        // The holder died holding the lock: take it over.
                        if lock
                            .word
                            .compare_exchange(h, mine, Ordering::Acquire, Ordering::Relaxed)
                            .is_ok()
                        {
                            tracing::warn!(holder = h - 1, "took over a dead rank's lock");
                            return Guard { lock };
                        }
                    }
                }
            }
        }
    }
}

pub struct Guard<'a> {
    lock: &'a Lock,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.lock.word.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_and_sized() {
        let l = Layout::new(4, 256, 8192, 64, 8192);
        assert_eq!(l.slot_size % 64, 0);
        assert!(l.slot_size >= SLOT_HDR + 8192);
        assert_eq!(l.area_stride % 4096, 0);
        assert_eq!(l.total, 4096 + 4 * l.area_stride);
        assert!(std::mem::size_of::<Area>() <= l.off_slots);
        assert_eq!(sref_parts(sref(3, 700)), (3, 700));
    }

    #[test]
    fn segment_create_open_and_lock() {
        let name = format!(
            "{}-limic-test",
            weft::shmem::object_name(&format!("t{}", std::process::id()), 0)
        );
        let lay = Layout::new(2, 8, 64, 4, 128);
        let mut a = Seg::create(&name, lay).unwrap();
        let mut b = Seg::open(&name).unwrap();
        assert_eq!(b.lay, lay);
        assert_eq!(b.area(1).queues.unexp_head.load(Ordering::Relaxed), NIL);
        a.mark_mapped();
        b.mark_mapped();
        assert!(Mapping::open(&name, 1, false).is_err(), "unlinked");
        {
            let _g = lock(&a.area(0).lock, 0, |_| true);
            assert_eq!(b.area(0).lock.word.load(Ordering::Relaxed), 1);
        }
        // A lock held by a rank that is gone is taken over.
        b.area(0).lock.word.store(2, Ordering::Relaxed);
        let g = lock(&a.area(0).lock, 0, |r| r != 1);
        assert_eq!(a.area(0).lock.word.load(Ordering::Relaxed), 1);
        drop(g);
    }
}

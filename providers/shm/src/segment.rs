//! The per-host shared segment: created by the first local rank (mode 0600, named from the job's
//! kvsname), mapped by the others, and unlinked by the last rank to map it, so a crash after
//! start-up leaves nothing in /dev/shm.

use crate::queue::{Cell, Line, Tails, Unit, CELL_SIZE, UNIT};
use std::sync::atomic::{AtomicU64, Ordering};
use weft_provider::{Error, ErrorDetail, Result};

pub const MAGIC: u64 = 0x5745_4654_5348_4d31; // "WEFTSHM1"
/// Layout version (2: a ring's receiver publishes a cell tail instead of handing cells back).
pub const VERSION: u64 = 2;
/// Bytes before a pair's cells: its [`Tails`], two cache lines.
const TAILS: usize = std::mem::size_of::<Tails>();

/// Queue organisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Ring = 1,
    Mpsc = 2,
}

pub use weft_provider::shmem::{object_name as segment_name, Mapping, RankSlot};

#[repr(C, align(64))]
pub struct Header {
    pub magic: AtomicU64,
    pub version: u64,
    pub nlocal: u64,
    pub ncells: u64,
    pub nunits: u64,
    pub chunk: u64,
    pub kind: u64,
    pub total: u64,
    pub mapped: AtomicU64,
}

/// Offsets of everything in the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub nlocal: usize,
    pub ncells: usize,
    pub nunits: usize,
    pub chunk: usize,
    pub kind: Kind,
    pub bell_words: usize,
    bell_stride: usize,
    off_ranks: usize,
    off_bells: usize,
    off_queues: usize,
    queue_stride: usize,
    off_pairs: usize,
    pair_stride: usize,
    pub total: usize,
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl Layout {
    pub fn new(nlocal: usize, ncells: usize, nunits: usize, chunk: usize, kind: Kind) -> Self {
        let bell_words = nlocal.div_ceil(64).max(1);
        let off_ranks = 4096;
        let off_bells = align(off_ranks + 64 * nlocal, 4096);
        // One word per cache line.
        let bell_stride = 64 * bell_words;
        let off_queues = align(off_bells + bell_stride * nlocal, 4096);
        let queue_stride = match kind {
            Kind::Mpsc => align(64 + ncells * CELL_SIZE, 4096),
            Kind::Ring => 0,
        };
        let off_pairs = align(off_queues + queue_stride * nlocal, 4096);
        let ring_cells = if kind == Kind::Ring { ncells } else { 0 };
        let pair_stride = align(TAILS + ring_cells * CELL_SIZE + nunits * UNIT, 4096);
        let total = off_pairs + pair_stride * nlocal * nlocal;
        Layout {
            nlocal,
            ncells,
            nunits,
            chunk,
            kind,
            bell_words,
            bell_stride,
            off_ranks,
            off_bells,
            off_queues,
            queue_stride,
            off_pairs,
            pair_stride,
            total,
        }
    }
}

/// The message segment: a [`Mapping`] with the queue [`Layout`].
pub struct Segment {
    map: Mapping,
    pub lay: Layout,
}

impl Segment {
    /// Create, size, map and initialise the segment (first local rank).
    pub fn create(name: &str, lay: Layout) -> Result<Segment> {
        let mut seg = Segment {
            map: Mapping::create(name, lay.total, true)?,
            lay,
        };
        seg.init();
        Ok(seg)
    }

    /// Open and map a segment another rank created.
    pub fn open(name: &str) -> Result<Segment> {
        let map = Mapping::open(name, 4096, true)?;
        let mut seg = Segment {
            lay: Layout::new(1, 1, 1, 64, Kind::Ring),
            map,
        };
        seg.lay.total = seg.map.len();
        let h = seg.header();
        if h.magic.load(Ordering::Acquire) != MAGIC || h.version != VERSION {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "shared memory {name} is not an initialised weft segment"
            ))));
        }
        let kind = match h.kind {
            1 => Kind::Ring,
            2 => Kind::Mpsc,
            k => {
                return Err(Error::from(ErrorDetail::Bootstrap(format!(
                    "unknown queue kind {k} in {name}"
                ))))
            }
        };
        let lay = Layout::new(
            h.nlocal as usize,
            h.ncells as usize,
            h.nunits as usize,
            h.chunk as usize,
            kind,
        );
        if lay.total != h.total as usize || lay.total > seg.map.len() {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "shared memory {name} has an inconsistent layout"
            ))));
        }
        seg.lay = lay;
        Ok(seg)
    }

    /// Write the header and free cells (creator only, before anyone else can see it).
    fn init(&mut self) {
        let lay = self.lay;
        for q in 0..lay.nlocal {
            if lay.kind == Kind::Mpsc {
                for (i, c) in self.queue_cells(q).iter().enumerate() {
                    c.seq.store(i as u64, Ordering::Relaxed);
                }
            }
            for s in 0..lay.nlocal {
                if lay.kind == Kind::Ring {
                    for (i, c) in self.pair_cells(s, q).iter().enumerate() {
                        c.seq.store(i as u64, Ordering::Relaxed);
                    }
                }
            }
        }
        // SAFETY: the header is at offset 0 of a fresh mapping nobody else has opened yet (the
        // others open it after the bootstrap fence that follows).
        let h = unsafe { &mut *(self.map.base() as *mut Header) };
        h.version = VERSION;
        h.nlocal = lay.nlocal as u64;
        h.ncells = lay.ncells as u64;
        h.nunits = lay.nunits as u64;
        h.chunk = lay.chunk as u64;
        h.kind = lay.kind as u64;
        h.total = lay.total as u64;
        h.magic.store(MAGIC, Ordering::Release);
    }

    /// Count this rank as mapped; the last one removes the name from /dev/shm.
    pub fn mark_mapped(&mut self) {
        let n = self.header().mapped.fetch_add(1, Ordering::AcqRel) + 1;
        if n as usize >= self.lay.nlocal {
            self.unlink();
        }
    }

    /// Remove the name (idempotent; the mapping stays valid).
    pub fn unlink(&mut self) {
        self.map.unlink();
    }

    pub fn header(&self) -> &Header {
        // SAFETY: offset 0 holds the Header in a mapping of at least 4096 bytes.
        unsafe { &*(self.map.base() as *const Header) }
    }

    /// # Safety (internal)
    /// `off + size_of::<T>() * n` lies inside the mapping and is aligned for T (guaranteed by
    /// `Layout`, whose offsets are multiples of 64 and whose strides are multiples of 64).
    #[inline]
    unsafe fn slice<T>(&self, off: usize, n: usize) -> &[T] {
        debug_assert!(off + std::mem::size_of::<T>() * n <= self.lay.total);
        std::slice::from_raw_parts(self.map.base().add(off) as *const T, n)
    }

    pub fn rank_slot(&self, i: usize) -> &RankSlot {
        assert!(i < self.lay.nlocal);
        // SAFETY: within the rank-slot region (see Layout::new).
        unsafe { &self.slice::<RankSlot>(self.lay.off_ranks + 64 * i, 1)[0] }
    }

    #[inline]
    pub fn bells(&self, receiver: usize) -> &[Line] {
        assert!(receiver < self.lay.nlocal);
        // SAFETY: within the doorbell region.
        unsafe {
            self.slice::<Line>(
                self.lay.off_bells + self.lay.bell_stride * receiver,
                self.lay.bell_words,
            )
        }
    }

    #[inline]
    pub fn queue_enq(&self, receiver: usize) -> &Line {
        assert!(receiver < self.lay.nlocal && self.lay.kind == Kind::Mpsc);
        // SAFETY: within the queue region.
        unsafe { &self.slice::<Line>(self.lay.off_queues + self.lay.queue_stride * receiver, 1)[0] }
    }

    #[inline]
    pub fn queue_cells(&self, receiver: usize) -> &[Cell] {
        assert!(receiver < self.lay.nlocal && self.lay.kind == Kind::Mpsc);
        // SAFETY: within the queue region.
        unsafe {
            self.slice::<Cell>(
                self.lay.off_queues + self.lay.queue_stride * receiver + 64,
                self.lay.ncells,
            )
        }
    }

    #[inline]
    fn pair_off(&self, s: usize, r: usize) -> usize {
        assert!(s < self.lay.nlocal && r < self.lay.nlocal);
        self.lay.off_pairs + self.lay.pair_stride * (s * self.lay.nlocal + r)
    }

    /// The pair's tails: data area and ring (written by the receiver).
    #[inline]
    pub fn pair_tails(&self, s: usize, r: usize) -> &Tails {
        // SAFETY: within the pair region.
        unsafe { &self.slice::<Tails>(self.pair_off(s, r), 1)[0] }
    }

    #[inline]
    pub fn pair_cells(&self, s: usize, r: usize) -> &[Cell] {
        let n = if self.lay.kind == Kind::Ring {
            self.lay.ncells
        } else {
            0
        };
        // SAFETY: within the pair region.
        unsafe { self.slice::<Cell>(self.pair_off(s, r) + TAILS, n) }
    }

    #[inline]
    pub fn pair_data(&self, s: usize, r: usize) -> &[Unit] {
        let cells = if self.lay.kind == Kind::Ring {
            self.lay.ncells
        } else {
            0
        };
        // SAFETY: within the pair region.
        unsafe {
            self.slice::<Unit>(
                self.pair_off(s, r) + TAILS + cells * CELL_SIZE,
                self.lay.nunits,
            )
        }
    }
}

// Over 800 lines: its unit tests, below the code (which is under 800), test it through its private state.
//! The lock-free shared-memory protocols of the `shm` provider.
//!
//! * **Cells** carry one active message each: a sequence word, the metadata, and up to
//!   [`INLINE`] bytes of header + payload. The sequence word is the flag that "rides with the
//!   data": a cell at position `p` is free when `seq == p`, full when `seq == p + 1`, and the
//!   receiver frees it by storing `p + n` (Vyukov's bounded queue). A receiver therefore never
//!   reads a shared head pointer, and stale bytes can never look like a message.
//! * Cells are organised either as one **SPSC ring per ordered pair** (`ring`) or as one
//!   **MPSC queue per receiver** (`mpsc`, senders reserve positions with a CAS).
//! * In a ring the receiver never writes a cell: it publishes how many messages it has
//!   consumed (the ring's *cell tail*, next to the data tail), lazily like the data tail, and the
//!   sender reads it only when its cached copy says the ring is full. A ping-pong message then
//!   costs the sender no read of a line the receiver wrote last, and the receiver no store
//!   ahead of its reply's in the store buffer. (The MPSC queue keeps Vyukov's hand-back, which
//!   its senders' position reservation needs.)
//! * Payloads that do not fit inline go to the pair's **data area** — the RDMA-channel ring:
//!   fixed 64-byte units, a private head at the sender and a tail the receiver publishes
//!   *lazily*, once a quarter of the area has been consumed; the sender re-reads the tail only
//!   when its cached copy says the area is full. While the receiver copies chunk k out, the
//!   sender fills chunk k+1.
//! * With `ring`, a per-receiver **doorbell** bitmask names the peers with traffic, so polling
//!   costs O(active peers), not O(peers). A sender sets its bit only when it is clear; a
//!   receiver clears it only after the ring has been idle, then re-checks the ring. SeqCst fences
//!   on both sides rule out the lost wake-up (model-checked with loom below).

use crate::sync::{fence, AtomicU64, Ordering, UnsafeCell};
use std::borrow::Cow;
use weft_provider::bytes::copy_small;

/// Bytes per cell.
pub const CELL_SIZE: usize = 256;
/// Header + payload bytes a cell holds inline.
pub const INLINE: usize = CELL_SIZE - 8 - std::mem::size_of::<Meta>();
/// Granule of the data area.
pub const UNIT: usize = 64;

/// Payload is in the pair's data area, not inline.
pub const F_EXT: u16 = 1;

/// Metadata of a message in a cell.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Sender's local index.
    pub src: u32,
    pub hdr_len: u16,
    pub flags: u16,
    /// Payload bytes.
    pub len: u32,
    /// First unit of the payload in the data area (with `F_EXT`).
    pub data_off: u32,
    /// Absolute data-area position (in units) just past this payload (with `F_EXT`).
    pub data_end: u64,
}

/// One message slot.
#[repr(C, align(64))]
pub struct Cell {
    pub seq: AtomicU64,
    meta: UnsafeCell<Meta>,
    inline: UnsafeCell<[u8; INLINE]>,
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Cell>() == CELL_SIZE);

impl Cell {
    /// A free cell for position `pos` (cells in the segment are initialised in place instead).
    #[cfg_attr(not(loom), allow(dead_code))]
    pub fn new(pos: u64) -> Self {
        Cell {
            seq: AtomicU64::new(pos),
            meta: UnsafeCell::new(Meta::default()),
            inline: UnsafeCell::new([0; INLINE]),
        }
    }
}

/// A counter alone on its cache line.
#[repr(C, align(64))]
pub struct Line {
    pub v: AtomicU64,
}

/// What a pair's receiver publishes to the sender, each counter alone on its line: the data
/// area's tail (in units) and, for a ring, the count of consumed messages.
#[repr(C)]
pub struct Tails {
    pub data: Line,
    pub cells: Line,
}

impl Tails {
    #[cfg_attr(not(loom), allow(dead_code))]
    pub fn new() -> Self {
        Tails {
            data: Line::new(0),
            cells: Line::new(0),
        }
    }
}

impl Line {
    #[cfg_attr(not(loom), allow(dead_code))]
    pub fn new(v: u64) -> Self {
        Line {
            v: AtomicU64::new(v),
        }
    }
}

/// One 64-byte granule of a data area.
pub type Unit = UnsafeCell<[u8; UNIT]>;

/// Sender-private state towards one receiver.
#[derive(Debug, Default, Clone)]
pub struct SendState {
    /// Next cell position (SPSC ring only).
    pub pos: u64,
    /// Next free data unit (absolute).
    pub data_head: u64,
    /// Last tail read from the receiver.
    pub tail_cache: u64,
    /// Ring only: the receiver's consumed-message count, as last read.
    pub cells_cache: u64,
}

/// Receiver-private state for one sender's data area (and, with rings, its ring).
#[derive(Debug, Default, Clone)]
pub struct DataState {
    pub consumed: u64,
    pub published: u64,
    /// Ring only: messages consumed, and the count last published in the cell tail.
    pub cells: u64,
    pub cells_published: u64,
}

/// Where a message's payload goes.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    start: u64,
    end: u64,
}

/// Units needed for `len` bytes.
#[inline]
fn units(len: usize) -> u64 {
    len.div_ceil(UNIT) as u64
}

/// Plan room for `len` payload bytes in `data` after `st.data_head`, wrapping to the start when
/// the payload would not be contiguous. `None` when there is no room even after re-reading the
/// receiver's tail.
pub fn plan(data: &[Unit], st: &mut SendState, tail: &Line, len: usize) -> Option<Plan> {
    plan_in(data.len() as u64, st, tail, len)
}

/// Whether a data area of `ring` bytes carries every payload of up to `chunk` bytes: `plan`
/// never reserves more than half the area (so a payload that would wrap always fits at the
/// start once the receiver has caught up), in whole units. The configuration check and the
/// automatic shrinking of rings use this, the planner's own arithmetic.
pub fn ring_fits(ring: usize, chunk: usize) -> bool {
    ((ring / UNIT) as u64) / 2 >= units(chunk)
}

/// `plan` over a data area of `n` units.
fn plan_in(n: u64, st: &mut SendState, tail: &Line, len: usize) -> Option<Plan> {
    let need = units(len);
    if need > n / 2 {
        return None;
    }
    let off = st.data_head % n;
    let start = if off + need > n {
        st.data_head + (n - off)
    } else {
        st.data_head
    };
    let end = start + need;
    // Wrapping: a tail ahead of us (written by a peer that scribbled on the segment) reads as
    // a full area, not as an overflow.
    if end.wrapping_sub(st.tail_cache) > n {
        st.tail_cache = tail.v.load(Ordering::Acquire);
        if end.wrapping_sub(st.tail_cache) > n {
            return None;
        }
    }
    Some(Plan { start, end })
}

/// Copy `parts` into the data area at `p` (no wrap inside one payload).
fn write_data(data: &[Unit], p: Plan, parts: &[&[u8]]) {
    let n = data.len() as u64;
    let first = (p.start % n) as usize;
    #[cfg(not(loom))]
    {
        let base = data[first].with_mut(|x| x as *mut u8);
        let mut at = 0usize;
        for part in parts {
            // SAFETY: [start, end) was reserved by `plan` against the receiver's tail, so no
            // reader looks at these units until the cell announcing them is published; the units
            // are contiguous (repr(transparent) cells in one array) and the total fits because
            // `plan` sized the reservation from the same lengths.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), base.add(at), part.len()) };
            at += part.len();
        }
    }
    #[cfg(loom)]
    {
        let mut bytes = Vec::new();
        for part in parts {
            bytes.extend_from_slice(part);
        }
        for (k, chunk) in bytes.chunks(UNIT).enumerate() {
            data[first + k]
                .with_mut(|u| unsafe { (&mut *u)[..chunk.len()].copy_from_slice(chunk) });
        }
    }
}

/// Fill a reserved cell and publish it at `pos`.
fn fill(cell: &Cell, pos: u64, meta: Meta, hdr: &[u8], inline_parts: &[&[u8]]) {
    // SAFETY: the cell at `pos` is ours: in a ring the receiver has published that it consumed
    // position `pos - n` (see `ring_send`), in the MPSC queue we reserved `pos` against seq ==
    // pos. No other thread writes it, and a reader reads meta/inline only after seeing seq ==
    // pos + 1, which we publish last.
    cell.meta.with_mut(|m| unsafe { *m = meta });
    cell.inline.with_mut(|b| {
        let b = unsafe { &mut *b };
        // A small message's header and payload: inline copies, no calls into memcpy.
        copy_small(b, hdr);
        let mut at = hdr.len();
        for p in inline_parts {
            copy_small(&mut b[at..], p);
            at += p.len();
        }
    });
    cell.seq.store(pos + 1, Ordering::Release);
}

/// Build the metadata and decide inline vs. data area. `None`: no data-area room.
fn prepare(
    data: &[Unit],
    st: &mut SendState,
    tail: &Line,
    src: u32,
    hdr: &[u8],
    total: usize,
) -> Option<(Meta, Option<Plan>)> {
    let mut meta = Meta {
        src,
        hdr_len: hdr.len() as u16,
        flags: 0,
        len: total as u32,
        data_off: 0,
        data_end: 0,
    };
    if hdr.len() + total <= INLINE {
        return Some((meta, None));
    }
    let p = plan(data, st, tail, total)?;
    meta.flags = F_EXT;
    meta.data_off = (p.start % data.len() as u64) as u32;
    meta.data_end = p.end;
    Some((meta, Some(p)))
}

/// SPSC ring send. `false` means Busy (no free cell or no data room); nothing was written.
///
/// The cell at `pos` is free once the receiver has consumed position `pos - n`: the sender
/// knows it from the published cell tail (re-read only when the cached one says full), not
/// from the cell. The tail's Acquire pairs with the receiver's Release after its last read of
/// those cells. A tail that is not a count this sender could have reached (a scribbling peer)
/// reads as a full ring.
#[allow(clippy::too_many_arguments)]
pub fn ring_send(
    cells: &[Cell],
    data: &[Unit],
    tails: &Tails,
    st: &mut SendState,
    src: u32,
    hdr: &[u8],
    parts: &[&[u8]],
    total: usize,
) -> bool {
    let n = cells.len() as u64;
    if st.pos.wrapping_sub(st.cells_cache) >= n {
        st.cells_cache = tails.cells.v.load(Ordering::Acquire);
        if st.pos.wrapping_sub(st.cells_cache) >= n {
            return false;
        }
    }
    let cell = &cells[(st.pos % n) as usize];
    let Some((meta, plan)) = prepare(data, st, &tails.data, src, hdr, total) else {
        return false;
    };
    match plan {
        Some(p) => {
            write_data(data, p, parts);
            st.data_head = p.end;
            fill(cell, st.pos, meta, hdr, &[]);
        }
        None => fill(cell, st.pos, meta, hdr, parts),
    }
    st.pos += 1;
    true
}

/// MPSC queue send: reserve a position with a CAS on `enq`. `false` means Busy.
#[allow(clippy::too_many_arguments)]
pub fn mpsc_send(
    enq: &Line,
    cells: &[Cell],
    data: &[Unit],
    tail: &Line,
    st: &mut SendState,
    src: u32,
    hdr: &[u8],
    parts: &[&[u8]],
    total: usize,
) -> bool {
    // Plan data room first: a reserved position cannot be given back.
    let Some((meta, plan)) = prepare(data, st, tail, src, hdr, total) else {
        return false;
    };
    let n = cells.len() as u64;
    let mut pos = enq.v.load(Ordering::Relaxed);
    loop {
        let cell = &cells[(pos % n) as usize];
        let seq = cell.seq.load(Ordering::Acquire);
        if seq == pos {
            match enq
                .v
                .compare_exchange(pos, pos + 1, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    match plan {
                        Some(p) => {
                            write_data(data, p, parts);
                            st.data_head = p.end;
                            fill(cell, pos, meta, hdr, &[]);
                        }
                        None => fill(cell, pos, meta, hdr, parts),
                    }
                    return true;
                }
                Err(p) => pos = p,
            }
        } else if seq < pos {
            return false; // full: the cell of the previous lap is not consumed yet
        } else {
            pos = enq.v.load(Ordering::Relaxed);
        }
    }
}

/// A received message, valid until [`release`] is called.
pub struct Received<'a> {
    pub meta: Meta,
    pub hdr: Cow<'a, [u8]>,
    pub payload: Cow<'a, [u8]>,
}

/// Why a full cell could not be read.
#[derive(Debug, PartialEq, Eq)]
pub struct Corrupt(pub &'static str);

/// Look at the cell at `pos`: `None` if it is empty. `data_of(src)` gives the data area of the
/// sender named in the cell. A cell whose metadata does not fit its bounds is `Err(Corrupt)`:
/// it must still be released.
#[inline]
pub fn peek<'a>(
    cells: &'a [Cell],
    pos: u64,
    data_of: impl FnOnce(u32) -> Option<&'a [Unit]>,
) -> Option<Result<Received<'a>, (Meta, Corrupt)>> {
    let n = cells.len() as u64;
    let cell = &cells[(pos % n) as usize];
    if cell.seq.load(Ordering::Acquire) != pos + 1 {
        return None;
    }
    // SAFETY: seq == pos + 1 was published with Release after the sender wrote meta/inline,
    // and the sender does not touch the cell again until we hand it back (store pos + n in the
    // MPSC queue; publish a cell tail past `pos` in a ring).
    let meta = cell.meta.with(|m| unsafe { *m });
    let h = meta.hdr_len as usize;
    let len = meta.len as usize;
    if h > INLINE {
        return Some(Err((meta, Corrupt("header longer than a cell"))));
    }
    let hdr = read_inline(cell, 0, h);
    if meta.flags & F_EXT == 0 {
        if h + len > INLINE {
            return Some(Err((meta, Corrupt("inline payload longer than a cell"))));
        }
        let payload = read_inline(cell, h, len);
        return Some(Ok(Received { meta, hdr, payload }));
    }
    let Some(data) = data_of(meta.src) else {
        return Some(Err((meta, Corrupt("sender index out of range"))));
    };
    let start = meta.data_off as usize;
    if start + units(len) as usize > data.len() {
        return Some(Err((meta, Corrupt("payload outside the data area"))));
    }
    Some(Ok(Received {
        meta,
        hdr,
        payload: read_data(data, start, len),
    }))
}

#[inline]
fn read_inline(cell: &Cell, at: usize, len: usize) -> Cow<'_, [u8]> {
    #[cfg(not(loom))]
    {
        // SAFETY: the cell is full and owned by the reader until released (see `peek`); the
        // range was bounds-checked against INLINE by the caller.
        Cow::Borrowed(cell.inline.with(|b| unsafe { &(&*b)[at..at + len] }))
    }
    #[cfg(loom)]
    {
        Cow::Owned(
            cell.inline
                .with(|b| unsafe { (&*b)[at..at + len].to_vec() }),
        )
    }
}

#[inline]
fn read_data(data: &[Unit], first: usize, len: usize) -> Cow<'_, [u8]> {
    #[cfg(not(loom))]
    {
        let base = data[first].with(|x| x as *const u8);
        // SAFETY: the units [first, first + units(len)) were bounds-checked by `peek`, written
        // before the cell was published (Release/Acquire on seq), and are not reused by the
        // sender before the receiver publishes a tail past them.
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(base, len) })
    }
    #[cfg(loom)]
    {
        let mut v = Vec::with_capacity(len);
        let mut k = first;
        while v.len() < len {
            let take = (len - v.len()).min(UNIT);
            data[k].with(|u| v.extend_from_slice(unsafe { &(&*u)[..take] }));
            k += 1;
        }
        Cow::Owned(v)
    }
}

/// Account a consumed message's data; publishes the data tail lazily (once a quarter of the
/// area has been consumed since the last publication).
#[inline]
fn consume_data(meta: &Meta, ds: &mut DataState, tail: &Line, nunits: usize) {
    if meta.flags & F_EXT != 0 {
        if meta.data_end > ds.consumed {
            ds.consumed = meta.data_end;
        }
        if ds.consumed - ds.published >= (nunits as u64 / 4).max(1) {
            tail.v.store(ds.consumed, Ordering::Release);
            ds.published = ds.consumed;
        }
    }
}

/// MPSC queue: free the cell at `pos` (Vyukov's hand-back) and account its data.
pub fn release(cells: &[Cell], pos: u64, meta: &Meta, ds: Option<(&mut DataState, &Line, usize)>) {
    let n = cells.len() as u64;
    if let Some((ds, tail, nunits)) = ds {
        consume_data(meta, ds, tail, nunits);
    }
    cells[(pos % n) as usize]
        .seq
        .store(pos + n, Ordering::Release);
}

/// Ring: the message just read from the ring is consumed. The cell is not written; the count of
/// consumed messages is published lazily (once a quarter of the ring), and by [`flush_tails`]
/// when the receiver stops reading.
#[inline]
pub fn release_ring(ncells: usize, meta: &Meta, ds: &mut DataState, tails: &Tails, nunits: usize) {
    consume_data(meta, ds, &tails.data, nunits);
    ds.cells += 1;
    if ds.cells - ds.cells_published >= (ncells as u64 / 4).max(1) {
        tails.cells.v.store(ds.cells, Ordering::Release);
        ds.cells_published = ds.cells;
    }
}

/// Publish both tails now (when a receiver goes idle, so a blocked sender can go on).
#[inline]
pub fn flush_tails(ds: &mut DataState, tails: &Tails) {
    if ds.consumed != ds.published {
        tails.data.v.store(ds.consumed, Ordering::Release);
        ds.published = ds.consumed;
    }
    if ds.cells != ds.cells_published {
        tails.cells.v.store(ds.cells, Ordering::Release);
        ds.cells_published = ds.cells;
    }
}

/// Sender side of the doorbell: after publishing a message, make sure the receiver will look.
pub fn ring_bell(bell: &[Line], src: u32) {
    fence(Ordering::SeqCst);
    let w = &bell[(src / 64) as usize];
    let bit = 1u64 << (src % 64);
    if w.v.load(Ordering::Relaxed) & bit == 0 {
        w.v.fetch_or(bit, Ordering::SeqCst);
    }
}

/// Receiver side: stop watching `src` (its ring was idle). After this returns, a message the
/// sender publishes either is visible to the next `peek` or sets the bit again.
pub fn clear_bell(bell: &[Line], src: u32) {
    let bit = 1u64 << (src % 64);
    bell[(src / 64) as usize]
        .v
        .fetch_and(!bit, Ordering::SeqCst);
    fence(Ordering::SeqCst);
}

#[cfg(all(test, not(loom)))]
mod plan_tests {
    use super::*;

    proptest::proptest! {
        /// Every configuration `ring_fits` accepts moves every payload size up to the chunk
        /// through the planner, at every offset the ring reaches, with a receiver that keeps
        /// up (before, `WEFT_SHM_CHUNK=1100 WEFT_SHM_RING=2200` was accepted and every
        /// message over about 1 KiB was Busy for ever).
        #[test]
        fn accepted_configurations_move_every_size(
            chunk in 1usize..(4 << 20),
            // Rings near the boundary (twice the chunk, give or take rounding) and far from it.
            extra in proptest::prop_oneof![0usize..256, 0usize..(8 << 20)],
            below in 0usize..2,
            sizes in proptest::collection::vec(0.0f64..=1.0, 1..64),
        ) {
            let ring = (2 * chunk + extra).saturating_sub(below * 128);
            proptest::prop_assume!(ring_fits(ring, chunk));
            let n = (ring / UNIT) as u64;
            let mut st = SendState::default();
            let tail = Line::new(0);
            // The largest payload first, then random ones.
            for f in std::iter::once(1.0).chain(sizes) {
                let len = ((chunk as f64 * f) as usize).clamp(1, chunk);
                let p = plan_in(n, &mut st, &tail, len);
                proptest::prop_assert!(p.is_some(), "{len} of {chunk} bytes in {ring}");
                let p = p.unwrap();
                st.data_head = p.end;
                // The receiver consumes it at once.
                tail.v.store(p.end, Ordering::Release);
            }
        }
    }

    /// A ring's cell is written again only once the receiver has published that it consumed
    /// it: lazily (a quarter of the ring at a time) or when it flushes on going idle. A tail no
    /// sender could have reached reads as a full ring.
    #[test]
    fn a_ring_cell_is_reused_only_after_the_receiver_publishes_it() {
        let cells: Vec<Cell> = (0..8).map(Cell::new).collect();
        let data: Vec<Unit> = (0..8).map(|_| UnsafeCell::new([0; UNIT])).collect();
        let tails = Tails::new();
        let mut st = SendState::default();
        let mut ds = DataState::default();
        let send =
            |st: &mut SendState, i: u8| ring_send(&cells, &data, &tails, st, 0, &[i], &[], 0);
        for i in 0..8 {
            assert!(send(&mut st, i));
        }
        assert!(!send(&mut st, 8), "a ninth message in eight cells");
        // One consumed, not yet published (a quarter is two): still full.
        let r = peek(&cells, 0, |_| Some(&data[..])).unwrap().unwrap();
        assert_eq!(&*r.hdr, &[0]);
        let meta = r.meta;
        release_ring(cells.len(), &meta, &mut ds, &tails, data.len());
        assert_eq!(tails.cells.v.load(Ordering::Relaxed), 0);
        assert!(!send(&mut st, 8));
        flush_tails(&mut ds, &tails);
        assert!(send(&mut st, 8));
        // The receiver still reads position 1, then position 8 in cell 0 (the next lap).
        let r = peek(&cells, 1, |_| Some(&data[..])).unwrap().unwrap();
        assert_eq!(&*r.hdr, &[1]);
        assert!(peek(&cells, 9, |_| Some(&data[..])).is_none());
        assert_eq!(
            &*peek(&cells, 8, |_| Some(&data[..])).unwrap().unwrap().hdr,
            &[8]
        );
        // A scribbled tail (ahead of the sender, or far behind) stops it; it does not panic.
        for bad in [u64::MAX, 100, 0] {
            tails.cells.v.store(bad, Ordering::Relaxed);
            st.cells_cache = bad;
            assert!(!send(&mut st, 9), "tail {bad}");
        }
    }

    /// A data tail that no receiver could have published (ahead of the sender, from a peer
    /// that scribbled on the segment) reads as a full area: Busy, not a panic. (Counts are
    /// modular: a tail within one area's length behind the sender cannot be told from a true
    /// one, and only the scribbler's own reads suffer from it.)
    #[test]
    fn a_scribbled_data_tail_reads_as_full() {
        let mut st = SendState::default();
        let tail = Line::new(0);
        assert!(plan_in(64, &mut st, &tail, 100).is_some());
        for bad in [u64::MAX / 2, 1 << 40, 3] {
            tail.v.store(bad, Ordering::Relaxed);
            st.tail_cache = bad;
            assert!(plan_in(64, &mut st, &tail, 100).is_none(), "tail {bad}");
        }
    }

    #[test]
    fn the_reported_configuration_is_refused() {
        assert!(!ring_fits(2200, 1100));
        assert!(ring_fits(2304, 1100));
        assert!(ring_fits(512 << 10, 32 << 10));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    struct Pair {
        cells: Vec<Cell>,
        data: Vec<Unit>,
        tails: Tails,
        bell: Vec<Line>,
        enq: Line,
    }

    fn pair(ncells: usize, nunits: usize) -> Arc<Pair> {
        Arc::new(Pair {
            cells: (0..ncells as u64).map(Cell::new).collect(),
            data: (0..nunits).map(|_| UnsafeCell::new([0u8; UNIT])).collect(),
            tails: Tails::new(),
            bell: vec![Line::new(0)],
            enq: Line::new(0),
        })
    }

    fn msg(i: u8, big: bool) -> Vec<u8> {
        vec![i; if big { INLINE + 10 } else { 3 }]
    }

    /// SPSC: messages arrive complete and in order through a 2-cell ring whose data area holds
    /// only one large payload at a time (exercises Busy, wrap and the lazy tail).
    #[test]
    fn spsc_ring_in_order() {
        loom::model(|| {
            let p = pair(2, 12);
            let q = p.clone();
            let prod = thread::spawn(move || {
                let mut st = SendState::default();
                for i in 0..3u8 {
                    let m = msg(i, i != 1);
                    while !ring_send(
                        &q.cells,
                        &q.data,
                        &q.tails,
                        &mut st,
                        0,
                        &[i],
                        &[&m],
                        m.len(),
                    ) {
                        thread::yield_now();
                    }
                }
            });
            let mut pos = 0u64;
            let mut ds = DataState::default();
            let mut got = 0u8;
            while got < 3 {
                let r = peek(&p.cells, pos, |_| Some(&p.data[..]));
                match r {
                    None => thread::yield_now(),
                    Some(Ok(m)) => {
                        assert_eq!(&*m.hdr, &[got]);
                        assert_eq!(&*m.payload, &msg(got, got != 1)[..]);
                        let meta = m.meta;
                        drop(m);
                        release_ring(p.cells.len(), &meta, &mut ds, &p.tails, p.data.len());
                        flush_tails(&mut ds, &p.tails);
                        pos += 1;
                        got += 1;
                    }
                    Some(Err(e)) => panic!("corrupt cell: {e:?}"),
                }
            }
            prod.join().unwrap();
        });
    }

    fn bounded(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(f);
    }

    fn mpsc_consume(p: &Pair, n: usize, mut check: impl FnMut(&Received<'_>)) {
        let mut pos = 0;
        for _ in 0..n {
            loop {
                match peek(&p.cells, pos, |_| None) {
                    None => thread::yield_now(),
                    Some(Ok(m)) => {
                        check(&m);
                        let meta = m.meta;
                        drop(m);
                        release(&p.cells, pos, &meta, None);
                        pos += 1;
                        break;
                    }
                    Some(Err(e)) => panic!("{e:?}"),
                }
            }
        }
    }

    /// MPSC: two producers racing for the same position; both messages arrive once, intact.
    #[test]
    fn mpsc_two_producers() {
        bounded(|| {
            let p = pair(2, 8);
            let mut hs = vec![];
            for src in 0..2u32 {
                let q = p.clone();
                hs.push(thread::spawn(move || {
                    let mut st = SendState::default();
                    let m = [src as u8, 9];
                    while !mpsc_send(
                        &q.enq,
                        &q.cells,
                        &q.data,
                        &q.tails.data,
                        &mut st,
                        src,
                        &[],
                        &[&m],
                        2,
                    ) {
                        thread::yield_now();
                    }
                }));
            }
            let mut seen = [false; 2];
            mpsc_consume(&p, 2, |m| {
                let s = m.payload[0] as usize;
                assert_eq!(m.meta.src as usize, s);
                assert_eq!(m.payload[1], 9);
                assert!(!seen[s], "duplicate from {s}");
                seen[s] = true;
            });
            for h in hs {
                h.join().unwrap();
            }
        });
    }

    /// MPSC: one producer through a 2-cell queue (Busy and wrap-around); order preserved.
    #[test]
    fn mpsc_wraps_in_order() {
        bounded(|| {
            let p = pair(2, 8);
            let q = p.clone();
            let h = thread::spawn(move || {
                let mut st = SendState::default();
                for i in 0..3u8 {
                    while !mpsc_send(
                        &q.enq,
                        &q.cells,
                        &q.data,
                        &q.tails.data,
                        &mut st,
                        0,
                        &[],
                        &[&[i]],
                        1,
                    ) {
                        thread::yield_now();
                    }
                }
            });
            let mut next = 0u8;
            mpsc_consume(&p, 3, |m| {
                assert_eq!(m.payload[0], next);
                next += 1;
            });
            h.join().unwrap();
        });
    }

    /// The doorbell never loses a wake-up: when the receiver stops watching a peer at the same
    /// time as the peer sends, either the receiver's re-check sees the message or the bit is set.
    #[test]
    fn doorbell_no_lost_wakeup() {
        loom::model(|| {
            let p = pair(2, 4);
            p.bell[0].v.store(1, Ordering::SeqCst); // peer 0 is being watched
            let q = p.clone();
            let prod = thread::spawn(move || {
                let mut st = SendState::default();
                assert!(ring_send(
                    &q.cells,
                    &q.data,
                    &q.tails,
                    &mut st,
                    0,
                    &[7],
                    &[],
                    0
                ));
                ring_bell(&q.bell, 0);
            });
            clear_bell(&p.bell, 0);
            let seen = peek(&p.cells, 0, |_| None).is_some();
            prod.join().unwrap();
            let bell = p.bell[0].v.load(Ordering::SeqCst) & 1 != 0;
            assert!(seen || bell, "message published but nobody will look at it");
        });
    }
}

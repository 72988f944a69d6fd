//! One-sided communication, engine side: the active-message protocols that implement RMA when
//! the provider has no native path, and the target-side state of every window (its memory, its
//! lock, the epochs opened on it).
//!
//! Wire formats (first header byte = handler id):
//!
//! | id | message | header fields | payload |
//! |---|---|---|---|
//! | `PUT` | data into a window | win, offset | data |
//! | `GET` | read request | win, offset, len, token | — |
//! | `GET_REPLY` | read data | token, offset | data |
//! | `ACC` | accumulate | win, offset, op, type | origin elements |
//! | `RMW` | get-accumulate, fetch-and-op, compare-and-swap | win, offset, op, type, token, has-compare | origin (+ compare) elements |
//! | `RMW_REPLY` | old values | token | elements |
//! | `POST` / `COMPLETE` | PSCW handshake | win | — |
//! | `LOCK` / `GRANT` | lock request and grant | win, kind, token | — |
//! | `UNLOCK` / `FLUSH` | release / flush; answered by `ACK` once every earlier operation is applied | win, token | — |
//! | `BATCH` | aggregated operations, optionally with a lock before and a sync after | win, flags, tokens | records |
//!
//! Active messages between a pair are delivered in order, so a `COMPLETE`, `UNLOCK` or `FLUSH`
//! is processed after every operation the origin sent before it: no per-operation
//! acknowledgements are needed.

use crate::engine::{Hdr, Out, Rd, State};
use crate::provider::RawIov;
use crate::types::{apply_op, BasicType, Op, Rank};
use crate::{Error, ErrorDetail, Result};
use hashbrown::HashMap;
use std::collections::VecDeque;

pub(crate) const H_PUT: u8 = 16;
pub(crate) const H_GET: u8 = 17;
pub(crate) const H_GET_REPLY: u8 = 18;
pub(crate) const H_ACC: u8 = 19;
pub(crate) const H_RMW: u8 = 20;
pub(crate) const H_RMW_REPLY: u8 = 21;
pub(crate) const H_POST: u8 = 22;
pub(crate) const H_COMPLETE: u8 = 23;
pub(crate) const H_LOCK: u8 = 24;
pub(crate) const H_GRANT: u8 = 25;
pub(crate) const H_UNLOCK: u8 = 26;
pub(crate) const H_FLUSH: u8 = 27;
pub(crate) const H_ACK: u8 = 28;
pub(crate) const H_BATCH: u8 = 29;

/// The exact header length of RMA message `kind` (see the table above), `None` if unknown.
pub(crate) fn header_len(kind: u8) -> Option<usize> {
    Some(match kind {
        H_PUT => 13,
        H_GET => 29,
        H_GET_REPLY => 17,
        H_ACC => 15,
        H_RMW => 24,
        H_RMW_REPLY | H_GRANT | H_ACK => 9,
        H_POST | H_COMPLETE => 5,
        H_LOCK => 14,
        H_UNLOCK | H_FLUSH => 13,
        H_BATCH => 15,
        _ => return None,
    })
}

/// Provider completion tokens with this bit belong to RMA operations.
pub(crate) const RMA_TOKEN: u64 = 1 << 63;

/// Batch flags.
pub(crate) const B_LOCK: u8 = 1;
pub(crate) const B_COMPLETE: u8 = 2;
pub(crate) const B_UNLOCK: u8 = 4;
pub(crate) const B_FLUSH: u8 = 8;

/// Record kinds inside a batch.
pub(crate) const R_PUT: u8 = 1;
pub(crate) const R_GET: u8 = 2;
pub(crate) const R_ACC: u8 = 3;
pub(crate) const R_RMW: u8 = 4;

/// Lock kinds.
pub(crate) const LOCK_SHARED: u8 = 1;
pub(crate) const LOCK_EXCLUSIVE: u8 = 2;

/// What an origin waits for, by token.
#[derive(Debug)]
pub(crate) enum Wait {
    /// GET data landing at `ptr` (`len` bytes); done when `got == len`.
    Data {
        ptr: *mut u8,
        len: usize,
        got: usize,
    },
    /// A one-message reply (RMW old values, or ACK / GRANT with `len == 0`).
    Reply {
        ptr: *mut u8,
        len: usize,
        done: bool,
    },
    /// A native operation reported through the provider's completion queue.
    Native {
        win: u32,
        done: bool,
    },
    Failed(Error),
}

impl Wait {
    fn done(&self) -> bool {
        match self {
            Wait::Data { len, got, .. } => got >= len,
            Wait::Reply { done, .. } | Wait::Native { done, .. } => *done,
            Wait::Failed(_) => true,
        }
    }
}

/// A request waiting for a lock at the target.
#[derive(Debug)]
enum Waiter {
    Lock {
        origin: Rank,
        kind: u8,
        token: u64,
    },
    /// A batch that starts with a lock: applied once the lock is granted.
    Batch {
        origin: Rank,
        kind: u8,
        msg: Vec<u8>,
        hdr_len: usize,
    },
}

/// Target-side and origin-side state of one window in this process.
#[derive(Debug)]
pub(crate) struct WinState {
    pub base: *mut u8,
    pub len: usize,
    /// POSTs received per origin rank, not yet consumed by `start`.
    pub posts: HashMap<Rank, u32>,
    /// COMPLETEs received per origin rank, not yet consumed by `wait`.
    pub completes: HashMap<Rank, u32>,
    /// Active-message operations applied here (fence accounting).
    pub applied: u64,
    /// Active-message operations this rank sent, per target world rank, in this fence epoch.
    pub sent: HashMap<Rank, u64>,
    /// Ranks holding the lock shared (a rank at most once per window), and the exclusive
    /// holder: kept by name so that a holder that dies can be released.
    shared: smallvec::SmallVec<[Rank; 4]>,
    exclusive: Option<Rank>,
    waiters: VecDeque<Waiter>,
    /// Native operations issued and completed (the window counter).
    pub native_issued: u64,
    pub native_done: u64,
}

impl WinState {
    pub fn new(base: *mut u8, len: usize) -> Self {
        WinState {
            base,
            len,
            posts: HashMap::new(),
            completes: HashMap::new(),
            applied: 0,
            sent: HashMap::new(),
            shared: smallvec::SmallVec::new(),
            exclusive: None,
            waiters: VecDeque::new(),
            native_issued: 0,
            native_done: 0,
        }
    }

    fn try_lock(&mut self, kind: u8, origin: Rank) -> bool {
        match kind {
            LOCK_EXCLUSIVE if self.exclusive.is_none() && self.shared.is_empty() => {
                self.exclusive = Some(origin);
                true
            }
            LOCK_SHARED if self.exclusive.is_none() => {
                self.shared.push(origin);
                true
            }
            _ => false,
        }
    }

    /// Release `origin`'s hold; `false` if it held none.
    fn unlock(&mut self, origin: Rank) -> bool {
        if self.exclusive == Some(origin) {
            self.exclusive = None;
            return true;
        }
        match self.shared.iter().position(|r| *r == origin) {
            Some(i) => {
                self.shared.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// `rank` died: drop its hold and its queued requests. Whether the window's memory is
    /// consistent after a holder died mid-epoch is the application's to judge (MPI leaves
    /// it undefined); what must not happen is every other rank waiting for the lock for good.
    fn forget(&mut self, rank: Rank) -> bool {
        let held = self.unlock(rank);
        let before = self.waiters.len();
        self.waiters.retain(|w| match w {
            Waiter::Lock { origin, .. } | Waiter::Batch { origin, .. } => *origin != rank,
        });
        held || self.waiters.len() != before
    }

    /// Bounds-checked start of window bytes `[off, off + n)`. Window memory is shared with
    /// other ranks (native operations, other processes): it is only ever accessed through raw
    /// pointers, never through a reference.
    fn range(&self, off: u64, n: usize) -> Option<*mut u8> {
        let off = usize::try_from(off).ok()?;
        if off.checked_add(n)? > self.len {
            return None;
        }
        // SAFETY: in bounds of the window memory, which lives as long as the WinState.
        Some(unsafe { self.base.add(off) })
    }
}

/// All RMA state of one process.
#[derive(Debug, Default)]
pub(crate) struct RmaState {
    pub wins: HashMap<u32, WinState>,
    /// Windows released without the collective free (their closure panicked).
    pub released: Vec<u32>,
    pub waits: HashMap<u64, Wait>,
    /// The remote rank each wait depends on (to fail it when that rank dies).
    waits_on: HashMap<u64, Rank>,
    next_token: u64,
}

impl RmaState {
    /// A fresh token for something the origin will wait for.
    pub fn token(&mut self, w: Wait, peer: Rank) -> u64 {
        self.next_token += 1;
        let t = RMA_TOKEN | self.next_token;
        self.waits.insert(t, w);
        self.waits_on.insert(t, peer);
        t
    }

    pub fn is_done(&self, t: u64) -> bool {
        self.waits.get(&t).is_none_or(|w| w.done())
    }

    /// Forget a finished wait, returning its error if it failed.
    pub fn take(&mut self, t: u64) -> Result<()> {
        self.waits_on.remove(&t);
        match self.waits.remove(&t) {
            Some(Wait::Failed(e)) => Err(e),
            _ => Ok(()),
        }
    }

    /// A provider completion for an RMA token.
    pub fn complete(&mut self, t: u64, r: Result<()>) {
        match self.waits.get_mut(&t) {
            Some(Wait::Native { win, done }) => {
                *done = true;
                let w = *win;
                if let Some(ws) = self.wins.get_mut(&w) {
                    ws.native_done += 1;
                }
                if let Err(e) = r {
                    self.waits.insert(t, Wait::Failed(e));
                }
            }
            Some(_) => {
                if let Err(e) = r {
                    self.waits.insert(t, Wait::Failed(e));
                }
            }
            None => tracing::warn!(t, "completion for an unknown RMA operation"),
        }
    }

    /// A peer died: whatever waits for it fails.
    pub fn peer_failed(&mut self, rank: Rank, why: &str) {
        for (t, r) in &self.waits_on {
            if *r == rank {
                if let Some(w) = self.waits.get_mut(t) {
                    if !w.done() {
                        *w = Wait::Failed(Error::peer_failed(rank, why));
                    }
                }
            }
        }
    }
}

/// `rank` failed: whatever waits for it fails (`RmaState::peer_failed`), and the locks it held
/// or waited for on this rank's windows are released, so that the next waiters get them.
pub(crate) fn peer_failed(st: &mut State, rank: Rank, why: &str) {
    st.rma.peer_failed(rank, why);
    let touched: smallvec::SmallVec<[u32; 4]> = st
        .rma
        .wins
        .iter_mut()
        .filter_map(|(id, w)| w.forget(rank).then_some(*id))
        .collect();
    for win in touched {
        tracing::warn!(rank, win, "released a window lock of a failed rank");
        grant_waiters(st, win);
    }
}

/// A malformed RMA message: the peer is failed (see `State::malformed`).
fn bad(st: &mut State, src: Rank, what: &str) -> Option<()> {
    st.malformed(src, what);
    Some(())
}

/// A message for window `win`, which this rank does not have: dropped quietly if the window
/// was released here without the collective free (a panic in its closure), when peers may
/// still be sending to it; a protocol error otherwise.
fn unknown_window(st: &mut State, src: Rank, win: u32) -> Option<()> {
    if st.rma.released.contains(&win) {
        tracing::debug!(
            peer = src,
            win,
            "dropping an RMA message for a released window"
        );
        Some(())
    } else {
        bad(st, src, &format!("RMA message for unknown window {win}"))
    }
}

/// A reply for `token`, which this rank does not wait for: dropped quietly if the wait was
/// given up (quarantined), a protocol error otherwise.
fn unknown_token(st: &mut State, src: Rank, token: u64, what: &str) -> Option<()> {
    if st.was_quarantined(token) {
        tracing::debug!(peer = src, "dropping a late {what}");
        Some(())
    } else {
        bad(st, src, &format!("{what} for an unknown request"))
    }
}

/// Dispatch an RMA active message (handler ids 16..).
pub(crate) fn on_am(
    st: &mut State,
    src: Rank,
    kind: u8,
    rd: &mut Rd<'_>,
    payload: &[u8],
) -> Option<()> {
    match kind {
        H_PUT => {
            let win = rd.u32()?;
            let off = rd.u64()?;
            put(st, src, win, off, payload)
        }
        H_GET => {
            let win = rd.u32()?;
            let off = rd.u64()?;
            let len = rd.u64()? as usize;
            let token = rd.u64()?;
            get(st, src, win, off, len, token)
        }
        H_GET_REPLY => {
            let token = rd.u64()?;
            let off = rd.u64()? as usize;
            match st.rma.waits.get_mut(&token) {
                Some(Wait::Data { ptr, len, got }) if off.checked_add(payload.len())? <= *len => {
                    // SAFETY: `ptr..ptr+len` is the origin buffer of a GET, borrowed by its epoch
                    // until the GET completes; the range was just checked.
                    unsafe {
                        std::ptr::copy_nonoverlapping(payload.as_ptr(), ptr.add(off), payload.len())
                    };
                    *got += payload.len();
                    Some(())
                }
                Some(Wait::Data { .. }) => bad(st, src, "GET reply outside its request"),
                _ => unknown_token(st, src, token, "GET reply"),
            }
        }
        H_ACC => {
            let win = rd.u32()?;
            let off = rd.u64()?;
            let op = Op::from_u8(rd.u8()?)?;
            let ty = BasicType::from_u8(rd.u8()?)?;
            acc(st, src, win, off, op, ty, payload)
        }
        H_RMW => {
            let win = rd.u32()?;
            let off = rd.u64()?;
            let op = Op::from_u8(rd.u8()?)?;
            let ty = BasicType::from_u8(rd.u8()?)?;
            let token = rd.u64()?;
            let has_compare = rd.u8()? != 0;
            rmw(st, src, win, off, op, ty, token, has_compare, payload)
        }
        H_RMW_REPLY => {
            let token = rd.u64()?;
            match st.rma.waits.get_mut(&token) {
                Some(Wait::Reply { ptr, len, done }) if *len == payload.len() => {
                    if *len > 0 {
                        // SAFETY: the result buffer of an RMW, borrowed by its epoch until done.
                        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), *ptr, *len) };
                    }
                    *done = true;
                    Some(())
                }
                Some(Wait::Reply { .. }) => bad(st, src, "RMW reply of the wrong length"),
                _ => unknown_token(st, src, token, "RMW reply"),
            }
        }
        H_ACK | H_GRANT => {
            let token = rd.u64()?;
            match st.rma.waits.get_mut(&token) {
                Some(Wait::Reply { done, .. }) => {
                    *done = true;
                    Some(())
                }
                _ => unknown_token(st, src, token, "acknowledgement"),
            }
        }
        H_POST | H_COMPLETE => {
            if kind == H_COMPLETE {
                st.own_raw_to(src);
            }
            let win = rd.u32()?;
            let Some(w) = st.rma.wins.get_mut(&win) else {
                return unknown_window(st, src, win);
            };
            let m = if kind == H_POST {
                &mut w.posts
            } else {
                &mut w.completes
            };
            *m.entry(src).or_insert(0) += 1;
            Some(())
        }
        H_LOCK => {
            let win = rd.u32()?;
            let lk = rd.u8()?;
            let token = rd.u64()?;
            let Some(w) = st.rma.wins.get_mut(&win) else {
                return unknown_window(st, src, win);
            };
            if w.waiters.is_empty() && w.try_lock(lk, src) {
                reply(st, src, H_GRANT, token);
            } else {
                w.waiters.push_back(Waiter::Lock {
                    origin: src,
                    kind: lk,
                    token,
                });
            }
            Some(())
        }
        H_UNLOCK => {
            // Replies to this origin read from the window must not see later epochs.
            st.own_raw_to(src);
            let win = rd.u32()?;
            let token = rd.u64()?;
            unlock(st, src, win, token)
        }
        H_FLUSH => {
            let _win = rd.u32()?;
            let token = rd.u64()?;
            reply(st, src, H_ACK, token);
            Some(())
        }
        H_BATCH => {
            let hdr = rd.rest();
            batch(st, src, hdr, payload)
        }
        _ => None,
    }
}

fn reply(st: &mut State, dest: Rank, kind: u8, token: u64) {
    let mut h = Hdr::new(kind);
    h.u64(token);
    st.push_ctrl(dest, h);
}

/// The window a message targets, or return from the handler with what to do without it.
macro_rules! target_win {
    ($st:expr, $src:expr, $win:expr) => {
        match $st.rma.wins.get_mut(&$win) {
            Some(w) => w,
            None => return unknown_window($st, $src, $win),
        }
    };
}

fn put(st: &mut State, src: Rank, win: u32, off: u64, data: &[u8]) -> Option<()> {
    let w = target_win!(st, src, win);
    let Some(p) = w.range(off, data.len()) else {
        return bad(st, src, "PUT outside the window");
    };
    // SAFETY: `p` is in bounds of the window memory (checked by `range`); message bytes cannot
    // overlap window memory.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    w.applied += 1;
    Some(())
}

fn get(st: &mut State, src: Rank, win: u32, off: u64, len: usize, token: u64) -> Option<()> {
    let chunk = st.caps.max_am_payload;
    let w = target_win!(st, src, win);
    let Some(p) = w.range(off, len) else {
        return bad(st, src, "GET outside the window");
    };
    w.applied += 1;
    // Reply in chunks read from the window as the outbox drains (no copy of the range here,
    // whatever its size). The window cannot change under them before the origin's epoch
    // ends: the origin waits for this data before it unlocks or completes, and a batch that
    // carries the unlock or completion with the get makes `own_raw_to` copy them first.
    let mut at = 0;
    loop {
        let n = (len - at).min(chunk);
        let mut h = Hdr::new(H_GET_REPLY);
        h.u64(token).u64(at as u64);
        let piece = RawIov {
            // SAFETY: within the checked range of window memory.
            ptr: unsafe { p.add(at) },
            len: n,
        };
        st.push_out(src, Out::Raw(h, piece));
        at += n;
        if at >= len {
            break;
        }
    }
    Some(())
}

fn acc(
    st: &mut State,
    src: Rank,
    win: u32,
    off: u64,
    op: Op,
    ty: BasicType,
    data: &[u8],
) -> Option<()> {
    let w = target_win!(st, src, win);
    let Some(p) = w.range(off, data.len()) else {
        return bad(st, src, "ACC outside the window");
    };
    // Apply on a private copy, then write the result back: no reference to window memory.
    let mut cur = std::mem::take(&mut st.scratch_acc);
    cur.clear();
    // SAFETY: `[p, p + len)` is in bounds of the window (checked); this thread is the only
    // one applying active-message operations to it.
    unsafe { append_raw(&mut cur, p, data.len()) };
    let ok = apply_acc(op, ty, &mut cur, data).is_ok();
    if ok {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(cur.as_ptr(), p, cur.len()) };
    }
    st.scratch_acc = cur;
    if !ok {
        return bad(st, src, "ACC with an invalid operation/type");
    }
    if let Some(w) = st.rma.wins.get_mut(&win) {
        w.applied += 1;
    }
    Some(())
}

/// Append `n` bytes at `p` to `v` without forming a reference to them.
///
/// # Safety
/// `p` must be valid for reads of `n` bytes.
unsafe fn append_raw(v: &mut Vec<u8>, p: *const u8, n: usize) {
    v.reserve(n);
    let at = v.len();
    // SAFETY: `reserve` made room for `n` more bytes; the caller guarantees the source.
    std::ptr::copy_nonoverlapping(p, v.as_mut_ptr().add(at), n);
    v.set_len(at + n);
}

/// `target = target op origin`, where `Replace` copies and `NoOp` leaves it alone.
pub(crate) fn apply_acc(op: Op, ty: BasicType, target: &mut [u8], origin: &[u8]) -> Result<()> {
    match op {
        Op::Replace => {
            if target.len() != origin.len() {
                return Err(Error::invalid("length mismatch"));
            }
            target.copy_from_slice(origin);
            Ok(())
        }
        Op::NoOp => Ok(()),
        _ => apply_op(op, ty, target, origin),
    }
}

#[allow(clippy::too_many_arguments)]
fn rmw(
    st: &mut State,
    src: Rank,
    win: u32,
    off: u64,
    op: Op,
    ty: BasicType,
    token: u64,
    has_compare: bool,
    payload: &[u8],
) -> Option<()> {
    let n = if has_compare {
        payload.len() / 2
    } else {
        payload.len()
    };
    let w = target_win!(st, src, win);
    let Some(p) = w.range(off, n) else {
        return bad(st, src, "RMW outside the window");
    };
    if has_compare && (op != Op::Cswap || n != ty.size()) {
        return bad(st, src, "compare-and-swap of more than one element");
    }
    let mut old = st.spare_buf();
    // SAFETY: as in `acc`.
    unsafe { append_raw(&mut old, p, n) };
    let mut new = std::mem::take(&mut st.scratch_acc);
    new.clear();
    new.extend_from_slice(&old);
    let ok = if has_compare {
        let (origin, compare) = payload.split_at(n);
        if old == compare {
            new.copy_from_slice(origin);
        }
        true
    } else {
        apply_acc(op, ty, &mut new, &payload[..n]).is_ok()
    };
    if ok {
        // SAFETY: as in `acc`.
        unsafe { std::ptr::copy_nonoverlapping(new.as_ptr(), p, n) };
    }
    st.scratch_acc = new;
    if !ok {
        return bad(st, src, "RMW with an invalid operation/type");
    }
    if let Some(w) = st.rma.wins.get_mut(&win) {
        w.applied += 1;
    }
    let mut h = Hdr::new(H_RMW_REPLY);
    h.u64(token);
    st.push_owned(src, h, old);
    Some(())
}

fn grant_waiters(st: &mut State, win: u32) {
    loop {
        let Some(w) = st.rma.wins.get_mut(&win) else {
            return;
        };
        let (kind, origin) = match w.waiters.front() {
            Some(Waiter::Lock { kind, origin, .. }) | Some(Waiter::Batch { kind, origin, .. }) => {
                (*kind, *origin)
            }
            None => return,
        };
        if !w.try_lock(kind, origin) {
            return;
        }
        match w.waiters.pop_front() {
            Some(Waiter::Lock { origin, token, .. }) => reply(st, origin, H_GRANT, token),
            Some(Waiter::Batch {
                origin,
                msg,
                hdr_len,
                ..
            }) => {
                let (h, p) = msg.split_at(hdr_len);
                apply_batch(st, origin, h, p, true);
            }
            None => return,
        }
    }
}

fn unlock(st: &mut State, src: Rank, win: u32, token: u64) -> Option<()> {
    let w = target_win!(st, src, win);
    if !w.unlock(src) {
        return bad(st, src, "UNLOCK of a lock it does not hold");
    }
    reply(st, src, H_ACK, token);
    grant_waiters(st, win);
    Some(())
}

/// Batch header (after the handler byte): win u32, flags u8, lock kind u8, sync token u64.
fn batch(st: &mut State, src: Rank, hdr: &[u8], payload: &[u8]) -> Option<()> {
    let mut rd = Rd::new(hdr);
    let win = rd.u32()?;
    let flags = rd.u8()?;
    let lk = rd.u8()?;
    let w = target_win!(st, src, win);
    if flags & B_LOCK != 0 && !(w.waiters.is_empty() && w.try_lock(lk, src)) {
        // Wait for the lock with the whole batch.
        let mut msg = hdr.to_vec();
        let hdr_len = msg.len();
        msg.extend_from_slice(payload);
        w.waiters.push_back(Waiter::Batch {
            origin: src,
            kind: lk,
            msg,
            hdr_len,
        });
        return Some(());
    }
    apply_batch(st, src, hdr, payload, flags & B_LOCK != 0)
}

/// Apply a batch whose lock (if any) is held.
fn apply_batch(st: &mut State, src: Rank, hdr: &[u8], payload: &[u8], _locked: bool) -> Option<()> {
    let mut rd = Rd::new(hdr);
    let win = rd.u32()?;
    let flags = rd.u8()?;
    let _lk = rd.u8()?;
    let token = rd.u64()?;
    let mut p = Rd::new(payload);
    while p.remaining() > 0 {
        let kind = p.u8()?;
        let off = p.u64()?;
        let len = p.u32()? as usize;
        match kind {
            R_PUT => {
                let data = p.bytes(len)?;
                put(st, src, win, off, data)?;
            }
            R_GET => {
                let t = p.u64()?;
                get(st, src, win, off, len, t)?;
            }
            R_ACC => {
                let op = Op::from_u8(p.u8()?)?;
                let ty = BasicType::from_u8(p.u8()?)?;
                let data = p.bytes(len)?;
                acc(st, src, win, off, op, ty, data)?;
            }
            R_RMW => {
                let op = Op::from_u8(p.u8()?)?;
                let ty = BasicType::from_u8(p.u8()?)?;
                let t = p.u64()?;
                let cmp = p.u8()? != 0;
                let data = p.bytes(len)?;
                rmw(st, src, win, off, op, ty, t, cmp, data)?;
            }
            _ => return bad(st, src, "unknown record in a batch"),
        }
    }
    if flags & (B_COMPLETE | B_UNLOCK) != 0 {
        // The gets of this batch are queued as window reads: copy them before the epoch ends.
        st.own_raw_to(src);
    }
    if flags & B_COMPLETE != 0 {
        let w = target_win!(st, src, win);
        *w.completes.entry(src).or_insert(0) += 1;
    }
    if flags & B_FLUSH != 0 {
        reply(st, src, H_ACK, token);
    }
    if flags & B_UNLOCK != 0 {
        unlock(st, src, win, token)?;
    }
    Some(())
}

/// Check an origin-side request against the window's size at the target: used by the native
/// path, which cannot rely on the target to refuse it.
pub(crate) fn check_remote(len_at_target: usize, off: usize, n: usize, target: Rank) -> Result<()> {
    if off.checked_add(n).is_none_or(|e| e > len_at_target) {
        return Err(Error::from(ErrorDetail::RemoteAccess {
            rank: target,
            what: format!(
                "bytes {off}..{} are outside the {len_at_target}-byte window",
                off.saturating_add(n)
            ),
        }));
    }
    Ok(())
}

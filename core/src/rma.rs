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

use crate::engine::{Hdr, Rd, State};
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
    shared: u32,
    exclusive: bool,
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
            shared: 0,
            exclusive: false,
            waiters: VecDeque::new(),
            native_issued: 0,
            native_done: 0,
        }
    }

    fn try_lock(&mut self, kind: u8) -> bool {
        match kind {
            LOCK_EXCLUSIVE if !self.exclusive && self.shared == 0 => {
                self.exclusive = true;
                true
            }
            LOCK_SHARED if !self.exclusive => {
                self.shared += 1;
                true
            }
            _ => false,
        }
    }

    fn unlock(&mut self) {
        if self.exclusive {
            self.exclusive = false;
        } else if self.shared > 0 {
            self.shared -= 1;
        }
    }

    /// Bounds-checked view of window bytes `[off, off + n)`.
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

fn bad(src: Rank, what: &str) -> Option<()> {
    tracing::warn!(peer = src, "dropping malformed RMA message: {what}");
    Some(())
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
                _ => bad(src, "GET reply for an unknown or smaller request"),
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
                _ => bad(src, "RMW reply for an unknown request"),
            }
        }
        H_ACK | H_GRANT => {
            let token = rd.u64()?;
            match st.rma.waits.get_mut(&token) {
                Some(Wait::Reply { done, .. }) => {
                    *done = true;
                    Some(())
                }
                _ => bad(src, "acknowledgement for an unknown request"),
            }
        }
        H_POST | H_COMPLETE => {
            let win = rd.u32()?;
            let Some(w) = st.rma.wins.get_mut(&win) else {
                return bad(src, "POST/COMPLETE for an unknown window");
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
                return bad(src, "LOCK for an unknown window");
            };
            if w.waiters.is_empty() && w.try_lock(lk) {
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

fn win_mut(st: &mut State, src: Rank, win: u32) -> Option<&mut WinState> {
    let w = st.rma.wins.get_mut(&win);
    if w.is_none() {
        tracing::warn!(peer = src, win, "RMA message for an unknown window");
    }
    w
}

fn put(st: &mut State, src: Rank, win: u32, off: u64, data: &[u8]) -> Option<()> {
    let w = win_mut(st, src, win)?;
    let Some(p) = w.range(off, data.len()) else {
        return bad(src, "PUT outside the window");
    };
    // SAFETY: `p` is in bounds of the window memory (checked by `range`); message bytes cannot
    // overlap window memory.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    w.applied += 1;
    Some(())
}

fn get(st: &mut State, src: Rank, win: u32, off: u64, len: usize, token: u64) -> Option<()> {
    let chunk = st.caps.max_am_payload;
    let w = win_mut(st, src, win)?;
    let Some(p) = w.range(off, len) else {
        return bad(src, "GET outside the window");
    };
    w.applied += 1;
    // Reply in chunks; copied now (the window may change after this message).
    let mut at = 0;
    loop {
        let n = (len - at).min(chunk);
        // SAFETY: within the checked range of window memory.
        let mut data = st.spare_buf();
        data.extend_from_slice(unsafe { std::slice::from_raw_parts(p.add(at), n) });
        let mut h = Hdr::new(H_GET_REPLY);
        h.u64(token).u64(at as u64);
        st.push_owned(src, h, data);
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
    let w = win_mut(st, src, win)?;
    let Some(p) = w.range(off, data.len()) else {
        return bad(src, "ACC outside the window");
    };
    // SAFETY: in bounds (checked); this thread is the only one applying AM operations to the
    // window, and the window's users may not access these bytes during the epoch.
    let target = unsafe { std::slice::from_raw_parts_mut(p, data.len()) };
    if apply_acc(op, ty, target, data).is_err() {
        return bad(src, "ACC with an invalid operation/type");
    }
    w.applied += 1;
    Some(())
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
    let mut old = st.spare_buf();
    let w = win_mut(st, src, win)?;
    let Some(p) = w.range(off, n) else {
        return bad(src, "RMW outside the window");
    };
    // SAFETY: as in `acc`.
    let target = unsafe { std::slice::from_raw_parts_mut(p, n) };
    old.extend_from_slice(target);
    if has_compare {
        if op != Op::Cswap || n != ty.size() {
            return bad(src, "compare-and-swap of more than one element");
        }
        let (origin, compare) = payload.split_at(n);
        if target == compare {
            target.copy_from_slice(origin);
        }
    } else if apply_acc(op, ty, target, &payload[..n]).is_err() {
        return bad(src, "RMW with an invalid operation/type");
    }
    w.applied += 1;
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
        let kind = match w.waiters.front() {
            Some(Waiter::Lock { kind, .. }) | Some(Waiter::Batch { kind, .. }) => *kind,
            None => return,
        };
        if !w.try_lock(kind) {
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
    let w = win_mut(st, src, win)?;
    w.unlock();
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
    let w = win_mut(st, src, win)?;
    if flags & B_LOCK != 0 && !(w.waiters.is_empty() && w.try_lock(lk)) {
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
            _ => return bad(src, "unknown record in a batch"),
        }
    }
    if flags & B_COMPLETE != 0 {
        let w = win_mut(st, src, win)?;
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

//! One-sided communication, protocol side: the active-message protocols that implement RMA when
//! the provider has no native path, and the state of every window the engine keeps (its memory,
//! its lock, the epochs opened on it, what origins wait for by token). The window API — issue,
//! scheduling, synchronisation — is [`crate::win`], above the engine; the target-side handlers
//! are `target.rs`. Handler ids are `am::RMA_IDS`; tokens carry `am::TOKEN_RMA`.
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
//! | `REPLY_BATCH` | the data of a batch's small gets, one message for many | — | records: token, len, data |
//! | `FENCE` | this origin reached the fence: every operation it sent before has arrived | win | — |
//! | `DONE` | this target holds every rank's `FENCE`: it has applied the epoch | win | — |
//!
//! Active messages between a pair are delivered in order, so a `COMPLETE`, `UNLOCK` or `FLUSH`
//! is processed after every operation the origin sent before it: no per-operation
//! acknowledgements are needed.

mod target;
mod waits;

pub(crate) use target::{on_am, on_data, Ctx};

use crate::am::{self, AmState};
use crate::types::{apply_op, BasicType, Op, Rank};
use crate::{Error, ErrorDetail, Result};
use hashbrown::HashMap;
use std::collections::VecDeque;

// Handler ids, within `am::RMA_IDS`.
pub(crate) const H_PUT: u8 = am::RMA_IDS.start;
pub(crate) const H_GET: u8 = H_PUT + 1;
pub(crate) const H_GET_REPLY: u8 = H_PUT + 2;
pub(crate) const H_ACC: u8 = H_PUT + 3;
pub(crate) const H_RMW: u8 = H_PUT + 4;
pub(crate) const H_RMW_REPLY: u8 = H_PUT + 5;
pub(crate) const H_POST: u8 = H_PUT + 6;
pub(crate) const H_COMPLETE: u8 = H_PUT + 7;
pub(crate) const H_LOCK: u8 = H_PUT + 8;
pub(crate) const H_GRANT: u8 = H_PUT + 9;
pub(crate) const H_UNLOCK: u8 = H_PUT + 10;
pub(crate) const H_FLUSH: u8 = H_PUT + 11;
pub(crate) const H_ACK: u8 = H_PUT + 12;
pub(crate) const H_BATCH: u8 = H_PUT + 13;
pub(crate) const H_REPLY_BATCH: u8 = H_PUT + 14;
pub(crate) const H_FENCE: u8 = H_PUT + 15;
pub(crate) const H_DONE: u8 = H_PUT + 16;
const _: () = assert!(H_DONE < am::RMA_IDS.end);

/// The exact header length of RMA message `kind` (see the table above), `None` if unknown.
#[inline]
pub(crate) fn header_len(kind: u8) -> Option<usize> {
    Some(match kind {
        H_PUT => 13,
        H_GET => 29,
        H_GET_REPLY => 17,
        H_ACC => 15,
        H_RMW => 24,
        H_RMW_REPLY | H_GRANT | H_ACK => 9,
        H_POST | H_COMPLETE | H_FENCE | H_DONE => 5,
        H_LOCK => 14,
        H_UNLOCK | H_FLUSH => 13,
        H_BATCH => 15,
        H_REPLY_BATCH => 1,
        _ => return None,
    })
}

/// Remote completion data of native writes (`Provider::rma_write_data`), 32 bits: a marker
/// kind in bits 30..31 and the window id below. `D_COMPLETE` (PSCW): the origin's access
/// epoch on this rank's window is complete — all its earlier writes are visible, since the
/// marker travels fenced behind them.
pub(crate) const D_COMPLETE: u32 = 2;
/// Largest window id markers can name.
pub(crate) const D_WIN_MAX: u32 = (1 << 30) - 1;

/// The completion data of marker `kind` for window `win`.
pub(crate) fn data_marker(kind: u32, win: u32) -> u64 {
    debug_assert!(win <= D_WIN_MAX);
    ((kind << 30) | (win & D_WIN_MAX)) as u64
}

/// Batch flags.
pub(crate) const B_LOCK: u8 = 1;
pub(crate) const B_COMPLETE: u8 = 2;
pub(crate) const B_UNLOCK: u8 = 4;
pub(crate) const B_FLUSH: u8 = 8;
/// The batch ends the origin's part of a fence (as `FENCE`).
pub(crate) const B_FENCE: u8 = 16;

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
    /// Native operations reported through the provider's completion queue: `pending` of them
    /// still in flight (an operation split in pieces shares its token), `err` the first
    /// failure. Done only when the provider has reported every piece: until then it may still
    /// use the operation's buffers, whatever happened to the peer.
    Native {
        win: u32,
        pending: u32,
        err: Option<Error>,
    },
    /// The gets of one target packed in an epoch's batches, under one token: each record of
    /// theirs carries a *sub-token* (the token and the get's index, [`sub_token`]) that its
    /// reply echoes; done when every destination is full (`left` counts those that are not).
    /// One wait instead of one per get: a get's token, lookup and removal were a fifth of an
    /// aggregated epoch's time at the origin.
    Gets {
        dests: Vec<Dest>,
        left: usize,
    },
    Failed(Error),
}

/// Where one packed get lands (see [`Wait::Gets`]).
#[derive(Debug)]
pub(crate) struct Dest {
    ptr: *mut u8,
    len: usize,
    got: usize,
}

/// A sub-token has this bit besides `am::TOKEN_RMA`; plain tokens never do (their sequence
/// numbers stay below 2^62).
const SUB: u64 = 1 << 62;
/// A sub-token's index sits above the token's sequence number, which must fit below it.
const SUB_SHIFT: u32 = 40;
const SUB_SEQ: u64 = (1 << SUB_SHIFT) - 1;
const SUB_IDX: u64 = (1 << (62 - SUB_SHIFT)) - 1;

/// The sub-token of destination `idx` of wait `t`, if both fit.
fn sub_token(t: u64, idx: usize) -> Option<u64> {
    let seq = t & !crate::am::TOKEN_RMA;
    (t & crate::am::TOKEN_RMA != 0 && seq <= SUB_SEQ && (idx as u64) <= SUB_IDX)
        .then_some(t | SUB | (idx as u64) << SUB_SHIFT)
}

/// A token as a reply names it: the wait's token, and the destination's index for a
/// sub-token.
pub(crate) fn split_token(t: u64) -> (u64, Option<usize>) {
    if t & crate::am::TOKEN_RMA != 0 && t & SUB != 0 {
        let idx = (t >> SUB_SHIFT) & SUB_IDX;
        (crate::am::TOKEN_RMA | (t & SUB_SEQ), Some(idx as usize))
    } else {
        (t, None)
    }
}

/// What became of GET data a reply brought ([`RmaState::land`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Landed {
    /// Copied into its destination.
    Done,
    /// The request exists but the data does not fit it (a protocol error of the peer).
    Unlike,
    /// No such request (given up earlier, or never made).
    Unknown,
}

impl Wait {
    fn done(&self) -> bool {
        match self {
            Wait::Gets { left, .. } => *left == 0,
            Wait::Data { len, got, .. } => got >= len,
            Wait::Reply { done, .. } => *done,
            Wait::Native { pending, .. } => *pending == 0,
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
    /// FENCEs received per origin rank since the window was created (cumulative).
    pub fences: HashMap<Rank, u64>,
    /// DONEs received per target rank since the window was created (cumulative).
    pub dones: HashMap<Rank, u64>,
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
            fences: HashMap::new(),
            dones: HashMap::new(),
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
    /// What origins wait for, by token, each with the remote rank it depends on (failed
    /// when that rank dies).
    pub waits: waits::Waits<Wait>,
    /// Scratch for applying active-message accumulates to a copy of window bytes.
    scratch_acc: Vec<u8>,
    /// Destination lists of finished [`Wait::Gets`], kept for the next (no allocation per
    /// epoch).
    spare_dests: Vec<Vec<Dest>>,
}

impl RmaState {
    /// A fresh token for something the origin will wait for.
    pub fn token(&mut self, w: Wait, peer: Rank) -> u64 {
        self.waits.add(w, peer)
    }

    pub fn is_done(&self, t: u64) -> bool {
        self.waits.get(&t).is_none_or(|w| w.done())
    }

    /// Forget a finished wait, returning its error if it failed.
    pub fn take(&mut self, t: u64) -> Result<()> {
        match self.waits.remove(&t) {
            Some(Wait::Failed(e)) | Some(Wait::Native { err: Some(e), .. }) => Err(e),
            Some(Wait::Gets { mut dests, .. }) => {
                if self.spare_dests.len() < 8 {
                    dests.clear();
                    self.spare_dests.push(dests);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// A fresh [`Wait::Gets`] for packed gets from `peer`, with no destination yet.
    pub fn gets_wait(&mut self, peer: Rank) -> u64 {
        let dests = self.spare_dests.pop().unwrap_or_default();
        self.waits.add(Wait::Gets { dests, left: 0 }, peer)
    }

    /// Add a destination of `len` bytes at `ptr` to [`Wait::Gets`] `t`, returning the
    /// sub-token its record carries; `None` if `t` is no such wait or the sub-token would not
    /// fit (the caller then gives the get a token of its own).
    pub fn add_get(&mut self, t: u64, ptr: *mut u8, len: usize) -> Option<u64> {
        let Some(Wait::Gets { dests, left }) = self.waits.get_mut(&t) else {
            return None;
        };
        let sub = sub_token(t, dests.len())?;
        dests.push(Dest { ptr, len, got: 0 });
        if len > 0 {
            *left += 1;
        }
        Some(sub)
    }

    /// Copy `data`, which a GET reply brought for token (or sub-token) `t` at offset `off`
    /// of the request, into the request's destination. `whole`: the data must be the whole
    /// request at once (a reply batch's record), else any piece not landed outside it.
    pub fn land(&mut self, t: u64, off: usize, data: &[u8], whole: bool) -> Landed {
        let (base, idx) = split_token(t);
        let (ptr, len, got, left) = match (self.waits.get_mut(&base), idx) {
            (Some(Wait::Data { ptr, len, got }), None) => (*ptr, *len, got, None),
            (Some(Wait::Gets { dests, left }), Some(i)) => match dests.get_mut(i) {
                Some(d) => (d.ptr, d.len, &mut d.got, Some(left)),
                None => return Landed::Unlike,
            },
            (Some(Wait::Data { .. } | Wait::Gets { .. }), _) => return Landed::Unlike,
            _ => return Landed::Unknown,
        };
        let fits = if whole {
            off == 0 && data.len() == len && *got == 0
        } else {
            off.checked_add(data.len()).is_some_and(|e| e <= len)
        };
        if !fits {
            return Landed::Unlike;
        }
        // SAFETY: `ptr..ptr+len` is the origin buffer of a GET, borrowed by its epoch until
        // the GET's wait is done or given up (then the wait is gone and nothing lands here);
        // `off + data.len() <= len` was just checked.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.add(off), data.len()) };
        let was_short = *got < len;
        *got += data.len();
        if let Some(left) = left {
            if was_short && *got >= len {
                *left -= 1;
            }
        }
        Landed::Done
    }

    /// A provider completion for an RMA token.
    pub fn complete(&mut self, t: u64, r: Result<()>) {
        match self.waits.get_mut(&t) {
            Some(Wait::Native { win, pending, err }) => {
                *pending = pending.saturating_sub(1);
                if let Err(e) = r {
                    err.get_or_insert(e);
                }
                let w = *win;
                if let Some(ws) = self.wins.get_mut(&w) {
                    ws.native_done += 1;
                }
            }
            Some(w) => {
                if let Err(e) = r {
                    *w = Wait::Failed(e);
                }
            }
            None => tracing::warn!(t, "completion for an unknown RMA operation"),
        }
    }

    /// A peer died: whatever waits for it fails.
    pub fn peer_failed(&mut self, rank: Rank, why: &str) {
        for w in self.waits.on_peer_mut(rank) {
            // Native operations end when the provider reports them (with an error, now that
            // the peer is gone): it may still be using their buffers.
            if !w.done() && !matches!(w, Wait::Native { .. }) {
                *w = Wait::Failed(Error::peer_failed(rank, why));
            }
        }
    }
}

/// `rank` failed: whatever waits for it fails (`RmaState::peer_failed`), and the locks it held
/// or waited for on this rank's windows are released, so that the next waiters get them.
pub(crate) fn peer_failed(rma: &mut RmaState, am: &mut AmState, rank: Rank) {
    let why = am.peer_failure(rank).unwrap_or("failed").to_string();
    rma.peer_failed(rank, &why);
    let touched: smallvec::SmallVec<[u32; 4]> = rma
        .wins
        .iter_mut()
        .filter_map(|(id, w)| w.forget(rank).then_some(*id))
        .collect();
    for win in touched {
        tracing::warn!(rank, win, "released a window lock of a failed rank");
        target::grant_waiters(
            &mut target::Ctx {
                rma: &mut *rma,
                am: &mut *am,
            },
            win,
        );
    }
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

/// Check an origin-side request against the window's size at the target: used by the native
/// path, which cannot rely on the target to refuse it. `target` names the target's world rank
/// for the error (worked out only then).
pub(crate) fn check_remote(
    len_at_target: usize,
    off: usize,
    n: usize,
    target: impl FnOnce() -> Rank,
) -> Result<()> {
    if off.checked_add(n).is_none_or(|e| e > len_at_target) {
        return Err(Error::from(ErrorDetail::RemoteAccess {
            rank: target(),
            what: format!(
                "bytes {off}..{} are outside the {len_at_target}-byte window",
                off.saturating_add(n)
            ),
        }));
    }
    Ok(())
}

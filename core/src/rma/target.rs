//! The target side of RMA on active messages: applying puts, gets, accumulates and
//! read-modify-writes to window memory, granting and releasing window locks, PSCW
//! bookkeeping, and aggregated batches.

use super::*;
use crate::am::{Hdr, Out, Rd};
use crate::provider::RawIov;

/// What a target-side handler works with: the RMA state and the active-message layer it
/// answers through.
pub(crate) struct Ctx<'a> {
    pub rma: &'a mut RmaState,
    pub am: &'a mut AmState,
}

/// A malformed RMA message: the peer is failed (see `AmState::malformed`).
fn bad(st: &mut Ctx<'_>, src: Rank, what: &str) -> Option<()> {
    st.am.malformed(src, what);
    Some(())
}

/// A message for window `win`, which this rank does not have: dropped quietly if the window
/// was released here without the collective free (a panic in its closure), when peers may
/// still be sending to it; a protocol error otherwise.
fn unknown_window(st: &mut Ctx<'_>, src: Rank, win: u32) -> Option<()> {
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
fn unknown_token(st: &mut Ctx<'_>, src: Rank, token: u64, what: &str) -> Option<()> {
    if st.am.was_quarantined(token) {
        tracing::debug!(peer = src, "dropping a late {what}");
        Some(())
    } else {
        bad(st, src, &format!("{what} for an unknown request"))
    }
}

/// Dispatch an RMA active message (`kind` in `am::RMA_IDS`, header length already checked);
/// `None` if its fields do not parse.
pub(crate) fn on_am(
    st: &mut Ctx<'_>,
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
            match st.rma.land(token, off, payload, false) {
                Landed::Done => Some(()),
                Landed::Unlike => bad(st, src, "GET reply outside its request"),
                Landed::Unknown => unknown_token(st, src, split_token(token).0, "GET reply"),
            }
        }
        H_REPLY_BATCH => {
            let mut p = Rd::new(payload);
            while p.remaining() > 0 {
                let token = p.u64()?;
                let len = p.u32()? as usize;
                let data = p.bytes(len)?;
                match st.rma.land(token, 0, data, true) {
                    Landed::Done => {}
                    Landed::Unlike => {
                        return bad(st, src, "GET reply batch record unlike its request")
                    }
                    Landed::Unknown if st.am.was_quarantined(split_token(token).0) => {
                        tracing::debug!(peer = src, "dropping a late GET reply");
                    }
                    Landed::Unknown => {
                        return bad(st, src, "GET reply batch record for an unknown request")
                    }
                }
            }
            Some(())
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
        H_FENCE => {
            // In-order delivery per pair: every operation the origin sent before has been
            // applied. Its gets were answered before it sent this (it waits for them first).
            let win = rd.u32()?;
            let Some(w) = st.rma.wins.get_mut(&win) else {
                return unknown_window(st, src, win);
            };
            *w.fences.entry(src).or_insert(0) += 1;
            Some(())
        }
        H_DONE => {
            let win = rd.u32()?;
            let Some(w) = st.rma.wins.get_mut(&win) else {
                return unknown_window(st, src, win);
            };
            *w.dones.entry(src).or_insert(0) += 1;
            Some(())
        }
        H_POST | H_COMPLETE => {
            if kind == H_COMPLETE {
                st.am.own_raw_to(src);
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
            st.am.own_raw_to(src);
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

/// Remote completion data from `src` (see `D_COMPLETE`): a PSCW completion that travelled
/// behind the epoch's writes.
pub(crate) fn on_data(st: &mut Ctx<'_>, src: Rank, data: u64) {
    let (kind, win) = ((data >> 30) as u32 & 3, (data as u32) & D_WIN_MAX);
    if data >> 32 != 0 {
        st.am
            .malformed(src, "remote completion data of more than 32 bits");
        return;
    }
    let Some(w) = st.rma.wins.get_mut(&win) else {
        let _ = unknown_window(st, src, win);
        return;
    };
    match kind {
        D_COMPLETE => *w.completes.entry(src).or_insert(0) += 1,
        _ => st
            .am
            .malformed(src, "remote completion data of an unknown kind"),
    }
}

fn reply(st: &mut Ctx<'_>, dest: Rank, kind: u8, token: u64) {
    let mut h = Hdr::new(kind);
    h.u64(token);
    st.am.push_ctrl(dest, h);
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

fn put(st: &mut Ctx<'_>, src: Rank, win: u32, off: u64, data: &[u8]) -> Option<()> {
    let w = target_win!(st, src, win);
    let Some(p) = w.range(off, data.len()) else {
        return bad(st, src, "PUT outside the window");
    };
    // SAFETY: `p` is in bounds of the window memory (checked by `range`); message bytes cannot
    // overlap window memory.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    Some(())
}

fn get(st: &mut Ctx<'_>, src: Rank, win: u32, off: u64, len: usize, token: u64) -> Option<()> {
    let chunk = st.am.caps.max_am_payload;
    let w = target_win!(st, src, win);
    let Some(p) = w.range(off, len) else {
        return bad(st, src, "GET outside the window");
    };
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
            desc: 0,
            // SAFETY: within the checked range of window memory.
            ptr: unsafe { p.add(at) },
            len: n,
        };
        st.am.push_out(src, Out::Raw(h, piece));
        at += n;
        if at >= len {
            break;
        }
    }
    Some(())
}

/// Bytes of a `REPLY_BATCH` record before its data: token u64, length u32.
const REPLY_REC: usize = 12;

/// A get of a batch answered in the batch's reply: its data copied (a snapshot, so nothing
/// refers to window memory once the batch is applied) into `out` as one record.
fn get_into(
    st: &mut Ctx<'_>,
    src: Rank,
    win: u32,
    off: u64,
    len: usize,
    token: u64,
    out: &mut Vec<u8>,
) -> Option<()> {
    let w = target_win!(st, src, win);
    let Some(p) = w.range(off, len) else {
        return bad(st, src, "GET outside the window");
    };
    out.extend_from_slice(&token.to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    // SAFETY: `p..p+len` is in bounds of the window memory (checked by `range`).
    unsafe { append_raw(out, p, len) };
    Some(())
}

fn acc(
    st: &mut Ctx<'_>,
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
    let mut cur = std::mem::take(&mut st.rma.scratch_acc);
    cur.clear();
    // SAFETY: `[p, p + len)` is in bounds of the window (checked); this thread is the only
    // one applying active-message operations to it.
    unsafe { append_raw(&mut cur, p, data.len()) };
    let ok = apply_acc(op, ty, &mut cur, data).is_ok();
    if ok {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(cur.as_ptr(), p, cur.len()) };
    }
    st.rma.scratch_acc = cur;
    if !ok {
        return bad(st, src, "ACC with an invalid operation/type");
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

#[allow(clippy::too_many_arguments)]
fn rmw(
    st: &mut Ctx<'_>,
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
    let mut old = st.am.spare_buf();
    // SAFETY: as in `acc`.
    unsafe { append_raw(&mut old, p, n) };
    let mut new = std::mem::take(&mut st.rma.scratch_acc);
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
    st.rma.scratch_acc = new;
    if !ok {
        return bad(st, src, "RMW with an invalid operation/type");
    }
    let mut h = Hdr::new(H_RMW_REPLY);
    h.u64(token);
    st.am.push_owned(src, h, old);
    Some(())
}

pub(super) fn grant_waiters(st: &mut Ctx<'_>, win: u32) {
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

fn unlock(st: &mut Ctx<'_>, src: Rank, win: u32, token: u64) -> Option<()> {
    let w = target_win!(st, src, win);
    if !w.unlock(src) {
        // An origin whose wait for the lock ran out (WEFT_TIMEOUT) ends its epoch with an
        // UNLOCK while its request still waits here: that withdraws the request. (Had the
        // lock been granted meanwhile, `unlock` above released it.)
        let waiting = w
            .waiters
            .iter()
            .position(|x| matches!(x, Waiter::Lock { origin, .. } if *origin == src));
        let Some(i) = waiting else {
            return bad(st, src, "UNLOCK of a lock it does not hold");
        };
        w.waiters.remove(i);
    }
    reply(st, src, H_ACK, token);
    grant_waiters(st, win);
    Some(())
}

/// Batch header (after the handler byte): win u32, flags u8, lock kind u8, sync token u64.
fn batch(st: &mut Ctx<'_>, src: Rank, hdr: &[u8], payload: &[u8]) -> Option<()> {
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
fn apply_batch(
    st: &mut Ctx<'_>,
    src: Rank,
    hdr: &[u8],
    payload: &[u8],
    _locked: bool,
) -> Option<()> {
    let mut rd = Rd::new(hdr);
    let win = rd.u32()?;
    let flags = rd.u8()?;
    let _lk = rd.u8()?;
    let token = rd.u64()?;
    // The data of the batch's small gets goes back in batches too (a message per get would
    // give back on the way home what aggregation saved on the way out).
    let chunk = st.am.caps.max_am_payload;
    let mut replies: Vec<u8> = Vec::new();
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
            R_GET if REPLY_REC + len <= chunk => {
                let t = p.u64()?;
                if replies.len() + REPLY_REC + len > chunk {
                    let full = std::mem::replace(&mut replies, st.am.spare_buf());
                    st.am
                        .push_out(src, Out::Owned(Hdr::new(H_REPLY_BATCH), full));
                }
                if replies.capacity() == 0 {
                    replies = st.am.spare_buf();
                }
                get_into(st, src, win, off, len, t, &mut replies)?;
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
    if !replies.is_empty() {
        st.am
            .push_out(src, Out::Owned(Hdr::new(H_REPLY_BATCH), replies));
    }
    if flags & (B_COMPLETE | B_UNLOCK | B_FENCE) != 0 {
        // The gets of this batch are queued as window reads: copy them before the epoch ends.
        st.am.own_raw_to(src);
    }
    if flags & B_COMPLETE != 0 {
        let w = target_win!(st, src, win);
        *w.completes.entry(src).or_insert(0) += 1;
    }
    if flags & B_FENCE != 0 {
        let w = target_win!(st, src, win);
        *w.fences.entry(src).or_insert(0) += 1;
    }
    if flags & B_FLUSH != 0 {
        reply(st, src, H_ACK, token);
    }
    if flags & B_UNLOCK != 0 {
        unlock(st, src, win, token)?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::Caps;

    /// Deliver reply batch `p` from rank 1: whether it was refused (unparsable, or the peer
    /// failed for it).
    fn refused(rma: &mut RmaState, am: &mut AmState, p: &[u8]) -> bool {
        let mut cx = Ctx { rma, am };
        let mut rd = Rd::new(&[]);
        let parsed = on_am(&mut cx, 1, H_REPLY_BATCH, &mut rd, p);
        parsed.is_none() || cx.am.is_failed(1)
    }

    fn record(token: u64, data: &[u8]) -> Vec<u8> {
        let mut r = token.to_le_bytes().to_vec();
        r.extend_from_slice(&(data.len() as u32).to_le_bytes());
        r.extend_from_slice(data);
        r
    }

    /// Packed gets share one wait: each reply (a batch record, or chunks of a large get) lands
    /// by its sub-token in its own buffer, the wait is done only when every non-empty buffer
    /// is full, and a record that names no destination of the wait, or lands twice, fails the
    /// peer. A late reply for a wait given up is dropped quietly.
    #[test]
    fn packed_gets_land_by_sub_token_under_one_wait() {
        let mut rma = RmaState::default();
        let mut am = AmState::new(2, Caps::am_only(64, 1024, 4), (0, 0));
        let (mut a, mut b, mut z) = ([0u8; 4], [0u8; 6], [0u8; 0]);
        let g = rma.gets_wait(1);
        let sa = rma.add_get(g, a.as_mut_ptr(), 4).unwrap();
        let sz = rma.add_get(g, z.as_mut_ptr(), 0).unwrap();
        let sb = rma.add_get(g, b.as_mut_ptr(), 6).unwrap();
        assert_eq!(split_token(sb), (g, Some(2)));
        assert_eq!(split_token(g), (g, None));
        assert!(!rma.is_done(g));
        let mut cx = Ctx {
            rma: &mut rma,
            am: &mut am,
        };
        // b in two chunks (a large get's replies), a and the empty one in a batch.
        let mut h = Hdr::new(H_GET_REPLY);
        h.u64(sb).u64(3);
        let hb = h.bytes().to_vec();
        let mut rd = Rd::new(&hb[1..]);
        assert!(on_am(&mut cx, 1, H_GET_REPLY, &mut rd, &[4, 5, 6]).is_some());
        assert!(!cx.rma.is_done(g));
        let mut p = record(sa, &[1, 2, 3, 4]);
        p.extend(record(sz, &[]));
        let mut rd = Rd::new(&[]);
        assert!(on_am(&mut cx, 1, H_REPLY_BATCH, &mut rd, &p).is_some());
        assert!(!cx.rma.is_done(g), "b is still short");
        let mut h = Hdr::new(H_GET_REPLY);
        h.u64(sb).u64(0);
        let hb = h.bytes().to_vec();
        let mut rd = Rd::new(&hb[1..]);
        assert!(on_am(&mut cx, 1, H_GET_REPLY, &mut rd, &[1, 2, 3]).is_some());
        assert!(!cx.am.is_failed(1));
        assert!(cx.rma.is_done(g));
        assert_eq!((a, b), ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]));
        assert!(cx.rma.take(g).is_ok());

        // Records the wait cannot take: each fails the peer and writes nothing.
        let bad_records = |g: u64, sa: u64| -> [Vec<u8>; 4] {
            [
                record(sa, &[9; 4]).repeat(2), // lands twice
                record(sa | 7 << 40, &[9; 4]), // no such destination
                record(g, &[9; 4]),            // the wait's own token
                record(sa, &[9; 3]),           // shorter than the request
            ]
        };
        for i in 0..4 {
            let mut rma = RmaState::default();
            let mut am = AmState::new(2, Caps::am_only(64, 1024, 4), (0, 0));
            let mut c = [0u8; 4];
            let g = rma.gets_wait(1);
            let sa = rma.add_get(g, c.as_mut_ptr(), 4).unwrap();
            let p = &bad_records(g, sa)[i];
            assert!(refused(&mut rma, &mut am, p), "case {i}");
            if i > 0 {
                assert_eq!(c, [0; 4], "case {i}: nothing written");
            }
        }

        // Given up (a wait that failed): a late reply is dropped, the peer stays.
        let mut rma = RmaState::default();
        let mut am = AmState::new(2, Caps::am_only(64, 1024, 4), (0, 0));
        let mut c = [0u8; 4];
        let g = rma.gets_wait(1);
        let sa = rma.add_get(g, c.as_mut_ptr(), 4).unwrap();
        assert!(rma.take(g).is_ok());
        am.note_quarantined(g);
        assert!(!refused(&mut rma, &mut am, &record(sa, &[9; 4])));
        assert_eq!(c, [0; 4]);
    }

    /// Sub-tokens are made only while the wait's sequence number and the index fit beside
    /// each other, and never look like a plain token.
    #[test]
    fn sub_tokens_fit_or_are_refused() {
        use crate::am::TOKEN_RMA;
        let t = TOKEN_RMA | 5;
        let s = sub_token(t, 3).unwrap();
        assert_ne!(s, t);
        assert_eq!(split_token(s), (t, Some(3)));
        assert_eq!(sub_token(TOKEN_RMA | (SUB_SEQ + 1), 0), None);
        assert_eq!(sub_token(t, SUB_IDX as usize + 1), None);
        assert_eq!(sub_token(5, 0), None, "not an RMA token");
        assert_eq!(
            split_token(TOKEN_RMA | SUB_SEQ),
            (TOKEN_RMA | SUB_SEQ, None)
        );
    }

    /// Two gets answered by one reply batch land each in its own buffer; a record unlike its
    /// request, one for no request, or a truncated one fails the peer and writes nothing more.
    #[test]
    fn reply_batches_land_each_record_or_fail_the_peer() {
        let mut rma = RmaState::default();
        let mut am = AmState::new(2, Caps::am_only(64, 1024, 4), (0, 0));
        let (mut a, mut b) = ([0u8; 4], [0u8; 3]);
        let ta = rma.token(
            Wait::Data {
                ptr: a.as_mut_ptr(),
                len: 4,
                got: 0,
            },
            1,
        );
        let tb = rma.token(
            Wait::Data {
                ptr: b.as_mut_ptr(),
                len: 3,
                got: 0,
            },
            1,
        );
        let mut p = record(ta, &[1, 2, 3, 4]);
        p.extend(record(tb, &[5, 6, 7]));
        let mut cx = Ctx {
            rma: &mut rma,
            am: &mut am,
        };
        let mut rd = Rd::new(&[]);
        assert!(on_am(&mut cx, 1, H_REPLY_BATCH, &mut rd, &p).is_some());
        assert!(!cx.am.is_failed(1));
        assert!(cx.rma.waits.values().all(|w| w.done()));
        assert_eq!((a, b), ([1, 2, 3, 4], [5, 6, 7]));

        let bad: [Vec<u8>; 3] = [
            record(ta, &[9; 5]),                // longer than the request
            record(12345, &[9; 4]),             // no such request
            record(ta, &[9; 4])[..10].to_vec(), // truncated
        ];
        for (i, p) in bad.iter().enumerate() {
            let mut rma = RmaState::default();
            let mut am = AmState::new(2, Caps::am_only(64, 1024, 4), (0, 0));
            let mut c = [0u8; 4];
            let t = rma.token(
                Wait::Data {
                    ptr: c.as_mut_ptr(),
                    len: 4,
                    got: 0,
                },
                1,
            );
            assert_eq!(t, ta, "tokens are numbered alike in a fresh state");
            assert!(refused(&mut rma, &mut am, p), "case {i}");
            assert_eq!(c, [0; 4], "case {i}: nothing written");
        }
    }
}

//! Issuing operations: native or active-message paths, deferral and reordering, aggregation
//! into batches, and waiting for local completion (counters, tokens).
//!
//! Size (over 800 lines): one concern, turning an epoch's operations into provider calls or active
//! messages and waiting for them; the native, active-message and batch paths share the deferral
//! queue, the token bookkeeping and the registrations held per epoch, which splitting would spread
//! across files.

use super::*;

impl<'w, P: Provider> Window<'w, P> {
    // ------------------------------------------------------------------------------ issuing

    /// Record or issue an operation.
    pub(super) fn submit(&self, op: PendingOp, deferrable: bool) -> Result<()> {
        self.epoch_ops.set(self.epoch_ops.get() + 1);
        if self.sched.defers() && deferrable {
            if self.sched == Sched::Reorder && op.kind == OpKind::Get {
                // Reordering as the program goes: a get leaves at once, ahead of the puts held
                // so far, and takes the oldest of them along, so that the two directions
                // interleave while the target is busy anyway (rather than idling until the
                // synchronisation). Held operations that no get releases leave at the sync.
                self.issue(op, None)?;
                let i = self.released.get();
                let held = self.pending.borrow().get(i).copied();
                if let Some(h) = held {
                    self.released.set(i + 1);
                    self.issue(h, None)?;
                }
                return Ok(());
            }
            self.pending.borrow_mut().push(op);
            Ok(())
        } else {
            self.issue(op, None).map(|_| ())
        }
    }

    pub(super) fn is_native(&self, k: OpKind) -> bool {
        match k {
            OpKind::Put => self.native_put,
            OpKind::Get => self.native_get,
            OpKind::Acc(..) | OpKind::Rmw(..) => self.native_atomics,
        }
    }

    /// Issue one operation now. Returns the token to wait on for its (local) completion, if
    /// any.
    pub(super) fn issue(&self, op: PendingOp, force_token: Option<()>) -> Result<Option<u64>> {
        self.await_done(op.trank)?;
        self.epoch_ops.set(self.epoch_ops.get() + 1);
        let target = self.world(op.trank);
        let peer = self.peers[op.trank as usize];
        let mut eng = self.engine();
        if self.is_native(op.kind) {
            let _ = peer;
            let base = match &self.keys {
                Some(k) => k[op.trank as usize],
                // Scalable registration: the key is the window id, addresses are offsets.
                None => RemoteAddr {
                    addr: 0,
                    key: self.id as u64,
                },
            };
            let ra = RemoteAddr {
                addr: base.addr + op.toff as u64,
                key: base.key,
            };
            let e = &mut *eng;
            e.st.am.touch(&mut e.p, target)?;
            // An HCA takes one element per atomic: longer ones go in pieces, which share the
            // operation's completion (counter increments or one token reported per piece).
            let elems = match op.kind {
                OpKind::Acc(_, ty) | OpKind::Rmw(_, ty) => op.len / ty.size(),
                _ => 0,
            };
            let per = match e.st.am.caps.atomic_max_count {
                0 => elems.max(1),
                m => m,
            };
            let pieces = if elems > 0 { elems.div_ceil(per) } else { 1 };
            // Bulk operations count on the window's counter; request-based ones (and every one
            // when the provider has no counters) get a CQ entry of their own.
            let (done, t) = match (self.cntr, force_token) {
                (Some(c), None) => {
                    self.cntr_issued.set(self.cntr_issued.get() + pieces as u64);
                    let mut ts = self.cntr_targets.borrow_mut();
                    if !ts.contains(&target) {
                        ts.push(target);
                    }
                    (Completion::cntr(c), None)
                }
                _ => {
                    let t = e.st.rma.token(
                        Wait::Native {
                            win: self.id,
                            pending: pieces as u32,
                            err: None,
                        },
                        target,
                    );
                    if let Some(w) = e.st.rma.wins.get_mut(&self.id) {
                        w.native_issued += pieces as u64;
                    }
                    (Completion::cq(t), Some(t))
                }
            };
            let mut posted = 0usize;
            let r = self.post_native(e, target, op, ra, done, per, &mut posted);
            if let Err(err) = r {
                // The pieces not posted will never be reported.
                let missing = (pieces - posted) as u64;
                match t {
                    Some(t) => {
                        if let Some(Wait::Native {
                            pending, err: e2, ..
                        }) = e.st.rma.waits.get_mut(&t)
                        {
                            *pending -= missing as u32;
                            e2.get_or_insert(err.clone());
                        }
                        if let Some(w) = e.st.rma.wins.get_mut(&self.id) {
                            w.native_issued -= missing;
                        }
                        if posted == 0 {
                            e.st.rma.take(t).ok();
                            return Err(err);
                        }
                        // Some pieces are out: the error surfaces when their token completes.
                        self.tokens.borrow_mut().push(t);
                        return Ok(Some(t));
                    }
                    None => {
                        // Pieces already posted still count on the window's counter.
                        self.cntr_issued.set(self.cntr_issued.get() - missing);
                        return Err(err);
                    }
                }
            }
            let Some(t) = t else {
                return Ok(None);
            };
            self.tokens.borrow_mut().push(t);
            return Ok(Some(t));
        }
        drop(eng);
        self.issue_am(op, force_token.is_some())
    }

    /// Make the native writes of this epoch to `targets` (communicator ranks; `None`: all)
    /// visible at their targets, for providers whose writes complete at transmission: one
    /// fenced 1-byte read per written target, which the provider starts only once the earlier
    /// writes to it are done there.
    pub(super) fn prove_delivery(&self, targets: Option<&[u32]>) -> Result<()> {
        let mut mine: SmallVec<[u32; 4]> = SmallVec::new();
        {
            let mut w = self.written.borrow_mut();
            match targets {
                Some(ts) => {
                    for &t in ts {
                        if std::mem::take(&mut w[t as usize]) {
                            mine.push(t);
                        }
                    }
                }
                None => {
                    for (t, x) in w.iter_mut().enumerate() {
                        if std::mem::take(x) {
                            mine.push(t as u32);
                        }
                    }
                }
            }
        }
        if mine.is_empty() {
            return Ok(());
        }
        let mut toks: SmallVec<[u64; 4]> = SmallVec::new();
        let mut eng = self.engine();
        let e = &mut *eng;
        let probe = self.probe.borrow_mut().as_mut_ptr();
        let mut err = None;
        for t in mine {
            let target = self.world(t);
            let ra = match &self.keys {
                Some(k) => k[t as usize],
                None => RemoteAddr {
                    addr: 0,
                    key: self.id as u64,
                },
            };
            let tok = e.st.rma.token(
                Wait::Native {
                    win: self.id,
                    pending: 1,
                    err: None,
                },
                target,
            );
            let d = if e.st.am.caps.mr_local {
                match e.st.am.mr.acquire(&mut e.p, probe, 1, Access::LOCAL_WRITE) {
                    Ok((d, m)) => {
                        self.local_mrs.borrow_mut().push(m);
                        d
                    }
                    Err(x) => {
                        e.st.rma.take(tok).ok();
                        err.get_or_insert(x);
                        continue;
                    }
                }
            } else {
                0
            };
            let local = [RawIovMut {
                ptr: probe,
                len: 1,
                desc: d,
            }];
            // SAFETY: `probe` is owned by the window, which outlives the read: this function
            // waits for it (or the failed wait ends the process, see quarantine_rma).
            match unsafe {
                e.p.rma_read(target, &local, ra, Completion::cq(tok).fenced())
            } {
                Ok(()) => toks.push(tok),
                Err(x) => {
                    e.st.rma.take(tok).ok();
                    err.get_or_insert(x);
                }
            }
        }
        let waited = eng.wait_until("RMA writes to become visible at their targets", |e| {
            toks.iter().all(|t| e.st.rma.is_done(*t))
        });
        if let Err(x) = waited {
            eng.quarantine_rma(&toks, true);
            return Err(x);
        }
        for t in toks {
            if let Err(x) = eng.st.rma.take(t) {
                err.get_or_insert(x);
            }
        }
        err.map_or(Ok(()), Err)
    }

    /// Post native operation `op` (in pieces of `per` elements for atomics), counting the
    /// pieces the provider took in `posted`. Local buffers get descriptors for providers that
    /// need them; the registrations are held until the epoch's operations have completed.
    #[allow(clippy::too_many_arguments)]
    fn post_native(
        &self,
        e: &mut Engine<P>,
        target: Rank,
        op: PendingOp,
        ra: RemoteAddr,
        done: Completion,
        per: usize,
        posted: &mut usize,
    ) -> Result<()> {
        let mr_local = e.st.am.caps.mr_local;
        let mut desc = |ptr: *const u8, len: usize, access: Access| -> Result<MrDesc> {
            if !mr_local || ptr.is_null() || len == 0 {
                return Ok(0);
            }
            let (d, m) = e.st.am.mr.acquire(&mut e.p, ptr, len, access)?;
            self.local_mrs.borrow_mut().push(m);
            Ok(d)
        };
        match op.kind {
            OpKind::Put => {
                if !e.st.am.caps.rma.is_some_and(|r| r.delivery_complete()) {
                    self.written.borrow_mut()[op.trank as usize] = true;
                }
                let d = desc(op.origin, op.len, Access::LOCAL)?;
                let local = [RawIov {
                    ptr: op.origin,
                    len: op.len,
                    desc: d,
                }];
                // SAFETY: the origin buffer is borrowed by the epoch (or owned by a request)
                // until the operation completes, which the epoch's synchronisation waits for.
                unsafe { e.p.rma_write(target, &local, ra, done)? };
                *posted += 1;
            }
            OpKind::Get => {
                let d = desc(op.result, op.len, Access::LOCAL_WRITE)?;
                let local = [RawIovMut {
                    ptr: op.result,
                    len: op.len,
                    desc: d,
                }];
                // SAFETY: as above, for the result buffer.
                unsafe { e.p.rma_read(target, &local, ra, done)? };
                *posted += 1;
            }
            OpKind::Acc(o, ty) | OpKind::Rmw(o, ty) => {
                let sz = ty.size();
                let (compare, result) = match op.kind {
                    OpKind::Rmw(..) => (op.compare, op.result),
                    _ => (std::ptr::null(), std::ptr::null_mut()),
                };
                let descs = [
                    desc(op.origin, op.len, Access::LOCAL)?,
                    desc(
                        compare,
                        if compare.is_null() { 0 } else { sz },
                        Access::LOCAL,
                    )?,
                    desc(result, op.len, Access::LOCAL_WRITE)?,
                ];
                let elems = op.len / sz;
                let mut at = 0;
                while at < elems {
                    let n = per.min(elems - at);
                    let off = at * sz;
                    // SAFETY: offsets within the operation's buffers (`elems` elements each;
                    // compare, when present, is one element and `elems` is 1 then).
                    let a = unsafe {
                        AtomicOp {
                            op: o,
                            ty,
                            count: n,
                            origin: op.origin.add(off),
                            compare,
                            result: if result.is_null() {
                                result
                            } else {
                                result.add(off)
                            },
                            desc: descs,
                        }
                    };
                    let r = RemoteAddr {
                        addr: ra.addr + off as u64,
                        key: ra.key,
                    };
                    // SAFETY: as above, for origin, compare and result.
                    unsafe { e.p.atomic(target, &a, r, done)? };
                    *posted += 1;
                    at += n;
                }
            }
        }
        Ok(())
    }

    pub(super) fn issue_am(&self, op: PendingOp, _req: bool) -> Result<Option<u64>> {
        let target = self.world(op.trank);
        let mut eng = self.engine();
        let e = &mut *eng;
        let chunk = e.st.am.caps.max_am_payload;
        self.am_dirty.borrow_mut()[op.trank as usize] = true;
        let token = match op.kind {
            OpKind::Put => {
                let mut at = 0;
                loop {
                    let n = (op.len - at).min(chunk);
                    let mut h = Hdr::new(rma::H_PUT);
                    h.u32(self.id).u64((op.toff + at) as u64);
                    // SAFETY: the origin buffer is borrowed by the epoch, which drains the
                    // outbox before it ends (see Out::Raw).
                    let r = RawIov {
                        desc: 0,
                        ptr: unsafe { op.origin.add(at) },
                        len: n,
                    };
                    e.st.am.push_out(target, Out::Raw(h, r));
                    at += n;
                    if at >= op.len {
                        break;
                    }
                }
                None
            }
            OpKind::Get => {
                let t = e.st.rma.token(
                    Wait::Data {
                        ptr: op.result,
                        len: op.len,
                        got: 0,
                    },
                    target,
                );
                let mut h = Hdr::new(rma::H_GET);
                h.u32(self.id).u64(op.toff as u64).u64(op.len as u64).u64(t);
                e.st.am.push_ctrl(target, h);
                Some(t)
            }
            OpKind::Acc(o, ty) => {
                let per = (chunk / ty.size()).max(1) * ty.size();
                let mut at = 0;
                loop {
                    let n = (op.len - at).min(per);
                    let mut h = Hdr::new(rma::H_ACC);
                    h.u32(self.id)
                        .u64((op.toff + at) as u64)
                        .u8(o as u8)
                        .u8(ty as u8);
                    // SAFETY: as for puts.
                    let r = RawIov {
                        desc: 0,
                        ptr: unsafe { op.origin.add(at) },
                        len: n,
                    };
                    e.st.am.push_out(target, Out::Raw(h, r));
                    at += n;
                    if at >= op.len {
                        break;
                    }
                }
                None
            }
            OpKind::Rmw(o, ty) => {
                let t = e.st.rma.token(
                    Wait::Reply {
                        ptr: op.result,
                        len: op.len,
                        done: false,
                    },
                    target,
                );
                let cmp = !op.compare.is_null();
                let mut data = Vec::with_capacity(op.len * 2);
                // SAFETY: origin (and compare) hold `len` bytes, borrowed by the epoch.
                unsafe {
                    data.extend_from_slice(std::slice::from_raw_parts(op.origin, op.len));
                    if cmp {
                        data.extend_from_slice(std::slice::from_raw_parts(op.compare, op.len));
                    }
                }
                let mut h = Hdr::new(rma::H_RMW);
                h.u32(self.id)
                    .u64(op.toff as u64)
                    .u8(o as u8)
                    .u8(ty as u8)
                    .u64(t)
                    .u8(cmp as u8);
                e.st.am.push_owned(target, h, data);
                Some(t)
            }
        };
        if let Some(t) = token {
            self.tokens.borrow_mut().push(t);
        }
        e.flush_out()?;
        Ok(token)
    }

    /// Issue the deferred operations in the policy's order; with aggregation, pack small
    /// active-message operations per target into batches. `fold` names a sync to fold into
    /// the last batch of each target in `fold_targets`: returns the targets whose sync was
    /// folded (their sync message must not be sent again).
    pub(super) fn drain_pending(&self, fold: Option<(u8, &[(u32, u64)])>) -> Result<Targets> {
        // Keep the list's capacity across epochs: an epoch should not cost an allocation.
        let mut ops = std::mem::take(&mut *self.pending.borrow_mut());
        // Operations a get already released (reorder) are issued: drop them from the list.
        let released = self.released.replace(0).min(ops.len());
        ops.drain(..released);
        if ops.is_empty() && fold.is_none() {
            *self.pending.borrow_mut() = ops;
            return Ok(Targets::new());
        }
        let r = self.drain_ops(&mut ops, fold);
        ops.clear();
        let mut p = self.pending.borrow_mut();
        if p.is_empty() {
            *p = ops;
        }
        r
    }

    pub(super) fn drain_ops(
        &self,
        ops: &mut Vec<PendingOp>,
        fold: Option<(u8, &[(u32, u64)])>,
    ) -> Result<Targets> {
        let is_get = |o: &PendingOp| o.kind == OpKind::Get;
        let aggregates = self.sched.aggregates();
        if (self.sched.reorders() || aggregates)
            && ops.iter().any(is_get)
            && !ops.iter().all(is_get)
        {
            // Gets first; puts and accumulates keep their relative order. (Nothing to do unless
            // both kinds are present.) Issued one by one, the gets are interleaved with the
            // rest so that both directions carry data; packed, they go first in a batch of
            // their own (below), which the target answers while the origin packs the rest:
            // an aggregated epoch is otherwise a chain — the whole batch out, the target's
            // work, the replies back.
            let mut scratch = self.reorder_scratch.borrow_mut();
            let (gets, rest) = &mut *scratch;
            for op in ops.drain(..) {
                if is_get(&op) {
                    gets.push(op);
                } else {
                    rest.push(op);
                }
            }
            if aggregates {
                ops.append(gets);
                ops.append(rest);
            } else {
                let (mut g, mut r) = (gets.drain(..), rest.drain(..));
                loop {
                    match (g.next(), r.next()) {
                        (None, None) => break,
                        (a, b) => {
                            ops.extend(a);
                            ops.extend(b);
                        }
                    }
                }
            }
        }
        if !aggregates {
            for op in ops.drain(..) {
                self.issue(op, None)?;
            }
            return Ok(Targets::new());
        }
        // A lazy lock may only ride on a batch that carries every operation to its target;
        // otherwise take the lock explicitly before issuing anything.
        if let Some((lt, lk)) = self.lazy_lock.get() {
            let chunk = self.engine().st.am.caps.max_am_payload;
            let mut bytes = 0usize;
            let all_small = ops.iter().filter(|o| o.trank == lt).all(|o| {
                bytes += Self::record_len(o);
                self.aggregatable(o, chunk)
            });
            if !all_small || bytes > chunk || fold.is_none() {
                self.lazy_lock.set(None);
                self.roundtrip(rma::H_LOCK, lt, Some(lk))?;
            }
        }
        // Aggregation: per target, consecutive small AM operations go into batch records.
        // One entry per target this epoch touches (not per rank of the communicator): its
        // batch, the batch's record count, the wait its packed gets share (see
        // `record_into`), and whether the batch holds gets only.
        type Batch = (u32, Vec<u8>, u64, Option<u64>, bool);
        let mut batches: SmallVec<[Batch; 4]> = SmallVec::new();
        fn slot(b: &mut SmallVec<[Batch; 4]>, t: u32) -> usize {
            b.iter().position(|e| e.0 == t).unwrap_or_else(|| {
                b.push((t, Vec::new(), 0, None, true));
                b.len() - 1
            })
        }
        let chunk = self.engine().st.am.caps.max_am_payload;
        // A lazy lock rides on the last batch to its target: nothing may go there before it.
        let lazy = self.lazy_lock.get().map(|(lt, _)| lt);
        // The target of the previous operation (epochs mostly go to one target at a time).
        let mut last = usize::MAX;
        for op in ops.drain(..) {
            let i = match batches.get(last) {
                Some(b) if b.0 == op.trank => last,
                _ => slot(&mut batches, op.trank),
            };
            last = i;
            let (t, buf, count, gets, gets_only) = &mut batches[i];
            if !is_get(&op) {
                // The gets packed so far leave now, ahead of the rest (see above).
                if *gets_only && *count > 0 && lazy != Some(*t) {
                    self.send_batch(*t, buf, count, 0, 0, 0)?;
                }
                *gets_only = false;
            }
            let small = self.aggregatable(&op, chunk);
            if !small {
                self.send_batch(*t, buf, count, 0, 0, 0)?;
                self.issue(op, None)?;
                continue;
            }
            if !buf.is_empty() && buf.len() + Self::record_len(&op) > chunk {
                self.send_batch(*t, buf, count, 0, 0, 0)?;
            }
            if buf.capacity() == 0 {
                *buf = self.engine().st.am.spare_buf();
            }
            self.record_into(op, buf, gets)?;
            *count += 1;
        }
        let mut folded = Targets::new();
        if let Some((flag, targets)) = fold {
            for &(tr, token) in targets {
                let lock = self.lazy_lock.get().filter(|(lt, _)| *lt == tr);
                let has = batches.iter().any(|e| e.0 == tr && !e.1.is_empty());
                if !has && lock.is_none() && flag & (rma::B_COMPLETE | rma::B_FENCE) == 0 {
                    continue;
                }
                let (lflag, lkind) = match lock {
                    Some((_, k)) => (rma::B_LOCK, k),
                    None => (0, 0),
                };
                let i = slot(&mut batches, tr);
                let (t, buf, count, _, _) = &mut batches[i];
                self.send_batch(*t, buf, count, flag | lflag, lkind, token)?;
                if lock.is_some() {
                    self.lazy_lock.set(None);
                }
                folded.push(tr);
            }
        }
        for (t, buf, count, _, _) in &mut batches {
            self.send_batch(*t, buf, count, 0, 0, 0)?;
        }
        Ok(folded)
    }

    /// Whether `op` goes into a batch: small by `WEFT_RMA_AGG_MAX`, on the active-message
    /// path (or a put or get of a window that packs those although they could go natively;
    /// atomics never leave their path, so that they stay atomic with each other), and its
    /// record fits one active message of `chunk` bytes (so a batch never exceeds what the
    /// provider carries, whatever `WEFT_RMA_AGG_MAX` says).
    pub(super) fn aggregatable(&self, op: &PendingOp, chunk: usize) -> bool {
        let path = !self.is_native(op.kind)
            || (self.pack_native && matches!(op.kind, OpKind::Put | OpKind::Get));
        op.len <= self.agg_max && path && Self::record_len(op) <= chunk
    }

    /// Bytes of `op`'s batch record: kind, offset and length, at most 11 bytes of operation
    /// fields, then the origin (and compare) data.
    pub(super) fn record_len(op: &PendingOp) -> usize {
        let data = match op.kind {
            OpKind::Get => 0,
            _ if !op.compare.is_null() => 2 * op.len,
            _ => op.len,
        };
        13 + 11 + data
    }

    /// Append one operation's batch record to `r`; registers a wait for returned data (a
    /// get: a destination of `gets`, the wait this drain's packed gets to the target share,
    /// made at the first).
    pub(super) fn record_into(
        &self,
        op: PendingOp,
        r: &mut Vec<u8>,
        gets: &mut Option<u64>,
    ) -> Result<()> {
        let target = self.world(op.trank);
        let (kind, token) = match op.kind {
            OpKind::Put => (rma::R_PUT, None),
            OpKind::Acc(..) => (rma::R_ACC, None),
            OpKind::Get => (rma::R_GET, Some(self.get_token(gets, target, &op))),
            OpKind::Rmw(..) => {
                let t = self.engine().st.rma.token(
                    Wait::Reply {
                        ptr: op.result,
                        len: op.len,
                        done: false,
                    },
                    target,
                );
                (rma::R_RMW, Some(t))
            }
        };
        if let (Some(t), OpKind::Rmw(..)) = (token, op.kind) {
            self.tokens.borrow_mut().push(t);
        }
        let cmp = !op.compare.is_null();
        let data_len = if cmp { op.len * 2 } else { op.len };
        let len_field = if matches!(op.kind, OpKind::Rmw(..)) {
            data_len
        } else {
            op.len
        };
        // The record's fixed fields, written into one array and appended at once (a push or
        // an extend per field cost a capacity check each, per operation of every batch).
        let mut h = [0u8; 24];
        h[0] = kind;
        h[1..9].copy_from_slice(&(op.toff as u64).to_le_bytes());
        h[9..13].copy_from_slice(&(len_field as u32).to_le_bytes());
        let t = token.unwrap_or(0).to_le_bytes();
        let n = match op.kind {
            OpKind::Put => 13,
            OpKind::Get => {
                h[13..21].copy_from_slice(&t);
                21
            }
            OpKind::Acc(o, ty) => {
                h[13] = o as u8;
                h[14] = ty as u8;
                15
            }
            OpKind::Rmw(o, ty) => {
                h[13] = o as u8;
                h[14] = ty as u8;
                h[15..23].copy_from_slice(&t);
                h[23] = cmp as u8;
                24
            }
        };
        let data = if matches!(op.kind, OpKind::Get) {
            0
        } else {
            data_len
        };
        r.reserve(n + data);
        r.extend_from_slice(&h[..n]);
        if matches!(op.kind, OpKind::Put | OpKind::Acc(..) | OpKind::Rmw(..)) {
            // SAFETY: origin (and compare) buffers hold `len` bytes, borrowed by the epoch.
            unsafe {
                r.extend_from_slice(std::slice::from_raw_parts(op.origin, op.len));
                if cmp {
                    r.extend_from_slice(std::slice::from_raw_parts(op.compare, op.len));
                }
            }
        }
        Ok(())
    }

    /// The token a packed get's record carries: a sub-token of `gets` (made now if this is
    /// the first), or, past what sub-tokens can number, a token of its own.
    fn get_token(&self, gets: &mut Option<u64>, target: Rank, op: &PendingOp) -> u64 {
        let mut eng = self.engine();
        let rma = &mut eng.st.rma;
        let g = *gets.get_or_insert_with(|| {
            let g = rma.gets_wait(target);
            self.tokens.borrow_mut().push(g);
            g
        });
        if let Some(t) = rma.add_get(g, op.result, op.len) {
            return t;
        }
        let t = rma.token(
            Wait::Data {
                ptr: op.result,
                len: op.len,
                got: 0,
            },
            target,
        );
        self.tokens.borrow_mut().push(t);
        t
    }

    /// Before an operation goes to `trank`: wait until it has said it applied the epoch of the
    /// last fence (its DONE), so that nothing of the next epoch overtakes what another rank
    /// sent it in that one. Usually long arrived; free once every rank's has been seen.
    pub(super) fn await_done(&self, trank: u32) -> Result<()> {
        self.await_done_or(trank, false)
    }

    /// [`Self::await_done`]; with `freeing`, the wait also ends when any rank of the window
    /// has failed: a fence that a failure cut short on some rank never sends its DONE there.
    pub(super) fn await_done_or(&self, trank: u32, freeing: bool) -> Result<()> {
        let k = self.fences.get();
        if self.done_seen.get() >= k {
            return Ok(());
        }
        let id = self.id;
        let n = self.comm.size();
        let worlds: SmallVec<[Rank; 8]> = (0..n).map(|t| self.world(t)).collect();
        let target = self.world(trank);
        let mut eng = self.engine();
        let mut failed = None;
        eng.wait_until("fence: the target's DONE", |e| {
            let Some(w) = e.st.rma.wins.get(&id) else {
                return true;
            };
            if w.dones.get(&target).copied().unwrap_or(0) >= k {
                return true;
            }
            if let Some(why) = e.st.am.peer_failure(target) {
                failed = Some(Error::peer_failed(target, why));
                return true;
            }
            if freeing && e.st.am.nfailed > 0 {
                if let Some(&r) = worlds.iter().find(|r| e.st.am.is_failed(**r)) {
                    let why = e.st.am.peer_failure(r).unwrap_or("failed").to_string();
                    failed = Some(Error::peer_failed(r, why));
                    return true;
                }
            }
            false
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        let all = eng.st.rma.wins.get(&id).is_some_and(|w| {
            worlds
                .iter()
                .all(|r| w.dones.get(r).copied().unwrap_or(0) >= k)
        });
        if all {
            self.done_seen.set(k);
        }
        Ok(())
    }

    /// Send a batch (if it has records or a sync flag).
    pub(super) fn send_batch(
        &self,
        trank: u32,
        buf: &mut Vec<u8>,
        count: &mut u64,
        flags: u8,
        lock_kind: u8,
        token: u64,
    ) -> Result<()> {
        if buf.is_empty() && flags == 0 {
            return Ok(());
        }
        if !buf.is_empty() {
            self.await_done(trank)?;
        }
        let target = self.world(trank);
        let mut h = Hdr::new(rma::H_BATCH);
        h.u32(self.id).u8(flags).u8(lock_kind).u64(token);
        let data = std::mem::take(buf);
        let mut eng = self.engine();
        eng.st.am.push_out(target, Out::Owned(h, data));
        *count = 0;
        self.am_dirty.borrow_mut()[trank as usize] = true;
        eng.flush_out()?;
        Ok(())
    }

    /// Wait for every operation issued so far to complete at the origin (replies arrived,
    /// native operations done, the outbox drained), returning the first error.
    pub(super) fn complete_local(&self) -> Result<()> {
        let mut toks = std::mem::take(&mut *self.tokens.borrow_mut());
        let id = self.id;
        let mut eng = self.engine();
        let mut cntr_err = None;
        // Tokens before `ready` are done (a done token stays done until taken below): each
        // round looks up only those not seen done yet, not every token of the epoch again.
        let mut ready = 0;
        let waited = eng.wait_until("RMA operations to complete", |e| {
            while toks.get(ready).is_some_and(|t| e.st.rma.is_done(*t)) {
                ready += 1;
            }
            ready == toks.len()
                && e.st.out_idle()
                && e.st
                    .rma
                    .wins
                    .get(&id)
                    .is_none_or(|w| w.native_done >= w.native_issued)
                && self.cntr_caught_up(e, &mut cntr_err)
        });
        if let Err(err) = waited {
            // The epoch's buffers go back to the caller with the error: nothing may land in
            // them later.
            let native_outstanding = eng
                .st
                .rma
                .wins
                .get(&id)
                .is_some_and(|w| w.native_done < w.native_issued)
                || (self.cntr.is_some() && self.cntr_seen.get().total() < self.cntr_issued.get());
            eng.quarantine_rma(&toks, native_outstanding);
            return Err(err);
        }
        let mut first = cntr_err;
        for t in toks.drain(..) {
            if let Err(err) = eng.st.rma.take(t) {
                first.get_or_insert(err);
            }
        }
        // Every native operation of the epoch is over: their buffers need no descriptor now.
        for m in self.local_mrs.borrow_mut().drain(..) {
            eng.st.am.mr.release(m);
        }
        // Keep the list's capacity for the next epoch.
        let mut tokens = self.tokens.borrow_mut();
        if tokens.is_empty() {
            *tokens = toks;
        }
        first.map_or(Ok(()), Err)
    }

    /// Has the window's counter reached the number of operations issued on it? A failed
    /// operation, or the death of a rank a counted operation went to, ends the wait with an
    /// error in `err`.
    pub(super) fn cntr_caught_up(&self, e: &mut Engine<P>, err: &mut Option<Error>) -> bool {
        let Some(c) = self.cntr else {
            return true;
        };
        let issued = self.cntr_issued.get();
        let seen = self.cntr_seen.get();
        if seen.total() >= issued {
            return true;
        }
        let v = match e.p.cntr_read(c) {
            Ok(v) => v,
            Err(x) => {
                err.get_or_insert(x);
                return true;
            }
        };
        self.cntr_seen.set(v);
        if v.err > seen.err {
            let rank = self.cntr_targets.borrow().first().copied().unwrap_or(0);
            err.get_or_insert(Error::from(ErrorDetail::RemoteAccess {
                rank,
                what: format!(
                    "{} RMA operation(s) of this window failed (provider counter)",
                    v.err - seen.err
                ),
            }));
        }
        if v.total() >= issued {
            self.cntr_targets.borrow_mut().clear();
            return true;
        }
        if let Some(&dead) = self
            .cntr_targets
            .borrow()
            .iter()
            .find(|r| e.st.peer_failure(**r).is_some())
        {
            let why = e.st.peer_failure(dead).unwrap_or_default();
            err.get_or_insert(Error::peer_failed(dead, &why));
            // The operations to the dead rank will never be counted.
            self.cntr_issued.set(v.total());
            return true;
        }
        false
    }

    /// Send a one-message sync (UNLOCK/FLUSH/LOCK) to `trank` and wait for its answer.
    pub(super) fn roundtrip(&self, kind: u8, trank: u32, lock_kind: Option<u8>) -> Result<()> {
        let target = self.world(trank);
        let mut eng = self.engine();
        let t = eng.st.rma.token(
            Wait::Reply {
                ptr: std::ptr::null_mut(),
                len: 0,
                done: false,
            },
            target,
        );
        let mut h = Hdr::new(kind);
        h.u32(self.id);
        if let Some(k) = lock_kind {
            h.u8(k);
        }
        h.u64(t);
        eng.st.am.push_ctrl(target, h);
        drop(eng);
        self.wait_token(t)
    }

    /// Wait for the operation or reply of token `t`; if the wait fails, `t` is quarantined.
    pub(super) fn wait_token(&self, t: u64) -> Result<()> {
        let mut eng = self.engine();
        let r = eng
            .flush_out()
            .and_then(|_| eng.wait_until("an RMA synchronisation reply", |e| e.st.rma.is_done(t)));
        if let Err(e) = r {
            eng.quarantine_rma(&[t], false);
            return Err(e);
        }
        eng.st.rma.take(t)
    }

    pub(super) fn new_reply_token(&self, trank: u32) -> u64 {
        let target = self.world(trank);
        self.engine().st.rma.token(
            Wait::Reply {
                ptr: std::ptr::null_mut(),
                len: 0,
                done: false,
            },
            target,
        )
    }
}

impl<'w, P: Provider> Window<'w, P> {
    /// Issue deferred operations; a lazy lock is taken explicitly first.
    pub(super) fn drain_pending_keep_lock(&self) -> Result<()> {
        if let Some((t, k)) = self.lazy_lock.take() {
            self.roundtrip(rma::H_LOCK, t, Some(k))?;
        }
        self.drain_pending(None).map(|_| ())
    }
}

//! RMA and atomics at both ends, over weft messages (the protocol and its codec: [`crate::rma`]).
//!
//! * Origin: [`Global::rma`] posts an operation — a control message, and for a long write or
//!   read its data as a message of its own — and keeps it as an [`Rop`] until the target's
//!   reply has come and every data message is done; then it counts and reports it.
//! * Target: a request is checked against the registered regions (key, bounds, rights) and
//!   carried out in this process's progress: small data copied from or into the control
//!   message, long data received straight into the region or sent straight from it, atomics
//!   applied one at a time under weft-fi's lock; every request is answered.
//!
//! A region's memory is written only by operations whose request passed its checks while it
//! was registered, and closing a region waits until none of them is left
//! ([`Global::mr_close`]), so that no late write lands in memory the application may free.

use crate::rma::{self, Kind, RHdr, Region, ATOMIC_MAX, INLINE};
use crate::serr;
use crate::state::{code_of, Entry, Global, Op, What, CTRL};
use std::os::raw::c_void;
use weft::{Source, TagSel};
use weft_ofi_sys as fi;

/// An origin's RMA operation waiting for its target.
pub struct Rop {
    pub ep: usize,
    rank: u32,
    ctx: *mut c_void,
    /// The completion's flags (`FI_RMA | FI_WRITE`, ...).
    flags: u64,
    report: bool,
    /// Where a small read's bytes or an atomic's old value go.
    result: *mut u8,
    result_len: usize,
    /// The target's reply has not come yet.
    awaiting: bool,
    /// Data messages (a long write's, a long read's) not finished yet.
    parts: u8,
    /// The first error (a positive libfabric code), 0 if none.
    err: u64,
    /// Counted as a read (else as a write) on the endpoint's counters.
    read: bool,
}

/// An RMA or atomic operation as the entry points give it.
pub struct RmaArgs {
    /// `Write`, `Read`, `Atomic`, `Fetch` or `Compare`.
    pub kind: Kind,
    /// The bytes written or the atomic's operand (null for `FI_ATOMIC_READ`).
    pub buf: *const c_void,
    /// Bytes at the target.
    pub len: usize,
    /// A compare atomic's comparand.
    pub compare: *const c_void,
    /// Where a read's bytes or a fetching atomic's old value go.
    pub result: *mut c_void,
    pub dest: u64,
    pub addr: u64,
    pub key: u64,
    pub op: u32,
    pub dtype: u32,
    pub data: Option<u64>,
    pub ctx: *mut c_void,
    pub flags: Option<u64>,
    pub inject: bool,
}

/// The rights a request needs in the target's region.
fn needs(kind: Kind) -> u64 {
    match kind {
        Kind::Write | Kind::Atomic => fi::FI_REMOTE_WRITE,
        Kind::Read => fi::FI_REMOTE_READ,
        _ => fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE,
    }
}

impl Global {
    /// Post an RMA or atomic operation.
    pub fn rma(&mut self, ep: usize, a: RmaArgs) -> isize {
        if !self.has_room() {
            return serr(fi::FI_EAGAIN);
        }
        let Some(e) = self.eps.get(&ep) else {
            return serr(fi::FI_EINVAL);
        };
        if !e.enabled {
            return serr(fi::FI_EOPBADSTATE as u64);
        }
        let flags = a.flags.unwrap_or(e.tx_op_flags);
        let inject = a.inject || flags & fi::FI_INJECT != 0;
        let atomic = matches!(a.kind, Kind::Atomic | Kind::Fetch | Kind::Compare);
        if atomic {
            if !rma::valid(a.kind, a.op, a.dtype) {
                return serr(fi::FI_EOPNOTSUPP);
            }
            if a.len > ATOMIC_MAX {
                return serr(fi::FI_EINVAL);
            }
        }
        if inject && (a.len > crate::info::INJECT || !matches!(a.kind, Kind::Write | Kind::Atomic))
        {
            return serr(fi::FI_EINVAL);
        }
        let reads_into = matches!(a.kind, Kind::Read | Kind::Fetch | Kind::Compare);
        let no_operand = a.kind == Kind::Read || (atomic && a.op == fi::FI_ATOMIC_READ);
        if a.len > 0
            && ((a.buf.is_null() && !no_operand)
                || (reads_into && a.result.is_null())
                || (a.kind == Kind::Compare && a.compare.is_null()))
        {
            return serr(fi::FI_EINVAL);
        }
        let Some(rank) = self.rank_at(e, a.dest) else {
            return serr(fi::FI_EINVAL);
        };
        let report = !inject && (!e.tx_selective || flags & fi::FI_COMPLETION != 0);
        if self.world.is_none() || self.data.is_none() {
            return serr(fi::FI_EOPBADSTATE as u64);
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut h = RHdr::new(a.kind, id);
        h.key = a.key;
        h.addr = a.addr;
        h.len = a.len as u64;
        h.data = a.data;
        h.op = a.op as u8;
        h.dtype = a.dtype as u8;
        let mut parts = 0;
        let view = |p: *const c_void| {
            if a.len == 0 {
                &[][..]
            } else {
                // SAFETY: libfabric's contract: `buf` (and `compare`) hold `len` readable
                // bytes for the call (checked non-null above); an FI_ATOMIC_READ's operand
                // is never read.
                unsafe { std::slice::from_raw_parts(p as *const u8, a.len) }
            }
        };
        let zeros;
        let operand: &[u8] = if no_operand {
            zeros = vec![0u8; if atomic { a.len } else { 0 }];
            &zeros
        } else {
            view(a.buf)
        };
        let mut payload: Vec<&[u8]> = Vec::new();
        match a.kind {
            Kind::Write if a.len > INLINE => {
                let t = self.long_tag(rank);
                h.long = Some(t);
                let dc = self.data.as_ref().expect("checked");
                // SAFETY: the buffer is the application's until this operation completes,
                // which waits for this data message (`parts`).
                match unsafe { dc.isend_raw(a.buf as *const u8, a.len, rank, t as i32, false) } {
                    Ok(req) => self.push_op(part(req, ep, id)),
                    Err(e) => return serr(code_of(&e)),
                }
                parts = 1;
            }
            Kind::Read if a.len > INLINE => {
                let n = &mut self.next_read[rank as usize];
                let t = (*n & 0x3fff_ffff) | 0x4000_0000;
                *n = n.wrapping_add(1);
                h.long = Some(t);
                let dc = self.data.as_ref().expect("checked");
                // SAFETY: the result buffer holds `len` writable bytes and is the provider's
                // until this operation completes, which waits for this receive (`parts`).
                match unsafe {
                    dc.irecv_raw(
                        a.result as *mut u8,
                        a.len,
                        Source::Rank(rank),
                        TagSel::Tag(t as i32),
                    )
                } {
                    Ok(req) => self.push_op(part(req, ep, id)),
                    Err(e) => return serr(code_of(&e)),
                }
                parts = 1;
            }
            Kind::Read => {}
            Kind::Compare => {
                payload.push(operand);
                payload.push(view(a.compare));
            }
            _ => payload.push(operand),
        }
        let (flags, read) = match a.kind {
            Kind::Write => (fi::FI_RMA | fi::FI_WRITE, false),
            Kind::Read => (fi::FI_RMA | fi::FI_READ, true),
            Kind::Atomic => (fi::FI_ATOMIC | fi::FI_WRITE, false),
            _ => (fi::FI_ATOMIC | fi::FI_READ, true),
        };
        let mut rop = Rop {
            ep,
            rank,
            ctx: a.ctx,
            flags,
            report,
            result: if reads_into && parts == 0 {
                a.result as *mut u8
            } else {
                std::ptr::null_mut()
            },
            result_len: if reads_into { a.len } else { 0 },
            awaiting: true,
            parts,
            err: 0,
            read,
        };
        if let Err(e) = self.ctrl_send(rank, &h, &payload) {
            if parts == 0 {
                return serr(e);
            }
            // The data message is posted already: the buffer stays the provider's until it
            // is done, so the error comes as the operation's completion.
            if let Some(w) = self.world.as_ref() {
                for o in &self.ops {
                    if matches!(o.what, What::Part { id: i } if i == id) {
                        let _ = w.cancel_raw(&o.req);
                    }
                }
            }
            rop.awaiting = false;
            rop.err = e;
        }
        self.rops.insert(id, rop);
        self.stats.rma_issued += 1;
        0
    }

    /// Send a control message of weft-fi's own (the bytes kept until weft is done with them).
    fn ctrl_send(&mut self, dst: u32, h: &RHdr, payload: &[&[u8]]) -> Result<(), u64> {
        let mut msg = self.spare.pop().unwrap_or_default();
        msg.clear();
        msg.extend_from_slice(&h.encode());
        for p in payload {
            msg.extend_from_slice(p);
        }
        let w: &weft::Comm = self.world.as_deref().ok_or(fi::FI_EOPBADSTATE as u64)?;
        // SAFETY: `msg` is weft-fi's own, kept in the op until weft is done with it.
        let req = unsafe { w.isend_raw(msg.as_ptr(), msg.len(), dst, CTRL, false) }
            .map_err(|e| code_of(&e))?;
        self.push_op(Op::quiet(req, 0, Some(msg), None));
        Ok(())
    }

    /// Answer the origin's operation `id` at `dst`.
    fn answer(&mut self, dst: u32, id: u64, status: u64, payload: &[u8]) {
        let mut h = RHdr::new(Kind::Reply, id);
        h.status = status as u32;
        // A failed origin gets no answer; its operations end with it.
        let _ = self.ctrl_send(dst, &h, &[payload]);
    }

    /// An RMA control message from `src`: a request to carry out, or a reply.
    pub(crate) fn rma_arrived(&mut self, src: u32, msg: &[u8]) {
        let Some((h, payload)) = RHdr::decode(msg) else {
            eprintln!("weft-fi: a malformed RMA message from rank {src} was dropped");
            return;
        };
        if h.kind == Kind::Reply {
            self.reply(src, h, payload);
        } else {
            self.request(src, h, payload);
        }
    }

    /// Carry out a request from `src` on this process's memory, and answer it.
    fn request(&mut self, src: u32, h: RHdr, payload: &[u8]) {
        self.stats.rma_served += 1;
        let len = h.len as usize;
        let at = match self.mrs.get(&h.key) {
            Some(r) => r.resolve(h.addr, h.len, needs(h.kind)),
            None => Err(fi::FI_EACCES),
        };
        let ptr = match at {
            Ok(p) => p as *mut u8,
            Err(e) => {
                if let (Kind::Write, Some(t)) = (h.kind, h.long) {
                    self.discard_long(0, src, t);
                }
                return self.answer(src, h.id, e, &[]);
            }
        };
        match h.kind {
            Kind::Write => match h.long {
                None => {
                    // SAFETY: `ptr..ptr+len` lies in a region the application registered for
                    // remote writes and has not closed (resolve checked it); the payload is
                    // weft-fi's bounce buffer. `copy` allows the two to be the same memory.
                    unsafe { std::ptr::copy(payload.as_ptr(), ptr, len) };
                    self.remote_write_done(h.data, len);
                    self.answer(src, h.id, 0, &[]);
                }
                Some(t) => {
                    let dc = self.data.as_ref().expect("a world");
                    // SAFETY: as above; the region stays registered until this receive is
                    // done (closing it waits for ops holding its key).
                    match unsafe {
                        dc.irecv_raw(ptr, len, Source::Rank(src), TagSel::Tag(t as i32))
                    } {
                        Ok(req) => self.push_op(Op {
                            req,
                            ep: 0,
                            what: What::TargetIn {
                                src,
                                id: h.id,
                                data: h.data,
                            },
                            ctx: crate::NULL,
                            report: false,
                            _owned: None,
                            key: Some(h.key),
                        }),
                        Err(e) => self.answer(src, h.id, code_of(&e), &[]),
                    }
                }
            },
            Kind::Read => match h.long {
                None => {
                    // SAFETY: `ptr..ptr+len` lies in a region registered for remote reads.
                    let bytes =
                        unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.to_vec();
                    self.remote_read_done();
                    self.answer(src, h.id, 0, &bytes);
                }
                Some(t) => {
                    let dc = self.data.as_ref().expect("a world");
                    // SAFETY: as above; the op holds the region's key until weft is done.
                    match unsafe { dc.isend_raw(ptr, len, src, t as i32, false) } {
                        Ok(req) => {
                            self.push_op(Op::quiet(req, 0, None, Some(h.key)));
                            self.remote_read_done();
                            self.answer(src, h.id, 0, &[]);
                        }
                        Err(e) => self.answer(src, h.id, code_of(&e), &[]),
                    }
                }
            },
            Kind::Atomic | Kind::Fetch | Kind::Compare => {
                let mut cur = vec![0u8; len];
                // SAFETY: `ptr..ptr+len` lies in a region registered for what the atomic
                // needs; `cur` is weft-fi's own. No other atomic runs meanwhile (the lock).
                unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, cur.as_mut_ptr(), len) };
                let old = (h.kind != Kind::Atomic).then(|| cur.clone());
                let (operand, compare) = payload.split_at(len);
                rma::apply(h.op as u32, h.dtype as u32, &mut cur, operand, compare);
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(cur.as_ptr(), ptr, len) };
                self.remote_write_done(None, len);
                self.answer(src, h.id, 0, old.as_deref().unwrap_or(&[]));
            }
            Kind::Reply => {}
        }
    }

    /// The endpoint that reports remote accesses: one that asked for RMA or atomics, else
    /// any enabled one.
    fn rma_ep(&self) -> usize {
        let mut any = 0;
        for (a, e) in &self.eps {
            if e.enabled && e.rma {
                return *a;
            }
            if e.enabled {
                any = *a;
            }
        }
        any
    }

    /// A remote write (or atomic) into this process is done: the remote-write counter, and
    /// the remote CQ data on the receive queue.
    fn remote_write_done(&mut self, data: Option<u64>, len: usize) {
        let ep = self.rma_ep();
        self.count(ep, |c| c.remote_write, true);
        if let Some(d) = data {
            let e = Entry {
                flags: fi::FI_RMA | fi::FI_REMOTE_WRITE | fi::FI_REMOTE_CQ_DATA,
                data: d,
                len,
                ..Entry::default()
            };
            self.report(ep, true, e);
        }
    }

    fn remote_read_done(&mut self) {
        let ep = self.rma_ep();
        self.count(ep, |c| c.remote_read, true);
    }

    /// A long write's data is in this process's region: answer its origin.
    pub(crate) fn target_in_done(
        &mut self,
        src: u32,
        id: u64,
        data: Option<u64>,
        r: &weft::Result<weft::Status>,
    ) {
        match r {
            Ok(st) if !st.cancelled => {
                self.remote_write_done(data, st.bytes);
                self.answer(src, id, 0, &[]);
            }
            Ok(_) => self.answer(src, id, fi::FI_ECANCELED, &[]),
            Err(e) => self.answer(src, id, code_of(e), &[]),
        }
    }

    /// The target's answer to operation `id`.
    fn reply(&mut self, src: u32, h: RHdr, payload: &[u8]) {
        let Some(r) = self.rops.get_mut(&h.id) else {
            return;
        };
        if r.rank != src || !r.awaiting {
            eprintln!("weft-fi: an RMA reply from rank {src} for no operation of it was dropped");
            return;
        }
        r.awaiting = false;
        if h.status != 0 {
            if r.err == 0 {
                r.err = h.status as u64;
            }
            // A long read's receive waits for data that will not come.
            if r.parts > 0 {
                if let Some(w) = self.world.as_ref() {
                    for o in &self.ops {
                        if matches!(o.what, What::Part { id } if id == h.id) {
                            let _ = w.cancel_raw(&o.req);
                        }
                    }
                }
            }
        } else if !r.result.is_null() {
            let n = payload.len().min(r.result_len);
            // SAFETY: libfabric's contract: the result buffer holds `result_len` writable
            // bytes and is the provider's until this operation completes; the payload is
            // weft-fi's bounce buffer.
            unsafe { std::ptr::copy(payload.as_ptr(), r.result, n) };
        }
        self.settle(h.id);
    }

    /// A data message of operation `id` is done.
    pub(crate) fn part_done(&mut self, id: u64, r: &weft::Result<weft::Status>) {
        let Some(op) = self.rops.get_mut(&id) else {
            return;
        };
        op.parts = op.parts.saturating_sub(1);
        if op.err == 0 {
            match r {
                Ok(st) if st.cancelled => op.err = fi::FI_ECANCELED,
                Ok(_) => {}
                Err(e) => op.err = code_of(e),
            }
        }
        self.settle(id);
    }

    /// Complete operation `id` once its reply and its data are all in.
    fn settle(&mut self, id: u64) {
        match self.rops.get(&id) {
            Some(r) if !r.awaiting && r.parts == 0 => {}
            _ => return,
        }
        let r = self.rops.remove(&id).expect("present");
        let ok = r.err == 0;
        if r.read {
            self.count(r.ep, |c| c.read, ok);
        } else {
            self.count(r.ep, |c| c.write, ok);
        }
        if r.report || !ok {
            let e = Entry {
                ctx: r.ctx,
                flags: r.flags,
                err: r.err,
                ..Entry::default()
            };
            self.report(r.ep, false, e);
        }
    }

    /// Operations towards failed ranks get no reply: they end with `FI_EIO` once their data
    /// messages (which weft fails with the peer) are done.
    pub(crate) fn fail_rma_to(&mut self, failed: &[u32]) {
        let ids: Vec<u64> = self
            .rops
            .iter()
            .filter(|(_, r)| r.awaiting && failed.contains(&r.rank))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(r) = self.rops.get_mut(&id) {
                r.awaiting = false;
                if r.err == 0 {
                    r.err = fi::FI_EIO;
                }
            }
            self.settle(id);
        }
    }

    /// Register `len` bytes at `base` on `domain` for the region object `mr`; its key.
    #[allow(clippy::too_many_arguments)]
    pub fn mr_reg(
        &mut self,
        domain: usize,
        mr: usize,
        base: usize,
        len: usize,
        access: u64,
        offset: u64,
        requested: u64,
    ) -> Result<u64, u64> {
        let mode = *self.domains.get(&domain).ok_or(fi::FI_EINVAL)?;
        let basic = mode & 3 == fi::FI_MR_BASIC as u64;
        let prov_key = basic || mode & fi::FI_MR_PROV_KEY != 0;
        let virt = basic || mode & fi::FI_MR_VIRT_ADDR != 0;
        if base.checked_add(len).is_none() {
            return Err(fi::FI_EINVAL);
        }
        let key = if prov_key {
            let k = self.next_key;
            self.next_key += 1;
            k
        } else if self.mrs.contains_key(&requested) {
            return Err(fi::FI_ENOKEY as u64);
        } else {
            requested
        };
        let remote = fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE;
        let access = if access == 0 { remote } else { access & remote };
        self.mrs.insert(
            key,
            Region {
                base,
                len,
                access,
                virt,
                offset,
            },
        );
        self.mr_keys.insert(mr, key);
        Ok(key)
    }

    /// Close region object `mr`: no new request reaches its memory; the operations still
    /// writing into or reading from it are asked to stop. How many are left (closing waits
    /// until none is).
    pub fn mr_close(&mut self, mr: usize) -> usize {
        let Some(key) = self.mr_keys.get(&mr).copied() else {
            return 0;
        };
        self.mrs.remove(&key);
        if let Some(w) = self.world.as_ref() {
            for o in self.ops.iter().filter(|o| o.key == Some(key)) {
                if matches!(o.what, What::TargetIn { .. }) {
                    let _ = w.cancel_raw(&o.req);
                }
            }
        }
        self.poll();
        let left = self.ops.iter().filter(|o| o.key == Some(key)).count();
        if left == 0 {
            self.mr_keys.remove(&mr);
        }
        left
    }
}

/// The op of a data message of origin operation `id`.
fn part(req: weft::RawRequest, ep: usize, id: u64) -> Op {
    Op {
        req,
        ep,
        what: What::Part { id },
        ctx: crate::NULL,
        report: false,
        _owned: None,
        key: None,
    }
}

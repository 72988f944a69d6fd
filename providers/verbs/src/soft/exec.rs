// Over 800 lines: the responder: every work request kind executed against a target's segment, sharing one set of key, range and rights checks.
//! The responder, run by the initiator: a process posting to a peer on its host reaches into
//! the peer's segment and does what the peer's HCA would do — check the key, range and rights
//! of the target region, take a posted receive, move the bytes, deliver the completion, execute
//! the atomic — without the peer taking part (the peer need not be in any call).
//!
//! Data path: device memory (`alloc_dm`, a part of the peer's segment that is mapped here too)
//! is written with plain stores; any other registered memory with Cross-Memory Attach. Either
//! way the last byte of a write lands after all the others: in device memory through a release
//! store of that byte; through CMA by giving it its own *local* iovec in the same system call —
//! the kernel copies each local iovec segment with a copy of its own, in order, and x86 keeps
//! the stores of one copy before those of the next, string copies included (stores within one
//! fast string operation may be reordered, stores across string operations are not). Splitting
//! the local side rather than the remote one keeps the target page pinned once.
//!
//! Regions are protected against deregistration by hazard words: before using a key the
//! initiator publishes it in its attach slot of the peer's segment, then checks the key is
//! still valid (both sequentially consistent); the owner's `dereg_mr` invalidates the key,
//! then waits until no live attached process publishes it. So no byte is moved into memory
//! whose registration has ended, and a region whose check fails is never touched.

use super::seg::{self, Seg, MR_DM, WQE_WORDS};
use crate::types::*;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::Instant;
use weft_provider::cma::{self, CopyError, Dir, Range};
use weft_provider::Result;

const SC: Ordering = Ordering::SeqCst;
const RLX: Ordering = Ordering::Relaxed;

/// Where a piece of target memory is.
#[derive(Debug, Clone, Copy)]
pub enum Place {
    /// Mapped here (device memory of the peer).
    Dm(*mut u8),
    /// At this address in the peer process.
    User(u64),
}

/// Why a request did not complete now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Done {
        byte_len: u32,
        value: u64,
    },
    /// Receiver not ready; retry after this RNR timer code.
    Rnr(u8),
    /// No answer (the peer is gone, mute, or its QP not ready for us).
    NoResponse,
    /// Completed in error with this status at the requester (the responder's side effects,
    /// its completion and its QP's error state, are done).
    Fail(WcStatus),
}

/// A peer's segment, mapped, with this process's attach slot in it.
pub struct Peer {
    pub seg: Seg,
    slot: usize,
    pidfd: Option<OwnedFd>,
    checked: AtomicU64,
    dead: AtomicBool,
    /// How long this process waits for another that holds up an access before fencing it
    /// out (`WEFT_VERBS_SOFT_FENCE` of the HCA that attached).
    pub fence: Option<std::time::Duration>,
}

/// Microseconds on the coarse monotonic clock (a few ns through the vDSO, millisecond
/// resolution: enough to space out liveness checks).
fn coarse_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

/// Fence out process `pid`, which has held up this HCA past `WEFT_VERBS_SOFT_FENCE` (stopped,
/// in a debugger, hung in the middle of an access): kill it, as a cluster fences a node that
/// stopped answering. Its hazards and claims are then a dead process's, which the HCA does not
/// wait for. Never this process.
pub fn fence_out(pid: u32, why: &str) {
    if pid == std::process::id() {
        return;
    }
    tracing::warn!(
        target: "weft::verbs",
        "soft HCA: process {pid} {why} for longer than WEFT_VERBS_SOFT_FENCE: killing it"
    );
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    if fd < 0 {
        return;
    }
    // SAFETY: a pidfd we own (no pid reuse between looking the process up and the signal);
    // closed right after.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd,
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        );
        libc::close(fd);
    }
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as i32, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

impl Peer {
    /// Map the segment `gid` names and claim an attach slot in it.
    pub fn attach(gid: &Gid) -> Result<Peer> {
        let seg = Seg::attach(gid)?;
        let me = std::process::id() as u64;
        let mut slot = None;
        let slots = seg.lay.max_attach as usize;
        for i in 0..slots {
            let s = seg.attach_slot(i);
            let cur = s.pid.load(SC);
            let free = cur == 0 || (cur != me && !pid_alive(cur as u32));
            if free && s.pid.compare_exchange(cur, me, SC, RLX).is_ok() {
                for h in &s.hz {
                    h.store(0, SC);
                }
                // Owners scan up to the highest slot ever taken.
                seg.header().attach_hw.fetch_max(i as u32 + 1, SC);
                slot = Some(i);
                break;
            }
        }
        let slot = slot.ok_or_else(|| {
            weft_provider::Error::invalid(format!(
                "soft HCA of process {}: all {slots} attach slots are taken (more processes \
                 talk to it than its WEFT_VERBS_SOFT_MAX_PEERS)",
                seg.pid(),
            ))
        })?;
        // SAFETY: pidfd_open returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, seg.pid() as i32, 0) };
        // SAFETY: a descriptor the kernel just gave us.
        let pidfd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) });
        Ok(Peer {
            seg,
            slot,
            pidfd,
            checked: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            fence: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.seg.pid()
    }

    /// Whether the peer answers: it has not closed its device, is not muted, and its process
    /// runs (looked at with its pidfd at most once a millisecond, or at once when `now_check`).
    pub fn responsive(&self, now_check: bool) -> bool {
        let h = self.seg.header();
        if h.closed.load(Ordering::Acquire) != 0 || h.mute.load(RLX) != 0 {
            return false;
        }
        if self.dead.load(RLX) {
            return false;
        }
        let t = coarse_us();
        if now_check || t >= self.checked.load(RLX) + 1000 {
            self.checked.store(t, RLX);
            let gone = match &self.pidfd {
                Some(fd) => {
                    let mut p = libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd, no waiting.
                    let n = unsafe { libc::poll(&mut p, 1, 0) };
                    n > 0 && p.revents & libc::POLLIN != 0
                }
                None => !pid_alive(self.pid()),
            };
            if gone {
                self.dead.store(true, RLX);
                return false;
            }
        }
        true
    }

    fn hz(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        &self.seg.attach_slot(self.slot).hz[i]
    }

    /// Publish `key` in hazard `i`, then check that it names a live region of protection
    /// domain `pd` with `need` rights covering `[addr, addr + len)`. On success the region
    /// stays registered until [`Peer::clear`].
    pub fn lookup(
        &self,
        i: usize,
        key: u32,
        pd: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Option<Place> {
        let e = self.seg.mr((key & 0xffff) as usize)?;
        self.hz(i).store(key as u64, SC);
        if key == 0 || e.key.load(SC) != key {
            return None;
        }
        let (base, rlen) = (e.addr.load(RLX), e.len.load(RLX));
        let end = addr.checked_add(len)?;
        if e.pd.load(RLX) != pd
            || !Access(e.access.load(RLX)).contains(need)
            || addr < base
            || end > base.checked_add(rlen)?
        {
            return None;
        }
        if e.kind.load(RLX) == MR_DM {
            let off = e.off.load(RLX).checked_add(addr - base)?;
            return self.seg.heap(off, len as usize).map(Place::Dm);
        }
        Some(Place::User(addr))
    }

    /// Drop the key hazards (the regions) of this process in the peer's segment.
    pub fn clear(&self) {
        for h in &self.seg.attach_slot(self.slot).hz[..seg::HZ_QP] {
            h.store(0, Ordering::Release);
        }
    }

    /// Drop every hazard, queues included (at the end of an operation).
    pub fn clear_all(&self) {
        for h in &self.seg.attach_slot(self.slot).hz {
            h.store(0, Ordering::Release);
        }
    }

    /// This process's claims on the peer's ring at heap offset `off` ([`super::ring`]): the
    /// ring's id and the store into our claim hazard word.
    pub fn claim(&self, off: u64) -> Option<(u64, impl Fn(u64) + '_)> {
        let w = self.hz(seg::HZ_RING);
        Some((off >> 7, move |v| w.store(v, SC)))
    }

    /// Publish `tag` in hazard `i` and check `still()` afterwards: the object it names is then
    /// kept until the hazard is cleared.
    fn hold(&self, i: usize, tag: u64, still: impl FnOnce() -> bool) -> bool {
        self.hz(i).store(tag, SC);
        still()
    }

    /// Deliver a completion into the peer's CQ `cq`; a full CQ is an overrun (the completion
    /// is lost, as on an HCA, and the owner's next poll reports the error).
    pub fn push_cqe(&self, cq: u32, wc: &Wc) {
        if let Some(e) = self.seg.cq(cq as usize) {
            if !self.hold(seg::HZ_CQ, seg::TAG_CQ | cq as u64, || e.live.load(SC) != 0) {
                self.hz(seg::HZ_CQ).store(0, Ordering::Release);
                return;
            }
            let off = e.off.load(RLX);
            let ok = self
                .seg
                .ring::<{ seg::CQE_WORDS }>(off, e.cap.load(RLX))
                .is_some_and(|r| r.push_as(&seg::cqe_record(wc), self.claim(off)));
            if !ok {
                e.overrun.store(1, Ordering::Release);
            }
            self.hz(seg::HZ_CQ).store(0, Ordering::Release);
        }
    }

    /// Move the peer's QP `qi` to the error state and flush its receive queue.
    /// Move responder QP `qi` to the error state because of a request it refused with `why`.
    pub fn fail_qp(&self, qi: usize, why: WcStatus) {
        let Some(q) = self.seg.qp(qi) else { return };
        q.fault.store(why as u32, SC);
        q.state.store(QpState::Err as u32, SC);
        flush_rq(&self.seg, qi, Some(self), |cq, wc| self.push_cqe(cq, wc));
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.clear();
        self.seg.attach_slot(self.slot).pid.store(0, SC);
    }
}

/// Complete every receive queued on QP `qi` of `seg` with a flush error (its own receive
/// queue only; an SRQ's receives belong to the SRQ). `by`: the initiator doing it (its claims
/// announced), `None` for the segment's owner.
pub fn flush_rq(seg: &Seg, qi: usize, by: Option<&Peer>, mut push: impl FnMut(u32, &Wc)) {
    let Some(q) = seg.qp(qi) else { return };
    if q.srq.load(RLX) != 0 {
        return;
    }
    let off = q.rq_off.load(RLX);
    let Some(r) = seg.ring::<WQE_WORDS>(off, q.rq_cap.load(RLX)) else {
        return;
    };
    let mut w = [0u64; WQE_WORDS];
    while r.pop_by_as(&mut w, seg::wqe_words, by.and_then(|p| p.claim(off))) {
        let b: u64 = seg::wqe_sges(&w).iter().map(|s| s.length as u64).sum();
        q.rq_taken.fetch_add(b, RLX);
        push(
            q.recv_cq.load(RLX),
            &Wc {
                wr_id: w[0],
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                qp_num: q.qpn.load(RLX),
                src_qp: 0,
                grh: false,
            },
        );
    }
}

/// A request as the responder sees it.
pub struct Request<'a> {
    pub op: WrOpcode,
    /// Our QP number and GID (the responder's QP must be connected to them; RC).
    pub src_qpn: u32,
    pub src_gid: Gid,
    pub dest_qpn: u32,
    pub psn: u32,
    /// Local memory holding the payload (send, write) or receiving the result (read, atomic).
    pub local: &'a [Range],
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: u32,
    pub compare_add: u64,
    pub swap: u64,
    pub len: usize,
    /// UD: the qkey the request carries.
    pub qkey: u32,
    /// UD: the GRH to place in front of the payload.
    pub grh: Option<[u8; GRH_LEN]>,
}

fn copy_err(e: CopyError) -> Outcome {
    match e {
        CopyError::Gone => Outcome::NoResponse,
        _ => Outcome::Fail(WcStatus::RemAccessErr),
    }
}

/// A few ranges, on the stack (no allocation per request).
type Ranges = smallvec::SmallVec<[Range; 8]>;

/// Local ranges `[from, from + n)` of the concatenation of `src`.
fn sub(src: &[Range], mut from: usize, mut n: usize, out: &mut Ranges) {
    out.clear();
    for r in src {
        if n == 0 {
            break;
        }
        if from >= r.len {
            from -= r.len;
            continue;
        }
        let take = (r.len - from).min(n);
        out.push(Range {
            base: r.base + from as u64,
            len: take,
        });
        from = 0;
        n -= take;
    }
}

/// Copy the local `src` bytes into the target `dst` pieces in order; the last byte last.
fn put(pid: u32, src: &[Range], dst: &[(Place, usize)]) -> std::result::Result<(), CopyError> {
    let total: usize = dst.iter().map(|d| d.1).sum();
    let mut off = 0usize;
    let (mut lv, mut rv, mut tmp) = (Ranges::new(), Ranges::new(), Ranges::new());
    for (k, &(place, n)) in dst.iter().enumerate() {
        let last = k + 1 == dst.len() && off + n == total && n > 0;
        match place {
            Place::Dm(p) => {
                if !rv.is_empty() {
                    cma_flush(pid, &mut lv, &mut rv)?;
                }
                sub(src, off, n, &mut tmp);
                let mut q = p;
                let body = if last { n - 1 } else { n };
                let mut left = body;
                for r in &tmp {
                    let c = r.len.min(left);
                    // SAFETY: `r` is memory of this process the caller validated against a
                    // registration; `q` lies inside the peer's heap (checked by lookup); the
                    // two never overlap (one is ours, one is the shared segment).
                    unsafe { std::ptr::copy_nonoverlapping(r.base as *const u8, q, c) };
                    // SAFETY: advancing within the piece of `n` bytes.
                    q = unsafe { q.add(c) };
                    left -= c;
                }
                if last {
                    let lr = tmp.last().copied().unwrap_or(Range { base: 0, len: 0 });
                    // SAFETY: the last source byte is inside the validated local range.
                    let b = unsafe { *((lr.base + lr.len as u64 - 1) as *const u8) };
                    fence(Ordering::Release);
                    // SAFETY: the last byte of the piece, inside the peer's heap; an atomic
                    // store so that a poller's acquire load sees everything before it.
                    unsafe { AtomicU8::from_ptr(p.add(n - 1)) }.store(b, Ordering::Release);
                }
            }
            Place::User(a) => {
                sub(src, off, n, &mut tmp);
                if last {
                    // The last byte as its own local iovec: the kernel copies it with a copy
                    // of its own, after the others, into the same pinned target page (a
                    // separate remote iovec would pin the page twice).
                    if let Some(l) = tmp.pop() {
                        if l.len > 1 {
                            tmp.push(Range {
                                base: l.base,
                                len: l.len - 1,
                            });
                        }
                        tmp.push(Range {
                            base: l.base + l.len as u64 - 1,
                            len: 1,
                        });
                    }
                }
                lv.extend_from_slice(&tmp);
                rv.push(Range { base: a, len: n });
            }
        }
        off += n;
    }
    if !rv.is_empty() {
        cma_flush(pid, &mut lv, &mut rv)?;
    }
    Ok(())
}

fn cma_flush(pid: u32, lv: &mut Ranges, rv: &mut Ranges) -> std::result::Result<(), CopyError> {
    let want: usize = rv.iter().map(|r| r.len).sum();
    // SAFETY: the local ranges are this process's registered memory (validated by the caller);
    // the remote ranges were checked against the peer's registrations under hazards; the
    // kernel checks the rest.
    let n = unsafe { cma::copy(pid as i32, Dir::Push, lv, rv, usize::MAX) }?;
    lv.clear();
    rv.clear();
    if n < want {
        return Err(CopyError::Fault { done: n });
    }
    Ok(())
}

/// Copy target bytes at `src` (`n` long) into the local `dst`.
fn get(pid: u32, src: Place, n: usize, dst: &[Range]) -> std::result::Result<(), CopyError> {
    match src {
        Place::Dm(p) => {
            let mut q = p as *const u8;
            let mut left = n;
            for r in dst {
                let c = r.len.min(left);
                // SAFETY: `q` is inside the peer's heap (lookup checked `n` bytes); `r` is
                // validated local memory with write rights.
                unsafe { std::ptr::copy_nonoverlapping(q, r.base as *mut u8, c) };
                // SAFETY: within the `n` checked bytes.
                q = unsafe { q.add(c) };
                left -= c;
            }
            Ok(())
        }
        Place::User(a) => {
            // SAFETY: as in cma_flush, in the other direction.
            let got =
                unsafe { cma::copy(pid as i32, Dir::Pull, dst, &[Range { base: a, len: n }], n) }?;
            if got < n {
                return Err(CopyError::Fault { done: got });
            }
            Ok(())
        }
    }
}

/// Execute `req` on the peer's RC QP. The caller holds nothing in the peer but its slot.
pub fn rc(peer: &Peer, req: &Request) -> Outcome {
    let o = rc_inner(peer, req);
    peer.clear_all();
    o
}

fn rc_inner(peer: &Peer, req: &Request) -> Outcome {
    let qi = (req.dest_qpn & 0xffff) as usize;
    let Some(q) = peer.seg.qp(qi) else {
        return Outcome::NoResponse;
    };
    if !peer.hold(seg::HZ_QP, seg::TAG_QP | req.dest_qpn as u64, || {
        q.qpn.load(SC) == req.dest_qpn
    }) {
        return Outcome::NoResponse;
    }
    let st = q.state.load(Ordering::Acquire);
    let g = [
        u64::from_le_bytes(req.src_gid.0[..8].try_into().unwrap_or_default()),
        u64::from_le_bytes(req.src_gid.0[8..].try_into().unwrap_or_default()),
    ];
    if q.qpn.load(RLX) != req.dest_qpn
        || q.qp_type.load(RLX) != QpType::Rc as u32
        || !(st == QpState::Rtr as u32 || st == QpState::Rts as u32)
        || q.dest_qpn.load(RLX) != req.src_qpn
        || q.dest_gid[0].load(RLX) != g[0]
        || q.dest_gid[1].load(RLX) != g[1]
    {
        // A real responder drops packets for a QP that is not connected to the sender.
        return Outcome::NoResponse;
    }
    let epsn = q.epsn.load(Ordering::Acquire);
    let diff = epsn.wrapping_sub(req.psn) & 0xff_ffff;
    if diff != 0 {
        if diff >= 1 << 23 {
            // Ahead of what the responder expects: a PSN sequence error; nothing answers it.
            return Outcome::NoResponse;
        }
        // A duplicate (our ACK was lost): re-acknowledge; an atomic returns its first result.
        let slot = req.psn as usize % seg::REPLAY;
        if req.op.is_atomic() {
            if q.replay_psn[slot].load(Ordering::Acquire) != req.psn as u64 + 1 {
                return Outcome::Fail(WcStatus::RemInvReqErr);
            }
            let v = q.replay_val[slot].load(RLX);
            return finish_atomic(req, v);
        }
        if req.op == WrOpcode::RdmaRead {
            // Reads are replayed by reading again.
            return read(peer, q, req);
        }
        return Outcome::Done {
            byte_len: req.len as u32,
            value: 0,
        };
    }
    let need = match req.op {
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm if req.len > 0 => Access::REMOTE_WRITE,
        WrOpcode::RdmaRead if req.len > 0 => Access::REMOTE_READ,
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => Access::REMOTE_ATOMIC,
        _ => Access(0),
    };
    if !Access(q.access.load(RLX)).contains(need) {
        // The QP does not grant the operation: the responder answers remote access error.
        return remote_fail(peer, qi, WcStatus::RemAccessErr);
    }
    let out = match req.op {
        WrOpcode::Send | WrOpcode::SendWithImm => deliver(peer, qi, req, None),
        WrOpcode::RdmaWriteWithImm => deliver(peer, qi, req, Some(())),
        WrOpcode::RdmaWrite => write(peer, qi, req),
        WrOpcode::RdmaRead => read(peer, q, req),
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => atomic(peer, qi, req),
    };
    if matches!(out, Outcome::Done { .. }) {
        q.epsn.store((req.psn + 1) & 0xff_ffff, Ordering::Release);
    }
    peer.clear();
    out
}

fn remote_fail(peer: &Peer, qi: usize, st: WcStatus) -> Outcome {
    peer.clear();
    peer.fail_qp(qi, st);
    Outcome::Fail(st)
}

fn write(peer: &Peer, qi: usize, req: &Request) -> Outcome {
    if req.len == 0 {
        return Outcome::Done {
            byte_len: 0,
            value: 0,
        };
    }
    let Some(q) = peer.seg.qp(qi) else {
        return Outcome::NoResponse;
    };
    let pd = q.pd.load(RLX);
    let Some(place) = peer.lookup(
        seg::HZ_RKEY,
        req.rkey,
        pd,
        req.remote_addr,
        req.len as u64,
        Access::REMOTE_WRITE,
    ) else {
        return remote_fail(peer, qi, WcStatus::RemAccessErr);
    };
    super::model::stall_point(super::model::Stall::StopInAccess);
    match put(peer.pid(), req.local, &[(place, req.len)]) {
        Ok(()) => Outcome::Done {
            byte_len: req.len as u32,
            value: 0,
        },
        Err(e) => match copy_err(e) {
            Outcome::NoResponse => Outcome::NoResponse,
            o => {
                peer.clear();
                if let Outcome::Fail(st) = o {
                    peer.fail_qp(qi, st);
                } else {
                    peer.fail_qp(qi, WcStatus::RemOpErr);
                }
                o
            }
        },
    }
}

fn read(peer: &Peer, q: &seg::QpEntry, req: &Request) -> Outcome {
    if req.len == 0 {
        return Outcome::Done {
            byte_len: 0,
            value: 0,
        };
    }
    let pd = q.pd.load(RLX);
    let qi = (q.qpn.load(RLX) & 0xffff) as usize;
    let Some(place) = peer.lookup(
        seg::HZ_RKEY,
        req.rkey,
        pd,
        req.remote_addr,
        req.len as u64,
        Access::REMOTE_READ,
    ) else {
        return remote_fail(peer, qi, WcStatus::RemAccessErr);
    };
    let r = get(peer.pid(), place, req.len, req.local);
    peer.clear();
    match r {
        Ok(()) => Outcome::Done {
            byte_len: req.len as u32,
            value: 0,
        },
        Err(CopyError::Gone) => Outcome::NoResponse,
        Err(_) => {
            peer.fail_qp(qi, WcStatus::RemAccessErr);
            Outcome::Fail(WcStatus::RemAccessErr)
        }
    }
}

fn finish_atomic(req: &Request, v: u64) -> Outcome {
    // The original value goes to the requester's 8-byte SGE.
    if let Some(r) = req.local.first() {
        // SAFETY: the caller validated an 8-byte local range with write rights.
        unsafe { std::ptr::write_unaligned(r.base as *mut u64, v) };
    }
    Outcome::Done {
        byte_len: 8,
        value: v,
    }
}

fn atomic(peer: &Peer, qi: usize, req: &Request) -> Outcome {
    let Some(q) = peer.seg.qp(qi) else {
        return Outcome::NoResponse;
    };
    if req.remote_addr % 8 != 0 {
        return remote_fail(peer, qi, WcStatus::RemInvReqErr);
    }
    let pd = q.pd.load(RLX);
    let Some(place) = peer.lookup(
        seg::HZ_RKEY,
        req.rkey,
        pd,
        req.remote_addr,
        8,
        Access::REMOTE_ATOMIC,
    ) else {
        return remote_fail(peer, qi, WcStatus::RemAccessErr);
    };
    let apply = |old: u64| match req.op {
        WrOpcode::AtomicFetchAndAdd => old.wrapping_add(req.compare_add),
        _ if old == req.compare_add => req.swap,
        _ => old,
    };
    let old = match place {
        Place::Dm(p) => {
            // SAFETY: 8-byte aligned (heap offsets keep the owner's alignment: the heap is
            // page aligned and dm regions are page aligned) and inside the peer's heap.
            let a = unsafe { AtomicU64::from_ptr(p as *mut u64) };
            match req.op {
                WrOpcode::AtomicFetchAndAdd => a.fetch_add(req.compare_add, SC),
                _ => a
                    .compare_exchange(req.compare_add, req.swap, SC, SC)
                    .unwrap_or_else(|v| v),
            }
        }
        Place::User(a) => {
            let lock = peer.seg.lock((a / 8) as usize);
            let me = std::process::id() as u64;
            let t0 = Instant::now();
            let mut fenced = false;
            loop {
                match lock.compare_exchange(0, me, Ordering::Acquire, RLX) {
                    Ok(_) => break,
                    Err(h) if t0.elapsed().as_millis() > 1 && !pid_alive(h as u32) => {
                        // The holder died in the middle: its operation never finished, take over.
                        let _ = lock.compare_exchange(h, 0, RLX, RLX);
                    }
                    Err(h) if !fenced && peer.fence.is_some_and(|f| t0.elapsed() > f) => {
                        // Alive but holding the lock past the fence time (stopped, hung).
                        fence_out(h as u32, "holds an atomic lock of a shared HCA segment");
                        fenced = true;
                    }
                    Err(_) if t0.elapsed().as_millis() > 1 => std::thread::yield_now(),
                    Err(_) => std::hint::spin_loop(),
                }
            }
            let mut old = 0u64;
            let mine = [Range {
                base: &mut old as *mut u64 as u64,
                len: 8,
            }];
            let r = get(peer.pid(), place, 8, &mine).and_then(|()| {
                let new = apply(old);
                let src = [Range {
                    base: &new as *const u64 as u64,
                    len: 8,
                }];
                put(peer.pid(), &src, &[(place, 8)])
            });
            lock.store(0, Ordering::Release);
            if let Err(e) = r {
                peer.clear();
                if matches!(e, CopyError::Gone) {
                    return Outcome::NoResponse;
                }
                peer.fail_qp(qi, WcStatus::RemAccessErr);
                return Outcome::Fail(WcStatus::RemAccessErr);
            }
            old
        }
    };
    let slot = req.psn as usize % seg::REPLAY;
    q.replay_val[slot].store(old, RLX);
    q.replay_psn[slot].store(req.psn as u64 + 1, Ordering::Release);
    peer.clear();
    finish_atomic(req, old)
}

/// Take a receive for QP `qi` (its own queue or its SRQ), firing the SRQ limit event when due.
fn take_recv(peer: &Peer, q: &seg::QpEntry) -> Option<(u32, [u64; WQE_WORDS])> {
    let seg = &peer.seg;
    let mut w = [0u64; WQE_WORDS];
    let srq = q.srq.load(RLX);
    let bytes = |w: &[u64; WQE_WORDS]| {
        seg::wqe_sges(w)
            .iter()
            .map(|s| s.length as u64)
            .sum::<u64>()
    };
    if srq != 0 {
        let s = seg.srq(srq as usize - 1)?;
        if !peer.hold(seg::HZ_SRQ, seg::TAG_SRQ | (srq as u64 - 1), || {
            s.live.load(SC) != 0
        }) {
            return None;
        }
        let off = s.off.load(RLX);
        let r = seg.ring::<WQE_WORDS>(off, s.cap.load(RLX))?;
        if !r.pop_by_as(&mut w, seg::wqe_words, peer.claim(off)) {
            return None;
        }
        s.taken.fetch_add(bytes(&w), RLX);
        let lim = s.limit.load(Ordering::Acquire);
        if lim != 0 && (r.len() as u32) < lim && s.limit.compare_exchange(lim, 0, SC, RLX).is_ok() {
            s.event.store(1, Ordering::Release);
        }
        return Some((s.pd.load(RLX), w));
    }
    let off = q.rq_off.load(RLX);
    let r = seg.ring::<WQE_WORDS>(off, q.rq_cap.load(RLX))?;
    if !r.pop_by_as(&mut w, seg::wqe_words, peer.claim(off)) {
        return None;
    }
    q.rq_taken.fetch_add(bytes(&w), RLX);
    Some((q.pd.load(RLX), w))
}

/// SEND, SEND_WITH_IMM (`write` None) and RDMA_WRITE_WITH_IMM (`write` Some): consume a
/// receive, place the data, complete at the responder.
fn deliver(peer: &Peer, qi: usize, req: &Request, write_imm: Option<()>) -> Outcome {
    let Some(q) = peer.seg.qp(qi) else {
        return Outcome::NoResponse;
    };
    let Some((pd, w)) = take_recv(peer, q) else {
        return Outcome::Rnr(q.min_rnr_timer.load(RLX) as u8);
    };
    let sges = seg::wqe_sges(&w);
    let mut wc = Wc {
        wr_id: w[0],
        status: WcStatus::Success,
        opcode: WcOpcode::Recv,
        byte_len: req.len as u32,
        imm: req.op.has_imm().then_some(req.imm),
        qp_num: req.dest_qpn,
        src_qp: req.src_qpn,
        grh: false,
    };
    let cq = q.recv_cq.load(RLX);
    let fail_both = |wc: &mut Wc, local: WcStatus, remote: WcStatus| {
        peer.clear();
        wc.status = local;
        wc.byte_len = 0;
        wc.imm = None;
        peer.push_cqe(cq, wc);
        peer.fail_qp(qi, remote);
        Outcome::Fail(remote)
    };
    if write_imm.is_some() {
        wc.opcode = WcOpcode::RecvRdmaWithImm;
        match write(peer, qi, req) {
            Outcome::Done { .. } => {}
            Outcome::Fail(st) => {
                // The write failed its check: the receive it took is flushed with the QP.
                wc.status = WcStatus::WrFlushErr;
                wc.imm = None;
                peer.push_cqe(cq, &wc);
                return Outcome::Fail(st);
            }
            o => return o,
        }
        peer.clear();
        peer.push_cqe(cq, &wc);
        return Outcome::Done {
            byte_len: req.len as u32,
            value: 0,
        };
    }
    let room: usize = sges.iter().map(|s| s.length as usize).sum();
    if req.len > room {
        return fail_both(&mut wc, WcStatus::LocLenErr, WcStatus::RemInvReqErr);
    }
    let mut dst: smallvec::SmallVec<[(Place, usize); 4]> = smallvec::SmallVec::new();
    let mut left = req.len;
    for (i, s) in sges.iter().enumerate() {
        if left == 0 {
            break;
        }
        let n = (s.length as usize).min(left);
        match peer.lookup(
            seg::HZ_RECV + i,
            s.lkey,
            pd,
            s.addr,
            n as u64,
            Access::LOCAL_WRITE,
        ) {
            Some(p) => dst.push((p, n)),
            None => return fail_both(&mut wc, WcStatus::LocProtErr, WcStatus::RemOpErr),
        }
        left -= n;
    }
    match put(peer.pid(), req.local, &dst) {
        Ok(()) => {}
        Err(CopyError::Gone) => {
            peer.clear();
            return Outcome::NoResponse;
        }
        Err(_) => return fail_both(&mut wc, WcStatus::LocProtErr, WcStatus::RemOpErr),
    }
    peer.clear();
    peer.push_cqe(cq, &wc);
    Outcome::Done {
        byte_len: req.len as u32,
        value: 0,
    }
}

/// Deliver a UD datagram to the peer's QP `dest_qpn`: dropped silently when the QP is not a UD
/// QP ready to receive, the qkey differs or no receive is posted; a receive too small for the
/// GRH and payload completes with a length error (the QP stays usable).
/// Returns whether it was delivered.
pub fn ud(peer: &Peer, req: &Request) -> bool {
    let o = ud_inner(peer, req);
    peer.clear_all();
    o
}

fn ud_inner(peer: &Peer, req: &Request) -> bool {
    let qi = (req.dest_qpn & 0xffff) as usize;
    let Some(q) = peer.seg.qp(qi) else {
        return false;
    };
    if !peer.hold(seg::HZ_QP, seg::TAG_QP | req.dest_qpn as u64, || {
        q.qpn.load(SC) == req.dest_qpn
    }) {
        return false;
    }
    let st = q.state.load(Ordering::Acquire);
    if q.qpn.load(RLX) != req.dest_qpn
        || q.qp_type.load(RLX) != QpType::Ud as u32
        || !(st == QpState::Rtr as u32 || st == QpState::Rts as u32)
        || q.qkey.load(RLX) != req.qkey
    {
        return false;
    }
    let Some((pd, w)) = take_recv(peer, q) else {
        return false;
    };
    let sges = seg::wqe_sges(&w);
    let cq = q.recv_cq.load(RLX);
    let total = GRH_LEN + req.len;
    let mut wc = Wc {
        wr_id: w[0],
        status: WcStatus::Success,
        opcode: WcOpcode::Recv,
        byte_len: total as u32,
        imm: req.op.has_imm().then_some(req.imm),
        qp_num: req.dest_qpn,
        src_qp: req.src_qpn,
        grh: true,
    };
    let room: usize = sges.iter().map(|s| s.length as usize).sum();
    let mut dst: smallvec::SmallVec<[(Place, usize); 4]> = smallvec::SmallVec::new();
    let mut left = total;
    let mut ok = room >= total;
    if !ok {
        wc.status = WcStatus::LocLenErr;
    }
    for (i, s) in sges.iter().enumerate() {
        if !ok || left == 0 {
            break;
        }
        let n = (s.length as usize).min(left);
        match peer.lookup(
            seg::HZ_RECV + i,
            s.lkey,
            pd,
            s.addr,
            n as u64,
            Access::LOCAL_WRITE,
        ) {
            Some(p) => dst.push((p, n)),
            None => {
                wc.status = WcStatus::LocProtErr;
                ok = false;
            }
        }
        left -= n;
    }
    if ok {
        let grh = req.grh.unwrap_or([0; GRH_LEN]);
        let mut src: smallvec::SmallVec<[Range; 4]> = smallvec::SmallVec::new();
        src.push(Range {
            base: grh.as_ptr() as u64,
            len: GRH_LEN,
        });
        src.extend_from_slice(req.local);
        if put(peer.pid(), &src, &dst).is_err() {
            wc.status = WcStatus::LocProtErr;
        }
    }
    if wc.status != WcStatus::Success {
        wc.byte_len = 0;
        wc.imm = None;
    }
    peer.clear();
    peer.push_cqe(cq, &wc);
    true
}

/// Deliver datagrams to one UD QP of the peer (every request names the same `dest_qpn` and
/// `qkey`), each exactly as [`ud`] would, in order, but with one Cross-Memory Attach call for
/// the bytes of all of them that land in user memory (device memory is stored to at once).
/// A system call per datagram is most of the cost of streaming MTU-sized pieces.
///
/// Each receive's region keys stay published in a hazard slot until the copy that fills it
/// has run; a key already published by an earlier datagram of the batch keeps its slot, and
/// when a datagram needs more new keys than slots are free, what is collected so far is
/// copied and completed first. Completions are pushed only after their bytes landed, in
/// the order of the requests. Returns how many datagrams were delivered (the others were
/// dropped: the QP not ready, no receive posted).
pub fn ud_batch(peer: &Peer, reqs: &[Request]) -> usize {
    let n = ud_batch_inner(peer, reqs);
    peer.clear_all();
    n
}

/// A datagram of a batch waiting for the copy: its completion, and its local and remote
/// ranges in the batch's lists (`lv[l.0..l.1]`, `rv[r.0..r.1]`).
struct Staged {
    wc: Wc,
    cq: u32,
    l: (usize, usize),
    r: (usize, usize),
}

fn ud_batch_inner(peer: &Peer, reqs: &[Request]) -> usize {
    let Some(first) = reqs.first() else {
        return 0;
    };
    let qi = (first.dest_qpn & 0xffff) as usize;
    let Some(q) = peer.seg.qp(qi) else {
        return 0;
    };
    if !peer.hold(seg::HZ_QP, seg::TAG_QP | first.dest_qpn as u64, || {
        q.qpn.load(SC) == first.dest_qpn
    }) {
        return 0;
    }
    let st = q.state.load(Ordering::Acquire);
    if q.qpn.load(RLX) != first.dest_qpn
        || q.qp_type.load(RLX) != QpType::Ud as u32
        || !(st == QpState::Rtr as u32 || st == QpState::Rts as u32)
        || q.qkey.load(RLX) != first.qkey
    {
        return 0;
    }
    const SLOTS: usize = seg::HZ_QP - seg::HZ_RECV;
    let mut keys = [0u32; SLOTS];
    let mut staged: Vec<Staged> = Vec::with_capacity(reqs.len());
    // Local and remote ranges, and for each remote range its local ones (`lv[a..b]`).
    let (mut lv, mut rv, mut rl) = (Vec::new(), Vec::new(), Vec::new());
    let mut tmp = Ranges::new();
    let mut delivered = 0;
    for req in reqs {
        debug_assert!(req.dest_qpn == first.dest_qpn && req.qkey == first.qkey);
        let Some((pd, w)) = take_recv(peer, q) else {
            continue;
        };
        delivered += 1;
        let sges = seg::wqe_sges(&w);
        let total = GRH_LEN + req.len;
        let mut wc = Wc {
            wr_id: w[0],
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: total as u32,
            imm: req.op.has_imm().then_some(req.imm),
            qp_num: req.dest_qpn,
            src_qp: req.src_qpn,
            grh: true,
        };
        let cq = q.recv_cq.load(RLX);
        let room: usize = sges.iter().map(|s| s.length as usize).sum();
        // The SGEs the datagram fills, and the slots their keys need.
        let mut used = 0;
        let mut left = total;
        while used < sges.len() && left > 0 {
            left -= (sges[used].length as usize).min(left);
            used += 1;
        }
        let mut fresh: smallvec::SmallVec<[u32; SLOTS]> = smallvec::SmallVec::new();
        for s in &sges[..used] {
            if !keys.contains(&s.lkey) && !fresh.contains(&s.lkey) {
                fresh.push(s.lkey);
            }
        }
        let free = keys.iter().filter(|&&k| k == 0).count();
        if fresh.len() > free {
            ud_copy(peer, &mut staged, &mut lv, &mut rv, &mut rl);
            peer.clear();
            keys = [0; SLOTS];
        }
        let l0 = lv.len();
        let r0 = rv.len();
        let mut ok = room >= total;
        if !ok {
            wc.status = WcStatus::LocLenErr;
        }
        let grh = req.grh.as_ref().map_or(&[0u8; GRH_LEN], |g| g);
        let src: smallvec::SmallVec<[Range; 5]> = std::iter::once(Range {
            base: grh.as_ptr() as u64,
            len: GRH_LEN,
        })
        .chain(req.local.iter().copied())
        .collect();
        let mut off = 0;
        for s in &sges[..if ok { used } else { 0 }] {
            let n = (s.length as usize).min(total - off);
            let slot = match keys.iter().position(|&k| k == s.lkey) {
                Some(i) => i,
                None => {
                    // Enough free slots were made above for every fresh key.
                    let Some(i) = keys.iter().position(|&k| k == 0) else {
                        ok = false;
                        wc.status = WcStatus::LocProtErr;
                        break;
                    };
                    keys[i] = s.lkey;
                    i
                }
            };
            match peer.lookup(
                seg::HZ_RECV + slot,
                s.lkey,
                pd,
                s.addr,
                n as u64,
                Access::LOCAL_WRITE,
            ) {
                Some(Place::Dm(p)) => {
                    sub(&src, off, n, &mut tmp);
                    let mut d = p;
                    for r in &tmp {
                        // SAFETY: `r` is memory of this process the caller validated against
                        // a registration; `d` stays inside the `n` bytes of the peer's heap
                        // that lookup checked (and holds under the hazard); never overlapping.
                        unsafe { std::ptr::copy_nonoverlapping(r.base as *const u8, d, r.len) };
                        // SAFETY: advancing within those `n` bytes.
                        d = unsafe { d.add(r.len) };
                    }
                }
                Some(Place::User(a)) => {
                    sub(&src, off, n, &mut tmp);
                    rl.push((lv.len(), lv.len() + tmp.len()));
                    lv.extend_from_slice(&tmp);
                    rv.push(Range { base: a, len: n });
                }
                None => {
                    wc.status = WcStatus::LocProtErr;
                    ok = false;
                    break;
                }
            }
            off += n;
        }
        if !ok {
            // Nothing of it is copied: drop what it staged.
            lv.truncate(l0);
            rv.truncate(r0);
            rl.truncate(r0);
            wc.byte_len = 0;
            wc.imm = None;
        }
        staged.push(Staged {
            wc,
            cq,
            l: (l0, lv.len()),
            r: (r0, rv.len()),
        });
    }
    ud_copy(peer, &mut staged, &mut lv, &mut rv, &mut rl);
    delivered
}

/// Copy the staged datagrams' bytes with one call, then push their completions in order.
///
/// The call writes each distinct remote range once (a range written by several datagrams —
/// a scratch buffer for GRHs — gets the last one's bytes, as writing them in order would
/// leave it), in address order with adjacent ranges merged: the kernel pins pages per remote
/// range, so pieces of one user buffer go as one range. Only when the ranges are disjoint;
/// otherwise in order as posted. A copy that fails is redone datagram by datagram, so each
/// gets its own status (rewriting the same bytes is harmless).
fn ud_copy(
    peer: &Peer,
    staged: &mut Vec<Staged>,
    lv: &mut Vec<Range>,
    rv: &mut Vec<Range>,
    rl: &mut Vec<(usize, usize)>,
) {
    let pid = peer.pid() as i32;
    let mut ok = true;
    if !rv.is_empty() {
        let mut order: Vec<usize> = (0..rv.len()).collect();
        order.sort_unstable_by_key(|&i| (rv[i].base, rv[i].len, std::cmp::Reverse(i)));
        order.dedup_by_key(|i| (rv[*i].base, rv[*i].len));
        let disjoint = order
            .windows(2)
            .all(|w| rv[w[0]].base + rv[w[0]].len as u64 <= rv[w[1]].base);
        let (mut fl, mut fr) = (
            Vec::with_capacity(lv.len()),
            Vec::with_capacity(order.len()),
        );
        let (l, r): (&[Range], &[Range]) = if disjoint {
            for &i in &order {
                match fr.last_mut() {
                    Some(Range { base, len }) if *base + *len as u64 == rv[i].base => {
                        *len += rv[i].len
                    }
                    _ => fr.push(rv[i]),
                }
                fl.extend_from_slice(&lv[rl[i].0..rl[i].1]);
            }
            (&fl, &fr)
        } else {
            (lv, rv)
        };
        let want: usize = r.iter().map(|r| r.len).sum();
        // SAFETY: the local ranges are this process's registered memory (validated by the
        // caller) or the GRHs of the requests, alive for the call; the remote ranges were
        // checked against the peer's registrations and are held by hazards until the caller
        // clears them after this copy; the kernel checks the rest.
        match unsafe { cma::copy(pid, Dir::Push, l, r, usize::MAX) } {
            Ok(n) if n == want => {}
            Err(CopyError::Gone) => {
                // Nobody will read these completions.
                staged.clear();
                lv.clear();
                rv.clear();
                rl.clear();
                return;
            }
            _ => ok = false,
        }
    }
    for s in staged.iter_mut() {
        if ok || s.wc.status != WcStatus::Success || s.r.0 == s.r.1 {
            continue;
        }
        let (l, r) = (&lv[s.l.0..s.l.1], &rv[s.r.0..s.r.1]);
        let want: usize = r.iter().map(|r| r.len).sum();
        // SAFETY: as above, for this datagram's ranges alone.
        let got = unsafe { cma::copy(pid, Dir::Push, l, r, usize::MAX) };
        if !matches!(got, Ok(n) if n == want) {
            s.wc.status = WcStatus::LocProtErr;
            s.wc.byte_len = 0;
            s.wc.imm = None;
        }
    }
    for s in staged.drain(..) {
        peer.push_cqe(s.cq, &s.wc);
    }
    lv.clear();
    rv.clear();
    rl.clear();
}

//! `limic`: kernel-assisted single-copy messaging between the ranks of one host — the LiMIC
//! design on Linux's Cross-Memory Attach (`process_vm_readv` / `process_vm_writev`).
//!
//! Tagged messaging is native: a send or a receive becomes a *descriptor* (peer, context, tag,
//! iovec, length) in shared memory, and MPI matching runs on descriptors under the receiver's
//! lock. **Whoever arrives second copies**: a receive that finds a matching send descriptor in
//! its unexpected queue pulls the data with one `process_vm_readv`; a send that finds a
//! matching posted receive pushes it with one `process_vm_writev`; the copier then marks the
//! other side's descriptor done. Messages up to `WEFT_LIMIC_INLINE` bytes travel inside the
//! descriptor instead (two `memcpy`s beat a system call there).
//!
//! One measured refinement (`WEFT_LIMIC_PULL=1`, the default): a sender that finds the
//! receive posted does not push; it hands the receiver its descriptor (state `MATCHED`) and
//! the receiver pulls at its next progress call. Every large copy then runs on the receiver's
//! core, into the buffer it will read, and destination cache lines stop bouncing between
//! cores — 64 KiB one-way latency falls from 9.5 to 6.0 µs on the 2-core test machine
//! (docs/history/benchmarks-notebook.md). `WEFT_LIMIC_PULL=0` restores the literal push.
//!
//! RMA on windows over user memory is one-sided for real: put is `process_vm_writev` and get
//! `process_vm_readv` into the target's registered region, which the origin checks against
//! the target's region table in shared memory; the target does nothing. Atomics take the core's
//! active-message path (CMA is not atomic). Active messages travel through a per-receiver ring.
//!
//! Size (over 800 lines): the provider's state machine — descriptor posting, matching under the
//! owner's lock, the copy hand-off, completion and repair after a dead lock holder — shares one
//! set of invariants over the shared segment; its layout (`seg.rs`) and the kernel copies
//! (`cma.rs`) are separate modules. About 150 of the lines are tests.

mod seg;

use seg::*;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use weft_provider::bootstrap::Bootstrap;
use weft_provider::cma::{self, CopyError, Dir, Range};
use weft_provider::provider::{
    Access, Caps, CntrId, CntrValue, Completed, Completion, CompletionLevel, CompletionTable,
    MemRegion, ProbeContext, Provider, RawIov, RawIovMut, RemoteAddr, RmaCaps, SendOutcome, Sink,
    StaticProvider, TaggedStatus, Token,
};
use weft_provider::{Error, ErrorDetail, Rank, Result};

weft_provider::param!(INLINE: Size[0, 1 << 20] = "limic", "INLINE", "6K",
    "messages up to this size travel inside the descriptor (two copies) instead of one cross-memory copy (at most 1M; see docs/history/benchmarks-notebook.md)");
weft_provider::param!(SLOTS: Uint[16, 65_000] = "limic", "SLOTS", "1024",
    "descriptor slots per rank: outstanding sends and posted receives (more wait in a local queue; 16 to 65000)");
weft_provider::param!(PULL: Bool = "limic", "PULL", "1",
    "a sender that finds the receive posted leaves a large message for the receiver to pull (1), or pushes it itself (0); see docs/history/benchmarks-notebook.md");
weft_provider::param!(PTRACER: Bool = "limic", "PTRACER", "1",
    "allow the other processes of this user to attach (PR_SET_PTRACER_ANY), which Yama ptrace_scope=1 requires for cross-memory attach");

/// Active-message cells per receiver and their payload.
const AM_CELLS: usize = 64;
const AM_PAYLOAD: usize = 8192;
/// How often an idle rank checks whether its peers are alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(50);

#[derive(Debug, Clone)]
struct Config {
    inline_max: usize,
    slots: usize,
    ptracer: bool,
    pull: bool,
}

impl Config {
    fn from_env() -> Result<Config> {
        // Every range is in the parameter's declaration.
        let inline_max = INLINE.get_size()?;
        let slots = SLOTS.get_u64()? as usize;
        Ok(Config {
            inline_max,
            slots,
            ptracer: PTRACER.get_bool()?,
            pull: PULL.get_bool()?,
        })
    }
}

fn caps() -> Caps {
    let mut c = Caps::am_only(AM_HEADER_MAX, AM_PAYLOAD, MAX_IOV);
    c.tagged = true;
    c.spans_processes = true;
    c.spans_hosts = false;
    c.rma = Some(RmaCaps {
        read: true,
        write: true,
        max_iov: MAX_IOV,
        scalable_keys: true,
        alloc: false,
        native_locks: false,
        user_memory: true,
        // Cross-memory-attach copies finish (visible at the target) before the call returns.
        completion: CompletionLevel::Delivery,
        fence: true,
        cq_data_size: 0,
        rndv_only: false,
    });
    c.counters = true;
    c
}

/// One of this rank's descriptors in flight.
#[derive(Debug)]
struct Out {
    slot: usize,
    /// `None`: a buffered send the user already has back; the slot is freed when consumed.
    token: Option<Token>,
    kind: u32,
    /// The rank at the other end, when it is known (sends; receives from one source).
    peer: Option<usize>,
    /// Receives: the buffer, kept here rather than read back from the shared slot (which any
    /// local peer can write), so nothing but this process decides where its data lands.
    iov: SmallVec<[Range; 4]>,
}

/// An operation waiting for a free slot (kept in posting order).
#[derive(Debug)]
enum Deferred {
    Send {
        dest: usize,
        ctx: u32,
        tag: i32,
        iov: SmallVec<[Range; 4]>,
        sync: bool,
        token: Token,
    },
    Recv {
        src: Option<usize>,
        ctx: u32,
        tag: Option<i32>,
        iov: SmallVec<[Range; 4]>,
        token: Token,
    },
}

pub struct Limic {
    seg: Seg,
    me: usize,
    size: u32,
    caps: Caps,
    pids: Vec<i32>,
    free: Vec<usize>,
    out: Vec<Out>,
    /// Sends and receives waiting for a slot, each in posting order.
    deferred_sends: VecDeque<Deferred>,
    deferred_recvs: VecDeque<Deferred>,
    done: CompletionTable,
    seen_done: u64,
    am_head: u64,
    failed: Vec<bool>,
    /// Slots given up with a dead peer (never reused).
    abandoned: usize,
    idle_polls: u32,
    last_check: Instant,
    next_key: u64,
    pull: bool,
    /// The local peers' processes (by pidfd: a recycled pid is never taken for a peer).
    watch: weft_provider::shmem::Watch,
}

fn total(r: &[Range]) -> usize {
    r.iter().map(|x| x.len).sum()
}

fn tag_matches(want: i64, tag: i64) -> bool {
    want == ANY_TAG || want == tag
}

impl Limic {
    fn open_with(boot: &mut dyn Bootstrap, cfg: &Config) -> Result<Self> {
        let (rank, size) = (boot.rank(), boot.size());
        let nodes = boot.nodes().clone();
        if nodes.hosts() > 1 {
            return Err(Error::from(ErrorDetail::ProviderUnavailable {
                requested: "limic".into(),
                details: "cross-memory attach reaches only processes on one host".into(),
            }));
        }
        let me = rank as usize;
        let n = size as usize;
        let lay = Layout::new(n, cfg.slots, cfg.inline_max, AM_CELLS, AM_PAYLOAD);
        let name = format!(
            "{}-limic",
            weft_provider::shmem::object_name(boot.job_id(), 0)
        );
        let created = (me == 0).then(|| Seg::create(&name, lay));
        boot.put(
            &format!("limic.ok.{rank}"),
            if created.as_ref().is_none_or(|c| c.is_ok()) {
                "1"
            } else {
                "0"
            },
        )?;
        boot.fence()?;
        let mapped = (|| -> Result<Seg> {
            let mut s = match created {
                Some(s) => s?,
                None => {
                    if boot.get("limic.ok.0")? != "1" {
                        return Err(Error::from(ErrorDetail::Bootstrap(format!(
                            "rank 0 could not create the limic segment {name}"
                        ))));
                    }
                    Seg::open(&name)?
                }
            };
            if s.lay.nlocal != n {
                return Err(Error::from(ErrorDetail::Bootstrap(format!(
                    "{name} has {} ranks, the job {n}",
                    s.lay.nlocal
                ))));
            }
            s.area(me).live.set_open();
            s.mark_mapped();
            Ok(s)
        })();
        // Everyone has mapped (and the last one unlinked) before anyone goes on.
        boot.fence()?;
        let seg = mapped?;
        if cfg.ptracer {
            // SAFETY: prctl with integer arguments; only affects Yama's ptrace policy.
            unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        }
        // The CMA check: read every local peer's probe word and compare it with the value it
        // published. Every rank reports, and every rank reaches the same verdict.
        let cookie: Box<u64> =
            Box::new(0x11AC_0000_0000_0000 | ((std::process::id() as u64) << 8) | me as u64);
        seg.area(me)
            .probe
            .addr
            .store(&*cookie as *const u64 as u64, Ordering::Relaxed);
        seg.area(me).probe.cookie.store(*cookie, Ordering::Release);
        boot.fence()?;
        let pids: Vec<i32> = (0..n)
            .map(|r| seg.area(r).live.pid.load(Ordering::Relaxed) as i32)
            .collect();
        let mut verdict = "ok".to_string();
        for (r, &pid) in pids.iter().enumerate() {
            if r == me {
                continue;
            }
            let want = seg.area(r).probe.cookie.load(Ordering::Acquire);
            let addr = seg.area(r).probe.addr.load(Ordering::Relaxed);
            let mut got = 0u64;
            let local = [Range {
                base: &mut got as *mut u64 as u64,
                len: 8,
            }];
            let remote = [Range { base: addr, len: 8 }];
            // SAFETY: `got` is ours and writable; the remote side is checked by the kernel.
            let r_ = unsafe { cma::copy(pid, Dir::Pull, &local, &remote, 8) };
            let bad = match r_ {
                Ok(8) if got == want => None,
                Ok(_) => Some("read the wrong value".to_string()),
                Err(e) => Some(e.to_string()),
            };
            if let Some(why) = bad {
                verdict = format!(
                    "process_vm_readv from rank {me} (pid {}) to rank {r} (pid {}): {why}{}",
                    std::process::id(),
                    pid,
                    ptrace_hint()
                );
                break;
            }
        }
        let all = weft_provider::bootstrap::allgather(boot, "limic.cma", &verdict)?;
        drop(cookie);
        if let Some(why) = all.iter().find(|v| *v != "ok") {
            return Err(Error::from(ErrorDetail::ProviderUnavailable {
                requested: "limic".into(),
                details: why.clone(),
            }));
        }
        let mut caps = caps();
        caps.eager_limit = AM_PAYLOAD;
        let seen_done = seg.area(me).done.v.load(Ordering::Acquire);
        let watch = weft_provider::shmem::Watch::new((0..n).map(|r| &seg.area(r).live));
        Ok(Limic {
            free: (0..seg.lay.nslots).rev().collect(),
            seg,
            me,
            size,
            caps,
            pids,
            out: Vec::new(),
            deferred_sends: VecDeque::new(),
            deferred_recvs: VecDeque::new(),
            done: CompletionTable::default(),
            seen_done,
            am_head: 0,
            failed: vec![false; n],
            abandoned: 0,
            idle_polls: 0,
            last_check: Instant::now(),
            next_key: 1,
            pull: cfg.pull,
            watch,
        })
    }

    fn alive_fn(&self) -> impl Fn(usize) -> bool + '_ {
        move |r| self.watch.gone(r, &self.seg.area(r).live).is_none()
    }

    fn peer_err(&self, r: usize, why: &str) -> Error {
        Error::peer_failed(r as Rank, why)
    }

    fn check_dest(&self, r: usize) -> Result<()> {
        if r >= self.size as usize {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        if self.failed[r] {
            return Err(self.peer_err(r, "rank exited"));
        }
        Ok(())
    }

    /// Copy between this process and local rank `peer`'s memory (a plain copy for ourselves).
    fn xfer(
        &self,
        peer: usize,
        dir: Dir,
        local: &[Range],
        remote: &[Range],
        limit: usize,
    ) -> std::result::Result<usize, CopyError> {
        if peer == self.me {
            let (dst, src) = match dir {
                Dir::Pull => (local, remote),
                Dir::Push => (remote, local),
            };
            // SAFETY: both sides are memory of this process that the operation's contract
            // keeps valid (user buffers borrowed until completion, or slot inline areas).
            return Ok(unsafe { copy_local(dst, src, limit) });
        }
        // SAFETY: `local` is this process's memory valid for the operation; the kernel checks
        // the remote side.
        unsafe { cma::copy(self.pids[peer], dir, local, remote, limit) }
    }

    /// The slot status and the caller's result for a finished copy with `peer`.
    fn copy_outcome(
        &self,
        peer: usize,
        res: std::result::Result<usize, CopyError>,
        what: &str,
        ok: Completed,
    ) -> (u32, Result<Completed>) {
        match res {
            Ok(_) => (E_OK, Ok(ok)),
            Err(e) => {
                let code = if matches!(e, CopyError::Gone) {
                    E_PEER
                } else {
                    E_FAULT
                };
                (code, Err(self.copy_error(peer, e, what)))
            }
        }
    }

    fn copy_error(&self, peer: usize, e: CopyError, what: &str) -> Error {
        match e {
            CopyError::Gone => self.peer_err(peer, "process died"),
            CopyError::Fault { done } => Error::from(ErrorDetail::RemoteAccess {
                rank: peer as Rank,
                what: format!("{what}: bad address after {done} bytes"),
            }),
            e => Error::from(ErrorDetail::Io {
                what: format!("{what} with rank {peer}"),
                source: std::io::Error::other(e.to_string()).into(),
            }),
        }
    }

    // ------------------------------------------------------------------------ descriptors

    fn write_iov(&self, s: &Slot, iov: &[Range]) {
        s.niov.store(iov.len() as u32, Ordering::Relaxed);
        for (k, r) in iov.iter().enumerate() {
            s.iov[k][0].store(r.base, Ordering::Relaxed);
            s.iov[k][1].store(r.len as u64, Ordering::Relaxed);
        }
    }

    fn read_iov(s: &Slot) -> SmallVec<[Range; 4]> {
        let n = (s.niov.load(Ordering::Relaxed) as usize).min(MAX_IOV);
        (0..n)
            .map(|k| Range {
                base: s.iov[k][0].load(Ordering::Relaxed),
                len: s.iov[k][1].load(Ordering::Relaxed) as usize,
            })
            .collect()
    }

    /// Describe a send of ours in slot `s` (by reference: its iovec).
    fn fill_send(&self, s: &Slot, ctx: u32, tag: i32, len: usize, sync: bool, iov: &[Range]) {
        s.kind.store(SEND, Ordering::Relaxed);
        s.src.store(self.me as u32, Ordering::Relaxed);
        s.ctx.store(ctx, Ordering::Relaxed);
        s.tag.store(tag as i64, Ordering::Relaxed);
        s.len.store(len as u64, Ordering::Relaxed);
        s.sync.store(sync as u32, Ordering::Relaxed);
        s.inline_len.store(0, Ordering::Relaxed);
        self.write_iov(s, iov);
    }

    /// Pull the message a sender matched to our posted receive `o`.
    fn pull_matched(&self, o: &Out) -> Result<Completed> {
        let me = self.me;
        let rs = self.seg.slot(me, o.slot);
        let Some((sender, si)) = self.seg.sref_ok(rs.matched.load(Ordering::Relaxed)) else {
            return Err(Error::malformed(
                me as Rank,
                "limic: a matched receive names no slot of the segment",
            ));
        };
        let ss = self.seg.slot(sender, si);
        let len = ss.len.load(Ordering::Relaxed) as usize;
        let tag = ss.tag.load(Ordering::Relaxed);
        let cap = total(&o.iov);
        let remote = Self::read_iov(ss);
        let res = self.xfer(sender, Dir::Pull, &o.iov, &remote, len.min(cap));
        let status = Completed::Received(TaggedStatus {
            source: sender as Rank,
            tag: tag as i32,
            bytes: len,
        });
        let (err, r) = self.copy_outcome(sender, res, "pulling a message", status);
        self.finish_slot(sender, si, me as u32, tag, len as u64, err);
        r
    }

    /// Mark `owner`'s slot done with a status and tell the owner.
    fn finish_slot(&self, owner: usize, i: usize, src: u32, tag: i64, bytes: u64, err: u32) {
        let s = self.seg.slot(owner, i);
        s.st_src.store(src, Ordering::Relaxed);
        s.st_tag.store(tag, Ordering::Relaxed);
        s.st_bytes.store(bytes, Ordering::Relaxed);
        s.st_err.store(err, Ordering::Relaxed);
        s.state.store(DONE, Ordering::Release);
        self.seg.area(owner).done.v.fetch_add(1, Ordering::AcqRel);
    }

    /// Send: match `dest`'s posted receives, else queue a descriptor in its unexpected queue.
    fn do_send(
        &mut self,
        dest: usize,
        ctx: u32,
        tag: i32,
        iov: &[Range],
        sync: bool,
        token: Token,
    ) -> Result<bool> {
        let len = total(iov);
        let small = len <= self.seg.lay.inline_max;
        let me = self.me;
        let g = lock_area(&self.seg, &self.watch, dest, me);
        let hit = self.seg.take_first(dest, Q::Posted, |r| {
            r.ctx.load(Ordering::Relaxed) == ctx
                && {
                    let s = r.src.load(Ordering::Relaxed);
                    s == ANY_SRC || s == me as u32
                }
                && tag_matches(r.tag.load(Ordering::Relaxed), tag as i64)
        });
        if let Some(r) = hit {
            let (_, ri) = sref_parts(r);
            let rs = self.seg.slot(dest, ri);
            rs.claimer.store(me as u32, Ordering::Relaxed);
            rs.state.store(CLAIMED, Ordering::Relaxed);
            drop(g);
            if !small && self.pull {
                if let Some(slot) = self.free.pop() {
                    // Leave the copy to the receiver: it writes its own buffer from its own
                    // core, where it will read it (no cache lines bouncing between cores).
                    let s = self.seg.slot(me, slot);
                    self.fill_send(s, ctx, tag, len, sync, iov);
                    s.claimer.store(dest as u32, Ordering::Relaxed);
                    s.state.store(CLAIMED, Ordering::Relaxed);
                    rs.matched.store(sref(me, slot), Ordering::Relaxed);
                    rs.state.store(MATCHED, Ordering::Release);
                    self.seg.area(dest).done.v.fetch_add(1, Ordering::AcqRel);
                    self.out.push(Out {
                        slot,
                        token: Some(token),
                        kind: SEND,
                        peer: Some(dest),
                        iov: SmallVec::new(),
                    });
                    return Ok(true);
                }
            }
            // We arrived second: push the data into the posted receive.
            let cap = rs.len.load(Ordering::Relaxed) as usize;
            let res = if small {
                let n = len.min(cap);
                let dst = [Range {
                    base: self.seg.slot_inline(dest, ri) as u64,
                    len: n,
                }];
                // SAFETY: the inline area belongs to the claimed slot, which nobody else
                // touches until DONE; the source is the caller's buffer.
                unsafe { copy_local(&dst, iov, n) };
                rs.inline_len.store(n as u64, Ordering::Relaxed);
                Ok(n)
            } else {
                rs.inline_len.store(0, Ordering::Relaxed);
                let remote = Self::read_iov(rs);
                self.xfer(dest, Dir::Push, iov, &remote, len.min(cap))
            };
            let (err, r) = self.copy_outcome(dest, res, "pushing a message", Completed::Done);
            self.finish_slot(dest, ri, me as u32, tag as i64, len as u64, err);
            self.done.push(token, r);
            return Ok(true);
        }
        // We arrived first: leave a descriptor for the receiver, in a slot of ours.
        let Some(slot) = self.free.pop() else {
            return Ok(false);
        };
        let s = self.seg.slot(me, slot);
        self.fill_send(s, ctx, tag, len, sync, iov);
        s.claimer.store(NIL, Ordering::Relaxed);
        if small {
            let dst = [Range {
                base: self.seg.slot_inline(me, slot) as u64,
                len,
            }];
            // SAFETY: our own free slot's inline area; the source is the caller's buffer.
            unsafe { copy_local(&dst, iov, len) };
            s.inline_len.store(len as u64, Ordering::Relaxed);
            s.niov.store(0, Ordering::Relaxed);
        }
        self.seg.append(dest, Q::Unexp, sref(me, slot));
        drop(g);
        let buffered = small && !sync;
        if buffered {
            // The data is in the descriptor: the user has the buffer back.
            self.done.push(token, Ok(Completed::Done));
        }
        self.out.push(Out {
            slot,
            token: (!buffered).then_some(token),
            kind: SEND,
            peer: Some(dest),
            iov: SmallVec::new(),
        });
        Ok(true)
    }

    /// Receive: match our unexpected sends, else post a descriptor.
    fn do_recv(
        &mut self,
        src: Option<usize>,
        ctx: u32,
        tag: Option<i32>,
        iov: &[Range],
        token: Token,
    ) -> Result<bool> {
        let cap = total(iov);
        let me = self.me;
        let g = lock_area(&self.seg, &self.watch, me, me);
        let want_tag = tag.map_or(ANY_TAG, |t| t as i64);
        let hit = self.seg.take_first(me, Q::Unexp, |s| {
            s.ctx.load(Ordering::Relaxed) == ctx
                && src.is_none_or(|w| s.src.load(Ordering::Relaxed) == w as u32)
                && tag_matches(want_tag, s.tag.load(Ordering::Relaxed))
        });
        if let Some(sr) = hit {
            let (sender, si) = sref_parts(sr);
            let ss = self.seg.slot(sender, si);
            ss.claimer.store(me as u32, Ordering::Relaxed);
            ss.state.store(CLAIMED, Ordering::Relaxed);
            drop(g);
            // We arrived second: pull the data.
            let len = ss.len.load(Ordering::Relaxed) as usize;
            let stag = ss.tag.load(Ordering::Relaxed);
            let res = if ss.inline_len.load(Ordering::Relaxed) as usize == len
                && len <= self.seg.lay.inline_max
                && ss.niov.load(Ordering::Relaxed) == 0
            {
                let srcr = [Range {
                    base: self.seg.slot_inline(sender, si) as u64,
                    len,
                }];
                // SAFETY: the claimed slot's inline bytes (written before it was queued) and
                // the caller's receive buffer.
                Ok(unsafe { copy_local(iov, &srcr, len.min(cap)) })
            } else {
                let remote = Self::read_iov(ss);
                self.xfer(sender, Dir::Pull, iov, &remote, len.min(cap))
            };
            let status = Completed::Received(TaggedStatus {
                source: sender as Rank,
                tag: stag as i32,
                bytes: len,
            });
            let (err, r) = self.copy_outcome(sender, res, "pulling a message", status);
            self.finish_slot(sender, si, me as u32, stag, len as u64, err);
            self.done.push(token, r);
            return Ok(true);
        }
        // We arrived first: post a descriptor, in a slot of ours.
        let Some(slot) = self.free.pop() else {
            return Ok(false);
        };
        let s = self.seg.slot(me, slot);
        s.kind.store(RECV, Ordering::Relaxed);
        s.src
            .store(src.map_or(ANY_SRC, |x| x as u32), Ordering::Relaxed);
        s.ctx.store(ctx, Ordering::Relaxed);
        s.tag.store(want_tag, Ordering::Relaxed);
        s.len.store(cap as u64, Ordering::Relaxed);
        s.inline_len.store(0, Ordering::Relaxed);
        s.claimer.store(NIL, Ordering::Relaxed);
        self.write_iov(s, iov);
        self.seg.append(me, Q::Posted, sref(me, slot));
        drop(g);
        self.out.push(Out {
            slot,
            token: Some(token),
            kind: RECV,
            peer: src,
            iov: iov.into(),
        });
        Ok(true)
    }

    /// Try a send or receive; `Ok(false)`: it needs a slot and none is free.
    fn attempt(&mut self, d: &Deferred) -> Result<bool> {
        match d {
            Deferred::Send {
                dest,
                ctx,
                tag,
                iov,
                sync,
                token,
            } => self.do_send(*dest, *ctx, *tag, iov, *sync, *token),
            Deferred::Recv {
                src,
                ctx,
                tag,
                iov,
                token,
            } => self.do_recv(*src, *ctx, *tag, iov, *token),
        }
    }

    /// Post a send or receive now, or queue it behind earlier ones of its kind (sends keep
    /// their order, and so do receives; the two kinds never wait for each other).
    fn post(&mut self, d: Deferred) -> Result<()> {
        let q = match d {
            Deferred::Send { .. } => &self.deferred_sends,
            Deferred::Recv { .. } => &self.deferred_recvs,
        };
        if q.is_empty() && self.attempt(&d)? {
            return Ok(());
        }
        match d {
            Deferred::Send { .. } => self.deferred_sends.push_back(d),
            Deferred::Recv { .. } => self.deferred_recvs.push_back(d),
        }
        Ok(())
    }

    /// Retry deferred operations, in order within each kind.
    fn run_deferred(&mut self) -> Result<usize> {
        let mut n = 0;
        for sends in [true, false] {
            loop {
                let q = if sends {
                    &mut self.deferred_sends
                } else {
                    &mut self.deferred_recvs
                };
                let Some(d) = q.pop_front() else {
                    break;
                };
                if self.attempt(&d)? {
                    n += 1;
                } else {
                    let q = if sends {
                        &mut self.deferred_sends
                    } else {
                        &mut self.deferred_recvs
                    };
                    q.push_front(d);
                    break;
                }
            }
        }
        Ok(n)
    }

    /// Complete our descriptors that others finished.
    fn reap(&mut self) -> usize {
        let seq = self.seg.area(self.me).done.v.load(Ordering::Acquire);
        if seq == self.seen_done {
            return 0;
        }
        self.seen_done = seq;
        let mut n = 0;
        let mut k = 0;
        while k < self.out.len() {
            let o = &self.out[k];
            let s = self.seg.slot(self.me, o.slot);
            let st = s.state.load(Ordering::Acquire);
            if st == MATCHED {
                let o = self.out.swap_remove(k);
                let r = self.pull_matched(&o);
                if let Some(t) = o.token {
                    self.done.push(t, r);
                }
                s.state.store(FREE, Ordering::Relaxed);
                self.free.push(o.slot);
                n += 1;
                continue;
            }
            if st != DONE {
                k += 1;
                continue;
            }
            let o = self.out.swap_remove(k);
            let err = s.st_err.load(Ordering::Relaxed);
            let peer = s.st_src.load(Ordering::Relaxed) as usize;
            if let Some(t) = o.token {
                let r = match (err, o.kind) {
                    (E_OK, SEND) => Ok(Completed::Done),
                    (E_OK, _) => {
                        let bytes = s.st_bytes.load(Ordering::Relaxed) as usize;
                        // Written by the peer: at most what the inline area and our buffer
                        // hold, whatever it says.
                        let il = (s.inline_len.load(Ordering::Relaxed) as usize)
                            .min(self.seg.lay.inline_max)
                            .min(total(&o.iov));
                        if il > 0 {
                            let srcr = [Range {
                                base: self.seg.slot_inline(self.me, o.slot) as u64,
                                len: il,
                            }];
                            // SAFETY: our DONE slot's inline bytes (ordered by the acquire
                            // above, `il` within the inline area) into the receive buffer the
                            // request still borrows (our own record of it, not the slot's).
                            unsafe { copy_local(&o.iov, &srcr, il) };
                        }
                        Ok(Completed::Received(TaggedStatus {
                            source: peer as Rank,
                            tag: s.st_tag.load(Ordering::Relaxed) as i32,
                            bytes,
                        }))
                    }
                    (E_PEER, _) => Err(self.peer_err(peer, "process died during the copy")),
                    _ => Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: peer as Rank,
                        what: "the message could not be copied (bad address)".into(),
                    })),
                };
                self.done.push(t, r);
            }
            s.state.store(FREE, Ordering::Relaxed);
            self.free.push(o.slot);
            n += 1;
        }
        n
    }

    /// Deliver active messages from our ring.
    fn drain_am(&mut self, sink: &mut dyn Sink) -> usize {
        let area = self.seg.area(self.me);
        let tail = area.am_tail.tail.load(Ordering::Acquire);
        let mut n = 0;
        while self.am_head < tail {
            let c = self.seg.cell(self.me, self.am_head as usize);
            // SAFETY: cells below `tail` were fully written before the release store of
            // `tail`; the producer does not reuse the cell until we advance `am_head`.
            unsafe {
                let src = (c as *const u32).read_unaligned();
                let hl = (c.add(4) as *const u32).read_unaligned() as usize;
                let pl = (c.add(8) as *const u32).read_unaligned() as usize;
                let hl = hl.min(AM_HEADER_MAX);
                let pl = pl.min(self.seg.lay.am_payload);
                let h = std::slice::from_raw_parts(c.add(CELL_HDR), hl);
                let p = std::slice::from_raw_parts(c.add(CELL_HDR + AM_HEADER_MAX), pl);
                sink.am(src, h, p);
            }
            self.am_head += 1;
            area.am_head.v.store(self.am_head, Ordering::Release);
            n += 1;
        }
        n
    }

    /// Find peers that went away and clean up after them.
    fn check_peers(&mut self, sink: &mut dyn Sink) -> usize {
        let mut n = 0;
        for r in 0..self.size as usize {
            if r == self.me || self.failed[r] {
                continue;
            }
            let Some(why) = self.watch.gone(r, &self.seg.area(r).live) else {
                continue;
            };
            self.failed[r] = true;
            // Deliver what it sent before it went away.
            n += self.drain_am(sink);
            self.forget_peer(r, why);
            sink.peer_failed(r as Rank, why);
            n += 1;
        }
        n
    }

    /// Drop every operation that depends on the dead rank `d`: the core fails the requests
    /// that name it; we make sure nothing refers to their buffers any more.
    fn forget_peer(&mut self, d: usize, why: &str) {
        let me = self.me;
        // Our receives from `d` still posted: unlink and free them.
        {
            let _g = lock_area(&self.seg, &self.watch, me, me);
            while let Some(r) = self
                .seg
                .take_first(me, Q::Posted, |s| s.src.load(Ordering::Relaxed) == d as u32)
            {
                let (_, i) = sref_parts(r);
                self.seg.slot(me, i).state.store(FREE, Ordering::Relaxed);
                if let Some(k) = self.out.iter().position(|o| o.slot == i) {
                    self.out.swap_remove(k);
                }
                self.free.push(i);
            }
        }
        let mut k = 0;
        while k < self.out.len() {
            let o = &self.out[k];
            let s = self.seg.slot(me, o.slot);
            let st = s.state.load(Ordering::Acquire);
            let claimed_by_d = st == CLAIMED && s.claimer.load(Ordering::Relaxed) == d as u32;
            let queued_at_d = st == POSTED && o.kind == SEND && o.peer == Some(d);
            if claimed_by_d || queued_at_d {
                let o = self.out.swap_remove(k);
                // A receive from any source that `d` was filling fails here; requests that
                // name `d` are failed by the core.
                if let (Some(t), true) = (o.token, o.peer.is_none()) {
                    self.done.push(t, Err(self.peer_err(d, why)));
                }
                // The slot stays referenced by the dead rank's queue or copy: never reuse it.
                self.abandoned += 1;
                continue;
            }
            k += 1;
        }
        self.deferred_sends
            .retain(|x| !matches!(x, Deferred::Send { dest, .. } if *dest == d));
        self.deferred_recvs
            .retain(|x| !matches!(x, Deferred::Recv { src, .. } if *src == Some(d)));
    }

    /// The target's registered region holding `[addr, addr + len)` under `key`, as an absolute
    /// address range.
    fn region(&self, target: usize, remote: RemoteAddr, len: usize, write: bool) -> Result<Range> {
        let area = self.seg.area(target);
        for reg in &area.regions {
            if reg.key.load(Ordering::Acquire) != remote.key {
                continue;
            }
            let base = reg.base.load(Ordering::Relaxed);
            let rlen = reg.len.load(Ordering::Relaxed);
            let flags = reg.flags.load(Ordering::Relaxed);
            let allowed = flags & if write { R_WRITE } else { R_READ } != 0;
            let start = if flags & R_KEYED != 0 {
                base.checked_add(remote.addr)
            } else {
                Some(remote.addr)
            };
            return match start {
                Some(s)
                    if allowed
                        && s >= base
                        && s.checked_add(len as u64).is_some_and(|e| e <= base + rlen) =>
                {
                    Ok(Range { base: s, len })
                }
                _ => Err(Error::from(ErrorDetail::RemoteAccess {
                    rank: target as Rank,
                    what: if allowed {
                        format!(
                            "{len} bytes at {:#x} lie outside the registered region",
                            remote.addr
                        )
                    } else {
                        "the region does not allow this access".into()
                    },
                })),
            };
        }
        Err(Error::from(ErrorDetail::RemoteAccess {
            rank: target as Rank,
            what: format!("no region with key {}", remote.key),
        }))
    }

    fn register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
        keyed: bool,
    ) -> Result<MemRegion> {
        let area = self.seg.area(self.me);
        let Some((i, reg)) = area
            .regions
            .iter()
            .enumerate()
            .find(|(_, r)| r.key.load(Ordering::Relaxed) == 0)
        else {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "limic: all {MAX_REGIONS} region entries are in use"
            ))));
        };
        let mut flags = 0;
        if access.remote_read {
            flags |= R_READ;
        }
        if access.remote_write {
            flags |= R_WRITE;
        }
        if keyed {
            flags |= R_KEYED;
        }
        reg.base.store(base as u64, Ordering::Relaxed);
        reg.len.store(len as u64, Ordering::Relaxed);
        reg.flags.store(flags, Ordering::Relaxed);
        reg.key.store(key, Ordering::Release);
        Ok(MemRegion {
            key,
            addr: if keyed { 0 } else { base as u64 },
            len,
            handle: i as u64,
            desc: i as u64,
        })
    }

    fn one_sided(
        &mut self,
        target: Rank,
        dir: Dir,
        local: &[Range],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let t = target as usize;
        self.check_dest(t)?;
        let len = total(local);
        // Announce the access before looking the region up (see `mr_deregister`).
        let access = &self.seg.area(self.me).rma_access.v;
        access.store(t as u64 + 1, Ordering::SeqCst);
        let res = self.region(t, remote, len, dir == Dir::Push).map(|r| {
            #[cfg(test)]
            tests::after_lookup();
            self.xfer(t, dir, local, &[r], len)
        });
        access.store(0, Ordering::Release);
        match res? {
            Ok(n) if n == len => {
                self.done.finish(done, Ok(()));
                Ok(())
            }
            Ok(n) => Err(Error::from(ErrorDetail::RemoteAccess {
                rank: target,
                what: format!("copied {n} of {len} bytes"),
            })),
            Err(e) => Err(self.copy_error(t, e, "RMA")),
        }
    }
}

/// Hold area `a`'s matching lock as local rank `me` (borrowing only the segment); if it was
/// taken over from a rank that died holding it, the queues it may have been editing are
/// rebuilt first.
fn lock_area<'s>(
    seg: &'s Seg,
    watch: &weft_provider::shmem::Watch,
    a: usize,
    me: usize,
) -> Guard<'s> {
    let g = lock(&seg.area(a).lock, me, |r| {
        watch.gone(r, &seg.area(r).live).is_none()
    });
    if g.took_over {
        seg.repair(a);
    }
    g
}

/// Why cross-memory attach may be refused here, for error messages.
fn ptrace_hint() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Ok(v) => format!(
            " (Yama ptrace_scope is {}; the processes must share a user and a container, be \
             dumpable, and no seccomp profile may forbid process_vm_readv)",
            v.trim()
        ),
        Err(_) => " (the processes must share a user and a container, be dumpable, and no \
                   seccomp profile may forbid process_vm_readv)"
            .into(),
    }
}

/// Copy up to `limit` bytes from `src` ranges to `dst` ranges, both in this process.
///
/// # Safety
/// Every range must be valid memory of this process (readable for `src`, writable for `dst`)
/// and the two sides must not overlap.
unsafe fn copy_local(dst: &[Range], src: &[Range], limit: usize) -> usize {
    let (mut di, mut doff, mut si, mut soff) = (0usize, 0usize, 0usize, 0usize);
    let mut done = 0;
    while done < limit && di < dst.len() && si < src.len() {
        let d = dst[di];
        let s = src[si];
        let n = (d.len - doff).min(s.len - soff).min(limit - done);
        if n > 0 {
            std::ptr::copy_nonoverlapping(
                (s.base as usize + soff) as *const u8,
                (d.base as usize + doff) as *mut u8,
                n,
            );
        }
        done += n;
        doff += n;
        soff += n;
        if doff == d.len {
            di += 1;
            doff = 0;
        }
        if soff == s.len {
            si += 1;
            soff = 0;
        }
    }
    done
}

fn ranges_of(v: &[RawIov]) -> SmallVec<[Range; 4]> {
    v.iter()
        .map(|r| Range {
            base: r.ptr as u64,
            len: r.len,
        })
        .collect()
}

fn ranges_of_mut(v: &[RawIovMut]) -> SmallVec<[Range; 4]> {
    v.iter()
        .map(|r| Range {
            base: r.ptr as u64,
            len: r.len,
        })
        .collect()
}

impl Drop for Limic {
    fn drop(&mut self) {
        self.seg.area(self.me).live.set_closed();
    }
}

impl Provider for Limic {
    fn name(&self) -> &str {
        "limic"
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        self.me as Rank
    }
    fn size(&self) -> u32 {
        self.size
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let d = dest as usize;
        self.check_dest(d)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > AM_HEADER_MAX || plen > self.seg.lay.am_payload {
            return Err(Error::invalid(format!(
                "limic: active message of {} + {plen} bytes exceeds {AM_HEADER_MAX} + {}",
                header.len(),
                self.seg.lay.am_payload
            )));
        }
        let area = self.seg.area(d);
        let _g = lock(&area.am_lock, self.me, self.alive_fn());
        let tail = area.am_tail.tail.load(Ordering::Relaxed);
        let head = area.am_head.v.load(Ordering::Acquire);
        if tail - head >= self.seg.lay.am_cells as u64 {
            return Ok(SendOutcome::Busy);
        }
        let c = self.seg.cell(d, tail as usize);
        // SAFETY: cell `tail` is free (the consumer is past it) and only we, holding the
        // producers' lock, write it; sizes were checked against the cell.
        unsafe {
            (c as *mut u32).write_unaligned(self.me as u32);
            (c.add(4) as *mut u32).write_unaligned(header.len() as u32);
            (c.add(8) as *mut u32).write_unaligned(plen as u32);
            std::ptr::copy_nonoverlapping(header.as_ptr(), c.add(CELL_HDR), header.len());
            let mut at = c.add(CELL_HDR + AM_HEADER_MAX);
            for p in payload {
                std::ptr::copy_nonoverlapping(p.as_ptr(), at, p.len());
                at = at.add(p.len());
            }
        }
        area.am_tail.tail.store(tail + 1, Ordering::Release);
        Ok(SendOutcome::Sent)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = self.reap();
        if !self.deferred_sends.is_empty() || !self.deferred_recvs.is_empty() {
            n += self.run_deferred()?;
        }
        n += self.done.deliver(sink);
        n += self.drain_am(sink);
        if n == 0 {
            self.idle_polls += 1;
            if self.idle_polls >= 256 {
                self.idle_polls = 0;
                let now = Instant::now();
                if now - self.last_check >= LIVENESS_EVERY {
                    self.last_check = now;
                    n += self.check_peers(sink);
                    n += self.done.deliver(sink);
                }
            }
        } else {
            self.idle_polls = 0;
        }
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        self.seg.area(self.me).live.set_closed();
        if self.abandoned > 0 {
            tracing::debug!(
                slots = self.abandoned,
                "limic: slots given up with failed peers"
            );
        }
        Ok(())
    }

    unsafe fn tagged_send(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        data: &[RawIov],
        sync: bool,
        token: Token,
    ) -> Result<()> {
        let d = dest as usize;
        self.check_dest(d)?;
        self.post(Deferred::Send {
            dest: d,
            ctx,
            tag,
            iov: ranges_of(data),
            sync,
            token,
        })
    }

    unsafe fn tagged_recv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: &[RawIovMut],
        token: Token,
    ) -> Result<()> {
        let s = src.map(|r| r as usize);
        if let Some(r) = s {
            if r >= self.size as usize {
                return self.check_dest(r);
            }
        }
        self.post(Deferred::Recv {
            src: s,
            ctx,
            tag,
            iov: ranges_of_mut(buf),
            token,
        })
    }

    fn tagged_probe(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        let me = self.me;
        let _g = lock_area(&self.seg, &self.watch, me, me);
        let want_tag = tag.map_or(ANY_TAG, |t| t as i64);
        let hit = self.seg.find(me, Q::Unexp, |r, s| {
            s.ctx.load(Ordering::Relaxed) == ctx
                && src.is_none_or(|w| r == w as usize)
                && tag_matches(want_tag, s.tag.load(Ordering::Relaxed))
        });
        Ok(hit.map(|sr| {
            let (r, i) = sref_parts(sr);
            let s = self.seg.slot(r, i);
            TaggedStatus {
                source: r as Rank,
                tag: s.tag.load(Ordering::Relaxed) as i32,
                bytes: s.len.load(Ordering::Relaxed) as usize,
            }
        }))
    }

    fn tagged_cancel(&mut self, token: Token) -> Result<bool> {
        // Still waiting for a slot: just forget it.
        if let Some(k) = self
            .deferred_recvs
            .iter()
            .position(|d| matches!(d, Deferred::Recv { token: t, .. } if *t == token))
        {
            self.deferred_recvs.remove(k);
            return Ok(true);
        }
        let Some(k) = self
            .out
            .iter()
            .position(|o| o.token == Some(token) && o.kind == RECV)
        else {
            return Ok(false);
        };
        let slot = self.out[k].slot;
        let me = self.me;
        let _g = lock_area(&self.seg, &self.watch, me, me);
        let target = sref(me, slot);
        let mut removed = false;
        // Only a receive still in the posted queue can be cancelled; a claimed one completes.
        if self.seg.slot(me, slot).state.load(Ordering::Relaxed) == POSTED {
            let mine = self.seg.slot(me, slot);
            removed = self
                .seg
                .take_first(me, Q::Posted, |s| std::ptr::eq(s, mine))
                .is_some_and(|r| r == target);
        }
        if removed {
            self.seg.slot(me, slot).state.store(FREE, Ordering::Relaxed);
            self.out.swap_remove(k);
            self.free.push(slot);
        }
        Ok(removed)
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        let key = (1 << 62) | self.next_key;
        self.next_key += 1;
        self.register(base, len, access, key, false)
    }

    unsafe fn mr_register_keyed(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
    ) -> Result<MemRegion> {
        if key == 0 || key & (1 << 62) != 0 {
            return Err(Error::invalid(format!("limic: key {key} is reserved")));
        }
        self.register(base, len, access, key, true)
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        let area = self.seg.area(self.me);
        if let Some(reg) = area.regions.get(mr.handle as usize) {
            if reg.key.load(Ordering::Relaxed) == mr.key {
                reg.key.store(0, Ordering::SeqCst);
            }
        }
        // A peer that looked the region up before the key went may still be copying: wait
        // until no live peer announces an access to this rank's regions. (Each side stores,
        // then loads the other's word, sequentially consistent: one of them sees the other.)
        let mine = self.me as u64 + 1;
        for r in 0..self.size as usize {
            if r == self.me {
                continue;
            }
            let word = &self.seg.area(r).rma_access.v;
            let mut spins = 0u32;
            while word.load(Ordering::SeqCst) == mine {
                spins += 1;
                if spins % 256 == 0 && self.watch.gone(r, &self.seg.area(r).live).is_some() {
                    break;
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.one_sided(src, Dir::Pull, &ranges_of_mut(local), remote, done)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.one_sided(dest, Dir::Push, &ranges_of(local), remote, done)
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        Ok(self.done.open())
    }

    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        self.done.read(cntr)
    }

    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        self.done.close(cntr)
    }
}

impl StaticProvider for Limic {
    const NAME: &'static str = "limic";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        if ctx.in_process {
            return Err("ranks are threads of one process; limic joins processes".into());
        }
        if ctx.hosts > 1 {
            return Err(format!(
                "the job spans {} hosts; cross-memory attach reaches only one host",
                ctx.hosts
            ));
        }
        if let Ok(v) = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
            if v.trim() == "3" {
                return Err("Yama ptrace_scope is 3: cross-memory attach is disabled".into());
            }
        }
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, &Config::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        Config::from_env()?;
        let mut c = caps();
        c.eager_limit = AM_PAYLOAD;
        Ok(c)
    }
}

weft_provider::register_provider!(
    Limic,
    priority = 40,
    summary = "kernel-assisted single copy within a host (LiMIC on cross-memory attach)"
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::Mutex;
    use std::time::Duration;

    /// A pause between a one-sided operation's region lookup and its copy, for the test below.
    static PAUSE: Mutex<Option<(Sender<()>, Receiver<()>)>> = Mutex::new(None);

    pub(super) fn after_lookup() {
        let pause = PAUSE.lock().unwrap().take();
        if let Some((arrived, go)) = pause {
            arrived.send(()).unwrap();
            go.recv_timeout(Duration::from_secs(30)).unwrap();
        }
    }

    /// Two limic ranks as threads of this process (cross-memory attach to our own pid works).
    fn pair() -> (Limic, Limic) {
        let job = weft_provider::bootstrap::InProcessJob::new(2, Duration::from_secs(30));
        let cfg = Config::from_env().unwrap();
        let (b0, b1) = (job.rank(0), job.rank(1));
        let c2 = cfg.clone();
        let h = std::thread::spawn(move || {
            let mut b1 = b1;
            Limic::open_with(&mut b1, &c2).unwrap()
        });
        let mut b0 = b0;
        let l0 = Limic::open_with(&mut b0, &cfg).unwrap();
        (l0, h.join().unwrap())
    }

    /// Deregistration waits for a peer's copy that looked the region up before the key went:
    /// the memory may be freed as soon as `mr_deregister` returns. (Before, it returned at
    /// once and the copy landed after.)
    #[test]
    fn deregistration_waits_for_a_copy_in_flight() {
        let (mut l0, mut l1) = pair();
        let mut target = vec![0u8; 4096];
        // SAFETY: `target` outlives the registration (deregistered below, before it drops).
        let mr = unsafe { l0.mr_register(target.as_mut_ptr(), 4096, Access::ALL) }.unwrap();
        let (arrived_tx, arrived_rx) = channel();
        let (go_tx, go_rx) = channel();
        *PAUSE.lock().unwrap() = Some((arrived_tx, go_rx));
        let src = [0x5Au8; 64];
        let writer = std::thread::spawn(move || {
            let local = [RawIov {
                desc: 0,
                ptr: src.as_ptr(),
                len: src.len(),
            }];
            let ra = RemoteAddr {
                addr: mr.addr,
                key: mr.key,
            };
            // SAFETY: `src` lives until the call returns (the copy is synchronous).
            let r = unsafe { l1.rma_write(0, &local, ra, Completion::default()) };
            (l1, r)
        });
        arrived_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        // The writer has the region and is about to copy: deregistering must wait for it.
        let (done_tx, done_rx) = channel();
        let dereg = std::thread::spawn(move || {
            l0.mr_deregister(&mr).unwrap();
            done_tx.send(()).unwrap();
            l0
        });
        assert!(
            done_rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "deregistration returned while a peer's copy into the region was pending"
        );
        go_tx.send(()).unwrap();
        let (_l1, r) = writer.join().unwrap();
        r.unwrap();
        done_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        let _l0 = dereg.join().unwrap();
        assert!(target[..64].iter().all(|&b| b == 0x5A));
    }

    struct Done(Vec<(Token, Result<Completed>)>);
    impl Sink for Done {
        fn am(&mut self, _: Rank, _: &[u8], _: &[u8]) {}
        fn complete(&mut self, t: Token, r: Result<Completed>) {
            self.0.push((t, r));
        }
        fn peer_failed(&mut self, _: Rank, _: &str) {}
    }

    /// Where this process's own copies land is decided by this process alone: a peer that
    /// rewrites the iovec of our posted receive in the shared slot cannot steer our pull into
    /// other memory of ours. (Before, the pull read the iovec back from the slot.)
    #[test]
    fn a_scribbled_slot_cannot_steer_our_writes() {
        let (mut l0, mut l1) = pair();
        assert!(
            l0.pull,
            "the test needs the receiver-pull protocol (WEFT_LIMIC_PULL=1)"
        );
        let len = 16 << 10; // above the inline limit: a cross-memory copy
        let mut mine = vec![0u8; len];
        let mut other = vec![0u8; len];
        let buf = [RawIovMut {
            desc: 0,
            ptr: mine.as_mut_ptr(),
            len,
        }];
        // SAFETY: `mine` outlives the receive (completed below).
        unsafe { l0.tagged_recv(Some(1), 0, Some(5), &buf, 77) }.unwrap();
        // A peer scribbles: the posted receive now "points" at `other`.
        let slot = l0.out[0].slot;
        l0.seg.slot(0, slot).iov[0][0].store(other.as_mut_ptr() as u64, Ordering::Relaxed);
        let data = vec![0xC3u8; len];
        let piece = [RawIov {
            desc: 0,
            ptr: data.as_ptr(),
            len,
        }];
        // SAFETY: `data` outlives the send (completed below).
        unsafe { l1.tagged_send(0, 0, 5, &piece, false, 88) }.unwrap();
        let mut done = Done(vec![]);
        let t0 = std::time::Instant::now();
        while !done.0.iter().any(|(t, _)| *t == 77) {
            l0.progress(&mut done).unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the receive never completed"
            );
        }
        let mut sent = Done(vec![]);
        while !sent.0.iter().any(|(t, _)| *t == 88) {
            l1.progress(&mut sent).unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the send never completed"
            );
        }
        assert!(
            mine.iter().all(|&b| b == 0xC3),
            "the data did not reach our buffer"
        );
        assert!(
            other.iter().all(|&b| b == 0),
            "our pull was steered into other memory"
        );
    }
}

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
//! cores, which lowers 64 KiB latency by about a third (measured: docs/history/
//! benchmarks-notebook.md, "Measurements behind code decisions"). `WEFT_LIMIC_PULL=0`
//! restores the literal push.
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

mod contract;
mod copy;
mod p2p;
mod rma;
mod seg;

use copy::*;
use rma::*;

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

    // ------------------------------------------------------------------------ descriptors

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

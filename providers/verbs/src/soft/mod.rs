// Over 800 lines: the soft HCA's state (objects, segment bookkeeping, the engine thread) that `verbs`, `exec`, `wire` and `service` share.
//! The soft HCA: a user-space emulation of an InfiniBand HCA, faithful in what providers can
//! observe (key, range and rights checks; reliable in-order RC with RNR and transport retries;
//! unreliable UD with a GRH; last byte last; HCA-level atomics executed once; flushing on
//! error), for machines without InfiniBand.
//!
//! Between processes of one host the requester does the responder's work itself, in the
//! peer's shared segment (`exec`): the target process takes no part, as with a real HCA.
//! Peers on other hosts (another network namespace counts as another host) are reached over
//! UDP (`wire`): each HCA's service thread runs the same responder for them.
//! The requester runs inside `post_send`, `poll_cq` and `progress` of the initiating process;
//! a request waiting for an RNR or transport retry timer moves on at the next such call.
//!
//! Size: the object tables and the verbs calls are one state machine under one lock; the
//! data path is in `exec`, the layout in `seg`, the models in `model`.

pub(crate) mod exec;
pub mod model;
pub(crate) mod ring;
pub(crate) mod seg;
pub mod service;
pub mod wire;

use crate::hca::{Accounting, Counters, Hca};
use crate::types::*;
use exec::{Outcome, Peer, Request};
use model::{Config, Rng, Timing};
use seg::{Layout, Seg, CQE_WORDS, MAX_SGE, WQE_WORDS};
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use weft_cma::Range;
use weft_provider::{Error, Result};

use weft_provider::cma as weft_cma;

const SC: Ordering = Ordering::SeqCst;
const RLX: Ordering = Ordering::Relaxed;

fn inval(what: impl Into<String>) -> Error {
    Error::invalid(what.into())
}

fn exhausted(what: &str) -> Error {
    Error::invalid(format!(
        "soft HCA: no {what} left (raise WEFT_VERBS_SOFT_*)"
    ))
}

/// First-fit allocator of the segment's heap (owner only).
#[derive(Debug)]
struct Heap {
    free: Vec<(u64, u64)>,
}

impl Heap {
    fn new(len: u64) -> Heap {
        Heap {
            free: vec![(0, len)],
        }
    }

    fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        let len = len.max(1).div_ceil(128) * 128;
        for i in 0..self.free.len() {
            let (o, l) = self.free[i];
            let a = o.div_ceil(align) * align;
            if a + len <= o + l {
                self.free.remove(i);
                if a > o {
                    self.free.push((o, a - o));
                }
                if a + len < o + l {
                    self.free.push((a + len, o + l - a - len));
                }
                self.free.sort_unstable();
                return Some(a);
            }
        }
        None
    }

    fn free(&mut self, off: u64, len: u64) {
        let len = len.max(1).div_ceil(128) * 128;
        self.free.push((off, len));
        self.free.sort_unstable();
        let mut m: Vec<(u64, u64)> = Vec::with_capacity(self.free.len());
        for (o, l) in self.free.drain(..) {
            match m.last_mut() {
                Some(last) if last.0 + last.1 == o => last.1 += l,
                _ => m.push((o, l)),
            }
        }
        self.free = m;
    }
}

struct MrLocal {
    key: u32,
    pd: u32,
    access: Access,
    addr: u64,
    len: usize,
    dm: Option<u32>,
}

struct CqLocal {
    cap: u32,
    off: u64,
    asked: u32,
    /// The ring position last found held up by a claim, and since when (`Core::settle`).
    stall: Option<(u64, Instant)>,
}

struct SrqLocal {
    pd: u32,
    cap: u32,
    off: u64,
    max_sge: u32,
    asked: u32,
    /// Buffer bytes posted (what is still posted: this less the segment's `taken`).
    posted: u64,
    stall: Option<(u64, Instant)>,
}

struct Pending {
    wr: SendWr,
    data: Option<Vec<u8>>,
    psn: u32,
    due: Option<Instant>,
    /// Fault injection: the ACK of the first execution was lost; the retry is a duplicate.
    acked_lost: bool,
    counted: bool,
}

/// Where a QP or address handle sends: a process of this host, whose segment we map, or the
/// wire service of an HCA on another host.
pub(crate) enum Target {
    Local(Peer),
    Remote(std::net::SocketAddrV4),
}

impl Target {
    fn responsive(&self, now_check: bool) -> bool {
        match self {
            Target::Local(p) => p.responsive(now_check),
            // Only the absence of answers tells (the requester's timeout).
            Target::Remote(_) => true,
        }
    }
}

struct Held {
    peer: Arc<Target>,
    dest_qpn: u32,
    qkey: u32,
    op: WrOpcode,
    imm: u32,
    data: Vec<u8>,
    since: Instant,
}

impl Held {
    /// The held datagram's bytes as a local range (valid while `self` lives).
    fn ranges(&self) -> [Range; 1] {
        [Range {
            base: self.data.as_ptr() as u64,
            len: self.data.len(),
        }]
    }
}

/// Datagrams collected for one process during a `drive`, delivered together.
#[derive(Default)]
struct UdBatch {
    peer: Option<Arc<Target>>,
    dest_qpn: u32,
    qkey: u32,
    items: Vec<UdItem>,
}

struct UdItem {
    op: WrOpcode,
    imm: u32,
    /// The payload: our validated memory (or the inline copy of a request that completes
    /// only after the batch is delivered).
    local: SmallVec<[Range; 4]>,
    len: usize,
    grh: [u8; GRH_LEN],
}

struct QpLocal {
    qpn: u32,
    ty: QpType,
    pd: u32,
    send_cq: u32,
    recv_cq: u32,
    srq: Option<u32>,
    cap: QpCap,
    sig_all: bool,
    state: QpState,
    mtu: Mtu,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    sq_psn: u32,
    dest: Option<(Arc<Target>, u32, Gid)>,
    rq_off: u64,
    rq_cap: u32,
    /// Buffer bytes posted to the receive queue since it was made or reset (what is still
    /// posted: this less the segment's `rq_taken`).
    rq_posted: u64,
    sq: VecDeque<Pending>,
    wait_until: Option<Instant>,
    rnr_tries: u8,
    retries: u8,
    held: Option<Held>,
    /// The request at the head of the send queue while it is under way to another host.
    ex: Option<Box<InFlight>>,
    /// The receive queue's position last found held up by a claim (`Core::settle`).
    rq_stall: Option<(u64, Instant)>,
}

/// A request under way to another host, and whether fault injection lost its
/// acknowledgement; counted in [`SoftHca`]'s `remote` for as long as it lives (whatever ends
/// it: an answer, a timeout, an error state, a reset or the QP's destruction).
struct InFlight {
    ex: wire::Exchange,
    lost: bool,
    live: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.live.fetch_sub(1, RLX);
    }
}

#[derive(Default)]
struct Inner {
    pds: Vec<u32>,
    next_pd: u32,
    mrs: Table<MrLocal>,
    mr_gen: Vec<u16>,
    qps: Table<Box<QpLocal>>,
    qp_gen: Vec<u8>,
    cqs: Table<CqLocal>,
    srqs: Table<SrqLocal>,
    ahs: Table<(Arc<Target>, AhAttr)>,
    dms: Table<(u64, usize)>,
    heap: Option<Heap>,
    peers: HashMap<Gid, Arc<Target>>,
    acct: Accounting,
    ctr: Counters,
    rng: Option<Rng>,
    timing: Option<Timing>,
    /// Reused by `drive` (no allocation per call).
    batch: UdBatch,
    served: u64,
    /// Rings of destroyed CQs, `(off, cap)`: only ever reused as a CQ's ring of the same
    /// capacity (see `SoftHca::cq_at`).
    spare_cqs: Vec<(u64, u32)>,
}

/// How often the engine thread drives due requests (with the timing model; with requests to
/// other hosts under way it wakes at once when an answer arrives).
pub const ENGINE_TICK: Duration = Duration::from_millis(1);

/// One process's soft HCA: a handle on its [`Core`], which its engine thread may share.
pub struct SoftHca(Arc<Core>);

impl std::ops::Deref for SoftHca {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.0
    }
}

/// The HCA's state, shared by the handle and the engine thread (which holds it only weakly,
/// so the HCA ends with its last handle).
pub struct Core {
    inner: Mutex<Inner>,
    /// Some QP may have work in its send queue (a request queued, a datagram held back): set
    /// with the lock held whenever that happens, cleared by `progress_all` when none is left.
    /// While it is clear, `poll_cq` of a CQ with nothing ready needs no lock.
    sq_work: std::sync::atomic::AtomicBool,
    /// Per CQ index, where its ring is, for `poll_cq`'s look without the lock: `off << 8 |
    /// (log2(cap) + 1)`, 0 for none. Written with the lock held. A look through a stale value
    /// (the CQ destroyed meanwhile, by another thread) still reads ring sequence words only:
    /// a destroyed CQ's ring is kept for CQs of the same capacity (`Inner::spare_cqs`), never
    /// given back to the heap for other uses.
    cq_at: Box<[std::sync::atomic::AtomicU64]>,
    /// Dropped before the segment: the service thread maps it.
    wire: wire::Wire,
    /// Requests under way to other hosts ([`InFlight`]): while there are none, the
    /// requester does not look at the wire.
    remote: Arc<std::sync::atomic::AtomicUsize>,
    seg: Seg,
    attr: DeviceAttr,
    cfg: Config,
    host: u16,
    me: std::sync::Weak<Core>,
    /// The engine thread, once started ([`Core::start_engine`]).
    engine: std::sync::OnceLock<std::thread::Thread>,
}

/// An object table (QPs, CQs, MRs...): entries by index, the lowest free one handed out before
/// the table grows. It reads as its `Vec` of entries; [`Table::slot`] and [`Table::free`] keep
/// where the search for a free entry starts, so that making thousands of QPs or address handles
/// in a row does not look at the taken ones again each time (it did: the 16K-peer synthetic run
/// spent two thirds of its time there).
struct Table<T> {
    v: Vec<Option<T>>,
    /// No entry below it is free: every [`Table::free`] lowers it, and [`Table::slot`] stops at
    /// the entry it hands out, so one whose creation failed is handed out again. An entry
    /// emptied without `free` is still found, once the table is full.
    from: usize,
    /// Entries never handed out again ([`Table::retire`]); almost always empty.
    retired: std::collections::BTreeSet<usize>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            v: Vec::new(),
            from: 0,
            retired: Default::default(),
        }
    }
}

impl<T> std::ops::Deref for Table<T> {
    type Target = Vec<Option<T>>;
    fn deref(&self) -> &Self::Target {
        &self.v
    }
}

impl<T> std::ops::DerefMut for Table<T> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.v
    }
}

impl<T> Table<T> {
    /// The lowest free entry, or a new one while the table has fewer than `max`.
    fn slot(&mut self, max: usize) -> Option<usize> {
        let start = self.from.min(self.v.len());
        let free = |(k, e): (usize, &Option<T>)| e.is_none() && !self.retired.contains(&k);
        let i = match self.v.iter().enumerate().skip(start).position(free) {
            Some(k) => start + k,
            None if self.v.len() < max => {
                self.v.push(None);
                self.v.len() - 1
            }
            // Full from `from` on: a free entry below it would be one emptied without `free`.
            None => self.v.iter().enumerate().position(free)?,
        };
        self.from = i;
        Some(i)
    }

    /// Take entry `i` out for good: it is never handed out again (its generations are used
    /// up, so a new key for it could equal one a peer still holds).
    fn retire(&mut self, i: usize) -> Option<T> {
        let t = self.v.get_mut(i)?.take();
        self.retired.insert(i);
        t
    }

    /// Take entry `i` out, freeing it.
    fn free(&mut self, i: usize) -> Option<T> {
        let t = self.v.get_mut(i)?.take();
        if t.is_some() {
            self.from = self.from.min(i);
        }
        t
    }
}

impl SoftHca {
    /// Open with the configuration of the environment (`WEFT_VERBS_SOFT_*`).
    pub fn open() -> Result<SoftHca> {
        SoftHca::with_config(Config::from_env()?)
    }

    /// Open as [`SoftHca::open`], shared. With the timing model on, requests wait until their
    /// modelled arrival time, and only a call into this HCA executes them; a process that
    /// posted and then waits on something else (a barrier over another provider, its peer's
    /// write into memory) would keep them back forever, which hardware never does. So a
    /// background thread, like an HCA's own engine, drives due requests every
    /// [`ENGINE_TICK`] for as long as the HCA lives. It does so too when the wire to other
    /// hosts is on: a request to another host moves on only when the requester runs, and a
    /// real HCA's requester runs without being called.
    pub fn open_shared() -> Result<Arc<SoftHca>> {
        let h = Arc::new(SoftHca::open()?);
        if h.cfg.timing() {
            h.start_engine()?;
        }
        Ok(h)
    }

    /// The state of QP `qp` as its entry in the segment says (a peer may have moved it to the
    /// error state) and, if a peer's refused request did that, the status the request got
    /// (`RemAccessErr`, `RemInvReqErr`, `RemOpErr`). Takes no lock: what the notifier of
    /// `export/ibverbs` watches to raise the asynchronous events a hardware HCA would.
    pub fn qp_watch(&self, qp: Qp) -> Option<(QpState, Option<WcStatus>)> {
        let e = self.seg.qp(qp.handle as usize)?;
        if e.qpn.load(SC) != qp.qpn {
            return None;
        }
        let st = QpState::from_u32(e.state.load(SC))?;
        Some((
            st,
            WcStatus::from_u32(e.fault.load(SC)).filter(|&w| w != WcStatus::Success),
        ))
    }

    /// Whether more completions came for `cq` than it has entries (what `poll_cq` then
    /// refuses with, and a hardware HCA raises `IBV_EVENT_CQ_ERR` for).
    pub fn cq_overrun(&self, cq: Cq) -> bool {
        self.seg
            .cq(cq.0 as usize)
            .is_some_and(|e| e.overrun.load(SC) != 0)
    }

    /// Whether `cq` holds a completion (or is overrun) that [`Hca::poll_cq`] would report;
    /// consumes nothing. What a completion channel's notifier watches (`export/ibverbs`).
    pub fn cq_ready(&self, cq: Cq) -> bool {
        let Some(at) = self
            .cq_at
            .get(cq.0 as usize)
            .map(|a| a.load(Ordering::Acquire))
        else {
            return false;
        };
        if at == 0 {
            return false;
        }
        let (off, cap) = (at >> 8, 1u32 << ((at & 0xff) - 1));
        self.seg
            .cq(cq.0 as usize)
            .is_some_and(|e| e.overrun.load(SC) != 0)
            || self
                .seg
                .ring::<CQE_WORDS>(off, cap)
                .is_some_and(|r| r.ready() || !r.is_empty())
    }

    pub fn with_config(cfg: Config) -> Result<SoftHca> {
        let lay = Layout::new(
            cfg.max_peers,
            cfg.max_mr,
            cfg.max_qp,
            cfg.max_cq,
            cfg.max_srq,
            cfg.heap,
        );
        let bound = wire::bind(&cfg.addr)?;
        let net = bound.net;
        let seg = Seg::create(lay, net)?;
        let wire = wire::Wire::start(bound, seg.gid())?;
        let attr = DeviceAttr {
            name: "soft".into(),
            kind: "soft",
            max_qp: cfg.max_qp,
            max_qp_wr: 16_384,
            max_sge: MAX_SGE as u32,
            max_cq: cfg.max_cq,
            max_cqe: 1 << 20,
            max_mr: cfg.max_mr,
            max_mr_size: 1 << 40,
            max_pd: 1 << 16,
            max_srq: cfg.max_srq,
            max_srq_wr: 16_384,
            max_qp_rd_atom: 16,
            max_inline_data: 1024,
            atomic_cap: AtomicCap::Hca,
            active_mtu: cfg.mtu,
            max_dm_size: seg.lay.heap_len as u64,
        };
        let inner = Inner {
            heap: Some(Heap::new(seg.lay.heap_len as u64)),
            rng: Some(Rng::new(cfg.seed)),
            timing: cfg.timing().then(Timing::new),
            next_pd: 1,
            ..Inner::default()
        };
        Ok(SoftHca(Arc::new_cyclic(|me| Core {
            inner: Mutex::new(inner),
            sq_work: std::sync::atomic::AtomicBool::new(false),
            cq_at: (0..cfg.max_cq)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            wire,
            remote: Arc::default(),
            seg,
            attr,
            cfg,
            host: net.host,
            me: me.clone(),
            engine: std::sync::OnceLock::new(),
        })))
    }
}

impl Core {
    /// Start the engine thread (once): like an HCA's own engine, it drives requests without
    /// being called — due requests of the timing model every [`ENGINE_TICK`], and requests
    /// under way to other hosts as their answers arrive — and sleeps while there are none.
    fn start_engine(&self) -> Result<()> {
        if let Some(t) = self.engine.get() {
            t.unpark();
            return Ok(());
        }
        let me = self.me.clone();
        let t = std::thread::Builder::new()
            .name("weft-soft-hca".into())
            .spawn(move || engine(me))
            .map_err(|e| Error::io("soft HCA: starting its engine thread", e))?;
        let _ = self.engine.set(t.thread().clone());
        Ok(())
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Fault injection: stop (or resume) answering peers, as a hung node would.
    pub fn set_mute(&self, mute: bool) {
        self.seg.header().mute.store(mute as u32, SC);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How this context reaches other hosts: the UDP address of its wire service (`None` with
    /// `WEFT_VERBS_SOFT_ADDR=off`).
    pub fn wire_addr(&self) -> Option<std::net::SocketAddrV4> {
        seg::gid_net(&self.seg.gid()).addr
    }

    fn peer(&self, inner: &mut Inner, gid: &Gid) -> Result<Arc<Target>> {
        if let Some(p) = inner.peers.get(gid) {
            return Ok(p.clone());
        }
        let net = seg::gid_net(gid);
        let p =
            Arc::new(if net.host == self.host {
                Target::Local({
                    let mut p = Peer::attach(gid)?;
                    p.fence = self.cfg.fence;
                    p
                })
            } else {
                match (net.addr, self.wire_addr()) {
                    (Some(a), Some(_)) => Target::Remote(a),
                    (None, _) => {
                        return Err(inval(
                            "soft HCA: the peer is on another host and its HCA takes no requests \
                         from other hosts (WEFT_VERBS_SOFT_ADDR=off there, or not a soft-HCA GID)",
                        ))
                    }
                    (_, None) => return Err(inval(
                        "soft HCA: the peer is on another host and WEFT_VERBS_SOFT_ADDR=off here",
                    )),
                }
            });
        inner.peers.insert(*gid, p.clone());
        Ok(p)
    }

    /// Wait until no live attached process holds hazard `tag` in our segment. A copy under
    /// way ends within microseconds, so the common case returns at once with the lock held;
    /// otherwise the lock is let go while waiting (the object is already withdrawn: nothing
    /// new reaches it) and taken again. A holder that is still there after the fence time
    /// (stopped, in a debugger, hung) is fenced out ([`exec::fence_out`]).
    fn wait_unused<'a>(&'a self, g: MutexGuard<'a, Inner>, tag: u64) -> MutexGuard<'a, Inner> {
        if self.holder(|h| h == tag).is_none() {
            return g;
        }
        drop(g);
        let t0 = Instant::now();
        let mut fenced = false;
        while let Some(pid) = self.holder(|h| h == tag) {
            if t0.elapsed() < Duration::from_micros(50) {
                std::hint::spin_loop();
                continue;
            }
            if !fenced && self.cfg.fence.is_some_and(|f| t0.elapsed() > f) {
                exec::fence_out(
                    pid,
                    "holds a queue or memory region this HCA is taking down",
                );
                fenced = true;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        self.lock()
    }

    /// A live attached process (its pid) with a hazard word `is` takes, if any.
    fn holder(&self, is: impl Fn(u64) -> bool) -> Option<u32> {
        let me = std::process::id() as u64;
        (0..self.seg.attached()).find_map(|i| {
            let s = self.seg.attach_slot(i);
            let pid = s.pid.load(SC);
            let holds = pid != 0 && s.hz.iter().any(|h| is(h.load(SC)));
            // A dead process holds nothing (it never finishes its access, nor starts one).
            (holds && (pid == me || !weft_provider::shmem::pid_gone(pid as i32)))
                .then_some(pid as u32)
        })
    }

    /// A ring position held up by a claim (`tag`, see [`ring::claim_tag`]): once seen twice
    /// in a row, finish it for a dead claimer (`finish`, which checks again that it is still
    /// held up), or fence out a live one holding it past the fence time. `true` once
    /// finished. `stall` is the object's record of the position it last found held up.
    fn settle(
        &self,
        stall: &mut Option<(u64, Instant)>,
        tag: u64,
        finish: impl FnOnce() -> bool,
    ) -> bool {
        let since = match *stall {
            Some((t, since)) if t == tag => since,
            _ => {
                *stall = Some((tag, Instant::now()));
                return false;
            }
        };
        match self.holder(|h| h == tag) {
            None => {
                *stall = None;
                finish()
            }
            Some(pid) => {
                if self.cfg.fence.is_some_and(|f| since.elapsed() > f) {
                    exec::fence_out(pid, "claimed a slot of this HCA's queue and never finished");
                    *stall = Some((tag, Instant::now()));
                }
                false
            }
        }
    }

    fn push_own(&self, cq: u32, wc: &Wc) {
        if let Some(e) = self.seg.cq(cq as usize) {
            let ok = self
                .seg
                .ring::<CQE_WORDS>(e.off.load(RLX), e.cap.load(RLX))
                .is_some_and(|r| r.push(&seg::cqe_record(wc)));
            if !ok {
                e.overrun.store(1, SC);
            }
        }
    }

    fn qp_mut(inner: &mut Inner, qp: Qp) -> Result<&mut QpLocal> {
        inner
            .qps
            .get_mut(qp.handle as usize)
            .and_then(|q| q.as_deref_mut())
            .filter(|q| q.qpn == qp.qpn)
            .ok_or_else(|| inval(format!("no QP {:#x}", qp.qpn)))
    }

    /// Pick up an error state a peer set on our QP (remote access or length error): flush.
    fn sync_state(&self, q: &mut QpLocal) {
        if q.state != QpState::Err {
            if let Some(e) = self.seg.qp((q.qpn & 0xffff) as usize) {
                if e.state.load(SC) == QpState::Err as u32 {
                    self.to_error(q);
                }
            }
        }
    }

    fn to_error(&self, q: &mut QpLocal) {
        q.state = QpState::Err;
        let qi = (q.qpn & 0xffff) as usize;
        if let Some(e) = self.seg.qp(qi) {
            e.state.store(QpState::Err as u32, SC);
        }
        while let Some(p) = q.sq.pop_front() {
            self.push_own(q.send_cq, &flush_wc(&p.wr, q.qpn));
        }
        q.held = None;
        q.ex = None;
        exec::flush_rq(&self.seg, qi, None, |cq, wc| self.push_own(cq, wc));
    }

    /// Local SGEs as ranges of this process, checked against our registrations.
    fn local(inner: &Inner, sg: &[Sge], need: Access) -> Option<SmallVec<[Range; 4]>> {
        let mut v = SmallVec::new();
        for s in sg {
            if s.length == 0 {
                continue;
            }
            let m = inner.mrs.get((s.lkey & 0xffff) as usize)?.as_ref()?;
            let end = s.addr.checked_add(s.length as u64)?;
            if m.key != s.lkey
                || !m.access.contains(need)
                || s.addr < m.addr
                || end > m.addr + m.len as u64
            {
                return None;
            }
            v.push(Range {
                base: s.addr,
                len: s.length as usize,
            });
        }
        Some(v)
    }

    fn complete(&self, q: &QpLocal, p: &Pending, status: WcStatus, byte_len: u32) {
        if status != WcStatus::Success || p.wr.signaled || q.sig_all {
            self.push_own(
                q.send_cq,
                &Wc {
                    wr_id: p.wr.wr_id,
                    status,
                    opcode: p.wr.opcode.wc(),
                    byte_len,
                    imm: None,
                    qp_num: q.qpn,
                    src_qp: 0,
                    grh: false,
                },
            );
        }
    }

    /// Run QP `qi`'s send queue as far as it goes now.
    fn drive(&self, inner: &mut Inner, qi: usize) {
        self.pump_wire(inner);
        let Some(mut q) = inner.qps.get_mut(qi).and_then(|q| q.take()) else {
            return;
        };
        self.sync_state(&mut q);
        if let Some(t) = inner.timing.as_mut() {
            // Stamp new requests with their arrival time now, as they are posted, so that
            // the latencies of a window of requests overlap (the link serialises only their
            // bytes).
            for p in q.sq.iter_mut().filter(|p| p.due.is_none()) {
                // The cache holds this QP's context: a UD QP reaches every destination with
                // the one context (the address travels in the work request), which is why
                // UD-SR stays in the cache where many RC QPs thrash it (paper 001).
                let (mut due, miss) = t.due(&self.cfg, u64::from(q.qpn), p.wr.len());
                // A read or an atomic is a round trip: its answer crosses the link back.
                if matches!(
                    p.wr.opcode,
                    WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd
                ) {
                    due += self.cfg.latency;
                }
                inner.ctr.qp_cache_misses += miss as u64;
                p.due = Some(due);
            }
        }
        if let Some(h) = &q.held {
            if h.since.elapsed() > Duration::from_millis(1) {
                let h = q.held.take();
                if let Some(h) = h {
                    let l = h.ranges();
                    self.deliver_ud(inner, &q, &h.peer, h.dest_qpn, h.qkey, h.op, h.imm, &l);
                }
            }
        }
        // UD datagrams to one process go out in batches (one copy for many); their sends
        // complete only once the batch is delivered, in order.
        let mut batch = std::mem::take(&mut inner.batch);
        let mut deferred: Vec<(Pending, WcStatus, u32)> = Vec::new();
        while q.state == QpState::Rts {
            let Some(mut p) = q.sq.pop_front() else { break };
            match self.step(inner, qi, &mut q, &mut p, &mut batch) {
                Some((st, len)) => {
                    q.rnr_tries = 0;
                    q.retries = 0;
                    q.wait_until = None;
                    q.ex = None;
                    if !deferred.is_empty() || !batch.items.is_empty() {
                        deferred.push((p, st, len));
                        continue;
                    }
                    self.complete(&q, &p, st, len);
                    if st != WcStatus::Success && q.ty == QpType::Rc {
                        self.to_error(&mut q);
                    }
                }
                None => {
                    q.sq.push_front(p);
                    break;
                }
            }
        }
        self.flush_ud(inner, &q, &mut batch);
        for (p, st, len) in deferred {
            self.complete(&q, &p, st, len);
        }
        inner.batch = batch;
        inner.qps[qi] = Some(q);
    }

    /// One attempt at the request at the head of the send queue: its completion status and
    /// length, or `None` to wait (a timer, or the timing model).
    fn step(
        &self,
        inner: &mut Inner,
        qi: usize,
        q: &mut QpLocal,
        p: &mut Pending,
        batch: &mut UdBatch,
    ) -> Option<(WcStatus, u32)> {
        // The clock is read only when a timer or the timing model needs it.
        if q.wait_until.is_some_and(|t| Instant::now() < t) {
            return None;
        }
        let len = p.wr.len();
        // Timing model: not before the time `drive` stamped on it when it was posted.
        if p.due.is_some_and(|d| Instant::now() < d) {
            return None;
        }
        // Local checks: the HCA reads the payload (or writes the result) through our keys.
        let need = match p.wr.opcode {
            WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                Access::LOCAL_WRITE
            }
            _ => Access(0),
        };
        let local: SmallVec<[Range; 4]> = match &p.data {
            Some(d) => smallvec::smallvec![Range {
                base: d.as_ptr() as u64,
                len: d.len(),
            }],
            None => match Self::local(inner, &p.wr.sg_list, need) {
                Some(v) => v,
                None => return Some((WcStatus::LocProtErr, 0)),
            },
        };
        if !p.counted {
            p.counted = true;
            let i = WR_OPCODES
                .iter()
                .position(|o| *o == p.wr.opcode)
                .unwrap_or(0);
            inner.ctr.ops[i] += 1;
            inner.ctr.payload_bytes += len as u64;
            let (pk, b) = model::wire(p.wr.opcode, len, q.mtu.bytes(), q.ty == QpType::Ud);
            inner.ctr.packets += pk;
            inner.ctr.wire_bytes += b;
        }
        if q.ty == QpType::Ud {
            return Some(self.step_ud(inner, q, p, &local, batch));
        }
        let (peer, dest_qpn, _) = q.dest.clone()?;
        let mut waited = false;
        let (out, lost, request_lost) = if let Some(f) = q.ex.as_mut() {
            // Under way to another host: the outcome once the answers (or the timeout) tell.
            let o = f.ex.poll(Instant::now())?;
            let f = q.ex.take()?;
            waited = true;
            let o = Self::finish_remote(&f.ex, o, p.wr.opcode, p.wr.len(), &local);
            (o, f.lost, false)
        } else {
            let rng = inner.rng.as_mut();
            let lost = rng.is_some_and(|r| r.chance(self.cfg.rc_loss));
            let request_lost =
                lost && !p.acked_lost && inner.rng.as_mut().is_some_and(|r| r.chance(0.5));
            let out = if request_lost || !peer.responsive(q.retries > 0) {
                Outcome::NoResponse
            } else {
                let req = Request {
                    op: p.wr.opcode,
                    src_qpn: q.qpn,
                    src_gid: self.seg.gid(),
                    dest_qpn,
                    psn: p.psn,
                    local: &local,
                    remote_addr: p.wr.remote_addr,
                    rkey: p.wr.rkey,
                    imm: p.wr.imm,
                    compare_add: p.wr.compare_add,
                    swap: p.wr.swap,
                    len,
                    qkey: 0,
                    grh: None,
                };
                match &*peer {
                    Target::Local(peer) => exec::rc(peer, &req),
                    Target::Remote(to) => {
                        match self.start_remote(qi, *to, &req, wire::wait_for(q.timeout)) {
                            Ok(ex) => {
                                if self.remote.fetch_add(1, RLX) == 0 {
                                    // Best effort: without it the requester still runs in
                                    // every call into the HCA.
                                    let _ = self.start_engine();
                                }
                                q.ex = Some(Box::new(InFlight {
                                    ex,
                                    lost,
                                    live: self.remote.clone(),
                                }));
                                return None;
                            }
                            Err(o) => o,
                        }
                    }
                }
            };
            (out, lost, request_lost)
        };
        if p.acked_lost && matches!(out, Outcome::Done { .. }) {
            inner.ctr.duplicates += 1;
        }
        if matches!(out, Outcome::Done { .. } | Outcome::Fail(_)) {
            inner.served += 1;
            self.maybe_mute(inner);
        }
        match out {
            Outcome::Done { .. } if lost && !request_lost && !p.acked_lost => {
                // Executed, but the acknowledgement never arrives: retry after the timeout;
                // the responder will see a duplicate.
                p.acked_lost = true;
                self.no_response(inner, q, false)
            }
            Outcome::Done { byte_len, .. } => Some((WcStatus::Success, byte_len)),
            Outcome::Fail(st) => Some((st, 0)),
            Outcome::Rnr(code) => {
                inner.ctr.rnr_naks += 1;
                q.rnr_tries = q.rnr_tries.saturating_add(1);
                if q.rnr_retry != 7 && q.rnr_tries > q.rnr_retry {
                    return Some((WcStatus::RnrRetryExcErr, 0));
                }
                q.wait_until = Some(
                    Instant::now() + Duration::from_micros(RNR_TIMER_US[code as usize & 31] as u64),
                );
                None
            }
            Outcome::NoResponse => self.no_response(inner, q, waited),
        }
    }

    /// Start `req` towards the responder on another host at `to` (an [`wire::Exchange`] the
    /// requester moves on at each later call); `Err` with the outcome when it cannot go at all.
    fn start_remote(
        &self,
        qi: usize,
        to: std::net::SocketAddrV4,
        req: &Request,
        wait: Duration,
    ) -> std::result::Result<wire::Exchange, Outcome> {
        if req.len > wire::MAX_MSG {
            return Err(Outcome::Fail(WcStatus::LocLenErr));
        }
        let hdr = wire::ReqHdr {
            ud: false,
            op: req.op,
            src_qpn: req.src_qpn,
            src_gid: req.src_gid,
            dest_qpn: req.dest_qpn,
            psn: req.psn,
            remote_addr: req.remote_addr,
            rkey: req.rkey,
            imm: req.imm,
            compare_add: req.compare_add,
            swap: req.swap,
            len: req.len as u32,
            qkey: 0,
        };
        let payload = if hdr.carries() {
            gather(req.local, req.len)
        } else {
            Vec::new()
        };
        let xid = self.wire.next_xid(qi);
        Ok(wire::Exchange::start(
            &self.wire,
            xid,
            to,
            hdr,
            payload,
            wait,
            Instant::now(),
        ))
    }

    /// The outcome of a finished exchange; a read's data and an atomic's original value land
    /// in `local` (our memory, validated again now against our registrations), as the local
    /// responder puts them.
    fn finish_remote(
        ex: &wire::Exchange,
        o: Outcome,
        op: WrOpcode,
        len: usize,
        local: &[Range],
    ) -> Outcome {
        if let Outcome::Done { value, .. } = o {
            if op == WrOpcode::RdmaRead {
                if ex.result().len() != len {
                    return Outcome::NoResponse;
                }
                scatter(ex.result(), local);
            } else if op.is_atomic() {
                scatter(&value.to_ne_bytes(), local);
            }
        }
        o
    }

    /// Hand the answers waiting on the wire to the exchanges they belong to (each names its
    /// QP in its id).
    fn pump_wire(&self, inner: &mut Inner) {
        if self.remote.load(RLX) == 0 {
            return;
        }
        let now = Instant::now();
        self.wire.drain(|from, xid, reply, frag, total, data| {
            let qi = wire::Wire::xid_qp(xid);
            if let Some(Some(q)) = inner.qps.get_mut(qi) {
                if let Some(f) = q.ex.as_mut().filter(|f| f.ex.xid == xid) {
                    f.ex.on_answer(&self.wire, from, reply, frag, total, data, now);
                }
            }
        });
    }

    /// Bytes this HCA's wire service holds now for other hosts (reassemblies and read
    /// results; bounded by [`service::BUDGET`]).
    pub fn wire_held(&self) -> usize {
        self.wire.held()
    }

    /// Packets from other hosts the wire service refused before executing them.
    pub fn wire_refused(&self) -> u64 {
        self.wire.refused()
    }

    fn no_response(
        &self,
        inner: &mut Inner,
        q: &mut QpLocal,
        waited: bool,
    ) -> Option<(WcStatus, u32)> {
        inner.ctr.retries += 1;
        q.retries = q.retries.saturating_add(1);
        if q.retries > q.retry_cnt {
            return Some((WcStatus::RetryExcErr, 0));
        }
        // Timeout 0 is "infinite": keep trying, looking again every millisecond.
        let t = ack_timeout(q.timeout).unwrap_or(Duration::from_millis(1));
        if q.timeout == 0 {
            q.retries = 0;
        }
        // Over the wire the timeout already ran out waiting for the answer.
        q.wait_until = (!waited).then(|| Instant::now() + t);
        None
    }

    fn maybe_mute(&self, inner: &Inner) {
        if self.cfg.mute_after > 0 && inner.served >= self.cfg.mute_after {
            self.set_mute(true);
        }
    }

    fn step_ud(
        &self,
        inner: &mut Inner,
        q: &mut QpLocal,
        p: &Pending,
        local: &[Range],
        batch: &mut UdBatch,
    ) -> (WcStatus, u32) {
        let len = p.wr.len();
        if len > q.mtu.bytes() {
            return (WcStatus::LocLenErr, 0);
        }
        let Some(ud) = p.wr.ud else {
            return (WcStatus::LocQpOpErr, 0);
        };
        let Some(Some((peer, _))) = inner.ahs.get(ud.ah.0 as usize).cloned() else {
            return (WcStatus::LocQpOpErr, 0);
        };
        let rng = inner.rng.as_mut();
        let (drop, dup, hold) = match rng {
            Some(r) => (
                r.chance(self.cfg.ud_drop),
                r.chance(self.cfg.ud_dup),
                r.chance(self.cfg.ud_reorder),
            ),
            None => (false, false, false),
        };
        if drop || !peer.responsive(false) {
            inner.ctr.ud_dropped += 1;
        } else if hold && q.held.is_none() {
            self.sq_busy();
            q.held = Some(Held {
                peer,
                dest_qpn: ud.remote_qpn,
                qkey: ud.remote_qkey,
                op: p.wr.opcode,
                imm: p.wr.imm,
                data: gather(local, len),
                since: Instant::now(),
            });
        } else {
            let n = if dup { 2 } else { 1 };
            // Batched when more datagrams follow (a lone one goes at once, no batch to fill).
            let batched = self.cfg.ud_batch > 1
                && matches!(*peer, Target::Local(_))
                && (!q.sq.is_empty() || !batch.items.is_empty());
            for _ in 0..n {
                if batched {
                    let same = batch.dest_qpn == ud.remote_qpn
                        && batch.qkey == ud.remote_qkey
                        && batch.peer.as_ref().is_some_and(|b| Arc::ptr_eq(b, &peer));
                    let full = batch.items.len() >= self.cfg.ud_batch;
                    if !batch.items.is_empty() && (full || !same) {
                        self.flush_ud(inner, q, batch);
                    }
                    batch.peer = Some(peer.clone());
                    batch.dest_qpn = ud.remote_qpn;
                    batch.qkey = ud.remote_qkey;
                    batch.items.push(UdItem {
                        op: p.wr.opcode,
                        imm: p.wr.imm,
                        local: local.iter().copied().collect(),
                        len,
                        grh: wire::grh(&self.seg.gid(), len),
                    });
                    continue;
                }
                self.deliver_ud(
                    inner,
                    q,
                    &peer,
                    ud.remote_qpn,
                    ud.remote_qkey,
                    p.wr.opcode,
                    p.wr.imm,
                    local,
                );
            }
            inner.ctr.ud_duplicated += dup as u64;
            if let Some(h) = q.held.take() {
                self.flush_ud(inner, q, batch);
                let l = h.ranges();
                self.deliver_ud(inner, q, &h.peer, h.dest_qpn, h.qkey, h.op, h.imm, &l);
            }
        }
        inner.served += 1;
        self.maybe_mute(inner);
        (WcStatus::Success, len as u32)
    }

    /// Deliver the datagrams collected in `batch` (see [`exec::ud_batch`]).
    fn flush_ud(&self, inner: &mut Inner, q: &QpLocal, batch: &mut UdBatch) {
        let Some(peer) = batch.peer.take() else {
            return;
        };
        if let Target::Local(p) = &*peer {
            let reqs: Vec<Request> = batch
                .items
                .iter()
                .map(|it| Request {
                    op: it.op,
                    src_qpn: q.qpn,
                    src_gid: self.seg.gid(),
                    dest_qpn: batch.dest_qpn,
                    psn: 0,
                    local: &it.local,
                    remote_addr: 0,
                    rkey: 0,
                    imm: it.imm,
                    compare_add: 0,
                    swap: 0,
                    len: it.len,
                    qkey: batch.qkey,
                    grh: Some(it.grh),
                })
                .collect();
            let delivered = exec::ud_batch(p, &reqs);
            inner.ctr.ud_dropped += (reqs.len() - delivered) as u64;
            inner.ctr.ud_batched += reqs.len() as u64;
            inner.ctr.ud_batches += 1;
        }
        batch.items.clear();
    }

    #[allow(clippy::too_many_arguments)]
    fn deliver_ud(
        &self,
        inner: &mut Inner,
        q: &QpLocal,
        peer: &Target,
        dest_qpn: u32,
        qkey: u32,
        op: WrOpcode,
        imm: u32,
        local: &[Range],
    ) {
        let len: usize = local.iter().map(|r| r.len).sum();
        let peer = match peer {
            Target::Local(p) => p,
            Target::Remote(to) => {
                let data = gather(local, len);
                let hdr = wire::ReqHdr {
                    ud: true,
                    op,
                    src_qpn: q.qpn,
                    src_gid: self.seg.gid(),
                    dest_qpn,
                    psn: 0,
                    remote_addr: 0,
                    rkey: 0,
                    imm,
                    compare_add: 0,
                    swap: 0,
                    len: data.len() as u32,
                    qkey,
                };
                self.wire.ud(*to, &hdr, &data);
                return;
            }
        };
        let grh = wire::grh(&self.seg.gid(), len);
        let req = Request {
            op,
            src_qpn: q.qpn,
            src_gid: self.seg.gid(),
            dest_qpn,
            psn: 0,
            local,
            remote_addr: 0,
            rkey: 0,
            imm,
            compare_add: 0,
            swap: 0,
            len,
            qkey,
            grh: Some(grh),
        };
        if !exec::ud(peer, &req) {
            inner.ctr.ud_dropped += 1;
        }
    }

    fn progress_all(&self, inner: &mut Inner) {
        if !self.sq_work.load(Ordering::Acquire) {
            return;
        }
        let busy = |inner: &Inner, qi: usize| {
            inner.qps[qi]
                .as_ref()
                .is_some_and(|q| !q.sq.is_empty() || q.held.is_some())
        };
        let mut left = false;
        for qi in 0..inner.qps.len() {
            if busy(inner, qi) {
                self.drive(inner, qi);
                left |= busy(inner, qi);
            }
        }
        if !left {
            self.sq_work.store(false, Ordering::Release);
        }
    }

    /// Note that a send queue holds work (the lock is held).
    fn sq_busy(&self) {
        self.sq_work.store(true, Ordering::Release);
    }

    /// `poll_cq`'s look without the lock: `true` when nothing needs it — no send queue
    /// holds work and CQ `cq`'s ring has no record ready (nor an overrun to report). `false`
    /// says only that the locked path must decide (an unknown CQ included).
    fn cq_idle(&self, cq: usize) -> bool {
        if self.sq_work.load(Ordering::Acquire) {
            return false;
        }
        let Some(at) = self.cq_at.get(cq).map(|a| a.load(Ordering::Acquire)) else {
            return false;
        };
        if at == 0 {
            return false;
        }
        let (off, cap) = (at >> 8, 1u32 << ((at & 0xff) - 1));
        let overrun = self.seg.cq(cq).is_none_or(|e| e.overrun.load(SC) != 0);
        !overrun
            && self
                .seg
                .ring::<CQE_WORDS>(off, cap)
                .is_some_and(|r| !r.ready() && r.is_empty())
    }

    /// Complete a receive a dead initiator took from a queue of ours (`w`, handed back by
    /// [`ring::Ring::release`]) with a flush error on `cq`, its bytes counted as taken.
    fn flush_taken(
        &self,
        cq: u32,
        qpn: u32,
        w: &[u64; WQE_WORDS],
        taken: &std::sync::atomic::AtomicU64,
    ) {
        let b: u64 = seg::wqe_sges(w).iter().map(|s| s.length as u64).sum();
        taken.fetch_add(b, RLX);
        self.push_own(
            cq,
            &Wc {
                wr_id: w[0],
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                qp_num: qpn,
                src_qp: 0,
                grh: false,
            },
        );
    }
}

fn flush_wc(wr: &SendWr, qpn: u32) -> Wc {
    Wc {
        wr_id: wr.wr_id,
        status: WcStatus::WrFlushErr,
        opcode: wr.opcode.wc(),
        byte_len: 0,
        imm: None,
        qp_num: qpn,
        src_qp: 0,
        grh: false,
    }
}

/// The first `len` bytes of our local ranges, in one buffer.
fn gather(local: &[Range], len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    for r in local {
        let n = r.len.min(len - v.len());
        if n == 0 {
            continue; // nothing to read, and its address may be anything (NULL)
        }
        // SAFETY: `local` are ranges of this process validated against our registrations (or
        // the inline copy), alive for the duration of the call.
        v.extend_from_slice(unsafe { std::slice::from_raw_parts(r.base as *const u8, n) });
    }
    v
}

/// Spread `data` over our local ranges in order.
fn scatter(data: &[u8], local: &[Range]) {
    let mut off = 0;
    for r in local {
        let n = r.len.min(data.len() - off);
        if n == 0 {
            continue; // nothing to write, and its address may be anything (NULL)
        }
        // SAFETY: `local` are ranges of this process validated with LOCAL_WRITE rights against
        // our registrations; `data` is a separate buffer.
        unsafe { std::ptr::copy_nonoverlapping(data[off..].as_ptr(), r.base as *mut u8, n) };
        off += n;
    }
}

fn gid_words(g: &Gid) -> [u64; 2] {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&g.0[..8]);
    b.copy_from_slice(&g.0[8..]);
    [u64::from_le_bytes(a), u64::from_le_bytes(b)]
}

impl Drop for SoftHca {
    fn drop(&mut self) {
        self.seg.header().closed.store(1, SC);
        if let Some(t) = self.engine.get() {
            t.unpark();
        }
    }
}

/// The engine thread's loop: until the HCA is gone.
fn engine(me: std::sync::Weak<Core>) {
    loop {
        let Some(c) = me.upgrade() else { return };
        let timing = c.cfg.timing();
        if c.remote.load(RLX) == 0 && !timing {
            drop(c);
            std::thread::park_timeout(Duration::from_millis(100));
            continue;
        }
        if !timing {
            c.wire.wait_answer(ENGINE_TICK);
        }
        {
            let mut g = c.lock();
            c.progress_all(&mut g);
        }
        drop(c);
        if timing {
            std::thread::sleep(ENGINE_TICK);
        }
    }
}

mod verbs;

#[cfg(test)]
mod tests {
    use super::Table;

    /// A table hands out its lowest free entry, grows only when none is free, and stops at
    /// `max`; the search starts past the entries it knows are taken, so filling a table of
    /// n entries looks at each once, not n²/2 times.
    #[test]
    fn slots_reuse_the_lowest_free_entry_and_look_at_each_taken_one_once() {
        let mut v: Table<u32> = Table::default();
        for i in 0..5 {
            let k = v.slot(5).unwrap();
            assert_eq!(k, i);
            v[k] = Some(i as u32);
        }
        assert_eq!(v.from, 4, "the search starts at the last entry handed out");
        assert_eq!(v.slot(5), None, "full at max");
        // Entries 3 and 1 freed (each free lowers `from` to the entry it frees).
        for i in [3, 1] {
            assert!(v.free(i).is_some());
        }
        assert_eq!(v.slot(5), Some(1));
        v[1] = Some(9);
        assert_eq!(v.slot(5), Some(3));
        v[3] = Some(9);
        // An entry emptied without `free` is still found once the table is full.
        v[0] = None;
        assert_eq!(v.slot(5), Some(0));
        v[0] = Some(9);
        // Below `max` a table without a free entry from `from` on grows; an entry handed out
        // but left empty (its creation failed) is the next one handed out.
        assert_eq!(v.slot(6), Some(5));
        assert_eq!(v.slot(6), Some(5));
    }
}

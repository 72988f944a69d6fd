// Over 800 lines: all of weft-fi's mutable state, behind its one lock, in one place by design.
//! The process's weft world and what libfabric's objects hold, behind one lock.
//!
//! Objects are never freed (a closed one is only marked dead), so a call through a closed
//! object's pointer reaches weft-fi and gets `-FI_EINVAL` instead of reading freed memory.
//! All mutable state lives here, keyed by the object's address: the objects themselves are
//! written once, when they are made.

use crate::matching::{Arrived, Hdr, Parts, Queues, Recv, EAGER, HDR};
use crate::{serr, NULL};
// hashbrown's default hasher: these maps are keyed by object addresses and looked up several
// times per message, where std's SipHash cost more than the rest of the lookup.
use hashbrown::{HashMap, HashSet};
use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use weft::{RawRequest, Source, TagSel};
use weft_ofi_sys as fi;

weft::param!(STATS: Bool = "fi", "STATS", "0",
    "weft-fi: when the domain closes, print what went through weft (messages sent and received, RMA and atomic operations issued and served) on stderr");

/// What went through weft, for `WEFT_FI_STATS`.
#[derive(Default, Clone, Copy, Debug)]
pub struct Stats {
    pub sent: u64,
    pub received: u64,
    pub rma_issued: u64,
    pub rma_served: u64,
}

/// What a queue holds for one finished operation.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    pub ctx: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub tag: u64,
    /// World rank of the sender (receives).
    pub src: Option<u32>,
    /// Remote CQ data (with `FI_REMOTE_CQ_DATA` in `flags`).
    pub data: u64,
    /// For error entries: the positive libfabric error and the bytes that did not fit.
    pub err: u64,
    pub olen: usize,
}

/// A completion queue's finished operations.
#[derive(Default)]
pub struct Cq {
    pub ok: VecDeque<Entry>,
    pub err: VecDeque<Entry>,
    pub format: u32,
}

/// An address vector: index (the `fi_addr_t`) to world rank; `u32::MAX` once removed.
#[derive(Default)]
pub struct Av {
    pub table: Vec<u32>,
}

/// A counter's values.
#[derive(Default, Clone, Copy, Debug)]
pub struct Cntr {
    pub value: u64,
    pub err: u64,
}

/// The counters an endpoint is bound to (0: none), by what they count.
#[derive(Default, Clone, Copy, Debug)]
pub struct Cntrs {
    pub send: usize,
    pub recv: usize,
    pub read: usize,
    pub write: usize,
    pub remote_read: usize,
    pub remote_write: usize,
}

/// An endpoint's bindings.
#[derive(Default)]
pub struct Ep {
    pub tx_cq: usize,
    pub rx_cq: usize,
    pub av: usize,
    pub tx_selective: bool,
    pub rx_selective: bool,
    pub tx_op_flags: u64,
    pub rx_op_flags: u64,
    pub enabled: bool,
    /// `FI_DIRECTED_RECV`: receives match their source address (else any source).
    pub directed: bool,
    /// Asked for `FI_RMA` or `FI_ATOMIC`: the endpoint that reports remote accesses.
    pub rma: bool,
    pub cntrs: Cntrs,
}

/// What a finished operation reports.
pub(crate) enum What {
    Send {
        tagged: bool,
    },
    /// A long message's data arriving in the receive its header matched.
    Recv {
        tagged: bool,
        r: Recv,
        hdr: Hdr,
        src: u32,
    },
    /// Nothing: a long message's header, a discarded message's data, an RMA control
    /// message, a target's read data.
    Quiet,
    /// The data of the origin's RMA operation `id` (a long write's or read's).
    Part {
        id: u64,
    },
    /// A long remote write's data arriving in a region of this process, for the origin's
    /// operation `id` at rank `src`, which is answered once it is in.
    TargetIn {
        src: u32,
        id: u64,
        data: Option<u64>,
    },
}

/// One weft operation in flight.
pub struct Op {
    pub(crate) req: RawRequest,
    pub(crate) ep: usize,
    pub(crate) what: What,
    pub(crate) ctx: *mut c_void,
    /// Report to the queue (false: inject, or a selective completion not asked for).
    pub(crate) report: bool,
    /// The bytes a send goes from when weft-fi made them (header and inline payload), kept
    /// until weft is done with them.
    pub(crate) _owned: Option<Vec<u8>>,
    /// The key of the region this operation reads or writes at its target (closing the
    /// region waits for it).
    pub(crate) key: Option<u64>,
}

impl Op {
    /// An operation that reports nothing, holding `owned` bytes and region `key` until done.
    pub(crate) fn quiet(
        req: RawRequest,
        ep: usize,
        owned: Option<Vec<u8>>,
        key: Option<u64>,
    ) -> Op {
        Op {
            req,
            ep,
            what: What::Quiet,
            ctx: NULL,
            report: false,
            _owned: owned,
            key,
        }
    }
}

/// A control-tag receive kept posted for arriving headers.
struct Bounce {
    req: RawRequest,
    buf: Vec<u8>,
}

/// Control receives kept posted (more arriving headers wait in weft's unexpected queue).
const BOUNCES: usize = 32;
/// The weft tag of headers (on the world communicator); long payloads use their own tags on
/// a communicator of their own.
pub(crate) const CTRL: i32 = 0;

/// A send as the entry points give it.
pub struct SendArgs {
    pub tagged: bool,
    pub buf: *const c_void,
    pub len: usize,
    /// An iovec of several entries (`buf` its first, `len` their sum).
    pub parts: Parts,
    pub dest: u64,
    pub tag: u64,
    /// Remote CQ data.
    pub data: Option<u64>,
    pub ctx: *mut c_void,
    /// `*msg` calls' flags; the endpoint's default otherwise.
    pub flags: Option<u64>,
    /// `fi_inject*`: copy now, report nothing.
    pub inject: bool,
}

/// A receive as the entry points give it.
pub struct RecvArgs {
    pub tagged: bool,
    pub buf: *mut c_void,
    pub len: usize,
    /// An iovec of several entries (`buf` its first, `len` their sum).
    pub parts: Parts,
    pub src: u64,
    pub tag: u64,
    pub ignore: u64,
    pub ctx: *mut c_void,
    pub flags: Option<u64>,
}

/// The world and the objects, for one process.
pub struct Global {
    /// The job this process belongs to, from the domain's opening on: enough to name the
    /// process; the provider opens (collectively) when the first peer address is inserted.
    boot: Option<Pending>,
    /// (rank, size) in the job.
    me: (u32, u32),
    pub(crate) world: Option<weft::World>,
    /// A communicator of its own for long payloads, each on a tag of its own.
    pub(crate) data: Option<weft::Comm>,
    pub domain: String,
    job: u64,
    pub live: HashSet<usize>,
    pub eps: HashMap<usize, Ep>,
    pub cqs: HashMap<usize, Cq>,
    pub avs: HashMap<usize, Av>,
    pub cntrs: HashMap<usize, Cntr>,
    /// Each domain's MR mode (`FI_MR_BASIC`, `FI_MR_SCALABLE` or the mode bits).
    pub domains: HashMap<usize, u64>,
    /// This process's registered regions by key, and the key of each region object.
    pub(crate) mrs: HashMap<u64, crate::rma::Region>,
    pub(crate) mr_keys: HashMap<usize, u64>,
    /// The next key weft-fi hands out (`FI_MR_PROV_KEY`): never one given before.
    pub(crate) next_key: u64,
    /// The RMA operations of this process waiting for their target's answer, by id.
    pub(crate) rops: HashMap<u64, crate::remote::Rop>,
    pub(crate) next_id: u64,
    pub(crate) ops: Vec<Op>,
    bounces: VecDeque<Bounce>,
    /// Matching of `FI_TAGGED` and of `FI_MSG` messages.
    tagq: Queues,
    msgq: Queues,
    /// The next long-payload tag towards each rank (long sends and writes: bit 30 clear).
    pub(crate) next_long: Vec<u32>,
    /// The next tag on which a long read's data comes from each rank (bit 30 set).
    pub(crate) next_read: Vec<u32>,
    /// Peer failures already acted on.
    failures_seen: u32,
    /// Send buffers of finished short messages, for the next ones (no allocation per message).
    pub(crate) spare: Vec<Vec<u8>>,
    /// Something was posted or delivered since the requests were last looked at.
    pub(crate) dirty: bool,
    pub(crate) stats: Stats,
    /// Progress rounds in a row that handled nothing (the requests are looked at anyway every
    /// [`LOOK_EVERY`] rounds).
    idle: u32,
}

/// Idle progress rounds between two looks at the requests when nothing seemed to happen.
const LOOK_EVERY: u32 = 64;

/// A bootstrap whose collective part may still be ahead.
enum Pending {
    /// PMI-1 before its node-map exchange (`Pmi::exchange_nodes`).
    Pmi(weft::bootstrap::pmi::Pmi),
    Ready(Box<dyn weft::bootstrap::Bootstrap>),
}

impl Pending {
    fn from_env() -> weft::Result<Pending> {
        use weft::bootstrap::Choice;
        Ok(match Choice::from_env()? {
            Choice::Pmi1 => Pending::Pmi(weft::bootstrap::pmi::Pmi::from_env_unexchanged(
                weft::pmi_timeout()?,
            )?),
            _ => Pending::Ready(weft::bootstrap_from_env()?),
        })
    }

    fn boot(&self) -> &dyn weft::bootstrap::Bootstrap {
        match self {
            Pending::Pmi(p) => p,
            Pending::Ready(b) => b.as_ref(),
        }
    }

    fn ready(self) -> weft::Result<Box<dyn weft::bootstrap::Bootstrap>> {
        match self {
            Pending::Pmi(mut p) => {
                p.exchange_nodes()?;
                Ok(Box::new(p))
            }
            Pending::Ready(b) => Ok(b),
        }
    }
}

/// The process's state behind a lock taken with one atomic and given back with a plain store
/// (std's `Mutex` also swaps on release, to wake sleepers: on a ping-pong over shm the two
/// atomics of every call cost more than the rest of the bridge). Waiters spin, then yield.
struct Lock {
    held: AtomicBool,
    state: UnsafeCell<Option<Global>>,
}

// SAFETY: the world holds `Rc`s and raw pointers and is neither `Send` nor `Sync`; `state` is
// reached only through a `Held` guard, which exists for one thread at a time (taken by the
// Acquire compare-exchange, given back by the Release store, which order every access between
// threads), and nothing obtained from it (no `Rc`, no `Comm`) leaves a `with` call.
unsafe impl Sync for Lock {}

static STATE: Lock = Lock {
    held: AtomicBool::new(false),
    state: UnsafeCell::new(None),
};

/// The lock, held until dropped (also when a panic unwinds through `with`).
struct Held;

impl Held {
    fn take() -> Held {
        let mut spins = 0u32;
        while STATE
            .held
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            while STATE.held.load(Ordering::Relaxed) {
                spins += 1;
                if spins < 128 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        Held
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        STATE.held.store(false, Ordering::Release);
    }
}

/// Run `f` on the process's state (made on first use). Not reentrant: `f` never calls `with`.
pub fn with<T>(f: impl FnOnce(&mut Global) -> T) -> T {
    let _held = Held::take();
    // SAFETY: `_held` makes this thread the only one in `STATE.state` until it drops, after
    // `f` returns (or unwinds); the reference does not outlive this call.
    let g = unsafe { &mut *STATE.state.get() };
    let g = g.get_or_insert_with(|| Global {
        boot: None,
        me: (0, 0),
        world: None,
        data: None,
        domain: String::new(),
        job: 0,
        live: HashSet::new(),
        eps: HashMap::new(),
        cqs: HashMap::new(),
        avs: HashMap::new(),
        cntrs: HashMap::new(),
        domains: HashMap::new(),
        mrs: HashMap::new(),
        mr_keys: HashMap::new(),
        next_key: 1,
        rops: HashMap::new(),
        next_id: 1,
        ops: Vec::new(),
        bounces: VecDeque::new(),
        tagq: Queues::default(),
        msgq: Queues::default(),
        next_long: Vec::new(),
        next_read: Vec::new(),
        failures_seen: 0,
        spare: Vec::new(),
        dirty: true,
        stats: Stats::default(),
        idle: 0,
    });
    f(g)
}

/// At libfabric's cleanup: finalize a world still open.
pub fn shutdown() {
    with(|g| g.close_world());
}

/// FNV-1a of the job's name: the part of a libfabric name that says which job it is from.
fn job_hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A name: "weft", the world rank, the job's hash.
pub const NAME_LEN: usize = 16;
const MAGIC: &[u8; 4] = b"weft";

/// A positive libfabric error code for a weft error.
pub(crate) fn code_of(e: &weft::Error) -> u64 {
    use weft::ErrorKind as K;
    match e.kind() {
        K::Truncated => fi::FI_ETRUNC as u64,
        K::PeerFailed => fi::FI_EIO,
        K::InvalidRank | K::InvalidTag | K::InvalidArgument => fi::FI_EINVAL,
        K::Timeout => fi::FI_ETIMEDOUT,
        K::Unsupported => fi::FI_ENOSYS,
        _ => fi::FI_EOTHER as u64,
    }
}

impl Global {
    /// Find this process's job for weft provider `domain` (not collective: the processes of
    /// a libfabric job open their domains at different times, and exchange names in between).
    pub fn open_world(&mut self, domain: &str) -> Result<(), u64> {
        if self.boot.is_some() || self.world.is_some() {
            return if self.domain == domain {
                Ok(())
            } else {
                eprintln!(
                    "weft-fi: this process already uses domain {}; {domain} refused",
                    self.domain
                );
                Err(fi::FI_EBUSY)
            };
        }
        weft::registry::Selection::parse(domain).map_err(|_| fi::FI_ENODATA)?;
        let boot = Pending::from_env().map_err(|e| {
            eprintln!("weft-fi: cannot join the job: {e}");
            fi::FI_ENODATA
        })?;
        self.me = (boot.boot().rank(), boot.boot().size());
        self.job = job_hash(boot.boot().job_id());
        self.boot = Some(boot);
        self.domain = domain.to_string();
        Ok(())
    }

    /// Open the provider with every process of the job (collective): at the first address
    /// inserted, when each process has its endpoint and has handed its name on (fi_pingpong's
    /// client opens its endpoint only once it has the server's name; Open MPI inserts its
    /// peers' addresses in `MPI_Init`). Receives posted before wait in weft-fi's queues.
    pub fn join(&mut self) -> Result<(), u64> {
        if self.world.is_some() {
            return Ok(());
        }
        let Some(boot) = self.boot.take() else {
            return Err(fi::FI_EOPBADSTATE as u64);
        };
        let sel = weft::registry::Selection::parse(&self.domain).map_err(|_| fi::FI_ENODATA)?;
        let boot = boot.ready().map_err(|e| {
            eprintln!("weft-fi: cannot join the job: {e}");
            fi::FI_EIO
        })?;
        let world = weft::init_on(boot, &sel).map_err(|e| {
            eprintln!("weft-fi: cannot open domain {}: {e}", self.domain);
            fi::FI_ENODATA
        })?;
        let data = world.dup().map_err(|e| {
            eprintln!("weft-fi: {e}");
            fi::FI_EOTHER as u64
        })?;
        self.next_long = vec![0; world.size() as usize];
        self.next_read = vec![0; world.size() as usize];
        self.world = Some(world);
        self.data = Some(data);
        for _ in 0..BOUNCES {
            self.post_bounce(vec![0u8; HDR + EAGER])?;
        }
        Ok(())
    }

    /// Keep one more control receive posted, into `buf`.
    fn post_bounce(&mut self, buf: Vec<u8>) -> Result<(), u64> {
        let w = self.world.as_ref().ok_or(fi::FI_EOPBADSTATE as u64)?;
        let mut buf = buf;
        // SAFETY: the buffer is owned by the `Bounce` that holds the request, which stays in
        // `bounces` until the request has completed (or the world is finalized); a Vec's heap
        // block does not move when the Vec does.
        let req =
            unsafe { w.irecv_raw(buf.as_mut_ptr(), buf.len(), Source::Any, TagSel::Tag(CTRL)) }
                .map_err(|e| code_of(&e))?;
        self.bounces.push_back(Bounce { req, buf });
        self.dirty = true;
        Ok(())
    }

    /// Finalize the world. Operations still in flight (an endpoint whose close gave up, or one
    /// never closed) are given a bounded time to finish first, so that no late message lands
    /// in a buffer the application may free once the domain is closed.
    pub fn close_world(&mut self) {
        if self.world.is_some() && STATS.get_bool().unwrap_or(false) {
            let s = self.stats;
            // One write of the whole line: the ranks' lines reach a launcher's merged stderr
            // whole (eprintln! writes a formatted line in pieces).
            let line = format!(
                "weft-fi: rank {} of {}, domain {}: {} messages sent, {} received; {} RMA and atomic operations issued, {} served\n",
                self.me.0, self.me.1, self.domain, s.sent, s.received, s.rma_issued, s.rma_served
            );
            use std::io::Write;
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
        let eps: Vec<usize> = self.eps.keys().copied().collect();
        let t0 = std::time::Instant::now();
        for ep in eps {
            while self.drain_ep(ep) > 0 && t0.elapsed() < std::time::Duration::from_secs(10) {
                std::thread::yield_now();
            }
        }
        if let Some(w) = self.world.as_ref() {
            for b in &self.bounces {
                let _ = w.cancel_raw(&b.req);
            }
        }
        // The buffers weft may still read or write (bounces, send copies) go only once the
        // world is finalized, which completes every request still open.
        let ops = std::mem::take(&mut self.ops);
        let bounces = std::mem::take(&mut self.bounces);
        self.data = None;
        if let Some(w) = self.world.take() {
            if let Err(e) = w.finalize() {
                eprintln!("weft-fi: finalize: {e}");
            }
        }
        drop((ops, bounces));
        // Receives still posted (on endpoints never closed) are never completed: a domain
        // opened later must not write into their buffers.
        self.tagq = Queues::default();
        self.msgq = Queues::default();
        // Regions and RMA operations belong to the world that ends here.
        self.rops.clear();
        self.mrs.clear();
        self.mr_keys.clear();
        self.failures_seen = 0;
        if let Some(b) = self.boot.take() {
            if let Ok(mut b) = b.ready() {
                let _ = b.finalize();
            }
        }
    }

    /// Whether the domain is open (the job known).
    pub fn has_world(&self) -> bool {
        self.world.is_some() || self.boot.is_some()
    }

    /// This process's name.
    pub fn name(&self) -> Option<[u8; NAME_LEN]> {
        self.has_world().then(|| self.name_of(self.me.0))
    }

    fn name_of(&self, rank: u32) -> [u8; NAME_LEN] {
        let mut n = [0u8; NAME_LEN];
        n[..4].copy_from_slice(MAGIC);
        n[4..8].copy_from_slice(&rank.to_le_bytes());
        n[8..16].copy_from_slice(&self.job.to_le_bytes());
        n
    }

    /// The world rank a name names, if it is a name of this job.
    pub fn rank_of_name(&self, name: &[u8]) -> Option<u32> {
        if !self.has_world() {
            return None;
        }
        if name.len() < NAME_LEN || &name[..4] != MAGIC {
            return None;
        }
        let rank = u32::from_le_bytes(name[4..8].try_into().ok()?);
        let job = u64::from_le_bytes(name[8..16].try_into().ok()?);
        (job == self.job && rank < self.me.1).then_some(rank)
    }

    /// The name of the rank at `addr` of address vector `av`.
    pub fn name_at(&self, av: usize, addr: u64) -> Option<[u8; NAME_LEN]> {
        let r = *self.avs.get(&av)?.table.get(addr as usize)?;
        (r != u32::MAX).then(|| self.name_of(r))
    }

    /// The rank behind `addr` in the endpoint's address vector.
    pub(crate) fn rank_at(&self, ep: &Ep, addr: u64) -> Option<u32> {
        let r = *self.avs.get(&ep.av)?.table.get(addr as usize)?;
        (r != u32::MAX).then_some(r)
    }

    /// The `fi_addr_t` of `rank` in `av` (for `fi_cq_readfrom`), or `FI_ADDR_NOTAVAIL`.
    pub fn addr_of(&self, av: usize, rank: u32) -> u64 {
        self.avs
            .get(&av)
            .and_then(|a| a.table.iter().position(|r| *r == rank))
            .map_or(fi::FI_ADDR_UNSPEC, |i| i as u64)
    }

    /// The address vector an endpoint whose queue is `cq` uses (for source addresses).
    pub fn av_of_cq(&self, cq: usize) -> usize {
        self.eps
            .values()
            .find(|e| e.rx_cq == cq || e.tx_cq == cq)
            .map_or(0, |e| e.av)
    }

    fn queue(&mut self, tagged: bool) -> &mut Queues {
        if tagged {
            &mut self.tagq
        } else {
            &mut self.msgq
        }
    }

    pub(crate) fn push_op(&mut self, op: Op) {
        self.ops.push(op);
        self.dirty = true;
    }

    /// Add one to the value (or the error count) of the counter `which` picks among those
    /// endpoint `ep` is bound to.
    pub(crate) fn count(&mut self, ep: usize, which: fn(&Cntrs) -> usize, ok: bool) {
        let Some(c) = self.eps.get(&ep).map(|e| which(&e.cntrs)) else {
            return;
        };
        if let Some(c) = self.cntrs.get_mut(&c) {
            if ok {
                c.value += 1;
            } else {
                c.err += 1;
            }
        }
    }

    /// Put `e` on the receive (`rx`) or transmit queue of endpoint `ep`.
    pub(crate) fn report(&mut self, ep: usize, rx: bool, e: Entry) {
        let Some(cq) = self
            .eps
            .get(&ep)
            .map(|e| if rx { e.rx_cq } else { e.tx_cq })
        else {
            return;
        };
        if let Some(q) = self.cqs.get_mut(&cq) {
            if e.err == 0 {
                q.ok.push_back(e);
            } else {
                q.err.push_back(e);
            }
        }
    }

    /// Post a send.
    pub fn send(&mut self, ep: usize, a: SendArgs) -> isize {
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
        if inject && a.len > crate::info::INJECT {
            return serr(fi::FI_EMSGSIZE);
        }
        if a.len > 0 && a.buf.is_null() {
            return serr(fi::FI_EINVAL);
        }
        let Some(rank) = self.rank_at(e, a.dest) else {
            return serr(fi::FI_EINVAL);
        };
        let report = !a.inject
            && flags & fi::FI_INJECT == 0
            && (!e.tx_selective || flags & fi::FI_COMPLETION != 0);
        if self.world.is_none() || self.data.is_none() {
            return serr(fi::FI_EOPBADSTATE as u64);
        }
        let long = (a.len > EAGER).then(|| self.long_tag(rank));
        let hdr = Hdr {
            tagged: a.tagged,
            tag: if a.tagged { a.tag } else { 0 },
            data: a.data,
            len: a.len as u64,
            long,
        };
        let mut msg = self.spare.pop().unwrap_or_default();
        msg.clear();
        msg.extend_from_slice(&hdr.encode());
        if long.is_none() && a.len > 0 {
            for &(p, l) in a.parts.as_deref().unwrap_or(&[(a.buf as usize, a.len)]) {
                if l > 0 {
                    // SAFETY: libfabric's contract: each entry holds `l` readable bytes for the
                    // call (checked non-null by `crate::data`).
                    msg.extend_from_slice(unsafe { std::slice::from_raw_parts(p as *const u8, l) });
                }
            }
        }
        let w: &weft::Comm = self.world.as_deref().expect("checked");
        // SAFETY: `msg` is weft-fi's own, kept in the op until weft is done with it (a Vec's
        // heap block does not move when the Vec does).
        let head = match unsafe { w.isend_raw(msg.as_ptr(), msg.len(), rank, CTRL, false) } {
            Ok(r) => r,
            Err(e) => return serr(code_of(&e)),
        };
        let body = match long {
            None => None,
            // SAFETY: the buffer is the application's until the completion this op reports
            // (libfabric's rule for fi_send); a long message is never an inject.
            Some(t) => match unsafe {
                let dc = self.data.as_ref().expect("checked");
                match a.parts.as_deref() {
                    None => dc.isend_raw(a.buf as *const u8, a.len, rank, t as i32, false),
                    Some(v) => {
                        let iov: Vec<(*const u8, usize)> =
                            v.iter().map(|&(p, l)| (p as *const u8, l)).collect();
                        dc.isendv_raw(&iov, rank, t as i32, false)
                    }
                }
            } {
                Ok(r) => Some(r),
                Err(e) => return serr(code_of(&e)),
            },
        };
        self.stats.sent += 1;
        let sent = What::Send { tagged: a.tagged };
        let quiet = body.is_some();
        self.dirty = true;
        self.ops.push(Op {
            req: head,
            ep,
            what: if quiet { What::Quiet } else { sent },
            ctx: a.ctx,
            report: report && !quiet,
            _owned: Some(msg),
            key: None,
        });
        if let Some(req) = body {
            self.ops.push(Op {
                req,
                ep,
                what: What::Send { tagged: a.tagged },
                ctx: a.ctx,
                report,
                _owned: None,
                key: None,
            });
        }
        0
    }

    /// The next tag of a long payload towards `rank` (bit 30 clear; long reads' data comes on
    /// tags with it set).
    pub(crate) fn long_tag(&mut self, rank: u32) -> u32 {
        let n = &mut self.next_long[rank as usize];
        let t = *n & 0x3fff_ffff;
        *n = n.wrapping_add(1);
        t
    }

    /// Post a receive (or, with `FI_PEEK`, look for a message; with `FI_CLAIM`, receive the
    /// message an earlier peek claimed).
    pub fn recv(&mut self, ep: usize, a: RecvArgs) -> isize {
        let Some(e) = self.eps.get(&ep) else {
            return serr(fi::FI_EINVAL);
        };
        if !e.enabled {
            return serr(fi::FI_EOPBADSTATE as u64);
        }
        let flags = a.flags.unwrap_or(e.rx_op_flags);
        if flags & fi::FI_MULTI_RECV != 0
            || (!a.tagged && flags & (fi::FI_PEEK | fi::FI_CLAIM | fi::FI_DISCARD) != 0)
        {
            return serr(fi::FI_ENOSYS);
        }
        if a.len > 0 && a.buf.is_null() && flags & (fi::FI_PEEK | fi::FI_DISCARD) == 0 {
            return serr(fi::FI_EINVAL);
        }
        let src = if a.src == fi::FI_ADDR_UNSPEC || !e.directed {
            None
        } else {
            match self.rank_at(e, a.src) {
                Some(r) => Some(r),
                None => return serr(fi::FI_EINVAL),
            }
        };
        let r = Recv {
            ep,
            buf: a.buf,
            len: a.len,
            parts: a.parts,
            src,
            tag: if a.tagged { a.tag } else { 0 },
            ignore: if a.tagged { a.ignore } else { 0 },
            ctx: a.ctx,
            report: !e.rx_selective || flags & fi::FI_COMPLETION != 0,
        };
        let kind = if a.tagged { fi::FI_TAGGED } else { fi::FI_MSG };
        if flags & fi::FI_PEEK != 0 {
            let claim = flags & fi::FI_CLAIM != 0;
            let found = self.queue(a.tagged).peek(&r, claim);
            let mut entry = Entry {
                ctx: a.ctx,
                flags: fi::FI_RECV | kind,
                ..Entry::default()
            };
            match found {
                Some((src, hdr)) => {
                    entry.fill(&hdr, src, hdr.len as usize);
                    if flags & fi::FI_DISCARD != 0 {
                        if let Some(m) = self.queue(a.tagged).take_unexpected(&r) {
                            self.discard(ep, m);
                        }
                    }
                }
                None => entry.err = fi::FI_ENOMSG,
            }
            self.report(ep, true, entry);
            return 0;
        }
        let found = if flags & fi::FI_CLAIM != 0 {
            match self.queue(a.tagged).take_claimed(a.ctx) {
                Some(m) => Some(m),
                None => return serr(fi::FI_EINVAL),
            }
        } else {
            self.queue(a.tagged).take_unexpected(&r)
        };
        match found {
            Some(m) if flags & fi::FI_DISCARD != 0 => {
                let mut entry = Entry {
                    ctx: a.ctx,
                    flags: fi::FI_RECV | kind,
                    ..Entry::default()
                };
                entry.fill(&m.hdr, m.src, 0);
                self.discard(ep, m);
                self.report(ep, true, entry);
            }
            Some(m) => self.deliver(r, m.src, m.hdr, &m.payload),
            None => self.queue(a.tagged).post(r),
        }
        0
    }

    /// A matched message into its receive: an inline payload is copied now; a long one is
    /// asked of weft, straight into the receive's buffer.
    fn deliver(&mut self, r: Recv, src: u32, hdr: Hdr, payload: &[u8]) {
        self.stats.received += 1;
        let kind = if hdr.tagged {
            fi::FI_TAGGED
        } else {
            fi::FI_MSG
        };
        let mut entry = Entry {
            ctx: r.ctx,
            flags: fi::FI_RECV | kind,
            buf: r.buf,
            ..Entry::default()
        };
        match hdr.long {
            None => {
                let n = payload.len().min(r.len);
                let mut rest = &payload[..n];
                for &(p, l) in r.parts.as_deref().unwrap_or(&[(r.buf as usize, r.len)]) {
                    let k = l.min(rest.len());
                    if k > 0 {
                        // SAFETY: libfabric's rule for fi_recv: each entry holds `l` >= k
                        // writable bytes and is the provider's until this completion is
                        // reported; `payload` is weft-fi's own bounce buffer, so they do not
                        // overlap.
                        unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), p as *mut u8, k) };
                    }
                    rest = &rest[k..];
                }
                entry.fill(&hdr, src, n);
                if n < payload.len() {
                    entry.err = fi::FI_ETRUNC as u64;
                    entry.olen = payload.len() - n;
                }
                self.count(r.ep, |c| c.recv, entry.err == 0);
                if r.report || entry.err != 0 {
                    self.report(r.ep, true, entry);
                }
            }
            Some(t) => {
                let Some(dc) = self.data.as_ref() else { return };
                // SAFETY: as above: the application's buffer of `r.len` bytes is weft's until
                // this op's completion is reported.
                let (from, tag) = (Source::Rank(src), TagSel::Tag(t as i32));
                match unsafe {
                    match r.parts.as_deref() {
                        None => dc.irecv_raw(r.buf as *mut u8, r.len, from, tag),
                        Some(v) => {
                            let iov: Vec<(*mut u8, usize)> =
                                v.iter().map(|&(p, l)| (p as *mut u8, l)).collect();
                            dc.irecvv_raw(&iov, from, tag)
                        }
                    }
                } {
                    Ok(req) => self.push_op(Op {
                        req,
                        ep: r.ep,
                        ctx: r.ctx,
                        report: r.report,
                        what: What::Recv {
                            tagged: hdr.tagged,
                            r,
                            hdr,
                            src,
                        },
                        _owned: None,
                        key: None,
                    }),
                    Err(e) => {
                        entry.fill(&hdr, src, 0);
                        entry.err = code_of(&e);
                        self.report(r.ep, true, entry);
                    }
                }
            }
        }
    }

    /// Drop an unexpected message (`FI_DISCARD`): a long one's data is received into nothing
    /// (weft truncates it), so its sender completes.
    fn discard(&mut self, ep: usize, m: Arrived) {
        if let Some(t) = m.hdr.long {
            self.discard_long(ep, m.src, t);
        }
    }

    /// Receive the long payload from `src` on tag `t` into nothing (weft truncates it), so
    /// that its sender finishes: a discarded message's, a refused remote write's.
    pub(crate) fn discard_long(&mut self, ep: usize, src: u32, t: u32) {
        let Some(dc) = self.data.as_ref() else {
            return;
        };
        // SAFETY: a receive of no bytes writes nothing.
        if let Ok(req) = unsafe {
            dc.irecv_raw(
                std::ptr::NonNull::<u8>::dangling().as_ptr(),
                0,
                Source::Rank(src),
                TagSel::Tag(t as i32),
            )
        } {
            self.push_op(Op::quiet(req, ep, None, None));
        }
    }

    /// Whether another operation may be posted (else the caller answers `-FI_EAGAIN`):
    /// at most twice an endpoint queue's size in flight, after a step of progress if full.
    pub(crate) fn has_room(&mut self) -> bool {
        let full = |g: &Global| g.ops.len() + g.rops.len() >= crate::info::QUEUE * 2;
        if full(self) {
            self.poll();
        }
        !full(self)
    }

    /// Cancel the receive posted with `ctx` on `ep`.
    pub fn cancel(&mut self, ep: usize, ctx: *mut c_void) -> isize {
        let hit = self
            .tagq
            .cancel(ep, ctx)
            .map(|r| (r, true))
            .or_else(|| self.msgq.cancel(ep, ctx).map(|r| (r, false)));
        match hit {
            Some((r, tagged)) => {
                self.report(
                    ep,
                    true,
                    Entry {
                        ctx: r.ctx,
                        flags: fi::FI_RECV | if tagged { fi::FI_TAGGED } else { fi::FI_MSG },
                        buf: r.buf,
                        err: fi::FI_ECANCELED,
                        ..Entry::default()
                    },
                );
                0
            }
            // Matched already (its data on the way) or never posted.
            None => serr(fi::FI_ENOENT),
        }
    }

    /// Take back the receives endpoint `ep` still has posted and make progress; how many of
    /// its operations weft still holds (their buffers are not the application's yet).
    pub fn drain_ep(&mut self, ep: usize) -> usize {
        self.tagq.drain_ep(ep);
        self.msgq.drain_ep(ep);
        if let Some(w) = self.world.as_ref() {
            // A long message's data already matched completes (or fails with its sender).
            for o in self.ops.iter().filter(|o| o.ep == ep) {
                if matches!(o.what, What::Recv { .. }) {
                    let _ = w.cancel_raw(&o.req);
                }
            }
        }
        self.poll();
        self.ops.iter().filter(|o| o.ep == ep).count()
            + self.rops.values().filter(|r| r.ep == ep).count()
    }

    /// One step of progress: arrived headers matched (in arrival order), finished operations
    /// onto their queues, receives that only a failed peer could match failed.
    pub fn poll(&mut self) {
        let Some(w) = self.world.as_ref() else {
            return;
        };
        let events = w.progress_events().unwrap_or(1);
        if events == 0 && !self.dirty && self.idle < LOOK_EVERY {
            // Nothing arrived or completed: the requests need no look (the cheap round of a
            // spinning fi_cq_read).
            self.idle += 1;
            return;
        }
        self.idle = 0;
        self.dirty = false;
        while let Some(b) = self.bounces.front_mut() {
            let Some(w) = self.world.as_ref() else { return };
            let res = match w.take_raw(&mut b.req) {
                Ok(Some(r)) => r,
                _ => break,
            };
            let b = self.bounces.pop_front().expect("front");
            if let Ok(st) = res {
                if !st.cancelled {
                    self.arrived(st.source, &b.buf[..st.bytes.min(b.buf.len())]);
                }
            }
            if self.post_bounce(b.buf).is_err() {
                break;
            }
        }
        self.finish_ops();
        self.check_failures();
    }

    /// A control message from `src`.
    fn arrived(&mut self, src: u32, msg: &[u8]) {
        if msg.first() == Some(&crate::rma::MAGIC) {
            return self.rma_arrived(src, msg);
        }
        let Some((hdr, payload)) = Hdr::decode(msg) else {
            eprintln!("weft-fi: a malformed message from rank {src} was dropped");
            return;
        };
        match self.queue(hdr.tagged).arrive(src, hdr.tag) {
            Some(r) => self.deliver(r, src, hdr, payload),
            None => self.queue(hdr.tagged).stash(Arrived {
                src,
                hdr,
                payload: payload.to_vec(),
                claimed: None,
            }),
        }
    }

    fn finish_ops(&mut self) {
        let mut i = 0;
        while i < self.ops.len() {
            let Some(w) = self.world.as_ref() else {
                return;
            };
            let r = match w.take_raw(&mut self.ops[i].req) {
                Ok(Some(r)) => r,
                Ok(None) => {
                    i += 1;
                    continue;
                }
                Err(_) => {
                    self.ops.swap_remove(i);
                    continue;
                }
            };
            let op = self.ops.swap_remove(i);
            self.finished(op, r);
        }
    }

    /// Report a finished operation (and keep its send buffer for the next sends).
    fn finished(&mut self, mut op: Op, r: weft::Result<weft::Status>) {
        // weft is done with the bytes: keep small buffers for the next sends.
        if let Some(b) = op._owned.take() {
            if b.capacity() <= HDR + EAGER && self.spare.len() < 64 {
                self.spare.push(b);
            }
        }
        let ok = matches!(&r, Ok(st) if !st.cancelled);
        match op.what {
            What::Part { id } => return self.part_done(id, &r),
            What::TargetIn { src, id, data } => return self.target_in_done(src, id, data, &r),
            What::Send { .. } => self.count(op.ep, |c| c.send, ok),
            What::Recv { .. } => self.count(op.ep, |c| c.recv, ok),
            What::Quiet => {}
        }
        if !op.report {
            return;
        }
        let mut e = Entry {
            ctx: op.ctx,
            ..Entry::default()
        };
        let rx = match &op.what {
            What::Quiet | What::Part { .. } | What::TargetIn { .. } => return,
            What::Send { tagged } => {
                e.flags = fi::FI_SEND | if *tagged { fi::FI_TAGGED } else { fi::FI_MSG };
                false
            }
            What::Recv {
                tagged,
                r,
                hdr,
                src,
            } => {
                e.flags = fi::FI_RECV | if *tagged { fi::FI_TAGGED } else { fi::FI_MSG };
                e.buf = r.buf;
                e.fill(hdr, *src, (hdr.len as usize).min(r.len));
                true
            }
        };
        match r {
            Ok(st) if st.cancelled => e.err = fi::FI_ECANCELED,
            Ok(_) => {}
            Err(err) => {
                e.err = code_of(&err);
                if let (Some((st, cap)), What::Recv { .. }) = (err.truncated(), &op.what) {
                    e.len = cap;
                    e.olen = st.bytes.saturating_sub(cap);
                }
            }
        }
        self.report(op.ep, rx, e);
    }

    /// Fail the posted receives only a newly failed peer could have matched (those from any
    /// source too, once no peer is left), with `FI_EIO`.
    fn check_failures(&mut self) {
        let Some(w) = self.world.as_ref() else {
            return;
        };
        let n = w.failed_peers();
        if n == self.failures_seen {
            return;
        }
        self.failures_seen = n;
        let size = w.size();
        let failed: Vec<u32> = (0..size).filter(|r| w.peer_failure(*r).is_some()).collect();
        let none_left = failed.len() as u32 + 1 >= size;
        self.fail_rma_to(&failed);
        for rank in failed {
            for tagged in [true, false] {
                let q = self.queue(tagged);
                q.forget_long_from(rank);
                for r in q.fail_source(rank, none_left) {
                    let e = Entry {
                        ctx: r.ctx,
                        flags: fi::FI_RECV | if tagged { fi::FI_TAGGED } else { fi::FI_MSG },
                        buf: r.buf,
                        err: fi::FI_EIO,
                        ..Entry::default()
                    };
                    self.report(r.ep, true, e);
                }
            }
        }
    }
}

impl Entry {
    /// A receive's fields from the message's header.
    fn fill(&mut self, hdr: &Hdr, src: u32, len: usize) {
        self.len = len;
        self.tag = if hdr.tagged { hdr.tag } else { 0 };
        self.src = Some(src);
        if let Some(d) = hdr.data {
            self.data = d;
            self.flags |= fi::FI_REMOTE_CQ_DATA;
        }
    }
}

impl Default for Entry {
    fn default() -> Self {
        Entry {
            ctx: NULL,
            flags: 0,
            len: 0,
            buf: NULL,
            tag: 0,
            data: 0,
            src: None,
            err: 0,
            olen: 0,
        }
    }
}

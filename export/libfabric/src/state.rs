//! The process's weft world and what libfabric's objects hold, behind one lock.
//!
//! Objects are never freed (a closed one is only marked dead), so a call through a closed
//! object's pointer reaches weft-fi and gets `-FI_EINVAL` instead of reading freed memory.
//! All mutable state lives here, keyed by the object's address: the objects themselves are
//! written once, when they are made.

use crate::info::TAG_BITS;
use crate::{serr, NULL};
use std::collections::{HashMap, HashSet, VecDeque};
use std::os::raw::c_void;
use std::sync::Mutex;
use weft::{RawRequest, Source, Status, TagSel};
use weft_ofi_sys as fi;

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
}

/// One operation in flight.
pub struct Op {
    req: RawRequest,
    ep: usize,
    recv: bool,
    tagged: bool,
    ctx: *mut c_void,
    buf: *mut c_void,
    /// Report to the queue (false: inject, or a selective completion not asked for).
    report: bool,
    /// The copy an inject sends from, kept until weft is done with it.
    _owned: Option<Vec<u8>>,
}

/// A receive posted before the job met.
struct Deferred {
    ep: usize,
    tagged: bool,
    buf: *mut c_void,
    len: usize,
    sel: TagSel,
    ctx: *mut c_void,
    report: bool,
}

/// The world and the objects, for one process.
pub struct Global {
    /// The job this process belongs to, from the domain's opening on: enough to name the
    /// process; the provider opens (collectively) when the first peer address is inserted.
    boot: Option<Pending>,
    /// (rank, size) in the job.
    me: (u32, u32),
    world: Option<weft::World>,
    /// A communicator of its own for `FI_MSG`, so untagged messages never match tagged ones.
    msg: Option<weft::Comm>,
    pub domain: String,
    job: u64,
    pub live: HashSet<usize>,
    pub eps: HashMap<usize, Ep>,
    pub cqs: HashMap<usize, Cq>,
    pub avs: HashMap<usize, Av>,
    ops: Vec<Op>,
    deferred: Vec<Deferred>,
}

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

struct Cell(Option<Global>);

// SAFETY: the world holds `Rc`s and raw pointers and is not `Send`; every access goes through
// `STATE`'s mutex, which serialises it and orders it between threads, and nothing obtained
// from it (no `Rc`, no `Comm`) leaves a `with` call.
unsafe impl Send for Cell {}

static STATE: Mutex<Cell> = Mutex::new(Cell(None));

/// Run `f` on the process's state (made on first use).
pub fn with<T>(f: impl FnOnce(&mut Global) -> T) -> T {
    let mut g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let g = g.0.get_or_insert_with(|| Global {
        boot: None,
        me: (0, 0),
        world: None,
        msg: None,
        domain: String::new(),
        job: 0,
        live: HashSet::new(),
        eps: HashMap::new(),
        cqs: HashMap::new(),
        avs: HashMap::new(),
        ops: Vec::new(),
        deferred: Vec::new(),
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
fn code_of(e: &weft::Error) -> u64 {
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
    /// inserted, when each process has its endpoint and has handed its name on.
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
        let msg = world.dup().map_err(|e| {
            eprintln!("weft-fi: {e}");
            fi::FI_EOTHER as u64
        })?;
        self.world = Some(world);
        self.msg = Some(msg);
        for d in std::mem::take(&mut self.deferred) {
            let r = self.post_recv(
                d.ep,
                d.tagged,
                d.buf,
                d.len,
                Source::Any,
                d.sel,
                d.ctx,
                d.report,
            );
            if r != 0 {
                self.fail_deferred(&d, (-r) as u64);
            }
        }
        Ok(())
    }

    /// An error entry on its endpoint's receive queue for a deferred receive that will not run.
    fn fail_deferred(&mut self, d: &Deferred, err: u64) {
        if let Some(q) = self
            .eps
            .get(&d.ep)
            .map(|e| e.rx_cq)
            .and_then(|c| self.cqs.get_mut(&c))
        {
            q.err.push_back(Entry {
                ctx: d.ctx,
                flags: fi::FI_RECV | if d.tagged { fi::FI_TAGGED } else { fi::FI_MSG },
                len: 0,
                buf: d.buf,
                tag: 0,
                src: None,
                err,
                olen: 0,
            });
        }
    }

    /// Finalize the world. Receives still posted (an endpoint whose close gave up, or one
    /// never closed) are cancelled and given a bounded time to finish first, so that no late
    /// message lands in a buffer the application may free once the domain is closed.
    pub fn close_world(&mut self) {
        let eps: Vec<usize> = self.ops.iter().map(|o| o.ep).collect();
        let t0 = std::time::Instant::now();
        for ep in eps {
            while self.drain_ep(ep) > 0 && t0.elapsed() < std::time::Duration::from_secs(10) {
                std::thread::yield_now();
            }
        }
        self.ops.clear();
        self.msg = None;
        if let Some(w) = self.world.take() {
            if let Err(e) = w.finalize() {
                eprintln!("weft-fi: finalize: {e}");
            }
        }
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
    fn rank_at(&self, ep: &Ep, addr: u64) -> Option<u32> {
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

    /// Post a send. `inject`: copy the data now and report nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &mut self,
        ep: usize,
        tagged: bool,
        buf: *const c_void,
        len: usize,
        dest: u64,
        tag: u64,
        ctx: *mut c_void,
        flags: Option<u64>,
        inject: bool,
    ) -> isize {
        if self.ops.len() >= crate::info::QUEUE * 2 {
            self.poll();
            if self.ops.len() >= crate::info::QUEUE * 2 {
                return serr(fi::FI_EAGAIN);
            }
        }
        let Some(e) = self.eps.get(&ep) else {
            return serr(fi::FI_EINVAL);
        };
        if !e.enabled {
            return serr(fi::FI_EOPBADSTATE as u64);
        }
        if tag & !TAG_BITS != 0 {
            return serr(fi::FI_EINVAL);
        }
        if inject && len > crate::info::INJECT {
            return serr(fi::FI_EMSGSIZE);
        }
        let Some(rank) = self.rank_at(e, dest) else {
            return serr(fi::FI_EINVAL);
        };
        let flags = flags.unwrap_or(e.tx_op_flags);
        let report = !inject
            && flags & fi::FI_INJECT == 0
            && (!e.tx_selective || flags & fi::FI_COMPLETION != 0);
        let owned = (inject || flags & fi::FI_INJECT != 0).then(|| {
            if len == 0 || buf.is_null() {
                Vec::new()
            } else {
                // SAFETY: libfabric's contract: `buf` holds `len` readable bytes for the call.
                unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec()
            }
        });
        let ptr = owned.as_ref().map_or(buf as *const u8, |v| v.as_ptr());
        let comm: &weft::Comm = match if tagged {
            self.world.as_deref()
        } else {
            self.msg.as_ref()
        } {
            Some(c) => c,
            // No address inserted yet: no peer to send to.
            None => return serr(fi::FI_EINVAL),
        };
        // SAFETY: the buffer is the application's until the completion this op reports
        // (libfabric's rule for fi_send), or our own copy, kept in the op until weft is done.
        let req = match unsafe { comm.isend_raw(ptr, len, rank, tag as i32, false) } {
            Ok(r) => r,
            Err(e) => return serr(code_of(&e)),
        };
        self.ops.push(Op {
            req,
            ep,
            recv: false,
            tagged,
            ctx,
            buf: buf as *mut c_void,
            report,
            _owned: owned,
        });
        0
    }

    /// Post a receive.
    #[allow(clippy::too_many_arguments)]
    pub fn recv(
        &mut self,
        ep: usize,
        tagged: bool,
        buf: *mut c_void,
        len: usize,
        src: u64,
        tag: u64,
        ignore: u64,
        ctx: *mut c_void,
        flags: Option<u64>,
    ) -> isize {
        let Some(e) = self.eps.get(&ep) else {
            return serr(fi::FI_EINVAL);
        };
        if !e.enabled {
            return serr(fi::FI_EOPBADSTATE as u64);
        }
        let flags = flags.unwrap_or(e.rx_op_flags);
        if flags & (fi::FI_PEEK | fi::FI_CLAIM | fi::FI_DISCARD | fi::FI_MULTI_RECV) != 0 {
            return serr(fi::FI_ENOSYS);
        }
        let sel = if !tagged || ignore & TAG_BITS == 0 {
            if tag & !TAG_BITS != 0 {
                return serr(fi::FI_EINVAL);
            }
            TagSel::Tag(if tagged { tag as i32 } else { 0 })
        } else if ignore & TAG_BITS == TAG_BITS {
            TagSel::Any
        } else {
            // A partial ignore mask: weft matches whole tags or any tag.
            return serr(fi::FI_EINVAL);
        };
        let source = if src == fi::FI_ADDR_UNSPEC || !e.directed {
            Source::Any
        } else {
            match self.rank_at(e, src) {
                Some(r) => Source::Rank(r),
                None => return serr(fi::FI_EINVAL),
            }
        };
        let report = !e.rx_selective || flags & fi::FI_COMPLETION != 0;
        if self.world.is_none() {
            // Before the job has met (no address inserted yet): posted when it does.
            self.deferred.push(Deferred {
                ep,
                tagged,
                buf,
                len,
                sel,
                ctx,
                report,
            });
            return 0;
        }
        self.post_recv(ep, tagged, buf, len, source, sel, ctx, report)
    }

    #[allow(clippy::too_many_arguments)]
    fn post_recv(
        &mut self,
        ep: usize,
        tagged: bool,
        buf: *mut c_void,
        len: usize,
        source: Source,
        sel: TagSel,
        ctx: *mut c_void,
        report: bool,
    ) -> isize {
        let comm: &weft::Comm = if tagged {
            self.world.as_deref()
        } else {
            self.msg.as_ref()
        }
        .expect("posted only once the job has met");
        // SAFETY: libfabric's rule for fi_recv: the buffer is the provider's until the
        // operation's completion (or its cancellation's) is reported.
        let req = match unsafe { comm.irecv_raw(buf as *mut u8, len, source, sel) } {
            Ok(r) => r,
            Err(e) => return serr(code_of(&e)),
        };
        self.ops.push(Op {
            req,
            ep,
            recv: true,
            tagged,
            ctx,
            buf,
            report,
            _owned: None,
        });
        0
    }

    /// Cancel the receive posted with `ctx` on `ep`.
    pub fn cancel(&mut self, ep: usize, ctx: *mut c_void) -> isize {
        if let Some(i) = self
            .deferred
            .iter()
            .position(|d| d.ep == ep && d.ctx == ctx && ctx != NULL)
        {
            let d = self.deferred.remove(i);
            self.fail_deferred(&d, fi::FI_ECANCELED);
            return 0;
        }
        let Some(w) = self.world.as_ref() else {
            return serr(fi::FI_ENOENT);
        };
        match self
            .ops
            .iter()
            .find(|o| o.ep == ep && o.recv && o.ctx == ctx && ctx != NULL)
        {
            Some(o) => match w.cancel_raw(&o.req) {
                Ok(()) => 0,
                Err(e) => serr(code_of(&e)),
            },
            None => serr(fi::FI_ENOENT),
        }
    }

    /// Cancel the receives endpoint `ep` still has posted and make progress; how many of its
    /// operations weft still holds (their buffers are not the application's yet).
    pub fn drain_ep(&mut self, ep: usize) -> usize {
        self.deferred.retain(|d| d.ep != ep);
        if let Some(w) = self.world.as_ref() {
            for o in self.ops.iter().filter(|o| o.ep == ep && o.recv) {
                let _ = w.cancel_raw(&o.req);
            }
        }
        self.poll();
        self.ops.iter().filter(|o| o.ep == ep).count()
    }

    /// One step of progress, and every finished operation onto its queue.
    pub fn poll(&mut self) {
        let Some(w) = self.world.as_ref() else {
            return;
        };
        let _ = w.progress();
        let mut done = vec![];
        let mut i = 0;
        while i < self.ops.len() {
            match w.take_raw(&mut self.ops[i].req) {
                Ok(Some(r)) => done.push((self.ops.remove(i), r)),
                Ok(None) => i += 1,
                Err(_) => {
                    self.ops.remove(i);
                }
            }
        }
        for (op, r) in done {
            if !op.report {
                continue;
            }
            let Some(ep) = self.eps.get(&op.ep) else {
                continue;
            };
            let cq = if op.recv { ep.rx_cq } else { ep.tx_cq };
            let Some(q) = self.cqs.get_mut(&cq) else {
                continue;
            };
            let kind = if op.tagged { fi::FI_TAGGED } else { fi::FI_MSG };
            let dir = if op.recv { fi::FI_RECV } else { fi::FI_SEND };
            let mut e = Entry {
                ctx: op.ctx,
                flags: kind | dir,
                len: 0,
                buf: if op.recv { op.buf } else { NULL },
                tag: 0,
                src: None,
                err: 0,
                olen: 0,
            };
            match r {
                Ok(Status {
                    cancelled: true, ..
                }) => {
                    e.err = fi::FI_ECANCELED;
                    q.err.push_back(e);
                }
                Ok(st) => {
                    if op.recv {
                        e.len = st.bytes;
                        e.tag = if op.tagged { st.tag as u64 } else { 0 };
                        e.src = Some(st.source);
                    }
                    q.ok.push_back(e);
                }
                Err(err) => {
                    e.err = code_of(&err);
                    if let Some((st, cap)) = err.truncated() {
                        e.len = cap;
                        e.olen = st.bytes.saturating_sub(cap);
                        e.tag = if op.tagged { st.tag as u64 } else { 0 };
                        e.src = Some(st.source);
                    }
                    q.err.push_back(e);
                }
            }
        }
    }
}

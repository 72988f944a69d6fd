//! `loopback`: ranks as threads of one process.
//!
//! The reference provider of the contract, and the engine of in-process test worlds
//! (`weft-testing`). Each rank has a bounded mailbox; `am_send` copies header and payload into
//! it (or reports `Busy` when it is full) and `progress` delivers the mailbox in order. A rank
//! whose provider is dropped is reported failed to the others once its messages have been
//! delivered.
//!
//! Every optional part of the contract can be switched on, so that the core's use of each is
//! tested without the hardware it is made for (all off by default):
//! * `WEFT_LOOPBACK_RMA=1` — registration and RMA reads and writes (bounds-, key- and
//!   rights-checked copies between threads): the zero-copy rendezvous and native windows;
//! * `WEFT_LOOPBACK_ZCOPY=1` — zero-copy active messages: the receiver copies the payload
//!   straight out of the sender's buffer, and the sender's token completes after that;
//! * `WEFT_LOOPBACK_MR_LOCAL=1` — descriptors required on every local buffer (`FI_MR_LOCAL`):
//!   an operation whose buffer is not described by a local registration is refused;
//! * `WEFT_LOOPBACK_COMPLETION=transmit` — writes complete when their data is copied out, and
//!   land at the target only at its second `progress` after issue (so later messages
//!   overtake them) or before a fenced operation from the same origin; remote
//!   completion data (`rma_write_data`) comes with it;
//! * `WEFT_LOOPBACK_LAZY=1` — connections are made on first use: addresses are looked up in
//!   the bootstrap's key-value space then, sends wait until the connection is up, and RMA
//!   reads and zero-copy sends towards a peer are offered only once it is;
//! * `WEFT_LOOPBACK_ATOMICS=hca` — an HCA's atomics: 8-byte fetch-and-add and
//!   compare-and-swap on `i64`, one element per call, on 8-byte aligned addresses.

mod rma;

use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use weft_provider::bootstrap::{Bootstrap, KvSpace};
use weft_provider::provider::{
    Access, AtomicOp, Caps, CntrId, CntrValue, Completed, Completion, CompletionLevel,
    CompletionTable, ConnEvent, MemRegion, PeerCaps, ProbeContext, Provider, RawIov, RawIovMut,
    RemoteAddr, RmaCaps, SendOutcome, Sink, StaticProvider, Token,
};
use weft_provider::types::{AtomicTable, BasicType, Op, Rank};
use weft_provider::{Error, ErrorDetail, Result};

weft_provider::param!(EAGER: Size = "loopback", "EAGER", "16K",
    "largest active-message payload (the eager limit) of the loopback provider");
weft_provider::param!(DEPTH: Uint = "loopback", "DEPTH", "4096",
    "messages a loopback mailbox holds before senders see Busy");
weft_provider::param!(RMA: Bool = "loopback", "RMA", "0",
    "let the loopback provider register memory and do RMA reads and writes (tests the zero-copy rendezvous and native windows)");
weft_provider::param!(COUNTERS: Bool = "loopback", "COUNTERS", "1",
    "with WEFT_LOOPBACK_RMA, offer completion counters (0: CQ entries only, the core counts)");
weft_provider::param!(ZCOPY: Bool = "loopback", "ZCOPY", "0",
    "zero-copy active messages above WEFT_LOOPBACK_INJECT bytes (the receiver copies from the sender's buffer)");
weft_provider::param!(INJECT: Size = "loopback", "INJECT", "256",
    "with WEFT_LOOPBACK_ZCOPY, payloads up to this size are copied at send (the inject size)");
weft_provider::param!(MR_LOCAL: Bool = "loopback", "MR_LOCAL", "0",
    "require a local descriptor on every buffer handed to the provider, like FI_MR_LOCAL (implies registration)");
weft_provider::param!(COMPLETION: Enum(&["delivery", "transmit"]) = "loopback", "COMPLETION", "delivery",
    "with WEFT_LOOPBACK_RMA, when writes complete: delivery (visible at the target) or transmit (land at the target's second progress after issue, so later messages overtake them, or before a fenced operation; adds remote completion data)");
weft_provider::param!(LAZY: Bool = "loopback", "LAZY", "0",
    "connect to each peer on first use (addresses from the key-value space; RMA reads and zero-copy only once connected)");
weft_provider::param!(ATOMICS: Enum(&["none", "hca"]) = "loopback", "ATOMICS", "none",
    "with WEFT_LOOPBACK_RMA, native atomics: none, or an HCA's (fetch-and-add and compare-and-swap on one aligned i64)");

/// Settings of a loopback world.
#[derive(Debug, Clone)]
pub struct LoopbackConfig {
    pub eager: usize,
    pub depth: usize,
    pub rma: bool,
    /// With `rma`: offer completion counters.
    pub counters: bool,
    /// Zero-copy active messages above `inject` bytes.
    pub zcopy: bool,
    pub inject: usize,
    /// Require local descriptors (`Caps::mr_local`).
    pub mr_local: bool,
    /// With `rma`: writes complete at transmission (and remote completion data is offered).
    pub transmit: bool,
    /// Connect on first use.
    pub lazy: bool,
    /// With `rma`: an HCA's atomics.
    pub hca_atomics: bool,
    /// With `rma`: offer peers writes but not reads (`PeerCaps`), so that the core's
    /// rendezvous writes into the receiver's buffer instead of reading the sender's.
    pub write_rndv: bool,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        LoopbackConfig {
            eager: 16 * 1024,
            depth: 4096,
            rma: false,
            counters: true,
            zcopy: false,
            inject: 256,
            mr_local: false,
            transmit: false,
            lazy: false,
            hca_atomics: false,
            write_rndv: false,
        }
    }
}

impl LoopbackConfig {
    pub fn from_env() -> Result<Self> {
        Ok(LoopbackConfig {
            eager: EAGER.get_size()?.max(1),
            depth: (DEPTH.get_u64()? as usize).max(1),
            rma: RMA.get_bool()?,
            counters: COUNTERS.get_bool()?,
            zcopy: ZCOPY.get_bool()?,
            inject: INJECT.get_size()?,
            mr_local: MR_LOCAL.get_bool()?,
            transmit: COMPLETION.get_enum()? == "transmit",
            lazy: LAZY.get_bool()?,
            hca_atomics: ATOMICS.get_enum()? == "hca",
            write_rndv: false,
        })
    }

    /// Everything contract 2 adds, switched on (for tests of the core's use of it).
    pub fn contract2() -> Self {
        LoopbackConfig {
            rma: true,
            zcopy: true,
            mr_local: true,
            transmit: true,
            lazy: true,
            hca_atomics: true,
            ..Default::default()
        }
    }

    fn caps(&self) -> Caps {
        let mut caps = Caps::am_only(128, self.eager, 16);
        caps.spans_processes = false;
        if self.rma {
            caps.rma = Some(RmaCaps {
                read: true,
                write: true,
                max_iov: 16,
                scalable_keys: true,
                alloc: false,
                native_locks: false,
                user_memory: true,
                completion: if self.transmit {
                    CompletionLevel::Transmit
                } else {
                    CompletionLevel::Delivery
                },
                // Copies between threads, or (transmit) pending writes drained first.
                fence: true,
                cq_data_size: if self.transmit { 4 } else { 0 },
                rndv_only: false,
            });
            caps.counters = self.counters;
            if self.hca_atomics {
                let mut t = AtomicTable::NONE;
                t.set(Op::Sum, BasicType::I64, true);
                t.set(Op::Cswap, BasicType::I64, true);
                caps.atomics = t;
                caps.atomic_max_count = 1;
            }
        }
        caps.am_isend = self.zcopy;
        caps.inject_size = if self.zcopy { self.inject } else { 0 };
        caps.mr_local = self.mr_local;
        caps.lazy_connect = self.lazy;
        caps.per_peer = self.lazy || (self.rma && self.write_rndv);
        caps
    }
}

/// A zero-copy payload: pieces of the sender's memory, valid until its token completes.
struct Zc {
    pieces: SmallVec<[(usize, usize); 4]>,
    token: Token,
}

struct Msg {
    src: Rank,
    hdr: SmallVec<[u8; 64]>,
    /// Small payloads stay inline (no allocation per message).
    data: SmallVec<[u8; 64]>,
    /// Boxed: only large zero-copy messages carry one, and a small `Msg` moves cheaply.
    zc: Option<Box<Zc>>,
}

#[derive(Default)]
struct Mailbox {
    q: Mutex<VecDeque<Msg>>,
    len: AtomicUsize,
}

struct Fabric {
    boxes: Vec<Mailbox>,
    alive: Vec<AtomicBool>,
    deaths: AtomicU64,
    /// Registered memory by (owner rank, key).
    regions: Mutex<HashMap<(Rank, u64), rma::Region>>,
    next_key: AtomicU64,
    /// Zero-copy tokens each rank's receivers finished with (or could not deliver).
    zc_done: Vec<Mutex<Vec<(Token, bool)>>>,
    /// Writes on their way to each rank (transmit completion), and the completion data
    /// each rank has to be told about.
    incoming: Vec<Mutex<rma::Incoming>>,
    /// HCA atomics are atomic only among themselves: one lock for the fabric.
    atomics: Mutex<()>,
}

fn fabrics() -> &'static Mutex<HashMap<String, Weak<Fabric>>> {
    static F: std::sync::OnceLock<Mutex<HashMap<String, Weak<Fabric>>>> =
        std::sync::OnceLock::new();
    F.get_or_init(Default::default)
}

/// Connection state towards one peer (`WEFT_LOOPBACK_LAZY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conn {
    /// `connect` was not called.
    None,
    /// Connecting: up after this many more `progress` rounds.
    Pending(u8),
    Up,
}

/// The loopback provider of one rank.
pub struct Loopback {
    fab: Arc<Fabric>,
    rank: Rank,
    size: u32,
    caps: Caps,
    depth: usize,
    seen_deaths: u64,
    reported: Vec<bool>,
    done: CompletionTable,
    inbox: VecDeque<Msg>,
    scratch: Vec<u8>,
    lazy: bool,
    /// `LoopbackConfig::write_rndv`.
    write_rndv: bool,
    conn: Vec<Conn>,
    /// Connections that came up, to report from `progress`.
    up: Vec<Rank>,
    kv: Option<Arc<dyn KvSpace>>,
    stats: Stats,
}

/// What this rank's provider carried ([`Provider::counters`]).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) am_send: u64,
    pub(crate) am_isend: u64,
    pub(crate) rma_read: u64,
    pub(crate) rma_write: u64,
    pub(crate) write_data: u64,
    pub(crate) fenced: u64,
    pub(crate) atomics: u64,
    pub(crate) connects: u64,
}

impl Loopback {
    /// Open with explicit settings (tests); [`StaticProvider::open`] reads the environment.
    pub fn open_with(boot: &mut dyn Bootstrap, cfg: &LoopbackConfig) -> Result<Self> {
        let size = boot.size();
        let fab = {
            let mut reg = fabrics().lock().unwrap_or_else(|e| e.into_inner());
            reg.retain(|_, w| w.strong_count() > 0);
            let key = boot.job_id().to_string();
            match reg.get(&key).and_then(|w| w.upgrade()) {
                Some(f) => f,
                None => {
                    let f = Arc::new(Fabric {
                        boxes: (0..size).map(|_| Mailbox::default()).collect(),
                        alive: (0..size).map(|_| AtomicBool::new(true)).collect(),
                        deaths: AtomicU64::new(0),
                        regions: Mutex::new(HashMap::new()),
                        next_key: AtomicU64::new(1),
                        zc_done: (0..size).map(|_| Mutex::default()).collect(),
                        incoming: (0..size).map(|_| Mutex::default()).collect(),
                        atomics: Mutex::new(()),
                    });
                    reg.insert(key, Arc::downgrade(&f));
                    f
                }
            }
        };
        if fab.boxes.len() != size as usize {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "loopback job '{}' exists with another size",
                boot.job_id()
            ))));
        }
        let rank = boot.rank();
        // A lazily connecting rank publishes its "address" now and reads a peer's only when
        // it first talks to it.
        let kv = if cfg.lazy {
            boot.put(&format!("loopback.addr.{rank}"), &format!("mailbox-{rank}"))?;
            Some(boot.kv().ok_or_else(|| {
                Error::from(ErrorDetail::Unsupported(
                    "WEFT_LOOPBACK_LAZY needs a bootstrap that keeps its key-value space".into(),
                ))
            })?)
        } else {
            None
        };
        // Everyone holds the fabric (and published its address) before anyone can drop it.
        boot.fence()?;
        let mut conn = vec![if cfg.lazy { Conn::None } else { Conn::Up }; size as usize];
        // Talking to oneself needs no connection.
        conn[rank as usize] = Conn::Up;
        Ok(Loopback {
            fab,
            rank,
            size,
            caps: cfg.caps(),
            depth: cfg.depth,
            seen_deaths: 0,
            reported: vec![false; size as usize],
            done: CompletionTable::default(),
            inbox: VecDeque::new(),
            scratch: Vec::new(),
            lazy: cfg.lazy,
            write_rndv: cfg.write_rndv,
            conn,
            up: Vec::new(),
            kv,
            stats: Stats::default(),
        })
    }

    /// Connections come up one progress round after they were asked for.
    fn connections_up(&mut self, sink: &mut dyn Sink) -> usize {
        for r in 0..self.size as usize {
            if let Conn::Pending(k) = self.conn[r] {
                self.conn[r] = if k <= 1 {
                    Conn::Up
                } else {
                    Conn::Pending(k - 1)
                };
                if self.conn[r] == Conn::Up {
                    self.up.push(r as Rank);
                }
            }
        }
        let n = self.up.len();
        for r in self.up.drain(..) {
            sink.connection(r, ConnEvent::Connected);
        }
        n
    }

    /// Zero-copy sends whose receivers finished with them (or could not take them).
    fn zero_copy_done(&mut self, sink: &mut dyn Sink) -> usize {
        let zc: Vec<(Token, bool)> = std::mem::take(
            &mut *self.fab.zc_done[self.rank as usize]
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        let n = zc.len();
        for (t, ok) in zc {
            let r = if ok {
                Ok(Completed::Done)
            } else {
                Err(Error::peer_failed(
                    self.rank,
                    "the receiver exited before reading a zero-copy message",
                ))
            };
            sink.complete(t, r);
        }
        n
    }

    /// Checks every send shares: a live peer of this job, a connection, room in its mailbox.
    fn sendable(&self, dest: Rank, header: &[u8], total: usize) -> Result<Option<&Mailbox>> {
        let mb = self.fab.boxes.get(dest as usize).ok_or_else(|| {
            Error::from(ErrorDetail::InvalidRank {
                rank: dest as i64,
                size: self.size,
            })
        })?;
        if !self.fab.alive[dest as usize].load(Ordering::Acquire) {
            return Err(Error::peer_failed(dest, "rank exited"));
        }
        match self.conn[dest as usize] {
            Conn::Up => {}
            Conn::Pending(_) => return Ok(None),
            Conn::None => {
                return Err(Error::invalid(format!(
                    "loopback: send to rank {dest} before connect() was called for it"
                )))
            }
        }
        if header.len() > self.caps.max_am_header {
            return Err(Error::invalid("active-message header too long"));
        }
        if total > self.caps.max_am_payload {
            return Err(Error::invalid("active-message payload too long"));
        }
        if mb.len.load(Ordering::Acquire) >= self.depth {
            return Ok(None);
        }
        Ok(Some(mb))
    }

    fn post(mb: &Mailbox, msg: Msg) {
        let mut q = mb.q.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back(msg);
        mb.len.store(q.len(), Ordering::Release);
    }

    /// Deliver one message; a zero-copy one is copied out of its sender's buffer, and the
    /// sender told its token is done.
    fn deliver(&mut self, m: Msg, sink: &mut dyn Sink) {
        match m.zc {
            None => sink.am(m.src, &m.hdr, &m.data),
            Some(zc) => {
                self.scratch.clear();
                for (p, l) in &zc.pieces {
                    // SAFETY: the sender keeps these bytes valid and unmodified until its
                    // token completes, which happens only below, after this copy.
                    self.scratch.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(*p as *const u8, *l)
                    });
                }
                sink.am(m.src, &m.hdr, &self.scratch);
                let mut d = self.fab.zc_done[m.src as usize]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                d.push((zc.token, true));
            }
        }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.fab.alive[self.rank as usize].store(false, Ordering::Release);
        // Zero-copy messages that will never be read: their senders get their tokens back
        // (failed) instead of waiting for them.
        let undelivered: Vec<Msg> = {
            let mut q = self.fab.boxes[self.rank as usize]
                .q
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            q.drain(..).collect()
        };
        for m in undelivered.into_iter().chain(self.inbox.drain(..)) {
            if let Some(zc) = m.zc {
                let mut d = self.fab.zc_done[m.src as usize]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                d.push((zc.token, false));
            }
        }
        self.fab.deaths.fetch_add(1, Ordering::AcqRel);
        let mut regs = self.fab.regions.lock().unwrap_or_else(|e| e.into_inner());
        regs.retain(|k, _| k.0 != self.rank);
    }
}

impl Provider for Loopback {
    fn name(&self) -> &str {
        "loopback"
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        self.rank
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
        let total: usize = payload.iter().map(|s| s.len()).sum();
        let Some(mb) = self.sendable(dest, header, total)? else {
            return Ok(SendOutcome::Busy);
        };
        let mut data = SmallVec::with_capacity(total);
        for s in payload {
            data.extend_from_slice(s);
        }
        let msg = Msg {
            src: self.rank,
            hdr: SmallVec::from_slice(header),
            data,
            zc: None,
        };
        Self::post(mb, msg);
        self.stats.am_send += 1;
        Ok(SendOutcome::Sent)
    }

    unsafe fn am_isend(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[RawIov],
        token: Token,
    ) -> Result<SendOutcome> {
        if !self.caps.am_isend {
            return Err(Error::from(ErrorDetail::Unsupported(
                "loopback zero-copy is off (WEFT_LOOPBACK_ZCOPY)".into(),
            )));
        }
        if self.lazy && !matches!(self.conn[dest as usize], Conn::Up) {
            return Err(Error::invalid(
                "loopback: zero-copy send before the connection is up (its peer caps say no)",
            ));
        }
        self.check_descs(
            payload.iter().map(|p| (p.ptr as usize, p.len, p.desc)),
            false,
        )?;
        let total: usize = payload.iter().map(|s| s.len).sum();
        let Some(mb) = self.sendable(dest, header, total)? else {
            return Ok(SendOutcome::Busy);
        };
        let msg = Msg {
            src: self.rank,
            hdr: SmallVec::from_slice(header),
            data: SmallVec::new(),
            zc: Some(Box::new(Zc {
                pieces: payload.iter().map(|p| (p.ptr as usize, p.len)).collect(),
                token,
            })),
        };
        Self::post(mb, msg);
        self.stats.am_isend += 1;
        Ok(SendOutcome::Sent)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = self.done.deliver(sink);
        // (Each optional part costs nothing per call when it is off.)
        if self.lazy {
            n += self.connections_up(sink);
        }
        if self.caps.rma.is_some() {
            n += self.apply_incoming(sink);
        }
        if self.caps.am_isend {
            n += self.zero_copy_done(sink);
        }
        let mb = &self.fab.boxes[self.rank as usize];
        if mb.len.load(Ordering::Acquire) > 0 {
            {
                let mut q = mb.q.lock().unwrap_or_else(|e| e.into_inner());
                std::mem::swap(&mut *q, &mut self.inbox);
                mb.len.store(0, Ordering::Release);
            }
            while let Some(m) = self.inbox.pop_front() {
                self.deliver(m, sink);
                n += 1;
            }
        } else {
            // Report ranks that exited, once everything they sent has been delivered. Order
            // matters: first learn who is dead (acquire, which makes everything they sent
            // visible), then check the mailbox; a message that raced with our first look is
            // delivered by the next call, and the deaths are reported after it.
            let d = self.fab.deaths.load(Ordering::Acquire);
            if d != self.seen_deaths {
                let dead: Vec<Rank> = (0..self.size)
                    .filter(|r| {
                        !self.reported[*r as usize]
                            && !self.fab.alive[*r as usize].load(Ordering::Acquire)
                    })
                    .collect();
                if mb.len.load(Ordering::Acquire) == 0 {
                    self.seen_deaths = d;
                    for r in dead {
                        self.reported[r as usize] = true;
                        sink.peer_failed(r, "rank exited");
                        n += 1;
                    }
                }
            }
        }
        Ok(n)
    }

    fn connect(&mut self, peer: Rank) -> Result<()> {
        if !self.lazy || self.conn.get(peer as usize) != Some(&Conn::None) {
            return Ok(());
        }
        let kv = self.kv.as_ref().expect("kept at open when lazy");
        match kv.get(&format!("loopback.addr.{peer}"))? {
            Some(a) if a == format!("mailbox-{peer}") => {
                self.conn[peer as usize] = Conn::Pending(2);
                self.stats.connects += 1;
                Ok(())
            }
            other => Err(Error::from(ErrorDetail::Bootstrap(format!(
                "loopback: rank {peer} published no address (found {other:?})"
            )))),
        }
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats;
        vec![
            ("am_send", s.am_send),
            ("am_isend", s.am_isend),
            ("rma_read", s.rma_read),
            ("rma_write", s.rma_write),
            ("rma_write_data", s.write_data),
            ("fenced", s.fenced),
            ("atomics", s.atomics),
            ("connects", s.connects),
        ]
    }

    fn peer_caps(&self, peer: Rank) -> Option<PeerCaps> {
        let write_rndv = self.write_rndv && self.caps.rma.is_some();
        if !self.lazy || self.conn.get(peer as usize) == Some(&Conn::Up) {
            return write_rndv.then(|| PeerCaps {
                rma_read: false,
                ..PeerCaps::from(&self.caps)
            });
        }
        // Until the connection is up: no RMA reads, no zero-copy, smaller messages.
        let mut p = PeerCaps::from(&self.caps);
        p.rma_read = false;
        p.am_isend = false;
        p.max_am_payload = (self.caps.max_am_payload / 2).max(1);
        p.eager_limit = p.eager_limit.min(p.max_am_payload);
        Some(p)
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        let key = self.fab.next_key.fetch_add(1, Ordering::Relaxed) | (1 << 62);
        self.register(base, len, access, key, false)
    }

    unsafe fn mr_register_keyed(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
    ) -> Result<MemRegion> {
        self.register(base, len, access, key, true)
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        self.fab
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(self.rank, mr.key));
        Ok(())
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        if !self.caps.counters {
            return Err(Error::from(ErrorDetail::Unsupported(
                "loopback counters are off (WEFT_LOOPBACK_RMA, WEFT_LOOPBACK_COUNTERS)".into(),
            )));
        }
        Ok(self.done.open())
    }

    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        self.done.read(cntr)
    }

    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        self.done.close(cntr)
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.read(src, local, remote, done)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.write(dest, local, remote, None, done)
    }

    unsafe fn rma_write_data(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        data: u64,
        done: Completion,
    ) -> Result<()> {
        if self.caps.rma.is_none_or(|r| r.cq_data_size == 0) {
            return Err(Error::from(ErrorDetail::Unsupported(
                "loopback remote completion data comes with WEFT_LOOPBACK_COMPLETION=transmit"
                    .into(),
            )));
        }
        if data >> 32 != 0 {
            return Err(Error::invalid("remote completion data wider than 4 bytes"));
        }
        self.stats.write_data += 1;
        self.write(dest, local, remote, Some(data as u32), done)
    }

    unsafe fn atomic(
        &mut self,
        dest: Rank,
        a: &AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.hca_atomic(dest, a, remote, done)
    }
}

impl StaticProvider for Loopback {
    const NAME: &'static str = "loopback";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        if ctx.in_process || ctx.size == 1 {
            Ok(())
        } else {
            Err("ranks are separate processes; loopback only joins threads of one process".into())
        }
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, &LoopbackConfig::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(LoopbackConfig::from_env()?.caps())
    }
}

weft_provider::register_provider!(
    Loopback,
    priority = 0,
    summary = "ranks as threads of one process; every optional part of the contract can be switched on (reference and test provider)"
);

//! `loopback`: ranks as threads of one process, active messages only.
//!
//! The reference provider of the contract's mandatory part, and the engine of in-process test
//! worlds (`weft-testing`). Each rank has a bounded mailbox; `am_send` copies header and
//! payload into it (or reports `Busy` when it is full) and `progress` delivers the mailbox in
//! order. A rank whose provider is dropped is reported failed to the others once its messages
//! have been delivered.
//!
//! With `WEFT_LOOPBACK_RMA=1` it also registers memory and performs RMA reads (a bounds- and
//! key-checked copy between threads), which exercises the core's zero-copy rendezvous.

use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use weft_provider::bootstrap::Bootstrap;
use weft_provider::provider::{
    Access, Caps, CntrId, CntrValue, Completion, CompletionTable, MemRegion, ProbeContext,
    Provider, RawIov, RawIovMut, RemoteAddr, RmaCaps, SendOutcome, Sink, StaticProvider,
};
use weft_provider::types::Rank;
use weft_provider::{Error, ErrorDetail, Result};

weft_provider::param!(EAGER: Size = "loopback", "EAGER", "16K",
    "largest active-message payload (the eager limit) of the loopback provider");
weft_provider::param!(DEPTH: Uint = "loopback", "DEPTH", "4096",
    "messages a loopback mailbox holds before senders see Busy");
weft_provider::param!(RMA: Bool = "loopback", "RMA", "0",
    "let the loopback provider register memory and do RMA reads (tests the zero-copy rendezvous)");
weft_provider::param!(COUNTERS: Bool = "loopback", "COUNTERS", "1",
    "with WEFT_LOOPBACK_RMA, offer completion counters (0: CQ entries only, the core counts)");

/// Settings of a loopback world.
#[derive(Debug, Clone)]
pub struct LoopbackConfig {
    pub eager: usize,
    pub depth: usize,
    pub rma: bool,
    /// With `rma`: offer completion counters.
    pub counters: bool,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        LoopbackConfig {
            eager: 16 * 1024,
            depth: 4096,
            rma: false,
            counters: true,
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
        })
    }
}

struct Msg {
    src: Rank,
    hdr: SmallVec<[u8; 64]>,
    /// Small payloads stay inline (no allocation per message).
    data: SmallVec<[u8; 64]>,
}

#[derive(Default)]
struct Mailbox {
    q: Mutex<VecDeque<Msg>>,
    len: AtomicUsize,
}

struct Region {
    base: usize,
    len: usize,
    access: Access,
    /// Addressed by offset (scalable registration) rather than by absolute address.
    keyed: bool,
}

struct Fabric {
    boxes: Vec<Mailbox>,
    alive: Vec<AtomicBool>,
    deaths: AtomicU64,
    /// Registered memory by (owner rank, key).
    regions: Mutex<HashMap<(Rank, u64), Region>>,
    next_key: AtomicU64,
}

fn fabrics() -> &'static Mutex<HashMap<String, Weak<Fabric>>> {
    static F: std::sync::OnceLock<Mutex<HashMap<String, Weak<Fabric>>>> =
        std::sync::OnceLock::new();
    F.get_or_init(Default::default)
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
        // Everyone holds the fabric before anyone can drop it.
        boot.fence()?;
        let mut caps = Caps::am_only(128, cfg.eager, 16);
        caps.spans_processes = false;
        if cfg.rma {
            caps.rma = Some(RmaCaps {
                read: true,
                write: true,
                max_iov: 16,
                scalable_keys: true,
                alloc: false,
                native_locks: false,
                user_memory: true,
                // Copies between threads: complete when issued, hence ordered.
                fence: true,
                ..RmaCaps::default()
            });
            caps.counters = cfg.counters;
        }
        Ok(Loopback {
            fab,
            rank: boot.rank(),
            size,
            caps,
            depth: cfg.depth,
            seen_deaths: 0,
            reported: vec![false; size as usize],
            done: CompletionTable::default(),
            inbox: VecDeque::new(),
        })
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.fab.alive[self.rank as usize].store(false, Ordering::Release);
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
        let mb = self.fab.boxes.get(dest as usize).ok_or_else(|| {
            Error::from(ErrorDetail::InvalidRank {
                rank: dest as i64,
                size: self.size,
            })
        })?;
        if !self.fab.alive[dest as usize].load(Ordering::Acquire) {
            return Err(Error::peer_failed(dest, "rank exited"));
        }
        if header.len() > self.caps.max_am_header {
            return Err(Error::invalid("active-message header too long"));
        }
        let total: usize = payload.iter().map(|s| s.len()).sum();
        if total > self.caps.max_am_payload {
            return Err(Error::invalid("active-message payload too long"));
        }
        if mb.len.load(Ordering::Acquire) >= self.depth {
            return Ok(SendOutcome::Busy);
        }
        let mut data = SmallVec::with_capacity(total);
        for s in payload {
            data.extend_from_slice(s);
        }
        let msg = Msg {
            src: self.rank,
            hdr: SmallVec::from_slice(header),
            data,
        };
        let mut q = mb.q.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back(msg);
        mb.len.store(q.len(), Ordering::Release);
        Ok(SendOutcome::Sent)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = self.done.deliver(sink);
        let mb = &self.fab.boxes[self.rank as usize];
        if mb.len.load(Ordering::Acquire) > 0 {
            {
                let mut q = mb.q.lock().unwrap_or_else(|e| e.into_inner());
                std::mem::swap(&mut *q, &mut self.inbox);
                mb.len.store(0, Ordering::Release);
            }
            while let Some(m) = self.inbox.pop_front() {
                sink.am(m.src, &m.hdr, &m.data);
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

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        self.fab
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(self.rank, mr.key));
        Ok(())
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let total: usize = local.iter().map(|l| l.len).sum();
        let res = self.with_region(src, remote, total, false, |mut at| {
            for l in local {
                // SAFETY: `at..at+total` lies in a region its owner registered and keeps alive
                // until it deregisters, which cannot happen while we hold the registry lock;
                // `l` is the caller's buffer, valid per this function's contract.
                std::ptr::copy_nonoverlapping(at as *const u8, l.ptr, l.len);
                at += l.len;
            }
        });
        self.done.finish(done, res);
        Ok(())
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let total: usize = local.iter().map(|l| l.len).sum();
        let res = self.with_region(dest, remote, total, true, |mut at| {
            for l in local {
                // SAFETY: as in rma_read, in the other direction.
                std::ptr::copy_nonoverlapping(l.ptr, at as *mut u8, l.len);
                at += l.len;
            }
        });
        self.done.finish(done, res);
        Ok(())
    }
}

impl Loopback {
    fn register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
        keyed: bool,
    ) -> Result<MemRegion> {
        if self.caps.rma.is_none() {
            return Err(Error::from(ErrorDetail::Unsupported(
                "loopback RMA is off (WEFT_LOOPBACK_RMA)".into(),
            )));
        }
        let mut regs = self.fab.regions.lock().unwrap_or_else(|e| e.into_inner());
        if regs.contains_key(&(self.rank, key)) {
            return Err(Error::invalid(format!("key {key} is already registered")));
        }
        regs.insert(
            (self.rank, key),
            Region {
                base: base as usize,
                len,
                access,
                keyed,
            },
        );
        Ok(MemRegion {
            key,
            addr: if keyed { 0 } else { base as u64 },
            len,
            handle: key,
            desc: key,
        })
    }

    /// Run `f` on the absolute start address of `[remote, remote + n)` in `owner`'s region,
    /// checking key, access and bounds, under the registry lock.
    fn with_region(
        &self,
        owner: Rank,
        remote: RemoteAddr,
        n: usize,
        write: bool,
        f: impl FnOnce(usize),
    ) -> Result<()> {
        let regs = self.fab.regions.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = regs.get(&(owner, remote.key)) else {
            return Err(Error::from(ErrorDetail::RemoteAccess {
                rank: owner,
                what: format!("no region with key {}", remote.key),
            }));
        };
        if (write && !r.access.remote_write) || (!write && !r.access.remote_read) {
            return Err(Error::from(ErrorDetail::RemoteAccess {
                rank: owner,
                what: "the region does not allow this access".into(),
            }));
        }
        let start = if r.keyed {
            r.base.checked_add(remote.addr as usize)
        } else {
            Some(remote.addr as usize)
        };
        match start {
            Some(s) if s >= r.base && s.checked_add(n).is_some_and(|e| e <= r.base + r.len) => {
                f(s);
                Ok(())
            }
            _ => Err(Error::from(ErrorDetail::RemoteAccess {
                rank: owner,
                what: "access outside the registered region".into(),
            })),
        }
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
        let cfg = LoopbackConfig::from_env()?;
        let mut caps = Caps::am_only(128, cfg.eager, 16);
        caps.spans_processes = false;
        Ok(caps)
    }
}

weft_provider::register_provider!(
    Loopback,
    priority = 0,
    summary = "ranks as threads of one process; active messages only (reference and test provider)"
);

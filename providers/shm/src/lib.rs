//! `shm`: two-copy shared-memory messaging between the ranks of one host.
//!
//! The sender copies into a shared segment, the receiver copies out. Small active messages
//! travel inline in 256-byte cells; payloads up to the chunk size go through the pair's data
//! area (the RDMA-channel ring), and the core's rendezvous streams larger messages through it
//! chunk by chunk, so the receiver copies chunk k while the sender fills chunk k+1. See
//! [`queue`] for the lock-free protocols and [`segment`] for the segment's life cycle.
//!
//! Parameters: `WEFT_SHM_CHUNK`, `WEFT_SHM_RING`, `WEFT_SHM_CELLS`, `WEFT_SHM_QUEUE`.

mod lock;
mod pool;
mod queue;
mod segment;
use weft_proto::sync;

#[cfg(not(loom))]
#[doc(hidden)]
pub mod bench_api;

pub use queue::{CELL_SIZE, INLINE};
pub use segment::{segment_name, Kind};

use queue::{DataState, SendState};
use segment::{Layout, Segment};
use smallvec_lite::Parts;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use weft_provider::bootstrap::Bootstrap;
use weft_provider::provider::{
    Caps, CntrId, CntrValue, Completion, CompletionTable, MemRegion, ProbeContext, Provider,
    RawIov, RawIovMut, RemoteAddr, SendOutcome, Sink, StaticProvider,
};
use weft_provider::{Error, ErrorDetail, Rank, Result};

weft_provider::param!(CHUNK: Size[1 << 10, 4 << 20] = "shm", "CHUNK", "32K",
    "largest active-message payload: the eager limit and the rendezvous chunk (1K to 4M; see docs/history/benchmarks-notebook.md)");
weft_provider::param!(RING: Size = "shm", "RING", "512K",
    "bytes of large-message ring (data area) per ordered pair of local ranks");
weft_provider::param!(CELLS: Uint[2, 1 << 20] = "shm", "CELLS", "64",
    "message cells per pair ring (ring) or per receiver queue (mpsc); 2 to 1048576");
weft_provider::param!(WIN_POOL: Size = "shm", "WIN_POOL", "256M",
    "shared memory per host for windows allocated by shm (split among local ranks; backed only when touched; 0: no native windows)");
weft_provider::param!(QUEUE: Enum(&["ring", "mpsc"]) = "shm", "QUEUE", "ring",
    "small-message queues: per-pair SPSC rings with a doorbell, or one MPSC queue per receiver");

/// Header bytes an active message may carry.
pub const MAX_HEADER: usize = 64;

/// A tiny fixed-capacity list of payload slices (avoids allocating per send).
mod smallvec_lite {
    pub struct Parts<'a> {
        buf: [&'a [u8]; 16],
        n: usize,
    }
    impl<'a> Parts<'a> {
        pub fn new() -> Self {
            Parts {
                buf: [&[]; 16],
                n: 0,
            }
        }
        pub fn push(&mut self, s: &'a [u8]) -> bool {
            if self.n == 16 {
                return false;
            }
            self.buf[self.n] = s;
            self.n += 1;
            true
        }
        pub fn as_slice(&self) -> &[&'a [u8]] {
            &self.buf[..self.n]
        }
    }
}

#[derive(Debug, Clone)]
struct Config {
    chunk: usize,
    ring: usize,
    cells: usize,
    kind: Kind,
    win_pool: usize,
}

impl Config {
    fn from_env() -> Result<Config> {
        let chunk = CHUNK.get_size()?;
        let ring = RING.get_size()?;
        let cells = CELLS.get_u64()? as usize;
        if !queue::ring_fits(ring, chunk) {
            let least = 2 * chunk.div_ceil(queue::UNIT) * queue::UNIT;
            return Err(Error::from(ErrorDetail::Param {
                var: RING.env_name(),
                value: RING.raw(),
                expected: format!(
                    "at least twice WEFT_SHM_CHUNK in whole {}-byte units ({least} bytes)",
                    queue::UNIT
                ),
            }));
        }
        let kind = match QUEUE.get_enum()? {
            "mpsc" => Kind::Mpsc,
            _ => Kind::Ring,
        };
        Ok(Config {
            chunk,
            ring,
            cells,
            kind,
            win_pool: WIN_POOL.get_size()?,
        })
    }

    fn caps(&self) -> Caps {
        let mut c = Caps::am_only(MAX_HEADER, self.chunk, 16);
        c.spans_processes = true;
        c.spans_hosts = false;
        if self.win_pool > 0 {
            // Native on windows shm allocates (in the pool); windows over user memory take
            // the core's active-message path (registration of user memory is refused).
            c.rma = Some(weft_provider::provider::RmaCaps {
                read: true,
                write: true,
                max_iov: 16,
                scalable_keys: false,
                alloc: true,
                native_locks: true,
                user_memory: false,
                // Copies and CPU atomics: complete (and visible) when issued, hence ordered.
                completion: weft_provider::provider::CompletionLevel::Delivery,
                fence: true,
                cq_data_size: 0,
                rndv_only: false,
            });
            c.atomics = weft_provider::types::AtomicTable::all();
            // Operations are copies and CPU atomics that finish when issued: counting them is
            // cheaper than a completion entry each.
            c.counters = true;
        }
        c
    }
}

/// Idle polls of a watched ring before its doorbell is cleared.
const IDLE_BEFORE_UNWATCH: u32 = 512;
/// How often an idle rank checks whether its peers are alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(20);

/// The shared-memory provider of one rank.
pub struct Shm {
    seg: Segment,
    rank: Rank,
    size: u32,
    me: usize,
    /// World rank -> local index (u32::MAX if on another host).
    local_of: Vec<u32>,
    /// Local index -> world rank.
    world_of: Vec<Rank>,
    caps: Caps,
    send: Vec<SendState>,
    recv_pos: Vec<u64>,
    mpsc_pos: u64,
    data: Vec<DataState>,
    watching: Vec<bool>,
    active: Vec<u32>,
    idle: Vec<u32>,
    selfq: VecDeque<(Vec<u8>, Vec<u8>)>,
    failed: Vec<bool>,
    idle_polls: u32,
    last_check: Instant,
    pool: Option<pool::Pool>,
    /// Allocation sizes by pool offset (for `mem_free`).
    allocs: Vec<(usize, usize)>,
    /// The local peers' processes.
    watch: weft_provider::shmem::Watch,
    done: CompletionTable,
}

impl Shm {
    fn open_with(boot: &mut dyn Bootstrap, cfg: &Config) -> Result<Self> {
        let nodes = boot.nodes().clone();
        if nodes.hosts() > 1 {
            return Err(Error::from(ErrorDetail::ProviderUnavailable {
                requested: "shm".into(),
                details: "ranks on other hosts are unreachable through shared memory".into(),
            }));
        }
        let rank = boot.rank();
        let size = boot.size();
        let locals = nodes.local_ranks();
        let nlocal = locals.len();
        let me = nodes.local_index(rank).unwrap_or(0);
        let mut local_of = vec![u32::MAX; size as usize];
        for (i, r) in locals.iter().enumerate() {
            local_of[*r as usize] = i as u32;
        }
        // Keep the whole segment bounded: shrink per-pair rings when there are many ranks.
        let budget: usize = 1 << 30;
        let mut ring = cfg.ring;
        while nlocal * nlocal * ring > budget && queue::ring_fits(ring / 2, cfg.chunk) {
            ring /= 2;
        }
        let lay = Layout::new(nlocal, cfg.cells, ring / queue::UNIT, cfg.chunk, cfg.kind);
        let name = segment_name(boot.job_id(), nodes.my_host);
        let pool_name = format!("{name}-w");
        let per_rank = cfg.win_pool / nlocal.max(1);
        let created = if me == 0 {
            let seg = Segment::create(&name, lay);
            let pool = if cfg.win_pool > 0 && seg.is_ok() {
                Some(pool::Pool::create(&pool_name, nlocal, per_rank, me))
            } else {
                None
            };
            Some((seg, pool))
        } else {
            None
        };
        // Everyone passes the fence, even if creation failed, so nobody hangs on it.
        let created_ok = created
            .as_ref()
            .is_none_or(|(s, p)| s.is_ok() && p.as_ref().is_none_or(|p| p.is_ok()));
        boot.put(
            &format!("shm.ok.{rank}"),
            if created_ok { "1" } else { "0" },
        )?;
        boot.fence()?;
        let first = locals[0];
        let mapped = (|| -> Result<(Segment, Option<pool::Pool>)> {
            let (mut seg, mut pool) = match created {
                Some((s, p)) => (s?, p.transpose()?),
                None => {
                    if boot.get(&format!("shm.ok.{first}"))? != "1" {
                        return Err(Error::from(ErrorDetail::Bootstrap(format!(
                            "rank {first} could not create the shared segment {name}"
                        ))));
                    }
                    let seg = Segment::open(&name)?;
                    let pool = if cfg.win_pool > 0 {
                        Some(pool::Pool::open(&pool_name, me)?)
                    } else {
                        None
                    };
                    (seg, pool)
                }
            };
            if let Some(p) = pool.as_mut() {
                p.mark_mapped();
            }
            seg.rank_slot(me).set_open();
            seg.mark_mapped();
            Ok((seg, pool))
        })();
        // Nobody leaves open before every local rank has mapped (and so the last one has
        // unlinked) the segments: a rank that exits right after start-up cannot get the
        // others killed while a name is still in /dev/shm. Every rank reaches this fence,
        // failed or not, so nobody waits for one that gave up.
        boot.fence()?;
        let (seg, pool) = mapped?;
        let lay = seg.lay;
        // Every local rank is open (the fence above): follow their processes from here on.
        let watch = weft_provider::shmem::Watch::new((0..lay.nlocal).map(|i| seg.rank_slot(i)));
        let mut caps = cfg.caps();
        caps.max_am_payload = lay.chunk;
        caps.eager_limit = lay.chunk;
        Ok(Shm {
            seg,
            rank,
            size,
            me,
            local_of,
            world_of: locals,
            caps,
            send: vec![SendState::default(); nlocal],
            recv_pos: vec![0; nlocal],
            mpsc_pos: 0,
            data: vec![DataState::default(); nlocal],
            watching: vec![false; nlocal],
            active: Vec::new(),
            idle: vec![0; nlocal],
            selfq: VecDeque::new(),
            failed: vec![false; nlocal],
            idle_polls: 0,
            last_check: Instant::now(),
            pool,
            allocs: Vec::new(),
            watch,
            done: CompletionTable::default(),
        })
    }

    fn pool_target(&self, dest: Rank) -> Result<(&pool::Pool, usize)> {
        let pool = self.pool.as_ref().ok_or_else(|| {
            Error::from(ErrorDetail::Unsupported(
                "shm RMA needs the window pool (WEFT_SHM_WIN_POOL > 0)".into(),
            ))
        })?;
        match self.local_of.get(dest as usize) {
            Some(&l) if l != u32::MAX => Ok((pool, l as usize)),
            _ => Err(Error::from(ErrorDetail::Unsupported(format!(
                "rank {dest} is not on this host"
            )))),
        }
    }

    /// Deliver everything waiting in one queue. Returns the number of messages.
    fn drain(&mut self, src: Option<usize>, sink: &mut dyn Sink) -> usize {
        let me = self.me;
        let nlocal = self.seg.lay.nlocal;
        let nunits = self.seg.lay.nunits;
        let mut n = 0;
        loop {
            let (cells, pos) = match src {
                Some(s) => (self.seg.pair_cells(s, me), self.recv_pos[s]),
                None => (self.seg.queue_cells(me), self.mpsc_pos),
            };
            let seg = &self.seg;
            let got = queue::peek(cells, pos, |s| {
                ((s as usize) < nlocal).then(|| seg.pair_data(s as usize, me))
            });
            let meta = match got {
                None => break,
                Some(Ok(m)) => {
                    let from = m.meta.src as usize;
                    if src.is_some_and(|s| s != from) || from >= nlocal {
                        tracing::warn!(from, "shm: cell names the wrong sender; dropped");
                    } else {
                        sink.am(self.world_of[from], &m.hdr, &m.payload);
                    }
                    m.meta
                }
                Some(Err((meta, why))) => {
                    tracing::warn!("shm: corrupt cell from local rank {}: {}", meta.src, why.0);
                    meta
                }
            };
            match src {
                Some(s) => {
                    // The pair's own ring: its data, whatever the cell claims.
                    let tails = self.seg.pair_tails(s, me);
                    queue::release_ring(cells.len(), &meta, &mut self.data[s], tails, nunits);
                    self.recv_pos[s] += 1;
                }
                None => {
                    let from = meta.src as usize;
                    let ds = (from < nlocal).then(|| {
                        (
                            &mut self.data[from],
                            &self.seg.pair_tails(from, me).data,
                            nunits,
                        )
                    });
                    queue::release(cells, pos, &meta, ds);
                    self.mpsc_pos += 1;
                }
            }
            n += 1;
        }
        if n > 0 {
            // The queue is empty: let blocked senders see the space we freed.
            match src {
                Some(s) => queue::flush_tails(&mut self.data[s], self.seg.pair_tails(s, me)),
                None => {
                    for s in 0..nlocal {
                        queue::flush_tails(&mut self.data[s], self.seg.pair_tails(s, me));
                    }
                }
            }
        }
        n
    }

    fn check_peers(&mut self, sink: &mut dyn Sink) -> usize {
        let mut n = 0;
        for i in 0..self.seg.lay.nlocal {
            if i == self.me || self.failed[i] {
                continue;
            }
            if let Some(why) = self.watch.gone(i, self.seg.rank_slot(i)) {
                // Deliver what it sent before it went away.
                n += match self.seg.lay.kind {
                    Kind::Ring => self.drain(Some(i), sink),
                    Kind::Mpsc => self.drain(None, sink),
                };
                self.failed[i] = true;
                sink.peer_failed(self.world_of[i], why);
                n += 1;
            }
        }
        n
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        self.seg.rank_slot(self.me).set_closed();
    }
}

impl Provider for Shm {
    fn name(&self) -> &str {
        "shm"
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
        if header.len() > MAX_HEADER || total > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "shm active message of {}+{total} bytes exceeds {MAX_HEADER}+{}",
                header.len(),
                self.caps.max_am_payload
            )));
        }
        if dest == self.rank {
            let mut data = Vec::with_capacity(total);
            for s in payload {
                data.extend_from_slice(s);
            }
            self.selfq.push_back((header.to_vec(), data));
            return Ok(SendOutcome::Sent);
        }
        let li = match self.local_of.get(dest as usize) {
            Some(&l) if l != u32::MAX => l as usize,
            Some(_) => {
                return Err(Error::from(ErrorDetail::Unsupported(format!(
                    "rank {dest} is on another host; shm reaches only ranks on this host"
                ))))
            }
            None => {
                return Err(Error::from(ErrorDetail::InvalidRank {
                    rank: dest as i64,
                    size: self.size,
                }))
            }
        };
        if self.failed[li] {
            return Err(Error::peer_failed(dest, "rank exited"));
        }
        let mut parts = Parts::new();
        let mut packed;
        let mut fits = true;
        for s in payload {
            fits &= parts.push(s);
        }
        if !fits {
            packed = Vec::with_capacity(total);
            for s in payload {
                packed.extend_from_slice(s);
            }
            parts = Parts::new();
            parts.push(&packed);
        }
        let me = self.me as u32;
        let ok = match self.seg.lay.kind {
            Kind::Ring => {
                let ok = queue::ring_send(
                    self.seg.pair_cells(self.me, li),
                    self.seg.pair_data(self.me, li),
                    self.seg.pair_tails(self.me, li),
                    &mut self.send[li],
                    me,
                    header,
                    parts.as_slice(),
                    total,
                );
                if ok {
                    queue::ring_bell(self.seg.bells(li), me);
                }
                ok
            }
            Kind::Mpsc => queue::mpsc_send(
                self.seg.queue_enq(li),
                self.seg.queue_cells(li),
                self.seg.pair_data(self.me, li),
                &self.seg.pair_tails(self.me, li).data,
                &mut self.send[li],
                me,
                header,
                parts.as_slice(),
                total,
            ),
        };
        Ok(if ok {
            SendOutcome::Sent
        } else {
            SendOutcome::Busy
        })
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = self.done.deliver(sink);
        while let Some((h, d)) = self.selfq.pop_front() {
            sink.am(self.rank, &h, &d);
            n += 1;
        }
        match self.seg.lay.kind {
            Kind::Mpsc => n += self.drain(None, sink),
            Kind::Ring => {
                // Newly rung doorbells join the active set.
                for w in 0..self.seg.lay.bell_words {
                    let bits = self.seg.bells(self.me)[w].v.load(Ordering::Acquire);
                    let mut b = bits;
                    while b != 0 {
                        let i = w * 64 + b.trailing_zeros() as usize;
                        b &= b - 1;
                        if i < self.watching.len() && !self.watching[i] {
                            self.watching[i] = true;
                            self.idle[i] = 0;
                            self.active.push(i as u32);
                        }
                    }
                }
                let mut k = 0;
                while k < self.active.len() {
                    let s = self.active[k] as usize;
                    let got = self.drain(Some(s), sink);
                    n += got;
                    if got > 0 {
                        self.idle[s] = 0;
                    } else {
                        self.idle[s] += 1;
                        if self.idle[s] > IDLE_BEFORE_UNWATCH {
                            queue::clear_bell(self.seg.bells(self.me), s as u32);
                            let again = self.drain(Some(s), sink);
                            n += again;
                            if again == 0 {
                                self.watching[s] = false;
                                self.active.swap_remove(k);
                                continue;
                            }
                            self.idle[s] = 0;
                        }
                    }
                    k += 1;
                }
            }
        }
        if n == 0 {
            self.idle_polls += 1;
            if self.idle_polls >= 1024 {
                self.idle_polls = 0;
                let now = Instant::now();
                if now - self.last_check >= LIVENESS_EVERY {
                    self.last_check = now;
                    n += self.check_peers(sink);
                }
            }
        } else {
            self.idle_polls = 0;
        }
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        self.seg.rank_slot(self.me).set_closed();
        Ok(())
    }

    fn mem_alloc(&mut self, len: usize) -> Result<(*mut u8, MemRegion)> {
        let pool = self.pool.as_mut().ok_or_else(|| {
            Error::from(ErrorDetail::Unsupported(
                "the shm window pool is off".into(),
            ))
        })?;
        let off = pool.alloc(len)?;
        self.allocs.push((off, len));
        Ok((
            pool.ptr(off),
            MemRegion {
                key: pool::POOL_KEY,
                addr: off as u64,
                len,
                handle: off as u64,
                desc: off as u64,
            },
        ))
    }

    fn mem_free(&mut self, _ptr: *mut u8, mr: &MemRegion) -> Result<()> {
        if let Some(i) = self.allocs.iter().position(|a| a.0 as u64 == mr.addr) {
            let (off, len) = self.allocs.swap_remove(i);
            if let Some(p) = self.pool.as_mut() {
                p.free(off, len);
            }
        }
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
        let (pool, li) = self.pool_target(dest)?;
        let at = pool.check(li, remote.key, remote.addr, total)?;
        let mut p = pool.ptr(at);
        for l in local {
            // SAFETY: `[at, at + total)` was checked against the target's pool slice; `l` is
            // valid per this function's contract and is not pool memory of the same window.
            std::ptr::copy_nonoverlapping(l.ptr, p, l.len);
            p = p.add(l.len);
        }
        self.done.finish(done, Ok(()));
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
        let (pool, li) = self.pool_target(src)?;
        let at = pool.check(li, remote.key, remote.addr, total)?;
        let mut p = pool.ptr(at) as *const u8;
        for l in local {
            // SAFETY: as in rma_write, in the other direction.
            std::ptr::copy_nonoverlapping(p, l.ptr, l.len);
            p = p.add(l.len);
        }
        self.done.finish(done, Ok(()));
        Ok(())
    }

    unsafe fn atomic(
        &mut self,
        dest: Rank,
        a: &weft_provider::provider::AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let (pool, li) = self.pool_target(dest)?;
        let at = pool.check(li, remote.key, remote.addr, a.count * a.ty.size())?;
        // SAFETY: in bounds of the target's pool slice (checked); the caller guarantees the
        // operand buffers; pool memory of atomically used windows is only accessed atomically.
        let r = pool::apply(
            a.op,
            a.ty,
            a.count,
            pool.ptr(at),
            a.origin,
            a.compare,
            a.result,
        );
        self.done.finish(done, r);
        Ok(())
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

    fn rma_try_lock(&mut self, target: Rank, window: RemoteAddr, exclusive: bool) -> Result<bool> {
        let (pool, li) = self.pool_target(target)?;
        let at = pool.check(li, window.key, window.addr, 0)?;
        let (seg, watch) = (&self.seg, &self.watch);
        Ok(pool.try_lock(at, exclusive, |i| watch.gone(i, seg.rank_slot(i)).is_none()))
    }

    fn rma_unlock(&mut self, target: Rank, window: RemoteAddr, exclusive: bool) -> Result<()> {
        let (pool, li) = self.pool_target(target)?;
        let at = pool.check(li, window.key, window.addr, 0)?;
        pool.unlock(at, exclusive);
        Ok(())
    }
}

impl StaticProvider for Shm {
    const NAME: &'static str = "shm";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        if ctx.hosts > 1 {
            return Err(format!(
                "the job spans {} hosts; shared memory reaches only ranks on one host",
                ctx.hosts
            ));
        }
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, &Config::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(Config::from_env()?.caps())
    }
}

weft_provider::register_provider!(
    Shm,
    priority = 50,
    summary = "two-copy shared memory between the ranks of one host"
);

/// Shared-memory objects this job left in /dev/shm (diagnostics and tests).
pub fn leftover_segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("weft-"))
                .collect()
        })
        .unwrap_or_default()
}

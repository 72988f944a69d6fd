//! `verbs-rc`: an InfiniBand Reliable Connection provider on the `weft-verbs` HCA layer (the
//! soft HCA, or a real HCA through rdma-core).
//!
//! # Channels
//! * **Connections** are made lazily, per peer, on first use ([`Provider::connect`]), by a
//!   small connection manager over one UD queue pair per process (MVAPICH's on-demand
//!   connection set-up): the requester creates its RC QP and sends `REQ` (its QP number and
//!   PSN) to the peer's UD address, published in the bootstrap's key-value space at open; the
//!   responder creates its QP, takes it to RTS towards the requester's and answers `REP`; the
//!   requester takes its QP to RTS and sends `RTU` as the first RC message, and the responder
//!   sends nothing before `RTU` arrives. Lost datagrams are covered by resending `REQ` (a
//!   responder answers a duplicate with the same `REP`); when both sides ask at once, the
//!   higher rank answers and the lower one ignores the higher's `REQ`. A peer that never
//!   answers fails after `WEFT_VERBS_RC_CONNECT_TIMEOUT`.
//! * **Active messages** go by RC send/receive into a shared receive queue (MVAPICH-Aptus's
//!   RC-SR): a frame header, the AM header and the payload, copied into a registered send
//!   buffer; the receiver hands the buffer to the core and reposts it. An empty receive queue
//!   makes the sender's HCA retry (RNR, forever: `rnr_retry` 7), so nothing is lost.
//! * **Eager rings** (`WEFT_VERBS_RC_EAGER`, [`eager`]): small messages by RDMA write into a
//!   per-peer ring in the receiver's memory — MVAPICH's fast-path slots (default, set up by the
//!   receiver once a peer has sent enough) or paper 000's basic, piggyback and pipeline rings
//!   (set up at connection). The receiver offers its ring in an `Offer` frame; messages that do
//!   not fit go by send/receive, and per-pair sequence numbers restore the order between the
//!   two channels.
//! * **RMA** is native: RDMA write and read between registered regions (local descriptors are
//!   the lkeys of the core's registrations, `mr_local`), write with immediate data for remote
//!   completion data, and the HCA's 8-byte fetch-and-add and compare-and-swap. RC
//!   acknowledges a write once it is placed, so writes complete at *delivery*.
//! * **Rendezvous** (`WEFT_VERBS_RC_RNDV`): `read` lets the core's receiver RDMA-read the
//!   sender's buffer (paper 000's zero-copy design); `write` has the receiver register its
//!   buffer and the sender RDMA-write into it (Aptus RC-RDMA; the provider says so by
//!   offering writes but not reads to its peers, `PeerCaps`); `copy` streams it through active
//!   messages instead, for comparison.
//!
//! # Failures
//! A work request that fails with *transport retry exceeded* (or RNR retry exceeded) means the
//! peer is gone: the peer is failed (`peer failed: rank N`) and every operation towards it
//! completes with an error as the HCA flushes it; the other peers go on. Any other error ends
//! the RC connection too (the HCA moves the QP to the error state): the failing operation
//! reports its status and the peer is failed with it.
//!
//! # Where things are
//! `rc/mod.rs` the channel's state (`VerbsRc`, `Peer`, `Stats`) and opening; `config` the
//! parameters; `cm` the connection manager (its decisions without I/O: `cm_state`); `am`
//! active messages over send/receive and their order with the rings; `ring_io` the eager
//! rings' I/O (the rings without I/O: `eager`); `rma` RMA and atomic work requests; `events`
//! completions and failures; `keepalive`; `provider` the `Provider` entry points and
//! teardown; `compose` [`crate::channel::RcChannel`], what a composition asks beyond the
//! contract; `footprint` `footprint()`; `wire` the codecs. The `weft-verbs-rc` crate gives the
//! channel its name in the provider registry.

mod am;
mod cm;
mod cm_state;
mod compose;
mod config;
pub mod eager;
mod events;
mod footprint;
mod keepalive;
mod provider;
mod ring_io;
mod rma;
pub mod wire;

pub use crate::channel::{RcChannel, Sizing};
pub use config::FP_BUFS;
use config::{Config, Rndv, BUF, FP_SIZE, FP_THRESHOLD, SEND_BUFS, SQ, SRQ};
pub use footprint::{footprint, Footprint};
use footprint::{rc_init, ud_init};
use ring_io::{EagerRx, EagerTx};

use crate as verbs;
use crate::{Chunked, Endpoint, Hca, Pool, QpType, SendWr, WcOpcode, WcStatus, WrOpcode};
use eager::{Design, Peek, RingMem, Shape};
use hashbrown::HashMap;
use smallvec::SmallVec;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_proto::book::AddressBook;
use weft_proto::order::{Arrival, Bounds, Holding, Reorder, Sequencer};
use weft_proto::slab::{Id as OpId, Slab};
use weft_provider::backoff::Backoff;
use weft_provider::bootstrap::Bootstrap;
use weft_provider::peers::PeerTable;
use weft_provider::provider::{
    Access, AtomicOp, Caps, CntrId, CntrValue, Completion, CompletionLevel, CompletionTable,
    ConnEvent, Discard, MemRegion, PeerCaps, ProbeContext, Provider, RawIov, RawIovMut, RemoteAddr,
    RmaCaps, SendOutcome, Sink, StaticProvider,
};
use weft_provider::types::{AtomicTable, BasicType, Op, Rank};
use weft_provider::{Error, ErrorDetail, Result};
use wire::{CmKind, CmMsg, Frame, FrameKind, Offer, CM_LEN, FRAME_HDR};

/// What a peer can make this process hold of its send/receive frames that overtook eager
/// records: a peer has at most its send queue's depth (16,384 at most, `WEFT_VERBS_RC_SQ`) of
/// frames in flight, so these are past anything a well-behaved peer sends; a peer past them is
/// failed (before they were, one that skipped a number made the receiver copy without end).
const HOLD: Bounds = Bounds {
    window: 1 << 20,
    per_peer: 1 << 14,
    per_peer_bytes: 64 << 20,
    total_bytes: 512 << 20,
};

/// Bytes after a ring's memory ([`Shape::mem_len`]) in a peer block: basic's tail word (the
/// peer acknowledges *our* ring there) and the source word of the tail pointers we write.
const BLOCK_EXTRA: usize = 16;

/// Eager-ring memory of one peer with rings of `shape`: the block it writes into here and the
/// mirror of ours.
fn ring_pair_bytes(shape: Shape) -> usize {
    2 * (shape.mem_len() + BLOCK_EXTRA)
}

/// How long `close` waits for requests still in flight.
const CLOSE_DRAIN: Duration = Duration::from_millis(250);

/// Largest active-message header.
const MAX_HDR: usize = 128;
/// The connection manager's queue key.
const QKEY: u32 = 0x5746_5243;
/// UD receive and send buffers of the connection manager.
const UD_RECVS: usize = 64;
const UD_SENDS: usize = 16;
const UD_SLOT: usize = 128;
/// RMA and atomic requests posted at once, over all peers: with the receive and send buffers
/// and one keepalive per peer, this bounds the completions the CQ must hold.
const OPS_IN_FLIGHT: usize = 4096;
/// Eager-ring RDMA writes (records, head and tail pointers) posted at once, over all peers.
const RING_IN_FLIGHT: usize = 2048;
/// Completions polled at once.
const POLL: usize = 32;
/// Keepalive probes in flight at most, over all peers (verbs-rc on its own; a composition's
/// budget of connections bounds them instead).
const KA_ROOM: usize = 256;
/// Send buffers a composition's send pool starts with, and grows by ([`RcChannel::open_sized`]).
const SEND_CHUNK: usize = 16;
/// First resend of an unanswered connection request; doubled each time, up to 1 s.
const REQ_RESEND: Duration = Duration::from_millis(20);

// wr_id kinds (top byte) and index (low 32 bits).
const K_SEND: u64 = 1 << 56;
const K_OP: u64 = 2 << 56;
const K_SRQ: u64 = 3 << 56;
const K_UDR: u64 = 4 << 56;
const K_UDS: u64 = 5 << 56;
const K_KA: u64 = 6 << 56;
const K_RING: u64 = 7 << 56;
const K_MASK: u64 = 0xff << 56;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conn {
    /// Never asked for.
    Idle,
    /// We sent `REQ` and wait for `REP`.
    Requesting {
        first: Instant,
        next: Instant,
        wait: Duration,
    },
    /// We answered a `REQ` and wait for `RTU`.
    Accepted,
    Up,
    /// Being closed by a composition ([`VerbsRc::quiesce`]): nothing new is posted (no
    /// sends, ring writes, credits, offers or keepalives), arrivals are still taken in, and an
    /// error completion is not a failure (the peer may have destroyed its side already).
    Draining,
    Failed,
}

struct Peer {
    conn: Conn,
    qp: Option<verbs::Qp>,
    psn: u32,
    gen: u32,
    /// The `REP` we sent, for a duplicate `REQ`.
    rep: Option<CmMsg>,
    /// The QP number our QP is connected to.
    remote_qpn: Option<u32>,
    /// Work requests posted on the QP and not yet completed.
    inflight: u32,
    /// RMA operations waiting for the connection or for room in the send queue.
    /// With the id of the operation each carries (in `ops`).
    queued: VecDeque<(SendWr, OpId)>,
    /// Listed in the provider's backlog.
    backlogged: bool,
    /// Sequence numbers of our active messages to the peer (over the ring and send/receive
    /// alike).
    seq_out: Sequencer,
    /// The next active message we deliver from the peer; send/receive frames that overtook
    /// eager records wait in the provider's `holding`.
    expect: Reorder,
    /// Active messages received from the peer (the fast path's set-up threshold).
    got: u64,
    /// The ring we write into, in the peer's memory.
    etx: Option<EagerTx>,
    /// The ring the peer writes into, in ours.
    erx: Option<EagerRx>,
    /// Our `Offer` still has to go (the send buffers were full).
    offer_pending: bool,
}

impl Default for Peer {
    fn default() -> Peer {
        Peer {
            conn: Conn::Idle,
            qp: None,
            psn: 0,
            gen: 0,
            rep: None,
            remote_qpn: None,
            inflight: 0,
            queued: VecDeque::new(),
            backlogged: false,
            seq_out: Sequencer::default(),
            expect: Reorder::default(),
            got: 0,
            etx: None,
            erx: None,
            offer_pending: false,
        }
    }
}

/// An RMA or atomic operation in flight.
struct OpRec {
    peer: Rank,
    done: Completion,
}

/// The provider.
pub struct VerbsRc {
    rank: Rank,
    size: u32,
    caps: Caps,
    rndv: Rndv,
    hca: Arc<dyn Hca>,
    pd: verbs::Pd,
    cq: verbs::Cq,
    srq: verbs::Srq,
    recv: Pool,
    /// Whole at open, or (a composition's, `lazy_pools`) one chunk at the first RC queue
    /// pair, more as sends find none free.
    send: Chunked,
    ud_qp: verbs::Qp,
    ud_recv: Pool,
    ud_send: Pool,
    scratch: Pool,
    sq_depth: u32,
    max_sge: usize,
    /// Per-peer state: four bytes per rank, a record per peer this process has talked to.
    peers: PeerTable<Peer>,
    by_qpn: HashMap<u32, Rank>,
    /// Peers with operations in their queue, to post as room frees up.
    backlog: Vec<Rank>,
    /// Where `poll_cq` puts completions.
    wcs: [verbs::Wc; POLL],
    /// RMA and atomic operations posted or queued, by the id in their work request (below
    /// the kind's byte: 24 generation bits, so a completion can never reach a later operation
    /// that reuses the slot).
    ops: Slab<OpRec, 24>,
    /// RMA and atomic requests posted and not yet completed (at most `OPS_IN_FLIGHT`).
    ops_posted: usize,
    table: CompletionTable,
    events: Vec<(Rank, ConnEvent)>,
    failures: Vec<(Rank, String)>,
    /// The peers' connection-manager addresses (read at first contact, or all at open without
    /// a key-value space) and their address handles.
    book: AddressBook<Endpoint, verbs::Ah>,
    job: u64,
    connect_timeout: Duration,
    rc: verbs::RcParams,
    keepalive: Option<Duration>,
    next_keepalive: Instant,
    /// Keepalive probes in flight, and at most (the completion queue's room for them).
    ka_posted: usize,
    ka_room: usize,
    /// Where the next keepalive round starts among the touched peers.
    ka_next: usize,
    /// Unanswered connection requests by the time of their next resend: the timers look at
    /// the due ones only, not at every peer touched. An entry whose peer is no longer
    /// requesting, or whose time is no longer the peer's, is stale and skipped.
    cm_due: BinaryHeap<Reverse<(Instant, Rank)>>,
    polls: u32,
    mrs: HashMap<u64, verbs::Mr>,
    /// The second QP of the connection to ourselves (its receives come from us).
    self_back: Option<verbs::Qp>,
    /// Eager design and geometry.
    shape: Shape,
    fp_threshold: u64,
    fp_peers: usize,
    /// Peers whose eager ring (in our memory) we poll.
    polling: Vec<Rank>,
    /// Ring writes posted and not yet completed (at most `ring_in_flight`).
    ring_posted: usize,
    /// RMA and atomic requests, and ring writes, posted at once at most (the completion
    /// queue has room for them).
    ops_in_flight: usize,
    ring_in_flight: usize,
    /// Sizes of the shared receive and send pools still to be made (lazily opened: at the
    /// first RC queue pair); `None` once they are.
    pools_due: Option<(usize, usize)>,
    /// Largest frame a send buffer holds.
    slot: usize,
    /// Send/receive frames that overtook eager records, of every peer: copies (within `HOLD`).
    holding: Holding<(usize, Vec<u8>)>,
    /// Frames and eager records are delivered in the peer's order (`Config::ordered`); else as
    /// they come, for a composition that orders them itself.
    ordered: bool,
    stats: Stats,
}

#[derive(Default)]
struct Stats {
    am_sent: u64,
    am_recv: u64,
    rma_write: u64,
    rma_read: u64,
    atomics: u64,
    write_data: u64,
    connects: u64,
    /// Connections closed by a composition ([`VerbsRc::disconnect`]).
    disconnects: u64,
    /// Connection-manager messages of an earlier connection, ignored.
    cm_stale: u64,
    /// Connection-manager datagrams not from the rank they name (or offering a QP on
    /// another HCA than that rank's): dropped.
    cm_forged: u64,
    cm_resends: u64,
    /// Connection requests the timers looked at (each due one once, stale ones included).
    cm_checked: u64,
    /// Keepalive probes posted.
    keepalives: u64,
    busy: u64,
    eager_ring: u64,
    eager_sr: u64,
    ring_full: u64,
    offers: u64,
    credits: u64,
    pointer_writes: u64,
    overtaken: u64,
    /// Chunks added to the send pool.
    send_grows: u64,
}

fn verr(what: &str, st: WcStatus) -> Error {
    Error::invalid(format!("verbs-rc: {what} failed: {}", st.as_str()))
}

fn vaccess(a: Access) -> verbs::Access {
    let mut v = verbs::Access::LOCAL_WRITE;
    if a.remote_read {
        v = v | verbs::Access::REMOTE_READ;
    }
    if a.remote_write {
        v = v | verbs::Access::REMOTE_WRITE;
    }
    if a.remote_atomic {
        v = v | verbs::Access::REMOTE_ATOMIC;
    }
    v
}

impl VerbsRc {
    /// Memory this process holds for communication, in bytes: the HCA's structures (queue
    /// pairs, completion and shared receive queues, registration tables), the buffers (device
    /// and host pools, eager rings and their mirrors), and the per-peer tables.
    fn memory(&self) -> (u64, u64, u64) {
        let a = self.hca.accounting();
        let mut host: usize = [&self.recv, &self.ud_recv, &self.ud_send, &self.scratch]
            .iter()
            .map(|p| p.host_bytes())
            .sum::<usize>()
            + self.send.host_bytes();
        for (_, p) in self.peers.iter() {
            host += p.etx.as_ref().map_or(0, |e| e.staging.host_bytes());
            host += p.erx.as_ref().map_or(0, |e| e.block.host_bytes());
        }
        let peers = self.peers.bytes()
            + self.book.bytes()
            + self.by_qpn.len() * 8
            + self.cm_due.capacity() * std::mem::size_of::<Reverse<(Instant, Rank)>>();
        (a.queues(), a.dm_bytes + host as u64, peers as u64)
    }

    fn open_with(boot: &mut dyn Bootstrap, cfg: &Config, hca: Arc<dyn Hca>) -> Result<VerbsRc> {
        let attr = hca.attr().clone();
        let pd = hca.alloc_pd()?;
        let max_sge = (attr.max_sge as usize).clamp(1, cfg.sges);
        let mut caps = cfg.caps();
        if let Some(r) = caps.rma.as_mut() {
            r.max_iov = max_sge;
        }
        caps.max_iov = 16;
        // Registrations pin pages on a real HCA; the soft HCA reaches memory through the page
        // tables (Cross-Memory Attach), as on-demand paging would.
        caps.mr_pins = attr.kind != "soft";
        let slot = FRAME_HDR + MAX_HDR + cfg.buf;
        // Every completion has a place: receives, sends of every peer's queue, the manager's.
        let (rank, size) = (boot.rank(), boot.size());
        let cq = hca.create_cq(cfg.cqe(size, &attr))?;
        let srq = hca.create_srq(pd, cfg.srq as u32, 1)?;
        // Receive buffers are written by peers: HCA memory where there is enough of it.
        // Lazily opened (a composition that may never connect a peer): one-slot placeholders,
        // nothing posted, until the first RC queue pair ([`VerbsRc::new_rc_qp`]).
        let (nr, ns) = if cfg.lazy_pools {
            (1, 1)
        } else {
            (cfg.srq, cfg.send_bufs)
        };
        let recv = Pool::new(&*hca, pd, nr, slot, true)?;
        let send = Chunked::fixed(&*hca, pd, ns, slot, false)?;
        let ud_recv = Pool::new(&*hca, pd, UD_RECVS, UD_SLOT, false)?;
        let ud_send = Pool::new(&*hca, pd, UD_SENDS, UD_SLOT, false)?;
        let scratch = Pool::new(&*hca, pd, 1, 8, false)?;
        let ud_qp = hca.create_qp(pd, &ud_init(cq))?;
        verbs::activate_ud(&*hca, ud_qp, QKEY)?;
        let mut me = VerbsRc {
            rank,
            size,
            caps,
            rndv: cfg.rndv,
            hca,
            pd,
            cq,
            srq,
            recv,
            send,
            ud_qp,
            ud_recv,
            ud_send,
            scratch,
            sq_depth: cfg.sq,
            max_sge,
            peers: PeerTable::new(size as usize),
            by_qpn: HashMap::new(),
            backlog: Vec::new(),
            wcs: [verbs::Wc::EMPTY; POLL],
            ops: Slab::default(),
            ops_posted: 0,
            table: CompletionTable::default(),
            events: Vec::new(),
            failures: Vec::new(),
            book: AddressBook::empty("verbs-rc", size),
            job: wire::job_hash(boot.job_id()),
            connect_timeout: cfg.connect_timeout,
            rc: cfg.rc,
            keepalive: cfg.keepalive,
            next_keepalive: Instant::now(),
            ka_posted: 0,
            ka_room: cfg.ka_room(size),
            ka_next: 0,
            cm_due: BinaryHeap::new(),
            polls: 0,
            mrs: HashMap::new(),
            self_back: None,
            shape: cfg.shape(),
            fp_threshold: cfg.fp_threshold,
            fp_peers: cfg.fp_peers,
            polling: Vec::new(),
            ring_posted: 0,
            ops_in_flight: cfg.ops_in_flight,
            ring_in_flight: cfg.ring_in_flight,
            pools_due: cfg.lazy_pools.then_some((cfg.srq, cfg.send_bufs)),
            slot,
            holding: Holding::new(HOLD),
            ordered: cfg.ordered,
            stats: Stats::default(),
        };
        if !cfg.lazy_pools {
            for i in 0..cfg.srq as u32 {
                me.post_srq(i)?;
            }
        } else {
            me.send.free.clear();
        }
        for i in 0..UD_RECVS as u32 {
            me.post_ud_recv(i)?;
        }
        me.ud_recv.free.clear();
        let ep = Endpoint::of(&*me.hca, me.ud_qp, 0);
        AddressBook::<Endpoint, verbs::Ah>::publish(boot, "verbs-rc", &ep)?;
        boot.fence()?;
        me.book = AddressBook::open(boot, "verbs-rc")?;
        Ok(me)
    }

    /// Make the shared receive and send pools if they were left for later: before the first
    /// RC queue pair, so nothing can have used the placeholders (no receive was posted from
    /// them, and sends need a queue pair). The receive pool whole (the depth of the shared
    /// receive queue sets streaming bandwidth, docs/history/benchmarks-notebook.md), the send pool one chunk of
    /// [`SEND_CHUNK`] buffers that grows as sends find none free ([`VerbsRc::grow_send`]).
    fn make_pools(&mut self) -> Result<()> {
        let Some((nr, ns)) = self.pools_due else {
            return Ok(());
        };
        let recv = Pool::new(&*self.hca, self.pd, nr, self.slot, true)?;
        let send = match Chunked::growing(&*self.hca, self.pd, SEND_CHUNK, ns, self.slot, false) {
            Ok(p) => p,
            Err(e) => {
                recv.release(&*self.hca);
                return Err(e);
            }
        };
        std::mem::replace(&mut self.recv, recv).release(&*self.hca);
        std::mem::replace(&mut self.send, send).release(&*self.hca);
        self.pools_due = None;
        for i in 0..nr as u32 {
            self.post_srq(i)?;
        }
        Ok(())
    }

    /// A send buffer when none is free: a new chunk while the send pool may grow (`None` at
    /// its limit, or if the memory cannot be had: the send waits for one to complete).
    #[cold]
    fn grow_send(&mut self) -> Option<u32> {
        match self.send.grow(&*self.hca, self.pd) {
            Ok(new) if !new.is_empty() => {
                self.stats.send_grows += 1;
                self.send.free.extend(new.rev());
                self.send.free.pop()
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(
                    "verbs-rc: send pool stays at {} buffers: {e}",
                    self.send.slots()
                );
                self.send.stop_growing();
                None
            }
        }
    }

    fn post_srq(&mut self, i: u32) -> Result<()> {
        let sge = self.recv.sge(i, self.recv.slot());
        self.hca
            .post_srq_recv(self.srq, &[verbs::RecvWr::new(K_SRQ | i as u64, &[sge])])
    }

    fn post_ud_recv(&mut self, i: u32) -> Result<()> {
        let sge = self.ud_recv.sge(i, UD_SLOT);
        self.hca
            .post_recv(self.ud_qp, &[verbs::RecvWr::new(K_UDR | i as u64, &[sge])])
    }

    fn check_rank(&self, r: Rank) -> Result<usize> {
        if r >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        Ok(r as usize)
    }

    fn peer_gone(&self, r: Rank) -> Error {
        Error::from(ErrorDetail::PeerFailed {
            rank: r,
            reason: "its RC connection failed".into(),
        })
    }

    fn new_rc_qp(&mut self) -> Result<verbs::Qp> {
        self.make_pools()?;
        self.hca.create_qp(
            self.pd,
            &rc_init(self.cq, self.srq, self.sq_depth, self.max_sge as u32),
        )
    }
}

/// Copy bytes `[from, from + dst.len())` of the concatenation of `parts` into `dst`.
fn copy_range(dst: &mut [u8], parts: &[&[u8]], from: usize) {
    let (mut skip, mut o) = (from, 0);
    for p in parts {
        if o == dst.len() {
            break;
        }
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        let n = (p.len() - skip).min(dst.len() - o);
        dst[o..o + n].copy_from_slice(&p[skip..skip + n]);
        o += n;
        skip = 0;
    }
}

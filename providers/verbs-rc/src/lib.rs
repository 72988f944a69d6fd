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

pub mod eager;
pub mod wire;

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
use weft_verbs::{
    self as verbs, Chunked, Endpoint, Hca, Pool, QpType, SendWr, WcOpcode, WcStatus, WrOpcode,
};
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

weft_provider::param!(BUF: Size[1 << 10, 1 << 20] = "verbs", "RC_BUF", "16K",
    "verbs-rc: bytes of active-message payload one RC send carries (the eager limit and the rendezvous chunk); 1K to 1M");
weft_provider::param!(SRQ: Uint[16, 16384] = "verbs", "RC_SRQ", "256",
    "verbs-rc: receive buffers in the shared receive queue (RC-SR); 16 to 16384");
weft_provider::param!(SEND_BUFS: Uint[16, 16384] = "verbs", "RC_SEND_BUFS", "256",
    "verbs-rc: registered send buffers shared by all peers; 16 to 16384");
weft_provider::param!(SQ: Uint[16, 16384] = "verbs", "RC_SQ", "128",
    "verbs-rc: send-queue depth of each RC queue pair (work requests in flight per peer); 16 to 16384");
weft_provider::param!(RNDV: Enum(&["read", "write", "copy"]) = "verbs", "RC_RNDV", "read",
    "verbs-rc: large messages: read (the receiver RDMA-reads the sender's buffer, zero copy), write (the receiver sends its buffer's key and the sender RDMA-writes into it, Aptus RC-RDMA) or copy (pipelined through active messages)");
weft_provider::param!(TIMEOUT: Uint[1, 31] = "verbs", "RC_TIMEOUT", "20",
    "verbs-rc: the RC local ACK timeout code (4.096 us x 2^code; 20 is about 4.3 s, MVAPICH's default); with RC_RETRY it sets how long a dead peer takes to notice; 1 to 31");
weft_provider::param!(RETRY: Uint[0, 7] = "verbs", "RC_RETRY", "7",
    "verbs-rc: RC transport retries before a peer is declared failed (0 to 7)");
weft_provider::param!(KEEPALIVE: Seconds = "verbs", "RC_KEEPALIVE", "2",
    "verbs-rc: seconds between keepalive probes (a zero-length RDMA write) to connected peers with nothing in flight, so that a rank waiting only to receive notices a dead peer; 0: off");
weft_provider::param!(EAGER: Enum(&["fastpath", "basic", "piggyback", "pipeline"]) = "verbs", "RC_EAGER", "fastpath",
    "verbs-rc: eager design: fastpath (MVAPICH RC-FP: per-peer RDMA slots after RC_FP_THRESHOLD messages, send/receive otherwise), basic (ring with head and tail pointers, three RDMA writes a message), piggyback (flags in the record, batched acknowledgements), pipeline (piggyback, large records written in RC_CHUNK pieces)");
weft_provider::param!(RING: Size[4 << 10, 8 << 20] check(weft_provider::param::checks::multiple_of_8) = "verbs", "RC_RING", "256K",
    "verbs-rc basic/piggyback/pipeline: bytes of each per-peer eager ring (in the receiver's memory, mirrored by the sender); 4K to 8M");
weft_provider::param!(CHUNK: Size[64, 1 << 30] check(weft_provider::param::checks::multiple_of_8) = "verbs", "RC_CHUNK", "16K",
    "verbs-rc pipeline design: bytes per RDMA write when a record is written piece by piece (paper 000: 16 KiB); a multiple of 8, 64 bytes or more");
weft_provider::param!(pub FP_BUFS: Uint[2, 1024] = "verbs", "RC_FP_BUFS", "16",
    "verbs-rc fastpath: RDMA eager slots per peer (MVAPICH MV2_NUM_RDMA_BUFFER); 2 to 1024");
weft_provider::param!(FP_SIZE: Size[256, 1 << 20] check(weft_provider::param::checks::multiple_of_8) = "verbs", "RC_FP_SIZE", "4K",
    "verbs-rc fastpath: bytes of one slot, head and tail flags included (MVAPICH MV2_RDMA_FAST_PATH_BUF_SIZE); 256 to 1M; unset, hybrid sizes its slots to its chain's RC-FP reach");
weft_provider::param!(FP_THRESHOLD: Uint = "verbs", "RC_FP_THRESHOLD", "16",
    "verbs-rc fastpath: messages received from a peer before its slots are set up (MVAPICH: 256, Open MPI: 16); 0: at connection");
weft_provider::param!(FP_PEERS: Uint[0, 1 << 20] = "verbs", "RC_FP_PEERS", "64",
    "verbs-rc fastpath: peers with slots at most (MVAPICH MV2_POLLING_SET_LIMIT); the others use send/receive");
weft_provider::param!(CONNECT_TIMEOUT: Seconds[1e-3, 1e9] = "verbs", "RC_CONNECT_TIMEOUT", "30",
    "verbs-rc: seconds a connection request may go unanswered before the peer is failed (0.001 to 10^9)");

/// How long `close` waits for requests still in flight.
const CLOSE_DRAIN: Duration = Duration::from_millis(250);

/// How large messages move (`WEFT_VERBS_RC_RNDV`); told to the core through `peer_caps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rndv {
    Read,
    Write,
    Copy,
}

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
/// Send buffers a composition's send pool starts with, and grows by ([`VerbsRc::open_sized`]).
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

/// Our side of the ring in a peer's memory.
struct EagerTx {
    tx: eager::Tx,
    /// The mirror of the ring, the source of the writes, and the head-pointer source word.
    staging: Pool,
    /// The peer's block: the ring, its head word, our tail word.
    addr: u64,
    rkey: u32,
}

/// The ring a peer writes into: our block ([`Shape::mem_len`] + [`BLOCK_EXTRA`] bytes).
struct EagerRx {
    rx: eager::Rx,
    block: Pool,
}

/// The receiver's view of its block for the sans-IO ring: loads and flag stores through raw
/// pointers, since the peer's HCA writes this memory while we read it.
struct BlockView {
    base: *mut u8,
    len: usize,
}

impl RingMem for BlockView {
    fn load(&self, off: usize) -> u64 {
        assert!(
            off % 8 == 0 && off + 8 <= self.len,
            "ring word out of the block"
        );
        // SAFETY: in bounds and 8-aligned (checked above; blocks are page- or word-aligned).
        // An atomic load because the peer's HCA stores into these bytes concurrently; acquire,
        // so that once a record's last byte (released last by the HCA) is seen, the rest is.
        unsafe { AtomicU64::from_ptr(self.base.add(off) as *mut u64) }.load(Ordering::Acquire)
    }

    fn clear_flag(&mut self, off: usize) {
        assert!(
            off % 8 == 0 && off + 8 <= self.len,
            "ring word out of the block"
        );
        // SAFETY: in bounds (checked above); a single-byte atomic store.
        unsafe { AtomicU8::from_ptr(self.base.add(off + 7)) }.store(0, Ordering::Release);
    }
}

impl BlockView {
    /// Store a word of ours in the block (the source of the tail pointers we write): through
    /// the pointer, since a reference to the block would cover bytes peers write.
    fn store(&mut self, off: usize, v: u64) {
        assert!(off % 8 == 0 && off + 8 <= self.len, "word out of the block");
        // SAFETY: in bounds and 8-aligned (checked above).
        unsafe { AtomicU64::from_ptr(self.base.add(off) as *mut u64) }.store(v, Ordering::Release);
    }
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

struct Config {
    design: Design,
    ring: usize,
    chunk: usize,
    fp_bufs: usize,
    fp_size: usize,
    fp_threshold: u64,
    fp_peers: usize,
    buf: usize,
    srq: usize,
    send_bufs: usize,
    sq: u32,
    rndv: Rndv,
    connect_timeout: Duration,
    rc: verbs::RcParams,
    keepalive: Option<Duration>,
    /// Connections expected at most (a composition's budget); `None`: any rank.
    conns: Option<usize>,
    /// RMA and atomic requests, and eager-ring writes, posted at once at most.
    ops_in_flight: usize,
    ring_in_flight: usize,
    /// The shared receive and send pools are made at the first RC queue pair, not at open.
    lazy_pools: bool,
    /// Scatter-gather entries per work request at most (the device's limit is lower or equal).
    sges: usize,
}

impl Config {
    fn from_env() -> Result<Config> {
        // Each value's range is in its declaration; only what ties two together is here.
        let buf = BUF.get_size()?;
        let range =
            |p: &weft_provider::param::ParamDesc| -> Result<usize> { Ok(p.get_u64()? as usize) };
        let timeout = TIMEOUT.get_u64()?;
        let retry = RETRY.get_u64()?;
        let design = Design::parse(EAGER.get_enum()?).expect("the parameter lists the designs");
        let (ring, chunk) = (RING.get_size()?, CHUNK.get_size()?);
        let (fp_bufs, fp_size) = (FP_BUFS.get_u64()? as usize, FP_SIZE.get_size()?);
        let cfg = Config {
            design,
            ring,
            chunk,
            fp_bufs,
            fp_size,
            fp_threshold: FP_THRESHOLD.get_u64()?,
            fp_peers: FP_PEERS.get_u64()? as usize,
            conns: None,
            ops_in_flight: OPS_IN_FLIGHT,
            ring_in_flight: RING_IN_FLIGHT,
            lazy_pools: false,
            sges: 16,
            rc: verbs::RcParams {
                timeout: timeout as u8,
                retry_cnt: retry as u8,
                ..verbs::RcParams::default()
            },
            keepalive: KEEPALIVE.get_seconds(true)?,
            buf,
            srq: range(&SRQ)?,
            send_bufs: range(&SEND_BUFS)?,
            sq: range(&SQ)? as u32,
            rndv: match RNDV.get_enum()? {
                "read" => Rndv::Read,
                "write" => Rndv::Write,
                _ => Rndv::Copy,
            },
            connect_timeout: CONNECT_TIMEOUT.get_duration()?,
        };
        if !cfg.shape_of(Design::Fastpath).valid() {
            return Err(FP_BUFS.refuse(format!(
                "with WEFT_VERBS_RC_FP_SIZE={fp_size}: 8 MiB of slots per peer at most"
            )));
        }
        Ok(cfg)
    }

    /// The geometry of every eager ring of the design in force.
    fn shape(&self) -> Shape {
        self.shape_of(self.design)
    }

    fn shape_of(&self, design: Design) -> Shape {
        Shape {
            design,
            size: if design == Design::Fastpath {
                self.fp_bufs * self.fp_size
            } else {
                self.ring
            },
            slot: self.fp_size,
            chunk: self.chunk,
        }
    }

    /// Bytes of eager-ring memory one peer costs on each side: the ring it writes into here
    /// (and the words beside it) and the mirror of ours there.
    fn eager_bytes(&self) -> usize {
        ring_pair_bytes(self.shape())
    }

    /// Keepalive probes in flight at most: one per connection a composition may hold, else
    /// [`KA_ROOM`] (never more than the job has peers). A process connected to more peers
    /// probes them in turns ([`VerbsRc::keepalives`]), so the completion queue does not grow
    /// with the job.
    fn ka_room(&self, size: u32) -> usize {
        self.conns.unwrap_or(KA_ROOM).min(size as usize).max(1)
    }

    /// Completion-queue entries for a job of `size` ranks: every receive and send buffer, the
    /// connection manager's, the RMA requests and ring writes in flight and the keepalive
    /// probes.
    fn cqe(&self, size: u32, attr: &verbs::DeviceAttr) -> u32 {
        let n = self.srq
            + self.send_bufs
            + UD_RECVS
            + UD_SENDS
            + self.ops_in_flight
            + self.ring_in_flight
            + self.ka_room(size);
        n.min(attr.max_cqe as usize) as u32
    }

    fn caps(&self) -> Caps {
        let mut caps = Caps::am_only(MAX_HDR, self.buf, 16);
        caps.spans_hosts = true;
        caps.rma = Some(RmaCaps {
            read: true,
            write: true,
            max_iov: 16,
            scalable_keys: false,
            alloc: false,
            native_locks: false,
            user_memory: true,
            completion: CompletionLevel::Delivery,
            fence: true,
            cq_data_size: 4,
            rndv_only: false,
        });
        let mut t = AtomicTable::NONE;
        t.set(Op::Sum, BasicType::I64, true);
        t.set(Op::Cswap, BasicType::I64, true);
        caps.atomics = t;
        caps.atomic_max_count = 1;
        caps.counters = true;
        caps.mr_local = true;
        caps.lazy_connect = true;
        caps.per_peer = self.rndv != Rndv::Read;
        caps
    }
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

    /// Open as one channel of a composition (the hybrid provider): the parameters of the
    /// environment, but RC-FP slots for at most `fp_peers` peers, and the slots' threshold, the
    /// eager buffer size and the shared pools' sizes given in `sizing` where the environment
    /// does not set them (the hybrid connects a few peers, not all, and only those that earned
    /// it).
    /// `hca` is the device the composition's other channels use too (one per process, as on
    /// hardware: one QP-context cache, one set of service threads).
    pub fn open_sized(
        boot: &mut dyn Bootstrap,
        sizing: Sizing,
        hca: Arc<dyn Hca>,
    ) -> Result<VerbsRc> {
        let mut cfg = Config::from_env()?;
        cfg.fp_peers = sizing.fp_peers;
        // One more than the budget: the connection to ourselves.
        cfg.conns = Some(sizing.conns.saturating_add(1));
        // The composition's RC carries active messages only (its RMA goes elsewhere), and
        // rings for at most `fp_peers` peers: the completion queue need not hold verbs-rc's
        // own in-flight limits.
        cfg.ops_in_flight = 64;
        cfg.ring_in_flight = (sizing.fp_peers * 32).clamp(64, RING_IN_FLIGHT);
        cfg.lazy_pools = true;
        if !FP_THRESHOLD.is_set() {
            cfg.fp_threshold = sizing.fp_threshold;
        }
        if !BUF.is_set() {
            cfg.buf = sizing.buf.clamp(1024, 1 << 20);
        }
        if !SRQ.is_set() {
            cfg.srq = sizing.pool.clamp(16, 16384);
        }
        if !SEND_BUFS.is_set() {
            cfg.send_bufs = sizing.pool.clamp(16, 16384);
        }
        if !SQ.is_set() && sizing.sq > 0 {
            cfg.sq = sizing.sq.clamp(16, 16384);
        }
        if sizing.sges > 0 {
            cfg.sges = sizing.sges.min(16);
        }
        if !FP_BUFS.is_set() && sizing.fp_bufs > 0 {
            cfg.fp_bufs = sizing.fp_bufs.clamp(2, 1024);
        }
        if !FP_SIZE.is_set() && sizing.fp_payload > 0 {
            // A frame (its header, the largest active-message header, the payload) per slot.
            let body = FRAME_HDR + MAX_HDR + sizing.fp_payload;
            cfg.fp_size = Shape::fastpath_slot_for(body).min(1 << 20);
            if !cfg.shape_of(Design::Fastpath).valid() {
                return Err(Error::invalid(format!(
                    "verbs-rc: RC-FP slots for payloads of {} bytes ({} bytes each) times \
                     WEFT_VERBS_RC_FP_BUFS={} exceed the 8 MiB a ring may take: fewer slots, \
                     or a smaller RC-FP reach",
                    sizing.fp_payload, cfg.fp_size, cfg.fp_bufs
                )));
            }
        }
        Self::open_with(boot, &cfg, hca)
    }

    /// This process writes into an eager ring (RC-FP slots) in `peer`'s memory: RC-FP is open
    /// towards it.
    pub fn fast_path_to(&self, peer: Rank) -> bool {
        self.peers
            .get(peer as usize)
            .is_some_and(|p| p.etx.is_some())
    }

    /// Eager-ring memory of one peer, both directions (the ring it writes into here and the
    /// mirror of ours), with the geometry in force (see [`Sizing::fp_payload`]).
    pub fn ring_bytes_per_peer(&self) -> u64 {
        ring_pair_bytes(self.shape) as u64
    }

    /// Stop posting anything to `peer` (a composition is closing the connection): sends to
    /// it are refused (`Busy`), no ring write, credit, offer or keepalive goes out, and an
    /// error completion no longer fails the peer. What the peer already wrote is still taken
    /// in. Then wait for [`VerbsRc::quiet`] and [`VerbsRc::disconnect`].
    pub fn quiesce(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if peer == self.rank {
            return Err(Error::invalid(
                "verbs-rc: the connection to ourselves is not closed",
            ));
        }
        if !matches!(self.peers[i].conn, Conn::Idle | Conn::Failed) {
            self.peers[i].conn = Conn::Draining;
        }
        Ok(())
    }

    /// RDMA operations towards `peer` can be posted: its connection is up, or closing with
    /// its queue pair still there (they complete before [`VerbsRc::quiet`] holds).
    pub fn rdma_open(&self, peer: Rank) -> bool {
        self.peers
            .get(peer as usize)
            .is_some_and(|p| matches!(p.conn, Conn::Up | Conn::Draining))
    }

    /// Nothing of ours towards `peer` is in flight or queued.
    pub fn quiet(&self, peer: Rank) -> bool {
        self.peers
            .get(peer as usize)
            .is_none_or(|p| p.inflight == 0 && p.queued.is_empty())
    }

    /// Tear down the connection to `peer` (after [`VerbsRc::quiesce`] and once
    /// [`VerbsRc::quiet`]): destroy its QP, release both eager rings, forget the connection's
    /// sequence numbers, and count a new generation so that requests of this connection still
    /// in the network are not answered. A later `connect` makes a fresh connection. The caller
    /// (the hybrid's budget) makes sure the peer has taken in everything we sent and we
    /// everything it sent.
    pub fn disconnect(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if peer == self.rank {
            return Err(Error::invalid(
                "verbs-rc: the connection to ourselves is not closed",
            ));
        }
        if matches!(self.peers[i].conn, Conn::Idle | Conn::Failed) {
            return Ok(());
        }
        if !self.quiet(peer) {
            return Err(Error::invalid(format!(
                "verbs-rc: closing the connection to rank {peer} with work requests in flight"
            )));
        }
        let p = &mut self.peers[i];
        let (qp, erx, etx) = (p.qp.take(), p.erx.take(), p.etx.take());
        p.conn = Conn::Idle;
        p.gen = p.gen.wrapping_add(1);
        p.psn = 0;
        p.rep = None;
        p.remote_qpn = None;
        p.seq_out = Sequencer::default();
        p.expect = Reorder::default();
        self.holding.forget(peer);
        p.got = 0;
        p.offer_pending = false;
        self.polling.retain(|&x| x != peer);
        if let Some(q) = qp {
            self.by_qpn.remove(&q.qpn);
            // Completions of it still in the CQ no longer find a peer (its number is gone,
            // and a new QP gets a new number): they are dropped.
            self.hca.destroy_qp(q)?;
        }
        // The QP is gone: the HCA reaches neither ring any more.
        if let Some(e) = erx {
            e.block.release(&*self.hca);
        }
        if let Some(e) = etx {
            e.staging.release(&*self.hca);
        }
        self.stats.disconnects += 1;
        Ok(())
    }

    /// Set up RC-FP slots for the connected `peer` if it has none and fewer than
    /// `fp_peers` peers have (a slot freed by a teardown goes to another connection).
    pub fn open_fast_path(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if self.shape.design == Design::Fastpath
            && self.peers[i].conn == Conn::Up
            && self.peers[i].erx.is_none()
            && self.polling.len() < self.fp_peers
        {
            self.open_rx(peer)?;
        }
        Ok(())
    }

    /// The largest active message (header and payload) the eager slots take in one record;
    /// larger ones go by send/receive. 0 without slots in this design.
    pub fn ring_max(&self) -> usize {
        self.shape.max_body().saturating_sub(FRAME_HDR)
    }

    /// The RC connection to `peer` is up (sends to it go out now rather than wait).
    pub fn connected(&self, peer: Rank) -> bool {
        self.route(peer).is_some()
    }

    /// [`VerbsRc::connected`] and [`VerbsRc::fast_path_to`] in one look at the peer's record:
    /// `None` while not connected, else whether its eager slots are set up (a composition
    /// asks on every send).
    #[inline]
    pub fn route(&self, peer: Rank) -> Option<bool> {
        self.peers
            .get(peer as usize)
            .filter(|p| p.conn == Conn::Up)
            .map(|p| p.etx.is_some())
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

    /// The connection-manager address `r` published (looked up once).
    fn published(&mut self, r: Rank) -> Result<Endpoint> {
        self.book.get(r)
    }

    /// Whether connection-manager datagram `m` is from the rank it names, on that rank's HCA:
    /// it came from the UD QP the rank published (the HCA stamps every UD receive with the
    /// sender's QP number and, in the GRH, its GID, which no sender chooses), and the QP it
    /// offers is on that same HCA. The endpoint a connection is made to is then the
    /// bootstrap's, never one a datagram chose: a forged request cannot point this HCA at
    /// another process (the soft HCA maps the process a GID names).
    fn cm_from_published(&mut self, m: &CmMsg, src_qp: u32, grh: Option<&[u8]>) -> bool {
        if m.src >= self.size {
            return false;
        }
        let Ok(e) = self.published(m.src) else {
            return false;
        };
        e.sent(src_qp, grh) && m.ep.gid == e.gid && m.ep.lid == e.lid
    }

    /// The peer's connection-manager address and handle.
    fn ud_of(&mut self, r: Rank) -> Result<(verbs::Ah, u32)> {
        let (hca, pd) = (&self.hca, self.pd);
        let (ah, ep) = self.book.handle(r, |ep| {
            let at = verbs::AhAttr {
                dgid: ep.gid,
                dlid: ep.lid,
                port_num: 1,
            };
            hca.create_ah(pd, &at)
        })?;
        Ok((ah, ep.qpn))
    }

    fn send_cm(&mut self, to: Rank, m: &CmMsg) -> Result<()> {
        let (ah, qpn) = self.ud_of(to)?;
        let Some(i) = self.ud_send.free.pop() else {
            // Every manager send slot is in flight: the resend timer covers a dropped one.
            return Ok(());
        };
        // SAFETY: a free send slot: no send of it is outstanding.
        let b = unsafe { self.ud_send.buf(i) };
        b[..CM_LEN].copy_from_slice(&m.encode());
        let wr = SendWr::send(K_UDS | i as u64, &[self.ud_send.sge(i, CM_LEN)]).to(ah, qpn, QKEY);
        if let Err(e) = self.hca.post_send(self.ud_qp, &[wr]) {
            self.ud_send.free.push(i);
            return Err(e);
        }
        Ok(())
    }

    fn my_ep(&self, p: &Peer) -> Endpoint {
        Endpoint::of(
            &*self.hca,
            p.qp.expect("a QP exists once a connection is asked for"),
            p.psn,
        )
    }

    /// Start connecting to `r` (nothing if already under way).
    fn start(&mut self, r: Rank) -> Result<()> {
        let i = self.check_rank(r)?;
        if self.peers[i].conn != Conn::Idle {
            return Ok(());
        }
        self.stats.connects += 1;
        let qp = self.new_rc_qp()?;
        self.by_qpn.insert(qp.qpn, r);
        let psn = (qp.qpn.wrapping_mul(2_654_435_761) ^ self.rank) & 0xff_ffff;
        if r == self.rank {
            // Ourselves: a second QP, the two connected to each other here.
            let back = self.new_rc_qp()?;
            self.by_qpn.insert(back.qpn, r);
            let p = self.rc;
            let a = Endpoint::of(&*self.hca, qp, psn);
            let b = Endpoint::of(&*self.hca, back, psn);
            verbs::connect_rc(&*self.hca, qp, psn, &b, &p)?;
            verbs::connect_rc(&*self.hca, back, psn, &a, &p)?;
            self.self_back = Some(back);
            let me = &mut self.peers[i];
            me.qp = Some(qp);
            me.psn = psn;
            me.conn = Conn::Up;
            self.events.push((r, ConnEvent::Connected));
            return self.on_up(r);
        }
        let now = Instant::now();
        let p = &mut self.peers[i];
        p.qp = Some(qp);
        p.psn = psn;
        p.conn = Conn::Requesting {
            first: now,
            next: now + REQ_RESEND,
            wait: REQ_RESEND,
        };
        self.cm_due.push(Reverse((now + REQ_RESEND, r)));
        let m = self.req(r);
        self.send_cm(r, &m)
    }

    fn req(&self, r: Rank) -> CmMsg {
        let p = &self.peers[r as usize];
        CmMsg {
            kind: CmKind::Req,
            job: self.job,
            src: self.rank,
            dst: r,
            gen: p.gen,
            ep: self.my_ep(p),
        }
    }

    /// A connection-manager datagram arrived.
    fn on_cm(&mut self, m: CmMsg) -> Result<()> {
        if m.job != self.job || m.dst != self.rank || m.src >= self.size || m.src == self.rank {
            return Ok(());
        }
        let r = m.src;
        let i = r as usize;
        let gen = self.peers[i].gen;
        match (m.kind, self.peers[i].conn) {
            (_, Conn::Failed | Conn::Draining) => {}
            // A request or answer of an earlier connection between us (torn down since, on
            // either side) is stale: answering it could leave one side half-connected.
            (CmKind::Req | CmKind::Rep, Conn::Idle | Conn::Requesting { .. }) if m.gen != gen => {
                self.stats.cm_stale += 1;
            }
            (CmKind::Req, Conn::Idle) => self.accept(r, &m)?,
            (CmKind::Req, Conn::Requesting { .. }) => {
                // Both asked: the higher rank answers, with the QP it already made.
                if self.rank > r {
                    self.accept(r, &m)?;
                }
            }
            (CmKind::Req, Conn::Accepted | Conn::Up) => {
                // Our REP was lost: say it again (only to the QP we connected to).
                let p = &self.peers[i];
                if let (Some(rep), Some(q)) = (p.rep, p.remote_qpn) {
                    if q == m.ep.qpn {
                        self.send_cm(r, &rep)?;
                    }
                }
            }
            (CmKind::Rep, Conn::Requesting { .. }) => {
                let p = &self.peers[i];
                let qp = p.qp.expect("requesting peers have a QP");
                verbs::connect_rc(&*self.hca, qp, p.psn, &m.ep, &self.rc)?;
                self.peers[i].remote_qpn = Some(m.ep.qpn);
                self.peers[i].conn = Conn::Up;
                self.send_frame(r, FrameKind::Rtu, 0, &[], &[])?;
                self.events.push((r, ConnEvent::Connected));
                self.on_up(r)?;
            }
            (CmKind::Rep, _) => {}
        }
        Ok(())
    }

    /// Answer `REQ` `m` from `r`: connect a QP to the requester's and say which.
    fn accept(&mut self, r: Rank, m: &CmMsg) -> Result<()> {
        let i = r as usize;
        if self.peers[i].qp.is_none() {
            let qp = self.new_rc_qp()?;
            self.by_qpn.insert(qp.qpn, r);
            self.peers[i].qp = Some(qp);
            self.peers[i].psn = (qp.qpn.wrapping_mul(2_654_435_761) ^ self.rank) & 0xff_ffff;
        }
        let p = &self.peers[i];
        let qp = p.qp.expect("just made");
        verbs::connect_rc(&*self.hca, qp, p.psn, &m.ep, &self.rc)?;
        let rep = CmMsg {
            kind: CmKind::Rep,
            job: self.job,
            src: self.rank,
            dst: r,
            gen: m.gen,
            ep: self.my_ep(p),
        };
        self.peers[i].remote_qpn = Some(m.ep.qpn);
        self.peers[i].rep = Some(rep);
        self.peers[i].conn = Conn::Accepted;
        self.send_cm(r, &rep)
    }
}

impl VerbsRc {
    /// Hand the core the connection events and peer failures noted since the last progress
    /// call (out of line: most calls have none).
    #[inline(never)]
    fn report_events(&mut self, sink: &mut dyn Sink) -> usize {
        let mut n = 0;
        for (r, e) in self.events.drain(..) {
            sink.connection(r, e);
            n += 1;
        }
        for (r, why) in std::mem::take(&mut self.failures) {
            sink.peer_failed(r, &why);
            n += 1;
        }
        n
    }

    /// Put a frame on `r`'s connection: `Busy` when its send queue or the send buffers are
    /// full.
    fn send_frame(
        &mut self,
        r: Rank,
        kind: FrameKind,
        seq: u32,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let i = r as usize;
        let Some(qp) = self.peers[i].qp else {
            return Ok(SendOutcome::Busy);
        };
        if self.peers[i].conn == Conn::Draining || self.peers[i].inflight >= self.sq_depth {
            return Ok(SendOutcome::Busy);
        }
        let Some(b) = self.send.free.pop().or_else(|| self.grow_send()) else {
            return Ok(SendOutcome::Busy);
        };
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        let ack = self.ack_for(r);
        // SAFETY: a free send slot: no send of it is outstanding until the post below.
        let buf = unsafe { self.send.buf(b) };
        Frame {
            kind,
            hlen: header.len(),
            plen,
            seq,
            ack,
        }
        .write(&mut buf[..FRAME_HDR]);
        let mut o = FRAME_HDR;
        buf[o..o + header.len()].copy_from_slice(header);
        o += header.len();
        for p in payload {
            buf[o..o + p.len()].copy_from_slice(p);
            o += p.len();
        }
        let wr = SendWr::send(K_SEND | b as u64, &[self.send.sge(b, o)]);
        if let Err(e) = self.hca.post_send(qp, &[wr]) {
            self.send.free.push(b);
            return Err(e);
        }
        self.peers[i].inflight += 1;
        Ok(SendOutcome::Sent)
    }

    /// Post `r`'s queued RMA operations while its send queue has room.
    fn flush_queued(&mut self, r: Rank) -> Result<()> {
        let i = r as usize;
        // A closing connection still takes RDMA operations (a rendezvous read decided
        // before the close): they complete before it is quiet.
        while matches!(self.peers[i].conn, Conn::Up | Conn::Draining)
            && self.peers[i].inflight < self.sq_depth
            && self.ops_posted < self.ops_in_flight
        {
            let Some((wr, _)) = self.peers[i].queued.pop_front() else {
                break;
            };
            let qp = self.peers[i].qp.expect("connected peers have a QP");
            self.hca.post_send(qp, std::slice::from_ref(&wr))?;
            self.peers[i].inflight += 1;
            self.ops_posted += 1;
        }
        Ok(())
    }

    /// Post (or queue) an RMA or atomic work request towards `dest`.
    fn submit(&mut self, dest: Rank, mut wr: SendWr, done: Completion) -> Result<()> {
        let i = self.check_rank(dest)?;
        if self.peers[i].conn == Conn::Failed {
            return Err(self.peer_gone(dest));
        }
        let op = self.ops.insert(OpRec { peer: dest, done });
        debug_assert_eq!(op & K_MASK, 0);
        wr.wr_id = K_OP | op;
        wr.signaled = true;
        self.peers[i].queued.push_back((wr, op));
        if self.peers[i].conn == Conn::Idle {
            self.start(dest)?;
        }
        self.flush_queued(dest)?;
        let p = &mut self.peers[i];
        if !p.queued.is_empty() && !p.backlogged {
            p.backlogged = true;
            self.backlog.push(dest);
        }
        Ok(())
    }

    /// Local SGEs of an RMA operation (empty pieces dropped).
    fn sges<'a>(
        &self,
        pieces: impl Iterator<Item = (u64, usize, u64)> + 'a,
    ) -> Result<SmallVec<[verbs::Sge; 2]>> {
        let mut v = SmallVec::new();
        for (addr, len, desc) in pieces {
            if len == 0 {
                continue;
            }
            if len > u32::MAX as usize || desc > u32::MAX as u64 {
                return Err(Error::invalid(
                    "verbs-rc: an iovec piece over 4 GiB or a foreign descriptor",
                ));
            }
            v.push(verbs::Sge {
                addr,
                length: len as u32,
                lkey: desc as u32,
            });
        }
        if v.len() > self.max_sge {
            return Err(Error::invalid(format!(
                "verbs-rc: {} iovec pieces, the HCA takes {} per operation",
                v.len(),
                self.max_sge
            )));
        }
        Ok(v)
    }

    /// Post (or queue) one RDMA read, write or write with immediate of `sg`; a read or write
    /// that moves nothing completes at once.
    fn rdma(
        &mut self,
        peer: Rank,
        op: WrOpcode,
        sg: SmallVec<[verbs::Sge; 2]>,
        remote: RemoteAddr,
        imm: u32,
        done: Completion,
    ) -> Result<()> {
        if sg.is_empty() && op != WrOpcode::RdmaWriteWithImm {
            self.check_rank(peer)?;
            self.table.finish(done, Ok(()));
            return Ok(());
        }
        let key = Self::rkey(remote)?;
        let wr = match op {
            WrOpcode::RdmaRead => {
                self.stats.rma_read += 1;
                SendWr::read(0, &sg, remote.addr, key)
            }
            WrOpcode::RdmaWriteWithImm => {
                self.stats.rma_write += 1;
                SendWr::write_imm(0, &sg, remote.addr, key, imm)
            }
            _ => {
                self.stats.rma_write += 1;
                SendWr::write(0, &sg, remote.addr, key)
            }
        };
        self.submit(peer, wr, done)
    }

    fn rkey(remote: RemoteAddr) -> Result<u32> {
        u32::try_from(remote.key)
            .map_err(|_| Error::invalid(format!("verbs-rc: {:#x} is not an rkey", remote.key)))
    }

    /// The connection to `r` is gone (`st` is why): fail the peer once, and every operation
    /// queued for it; those in flight fail as the HCA flushes them.
    fn conn_failed(&mut self, r: Rank, st: WcStatus) {
        // Failed already, or closed on purpose (draining, or torn down: no QP left to fail).
        if matches!(
            self.peers[r as usize].conn,
            Conn::Failed | Conn::Draining | Conn::Idle
        ) {
            return;
        }
        let reason = match st {
            WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr => {
                format!(
                    "transport retry exceeded ({}): the peer does not answer",
                    st.as_str()
                )
            }
            WcStatus::Success => "no answer to the connection request".to_string(),
            _ => format!("its RC connection broke with {}", st.as_str()),
        };
        self.fail_peer(r, reason);
    }

    /// Answering `r`'s connection-manager datagram failed (its process is gone, say, before
    /// our QP could be connected to its): that peer is failed, no other.
    fn cm_failed(&mut self, r: Rank, e: &Error) {
        if matches!(self.peers[r as usize].conn, Conn::Failed | Conn::Draining) {
            return;
        }
        self.fail_peer(
            r,
            format!("its connection request could not be answered: {e}"),
        );
    }

    fn fail_peer(&mut self, r: Rank, reason: String) {
        let i = r as usize;
        self.peers[i].conn = Conn::Failed;
        self.polling.retain(|&p| p != r);
        tracing::debug!("verbs-rc: rank {r}: {reason}");
        let queued: Vec<_> = self.peers[i].queued.drain(..).collect();
        for (_, op) in queued {
            if let Some(rec) = self.ops.remove(op) {
                self.table
                    .finish(rec.done, Err(Error::peer_failed(r, reason.clone())));
            }
        }
        self.failures.push((r, reason));
    }

    fn on_wc(&mut self, wc: &verbs::Wc, sink: &mut dyn Sink) -> Result<()> {
        let idx = (wc.wr_id & 0xffff_ffff) as u32;
        let ok = wc.status == WcStatus::Success;
        match wc.wr_id & K_MASK {
            K_SRQ => {
                let src = self.by_qpn.get(&wc.qp_num).copied();
                if let (true, Some(src)) = (ok, src) {
                    self.on_recv(src, idx, wc, sink)?;
                }
                self.post_srq(idx)?;
            }
            K_SEND => {
                self.send.free.push(idx);
                if let Some(&r) = self.by_qpn.get(&wc.qp_num) {
                    let p = &mut self.peers[r as usize];
                    p.inflight = p.inflight.saturating_sub(1);
                    if !ok && wc.status != WcStatus::WrFlushErr {
                        self.conn_failed(r, wc.status);
                    }
                }
            }
            K_OP => {
                let Some(rec) = self.ops.remove(wc.wr_id & !K_MASK) else {
                    return Ok(());
                };
                self.ops_posted = self.ops_posted.saturating_sub(1);
                let r = rec.peer;
                let p = &mut self.peers[r as usize];
                p.inflight = p.inflight.saturating_sub(1);
                let res = match wc.status {
                    WcStatus::Success => Ok(()),
                    WcStatus::RemAccessErr => Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: r,
                        what:
                            "the remote key does not cover the address range with the needed rights"
                                .into(),
                    })),
                    WcStatus::WrFlushErr => Err(self.peer_gone(r)),
                    st => Err(verr("RMA operation", st)),
                };
                self.table.finish(rec.done, res);
                if !ok && wc.status != WcStatus::WrFlushErr {
                    self.conn_failed(r, wc.status);
                }
            }
            K_UDR => {
                if ok {
                    let n = (wc.byte_len as usize).min(UD_SLOT);
                    let skip = if wc.grh { verbs::GRH_LEN } else { 0 };
                    // SAFETY: the receive of slot `idx` just completed; it is reposted only
                    // after this read.
                    let b = unsafe { self.ud_recv.buf(idx) };
                    let m = b.get(skip..n).and_then(CmMsg::decode);
                    let grh: Option<[u8; verbs::GRH_LEN]> = wc
                        .grh
                        .then(|| b.get(..verbs::GRH_LEN)?.try_into().ok())
                        .flatten();
                    if let Some(m) = m {
                        if !self.cm_from_published(&m, wc.src_qp, grh.as_ref().map(|g| &g[..])) {
                            self.stats.cm_forged += 1;
                        } else if let Err(e) = self.on_cm(m) {
                            self.cm_failed(m.src, &e);
                        }
                    }
                }
                // Whatever the datagram was, its buffer is posted again.
                self.post_ud_recv(idx)?;
            }
            K_UDS => self.ud_send.free.push(idx),
            K_RING => {
                self.ring_posted = self.ring_posted.saturating_sub(1);
                if let Some(p) = self.peers.touched_mut(idx as usize) {
                    p.inflight = p.inflight.saturating_sub(1);
                    if !ok && wc.status != WcStatus::WrFlushErr {
                        self.conn_failed(idx, wc.status);
                    }
                }
            }
            K_KA => {
                let r = idx;
                self.ka_posted = self.ka_posted.saturating_sub(1);
                if let Some(p) = self.peers.touched_mut(r as usize) {
                    p.inflight = p.inflight.saturating_sub(1);
                    if !ok && wc.status != WcStatus::WrFlushErr {
                        self.conn_failed(r, wc.status);
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn on_recv(&mut self, src: Rank, idx: u32, wc: &verbs::Wc, sink: &mut dyn Sink) -> Result<()> {
        if self.peers[src as usize].conn == Conn::Failed {
            // What a failed peer still sends is dropped: the core was told it is gone, and
            // nothing of it may be held again.
            return Ok(());
        }
        if wc.opcode == WcOpcode::RecvRdmaWithImm {
            self.stats.write_data += 1;
            sink.rma_data(src, wc.imm.unwrap_or(0) as u64);
            return Ok(());
        }
        let i = src as usize;
        // SAFETY: the receive of slot `idx` completed; the slot is reposted only once its
        // bytes have been handed on (below).
        let b = unsafe { self.recv.bytes(idx, wc.byte_len as usize) };
        let Some(f) = Frame::read(b, MAX_HDR) else {
            self.malformed(src, "malformed verbs-rc frame", sink);
            return Ok(());
        };
        if self.shape.design != Design::Basic {
            // (`take_ack`, spelled out: `b` borrows the receive pool.)
            if let Some(e) = self.peers[i].etx.as_mut() {
                e.tx.ack(f.ack);
            }
        }
        match f.kind {
            FrameKind::Am => {
                // Eager records written before this send may still be in our ring: then a copy
                // of this frame waits until they have been delivered.
                let body = &b[FRAME_HDR..];
                let hold = || (f.hlen, body.to_vec());
                match self.peers[i]
                    .expect
                    .arrive(&mut self.holding, src, f.seq, body.len(), hold)
                {
                    Ok(Arrival::Deliver) => {
                        self.stats.am_recv += 1;
                        sink.am(src, &body[..f.hlen], &body[f.hlen..]);
                        self.delivered(src)?;
                    }
                    Ok(Arrival::Held) => {
                        self.stats.overtaken += 1;
                        self.poll_ring(src, sink)?;
                    }
                    Err(e) => {
                        self.holding.forget(src);
                        let why = format!("verbs-rc: active messages out of sequence: {e}");
                        self.malformed(src, &why, sink);
                    }
                }
            }
            FrameKind::Rtu => {
                let p = &mut self.peers[i];
                if p.conn == Conn::Accepted {
                    p.conn = Conn::Up;
                    sink.connection(src, ConnEvent::Connected);
                    self.on_up(src)?;
                }
            }
            FrameKind::Offer => {
                let o = Offer::decode(&b[FRAME_HDR..]);
                match o.map(|o| self.on_offer(src, o)) {
                    Some(Ok(())) => {}
                    Some(Err(why)) => self.malformed(src, &why, sink),
                    None => self.malformed(src, "verbs-rc: malformed ring offer", sink),
                }
            }
            FrameKind::Credit => {}
        }
        Ok(())
    }

    /// The peer sent what no verbs-rc peer sends: it is failed.
    fn malformed(&mut self, src: Rank, why: &str, sink: &mut dyn Sink) {
        let p = &mut self.peers[src as usize];
        if p.conn != Conn::Failed {
            p.conn = Conn::Failed;
            self.polling.retain(|&r| r != src);
            sink.peer_failed(src, why);
        }
    }

    /// An acknowledgement of our ring in `src`'s memory arrived in a frame header.
    fn take_ack(&mut self, src: Rank, ack: u32) {
        if self.shape.design == Design::Basic {
            return;
        }
        if let Some(e) = self.peers[src as usize].etx.as_mut() {
            e.tx.ack(ack);
        }
    }

    /// What to acknowledge to `r` in the header of a frame going there (not basic: it has its
    /// tail pointer).
    fn ack_for(&mut self, r: Rank) -> u32 {
        if self.shape.design == Design::Basic {
            return 0;
        }
        self.peers[r as usize]
            .erx
            .as_mut()
            .map_or(0, |e| e.rx.report() as u32)
    }

    /// One more active message from `src` delivered in order: deliver what waited behind it,
    /// and set up the fast path once the peer has earned it.
    fn delivered(&mut self, src: Rank) -> Result<()> {
        let p = &mut self.peers[src as usize];
        p.got += 1;
        if self.shape.design == Design::Fastpath
            && p.erx.is_none()
            && p.got >= self.fp_threshold
            && p.conn == Conn::Up
            && self.polling.len() < self.fp_peers
        {
            self.open_rx(src)?;
        }
        Ok(())
    }

    /// Deliver held send/receive frames from `src` that are next in sequence.
    fn drain_held(&mut self, src: Rank, sink: &mut dyn Sink) -> Result<bool> {
        let mut any = false;
        loop {
            if self.holding.is_empty() {
                return Ok(any);
            }
            let p = &mut self.peers[src as usize];
            let Some((hlen, v)) = p.expect.pop(&mut self.holding, src) else {
                return Ok(any);
            };
            self.stats.am_recv += 1;
            sink.am(src, &v[..hlen], &v[hlen..]);
            self.delivered(src)?;
            any = true;
        }
    }

    /// The connection to `r` is up: the ring designs offer their ring at once.
    fn on_up(&mut self, r: Rank) -> Result<()> {
        let now = match self.shape.design {
            // The fast path waits for its threshold (in `delivered`), unless that is 0.
            Design::Fastpath => self.fp_threshold == 0 && self.polling.len() < self.fp_peers,
            _ => true,
        };
        if now && self.peers[r as usize].erx.is_none() {
            self.open_rx(r)?;
        }
        Ok(())
    }

    /// Make a ring for `r` to write into, and offer it. Without the memory or registrations
    /// for it, the peer stays on send/receive.
    fn open_rx(&mut self, r: Rank) -> Result<()> {
        let len = self.shape.mem_len() + BLOCK_EXTRA;
        // Device memory where there is enough: a peer's writes into it are plain stores.
        let block = match Pool::remote(&*self.hca, self.pd, len, true) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!("verbs-rc: no eager ring for rank {r}: {e}");
                return Ok(());
            }
        };
        let p = &mut self.peers[r as usize];
        p.erx = Some(EagerRx {
            rx: eager::Rx::new(self.shape),
            block,
        });
        p.offer_pending = true;
        self.polling.push(r);
        self.send_offer(r)
    }

    fn send_offer(&mut self, r: Rank) -> Result<()> {
        let Some(e) = self.peers[r as usize].erx.as_ref() else {
            return Ok(());
        };
        let o = Offer {
            addr: e.block.mr().addr,
            rkey: e.block.mr().rkey,
            design: self.shape.design as u8,
            size: self.shape.size as u32,
            slot: self.shape.slot as u32,
        }
        .encode();
        if self.send_frame(r, FrameKind::Offer, 0, &[], &[IoSlice::new(&o)])? == SendOutcome::Sent {
            self.stats.offers += 1;
            self.peers[r as usize].offer_pending = false;
        }
        Ok(())
    }

    /// `src` offers a ring: check it is ours in shape, and make the mirror to write from.
    fn on_offer(&mut self, src: Rank, o: Offer) -> std::result::Result<(), String> {
        let mine = self.shape;
        if o.design != mine.design as u8
            || o.size as usize != mine.size
            || o.slot as usize != mine.slot
        {
            return Err(format!(
                "verbs-rc: rank {src} runs another eager design or geometry (WEFT_VERBS_RC_EAGER, _RING, _FP_BUFS and _FP_SIZE must agree across the job)"
            ));
        }
        if self.peers[src as usize].etx.is_some() {
            return Err("verbs-rc: a second ring offer".into());
        }
        let staging = Pool::new(&*self.hca, self.pd, 1, mine.mem_len() + 8, false)
            .map_err(|e| format!("verbs-rc: no memory for the eager mirror: {e}"))?;
        self.peers[src as usize].etx = Some(EagerTx {
            tx: eager::Tx::new(mine),
            staging,
            addr: o.addr,
            rkey: o.rkey,
        });
        Ok(())
    }

    /// Send an active message, through the peer's eager ring where `ring` allows and the ring
    /// takes it, else by RC send/receive (the hybrid provider picks RC-FP or RC-SR per message;
    /// order between the two is kept by the frames' sequence numbers either way).
    pub fn am_send_via(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
        ring: bool,
    ) -> Result<SendOutcome> {
        let i = self.check_rank(dest)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > MAX_HDR || plen > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "verbs-rc: active message of {} + {plen} bytes exceeds {MAX_HDR} + {}",
                header.len(),
                self.caps.max_am_payload
            )));
        }
        match self.peers[i].conn {
            Conn::Up => {}
            Conn::Failed => return Err(self.peer_gone(dest)),
            Conn::Idle => {
                self.start(dest)?;
                if self.peers[i].conn != Conn::Up {
                    self.stats.busy += 1;
                    return Ok(SendOutcome::Busy);
                }
            }
            _ => {
                self.stats.busy += 1;
                return Ok(SendOutcome::Busy);
            }
        }
        if !self.peers[i].queued.is_empty() {
            self.flush_queued(dest)?;
            if !self.peers[i].queued.is_empty() {
                self.stats.busy += 1;
                return Ok(SendOutcome::Busy);
            }
        }
        if ring && self.ring_send(dest, header, payload)? {
            self.stats.am_sent += 1;
            return Ok(SendOutcome::Sent);
        }
        if FRAME_HDR + header.len() + plen > self.slot {
            // Only the ring takes it (a ring design's larger messages): wait for room.
            self.stats.busy += 1;
            return Ok(SendOutcome::Busy);
        }
        let seq = self.peers[i].seq_out.peek();
        let o = self.send_frame(dest, FrameKind::Am, seq, header, payload)?;
        match o {
            SendOutcome::Sent => {
                self.peers[i].seq_out.take();
                self.stats.am_sent += 1;
                self.stats.eager_sr += 1;
            }
            _ => self.stats.busy += 1,
        }
        Ok(o)
    }

    /// Try to send an active message through `r`'s ring: `false` if it cannot go that way
    /// now (no ring yet, too large, full, or the send queue is).
    fn ring_send(&mut self, r: Rank, header: &[u8], payload: &[IoSlice<'_>]) -> Result<bool> {
        let i = r as usize;
        if self.peers[i].conn != Conn::Up {
            return Ok(false);
        }
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        let len = FRAME_HDR + header.len() + plen;
        let (sq, inflight) = (self.sq_depth as usize, self.peers[i].inflight as usize);
        let ring_posted = self.ring_posted;
        let basic = self.shape.design == Design::Basic;
        let p = &mut self.peers[i];
        // The acknowledgement this record carries (reported below, once it has gone).
        let ack = match (&p.erx, basic) {
            (Some(e), false) => e.rx.position() as u32,
            _ => 0,
        };
        let Some(e) = p.etx.as_mut() else {
            return Ok(false);
        };
        let n = e.tx.writes_for(len);
        if len > e.tx.shape().max_body()
            || inflight + n > sq
            || ring_posted + n > self.ring_in_flight
        {
            return Ok(false);
        }
        // SAFETY: the staging buffer is only ever read by the HCA (the writes that carry its
        // records), and `place` writes only bytes of the ring no write in flight reads: the
        // ring's free space (the eager engine's invariant).
        let Some(placed) = e.tx.place(unsafe { e.staging.buf(0) }, len) else {
            self.stats.ring_full += 1;
            return Ok(false);
        };
        let mut fh = [0u8; FRAME_HDR];
        Frame {
            kind: FrameKind::Am,
            hlen: header.len(),
            plen,
            seq: p.seq_out.take(),
            ack,
        }
        .write(&mut fh);
        let qp = p.qp.expect("connected peers have a QP");
        let (addr, rkey) = (e.addr, e.rkey);
        let mut parts: SmallVec<[&[u8]; 4]> = SmallVec::new();
        parts.push(&fh);
        parts.push(header);
        parts.extend(payload.iter().map(|s| &**s));
        // Copy what each write carries just before posting it: with pipeline's pieces the
        // HCA moves one while the next is copied.
        let mut wrs: SmallVec<[SendWr; 4]> = SmallVec::new();
        for w in &placed.writes {
            let from = w.off.max(placed.body) - placed.body;
            let to = (w.off + w.len)
                .min(placed.body + len)
                .saturating_sub(placed.body);
            if to > from {
                // SAFETY: the record just placed, not yet posted (as for `place` above).
                let dst = &mut unsafe { e.staging.buf(0) }[placed.body + from..placed.body + to];
                copy_range(dst, &parts, from);
            }
            let sge = e.staging.mr().sge(w.off, w.len);
            let wr = SendWr::write(K_RING | r as u64, &[sge], addr + w.off as u64, rkey);
            if self.shape.design == Design::Pipeline {
                self.hca.post_send(qp, std::slice::from_ref(&wr))?;
            } else {
                wrs.push(wr);
            }
        }
        let mut posted = placed.writes.len();
        if let Some(h) = placed.head {
            let at = self.shape.mem_len();
            // SAFETY: the head word past the ring's memory; the write that reads it is
            // posted below, and a new head is written only once that one completed
            // (`head_due`).
            let b = unsafe { e.staging.buf(0) };
            b[at..at + 8].copy_from_slice(&h.to_le_bytes());
            let sge = e.staging.mr().sge(at, 8);
            let head = addr + self.shape.head_at() as u64;
            wrs.push(SendWr::write(K_RING | r as u64, &[sge], head, rkey));
            posted += 1;
            self.stats.pointer_writes += 1;
        }
        if !wrs.is_empty() {
            self.hca.post_send(qp, &wrs)?;
        }
        p.inflight += posted as u32;
        if let (Some(e), false) = (p.erx.as_mut(), basic) {
            e.rx.report();
        }
        self.ring_posted += posted;
        self.stats.eager_ring += 1;
        Ok(true)
    }

    /// Poll `r`'s ring in our memory: deliver the records that are next in sequence, answer
    /// with acknowledgements when due, and (basic) take the peer's tail pointer and send the
    /// head pointer that waited for it.
    fn poll_ring(&mut self, r: Rank, sink: &mut dyn Sink) -> Result<usize> {
        let i = r as usize;
        let mut n = 0;
        loop {
            let p = &mut self.peers[i];
            if p.conn == Conn::Failed {
                return Ok(n);
            }
            let Some(e) = p.erx.as_mut() else {
                return Ok(n);
            };
            let mut view = BlockView {
                base: e.block.base(),
                len: e.block.slot(),
            };
            match e.rx.peek(&mut view) {
                Peek::Empty => break,
                Peek::Bad => {
                    self.malformed(r, "verbs-rc: malformed eager record", sink);
                    return Ok(n);
                }
                Peek::Body { off, len } => {
                    // SAFETY: `peek` returned a record inside the block; the peer does not
                    // write it again before we acknowledge it (after `consume`). A peer that
                    // broke the protocol could change bytes while we read them, which only
                    // garbles what it sends us: the block is ours and stays allocated.
                    let b = unsafe { std::slice::from_raw_parts(e.block.base().add(off), len) };
                    let f = match Frame::read(b, MAX_HDR) {
                        Some(f) if f.kind == FrameKind::Am => f,
                        _ => {
                            self.malformed(r, "verbs-rc: malformed eager record", sink);
                            return Ok(n);
                        }
                    };
                    match p.expect.check(f.seq, HOLD.window) {
                        Ok(0) => {}
                        // A send/receive frame before it is still in the completion queue.
                        Ok(_) => break,
                        Err(e) => {
                            let why = format!("verbs-rc: an eager record out of sequence: {e}");
                            self.holding.forget(r);
                            self.malformed(r, &why, sink);
                            return Ok(n);
                        }
                    }
                    p.expect.advance();
                    self.stats.am_recv += 1;
                    sink.am(
                        r,
                        &b[FRAME_HDR..FRAME_HDR + f.hlen],
                        &b[FRAME_HDR + f.hlen..],
                    );
                    e.rx.consume(&view, len);
                    let ack = f.ack;
                    self.take_ack(r, ack);
                    self.delivered(r)?;
                    n += 1;
                }
            }
            if self.drain_held(r, sink)? {
                n += 1;
            }
        }
        if self.drain_held(r, sink)? {
            n += 1;
        }
        self.ring_control(r)?;
        Ok(n)
    }

    /// Acknowledgements, pointers and offers owed to `r`.
    fn ring_control(&mut self, r: Rank) -> Result<()> {
        let i = r as usize;
        if self.peers[i].conn == Conn::Draining {
            return Ok(());
        }
        if self.peers[i].offer_pending {
            self.send_offer(r)?;
        }
        let due = self.peers[i].erx.as_ref().is_some_and(|e| e.rx.ack_due());
        if self.shape.design != Design::Basic {
            if due && self.send_frame(r, FrameKind::Credit, 0, &[], &[])? == SendOutcome::Sent {
                self.stats.credits += 1;
            }
            return Ok(());
        }
        let basic_room =
            self.peers[i].inflight < self.sq_depth && self.ring_posted < self.ring_in_flight;
        let mem = self.shape.mem_len();
        let p = &mut self.peers[i];
        let (Some(qp), Some(rx), Some(tx)) = (p.qp, p.erx.as_mut(), p.etx.as_mut()) else {
            return Ok(());
        };
        // Our tail word (the peer's acknowledgement of our ring) is beside its ring here.
        let mut view = BlockView {
            base: rx.block.base(),
            len: rx.block.slot(),
        };
        if tx.tx.tail_word(view.load(mem)) {
            view.clear_flag(mem);
        }
        let mut wrs: SmallVec<[SendWr; 2]> = SmallVec::new();
        if due && basic_room {
            view.store(mem + 8, eager::pointer_word(rx.rx.report()));
            let sge = rx.block.mr().sge(mem + 8, 8);
            wrs.push(SendWr::write(
                K_RING | r as u64,
                &[sge],
                tx.addr + mem as u64,
                tx.rkey,
            ));
        }
        if basic_room {
            if let Some(h) = tx.tx.head_due() {
                // SAFETY: the head word, as in `ring_send`: no write of it is in flight.
                let b = unsafe { tx.staging.buf(0) };
                b[mem..mem + 8].copy_from_slice(&h.to_le_bytes());
                let sge = tx.staging.mr().sge(mem, 8);
                let at = tx.addr + self.shape.head_at() as u64;
                wrs.push(SendWr::write(K_RING | r as u64, &[sge], at, tx.rkey));
            }
        }
        if !wrs.is_empty() {
            self.hca.post_send(qp, &wrs)?;
            p.inflight += wrs.len() as u32;
            self.ring_posted += wrs.len();
            self.stats.pointer_writes += wrs.len() as u64;
        }
        Ok(())
    }

    /// Probe connected peers with nothing in flight by a zero-length RDMA write: a dead one
    /// fails it with transport retry exceeded.
    fn keepalives(&mut self) -> Result<()> {
        let Some(every) = self.keepalive else {
            return Ok(());
        };
        let now = Instant::now();
        if now < self.next_keepalive {
            return Ok(());
        }
        self.next_keepalive = now + every;
        // Probes in flight stay within the completion queue's room for them, starting where
        // the last round stopped, so that every connection is probed in turn. A round the room
        // cut short is followed sooner, so that each of `n` peers is still probed about once
        // per interval (a probe completes in microseconds, freeing its room).
        let n = self.peers.touched();
        for j in 0..n {
            if self.ka_posted >= self.ka_room {
                let share = self.ka_room as f64 / n as f64;
                self.next_keepalive = now + every.mul_f64(share).max(Duration::from_millis(1));
                break;
            }
            let k = (self.ka_next + j) % n;
            let r = self.peers.touched_rank(k) as Rank;
            let p = &self.peers[r as usize];
            if r == self.rank || p.conn != Conn::Up || p.inflight > 0 {
                continue;
            }
            let qp = p.qp.expect("connected peers have a QP");
            self.hca
                .post_send(qp, &[SendWr::write(K_KA | r as u64, &[], 0, 0)])?;
            self.peers[r as usize].inflight += 1;
            self.ka_posted += 1;
            self.stats.keepalives += 1;
            self.ka_next = k + 1;
        }
        Ok(())
    }

    /// Resend unanswered connection requests whose time has come; fail peers that never
    /// answer. Only the due requests are looked at (a heap by time): a process that has
    /// touched thousands of peers pays nothing here for those already connected.
    fn cm_timers(&mut self) -> Result<()> {
        let now = Instant::now();
        while let Some(&Reverse((at, r))) = self.cm_due.peek() {
            if at > now {
                break;
            }
            self.cm_due.pop();
            self.stats.cm_checked += 1;
            let Conn::Requesting { first, next, wait } = self.peers[r as usize].conn else {
                continue;
            };
            if next != at {
                continue;
            }
            if now - first > self.connect_timeout {
                self.conn_failed(r, WcStatus::Success);
                continue;
            }
            let wait = (wait * 2).min(Duration::from_secs(1));
            self.peers[r as usize].conn = Conn::Requesting {
                first,
                next: now + wait,
                wait,
            };
            self.cm_due.push(Reverse((now + wait, r)));
            self.stats.cm_resends += 1;
            let m = self.req(r);
            self.send_cm(r, &m)?;
        }
        Ok(())
    }
}

impl Provider for VerbsRc {
    fn name(&self) -> &str {
        "verbs-rc"
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
        self.am_send_via(dest, header, payload, true)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = 0;
        loop {
            let k = self.hca.poll_cq(self.cq, &mut self.wcs)?;
            for j in 0..k {
                let wc = self.wcs[j];
                self.on_wc(&wc, sink)?;
            }
            n += k;
            if k < POLL {
                break;
            }
        }
        let mut k = 0;
        while k < self.polling.len() {
            let r = self.polling[k];
            n += self.poll_ring(r, sink)?;
            k += 1;
        }
        self.polls = self.polls.wrapping_add(1);
        if self.polls % 256 == 0 {
            self.cm_timers()?;
            self.keepalives()?;
        }
        let mut i = 0;
        while i < self.backlog.len() {
            let r = self.backlog[i];
            self.flush_queued(r)?;
            let p = &mut self.peers[r as usize];
            if p.queued.is_empty() {
                p.backlogged = false;
                self.backlog.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if !self.events.is_empty() || !self.failures.is_empty() {
            n += self.report_events(sink);
        }
        n += self.table.deliver(sink);
        Ok(n)
    }

    fn connect(&mut self, peer: Rank) -> Result<()> {
        self.start(peer)
    }

    /// After the final barrier: let what is still on its way out (the barrier's last
    /// messages, acknowledgements) complete before `Drop` destroys the QPs, which would drop
    /// it — the peer would then wait for a message that never comes. Bounded: a peer that has
    /// already gone never acknowledges (nothing it needs is lost then).
    fn close(&mut self) -> Result<()> {
        let deadline = Instant::now() + CLOSE_DRAIN;
        // Empty rounds yield, then sleep, leaving the CPU to the peers being waited for.
        let mut pause = Backoff::new();
        while self
            .peers
            .iter()
            .any(|(_, p)| p.inflight > 0 && matches!(p.conn, Conn::Up | Conn::Accepted))
        {
            if Instant::now() > deadline {
                tracing::debug!("verbs-rc: closing with requests still in flight");
                break;
            }
            let n = self.progress(&mut Discard::default())?;
            pause.round(n > 0);
        }
        Ok(())
    }

    fn peer_caps(&self, _peer: Rank) -> Option<PeerCaps> {
        // Only the rendezvous reads these: RMA windows stay native in every mode.
        let mut p = PeerCaps::from(&self.caps);
        match self.rndv {
            Rndv::Read => return None,
            Rndv::Write => p.rma_read = false,
            Rndv::Copy => {
                p.rma_read = false;
                p.rma_write = false;
            }
        }
        Some(p)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let up = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p.conn, Conn::Up | Conn::Accepted))
            .count() as u64;
        let hc = self.hca.counters();
        let mem = self.memory();
        vec![
            ("am_sent", s.am_sent),
            ("am_received", s.am_recv),
            ("rma_writes", s.rma_write),
            ("rma_reads", s.rma_read),
            ("atomics", s.atomics),
            ("write_data", s.write_data),
            ("connections_asked", s.connects),
            ("connections_closed", s.disconnects),
            ("cm_stale", s.cm_stale),
            ("cm_forged", s.cm_forged),
            ("connections_up", up),
            ("cm_resends", s.cm_resends),
            ("cm_checked", s.cm_checked),
            ("keepalives", s.keepalives),
            ("busy", s.busy),
            ("eager_ring", s.eager_ring),
            ("eager_send_recv", s.eager_sr),
            ("ring_full", s.ring_full),
            ("ring_offers", s.offers),
            ("credit_msgs", s.credits),
            ("pointer_writes", s.pointer_writes),
            ("overtaken", s.overtaken),
            ("send_pool_grows", s.send_grows),
            ("send_pool_slots", self.send.slots() as u64),
            ("rings_polled", self.polling.len() as u64),
            // What the HCA executed for this process (work requests by kind, packets): the
            // verbs operations each design costs per message.
            ("hca_writes", hc.op(WrOpcode::RdmaWrite)),
            ("hca_writes_imm", hc.op(WrOpcode::RdmaWriteWithImm)),
            (
                "hca_sends",
                hc.op(WrOpcode::Send) + hc.op(WrOpcode::SendWithImm),
            ),
            ("hca_reads", hc.op(WrOpcode::RdmaRead)),
            (
                "hca_atomics",
                hc.op(WrOpcode::AtomicCmpAndSwp) + hc.op(WrOpcode::AtomicFetchAndAdd),
            ),
            ("hca_packets", hc.packets),
            ("hca_wire_bytes", hc.wire_bytes),
            ("hca_qp_cache_misses", hc.qp_cache_misses),
            // Sends this process's HCA found no posted receive for at the peer (each waited
            // out the RNR timer): a shared receive queue too shallow for the traffic.
            ("hca_rnr_naks", hc.rnr_naks),
            ("mem_hca_bytes", mem.0),
            ("mem_buffer_bytes", mem.1),
            ("mem_peer_bytes", mem.2),
        ]
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if len == 0 {
            return Ok(MemRegion {
                key: 0,
                addr: base as u64,
                len: 0,
                handle: u64::MAX,
                desc: 0,
            });
        }
        // SAFETY: the caller keeps the memory valid until `mr_deregister` (this function's
        // contract), which is the HCA's registration contract.
        let mr = unsafe { self.hca.reg_mr(self.pd, base, len, vaccess(access)) }?;
        self.mrs.insert(mr.handle as u64, mr);
        Ok(MemRegion {
            key: mr.rkey as u64,
            addr: base as u64,
            len,
            handle: mr.handle as u64,
            desc: mr.lkey as u64,
        })
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        if mr.handle == u64::MAX {
            return Ok(());
        }
        let m = self
            .mrs
            .remove(&mr.handle)
            .ok_or_else(|| Error::invalid("verbs-rc: deregistering an unknown region"))?;
        self.hca.dereg_mr(m)
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let sg = self.sges(local.iter().map(|v| (v.ptr as u64, v.len, v.desc)))?;
        self.rdma(src, WrOpcode::RdmaRead, sg, remote, 0, done)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let sg = self.sges(local.iter().map(|v| (v.ptr as u64, v.len, v.desc)))?;
        self.rdma(dest, WrOpcode::RdmaWrite, sg, remote, 0, done)
    }

    unsafe fn rma_write_data(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        data: u64,
        done: Completion,
    ) -> Result<()> {
        let imm = u32::try_from(data).map_err(|_| {
            Error::invalid(format!(
                "verbs-rc: remote completion data {data:#x} is over the 4 bytes of an immediate"
            ))
        })?;
        let sg = self.sges(local.iter().map(|v| (v.ptr as u64, v.len, v.desc)))?;
        self.rdma(dest, WrOpcode::RdmaWriteWithImm, sg, remote, imm, done)
    }

    unsafe fn atomic(
        &mut self,
        dest: Rank,
        a: &AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        if !self.caps.atomics.query(a.op, a.ty) {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "verbs-rc: the HCA does 8-byte fetch-and-add and compare-and-swap, not {:?} on {:?}",
                a.op, a.ty
            ))));
        }
        if a.count != 1 {
            return Err(Error::invalid(format!(
                "verbs-rc: HCA atomics take one element, not {}",
                a.count
            )));
        }
        if remote.addr % 8 != 0 {
            return Err(Error::invalid(format!(
                "verbs-rc: HCA atomics need an 8-byte aligned target, not {:#x}",
                remote.addr
            )));
        }
        // SAFETY: `origin` (and `compare` for CSWAP) point at one element (this function's
        // contract); read now, they travel in the work request.
        let origin = unsafe { (a.origin as *const i64).read_unaligned() } as u64;
        let sge = if a.result.is_null() {
            // Nobody wants the old value: every such atomic lands it in the same scratch word.
            self.scratch.sge(0, 8)
        } else {
            verbs::Sge {
                addr: a.result as u64,
                length: 8,
                lkey: u32::try_from(a.desc[2])
                    .map_err(|_| Error::invalid("verbs-rc: a foreign descriptor"))?,
            }
        };
        let key = Self::rkey(remote)?;
        let wr = if a.op == Op::Cswap {
            // SAFETY: as above.
            let cmp = unsafe { (a.compare as *const i64).read_unaligned() } as u64;
            SendWr::cas(0, sge, remote.addr, key, cmp, origin)
        } else {
            SendWr::fetch_add(0, sge, remote.addr, key, origin)
        };
        self.stats.atomics += 1;
        self.submit(dest, wr, done)
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        Ok(self.table.open())
    }

    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        self.table.read(cntr)
    }

    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        self.table.close(cntr)
    }
}

impl Drop for VerbsRc {
    fn drop(&mut self) {
        // QPs first: after them the HCA touches none of our memory; then the registrations.
        let qps: Vec<verbs::Qp> = self
            .peers
            .iter()
            .filter_map(|(_, p)| p.qp)
            .chain(self.self_back.take())
            .chain(std::iter::once(self.ud_qp))
            .collect();
        for q in qps {
            let _ = self.hca.destroy_qp(q);
        }
        for ah in self.book.handles() {
            let _ = self.hca.destroy_ah(ah);
        }
        let _ = self.hca.destroy_srq(self.srq);
        for m in self.mrs.drain().map(|(_, m)| m).collect::<Vec<_>>() {
            let _ = self.hca.dereg_mr(m);
        }
        self.send.release(&*self.hca);
        for pool in [&self.recv, &self.ud_recv, &self.ud_send, &self.scratch] {
            pool.release(&*self.hca);
        }
        for (_, p) in self.peers.iter() {
            if let Some(e) = &p.erx {
                e.block.release(&*self.hca);
            }
            if let Some(e) = &p.etx {
                e.staging.release(&*self.hca);
            }
        }
        let _ = self.hca.destroy_cq(self.cq);
        let _ = self.hca.dealloc_pd(self.pd);
    }
}

impl StaticProvider for VerbsRc {
    const NAME: &'static str = "verbs-rc";

    fn probe(_ctx: &ProbeContext) -> std::result::Result<(), String> {
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, &Config::from_env()?, verbs::open_default()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(Config::from_env()?.caps())
    }
}

weft_provider::register_provider!(
    VerbsRc,
    priority = 8,
    summary = "InfiniBand Reliable Connection on the verbs layer (soft HCA or rdma-core): lazy RC connections, RC send/receive over a shared receive queue, native RDMA read/write and HCA atomics"
);

/// Sizes for [`VerbsRc::open_sized`].
#[derive(Debug, Clone, Copy)]
pub struct Sizing {
    /// Peers with RC-FP slots at most (`WEFT_VERBS_RC_FP_PEERS`).
    pub fp_peers: usize,
    /// Messages received from a peer over RC before its slots are set up
    /// (`WEFT_VERBS_RC_FP_THRESHOLD`; 0: at connection).
    pub fp_threshold: u64,
    /// Active-message payload of one RC send (`WEFT_VERBS_RC_BUF`).
    pub buf: usize,
    /// Receive buffers in the shared receive queue, and send buffers
    /// (`WEFT_VERBS_RC_SRQ`, `WEFT_VERBS_RC_SEND_BUFS`).
    pub pool: usize,
    /// Connections the composition opens at most (its RC budget): the completion queue keeps
    /// room for that many keepalive probes rather than one per rank of the job. More
    /// connections still work; their keepalives then take turns.
    pub conns: usize,
    /// The largest active-message payload the composition sends through RC-FP: each slot is
    /// made large enough for it with the largest header and some slack
    /// ([`eager::Shape::fastpath_slot_for`]; `WEFT_VERBS_RC_FP_SIZE` instead when set). 0:
    /// that parameter's slots.
    pub fp_payload: usize,
    /// Slots of each RC-FP ring (`WEFT_VERBS_RC_FP_BUFS` instead when set; 0: that
    /// parameter's default): a composition may spread a memory budget over more peers with
    /// shallower rings.
    pub fp_bufs: usize,
    /// Send-queue depth of each RC queue pair (`WEFT_VERBS_RC_SQ` when set; 0: that
    /// parameter's default).
    pub sq: u32,
    /// Scatter-gather entries a work request needs at most: a composition that sends by copy
    /// and offers RMA on single buffers needs one, and each queue pair's send ring shrinks with
    /// it (0: as many as the device takes, up to 16).
    pub sges: usize,
}

/// What verbs-rc costs in memory with the current parameters, measured with the HCA's own
/// accounting (the soft HCA counts queue entries and registrations exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// HCA memory of one connected peer: its RC queue pair and send queue.
    pub per_peer: u64,
    /// Per process, whatever the number of peers: the completion queue, the shared receive
    /// queue and the connection manager's UD queue pair (HCA side) ...
    pub hca_shared: u64,
    /// ... and the registered receive and send buffers (provider side).
    pub buffers: u64,
    /// Eager-ring memory of one peer, both directions (the ring a peer writes here and the
    /// mirror of ours): every connected peer with basic, piggyback and pipeline; with
    /// fastpath only peers past the threshold, at most `WEFT_VERBS_RC_FP_PEERS`.
    pub eager_per_peer: u64,
    /// The eager design in force, and when its rings exist.
    pub eager: &'static str,
}

/// Measure [`Footprint`] on the device `WEFT_VERBS_DEVICE` names.
pub fn footprint() -> Result<Footprint> {
    let cfg = Config::from_env()?;
    let hca = verbs::open_default()?;
    let pd = hca.alloc_pd()?;
    let a0 = hca.accounting().total();
    let cq = hca.create_cq(cfg.cqe(1, hca.attr()))?;
    let srq = hca.create_srq(pd, cfg.srq as u32, 1)?;
    let ud = hca.create_qp(pd, &ud_init(cq))?;
    let a1 = hca.accounting().total();
    let max_sge = (hca.attr().max_sge).clamp(1, cfg.sges as u32);
    let rc = hca.create_qp(pd, &rc_init(cq, srq, cfg.sq, max_sge))?;
    let a2 = hca.accounting().total();
    for q in [rc, ud] {
        let _ = hca.destroy_qp(q);
    }
    let _ = hca.destroy_srq(srq);
    let _ = hca.destroy_cq(cq);
    let _ = hca.dealloc_pd(pd);
    let slot = (FRAME_HDR + MAX_HDR + cfg.buf) as u64;
    Ok(Footprint {
        per_peer: a2 - a1,
        hca_shared: a1 - a0,
        buffers: (cfg.srq + cfg.send_bufs) as u64 * slot
            + ((UD_RECVS + UD_SENDS) * UD_SLOT + 8) as u64,
        eager_per_peer: cfg.eager_bytes() as u64,
        eager: match cfg.design {
            Design::Fastpath => {
                "fastpath: once a peer has sent WEFT_VERBS_RC_FP_THRESHOLD messages"
            }
            Design::Basic => "basic: every connected peer",
            Design::Piggyback => "piggyback: every connected peer",
            Design::Pipeline => "pipeline: every connected peer",
        },
    })
}

/// The connection manager's UD queue pair.
fn ud_init(cq: verbs::Cq) -> verbs::QpInitAttr {
    verbs::QpInitAttr {
        qp_type: QpType::Ud,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: verbs::QpCap {
            max_send_wr: UD_SENDS as u32,
            max_recv_wr: UD_RECVS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
    }
}

/// An RC queue pair towards one peer: receives from the shared receive queue.
fn rc_init(cq: verbs::Cq, srq: verbs::Srq, sq: u32, max_sge: u32) -> verbs::QpInitAttr {
    verbs::QpInitAttr {
        qp_type: QpType::Rc,
        send_cq: cq,
        recv_cq: cq,
        srq: Some(srq),
        cap: verbs::QpCap {
            max_send_wr: sq,
            max_recv_wr: 0,
            max_send_sge: max_sge,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
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

//! The `verbs-ud` provider: active messages over one InfiniBand Unreliable Datagram queue
//! pair per process (MVAPICH-Aptus' UD-SR channel), made reliable and ordered by the sans-IO
//! engine of `weft_proto::reliable`, one link per peer.
//!
//! * **Constant memory per peer.** One UD QP reaches every peer; receive buffers come from one
//!   pool posted to it (`WEFT_VERBS_UD_RECVS`), send buffers from one pool
//!   (`WEFT_VERBS_UD_SEND_BUFS`). What a peer costs is its address handle and its link's
//!   state (sequence numbers, timers, the packets it holds out of order, bounded by the
//!   window), never queue pairs or buffers of its own.
//! * **Packets.** A message is cut into packets of at most the path MTU
//!   (`WEFT_VERBS_UD_MTU`, 2048; the receive buffers hold the 40-byte GRH in front). Each
//!   packet carries a 20-byte header: kind, first/last flags, the active message's header
//!   length, the sender's rank, the packet's sequence number, the cumulative
//!   acknowledgement and the message's payload length. The queue key is derived from the job
//!   id, so datagrams of another job never arrive.
//! * **Reliability** is the engine's: a window of `WEFT_VERBS_UD_WINDOW` packets per peer,
//!   acknowledgements on every packet going back (and alone when due), retransmission on a
//!   measured timeout and on duplicate acknowledgements, in-order delivery. A send buffer is
//!   reused only once the peer has acknowledged it and the HCA no longer reads it. A peer that
//!   owes acknowledgements and stays silent for `WEFT_VERBS_UD_TIMEOUT` seconds is failed
//!   (`peer failed: rank N`).
//! * **UD zero-copy** (Aptus UD-ZCopy, [`zcopy`]): a message of `WEFT_VERBS_UD_ZCOPY_MIN`
//!   bytes or more goes by the core's write rendezvous. The receiver's registration of its
//!   buffer takes a UD QP from a small pool (`WEFT_VERBS_UD_ZCOPY_QPS`) and posts the buffer
//!   there as MTU-sized receives; the key it hands out names that QP. The sender's "write"
//!   sends the pieces straight from its buffer with the piece number in the immediate data.
//!   Losses are repaired in rounds (see [`zcopy`]); the write completes when the receiver
//!   says every piece is in place. Deregistration takes posted receives back (QP reset)
//!   before it returns, so nothing lands in the buffer once the core gives it back.
//! * **No RDMA on UD**: windows (RMA and atomics) go through the core's active-message path
//!   (`RmaCaps::rndv_only`).

pub mod wire;
/// UD zero-copy's sans-IO engine and its control messages (public for the fuzz target of
/// `Ctl::decode`, which reads what a peer sends).
pub mod zcopy;

use wire::{F_CTRL, F_FIRST, F_LAST, F_PING, KIND_DATA, PKT};

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::time::Duration;
use weft_proto::book::AddressBook;
use weft_proto::reliable::{self, Header, Instant, Link};
use weft_provider::backoff::Backoff;
use weft_provider::bootstrap::Bootstrap;
use weft_provider::peers::PeerTable;
use weft_provider::provider::{
    Access, Caps, Completed, Completion, CompletionLevel, Discard, MemRegion, PeerCaps,
    ProbeContext, Provider, RawIov, RemoteAddr, RmaCaps, SendOutcome, Sink, StaticProvider, Token,
};
use weft_provider::types::Rank;
use weft_provider::{Error, ErrorDetail, Result};
use weft_verbs::{self as verbs, Endpoint, Hca, Pool, QpType, SendWr, WcStatus};

weft_provider::param!(MTU: Uint[256, 4096] check(weft_provider::param::checks::power_of_two) = "verbs", "UD_MTU", "2048",
    "verbs-ud: bytes of one packet (the path MTU; 256 to 4096, a power of two, at most the port's active MTU; the default is lowered to it)");
weft_provider::param!(WINDOW: Uint[1, 4096] = "verbs", "UD_WINDOW", "128",
    "verbs-ud: packets in flight to one peer before its acknowledgements (1 to 4096); one active message is at most what this many packets hold");
weft_provider::param!(RECVS: Uint[16, 16384] = "verbs", "UD_RECVS", "512",
    "verbs-ud: receive buffers of the one UD queue pair, shared by every peer (16 to 16384)");
weft_provider::param!(SEND_BUFS: Uint[16, 65536] = "verbs", "UD_SEND_BUFS", "1024",
    "verbs-ud: send buffers shared by every peer; a packet holds one until acknowledged (16 to 65536)");
weft_provider::param!(TIMEOUT: Seconds[1e-3, 1e9] = "verbs", "UD_TIMEOUT", "30",
    "verbs-ud: seconds a peer that owes acknowledgements may stay silent before it is failed (UCX ud: 30; 0.001 to 10^9)");
weft_provider::param!(ZCOPY_MIN: Size = "verbs", "UD_ZCOPY_MIN", "8K",
    "verbs-ud: messages of this many bytes or more that go by rendezvous are received in place (UD zero-copy); smaller ones are copied out of the shared receive buffers");
weft_provider::param!(ZCOPY_QPS: Uint[0, 64] = "verbs", "UD_ZCOPY_QPS", "4",
    "verbs-ud: UD queue pairs kept for zero-copy receives, so that many large receives at once (0: no zero-copy; 0 to 64)");
weft_provider::param!(ACK_DELAY: Float[0, 1e6] = "verbs", "UD_ACK_DELAY_US", "100",
    "verbs-ud: µs at most a received packet waits for data going back to carry its acknowledgement before one goes alone; retransmission timeouts include it (raise it for lossless runs with more ranks than cores); 0 to 10^6");
weft_provider::param!(KEEPALIVE: Seconds = "verbs", "UD_KEEPALIVE", "2",
    "verbs-ud: seconds between probes of peers we talk to that have nothing unacknowledged, so that a dead one is noticed (0: never)");
weft_provider::param!(KEEPALIVE_PEERS: Uint[1, 1 << 20] = "verbs", "UD_KEEPALIVE_PEERS", "128",
    "verbs-ud: peers looked at per keepalive round at most, in turn from where the last round stopped, so that a round costs the same at any job size; a dead peer among N we talk to is probed within N/this rounds (UCX: UCX_KEEPALIVE_NUM_EPS, 128; 1 to 1048576)");

/// Largest active-message header.
const MAX_HDR: usize = 128;
/// The GRH in front of every UD receive.
const GRH: usize = 40;
/// Receives a zero-copy QP holds at once (2 MiB at the default MTU: one round for 1 MiB).
const ZDEPTH: u32 = 1024;
/// Send-queue entries zero-copy pieces leave to the link's packets.
const SQ_RESERVE: u32 = 64;
/// Buffers for acknowledgements without data.
const CTL: usize = 64;
/// Send queue depth of the UD QP.
const SQ: u32 = 512;
/// Largest active-message payload (the core's rendezvous chunk).
const MAX_PAYLOAD: usize = 64 << 10;
const POLL: usize = 32;
/// Receive buffers given back to the QP in one post.
const REPOST: usize = 16;
/// Packet buffers kept for reuse.
const SPARE: usize = 256;
/// Idle progress calls between two runs of the timers.
const IDLE_CHECK: u32 = 16;
// wr_id kinds.
const K_RECV: u64 = 1 << 56;
const K_SEND: u64 = 2 << 56;
const K_CTL: u64 = 3 << 56;
const K_ZRX: u64 = 4 << 56;
const K_ZTX: u64 = 5 << 56;
/// `MemRegion::handle` of a zero-copy receive (else: a local registration's handle).
const Z_HANDLE: u64 = 1 << 62;
const K_MASK: u64 = 0xff << 56;

struct Config {
    mtu: usize,
    /// `WEFT_VERBS_UD_MTU` was given (else `mtu` is the default, lowered to the port's).
    mtu_set: bool,
    window: u32,
    recvs: usize,
    send_bufs: usize,
    timeout: Duration,
    keepalive: Option<Duration>,
    /// Peers looked at per keepalive round at most.
    keepalive_peers: usize,
    ack_delay: Duration,
    zcopy_min: usize,
    zcopy_qps: usize,
}

impl Config {
    fn from_env() -> Result<Config> {
        // Every range is in the parameter's declaration.
        Ok(Config {
            keepalive: KEEPALIVE.get_seconds(true)?,
            keepalive_peers: KEEPALIVE_PEERS.get_u64()? as usize,
            ack_delay: Duration::from_nanos((ACK_DELAY.get_f64()? * 1e3) as u64),
            mtu: MTU.get_u64()? as usize,
            mtu_set: MTU.is_set(),
            window: WINDOW.get_u64()? as u32,
            recvs: RECVS.get_u64()? as usize,
            send_bufs: SEND_BUFS.get_u64()? as usize,
            timeout: TIMEOUT.get_duration()?,
            zcopy_min: ZCOPY_MIN.get_size()?.max(1),
            zcopy_qps: ZCOPY_QPS.get_u64()? as usize,
        })
    }

    /// Fit the packet size to the port: a datagram larger than the port's active MTU is never
    /// delivered (the HCA fails its send), so a `WEFT_VERBS_UD_MTU` above it is refused here
    /// rather than left to end in a silent peer; the default is lowered to it (as MVAPICH2's
    /// `MV2_UD_MTU` defaults to the port's active MTU).
    fn fit_mtu(&mut self, active: usize) -> Result<()> {
        if self.mtu <= active {
            return Ok(());
        }
        if self.mtu_set {
            return Err(Error::invalid(format!(
                "WEFT_VERBS_UD_MTU={} is above the port's active MTU ({active} bytes): no \
                 datagram that large can be delivered (on the soft HCA, raise \
                 WEFT_VERBS_SOFT_MTU)",
                self.mtu
            )));
        }
        self.mtu = active;
        Ok(())
    }

    /// The largest payload one active message may carry: `am_send` takes a message only when
    /// the peer's send window and the shared send buffers have room for all its packets at
    /// once, so a message of more packets than either holds could never go.
    fn max_payload(&self) -> usize {
        let packets = (self.window as usize).min(self.send_bufs);
        (packets * (self.mtu - PKT))
            .saturating_sub(MAX_HDR)
            .min(MAX_PAYLOAD)
    }

    fn caps(&self) -> Caps {
        let max_payload = self.max_payload();
        let mut c = Caps::am_only(MAX_HDR, max_payload, 16);
        // Aptus sends up to 8 KiB by UD-SR; larger messages by rendezvous.
        c.eager_limit = max_payload.min(8 << 10);
        c.spans_hosts = true;
        if self.zcopy_qps > 0 {
            // The write rendezvous only: a receive buffer posted to a UD QP (no windows).
            c.rma = Some(RmaCaps {
                write: true,
                max_iov: 1,
                user_memory: true,
                completion: CompletionLevel::Delivery,
                rndv_only: true,
                ..RmaCaps::default()
            });
            c.mr_local = true;
            c.per_peer = true;
        }
        c
    }

    fn link(&self) -> reliable::Config {
        reliable::Config {
            window: self.window,
            peer_timeout: self.timeout,
            ack_delay: self.ack_delay,
            ..reliable::Config::default()
        }
    }
}

/// The fields of a data packet's header that assembly needs.
#[derive(Clone, Copy)]
struct Head {
    flags: u8,
    hlen: usize,
    total: u32,
}

/// A message being put together from its packets (they arrive in order).
#[derive(Default)]
struct Rx {
    active: bool,
    hlen: usize,
    total: usize,
    data: Vec<u8>,
}

#[derive(Default)]
struct Peer {
    link: Option<Link<u32, Vec<u8>>>,
    rx: Rx,
    failed: bool,
    /// In `VerbsUd::busy`: its link has work (see there).
    busy: bool,
    /// Zero-copy control messages waiting for room in the link.
    ctl_out: VecDeque<Vec<u8>>,
}

/// A UD QP of the zero-copy pool. `gen` changes whenever its receives are taken back, so
/// completions of earlier ones are told apart.
struct ZQp {
    qp: verbs::Qp,
    gen: u32,
    user: Option<usize>,
}

/// A zero-copy receive: the core's buffer registered and posted to a pool QP.
struct ZRecv {
    r: zcopy::Recv,
    qp: usize,
    mr: verbs::Mr,
    base: *mut u8,
    sender: Option<Rank>,
    fin: bool,
}

/// A zero-copy "write": pieces of a registered send buffer going to a peer's pool QP.
struct ZSend {
    dest: Rank,
    key: zcopy::Key,
    ptr: *const u8,
    len: usize,
    lkey: u32,
    queue: VecDeque<u32>,
    round: u32,
    done_due: bool,
    outstanding: u32,
    result: Option<Result<()>>,
    token: Option<Token>,
}

#[derive(Default)]
struct Stats {
    am_sent: u64,
    am_recv: u64,
    packets_sent: u64,
    packets_recv: u64,
    malformed: u64,
    /// Packets whose claimed source rank is not the QP and GID they came from.
    spoofed: u64,
    zsends: u64,
    zrecvs: u64,
    zpieces: u64,
    zrounds: u64,
    zmoved: u64,
    zregranted: u64,
    zrefused: u64,
}

pub struct VerbsUd {
    rank: Rank,
    size: u32,
    caps: Caps,
    cfg: Config,
    hca: std::sync::Arc<dyn Hca>,
    pd: verbs::Pd,
    cq: verbs::Cq,
    qp: verbs::Qp,
    qkey: u32,
    recv: Pool,
    send: Pool,
    ctl: Pool,
    /// Per send slot: bytes of its packet, posts the HCA has not completed, acknowledged.
    send_len: Vec<u32>,
    send_refs: Vec<u16>,
    send_acked: Vec<bool>,
    sq_used: u32,
    /// Per-peer records, made at first touch (four bytes per rank of the job otherwise).
    peers: PeerTable<Peer>,
    /// Peers with a link, in the order they got one.
    active: Vec<Rank>,
    /// The links with work: something to send, to deliver or to acknowledge, or a timer
    /// running. Progress walks these, not every link ever made: a link joins when it is used
    /// (`link`, a keepalive probe) and leaves once idle after a progress call
    /// ([`Link::idle`]), so a progress call costs what the busy peers need however many peers
    /// the process has talked to.
    busy: Vec<Rank>,
    /// The peers' addresses (read at first contact, or all at open without a key-value space)
    /// and their address handles.
    book: AddressBook<Endpoint, verbs::Ah>,
    failures: VecDeque<(Rank, String)>,
    /// Why each failed peer failed (only failed peers: nothing per healthy peer).
    gone: std::collections::HashMap<Rank, String>,
    wcs: Vec<verbs::Wc>,
    next_keepalive: Instant,
    /// Where the next keepalive round starts in `active`.
    ka_next: usize,
    stats: Stats,
    zqps: Vec<ZQp>,
    zrecvs: Vec<Option<ZRecv>>,
    zsends: Vec<Option<ZSend>>,
    next_xfer: u32,
    /// Local registrations (send buffers of zero-copy writes), by HCA handle.
    locals: HashMap<u32, verbs::Mr>,
    /// Where the GRH of every zero-copy receive goes (never read).
    scratch: Pool,
    /// Control messages delivered by the links, handled after the drain.
    zin: Vec<(Rank, Vec<u8>)>,
    /// Idle progress calls since the timers last ran.
    idle: u32,
    /// Buffers of delivered packets, for the next arrivals.
    spare: Vec<Vec<u8>>,
    /// Receive buffers consumed and not posted again yet (fewer than `REPOST`).
    repost: Vec<u32>,
}

fn get_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn get_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn job_qkey(job: &str) -> u32 {
    let h = job.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    });
    // The top bit set is a privileged qkey in InfiniBand: keep it clear.
    h & 0x7fff_ffff
}

impl VerbsUd {
    /// Open on `hca`, which a composition (the hybrid provider) shares with its other channels:
    /// one device per process, as on hardware, so that they share its QP-context cache and
    /// its service threads.
    pub fn open_on(boot: &mut dyn Bootstrap, hca: std::sync::Arc<dyn Hca>) -> Result<VerbsUd> {
        Self::open_with(boot, Config::from_env()?, hca)
    }

    fn open_with(
        boot: &mut dyn Bootstrap,
        mut cfg: Config,
        hca: std::sync::Arc<dyn Hca>,
    ) -> Result<VerbsUd> {
        cfg.fit_mtu(hca.attr().active_mtu.bytes())?;
        let pd = hca.alloc_pd()?;
        let qkey = job_qkey(boot.job_id());
        let (cq, qp, zqps) = create_queues(&*hca, pd, &cfg, Some(qkey))?;
        let zqps = zqps
            .into_iter()
            .map(|qp| ZQp {
                qp,
                gen: 0,
                user: None,
            })
            .collect();
        let [scratch, recv, send, ctl] = create_pools(&*hca, pd, &cfg)?;
        let (rank, size) = (boot.rank(), boot.size());
        let n = cfg.send_bufs;
        let mut me = VerbsUd {
            rank,
            size,
            caps: cfg.caps(),
            hca,
            pd,
            cq,
            qp,
            qkey,
            recv,
            send,
            ctl,
            send_len: vec![0; n],
            send_refs: vec![0; n],
            send_acked: vec![false; n],
            sq_used: 0,
            peers: PeerTable::new(size as usize),
            active: Vec::new(),
            busy: Vec::new(),
            book: AddressBook::empty("verbs-ud", size),
            failures: VecDeque::new(),
            gone: std::collections::HashMap::new(),
            wcs: vec![verbs::Wc::EMPTY; POLL],
            next_keepalive: reliable::now(),
            ka_next: 0,
            stats: Stats::default(),
            cfg,
            zqps,
            zrecvs: Vec::new(),
            zsends: Vec::new(),
            next_xfer: 0,
            locals: HashMap::new(),
            scratch,
            zin: Vec::new(),
            idle: 0,
            spare: Vec::new(),
            repost: Vec::with_capacity(POLL + REPOST),
        };
        for i in 0..me.cfg.recvs as u32 {
            me.post_recv(i)?;
        }
        me.recv.free.clear();
        let ep = Endpoint::of(&*me.hca, me.qp, 0);
        AddressBook::<Endpoint, verbs::Ah>::publish(boot, "verbs-ud", &ep)?;
        boot.fence()?;
        me.book = AddressBook::open(boot, "verbs-ud")?;
        Ok(me)
    }

    fn post_recv(&mut self, i: u32) -> Result<()> {
        let sge = self.recv.sge(i, self.recv.slot());
        self.hca
            .post_recv(self.qp, &[verbs::RecvWr::new(K_RECV | i as u64, &[sge])])
    }

    /// Give the consumed receive buffers back to the QP, in one post.
    fn repost(&mut self) -> Result<()> {
        if self.repost.is_empty() {
            return Ok(());
        }
        let slot = self.recv.slot();
        let wrs: smallvec::SmallVec<[verbs::RecvWr; REPOST]> = self
            .repost
            .drain(..)
            .map(|i| verbs::RecvWr::new(K_RECV | i as u64, &[self.recv.sge(i, slot)]))
            .collect();
        self.hca.post_recv(self.qp, &wrs)
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

    /// The address `r` published (looked up once).
    /// Whether a packet that claims to be from `r` came from `r`'s QP on `r`'s HCA, the one
    /// `r` published through the bootstrap ([`Endpoint::sent`]).
    #[inline]
    fn sent_by(&mut self, r: Rank, src_qp: u32, grh: Option<&[u8]>) -> bool {
        self.book.get(r).is_ok_and(|e| e.sent(src_qp, grh))
    }

    /// The peer's address handle and QP number.
    fn ah_of(&mut self, r: Rank) -> Result<(verbs::Ah, u32)> {
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

    /// The link to `r`, made on first use (both sides start their sequences at 0).
    fn link(&mut self, r: Rank) -> &mut Link<u32, Vec<u8>> {
        let p = &mut self.peers[r as usize];
        Self::link_of(p, r, &self.cfg, &mut self.active, &mut self.busy)
    }

    /// [`VerbsUd::link`] on `r`'s record `p`, already looked up (one look at the table per
    /// packet: each look is a slot, a chunk and the record).
    #[inline]
    fn link_of<'a>(
        p: &'a mut Peer,
        r: Rank,
        cfg: &Config,
        active: &mut Vec<Rank>,
        busy: &mut Vec<Rank>,
    ) -> &'a mut Link<u32, Vec<u8>> {
        if !p.busy {
            p.busy = true;
            busy.push(r);
        }
        p.link.get_or_insert_with(|| {
            active.push(r);
            Link::new(cfg.link(), reliable::now(), 0, 0)
        })
    }

    /// Progress looks at `r`'s link until it is idle again.
    #[inline]
    fn mark_busy(&mut self, r: Rank) {
        let p = &mut self.peers[r as usize];
        if !p.busy {
            p.busy = true;
            self.busy.push(r);
        }
    }

    /// Memory this process holds for communication, in bytes: the HCA's structures (queue
    /// pairs, completion queue, registration tables), the buffers (device and host pools), and
    /// the per-peer tables (address book, link state of the peers talked to).
    fn memory(&self) -> (u64, u64, u64) {
        let a = self.hca.accounting();
        let pools = [&self.recv, &self.send, &self.ctl, &self.scratch];
        let host: usize = pools.iter().map(|p| p.host_bytes()).sum();
        // The records (each link inline in its peer's), the address book, the list of links,
        // and what links, assemblies and queued control messages hold on the heap.
        let heap: usize = self
            .peers
            .iter()
            .map(|(_, p)| {
                p.link.as_ref().map_or(0, |l| l.heap_bytes(Vec::capacity))
                    + p.rx.data.capacity()
                    + p.ctl_out.capacity() * std::mem::size_of::<Vec<u8>>()
                    + p.ctl_out.iter().map(Vec::capacity).sum::<usize>()
            })
            .sum();
        let peers = self.peers.bytes()
            + self.book.bytes()
            + self.active.capacity() * std::mem::size_of::<Rank>()
            + heap;
        (a.queues(), a.dm_bytes + host as u64, peers as u64)
    }

    /// The error of an operation towards failed peer `r`: the reason it failed for.
    fn peer_gone(&self, r: Rank) -> Error {
        let why = self.gone.get(&r).map_or("failed earlier", String::as_str);
        Error::peer_failed(r, why.to_string())
    }

    /// Peer `r` failed: its zero-copy sends fail, and the core hears of it at the next
    /// progress call.
    fn fail_peer(&mut self, r: Rank, why: String) {
        self.peers[r as usize].failed = true;
        self.gone.insert(r, why.clone());
        for z in self.zsends.iter_mut().flatten() {
            if z.dest == r && z.result.is_none() {
                z.result = Some(Err(Error::peer_failed(r, why.clone())));
            }
        }
        self.failures.push_back((r, why));
    }

    /// The address handle of `r`; a peer whose process is gone is failed (`None`), not an
    /// error of this call: a rank that finished may exit before a slower one first answers it.
    fn reach(&mut self, r: Rank) -> Result<Option<(verbs::Ah, u32)>> {
        match self.ah_of(r) {
            Ok(a) => Ok(Some(a)),
            Err(e) if e.kind() == weft_provider::ErrorKind::PeerFailed => {
                if !self.peers[r as usize].failed {
                    let why = match e.detail() {
                        weft_provider::ErrorDetail::PeerFailed { reason, .. } => reason.clone(),
                        _ => e.to_string(),
                    };
                    self.fail_peer(r, why);
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Post what `r`'s link has to send, while the send queue has room.
    fn transmit(&mut self, r: Rank, now: Instant) -> Result<()> {
        let i = r as usize;
        let p = &self.peers[i];
        if p.link.is_none() || p.failed {
            return Ok(());
        }
        let Some((ah, qpn)) = self.reach(r)? else {
            return Ok(());
        };
        let Some(link) = self.peers[i].link.as_mut() else {
            return Ok(());
        };
        while self.sq_used < SQ {
            let Some(tx) = link.poll_transmit(now) else {
                break;
            };
            let h = tx.header;
            let wr = match tx.payload {
                Some(&slot) => {
                    // A copy of this packet still in the HCA's hands keeps the header it had
                    // (same sequence number, an older acknowledgement, still true): the HCA
                    // may be reading those bytes.
                    if self.send_refs[slot as usize] == 0 {
                        // SAFETY: no send of the slot is in the HCA's hands (no reference).
                        let b = unsafe { self.send.buf(slot) };
                        wire::put_seq(b, h.psn.unwrap_or(0), h.ack);
                    }
                    self.send_refs[slot as usize] += 1;
                    let len = self.send_len[slot as usize] as usize;
                    SendWr::send(K_SEND | slot as u64, &[self.send.sge(slot, len)])
                }
                None => {
                    // A pure acknowledgement; with no buffer free it is dropped (the peer's
                    // timer or its next packet brings another).
                    let Some(c) = self.ctl.free.pop() else {
                        continue;
                    };
                    // SAFETY: a free control slot: no send of it is outstanding.
                    let b = unsafe { self.ctl.buf(c) };
                    wire::put_ack(b, self.rank, h.ack);
                    SendWr::send(K_CTL | c as u64, &[self.ctl.sge(c, PKT)])
                }
            };
            self.hca.post_send(self.qp, &[wr.to(ah, qpn, self.qkey)])?;
            self.sq_used += 1;
            self.stats.packets_sent += 1;
        }
        Ok(())
    }

    /// Probe the peers we have a link to and nothing unacknowledged with: a dead one then
    /// owes an acknowledgement and is failed after `WEFT_VERBS_UD_TIMEOUT` (a rank that only
    /// waits to receive would otherwise never notice). A round looks at the next
    /// `WEFT_VERBS_UD_KEEPALIVE_PEERS` links in turn, not at all of them, and probes hold at
    /// most half the send buffers (a probe keeps its buffer until acknowledged): a process that
    /// had talked to 16K peers probed until no send buffer was left, every 2 s, and its own
    /// messages waited for the acknowledgements of a thousand probes.
    fn keepalives(&mut self) {
        let n = self.active.len();
        for _ in 0..self.cfg.keepalive_peers.min(n) {
            let k = self.ka_next % n;
            let r = self.active[k];
            let p = &mut self.peers[r as usize];
            if r == self.rank || p.failed || p.link.as_ref().is_none_or(|l| l.in_flight() > 0) {
                self.ka_next = k + 1;
                continue;
            }
            // The other half of the send buffers stays for data: this peer is the first of the
            // next round.
            if self.send.free.len() <= self.cfg.send_bufs / 2 {
                return;
            }
            let Some(slot) = self.send.free.pop() else {
                return;
            };
            self.ka_next = k + 1;
            // SAFETY: a free send slot: no send of it is outstanding.
            let b = unsafe { self.send.buf(slot) };
            wire::put_data(b, F_FIRST | F_LAST | F_PING, 0, self.rank, 0);
            self.send_len[slot as usize] = PKT as u32;
            let link = self.peers[r as usize].link.as_mut().expect("checked above");
            if link.send(slot).is_err() {
                self.send.free.push(slot);
            } else {
                self.mark_busy(r);
            }
        }
    }

    /// A send slot is free once acknowledged and no longer read by the HCA.
    fn maybe_free(&mut self, slot: u32) {
        let s = slot as usize;
        if self.send_acked[s] && self.send_refs[s] == 0 {
            self.send_acked[s] = false;
            self.send.free.push(slot);
        }
    }

    /// A packet arrived in receive slot `i` (`n` bytes after the GRH). A data packet next in
    /// order, with nothing kept ahead of it, is assembled straight from the receive buffer
    /// (returns the messages that delivers to `sink`); any other packet is copied into its
    /// link to wait for `drain`.
    fn on_recv(
        &mut self,
        i: u32,
        n: usize,
        (src_qp, with_grh): (u32, bool),
        now: Instant,
        sink: &mut dyn Sink,
    ) -> usize {
        let mtu = self.cfg.mtu;
        // SAFETY (here and below): the receive of slot `i` completed; the slot is reposted
        // only after `on_recv` returns.
        let b = &unsafe { self.recv.buf(i) }[GRH..GRH + n.min(mtu)];
        let Some(wire::Pkt {
            kind,
            flags,
            hlen,
            src,
            psn,
            ack,
            total,
        }) = wire::decode(b, self.size, MAX_HDR, MAX_PAYLOAD)
        else {
            self.stats.malformed += 1;
            return 0;
        };
        // SAFETY: as above (the GRH in front of the packet; copied: `sent_by` needs `self`).
        let grh: Option<[u8; GRH]> = with_grh
            .then(|| unsafe { self.recv.bytes(i, GRH) }.try_into().ok())
            .flatten();
        if !self.sent_by(src, src_qp, grh.as_ref().map(|g| &g[..])) {
            self.stats.spoofed += 1;
            return 0;
        }
        let p = &mut self.peers[src as usize];
        if p.failed {
            return 0;
        }
        self.stats.packets_recv += 1;
        let header = Header {
            psn: (kind == KIND_DATA).then_some(psn),
            ack,
        };
        if kind == KIND_DATA
            && Self::link_of(p, src, &self.cfg, &mut self.active, &mut self.busy)
                .on_next_in_order(now, header)
        {
            // Next in order with nothing waiting: straight from the receive buffer (what
            // `drain` does with a packet the link kept).
            // SAFETY: as above.
            let body = &unsafe { self.recv.buf(i) }[GRH + PKT..GRH + n.min(mtu)];
            let head = Head { flags, hlen, total };
            return Self::take(
                &mut p.rx,
                &mut self.zin,
                &mut self.stats,
                src,
                head,
                body,
                sink,
            );
        }
        // The engine keeps the packet (flags, lengths and bytes) until it is next in order.
        // SAFETY: as above.
        let b = &unsafe { self.recv.buf(i) }[GRH..GRH + n.min(mtu)];
        let spare = &mut self.spare;
        let payload = (kind == KIND_DATA).then(|| {
            let mut v = spare.pop().unwrap_or_default();
            v.clear();
            v.push(flags);
            v.extend_from_slice(&b[2..4]);
            v.extend_from_slice(&b[16..20]);
            v.extend_from_slice(&b[PKT..]);
            v
        });
        let link = self.link(src);
        link.on_packet(now, header, payload);
        0
    }

    /// Deliver `r`'s packets that are next in order, and free the send slots it acknowledged.
    fn drain(&mut self, r: Rank, sink: &mut dyn Sink) -> usize {
        let i = r as usize;
        let mut n = 0;
        let peer = &mut self.peers[i];
        loop {
            let Some(link) = peer.link.as_mut() else {
                return n;
            };
            let Some(p) = link.poll_deliver() else {
                break;
            };
            let head = Head {
                flags: p[0],
                hlen: get_u16(&p[1..3]) as usize,
                total: get_u32(&p[3..7]),
            };
            let rx = &mut peer.rx;
            n += Self::take(rx, &mut self.zin, &mut self.stats, r, head, &p[7..], sink);
            // The packet's buffer serves a later arrival (no allocation per packet).
            if self.spare.len() < SPARE {
                self.spare.push(p);
            }
        }
        while let Some(slot) = self.peers[i].link.as_mut().and_then(|l| l.poll_acked()) {
            self.send_acked[slot as usize] = true;
            self.maybe_free(slot);
        }
        n
    }

    /// `r`'s next data packet in order, from the receive buffer or from its link: a
    /// zero-copy control message waits in `zin`, a probe is dropped, anything else goes to
    /// the message being assembled. Returns the messages delivered to `sink`. Inlined: out of
    /// line it cost 8-byte latency 0.03 µs (0.52 against 0.49, alternated runs).
    #[inline]
    fn take(
        rx: &mut Rx,
        zin: &mut Vec<(Rank, Vec<u8>)>,
        stats: &mut Stats,
        r: Rank,
        head: Head,
        body: &[u8],
        sink: &mut dyn Sink,
    ) -> usize {
        if head.flags & F_CTRL != 0 {
            zin.push((r, body.to_vec()));
            0
        } else if head.flags & F_PING != 0 {
            0
        } else {
            Self::assemble(rx, stats, r, head, body, sink)
        }
    }

    /// Put `r`'s next packet in order (`body`, with its flags and lengths) into the message
    /// being assembled; deliver a message it completes. Returns the messages delivered.
    fn assemble(
        rx: &mut Rx,
        stats: &mut Stats,
        r: Rank,
        head: Head,
        body: &[u8],
        sink: &mut dyn Sink,
    ) -> usize {
        let Head { flags, hlen, total } = head;
        if flags & F_FIRST != 0 {
            if body.len() < hlen || rx.active {
                stats.malformed += 1;
                rx.active = false;
                return 0;
            }
            if flags & F_LAST != 0 {
                if body.len() - hlen != total as usize {
                    stats.malformed += 1;
                    return 0;
                }
                stats.am_recv += 1;
                sink.am(r, &body[..hlen], &body[hlen..]);
                return 1;
            }
            rx.active = true;
            rx.hlen = hlen;
            rx.total = total as usize;
            rx.data.clear();
            rx.data.extend_from_slice(body);
            return 0;
        }
        if !rx.active {
            stats.malformed += 1;
            return 0;
        }
        rx.data.extend_from_slice(body);
        if rx.data.len() > rx.hlen + rx.total {
            stats.malformed += 1;
            rx.active = false;
            return 0;
        }
        if flags & F_LAST != 0 {
            rx.active = false;
            if rx.data.len() != rx.hlen + rx.total {
                stats.malformed += 1;
                return 0;
            }
            stats.am_recv += 1;
            sink.am(r, &rx.data[..rx.hlen], &rx.data[rx.hlen..]);
            return 1;
        }
        0
    }
}

/// UD zero-copy: the receive side (registration, posting, rounds) and the send side.
impl VerbsUd {
    /// Post receives for `pieces` of zero-copy receive `z` (recorded as posted by its
    /// [`zcopy::Recv`] already), in this order.
    fn zpost(&mut self, z: usize, pieces: &[u32]) -> Result<()> {
        let Some(zr) = self.zrecvs[z].as_ref() else {
            return Ok(());
        };
        let zq = &self.zqps[zr.qp];
        let grh = self.scratch.sge(0, GRH);
        let wrs: Vec<verbs::RecvWr> = pieces
            .iter()
            .map(|&k| {
                let (off, len) = zr.r.region(k);
                let user = verbs::Sge {
                    addr: zr.mr.addr + off as u64,
                    length: len as u32,
                    lkey: zr.mr.lkey,
                };
                let id = K_ZRX | (zr.qp as u64) << 48 | ((zq.gen & 0xffff) as u64) << 32 | k as u64;
                verbs::RecvWr::new(id, &[grh, user])
            })
            .collect();
        self.hca.post_recv(zq.qp, &wrs)
    }

    /// Register `[base, base + len)` for one zero-copy transfer into it: a pool QP, the
    /// first round's receives posted.
    fn zrecv_open(&mut self, base: *mut u8, len: usize, shared: bool) -> Result<MemRegion> {
        let piece = self.cfg.mtu;
        if len < self.cfg.zcopy_min || len.div_ceil(piece) > zcopy::MAX_PIECES as usize {
            return Err(Error::invalid(format!(
                "verbs-ud: {len} bytes go by copy (WEFT_VERBS_UD_ZCOPY_MIN={}, at most {} pieces)",
                self.cfg.zcopy_min,
                zcopy::MAX_PIECES
            )));
        }
        let Some(q) = self.zqps.iter().position(|z| z.user.is_none()) else {
            self.stats.zrefused += 1;
            return Err(Error::invalid(
                "verbs-ud: every zero-copy QP is busy (WEFT_VERBS_UD_ZCOPY_QPS)",
            ));
        };
        // SAFETY: the caller (the core's write rendezvous) keeps the buffer borrowed until
        // `mr_deregister`, which takes the posted receives back and deregisters first.
        let mr = unsafe {
            self.hca
                .reg_mr(self.pd, base, len, verbs::Access::LOCAL_WRITE)
        }?;
        let xfer = self.next_xfer;
        self.next_xfer = (xfer + 1) & zcopy::XFER_MASK;
        let mut r = zcopy::Recv::new(
            xfer,
            len,
            piece,
            ZDEPTH as usize,
            zcopy::max_ranges(self.cfg.mtu - PKT),
            !shared,
        );
        let first = r.first();
        let z = match self.zrecvs.iter().position(Option::is_none) {
            Some(z) => z,
            None => {
                self.zrecvs.push(None);
                self.zrecvs.len() - 1
            }
        };
        self.zrecvs[z] = Some(ZRecv {
            r,
            qp: q,
            mr,
            base,
            sender: None,
            fin: false,
        });
        self.zqps[q].user = Some(z);
        if let Err(e) = self.zpost(z, &first) {
            let _ = self.zrecv_close(z);
            return Err(e);
        }
        let key = zcopy::Key {
            qpn: self.zqps[q].qp.qpn,
            xfer,
            first: first.len() as u32,
            piece,
        };
        Ok(MemRegion {
            key: key.encode(),
            // Writes address the region by offset.
            addr: 0,
            len,
            handle: Z_HANDLE | z as u64,
            desc: mr.lkey as u64,
        })
    }

    /// End zero-copy receive `z`: receives still posted over the buffer are taken back (QP
    /// reset) and the buffer deregistered (waiting out a landing under way) before this
    /// returns; a sender not yet told the transfer ended is told it was given up.
    fn zrecv_close(&mut self, z: usize) -> Result<()> {
        let zr = self
            .zrecvs
            .get_mut(z)
            .and_then(Option::take)
            .ok_or_else(|| Error::invalid("verbs-ud: deregistering an unknown region"))?;
        let zq = &mut self.zqps[zr.qp];
        zq.gen = zq.gen.wrapping_add(1);
        zq.user = None;
        let qp = zq.qp;
        let reset = if zr.r.has_posted() {
            self.hca
                .modify_qp(
                    qp,
                    &verbs::QpAttr {
                        qp_state: Some(verbs::QpState::Reset),
                        ..verbs::QpAttr::default()
                    },
                )
                .and_then(|()| verbs::activate_ud(&*self.hca, qp, self.qkey))
        } else {
            Ok(())
        };
        let dereg = self.hca.dereg_mr(zr.mr);
        if !zr.fin {
            if let Some(s) = zr.sender {
                self.send_ctl(s, &zcopy::Ctl::Abort { xfer: zr.r.xfer });
            }
        }
        if let Err(e) = &reset {
            // The QP could not be reset: keep it out of the pool (its receives point at a
            // deregistered buffer and would only fail).
            tracing::warn!("verbs-ud: a zero-copy QP could not be reset: {e}");
            self.zqps[zr.qp].user = Some(usize::MAX);
        }
        dereg.and(reset)
    }

    /// Queue control message `c` to `r` and send what the link has room for.
    fn send_ctl(&mut self, r: Rank, c: &zcopy::Ctl) {
        self.peers[r as usize].ctl_out.push_back(c.encode());
        self.flush_ctl(r);
    }

    fn flush_ctl(&mut self, r: Rank) {
        let i = r as usize;
        while !self.peers[i].ctl_out.is_empty() && !self.peers[i].failed {
            if self.link(r).room() < 1 {
                return;
            }
            let Some(slot) = self.send.free.pop() else {
                return;
            };
            let body = self.peers[i].ctl_out.pop_front().expect("checked above");
            let rank = self.rank;
            // SAFETY: a free send slot: no send of it is outstanding.
            let b = unsafe { self.send.buf(slot) };
            wire::put_data(b, F_FIRST | F_LAST | F_CTRL, 0, rank, body.len() as u32);
            b[PKT..PKT + body.len()].copy_from_slice(&body);
            self.send_len[slot as usize] = (PKT + body.len()) as u32;
            if self.link(r).send(slot).is_err() {
                self.send.free.push(slot);
                return;
            }
        }
    }

    /// Post the pieces zero-copy sends have due, while the send queue has room; announce a
    /// round's end once all its pieces are posted.
    fn zpump(&mut self) -> Result<()> {
        for s in 0..self.zsends.len() {
            let Some(z) = self.zsends[s].as_ref() else {
                continue;
            };
            if z.result.is_some() || (z.queue.is_empty() && !z.done_due) {
                continue;
            }
            let dest = z.dest;
            let Some((ah, _)) = self.reach(dest)? else {
                continue;
            };
            let z = self.zsends[s].as_mut().expect("checked above");
            let room = (SQ - SQ_RESERVE).saturating_sub(self.sq_used) as usize;
            let n = room.min(z.queue.len());
            if n > 0 {
                let wrs: Vec<SendWr> = z
                    .queue
                    .drain(..n)
                    .map(|k| {
                        let off = k as usize * z.key.piece;
                        let sge = verbs::Sge {
                            // SAFETY (address arithmetic only): `k` < pieces, so `off` < len.
                            addr: z.ptr as u64 + off as u64,
                            length: z.key.piece.min(z.len - off) as u32,
                            lkey: z.lkey,
                        };
                        SendWr::send_imm(K_ZTX | s as u64, &[sge], zcopy::imm(z.key.xfer, k))
                            .to(ah, z.key.qpn, self.qkey)
                    })
                    .collect();
                self.hca.post_send(self.qp, &wrs)?;
                z.outstanding += n as u32;
                self.sq_used += n as u32;
                self.stats.zpieces += n as u64;
            }
            if z.queue.is_empty() && z.done_due {
                z.done_due = false;
                let c = zcopy::Ctl::Done {
                    xfer: z.key.xfer,
                    round: z.round,
                };
                self.send_ctl(dest, &c);
            }
        }
        Ok(())
    }

    /// A zero-copy control message from `src`.
    fn zctl(&mut self, src: Rank, body: &[u8]) -> Result<()> {
        use zcopy::Ctl;
        let Some(c) = Ctl::decode(body) else {
            self.stats.malformed += 1;
            return Ok(());
        };
        match c {
            Ctl::Done { xfer, round } => {
                let z = self.zrecvs.iter().position(|z| {
                    z.as_ref()
                        .is_some_and(|z| z.r.xfer == xfer && z.sender.is_none_or(|s| s == src))
                });
                let Some(z) = z else {
                    // The receive is gone (or never was): the sender must not wait.
                    self.send_ctl(src, &Ctl::Abort { xfer });
                    return Ok(());
                };
                let zr = self.zrecvs[z].as_mut().expect("found above");
                zr.sender = Some(src);
                let Some((moves, next)) = zr.r.on_done(round) else {
                    return Ok(());
                };
                for &(from, to, len) in &moves {
                    let (f, _) = zr.r.region(from);
                    let (t, _) = zr.r.region(to);
                    // SAFETY: both places lie in the buffer registered for this receive
                    // (alive until `mr_deregister`); they are different pieces, so they do not
                    // overlap; neither has a receive posted (`Recv::on_done` moves only into
                    // places without one, and `from`'s receive completed), so the HCA does not
                    // write either meanwhile; `len` is at most a piece.
                    unsafe { std::ptr::copy_nonoverlapping(zr.base.add(f), zr.base.add(t), len) };
                }
                self.stats.zmoved += moves.len() as u64;
                match next {
                    zcopy::Next::Finished => {
                        zr.fin = true;
                        self.stats.zrecvs += 1;
                        self.stats.zregranted += zr.r.regranted;
                        self.send_ctl(src, &Ctl::Fin { xfer });
                    }
                    zcopy::Next::Stuck => {
                        zr.fin = true;
                        self.send_ctl(src, &Ctl::Abort { xfer });
                    }
                    zcopy::Next::Grant { round, new, pieces } => {
                        self.stats.zrounds += 1;
                        self.zpost(z, &new)?;
                        self.send_ctl(
                            src,
                            &Ctl::Grant {
                                xfer,
                                round,
                                pieces,
                            },
                        );
                    }
                }
            }
            Ctl::Grant {
                xfer,
                round,
                pieces,
            } => {
                if let Some(z) = self.zsend_of(src, xfer) {
                    let n = z.len.div_ceil(z.key.piece) as u32;
                    if pieces.iter().any(|&k| k >= n) {
                        self.stats.malformed += 1;
                    } else if round == z.round + 1 {
                        z.round = round;
                        z.queue = pieces.into();
                        z.done_due = true;
                    }
                }
            }
            Ctl::Fin { xfer } => {
                if let Some(z) = self.zsend_of(src, xfer) {
                    z.result = Some(Ok(()));
                }
            }
            Ctl::Abort { xfer } => {
                if let Some(z) = self.zsend_of(src, xfer) {
                    z.result = Some(Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: src,
                        what: "the receiver gave the zero-copy transfer up".into(),
                    })));
                }
            }
        }
        Ok(())
    }

    fn zsend_of(&mut self, dest: Rank, xfer: u32) -> Option<&mut ZSend> {
        self.zsends
            .iter_mut()
            .flatten()
            .find(|z| z.dest == dest && z.key.xfer == xfer && z.result.is_none())
    }

    /// Report zero-copy sends that are over and whose pieces the HCA no longer reads.
    fn zcomplete(&mut self, sink: &mut dyn Sink) -> usize {
        let mut n = 0;
        for slot in &mut self.zsends {
            if slot
                .as_ref()
                .is_some_and(|z| z.result.is_some() && z.outstanding == 0)
            {
                let z = slot.take().expect("checked above");
                if let Some(t) = z.token {
                    sink.complete(
                        t,
                        z.result.expect("checked above").map(|()| Completed::Done),
                    );
                }
                n += 1;
            }
        }
        n
    }
}

impl Provider for VerbsUd {
    fn name(&self) -> &str {
        "verbs-ud"
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let i = self.check_rank(dest)?;
        if header.len() > MAX_HDR {
            return Err(Error::invalid(format!(
                "verbs-ud: header of {} bytes (at most {MAX_HDR})",
                header.len()
            )));
        }
        let total: usize = payload.iter().map(|p| p.len()).sum();
        if total > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "verbs-ud: payload of {total} bytes (at most {}: the packets of one message \
                 must fit WEFT_VERBS_UD_WINDOW and WEFT_VERBS_UD_SEND_BUFS)",
                self.caps.max_am_payload
            )));
        }
        if self.peers[i].failed {
            return Err(self.peer_gone(dest));
        }
        let room = self.cfg.mtu - PKT;
        let bytes = header.len() + total;
        let packets = bytes.div_ceil(room).max(1);
        let link = Self::link_of(
            &mut self.peers[i],
            dest,
            &self.cfg,
            &mut self.active,
            &mut self.busy,
        );
        if link.room() < packets || self.send.free.len() < packets {
            return Ok(SendOutcome::Busy);
        }
        // Header and payload, cut into packets: slices copied whole (not byte by byte).
        let parts: smallvec::SmallVec<[&[u8]; 8]> = std::iter::once(header)
            .chain(payload.iter().map(|p| &**p))
            .filter(|p| !p.is_empty())
            .collect();
        let (mut part, mut at) = (0usize, 0usize);
        for k in 0..packets {
            let slot = self.send.free.pop().expect("counted above");
            let n = room.min(bytes - k * room);
            // SAFETY: a free send slot: no send of it is outstanding.
            let b = unsafe { self.send.buf(slot) };
            let flags =
                if k == 0 { F_FIRST } else { 0 } | if k + 1 == packets { F_LAST } else { 0 };
            wire::put_data(b, flags, header.len() as u16, self.rank, total as u32);
            let mut filled = 0;
            while filled < n {
                let src = &parts[part][at..];
                let c = src.len().min(n - filled);
                b[PKT + filled..PKT + filled + c].copy_from_slice(&src[..c]);
                filled += c;
                at += c;
                if at == parts[part].len() {
                    part += 1;
                    at = 0;
                }
            }
            self.send_len[slot as usize] = (PKT + n) as u32;
            if link.send(slot).is_err() {
                // Counted above: the window had room.
                self.send.free.push(slot);
                return Err(Error::invalid("verbs-ud: send window accounting"));
            }
        }
        self.stats.am_sent += 1;
        self.transmit(dest, reliable::now())?;
        Ok(SendOutcome::Sent)
    }

    /// First contact (the core calls this once, before the first operation towards `peer`):
    /// read its address, make the address handle and the link now, so that the first send
    /// finds them; a peer that published no address fails here.
    fn connect(&mut self, peer: Rank) -> Result<()> {
        let i = self.check_rank(peer)?;
        if self.peers[i].failed {
            return Err(self.peer_gone(peer));
        }
        self.ah_of(peer)?;
        self.link(peer);
        Ok(())
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut events = 0;
        // An idle call (nothing completed, nothing waiting here) only polls: timers
        // (retransmission, delayed acknowledgements, keepalives) run on every IDLE_CHECK-th
        // idle call, which keeps the clock and the links out of the spin loop.
        let n = self.hca.poll_cq(self.cq, &mut self.wcs)?;
        if n == 0
            && self.zin.is_empty()
            && self.failures.is_empty()
            && self.zsends.iter().all(Option::is_none)
        {
            self.idle = self.idle.wrapping_add(1);
            if self.idle % IDLE_CHECK != 0 {
                return Ok(0);
            }
        }
        if n == 0 {
            // Timers' turn: nothing is arriving, so the buffers consumed so far go back now.
            self.repost()?;
        }
        self.idle = 0;
        let now = reliable::now();
        let mut first = Some(n);
        loop {
            let mut wcs = std::mem::take(&mut self.wcs);
            let n = match first.take() {
                Some(n) => n,
                None => self.hca.poll_cq(self.cq, &mut wcs)?,
            };
            for wc in &wcs[..n] {
                let idx = (wc.wr_id & 0xffff_ffff) as u32;
                match wc.wr_id & K_MASK {
                    K_RECV => {
                        if wc.status == WcStatus::Success {
                            let len = (wc.byte_len as usize).saturating_sub(GRH);
                            let from = (wc.src_qp, wc.grh);
                            events += self.on_recv(idx, len, from, now, sink);
                        }
                        self.repost.push(idx);
                    }
                    K_SEND => {
                        self.sq_used -= 1;
                        let s = idx as usize;
                        self.send_refs[s] = self.send_refs[s].saturating_sub(1);
                        self.maybe_free(idx);
                    }
                    K_CTL => {
                        self.sq_used -= 1;
                        self.ctl.free.push(idx);
                    }
                    K_ZRX => {
                        let q = ((wc.wr_id >> 48) & 0xff) as usize;
                        let gen = ((wc.wr_id >> 32) & 0xffff) as u32;
                        let Some(zq) = self.zqps.get(q) else {
                            continue;
                        };
                        // A completion of receives taken back earlier is not this transfer's.
                        if zq.gen & 0xffff != gen {
                            continue;
                        }
                        let Some(zr) = zq.user.and_then(|u| self.zrecvs.get_mut(u)?.as_mut())
                        else {
                            continue;
                        };
                        let got = match (wc.status, wc.imm) {
                            (WcStatus::Success, Some(imm)) => {
                                let (x, k) = zcopy::split_imm(imm);
                                Some((x, k, (wc.byte_len as usize).saturating_sub(GRH)))
                            }
                            _ => None,
                        };
                        zr.r.on_landed(got);
                    }
                    K_ZTX => {
                        self.sq_used -= 1;
                        if let Some(z) = self.zsends.get_mut(idx as usize).and_then(Option::as_mut)
                        {
                            z.outstanding = z.outstanding.saturating_sub(1);
                            if wc.status != WcStatus::Success && z.result.is_none() {
                                z.result = Some(Err(Error::invalid(format!(
                                    "verbs-ud: a zero-copy piece failed: {}",
                                    wc.status.as_str()
                                ))));
                            }
                        }
                    }
                    _ => {}
                }
            }
            self.wcs = wcs;
            // Consumed receive buffers go back in batches (one post for several).
            if self.repost.len() >= REPOST {
                self.repost()?;
            }
            if n < POLL {
                break;
            }
        }
        if let Some(every) = self.cfg.keepalive {
            if now >= self.next_keepalive {
                self.next_keepalive = now + every;
                self.keepalives();
            }
        }
        let busy = std::mem::take(&mut self.busy);
        for &r in &busy {
            events += self.drain(r, sink);
            let link = self.peers[r as usize].link.as_mut().expect("busy");
            // Checks its own timers (cheaper than asking for the next one first).
            link.on_timeout(now);
            if link.failed() && !self.peers[r as usize].failed {
                let why = format!(
                    "no acknowledgement for {} s",
                    self.cfg.timeout.as_secs_f64()
                );
                self.fail_peer(r, why);
            }
        }
        for (src, body) in std::mem::take(&mut self.zin) {
            self.zctl(src, &body)?;
        }
        self.zpump()?;
        events += self.zcomplete(sink);
        // Links that became busy meanwhile (a first packet from a new peer) joined
        // `self.busy`; they transmit on the next call.
        let mut busy = busy;
        let old = busy.len();
        busy.append(&mut self.busy);
        self.busy = busy;
        for k in 0..old {
            let r = self.busy[k];
            if !self.peers[r as usize].ctl_out.is_empty() {
                self.flush_ctl(r);
            }
            self.transmit(r, now)?;
        }
        // Idle links leave (a failed peer's too: it was failed above and sends nothing more).
        let peers = &mut self.peers;
        self.busy.retain(|&r| {
            let p = &mut peers[r as usize];
            let keep =
                !p.failed && (!p.ctl_out.is_empty() || p.link.as_ref().is_some_and(|l| !l.idle()));
            p.busy = keep;
            keep
        });
        while let Some((r, why)) = self.failures.pop_front() {
            sink.peer_failed(r, &why);
            events += 1;
        }
        Ok(events)
    }

    fn peer_caps(&self, _peer: Rank) -> Option<PeerCaps> {
        // Written (UD zero-copy), never read: the core's write rendezvous.
        let mut p = PeerCaps::from(&self.caps);
        p.rma_read = false;
        Some(p)
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if access.remote_read || access.remote_atomic {
            return Err(Error::from(ErrorDetail::Unsupported(
                "verbs-ud: no RDMA reads or atomics over unreliable datagrams".into(),
            )));
        }
        if self.zqps.is_empty() {
            return Err(Error::from(ErrorDetail::Unsupported(
                "verbs-ud: zero-copy is off (WEFT_VERBS_UD_ZCOPY_QPS=0)".into(),
            )));
        }
        if len == 0 {
            return Ok(MemRegion {
                key: 0,
                addr: base as u64,
                len: 0,
                handle: u64::MAX,
                desc: 0,
            });
        }
        if access.remote_write {
            return self.zrecv_open(base, len, access.shared);
        }
        let va = if access.local_write {
            verbs::Access::LOCAL_WRITE
        } else {
            verbs::Access(0)
        };
        // SAFETY: the caller keeps the memory valid until `mr_deregister` (this function's
        // contract), which is the HCA's registration contract.
        let mr = unsafe { self.hca.reg_mr(self.pd, base, len, va) }?;
        self.locals.insert(mr.handle, mr);
        Ok(MemRegion {
            key: 0,
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
        if mr.handle & Z_HANDLE != 0 {
            return self.zrecv_close((mr.handle & !Z_HANDLE) as usize);
        }
        let m = u32::try_from(mr.handle)
            .ok()
            .and_then(|h| self.locals.remove(&h))
            .ok_or_else(|| Error::invalid("verbs-ud: deregistering an unknown region"))?;
        self.hca.dereg_mr(m)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let i = self.check_rank(dest)?;
        if self.peers[i].failed {
            return Err(self.peer_gone(dest));
        }
        let bad = |what: &str| {
            Error::from(ErrorDetail::RemoteAccess {
                rank: dest,
                what: what.into(),
            })
        };
        let key = zcopy::Key::decode(remote.key)
            .filter(|k| k.piece == self.cfg.mtu)
            .ok_or_else(|| {
                bad("not a UD zero-copy key of this MTU (WEFT_VERBS_UD_MTU must agree)")
            })?;
        if remote.addr != 0 {
            return Err(bad("a zero-copy write starts at its region's start"));
        }
        let [one] = local else {
            return Err(Error::invalid(
                "verbs-ud: a zero-copy write takes one local piece",
            ));
        };
        let n = one.len.div_ceil(key.piece);
        if one.len == 0 || n > zcopy::MAX_PIECES as usize || one.desc == 0 {
            return Err(Error::invalid(format!(
                "verbs-ud: a zero-copy write of {} bytes from a registered buffer (at most {} pieces)",
                one.len,
                zcopy::MAX_PIECES
            )));
        }
        let z = ZSend {
            dest,
            key,
            ptr: one.ptr,
            len: one.len,
            lkey: one.desc as u32,
            queue: (0..key.first.min(n as u32)).collect(),
            round: 0,
            done_due: true,
            outstanding: 0,
            result: None,
            token: done.cq,
        };
        match self.zsends.iter().position(Option::is_none) {
            Some(s) => self.zsends[s] = Some(z),
            None => self.zsends.push(Some(z)),
        }
        self.stats.zsends += 1;
        self.link(dest);
        self.zpump()?;
        self.transmit(dest, reliable::now())
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let mut st = reliable::Stats::default();
        for (_, p) in self.peers.iter() {
            if let Some(l) = &p.link {
                let x = l.stats();
                st.resent += x.resent;
                st.timeouts += x.timeouts;
                st.fast_resends += x.fast_resends;
                st.pure_acks += x.pure_acks;
                st.duplicates += x.duplicates;
                st.kept += x.kept;
            }
        }
        let hc = self.hca.counters();
        let mem = self.memory();
        vec![
            ("am_sent", s.am_sent),
            ("am_received", s.am_recv),
            ("packets_sent", s.packets_sent),
            ("packets_received", s.packets_recv),
            ("resent", st.resent),
            ("timeouts", st.timeouts),
            ("fast_resends", st.fast_resends),
            ("pure_acks", st.pure_acks),
            ("duplicates", st.duplicates),
            ("out_of_order_kept", st.kept),
            ("malformed", s.malformed),
            ("spoofed", s.spoofed),
            ("links", self.active.len() as u64),
            ("busy_links", self.busy.len() as u64),
            ("zcopy_sends", s.zsends),
            ("zcopy_recvs", s.zrecvs),
            ("zcopy_pieces", s.zpieces),
            ("zcopy_rounds", s.zrounds),
            ("zcopy_moved", s.zmoved),
            ("zcopy_regranted", s.zregranted),
            ("zcopy_refused", s.zrefused),
            ("hca_ud_dropped", hc.ud_dropped),
            ("hca_ud_duplicated", hc.ud_duplicated),
            ("hca_qp_cache_misses", hc.qp_cache_misses),
            ("mem_hca_bytes", mem.0),
            ("mem_buffer_bytes", mem.1),
            ("mem_peer_bytes", mem.2),
        ]
    }

    fn close(&mut self) -> Result<()> {
        // After the final barrier: let the last packets be acknowledged (a peer may still
        // need them), bounded — a peer that already left never acknowledges.
        let deadline = reliable::now() + Duration::from_millis(250);
        // Empty rounds yield, then sleep: the acknowledgements come from peers' processes,
        // which on an oversubscribed host need the CPU this loop would otherwise keep.
        let mut pause = Backoff::new();
        loop {
            // Acknowledgements we owe go now, not after their delay: once we are gone nothing
            // would send them, and the peer's own close would wait for them in vain.
            let now = reliable::now();
            let mut waiting = false;
            for k in 0..self.peers.touched() {
                let r = self.peers.touched_rank(k);
                let p = &mut self.peers[r];
                let Some(l) = p.link.as_mut().filter(|_| !p.failed) else {
                    continue;
                };
                if l.owes_ack() {
                    l.ack_at_once();
                    self.transmit(r as Rank, now)?;
                }
                // (A peer that `transmit` found gone is waited for no more.)
                let p = &self.peers[r];
                if let Some(l) = p.link.as_ref().filter(|_| !p.failed) {
                    waiting |= l.in_flight() > 0 || l.owes_ack();
                }
            }
            // ... and must have left the send queue before `Drop` destroys the QP.
            if !(waiting || self.sq_used > 0) || now >= deadline {
                break;
            }
            let n = self.progress(&mut Discard::default())?;
            pause.round(n > 0);
        }
        Ok(())
    }
}

impl Drop for VerbsUd {
    fn drop(&mut self) {
        let _ = self.hca.destroy_qp(self.qp);
        for z in &self.zqps {
            let _ = self.hca.destroy_qp(z.qp);
        }
        for z in self.zrecvs.iter().flatten() {
            let _ = self.hca.dereg_mr(z.mr);
        }
        for m in self.locals.values() {
            let _ = self.hca.dereg_mr(*m);
        }
        self.scratch.release(&*self.hca);
        for ah in self.book.handles() {
            let _ = self.hca.destroy_ah(ah);
        }
        for pool in [&self.recv, &self.send, &self.ctl] {
            pool.release(&*self.hca);
        }
        let _ = self.hca.destroy_cq(self.cq);
        let _ = self.hca.dealloc_pd(self.pd);
    }
}

impl StaticProvider for VerbsUd {
    const NAME: &'static str = "verbs-ud";

    fn probe(_ctx: &ProbeContext) -> std::result::Result<(), String> {
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, Config::from_env()?, verbs::open_default()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(Config::from_env()?.caps())
    }
}

weft_provider::register_provider!(
    VerbsUd,
    priority = 7,
    summary = "InfiniBand Unreliable Datagram on the verbs layer (soft HCA or rdma-core): one UD queue pair for every peer, constant memory per peer, reliability and order by a sans-IO engine; RMA and atomics by active messages"
);

/// The completion queue, the UD QP every peer reaches and the zero-copy pool's QPs, activated
/// with `qkey` when given.
fn create_queues(
    hca: &dyn Hca,
    pd: verbs::Pd,
    cfg: &Config,
    qkey: Option<u32>,
) -> Result<(verbs::Cq, verbs::Qp, Vec<verbs::Qp>)> {
    let cqe = cfg.recvs as u32 + SQ + 16 + cfg.zcopy_qps as u32 * ZDEPTH;
    let cq = hca.create_cq(cqe.min(hca.attr().max_cqe.max(64)))?;
    let qp = hca.create_qp(pd, &qp_init(cq, cfg.recvs as u32))?;
    if let Some(k) = qkey {
        verbs::activate_ud(hca, qp, k)?;
    }
    let mut zqps = Vec::with_capacity(cfg.zcopy_qps);
    for _ in 0..cfg.zcopy_qps {
        let mut init = qp_init(cq, ZDEPTH);
        init.cap.max_send_wr = 1;
        init.cap.max_recv_sge = 2;
        let q = hca.create_qp(pd, &init)?;
        if let Some(k) = qkey {
            verbs::activate_ud(hca, q, k)?;
        }
        zqps.push(q);
    }
    Ok((cq, qp, zqps))
}

/// The buffer pools: scratch (zero-copy GRHs), receive (where every packet lands: HCA memory
/// where there is enough of it), send, control.
fn create_pools(hca: &dyn Hca, pd: verbs::Pd, cfg: &Config) -> Result<[Pool; 4]> {
    Ok([
        Pool::new(hca, pd, 1, 64, false)?,
        Pool::new(hca, pd, cfg.recvs, GRH + cfg.mtu, true)?,
        Pool::new(hca, pd, cfg.send_bufs, cfg.mtu, false)?,
        Pool::new(hca, pd, CTL, PKT, false)?,
    ])
}

/// What verbs-ud costs in memory with the current parameters, from the HCA's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Per process, whatever the number of peers: the completion queue, the UD QP and the
    /// zero-copy pool's QPs (HCA side) ...
    pub hca: u64,
    /// ... and the receive, send and control buffers.
    pub buffers: u64,
    /// Per rank of the job: its entry in the address book and its slot in the peer table
    /// (provider side) ...
    pub per_rank: u64,
    /// ... and per peer talked to, its record (the reliability link among it) and list entries.
    pub per_peer: u64,
}

/// Whether UD-ZCOPY is on under the environment (`WEFT_VERBS_UD_ZCOPY_QPS` above 0): without
/// it, large messages go by the core's pipeline over UD-SR.
pub fn zero_copy_on() -> Result<bool> {
    Ok(Config::from_env()?.zcopy_qps > 0)
}

/// Measure [`Footprint`] on the device `WEFT_VERBS_DEVICE` names.
pub fn footprint() -> Result<Footprint> {
    let mut cfg = Config::from_env()?;
    let hca = verbs::open_default()?;
    cfg.fit_mtu(hca.attr().active_mtu.bytes())?;
    let pd = hca.alloc_pd()?;
    let a0 = hca.accounting();
    let (cq, qp, zqps) = create_queues(&*hca, pd, &cfg, None)?;
    let a1 = hca.accounting();
    let pools = create_pools(&*hca, pd, &cfg)?;
    let a2 = hca.accounting();
    let host: usize = pools.iter().map(Pool::host_bytes).sum();
    for p in &pools {
        p.release(&*hca);
    }
    for q in zqps.into_iter().chain([qp]) {
        let _ = hca.destroy_qp(q);
    }
    let _ = hca.destroy_cq(cq);
    let _ = hca.dealloc_pd(pd);
    Ok(Footprint {
        hca: a1.queues() - a0.queues(),
        buffers: a2.dm_bytes - a1.dm_bytes + host as u64,
        per_rank: (4 + AddressBook::<Endpoint, verbs::Ah>::PER_RANK) as u64,
        per_peer: (std::mem::size_of::<Peer>()
            + 4
            + std::mem::size_of::<Rank>()
            + AddressBook::<Endpoint, verbs::Ah>::PER_ENTRY) as u64,
    })
}

/// The UD queue pair: receives from the shared pool.
fn qp_init(cq: verbs::Cq, recvs: u32) -> verbs::QpInitAttr {
    verbs::QpInitAttr {
        qp_type: QpType::Ud,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: verbs::QpCap {
            max_send_wr: SQ,
            max_recv_wr: recvs,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_provider::bootstrap::InProcessJob;
    use weft_testing::thread_cpu_ticks;

    /// A close that lingers for an acknowledgement that does not come (the peer alive but not
    /// progressing) must not spin on its CPU for the whole linger: on an oversubscribed host
    /// that CPU is what the peer needs to answer. It used to spin for all 250 ms.
    #[test]
    fn a_lingering_close_leaves_the_cpu_to_others() {
        let job = InProcessJob::new(2, Duration::from_secs(20));
        let (closed_tx, closed_rx) = std::sync::mpsc::channel::<()>();
        // Rank 1 stays open and never progresses until rank 0 has closed: rank 0's message
        // is never acknowledged.
        let j1 = job.clone();
        let one = std::thread::spawn(move || {
            let mut b = VerbsUd::open(&mut j1.rank(1)).unwrap();
            closed_rx
                .recv_timeout(Duration::from_secs(20))
                .expect("rank 0 closed");
            b.close().unwrap();
        });
        let zero = std::thread::spawn(move || {
            let mut a = VerbsUd::open(&mut job.rank(0)).unwrap();
            a.connect(1).unwrap();
            assert_eq!(a.am_send(1, &[1], &[]).unwrap(), SendOutcome::Sent);
            let (t0, c0) = (std::time::Instant::now(), thread_cpu_ticks());
            a.close().unwrap();
            let r = (t0.elapsed(), thread_cpu_ticks() - c0);
            closed_tx.send(()).unwrap();
            r
        });
        let (wall, cpu) = zero.join().unwrap();
        one.join().unwrap();
        assert!(
            wall >= Duration::from_millis(200),
            "the close did not linger ({wall:?}): the test proves nothing"
        );
        assert!(
            cpu * 10 < wall.as_millis() as u64 / 2,
            "the close ran {} ms on its CPU out of {wall:?}",
            cpu * 10
        );
    }

    /// A rank that closes while it owes an acknowledgement (they are delayed by up to 100 µs)
    /// sends it before it goes: nothing else ever would, and the peer's close then lingered its
    /// whole 250 ms for it — at the end of every hybrid job, whose UD links fall quiet once
    /// RC takes the traffic.
    #[test]
    fn a_close_sends_the_acknowledgements_it_owes() {
        let job = InProcessJob::new(2, Duration::from_secs(20));
        let (closed_tx, closed_rx) = std::sync::mpsc::channel::<()>();
        // No keepalive probes: rank 1 must have nothing of its own in flight.
        let open = |r: Rank, job: &std::sync::Arc<InProcessJob>| {
            let mut cfg = Config::from_env().unwrap();
            cfg.keepalive = None;
            VerbsUd::open_with(&mut job.rank(r), cfg, verbs::open_default().unwrap()).unwrap()
        };
        let j1 = job.clone();
        let one = std::thread::spawn(move || {
            let mut b = open(1, &j1);
            b.connect(0).unwrap();
            let (mut got, t0) = (Discard::default(), reliable::now());
            while got.ams == 0 {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "rank 0's message never came"
                );
                b.progress(&mut got).unwrap();
            }
            // Nothing of its own in flight: the close has no acknowledgement to wait for.
            let l = b.peers[0].link.as_ref().unwrap();
            assert!(
                l.owes_ack() && l.in_flight() == 0,
                "not the case under test"
            );
            b.close().unwrap();
            drop(b);
            closed_tx.send(()).unwrap();
        });
        let mut a = open(0, &job);
        a.connect(1).unwrap();
        assert_eq!(a.am_send(1, &[1], &[]).unwrap(), SendOutcome::Sent);
        closed_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("rank 1 closed");
        one.join().unwrap();
        let t0 = reliable::now();
        while a.peers[1].link.as_ref().unwrap().in_flight() > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "rank 1 left without acknowledging rank 0's message"
            );
            a.progress(&mut Discard::default()).unwrap();
        }
    }

    /// A keepalive round looks at the next `WEFT_VERBS_UD_KEEPALIVE_PEERS` links, starting
    /// where the last one stopped, so that every peer is probed in turn at a cost per round
    /// that does not grow with the peers talked to; probes leave half the send buffers to
    /// data. Every round used to probe every link, until no send buffer was left.
    #[test]
    fn keepalive_rounds_take_the_linked_peers_in_turn() {
        const N: u32 = 13;
        let job = InProcessJob::new(N, Duration::from_secs(20));
        // The other ranks never progress: a probe stays unacknowledged, so a probed link is
        // one with something in flight. They stay open until rank 0 is done.
        let (others, dones): (Vec<_>, Vec<_>) = (1..N)
            .map(|r| {
                let job = job.clone();
                let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
                let h = std::thread::spawn(move || {
                    let p = VerbsUd::open(&mut job.rank(r)).unwrap();
                    done_rx
                        .recv_timeout(Duration::from_secs(20))
                        .expect("rank 0 done");
                    drop(p);
                });
                (h, done_tx)
            })
            .unzip();
        let mut cfg = Config::from_env().unwrap();
        // Rounds run only when the test calls them.
        cfg.keepalive = None;
        cfg.keepalive_peers = 5;
        // Probes may hold 8 of them.
        cfg.send_bufs = 16;
        let mut a =
            VerbsUd::open_with(&mut job.rank(0), cfg, verbs::open_default().unwrap()).unwrap();
        for r in 1..N {
            a.connect(r).unwrap();
        }
        let probed = |a: &VerbsUd| -> Vec<Rank> {
            (1..N)
                .filter(|&r| a.peers[r as usize].link.as_ref().unwrap().in_flight() > 0)
                .collect()
        };
        assert!(probed(&a).is_empty(), "in flight before any round");
        // Progress sends what the links queued (on its timers' turn: an idle call only polls).
        let flush = |a: &mut VerbsUd| {
            for _ in 0..IDLE_CHECK {
                a.progress(&mut Discard::default()).unwrap();
            }
        };
        // Packets sent, less those sent again (a probe's timer may run out meanwhile).
        let sent = |a: &VerbsUd| {
            let resent = a
                .counters()
                .iter()
                .find(|c| c.0 == "resent")
                .map_or(0, |c| c.1);
            a.stats.packets_sent - resent
        };
        let sent0 = sent(&a);
        a.keepalives();
        assert_eq!(probed(&a), [1, 2, 3, 4, 5], "the first round");
        flush(&mut a);
        assert_eq!(sent(&a) - sent0, 5, "probes sent by the first round");
        // Three more probes, and half the send buffers are taken: the round stops there.
        a.keepalives();
        assert_eq!(probed(&a), (1..=8).collect::<Vec<_>>(), "the second round");
        a.keepalives();
        assert_eq!(
            probed(&a),
            (1..=8).collect::<Vec<_>>(),
            "no buffer to spare"
        );
        flush(&mut a);
        assert_eq!(sent(&a) - sent0, 8, "one probe a peer");
        assert_eq!(a.send.free.len(), 8, "the data's half of the send buffers");
        // Data still goes out.
        assert_eq!(a.am_send(12, &[1], &[]).unwrap(), SendOutcome::Sent);
        for d in dones {
            d.send(()).unwrap();
        }
        for h in others {
            h.join().unwrap();
        }
    }

    /// A peer failed for a reason other than silence is reported with that reason by every
    /// later operation towards it (it used to be "no acknowledgement for 30 s" whatever the
    /// reason).
    #[test]
    fn a_failed_peer_is_reported_with_the_reason_it_failed_for() {
        let job = InProcessJob::new(2, Duration::from_secs(20));
        // Rank 1 keeps its device until rank 0 is done: an open (or a connect) that reaches
        // for a device already dropped fails, as it should, and the test with it (it did when
        // rank 1 left first).
        let done = std::sync::Arc::new(std::sync::Barrier::new(2));
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (job, done) = (job.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut p = VerbsUd::open(&mut job.rank(r)).unwrap();
                    if r == 0 {
                        p.connect(1).unwrap();
                        p.fail_peer(1, "soft HCA of process 7 is gone (it exited)".into());
                        let e = p.am_send(1, &[1], &[]).unwrap_err();
                        assert!(e.to_string().contains("it exited"), "{e}");
                        let e = p.connect(1).unwrap_err();
                        assert!(e.to_string().contains("it exited"), "{e}");
                    }
                    done.wait();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }
}

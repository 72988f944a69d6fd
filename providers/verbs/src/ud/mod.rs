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

// Here the provider's state and opening; a module per concern beside it: `config` the
// parameters, `send` and `recv` the two sides of the data path, `zcopy_io` UD zero-copy's I/O
// (`zcopy` its protocol without I/O), `provider` the `Provider` entry points and teardown,
// `footprint` the queues and pools it opens with and `footprint()`, `wire` the packet header.
mod config;
mod footprint;
mod provider;
mod recv;
mod send;
pub mod wire;
/// UD zero-copy's sans-IO engine and its control messages (public for the fuzz target of
/// `Ctl::decode`, which reads what a peer sends).
pub mod zcopy;
mod zcopy_io;

use config::*;
use footprint::*;
pub use footprint::{footprint, zero_copy_on, Footprint};
use wire::{F_CTRL, F_FIRST, F_LAST, F_PING, KIND_DATA, PKT};

use crate as verbs;
use crate::{Endpoint, Hca, Pool, QpType, SendWr, WcStatus};
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

impl crate::channel::UdChannel for VerbsUd {
    fn open_on(boot: &mut dyn Bootstrap, hca: std::sync::Arc<dyn Hca>) -> Result<VerbsUd> {
        Self::open_with(boot, Config::from_env()?, hca)
    }
}

impl VerbsUd {
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
        let (ah, ep) = self.book.handle(r, |ep| hca.create_ah(pd, &ep.ah_attr()))?;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_proto::testkit::thread_cpu_ticks;
    use weft_provider::bootstrap::InProcessJob;

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

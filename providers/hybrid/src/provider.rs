//! The `hybrid` provider: verbs-ud and verbs-rc opened side by side, each active message sent
//! over the channel the send-rule chain picks among those open to its peer, RC connections
//! opened by the budget's agreement, and order across channels restored on receipt.
//!
//! Every peer starts on UD-SR (verbs-ud's one UD QP). A message to or from a peer counts
//! towards its RC threshold; past it the two budgets agree ([`crate::budget`], control
//! messages over UD-SR) and both sides connect verbs-rc's RC QP, after which the chain may pick
//! RC-SR (send/receive over the shared receive queue) or, once verbs-rc has set up the peer's
//! eager slots, RC-FP. Each data message carries a per-peer sequence number (5 bytes before
//! the core's header: kind, number); the receiver hands messages to the core in that order
//! ([`crate::order`]), holding a copy of any that overtook its predecessors on another channel.
//!
//! Large messages go by the core's rendezvous over the channel the chain picks for them
//! (`peer_caps`, read again at connection events): RC-RDMA while the pair is connected (the
//! receiver reads the sender's buffer with verbs-rc), else UD-ZCOPY (the receiver's buffer
//! posted on one of verbs-ud's zero-copy QPs, the sender writes it). Registrations go to the
//! channel their access names; local ones to both. A chain without either channel streams
//! large messages in active-message chunks of at most its UD-SR size.
//!
//! Closing a connection (rebalancing with `WEFT_HYBRID_REBALANCE=1`, or a peer yielding its
//! slot to a starved process under `WEFT_HYBRID_FAIR`): the budget's `Drain` stops RC sends to the peer
//! (verbs-rc `quiesce`); once verbs-rc is quiet towards it the budget hears `drained` and
//! sends `Closed` with our next sequence number; its `Teardown` destroys the connection
//! (verbs-rc `disconnect`) once every message the peer numbered below its own `Closed` has
//! been delivered here.

use crate::budget::{Action, Budget, Ctrl, Limits, Link, RcState, Record};
use crate::rules::{Chain, Channel, JobChain, Open};
use crate::wire::{self, PREFIX};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;
use weft_proto::order::{Arrival, Holding, Reorder, Sequencer};
use weft_provider::bootstrap::Bootstrap;
use weft_provider::peers::PeerTable;
use weft_provider::provider::{
    Access, Caps, Completed, Completion, CompletionLevel, ConnEvent, MemRegion, PeerCaps,
    ProbeContext, Provider, RawIov, RawIovMut, RemoteAddr, RmaCaps, SendOutcome, Sink,
    StaticProvider, Token,
};
use weft_provider::types::Rank;
use weft_provider::{Error, Result};
use weft_verbs::Hca;
use weft_verbs_rc::{Sizing, VerbsRc};
use weft_verbs_ud::VerbsUd;

/// `WEFT_HYBRID_RULES` is empty, `auto` or a chain that parses.
fn check_rules(v: &str) -> std::result::Result<(), String> {
    if v.is_empty() || v.eq_ignore_ascii_case("auto") {
        return Ok(());
    }
    Chain::parse(v)
        .map(|_| ())
        .map_err(|e| format!("a send-rule chain ({e})"))
}

weft_provider::param!(RULES: Str check(check_rules) = "hybrid", "RULES", "",
    "hybrid: the send-rule chain, e.g. {size<=2048: RC-FP}, {size<=2008: UD-SR}, {size<=8192: RC-SR}, {size<=8192: UD-SR}, {true: RC-RDMA}, {true: UD-ZCOPY} (empty: that chain, paper 001's; sizes count the payload); auto: derived from each channel's cost measured on this host (cached)");
weft_provider::param!(RC_THRESHOLD: Uint = "hybrid", "RC_THRESHOLD", "100",
    "hybrid: messages exchanged with a peer (those the chain would send over RC were it open) before it earns an RC connection (MVAPICH: 100); 0 or 1: at the first message");
weft_provider::param!(MAX_RC: Uint[0, 1 << 20] = "hybrid", "MAX_RC", "16",
    "hybrid: RC connections per process at most (paper 001: 16; unset, every peer in a job of fewer than LIMITS_FROM ranks); 0: UD only");
weft_provider::param!(MAX_FP: Uint[0, 1 << 20] = "hybrid", "MAX_FP", "8",
    "hybrid: RC-FP rings per process (paper 001: 8 peers; FP_SPREAD shares their slots among up to MAX_RC peers; unset, every peer in a job of fewer than SMALL_JOB ranks, up to 64 peers with half rings below LIMITS_FROM)");
weft_provider::param!(SMALL_JOB: Uint = "hybrid", "SMALL_JOB", "32",
    "hybrid: in a job of fewer ranks (and of fewer than LIMITS_FROM), MAX_FP left unset gives every peer a whole RC-FP ring (MVAPICH2 gives RC-FP to every peer below 32 processes)");
weft_provider::param!(LIMITS_FROM: Uint = "hybrid", "LIMITS_FROM", "512",
    "hybrid: paper 001's limits (MAX_RC, MAX_FP left unset) hold in jobs of this many ranks and more (MVAPICH2 2.3.7 turns its hybrid on from 512 processes); below, an unset MAX_RC allows every peer and an unset MAX_FP up to 64 peers (MVAPICH2's polling set) with rings of half depth, whole rings for every peer below SMALL_JOB; 0: paper 001's limits at any size");
weft_provider::param!(FP_SPREAD: Bool = "hybrid", "FP_SPREAD", "1",
    "hybrid: where MAX_FP is below MAX_RC, share the RC-FP slots of MAX_FP rings of WEFT_VERBS_RC_FP_BUFS among up to MAX_RC peers with shallower rings (at least 4 slots; the same memory); 0: MAX_FP peers with whole rings, as paper 001 (also when WEFT_VERBS_RC_FP_BUFS is set)");
weft_provider::param!(REBALANCE: Bool = "hybrid", "REBALANCE", "0",
    "hybrid: at the RC limit, close the least-recently-used connection (idle for RC_THRESHOLD messages) for a busier peer, both sides draining first");
weft_provider::param!(FAIR: Bool = "hybrid", "FAIR", "1",
    "hybrid: at the RC limit, a process that refuses a peer holding fewer connections than one of its own RC peers asks that peer to give up its connection for the refused one (swaps only towards the process with fewer, so they end); 0: first come, first served");
weft_provider::param!(STATS: Bool = "hybrid", "STATS", "0",
    "hybrid: print messages and bytes per peer and channel, RC connections and RC-FP slots opened and closed, and the limits in force, at finalize (standard error)");

/// Room for the prefix and the core's header when sending: no channel takes a longer header
/// (verbs-rc 128 bytes, verbs-ud fewer), and `max_am_header` is theirs less the prefix.
const HDR_ROOM: usize = 160;
/// Receive and send buffers of the RC channel (verbs-rc alone: 256 each).
const RC_POOL: usize = 128;
/// Send-queue depth of each RC queue pair (verbs-rc alone: 128).
const RC_SQ: u32 = 64;
/// Channels counted per peer (index by [`slot`]): the zero-copy ones count the rendezvous
/// data this side moved (RC-RDMA: reads as receiver; UD-ZCOPY: writes as sender).
const COUNTED: [Channel; 5] = [
    Channel::UdSr,
    Channel::RcSr,
    Channel::RcFp,
    Channel::RcRdma,
    Channel::UdZcopy,
];
type Sent = [(u64, u64); 5];

fn slot(c: Channel) -> usize {
    match c {
        Channel::UdSr => 0,
        Channel::RcSr => 1,
        Channel::RcFp => 2,
        Channel::RcRdma => 3,
        Channel::UdZcopy => 4,
    }
}

/// A message larger than any the hybrid sends in one piece: the chain's choice for it is the
/// rendezvous channel.
const LARGE: u64 = u64::MAX;

/// The RMA capabilities the hybrid offers: rendezvous only (windows go by active messages,
/// as on verbs-ud), reads where the chain has RC-RDMA, writes where it has UD-ZCOPY and
/// verbs-ud can place them.
fn rndv_caps(chain: &JobChain, ud: &Caps) -> Option<RmaCaps> {
    let has = |c: Channel| chain.rules().iter().any(|r| r.channel == c);
    let read = has(Channel::RcRdma);
    let write = has(Channel::UdZcopy) && ud.rma.is_some_and(|r| r.write);
    (read || write).then(|| RmaCaps {
        read,
        write,
        max_iov: 1,
        user_memory: true,
        completion: CompletionLevel::Delivery,
        rndv_only: true,
        ..RmaCaps::default()
    })
}

/// A registration of the hybrid: one of verbs-rc's (remote reads: RC-RDMA), one of
/// verbs-ud's (remote writes: UD-ZCOPY), or one of each (local use by either channel: the
/// descriptor carries verbs-rc's local key in its low 32 bits, verbs-ud's in the high).
struct HMr {
    rc: Option<MemRegion>,
    ud: Option<MemRegion>,
}

/// The parameters, checked.
#[derive(Debug, Clone)]
struct Config {
    chain: Chain,
    /// `WEFT_HYBRID_RULES=auto`: `chain` is the default until the calibrated one replaces it
    /// at open ([`crate::auto`]).
    auto: bool,
    limits: Limits,
    /// Whether `WEFT_HYBRID_MAX_RC` and `WEFT_HYBRID_MAX_FP` were set (else they may be
    /// lifted for a small job, [`Config::limits_for`]).
    max_rc_set: bool,
    max_fp_set: bool,
    small_job: u64,
    /// `WEFT_HYBRID_LIMITS_FROM`: the job size from which the paper's limits hold.
    limits_from: u64,
    /// Slots of a whole RC-FP ring when `WEFT_HYBRID_FP_SPREAD` may share them among more
    /// peers (`None`: spreading off, or `WEFT_VERBS_RC_FP_BUFS` set).
    fp_ring: Option<usize>,
    stats: bool,
}

/// The limits a job's size gives where `WEFT_HYBRID_MAX_RC` and `_MAX_FP` are left unset.
///
/// - `Small` (fewer than `WEFT_HYBRID_SMALL_JOB` ranks, 32, and fewer than `LIMITS_FROM`):
///   every peer may connect and have a whole RC-FP ring, as MVAPICH2 gives RC-FP to every
///   peer below 32 processes.
/// - `Mid` (from `SMALL_JOB` to fewer than `WEFT_HYBRID_LIMITS_FROM`, 512): every peer may
///   connect; RC-FP for up to [`MID_FP_PEERS`], with rings of half depth. MVAPICH2 2.3.7 does
///   not turn its hybrid on below 512 processes (RC to every peer it talks to, RC-FP within
///   its polling set of 64); half rings keep the memory a ring sweeps small where many ranks
///   share a core (docs/history/benchmarks-notebook.md, "Thirty-two ranks without the paper's limits").
/// - `Paper`: paper 001's 16 connections and 8 rings (shared out by `WEFT_HYBRID_FP_SPREAD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    Small,
    Mid,
    Paper,
}

/// RC-FP peers at most in a mid-sized job (MVAPICH2's polling set, verbs-rc's
/// `WEFT_VERBS_RC_FP_PEERS`).
const MID_FP_PEERS: usize = 64;

/// Fewest slots a shared-out RC-FP ring keeps (4: streaming 2 KiB messages through 8 slots
/// kept within 3 % of 16 on the soft HCA, through 4 it lost 5 %; docs/history/benchmarks-notebook.md).
const FP_RING_MIN: usize = 4;

/// The RC-FP slots of `l.max_fp` rings of `ring` slots shared among up to `l.max_rc` of a
/// job's `peers`: (peers, slots of each ring), or `None` when that gives no more peers than
/// `max_fp`.
fn spread(l: &Limits, peers: usize, ring: usize) -> Option<(usize, usize)> {
    let rc = l.max_rc.min(peers);
    if l.max_fp == 0 || l.max_fp >= rc || ring <= FP_RING_MIN {
        return None;
    }
    let total = l.max_fp.saturating_mul(ring);
    let slots = (total / rc).clamp(FP_RING_MIN, ring);
    let peers = (total / slots).min(rc);
    (peers > l.max_fp).then_some((peers, slots))
}

impl Config {
    fn from_env() -> Result<Config> {
        let text = RULES.get_str();
        let auto = text.trim().eq_ignore_ascii_case("auto");
        let chain = if text.trim().is_empty() || auto {
            Chain::default()
        } else {
            RULES.validate()?;
            Chain::parse(&text).map_err(|e| RULES.refuse(format!("a send-rule chain ({e})")))?
        };
        Ok(Config {
            chain,
            auto,
            limits: Limits {
                threshold: RC_THRESHOLD.get_u64()?,
                max_rc: MAX_RC.get_u64()? as usize,
                max_fp: MAX_FP.get_u64()? as usize,
                rebalance: REBALANCE.get_bool()?,
                fair: FAIR.get_bool()?,
            },
            max_rc_set: MAX_RC.is_set(),
            max_fp_set: MAX_FP.is_set(),
            small_job: SMALL_JOB.get_u64()?,
            limits_from: LIMITS_FROM.get_u64()?,
            fp_ring: if FP_SPREAD.get_bool()? && !weft_verbs_rc::FP_BUFS.is_set() {
                Some(weft_verbs_rc::FP_BUFS.get_u64()? as usize)
            } else {
                None
            },
            stats: STATS.get_bool()?,
        })
    }

    /// Which limits a job of `size` ranks takes where `WEFT_HYBRID_MAX_RC` and `_MAX_FP` are
    /// left unset ([`Tier`]).
    fn tier(&self, size: u32) -> Tier {
        let n = u64::from(size);
        if n >= self.limits_from {
            Tier::Paper
        } else if n < self.small_job {
            Tier::Small
        } else {
            Tier::Mid
        }
    }

    /// The limits for a job of `size` ranks. Paper 001's limits bound memory and the HCA's
    /// context cache at scale (its evaluation: 512 processes); in a smaller job a limit left
    /// unset is lifted ([`Tier`]), as MVAPICH2 lifts them: there they only cost speed (small
    /// messages to the peers past them go by UD-SR, and a process whose peers filled their
    /// slots first keeps most of its peers on UD) and save a few MiB at most.
    fn limits_for(&self, size: u32) -> Limits {
        let mut l = self.limits;
        let peers = size.saturating_sub(1) as usize;
        let fp_peers = match self.tier(size) {
            Tier::Paper => return l,
            Tier::Small => peers,
            Tier::Mid => peers.min(MID_FP_PEERS),
        };
        if !self.max_rc_set {
            l.max_rc = l.max_rc.max(peers);
        }
        if !self.max_fp_set {
            l.max_fp = l.max_fp.max(fp_peers);
        }
        l
    }

    /// The limits for a job of `size` ranks with the RC-FP slots shared out
    /// (`WEFT_HYBRID_FP_SPREAD`), and the slots of each RC-FP ring (0: verbs-rc's
    /// `WEFT_VERBS_RC_FP_BUFS`). A mid-sized job with `MAX_FP` unset gives its RC-FP peers rings
    /// of half depth instead.
    fn in_force(&self, size: u32) -> (Limits, usize) {
        let mut l = self.limits_for(size);
        if self.tier(size) == Tier::Mid && !self.max_fp_set {
            let slots = self.fp_ring.map_or(0, |ring| (ring / 2).max(FP_RING_MIN));
            return (l, slots);
        }
        let peers = size.saturating_sub(1) as usize;
        match self.fp_ring.and_then(|ring| spread(&l, peers, ring)) {
            Some((peers, slots)) => {
                l.max_fp = peers;
                (l, slots)
            }
            None => (l, 0),
        }
    }

    /// The chain for a job of `size` ranks and the largest message (payload; the core's
    /// header comes on top) it sends by UD-SR to a peer with UD alone, which bounds what
    /// this provider takes in one active message.
    fn job(&self, size: u32) -> Result<(JobChain, u64)> {
        let job = self
            .chain
            .for_job(u64::from(size))
            .map_err(|e| Error::invalid(format!("WEFT_HYBRID_RULES: {e}")))?;
        match job.ud_sr_upto() {
            Some(n) if n >= 1024 => Ok((job, n)),
            n => Err(Error::invalid(format!(
                "WEFT_HYBRID_RULES: eager messages and the rendezvous' control messages go as \
                 active messages, so a peer with UD alone must be sent messages of up to 1024 \
                 bytes or more by UD-SR (the chain stops at {}); the zero-copy channels carry \
                 only the rendezvous' data",
                n.map_or("0 bytes".to_string(), |n| format!("{n} bytes"))
            ))),
        }
    }
}

/// A message of `size` bytes counts towards its peer's RC threshold when the chain would send
/// it over an RC channel were one open (paper 001 counts by send rule): a chain that never
/// uses RC never opens a connection.
fn rc_worthy(chain: &JobChain, size: u64) -> bool {
    chain.pick(size, Open::ALL).is_some_and(|c| !c.is_ud())
}

/// The channels open to `peer` now: UD's always; RC-SR and RC-RDMA while the budget has the
/// pair up and verbs-rc is connected; RC-FP once verbs-rc has set up its slots too. (A free
/// function so that the send path can hold its peer's record meanwhile.)
#[inline]
fn open_to(rc: &VerbsRc, budget: &Budget<PeerState>, peer: Rank) -> Open {
    open_with(rc, budget.state(peer), peer)
}

/// [`open_to`] with the budget's state towards `peer` already read from its record.
#[inline]
fn open_with(rc: &VerbsRc, state: RcState, peer: Rank) -> Open {
    match rc.route(peer) {
        Some(fp) if state == RcState::Up => {
            let o = Open::UD.with(Channel::RcSr).with(Channel::RcRdma);
            if fp {
                o.with(Channel::RcFp)
            } else {
                o
            }
        }
        _ => Open::UD,
    }
}

/// A message that overtook others, held until its turn.
struct Held {
    header: Vec<u8>,
    payload: Vec<u8>,
}

/// One peer's record: the order state both ways, the budget's link and whether the peer
/// failed, in one table so that a message looks at one record (20 bytes; a job has one per
/// peer talked to).
#[derive(Default)]
struct PeerState {
    seq: Sequencer,
    reorder: Reorder,
    link: Link,
    failed: bool,
}

impl Record for PeerState {
    fn link(&self) -> &Link {
        &self.link
    }
    fn link_mut(&mut self) -> &mut Link {
        &mut self.link
    }
}

/// Totals for `counters()`.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    /// Messages and bytes sent per counted channel (index by [`slot`]).
    sent: Sent,
    held: u64,
    rc_fallback: u64,
    ctrl_sent: u64,
}

/// The `hybrid` provider.
pub struct Hybrid {
    rank: Rank,
    size: u32,
    ud: VerbsUd,
    rc: VerbsRc,
    /// The one device both channels use (its accounting is read once, not once per channel).
    hca: Arc<dyn Hca>,
    chain: JobChain,
    /// The RC budget, and every peer's record (four bytes per rank, a record per peer talked
    /// to).
    budget: Budget<PeerState>,
    /// Messages that overtook others, until their turn.
    holding: Holding<Held>,
    /// Messages and bytes sent per peer and channel: kept only for `WEFT_HYBRID_STATS=1`
    /// (the totals always are), so that the per-peer cost stays small in large jobs.
    sent_by_peer: Option<PeerTable<Sent>>,
    /// Registrations by the handle handed out.
    mrs: std::collections::HashMap<u64, HMr>,
    next_mr: u64,
    /// Peers whose rendezvous channel changed (RC closing): the core reads `peer_caps` again.
    caps_changed: Vec<Rank>,
    caps: Caps,
    /// Control messages waiting for room on UD, in order.
    ctrl_out: VecDeque<(Rank, Ctrl)>,
    /// Control messages received, with the sequence number a `Closed` carries.
    ctrl_in: Vec<(Rank, Ctrl, u32)>,
    actions: Vec<Action>,
    /// Peers whose RC connection is being closed: RC sends to them still completing. The flag
    /// is set by the first `closing` after the drain began: only from then on may the peer be
    /// reported drained (see `closing`).
    draining: Vec<(Rank, bool)>,
    /// Connections both sides drained, to tear down once every message the peer sent before
    /// its `Closed` has been delivered here: (peer, its next sequence number at `Closed`).
    teardown: Vec<(Rank, u32)>,
    /// The sequence number each closing peer's `Closed` carried.
    closed_at: Vec<(Rank, u32)>,
    totals: Totals,
    stats: bool,
    /// Some RC connection was made: RC's queues are polled from then on.
    rc_active: bool,
    /// Progress calls since UD last delivered something or was handed work (a send, a
    /// zero-copy transfer, a registration, a connection). Once RC is up, a UD quiet for
    /// `UD_QUIET` calls is polled on every `UD_EVERY`-th call only (see `progress`).
    ud_quiet: u32,
}

/// Calls a quiet UD keeps being polled on every progress call.
const UD_QUIET: u32 = 256;
/// Beyond them, UD is polled on every this many calls.
const UD_EVERY: u32 = 16;

/// Whether this progress call polls UD, `quiet` calls after UD last had something to do.
#[inline]
fn poll_ud_now(rc_active: bool, quiet: u32) -> bool {
    !rc_active || quiet < UD_QUIET || quiet % UD_EVERY == 0
}

/// The quiet count after a call in which UD delivered `n` events. It wraps (to polling on
/// every call for a while) rather than stops: a count stuck at its maximum, which is not a
/// multiple of `UD_EVERY`, would never poll UD again.
#[inline]
fn next_quiet(quiet: u32, n: usize) -> u32 {
    if n > 0 {
        0
    } else {
        quiet.wrapping_add(1)
    }
}

impl Hybrid {
    /// What a progress call brought besides messages for the core: control messages, closing
    /// connections, the budget's actions, changed capabilities (out of line: most calls have
    /// none).
    #[inline(never)]
    fn after_progress(&mut self, sink: &mut dyn Sink) -> Result<()> {
        for (src, c, seq) in std::mem::take(&mut self.ctrl_in) {
            if c == Ctrl::Closed {
                self.closed_at.retain(|&(r, _)| r != src);
                self.closed_at.push((src, seq));
            }
            self.budget.on_ctrl(src, c, &mut self.actions);
        }
        if !self.draining.is_empty() || !self.teardown.is_empty() {
            self.closing()?;
        }
        if !self.actions.is_empty() || !self.ctrl_out.is_empty() {
            self.run_actions()?;
        }
        for p in std::mem::take(&mut self.caps_changed) {
            sink.connection(p, ConnEvent::CapsChanged);
        }
        Ok(())
    }

    fn open_with(boot: &mut dyn Bootstrap, mut cfg: Config) -> Result<Hybrid> {
        let (rank, size) = (boot.rank(), boot.size());
        let fp_bufs;
        (cfg.limits, fp_bufs) = cfg.in_force(size);
        let (job, ud_upto) = cfg.job(size)?;
        // RC-FP slots hold what the chain sends through them, no more (verbs-rc's own slots
        // are 4 KiB; the default chain's RC-FP reach is 2 KiB); a chain without RC-FP sets up
        // no slots at all. `auto` decides the chain after the channels are open, so it keeps
        // verbs-rc's slots and measures RC-FP in them.
        let fp_reach = if cfg.auto {
            None
        } else {
            job.reach(Channel::RcFp)
        };
        if !cfg.auto && fp_reach.is_none() {
            cfg.limits.max_fp = 0;
        }
        let fp_payload = fp_reach.map_or(0, |r| {
            usize::try_from(r.min(ud_upto))
                .unwrap_or(usize::MAX)
                .min(64 << 10)
        });
        // RC serves at most max_rc peers and messages up to the chain's UD-SR reach: smaller
        // shared pools than verbs-rc alone takes for a job where every peer may connect
        // (unless WEFT_VERBS_RC_BUF, _SRQ or _SEND_BUFS say otherwise).
        let sizing = Sizing {
            fp_peers: cfg.limits.max_fp,
            // A peer that earned RC gets RC-FP slots at once (within MAX_FP): small
            // messages, which the chain sends by UD-SR until RC-FP opens, would otherwise
            // never reach verbs-rc's own threshold.
            fp_threshold: 0,
            buf: usize::try_from(ud_upto).unwrap_or(usize::MAX).min(64 << 10),
            pool: RC_POOL,
            conns: cfg.limits.max_rc,
            fp_payload,
            fp_bufs,
            // MVAPICH's send-queue depth (`MV2_DEFAULT_MAX_SEND_WQE`, 64), and one
            // scatter-gather entry: every RC send is a copy out of a pool buffer and the
            // hybrid's RMA (RC-RDMA) takes one piece a request (`rndv_caps`).
            sq: RC_SQ,
            sges: 1,
        };
        // One device for both channels, as a process has one HCA: they share its QP-context
        // cache (the timing model's included) and its service threads.
        let hca = weft_verbs::open_default()?;
        let mut ud = VerbsUd::open_on(boot, hca.clone())?;
        let mut rc = VerbsRc::open_sized(boot, sizing, hca.clone())?;
        if cfg.auto {
            // Calibrated (or cached) per host with the channels just opened; it reaches UD-SR
            // as far as the default chain does, so the sizes above stand.
            cfg.chain = crate::auto::chain_for_job(boot, &mut ud, &mut rc, sizing)?;
        }
        let (chain, ud_upto) = cfg.job(size)?;
        let (uc, rcc) = (ud.caps(), rc.caps());
        let max_hdr = uc.max_am_header.min(rcc.max_am_header) - PREFIX;
        // Every message must fit UD-SR, which every peer has; sizes count the payload.
        let by_chain = usize::try_from(ud_upto).unwrap_or(usize::MAX);
        let max_payload = by_chain
            .min(uc.max_am_payload)
            .min(rcc.max_am_payload)
            .min(64 << 10);
        let mut caps = Caps::am_only(max_hdr, max_payload, uc.max_iov.min(rcc.max_iov));
        caps.eager_limit = max_payload;
        caps.spans_hosts = uc.spans_hosts && rcc.spans_hosts;
        caps.lazy_connect = uc.lazy_connect;
        caps.rma = rndv_caps(&chain, uc);
        if caps.rma.is_some() {
            caps.mr_local = true;
            caps.per_peer = true;
        }
        Ok(Hybrid {
            rank,
            size,
            ud,
            rc,
            hca,
            chain,
            budget: Budget::new(rank, size, cfg.limits),
            holding: Holding::default(),
            sent_by_peer: cfg.stats.then(|| PeerTable::new(size as usize)),
            mrs: std::collections::HashMap::new(),
            next_mr: 0,
            caps_changed: vec![],
            caps,
            ctrl_out: VecDeque::new(),
            ctrl_in: vec![],
            actions: vec![],
            draining: vec![],
            teardown: vec![],
            closed_at: vec![],
            totals: Totals::default(),
            stats: cfg.stats,
            rc_active: false,
            ud_quiet: 0,
        })
    }

    /// The chain in force (for `weft info` and the statistics).
    pub fn chain(&self) -> &JobChain {
        &self.chain
    }

    /// Eager-ring memory (RC-FP slots, both directions) of each peer that gets slots, or
    /// `None` when none will (the chain names no RC-FP, or `WEFT_HYBRID_MAX_FP=0`).
    pub fn fp_bytes_per_peer(&self) -> Option<u64> {
        (self.budget.limits().max_fp > 0).then(|| self.rc.ring_bytes_per_peer())
    }

    /// The limits in force for this job (`WEFT_HYBRID_MAX_RC`, `_MAX_FP` as the job's size
    /// and `WEFT_HYBRID_FP_SPREAD` make them).
    pub fn limits(&self) -> Limits {
        self.budget.limits()
    }

    /// `peer` failed (an untouched peer has not).
    fn failed(&self, peer: Rank) -> bool {
        self.budget.peer(peer).is_some_and(|s| s.failed)
    }

    fn check_rank(&self, r: Rank) -> Result<usize> {
        if r >= self.size {
            return Err(Error::from(weft_provider::ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        Ok(r as usize)
    }

    fn count(&mut self, peer: Rank, ch: Channel, bytes: u64) {
        let c = &mut self.totals.sent[slot(ch)];
        c.0 += 1;
        c.1 += bytes;
        if let Some(t) = self.sent_by_peer.as_mut() {
            let c = &mut t[peer as usize][slot(ch)];
            c.0 += 1;
            c.1 += bytes;
        }
    }

    fn new_mr(&mut self, m: HMr, addr: u64, len: usize, key: u64, desc: u64) -> MemRegion {
        self.next_mr += 1;
        self.mrs.insert(self.next_mr, m);
        MemRegion {
            key,
            addr,
            len,
            handle: self.next_mr,
            desc,
        }
    }

    /// Carry out what the budget asked for.
    fn run_actions(&mut self) -> Result<()> {
        for a in std::mem::take(&mut self.actions) {
            match a {
                Action::Send(p, c) => self.ctrl_out.push_back((p, c)),
                Action::Connect(p) => {
                    if !self.failed(p) {
                        self.rc_active = true;
                        self.rc.connect(p)?;
                    }
                }
                // verbs-rc sets up RC-FP slots itself at connection (at most MAX_FP peers);
                // a slot a teardown freed goes to the connection the budget names.
                Action::OpenFp(p) => self.rc.open_fast_path(p)?,
                // The slots go with the connection; draining stops the ring writes.
                Action::CloseFp(_) => {}
                Action::Drain(p) => {
                    self.rc.quiesce(p)?;
                    // Rendezvous with the peer go by UD-ZCOPY from now on.
                    self.caps_changed.push(p);
                    if !self.draining.iter().any(|d| d.0 == p) {
                        self.draining.push((p, false));
                    }
                }
                Action::Teardown(p) => {
                    let upto = self
                        .closed_at
                        .iter()
                        .find(|&&(r, _)| r == p)
                        .map_or(0, |&(_, s)| s);
                    self.closed_at.retain(|&(r, _)| r != p);
                    self.teardown.push((p, upto));
                }
            }
        }
        self.flush_ctrl()
    }

    /// Rebalancing: report drained connections to the budget, and tear down those both sides
    /// drained once the peer's messages sent before its `Closed` have all been delivered (the
    /// last of them may still sit in RC's queues behind the `Closed` that came by UD).
    ///
    /// A peer is reported drained no earlier than the second `closing` after its drain began.
    /// Until the core has read the peer's new capabilities (the `CapsChanged` event goes out at
    /// the end of this `progress`, and the core reads it after it has issued the RMA reads it
    /// decided meanwhile), a rendezvous matched under the old ones still reads over RC; once
    /// drained is reported the peer may destroy its end, and such a read would find nobody
    /// there. By the second call every such read has been posted, so `quiet` counts it. A
    /// teardown likewise waits until nothing of ours to the peer is in flight.
    fn closing(&mut self) -> Result<()> {
        let mut k = 0;
        while k < self.draining.len() {
            let (p, armed) = self.draining[k];
            if !armed {
                self.draining[k].1 = true;
                k += 1;
            } else if self.rc.quiet(p) {
                self.draining.swap_remove(k);
                self.budget.drained(p, &mut self.actions);
            } else {
                k += 1;
            }
        }
        let mut k = 0;
        while k < self.teardown.len() {
            let (p, upto) = self.teardown[k];
            let (delivered, failed) = self
                .budget
                .peer(p)
                .map_or((0, true), |s| (s.reorder.expected(), s.failed));
            // Every number before `upto` delivered (wrap-safe), and nothing of ours in flight.
            if failed || (upto.wrapping_sub(delivered) as i32 <= 0 && self.rc.quiet(p)) {
                self.teardown.swap_remove(k);
                self.rc.disconnect(p)?;
                // The budget may have agreed on a new connection meanwhile (verbs-rc ignored
                // the connect while the old one stood): make it now.
                if self.budget.state(p) == RcState::Up && !self.failed(p) {
                    self.rc.connect(p)?;
                }
            } else {
                k += 1;
            }
        }
        if !self.actions.is_empty() {
            self.run_actions()?;
        }
        Ok(())
    }

    /// Send the control messages waiting, in order, until UD has no room.
    fn flush_ctrl(&mut self) -> Result<()> {
        while let Some(&(p, c)) = self.ctrl_out.front() {
            if self.failed(p) {
                self.ctrl_out.pop_front();
                continue;
            }
            let mut m = [0u8; wire::CTRL_MAX];
            // `Closed` carries our next sequence number: every message to the peer before it
            // (over RC too: drained, so completed) is numbered below it.
            let next = self.budget.peer(p).map_or(0, |s| s.seq.peek());
            let len = wire::put_ctrl(&mut m, c, next);
            self.ud_quiet = 0;
            match self.ud.am_send(p, &m[..len], &[]) {
                Ok(SendOutcome::Sent) => {
                    self.totals.ctrl_sent += 1;
                    self.ctrl_out.pop_front();
                }
                Ok(_) => break,
                // The peer failed: verbs-ud reports it through progress.
                Err(_) => {
                    self.ctrl_out.pop_front();
                }
            }
        }
        Ok(())
    }

    fn print_stats(&self) {
        let mut lines = vec![format!(
            "hybrid: rank {} chain {}",
            self.rank,
            crate::rules::Chain(self.chain.rules().to_vec())
        )];
        let mut by_peer: Vec<(usize, Sent)> = self
            .sent_by_peer
            .iter()
            .flat_map(|t| t.iter().map(|(r, s)| (r, *s)))
            .collect();
        by_peer.sort_unstable_by_key(|&(r, _)| r);
        for (r, sent) in by_peer {
            if sent.iter().all(|&(m, _)| m == 0) {
                continue;
            }
            let per: Vec<String> = COUNTED
                .iter()
                .zip(sent)
                .filter(|(_, (m, _))| *m > 0)
                .map(|(c, (m, b))| format!("{} {m} msgs {b} B", c.name()))
                .collect();
            let rc = match self.budget.state(r as Rank) {
                RcState::Up => " [RC]",
                _ => "",
            };
            lines.push(format!(
                "hybrid: rank {} -> {r}{rc}: {}",
                self.rank,
                per.join(", ")
            ));
        }
        let s = self.budget.stats();
        let l = self.budget.limits();
        lines.push(format!(
            "hybrid: rank {} RC asked {} refused {} opened {} closed {} (asked others to yield {}, yielded {}); RC-FP opened {} closed {}; held for order {} (at most {} at once); limits: RC {}, RC-FP {}, threshold {}",
            self.rank,
            s.asked,
            s.refused,
            s.opened,
            s.closed,
            s.yields_asked,
            s.yielded,
            s.fp_opened,
            s.fp_closed,
            self.totals.held,
            self.holding.max(),
            l.max_rc,
            l.max_fp,
            l.threshold
        ));
        eprintln!("{}", lines.join("\n"));
    }
}

/// The sink the two channels report to: strips the hybrid prefix, restores order, feeds the
/// budget, and passes everything else on to the core.
struct Recv<'a> {
    core: &'a mut dyn Sink,
    chain: &'a JobChain,
    budget: &'a mut Budget<PeerState>,
    holding: &'a mut Holding<Held>,
    actions: &'a mut Vec<Action>,
    ctrl_in: &'a mut Vec<(Rank, Ctrl, u32)>,
    held: &'a mut u64,
}

impl Recv<'_> {
    fn malformed(&mut self, src: Rank, why: &str) {
        self.peer_failed(src, &format!("malformed hybrid message: {why}"));
    }
}

impl Sink for Recv<'_> {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        let msg = match wire::decode(header) {
            Ok(m) => m,
            Err(why) => {
                if self.budget.peer(src).is_some_and(|p| !p.failed) {
                    self.malformed(src, &why);
                }
                return;
            }
        };
        if let wire::Msg::Data { seq, header: h } = msg {
            // Data, on every message: one look at the peer's record.
            let Some(p) = self.budget.peer_mut(src) else {
                return;
            };
            if p.failed {
                return;
            }
            let len = h.len() + payload.len();
            match p.reorder.arrive(self.holding, src, seq, len, || Held {
                header: h.to_vec(),
                payload: payload.to_vec(),
            }) {
                Ok(Arrival::Deliver) => {
                    self.core.am(src, h, payload);
                    while let Some(m) = p.reorder.pop(self.holding, src) {
                        self.core.am(src, &m.header, &m.payload);
                    }
                }
                Ok(Arrival::Held) => *self.held += 1,
                Err(e) => {
                    let why = e.to_string();
                    self.malformed(src, &why);
                    return;
                }
            }
            let chain = self.chain;
            self.budget
                .note_if(src, || rc_worthy(chain, payload.len() as u64), self.actions);
            return;
        }
        if self.budget.peer(src).is_none_or(|p| p.failed) {
            return;
        }
        // `Closed` carries the sender's next sequence number: everything it sent before (over
        // RC too) must be delivered here before the connection goes.
        if let wire::Msg::Ctrl { ctrl, seq } = msg {
            self.ctrl_in.push((src, ctrl, seq));
        }
    }

    fn complete(&mut self, token: Token, result: Result<Completed>) {
        self.core.complete(token, result);
    }

    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        // Both channels may report the same peer: once is enough.
        if let Some(p) = self.budget.peer_mut(rank) {
            if !p.failed {
                p.failed = true;
                self.budget.peer_failed(rank);
                self.holding.forget(rank);
                self.core.peer_failed(rank, reason);
            }
        }
    }

    fn connection(&mut self, peer: Rank, event: ConnEvent) {
        self.core.connection(peer, event);
    }
}

impl Provider for Hybrid {
    fn name(&self) -> &str {
        "hybrid"
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
        self.check_rank(dest)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > self.caps.max_am_header || plen > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "hybrid: active message of {} + {plen} bytes exceeds {} + {}",
                header.len(),
                self.caps.max_am_header,
                self.caps.max_am_payload
            )));
        }
        // One look at each table on the way: our record (order and budget), held while the
        // channels send, and verbs-rc's for the channels open.
        let Some(st) = self.budget.peer_mut(dest) else {
            return Err(Error::invalid("hybrid: rank past the job"));
        };
        let open = open_with(&self.rc, st.link.state(), dest);
        if st.failed {
            return Err(Error::peer_failed(dest, "failed earlier"));
        }
        // Rule sizes count the payload, as MVAPICH counts a message's size: the core's header
        // (at most `max_am_header` bytes) rides on top in every channel's buffers.
        let size = plen as u64;
        let want = self.chain.pick(size, open).unwrap_or(Channel::UdSr);
        // The prefix and the core's header, on the stack: `max_am_header` leaves room for the
        // prefix within the channels' largest header (checked above).
        let mut buf = [0u8; HDR_ROOM];
        let hdr = buf
            .get_mut(..PREFIX + header.len())
            .ok_or_else(|| Error::invalid("hybrid: header longer than the channels take"))?;
        wire::put_data(hdr, st.seq.peek());
        hdr[PREFIX..].copy_from_slice(header);
        let hdr = &*hdr;
        let mut used = want;
        let mut out = match want {
            Channel::RcSr | Channel::RcFp => {
                self.rc
                    .am_send_via(dest, hdr, payload, want == Channel::RcFp)?
            }
            _ => SendOutcome::Busy,
        };
        if out != SendOutcome::Sent {
            if want != Channel::UdSr && want != Channel::UdZcopy {
                self.totals.rc_fallback += 1;
            }
            used = Channel::UdSr;
            self.ud_quiet = 0;
            out = self.ud.am_send(dest, hdr, payload)?;
        }
        if out == SendOutcome::Sent {
            st.seq.take();
            self.count(dest, used, size);
            // A connected peer's count decides nothing unless rebalancing: skip the budget.
            if !open.has(Channel::RcSr) || self.budget.limits().rebalance {
                let chain = &self.chain;
                self.budget
                    .note_if(dest, || rc_worthy(chain, size), &mut self.actions);
            }
            if !self.actions.is_empty() {
                self.run_actions()?;
            }
        }
        Ok(out)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut held = 0;
        let n = {
            let mut up = Recv {
                core: sink,
                chain: &self.chain,
                budget: &mut self.budget,
                holding: &mut self.holding,
                actions: &mut self.actions,
                ctrl_in: &mut self.ctrl_in,
                held: &mut held,
            };
            // Once RC carries the busy peers, UD mostly carries nothing: polling it on every
            // call added a second completion-queue poll to every idle progress call, which
            // showed in RC's small-message latency. A UD that delivered nothing and was given
            // nothing for UD_QUIET calls is polled on every UD_EVERY-th call, which delays a
            // first message over UD by at most that many calls; its timers (retransmission,
            // acknowledgements, keepalives) run on its polls, with their margins in time.
            let poll_ud = poll_ud_now(self.rc_active, self.ud_quiet);
            let n = if poll_ud {
                self.ud.progress(&mut up)?
            } else {
                0
            };
            self.ud_quiet = next_quiet(self.ud_quiet, n);
            // RC carries nothing until the budget has connected some peer (every agreement
            // goes over UD first): until then its queues are not polled.
            n + if self.rc_active {
                self.rc.progress(&mut up)?
            } else {
                0
            }
        };
        self.totals.held += held;
        if !self.ctrl_in.is_empty()
            || !self.draining.is_empty()
            || !self.teardown.is_empty()
            || !self.actions.is_empty()
            || !self.ctrl_out.is_empty()
            || !self.caps_changed.is_empty()
        {
            self.after_progress(sink)?;
        }
        Ok(n)
    }

    /// The rendezvous channel towards `peer`: the chain's pick for a large message among the
    /// channels open to it — RC-RDMA (the core reads the sender's buffer) while the budget
    /// has the pair connected, else UD-ZCOPY (the core's write rendezvous into the
    /// receiver's buffer posted on a zero-copy QP). Read again at connection events.
    fn peer_caps(&self, peer: Rank) -> Option<PeerCaps> {
        let rma = self.caps.rma?;
        let mut c = PeerCaps::from(&self.caps);
        let pick = self
            .chain
            .pick(LARGE, open_to(&self.rc, &self.budget, peer));
        c.rma_read = rma.read && pick == Some(Channel::RcRdma);
        c.rma_write = rma.write && pick == Some(Channel::UdZcopy);
        Some(c)
    }

    /// Remote reads: verbs-rc (RC-RDMA). Remote writes: verbs-ud (UD-ZCOPY's posted buffer).
    /// Local use only: both, the descriptor carrying both local keys.
    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if access.remote_atomic || (access.remote_read && access.remote_write) {
            return Err(Error::invalid(
                "hybrid: registrations serve one rendezvous: remote reads or remote writes",
            ));
        }
        if access.remote_read {
            // SAFETY: the caller's contract (memory valid until `mr_deregister`) is passed on
            // unchanged.
            let m = unsafe { self.rc.mr_register(base, len, access) }?;
            let (addr, key, desc) = (m.addr, m.key, m.desc & 0xffff_ffff);
            return Ok(self.new_mr(
                HMr {
                    rc: Some(m),
                    ud: None,
                },
                addr,
                len,
                key,
                desc,
            ));
        }
        if access.remote_write {
            // SAFETY: as above.
            let m = unsafe { self.ud.mr_register(base, len, access) }?;
            // A zero-copy receive is posted: its pieces arrive over UD.
            self.ud_quiet = 0;
            let (addr, key, desc) = (m.addr, m.key, m.desc << 32);
            return Ok(self.new_mr(
                HMr {
                    rc: None,
                    ud: Some(m),
                },
                addr,
                len,
                key,
                desc,
            ));
        }
        // SAFETY: as above, for each channel's registration.
        let r = unsafe { self.rc.mr_register(base, len, access) }?;
        // verbs-ud needs a local key only to send UD-ZCOPY pieces; without its zero-copy
        // QPs (`WEFT_VERBS_UD_ZCOPY_QPS=0`) it has no registrations at all.
        let u = if self.ud.caps().rma.is_some() {
            // SAFETY: as above.
            match unsafe { self.ud.mr_register(base, len, access) } {
                Ok(u) => Some(u),
                Err(e) => {
                    let _ = self.rc.mr_deregister(&r);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let desc = u.as_ref().map_or(0, |u| u.desc << 32) | (r.desc & 0xffff_ffff);
        Ok(self.new_mr(HMr { rc: Some(r), ud: u }, base as u64, len, 0, desc))
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        let m = self
            .mrs
            .remove(&mr.handle)
            .ok_or_else(|| Error::invalid("hybrid: deregistering an unknown region"))?;
        let a = m.rc.map_or(Ok(()), |r| self.rc.mr_deregister(&r));
        let b = m.ud.map_or(Ok(()), |u| self.ud.mr_deregister(&u));
        a.and(b)
    }

    /// RC-RDMA: a read of the sender's buffer over the pair's RC connection (up, or closing
    /// with its queue pair still there: the close waits for the read).
    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.check_rank(src)?;
        if !self.rc.rdma_open(src) {
            return Err(Error::invalid(format!(
                "hybrid: a rendezvous read from rank {src} without an RC connection to it"
            )));
        }
        let pieces: SmallVec<[RawIovMut; 4]> = local
            .iter()
            .map(|p| RawIovMut {
                desc: p.desc & 0xffff_ffff,
                ..*p
            })
            .collect();
        let bytes: usize = pieces.iter().map(|p| p.len).sum();
        // SAFETY: the caller's contract for `local` (valid and not otherwise accessed until
        // `done` is reported) is passed on; only the descriptors are narrowed to verbs-rc's.
        unsafe { self.rc.rma_read(src, &pieces, remote, done) }?;
        self.count(src, Channel::RcRdma, bytes as u64);
        Ok(())
    }

    /// UD-ZCOPY: a write rendezvous into the receiver's posted buffer (a key verbs-ud made);
    /// a key of verbs-rc's (an RC registration) goes by RC-RDMA write.
    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.check_rank(dest)?;
        let ud_key = u32::try_from(remote.key).is_err();
        let shift = if ud_key { 32 } else { 0 };
        let pieces: SmallVec<[RawIov; 4]> = local
            .iter()
            .map(|p| RawIov {
                desc: (p.desc >> shift) & 0xffff_ffff,
                ..*p
            })
            .collect();
        let bytes: usize = pieces.iter().map(|p| p.len).sum();
        if ud_key {
            // SAFETY: the caller's contract for `local` is passed on; only the descriptors
            // are narrowed to verbs-ud's.
            unsafe { self.ud.rma_write(dest, &pieces, remote, done) }?;
            self.ud_quiet = 0;
            self.count(dest, Channel::UdZcopy, bytes as u64);
        } else {
            if !self.rc.rdma_open(dest) {
                return Err(Error::invalid(format!(
                    "hybrid: an RDMA write to rank {dest} without an RC connection to it"
                )));
            }
            // SAFETY: as above, verbs-rc's descriptors.
            unsafe { self.rc.rma_write(dest, &pieces, remote, done) }?;
            self.count(dest, Channel::RcRdma, bytes as u64);
        }
        Ok(())
    }

    /// First contact: UD's address handle and link, our order record and the budget's count
    /// (what the first message would make).
    fn connect(&mut self, peer: Rank) -> Result<()> {
        self.check_rank(peer)?;
        self.ud.connect(peer)?;
        self.ud_quiet = 0;
        self.budget.touch(peer);
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if self.stats {
            self.print_stats();
        }
        let a = self.ud.close();
        let b = self.rc.close();
        a.and(b)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let sum = |k: usize, f: fn(&(u64, u64)) -> u64| -> u64 { f(&self.totals.sent[k]) };
        let s = self.budget.stats();
        let hc = self.hca.counters();
        let mut v = vec![
            ("ud_sr_msgs", sum(0, |c| c.0)),
            ("ud_sr_bytes", sum(0, |c| c.1)),
            ("rc_sr_msgs", sum(1, |c| c.0)),
            ("rc_sr_bytes", sum(1, |c| c.1)),
            ("rc_fp_msgs", sum(2, |c| c.0)),
            ("rc_fp_bytes", sum(2, |c| c.1)),
            ("rc_asked", s.asked),
            ("rc_refused", s.refused),
            ("rc_opened", s.opened),
            ("rc_closed", s.closed),
            ("rc_yields_asked", s.yields_asked),
            ("rc_yielded", s.yielded),
            ("fp_opened", s.fp_opened),
            ("fp_closed", s.fp_closed),
            ("rc_fallback_ud", self.totals.rc_fallback),
            ("ctrl_sent", self.totals.ctrl_sent),
            ("held_for_order", self.totals.held),
            // The one device both channels share (timing model: QP contexts not cached).
            ("hca_qp_cache_misses", hc.qp_cache_misses),
            ("hca_rnr_naks", hc.rnr_naks),
        ];
        // Memory (`weft bench mem`): the device's accounting once (both channels report the
        // whole shared device, queues and device memory), the channels' host buffers and
        // per-peer records added up, and our own per-peer tables.
        let (u, r) = (self.ud.counters(), self.rc.counters());
        let get = |c: &[(&'static str, u64)], key: &str| {
            c.iter().find(|(k, _)| *k == key).map_or(0, |(_, x)| *x)
        };
        // UD's packets beside the messages: what its reliability costs (a pure
        // acknowledgement is a datagram sent and received that carries no data).
        for (key, from) in [
            ("ud_packets_sent", "packets_sent"),
            ("ud_pure_acks", "pure_acks"),
            ("ud_resent", "resent"),
            ("ud_duplicates", "duplicates"),
            ("ud_timeouts", "timeouts"),
            ("hca_ud_dropped", "hca_ud_dropped"),
            ("ud_busy_links", "busy_links"),
        ] {
            v.push((key, get(&u, from)));
        }
        let a = self.hca.accounting();
        let own = self.holding.bytes()
            + self.sent_by_peer.as_ref().map_or(0, |t| t.bytes())
            + self.budget.bytes();
        let buffers = get(&u, "mem_buffer_bytes") + get(&r, "mem_buffer_bytes");
        v.push(("mem_hca_bytes", a.queues()));
        v.push(("mem_buffer_bytes", buffers.saturating_sub(a.dm_bytes)));
        v.push((
            "mem_peer_bytes",
            get(&u, "mem_peer_bytes") + get(&r, "mem_peer_bytes") + own as u64,
        ));
        v
    }
}

impl StaticProvider for Hybrid {
    const NAME: &'static str = "hybrid";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        VerbsUd::probe(ctx).map_err(|e| format!("verbs-ud: {e}"))?;
        VerbsRc::probe(ctx).map_err(|e| format!("verbs-rc: {e}"))?;
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, Config::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        let cfg = Config::from_env()?;
        let (_, upto) = cfg.job(2)?;
        let (uc, rcc) = (VerbsUd::static_caps()?, VerbsRc::static_caps()?);
        let max_hdr = uc.max_am_header.min(rcc.max_am_header) - PREFIX;
        let max_payload = usize::try_from(upto)
            .unwrap_or(usize::MAX)
            .min(uc.max_am_payload)
            .min(rcc.max_am_payload)
            .min(64 << 10);
        let mut caps = Caps::am_only(max_hdr, max_payload, uc.max_iov.min(rcc.max_iov));
        caps.eager_limit = max_payload;
        caps.spans_hosts = uc.spans_hosts && rcc.spans_hosts;
        caps.lazy_connect = uc.lazy_connect;
        caps.rma = rndv_caps(
            &cfg.chain
                .for_job(2)
                .map_err(|e| Error::invalid(e.to_string()))?,
            &uc,
        );
        if caps.rma.is_some() {
            caps.mr_local = true;
            caps.per_peer = true;
        }
        Ok(caps)
    }
}

weft_provider::register_provider!(
    Hybrid,
    priority = 6,
    summary = "MVAPICH-Aptus on the verbs layer: UD-SR, RC-SR and RC-FP at once, chosen per message by a send-rule chain (WEFT_HYBRID_RULES), RC connections opened lazily under per-process limits, order kept across channels"
);

/// The RC limits the settings give, as `weft info` prints them: paper 001's (or those set)
/// and, when a small job lifts them, from which size on they hold.
pub fn limits_in_force() -> std::result::Result<String, String> {
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    let (l, slots) = cfg.in_force(u32::MAX);
    let lifted = match (cfg.limits_from, cfg.max_rc_set, cfg.max_fp_set) {
        (0, ..) | (_, true, true) => String::new(),
        (from, rc_set, fp_set) => {
            let rc = if rc_set {
                String::new()
            } else {
                "every peer may connect".to_string()
            };
            let fp = if fp_set {
                String::new()
            } else {
                format!(
                    "RC-FP for up to {MID_FP_PEERS} peers with half rings (every peer, whole \
                     rings, below {} ranks: WEFT_HYBRID_SMALL_JOB)",
                    cfg.small_job.min(from)
                )
            };
            let both = if rc.is_empty() || fp.is_empty() {
                ""
            } else {
                ", "
            };
            format!("; below {from} ranks (WEFT_HYBRID_LIMITS_FROM) {rc}{both}{fp}")
        }
    };
    Ok(format!(
        "RC connections {}, RC-FP peers {}{}, after {} messages{}{}{}",
        l.max_rc,
        l.max_fp,
        match cfg.fp_ring.filter(|_| slots > 0) {
            None => String::new(),
            Some(ring) => format!(
                " ({slots} slots each: the slots of {} rings of {ring} shared out, \
                 WEFT_HYBRID_FP_SPREAD)",
                cfg.limits.max_fp
            ),
        },
        l.threshold,
        lifted,
        if l.rebalance { "; rebalanced" } else { "" },
        if l.fair {
            "; at the limit a refused peer holding fewer connections may take a slot from one \
             holding more (WEFT_HYBRID_FAIR)"
        } else {
            ""
        }
    ))
}

/// The chain `WEFT_HYBRID_RULES` sets for a job of `size` ranks, as `weft info` prints it, or
/// why it is refused.
pub fn chain_in_force(size: u32) -> std::result::Result<String, String> {
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    if cfg.auto {
        return Ok(match crate::auto::cache_path() {
            Some(p) => match std::fs::read_to_string(&p).ok().and_then(|t| {
                t.lines()
                    .find(|l| !l.starts_with('#') && !l.trim().is_empty())
                    .map(str::to_string)
            }) {
                Some(c) => format!(
                    "auto: calibrated per host at start; last cached in {}: {c}",
                    p.display()
                ),
                None => format!(
                    "auto: calibrated per host at start, then cached in {}",
                    p.display()
                ),
            },
            None => {
                "auto: calibrated per host at every start (WEFT_HYBRID_AUTO_CACHE=none)".to_string()
            }
        });
    }
    let (job, upto) = cfg.job(size).map_err(|e| e.to_string())?;
    let zcopy_off = job.rules().iter().any(|r| r.channel == Channel::UdZcopy)
        && !weft_verbs_ud::zero_copy_on().map_err(|e| e.to_string())?;
    Ok(format!(
        "{} ({}){}",
        crate::rules::Chain(job.rules().to_vec()),
        if upto == u64::MAX {
            "UD-SR at every size".to_string()
        } else {
            format!("UD-SR up to {upto} bytes")
        },
        if zcopy_off {
            "; UD-ZCOPY is off (WEFT_VERBS_UD_ZCOPY_QPS=0): what it would carry goes by the \
             core's pipeline over UD-SR"
        } else {
            ""
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{K_CTRL, K_DATA};

    /// The order state of one peer: a job of 16K ranks holds one per peer talked to.
    #[test]
    fn a_peers_record_takes_20_bytes() {
        assert_eq!(std::mem::size_of::<PeerState>(), 20);
    }

    /// However long RC alone has carried the traffic, a quiet UD is still polled on one call
    /// in `UD_EVERY`: its peers' first messages, acknowledgements and control messages must
    /// get through. (A saturating count stopped at `u32::MAX`, not a multiple of `UD_EVERY`,
    /// and never polled UD again after 2^32 quiet calls, a few minutes of polling.)
    #[test]
    fn a_quiet_ud_is_polled_however_long_it_was_quiet() {
        for start in [0, UD_QUIET, 1 << 31, u32::MAX - 40, u32::MAX - 1, u32::MAX] {
            let mut quiet = start;
            let mut gap = 0;
            for _ in 0..200 {
                if poll_ud_now(true, quiet) {
                    gap = 0;
                } else {
                    gap += 1;
                    assert!(gap < UD_EVERY, "UD not polled for {gap} calls from {start}");
                }
                quiet = next_quiet(quiet, 0);
            }
        }
        assert_eq!(next_quiet(12345, 1), 0);
        assert!(
            poll_ud_now(false, 7),
            "before RC is up UD is polled on every call"
        );
    }

    #[derive(Default)]
    struct Core {
        ams: Vec<(Rank, Vec<u8>, Vec<u8>)>,
        failed: Vec<(Rank, String)>,
    }

    impl Sink for Core {
        fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
            self.ams.push((src, header.to_vec(), payload.to_vec()));
        }
        fn complete(&mut self, _: Token, _: Result<Completed>) {}
        fn peer_failed(&mut self, rank: Rank, reason: &str) {
            self.failed.push((rank, reason.to_string()));
        }
    }

    struct Rig {
        core: Core,
        budget: Budget<PeerState>,
        holding: Holding<Held>,
        chain: JobChain,
        actions: Vec<Action>,
        ctrl_in: Vec<(Rank, Ctrl, u32)>,
        held: u64,
    }

    impl Rig {
        fn new(threshold: u64) -> Rig {
            Rig {
                core: Core::default(),
                holding: Holding::default(),
                budget: Budget::new(
                    0,
                    3,
                    Limits {
                        threshold,
                        ..Limits::default()
                    },
                ),
                chain: Chain::default().for_job(3).unwrap(),
                actions: vec![],
                ctrl_in: vec![],
                held: 0,
            }
        }

        fn arrive(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
            let mut r = Recv {
                core: &mut self.core,
                chain: &self.chain,
                budget: &mut self.budget,
                holding: &mut self.holding,
                actions: &mut self.actions,
                ctrl_in: &mut self.ctrl_in,
                held: &mut self.held,
            };
            r.am(src, header, payload);
        }
    }

    fn data(seq: u32, h: &[u8]) -> Vec<u8> {
        let mut v = vec![K_DATA];
        v.extend_from_slice(&seq.to_le_bytes());
        v.extend_from_slice(h);
        v
    }

    #[test]
    fn a_message_that_overtook_on_another_channel_waits_its_turn() {
        let mut rig = Rig::new(100);
        rig.arrive(1, &data(1, b"second"), b"bb");
        rig.arrive(2, &data(0, b"other peer"), b"");
        assert_eq!(rig.core.ams.len(), 1, "peer 1's first message is missing");
        rig.arrive(1, &data(0, b"first"), b"a");
        let got: Vec<_> = rig
            .core
            .ams
            .iter()
            .map(|(s, h, p)| (*s, h.clone(), p.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (2, b"other peer".to_vec(), vec![]),
                (1, b"first".to_vec(), b"a".to_vec()),
                (1, b"second".to_vec(), b"bb".to_vec()),
            ]
        );
        assert_eq!(rig.held, 1);
        assert!(rig.core.failed.is_empty());
    }

    #[test]
    fn control_messages_reach_the_budget_and_bad_ones_fail_the_peer() {
        let mut rig = Rig::new(100);
        rig.arrive(1, &[K_CTRL, Ctrl::Ask(0).code(), 3, 1], &[]);
        assert_eq!(rig.ctrl_in, vec![(1, Ctrl::Ask(259), 0)]);
        rig.arrive(1, &[K_CTRL, Ctrl::Closed.code(), 7, 0, 0, 0], &[]);
        assert_eq!(rig.ctrl_in[1], (1, Ctrl::Closed, 7));
        assert!(rig.core.failed.is_empty());
        rig.arrive(2, &[K_CTRL, 99], &[]);
        rig.arrive(2, &data(0, b"after"), b"");
        assert_eq!(rig.core.failed.len(), 1);
        assert!(rig.core.failed[0].1.contains("control code 99"));
        assert!(rig.core.ams.is_empty(), "nothing from a failed peer");
        let closed = Ctrl::Closed.code();
        let ask = Ctrl::Ask(0).code();
        let yes = Ctrl::Yes.code();
        for bad in [
            &[][..],
            &[K_DATA, 0, 0][..],
            &[7, 0, 0, 0, 0][..],
            // `Closed` without its sequence number, another control with bytes after it.
            &[K_CTRL, closed][..],
            &[K_CTRL, closed, 1, 2][..],
            &[K_CTRL, ask, 0][..],
            // An `Ask` without its count, a `Yes` with one.
            &[K_CTRL, ask][..],
            &[K_CTRL, yes, 0, 0][..],
        ] {
            let mut rig = Rig::new(100);
            rig.arrive(1, bad, b"");
            assert_eq!(rig.core.failed.len(), 1, "{bad:?}");
            assert!(rig.core.failed[0].1.starts_with("malformed hybrid message"));
        }
        // A duplicate fails the peer too (every channel below delivers once).
        let mut rig = Rig::new(100);
        rig.arrive(1, &data(0, b"x"), b"");
        rig.arrive(1, &data(0, b"x"), b"");
        assert!(rig.core.failed[0].1.contains("arrived twice"));
    }

    #[test]
    fn only_messages_the_chain_would_send_over_rc_count_towards_it() {
        // Paper 001's chain: up to 2008 bytes UD-SR is picked before RC-SR only when RC-FP
        // is closed, so every size has an RC rule first (RC-FP, RC-SR, RC-RDMA).
        let mut rig = Rig::new(2);
        rig.arrive(1, &data(0, b"h"), &[0; 100]);
        rig.arrive(1, &data(1, b"h"), &[0; 5000]);
        assert_eq!(rig.actions, vec![Action::Send(1, Ctrl::Ask(0))]);
        // A chain that never uses RC never asks.
        let mut rig = Rig::new(1);
        rig.chain = Chain::parse("{true: UD-SR}").unwrap().for_job(3).unwrap();
        for s in 0..10 {
            rig.arrive(1, &data(s, b"h"), &[0; 5000]);
        }
        assert!(rig.actions.is_empty());
    }

    #[test]
    fn rule_sizes_count_the_payload_not_the_header() {
        // As MVAPICH counts a message's size: a message of 100 payload bytes is RC-worthy
        // under `{size<=100: RC-SR}` whatever the core's header adds.
        let mut rig = Rig::new(1);
        rig.chain = Chain::parse("{size<=100: RC-SR}, {true: UD-SR}")
            .unwrap()
            .for_job(3)
            .unwrap();
        rig.arrive(1, &data(0, &[7; 40]), &[0; 101]);
        assert!(
            rig.actions.is_empty(),
            "101 payload bytes are past the rule"
        );
        rig.arrive(1, &data(1, &[7; 40]), &[0; 100]);
        assert_eq!(rig.actions, vec![Action::Send(1, Ctrl::Ask(0))]);
        // The eager limit is the chain's UD-SR reach (paper 001: 8192), so a message of
        // 8 KiB goes eagerly rather than by a rendezvous for the header's sake.
        let caps = Hybrid::static_caps().unwrap();
        assert_eq!(caps.eager_limit, 8192);
        assert_eq!(caps.max_am_payload, 8192);
    }

    /// Below `LIMITS_FROM` ranks an unset limit is lifted (every peer may connect; RC-FP for
    /// every peer below `SMALL_JOB`, for up to 64 above); a set one, or a job at or above the
    /// cut-off, keeps its value.
    #[test]
    fn smaller_jobs_lift_the_limits_left_unset() {
        let cfg =
            |(max_rc_set, max_fp_set): (bool, bool), small_job: u64, limits_from: u64| Config {
                chain: Chain::default(),
                auto: false,
                limits: Limits::default(),
                max_rc_set,
                max_fp_set,
                small_job,
                limits_from,
                fp_ring: None,
                stats: false,
            };
        let lim = |c: &Config, n: u32| {
            let l = c.limits_for(n);
            (l.max_rc, l.max_fp)
        };
        let unset = cfg((false, false), 32, 512);
        assert_eq!(lim(&unset, 2), (16, 8), "never below the paper's limits");
        assert_eq!(lim(&unset, 16), (16, 15));
        assert_eq!(lim(&unset, 31), (30, 30));
        assert_eq!(
            lim(&unset, 32),
            (31, 31),
            "from SMALL_JOB: RC-FP for up to 64"
        );
        assert_eq!(lim(&unset, 100), (99, 64));
        assert_eq!(lim(&unset, 511), (510, 64));
        assert_eq!(
            lim(&unset, 512),
            (16, 8),
            "the paper's limits from LIMITS_FROM on"
        );
        assert_eq!(lim(&unset, 16384), (16, 8));
        assert_eq!(lim(&cfg((true, false), 32, 512), 24), (16, 23));
        assert_eq!(lim(&cfg((false, true), 32, 512), 24), (23, 8));
        assert_eq!(lim(&cfg((true, true), 32, 512), 100), (16, 8));
        assert_eq!(
            lim(&cfg((false, false), 0, 512), 24),
            (23, 23),
            "SMALL_JOB=0"
        );
        assert_eq!(
            lim(&cfg((false, false), 32, 0), 24),
            (16, 8),
            "LIMITS_FROM=0: the paper's limits at any size"
        );
        assert_eq!(lim(&cfg((false, false), 32, 24), 24), (16, 8));
        assert_eq!(lim(&cfg((false, false), 32, 24), 23), (22, 22));
    }

    /// The slots of MAX_FP whole rings go to up to MAX_RC peers, none shallower than
    /// FP_RING_MIN; nothing is shared out where MAX_FP already covers MAX_RC, without RC-FP,
    /// in a small job (which lifts MAX_FP) or with spreading off.
    #[test]
    fn rc_fp_slots_are_shared_out_among_the_rc_peers() {
        let l = |max_rc, max_fp| Limits {
            max_rc,
            max_fp,
            ..Limits::default()
        };
        assert_eq!(
            spread(&l(16, 8), 63, 16),
            Some((16, 8)),
            "paper 001's limits"
        );
        assert_eq!(spread(&l(9, 8), 63, 16), Some((9, 14)));
        assert_eq!(
            spread(&l(64, 8), 63, 16),
            Some((32, 4)),
            "never below 4 slots"
        );
        assert_eq!(spread(&l(64, 8), 20, 16), Some((20, 6)));
        assert_eq!(spread(&l(16, 16), 63, 16), None);
        assert_eq!(spread(&l(16, 0), 63, 16), None);
        assert_eq!(spread(&l(16, 8), 63, 4), None, "rings already at the least");
        assert_eq!(spread(&l(0, 8), 63, 16), None);
        assert_eq!(
            spread(&l(16, 8), 8, 16),
            None,
            "8 peers in the job: all have whole rings"
        );
        assert_eq!(
            spread(&l(16, 8), 10, 16),
            Some((10, 12)),
            "10 peers can connect"
        );
        let cfg = |fp_ring| Config {
            chain: Chain::default(),
            auto: false,
            limits: Limits::default(),
            max_rc_set: false,
            max_fp_set: false,
            small_job: 32,
            limits_from: 512,
            fp_ring,
            stats: false,
        };
        let got = |c: &Config, n: u32| {
            let (l, slots) = c.in_force(n);
            (l.max_rc, l.max_fp, slots)
        };
        assert_eq!(got(&cfg(Some(16)), 1024), (16, 16, 8), "paper 001's limits");
        assert_eq!(
            got(&cfg(Some(16)), 16),
            (16, 15, 0),
            "a small job: whole rings"
        );
        assert_eq!(
            got(&cfg(Some(16)), 64),
            (63, 63, 8),
            "a mid-sized job: every peer, half rings"
        );
        assert_eq!(got(&cfg(Some(16)), 200), (199, 64, 8), "at most 64 rings");
        assert_eq!(got(&cfg(None), 1024), (16, 8, 0), "spreading off");
        assert_eq!(
            got(&cfg(None), 64),
            (63, 63, 0),
            "WEFT_VERBS_RC_FP_BUFS set: its rings"
        );
    }

    #[test]
    fn chains_this_version_cannot_carry_are_refused_at_init() {
        let cfg = |rules: &str| Config {
            chain: Chain::parse(rules).unwrap(),
            auto: false,
            limits: Limits::default(),
            max_rc_set: false,
            max_fp_set: false,
            small_job: 32,
            limits_from: 512,
            fp_ring: None,
            stats: false,
        };
        assert_eq!(cfg("{true: UD-SR}").job(4).unwrap().1, u64::MAX);
        let e = cfg("{size<=512: UD-SR}, {true: UD-ZCOPY}")
            .job(4)
            .unwrap_err();
        assert!(e.to_string().contains("512 bytes"), "{e}");
        let e = cfg("{size<=4K: RC-SR}").job(4).unwrap_err();
        assert!(e.to_string().contains("no rule on a UD channel"), "{e}");
    }
}

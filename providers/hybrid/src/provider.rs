// Over 800 lines: its unit tests, below the code (which is under 800), test it through its private state.
//! The `hybrid` provider: the UD and RC channels (`weft_verbs::channel`) opened side by side,
//! each active message sent over the channel the send-rule chain picks among those open to its
//! peer, RC connections opened by the budget's agreement, and order across channels (and
//! across RC-FP and RC-SR: the RC channel does not order them in a composition) restored on
//! receipt by one sequencer.
//!
//! Every peer starts on UD-SR (verbs-ud's one UD QP). A message to or from a peer counts
//! towards its RC threshold; past it the two budgets agree ([`crate::budget`], control
//! messages over UD-SR) and both sides connect verbs-rc's RC QP, after which the chain may pick
//! RC-SR (send/receive over the shared receive queue) or, once verbs-rc has set up the peer's
//! eager slots, RC-FP. Each data message carries a per-peer sequence number (5 bytes before
//! the core's header: kind, number); the receiver hands messages to the core in that order
//! ([`weft_proto::order`]), holding a copy of any that overtook its predecessors on another channel.
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

mod budget_io;
mod config;
mod contract;
mod recv;

use config::*;
pub use config::{chain_in_force, limits_in_force};
use recv::Recv;

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
use weft_verbs::channel::{RcChannel, Sizing, UdChannel};
use weft_verbs::rc::VerbsRc;
use weft_verbs::ud::VerbsUd;
use weft_verbs::Hca;

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

weft_provider::register_provider!(
    Hybrid,
    priority = 6,
    summary = "MVAPICH-Aptus on the verbs layer: UD-SR, RC-SR and RC-FP at once, chosen per message by a send-rule chain (WEFT_HYBRID_RULES), RC connections opened lazily under per-process limits, order kept across channels"
);

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

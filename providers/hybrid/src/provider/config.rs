//! The hybrid provider's configuration: its parameters (`WEFT_HYBRID_*`), the send-rule chain
//! read from them, and the limits in force for a job of a given size (`Tier`, the RC-FP slots
//! shared out); `limits_in_force` and `chain_in_force` say the same for `weft info`.

use super::*;

/// `WEFT_HYBRID_RULES` is empty, `auto` or a chain that parses.
pub(crate) fn check_rules(v: &str) -> std::result::Result<(), String> {
    if v.is_empty() || v.eq_ignore_ascii_case("auto") {
        return Ok(());
    }
    Chain::parse(v)
        .map(|_| ())
        .map_err(|e| format!("a send-rule chain ({e})"))
}

weft_provider::param!(pub(crate) RULES: Str check(check_rules) = "hybrid", "RULES", "",
    "hybrid: the send-rule chain, e.g. {size<=2048: RC-FP}, {size<=2008: UD-SR}, {size<=8192: RC-SR}, {size<=8192: UD-SR}, {true: RC-RDMA}, {true: UD-ZCOPY} (empty: that chain, paper 001's; sizes count the payload); auto: derived from each channel's cost measured on this host (cached)");
weft_provider::param!(pub(crate) RC_THRESHOLD: Uint = "hybrid", "RC_THRESHOLD", "100",
    "hybrid: messages exchanged with a peer (those the chain would send over RC were it open) before it earns an RC connection (MVAPICH: 100); 0 or 1: at the first message");
weft_provider::param!(pub(crate) MAX_RC: Uint[0, 1 << 20] = "hybrid", "MAX_RC", "16",
    "hybrid: RC connections per process at most (paper 001: 16; unset, every peer in a job of fewer than LIMITS_FROM ranks); 0: UD only");
weft_provider::param!(pub(crate) MAX_FP: Uint[0, 1 << 20] = "hybrid", "MAX_FP", "8",
    "hybrid: RC-FP rings per process (paper 001: 8 peers; FP_SPREAD shares their slots among up to MAX_RC peers; unset, every peer in a job of fewer than SMALL_JOB ranks, up to 64 peers with half rings below LIMITS_FROM)");
weft_provider::param!(pub(crate) SMALL_JOB: Uint = "hybrid", "SMALL_JOB", "32",
    "hybrid: in a job of fewer ranks (and of fewer than LIMITS_FROM), MAX_FP left unset gives every peer a whole RC-FP ring (MVAPICH2 gives RC-FP to every peer below 32 processes)");
weft_provider::param!(pub(crate) LIMITS_FROM: Uint = "hybrid", "LIMITS_FROM", "512",
    "hybrid: paper 001's limits (MAX_RC, MAX_FP left unset) hold in jobs of this many ranks and more (MVAPICH2 2.3.7 turns its hybrid on from 512 processes); below, an unset MAX_RC allows every peer and an unset MAX_FP up to 64 peers (MVAPICH2's polling set) with rings of half depth, whole rings for every peer below SMALL_JOB; 0: paper 001's limits at any size");
weft_provider::param!(pub(crate) FP_SPREAD: Bool = "hybrid", "FP_SPREAD", "1",
    "hybrid: where MAX_FP is below MAX_RC, share the RC-FP slots of MAX_FP rings of WEFT_VERBS_RC_FP_BUFS among up to MAX_RC peers with shallower rings (at least 4 slots; the same memory); 0: MAX_FP peers with whole rings, as paper 001 (also when WEFT_VERBS_RC_FP_BUFS is set)");
weft_provider::param!(pub(crate) REBALANCE: Bool = "hybrid", "REBALANCE", "0",
    "hybrid: at the RC limit, close the least-recently-used connection (idle for RC_THRESHOLD messages) for a busier peer, both sides draining first");
weft_provider::param!(pub(crate) FAIR: Bool = "hybrid", "FAIR", "1",
    "hybrid: at the RC limit, a process that refuses a peer holding fewer connections than one of its own RC peers asks that peer to give up its connection for the refused one (swaps only towards the process with fewer, so they end); 0: first come, first served");
weft_provider::param!(pub(crate) STATS: Bool = "hybrid", "STATS", "0",
    "hybrid: print messages and bytes per peer and channel, RC connections and RC-FP slots opened and closed, and the limits in force, at finalize (standard error)");

/// The parameters, checked.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) chain: Chain,
    /// `WEFT_HYBRID_RULES=auto`: `chain` is the default until the calibrated one replaces it
    /// at open ([`crate::auto`]).
    pub(crate) auto: bool,
    pub(crate) limits: Limits,
    /// Whether `WEFT_HYBRID_MAX_RC` and `WEFT_HYBRID_MAX_FP` were set (else they may be
    /// lifted for a small job, [`Config::limits_for`]).
    pub(crate) max_rc_set: bool,
    pub(crate) max_fp_set: bool,
    pub(crate) small_job: u64,
    /// `WEFT_HYBRID_LIMITS_FROM`: the job size from which the paper's limits hold.
    pub(crate) limits_from: u64,
    /// Slots of a whole RC-FP ring when `WEFT_HYBRID_FP_SPREAD` may share them among more
    /// peers (`None`: spreading off, or `WEFT_VERBS_RC_FP_BUFS` set).
    pub(crate) fp_ring: Option<usize>,
    pub(crate) stats: bool,
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
pub(crate) enum Tier {
    Small,
    Mid,
    Paper,
}

/// RC-FP peers at most in a mid-sized job (MVAPICH2's polling set, verbs-rc's
/// `WEFT_VERBS_RC_FP_PEERS`).
pub(crate) const MID_FP_PEERS: usize = 64;

/// Fewest slots a shared-out RC-FP ring keeps (4: streaming 2 KiB messages through 8 slots
/// kept within 3 % of 16 on the soft HCA, through 4 it lost 5 %; docs/history/benchmarks-notebook.md).
pub(crate) const FP_RING_MIN: usize = 4;

/// The RC-FP slots of `l.max_fp` rings of `ring` slots shared among up to `l.max_rc` of a
/// job's `peers`: (peers, slots of each ring), or `None` when that gives no more peers than
/// `max_fp`.
pub(crate) fn spread(l: &Limits, peers: usize, ring: usize) -> Option<(usize, usize)> {
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
    pub(crate) fn from_env() -> Result<Config> {
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
            fp_ring: if FP_SPREAD.get_bool()? && !weft_verbs::rc::FP_BUFS.is_set() {
                Some(weft_verbs::rc::FP_BUFS.get_u64()? as usize)
            } else {
                None
            },
            stats: STATS.get_bool()?,
        })
    }

    /// Which limits a job of `size` ranks takes where `WEFT_HYBRID_MAX_RC` and `_MAX_FP` are
    /// left unset ([`Tier`]).
    pub(crate) fn tier(&self, size: u32) -> Tier {
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
    pub(crate) fn limits_for(&self, size: u32) -> Limits {
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
    pub(crate) fn in_force(&self, size: u32) -> (Limits, usize) {
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
    pub(crate) fn job(&self, size: u32) -> Result<(JobChain, u64)> {
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
        && !weft_verbs::ud::zero_copy_on().map_err(|e| e.to_string())?;
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

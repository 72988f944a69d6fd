//! The soft HCA's knobs, its memory-accounting model, its wire model and its optional timing
//! model. The accounting follows what an mlx5-class HCA and rdma-core's mlx5 provider allocate
//! (docs/verbs.md gives each term and where it comes from); the soft HCA's own shared-memory
//! layout is an implementation detail and is not what is reported.

use crate::types::{Mtu, WrOpcode, GRH_LEN};
use std::time::{Duration, Instant};
use weft_provider::Result;

weft_provider::param!(pub DEVICE: Str = "verbs", "DEVICE", "auto",
    "HCA to open: `soft`, an rdma-core device name (mlx5_0), or `auto` (the first real HCA, else soft)");
weft_provider::param!(pub IBV_VERBOSE: Bool = "verbs", "IBV_VERBOSE", "0",
    "the soft HCA as libibverbs.so.1 (export/ibverbs): print on stderr why each failing verbs call failed");
weft_provider::param!(MAX_QP: Uint[1, 65_535] = "verbs", "SOFT_MAX_QP", "4096", "soft HCA: queue pairs per process");
weft_provider::param!(MAX_MR: Uint[1, 65_535] = "verbs", "SOFT_MAX_MR", "8192", "soft HCA: memory regions per process");
weft_provider::param!(MAX_CQ: Uint[1, 65_535] = "verbs", "SOFT_MAX_CQ", "1024", "soft HCA: completion queues per process");
weft_provider::param!(MAX_PEERS: Uint[2, 65_536] = "verbs", "SOFT_MAX_PEERS", "4096",
    "soft HCA: processes that may reach this one through its shared segment at once (2..=65536; its own wire service is one of them)");
weft_provider::param!(FENCE: Seconds = "verbs", "SOFT_FENCE", "10",
    "soft HCA: seconds a peer may hold up this HCA (stopped or hung in the middle of an access to it) before it is fenced out: killed, as a cluster fences a node; 0: never (wait for it)");
weft_provider::param!(MAX_SRQ: Uint[1, 65_535] = "verbs", "SOFT_MAX_SRQ", "256", "soft HCA: shared receive queues per process");
weft_provider::param!(HEAP: Size[1 << 20, 1u64 << 40] = "verbs", "SOFT_HEAP", "1G",
    "soft HCA: shared memory for queues and device memory per process (sparse: only what is used is backed; 1M to 1T)");
weft_provider::param!(ADDR: Str = "verbs", "SOFT_ADDR", "auto",
    "soft HCA: IPv4 address peers on other hosts reach this HCA's UDP wire service at (auto: the first non-loopback address; off: this host only)");
weft_provider::param!(MTU: Uint[256, 4096] check(weft_provider::param::checks::power_of_two) = "verbs", "SOFT_MTU", "2048", "soft HCA: active path MTU (256..4096, a power of two)");
weft_provider::param!(UD_DROP: Float[0, 1] = "verbs", "SOFT_UD_DROP", "0", "soft HCA fault injection: probability that a UD datagram is dropped");
weft_provider::param!(UD_DUP: Float[0, 1] = "verbs", "SOFT_UD_DUP", "0", "soft HCA fault injection: probability that a UD datagram is delivered twice");
weft_provider::param!(UD_REORDER: Float[0, 1] = "verbs", "SOFT_UD_REORDER", "0",
    "soft HCA fault injection: probability that a UD datagram is held back behind the next one");
weft_provider::param!(UD_BATCH: Uint[1, 1024] = "verbs", "SOFT_UD_BATCH", "64",
    "soft HCA: UD datagrams of one post to one process delivered with one Cross-Memory Attach copy at most (1: a copy each)");
weft_provider::param!(RC_LOSS: Float[0, 1] = "verbs", "SOFT_RC_LOSS", "0",
    "soft HCA fault injection: probability that an RC request or its acknowledgement is lost (the requester retries)");
weft_provider::param!(SEED: Uint = "verbs", "SOFT_SEED", "1", "soft HCA fault injection: random seed");
weft_provider::param!(MUTE_AFTER: Uint = "verbs", "SOFT_MUTE_AFTER", "0",
    "soft HCA fault injection: stop responding after this many requests served (0 = never)");
weft_provider::param!(LATENCY: Float[0, 1e7] = "verbs", "SOFT_LATENCY_US", "0", "soft HCA timing model: link latency per message, µs (0 = off; at most 10^7)");
weft_provider::param!(BANDWIDTH: Float[0, 1e9] check(weft_provider::param::checks::zero_or_a_rate) = "verbs", "SOFT_BANDWIDTH_MBS", "0", "soft HCA timing model: link bandwidth, MB/s (0 = unlimited; 0.001 to 10^9)");
weft_provider::param!(QP_CACHE: Uint[0, 1 << 20] = "verbs", "SOFT_QP_CACHE", "0", "soft HCA timing model: QP contexts the HCA caches (0 = no cache model)");
weft_provider::param!(QP_MISS: Float[0, 1e7] = "verbs", "SOFT_QP_MISS_US", "0.5", "soft HCA timing model: cost of a QP-context cache miss, µs (at most 10^7)");

/// Everything configurable about one soft HCA.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub max_qp: u32,
    pub max_mr: u32,
    pub max_cq: u32,
    pub max_srq: u32,
    /// Attach slots of the segment (`WEFT_VERBS_SOFT_MAX_PEERS`).
    pub max_peers: u32,
    /// How long a peer may hold up this HCA before it is fenced out; `None`: forever.
    pub fence: Option<Duration>,
    pub heap: usize,
    pub mtu: Mtu,
    pub ud_drop: f64,
    pub ud_dup: f64,
    pub ud_reorder: f64,
    /// UD datagrams delivered together (one copy) at most.
    pub ud_batch: usize,
    pub rc_loss: f64,
    pub seed: u64,
    pub mute_after: u64,
    pub latency: Duration,
    /// Bytes per second, 0 = unlimited.
    pub bandwidth: f64,
    pub qp_cache: usize,
    pub qp_miss: Duration,
    /// `WEFT_VERBS_SOFT_ADDR`: `auto`, `off` or an IPv4 address.
    pub addr: String,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            max_qp: 4096,
            max_mr: 8192,
            max_cq: 1024,
            max_srq: 256,
            max_peers: crate::soft::seg::ATTACH_SLOTS,
            fence: Some(Duration::from_secs(10)),
            heap: 1 << 30,
            mtu: Mtu::M2048,
            ud_drop: 0.0,
            ud_dup: 0.0,
            ud_reorder: 0.0,
            ud_batch: 64,
            rc_loss: 0.0,
            seed: 1,
            mute_after: 0,
            latency: Duration::ZERO,
            bandwidth: 0.0,
            qp_cache: 0,
            qp_miss: Duration::from_nanos(500),
            addr: "auto".into(),
        }
    }
}

fn micros(p: &weft_provider::param::ParamDesc) -> Result<Duration> {
    Ok(Duration::from_nanos((p.get_f64()? * 1000.0) as u64))
}

impl Config {
    /// From the `WEFT_VERBS_SOFT_*` environment.
    pub fn from_env() -> Result<Config> {
        // Every range is in the parameter's declaration.
        let u32_of =
            |p: &weft_provider::param::ParamDesc| -> Result<u32> { Ok(p.get_u64()? as u32) };
        Ok(Config {
            max_qp: u32_of(&MAX_QP)?,
            max_mr: u32_of(&MAX_MR)?,
            max_cq: u32_of(&MAX_CQ)?,
            max_srq: u32_of(&MAX_SRQ)?,
            max_peers: u32_of(&MAX_PEERS)?,
            fence: FENCE.get_seconds(true)?,
            heap: HEAP.get_size()?,
            mtu: Mtu::from_bytes(MTU.get_u64()? as usize)
                .ok_or_else(|| MTU.refuse("256, 512, 1024, 2048 or 4096"))?,
            ud_drop: UD_DROP.get_f64()?,
            ud_dup: UD_DUP.get_f64()?,
            ud_reorder: UD_REORDER.get_f64()?,
            ud_batch: UD_BATCH.get_u64()? as usize,
            rc_loss: RC_LOSS.get_f64()?,
            seed: SEED.get_u64()?,
            mute_after: MUTE_AFTER.get_u64()?,
            latency: micros(&LATENCY)?,
            bandwidth: BANDWIDTH.get_f64()? * 1e6,
            qp_cache: QP_CACHE.get_u64()? as usize,
            qp_miss: micros(&QP_MISS)?,
            addr: ADDR.get_str(),
        })
    }

    pub fn timing(&self) -> bool {
        !self.latency.is_zero() || self.bandwidth > 0.0 || self.qp_cache > 0
    }
}

/// The seeded generator of fault injection (xorshift64*, `weft_proto::sim`): reproducible for
/// a seed.
pub use weft_proto::sim::Rng;

// ---- accounting model (mlx5-shaped; docs/verbs.md) ----

/// Queue-pair context in HCA memory (ICM), and the doorbell record.
pub const QPC: u64 = 256;
pub const DBREC: u64 = 64;
/// The user-space driver's per-QP structure (rdma-core mlx5: `struct mlx5_qp` and its locks).
pub const QP_DRIVER: u64 = 1024;
pub const CQC: u64 = 64;
pub const CQE: u64 = 64;
pub const SRQC: u64 = 64;
pub const MKEY: u64 = 64;
/// Translation entry per 4 KiB page of a region.
pub const MTT: u64 = 8;

fn pow2(x: u32) -> u64 {
    (x.max(1) as u64).next_power_of_two()
}

/// Bytes of a send WQE (64-byte basic blocks): control 16, then the RDMA address and atomic
/// segments (RC, 32) or the datagram segment (UD, 48), then the data segments or the inline data.
pub fn send_wqe(ud: bool, sge: u32, inline: u32) -> u64 {
    let addr = if ud { 48 } else { 32 };
    let data = (16 * sge as u64).max((4 + inline as u64).div_ceil(16) * 16);
    (16 + addr + data).div_ceil(64) * 64
}

/// Bytes of a receive WQE: 16 per scatter entry, a power of two.
pub fn recv_wqe(sge: u32) -> u64 {
    (16 * sge.max(1) as u64).next_power_of_two()
}

/// Bytes a QP costs: context, doorbell, driver structure, send ring, receive ring (none with
/// an SRQ), and the 8-byte work-request-id arrays of both.
pub fn qp_bytes(ud: bool, cap: &crate::QpCap, srq: bool) -> u64 {
    let sq = pow2(cap.max_send_wr);
    let rq = if srq { 0 } else { pow2(cap.max_recv_wr) };
    QPC + DBREC
        + QP_DRIVER
        + sq * send_wqe(ud, cap.max_send_sge, cap.max_inline_data)
        + rq * recv_wqe(cap.max_recv_sge)
        + 8 * (sq + rq)
}

pub fn cq_bytes(cqe: u32) -> u64 {
    CQC + DBREC + pow2(cqe + 1) * CQE
}

pub fn srq_bytes(wr: u32, sge: u32) -> u64 {
    SRQC + DBREC + pow2(wr) * (recv_wqe(sge + 1) + 8)
}

pub fn mr_bytes(addr: u64, len: usize) -> u64 {
    let first = addr / 4096;
    let last = (addr + len.max(1) as u64 - 1) / 4096;
    MKEY + MTT * (last - first + 1)
}

// ---- wire model ----

/// Local route header, base transport header, invariant and variant CRCs.
pub const PKT_HDR: u64 = 8 + 12 + 4 + 2;
/// An acknowledgement: a header plus the 4-byte ACK extended header.
pub const ACK: u64 = PKT_HDR + 4;

/// (packets, bytes) on the wire for one message of `len` payload bytes, its responses and its
/// acknowledgement included.
pub fn wire(op: WrOpcode, len: usize, mtu: usize, ud: bool) -> (u64, u64) {
    let pk = (len.div_ceil(mtu)).max(1) as u64;
    let imm = if op.has_imm() { 4 } else { 0 };
    if ud {
        // DETH 8, and the GRH the receiver gets; no acknowledgement.
        return (1, PKT_HDR + 8 + GRH_LEN as u64 + imm + len as u64);
    }
    match op {
        WrOpcode::RdmaRead => (1 + pk, PKT_HDR + 16 + pk * (PKT_HDR + 4) + len as u64),
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
            (2, PKT_HDR + 28 + PKT_HDR + 4 + 8)
        }
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => {
            (pk + 1, pk * PKT_HDR + 16 + imm + len as u64 + ACK)
        }
        WrOpcode::Send | WrOpcode::SendWithImm => (pk + 1, pk * PKT_HDR + imm + len as u64 + ACK),
    }
}

// ---- timing model ----

/// The link and QP-context cache of the timing model: when a message may be delivered.
#[derive(Debug)]
pub struct Timing {
    link_free: Instant,
    cache: Vec<(u64, u64)>,
    tick: u64,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing::new()
    }
}

impl Timing {
    pub fn new() -> Timing {
        Timing {
            link_free: Instant::now(),
            cache: Vec::new(),
            tick: 0,
        }
    }

    /// When a message of `len` bytes posted now on the QP `ctx` arrives, and whether its
    /// QP context missed the cache. The link serialises messages; latency overlaps.
    pub fn due(&mut self, cfg: &Config, ctx: u64, len: usize) -> (Instant, bool) {
        let now = Instant::now();
        let ser = if cfg.bandwidth > 0.0 {
            Duration::from_secs_f64(len as f64 / cfg.bandwidth)
        } else {
            Duration::ZERO
        };
        let mut miss = false;
        let mut extra = Duration::ZERO;
        if cfg.qp_cache > 0 {
            self.tick += 1;
            if let Some(e) = self.cache.iter_mut().find(|e| e.0 == ctx) {
                e.1 = self.tick;
            } else {
                miss = true;
                extra = cfg.qp_miss;
                if self.cache.len() >= cfg.qp_cache {
                    let lru = (0..self.cache.len())
                        .min_by_key(|i| self.cache[*i].1)
                        .unwrap_or(0);
                    self.cache.swap_remove(lru);
                }
                self.cache.push((ctx, self.tick));
            }
        }
        let start = self.link_free.max(now);
        self.link_free = start + ser + extra;
        (self.link_free + cfg.latency, miss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounting_follows_the_model() {
        let cap = crate::QpCap::default();
        // 64 send WQEs of 128 B (16 + 32 + 4 SGEs x 16 = 112 -> 128; inline 256 -> 272 -> 320).
        assert_eq!(send_wqe(false, 4, 256), 320);
        assert_eq!(send_wqe(false, 1, 0), 64);
        assert_eq!(recv_wqe(4), 64);
        let rc = qp_bytes(false, &cap, false);
        assert_eq!(rc, QPC + DBREC + QP_DRIVER + 64 * 320 + 128 * 64 + 8 * 192);
        assert!(
            qp_bytes(false, &cap, true) < rc,
            "an SRQ saves the receive ring"
        );
        assert_eq!(cq_bytes(255), CQC + DBREC + 256 * 64);
        assert_eq!(mr_bytes(4096, 4096), MKEY + MTT);
        assert_eq!(mr_bytes(4095, 2), MKEY + 2 * MTT);
    }

    #[test]
    fn wire_and_rng() {
        assert_eq!(
            wire(WrOpcode::RdmaWrite, 8, 2048, false),
            (2, 26 + 16 + 8 + 30)
        );
        assert_eq!(wire(WrOpcode::Send, 4096, 2048, false).0, 3);
        assert_eq!(
            wire(WrOpcode::Send, 100, 2048, true),
            (1, 26 + 8 + 40 + 100)
        );
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let x: Vec<f64> = (0..100).map(|_| a.next_f64()).collect();
        assert!(x.iter().all(|v| (0.0..1.0).contains(v)));
        assert_eq!(x, (0..100).map(|_| b.next_f64()).collect::<Vec<_>>());
        let hits = (0..10_000).filter(|_| a.chance(0.25)).count();
        assert!((2000..3000).contains(&hits), "{hits}");
    }

    #[test]
    fn timing_serialises_and_caches() {
        let cfg = Config {
            bandwidth: 1e9,
            qp_cache: 2,
            qp_miss: Duration::from_micros(1),
            ..Config::default()
        };
        let mut t = Timing::new();
        let (d1, m1) = t.due(&cfg, 1, 1_000_000);
        let (d2, m2) = t.due(&cfg, 1, 1_000_000);
        assert!(m1 && !m2);
        assert!(d2 - d1 >= Duration::from_micros(999), "{:?}", d2 - d1);
        assert!(t.due(&cfg, 2, 0).1, "second context misses");
        assert!(t.due(&cfg, 3, 0).1, "third context misses");
        assert!(t.due(&cfg, 1, 0).1, "least recently used was evicted");
    }
}

/// Fault injection for the tests of a peer that dies or stops in the middle of an access to
/// another process's HCA (what `WEFT_VERBS_SOFT_FENCE` and the ring's claims are for): this
/// process, as an initiator, stops itself (`SIGSTOP`) or exits at the point named, the next
/// time it gets there. Process-wide; off unless set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stall {
    Off = 0,
    /// Exit after claiming a slot of a peer's ring for a record, before publishing it.
    ExitInPush = 1,
    /// Stop there.
    StopInPush = 2,
    /// Exit after claiming a record of a peer's ring, before handing its slot back.
    ExitInPop = 3,
    /// Stop while holding a hazard on a peer's memory region (before the copy into it).
    StopInAccess = 4,
}

static STALL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Arm [`Stall`] `s` (fault injection).
pub fn stall_at(s: Stall) {
    STALL.store(s as u8, std::sync::atomic::Ordering::SeqCst);
}

/// Where an initiator passes a stall point: act if it is the one armed.
#[inline]
pub(crate) fn stall_point(here: Stall) {
    if STALL.load(std::sync::atomic::Ordering::Relaxed) == here as u8 && here != Stall::Off {
        match here {
            Stall::ExitInPush | Stall::ExitInPop => {
                // SAFETY: ends the process at once, as a kill would (no destructors run).
                unsafe { libc::_exit(0) }
            }
            _ => {
                STALL.store(0, std::sync::atomic::Ordering::SeqCst);
                // SAFETY: stops this process until a SIGCONT (or a SIGKILL: fencing).
                unsafe { libc::raise(libc::SIGSTOP) };
            }
        }
    }
}

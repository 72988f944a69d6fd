//! The HCA interface both backends implement: one opened device context, its objects named by
//! small handles, the calls of `ibv_*` with Rust types and `Result`s.

use crate::types::*;
use weft_provider::Result;

/// Memory the device model accounts for, in bytes, by object kind (see `docs/verbs.md` for the
/// model each figure follows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accounting {
    pub rc_qps: u64,
    pub ud_qps: u64,
    pub rc_qp_bytes: u64,
    pub ud_qp_bytes: u64,
    pub cqs: u64,
    pub cq_bytes: u64,
    pub srqs: u64,
    pub srq_bytes: u64,
    pub mrs: u64,
    pub mr_bytes: u64,
    /// Receive work requests posted and not yet consumed, and the buffer bytes they hold.
    pub posted_recvs: u64,
    pub posted_recv_bytes: u64,
    pub dm_bytes: u64,
}

impl Accounting {
    /// The device's and driver's own structures: queue pairs, completion and shared receive
    /// queues, and registration tables (what `mem_hca_bytes` reports; buffers apart).
    pub fn queues(&self) -> u64 {
        self.rc_qp_bytes + self.ud_qp_bytes + self.cq_bytes + self.srq_bytes + self.mr_bytes
    }

    /// Everything the device and its driver hold (buffers of posted receives included).
    pub fn total(&self) -> u64 {
        self.rc_qp_bytes
            + self.ud_qp_bytes
            + self.cq_bytes
            + self.srq_bytes
            + self.mr_bytes
            + self.posted_recv_bytes
            + self.dm_bytes
    }
}

/// What went through the device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Work requests executed, by opcode (index: [`WR_OPCODES`] order).
    pub ops: [u64; 7],
    /// Payload bytes moved by requests of this context.
    pub payload_bytes: u64,
    /// Bytes on the wire, headers and acknowledgements included (the model in the docs).
    pub wire_bytes: u64,
    /// Packets on the wire.
    pub packets: u64,
    /// RNR NAKs received, and transport retries made.
    pub rnr_naks: u64,
    pub retries: u64,
    /// Requests the responder recognised as duplicates (retries after a lost ACK).
    pub duplicates: u64,
    /// UD datagrams dropped: no receive posted, wrong qkey, or by fault injection.
    pub ud_dropped: u64,
    /// UD datagrams delivered twice by fault injection.
    pub ud_duplicated: u64,
    /// UD datagrams handed over in batches (several of one post to one process), and the
    /// batches: each batch's bytes move with one copy (soft HCA).
    pub ud_batched: u64,
    pub ud_batches: u64,
    /// QP-context cache misses (timing model).
    pub qp_cache_misses: u64,
    /// Requests from other hosts this context's soft-HCA wire service executed (RC requests
    /// answered, UD datagrams delivered); peers on this host do not pass through it.
    pub remote_served: u64,
}

impl Counters {
    pub fn op(&self, o: WrOpcode) -> u64 {
        self.ops[WR_OPCODES.iter().position(|x| *x == o).unwrap_or(0)]
    }
}

/// An opened HCA (`ibv_context` plus its port). Every call is thread-safe.
pub trait Hca: Send + Sync {
    /// Limits and abilities.
    fn attr(&self) -> &DeviceAttr;
    /// The port's GID: what peers put in their address vectors to reach this context.
    fn gid(&self) -> Gid;
    /// The port's LID on an InfiniBand fabric (0: none, as on RoCE and the soft HCA).
    fn lid(&self) -> u16 {
        0
    }

    fn alloc_pd(&self) -> Result<Pd>;
    /// Fails while MRs, QPs or SRQs of the PD exist.
    fn dealloc_pd(&self, pd: Pd) -> Result<()>;

    /// Register `[addr, addr + len)`.
    ///
    /// # Safety
    /// The memory must stay allocated until [`Hca::dereg_mr`] returns, and while any work
    /// request that names it (locally by lkey, or remotely by rkey) may run, nothing may hold a
    /// Rust reference to the bytes the HCA can write (LOCAL_WRITE, REMOTE_WRITE,
    /// REMOTE_ATOMIC), as with DMA by a real device.
    unsafe fn reg_mr(&self, pd: Pd, addr: *mut u8, len: usize, access: Access) -> Result<Mr>;
    /// Deregister; returns once no remote access to the region is under way, so the memory
    /// may be freed afterwards.
    fn dereg_mr(&self, mr: Mr) -> Result<()>;
    /// Allocate device memory (`ibv_alloc_dm`), zeroed; register it with [`Hca::reg_mr`] on
    /// `dm.ptr`.
    fn alloc_dm(&self, len: usize) -> Result<Dm>;
    /// Fails while an MR covers it.
    fn free_dm(&self, dm: Dm) -> Result<()>;

    /// A completion queue of at least `cqe` entries.
    fn create_cq(&self, cqe: u32) -> Result<Cq>;
    fn destroy_cq(&self, cq: Cq) -> Result<()>;
    /// Move up to `out.len()` completions into `out`; returns how many. Also drives this
    /// context's requests (the soft HCA's requester runs here and in `post_send`). An error is
    /// the CQ's own (overrun), not a work request's.
    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize>;

    fn create_srq(&self, pd: Pd, max_wr: u32, max_sge: u32) -> Result<Srq>;
    fn destroy_srq(&self, srq: Srq) -> Result<()>;
    /// Arm the limit event: it fires once when fewer than `limit` receives remain (0 disarms).
    fn arm_srq_limit(&self, srq: Srq, limit: u32) -> Result<()>;
    /// Whether the limit event fired since the last call (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    fn srq_limit_reached(&self, srq: Srq) -> Result<bool>;
    fn post_srq_recv(&self, srq: Srq, wrs: &[RecvWr]) -> Result<()>;

    fn create_qp(&self, pd: Pd, init: &QpInitAttr) -> Result<Qp>;
    /// Apply the attributes that are `Some`; a state change must be legal and carry the
    /// attributes the spec requires for it.
    fn modify_qp(&self, qp: Qp, attr: &QpAttr) -> Result<()>;
    fn query_qp_state(&self, qp: Qp) -> Result<QpState>;
    /// The capacities the QP got (at least what was asked).
    fn query_qp_cap(&self, qp: Qp) -> Result<QpCap>;
    fn destroy_qp(&self, qp: Qp) -> Result<()>;

    fn create_ah(&self, pd: Pd, attr: &AhAttr) -> Result<Ah>;
    fn destroy_ah(&self, ah: Ah) -> Result<()>;

    /// Post send work requests in order. An invalid request (too many SGEs, inline too long,
    /// queue full, wrong opcode for the QP, QP not in RTS) is an error and it and the ones
    /// after it are not posted (`bad_wr`); the `usize` in the error's text names it.
    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> Result<()>;
    /// Post receives (allowed from INIT on).
    fn post_recv(&self, qp: Qp, wrs: &[RecvWr]) -> Result<()>;

    /// Drive outstanding requests without polling a CQ (the soft HCA's requester; a real HCA
    /// needs nothing).
    fn progress(&self) {}

    fn accounting(&self) -> Accounting;
    fn counters(&self) -> Counters;
}

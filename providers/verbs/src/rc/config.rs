//! verbs-rc's configuration: its parameters (`WEFT_VERBS_RC_*`), read and checked once at open
//! into a `Config`, and what follows from them (the eager rings' shape, queue depths, `Caps`).

use super::*;

weft_provider::param!(pub(super) BUF: Size[1 << 10, 1 << 20] = "verbs", "RC_BUF", "16K",
    "verbs-rc: bytes of active-message payload one RC send carries (the eager limit and the rendezvous chunk); 1K to 1M");
weft_provider::param!(pub(super) SRQ: Uint[16, 16384] = "verbs", "RC_SRQ", "256",
    "verbs-rc: receive buffers in the shared receive queue (RC-SR); 16 to 16384");
weft_provider::param!(pub(super) SEND_BUFS: Uint[16, 16384] = "verbs", "RC_SEND_BUFS", "256",
    "verbs-rc: registered send buffers shared by all peers; 16 to 16384");
weft_provider::param!(pub(super) SQ: Uint[16, 16384] = "verbs", "RC_SQ", "128",
    "verbs-rc: send-queue depth of each RC queue pair (work requests in flight per peer); 16 to 16384");
weft_provider::param!(pub(super) RNDV: Enum(&["read", "write", "copy"]) = "verbs", "RC_RNDV", "read",
    "verbs-rc: large messages: read (the receiver RDMA-reads the sender's buffer, zero copy), write (the receiver sends its buffer's key and the sender RDMA-writes into it, Aptus RC-RDMA) or copy (pipelined through active messages)");
weft_provider::param!(pub(super) TIMEOUT: Uint[1, 31] = "verbs", "RC_TIMEOUT", "20",
    "verbs-rc: the RC local ACK timeout code (4.096 us x 2^code; 20 is about 4.3 s, MVAPICH's default); with RC_RETRY it sets how long a dead peer takes to notice; 1 to 31");
weft_provider::param!(pub(super) RETRY: Uint[0, 7] = "verbs", "RC_RETRY", "7",
    "verbs-rc: RC transport retries before a peer is declared failed (0 to 7)");
weft_provider::param!(pub(super) KEEPALIVE: Seconds = "verbs", "RC_KEEPALIVE", "2",
    "verbs-rc: seconds between keepalive probes (a zero-length RDMA write) to connected peers with nothing in flight, so that a rank waiting only to receive notices a dead peer; 0: off");
weft_provider::param!(pub(super) EAGER: Enum(&["fastpath", "basic", "piggyback", "pipeline"]) = "verbs", "RC_EAGER", "fastpath",
    "verbs-rc: eager design: fastpath (MVAPICH RC-FP: per-peer RDMA slots after RC_FP_THRESHOLD messages, send/receive otherwise), basic (ring with head and tail pointers, three RDMA writes a message), piggyback (flags in the record, batched acknowledgements), pipeline (piggyback, large records written in RC_CHUNK pieces)");
weft_provider::param!(pub(super) RING: Size[4 << 10, 8 << 20] check(weft_provider::param::checks::multiple_of_8) = "verbs", "RC_RING", "256K",
    "verbs-rc basic/piggyback/pipeline: bytes of each per-peer eager ring (in the receiver's memory, mirrored by the sender); 4K to 8M");
weft_provider::param!(pub(super) CHUNK: Size[64, 1 << 30] check(weft_provider::param::checks::multiple_of_8) = "verbs", "RC_CHUNK", "16K",
    "verbs-rc pipeline design: bytes per RDMA write when a record is written piece by piece (paper 000: 16 KiB); a multiple of 8, 64 bytes or more");
weft_provider::param!(pub FP_BUFS: Uint[2, 1024] = "verbs", "RC_FP_BUFS", "16",
    "verbs-rc fastpath: RDMA eager slots per peer (MVAPICH MV2_NUM_RDMA_BUFFER); 2 to 1024");
weft_provider::param!(pub(super) FP_SIZE: Size[256, 1 << 20] check(weft_provider::param::checks::multiple_of_8) = "verbs", "RC_FP_SIZE", "4K",
    "verbs-rc fastpath: bytes of one slot, head and tail flags included (MVAPICH MV2_RDMA_FAST_PATH_BUF_SIZE); 256 to 1M; unset, hybrid sizes its slots to its chain's RC-FP reach");
weft_provider::param!(pub(super) FP_THRESHOLD: Uint = "verbs", "RC_FP_THRESHOLD", "16",
    "verbs-rc fastpath: messages received from a peer before its slots are set up (MVAPICH: 256, Open MPI: 16); 0: at connection");
weft_provider::param!(pub(super) FP_PEERS: Uint[0, 1 << 20] = "verbs", "RC_FP_PEERS", "64",
    "verbs-rc fastpath: peers with slots at most (MVAPICH MV2_POLLING_SET_LIMIT); the others use send/receive");
weft_provider::param!(pub(super) CONNECT_TIMEOUT: Seconds[1e-3, 1e9] = "verbs", "RC_CONNECT_TIMEOUT", "30",
    "verbs-rc: seconds a connection request may go unanswered before the peer is failed (0.001 to 10^9)");

/// How large messages move (`WEFT_VERBS_RC_RNDV`); told to the core through `peer_caps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rndv {
    Read,
    Write,
    Copy,
}

pub(super) struct Config {
    pub(super) design: Design,
    pub(super) ring: usize,
    pub(super) chunk: usize,
    pub(super) fp_bufs: usize,
    pub(super) fp_size: usize,
    pub(super) fp_threshold: u64,
    pub(super) fp_peers: usize,
    pub(super) buf: usize,
    pub(super) srq: usize,
    pub(super) send_bufs: usize,
    pub(super) sq: u32,
    pub(super) rndv: Rndv,
    pub(super) connect_timeout: Duration,
    pub(super) rc: verbs::RcParams,
    pub(super) keepalive: Option<Duration>,
    /// Connections expected at most (a composition's budget); `None`: any rank.
    pub(super) conns: Option<usize>,
    /// RMA and atomic requests, and eager-ring writes, posted at once at most.
    pub(super) ops_in_flight: usize,
    pub(super) ring_in_flight: usize,
    /// The shared receive and send pools are made at the first RC queue pair, not at open.
    pub(super) lazy_pools: bool,
    /// Scatter-gather entries per work request at most (the device's limit is lower or equal).
    pub(super) sges: usize,
    /// Active messages of a peer are handed on in the order it sent them, across the eager
    /// ring and send/receive (verbs-rc on its own); `false` in a composition, whose own
    /// sequencer orders what all its channels deliver (one sequencer, not two).
    pub(super) ordered: bool,
}

impl Config {
    pub(super) fn from_env() -> Result<Config> {
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
            ordered: true,
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
    pub(super) fn shape(&self) -> Shape {
        self.shape_of(self.design)
    }

    pub(super) fn shape_of(&self, design: Design) -> Shape {
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
    pub(super) fn eager_bytes(&self) -> usize {
        ring_pair_bytes(self.shape())
    }

    /// Keepalive probes in flight at most: one per connection a composition may hold, else
    /// [`KA_ROOM`] (never more than the job has peers). A process connected to more peers
    /// probes them in turns ([`VerbsRc::keepalives`]), so the completion queue does not grow
    /// with the job.
    pub(super) fn ka_room(&self, size: u32) -> usize {
        self.conns.unwrap_or(KA_ROOM).min(size as usize).max(1)
    }

    /// Completion-queue entries for a job of `size` ranks: every receive and send buffer, the
    /// connection manager's, the RMA requests and ring writes in flight and the keepalive
    /// probes.
    pub(super) fn cqe(&self, size: u32, attr: &verbs::DeviceAttr) -> u32 {
        let n = self.srq
            + self.send_bufs
            + UD_RECVS
            + UD_SENDS
            + self.ops_in_flight
            + self.ring_in_flight
            + self.ka_room(size);
        n.min(attr.max_cqe as usize) as u32
    }

    pub(super) fn caps(&self) -> Caps {
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

//! The verbs vocabulary, named and numbered as in `<infiniband/verbs.h>` so that a reader who
//! knows `ibv_*` recognises every value (the numeric codes are ibverbs' own, which keeps the
//! rdma-core backend a plain conversion).

use smallvec::SmallVec;

/// Memory-region access rights (`IBV_ACCESS_*`). Local read is always allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Access(pub u32);

impl Access {
    pub const LOCAL_WRITE: Access = Access(1);
    pub const REMOTE_WRITE: Access = Access(2);
    pub const REMOTE_READ: Access = Access(4);
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Everything a window or a rendezvous buffer needs.
    pub const ALL: Access = Access(15);

    pub fn contains(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

/// Completion status (`enum ibv_wc_status`, same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    Success = 0,
    /// A receive buffer too small for the message (at the receiver), or a send larger than the
    /// port allows (at the sender).
    LocLenErr = 1,
    /// The work request is not valid for the QP (e.g. too many SGEs, inline too long).
    LocQpOpErr = 2,
    /// A local SGE's key, range or rights do not allow the access.
    LocProtErr = 4,
    /// The QP went to the error state before this request completed.
    WrFlushErr = 5,
    /// The responder rejected the request (length error at the receiver, misaligned atomic,
    /// an opcode its QP does not allow).
    RemInvReqErr = 9,
    /// The responder's key, range or rights check failed; the target memory is untouched.
    RemAccessErr = 10,
    /// The responder could not carry the request out (e.g. a local error at its side).
    RemOpErr = 11,
    /// No answer after `retry_cnt` transport retries (the peer is gone or not ready).
    RetryExcErr = 12,
    /// The responder kept answering "receiver not ready" past `rnr_retry` retries.
    RnrRetryExcErr = 13,
    /// A hardware HCA's other failures (bad response, local access, fatal, ...); the soft HCA
    /// never reports it.
    GeneralErr = 21,
}

impl WcStatus {
    pub fn from_u32(v: u32) -> Option<WcStatus> {
        use WcStatus::*;
        Some(match v {
            0 => Success,
            1 => LocLenErr,
            2 => LocQpOpErr,
            4 => LocProtErr,
            5 => WrFlushErr,
            9 => RemInvReqErr,
            10 => RemAccessErr,
            11 => RemOpErr,
            12 => RetryExcErr,
            13 => RnrRetryExcErr,
            21 => GeneralErr,
            _ => return None,
        })
    }

    /// `ibv_wc_status_str`'s wording.
    pub fn as_str(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "success",
            LocLenErr => "local length error",
            LocQpOpErr => "local QP operation error",
            LocProtErr => "local protection error",
            WrFlushErr => "Work Request Flushed Error",
            RemInvReqErr => "invalid request error",
            RemAccessErr => "remote access error",
            RemOpErr => "remote operation error",
            RetryExcErr => "transport retry counter exceeded",
            RnrRetryExcErr => "RNR retry counter exceeded",
            GeneralErr => "general error",
        }
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a completion reports (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    pub fn from_u32(v: u32) -> Option<WcOpcode> {
        use WcOpcode::*;
        Some(match v {
            0 => Send,
            1 => RdmaWrite,
            2 => RdmaRead,
            3 => CompSwap,
            4 => FetchAdd,
            128 => Recv,
            129 => RecvRdmaWithImm,
            _ => return None,
        })
    }
}

/// A send-queue operation (`enum ibv_wr_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WrOpcode {
    RdmaWrite = 0,
    RdmaWriteWithImm = 1,
    Send = 2,
    SendWithImm = 3,
    RdmaRead = 4,
    AtomicCmpAndSwp = 5,
    AtomicFetchAndAdd = 6,
}

/// Every operation, for per-operation counters.
pub const WR_OPCODES: [WrOpcode; 7] = [
    WrOpcode::RdmaWrite,
    WrOpcode::RdmaWriteWithImm,
    WrOpcode::Send,
    WrOpcode::SendWithImm,
    WrOpcode::RdmaRead,
    WrOpcode::AtomicCmpAndSwp,
    WrOpcode::AtomicFetchAndAdd,
];

impl WrOpcode {
    pub fn name(self) -> &'static str {
        match self {
            WrOpcode::RdmaWrite => "RDMA_WRITE",
            WrOpcode::RdmaWriteWithImm => "RDMA_WRITE_WITH_IMM",
            WrOpcode::Send => "SEND",
            WrOpcode::SendWithImm => "SEND_WITH_IMM",
            WrOpcode::RdmaRead => "RDMA_READ",
            WrOpcode::AtomicCmpAndSwp => "ATOMIC_CMP_AND_SWP",
            WrOpcode::AtomicFetchAndAdd => "ATOMIC_FETCH_AND_ADD",
        }
    }

    /// The completion opcode at the requester.
    pub fn wc(self) -> WcOpcode {
        match self {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            WrOpcode::Send | WrOpcode::SendWithImm => WcOpcode::Send,
            WrOpcode::RdmaRead => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
        }
    }

    pub fn is_atomic(self) -> bool {
        matches!(
            self,
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd
        )
    }

    /// Whether it consumes a receive at the responder.
    pub fn consumes_recv(self) -> bool {
        matches!(
            self,
            WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWriteWithImm
        )
    }

    pub fn has_imm(self) -> bool {
        matches!(self, WrOpcode::SendWithImm | WrOpcode::RdmaWriteWithImm)
    }
}

/// Queue-pair transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum QpType {
    /// Reliable connected.
    Rc = 2,
    /// Unreliable datagram.
    Ud = 4,
}

/// Queue-pair state (`enum ibv_qp_state`; SQD/SQE are not modelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum QpState {
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
    Err = 6,
}

impl QpState {
    pub fn from_u32(v: u32) -> Option<QpState> {
        Some(match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            6 => QpState::Err,
            _ => return None,
        })
    }

    /// Whether `ibv_modify_qp` allows going from `self` to `to` (IBA 10.3.1, Figure 141, without
    /// SQD/SQE): RESET→INIT→RTR→RTS, any state to RESET or ERR, INIT→INIT and RTS→RTS.
    pub fn can_go(self, to: QpState) -> bool {
        use QpState::*;
        matches!(
            (self, to),
            (_, Reset)
                | (_, Err)
                | (Reset, Init)
                | (Init, Init)
                | (Init, Rtr)
                | (Rtr, Rts)
                | (Rts, Rts)
        )
    }
}

/// Path MTU (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mtu {
    M256 = 1,
    M512 = 2,
    M1024 = 3,
    M2048 = 4,
    M4096 = 5,
}

impl Mtu {
    pub fn bytes(self) -> usize {
        128 << (self as usize)
    }

    pub fn from_bytes(b: usize) -> Option<Mtu> {
        Some(match b {
            256 => Mtu::M256,
            512 => Mtu::M512,
            1024 => Mtu::M1024,
            2048 => Mtu::M2048,
            4096 => Mtu::M4096,
            _ => return None,
        })
    }
}

/// What a device can do with atomics (`enum ibv_atomic_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicCap {
    None,
    /// Atomic with respect to other atomics through the same HCA only.
    Hca,
    /// Also atomic with respect to the CPUs of the host.
    Glob,
}

/// One scatter/gather element (`struct ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A global identifier: for the soft HCA the address of a process's HCA (see `soft`), for a
/// real HCA the port GID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

/// Opaque handles. They are small numbers, valid in the context that made them.
macro_rules! handle {
    ($($(#[$m:meta])* $n:ident),*) => {$(
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $n(pub u32);
    )*};
}
handle!(
    /// Protection domain.
    Pd,
    /// Completion queue.
    Cq,
    /// Shared receive queue.
    Srq,
    /// Address handle (UD destination).
    Ah
);

/// A queue pair: its handle and its QP number (what peers address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Qp {
    pub handle: u32,
    pub qpn: u32,
}

/// A registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mr {
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: usize,
}

impl Mr {
    /// The SGE for `[off, off + len)` of this region.
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr + off as u64,
            length: len as u32,
            lkey: self.lkey,
        }
    }
}

/// Device memory (`ibv_alloc_dm`): memory the HCA provides, which peers' RDMA writes reach
/// directly. It is shared with other processes, so it is accessed through raw pointers and
/// volatile or atomic operations, never through Rust references.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dm {
    pub handle: u32,
    /// Where this process sees it.
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a Dm is a plain description (address and length) of memory the HCA owns; moving the
// description between threads is harmless, and every access through it is raw and unsafe.
unsafe impl Send for Dm {}
// SAFETY: as above.
unsafe impl Sync for Dm {}

/// A send work request (`struct ibv_send_wr`).
#[derive(Debug, Clone)]
pub struct SendWr {
    pub wr_id: u64,
    pub opcode: WrOpcode,
    pub sg_list: SmallVec<[Sge; 2]>,
    /// Immediate data for the `*_WITH_IMM` opcodes.
    pub imm: u32,
    /// `IBV_SEND_SIGNALED` (always true in effect when the QP has `sq_sig_all`).
    pub signaled: bool,
    /// `IBV_SEND_INLINE`: the payload is copied at post time, the SGEs need no lkey. Set only
    /// by the unsafe [`SendWr::inlined`]: the HCA then reads the SGEs' addresses unchecked.
    inline: bool,
    /// RDMA and atomic target.
    pub remote_addr: u64,
    pub rkey: u32,
    /// Atomics: compare (CAS) or add (FAA) operand, and the swap value.
    pub compare_add: u64,
    pub swap: u64,
    /// UD destination.
    pub ud: Option<UdDest>,
}

impl SendWr {
    fn base(wr_id: u64, opcode: WrOpcode, sg: &[Sge]) -> SendWr {
        SendWr {
            wr_id,
            opcode,
            sg_list: SmallVec::from_slice(sg),
            imm: 0,
            signaled: true,
            inline: false,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            ud: None,
        }
    }

    pub fn send(wr_id: u64, sg: &[Sge]) -> SendWr {
        SendWr::base(wr_id, WrOpcode::Send, sg)
    }

    pub fn send_imm(wr_id: u64, sg: &[Sge], imm: u32) -> SendWr {
        SendWr {
            imm,
            ..SendWr::base(wr_id, WrOpcode::SendWithImm, sg)
        }
    }

    pub fn write(wr_id: u64, sg: &[Sge], remote_addr: u64, rkey: u32) -> SendWr {
        SendWr {
            remote_addr,
            rkey,
            ..SendWr::base(wr_id, WrOpcode::RdmaWrite, sg)
        }
    }

    pub fn write_imm(wr_id: u64, sg: &[Sge], remote_addr: u64, rkey: u32, imm: u32) -> SendWr {
        SendWr {
            remote_addr,
            rkey,
            imm,
            ..SendWr::base(wr_id, WrOpcode::RdmaWriteWithImm, sg)
        }
    }

    pub fn read(wr_id: u64, sg: &[Sge], remote_addr: u64, rkey: u32) -> SendWr {
        SendWr {
            remote_addr,
            rkey,
            ..SendWr::base(wr_id, WrOpcode::RdmaRead, sg)
        }
    }

    pub fn cas(wr_id: u64, sge: Sge, remote_addr: u64, rkey: u32, cmp: u64, swap: u64) -> SendWr {
        SendWr {
            remote_addr,
            rkey,
            compare_add: cmp,
            swap,
            ..SendWr::base(wr_id, WrOpcode::AtomicCmpAndSwp, &[sge])
        }
    }

    pub fn fetch_add(wr_id: u64, sge: Sge, remote_addr: u64, rkey: u32, add: u64) -> SendWr {
        SendWr {
            remote_addr,
            rkey,
            compare_add: add,
            ..SendWr::base(wr_id, WrOpcode::AtomicFetchAndAdd, &[sge])
        }
    }

    /// Address a UD send.
    pub fn to(mut self, ah: Ah, remote_qpn: u32, remote_qkey: u32) -> SendWr {
        self.ud = Some(UdDest {
            ah,
            remote_qpn,
            remote_qkey,
        });
        self
    }

    pub fn unsignaled(mut self) -> SendWr {
        self.signaled = false;
        self
    }

    /// Mark the request inline (`IBV_SEND_INLINE`): its payload is copied when it is posted,
    /// straight from the SGEs' addresses, with no key and no registration to check them.
    ///
    /// # Safety
    /// Whenever the request is posted, each of its SGEs (as they are then: `sg_list` stays
    /// public) must name `length` bytes of this process's memory that are readable for the
    /// duration of the `post_send` call and that nothing writes during it.
    ///
    /// Safe code cannot make one (an inline request at address 0x10 used to be a segfault
    /// from safe code):
    ///
    /// ```compile_fail,E0133
    /// let bogus = weft_verbs::Sge { addr: 0x10, length: 8, lkey: 0 };
    /// let _ = weft_verbs::SendWr::send(1, &[bogus]).inlined();
    /// ```
    ///
    /// ```compile_fail,E0451
    /// let _ = weft_verbs::SendWr { inline: true, ..weft_verbs::SendWr::send(1, &[]) };
    /// ```
    pub unsafe fn inlined(mut self) -> SendWr {
        self.inline = true;
        self
    }

    /// Whether the request is inline ([`SendWr::inlined`]).
    pub fn is_inline(&self) -> bool {
        self.inline
    }

    /// Payload length.
    pub fn len(&self) -> usize {
        self.sg_list.iter().map(|s| s.length as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a UD send goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    pub ah: Ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// A receive work request (`struct ibv_recv_wr`).
#[derive(Debug, Clone)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sg_list: SmallVec<[Sge; 2]>,
}

impl RecvWr {
    pub fn new(wr_id: u64, sg: &[Sge]) -> RecvWr {
        RecvWr {
            wr_id,
            sg_list: SmallVec::from_slice(sg),
        }
    }
}

/// A work completion (`struct ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    /// Immediate data (`IBV_WC_WITH_IMM`).
    pub imm: Option<u32>,
    /// The local QP the completion belongs to.
    pub qp_num: u32,
    /// UD receives: the sender's QP number.
    pub src_qp: u32,
    /// UD receives: a 40-byte GRH precedes the payload in the buffer (`IBV_WC_GRH`).
    pub grh: bool,
}

impl Wc {
    /// A placeholder, for arrays that `poll_cq` fills.
    pub const EMPTY: Wc = Wc {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: 0,
        src_qp: 0,
        grh: false,
    };
}

/// Sizes of a QP's queues (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl Default for QpCap {
    /// MVAPICH2's defaults (`MV2_DEFAULT_MAX_SEND_WQE` 64, `..._RECV_WQE` 128), 4 SGEs each
    /// way, 256 bytes inline (libfabric verbs' `FI_VERBS_INLINE_SIZE`).
    fn default() -> QpCap {
        QpCap {
            max_send_wr: 64,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
        }
    }
}

/// `ibv_create_qp`'s attributes.
#[derive(Debug, Clone, Copy)]
pub struct QpInitAttr {
    pub qp_type: QpType,
    pub send_cq: Cq,
    pub recv_cq: Cq,
    pub srq: Option<Srq>,
    pub cap: QpCap,
    /// Every send work request completes with a completion, whatever its flags say.
    pub sq_sig_all: bool,
}

/// Where a peer is: its GID (and, on a real fabric, LID and port).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    pub dgid: Gid,
    pub dlid: u16,
    pub port_num: u8,
}

/// `ibv_modify_qp`'s attributes; the fields that are `Some` form the attribute mask.
#[derive(Debug, Clone, Copy, Default)]
pub struct QpAttr {
    pub qp_state: Option<QpState>,
    pub qp_access_flags: Option<Access>,
    pub pkey_index: Option<u16>,
    pub port_num: Option<u8>,
    pub qkey: Option<u32>,
    pub path_mtu: Option<Mtu>,
    pub ah_attr: Option<AhAttr>,
    pub dest_qp_num: Option<u32>,
    pub rq_psn: Option<u32>,
    pub sq_psn: Option<u32>,
    /// Responder side: reads/atomics it accepts at a time.
    pub max_dest_rd_atomic: Option<u8>,
    /// Requester side: reads/atomics it has outstanding at a time.
    pub max_rd_atomic: Option<u8>,
    /// RNR NAK timer code (0..=31; 12 = 0.64 ms).
    pub min_rnr_timer: Option<u8>,
    /// Local ACK timeout: 4.096 µs × 2^timeout (0 = infinite).
    pub timeout: Option<u8>,
    /// Transport retries (0..=7).
    pub retry_cnt: Option<u8>,
    /// RNR retries (0..=7; 7 = for ever).
    pub rnr_retry: Option<u8>,
}

/// A device's limits and abilities (`struct ibv_device_attr` plus the port's MTU).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceAttr {
    pub name: String,
    /// `soft` or the rdma-core driver name.
    pub kind: &'static str,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_mr_size: u64,
    pub max_pd: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_qp_rd_atom: u32,
    pub max_inline_data: u32,
    pub atomic_cap: AtomicCap,
    pub active_mtu: Mtu,
    /// Bytes of device memory (`ibv_alloc_dm`).
    pub max_dm_size: u64,
}

/// The RNR NAK timer codes in µs (IBA table 45; rxe's `rnrnak_usec`).
pub const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
    5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760,
    327_680, 491_520,
];

/// The local ACK timeout for `code`: 4.096 µs × 2^code, `None` for 0 (infinite).
pub fn ack_timeout(code: u8) -> Option<std::time::Duration> {
    (code != 0).then(|| std::time::Duration::from_nanos(4096u64 << code.min(31)))
}

/// Length of the global route header a UD receive finds in front of the payload.
pub const GRH_LEN: usize = 40;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_machine_matches_the_spec() {
        use QpState::*;
        assert!(Reset.can_go(Init) && Init.can_go(Rtr) && Rtr.can_go(Rts));
        assert!(!Reset.can_go(Rtr) && !Reset.can_go(Rts) && !Init.can_go(Rts));
        assert!(!Rts.can_go(Rtr) && !Err.can_go(Rts) && Err.can_go(Reset));
        for s in [Reset, Init, Rtr, Rts, Err] {
            assert!(s.can_go(Err) && s.can_go(Reset));
            assert_eq!(QpState::from_u32(s as u32), Some(s));
        }
    }

    #[test]
    fn codes_and_timers() {
        for v in 0..200 {
            if let Some(s) = WcStatus::from_u32(v) {
                assert_eq!(s as u32, v);
            }
            if let Some(o) = WcOpcode::from_u32(v) {
                assert_eq!(o as u32, v);
            }
        }
        assert_eq!(RNR_TIMER_US[12], 640);
        assert_eq!(ack_timeout(14).unwrap().as_micros(), 67_108);
        assert_eq!(ack_timeout(0), None);
        assert_eq!(Mtu::M2048.bytes(), 2048);
        assert_eq!(Mtu::from_bytes(4096), Some(Mtu::M4096));
    }
}

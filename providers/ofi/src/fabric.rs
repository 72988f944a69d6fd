//! The provider on libfabric: object set-up, active messages, tagged messaging, RMA, atomics and
//! counters. See the crate documentation for the mapping.
//!
//! Every libfabric call is `unsafe` FFI through the objects' operation tables; the objects are
//! opened in `open`, used only through `&mut self`, and closed in `Drop` in reverse order.
//! Operation contexts are indexes into `ops` (plus one, so that a null context means "no
//! operation"), never pointers, so a stale or foreign completion cannot reach freed memory.

use crate::tag::Layout;
use crate::{AM_BUF, AM_RX, DOMAIN, NATIVE, PROVIDER, RNDV};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::ffi::{c_void, CString};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};
use weft_ofi_sys::ops::*;
use weft_ofi_sys::*;
use weft_provider::bootstrap::Bootstrap;
use weft_provider::provider::{
    Access, AtomicOp, Caps, CntrId, CntrValue, Completed, Completion, CompletionLevel, MemRegion,
    PeerCaps, ProbeContext, Provider, RawIov, RawIovMut, RemoteAddr, RmaCaps, SendOutcome, Sink,
    StaticProvider, TaggedStatus, Token,
};
use weft_provider::types::{AtomicTable, BasicType, Op as WOp};
use weft_provider::{Error, ErrorDetail, Rank, Result};

use crate::wire::{self, K_AM, K_CTS, K_SYNC_ACK, MAX_HDR, PREFIX};
use weft_proto::order::{Arrival, Bounds, Holding, OrderError, Reorder, Sequencer};

/// What a peer can make this process hold of its active messages that overtook others: a
/// sender has at most its send buffers' worth in flight (4096 at most, `WEFT_OFI_AM_RX`) and
/// injected ones besides, so 2^16 ahead, 2^13 messages or 64 MiB of one peer, and 256 MiB in
/// all are past anything a well-behaved peer sends; a peer past them is failed.
const HOLD: Bounds = Bounds {
    window: 1 << 16,
    per_peer: 1 << 13,
    per_peer_bytes: 64 << 20,
    total_bytes: 256 << 20,
};
/// No bounce buffer.
const NO_BOUNCE: u32 = u32::MAX;
/// Bounce buffers allocated (and registered) at a time.
const BOUNCE_CHUNK: usize = 16;
/// Bits of a large message's length in its announcement's CQ data (the operation above them).
const LEN_BITS: u32 = 40;
/// Remote CQ data of a large message's announcement: this bit, the sender's operation (23
/// bits), the length (40 bits).
const D_ANNOUNCE: u64 = 1 << 63;
/// Remote CQ data of a synchronous send: this bit and the sender's operation.
const D_SYNC: u64 = 1 << 62;
/// Operations a large send's announcement can name.
const ANNOUNCE_OPS: usize = 1 << (63 - LEN_BITS);
/// How long probe and cancel poll for their own answer before leaving it to `progress`.
const SYNC_POLL: Duration = Duration::from_millis(50);
/// Keys of registrations without a caller's key (window ids are 32-bit, so no clash).
const FIRST_KEY: u64 = 1 << 32;
/// The handle of a write-rendezvous registration: this bit and its operation (a `fid_mr`
/// pointer, the handle of a native registration, never has it).
const W_HANDLE: u64 = 1 << 63;
/// How long taking back a write-rendezvous receive may wait for libfabric before the process
/// ends (the buffer cannot be given back while libfabric may still write into it).
const WRECV_WAIT: Duration = Duration::from_secs(10);

fn fi_err(what: &str, rc: isize) -> Error {
    Error::from(ErrorDetail::Provider {
        provider: "ofi".into(),
        what: format!("{what}: {} ({rc})", strerror(rc as i64)),
    })
}

fn check(what: &str, rc: isize) -> Result<()> {
    if rc < 0 {
        Err(fi_err(what, rc))
    } else {
        Ok(())
    }
}

const EAGAIN: isize = -(FI_EAGAIN as isize);

// ---- choosing the libfabric provider --------------------------------------------------------

/// What `fi_getinfo` chose, and the capabilities weft takes from it.
struct Chosen {
    info: *mut fi_info,
    caps: u64,
    delivery: bool,
}

/// The capability sets tried in order: each step drops one capability the core can replace.
const LADDER: [u64; 4] = [
    FI_TAGGED | FI_MSG | FI_RMA | FI_ATOMIC,
    FI_TAGGED | FI_MSG | FI_RMA,
    FI_TAGGED | FI_MSG,
    FI_MSG,
];

/// Ask `fi_getinfo` for an RDM endpoint, down the capability ladder; with RMA, first with
/// delivery-complete writes.
fn choose(prov: &str, dom: &str) -> Result<Chosen> {
    let lib = fabric().map_err(|e| Error::from(ErrorDetail::Unsupported(e)))?;
    let mut tried = Vec::new();
    for caps in LADDER {
        for delivery in [true, false] {
            if delivery && caps & FI_RMA == 0 {
                continue;
            }
            // SAFETY: fi_dupinfo(NULL) allocates a zeroed fi_info with its attribute structs;
            // the strings stored in it are malloc'd (strdup) because fi_freeinfo frees them.
            let hints = unsafe { (lib.fi_dupinfo)(null()) };
            if hints.is_null() {
                return Err(fi_err("fi_allocinfo", -(FI_ENOMEM as isize)));
            }
            // SAFETY: `hints` and its attribute pointers were just allocated by libfabric.
            let rc = unsafe {
                let h = &mut *hints;
                h.caps = caps;
                h.mode = 0;
                (*h.ep_attr).type_ = FI_EP_RDM;
                (*h.domain_attr).mr_mode =
                    (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY) as i32;
                (*h.domain_attr).threading = FI_THREAD_DOMAIN;
                if delivery {
                    (*h.tx_attr).op_flags = FI_DELIVERY_COMPLETE;
                }
                if !prov.is_empty() {
                    let c = CString::new(prov)
                        .map_err(|_| Error::invalid("NUL in WEFT_OFI_PROVIDER"))?;
                    (*h.fabric_attr).prov_name = libc::strdup(c.as_ptr());
                }
                if !dom.is_empty() {
                    let c =
                        CString::new(dom).map_err(|_| Error::invalid("NUL in WEFT_OFI_DOMAIN"))?;
                    (*h.domain_attr).name = libc::strdup(c.as_ptr());
                }
                let mut info = null_mut();
                let rc = (lib.fi_getinfo)(
                    fi_version(FI_MAJOR_VERSION as u32, FI_MINOR_VERSION as u32),
                    null(),
                    null(),
                    0,
                    hints,
                    &mut info,
                );
                (lib.fi_freeinfo)(hints);
                if rc == 0 && !info.is_null() {
                    // Keep the first answer only.
                    let first = (lib.fi_dupinfo)(info);
                    (lib.fi_freeinfo)(info);
                    if !first.is_null() {
                        return Ok(Chosen {
                            info: first,
                            caps,
                            delivery,
                        });
                    }
                }
                rc
            };
            tried.push(format!("{} {}", caps_name(caps), strerror(rc as i64)));
        }
    }
    Err(Error::from(ErrorDetail::Unsupported(format!(
        "ofi: fi_getinfo offers no FI_EP_RDM endpoint{}{} ({})",
        if prov.is_empty() {
            String::new()
        } else {
            format!(" of provider '{prov}'")
        },
        if dom.is_empty() {
            String::new()
        } else {
            format!(" in domain '{dom}'")
        },
        tried.join("; ")
    ))))
}

/// `WEFT_OFI_NATIVE`: whether the core hands tagged messages, RMA and atomics to libfabric, or
/// only active messages. Not on shm before 1.19 (unless asked): across processes its shared
/// receive context matches a message that arrived before its receive against the message's own
/// ignore mask instead of the receive's (a receive with a wildcard tag never matches it;
/// libfabric 1.17 `util_srx`), and its RMA operations never complete in the conformance suite.
fn native_ops(prov: &str) -> bool {
    match NATIVE.raw().trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "yes" | "true" => true,
        "0" | "off" | "no" | "false" => false,
        _ => {
            let version = fabric().map_or(0, |f| {
                // SAFETY: fi_version takes no arguments and returns the library's version.
                unsafe { (f.fi_version)() }
            });
            !(prov.split(';').next() == Some("shm") && version < fi_version(1, 19))
        }
    }
}

/// `WEFT_OFI_RNDV`: a size, or `auto`: 16 KiB, but the inject size on libfabric 1.17's shm,
/// whose larger messages hang when they arrive before their receive (libfabric issue 9143,
/// fixed in 1.19).
fn rndv_for(ch: &Chosen) -> Result<usize> {
    let v = RNDV.raw();
    if v.trim().eq_ignore_ascii_case("auto") {
        // SAFETY: a live fi_info from fi_getinfo.
        let (name, inject) = unsafe {
            let i = &*ch.info;
            (cstr((*i.fabric_attr).prov_name), (*i.tx_attr).inject_size)
        };
        let shm = name.split(';').next() == Some("shm");
        return Ok(if shm {
            inject.clamp(64, 16 << 10)
        } else {
            16 << 10
        });
    }
    // The range is in the parameter's check.
    RNDV.get_size()
}

fn caps_name(c: u64) -> String {
    let mut v = Vec::new();
    for (b, n) in [
        (FI_TAGGED, "tagged"),
        (FI_MSG, "msg"),
        (FI_RMA, "rma"),
        (FI_ATOMIC, "atomic"),
    ] {
        if c & b != 0 {
            v.push(n);
        }
    }
    v.join("+")
}

fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric's attribute strings are NUL-terminated and live as long as the info.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// weft's (operation, type) in libfabric's terms.
fn fi_types(op: WOp, ty: BasicType) -> (fi_op, fi_datatype) {
    let o = match op {
        WOp::Sum => FI_SUM,
        WOp::Prod => FI_PROD,
        WOp::Min => FI_MIN,
        WOp::Max => FI_MAX,
        WOp::Band => FI_BAND,
        WOp::Bor => FI_BOR,
        WOp::Bxor => FI_BXOR,
        WOp::Land => FI_LAND,
        WOp::Lor => FI_LOR,
        WOp::Lxor => FI_LXOR,
        WOp::Replace => FI_ATOMIC_WRITE,
        WOp::NoOp => FI_ATOMIC_READ,
        WOp::Cswap => FI_CSWAP,
    };
    let t = match ty {
        BasicType::I8 => FI_INT8,
        BasicType::U8 => FI_UINT8,
        BasicType::I16 => FI_INT16,
        BasicType::U16 => FI_UINT16,
        BasicType::I32 => FI_INT32,
        BasicType::U32 => FI_UINT32,
        BasicType::I64 => FI_INT64,
        BasicType::U64 => FI_UINT64,
        BasicType::F32 => FI_FLOAT,
        BasicType::F64 => FI_DOUBLE,
    };
    (o, t)
}

/// Capabilities of a chosen endpoint; `dom` (an open domain) answers `fi_query_atomic`.
/// `native`: `WEFT_OFI_NATIVE`'s answer unless given.
fn caps_of(ch: &Chosen, dom: Option<*mut fid_domain>, native: Option<bool>) -> Caps {
    // SAFETY: `ch.info` is a live fi_info from fi_getinfo with its attribute structs.
    let (tx, rx, d) = unsafe {
        let i = &*ch.info;
        (&*i.tx_attr, &*i.rx_attr, &*i.domain_attr)
    };
    let am_buf = AM_BUF.get_size().unwrap_or(16 << 10);
    let iov = tx.iov_limit.min(rx.iov_limit).clamp(1, 64);
    let mut c = Caps::am_only(MAX_HDR, am_buf - PREFIX - MAX_HDR, iov);
    // SAFETY: as above.
    let name = unsafe { cstr((*(*ch.info).fabric_attr).prov_name) };
    let native = native.unwrap_or_else(|| native_ops(&name));
    c.tagged = ch.caps & FI_TAGGED != 0 && native;
    // shm reaches the processes of one host; the others go through a network.
    c.spans_hosts = name.split(';').next() != Some("shm");
    let mr_mode = d.mr_mode as u64;
    c.mr_local = mr_mode & FI_MR_LOCAL != 0;
    // A fabric that needs local registration pins pages (verbs); the cache then checks frames.
    c.mr_pins = c.mr_local;
    c.inject_size = tx.inject_size;
    if ch.caps & FI_RMA != 0 && native {
        c.rma = Some(RmaCaps {
            read: true,
            write: true,
            max_iov: tx.iov_limit.clamp(1, 64),
            scalable_keys: mr_mode & FI_MR_PROV_KEY == 0,
            alloc: false,
            native_locks: false,
            user_memory: true,
            completion: if ch.delivery {
                CompletionLevel::Delivery
            } else {
                CompletionLevel::Transmit
            },
            fence: ch.caps & FI_FENCE != 0,
            cq_data_size: 0,
            rndv_only: false,
        });
        c.counters = d.cntr_cnt > 0;
    }
    if ch.caps & FI_TAGGED != 0 && !native && !c.mr_local {
        // Active messages only, but the core's write rendezvous still moves large messages
        // without copies: a "registration" posts the receive buffer as a tagged receive in the
        // provider's data context, the "write" is a tagged send to it (see `wrecv_open`).
        c.rma = Some(RmaCaps {
            write: true,
            max_iov: iov,
            user_memory: true,
            completion: CompletionLevel::Delivery,
            rndv_only: true,
            ..RmaCaps::default()
        });
        c.per_peer = true;
    }
    if ch.caps & FI_ATOMIC != 0 && native {
        if let Some(dom) = dom {
            let (t, max) = atomic_table(dom);
            c.atomics = t;
            c.atomic_max_count = max;
        }
    }
    c
}

/// The pairs every form of which (plain, fetching; compare for CSWAP, fetch for NO_OP) the
/// domain performs, and the fewest elements any of them allows per call.
fn atomic_table(dom: *mut fid_domain) -> (AtomicTable, usize) {
    let mut t = AtomicTable::NONE;
    let mut max = usize::MAX;
    for op in WOp::ALL {
        for ty in BasicType::ALL {
            if !op.valid_for(ty) {
                continue;
            }
            let (o, d) = fi_types(op, ty);
            let forms: &[u64] = match op {
                WOp::Cswap => &[FI_COMPARE_ATOMIC],
                WOp::NoOp => &[FI_FETCH_ATOMIC],
                _ => &[0, FI_FETCH_ATOMIC],
            };
            let mut ok = true;
            for f in forms {
                let mut attr = fi_atomic_attr::default();
                // SAFETY: `dom` is an open domain; `attr` is ours to fill.
                let rc = unsafe { fi_query_atomic(dom, d, o, &mut attr, *f) };
                if rc != 0 || attr.count == 0 {
                    ok = false;
                    break;
                }
                max = max.min(attr.count);
            }
            t.set(op, ty, ok);
        }
    }
    (t, if t.is_empty() { 0 } else { max })
}

// ---- the provider ---------------------------------------------------------------------------

/// An outstanding libfabric operation; its context is its index in `ops` plus one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Free,
    /// Receive buffer `i` is posted.
    AmRx(u32),
    /// Send buffer `i` is being sent to the rank.
    AmTx(u32, Rank),
    /// A tagged send; `ack`: a synchronous send still waiting for the receiver's match,
    /// `sent`: the local completion came.
    Send {
        token: Token,
        dest: Rank,
        ack: bool,
        sent: bool,
    },
    /// A tagged receive into `cap` bytes, posted into bounce buffer `bounce` (or [`NO_BOUNCE`]).
    Recv {
        token: Token,
        cap: usize,
        bounce: u32,
    },
    /// A probe; `Some` once answered.
    Peek(Option<Option<TaggedStatus>>),
    /// A probe that gave up waiting: its answer is dropped.
    Orphan,
    /// A receive being cancelled; `Cancelled` once libfabric confirmed it.
    Cancelling(Token, usize, u32),
    Cancelled(u32),
    /// An RMA or atomic operation that reports through the CQ.
    Rma {
        token: Token,
        peer: Rank,
    },
    /// A large send (its iovec in `iovs`): `owed` completions still to come from libfabric
    /// (the announcement's, the data's once posted), `failed` once one failed.
    LSend {
        token: Token,
        dest: Rank,
        owed: u8,
        data: bool,
        failed: bool,
    },
    /// The data receive of a large message of `len` bytes.
    LRecv {
        token: Token,
        source: Rank,
        tag: i32,
        len: usize,
    },
    /// A receive buffer registered for the write rendezvous, posted as a tagged receive;
    /// `done`: its completion came (libfabric's error number, 0 for success).
    WRecv {
        done: Option<i32>,
    },
    /// A write-rendezvous write: a tagged send to a [`Op::WRecv`]'s key.
    WSend {
        token: Token,
        dest: Rank,
    },
}

/// A completion, read from the CQ (successful or not).
#[derive(Debug, Clone, Copy)]
struct Ev {
    ctx: usize,
    flags: u64,
    len: usize,
    data: u64,
    tag: u64,
    /// 0, or libfabric's (positive) error number.
    err: i32,
    olen: usize,
    prov_errno: i32,
}

/// A window's counter and the endpoint it counts (paper 003: one per window).
struct WinCntr {
    cntr: *mut fid_cntr,
    ep: *mut fid_ep,
}

/// Memory registered once for the provider's own buffers (`FI_MR_LOCAL` fabrics).
struct OwnMr {
    mr: *mut fid_mr,
    desc: *mut c_void,
}

/// A tagged post that found the endpoint's queue full, kept for the next progress.
struct Deferred {
    recv: bool,
    iov: SmallVec<[(usize, usize, u64); 4]>,
    peer: fi_addr_t,
    tag: u64,
    ignore: u64,
    data: u64,
    flags: u64,
    op: usize,
}

/// Idle progress calls between two looks at the local peers' processes.
const WATCH_EVERY: u32 = 1024;

/// Handled active-message buffers kept aside before they are posted again within one progress
/// call; at most half of the smallest pool `WEFT_OFI_AM_RX` allows (8).
const REPOST_BATCH: usize = 4;

/// The `ofi` provider.
pub struct Ofi {
    rank: Rank,
    size: u32,
    caps: Caps,
    layout: Layout,
    lib: &'static Fabric,
    info: *mut fi_info,
    fab: *mut fid_fabric,
    dom: *mut fid_domain,
    ep: *mut fid_ep,
    cq: *mut fid_cq,
    av: *mut fid_av,
    addrs: Vec<fi_addr_t>,
    /// "tcp;ofi_rxm on eth0".
    what: String,
    delivery: bool,
    virt_addr: bool,
    prov_key: bool,
    next_key: u64,
    ops: Vec<Op>,
    free_ops: Vec<usize>,
    /// The iovecs of receives and large sends, by operation.
    iovs: Vec<SmallVec<[(usize, usize, u64); 4]>>,
    rndv: usize,
    next_data_id: u32,
    /// Answers to large messages' announcements, waiting to be sent: (to, their operation,
    /// data id, bytes).
    cts: VecDeque<(Rank, u64, u32, u64)>,
    /// Bounce buffers of `rndv` bytes, in chunks (each with its descriptor), and the free ones.
    bounce: Vec<(Vec<u8>, *mut c_void)>,
    bounce_free: Vec<u32>,
    // Active messages.
    slot: usize,
    rx_mem: Vec<u8>,
    /// Receive buffers whose message was handled, to be posted again at the start of the next
    /// progress call (or at once when `REPOST_BATCH` wait): posting one costs a call into
    /// libfabric that a ping-pong would otherwise pay between an arrival and its answer.
    rx_idle: Vec<u32>,
    tx_mem: Vec<u8>,
    tx_free: Vec<u32>,
    own_mr: Vec<OwnMr>,
    rx_desc: *mut c_void,
    tx_desc: *mut c_void,
    /// Per-peer order of active messages: libfabric does not promise that completions of one
    /// sender come in send order, so each carries a sequence number and one that overtook
    /// others waits in `holding` (within [`HOLD`]).
    seq_out: Vec<Sequencer>,
    seq_in: Vec<Reorder>,
    holding: Holding<Vec<u8>>,
    /// Peers failed for what they sent (their messages are dropped from then on).
    refused: std::collections::HashSet<Rank>,
    selfq: VecDeque<Vec<u8>>,
    acks: VecDeque<(Rank, u64)>,
    // Completions read early (by probe or cancel), and completions of injected sends.
    early: VecDeque<Ev>,
    done: VecDeque<(Token, Result<Completed>)>,
    deferred: VecDeque<Deferred>,
    cntrs: Vec<Option<WinCntr>>,
    /// Counters and endpoints of closed windows, reset and kept for the next window (closing an
    /// endpoint while the fabric still holds connections of it is not safe on every provider).
    spare_cntrs: Vec<WinCntr>,
    scratch: Vec<u8>,
    n_inject: u64,
    n_am_copy: u64,
    n_tsend: u64,
    n_tinject: u64,
    n_trecv: u64,
    n_read: u64,
    n_write: u64,
    n_atomic: u64,
    n_ack: u64,
    /// Registrations are write-rendezvous receives (active-message mode with tagged messaging).
    wrndv: bool,
    n_wrndv: u64,
    /// The processes of the other ranks on this host, and those found dead: libfabric says
    /// nothing when a peer process dies (shm), or only on an operation towards it (tcp), so a
    /// receive from a dead rank would wait for ever.
    watch: weft_provider::shmem::Watch,
    dead: Vec<bool>,
    ticks: u32,
}

impl Ofi {
    /// Open on libfabric provider `prov` in domain `dom` (empty: the first `fi_getinfo` offers);
    /// `open` takes both from `WEFT_OFI_PROVIDER` and `WEFT_OFI_DOMAIN`. Collective.
    pub fn open_on(boot: &mut dyn Bootstrap, prov: &str, dom: &str) -> Result<Self> {
        Self::open_with(boot, prov, dom, None)
    }

    /// As [`Ofi::open_on`], with `native` in place of `WEFT_OFI_NATIVE` when given.
    pub fn open_with(
        boot: &mut dyn Bootstrap,
        prov: &str,
        dom: &str,
        native: Option<bool>,
    ) -> Result<Self> {
        let lib = fabric().map_err(|e| Error::from(ErrorDetail::Unsupported(e)))?;
        let ch = choose(prov, dom)?;
        let mut me = Ofi {
            rank: boot.rank(),
            size: boot.size(),
            caps: Caps::am_only(MAX_HDR, 1, 1),
            layout: Layout::for_job(boot.size()),
            lib,
            info: ch.info,
            fab: null_mut(),
            dom: null_mut(),
            ep: null_mut(),
            cq: null_mut(),
            av: null_mut(),
            addrs: Vec::new(),
            what: String::new(),
            delivery: ch.delivery,
            virt_addr: false,
            prov_key: false,
            next_key: FIRST_KEY,
            ops: Vec::new(),
            free_ops: Vec::new(),
            iovs: Vec::new(),
            rndv: rndv_for(&ch)?,
            next_data_id: 0,
            cts: VecDeque::new(),
            bounce: Vec::new(),
            bounce_free: Vec::new(),
            slot: 0,
            rx_mem: Vec::new(),
            rx_idle: Vec::new(),
            tx_mem: Vec::new(),
            tx_free: Vec::new(),
            own_mr: Vec::new(),
            rx_desc: null_mut(),
            tx_desc: null_mut(),
            seq_out: vec![Sequencer::default(); boot.size() as usize],
            seq_in: vec![Reorder::default(); boot.size() as usize],
            watch: weft_provider::shmem::Watch::of_pids(std::iter::empty()),
            dead: vec![false; boot.size() as usize],
            ticks: 0,
            holding: Holding::new(HOLD),
            refused: Default::default(),
            selfq: VecDeque::new(),
            acks: VecDeque::new(),
            early: VecDeque::new(),
            done: VecDeque::new(),
            deferred: VecDeque::new(),
            cntrs: Vec::new(),
            spare_cntrs: Vec::new(),
            scratch: Vec::new(),
            n_inject: 0,
            n_am_copy: 0,
            n_tsend: 0,
            n_tinject: 0,
            n_trecv: 0,
            n_read: 0,
            n_write: 0,
            n_atomic: 0,
            n_ack: 0,
            wrndv: false,
            n_wrndv: 0,
        };
        // From here on `Drop` closes whatever was opened.
        // SAFETY: `info` is live; each object is opened on its live parent and stored at once.
        unsafe {
            let i = &*me.info;
            me.what = format!(
                "{} on {}",
                cstr((*i.fabric_attr).prov_name),
                cstr((*i.domain_attr).name)
            );
            let mr_mode = (*i.domain_attr).mr_mode as u64;
            me.virt_addr = mr_mode & FI_MR_VIRT_ADDR != 0;
            me.prov_key = mr_mode & FI_MR_PROV_KEY != 0;
            check(
                "fi_fabric",
                (lib.fi_fabric)(i.fabric_attr, &mut me.fab, null_mut()) as isize,
            )?;
            check(
                "fi_domain",
                fi_domain(me.fab, me.info, &mut me.dom, null_mut()),
            )?;
            let mut cq_attr = fi_cq_attr {
                size: 0,
                format: FI_CQ_FORMAT_TAGGED,
                wait_obj: FI_WAIT_NONE,
                ..Default::default()
            };
            check(
                "fi_cq_open",
                fi_cq_open(me.dom, &mut cq_attr, &mut me.cq, null_mut()),
            )?;
            let mut av_attr = fi_av_attr {
                type_: FI_AV_TABLE,
                count: me.size as usize,
                ..Default::default()
            };
            check(
                "fi_av_open",
                fi_av_open(me.dom, &mut av_attr, &mut me.av, null_mut()),
            )?;
            me.ep = me.endpoint(None)?;
        }
        me.caps = caps_of(&ch, Some(me.dom), native);
        me.wrndv = me.caps.rma.is_some_and(|r| r.rndv_only);
        // Addresses: one allgather through the bootstrap, into the address vector.
        let mut name = vec![0u8; 256];
        let mut len = name.len();
        // SAFETY: `name` has `len` writable bytes; fi_getname writes at most that and sets len.
        let mut rc = unsafe { fi_getname(&mut (*me.ep).fid, name.as_mut_ptr().cast(), &mut len) };
        if rc == -(FI_ETOOSMALL as isize) {
            name.resize(len, 0);
            // SAFETY: as above, with the length libfabric asked for.
            rc = unsafe { fi_getname(&mut (*me.ep).fid, name.as_mut_ptr().cast(), &mut len) };
        }
        check("fi_getname", rc)?;
        name.truncate(len);
        let hex: String = name.iter().map(|b| format!("{b:02x}")).collect();
        let all = weft_provider::bootstrap::allgather(boot, "ofi.addr", &hex)?;
        me.addrs = vec![FI_ADDR_UNSPEC; me.size as usize];
        for (r, a) in all.iter().enumerate() {
            let bytes = decode_hex(a).filter(|b| b.len() == len).ok_or_else(|| {
                Error::from(ErrorDetail::Bootstrap(format!(
                    "rank {r} published a bad libfabric address '{a}' (another libfabric provider?)"
                )))
            })?;
            // One at a time: string addresses (shm's) are read up to their NUL, so a packed
            // array of fixed-size names would be misread.
            // SAFETY: `bytes` is one address of the endpoint's format; `addrs[r]` takes the
            // result.
            let n = unsafe {
                fi_av_insert(
                    me.av,
                    bytes.as_ptr().cast(),
                    1,
                    &mut me.addrs[r],
                    0,
                    null_mut(),
                )
            };
            if n != 1 {
                return Err(fi_err("fi_av_insert", n.min(-1)));
            }
        }
        // The processes of the other ranks on this host, watched from here on (ranks that are
        // threads of this process have none of their own).
        let pid = std::process::id().to_string();
        let pids = weft_provider::bootstrap::allgather(boot, "ofi.pid", &pid)?;
        let local = |r: usize| {
            r != me.rank as usize && !boot.in_process() && boot.nodes().is_local(r as Rank)
        };
        me.watch = weft_provider::shmem::Watch::of_pids(pids.iter().enumerate().map(|(r, p)| {
            if local(r) {
                p.parse().unwrap_or(0)
            } else {
                0
            }
        }));
        me.post_am_buffers()?;
        Ok(me)
    }

    /// Open an endpoint bound to the CQ and the AV (and, for a window, to its counter, with CQ
    /// entries only for operations that ask), and enable it.
    fn endpoint(&mut self, cntr: Option<*mut fid_cntr>) -> Result<*mut fid_ep> {
        let mut ep = null_mut();
        // SAFETY: domain, CQ, AV and counter are open; the endpoint is closed on any error.
        unsafe {
            check(
                "fi_endpoint",
                fi_endpoint(self.dom, self.info, &mut ep, null_mut()),
            )?;
            let flags = match cntr {
                Some(_) => FI_TRANSMIT | FI_RECV | FI_SELECTIVE_COMPLETION,
                None => FI_TRANSMIT | FI_RECV,
            };
            let mut rc = fi_ep_bind(ep, &mut (*self.cq).fid, flags);
            if rc == 0 {
                rc = fi_ep_bind(ep, &mut (*self.av).fid, 0);
            }
            if let (0, Some(c)) = (rc, cntr) {
                rc = fi_ep_bind(ep, &mut (*c).fid, FI_READ | FI_WRITE);
            }
            if rc == 0 {
                rc = fi_enable(ep);
            }
            if rc != 0 {
                fi_close(&mut (*ep).fid);
                return Err(fi_err("binding and enabling an endpoint", rc));
            }
        }
        Ok(ep)
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The context of operation `i`.
fn ctx(i: usize) -> *mut c_void {
    (i + 1) as *mut c_void
}

impl Ofi {
    fn new_op(&mut self, op: Op) -> usize {
        match self.free_ops.pop() {
            Some(i) => {
                self.ops[i] = op;
                i
            }
            None => {
                self.ops.push(op);
                self.iovs.push(SmallVec::new());
                self.ops.len() - 1
            }
        }
    }

    fn free_op(&mut self, i: usize) {
        self.ops[i] = Op::Free;
        self.free_ops.push(i);
    }

    /// Register memory once for the provider's own buffers, where the fabric asks for local
    /// descriptors.
    fn own_registration(&mut self, base: *const u8, len: usize) -> Result<*mut c_void> {
        if !self.caps.mr_local {
            return Ok(null_mut());
        }
        let mut mr = null_mut();
        // SAFETY: `base..base+len` is a buffer owned by `self` that outlives the registration
        // (closed in Drop before the buffers are freed).
        let rc = unsafe {
            fi_mr_reg(
                self.dom,
                base.cast(),
                len,
                FI_SEND | FI_RECV,
                0,
                self.take_key(),
                0,
                &mut mr,
                null_mut(),
            )
        };
        check("registering the active-message buffers", rc)?;
        // SAFETY: a registration just opened.
        let desc = unsafe { (*mr).mem_desc };
        self.own_mr.push(OwnMr { mr, desc });
        Ok(desc)
    }

    fn take_key(&mut self) -> u64 {
        if self.prov_key {
            return 0;
        }
        self.next_key += 1;
        self.next_key
    }

    fn post_am_buffers(&mut self) -> Result<()> {
        self.slot = PREFIX + MAX_HDR + self.caps.max_am_payload;
        let n = AM_RX.get_u64()? as usize;
        self.rx_mem = vec![0; n * self.slot];
        self.tx_mem = vec![0; n * self.slot];
        self.tx_free = (0..n as u32).rev().collect();
        self.rx_desc = self.own_registration(self.rx_mem.as_ptr(), self.rx_mem.len())?;
        self.tx_desc = self.own_registration(self.tx_mem.as_ptr(), self.tx_mem.len())?;
        for i in 0..n as u32 {
            self.post_rx(i)?;
        }
        Ok(())
    }

    /// Post the receive buffers `handle` set aside.
    fn repost(&mut self) -> Result<()> {
        while let Some(b) = self.rx_idle.pop() {
            self.post_rx(b)?;
        }
        Ok(())
    }

    fn post_rx(&mut self, i: u32) -> Result<()> {
        let op = self.new_op(Op::AmRx(i));
        let base = i as usize * self.slot;
        loop {
            // SAFETY: buffer `i` is `slot` bytes inside `rx_mem`, which is never resized and
            // outlives the endpoint; it is not read again until its completion.
            let rc = unsafe {
                fi_recv(
                    self.ep,
                    self.rx_mem.as_mut_ptr().add(base).cast(),
                    self.slot,
                    self.rx_desc,
                    FI_ADDR_UNSPEC,
                    ctx(op),
                )
            };
            if rc == EAGAIN {
                self.drive()?;
                continue;
            }
            if rc != 0 {
                self.free_op(op);
            }
            return check("posting an active-message buffer", rc);
        }
    }

    /// Read whatever the CQ holds (this is what makes a manual-progress provider progress).
    /// Without a sink: answers to probes and cancels are taken at once, the rest kept in
    /// `early` for `progress`.
    fn drive(&mut self) -> Result<usize> {
        let mut n = 0;
        loop {
            let mut evs = SmallVec::new();
            self.read_batch(&mut evs)?;
            if evs.is_empty() {
                return Ok(n);
            }
            n += evs.len();
            for ev in evs {
                if !self.absorb(&ev) {
                    self.early.push_back(ev);
                }
            }
        }
    }

    /// The completions the CQ holds, up to 16 (one call: each read drives a manual-progress
    /// provider, a poll of its sockets on tcp), or one error entry.
    fn read_batch(&mut self, out: &mut SmallVec<[Ev; 16]>) -> Result<()> {
        // Not zeroed: this runs on every poll, and 768 bytes of memset were a visible share of
        // an idle poll.
        let mut e = MaybeUninit::<[fi_cq_tagged_entry; 16]>::uninit();
        // SAFETY: room for 16 tagged entries (the CQ's format); libfabric writes at most that.
        let rc = unsafe { fi_cq_read(self.cq, e.as_mut_ptr().cast(), 16) };
        if rc > 0 {
            let n = (rc as usize).min(16);
            // SAFETY: fi_cq_read returned `rc` entries, all written, at the start of `e`.
            let e =
                unsafe { std::slice::from_raw_parts(e.as_ptr().cast::<fi_cq_tagged_entry>(), n) };
            out.extend(e.iter().map(|e| Ev {
                ctx: e.op_context as usize,
                flags: e.flags,
                len: e.len,
                data: e.data,
                tag: e.tag,
                err: 0,
                olen: 0,
                prov_errno: 0,
            }));
            return Ok(());
        }
        if let Some(ev) = self.read_error(rc)? {
            out.push(ev);
        }
        Ok(())
    }

    /// After a read that returned `rc` (no entries): the error entry, if one is waiting.
    fn read_error(&mut self, rc: isize) -> Result<Option<Ev>> {
        if rc == EAGAIN || rc == 0 {
            return Ok(None);
        }
        if rc == -(FI_EAVAIL as isize) {
            let mut x = fi_cq_err_entry::default();
            // SAFETY: `x` is ours; libfabric fills it (err_data stays libfabric's; unused).
            let rc = unsafe { fi_cq_readerr(self.cq, &mut x, 0) };
            if rc == 1 {
                return Ok(Some(Ev {
                    ctx: x.op_context as usize,
                    flags: x.flags,
                    len: x.len,
                    data: x.data,
                    tag: x.tag,
                    // Positive by the documentation; some providers store it negated.
                    err: match x.err.unsigned_abs() {
                        0 => x.prov_errno.unsigned_abs().max(1) as i32,
                        e => e as i32,
                    },
                    olen: x.olen,
                    prov_errno: x.prov_errno,
                }));
            }
            return Ok(None);
        }
        Err(fi_err("fi_cq_read", rc))
    }

    /// Take a completion that needs no sink: a probe's answer, a cancelled receive.
    fn absorb(&mut self, ev: &Ev) -> bool {
        let Some(i) = ev.ctx.checked_sub(1).filter(|i| *i < self.ops.len()) else {
            return false;
        };
        match self.ops[i] {
            Op::Peek(None) => {
                // A message was found: a success, or a truncation into the peek's empty buffer
                // (which some providers report); anything else (FI_ENOMSG) means none.
                let found = ev.err == 0 || ev.err == FI_ETRUNC as i32;
                let ans = found.then(|| {
                    let (source, tag) = self.layout.unpack(ev.tag);
                    // Some providers (tcp;ofi_rxm) leave FI_REMOTE_CQ_DATA out of a peek's
                    // flags but pass the data: a 1-byte message whose data says "announce".
                    let announce = is_announce(ev)
                        || (ev.len == 1 && ev.data & D_ANNOUNCE != 0 && ev.data & D_SYNC == 0);
                    let bytes = if announce {
                        (ev.data & ((1 << LEN_BITS) - 1)) as usize
                    } else {
                        ev.len + ev.olen
                    };
                    TaggedStatus { source, tag, bytes }
                });
                self.ops[i] = Op::Peek(Some(ans));
                true
            }
            Op::Orphan => {
                self.free_op(i);
                true
            }
            Op::Cancelling(_, _, b) if ev.err == FI_ECANCELED as i32 => {
                self.ops[i] = Op::Cancelled(b);
                true
            }
            Op::WRecv { done: None } => {
                self.ops[i] = Op::WRecv { done: Some(ev.err) };
                true
            }
            _ => false,
        }
    }

    /// Post (or queue behind earlier ones) a tagged send or receive.
    fn post(&mut self, d: Deferred) -> Result<()> {
        if !self.deferred.is_empty() {
            self.deferred.push_back(d);
            return Ok(());
        }
        let mut rc = self.try_post(&d);
        if rc == EAGAIN {
            self.drive()?;
            rc = self.try_post(&d);
        }
        if rc == EAGAIN {
            self.deferred.push_back(d);
            return Ok(());
        }
        if rc != 0 {
            self.free_op(d.op);
            return Err(fi_err(
                if d.recv { "fi_trecvmsg" } else { "fi_tsendmsg" },
                rc,
            ));
        }
        Ok(())
    }

    fn try_post(&mut self, d: &Deferred) -> isize {
        let iov: SmallVec<[iovec; 4]> = d
            .iov
            .iter()
            .map(|&(p, l, _)| iovec {
                iov_base: p as *mut c_void,
                iov_len: l,
            })
            .collect();
        let mut desc: SmallVec<[*mut c_void; 4]> =
            d.iov.iter().map(|&(_, _, x)| x as *mut c_void).collect();
        let msg = fi_msg_tagged {
            msg_iov: iov.as_ptr(),
            desc: desc.as_mut_ptr(),
            iov_count: iov.len(),
            addr: d.peer,
            tag: d.tag,
            ignore: d.ignore,
            context: ctx(d.op),
            data: d.data,
        };
        // SAFETY: the iovecs point at memory the core keeps valid until the operation's token
        // completes (the contract of tagged_send/tagged_recv); `msg` is read during the call.
        unsafe {
            if d.recv {
                fi_trecvmsg(self.ep, &msg, d.flags)
            } else {
                fi_tsendmsg(self.ep, &msg, d.flags)
            }
        }
    }

    fn retry_deferred(&mut self) -> Result<usize> {
        let mut n = 0;
        while let Some(d) = self.deferred.pop_front() {
            let rc = self.try_post(&d);
            if rc == EAGAIN {
                self.deferred.push_front(d);
                break;
            }
            n += 1;
            if rc != 0 {
                let token = match self.ops[d.op] {
                    Op::Send { token, .. }
                    | Op::Recv { token, .. }
                    | Op::LSend { token, .. }
                    | Op::LRecv { token, .. }
                    | Op::WSend { token, .. } => Some(token),
                    _ => None,
                };
                if let Op::WRecv { .. } = self.ops[d.op] {
                    // Taken back (and freed) at deregistration; no write can land.
                    self.ops[d.op] = Op::WRecv {
                        done: Some(-(rc as i32)),
                    };
                    continue;
                }
                self.free_op(d.op);
                if let Some(t) = token {
                    self.done
                        .push_back((t, Err(fi_err("posting a deferred tagged operation", rc))));
                }
            }
        }
        Ok(n)
    }

    /// Send an active message (or an acknowledgement) over `FI_MSG`.
    fn am_post(
        &mut self,
        dest: Rank,
        kind: u8,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        let total = PREFIX + header.len() + plen;
        let fill = |buf: &mut [u8], rank: Rank, seq: u32| {
            wire::put_prefix(buf, kind, header.len() as u16, rank, seq);
            buf[PREFIX..PREFIX + header.len()].copy_from_slice(header);
            let mut o = PREFIX + header.len();
            for p in payload {
                buf[o..o + p.len()].copy_from_slice(p);
                o += p.len();
            }
        };
        if dest == self.rank {
            let mut m = vec![0; total];
            fill(&mut m, self.rank, 0);
            self.selfq.push_back(m);
            return Ok(SendOutcome::Sent);
        }
        let seq = self.seq_out[dest as usize].peek();
        let addr = self.addrs[dest as usize];
        if total <= self.caps.inject_size {
            self.scratch.resize(total, 0);
            fill(&mut self.scratch, self.rank, seq);
            for attempt in 0..2 {
                // SAFETY: `scratch` holds `total` bytes; fi_inject copies them before returning.
                let rc = unsafe { fi_inject(self.ep, self.scratch.as_ptr().cast(), total, addr) };
                if rc == 0 {
                    self.seq_out[dest as usize].take();
                    self.n_inject += 1;
                    return Ok(SendOutcome::Sent);
                }
                if rc != EAGAIN {
                    return Err(fi_err("fi_inject", rc));
                }
                if attempt == 0 {
                    self.drive()?;
                }
            }
            return Ok(SendOutcome::Busy);
        }
        let Some(i) = self.tx_free.pop() else {
            self.drive()?;
            return Ok(SendOutcome::Busy);
        };
        let base = i as usize * self.slot;
        let rank = self.rank;
        fill(&mut self.tx_mem[base..base + total], rank, seq);
        let op = self.new_op(Op::AmTx(i, dest));
        // SAFETY: send buffer `i` lies in `tx_mem` (never resized, outlives the endpoint) and is
        // not written again until its completion returns it to `tx_free`.
        let rc = unsafe {
            fi_send(
                self.ep,
                self.tx_mem.as_ptr().add(base).cast(),
                total,
                self.tx_desc,
                addr,
                ctx(op),
            )
        };
        if rc != 0 {
            self.free_op(op);
            self.tx_free.push(i);
            if rc == EAGAIN {
                self.drive()?;
                return Ok(SendOutcome::Busy);
            }
            return Err(fi_err("fi_send", rc));
        }
        self.seq_out[dest as usize].take();
        self.n_am_copy += 1;
        Ok(SendOutcome::Sent)
    }

    /// An arrived active message in `m` (prefix included): deliver it in per-pair order, or
    /// hold a copy when it overtook others (`in_order`: it was held and its turn came). The
    /// peer whose message was delivered, so that what waited behind it goes next.
    fn on_am(&mut self, m: &[u8], in_order: bool, sink: &mut dyn Sink) -> Option<Rank> {
        let wire::Prefix {
            kind,
            hlen,
            src,
            seq,
        } = match wire::decode(m, self.size) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("ofi: {}; dropped", e.why);
                if let Some(src) = e.src {
                    sink.peer_failed(src, "malformed active message");
                }
                return None;
            }
        };
        if self.refused.contains(&src) {
            return None;
        }
        if src != self.rank && !in_order {
            let r = &mut self.seq_in[src as usize];
            let behind = seq.wrapping_sub(r.expected()) >= u32::MAX / 2;
            match r.arrive(&mut self.holding, src, seq, m.len(), || m.to_vec()) {
                Ok(Arrival::Deliver) => {}
                Ok(Arrival::Held) => return None,
                Err(OrderError::Duplicate { .. }) if behind => {
                    tracing::warn!("ofi: duplicate active message {seq} from rank {src}; dropped");
                    return None;
                }
                Err(e) => {
                    self.holding.forget(src);
                    self.refused.insert(src);
                    sink.peer_failed(src, &format!("active messages out of order: {e}"));
                    return None;
                }
            }
        }
        let (h, p) = m[PREFIX..].split_at(hlen);
        match kind {
            K_AM => sink.am(src, h, p),
            K_SYNC_ACK if wire::sync_ack(h).is_some() => {
                let i = wire::sync_ack(h).unwrap_or_default() as usize;
                match self.ops.get(i).copied() {
                    Some(Op::Send {
                        token,
                        dest,
                        ack: true,
                        sent,
                    }) if dest == src => {
                        if sent {
                            self.free_op(i);
                            sink.complete(token, Ok(Completed::Done));
                        } else {
                            self.ops[i] = Op::Send {
                                token,
                                dest,
                                ack: false,
                                sent,
                            };
                        }
                    }
                    _ => sink.peer_failed(src, "acknowledged a synchronous send it was not sent"),
                }
            }
            K_CTS if wire::cts(h).is_some() => {
                let (op, id, take) = wire::cts(h).unwrap_or_default();
                if let Err(e) = self.send_data(src, op as usize, id, take as usize) {
                    sink.peer_failed(src, &format!("large message: {e}"));
                }
            }
            _ => sink.peer_failed(src, "unknown active-message kind"),
        }
        (src != self.rank).then_some(src)
    }

    /// A receive matched a large message's announcement: post a receive for the bytes it takes
    /// (in the provider's data context) and ask the sender for them.
    fn on_announce(&mut self, i: usize, token: Token, cap: usize, ev: &Ev) {
        let (source, tag) = self.layout.unpack(ev.tag);
        let len = (ev.data & ((1 << LEN_BITS) - 1)) as usize;
        let their = (ev.data & !D_ANNOUNCE) >> LEN_BITS;
        let take = len.min(cap);
        let iov = truncate(&self.iovs[i], take);
        self.free_op(i);
        if ev.flags & FI_REMOTE_CQ_DATA == 0 {
            self.done.push_back((
                token,
                Err(Error::from(ErrorDetail::Malformed {
                    peer: source,
                    what: "a large message announced without its length".into(),
                })),
            ));
            return;
        }
        let id = self.next_data_id;
        self.next_data_id = id.wrapping_add(1);
        let op = self.new_op(Op::LRecv {
            token,
            source,
            tag,
            len,
        });
        let d = Deferred {
            recv: true,
            iov,
            peer: FI_ADDR_UNSPEC,
            tag: self.layout.data_tag(source, id),
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        };
        match self.post(d) {
            Ok(()) => self.cts.push_back((source, their, id, take as u64)),
            Err(e) => self.done.push_back((token, Err(e))),
        }
    }

    /// The receiver of large send `op` asked for `take` bytes under data id `id`.
    fn send_data(&mut self, src: Rank, op: usize, id: u32, take: usize) -> Result<()> {
        let Some(Op::LSend {
            token,
            dest,
            owed,
            data: false,
            failed,
        }) = self.ops.get(op).copied()
        else {
            return Err(Error::invalid(format!(
                "asked for the data of unknown send {op}"
            )));
        };
        if dest != src {
            return Err(Error::invalid(format!(
                "asked for the data of a send to rank {dest}"
            )));
        }
        let total: usize = self.iovs[op].iter().map(|x| x.1).sum();
        if take > total {
            return Err(Error::invalid(format!("asked for {take} of {total} bytes")));
        }
        self.ops[op] = Op::LSend {
            token,
            dest,
            owed: owed + 1,
            data: true,
            failed,
        };
        let d = Deferred {
            recv: false,
            iov: truncate(&self.iovs[op], take),
            peer: self.addrs[dest as usize],
            tag: self.layout.data_tag(self.rank, id),
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        };
        self.post(d)
    }

    fn take_bounce(&mut self) -> Result<u32> {
        if let Some(b) = self.bounce_free.pop() {
            return Ok(b);
        }
        let mem = vec![0u8; BOUNCE_CHUNK * self.rndv.max(1)];
        let desc = self.own_registration(mem.as_ptr(), mem.len())?;
        let first = self.bounce.len() * BOUNCE_CHUNK;
        self.bounce.push((mem, desc));
        self.bounce_free
            .extend((first + 1..first + BOUNCE_CHUNK).rev().map(|b| b as u32));
        Ok(first as u32)
    }

    fn release_bounce(&mut self, b: u32) {
        if b != NO_BOUNCE {
            self.bounce_free.push(b);
        }
    }

    /// Where bounce buffer `b` lies, and its descriptor.
    fn bounce_at(&mut self, b: u32) -> (*mut u8, *mut c_void) {
        let (chunk, k) = (b as usize / BOUNCE_CHUNK, b as usize % BOUNCE_CHUNK);
        let (mem, desc) = &mut self.bounce[chunk];
        // SAFETY: `k * rndv` lies inside the chunk of BOUNCE_CHUNK * rndv bytes.
        (unsafe { mem.as_mut_ptr().add(k * self.rndv) }, *desc)
    }

    /// Copy the first `n` bytes of bounce buffer `b` into receive `op`'s buffer.
    fn unbounce(&mut self, b: u32, op: usize, mut n: usize) {
        let (src, _) = self.bounce_at(b);
        let mut off = 0;
        for &(p, l, _) in &self.iovs[op] {
            let k = l.min(n);
            // SAFETY: the receive's pieces are the caller's buffer, valid and unaliased until
            // its token completes (now); `src + off .. + k` lies in the bounce buffer (n is at
            // most the message length, which libfabric fitted into the buffer).
            unsafe { std::ptr::copy_nonoverlapping(src.add(off), p as *mut u8, k) };
            off += k;
            n -= k;
            if n == 0 {
                break;
            }
        }
    }

    /// Deliver held messages from `src` that are now next in order.
    fn drain_held(&mut self, src: Rank, sink: &mut dyn Sink) {
        while let Some(m) = self.seq_in[src as usize].pop(&mut self.holding, src) {
            self.on_am(&m, true, sink);
        }
    }

    /// Handle one completion with the sink at hand.
    fn handle(&mut self, ev: Ev, sink: &mut dyn Sink) -> Result<()> {
        let Some(i) = ev.ctx.checked_sub(1) else {
            if ev.err != 0 {
                // A counted operation (no CQ entry asked) failed: its counter's error count
                // says so to the window; nothing else to do here.
                tracing::debug!(
                    "ofi: a counted operation failed: {}",
                    strerror(ev.err as i64)
                );
            }
            return Ok(());
        };
        let Some(op) = self.ops.get(i).copied() else {
            tracing::warn!("ofi: completion for an unknown operation {i}");
            return Ok(());
        };
        let reason = || {
            format!(
                "{} (provider error {})",
                strerror(ev.err as i64),
                ev.prov_errno
            )
        };
        tracing::trace!(?op, ?ev, "ofi completion");
        match op {
            Op::AmRx(b) => {
                self.free_op(i);
                if ev.err == 0 {
                    let base = b as usize * self.slot;
                    let len = ev.len.min(self.slot);
                    // Borrow the buffer out of `self` while the sink runs.
                    let mem = std::mem::take(&mut self.rx_mem);
                    let delivered = self.on_am(&mem[base..base + len], false, sink);
                    self.rx_mem = mem;
                    if let Some(s) = delivered {
                        self.drain_held(s, sink);
                    }
                } else if ev.err != FI_ECANCELED as i32 {
                    tracing::warn!("ofi: active-message receive failed: {}", reason());
                }
                if ev.err != FI_ECANCELED as i32 {
                    self.rx_idle.push(b);
                    if self.rx_idle.len() >= REPOST_BATCH {
                        self.repost()?;
                    }
                }
            }
            Op::AmTx(b, dest) => {
                self.free_op(i);
                self.tx_free.push(b);
                if ev.err != 0 {
                    sink.peer_failed(dest, &format!("send failed: {}", reason()));
                }
            }
            Op::Send {
                token, dest, ack, ..
            } => {
                if ev.err != 0 {
                    self.free_op(i);
                    sink.complete(
                        token,
                        Err(Error::peer_failed(
                            dest,
                            format!("tagged send failed: {}", reason()),
                        )),
                    );
                } else if ack {
                    self.ops[i] = Op::Send {
                        token,
                        dest,
                        ack,
                        sent: true,
                    };
                } else {
                    self.free_op(i);
                    sink.complete(token, Ok(Completed::Done));
                }
            }
            Op::Recv { token, cap, bounce } | Op::Cancelling(token, cap, bounce)
                if is_announce(&ev) && (ev.err == 0 || ev.err == FI_ETRUNC as i32) =>
            {
                self.n_trecv += 1;
                self.release_bounce(bounce);
                self.on_announce(i, token, cap, &ev);
            }
            Op::Recv { token, cap, bounce } | Op::Cancelling(token, cap, bounce) => {
                if bounce != NO_BOUNCE {
                    if ev.err == 0 {
                        self.unbounce(bounce, i, ev.len.min(cap));
                    }
                    self.release_bounce(bounce);
                }
                self.free_op(i);
                self.n_trecv += 1;
                let (source, tag) = self.layout.unpack(ev.tag);
                let matched = ev.err == 0 || ev.err == FI_ETRUNC as i32;
                if matched && ev.flags & FI_REMOTE_CQ_DATA != 0 && ev.data & D_SYNC != 0 {
                    self.acks.push_back((source, ev.data & !D_SYNC));
                }
                let r = match ev.err {
                    0 => Ok(Completed::Received(TaggedStatus {
                        source,
                        tag,
                        bytes: ev.len,
                    })),
                    // Some providers (libfabric 1.17's tcp;ofi_rxm and shm) leave the length of
                    // a truncated message out: then all that is known is "more than fits".
                    e if e == FI_ETRUNC as i32 => Ok(Completed::Received(TaggedStatus {
                        source,
                        tag,
                        bytes: (ev.len + ev.olen).max(cap + 1),
                    })),
                    e if e == FI_ECANCELED as i32 => Ok(Completed::Cancelled),
                    _ => Err(fi_err("tagged receive", -(ev.err as isize))),
                };
                sink.complete(token, r);
            }
            Op::Rma { token, peer } => {
                self.free_op(i);
                let r = if ev.err == 0 {
                    Ok(Completed::Done)
                } else {
                    Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: peer,
                        what: reason(),
                    }))
                };
                sink.complete(token, r);
            }
            Op::LSend {
                token,
                dest,
                owed,
                data,
                failed,
            } => {
                let owed = owed - 1;
                let failed = if ev.err != 0 && !failed {
                    sink.complete(
                        token,
                        Err(Error::peer_failed(
                            dest,
                            format!("tagged send failed: {}", reason()),
                        )),
                    );
                    true
                } else {
                    failed
                };
                if owed == 0 && (data || failed) {
                    if !failed {
                        sink.complete(token, Ok(Completed::Done));
                    }
                    self.free_op(i);
                } else {
                    self.ops[i] = Op::LSend {
                        token,
                        dest,
                        owed,
                        data,
                        failed,
                    };
                }
            }
            Op::LRecv {
                token,
                source,
                tag,
                len,
            } => {
                self.free_op(i);
                let r = if ev.err == 0 {
                    Ok(Completed::Received(TaggedStatus {
                        source,
                        tag,
                        bytes: len,
                    }))
                } else {
                    Err(Error::peer_failed(
                        source,
                        format!("large message data: {}", reason()),
                    ))
                };
                sink.complete(token, r);
            }
            Op::WSend { token, dest } => {
                self.free_op(i);
                let r = if ev.err == 0 {
                    Ok(Completed::Done)
                } else {
                    Err(Error::peer_failed(
                        dest,
                        format!("write-rendezvous data: {}", reason()),
                    ))
                };
                sink.complete(token, r);
            }
            Op::Peek(_) | Op::Orphan | Op::Cancelled(_) | Op::Free | Op::WRecv { .. } => {
                if !self.absorb(&ev) {
                    tracing::debug!("ofi: completion for finished operation {i}");
                }
            }
        }
        Ok(())
    }

    /// The open counter (and its endpoint) of id `c`.
    fn win_cntr(&self, c: CntrId) -> Result<&WinCntr> {
        c.checked_sub(1)
            .and_then(|i| self.cntrs.get(i as usize))
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid(format!("no open completion counter {c}")))
    }

    /// Report an operation that needs no libfabric call as finished, where `done` says.
    fn finish_now(&mut self, done: &Completion) -> Result<()> {
        if let Some(c) = done.cntr {
            let w = self.win_cntr(c)?;
            // SAFETY: an open counter.
            check("fi_cntr_add", unsafe { fi_cntr_add(w.cntr, 1) })?;
        }
        if let Some(t) = done.cq {
            self.done.push_back((t, Ok(Completed::Done)));
        }
        Ok(())
    }

    fn keep_cntr(&mut self, w: WinCntr) -> CntrId {
        let w = Some(w);
        let i = match self.cntrs.iter().position(Option::is_none) {
            Some(i) => {
                self.cntrs[i] = w;
                i
            }
            None => {
                self.cntrs.push(w);
                self.cntrs.len() - 1
            }
        };
        i as CntrId + 1
    }

    fn peer_ok(&self, r: Rank) -> Result<()> {
        if r >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        Ok(())
    }

    /// The endpoint for an RMA operation: its window's (counted) or the main one.
    fn rma_ep(&self, done: &Completion) -> Result<*mut fid_ep> {
        match done.cntr {
            None => Ok(self.ep),
            Some(c) => self.win_cntr(c).map(|w| w.ep),
        }
    }

    /// Context and flags for an RMA operation that reports as `done` says.
    fn rma_ctx(&mut self, peer: Rank, done: &Completion) -> (*mut c_void, u64, Option<usize>) {
        let mut flags = if done.fence { FI_FENCE } else { 0 };
        match done.cq {
            Some(token) => {
                let op = self.new_op(Op::Rma { token, peer });
                flags |= FI_COMPLETION;
                (ctx(op), flags, Some(op))
            }
            None => (null_mut(), flags, None),
        }
    }

    /// Retry a post while the provider's queue is full (bounded).
    fn retry(
        &mut self,
        what: &str,
        op: Option<usize>,
        mut post: impl FnMut() -> isize,
    ) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let rc = post();
            if rc == 0 {
                return Ok(());
            }
            if rc != EAGAIN || Instant::now() > deadline {
                if let Some(o) = op {
                    self.free_op(o);
                }
                return Err(fi_err(what, rc));
            }
            self.drive()?;
        }
    }

    fn rma(
        &mut self,
        peer: Rank,
        write: bool,
        local: &[(usize, usize, u64)],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.peer_ok(peer)?;
        let ep = self.rma_ep(&done)?;
        let (context, mut flags, op) = self.rma_ctx(peer, &done);
        if write && self.delivery {
            flags |= FI_DELIVERY_COMPLETE;
        }
        let iov: SmallVec<[iovec; 4]> = local
            .iter()
            .map(|&(p, l, _)| iovec {
                iov_base: p as *mut c_void,
                iov_len: l,
            })
            .collect();
        let mut desc: SmallVec<[*mut c_void; 4]> =
            local.iter().map(|&(_, _, d)| d as *mut c_void).collect();
        let rio = fi_rma_iov {
            addr: remote.addr,
            len: local.iter().map(|x| x.1).sum(),
            key: remote.key,
        };
        let msg = fi_msg_rma {
            msg_iov: iov.as_ptr(),
            desc: desc.as_mut_ptr(),
            iov_count: iov.len(),
            addr: self.addrs[peer as usize],
            rma_iov: &rio,
            rma_iov_count: 1,
            context,
            data: 0,
        };
        if write {
            self.n_write += 1;
        } else {
            self.n_read += 1;
        }
        // SAFETY: the local iovecs stay valid until completion (the caller's contract); `msg`
        // and what it points at live across the call.
        self.retry(
            if write { "fi_writemsg" } else { "fi_readmsg" },
            op,
            || unsafe {
                if write {
                    fi_writemsg(ep, &msg, flags)
                } else {
                    fi_readmsg(ep, &msg, flags)
                }
            },
        )
    }

    fn register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: Option<u64>,
    ) -> Result<MemRegion> {
        let mut acc = FI_SEND | FI_RECV | FI_READ | FI_WRITE;
        if access.remote_read || access.remote_atomic {
            acc |= FI_REMOTE_READ;
        }
        if access.remote_write || access.remote_atomic {
            acc |= FI_REMOTE_WRITE;
        }
        let requested = match key {
            Some(_) if self.prov_key => {
                return Err(Error::from(ErrorDetail::Unsupported(
                    "ofi: this fabric chooses its own keys (FI_MR_PROV_KEY)".into(),
                )))
            }
            Some(k) => k,
            None => self.take_key(),
        };
        let mut mr = null_mut();
        // SAFETY: the caller keeps `base..base+len` valid until deregistration.
        let rc = unsafe {
            fi_mr_reg(
                self.dom,
                base as *const c_void,
                len,
                acc,
                0,
                requested,
                0,
                &mut mr,
                null_mut(),
            )
        };
        check("fi_mr_reg", rc)?;
        // SAFETY: a registration just opened.
        let (k, d) = unsafe { ((*mr).key, (*mr).mem_desc) };
        Ok(MemRegion {
            key: k,
            addr: if self.virt_addr { base as u64 } else { 0 },
            len,
            handle: mr as u64,
            desc: d as u64,
        })
    }
}

/// The write rendezvous in active-message mode (`wrndv`). The core's receiver registers its
/// buffer for one peer's write of the whole message and sends the key; the sender writes, then
/// tells the receiver (`WFIN`), which deregisters before it hands the buffer back. Here the
/// registration posts the buffer as a tagged receive with an exact tag in the provider's data
/// context (the key: never a wildcard, and posted before the key leaves, so libfabric 1.17
/// shm's faults with unexpected messages cannot arise), and the write is a tagged send with
/// that tag: libfabric moves the data its own way (shm: one CMA copy or its pipelined
/// segments) with no copy through active-message buffers.
impl Ofi {
    fn wrecv_open(&mut self, base: *mut u8, len: usize, access: Access) -> Result<MemRegion> {
        if access.remote_read || access.remote_atomic || !access.remote_write || len == 0 {
            return Err(am_mode("a registration serves the write rendezvous only"));
        }
        let id = self.next_data_id;
        self.next_data_id = id.wrapping_add(1);
        let key = self.layout.data_tag(self.rank, id);
        let op = self.new_op(Op::WRecv { done: None });
        self.post(Deferred {
            recv: true,
            iov: SmallVec::from_slice(&[(base as usize, len, 0)]),
            peer: FI_ADDR_UNSPEC,
            tag: key,
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        })?;
        Ok(MemRegion {
            key,
            addr: 0,
            len,
            handle: W_HANDLE | op as u64,
            desc: 0,
        })
    }

    /// Take write-rendezvous receive `i` back: once its data is in (the usual case: the
    /// sender's `WFIN` follows its completion), else cancelled. libfabric must answer within
    /// [`WRECV_WAIT`]; if it does not, the process ends, because returning would hand back a
    /// buffer libfabric may still write into.
    fn wrecv_close(&mut self, i: usize) -> Result<()> {
        if !matches!(self.ops.get(i), Some(Op::WRecv { .. })) {
            return Err(Error::invalid(
                "ofi: deregistering a region it never registered",
            ));
        }
        if let Some(d) = self.deferred.iter().position(|d| d.op == i) {
            // Never reached libfabric.
            self.deferred.remove(d);
            self.free_op(i);
            return Ok(());
        }
        let start = Instant::now();
        let mut cancelled = false;
        loop {
            if let Op::WRecv { done: Some(err) } = self.ops[i] {
                self.free_op(i);
                if err != 0 && err != FI_ECANCELED as i32 {
                    tracing::warn!(
                        "ofi: a write-rendezvous receive failed: {}",
                        strerror(err as i64)
                    );
                }
                return Ok(());
            }
            let waited = start.elapsed();
            if !cancelled && waited > SYNC_POLL {
                // No data came: the sender failed or the receive was given up. A receive
                // that is already matched cannot be cancelled; its completion still comes.
                // SAFETY: `ep` is open; the context names one of its posted receives.
                unsafe { fi_cancel(&mut (*self.ep).fid, ctx(i)) };
                cancelled = true;
            }
            if waited > WRECV_WAIT {
                tracing::error!("ofi: libfabric kept a receive buffer after cancellation");
                eprintln!(
                    "weft: ofi: libfabric neither completed nor cancelled a receive into a buffer                      that is being given back ({} s); ending the process rather than let it                      write there",
                    WRECV_WAIT.as_secs()
                );
                std::process::abort();
            }
            self.drive()?;
        }
    }

    fn wsend(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.peer_ok(dest)?;
        if remote.addr != 0 || !self.layout.is_data(remote.key) {
            return Err(Error::from(ErrorDetail::RemoteAccess {
                rank: dest,
                what: "not a write-rendezvous key of the ofi provider".into(),
            }));
        }
        let Some(token) = done.cq else {
            return Err(Error::invalid(
                "ofi: a write-rendezvous write reports through the completion queue",
            ));
        };
        if local.iter().map(|x| x.len).sum::<usize>() == 0 {
            return Err(Error::invalid("ofi: an empty write-rendezvous write"));
        }
        let op = self.new_op(Op::WSend { token, dest });
        self.n_wrndv += 1;
        self.post(Deferred {
            recv: false,
            iov: raw(local),
            peer: self.addrs[dest as usize],
            tag: remote.key,
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        })
    }
}

/// What active-message mode (`WEFT_OFI_NATIVE=0`) does not do.
fn am_mode(what: &str) -> Error {
    Error::from(ErrorDetail::Unsupported(format!(
        "ofi: with WEFT_OFI_NATIVE=0 {what}"
    )))
}

/// The first `n` bytes of an iovec.
fn truncate(iov: &[(usize, usize, u64)], mut n: usize) -> SmallVec<[(usize, usize, u64); 4]> {
    let mut v = SmallVec::new();
    for &(p, l, d) in iov {
        if n == 0 {
            break;
        }
        v.push((p, l.min(n), d));
        n -= l.min(n);
    }
    v
}

/// A large message's announcement (told by its remote CQ data).
fn is_announce(ev: &Ev) -> bool {
    ev.flags & FI_REMOTE_CQ_DATA != 0 && ev.data & D_ANNOUNCE != 0
}

fn raw(iov: &[RawIov]) -> SmallVec<[(usize, usize, u64); 4]> {
    iov.iter()
        .map(|x| (x.ptr as usize, x.len, x.desc))
        .collect()
}

fn raw_mut(iov: &[RawIovMut]) -> SmallVec<[(usize, usize, u64); 4]> {
    iov.iter()
        .map(|x| (x.ptr as usize, x.len, x.desc))
        .collect()
}

impl Provider for Ofi {
    fn name(&self) -> &str {
        "ofi"
    }

    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn peer_caps(&self, _peer: Rank) -> Option<PeerCaps> {
        // Written, never read: the core's write rendezvous.
        self.wrndv.then(|| PeerCaps::from(&self.caps))
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
        self.peer_ok(dest)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > MAX_HDR || plen > self.caps.max_am_payload {
            return Err(Error::invalid(format!(
                "active message of {} + {plen} bytes exceeds {MAX_HDR} + {}",
                header.len(),
                self.caps.max_am_payload
            )));
        }
        if !self.acks.is_empty() || !self.cts.is_empty() {
            return Ok(SendOutcome::Busy);
        }
        self.am_post(dest, K_AM, header, payload)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        if !self.rx_idle.is_empty() {
            self.repost()?;
        }
        let mut n = self.retry_deferred()?;
        while let Some(&(r, op)) = self.acks.front() {
            match self.am_post(r, K_SYNC_ACK, &op.to_le_bytes(), &[])? {
                SendOutcome::Sent => {
                    self.acks.pop_front();
                    self.n_ack += 1;
                    n += 1;
                }
                SendOutcome::Busy => break,
            }
        }
        while let Some(&(r, op, id, take)) = self.cts.front() {
            let h = wire::put_cts(op, id, take);
            match self.am_post(r, K_CTS, &h, &[])? {
                SendOutcome::Sent => {
                    self.cts.pop_front();
                    n += 1;
                }
                SendOutcome::Busy => break,
            }
        }
        while let Some(m) = self.selfq.pop_front() {
            self.on_am(&m, false, sink);
            n += 1;
        }
        while let Some(ev) = self.early.pop_front() {
            self.handle(ev, sink)?;
            n += 1;
        }
        while let Some((t, r)) = self.done.pop_front() {
            sink.complete(t, r);
            n += 1;
        }
        // A bounded number of batches, so that one progress call cannot starve the caller.
        for _ in 0..4 {
            let mut evs: SmallVec<[Ev; 16]> = SmallVec::new();
            self.read_batch(&mut evs)?;
            let full = evs.len() == 16;
            n += evs.len();
            for ev in evs {
                self.handle(ev, sink)?;
            }
            if !full {
                break;
            }
        }
        // Peers' processes, every WATCH_EVERY idle calls (one poll for all of them): a rank
        // waiting on a dead peer is idle, a busy one pays nothing.
        if n == 0 {
            self.ticks = self.ticks.wrapping_add(1);
            if self.ticks % WATCH_EVERY == 0 {
                for r in self.watch.exited(|i| self.dead[i]) {
                    self.dead[r] = true;
                    sink.peer_failed(r as Rank, "process died");
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        // Let the sends in flight leave before the endpoint goes (closed in Drop, after the
        // bootstrap's finalize).
        let deadline = Instant::now() + Duration::from_secs(5);
        while (self.tx_free.len() * self.slot < self.tx_mem.len()
            || !self.deferred.is_empty()
            || !self.acks.is_empty()
            || !self.cts.is_empty())
            && Instant::now() < deadline
        {
            let mut sink = Drain;
            self.progress(&mut sink)?;
        }
        Ok(())
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("am_inject", self.n_inject),
            ("am_copy", self.n_am_copy),
            ("tagged_send", self.n_tsend),
            ("tagged_inject", self.n_tinject),
            ("tagged_recv", self.n_trecv),
            ("sync_acks", self.n_ack),
            ("rma_read", self.n_read),
            ("rma_write", self.n_write),
            ("atomics", self.n_atomic),
            ("rndv_write", self.n_wrndv),
        ]
    }

    unsafe fn tagged_send(
        &mut self,
        dest: Rank,
        ctx_id: u32,
        tag: i32,
        data: &[RawIov],
        sync: bool,
        token: Token,
    ) -> Result<()> {
        self.peer_ok(dest)?;
        let bits = self.layout.pack(ctx_id, self.rank, tag)?;
        let total: usize = data.iter().map(|d| d.len).sum();
        let addr = self.addrs[dest as usize];
        if !sync && total <= self.caps.inject_size && self.deferred.is_empty() {
            let (p, rc) = match data {
                [one] => (one.ptr, 0),
                _ => {
                    self.scratch.clear();
                    for d in data {
                        // SAFETY: the caller's pieces are valid for reads of their length.
                        self.scratch
                            .extend_from_slice(std::slice::from_raw_parts(d.ptr, d.len));
                    }
                    (self.scratch.as_ptr(), 0)
                }
            };
            let _ = rc;
            // SAFETY: `total` readable bytes at `p`; fi_tinject copies them before returning.
            let rc = fi_tinject(self.ep, p.cast(), total, addr, bits);
            if rc == 0 {
                self.n_tinject += 1;
                self.done.push_back((token, Ok(Completed::Done)));
                return Ok(());
            }
            if rc != EAGAIN {
                return Err(fi_err("fi_tinject", rc));
            }
        }
        if total > self.rndv {
            if total >> LEN_BITS != 0 {
                return Err(Error::invalid(format!(
                    "a {total}-byte message exceeds the ofi provider's 2^{LEN_BITS} bytes"
                )));
            }
            let op = self.new_op(Op::LSend {
                token,
                dest,
                owed: 0,
                data: false,
                failed: false,
            });
            if op >= ANNOUNCE_OPS {
                self.free_op(op);
                return Err(Error::invalid("too many operations outstanding"));
            }
            self.iovs[op] = raw(data);
            self.n_tsend += 1;
            let cq_data = D_ANNOUNCE | (op as u64) << LEN_BITS | total as u64;
            // The announcement carries the message's first byte (which lands where the data
            // will): libfabric 1.17's shm loses empty messages that arrive unexpected, and its
            // tcp;ofi_rxm mishandles an empty injected one.
            self.ops[op] = Op::LSend {
                token,
                dest,
                owed: 1,
                data: false,
                failed: false,
            };
            return self.post(Deferred {
                recv: false,
                iov: truncate(&self.iovs[op], 1),
                peer: addr,
                tag: bits,
                ignore: 0,
                data: cq_data,
                flags: FI_REMOTE_CQ_DATA,
                op,
            });
        }
        let op = self.new_op(Op::Send {
            token,
            dest,
            ack: sync,
            sent: false,
        });
        self.n_tsend += 1;
        self.post(Deferred {
            recv: false,
            iov: raw(data),
            peer: addr,
            tag: bits,
            ignore: 0,
            data: D_SYNC | op as u64,
            flags: if sync { FI_REMOTE_CQ_DATA } else { 0 },
            op,
        })
    }

    unsafe fn tagged_recv(
        &mut self,
        src: Option<Rank>,
        ctx_id: u32,
        tag: Option<i32>,
        buf: &[RawIovMut],
        token: Token,
    ) -> Result<()> {
        if let Some(s) = src {
            self.peer_ok(s)?;
        }
        let (bits, ignore) = self.layout.matcher(ctx_id, src, tag)?;
        let cap = buf.iter().map(|b| b.len).sum();
        // A receive smaller than the largest eager message is posted into a bounce buffer of
        // that size: libfabric then never truncates (larger messages are announced, and an
        // announcement fits any buffer), and weft delivers the prefix and the exact length.
        let (bounce, iov) = if cap < self.rndv {
            let b = self.take_bounce()?;
            let (p, d) = self.bounce_at(b);
            (
                b,
                SmallVec::from_slice(&[(p as usize, self.rndv, d as u64)]),
            )
        } else {
            (NO_BOUNCE, raw_mut(buf))
        };
        let op = self.new_op(Op::Recv { token, cap, bounce });
        self.iovs[op] = raw_mut(buf);
        self.post(Deferred {
            recv: true,
            iov,
            peer: FI_ADDR_UNSPEC,
            tag: bits,
            ignore,
            data: 0,
            flags: 0,
            op,
        })
    }

    fn tagged_probe(
        &mut self,
        src: Option<Rank>,
        ctx_id: u32,
        tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        if let Some(s) = src {
            self.peer_ok(s)?;
        }
        let (bits, ignore) = self.layout.matcher(ctx_id, src, tag)?;
        let op = self.new_op(Op::Peek(None));
        let msg = fi_msg_tagged {
            msg_iov: null(),
            desc: null_mut(),
            iov_count: 0,
            addr: FI_ADDR_UNSPEC,
            tag: bits,
            ignore,
            context: ctx(op),
            data: 0,
        };
        // SAFETY: a peek names no buffer; `msg` is read during the call.
        let rc = unsafe { fi_trecvmsg(self.ep, &msg, FI_PEEK) };
        if rc != 0 {
            self.free_op(op);
            return if rc == EAGAIN {
                Ok(None)
            } else {
                Err(fi_err("fi_trecvmsg(FI_PEEK)", rc))
            };
        }
        let deadline = Instant::now() + SYNC_POLL;
        loop {
            if let Op::Peek(Some(ans)) = self.ops[op] {
                self.free_op(op);
                return Ok(ans);
            }
            if Instant::now() > deadline {
                // The answer will come; whoever reads it drops it.
                self.ops[op] = Op::Orphan;
                return Ok(None);
            }
            self.drive()?;
        }
    }

    fn tagged_cancel(&mut self, token: Token) -> Result<bool> {
        let mine = |o: &Op| matches!(o, Op::Recv { token: t, .. } if *t == token);
        let Some(i) = self.ops.iter().position(mine) else {
            if let Some(d) = self.deferred.iter().position(|d| mine(&self.ops[d.op])) {
                // Never reached libfabric.
                let d = self.deferred.remove(d).expect("index from position");
                if let Op::Recv { bounce, .. } = self.ops[d.op] {
                    self.release_bounce(bounce);
                }
                self.free_op(d.op);
                return Ok(true);
            }
            return Ok(false);
        };
        // SAFETY: `ep` is open; the context names one of its posted receives.
        let rc = unsafe { fi_cancel(&mut (*self.ep).fid, ctx(i)) };
        if rc != 0 {
            return Ok(false);
        }
        let Op::Recv { cap, bounce, .. } = self.ops[i] else {
            return Ok(false);
        };
        self.ops[i] = Op::Cancelling(token, cap, bounce);
        let deadline = Instant::now() + SYNC_POLL;
        loop {
            match self.ops[i] {
                Op::Cancelled(b) => {
                    self.release_bounce(b);
                    self.free_op(i);
                    return Ok(true);
                }
                Op::Cancelling(..) if Instant::now() < deadline => {}
                // Matched after all, or not answered yet: the completion (data or
                // cancellation) is reported through progress.
                _ => return Ok(false),
            }
            // A normal completion of this receive lands in `early` and is handled as a receive.
            if self.early.iter().any(|e| e.ctx == i + 1) {
                return Ok(false);
            }
            self.drive()?;
        }
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if self.wrndv {
            return self.wrecv_open(base, len, access);
        }
        self.register(base, len, access, None)
    }

    unsafe fn mr_register_keyed(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
    ) -> Result<MemRegion> {
        if self.wrndv {
            return Err(am_mode("windows go by active messages"));
        }
        self.register(base, len, access, Some(key))
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        if mr.handle & W_HANDLE != 0 {
            return self.wrecv_close((mr.handle & !W_HANDLE) as usize);
        }
        let p = mr.handle as *mut fid_mr;
        if p.is_null() {
            return Err(Error::invalid(
                "ofi: deregistering a region it never registered",
            ));
        }
        // SAFETY: `handle` is the fid_mr this provider opened in `register` (the core hands back
        // the MemRegion it was given, once).
        check("closing a registration", unsafe { fi_close(&mut (*p).fid) })
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        if self.wrndv {
            return Err(am_mode("there are no reads"));
        }
        self.rma(src, false, &raw_mut(local), remote, done)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        if self.wrndv {
            return self.wsend(dest, local, remote, done);
        }
        self.rma(dest, true, &raw(local), remote, done)
    }

    unsafe fn atomic(
        &mut self,
        dest: Rank,
        a: &AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.peer_ok(dest)?;
        if a.op == WOp::NoOp && a.result.is_null() {
            // An accumulate of NO_OP changes nothing and returns nothing: done at once
            // (libfabric has no non-fetching form of FI_ATOMIC_READ).
            return self.finish_now(&done);
        }
        let ep = self.rma_ep(&done)?;
        let (context, mut flags, op) = self.rma_ctx(dest, &done);
        if self.delivery {
            flags |= FI_DELIVERY_COMPLETE;
        }
        let (o, t) = fi_types(a.op, a.ty);
        // FI_ATOMIC_READ ignores its origin buffer, but some providers want one named.
        let origin = if a.origin.is_null() {
            a.result as *const u8
        } else {
            a.origin
        };
        let oi = fi_ioc {
            addr: origin as *mut c_void,
            count: a.count,
        };
        let ci = fi_ioc {
            addr: a.compare as *mut c_void,
            count: a.count,
        };
        let mut ri = fi_ioc {
            addr: a.result as *mut c_void,
            count: a.count,
        };
        let mut d = a.desc.map(|x| x as *mut c_void);
        let rio = fi_rma_ioc {
            addr: remote.addr,
            count: a.count,
            key: remote.key,
        };
        let msg = fi_msg_atomic {
            msg_iov: &oi,
            desc: &mut d[0],
            iov_count: 1,
            addr: self.addrs[dest as usize],
            rma_iov: &rio,
            rma_iov_count: 1,
            datatype: t,
            op: o,
            context,
            data: 0,
        };
        self.n_atomic += 1;
        let (d1, d2) = (&mut d[1] as *mut *mut c_void, &mut d[2] as *mut *mut c_void);
        let fetch = !a.result.is_null();
        let cswap = a.op == WOp::Cswap;
        // SAFETY: origin, compare and result are valid for `count` elements until completion
        // (the caller's contract); `msg` and the ioc structs live across the call.
        self.retry("fi_atomic", op, || {
            if cswap {
                fi_compare_atomicmsg(ep, &msg, &ci, d1, 1, &mut ri, d2, 1, flags)
            } else if fetch {
                fi_fetch_atomicmsg(ep, &msg, &mut ri, d2, 1, flags)
            } else {
                fi_atomicmsg(ep, &msg, flags)
            }
        })
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        if let Some(w) = self.spare_cntrs.pop() {
            return Ok(self.keep_cntr(w));
        }
        let mut attr = fi_cntr_attr {
            events: FI_CNTR_EVENTS_COMP,
            wait_obj: FI_WAIT_NONE,
            ..Default::default()
        };
        let mut c = null_mut();
        // SAFETY: the domain is open; `attr` is read during the call.
        check("fi_cntr_open", unsafe {
            fi_cntr_open(self.dom, &mut attr, &mut c, null_mut())
        })?;
        let ep = match self.endpoint(Some(c)) {
            Ok(ep) => ep,
            Err(e) => {
                // SAFETY: the counter was just opened and is bound to nothing.
                unsafe { fi_close(&mut (*c).fid) };
                return Err(e);
            }
        };
        Ok(self.keep_cntr(WinCntr { cntr: c, ep }))
    }

    fn cntr_read(&mut self, c: CntrId) -> Result<CntrValue> {
        let w = self.win_cntr(c)?;
        // SAFETY: an open counter.
        Ok(unsafe {
            CntrValue {
                ok: fi_cntr_read(w.cntr),
                err: fi_cntr_readerr(w.cntr),
            }
        })
    }

    fn cntr_close(&mut self, c: CntrId) -> Result<()> {
        self.win_cntr(c)?;
        let w = self.cntrs[c as usize - 1]
            .take()
            .expect("win_cntr found it open");
        // SAFETY: an open counter with nothing outstanding on it (the contract); it and its
        // endpoint are kept for the next window, from zero.
        unsafe {
            check("resetting a counter", fi_cntr_set(w.cntr, 0))?;
            check("resetting a counter", fi_cntr_seterr(w.cntr, 0))?;
        }
        self.spare_cntrs.push(w);
        Ok(())
    }
}

/// A sink for `close`: the job is over, arrivals are dropped.
struct Drain;

impl Sink for Drain {
    fn am(&mut self, _: Rank, _: &[u8], _: &[u8]) {}
    fn complete(&mut self, _: Token, _: Result<Completed>) {}
    fn peer_failed(&mut self, _: Rank, _: &str) {}
}

impl Drop for Ofi {
    fn drop(&mut self) {
        // SAFETY: every object was opened by `open_with` (or is null) and is closed once, children
        // before parents; the buffers they used are freed only after this body.
        unsafe {
            let spare = std::mem::take(&mut self.spare_cntrs);
            for w in self.cntrs.drain(..).flatten().chain(spare) {
                fi_close(&mut (*w.ep).fid);
                fi_close(&mut (*w.cntr).fid);
            }
            if !self.ep.is_null() {
                fi_close(&mut (*self.ep).fid);
            }
            for m in self.own_mr.drain(..) {
                let _ = m.desc;
                fi_close(&mut (*m.mr).fid);
            }
            if !self.av.is_null() {
                fi_close(&mut (*self.av).fid);
            }
            if !self.cq.is_null() {
                fi_close(&mut (*self.cq).fid);
            }
            if !self.dom.is_null() {
                fi_close(&mut (*self.dom).fid);
            }
            if !self.fab.is_null() {
                fi_close(&mut (*self.fab).fid);
            }
            if !self.info.is_null() {
                (self.lib.fi_freeinfo)(self.info);
            }
        }
    }
}

impl StaticProvider for Ofi {
    const NAME: &'static str = "ofi";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        let ch = choose(&PROVIDER.get_str(), &DOMAIN.get_str()).map_err(|e| e.to_string())?;
        let one_host = !caps_of(&ch, None, None).spans_hosts;
        // SAFETY: `info` came from fi_getinfo (through fi_dupinfo) and is freed once.
        unsafe { (fabric()?.fi_freeinfo)(ch.info) };
        if one_host && ctx.hosts > 1 {
            return Err(
                "the libfabric provider reaches one host only; the job spans several".into(),
            );
        }
        Ok(())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_on(boot, &PROVIDER.get_str(), &DOMAIN.get_str())
    }

    fn static_caps() -> Result<Caps> {
        let ch = choose(&PROVIDER.get_str(), &DOMAIN.get_str())?;
        // Native atomics are a domain's answer: open one for the question, then close it.
        let lib = fabric().map_err(Error::invalid)?;
        let (mut fab, mut dom) = (null_mut(), null_mut());
        // SAFETY: `info` is live; the objects opened here are closed below, children first.
        let c = unsafe {
            let ok = ch.caps & FI_ATOMIC != 0
                && (lib.fi_fabric)((*ch.info).fabric_attr, &mut fab, null_mut()) == 0
                && fi_domain(fab, ch.info, &mut dom, null_mut()) == 0;
            let c = caps_of(&ch, ok.then_some(dom), None);
            if !dom.is_null() {
                fi_close(&mut (*dom).fid);
            }
            if !fab.is_null() {
                fi_close(&mut (*fab).fid);
            }
            c
        };
        // SAFETY: as in `probe`.
        unsafe { (fabric().map_err(Error::invalid)?.fi_freeinfo)(ch.info) };
        Ok(c)
    }
}

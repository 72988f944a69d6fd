//! The provider on libfabric: object set-up, active messages, tagged messaging, RMA, atomics and
//! counters. See the crate documentation for the mapping.
//!
//! Every libfabric call is `unsafe` FFI through the objects' operation tables; the objects are
//! opened in `open`, used only through `&mut self`, and closed in `Drop` in reverse order.
//! Operation contexts are indexes into `ops` (plus one, so that a null context means "no
//! operation"), never pointers, so a stale or foreign completion cannot reach freed memory.
//!
//! Here: the provider's state (`Ofi`, the operation table `Op`) and opening (`open_with`:
//! fabric, domain, endpoint, CQ, AV, the peers' addresses). Beside it, a module per concern:
//! `ladder` the capability ladder, `am` active messages, `tagged` native tagged messaging's
//! large messages and bounce buffers, `events` completions and deferred posts, `rma` RMA,
//! atomics and the write rendezvous, `provider` the `Provider` entry points and teardown.

mod am;
mod events;
mod ladder;
mod provider;
mod rma;
mod tagged;

use ladder::*;

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

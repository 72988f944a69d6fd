//! The protocol engine: requests, the two-sided protocols built on active messages, and dispatch
//! to a provider's native tagged messaging when it has one.
//!
//! Protocols on active messages (the core fallback, MPICH CH4's MPIDIG):
//! * **eager** — payload up to the eager limit travels with the header; unexpected eager data
//!   is copied into the unexpected queue. `ssend` adds a sync flag and the receiver acknowledges
//!   the match (`SACK`).
//! * **rendezvous** — `RTS` (size, sender request id, and the sender buffer's key when the
//!   provider can do RMA reads). On a match the receiver either pulls the data with one RMA read
//!   straight into its buffer and answers `FIN`, or answers `CTS` and the sender streams `DATA`
//!   chunks of at most the provider's payload limit, flow-controlled by the provider (`Busy`).
//! * **speculative rendezvous** (up to `WEFT_SPEC_LIMIT`, on by default where a round trip is a
//!   network's) — `SPEC` announces the message like `RTS` and carries its first chunk; `SDATA`
//!   chunks (keyed by the sender's request) follow without waiting for a `CTS`. A receiver that
//!   has the receive posted places them and answers `SACK`. One that has not stages the data
//!   (and answers `SACK`) while the staged total stays within `WEFT_SPEC_BUFFER`; beyond it, it
//!   keeps only the announcement (as an unexpected `RTS`), drops the data and answers `CTS`
//!   when a receive matches, so unexpected data stays bounded. The send completes when all its
//!   data is written and `SACK` came, or when the `CTS` stream finished. `ssend` never
//!   speculates (a staged message is acknowledged before it matches).
//!
//! The engine owns the provider `P` and the core [`State`]; `State` is the [`Sink`] the provider
//! reports into, so handlers never call the provider: what they need sent goes into the outbox,
//! flushed after `progress` returns.

use crate::datatype::Datatype;
use crate::matching::{Matcher, PostedHandle};
use crate::provider::{
    Access, Caps, Completed, Completion, MemRegion, Provider, RawIov, RawIovMut, RemoteAddr,
    SendOutcome, Sink, Token,
};
use crate::types::Rank;
use crate::{Error, ErrorDetail, ErrorKind, Result, Status};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::time::{Duration, Instant};

/// Header bytes the core needs from every provider.
pub const MIN_AM_HEADER: usize = 64;

// Active-message handler ids (first header byte).
const H_EAGER: u8 = 1;
const H_RTS: u8 = 2;
const H_CTS: u8 = 3;
const H_DATA: u8 = 4;
const H_FIN: u8 = 5;
const H_SACK: u8 = 6;
const H_SPEC: u8 = 7;
const H_SDATA: u8 = 8;
const H_CREDIT: u8 = 9;

/// Bytes an eager message counts against its peer's window besides its payload: the share of
/// an unexpected-queue entry and its header.
const EAGER_OVERHEAD: usize = 64;

/// The exact header length of a message of `kind` whose second byte is `flags` (for the kinds
/// that have a flags byte), or `None` for an unknown kind. Every handler's fields are fixed,
/// so a header of any other length is a protocol error, caught before anything is done.
fn header_len(kind: u8, flags: Option<u8>) -> Option<usize> {
    Some(match kind {
        H_EAGER => 10 + if flags? & F_SYNC != 0 { 8 } else { 0 },
        H_RTS => 26 + if flags? & F_REMOTE != 0 { 16 } else { 0 },
        H_CTS => 25,
        H_DATA | H_SDATA => 17,
        H_FIN | H_SACK | H_CREDIT => 9,
        H_SPEC => 26,
        k => return crate::rma::header_len(k),
    })
}

/// Quarantined request ids remembered for dropping their late messages quietly.
const QUARANTINE_MEMORY: usize = 4096;

const F_SYNC: u8 = 1;
const F_REMOTE: u8 = 2;

/// A fixed-size header under construction.
#[derive(Clone, Copy)]
pub(crate) struct Hdr {
    buf: [u8; MIN_AM_HEADER],
    len: u8,
}

impl Hdr {
    pub(crate) fn new(kind: u8) -> Self {
        let mut h = Hdr {
            buf: [0; MIN_AM_HEADER],
            len: 0,
        };
        h.u8(kind);
        h
    }
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf[self.len as usize] = v;
        self.len += 1;
        self
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        let l = self.len as usize;
        self.buf[l..l + 4].copy_from_slice(&v.to_le_bytes());
        self.len += 4;
        self
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        let l = self.len as usize;
        self.buf[l..l + 8].copy_from_slice(&v.to_le_bytes());
        self.len += 8;
        self
    }
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

/// Bounds-checked header reader: a short or garbled header from a peer is an error value.
pub(crate) struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Rd { b, at: 0 }
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        let v = *self.b.get(self.at)?;
        self.at += 1;
        Some(v)
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        let v = self.b.get(self.at..self.at + 4)?;
        self.at += 4;
        Some(u32::from_le_bytes(v.try_into().ok()?))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        let v = self.b.get(self.at..self.at + 8)?;
        self.at += 8;
        Some(u64::from_le_bytes(v.try_into().ok()?))
    }
    /// The next `n` bytes.
    pub(crate) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let v = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(v)
    }
    /// Everything not read yet.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let v = &self.b[self.at.min(self.b.len())..];
        self.at = self.b.len();
        v
    }
    pub(crate) fn remaining(&self) -> usize {
        self.b.len().saturating_sub(self.at)
    }
}

/// The memory layout of a message buffer.
#[derive(Clone, Debug)]
pub(crate) enum Layout {
    Contig,
    Typed(Datatype, usize),
}

/// A send buffer: `len` packed bytes at `base` in `layout`. The creator has checked bounds and
/// the request that holds it borrows the memory until completion.
#[derive(Clone, Debug)]
pub(crate) struct SendBuf {
    pub base: *const u8,
    pub len: usize,
    pub layout: Layout,
}

/// A receive buffer with room for `cap` packed bytes.
#[derive(Clone, Debug)]
pub(crate) struct RecvBuf {
    pub base: *mut u8,
    pub cap: usize,
    pub layout: Layout,
}

impl SendBuf {
    /// iovec pieces for packed bytes `[off, off+len)`, as raw `(ptr, len)`.
    fn pieces(&self, off: usize, len: usize, out: &mut SmallVec<[RawIov; 8]>) {
        match &self.layout {
            Layout::Contig => out.push(RawIov {
                // SAFETY: off+len <= self.len, checked by callers; base..base+len is the
                // borrowed buffer.
                ptr: unsafe { self.base.add(off) },
                len,
            }),
            Layout::Typed(dt, count) => {
                let _ = dt.for_range(*count, off, len, |o, l| {
                    out.push(RawIov {
                        // SAFETY: the datatype's span was checked against the buffer length.
                        ptr: unsafe { self.base.offset(o) },
                        len: l,
                    })
                });
            }
        }
    }

    fn piece_count(&self, max: usize) -> usize {
        match &self.layout {
            Layout::Contig => 1,
            Layout::Typed(dt, count) => {
                let mut n = 0;
                let _ = dt.for_range(*count, 0, self.len, |_, _| n += 1);
                n.min(max + 1)
            }
        }
    }
}

crate::param!(NT_COPY_MIN: Str = "", "NT_COPY_MIN", "auto",
    "messages at least this long are copied into receive buffers with non-temporal stores: a size, 0 (never) or auto (3/4 of one core's share of the last-level cache, glibc's rule)");

/// `WEFT_NT_COPY_MIN` in bytes (`usize::MAX`: never).
fn nt_copy_min_from_env() -> Result<usize> {
    let raw = NT_COPY_MIN.raw();
    let v = raw.trim();
    if v.eq_ignore_ascii_case("auto") {
        return Ok(nt_copy_auto());
    }
    match crate::param::parse_size(v) {
        Some(0) => Ok(usize::MAX),
        Some(n) => Ok(n),
        None => Err(Error::from(ErrorDetail::Param {
            var: NT_COPY_MIN.env_name(),
            value: raw,
            expected: "auto, 0 or a size such as 16M".into(),
        })),
    }
}

/// Streaming stores pay once the destination cannot stay in the cache anyway: from 3/4 of the
/// last-level cache divided among the CPUs that share it (what glibc's memcpy uses for its own
/// non-temporal threshold). Unknown cache: 16 MiB.
fn nt_copy_auto() -> usize {
    // The caches do not change while we run: read sysfs once per process.
    static AUTO: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AUTO.get_or_init(read_nt_copy_auto)
}

fn read_nt_copy_auto() -> usize {
    let dir = "/sys/devices/system/cpu/cpu0/cache";
    let mut best: Option<(u32, usize, usize)> = None; // (level, bytes, sharing CPUs)
    for i in 0..8 {
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/index{i}/{f}")).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let level: u32 = level.trim().parse().unwrap_or(0);
        let Some(bytes) = crate::param::parse_size(size.trim()) else {
            continue;
        };
        let sharing = read("shared_cpu_list").map_or(1, |l| cpu_list_len(l.trim()));
        if best.is_none_or(|(l, ..)| level > l) {
            best = Some((level, bytes, sharing.max(1)));
        }
    }
    match best {
        Some((_, bytes, sharing)) if bytes > 0 => (bytes / sharing) * 3 / 4,
        _ => 16 << 20,
    }
}

/// Number of CPUs in a sysfs CPU list such as `0-3,8,10-11`.
fn cpu_list_len(list: &str) -> usize {
    list.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 1,
            },
            None => 1,
        })
        .sum()
}

/// Copy `src` to `dst` with non-temporal stores where the platform has them.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and not overlap `src`.
unsafe fn copy_nt(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = src.len();
        // Head up to 16-byte alignment of the destination, then 16-byte streaming stores.
        let head = dst.align_offset(16).min(n);
        // SAFETY: both ranges are within the caller's guarantee.
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        let mut i = head;
        while i + 64 <= n {
            for k in 0..4 {
                let at = i + 16 * k;
                // SAFETY: at + 16 <= n; dst + at is 16-byte aligned (head aligned it); SSE2 is
                // part of x86_64.
                let v = _mm_loadu_si128(src.as_ptr().add(at) as *const __m128i);
                _mm_stream_si128(dst.add(at) as *mut __m128i, v);
            }
            i += 64;
        }
        // SAFETY: the tail is within both ranges.
        std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), n - i);
        // Order the streaming stores before whatever publishes completion.
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
}

impl RecvBuf {
    /// Copy `data` to packed offset `off`. Caller guarantees `off + data.len() <= cap`.
    fn write(&self, off: usize, data: &[u8]) {
        debug_assert!(off + data.len() <= self.cap);
        match &self.layout {
            Layout::Contig => {
                // SAFETY: off+len <= cap = the borrowed buffer's length; the request holds the
                // unique borrow, and `data` (provider or unexpected memory) cannot overlap it.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(off), data.len())
                }
            }
            Layout::Typed(dt, count) => {
                let mut at = 0;
                let _ = dt.for_range(*count, off, data.len(), |o, l| {
                    // SAFETY: the datatype's span was checked against the buffer; see above.
                    unsafe {
                        std::ptr::copy_nonoverlapping(data.as_ptr().add(at), self.base.offset(o), l)
                    };
                    at += l;
                });
            }
        }
    }

    /// Like `write`, with non-temporal stores for a contiguous buffer: the bytes go to memory
    /// without first reading the destination lines into the cache (for messages too large to
    /// stay in cache anyway).
    fn write_nt(&self, off: usize, data: &[u8]) {
        match &self.layout {
            // SAFETY: as in `write`: off + len <= cap, the request holds the unique borrow.
            Layout::Contig => unsafe { copy_nt(self.base.add(off), data) },
            Layout::Typed(..) => self.write(off, data),
        }
    }

    fn pieces(&self, len: usize, out: &mut SmallVec<[RawIovMut; 8]>) {
        match &self.layout {
            Layout::Contig => out.push(RawIovMut {
                ptr: self.base,
                len,
            }),
            Layout::Typed(dt, count) => {
                let _ = dt.for_range(*count, 0, len, |o, l| {
                    out.push(RawIovMut {
                        // SAFETY: within the checked span of the borrowed buffer.
                        ptr: unsafe { self.base.offset(o) },
                        len: l,
                    })
                });
            }
        }
    }
}

// ------------------------------------------------------------------------------------ requests

/// Request id: generation in bits 32..63, slot in the low 32. Bit 63 is never set (it marks
/// RMA tokens, see `rma::RMA_TOKEN`) and no id is 0 (which the C ABI reads as "no token").
pub(crate) type ReqId = u64;

/// Largest slot generation: a slot whose generation reaches it is retired instead of reused,
/// so an id is never issued twice and never has bit 63 set.
const MAX_GEN: u32 = 0x7fff_ffff;

#[derive(Debug)]
enum SendPhase {
    Queued,
    WaitAck,
    WaitCts,
    Stream {
        rreq: u64,
        off: usize,
        len: usize,
    },
    WaitFin,
    /// Speculative rendezvous: `off` bytes written (the `SPEC` frame is in the outbox while
    /// 0); `acked` once the receiver's `SACK` says its receive matched.
    Spec {
        off: usize,
        acked: bool,
    },
}

#[derive(Debug)]
struct SendReq {
    dest: Rank,
    ctx: u32,
    tag: i32,
    buf: SendBuf,
    sync: bool,
    phase: SendPhase,
    /// Registration of the send buffer for a receiver-side RMA read (rare: boxed).
    mr: Option<Box<MemRegion>>,
}

#[derive(Debug)]
enum RecvPhase {
    Posted(PostedHandle),
    Stream {
        got: usize,
        expect: usize,
        total: usize,
        src: Rank,
        tag: i32,
    },
    Reading {
        len: usize,
        total: usize,
        src: Rank,
        tag: i32,
        sreq: u64,
        remote: RemoteAddr,
        issued: bool,
    },
}

#[derive(Debug)]
struct RecvReq {
    src: Option<Rank>,
    buf: RecvBuf,
    phase: RecvPhase,
}

#[derive(Debug)]
enum Kind {
    Send(SendReq),
    Recv(RecvReq),
    /// A send handed to the provider's native tagged messaging (`tmp` holds packed data).
    NSend {
        dest: Rank,
        _tmp: Option<Vec<u8>>,
    },
    /// A receive handed to the provider (`tmp` receives packed data to unpack at the end).
    NRecv {
        src: Option<Rank>,
        buf: RecvBuf,
        tmp: Option<Vec<u8>>,
    },
}

#[derive(Debug)]
struct Req {
    scope: u64,
    done: Option<Result<Status>>,
    kind: Kind,
}

struct Slot {
    gen: u32,
    req: Option<Req>,
}

#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    free: Vec<u32>,
    live: usize,
}

impl Slab {
    fn insert(&mut self, r: Req) -> ReqId {
        self.live += 1;
        if let Some(i) = self.free.pop() {
            let s = &mut self.slots[i as usize];
            // `remove` frees only slots whose generation can still grow.
            s.gen += 1;
            s.req = Some(r);
            ((s.gen as u64) << 32) | i as u64
        } else {
            self.slots.push(Slot {
                gen: 1,
                req: Some(r),
            });
            (1u64 << 32) | (self.slots.len() - 1) as u64
        }
    }

    fn get_mut(&mut self, id: ReqId) -> Option<&mut Req> {
        let s = self.slots.get_mut((id & 0xffff_ffff) as usize)?;
        if s.gen as u64 != id >> 32 {
            return None;
        }
        s.req.as_mut()
    }

    fn get(&self, id: ReqId) -> Option<&Req> {
        let s = self.slots.get((id & 0xffff_ffff) as usize)?;
        if s.gen as u64 != id >> 32 {
            return None;
        }
        s.req.as_ref()
    }

    fn remove(&mut self, id: ReqId) -> Option<Req> {
        let i = (id & 0xffff_ffff) as usize;
        let s = self.slots.get_mut(i)?;
        if s.gen as u64 != id >> 32 || s.req.is_none() {
            return None;
        }
        self.live -= 1;
        // A slot at the last generation is retired (a few bytes per 2^31 uses of one slot),
        // so a late completion for an old id can never reach a new request.
        if s.gen < MAX_GEN {
            self.free.push(i as u32);
        }
        s.req.take()
    }

    fn ids(&self) -> Vec<ReqId> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.req.is_some())
            .map(|(i, s)| ((s.gen as u64) << 32) | i as u64)
            .collect()
    }
}

/// What an unexpected message carries.
enum Unexp {
    Eager {
        data: Vec<u8>,
        sreq: Option<u64>,
    },
    Rts {
        total: usize,
        sreq: u64,
        remote: Option<RemoteAddr>,
    },
    /// A speculative message being staged (its data is in `State::spec_staged`).
    Spec {
        total: usize,
        sreq: u64,
    },
}

/// An unexpected speculative message's data, as far as it has arrived.
struct Staged {
    src: Rank,
    sreq: u64,
    total: usize,
    data: Vec<u8>,
}

pub(crate) enum Out {
    /// A queued eager send; header and payload come from the request.
    Eager(ReqId),
    Ctrl(Hdr),
    /// Header and an owned payload (RMA replies, aggregated batches).
    Owned(Hdr, Vec<u8>),
    /// Header and a payload in memory that stays valid until the message is sent: RMA origin
    /// buffers, borrowed by their epoch, which drains the outbox before it ends; and window
    /// memory that a GET reply is read from as the outbox drains (so a large get costs no
    /// copy of the window at the target). Whoever ends that validity first turns the
    /// payloads into copies (`State::own_raw_payloads`, `State::own_raw_to`).
    Raw(Hdr, RawIov),
    /// The `SPEC` frame of a speculative rendezvous send (header and first chunk).
    Spec(ReqId),
}

/// Result of posting an operation.
#[derive(Debug)]
pub(crate) enum Posted {
    /// Finished during the call (e.g. an eager send the provider took).
    Done(Result<Status>),
    Pending(ReqId),
}

/// Engine settings, from the core parameters.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Messages up to this size go eagerly (capped by the provider's payload limit).
    pub eager_limit: Option<usize>,
    /// DATA for receives at least this long is copied with non-temporal stores
    /// (`usize::MAX`: never).
    pub nt_copy_min: usize,
    /// Bound on every blocking wait; `None` waits forever.
    pub timeout: Option<Duration>,
    /// Empty progress rounds before a waiter starts yielding the CPU.
    pub spin: u32,
    /// Rendezvous messages up to this size send their data speculatively (`None`: 4 MiB on
    /// providers that span hosts and cannot read remote memory, else off).
    pub spec_limit: Option<usize>,
    /// Unexpected speculative data a rank stages for later receives, in bytes; beyond it the
    /// data is dropped and asked for again.
    pub spec_buffer: usize,
    /// Speculate also behind data already queued or streaming to the same peer (by default
    /// only onto an idle link: behind other data the `RTS`/`CTS` round trip overlaps that data).
    pub spec_behind: bool,
    /// Eager bytes a rank may have sent to one peer that the peer has not matched yet; beyond
    /// it, messages go by rendezvous until the peer's receives catch up (flow control: what a
    /// peer can make this rank hold in its unexpected queue is bounded by it).
    pub eager_window: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            eager_limit: None,
            nt_copy_min: nt_copy_auto(),
            timeout: None,
            spin: 1000,
            spec_limit: None,
            spec_buffer: 4 << 20,
            spec_behind: false,
            eager_window: 8 << 20,
        }
    }
}

crate::param!(EAGER_LIMIT: Size = "", "EAGER_LIMIT", "0",
    "eager/rendezvous switch-over in bytes (0: the provider's own threshold)");
crate::param!(TIMEOUT: Float = "", "TIMEOUT", "0",
    "seconds any blocking wait may take before it fails with a timeout (0: no limit)");
crate::param!(POLL_SPIN: Uint = "", "POLL_SPIN", "1000",
    "idle progress rounds before a waiting rank starts yielding its core");
crate::param!(SPEC_LIMIT: Str = "", "SPEC_LIMIT", "auto",
    "rendezvous messages up to this size send their data without waiting for the receiver's CTS: a size, 0 (never) or auto (4M on providers that span hosts and cannot read remote memory, else 0)");
crate::param!(SPEC_BEHIND: Bool = "", "SPEC_BEHIND", "0",
    "1: speculate also behind data already queued or streaming to the same peer; 0: only onto an idle link, since behind other data the RTS/CTS round trip is hidden anyway");
crate::param!(EAGER_WINDOW: Size = "", "EAGER_WINDOW", "8M",
    "eager bytes a rank may send to one peer before that peer matches them; beyond, messages go by rendezvous (bounds each peer's share of the receiver's unexpected queue; the same on every rank)");
crate::param!(SPEC_BUFFER: Size = "", "SPEC_BUFFER", "4M",
    "speculative messages that arrive before their receive are held up to this many bytes in all; beyond, their data is dropped and sent again when a receive matches");

/// `WEFT_SPEC_LIMIT`: `None` for auto.
fn spec_limit_from_env() -> Result<Option<usize>> {
    let raw = SPEC_LIMIT.raw();
    let v = raw.trim();
    if v.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    crate::param::parse_size(v).map(Some).ok_or_else(|| {
        Error::from(ErrorDetail::Param {
            var: SPEC_LIMIT.env_name(),
            value: raw,
            expected: "auto, 0 or a size such as 4M".into(),
        })
    })
}

/// Speculation saves the `RTS`/`CTS` round trip: worth it where that trip crosses a network
/// stack (providers that span hosts) and there is no zero-copy read to use instead. Past a
/// few MiB the trip is lost in the transfer time (≈9 µs against 0.2 ms for 1 MiB on loopback
/// TCP), while data that finds no receive and no staging room is sent twice.
fn spec_limit_auto(caps: &Caps) -> usize {
    if caps.spans_hosts && !caps.rma.is_some_and(|r| r.read) {
        4 << 20
    } else {
        0
    }
}

impl EngineConfig {
    /// Read `WEFT_EAGER_LIMIT`, `WEFT_NT_COPY_MIN`, `WEFT_TIMEOUT`, `WEFT_POLL_SPIN`,
    /// `WEFT_SPEC_LIMIT`, `WEFT_SPEC_BUFFER` and `WEFT_SPEC_BEHIND`.
    pub fn from_env() -> Result<Self> {
        let e = EAGER_LIMIT.get_size()?;
        Ok(EngineConfig {
            eager_limit: (e > 0).then_some(e),
            nt_copy_min: nt_copy_min_from_env()?,
            timeout: TIMEOUT.get_seconds(true)?,
            spin: POLL_SPIN.get_u64()?.min(u32::MAX as u64) as u32,
            spec_limit: spec_limit_from_env()?,
            spec_buffer: SPEC_BUFFER.get_size()?,
            spec_behind: SPEC_BEHIND.get_bool()?,
            eager_window: EAGER_WINDOW.get_size()?,
        })
    }
}

/// Core state: everything but the provider. It is the provider's [`Sink`].
pub(crate) struct State {
    pub(crate) size: u32,
    pub(crate) caps: Caps,
    eager_limit: usize,
    /// Rendezvous sends up to this size go speculatively (0: never).
    spec_limit: usize,
    /// Speculate behind other data to the same peer too (`EngineConfig::spec_behind`).
    spec_behind: bool,
    /// Speculative messages this rank matched whose data is still arriving: (source, sender's
    /// request, receive).
    spec_rx: Vec<(Rank, u64, ReqId)>,
    /// Unexpected speculative messages held for a receive (at most `spec_buffer` bytes of
    /// announced length in all); the unexpected queue has a `Unexp::Spec` for each.
    spec_staged: Vec<Staged>,
    pub(crate) spec_staged_bytes: usize,
    /// Buffers of received staged messages, for the next ones (`staging_buf`).
    staging_spare: Vec<Vec<u8>>,
    spec_buffer: usize,
    /// Eager flow control (see `EngineConfig::eager_window`): bytes sent to each peer and not
    /// yet credited back, and bytes received from each peer, matched, not yet credited.
    eager_window: usize,
    eager_out: Vec<usize>,
    eager_in: Vec<usize>,
    /// Bytes of eager payload waiting in the unexpected queue (diagnostics).
    pub(crate) unexpected_bytes: usize,
    nt_copy_min: usize,
    chunk: usize,
    rma_read: bool,
    reqs: Slab,
    matcher: Matcher<ReqId, Unexp>,
    outq: Vec<VecDeque<Out>>,
    out_pending: Vec<Rank>,
    out_flag: Vec<bool>,
    streams: Vec<ReqId>,
    reads: Vec<ReqId>,
    deregs: Vec<MemRegion>,
    failed: Vec<Option<String>>,
    nfailed: u32,
    pub(crate) rma: crate::rma::RmaState,
    /// Finalize passed its barrier: peers going away now is expected.
    pub(crate) closing: bool,
    scratch: Vec<u8>,
    /// Requests given up by [`Engine::quarantine`] (the most recent ones): what still arrives
    /// for them is dropped quietly instead of being taken for a peer's protocol error.
    quarantined: VecDeque<ReqId>,
    /// Peers that sent something malformed: failed, and nothing more from them is taken.
    rogue: Vec<bool>,
    /// The provider reported something impossible (a message from outside the world):
    /// `progress` fails with this.
    provider_fault: Option<String>,
    /// Scratch for applying active-message accumulates to a copy of window bytes.
    pub(crate) scratch_acc: Vec<u8>,
    /// Small payload buffers kept for reuse: of sent `Out::Owned` messages (RMA replies,
    /// batches) and of unexpected eager messages once received, which would otherwise cost an
    /// allocation each.
    spare: crate::BufPool,
}

/// The engine: a provider plus the core state.
pub(crate) struct Engine<P: Provider> {
    pub(crate) p: P,
    pub(crate) st: State,
    pub(crate) cfg: EngineConfig,
}

fn status(source: Rank, tag: i32, bytes: usize) -> Status {
    Status {
        source,
        tag,
        bytes,
        cancelled: false,
    }
}

fn recv_result(st: Status, cap: usize) -> Result<Status> {
    if st.bytes > cap {
        Err(Error::from(ErrorDetail::Truncated {
            status: st,
            capacity: cap,
        }))
    } else {
        Ok(st)
    }
}

impl<P: Provider> Engine<P> {
    pub(crate) fn new(p: P, cfg: EngineConfig) -> Result<Self> {
        let caps = p.caps().clone();
        if caps.max_am_header < MIN_AM_HEADER {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "provider '{}' offers {}-byte active-message headers; weft needs {MIN_AM_HEADER}",
                p.name(),
                caps.max_am_header
            ))));
        }
        if caps.max_am_payload == 0 || caps.max_iov == 0 {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "provider '{}' declares no active-message payload",
                p.name()
            ))));
        }
        let size = p.size();
        let eager_limit = cfg
            .eager_limit
            .unwrap_or(caps.eager_limit)
            .min(caps.max_am_payload);
        // The zero-copy rendezvous registers the sender's buffer: user memory.
        let rma_read = caps.rma.is_some_and(|r| r.read && r.user_memory);
        let spec_limit = cfg.spec_limit.unwrap_or_else(|| spec_limit_auto(&caps));
        let st = State {
            size,
            eager_limit,
            spec_limit,
            spec_behind: cfg.spec_behind,
            spec_rx: Vec::new(),
            spec_staged: Vec::new(),
            spec_staged_bytes: 0,
            staging_spare: Vec::new(),
            spec_buffer: cfg.spec_buffer,
            eager_window: cfg.eager_window.max(2 * (eager_limit + EAGER_OVERHEAD)),
            eager_out: vec![0; size as usize],
            eager_in: vec![0; size as usize],
            unexpected_bytes: 0,
            nt_copy_min: cfg.nt_copy_min,
            chunk: caps.max_am_payload,
            rma_read,
            caps,
            reqs: Slab::default(),
            matcher: Matcher::new(),
            outq: (0..size).map(|_| VecDeque::new()).collect(),
            out_pending: Vec::new(),
            out_flag: vec![false; size as usize],
            streams: Vec::new(),
            reads: Vec::new(),
            deregs: Vec::new(),
            failed: vec![None; size as usize],
            nfailed: 0,
            rma: Default::default(),
            closing: false,
            scratch: Vec::new(),
            quarantined: VecDeque::new(),
            rogue: vec![false; size as usize],
            provider_fault: None,
            scratch_acc: Vec::new(),
            // 32 buffers of up to 32 KiB: a small-message epoch's replies and batches.
            spare: crate::BufPool::new(32, 32 << 10),
        };
        Ok(Engine { p, st, cfg })
    }

    fn check_peer(&self, r: Rank) -> Result<()> {
        if r >= self.st.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.st.size,
            }));
        }
        if let Some(why) = &self.st.failed[r as usize] {
            return Err(Error::peer_failed(r, why.clone()));
        }
        Ok(())
    }

    // ------------------------------------------------------------------------------ posting

    pub(crate) fn isend(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        buf: SendBuf,
        sync: bool,
        scope: u64,
    ) -> Result<Posted> {
        self.check_peer(dest)?;
        if self.st.caps.tagged {
            return self.native_send(dest, ctx, tag, buf, sync, scope);
        }
        if buf.len <= self.st.eager_limit && self.st.eager_credit(dest, buf.len) {
            // Fast path: straight to the provider when nothing is queued ahead for `dest`; a
            // plain send then needs no request at all.
            if !sync && self.st.outq[dest as usize].is_empty() {
                let mut h = Hdr::new(H_EAGER);
                h.u8(0).u32(ctx).u32(tag as u32);
                if self.send_eager_now(dest, &h, &buf)? == SendOutcome::Sent {
                    return Ok(Posted::Done(Ok(status(dest, tag, buf.len))));
                }
            }
            let id = self
                .st
                .new_send(scope, dest, ctx, tag, buf, sync, SendPhase::Queued, None);
            self.st.push_out(dest, Out::Eager(id));
            if sync {
                self.flush_out()?;
            }
            return Ok(Posted::Pending(id));
        }
        // Not for `ssend`: a staged message is acknowledged before it matches.
        if buf.len <= self.st.spec_limit && !sync && (self.st.spec_behind || self.st.idle(dest)) {
            let phase = SendPhase::Spec {
                off: 0,
                acked: false,
            };
            let id = self
                .st
                .new_send(scope, dest, ctx, tag, buf, sync, phase, None);
            self.st.push_out(dest, Out::Spec(id));
            self.flush_out()?;
            return Ok(Posted::Pending(id));
        }
        // Rendezvous.
        let mut mr = None;
        if self.st.rma_read && matches!(buf.layout, Layout::Contig) {
            // SAFETY: the send request borrows `buf` until it completes, and completion waits
            // for FIN, sent only after the peer's read finished; we deregister before completing.
            match unsafe {
                self.p
                    .mr_register(buf.base as *mut u8, buf.len, Access::READ)
            } {
                Ok(m) => mr = Some(Box::new(m)),
                // Providers whose RMA reaches only memory they placed (shm windows) cannot
                // register user buffers: stop asking (each refusal costs an error value).
                Err(e) if e.kind() == ErrorKind::Unsupported => {
                    tracing::debug!("rendezvous streams from now on: {e}");
                    self.st.rma_read = false;
                }
                Err(e) => tracing::debug!("registration failed, streaming instead: {e}"),
            }
        }
        let remote = mr.as_ref().map(|m| (m.addr, m.key));
        let phase = if mr.is_some() {
            SendPhase::WaitFin
        } else {
            SendPhase::WaitCts
        };
        let len = buf.len;
        let id = self
            .st
            .new_send(scope, dest, ctx, tag, buf, sync, phase, mr);
        let mut h = Hdr::new(H_RTS);
        h.u8(if remote.is_some() { F_REMOTE } else { 0 })
            .u32(ctx)
            .u32(tag as u32)
            .u64(len as u64)
            .u64(id);
        if let Some((addr, key)) = remote {
            h.u64(addr).u64(key);
        }
        self.st.push_out(dest, Out::Ctrl(h));
        self.flush_out()?;
        Ok(Posted::Pending(id))
    }

    /// Try to hand the `SPEC` frame of speculative send `id` to the provider; once it is taken
    /// the rest of the data streams as `SDATA`.
    fn send_spec_head(&mut self, id: ReqId) -> Result<SendOutcome> {
        let Some(Req {
            kind: Kind::Send(r),
            done: None,
            ..
        }) = self.st.reqs.get(id)
        else {
            // Failed meanwhile: drop it.
            return Ok(SendOutcome::Sent);
        };
        let (buf, dest, len) = (r.buf.clone(), r.dest, r.buf.len);
        let n = len.min(self.st.chunk);
        let mut h = Hdr::new(H_SPEC);
        h.u8(0).u32(r.ctx).u32(r.tag as u32).u64(len as u64).u64(id);
        let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
        buf.pieces(0, n, &mut pieces);
        let o = send_pieces(
            &mut self.p,
            self.st.caps.max_iov,
            &mut self.st.scratch,
            dest,
            h.bytes(),
            &pieces,
        )?;
        if o == SendOutcome::Sent {
            self.st.set_send_phase(
                id,
                SendPhase::Spec {
                    off: n,
                    acked: false,
                },
            );
            if n < len {
                self.st.streams.push(id);
            }
        }
        Ok(o)
    }

    /// Try to hand an eager message to the provider now.
    fn send_eager_now(&mut self, dest: Rank, h: &Hdr, buf: &SendBuf) -> Result<SendOutcome> {
        let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
        buf.pieces(0, buf.len, &mut pieces);
        send_pieces(
            &mut self.p,
            self.st.caps.max_iov,
            &mut self.st.scratch,
            dest,
            h.bytes(),
            &pieces,
        )
    }

    fn native_send(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        buf: SendBuf,
        sync: bool,
        scope: u64,
    ) -> Result<Posted> {
        let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
        let mut tmp = None;
        if buf.piece_count(self.st.caps.max_iov) > self.st.caps.max_iov {
            let mut v = vec![0u8; buf.len];
            gather(&buf, &mut v);
            pieces.push(RawIov {
                ptr: v.as_ptr(),
                len: v.len(),
            });
            tmp = Some(v);
        } else {
            buf.pieces(0, buf.len, &mut pieces);
        }
        let id = self.st.reqs.insert(Req {
            scope,
            done: None,
            kind: Kind::NSend { dest, _tmp: tmp },
        });
        // SAFETY: the pieces point into the user's buffer (borrowed by the request until it
        // completes) or into `tmp`, owned by the request; both outlive the provider's use.
        if let Err(e) = unsafe { self.p.tagged_send(dest, ctx, tag, &pieces, sync, id) } {
            self.st.reqs.remove(id);
            return Err(e);
        }
        Ok(Posted::Pending(id))
    }

    pub(crate) fn irecv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: RecvBuf,
        scope: u64,
    ) -> Result<Posted> {
        // A failed source can still have sent messages that arrived before it failed: they
        // match as usual; only a receive nothing can satisfy fails.
        let dead = match src {
            Some(s) => self.check_peer(s).err(),
            None => None,
        };
        if let Some(e) = dead {
            if e.kind() != ErrorKind::PeerFailed || self.iprobe_local(src, ctx, tag)?.is_none() {
                return Err(e);
            }
        }
        if self.st.caps.tagged {
            return self.native_recv(src, ctx, tag, buf, scope);
        }
        if let Some((msrc, mtag, m)) = self.st.matcher.take_unexpected(ctx, src, tag) {
            match m {
                Unexp::Eager { data, sreq } => {
                    let n = data.len().min(buf.cap);
                    buf.write(0, &data[..n]);
                    let st = status(msrc, mtag, data.len());
                    self.st.unexpected_bytes -= data.len();
                    self.st.eager_consumed(msrc, data.len());
                    self.st.recycle(data);
                    if sreq.is_none() && !self.st.out_pending.is_empty() {
                        self.flush_out()?;
                    }
                    if let Some(s) = sreq {
                        let mut h = Hdr::new(H_SACK);
                        h.u64(s);
                        self.st.push_out(msrc, Out::Ctrl(h));
                        self.flush_out()?;
                    }
                    return Ok(Posted::Done(recv_result(st, buf.cap)));
                }
                Unexp::Rts {
                    total,
                    sreq,
                    remote,
                } => {
                    let id = self.st.reqs.insert(Req {
                        scope,
                        done: None,
                        kind: Kind::Recv(RecvReq {
                            src,
                            buf,
                            phase: RecvPhase::Posted(PostedHandle::dangling()),
                        }),
                    });
                    self.st.start_rndv(id, msrc, mtag, total, sreq, remote);
                    self.issue_reads()?;
                    self.flush_out()?;
                    return Ok(Posted::Pending(id));
                }
                Unexp::Spec { total, sreq } => {
                    return self.recv_staged(msrc, mtag, total, sreq, buf, scope);
                }
            }
        }
        let id = self.st.reqs.insert(Req {
            scope,
            done: None,
            kind: Kind::Recv(RecvReq {
                src,
                buf,
                phase: RecvPhase::Posted(PostedHandle::dangling()),
            }),
        });
        let h = self.st.matcher.post(ctx, src, tag, id);
        if let Some(Req {
            kind: Kind::Recv(r),
            ..
        }) = self.st.reqs.get_mut(id)
        {
            r.phase = RecvPhase::Posted(h);
        }
        Ok(Posted::Pending(id))
    }

    /// A receive matched a staged speculative message: take what arrived; if more is due, it
    /// goes straight into `buf` from now on.
    fn recv_staged(
        &mut self,
        src: Rank,
        tag: i32,
        total: usize,
        sreq: u64,
        buf: RecvBuf,
        scope: u64,
    ) -> Result<Posted> {
        let st = &mut self.st;
        let Some(i) = st
            .spec_staged
            .iter()
            .position(|e| e.src == src && e.sreq == sreq)
        else {
            // Released when its sender failed before all of it arrived.
            if let Some(why) = &st.failed[src as usize] {
                return Err(Error::peer_failed(src, why.clone()));
            }
            return Err(Error::malformed(src, "staged speculative message lost"));
        };
        let staged = st.spec_staged.swap_remove(i);
        st.spec_staged_bytes -= staged.total;
        let expect = total.min(buf.cap);
        let have = staged.data.len().min(expect);
        buf.write(0, &staged.data[..have]);
        let complete = staged.data.len() == total;
        st.staging_give(staged.data);
        if complete || have == expect {
            return Ok(Posted::Done(recv_result(status(src, tag, total), buf.cap)));
        }
        if let Some(why) = &st.failed[src as usize] {
            return Err(Error::peer_failed(src, why.clone()));
        }
        let id = st.reqs.insert(Req {
            scope,
            done: None,
            kind: Kind::Recv(RecvReq {
                src: Some(src),
                buf,
                phase: RecvPhase::Stream {
                    got: have,
                    expect,
                    total,
                    src,
                    tag,
                },
            }),
        });
        st.spec_rx.push((src, sreq, id));
        Ok(Posted::Pending(id))
    }

    fn native_recv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: RecvBuf,
        scope: u64,
    ) -> Result<Posted> {
        let mut pieces: SmallVec<[RawIovMut; 8]> = SmallVec::new();
        let count = match &buf.layout {
            Layout::Contig => 1,
            Layout::Typed(dt, c) => dt.iovecs(*c)?.len(),
        };
        let mut tmp = None;
        if count > self.st.caps.max_iov {
            let mut v = vec![0u8; buf.cap];
            pieces.push(RawIovMut {
                ptr: v.as_mut_ptr(),
                len: v.len(),
            });
            tmp = Some(v);
        } else {
            buf.pieces(buf.cap, &mut pieces);
        }
        let id = self.st.reqs.insert(Req {
            scope,
            done: None,
            kind: Kind::NRecv { src, buf, tmp },
        });
        // SAFETY: the pieces point into the user's buffer (uniquely borrowed by the request
        // until it completes or is cancelled) or into the request-owned `tmp` (a Vec whose heap
        // storage does not move when the request moves).
        if let Err(e) = unsafe { self.p.tagged_recv(src, ctx, tag, &pieces, id) } {
            self.st.reqs.remove(id);
            return Err(e);
        }
        Ok(Posted::Pending(id))
    }

    /// Is a matching message waiting? (MPI_Iprobe)
    pub(crate) fn iprobe(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<Status>> {
        if let Some(s) = src {
            if s >= self.st.size {
                self.check_peer(s)?;
            }
        }
        self.progress()?;
        let found = self.iprobe_local(src, ctx, tag)?;
        // Nothing waiting from a source that failed: nothing ever will.
        if let (None, Some(s)) = (&found, src) {
            self.check_peer(s)?;
        }
        Ok(found)
    }

    /// A matching message that has already arrived (no progress, no liveness check).
    fn iprobe_local(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<Status>> {
        if self.st.caps.tagged {
            return Ok(self
                .p
                .tagged_probe(src, ctx, tag)?
                .map(|t| status(t.source, t.tag, t.bytes)));
        }
        Ok(self
            .st
            .matcher
            .peek_unexpected(ctx, src, tag)
            .map(|(s, t, m)| {
                let bytes = match m {
                    Unexp::Eager { data, .. } => data.len(),
                    Unexp::Rts { total, .. } | Unexp::Spec { total, .. } => *total,
                };
                status(s, t, bytes)
            }))
    }

    // ------------------------------------------------------------------------------ progress

    /// One round: provider arrivals, then queued sends, streams and RMA reads.
    pub(crate) fn progress(&mut self) -> Result<usize> {
        let mut n = self.p.progress(&mut self.st)?;
        if let Some(why) = &self.st.provider_fault {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "provider '{}' is broken: it {why}",
                self.p.name()
            ))));
        }
        if !self.st.out_pending.is_empty() || !self.st.streams.is_empty() {
            n += self.flush_out()?;
        }
        if !self.st.reads.is_empty() {
            n += self.issue_reads()?;
        }
        while let Some(m) = self.st.deregs.pop() {
            if let Err(e) = self.p.mr_deregister(&m) {
                tracing::warn!("deregistration failed: {e}");
            }
        }
        Ok(n)
    }

    /// Send queued messages in per-destination order, then advance rendezvous streams.
    ///
    /// A send the provider refuses with an error fails what it belongs to, never the queue: a
    /// user's message fails its request; a protocol message (a reply, a handshake), whose loss
    /// would leave this rank or the peer waiting, fails the peer. Either way the queue moves on.
    pub(crate) fn flush_out(&mut self) -> Result<usize> {
        let mut sent = 0;
        let mut i = 0;
        while i < self.st.out_pending.len() {
            let dest = self.st.out_pending[i];
            let mut blocked = false;
            while let Some(item) = self.st.outq[dest as usize].front() {
                let tried = match item {
                    Out::Ctrl(h) => {
                        let h = *h;
                        self.p.am_send(dest, h.bytes(), &[])
                    }
                    Out::Owned(h, data) => self.p.am_send(dest, h.bytes(), &[IoSlice::new(data)]),
                    Out::Raw(h, r) => {
                        // SAFETY: see `Out::Raw`: the memory outlives the queued message.
                        let data = unsafe { raw_slice(r) };
                        self.p.am_send(dest, h.bytes(), &[IoSlice::new(data)])
                    }
                    Out::Spec(id) => {
                        let id = *id;
                        self.send_spec_head(id)
                    }
                    Out::Eager(id) => {
                        let id = *id;
                        match self.st.reqs.get(id) {
                            Some(Req {
                                kind: Kind::Send(r),
                                done: None,
                                ..
                            }) => {
                                let mut h = Hdr::new(H_EAGER);
                                h.u8(if r.sync { F_SYNC } else { 0 })
                                    .u32(r.ctx)
                                    .u32(r.tag as u32);
                                if r.sync {
                                    h.u64(id);
                                }
                                let (buf, sync, rdest, tag) =
                                    (r.buf.clone(), r.sync, r.dest, r.tag);
                                let o = self.send_eager_now(rdest, &h, &buf);
                                if o.as_ref().is_ok_and(|o| *o == SendOutcome::Sent) {
                                    if sync {
                                        self.st.set_send_phase(id, SendPhase::WaitAck);
                                    } else {
                                        self.st.finish(id, Ok(status(rdest, tag, buf.len)));
                                    }
                                }
                                o
                            }
                            // Failed or cancelled meanwhile: drop it.
                            _ => Ok(SendOutcome::Sent),
                        }
                    }
                };
                let outcome = match tried {
                    Ok(o) => o,
                    Err(e) => {
                        self.send_failed(dest, e);
                        if self.st.outq[dest as usize].is_empty() {
                            break;
                        }
                        continue;
                    }
                };
                if outcome == SendOutcome::Busy {
                    blocked = true;
                    break;
                }
                if let Some(Out::Owned(_, data)) = self.st.outq[dest as usize].pop_front() {
                    self.st.recycle(data);
                }
                sent += 1;
            }
            if blocked {
                i += 1;
            } else {
                self.st.out_flag[dest as usize] = false;
                self.st.out_pending.swap_remove(i);
            }
        }
        sent += self.pump_streams()?;
        Ok(sent)
    }

    /// The provider refused the message at the head of `dest`'s queue with `e`: drop it and
    /// fail what it belongs to (see `flush_out`).
    fn send_failed(&mut self, dest: Rank, e: Error) {
        let Some(item) = self.st.outq[dest as usize].pop_front() else {
            return;
        };
        match item {
            Out::Eager(id) | Out::Spec(id) if e.kind() != ErrorKind::PeerFailed => {
                tracing::debug!(peer = dest, "a send failed: {e}");
                self.st.finish(id, Err(e));
            }
            other => {
                if let Out::Owned(_, data) = other {
                    self.st.recycle(data);
                }
                let why = match e.detail() {
                    ErrorDetail::PeerFailed { reason, .. } => reason.clone(),
                    _ => format!("sending to it failed: {e}"),
                };
                self.st.fail_peer(dest, &why);
            }
        }
    }

    /// Advance the data of rendezvous sends: `DATA` after a `CTS`, `SDATA` of speculative ones.
    fn pump_streams(&mut self) -> Result<usize> {
        let mut sent = 0;
        let mut i = 0;
        while i < self.st.streams.len() {
            let id = self.st.streams[i];
            // `rreq`: the receive a CTS named; `None` while speculating.
            let (dest, rreq, mut off, len, buf) = match self.st.reqs.get(id) {
                Some(Req {
                    kind: Kind::Send(s),
                    done: None,
                    ..
                }) => match s.phase {
                    SendPhase::Stream { rreq, off, len } => {
                        (s.dest, Some(rreq), off, len, s.buf.clone())
                    }
                    SendPhase::Spec { off, .. } if off > 0 && off < s.buf.len => {
                        (s.dest, None, off, s.buf.len, s.buf.clone())
                    }
                    _ => {
                        self.st.streams.swap_remove(i);
                        continue;
                    }
                },
                _ => {
                    self.st.streams.swap_remove(i);
                    continue;
                }
            };
            while off < len {
                let n = (len - off).min(self.st.chunk);
                let mut h = match rreq {
                    Some(r) => {
                        let mut h = Hdr::new(H_DATA);
                        h.u64(r);
                        h
                    }
                    None => {
                        let mut h = Hdr::new(H_SDATA);
                        h.u64(id);
                        h
                    }
                };
                h.u64(off as u64);
                let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
                buf.pieces(off, n, &mut pieces);
                let max_iov = self.st.caps.max_iov;
                match send_pieces(
                    &mut self.p,
                    max_iov,
                    &mut self.st.scratch,
                    dest,
                    h.bytes(),
                    &pieces,
                ) {
                    Ok(SendOutcome::Sent) => {
                        off += n;
                        sent += 1;
                    }
                    Ok(SendOutcome::Busy) => break,
                    Err(e) => {
                        // The stream cannot go on: its send fails (and with it the peer, whose
                        // receive would otherwise wait for the rest).
                        self.st.finish(id, Err(e.clone()));
                        let why = match e.detail() {
                            ErrorDetail::PeerFailed { reason, .. } => reason.clone(),
                            _ => format!("sending to it failed: {e}"),
                        };
                        self.st.fail_peer(dest, &why);
                        break;
                    }
                }
            }
            let mut finished = false;
            if let Some(Req {
                kind: Kind::Send(s),
                ..
            }) = self.st.reqs.get_mut(id)
            {
                match &mut s.phase {
                    SendPhase::Stream { off: o, .. } => {
                        *o = off;
                        finished = off >= len;
                    }
                    SendPhase::Spec { off: o, acked } => {
                        *o = off;
                        // Written, but the buffer is still needed if a CTS comes instead.
                        finished = off >= len && *acked;
                    }
                    _ => {}
                }
            }
            if finished {
                let tag = match self.st.reqs.get(id) {
                    Some(Req {
                        kind: Kind::Send(s),
                        ..
                    }) => s.tag,
                    _ => 0,
                };
                self.st.finish(id, Ok(status(dest, tag, len)));
            }
            if off >= len {
                self.st.streams.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(sent)
    }

    fn issue_reads(&mut self) -> Result<usize> {
        let mut n = 0;
        let reads = std::mem::take(&mut self.st.reads);
        for id in reads {
            let Some(Req {
                kind:
                    Kind::Recv(RecvReq {
                        buf,
                        phase:
                            RecvPhase::Reading {
                                len,
                                src,
                                remote,
                                issued,
                                ..
                            },
                        ..
                    }),
                done: None,
                ..
            }) = self.st.reqs.get_mut(id)
            else {
                continue;
            };
            *issued = true;
            let mut pieces: SmallVec<[RawIovMut; 8]> = SmallVec::new();
            buf.pieces(*len, &mut pieces);
            let (src, remote) = (*src, *remote);
            // SAFETY: the receive request uniquely borrows the buffer until it completes, which
            // happens only when the provider reports this token (or the peer fails).
            if let Err(e) = unsafe { self.p.rma_read(src, &pieces, remote, Completion::cq(id)) } {
                self.st.complete(id, Err(e));
            }
            n += 1;
        }
        Ok(n)
    }

    // ------------------------------------------------------------------------------ completion

    /// The result of a finished request, freeing it; `None` if still running.
    pub(crate) fn try_take(&mut self, id: ReqId) -> Option<Result<Status>> {
        match self.st.reqs.get(id) {
            Some(Req { done: Some(_), .. }) => self.st.reqs.remove(id).and_then(|r| r.done),
            Some(_) => None,
            None => Some(Err(Error::invalid("request already completed"))),
        }
    }

    pub(crate) fn test(&mut self, id: ReqId) -> Result<Option<Result<Status>>> {
        if let Some(r) = self.try_take(id) {
            return Ok(Some(r));
        }
        self.progress()?;
        Ok(self.try_take(id))
    }

    /// Spin on progress until `done(self)` holds, yielding the CPU after `cfg.spin` idle rounds,
    /// and failing after `cfg.timeout`.
    pub(crate) fn wait_until(
        &mut self,
        what: &str,
        mut done: impl FnMut(&mut Self) -> bool,
    ) -> Result<()> {
        let mut idle = 0u32;
        let mut rounds = 0u32;
        let start = self.cfg.timeout.map(|t| (Instant::now(), t));
        loop {
            if done(self) {
                return Ok(());
            }
            let n = self.progress()?;
            if n == 0 {
                idle = idle.saturating_add(1);
                if idle > self.cfg.spin {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                idle = 0;
            }
            rounds = rounds.wrapping_add(1);
            if rounds % 256 == 0 {
                if let Some((t0, limit)) = start {
                    if t0.elapsed() > limit {
                        return Err(Error::from(ErrorDetail::Timeout {
                            what: what.to_string(),
                            secs: limit.as_secs_f64(),
                        }));
                    }
                }
            }
        }
    }

    /// Wait for request `id`. If the wait itself fails (timeout, provider error) the request
    /// is quarantined: it gives up its buffer before the error is returned.
    pub(crate) fn wait(&mut self, id: ReqId) -> Result<Status> {
        let mut out = None;
        if let Err(e) = self.wait_until("a request", |e| {
            out = e.try_take(id);
            out.is_some()
        }) {
            self.quarantine(id);
            return Err(e);
        }
        out.expect("set when done")
    }

    /// Wait for request `id`, or until a rank that `member` accepts has failed (then `id` is
    /// given up and the error names that rank).
    pub(crate) fn wait_or_member_failed(
        &mut self,
        id: ReqId,
        member: impl Fn(Rank) -> bool,
    ) -> Result<Status> {
        let mut out = None;
        let mut dead = None;
        let waited = self.wait_until("a collective operation", |e| {
            out = e.try_take(id);
            if out.is_some() {
                return true;
            }
            if e.st.nfailed > 0 {
                dead = (0..e.st.size).find(|r| member(*r) && e.st.failed[*r as usize].is_some());
            }
            dead.is_some()
        });
        if let Err(e) = waited {
            self.quarantine(id);
            return Err(e);
        }
        if let Some(r) = out {
            return r;
        }
        let _ = self.cancel(id);
        self.quarantine(id);
        let r = dead.expect("set when the wait ended without the request");
        let why = self.st.failed[r as usize].clone().unwrap_or_default();
        Err(Error::peer_failed(
            r,
            format!("a member of the collective: {why}"),
        ))
    }

    /// Give up request `id` without waiting for it: once this returns, nothing writes into its
    /// buffer or reads from it, so the caller may free the memory.
    ///
    /// Where the engine performs every access itself (the active-message protocols), the
    /// request is dropped and whatever still arrives for it is discarded. Where the provider
    /// holds a pointer into the buffer that it cannot hand back (a native send or a matched
    /// native receive, an RMA read in flight), no safe way remains but to end the process, as
    /// MPI's default error handler does: waiting longer is a hang, and returning would let the
    /// provider write into memory the caller is about to free.
    pub(crate) fn quarantine(&mut self, id: ReqId) {
        let held = match self.st.reqs.get(id) {
            None => return,
            Some(Req { done: Some(_), .. }) => {
                self.st.reqs.remove(id);
                return;
            }
            Some(Req { kind, .. }) => match kind {
                Kind::NSend { .. } => Some("a send whose buffer the provider may still read"),
                Kind::NRecv { .. } => match self.p.tagged_cancel(id) {
                    Ok(true) => None,
                    _ => Some("a matched receive the provider may still write into"),
                },
                Kind::Recv(RecvReq {
                    phase: RecvPhase::Reading { issued: true, .. },
                    ..
                }) => Some("an RMA read the provider is still performing into a receive buffer"),
                _ => None,
            },
        };
        if let Some(what) = held {
            fatal(self.p.rank(), what);
        }
        let Some(req) = self.st.reqs.remove(id) else {
            return;
        };
        match req.kind {
            Kind::Recv(r) => match r.phase {
                RecvPhase::Posted(h) => {
                    self.st.matcher.cancel(h);
                }
                RecvPhase::Stream { .. } => self.st.spec_done(id),
                RecvPhase::Reading { .. } => {}
            },
            Kind::Send(s) => {
                // The receiver may hold the key for a read: revoke it now.
                if let Some(m) = s.mr {
                    if let Err(e) = self.p.mr_deregister(&m) {
                        tracing::warn!("deregistration failed: {e}");
                    }
                }
            }
            Kind::NSend { .. } | Kind::NRecv { .. } => {}
        }
        self.st.note_quarantined(id);
    }

    pub(crate) fn is_done(&self, id: ReqId) -> bool {
        !matches!(self.st.reqs.get(id), Some(Req { done: None, .. }))
    }

    /// Cancel a receive that has not matched (MPI_Cancel). A send, or a receive that already
    /// matched, is left to complete normally.
    pub(crate) fn cancel(&mut self, id: ReqId) -> Result<()> {
        let Some(req) = self.st.reqs.get_mut(id) else {
            return Ok(());
        };
        if req.done.is_some() {
            return Ok(());
        }
        match &req.kind {
            Kind::Recv(RecvReq {
                phase: RecvPhase::Posted(h),
                ..
            }) => {
                let h = *h;
                if self.st.matcher.cancel(h).is_some() {
                    self.st.finish(id, Ok(cancelled_status()));
                }
                Ok(())
            }
            Kind::NRecv { .. } => {
                if self.p.tagged_cancel(id)? {
                    self.st.finish(id, Ok(cancelled_status()));
                }
                Ok(())
            }
            Kind::Recv(_) => Ok(()),
            _ => Err(Error::invalid("only receives can be cancelled")),
        }
    }

    /// Complete every request of `scope` (receives that have not matched are cancelled). If a
    /// wait fails, the scope's remaining requests are quarantined without waiting (each would
    /// fail the same way), so the scope's buffers may go away when this returns, in any case.
    pub(crate) fn drain_scope(&mut self, scope: u64) -> Result<()> {
        if self.st.reqs.live == 0 {
            return Ok(());
        }
        let ids: Vec<ReqId> = self
            .st
            .reqs
            .ids()
            .into_iter()
            .filter(|id| self.st.reqs.get(*id).is_some_and(|r| r.scope == scope))
            .collect();
        let mut first_err = None;
        let mut broken = false;
        for id in ids {
            if broken {
                self.quarantine(id);
                continue;
            }
            let is_recv = matches!(
                self.st.reqs.get(id).map(|r| &r.kind),
                Some(Kind::Recv(_) | Kind::NRecv { .. })
            );
            if is_recv {
                let _ = self.cancel(id);
            }
            let mut out = None;
            match self.wait_until("a request at the end of its scope", |e| {
                out = e.try_take(id);
                out.is_some()
            }) {
                Ok(()) => {
                    if let Some(Err(e)) = out {
                        first_err.get_or_insert(e);
                    }
                }
                Err(e) => {
                    self.quarantine(id);
                    broken = true;
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Give up RMA operations whose completion wait failed (see [`Engine::quarantine`]):
    /// queued messages that still point at origin buffers get a copy of their data, and
    /// replies that arrive later for `tokens` are dropped. `native_outstanding`: the provider
    /// may still be performing native operations into this window's buffers, which only
    /// ending the process can stop.
    pub(crate) fn quarantine_rma(&mut self, tokens: &[u64], native_outstanding: bool) {
        self.st.own_raw_payloads();
        let native = tokens.iter().any(|t| {
            matches!(
                self.st.rma.waits.get(t),
                Some(crate::rma::Wait::Native { done: false, .. })
            )
        });
        if native || native_outstanding {
            fatal(
                self.p.rank(),
                "native RMA operations were still in flight into the epoch's buffers",
            );
        }
        for &t in tokens {
            let _ = self.st.rma.take(t);
            self.st.note_quarantined(t);
        }
    }

    /// Wait until nothing is queued for sending (used before shutdown).
    pub(crate) fn quiesce(&mut self) -> Result<()> {
        self.wait_until("outgoing messages to drain", |e| {
            e.st.out_pending.is_empty() && e.st.streams.is_empty()
        })
    }

    /// Number of live requests (diagnostics, tests).
    pub(crate) fn live_requests(&self) -> usize {
        self.st.reqs.live
    }
}

/// End the process because `what` cannot be released safely (see [`Engine::quarantine`]).
pub(crate) fn fatal(rank: Rank, what: &str) -> ! {
    let msg = format!(
        "weft: rank {rank}: fatal: a wait failed while {what}; ending the process so that no \
         memory it no longer owns can be written (raise WEFT_TIMEOUT if the peer is only slow)"
    );
    tracing::error!("{msg}");
    eprintln!("{msg}");
    std::process::exit(1)
}

fn cancelled_status() -> Status {
    Status {
        source: 0,
        tag: 0,
        bytes: 0,
        cancelled: true,
    }
}

/// Copy a send buffer's packed bytes into `out`.
fn gather(buf: &SendBuf, out: &mut [u8]) {
    let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
    buf.pieces(0, buf.len, &mut pieces);
    let mut at = 0;
    for p in pieces {
        // SAFETY: pieces lie within the borrowed send buffer (bounds checked at creation).
        let s = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
        out[at..at + p.len].copy_from_slice(s);
        at += p.len;
    }
}

/// Send header + pieces, packing into `scratch` when there are more pieces than the provider's
/// iovec limit.
fn send_pieces<P: Provider>(
    p: &mut P,
    max_iov: usize,
    scratch: &mut Vec<u8>,
    dest: Rank,
    hdr: &[u8],
    pieces: &[RawIov],
) -> Result<SendOutcome> {
    if pieces.len() <= max_iov && pieces.len() <= 8 {
        let mut iov: SmallVec<[IoSlice<'_>; 8]> = SmallVec::new();
        for pc in pieces {
            // SAFETY: each piece lies within a buffer borrowed by a live request (or is empty).
            iov.push(IoSlice::new(unsafe { raw_slice(pc) }));
        }
        return p.am_send(dest, hdr, &iov);
    }
    if pieces.len() <= max_iov {
        let iov: Vec<IoSlice<'_>> = pieces
            .iter()
            // SAFETY: as above.
            .map(|pc| IoSlice::new(unsafe { raw_slice(pc) }))
            .collect();
        return p.am_send(dest, hdr, &iov);
    }
    scratch.clear();
    for pc in pieces {
        // SAFETY: as above.
        scratch.extend_from_slice(unsafe { raw_slice(pc) });
    }
    p.am_send(dest, hdr, &[IoSlice::new(scratch)])
}

/// # Safety
/// `pc` must describe readable memory that stays valid for the returned lifetime.
unsafe fn raw_slice<'a>(pc: &RawIov) -> &'a [u8] {
    if pc.len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(pc.ptr, pc.len)
    }
}

// ---------------------------------------------------------------------------------- handlers

impl State {
    /// Turn every queued message whose payload points into user or window memory (`Out::Raw`)
    /// into one that owns a copy: before an epoch gives up its buffers, and before a window
    /// goes away.
    pub(crate) fn own_raw_payloads(&mut self) {
        for d in 0..self.outq.len() as Rank {
            self.own_raw_to(d);
        }
    }

    /// Like `own_raw_payloads`, for the messages queued to `dest` only: before `dest`'s access
    /// epoch on one of our windows ends (UNLOCK, COMPLETE), the GET replies still queued for it
    /// must hold the data the window had during the epoch.
    pub(crate) fn own_raw_to(&mut self, dest: Rank) {
        let Some(q) = self.outq.get_mut(dest as usize) else {
            return;
        };
        for o in q.iter_mut() {
            if let Out::Raw(h, r) = o {
                // Pooled buffers: a batch that carries a get and its epoch's end does this
                // every epoch (they return to the pool once sent).
                let mut data = self.spare.take();
                // SAFETY: see `Out::Raw`: the memory is valid until the message is sent or
                // this conversion runs, whichever comes first.
                data.extend_from_slice(unsafe { raw_slice(r) });
                *o = Out::Owned(*h, data);
            }
        }
    }

    /// An empty buffer for `total` bytes of staged speculative data, reusing one a received
    /// staged message gave back: whether a speculative message finds its receive posted is a
    /// matter of timing, and a loaded machine would otherwise allocate one per message.
    fn staging_buf(&mut self, total: usize) -> Vec<u8> {
        let mut v = match self
            .staging_spare
            .iter()
            .position(|b| b.capacity() >= total)
        {
            Some(i) => self.staging_spare.swap_remove(i),
            None => self.staging_spare.pop().unwrap_or_default(),
        };
        v.clear();
        v.reserve(total);
        v
    }

    /// Keep a staging buffer for reuse (a few, together within `WEFT_SPEC_BUFFER`).
    fn staging_give(&mut self, v: Vec<u8>) {
        let kept: usize = self.staging_spare.iter().map(Vec::capacity).sum();
        if self.staging_spare.len() < 4 && kept + v.capacity() <= self.spec_buffer {
            self.staging_spare.push(v);
        }
    }

    /// Take `len` bytes of eager credit towards `dest`, if its window has room.
    #[inline]
    fn eager_credit(&mut self, dest: Rank, len: usize) -> bool {
        let out = &mut self.eager_out[dest as usize];
        let cost = len + EAGER_OVERHEAD;
        if *out + cost > self.eager_window {
            return false;
        }
        *out += cost;
        true
    }

    /// An eager message of `len` bytes from `src` was matched: return the credit once half a
    /// window has gathered (one small message per half window).
    #[inline]
    fn eager_consumed(&mut self, src: Rank, len: usize) {
        let got = &mut self.eager_in[src as usize];
        *got += len + EAGER_OVERHEAD;
        if *got >= self.eager_window / 2 {
            let mut h = Hdr::new(H_CREDIT);
            h.u64(*got as u64);
            *got = 0;
            self.push_out(src, Out::Ctrl(h));
        }
    }

    fn on_credit(&mut self, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let n = usize::try_from(rd.u64()?).ok()?;
        let out = &mut self.eager_out[src as usize];
        if n > *out {
            self.malformed(src, "credit for more eager bytes than were sent");
            return Some(());
        }
        *out -= n;
        Some(())
    }

    /// Bytes of payload copies waiting in the outbox (diagnostics).
    pub(crate) fn queued_copies(&self) -> usize {
        self.outq
            .iter()
            .flatten()
            .map(|o| match o {
                Out::Owned(_, d) => d.len(),
                _ => 0,
            })
            .sum()
    }

    /// Remember a quarantined request (bounded: the oldest are forgotten).
    fn note_quarantined(&mut self, id: ReqId) {
        if self.quarantined.len() >= QUARANTINE_MEMORY {
            self.quarantined.pop_front();
        }
        self.quarantined.push_back(id);
    }

    /// Was `id` given up by a failed wait? (Late messages for it are expected then.)
    pub(crate) fn was_quarantined(&self, id: u64) -> bool {
        self.quarantined.contains(&id)
    }

    /// Nothing queued for sending and no rendezvous stream running.
    pub(crate) fn out_idle(&self) -> bool {
        self.out_pending.is_empty() && self.streams.is_empty()
    }

    pub(crate) fn push_ctrl(&mut self, dest: Rank, h: Hdr) {
        self.push_out(dest, Out::Ctrl(h));
    }

    /// An empty buffer for an owned payload, reusing one of a message already sent.
    pub(crate) fn spare_buf(&mut self) -> Vec<u8> {
        self.spare.take()
    }

    fn recycle(&mut self, data: Vec<u8>) {
        self.spare.give(data);
    }

    pub(crate) fn push_owned(&mut self, dest: Rank, h: Hdr, data: Vec<u8>) {
        self.push_out(dest, Out::Owned(h, data));
    }

    pub(crate) fn push_out(&mut self, dest: Rank, o: Out) {
        self.outq[dest as usize].push_back(o);
        if !self.out_flag[dest as usize] {
            self.out_flag[dest as usize] = true;
            self.out_pending.push(dest);
        }
    }

    /// Nothing is queued or streaming to `dest`: data sent now leaves at once.
    fn idle(&self, dest: Rank) -> bool {
        self.outq[dest as usize].is_empty()
            && !self.streams.iter().any(|&id| {
                matches!(self.reqs.get(id), Some(Req { kind: Kind::Send(s), .. }) if s.dest == dest)
            })
    }

    fn set_send_phase(&mut self, id: ReqId, phase: SendPhase) {
        if let Some(Req {
            kind: Kind::Send(s),
            ..
        }) = self.reqs.get_mut(id)
        {
            s.phase = phase;
        }
    }

    /// A send request in `phase`, owned by `scope`.
    #[allow(clippy::too_many_arguments)]
    fn new_send(
        &mut self,
        scope: u64,
        dest: Rank,
        ctx: u32,
        tag: i32,
        buf: SendBuf,
        sync: bool,
        phase: SendPhase,
        mr: Option<Box<MemRegion>>,
    ) -> ReqId {
        self.reqs.insert(Req {
            scope,
            done: None,
            kind: Kind::Send(SendReq {
                dest,
                ctx,
                tag,
                buf,
                sync,
                phase,
                mr,
            }),
        })
    }

    /// Mark a request finished with `res`.
    pub(crate) fn finish(&mut self, id: ReqId, res: Result<Status>) {
        if let Some(r) = self.reqs.get_mut(id) {
            if r.done.is_none() {
                r.done = Some(res);
            }
        }
    }

    fn start_rndv(
        &mut self,
        id: ReqId,
        src: Rank,
        tag: i32,
        total: usize,
        sreq: u64,
        remote: Option<RemoteAddr>,
    ) {
        let rma_read = self.rma_read;
        let max_iov = self.caps.rma.map_or(0, |r| r.max_iov);
        let Some(Req {
            kind: Kind::Recv(r),
            ..
        }) = self.reqs.get_mut(id)
        else {
            return;
        };
        let len = total.min(r.buf.cap);
        let pieces = match &r.buf.layout {
            Layout::Contig => 1,
            Layout::Typed(dt, c) => dt.iovecs(*c).map_or(usize::MAX, |v| v.len()),
        };
        if let (Some(remote), true, true, true) = (remote, rma_read, pieces <= max_iov, len > 0) {
            r.phase = RecvPhase::Reading {
                len,
                total,
                src,
                tag,
                sreq,
                remote,
                issued: false,
            };
            self.reads.push(id);
            return;
        }
        r.phase = RecvPhase::Stream {
            got: 0,
            expect: len,
            total,
            src,
            tag,
        };
        let cap = r.buf.cap;
        let mut h = Hdr::new(H_CTS);
        h.u64(sreq).u64(id).u64(len as u64);
        // A sender that registered for a read we will not do releases it on this CTS.
        self.push_out(src, Out::Ctrl(h));
        if len == 0 {
            self.finish(id, recv_result(status(src, tag, total), cap));
        }
    }

    /// A message from `src` breaks the protocol: that peer is failed (everything that waits
    /// for it ends with "peer failed: rank N (malformed message: ...)") and whatever else it
    /// sends is dropped. A protocol error never leaves a rank waiting for a message that will
    /// not come.
    pub(crate) fn malformed(&mut self, src: Rank, what: &str) {
        if src >= self.size {
            // Not a peer at all: the provider itself is broken.
            self.provider_fault
                .get_or_insert_with(|| format!("delivered a message from rank {src}: {what}"));
            return;
        }
        if !std::mem::replace(&mut self.rogue[src as usize], true) {
            tracing::error!(
                peer = src,
                "malformed message: {what}; the peer is treated as failed"
            );
        }
        self.fail_peer(src, &format!("malformed message: {what}"));
    }

    /// A message that names request `id`, which no longer exists: expected when `id` was
    /// quarantined (its data is dropped quietly), a protocol error otherwise.
    fn stale(&mut self, src: Rank, id: u64, what: &str) {
        if self.was_quarantined(id) {
            tracing::debug!(peer = src, "dropping {what} for a request given up earlier");
        } else {
            self.malformed(src, &format!("{what} for an unknown request"));
        }
    }

    fn on_eager(&mut self, src: Rank, rd: &mut Rd<'_>, payload: &[u8]) -> Option<()> {
        let flags = rd.u8()?;
        let ctx = rd.u32()?;
        let tag = rd.u32()? as i32;
        let sreq = if flags & F_SYNC != 0 {
            Some(rd.u64()?)
        } else {
            None
        };
        if let Some(id) = self.matcher.take_posted(ctx, src, tag) {
            if let Some(Req {
                kind: Kind::Recv(r),
                ..
            }) = self.reqs.get_mut(id)
            {
                let n = payload.len().min(r.buf.cap);
                r.buf.write(0, &payload[..n]);
                let cap = r.buf.cap;
                self.finish(id, recv_result(status(src, tag, payload.len()), cap));
            }
            self.eager_consumed(src, payload.len());
            if let Some(s) = sreq {
                let mut h = Hdr::new(H_SACK);
                h.u64(s);
                self.push_out(src, Out::Ctrl(h));
            }
        } else {
            let mut data = self.spare_buf();
            data.extend_from_slice(payload);
            self.unexpected_bytes += data.len();
            self.matcher
                .add_unexpected(ctx, src, tag, Unexp::Eager { data, sreq });
        }
        Some(())
    }

    fn on_rts(&mut self, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let flags = rd.u8()?;
        let ctx = rd.u32()?;
        let tag = rd.u32()? as i32;
        let total = usize::try_from(rd.u64()?).ok()?;
        let sreq = rd.u64()?;
        let remote = if flags & F_REMOTE != 0 {
            Some(RemoteAddr {
                addr: rd.u64()?,
                key: rd.u64()?,
            })
        } else {
            None
        };
        if let Some(id) = self.matcher.take_posted(ctx, src, tag) {
            self.start_rndv(id, src, tag, total, sreq, remote);
        } else {
            self.matcher.add_unexpected(
                ctx,
                src,
                tag,
                Unexp::Rts {
                    total,
                    sreq,
                    remote,
                },
            );
        }
        Some(())
    }

    fn on_cts(&mut self, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let sreq = rd.u64()?;
        let rreq = rd.u64()?;
        let len = usize::try_from(rd.u64()?).ok()?;
        let Some(Req {
            kind: Kind::Send(s),
            done: None,
            ..
        }) = self.reqs.get_mut(sreq)
        else {
            self.stale(src, sreq, "CTS");
            return Some(());
        };
        if s.dest != src
            || !matches!(
                s.phase,
                SendPhase::WaitCts | SendPhase::WaitFin | SendPhase::Spec { .. }
            )
            || len > s.buf.len
        {
            self.malformed(src, "CTS does not fit its send");
            return Some(());
        }
        let tag = s.tag;
        if let Some(m) = s.mr.take() {
            self.deregs.push(*m);
        }
        // A speculative send still pumping `SDATA` is in `streams` already; it switches to
        // `DATA` (the receiver dropped what it got before its receive matched).
        let streaming =
            matches!(s.phase, SendPhase::Spec { off, .. } if off > 0 && off < s.buf.len);
        if len == 0 {
            self.finish(sreq, Ok(status(src, tag, 0)));
        } else {
            s.phase = SendPhase::Stream { rreq, off: 0, len };
            if !streaming {
                self.streams.push(sreq);
            }
        }
        Some(())
    }

    /// A speculative message from `src` announces itself: match it now (data follows), stage
    /// it within the budget, or keep only the announcement, as an unexpected `RTS` (its data is
    /// dropped and a `CTS` asks for it again when a receive matches).
    fn on_spec(&mut self, src: Rank, rd: &mut Rd<'_>, payload: &[u8]) -> Option<()> {
        let _flags = rd.u8()?;
        let ctx = rd.u32()?;
        let tag = rd.u32()? as i32;
        let total = usize::try_from(rd.u64()?).ok()?;
        let sreq = rd.u64()?;
        // Already matched when the provider asked where to place this payload.
        if self.spec_rreq(src, sreq).is_none() && !self.spec_match(src, ctx, tag, total, sreq) {
            if self.spec_staged_bytes.saturating_add(total) <= self.spec_buffer {
                self.spec_staged_bytes += total;
                let data = self.staging_buf(total);
                self.spec_staged.push(Staged {
                    src,
                    sreq,
                    total,
                    data,
                });
                self.matcher
                    .add_unexpected(ctx, src, tag, Unexp::Spec { total, sreq });
                self.spec_ack(src, sreq);
            } else {
                // Over the budget: like an RTS, the data is asked for when a receive matches.
                let rts = Unexp::Rts {
                    total,
                    sreq,
                    remote: None,
                };
                self.matcher.add_unexpected(ctx, src, tag, rts);
                return Some(());
            }
        }
        self.spec_data(src, sreq, 0, payload);
        Some(())
    }

    /// Match speculative message `sreq` from `src` to a posted receive, which its data then
    /// fills; `false` if none is posted.
    fn spec_match(&mut self, src: Rank, ctx: u32, tag: i32, total: usize, sreq: u64) -> bool {
        let Some(id) = self.matcher.take_posted(ctx, src, tag) else {
            return false;
        };
        if let Some(Req {
            kind: Kind::Recv(r),
            ..
        }) = self.reqs.get_mut(id)
        {
            r.phase = RecvPhase::Stream {
                got: 0,
                expect: total.min(r.buf.cap),
                total,
                src,
                tag,
            };
        }
        self.spec_rx.push((src, sreq, id));
        self.spec_ack(src, sreq);
        true
    }

    /// Tell the sender of speculative message `sreq` that its data is taken (matched or staged).
    fn spec_ack(&mut self, src: Rank, sreq: u64) {
        let mut h = Hdr::new(H_SACK);
        h.u64(sreq);
        self.push_out(src, Out::Ctrl(h));
    }

    /// Bytes `[off, off + payload.len())` of speculative message `sreq` from `src`: into its
    /// receive if it matched (clipped to the receive's length), into its staging buffer if it
    /// was staged, else dropped.
    fn spec_data(&mut self, src: Rank, sreq: u64, off: usize, payload: &[u8]) {
        let Some(rreq) = self.spec_rreq(src, sreq) else {
            // Staged (the stream delivers in order: `off` is what it holds), or dropped.
            if let Some(st) = self
                .spec_staged
                .iter_mut()
                .find(|e| e.src == src && e.sreq == sreq)
            {
                let room = st.total - st.data.len();
                if off == st.data.len() && payload.len() <= room {
                    st.data.extend_from_slice(payload);
                } else {
                    tracing::warn!(peer = src, "speculative data out of order or too long");
                }
            }
            return;
        };
        let mut k = 0;
        if let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get_mut(rreq)
        {
            if let RecvPhase::Stream { expect, .. } = r.phase {
                k = payload.len().min(expect.saturating_sub(off));
                if expect >= self.nt_copy_min {
                    r.buf.write_nt(off, &payload[..k]);
                } else {
                    r.buf.write(off, &payload[..k]);
                }
            }
        }
        // Finishes the receive when everything expected is in (also when that is nothing).
        self.data_arrived(rreq, src, k);
    }

    fn on_sdata(&mut self, src: Rank, rd: &mut Rd<'_>, payload: &[u8]) -> Option<()> {
        let sreq = rd.u64()?;
        let off = usize::try_from(rd.u64()?).ok()?;
        self.spec_data(src, sreq, off, payload);
        Some(())
    }

    fn on_data(&mut self, src: Rank, rd: &mut Rd<'_>, payload: &[u8]) -> Option<()> {
        let rreq = rd.u64()?;
        let off = usize::try_from(rd.u64()?).ok()?;
        let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get_mut(rreq)
        else {
            self.stale(src, rreq, "DATA");
            return Some(());
        };
        let RecvPhase::Stream {
            expect, src: from, ..
        } = &r.phase
        else {
            self.malformed(src, "DATA for a receive that is not streaming");
            return Some(());
        };
        if *from != src || off.checked_add(payload.len()).is_none_or(|e| e > *expect) {
            self.malformed(src, "DATA outside the announced range");
            return Some(());
        }
        if *expect >= self.nt_copy_min {
            r.buf.write_nt(off, payload);
        } else {
            r.buf.write(off, payload);
        }
        self.data_arrived(rreq, src, payload.len());
        Some(())
    }

    /// `k` more bytes of streaming receive `rreq` are in its buffer (copied by `on_data` or
    /// placed by the provider); finish it when all have arrived.
    fn data_arrived(&mut self, rreq: u64, src: Rank, k: usize) {
        let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get_mut(rreq)
        else {
            self.spec_done(rreq);
            return;
        };
        let RecvPhase::Stream {
            got,
            expect,
            total,
            tag,
            ..
        } = &mut r.phase
        else {
            return;
        };
        *got += k;
        if *got >= *expect {
            let st = status(src, *tag, *total);
            let cap = r.buf.cap;
            self.finish(rreq, recv_result(st, cap));
            self.spec_done(rreq);
        }
    }

    /// Receive `rreq` needs no more speculative data (what still comes for it is dropped).
    fn spec_done(&mut self, rreq: ReqId) {
        if !self.spec_rx.is_empty() {
            self.spec_rx.retain(|e| e.2 != rreq);
        }
    }

    /// For direct placement of a DATA payload: the streaming receive that bytes `[poff,
    /// poff + n)` of this DATA message's payload belong to, and their offset in its buffer;
    /// `None` when that is not a contiguous receive still expecting exactly those bytes.
    fn data_slot(&self, src: Rank, header: &[u8], poff: usize, n: usize) -> Option<(u64, usize)> {
        let mut rd = Rd::new(header);
        let (rreq, off) = match rd.u8()? {
            H_DATA => (rd.u64()?, usize::try_from(rd.u64()?).ok()?),
            H_SPEC => {
                rd.bytes(1 + 4 + 4 + 8)?;
                (self.spec_rreq(src, rd.u64()?)?, 0)
            }
            H_SDATA => {
                let sreq = rd.u64()?;
                (self.spec_rreq(src, sreq)?, usize::try_from(rd.u64()?).ok()?)
            }
            _ => return None,
        };
        let off = off.checked_add(poff)?;
        let Some(Req {
            kind: Kind::Recv(r),
            done: None,
            ..
        }) = self.reqs.get(rreq)
        else {
            return None;
        };
        let RecvPhase::Stream {
            expect, src: from, ..
        } = &r.phase
        else {
            return None;
        };
        let fits = off.checked_add(n).is_some_and(|e| e <= *expect);
        (*from == src && fits && matches!(r.buf.layout, Layout::Contig)).then_some((rreq, off))
    }

    /// The receive matched to speculative message `sreq` from `src`, while data is due.
    fn spec_rreq(&self, src: Rank, sreq: u64) -> Option<ReqId> {
        self.spec_rx
            .iter()
            .find(|e| e.0 == src && e.1 == sreq)
            .map(|e| e.2)
    }

    fn on_fin(&mut self, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let sreq = rd.u64()?;
        let Some(Req {
            kind: Kind::Send(s),
            done: None,
            ..
        }) = self.reqs.get_mut(sreq)
        else {
            self.stale(src, sreq, "FIN");
            return Some(());
        };
        if s.dest != src {
            self.malformed(src, "FIN from the wrong peer");
            return Some(());
        }
        if let Some(m) = s.mr.take() {
            self.deregs.push(*m);
        }
        let (tag, len) = (s.tag, s.buf.len);
        self.finish(sreq, Ok(status(src, tag, len)));
        Some(())
    }

    fn on_sack(&mut self, src: Rank, rd: &mut Rd<'_>) -> Option<()> {
        let sreq = rd.u64()?;
        match self.reqs.get_mut(sreq) {
            Some(Req {
                kind: Kind::Send(s),
                done: None,
                ..
            }) if s.dest == src => {
                let (tag, len) = (s.tag, s.buf.len);
                match &mut s.phase {
                    // Speculative: matched; done once all of it is written.
                    SendPhase::Spec { off, acked } if *off < len => *acked = true,
                    _ => self.finish(sreq, Ok(status(src, tag, len))),
                }
            }
            _ => self.stale(src, sreq, "SACK"),
        }
        Some(())
    }

    /// Why `rank` failed, if it did.
    pub(crate) fn peer_failure(&self, rank: Rank) -> Option<String> {
        self.failed.get(rank as usize).cloned().flatten()
    }

    fn fail_peer(&mut self, rank: Rank, reason: &str) {
        if rank >= self.size || self.failed[rank as usize].is_some() {
            return;
        }
        self.failed[rank as usize] = Some(reason.to_string());
        self.nfailed += 1;
        // Owned payloads of messages that will never be sent go back to the pool.
        while let Some(o) = self.outq[rank as usize].pop_front() {
            if let Out::Owned(_, data) = o {
                self.recycle(data);
            }
        }
        self.spec_rx.retain(|e| e.0 != rank);
        // Speculative data staged from it that will never be complete: release it and its
        // share of WEFT_SPEC_BUFFER (a complete message stays: it can still be received).
        let mut freed = 0;
        self.spec_staged.retain(|e| {
            let keep = e.src != rank || e.data.len() == e.total;
            if !keep {
                freed += e.total;
            }
            keep
        });
        self.spec_staged_bytes -= freed;
        self.eager_out[rank as usize] = 0;
        self.eager_in[rank as usize] = 0;
        let all_others_gone = self.nfailed + 1 >= self.size;
        let err = || Error::peer_failed(rank, reason);
        let mut affected = 0usize;
        for id in self.reqs.ids() {
            let Some(req) = self.reqs.get_mut(id) else {
                continue;
            };
            if req.done.is_some() {
                continue;
            }
            let hit = match &req.kind {
                Kind::Send(s) => s.dest == rank,
                Kind::NSend { dest, .. } => *dest == rank,
                Kind::Recv(r) => match &r.phase {
                    RecvPhase::Posted(_) => {
                        r.src == Some(rank) || (r.src.is_none() && all_others_gone)
                    }
                    RecvPhase::Stream { src, .. } | RecvPhase::Reading { src, .. } => *src == rank,
                },
                Kind::NRecv { src, .. } => *src == Some(rank) || (src.is_none() && all_others_gone),
            };
            if hit {
                if let Kind::Recv(RecvReq {
                    phase: RecvPhase::Posted(h),
                    ..
                }) = &req.kind
                {
                    let h = *h;
                    self.matcher.cancel(h);
                }
                if let Some(Req {
                    kind: Kind::Send(s),
                    ..
                }) = self.reqs.get_mut(id)
                {
                    if let Some(m) = s.mr.take() {
                        self.deregs.push(*m);
                    }
                }
                self.finish(id, Err(err()));
                affected += 1;
            }
        }
        crate::rma::peer_failed(self, rank, reason);
        // A peer that leaves while nothing waits for it has most likely finished normally.
        if affected > 0 && !self.closing {
            tracing::warn!(rank, affected, "peer failed: {reason}");
        } else {
            tracing::debug!(rank, "peer gone: {reason}");
        }
    }
}

impl Sink for State {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        if src >= self.size {
            self.malformed(src, "a rank outside the world");
            return;
        }
        if self.rogue[src as usize] {
            return;
        }
        if header.len() > self.caps.max_am_header || payload.len() > self.caps.max_am_payload {
            let what = format!(
                "{}-byte header and {}-byte payload exceed the provider's limits ({} and {})",
                header.len(),
                payload.len(),
                self.caps.max_am_header,
                self.caps.max_am_payload
            );
            self.malformed(src, &what);
            return;
        }
        let kind = header.first().copied();
        let want = kind.and_then(|k| header_len(k, header.get(1).copied()));
        if want != Some(header.len()) {
            let what = match want {
                None => format!("unknown or short header (kind {kind:?})"),
                Some(n) => format!(
                    "a header of kind {} with {} bytes instead of {n}",
                    kind.unwrap_or(0),
                    header.len()
                ),
            };
            self.malformed(src, &what);
            return;
        }
        let mut rd = Rd::new(header);
        let kind = rd.u8();
        let ok = match kind {
            Some(H_EAGER) => self.on_eager(src, &mut rd, payload),
            Some(H_RTS) => self.on_rts(src, &mut rd),
            Some(H_CTS) => self.on_cts(src, &mut rd),
            Some(H_DATA) => self.on_data(src, &mut rd, payload),
            Some(H_FIN) => self.on_fin(src, &mut rd),
            Some(H_SACK) => self.on_sack(src, &mut rd),
            Some(H_SPEC) => self.on_spec(src, &mut rd, payload),
            Some(H_SDATA) => self.on_sdata(src, &mut rd, payload),
            Some(H_CREDIT) => self.on_credit(src, &mut rd),
            Some(k) if k >= crate::rma::H_PUT => crate::rma::on_am(self, src, k, &mut rd, payload),
            _ => None,
        };
        if ok.is_none() {
            self.malformed(
                src,
                &format!("a header of kind {kind:?} that does not parse"),
            );
        }
    }

    fn am_target(
        &mut self,
        src: Rank,
        header: &[u8],
        off: usize,
        n: usize,
    ) -> Option<std::ptr::NonNull<u8>> {
        if off == 0 && header.first() == Some(&H_SPEC) {
            // Match now so the payload can go straight into the receive. Unmatched: `None`,
            // and `am` delivers the frame, which queues the announcement and drops the data.
            let mut rd = Rd::new(&header[1..]);
            let (_, ctx, tag, total, sreq) = (rd.u8()?, rd.u32()?, rd.u32()?, rd.u64()?, rd.u64()?);
            let total = usize::try_from(total).ok()?;
            if self.spec_rreq(src, sreq).is_none()
                && !self.spec_match(src, ctx, tag as i32, total, sreq)
            {
                return None;
            }
        }
        let (rreq, at) = self.data_slot(src, header, off, n)?;
        let Kind::Recv(r) = &self.reqs.get(rreq)?.kind else {
            return None;
        };
        // SAFETY: `data_slot` checked at + n <= expect <= cap, the length of the buffer the
        // receive borrows for its scope; the request stays live until its bytes are all placed
        // or its peer fails, and the provider writes before its next call into this sink.
        std::ptr::NonNull::new(unsafe { r.buf.base.add(at) })
    }

    fn am_placed(&mut self, src: Rank, header: &[u8], off: usize, k: usize) {
        match self.data_slot(src, header, off, k) {
            Some((rreq, _)) => self.data_arrived(rreq, src, k),
            None => self.malformed(src, "placed DATA outside a streaming receive"),
        }
    }

    fn complete(&mut self, token: Token, result: Result<Completed>) {
        if token & crate::rma::RMA_TOKEN != 0 {
            self.rma.complete(token, result.map(|_| ()));
            return;
        }
        let Some(req) = self.reqs.get_mut(token) else {
            tracing::warn!(token, "completion for an unknown operation");
            return;
        };
        match &mut req.kind {
            Kind::NSend { dest, .. } => {
                let d = *dest;
                self.finish(token, result.map(|_| status(d, 0, 0)));
            }
            Kind::NRecv { buf, tmp, .. } => {
                let res = match result {
                    Ok(Completed::Received(ts)) => {
                        let cap = buf.cap;
                        if let Some(t) = tmp.take() {
                            let n = ts.bytes.min(cap);
                            buf.write(0, &t[..n]);
                        }
                        recv_result(status(ts.source, ts.tag, ts.bytes), cap)
                    }
                    Ok(Completed::Cancelled) => Ok(cancelled_status()),
                    Ok(Completed::Done) => Err(Error::invalid(
                        "provider completed a receive without a status",
                    )),
                    Err(e) => Err(e),
                };
                self.finish(token, res);
            }
            Kind::Recv(RecvReq {
                phase:
                    RecvPhase::Reading {
                        len,
                        total,
                        src,
                        tag,
                        sreq,
                        ..
                    },
                buf,
                ..
            }) => {
                let (len, total, src, tag, sreq, cap) = (*len, *total, *src, *tag, *sreq, buf.cap);
                let _ = len;
                let mut f = Hdr::new(H_FIN);
                f.u64(sreq);
                self.push_out(src, Out::Ctrl(f));
                let res = match result {
                    Ok(_) => recv_result(status(src, tag, total), cap),
                    Err(e) => Err(e),
                };
                self.finish(token, res);
            }
            _ => tracing::warn!(token, "unexpected completion"),
        }
    }

    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        self.fail_peer(rank, reason);
    }
}

#[cfg(test)]
mod nt_tests {
    use super::{copy_nt, cpu_list_len, nt_copy_auto};

    #[test]
    fn cpu_lists_count_their_cpus() {
        assert_eq!(cpu_list_len("0"), 1);
        assert_eq!(cpu_list_len("0-1"), 2);
        assert_eq!(cpu_list_len("0-3,8,10-11"), 7);
        assert_eq!(cpu_list_len(""), 0);
        assert!(nt_copy_auto() >= 1 << 20, "{}", nt_copy_auto());
    }

    #[test]
    fn streaming_copy_matches_memcpy_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for dst_off in 0..17 {
            for src_off in [0usize, 1, 5, 16] {
                for len in [0usize, 1, 15, 16, 17, 63, 64, 65, 200, 4096, 4900] {
                    let mut dst = vec![0xAAu8; 5100];
                    let s = &src[src_off..src_off + len];
                    // SAFETY: dst has room for dst_off + len bytes; the vectors are distinct.
                    unsafe { copy_nt(dst.as_mut_ptr().add(dst_off), s) };
                    assert_eq!(&dst[dst_off..dst_off + len], s, "{dst_off} {src_off} {len}");
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xAA));
                    assert!(dst[dst_off + len..].iter().all(|&b| b == 0xAA));
                }
            }
        }
    }
}

#[cfg(test)]
mod slab_tests {
    use super::{Kind, Req, Slab, MAX_GEN};

    fn req() -> Req {
        Req {
            scope: 0,
            done: None,
            kind: Kind::NSend {
                dest: 0,
                _tmp: None,
            },
        }
    }

    /// A slot reused 2^31 times must neither issue an id that looks like an RMA token (bit 63)
    /// nor wrap to an id it issued before (or to 0, "no token" in the C ABI).
    #[test]
    fn worn_out_slots_retire_instead_of_wrapping() {
        let mut s = Slab::default();
        let first = s.insert(req());
        s.remove(first);
        // Fast-forward slot 0 to just below the last generation.
        s.slots[0].gen = MAX_GEN - 2;
        let mut seen = Vec::new();
        for _ in 0..6 {
            let id = s.insert(req());
            assert_eq!(id >> 63, 0, "id {id:#x} has the RMA-token bit");
            assert_ne!(id, 0);
            assert!(!seen.contains(&id), "id {id:#x} issued twice");
            seen.push(id);
            assert!(s.remove(id).is_some());
        }
        // Slot 0 retired at MAX_GEN; later ids come from new slots.
        assert_eq!(s.slots[0].gen, MAX_GEN);
        assert!(s.slots.len() > 1);
        assert_eq!(s.live, 0);
    }
}

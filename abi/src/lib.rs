//! The C ABI between weft and provider libraries, version 1.1: `#[repr(C)]` types and constants
//! only, no logic. `include/weft_provider.h` is generated from this file with cbindgen.
//!
//! 1.1 adds, all optional and all at the ends of existing tables: the contract-2 capability
//! bits and limits in [`WeftCaps`], a local descriptor in [`WeftMr`] (and the local-write access
//! bit), remote completion data and connection events in [`WeftSink`], a key-value space that
//! stays valid after `open` in [`WeftBoot`], and the [`WeftExtOps`] table (connections,
//! per-peer capabilities, zero-copy active messages, RMA and atomics with local descriptors and
//! the fence flag, writes with completion data). A 1.0 library never sees any of it: the
//! loader reads and passes the 1.1 parts only to libraries that declare minor 1 or later.
//!
//! A provider library `libweft-<name>.so` exports one symbol, `weft_provider_entry`, returning
//! a pointer to a [`WeftEntry`]. Every table begins with its own size so it can grow compatibly:
//! a loader accepts a table at least as large as the one it knows. The entry begins, in every
//! ABI version, with `abi_version` (major << 16 | minor) and `size`.
//!
//! Calls return [`WEFT_OK`], [`WEFT_BUSY`] (`am_send` only: nothing taken, retry after
//! progress) or a negative `WEFT_E*` code; `last_error` then describes the failure.
#![allow(non_camel_case_types)]
// Function-pointer fields of C tables are long by nature.
#![allow(clippy::type_complexity)]

use std::ffi::{c_char, c_void};

/// ABI major version: a loader refuses a provider whose major differs.
pub const WEFT_ABI_MAJOR: u32 = 1;
/// ABI minor version: a loader accepts providers with a minor not newer than its own.
pub const WEFT_ABI_MINOR: u32 = 1;
/// `major << 16 | minor`, the first field of every entry.
pub const WEFT_ABI_VERSION: u32 = (WEFT_ABI_MAJOR << 16) | WEFT_ABI_MINOR;

/// Name of the symbol every provider library exports.
pub const WEFT_ENTRY_SYMBOL: &str = "weft_provider_entry";

pub const WEFT_OK: i32 = 0;
/// `am_send`: no resources now; nothing was taken.
pub const WEFT_BUSY: i32 = 1;
/// Generic failure (see `last_error`).
pub const WEFT_EFAIL: i32 = -1;
/// Bad argument.
pub const WEFT_EINVAL: i32 = -2;
/// The peer is gone.
pub const WEFT_EPEER: i32 = -3;
/// Not supported by this provider.
pub const WEFT_ENOSYS: i32 = -4;
/// The provider cannot run here (probe).
pub const WEFT_EUNAVAIL: i32 = -5;
/// Remote access outside a registered region or with a bad key.
pub const WEFT_EACCESS: i32 = -6;

/// Capability flags in [`WeftCaps::flags`].
pub const WEFT_CAP_TAGGED: u32 = 1 << 0;
pub const WEFT_CAP_RMA_READ: u32 = 1 << 1;
pub const WEFT_CAP_RMA_WRITE: u32 = 1 << 2;
pub const WEFT_CAP_SCALABLE_KEYS: u32 = 1 << 3;
pub const WEFT_CAP_MEM_ALLOC: u32 = 1 << 4;
pub const WEFT_CAP_NATIVE_LOCKS: u32 = 1 << 5;
pub const WEFT_CAP_COUNTERS: u32 = 1 << 6;
pub const WEFT_CAP_SPANS_PROCESSES: u32 = 1 << 7;
pub const WEFT_CAP_SPANS_HOSTS: u32 = 1 << 8;
/// 1.1: the provider needs a local descriptor ([`WeftMr::desc`]) for every local buffer of
/// [`WeftExtOps`] calls (libfabric's `FI_MR_LOCAL`).
pub const WEFT_CAP_MR_LOCAL: u32 = 1 << 9;
/// 1.1: registrations pin pages (a cached registration could go stale after unmap + map).
pub const WEFT_CAP_MR_PINS: u32 = 1 << 10;
/// 1.1: [`WeftExtOps::am_isend`] (zero-copy active messages above `inject_size`).
pub const WEFT_CAP_AM_ISEND: u32 = 1 << 11;
/// 1.1: connects to a peer when [`WeftExtOps::connect`] is called, not at `open`.
pub const WEFT_CAP_LAZY_CONNECT: u32 = 1 << 12;
/// 1.1: capabilities may be narrower towards some peers ([`WeftExtOps::peer_caps`]).
pub const WEFT_CAP_PER_PEER: u32 = 1 << 13;
/// 1.1: RMA writes complete when their data has left (transmit completion), not when it is
/// visible at the target (delivery completion, the 1.0 meaning).
pub const WEFT_CAP_RMA_TRANSMIT: u32 = 1 << 14;
/// 1.1: [`WEFT_OP_FENCE`] is honoured.
pub const WEFT_CAP_RMA_FENCE: u32 = 1 << 15;

/// 1.1 access bits of [`WeftRmaOps::reg`] beyond 1.0's (1 remote read, 2 remote write, 4 remote
/// atomic): the provider may write into the region locally.
pub const WEFT_ACCESS_LOCAL_WRITE: u32 = 8;

/// 1.1 operation flag of [`WeftExtOps`] RMA calls: start only after this rank's earlier writes
/// to the same target have landed there.
pub const WEFT_OP_FENCE: u32 = 1;

/// 1.1 connection events ([`WeftSink::connection`]).
pub const WEFT_CONN_CONNECTED: u32 = 0;
/// The peer's capabilities changed: ask [`WeftExtOps::peer_caps`] again.
pub const WEFT_CONN_CAPS_CHANGED: u32 = 1;

/// One piece of a message.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct WeftIov {
    pub base: *const u8,
    pub len: usize,
}

/// One writable piece of memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct WeftIovMut {
    pub base: *mut u8,
    pub len: usize,
}

/// What a provider can do (filled by `caps`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct WeftCaps {
    /// `sizeof(WeftCaps)` as the caller knows it.
    pub size: u32,
    pub max_am_header: u32,
    pub max_am_payload: u64,
    pub eager_limit: u64,
    pub max_iov: u32,
    /// `WEFT_CAP_*` bits.
    pub flags: u32,
    pub rma_max_iov: u32,
    pub reserved: u32,
    /// Native atomics: for each operation (weft's `Op` order: sum, prod, min, max, band, bor,
    /// bxor, land, lor, lxor, replace, no_op, cswap), a bitmask of basic types (i8, u8, i16,
    /// u16, i32, u32, i64, u64, f32, f64 as bits 0..9).
    pub atomics: [u16; 13],
    pub reserved2: u16,
    /// 1.1: with `WEFT_CAP_AM_ISEND`, payloads up to this size go through `am_send`.
    pub inject_size: u64,
    /// 1.1: bytes of remote completion data [`WeftExtOps::write_data`] carries (0: none).
    pub cq_data_size: u32,
    /// 1.1: most elements per native atomic call (0: no limit).
    pub atomic_max_count: u32,
}

/// 1.1: what a provider offers towards one peer ([`WeftExtOps::peer_caps`]); each field can
/// only narrow the provider-wide value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WeftPeerCaps {
    pub size: u32,
    /// `WEFT_PEER_*` bits.
    pub flags: u32,
    pub max_am_payload: u64,
    pub eager_limit: u64,
}

/// [`WeftPeerCaps::flags`]: RMA reads of the peer's memory.
pub const WEFT_PEER_RMA_READ: u32 = 1;
/// RMA writes into the peer's memory.
pub const WEFT_PEER_RMA_WRITE: u32 = 2;
/// `am_isend` to the peer.
pub const WEFT_PEER_AM_ISEND: u32 = 4;

/// What `probe` may look at.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct WeftProbeCtx {
    pub size: u32,
    pub rank: u32,
    pub nranks: u32,
    /// Non-zero when the ranks are threads of one process.
    pub in_process: u32,
    pub hosts: u32,
    pub local_ranks: u32,
}

/// The bootstrap, offered to `open`: the job's key-value space and node map.
#[repr(C)]
pub struct WeftBoot {
    pub size: u32,
    pub rank: u32,
    pub nranks: u32,
    pub reserved: u32,
    /// A string unique to the job (NUL-terminated).
    pub job_id: *const c_char,
    pub ctx: *mut c_void,
    /// Publish `key = value` (visible after the next fence).
    pub put: Option<
        unsafe extern "C" fn(ctx: *mut c_void, key: *const c_char, value: *const c_char) -> i32,
    >,
    /// Collective: commit and wait for every rank.
    pub fence: Option<unsafe extern "C" fn(ctx: *mut c_void) -> i32>,
    /// Read a key into `buf` (NUL-terminated); `*needed` receives the length + 1. Returns
    /// `WEFT_EINVAL` when `buf` is too small.
    pub get: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: *const c_char,
            buf: *mut c_char,
            buflen: usize,
            needed: *mut usize,
        ) -> i32,
    >,
    /// Host index of `rank` (ranks with equal indices share a host).
    pub host_of: Option<unsafe extern "C" fn(ctx: *mut c_void, rank: u32) -> u32>,
    /// 1.1: the job's key-value space, valid from `open` until `close` (for addresses looked
    /// up on first use). Null where the bootstrap keeps none. A value put is visible to the
    /// others after their next successful `kv_get` retry or the next collective fence.
    pub kv_ctx: *mut c_void,
    pub kv_put: Option<
        unsafe extern "C" fn(ctx: *mut c_void, key: *const c_char, value: *const c_char) -> i32,
    >,
    /// As `get`; `WEFT_OK` with `*needed` = 0 when the key is not (yet) there.
    pub kv_get: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: *const c_char,
            buf: *mut c_char,
            buflen: usize,
            needed: *mut usize,
        ) -> i32,
    >,
}

/// Status of a natively matched receive.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WeftTaggedStatus {
    pub source: u32,
    pub tag: i32,
    pub bytes: u64,
    /// 0: received; 1: cancelled.
    pub cancelled: u32,
    pub reserved: u32,
}

/// Where a provider reports arrivals, completions and failures during `progress`. The
/// pointers passed to `am` are valid only during the call.
#[repr(C)]
pub struct WeftSink {
    pub size: u32,
    pub reserved: u32,
    pub ctx: *mut c_void,
    pub am: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            src: u32,
            hdr: *const u8,
            hdr_len: usize,
            payload: *const u8,
            payload_len: usize,
        ),
    >,
    /// `status` is `WEFT_OK` or a `WEFT_E*` code; `tagged` is set for received messages.
    pub complete: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            token: u64,
            status: i32,
            tagged: *const WeftTaggedStatus,
        ),
    >,
    pub peer_failed:
        Option<unsafe extern "C" fn(ctx: *mut c_void, rank: u32, reason: *const c_char)>,
    /// 1.1 (present when `size` covers it): a write from `src` with completion data `data`
    /// is visible in this rank's memory.
    pub rma_data: Option<unsafe extern "C" fn(ctx: *mut c_void, src: u32, data: u64)>,
    /// 1.1: the connection to `peer` changed (`WEFT_CONN_*`).
    pub connection: Option<unsafe extern "C" fn(ctx: *mut c_void, peer: u32, event: u32)>,
}

/// The mandatory group: active messages and the provider's life cycle.
#[repr(C)]
pub struct WeftAmOps {
    /// `sizeof(WeftAmOps)` as the provider knows it.
    pub size: u32,
    pub reserved: u32,
    /// Can the provider run in this job? Local checks only. On failure, write a reason.
    pub probe: Option<
        unsafe extern "C" fn(ctx: *const WeftProbeCtx, why: *mut c_char, why_len: usize) -> i32,
    >,
    /// Fill `caps` (with the current parameters), without opening.
    pub caps: Option<unsafe extern "C" fn(caps: *mut WeftCaps) -> i32>,
    /// Collective open; `*provider` receives the instance.
    pub open:
        Option<unsafe extern "C" fn(boot: *const WeftBoot, provider: *mut *mut c_void) -> i32>,
    /// Orderly shutdown and release of the instance.
    pub close: Option<unsafe extern "C" fn(provider: *mut c_void) -> i32>,
    /// Buffered send: `WEFT_OK` (taken), `WEFT_BUSY` (nothing taken) or an error.
    pub am_send: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            hdr: *const u8,
            hdr_len: usize,
            iov: *const WeftIov,
            iovcnt: usize,
        ) -> i32,
    >,
    /// Deliver arrivals to `sink`; `*events` receives how many.
    pub progress: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            sink: *const WeftSink,
            events: *mut usize,
        ) -> i32,
    >,
    /// A description of the last failure of `provider` (NUL-terminated; may be null when no
    /// instance exists, e.g. after a failed `open`).
    pub last_error: Option<unsafe extern "C" fn(provider: *mut c_void) -> *const c_char>,
}

/// Optional: native tagged messaging.
#[repr(C)]
pub struct WeftTaggedOps {
    pub size: u32,
    pub reserved: u32,
    pub send: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            ctx: u32,
            tag: i32,
            iov: *const WeftIov,
            iovcnt: usize,
            sync: u32,
            token: u64,
        ) -> i32,
    >,
    /// `src`/`tag` of -1 are wildcards.
    pub recv: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            src: i64,
            ctx: u32,
            tag: i64,
            iov: *const WeftIovMut,
            iovcnt: usize,
            token: u64,
        ) -> i32,
    >,
    /// `WEFT_OK` with `*found` = 1 and `status` filled when a message waits.
    pub probe: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            src: i64,
            ctx: u32,
            tag: i64,
            found: *mut u32,
            status: *mut WeftTaggedStatus,
        ) -> i32,
    >,
    /// `*cancelled` = 1 when the receive will never complete.
    pub cancel:
        Option<unsafe extern "C" fn(provider: *mut c_void, token: u64, cancelled: *mut u32) -> i32>,
}

/// A registered region.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WeftMr {
    pub key: u64,
    pub addr: u64,
    pub len: u64,
    pub handle: u64,
    /// 1.1: the local descriptor to pass for memory inside the region (with
    /// `WEFT_CAP_MR_LOCAL`); a 1.0 library leaves it 0.
    pub desc: u64,
}

/// Optional: memory registration and RMA.
///
/// Completion of `read`, `write` (and `atomic` below): when `token` is non-zero, the provider
/// reports it through `WeftSink::complete`; when `cntr` is non-zero (a counter from
/// `WeftCntrOps::open`), it increments that counter's success or error count. The core passes
/// one or both; a provider without `WEFT_CAP_COUNTERS` only ever sees `cntr == 0`.
#[repr(C)]
pub struct WeftRmaOps {
    pub size: u32,
    pub reserved: u32,
    /// `access` bits: 1 read, 2 write, 4 atomic.
    pub reg: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            base: *mut u8,
            len: usize,
            access: u32,
            mr: *mut WeftMr,
        ) -> i32,
    >,
    pub dereg: Option<unsafe extern "C" fn(provider: *mut c_void, mr: *const WeftMr) -> i32>,
    pub read: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            src: u32,
            local: *const WeftIovMut,
            cnt: usize,
            addr: u64,
            key: u64,
            token: u64,
            cntr: u64,
        ) -> i32,
    >,
    pub write: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            local: *const WeftIov,
            cnt: usize,
            addr: u64,
            key: u64,
            token: u64,
            cntr: u64,
        ) -> i32,
    >,
}

/// Optional: native atomics (the supported pairs are in [`WeftCaps::atomics`]).
#[repr(C)]
pub struct WeftAtomicOps {
    pub size: u32,
    pub reserved: u32,
    pub atomic: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            op: u32,
            ty: u32,
            count: usize,
            origin: *const u8,
            compare: *const u8,
            result: *mut u8,
            addr: u64,
            key: u64,
            token: u64,
            cntr: u64,
        ) -> i32,
    >,
}

/// Optional: completion counters (with `WEFT_CAP_COUNTERS`), for bulk completion of RMA and
/// atomic operations, like libfabric's `fi_cntr`.
#[repr(C)]
pub struct WeftCntrOps {
    pub size: u32,
    pub reserved: u32,
    /// Open a counter; `*cntr` receives its non-zero id.
    pub open: Option<unsafe extern "C" fn(provider: *mut c_void, cntr: *mut u64) -> i32>,
    /// Read a counter without blocking.
    pub read: Option<
        unsafe extern "C" fn(provider: *mut c_void, cntr: u64, ok: *mut u64, err: *mut u64) -> i32,
    >,
    /// Close a counter with no operation outstanding on it.
    pub close: Option<unsafe extern "C" fn(provider: *mut c_void, cntr: u64) -> i32>,
}

/// 1.1, optional: the contract-2 entries. Local buffers come with a parallel array of
/// descriptors (`descs[i]` for `iov[i]`; null when the provider did not ask for them with
/// `WEFT_CAP_MR_LOCAL`); `flags` takes `WEFT_OP_*`. Completion as in [`WeftRmaOps`].
#[repr(C)]
pub struct WeftExtOps {
    pub size: u32,
    pub reserved: u32,
    /// Called once before the first operation towards `peer` (with `WEFT_CAP_LAZY_CONNECT`);
    /// report `WEFT_CONN_CONNECTED` from `progress` when it is up, answer `WEFT_BUSY` to sends
    /// until then.
    pub connect: Option<unsafe extern "C" fn(provider: *mut c_void, peer: u32) -> i32>,
    /// Narrower capabilities towards `peer`: fill `*caps` and return 1, or return 0 when the
    /// provider-wide ones apply.
    pub peer_caps: Option<
        unsafe extern "C" fn(provider: *mut c_void, peer: u32, caps: *mut WeftPeerCaps) -> i32,
    >,
    /// Zero-copy active message: the provider may read the payload until it reports `token`
    /// through `WeftSink::complete`. `WEFT_BUSY`: nothing taken, `token` never reported.
    pub am_isend: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            hdr: *const u8,
            hdr_len: usize,
            iov: *const WeftIov,
            descs: *const u64,
            iovcnt: usize,
            token: u64,
        ) -> i32,
    >,
    pub read: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            src: u32,
            local: *const WeftIovMut,
            descs: *const u64,
            cnt: usize,
            addr: u64,
            key: u64,
            token: u64,
            cntr: u64,
            flags: u32,
        ) -> i32,
    >,
    pub write: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            local: *const WeftIov,
            descs: *const u64,
            cnt: usize,
            addr: u64,
            key: u64,
            token: u64,
            cntr: u64,
            flags: u32,
        ) -> i32,
    >,
    /// A write whose target is told `data` (`WeftSink::rma_data`) once it is visible.
    pub write_data: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            local: *const WeftIov,
            descs: *const u64,
            cnt: usize,
            addr: u64,
            key: u64,
            data: u64,
            token: u64,
            cntr: u64,
            flags: u32,
        ) -> i32,
    >,
    /// `descs`: origin, compare, result (null without `WEFT_CAP_MR_LOCAL`).
    pub atomic: Option<
        unsafe extern "C" fn(
            provider: *mut c_void,
            dest: u32,
            op: u32,
            ty: u32,
            count: usize,
            origin: *const u8,
            compare: *const u8,
            result: *mut u8,
            descs: *const u64,
            addr: u64,
            key: u64,
            token: u64,
            cntr: u64,
            flags: u32,
        ) -> i32,
    >,
}

/// What `weft_provider_entry` returns.
#[repr(C)]
pub struct WeftEntry {
    /// `WEFT_ABI_VERSION` of the provider's build (first in every ABI version).
    pub abi_version: u32,
    /// `sizeof(WeftEntry)` as the provider knows it (second in every ABI version).
    pub size: u32,
    /// Provider name; the library file must be `libweft-<name>.so`.
    pub name: *const c_char,
    pub version: *const c_char,
    pub summary: *const c_char,
    pub priority: i32,
    pub reserved: u32,
    /// Mandatory.
    pub am: *const WeftAmOps,
    /// Optional groups (null when absent).
    pub tagged: *const WeftTaggedOps,
    pub rma: *const WeftRmaOps,
    pub atomics: *const WeftAtomicOps,
    pub cntr: *const WeftCntrOps,
    /// 1.1 (present when `abi_version` says minor 1 or later and `size` covers it).
    pub ext: *const WeftExtOps,
}

// SAFETY: the entry and its tables are immutable static data describing functions; the
// pointers inside point at static strings and tables.
unsafe impl Sync for WeftEntry {}
// SAFETY: as above.
unsafe impl Sync for WeftAmOps {}
// SAFETY: as above.
unsafe impl Sync for WeftTaggedOps {}
// SAFETY: as above.
unsafe impl Sync for WeftRmaOps {}
// SAFETY: as above.
unsafe impl Sync for WeftAtomicOps {}
// SAFETY: as above.
unsafe impl Sync for WeftCntrOps {}
// SAFETY: as above.
unsafe impl Sync for WeftExtOps {}

/// The signature of `weft_provider_entry`.
pub type WeftEntryFn = unsafe extern "C" fn() -> *const WeftEntry;

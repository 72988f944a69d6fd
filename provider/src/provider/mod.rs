//! The provider contract.
//!
//! The only mandatory part is **active messages**: [`Provider::am_send`] sends a small header and
//! an optional payload (an iovec) to a peer, and [`Provider::progress`] hands arrivals to the
//! core through a [`Sink`]. Everything else is optional and advertised in [`Caps`]; where a
//! provider lacks it, the core implements it on top of active messages (MPICH CH4's MPIDIG idea).
//!
//! # Contract summary
//! * Active messages from one source to one destination are delivered **in send order**.
//! * `am_send` is a *buffered* send: when it returns [`SendOutcome::Sent`] the provider has
//!   consumed the header and payload (copied or written them), so the caller may reuse them.
//!   [`SendOutcome::Busy`] means nothing was taken; the core retries after `progress`.
//! * Operations that keep pointing at user memory after they return (tagged send/receive, RMA,
//!   atomics) are `unsafe fn`: the core guarantees the memory stays valid until the provider
//!   reports the operation's [`Token`] through [`Sink::complete`] (or a cancel succeeds).
//! * `progress` must never block; it delivers what has arrived and returns.
//! * **Self-sends**: `am_send` to the provider's own rank works like any other (the core sends
//!   to itself, e.g. in collectives), and its message is delivered by `progress` as any other.
//! * Headers of at least [`MIN_AM_HEADER`] bytes, a payload and an iovec of at least one
//!   ([`Caps::check_contract`], checked when the core opens the provider).
//!
//! # Contract 2: what RDMA fabrics add (all optional, advertised in [`Caps`])
//! * **Registration with keys.** [`Provider::mr_register`] / [`Provider::mr_register_iov`] take
//!   [`Access`] rights and return a [`MemRegion`] with a remote key and a local descriptor. A
//!   provider that needs descriptors on local buffers sets [`Caps::mr_local`]; the core then
//!   registers every buffer it hands over (through a bounded LRU registration cache) and puts
//!   the descriptor in [`RawIov::desc`]. [`Caps::mr_pins`] says whether a registration pins
//!   pages (see the cache's stale-frame rule in `weft::mr_cache`).
//! * **Zero-copy active messages.** [`Provider::am_isend`] may keep reading the payload until
//!   its token completes; payloads up to [`Caps::inject_size`] still go through `am_send`.
//! * **Completion semantics.** Reads complete when their data has arrived. Writes and atomics
//!   complete at the level [`RmaCaps::completion`] declares: *delivery* (visible at the target)
//!   or *transmit* (only the local buffer is free again). The core relies on nothing more: with
//!   transmit completion it proves delivery with a fenced read ([`Completion::fence`],
//!   [`RmaCaps::fence`]) before a synchronisation ends, and without a fence it keeps writes on
//!   active messages. [`Provider::rma_write_data`] delivers remote completion data
//!   ([`Sink::rma_data`]), so a target can count arrivals without another message.
//! * **Lazy connections.** [`Provider::connect`] is called once per peer before the first
//!   operation towards it; the provider may keep the bootstrap's key-value space
//!   ([`Bootstrap::kv`]) to look addresses up then, and reports [`Sink::connection`] events.
//!   Nothing requires connecting every pair at open.
//! * **Per-peer capabilities.** [`Provider::peer_caps`] narrows payload limits and RMA per peer.
//! * **HCA atomics.** [`Caps::atomic_max_count`] (1 on an HCA) and a table with only
//!   `(FetchAndOp SUM, i64)` and `(CSWAP, i64)` are enough for windows whose `accumulate_ops`
//!   hint names only those.

mod boxed;
mod caps;
mod completion;
mod mem;

pub use caps::{Caps, CompletionLevel, PeerCaps, RmaCaps, MIN_AM_HEADER};
pub use completion::{
    CntrId, CntrValue, Completed, Completion, CompletionTable, ConnEvent, SendOutcome,
    TaggedStatus, Token,
};
pub use mem::{Access, AtomicOp, MemRegion, MrDesc, RawIov, RawIovMut, RemoteAddr};

use crate::bootstrap::Bootstrap;
use crate::types::Rank;
use crate::{Error, ErrorDetail, Result};
use std::io::IoSlice;

/// The core's side of `progress`: providers report arrivals, completions and failures here.
///
/// Handlers never call back into the provider; whatever they need to send is queued and sent
/// after `progress` returns.
pub trait Sink {
    /// An active message from world rank `src` arrived. `header` and `payload` are valid only
    /// during the call.
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]);
    /// An operation posted with `token` finished (or failed).
    fn complete(&mut self, token: Token, result: Result<Completed>);
    /// `rank` is gone: nothing more will arrive from it and nothing sent to it will be delivered.
    fn peer_failed(&mut self, rank: Rank, reason: &str);

    /// Optional **direct placement**, for providers that read payloads from a byte stream (a
    /// socket) and would otherwise stage them: before reading bytes `[off, off + n)` of the
    /// payload of the active message with `header` from `src`, ask where they go. `Some(p)`:
    /// `p` is valid for writes of `n` bytes until the provider's next call into this sink or
    /// its return from `progress`, whichever comes first; after writing `k <= n` bytes there
    /// the provider reports them with [`Sink::am_placed`] (and never calls [`Sink::am`] for
    /// this message). `None`: no direct placement; deliver the message through `am` (asked at
    /// `off == 0`), or, if `off > 0` (the destination went away), discard the rest.
    fn am_target(
        &mut self,
        _src: Rank,
        _header: &[u8],
        _off: usize,
        _n: usize,
    ) -> Option<std::ptr::NonNull<u8>> {
        None
    }

    /// `k` payload bytes starting at `off` were written where [`Sink::am_target`] said; the
    /// message is complete once the placed bytes add up to its payload length.
    fn am_placed(&mut self, _src: Rank, _header: &[u8], _off: usize, _k: usize) {}

    /// Remote completion data: a write from `src` made with [`Provider::rma_write_data`]
    /// carried `data`; the written bytes are visible in this rank's memory when this is called.
    fn rma_data(&mut self, _src: Rank, _data: u64) {}

    /// The connection to `peer` changed (see [`ConnEvent`]).
    fn connection(&mut self, _peer: Rank, _event: ConnEvent) {}
}

/// A sink that drops everything it is given and counts the active messages: for a provider's
/// own progress calls outside the core's (a close draining what is still on its way, a
/// calibration run that only counts arrivals).
#[derive(Debug, Default)]
pub struct Discard {
    /// Active messages handed to it so far.
    pub ams: usize,
}

impl Sink for Discard {
    fn am(&mut self, _: Rank, _: &[u8], _: &[u8]) {
        self.ams += 1;
    }
    fn complete(&mut self, _: Token, _: Result<Completed>) {}
    fn peer_failed(&mut self, _: Rank, _: &str) {}
}

fn unsupported<T>(what: &str) -> Result<T> {
    Err(Error::from(ErrorDetail::Unsupported(format!(
        "{what} is not a native capability of this provider"
    ))))
}

/// A fabric provider. See the module documentation for the contract.
///
/// Only `name`, `caps`, `rank`, `size`, `am_send` and `progress` are mandatory; every other
/// method has a default that reports [`Error::from(ErrorDetail::Unsupported)`] and is only
/// called when [`Caps`] advertises it.
pub trait Provider: 'static {
    /// Name as registered (`shm`, `tcp-sim`, ...).
    fn name(&self) -> &str;
    fn caps(&self) -> &Caps;
    /// This process's world rank.
    fn rank(&self) -> Rank;
    /// Number of ranks in the world.
    fn size(&self) -> u32;

    /// Send an active message: `header.len() <= caps.max_am_header`, total payload
    /// `<= caps.max_am_payload` (and the peer's [`PeerCaps::max_am_payload`]),
    /// `payload.len() <= caps.max_iov`.
    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome>;

    /// Deliver arrivals and completions to `sink`; never blocks. Returns how many events were
    /// delivered (0 means nothing happened, which lets waiters back off).
    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize>;

    /// Orderly shutdown (after the final barrier). Errors are reported, not fatal.
    fn close(&mut self) -> Result<()> {
        Ok(())
    }

    // ---- connections and per-peer capabilities ---------------------------------------------

    /// The core is about to talk to `peer` for the first time (called once per peer, before
    /// the first operation towards it, and also before answering a peer that spoke first).
    /// A provider that connects lazily ([`Caps::lazy_connect`]) starts its connection here —
    /// looking the peer's address up in the bootstrap's key-value space
    /// ([`Bootstrap::kv`]) if it kept a handle — and may answer `Busy` to sends until it is up,
    /// then reports [`ConnEvent::Connected`]. An error fails the peer.
    fn connect(&mut self, _peer: Rank) -> Result<()> {
        Ok(())
    }

    /// Narrower capabilities towards `peer` ([`Caps::per_peer`]); `None`: [`Caps`] apply. The
    /// core reads them after `connect` and again on every [`ConnEvent`] for that peer.
    fn peer_caps(&self, _peer: Rank) -> Option<PeerCaps> {
        None
    }

    /// Named counts of what this provider carried (messages by path, zero-copy sends,
    /// completion data, connections...): diagnostics for users, and the proof in tests and
    /// benchmarks of which path a job took. Names are stable per provider; empty by default.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// Zero-copy active message ([`Caps::am_isend`]): like `am_send`, but the provider may keep
    /// reading `payload` until it reports `token` through [`Sink::complete`] (with
    /// [`Completed::Done`], or an error). The header is copied during the call. `Busy`: nothing
    /// was taken and `token` will not be reported. Messages from `am_send` and `am_isend` to
    /// one peer are delivered in the order they were posted.
    ///
    /// # Safety
    /// The memory in `payload` must stay valid and unmodified until `token` completes.
    unsafe fn am_isend(
        &mut self,
        _dest: Rank,
        _header: &[u8],
        _payload: &[RawIov],
        _token: Token,
    ) -> Result<SendOutcome> {
        unsupported("zero-copy active messages")
    }

    // ---- native tagged messaging (caps.tagged) --------------------------------------------

    /// Send `data` with (ctx, tag); completion is reported with `token`. With `sync`, complete
    /// only once a receive has matched (MPI_Ssend).
    ///
    /// # Safety
    /// The memory in `data` must stay valid and unmodified until `token` completes.
    unsafe fn tagged_send(
        &mut self,
        _dest: Rank,
        _ctx: u32,
        _tag: i32,
        _data: &[RawIov],
        _sync: bool,
        _token: Token,
    ) -> Result<()> {
        unsupported("tagged send")
    }

    /// Post a receive; `None` source or tag is a wildcard.
    ///
    /// # Safety
    /// The memory in `buf` must stay valid and unaliased until `token` completes or is
    /// cancelled.
    unsafe fn tagged_recv(
        &mut self,
        _src: Option<Rank>,
        _ctx: u32,
        _tag: Option<i32>,
        _buf: &[RawIovMut],
        _token: Token,
    ) -> Result<()> {
        unsupported("tagged receive")
    }

    /// Is a matching message waiting? Does not receive it.
    fn tagged_probe(
        &mut self,
        _src: Option<Rank>,
        _ctx: u32,
        _tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        unsupported("tagged probe")
    }

    /// Cancel a posted receive that has not matched. `Ok(true)` if cancelled (the provider no
    /// longer touches its buffer and reports nothing more for it), `Ok(false)` if too late.
    fn tagged_cancel(&mut self, _token: Token) -> Result<bool> {
        unsupported("tagged cancel")
    }

    // ---- memory registration and RMA (caps.rma) -------------------------------------------

    /// Register `len` bytes at `base` for remote access.
    ///
    /// # Safety
    /// The memory must stay valid until `mr_deregister`.
    unsafe fn mr_register(
        &mut self,
        _base: *mut u8,
        _len: usize,
        _access: Access,
    ) -> Result<MemRegion> {
        unsupported("memory registration")
    }

    /// Register with a key chosen by the caller (scalable registration, `caps.rma.scalable_keys`):
    /// peers then address the region as (`key`, byte offset from its start) without any
    /// exchange.
    ///
    /// # Safety
    /// As for [`Provider::mr_register`].
    unsafe fn mr_register_keyed(
        &mut self,
        _base: *mut u8,
        _len: usize,
        _access: Access,
        _key: u64,
    ) -> Result<MemRegion> {
        unsupported("scalable memory registration")
    }

    /// Register the pieces of `iov` as one region (libfabric `fi_mr_regv`): peers address it as
    /// the concatenation of the pieces. The default handles a single piece with
    /// [`Provider::mr_register`].
    ///
    /// # Safety
    /// As for [`Provider::mr_register`].
    unsafe fn mr_register_iov(&mut self, iov: &[RawIovMut], access: Access) -> Result<MemRegion> {
        match iov {
            [one] => self.mr_register(one.ptr, one.len, access),
            _ => unsupported("registration of several pieces as one region"),
        }
    }

    fn mr_deregister(&mut self, _mr: &MemRegion) -> Result<()> {
        unsupported("memory registration")
    }

    /// Allocate `len` bytes of window memory placed by the provider (e.g. in a shared segment)
    /// and register it. Returns the local pointer and the registration.
    fn mem_alloc(&mut self, _len: usize) -> Result<(*mut u8, MemRegion)> {
        unsupported("window memory allocation")
    }

    /// Free memory from `mem_alloc`.
    fn mem_free(&mut self, _ptr: *mut u8, _mr: &MemRegion) -> Result<()> {
        unsupported("window memory allocation")
    }

    /// Read from `src`'s registered memory into `local`; report completion as `done` says.
    ///
    /// # Safety
    /// `local` must stay valid and unaliased until the operation completes.
    unsafe fn rma_read(
        &mut self,
        _src: Rank,
        _local: &[RawIovMut],
        _remote: RemoteAddr,
        _done: Completion,
    ) -> Result<()> {
        unsupported("RMA read")
    }

    /// Write `local` into `dest`'s registered memory; report completion as `done` says.
    ///
    /// # Safety
    /// `local` must stay valid until the operation completes.
    unsafe fn rma_write(
        &mut self,
        _dest: Rank,
        _local: &[RawIov],
        _remote: RemoteAddr,
        _done: Completion,
    ) -> Result<()> {
        unsupported("RMA write")
    }

    /// Write `local` into `dest`'s registered memory and deliver `data` (at most
    /// [`RmaCaps::cq_data_size`] bytes, little-endian) to the target: its sink gets
    /// [`Sink::rma_data`] once the written bytes are visible there (`FI_REMOTE_CQ_DATA`,
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`). `local` may be empty (the data alone).
    ///
    /// # Safety
    /// `local` must stay valid until the operation completes.
    unsafe fn rma_write_data(
        &mut self,
        _dest: Rank,
        _local: &[RawIov],
        _remote: RemoteAddr,
        _data: u64,
        _done: Completion,
    ) -> Result<()> {
        unsupported("RMA write with remote completion data")
    }

    /// Try to take the lock of the window registered at `window` on `target` (native locks).
    /// `Ok(false)`: held by someone else; the caller retries after progress.
    fn rma_try_lock(
        &mut self,
        _target: Rank,
        _window: RemoteAddr,
        _exclusive: bool,
    ) -> Result<bool> {
        unsupported("native window locks")
    }

    /// Release a lock taken with [`Provider::rma_try_lock`].
    fn rma_unlock(&mut self, _target: Rank, _window: RemoteAddr, _exclusive: bool) -> Result<()> {
        unsupported("native window locks")
    }

    /// Native atomic ([`AtomicOp`]) on the elements at `remote`; report completion as `done`
    /// says, once the operation was performed at the target (and its old values, if asked
    /// for, are in `result`).
    ///
    /// # Safety
    /// `origin`, `compare` and `result` (when non-null) must point at `count` elements and stay
    /// valid until the operation completes.
    unsafe fn atomic(
        &mut self,
        _dest: Rank,
        _a: &AtomicOp,
        _remote: RemoteAddr,
        _done: Completion,
    ) -> Result<()> {
        unsupported("native atomics")
    }

    /// Open a completion counter (caps.counters): RMA and atomic operations given it in their
    /// [`Completion`] increment it when they finish, instead of (or as well as) a CQ entry.
    fn cntr_open(&mut self) -> Result<CntrId> {
        unsupported("completion counters")
    }

    /// Read a counter. Never blocks; the core calls `progress` between reads.
    fn cntr_read(&mut self, _cntr: CntrId) -> Result<CntrValue> {
        unsupported("completion counters")
    }

    /// Close a counter with no operation outstanding on it.
    fn cntr_close(&mut self, _cntr: CntrId) -> Result<()> {
        unsupported("completion counters")
    }
}

/// The dynamic path: a provider chosen at run time, one trait-object call per operation.
pub type DynProvider = Box<dyn Provider>;

/// A provider type known at compile time (the static path, `World<P>`).
pub trait StaticProvider: Provider + Sized {
    /// Registered name.
    const NAME: &'static str;
    /// Can it run in this job? Local checks only (no collective calls); `Err` gives the reason.
    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String>;
    /// Open it. Collective: every rank makes the same bootstrap calls in the same order.
    fn open(boot: &mut dyn Bootstrap) -> Result<Self>;
    /// Capabilities with the current parameters, without opening.
    fn static_caps() -> Result<Caps>;
}

/// What a provider's `probe` can look at.
#[derive(Debug, Clone)]
pub struct ProbeContext {
    pub rank: Rank,
    pub size: u32,
    /// The ranks are threads of one process (test worlds).
    pub in_process: bool,
    /// Number of distinct hosts in the job.
    pub hosts: u32,
    /// Ranks on this host (including this one).
    pub local_ranks: u32,
}

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

use crate::bootstrap::Bootstrap;
use crate::types::{AtomicTable, BasicType, Op, Rank};
use crate::{Error, ErrorDetail, Result};
use std::io::IoSlice;

/// Identifies an operation whose completion a provider reports later through [`Sink::complete`].
pub type Token = u64;

/// A completion counter opened with [`Provider::cntr_open`] (never 0).
pub type CntrId = u64;

/// Where an RMA or atomic operation reports that it finished: a completion-queue entry
/// ([`Sink::complete`] with the token), an increment of a counter, or both. The core asks for a
/// counter only from providers whose [`Caps::counters`] is set; MPICH-OFI's bulk completion of
/// window operations (counters) and request completion (CQ entries) in one type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion {
    /// Report through `Sink::complete(token, ..)`.
    pub cq: Option<Token>,
    /// Increment this counter (its success or its error count).
    pub cntr: Option<CntrId>,
}

impl Completion {
    /// A completion-queue entry only.
    pub const fn cq(token: Token) -> Self {
        Completion {
            cq: Some(token),
            cntr: None,
        }
    }

    /// A counter increment only.
    pub const fn cntr(c: CntrId) -> Self {
        Completion {
            cq: None,
            cntr: Some(c),
        }
    }
}

/// The value of a completion counter: operations that finished, and those that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CntrValue {
    pub ok: u64,
    pub err: u64,
}

impl CntrValue {
    /// Every operation counted, successful or not.
    pub fn total(&self) -> u64 {
        self.ok + self.err
    }
}

/// Counters and completion entries for a provider whose operations finish when they are
/// issued (memory copies, CPU atomics): `finish` records an outcome where [`Completion`] says;
/// `progress` hands the CQ entries to the sink with [`CompletionTable::deliver`].
#[derive(Debug, Default)]
pub struct CompletionTable {
    counters: Vec<Option<CntrValue>>,
    cq: Vec<(Token, Result<Completed>)>,
}

impl CompletionTable {
    /// Open a counter.
    pub fn open(&mut self) -> CntrId {
        let i = match self.counters.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.counters.push(None);
                self.counters.len() - 1
            }
        };
        self.counters[i] = Some(CntrValue::default());
        i as CntrId + 1
    }

    fn slot(&mut self, c: CntrId) -> Result<&mut CntrValue> {
        c.checked_sub(1)
            .and_then(|i| self.counters.get_mut(i as usize))
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::invalid(format!("no open completion counter {c}")))
    }

    /// Read a counter.
    pub fn read(&mut self, c: CntrId) -> Result<CntrValue> {
        self.slot(c).map(|v| *v)
    }

    /// Close a counter.
    pub fn close(&mut self, c: CntrId) -> Result<()> {
        self.slot(c)?;
        self.counters[c as usize - 1] = None;
        Ok(())
    }

    /// Record that an operation finished with `r`.
    pub fn finish(&mut self, done: Completion, r: Result<()>) {
        if let Some(c) = done.cntr {
            if let Ok(v) = self.slot(c) {
                if r.is_ok() {
                    v.ok += 1;
                } else {
                    v.err += 1;
                }
            }
        }
        if let Some(t) = done.cq {
            self.cq.push((t, r.map(|_| Completed::Done)));
        }
    }

    /// Pending CQ entries, for a provider's own completions.
    pub fn push(&mut self, t: Token, r: Result<Completed>) {
        self.cq.push((t, r));
    }

    /// Deliver every pending CQ entry; returns how many.
    pub fn deliver(&mut self, sink: &mut dyn Sink) -> usize {
        let n = self.cq.len();
        for (t, r) in self.cq.drain(..) {
            sink.complete(t, r);
        }
        n
    }
}

/// A raw read-only iovec entry, for operations that outlive the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct RawIov {
    pub ptr: *const u8,
    pub len: usize,
}

/// A raw writable iovec entry, for operations that outlive the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct RawIovMut {
    pub ptr: *mut u8,
    pub len: usize,
}

/// Result of a buffered active-message send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOutcome {
    /// The provider took the message; header and payload may be reused.
    Sent,
    /// No resources now (ring full, socket buffer full); nothing was taken. Retry after progress.
    Busy,
}

/// RMA capabilities of a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RmaCaps {
    /// One-sided read of a peer's registered memory.
    pub read: bool,
    /// One-sided write into a peer's registered memory.
    pub write: bool,
    /// Longest local iovec one RMA operation takes.
    pub max_iov: usize,
    /// Remote keys can be computed locally from a window id (libfabric's scalable registration):
    /// windows then keep no per-peer key table.
    pub scalable_keys: bool,
    /// The provider can place window memory itself (e.g. in a shared segment).
    pub alloc: bool,
    /// Passive-target locks on provider-placed window memory without the target's help
    /// (`rma_try_lock` / `rma_unlock`, e.g. a lock word in shared memory).
    pub native_locks: bool,
    /// Any user memory can be registered (windows over user buffers, zero-copy rendezvous);
    /// `false`: only memory the provider places itself (`mem_alloc`) is reachable natively.
    pub user_memory: bool,
}

/// What a provider can do, and its limits. Capabilities are honest: a provider that says it
/// does something natively does it natively.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caps {
    /// Largest active-message header in bytes.
    pub max_am_header: usize,
    /// Largest active-message payload in bytes (the rendezvous chunk size).
    pub max_am_payload: usize,
    /// Messages up to this size go eagerly (`<= max_am_payload`); `WEFT_EAGER_LIMIT` overrides.
    pub eager_limit: usize,
    /// Longest payload iovec `am_send` takes.
    pub max_iov: usize,
    /// The provider matches tagged messages itself (libfabric FI_TAGGED).
    pub tagged: bool,
    /// Memory registration and RMA, if any.
    pub rma: Option<RmaCaps>,
    /// Native (operation, type) atomic pairs.
    pub atomics: AtomicTable,
    /// Completion counters ([`Provider::cntr_open`]) for RMA and atomic operations.
    pub counters: bool,
    /// Ranks may live in different processes.
    pub spans_processes: bool,
    /// Ranks may live on different hosts.
    pub spans_hosts: bool,
}

impl Caps {
    /// Active messages only, with the given limits.
    pub fn am_only(max_am_header: usize, max_am_payload: usize, max_iov: usize) -> Self {
        Caps {
            max_am_header,
            max_am_payload,
            eager_limit: max_am_payload,
            max_iov,
            tagged: false,
            rma: None,
            atomics: AtomicTable::NONE,
            counters: false,
            spans_processes: true,
            spans_hosts: false,
        }
    }

    /// Short list of capability names for `weft info`.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v = vec!["am"];
        if self.tagged {
            v.push("tagged");
        }
        if let Some(r) = &self.rma {
            if r.read {
                v.push("rma-read");
            }
            if r.write {
                v.push("rma-write");
            }
            if r.alloc {
                v.push("win-alloc");
            }
            if r.scalable_keys {
                v.push("scalable-keys");
            }
        }
        if !self.atomics.is_empty() {
            v.push("atomics");
        }
        if self.counters {
            v.push("counters");
        }
        v
    }
}

/// Status of a natively matched tagged receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaggedStatus {
    /// World rank of the sender.
    pub source: Rank,
    pub tag: i32,
    /// Length of the message as sent (may exceed the receive buffer: then it was truncated).
    pub bytes: usize,
}

/// What completed, reported through [`Sink::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completed {
    /// A send, RMA or atomic operation finished.
    Done,
    /// A tagged receive matched and its data is in place.
    Received(TaggedStatus),
    /// A tagged receive was cancelled before it matched.
    Cancelled,
}

/// Where a remote RMA access lands: a key and an address as the target registered them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteAddr {
    pub addr: u64,
    pub key: u64,
}

/// A registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemRegion {
    /// Key a peer presents to access the region.
    pub key: u64,
    /// Address a peer uses for the region's first byte.
    pub addr: u64,
    pub len: usize,
    /// Provider-private handle.
    pub handle: u64,
}

/// Access rights of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    pub remote_read: bool,
    pub remote_write: bool,
    pub remote_atomic: bool,
}

impl Access {
    pub const READ: Access = Access {
        remote_read: true,
        remote_write: false,
        remote_atomic: false,
    };
    pub const WRITE: Access = Access {
        remote_read: false,
        remote_write: true,
        remote_atomic: false,
    };
    pub const ALL: Access = Access {
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
    };
}

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
}

fn unsupported<T>(what: &str) -> Result<T> {
    Err(Error::from(ErrorDetail::Unsupported(format!(
        "{what} is not a native capability of this provider"
    ))))
}

/// A fabric provider. See the module documentation for the contract.
///
/// Only `caps`, `rank`, `size`, `am_send` and `progress` are mandatory; every other method has a
/// default that reports [`Error::from(ErrorDetail::Unsupported)`] and is only called when [`Caps`] advertises it.
pub trait Provider: 'static {
    /// Name as registered (`shm`, `tcp-sim`, ...).
    fn name(&self) -> &str;
    fn caps(&self) -> &Caps;
    /// This process's world rank.
    fn rank(&self) -> Rank;
    /// Number of ranks in the world.
    fn size(&self) -> u32;

    /// Send an active message: `header.len() <= caps.max_am_header`, total payload
    /// `<= caps.max_am_payload`, `payload.len() <= caps.max_iov`.
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

    /// Native atomic on `count` elements of `ty` at `remote`: `target = target op origin`
    /// (or compare-and-swap with `compare`), old values to `result` when not null.
    ///
    /// # Safety
    /// `origin`, `compare` and `result` (when non-null) must point at `count` elements and stay
    /// valid until the operation completes (reported as `done` says).
    #[allow(clippy::too_many_arguments)]
    unsafe fn atomic(
        &mut self,
        _dest: Rank,
        _op: Op,
        _ty: BasicType,
        _count: usize,
        _origin: *const u8,
        _compare: *const u8,
        _result: *mut u8,
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

impl<T: Provider + ?Sized> Provider for Box<T> {
    #[inline]
    fn name(&self) -> &str {
        (**self).name()
    }
    #[inline]
    fn caps(&self) -> &Caps {
        (**self).caps()
    }
    #[inline]
    fn rank(&self) -> Rank {
        (**self).rank()
    }
    #[inline]
    fn size(&self) -> u32 {
        (**self).size()
    }
    #[inline]
    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        (**self).am_send(dest, header, payload)
    }
    #[inline]
    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        (**self).progress(sink)
    }
    fn close(&mut self) -> Result<()> {
        (**self).close()
    }
    unsafe fn tagged_send(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        data: &[RawIov],
        sync: bool,
        token: Token,
    ) -> Result<()> {
        (**self).tagged_send(dest, ctx, tag, data, sync, token)
    }
    unsafe fn tagged_recv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: &[RawIovMut],
        token: Token,
    ) -> Result<()> {
        (**self).tagged_recv(src, ctx, tag, buf, token)
    }
    fn tagged_probe(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        (**self).tagged_probe(src, ctx, tag)
    }
    fn tagged_cancel(&mut self, token: Token) -> Result<bool> {
        (**self).tagged_cancel(token)
    }
    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        (**self).mr_register(base, len, access)
    }
    unsafe fn mr_register_keyed(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
    ) -> Result<MemRegion> {
        (**self).mr_register_keyed(base, len, access, key)
    }
    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        (**self).mr_deregister(mr)
    }
    fn mem_alloc(&mut self, len: usize) -> Result<(*mut u8, MemRegion)> {
        (**self).mem_alloc(len)
    }
    fn mem_free(&mut self, ptr: *mut u8, mr: &MemRegion) -> Result<()> {
        (**self).mem_free(ptr, mr)
    }
    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        (**self).rma_read(src, local, remote, done)
    }
    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        (**self).rma_write(dest, local, remote, done)
    }
    unsafe fn atomic(
        &mut self,
        dest: Rank,
        op: Op,
        ty: BasicType,
        count: usize,
        origin: *const u8,
        compare: *const u8,
        result: *mut u8,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        (**self).atomic(dest, op, ty, count, origin, compare, result, remote, done)
    }
    fn cntr_open(&mut self) -> Result<CntrId> {
        (**self).cntr_open()
    }
    #[inline]
    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        (**self).cntr_read(cntr)
    }
    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        (**self).cntr_close(cntr)
    }
    fn rma_try_lock(&mut self, target: Rank, window: RemoteAddr, exclusive: bool) -> Result<bool> {
        (**self).rma_try_lock(target, window, exclusive)
    }
    fn rma_unlock(&mut self, target: Rank, window: RemoteAddr, exclusive: bool) -> Result<()> {
        (**self).rma_unlock(target, window, exclusive)
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

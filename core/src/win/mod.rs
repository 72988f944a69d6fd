//! One-sided communication: windows, epochs, operations, synchronisation and epoch scheduling.
//!
//! A [`Window`] exposes memory of every rank of a communicator. Operations run inside an
//! *epoch*, which this API expresses as a closure — the same way [`Comm::scope`] holds
//! nonblocking requests — so origin buffers stay borrowed until the synchronisation that
//! completes them:
//!
//! ```
//! # weft_testing::world(2, |comm| {
//! let mut mem = vec![0u64; 4];
//! let me = comm.rank();
//! comm.win_create(&mut mem, weft::WinInfo::default(), |win| {
//!     let src = [me as u64 + 1; 2];
//!     win.fence_epoch(weft::Assert::NONE, |e| e.put(&src, 1 - me, 2))?;
//!     let mut seen = [0u64; 2];
//!     win.read_local(2, &mut seen)?;
//!     assert_eq!(seen, [(1 - me) as u64 + 1; 2]);
//!     Ok(())
//! })
//! .unwrap();
//! assert_eq!(mem[2..], [(1 - me) as u64 + 1; 2]); // the memory is the caller's again
//! # });
//! ```
//!
//! A window cannot leave its closure, so it cannot be leaked (`mem::forget`) while its memory
//! goes away and peers still write into it:
//!
//! ```compile_fail
//! # weft_testing::world(1, |comm| {
//! let mut mem = vec![0u8; 8];
//! let win = comm.win_create(&mut mem, weft::WinInfo::default(), |w| Ok(w)).unwrap();
//! std::mem::forget(win);
//! # });
//! ```
//!
//! Synchronisation: [`Window::fence_epoch`]/[`Window::fence`]; [`Window::post`] +
//! [`Window::wait`] with [`Window::start_epoch`] (post-start-complete-wait);
//! [`Window::lock_epoch`] and [`Window::lock_all_epoch`], with `flush`, `flush_all`,
//! `flush_local` inside.
//!
//! Paths: when the provider can register the window's memory and read/write it remotely, puts
//! and gets are native; otherwise they are active messages applied by the target's progress.
//! A window uses native atomics only if every (operation, type) its `accumulate_ops` allows is
//! native, otherwise the active-message path for all of them.
//!
//! Epoch scheduling (`WEFT_RMA_SCHED`, or [`WinInfo::sched`]): `off` issues in program order;
//! `reorder` holds puts and accumulates, sends each get at once ahead of them together with the
//! oldest held one (so the two directions interleave while the program goes on), and issues
//! what is still held at the synchronisation;
//! `aggregate` defers and packs operations up to `WEFT_RMA_AGG_MAX` bytes per target into one
//! active message, with the synchronisation (complete, unlock, flush, even the lock itself)
//! folded into the last one; `full` does both. As in paper 002, packing takes small puts and
//! gets off the native path too, on windows over registered memory (large ones stay native;
//! atomics keep their path): a batch pays the fabric's per-operation cost once. If any rank of
//! a window aggregates, the window is *packing* on every rank (agreed at creation): it then
//! uses the active-message fence and locks, which see the batches. Packed gets leave first,
//! in a batch of their own, so that the target answers them while the origin packs the rest
//! (not ahead of a lazy lock, which rides on the epoch's one batch).

use crate::am::mr_cache::MrRef;
use crate::am::{Hdr, Out};
use crate::comm::Comm;
use crate::datatype::Datatype;
use crate::engine::Engine;
use crate::provider::{
    Access, AtomicOp, CntrId, CntrValue, Completion, MemRegion, MrDesc, Provider, RawIov,
    RawIovMut, RemoteAddr,
};
use crate::rma::{self, Wait, WinState};
use crate::types::{BasicType, Element, Op, Rank};
use crate::{Error, ErrorDetail, Result};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

mod epoch;
mod issue;
mod sync;

pub use epoch::{Epoch, RmaRequest};

/// A few communicator ranks (the targets of one synchronisation), without an allocation.
type Targets = SmallVec<[u32; 4]>;

crate::param!(RMA_SCHED: Enum(&["off", "reorder", "aggregate", "full"]) = "", "RMA_SCHED", "off",
    "epoch scheduling of RMA operations: off (program order), reorder (gets interleaved ahead of puts), aggregate (pack small operations, fold the sync), full (both)");
crate::param!(RMA_AGG_MAX: Size = "", "RMA_AGG_MAX", "1K",
    "operations up to this many bytes are aggregated by WEFT_RMA_SCHED=aggregate|full (puts and gets also on native windows over registered memory)");

/// Epoch scheduling policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sched {
    Off,
    Reorder,
    Aggregate,
    Full,
}

impl Sched {
    pub fn from_env() -> Result<Sched> {
        Ok(match RMA_SCHED.get_enum()? {
            "reorder" => Sched::Reorder,
            "aggregate" => Sched::Aggregate,
            "full" => Sched::Full,
            _ => Sched::Off,
        })
    }
    fn defers(self) -> bool {
        self != Sched::Off
    }
    fn reorders(self) -> bool {
        matches!(self, Sched::Reorder | Sched::Full)
    }
    fn aggregates(self) -> bool {
        matches!(self, Sched::Aggregate | Sched::Full)
    }
}

/// Window creation hints.
#[derive(Debug, Clone, Default)]
pub struct WinInfo {
    /// The (operation, type) pairs accumulate-class operations on this window may use; `None`
    /// means all. Native atomics are used only if the provider has every one of them.
    pub accumulate_ops: Option<Vec<(Op, BasicType)>>,
    /// Scheduling policy; `None` reads `WEFT_RMA_SCHED`.
    pub sched: Option<Sched>,
    /// Largest operation the `aggregate` and `full` policies pack into batches; `None` reads
    /// `WEFT_RMA_AGG_MAX`. Operations whose batch record would not fit one active message of
    /// the provider are never aggregated.
    pub agg_max: Option<usize>,
}

/// Fence assertions (MPI_MODE_*).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Assert(u8);

impl Assert {
    pub const NONE: Assert = Assert(0);
    /// No RMA operations were issued in the epoch this fence closes (anywhere).
    pub const NOPRECEDE: Assert = Assert(1);
    /// No RMA operations will be issued in the epoch this fence opens.
    pub const NOSUCCEED: Assert = Assert(2);
    /// The local window was not updated by local stores since the last synchronisation.
    pub const NOSTORE: Assert = Assert(4);
    /// The local window will not be updated by puts or accumulates in the next epoch.
    pub const NOPUT: Assert = Assert(8);

    pub fn contains(self, o: Assert) -> bool {
        self.0 & o.0 == o.0
    }
}

impl std::ops::BitOr for Assert {
    type Output = Assert;
    fn bitor(self, o: Assert) -> Assert {
        Assert(self.0 | o.0)
    }
}

/// Lock kinds for passive-target epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockKind {
    Shared,
    Exclusive,
}

/// What a remote rank's window looks like to us.
#[derive(Debug, Clone, Copy)]
struct Peer {
    len: usize,
    disp_unit: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Put,
    Get,
    Acc(Op, BasicType),
    /// get-accumulate / fetch-and-op (`cmp` null) or compare-and-swap.
    Rmw(Op, BasicType),
}

/// One contiguous operation on one target.
#[derive(Debug, Clone, Copy)]
struct PendingOp {
    kind: OpKind,
    /// Communicator rank of the target.
    trank: u32,
    /// Byte offset in the target window.
    toff: usize,
    len: usize,
    /// Origin data (put, acc, rmw).
    origin: *const u8,
    /// Where results land (get, rmw).
    result: *mut u8,
    /// Compare data (compare-and-swap).
    compare: *const u8,
}

/// Memory the window owns (allocated windows).
enum Owned {
    Core(Vec<u8>),
    Provider(*mut u8, MemRegion),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access_ {
    None,
    Fence,
    Start,
    Lock,
}

/// A window: memory of every rank of a communicator, open to one-sided operations.
pub struct Window<'w, P: Provider> {
    comm: Comm<P>,
    id: u32,
    base: *mut u8,
    len: usize,
    disp_unit: usize,
    peers: Vec<Peer>,
    /// Remote keys per rank for native access; `None` when the provider computes keys from the
    /// window id (scalable registration) or the window is not native.
    keys: Option<Vec<RemoteAddr>>,
    native_put: bool,
    native_get: bool,
    native_atomics: bool,
    /// Locks through the provider (shared flags) instead of active messages.
    native_locks: bool,
    /// Aggregation packs small puts and gets into batches although they could go natively
    /// (some rank aggregates, and the memory is registered, not provider-placed).
    pack_native: bool,
    sched: Sched,
    agg_max: usize,
    mr: Option<MemRegion>,
    owned: Option<Owned>,
    pending: RefCell<Vec<PendingOp>>,
    /// How many operations at the front of `pending` a get has already issued (reorder).
    released: Cell<usize>,
    /// Gets and the rest while reordering (kept to reuse their capacity).
    reorder_scratch: RefCell<(Vec<PendingOp>, Vec<PendingOp>)>,
    access: Cell<Access_>,
    /// Targets of the current start epoch, or the locked target(s).
    targets: RefCell<Vec<u32>>,
    /// Origins of the current post (exposure) epoch.
    exposed: RefCell<Vec<u32>>,
    /// Lock deferred to the first synchronisation (aggregate): (target, kind).
    lazy_lock: Cell<Option<(u32, u8)>>,
    /// Targets that received active-message operations since their last flush/unlock.
    am_dirty: RefCell<Vec<bool>>,
    /// Targets of native writes not proven delivered yet (providers with transmit completion).
    written: RefCell<Vec<bool>>,
    /// Where the fenced reads that prove delivery land.
    probe: RefCell<Box<[u8; 8]>>,
    /// Tokens of operations not known to be complete.
    tokens: RefCell<Vec<u64>>,
    /// Registrations describing the epoch's local buffers to a provider that needs local
    /// descriptors; released once its operations have completed.
    local_mrs: RefCell<Vec<MrRef>>,
    /// The provider's completion counter for this window's bulk native operations (None:
    /// every native operation reports a CQ entry and the core counts them).
    cntr: Option<CntrId>,
    /// Operations issued on `cntr`, and those of them known complete (or failed).
    cntr_issued: Cell<u64>,
    cntr_seen: Cell<CntrValue>,
    /// World ranks targeted by counted operations since the counter last caught up.
    cntr_targets: RefCell<Vec<Rank>>,
    /// Operations issued or recorded in the current epoch.
    epoch_ops: Cell<u64>,
    /// Fences this rank has ended on the window (the count of `FENCE`s it waits for from
    /// every rank).
    fences: Cell<u64>,
    /// The last of those fences for which every rank's DONE has been seen: operations to a
    /// rank wait for its DONE of the last fence (it has applied that epoch) before they go.
    done_seen: Cell<u64>,
    /// The current lock epoch is exclusive.
    excl: Cell<bool>,
    /// The provider's ranks may be processes (else threads of this one: see `self_addr`).
    spans_processes: bool,
    freed: Cell<bool>,
    _mem: PhantomData<&'w mut [u8]>,
}

impl<P: Provider> Comm<P> {
    /// Expose `mem` as a window for the duration of `f` (MPI_Win_create ... MPI_Win_free);
    /// `disp_unit` = `size_of::<T>()`. Collective over the communicator, at both ends: the
    /// window is freed (a barrier) when `f` returns, and `f`'s result is returned after that.
    ///
    /// The window lives in a closure, like the requests of a [`Comm::scope`], so that it cannot
    /// outlive `mem`: a window that could be leaked (`mem::forget`) would stay registered while
    /// the memory went away, and a peer's put would land in freed memory. If `f` panics, the
    /// window is released locally (not collectively) on the way out. Windows whose memory the
    /// library allocates ([`Comm::win_allocate`]) own it and need no closure.
    pub fn win_create<T: Element, R>(
        &self,
        mem: &mut [T],
        info: WinInfo,
        f: impl FnOnce(&Window<'_, P>) -> Result<R>,
    ) -> Result<R> {
        let base = mem.as_mut_ptr() as *mut u8;
        let len = std::mem::size_of_val(mem);
        let win = Window::new(self, base, len, std::mem::size_of::<T>(), info, None)?;
        let r = f(&win);
        // Dropped here on unwinding instead: `Drop` releases locally.
        let freed = win.free_inner();
        let v = r?;
        freed?;
        Ok(v)
    }

    /// Create a window over `len` zeroed elements of `T` placed by the provider where it can
    /// (e.g. in the shared segment), else by the core (MPI_Win_allocate). Collective.
    pub fn win_allocate<T: Element>(
        &self,
        len: usize,
        info: WinInfo,
    ) -> Result<Window<'static, P>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::invalid("window size overflows"))?;
        // Every rank asks the provider only if every rank can, so the choice is consistent.
        let can = self.provider_caps().rma.is_some_and(|r| r.alloc) as u32;
        let mut all = [0u32];
        self.allreduce(&[can], &mut all, Op::Min)?;
        let owned = if all[0] == 1 {
            let r = self.sh.engine.borrow_mut().p.mem_alloc(bytes.max(1));
            match r {
                Ok((p, mr)) => Owned::Provider(p, mr),
                Err(e) => {
                    tracing::info!("provider window allocation failed ({e}); using core memory");
                    Owned::Core(vec![0u8; bytes])
                }
            }
        } else {
            Owned::Core(vec![0u8; bytes])
        };
        // Agree on whether everyone got provider memory.
        let got = matches!(owned, Owned::Provider(..)) as u32;
        let mut allgot = [0u32];
        self.allreduce(&[got], &mut allgot, Op::Min)?;
        let owned = match (owned, allgot[0]) {
            (Owned::Provider(p, mr), 0) => {
                let _ = self.sh.engine.borrow_mut().p.mem_free(p, &mr);
                Owned::Core(vec![0u8; bytes])
            }
            (o, _) => o,
        };
        let (base, mr) = match &owned {
            Owned::Core(v) => (v.as_ptr() as *mut u8, None),
            Owned::Provider(p, mr) => {
                // SAFETY: fresh provider memory of `bytes` bytes; zero it.
                unsafe { std::ptr::write_bytes(*p, 0, bytes) };
                (*p, Some(*mr))
            }
        };
        Window::new(
            self,
            base,
            bytes,
            std::mem::size_of::<T>(),
            info,
            Some((owned, mr)),
        )
    }
}

impl<'w, P: Provider> Window<'w, P> {
    fn new(
        comm: &Comm<P>,
        base: *mut u8,
        len: usize,
        disp_unit: usize,
        info: WinInfo,
        owned: Option<(Owned, Option<MemRegion>)>,
    ) -> Result<Self> {
        let wcomm = comm.dup()?;
        let id = wcomm.ctx;
        let sched = match info.sched {
            Some(s) => s,
            None => Sched::from_env()?,
        };
        let agg_max = match info.agg_max {
            Some(v) => v,
            None => RMA_AGG_MAX.get_size()?,
        };
        let caps = comm.provider_caps();
        let (owned, pre_mr) = match owned {
            Some((o, m)) => (Some(o), m),
            None => (None, None),
        };
        // Register the memory for native access when the provider can; with scalable keys
        // the key is the window id and addresses are offsets, so nobody needs a key table.
        let scalable = caps.rma.is_some_and(|r| r.scalable_keys) && pre_mr.is_none();
        let placed = pre_mr.is_some();
        let mut mr = pre_mr;
        if mr.is_none() {
            if let Some(rc) = caps.rma {
                if (rc.read || rc.write) && rc.user_memory && !rc.rndv_only {
                    let mut eng = comm.sh.engine.borrow_mut();
                    // SAFETY: the window keeps `base..base+len` borrowed (or owned) until
                    // `free`, which deregisters first.
                    let r = unsafe {
                        if scalable {
                            eng.p
                                .mr_register_keyed(base, len.max(1), Access::ALL, id as u64)
                        } else {
                            eng.p.mr_register(base, len.max(1), Access::ALL)
                        }
                    };
                    match r {
                        Ok(m) => mr = Some(m),
                        Err(e) => tracing::debug!("window registration failed: {e}"),
                    }
                }
            }
        }
        let native_mem = mr.is_some() as u32;
        // Agree on the path (and on what decides whether small operations are packed, below),
        // then exchange sizes and (unless keys are computable) keys.
        let no_packing = !sched.aggregates() as u32;
        let mut agreed = [0u32; 3];
        wcomm.allreduce(
            &[native_mem, no_packing, placed as u32],
            &mut agreed,
            Op::Min,
        )?;
        let native = agreed[0] == 1;
        // Paper 002's aggregation: small puts and gets travel packed in active-message batches
        // even where the window is native (large ones stay native), because a native operation
        // over registered memory pays the fabric's initiation and completion per operation (a
        // CMA system call, a work request) and a batch pays them once. Not on memory the
        // provider placed (shm's segment), where a native put is a plain copy. Agreed by all
        // ranks, because it decides collective paths: such a window never takes the all-native
        // fence or native locks, which know nothing of active messages.
        let pack_native = native && agreed[1] == 0 && agreed[2] == 0;
        let n = wcomm.size() as usize;
        let mut sizes = vec![0u64; 2 * n];
        wcomm.allgather(&[len as u64, disp_unit as u64], &mut sizes)?;
        let peers = sizes
            .chunks(2)
            .map(|c| Peer {
                len: c[0] as usize,
                disp_unit: c[1] as usize,
            })
            .collect::<Vec<_>>();
        let keys = if native && !scalable {
            let mut t = vec![0u64; 2 * n];
            wcomm.allgather(&[mr.map_or(0, |m| m.addr), mr.map_or(0, |m| m.key)], &mut t)?;
            Some(
                t.chunks(2)
                    .map(|c| RemoteAddr {
                        addr: c[0],
                        key: c[1],
                    })
                    .collect(),
            )
        } else {
            None
        };
        let ops: Vec<(Op, BasicType)> = info.accumulate_ops.clone().unwrap_or_else(|| {
            Op::ALL
                .iter()
                .flat_map(|o| BasicType::ALL.iter().map(move |t| (*o, *t)))
                .filter(|(o, t)| o.valid_for(*t))
                .collect()
        });
        let native_atomics = native && ops.iter().all(|(o, t)| caps.atomics.query(*o, *t));
        // Writes that complete only at transmission need a fenced read to prove delivery at
        // the end of an epoch; without a fence they stay on active messages.
        let native_put = native
            && caps
                .rma
                .is_some_and(|r| r.write && (r.delivery_complete() || (r.fence && r.read)));
        let native_get = native && caps.rma.is_some_and(|r| r.read);
        // Native locks only make sense when no operation needs the target's progress.
        let native_locks = !pack_native
            && native_put
            && native_get
            && native_atomics
            && keys.is_some()
            && caps.rma.is_some_and(|r| r.native_locks);
        let cntr = if (native_put || native_get || native_atomics) && caps.counters {
            match comm.sh.engine.borrow_mut().p.cntr_open() {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::debug!("no completion counter ({e}); counting CQ entries");
                    None
                }
            }
        } else {
            None
        };
        comm.sh
            .engine
            .borrow_mut()
            .st
            .rma
            .wins
            .insert(id, WinState::new(base, len));
        // Everyone has the window registered in its engine before anyone sends to it.
        wcomm.barrier()?;
        Ok(Window {
            id,
            base,
            len,
            disp_unit,
            peers,
            keys,
            native_put,
            native_get,
            native_atomics,
            native_locks,
            pack_native,
            sched,
            agg_max,
            mr: if owned.is_some() { None } else { mr },
            owned,
            pending: RefCell::new(Vec::new()),
            released: Cell::new(0),
            reorder_scratch: RefCell::new((Vec::new(), Vec::new())),
            access: Cell::new(Access_::None),
            targets: RefCell::new(Vec::new()),
            exposed: RefCell::new(Vec::new()),
            lazy_lock: Cell::new(None),
            am_dirty: RefCell::new(vec![false; n]),
            written: RefCell::new(vec![false; n]),
            probe: RefCell::new(Box::new([0; 8])),
            tokens: RefCell::new(Vec::new()),
            local_mrs: RefCell::new(Vec::new()),
            cntr,
            cntr_issued: Cell::new(0),
            cntr_seen: Cell::new(CntrValue::default()),
            cntr_targets: RefCell::new(Vec::new()),
            epoch_ops: Cell::new(0),
            fences: Cell::new(0),
            done_seen: Cell::new(0),
            excl: Cell::new(false),
            spans_processes: caps.spans_processes,
            freed: Cell::new(false),
            comm: wcomm,
            _mem: PhantomData,
        })
    }

    /// Which paths this window uses: (native put, native get, native atomics).
    pub fn native_paths(&self) -> (bool, bool, bool) {
        (self.native_put, self.native_get, self.native_atomics)
    }

    /// How this window's bulk (not request-based) native operations complete: through a
    /// provider counter, through one completion-queue entry each, or not at all because
    /// every operation takes the active-message path.
    pub fn completion(&self) -> WinCompletion {
        if !(self.native_put || self.native_get || self.native_atomics) {
            WinCompletion::ActiveMessages
        } else if self.cntr.is_some() {
            WinCompletion::Counter
        } else {
            WinCompletion::Queue
        }
    }

    /// Whether passive-target locks go through the provider (shared flags).
    pub fn native_locks(&self) -> bool {
        self.native_locks
    }

    /// Whether small puts and gets travel in aggregated batches although this window is
    /// native (some rank's policy aggregates and the memory is registered user memory).
    pub fn packs_native(&self) -> bool {
        self.pack_native
    }

    /// Whether the window keeps a per-peer key table (false with scalable registration).
    pub fn has_key_table(&self) -> bool {
        self.keys.is_some()
    }

    pub fn sched(&self) -> Sched {
        self.sched
    }

    /// The window's communicator (a duplicate of the one it was created on).
    pub fn comm(&self) -> &Comm<P> {
        &self.comm
    }

    /// Bytes of local window memory.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// Copy local window elements starting at `disp` into `out`. Outside this rank's epochs
    /// on the window only (an open access or exposure epoch is an error): the window's own
    /// operations may still be landing then.
    pub fn read_local<T: Element>(&self, disp: usize, out: &mut [T]) -> Result<()> {
        let off = self.local_range(disp, std::mem::size_of_val(out), "read")?;
        let n = std::mem::size_of_val(out);
        if let Some(ra) = self.self_addr(off) {
            return self.local_via_provider(ra, out.as_mut_ptr() as *mut u8, n, false);
        }
        // SAFETY: `[off, off + n)` is inside the window memory (checked); the copy goes through
        // raw pointers, so no reference to memory other processes may write is ever formed.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(off), out.as_mut_ptr() as *mut u8, n)
        };
        Ok(())
    }

    /// Copy `data` into local window elements starting at `disp` (outside this rank's epochs on
    /// the window, as for [`Window::read_local`]).
    pub fn write_local<T: Element>(&self, disp: usize, data: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(data);
        let off = self.local_range(disp, n, "write")?;
        if let Some(ra) = self.self_addr(off) {
            return self.local_via_provider(ra, data.as_ptr() as *mut u8, n, true);
        }
        // SAFETY: as in `read_local`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, self.base.add(off), n) };
        Ok(())
    }

    /// MPI_Win_sync, then a load: drive progress once (operations that reach this rank as
    /// active messages land), order memory, and copy local window elements starting at `disp`
    /// into `out`. Unlike [`Window::read_local`] this may be called in any epoch, to watch
    /// memory that other ranks write (MPI's unified memory model): an operation landing
    /// meanwhile may be seen in part, so a reader polls a value the writer puts last (the last
    /// byte of a put, as `ucx_perftest`'s put latency does) or one an atomic wrote.
    pub fn sync_read_local<T: Element>(&self, disp: usize, out: &mut [T]) -> Result<()> {
        if self.freed.get() {
            return Err(Error::invalid("window already freed"));
        }
        let n = std::mem::size_of_val(out);
        let off = disp
            .checked_mul(self.disp_unit)
            .filter(|off| off.checked_add(n).is_some_and(|end| end <= self.len))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "local read of {n} bytes at element {disp} is outside the {}-byte window",
                    self.len
                ))
            })?;
        self.engine().progress()?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if let Some(ra) = self.self_addr(off) {
            // Other ranks are threads of this process writing under the provider's lock.
            return self.local_via_provider(ra, out.as_mut_ptr() as *mut u8, n, false);
        }
        let dst = out.as_mut_ptr() as *mut u8;
        for i in 0..n {
            // SAFETY: `[off, off + n)` is inside the window memory (checked) and `dst` is `out`,
            // `n` bytes. The loads are volatile and through raw pointers: other processes may
            // write this memory at any time (through a shared mapping or the kernel), so no
            // reference to it is formed and no load may be elided or merged; whatever bytes
            // are read are valid for `T: Element` (plain old data).
            unsafe { *dst.add(i) = std::ptr::read_volatile(self.base.add(off + i)) };
        }
        Ok(())
    }

    /// Local access through the provider (see [`Window::self_addr`]): `n` bytes at `ptr` are
    /// read from (`write`) or written with the window memory at `ra`. The buffer gets a local
    /// descriptor when the provider wants one, and a write whose completion is only
    /// transmission is proven landed (a fenced read) before this returns.
    fn local_via_provider(
        &self,
        ra: RemoteAddr,
        ptr: *mut u8,
        n: usize,
        write: bool,
    ) -> Result<()> {
        let me_t = self.comm.rank();
        let me = self.world(me_t);
        let delivery = {
            let mut eng = self.engine();
            let e = &mut *eng;
            let access = if write {
                crate::provider::Access::LOCAL
            } else {
                crate::provider::Access::LOCAL_WRITE
            };
            let (desc, mr) = if e.st.am.caps.mr_local && n > 0 {
                let (d, m) = e.st.am.mr.acquire(&mut e.p, ptr, n, access)?;
                (d, Some(m))
            } else {
                (0, None)
            };
            // SAFETY: the caller's buffer is borrowed for this call, and the copy happens within
            // it: this path is taken only for providers whose ranks are threads of one process,
            // which copy at issue time (the contract of `Caps::spans_processes == false`).
            let r = unsafe {
                if write {
                    let local = [RawIov { desc, ptr, len: n }];
                    e.p.rma_write(me, &local, ra, Completion::default())
                } else {
                    let local = [RawIovMut { desc, ptr, len: n }];
                    e.p.rma_read(me, &local, ra, Completion::default())
                }
            };
            if let Some(m) = mr {
                e.st.am.mr.release(m);
            }
            r?;
            e.st.am.caps.rma.is_some_and(|r| r.delivery_complete())
        };
        if write && !delivery {
            self.written.borrow_mut()[me_t as usize] = true;
            self.prove_delivery(Some(&[me_t]))?;
        }
        Ok(())
    }

    /// The byte offset of local elements `[disp, disp + n bytes)`, checked without overflow,
    /// outside this rank's epochs on the window.
    fn local_range(&self, disp: usize, n: usize, what: &str) -> Result<usize> {
        if self.freed.get() {
            return Err(Error::invalid("window already freed"));
        }
        if self.access.get() != Access_::None || !self.exposed.borrow().is_empty() {
            return Err(Error::invalid(format!(
                "local {what} of window memory during an epoch of this window"
            )));
        }
        disp.checked_mul(self.disp_unit)
            .filter(|off| off.checked_add(n).is_some_and(|end| end <= self.len))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "local {what} of {n} bytes at element {disp} is outside the {}-byte window",
                    self.len
                ))
            })
    }

    /// Where the provider addresses this rank's own window memory at `off`, when local access
    /// must go through it: native windows of a provider whose ranks are threads of one process
    /// (other ranks' threads copy into this memory under the provider's lock, so a plain copy
    /// here would race with them).
    fn self_addr(&self, off: usize) -> Option<RemoteAddr> {
        if self.spans_processes || !(self.native_put || self.native_get) {
            return None;
        }
        let me = self.comm.rank() as usize;
        let base = match &self.keys {
            Some(k) => k[me],
            None => RemoteAddr {
                addr: 0,
                key: self.id as u64,
            },
        };
        Some(RemoteAddr {
            addr: base.addr + off as u64,
            key: base.key,
        })
    }

    fn engine(&self) -> std::cell::RefMut<'_, Engine<P>> {
        self.comm.sh.engine.borrow_mut()
    }

    fn world(&self, trank: u32) -> Rank {
        self.comm.world_rank(trank).expect("checked rank")
    }

    fn check_target(&self, trank: u32, toff: usize, n: usize) -> Result<()> {
        let p = self.peers.get(trank as usize).ok_or_else(|| {
            Error::from(ErrorDetail::InvalidRank {
                rank: trank as i64,
                size: self.comm.size(),
            })
        })?;
        rma::check_remote(p.len, toff, n, || self.world(trank))
    }
}

impl<'w, P: Provider> Window<'w, P> {
    /// Free the window (MPI_Win_free). Collective; completes nothing by itself.
    pub fn free(self) -> Result<()> {
        self.free_inner()
    }

    fn free_inner(&self) -> Result<()> {
        if self.freed.replace(true) {
            return Ok(());
        }
        // Every DONE of the last fence in first, so that none arrives for a window gone. If a
        // rank of the window failed, some may never come (a fence the failure cut short sends
        // none) and others may come late: the window is then remembered as released, so that
        // what still arrives for it is dropped, not taken for a protocol error.
        let d = (0..self.comm.size()).try_for_each(|t| self.await_done_or(t, true));
        let cut_short = d.is_err();
        let b = self.comm.barrier().and(d);
        let mut eng = self.engine();
        if cut_short {
            eng.st.rma.released.push(self.id);
        }
        // Replies still queued may read this window's memory: copy them before it goes.
        eng.st.am.own_raw_payloads();
        eng.st.rma.wins.remove(&self.id);
        if let Some(c) = self.cntr {
            let _ = eng.p.cntr_close(c);
        }
        if let Some(m) = &self.mr {
            let _ = eng.p.mr_deregister(m);
        }
        if let Some(Owned::Provider(p, m)) = &self.owned {
            let _ = eng.p.mem_free(*p, m);
        }
        b
    }
}

impl<P: Provider> Drop for Window<'_, P> {
    fn drop(&mut self) {
        if !self.freed.get() {
            // Not collective any more (the others may be gone): just release locally.
            self.freed.set(true);
            let Ok(mut eng) = self.comm.sh.engine.try_borrow_mut() else {
                // Only reachable if a window is dropped from inside an engine call: its memory
                // is about to go away while registered, which must not happen.
                crate::engine::fatal(
                    self.comm.sh.engine_rank(),
                    "a window was released while the engine was busy",
                );
            };
            {
                eng.st.am.own_raw_payloads();
                eng.st.rma.wins.remove(&self.id);
                // Peers may still send to it: their messages are dropped quietly.
                eng.st.rma.released.push(self.id);
                if let Some(c) = self.cntr {
                    let _ = eng.p.cntr_close(c);
                }
                if let Some(m) = &self.mr {
                    let _ = eng.p.mr_deregister(m);
                }
                if let Some(Owned::Provider(p, m)) = &self.owned {
                    let _ = eng.p.mem_free(*p, m);
                }
            }
        }
    }
}

/// How a window's bulk native operations report completion ([`Window::completion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WinCompletion {
    /// A provider counter per window; fence and flush wait for it to reach the number issued.
    Counter,
    /// One completion-queue entry per operation, counted by the core.
    Queue,
    /// Every operation is an active message (the target's progress applies it).
    ActiveMessages,
}

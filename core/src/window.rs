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
//! folded into the last one; `full` does both.

use crate::am::{Hdr, Out};
use crate::comm::Comm;
use crate::datatype::Datatype;
use crate::engine::Engine;
use crate::provider::{
    Access, CntrId, CntrValue, Completion, MemRegion, Provider, RawIov, RawIovMut, RemoteAddr,
};
use crate::rma::{self, Wait, WinState};
use crate::types::{BasicType, Element, Op, Rank};
use crate::{Error, ErrorDetail, Result};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

/// A few communicator ranks (the targets of one synchronisation), without an allocation.
type Targets = SmallVec<[u32; 4]>;

crate::param!(RMA_SCHED: Enum(&["off", "reorder", "aggregate", "full"]) = "", "RMA_SCHED", "off",
    "epoch scheduling of RMA operations: off (program order), reorder (gets interleaved ahead of puts), aggregate (pack small operations, fold the sync), full (both)");
crate::param!(RMA_AGG_MAX: Size = "", "RMA_AGG_MAX", "1K",
    "operations up to this many bytes are aggregated by WEFT_RMA_SCHED=aggregate|full");

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
    /// Tokens of operations not known to be complete.
    tokens: RefCell<Vec<u64>>,
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
        let mut mr = pre_mr;
        if mr.is_none() {
            if let Some(rc) = caps.rma {
                if (rc.read || rc.write) && rc.user_memory {
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
        // Agree on the path, then exchange sizes and (unless keys are computable) keys.
        let mut all_native = [0u32];
        wcomm.allreduce(&[native_mem], &mut all_native, Op::Min)?;
        let native = all_native[0] == 1;
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
        let native_put = native && caps.rma.is_some_and(|r| r.write);
        let native_get = native && caps.rma.is_some_and(|r| r.read);
        // Native locks only make sense when no operation needs the target's progress.
        let native_locks = native_put
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
            tokens: RefCell::new(Vec::new()),
            cntr,
            cntr_issued: Cell::new(0),
            cntr_seen: Cell::new(CntrValue::default()),
            cntr_targets: RefCell::new(Vec::new()),
            epoch_ops: Cell::new(0),
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
            let local = [RawIovMut {
                ptr: out.as_mut_ptr() as *mut u8,
                len: n,
            }];
            let me = self.world(self.comm.rank());
            // SAFETY: `out` is borrowed for the call and the copy finishes within it (the
            // in-process providers copy at issue time).
            return unsafe {
                self.engine()
                    .p
                    .rma_read(me, &local, ra, Completion::default())
            };
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
            let local = [RawIov {
                ptr: data.as_ptr() as *const u8,
                len: n,
            }];
            let me = self.world(self.comm.rank());
            // SAFETY: as in `read_local`.
            return unsafe {
                self.engine()
                    .p
                    .rma_write(me, &local, ra, Completion::default())
            };
        }
        // SAFETY: as in `read_local`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, self.base.add(off), n) };
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
        rma::check_remote(p.len, toff, n, self.world(trank))
    }

    // ------------------------------------------------------------------------------ issuing

    /// Record or issue an operation.
    fn submit(&self, op: PendingOp, deferrable: bool) -> Result<()> {
        self.epoch_ops.set(self.epoch_ops.get() + 1);
        if self.sched.defers() && deferrable {
            if self.sched == Sched::Reorder && op.kind == OpKind::Get {
                // Reordering as the program goes: a get leaves at once, ahead of the puts held
                // so far, and takes the oldest of them along, so that the two directions
                // interleave while the target is busy anyway (rather than idling until the
                // synchronisation). Held operations that no get releases leave at the sync.
                self.issue(op, None)?;
                let i = self.released.get();
                let held = self.pending.borrow().get(i).copied();
                if let Some(h) = held {
                    self.released.set(i + 1);
                    self.issue(h, None)?;
                }
                return Ok(());
            }
            self.pending.borrow_mut().push(op);
            Ok(())
        } else {
            self.issue(op, None).map(|_| ())
        }
    }

    fn is_native(&self, k: OpKind) -> bool {
        match k {
            OpKind::Put => self.native_put,
            OpKind::Get => self.native_get,
            OpKind::Acc(..) | OpKind::Rmw(..) => self.native_atomics,
        }
    }

    /// Issue one operation now. Returns the token to wait on for its (local) completion, if
    /// any.
    fn issue(&self, op: PendingOp, force_token: Option<()>) -> Result<Option<u64>> {
        self.epoch_ops.set(self.epoch_ops.get() + 1);
        let target = self.world(op.trank);
        let peer = self.peers[op.trank as usize];
        let mut eng = self.engine();
        if self.is_native(op.kind) {
            let _ = peer;
            let base = match &self.keys {
                Some(k) => k[op.trank as usize],
                // Scalable registration: the key is the window id, addresses are offsets.
                None => RemoteAddr {
                    addr: 0,
                    key: self.id as u64,
                },
            };
            let ra = RemoteAddr {
                addr: base.addr + op.toff as u64,
                key: base.key,
            };
            let e = &mut *eng;
            // Bulk operations count on the window's counter; request-based ones (and every one
            // when the provider has no counters) get a CQ entry of their own.
            let (done, t) = match (self.cntr, force_token) {
                (Some(c), None) => {
                    self.cntr_issued.set(self.cntr_issued.get() + 1);
                    let mut ts = self.cntr_targets.borrow_mut();
                    if !ts.contains(&target) {
                        ts.push(target);
                    }
                    (Completion::cntr(c), None)
                }
                _ => {
                    let t = e.st.rma.token(
                        Wait::Native {
                            win: self.id,
                            done: false,
                        },
                        target,
                    );
                    if let Some(w) = e.st.rma.wins.get_mut(&self.id) {
                        w.native_issued += 1;
                    }
                    (Completion::cq(t), Some(t))
                }
            };
            // SAFETY (all arms): origin/result/compare point at buffers borrowed by the epoch
            // (or owned by a request) until the token completes, which the epoch's
            // synchronisation waits for.
            let r = unsafe {
                match op.kind {
                    OpKind::Put => e.p.rma_write(
                        target,
                        &[RawIov {
                            ptr: op.origin,
                            len: op.len,
                        }],
                        ra,
                        done,
                    ),
                    OpKind::Get => e.p.rma_read(
                        target,
                        &[RawIovMut {
                            ptr: op.result,
                            len: op.len,
                        }],
                        ra,
                        done,
                    ),
                    OpKind::Acc(o, ty) => e.p.atomic(
                        target,
                        o,
                        ty,
                        op.len / ty.size(),
                        op.origin,
                        std::ptr::null(),
                        std::ptr::null_mut(),
                        ra,
                        done,
                    ),
                    OpKind::Rmw(o, ty) => e.p.atomic(
                        target,
                        o,
                        ty,
                        op.len / ty.size(),
                        op.origin,
                        op.compare,
                        op.result,
                        ra,
                        done,
                    ),
                }
            };
            if let Err(err) = r {
                match t {
                    Some(t) => {
                        e.st.rma.take(t).ok();
                        if let Some(w) = e.st.rma.wins.get_mut(&self.id) {
                            w.native_issued -= 1;
                        }
                    }
                    None => self.cntr_issued.set(self.cntr_issued.get() - 1),
                }
                return Err(err);
            }
            let Some(t) = t else {
                return Ok(None);
            };
            self.tokens.borrow_mut().push(t);
            return Ok(Some(t));
        }
        drop(eng);
        self.issue_am(op, force_token.is_some())
    }

    fn issue_am(&self, op: PendingOp, _req: bool) -> Result<Option<u64>> {
        let target = self.world(op.trank);
        let mut eng = self.engine();
        let e = &mut *eng;
        let chunk = e.st.am.caps.max_am_payload;
        self.am_dirty.borrow_mut()[op.trank as usize] = true;
        let mut msgs = 0u64;
        let token = match op.kind {
            OpKind::Put => {
                let mut at = 0;
                loop {
                    let n = (op.len - at).min(chunk);
                    let mut h = Hdr::new(rma::H_PUT);
                    h.u32(self.id).u64((op.toff + at) as u64);
                    // SAFETY: the origin buffer is borrowed by the epoch, which drains the
                    // outbox before it ends (see Out::Raw).
                    let r = RawIov {
                        ptr: unsafe { op.origin.add(at) },
                        len: n,
                    };
                    e.st.am.push_out(target, Out::Raw(h, r));
                    msgs += 1;
                    at += n;
                    if at >= op.len {
                        break;
                    }
                }
                None
            }
            OpKind::Get => {
                let t = e.st.rma.token(
                    Wait::Data {
                        ptr: op.result,
                        len: op.len,
                        got: 0,
                    },
                    target,
                );
                let mut h = Hdr::new(rma::H_GET);
                h.u32(self.id).u64(op.toff as u64).u64(op.len as u64).u64(t);
                e.st.am.push_ctrl(target, h);
                msgs += 1;
                Some(t)
            }
            OpKind::Acc(o, ty) => {
                let per = (chunk / ty.size()).max(1) * ty.size();
                let mut at = 0;
                loop {
                    let n = (op.len - at).min(per);
                    let mut h = Hdr::new(rma::H_ACC);
                    h.u32(self.id)
                        .u64((op.toff + at) as u64)
                        .u8(o as u8)
                        .u8(ty as u8);
                    // SAFETY: as for puts.
                    let r = RawIov {
                        ptr: unsafe { op.origin.add(at) },
                        len: n,
                    };
                    e.st.am.push_out(target, Out::Raw(h, r));
                    msgs += 1;
                    at += n;
                    if at >= op.len {
                        break;
                    }
                }
                None
            }
            OpKind::Rmw(o, ty) => {
                let t = e.st.rma.token(
                    Wait::Reply {
                        ptr: op.result,
                        len: op.len,
                        done: false,
                    },
                    target,
                );
                let cmp = !op.compare.is_null();
                let mut data = Vec::with_capacity(op.len * 2);
                // SAFETY: origin (and compare) hold `len` bytes, borrowed by the epoch.
                unsafe {
                    data.extend_from_slice(std::slice::from_raw_parts(op.origin, op.len));
                    if cmp {
                        data.extend_from_slice(std::slice::from_raw_parts(op.compare, op.len));
                    }
                }
                let mut h = Hdr::new(rma::H_RMW);
                h.u32(self.id)
                    .u64(op.toff as u64)
                    .u8(o as u8)
                    .u8(ty as u8)
                    .u64(t)
                    .u8(cmp as u8);
                e.st.am.push_owned(target, h, data);
                msgs += 1;
                Some(t)
            }
        };
        if let Some(w) = e.st.rma.wins.get_mut(&self.id) {
            *w.sent.entry(target).or_insert(0) += msgs;
        }
        if let Some(t) = token {
            self.tokens.borrow_mut().push(t);
        }
        e.flush_out()?;
        Ok(token)
    }

    /// Issue the deferred operations in the policy's order; with aggregation, pack small
    /// active-message operations per target into batches. `fold` names a sync to fold into
    /// the last batch of each target in `fold_targets`: returns the targets whose sync was
    /// folded (their sync message must not be sent again).
    fn drain_pending(&self, fold: Option<(u8, &[(u32, u64)])>) -> Result<Targets> {
        // Keep the list's capacity across epochs: an epoch should not cost an allocation.
        let mut ops = std::mem::take(&mut *self.pending.borrow_mut());
        // Operations a get already released (reorder) are issued: drop them from the list.
        let released = self.released.replace(0).min(ops.len());
        ops.drain(..released);
        if ops.is_empty() && fold.is_none() {
            *self.pending.borrow_mut() = ops;
            return Ok(Targets::new());
        }
        let r = self.drain_ops(&mut ops, fold);
        ops.clear();
        let mut p = self.pending.borrow_mut();
        if p.is_empty() {
            *p = ops;
        }
        r
    }

    fn drain_ops(
        &self,
        ops: &mut Vec<PendingOp>,
        fold: Option<(u8, &[(u32, u64)])>,
    ) -> Result<Targets> {
        let is_get = |o: &PendingOp| o.kind == OpKind::Get;
        if self.sched.reorders() && ops.iter().any(is_get) && !ops.iter().all(is_get) {
            // Gets first, interleaved with the rest so both directions carry data; accumulates
            // keep their relative order. (Nothing to do unless both kinds are present.)
            let mut scratch = self.reorder_scratch.borrow_mut();
            let (gets, rest) = &mut *scratch;
            for op in ops.drain(..) {
                if is_get(&op) {
                    gets.push(op);
                } else {
                    rest.push(op);
                }
            }
            let (mut g, mut r) = (gets.drain(..), rest.drain(..));
            loop {
                match (g.next(), r.next()) {
                    (None, None) => break,
                    (a, b) => {
                        ops.extend(a);
                        ops.extend(b);
                    }
                }
            }
        }
        if !self.sched.aggregates() {
            for op in ops.drain(..) {
                self.issue(op, None)?;
            }
            return Ok(Targets::new());
        }
        // A lazy lock may only ride on a batch that carries every operation to its target;
        // otherwise take the lock explicitly before issuing anything.
        if let Some((lt, lk)) = self.lazy_lock.get() {
            let chunk = self.engine().st.am.caps.max_am_payload;
            let mut bytes = 0usize;
            let all_small = ops.iter().filter(|o| o.trank == lt).all(|o| {
                bytes += Self::record_len(o);
                self.aggregatable(o, chunk)
            });
            if !all_small || bytes > chunk || fold.is_none() {
                self.lazy_lock.set(None);
                self.roundtrip(rma::H_LOCK, lt, Some(lk))?;
            }
        }
        // Aggregation: per target, consecutive small AM operations go into batch records.
        // One entry per target this epoch touches (not per rank of the communicator).
        let mut batches: SmallVec<[(u32, Vec<u8>, u64); 4]> = SmallVec::new();
        fn slot(b: &mut SmallVec<[(u32, Vec<u8>, u64); 4]>, t: u32) -> usize {
            b.iter().position(|e| e.0 == t).unwrap_or_else(|| {
                b.push((t, Vec::new(), 0));
                b.len() - 1
            })
        }
        let chunk = self.engine().st.am.caps.max_am_payload;
        for op in ops.drain(..) {
            let i = slot(&mut batches, op.trank);
            let (t, buf, count) = &mut batches[i];
            let small = self.aggregatable(&op, chunk);
            if !small {
                self.send_batch(*t, buf, count, 0, 0, 0)?;
                self.issue(op, None)?;
                continue;
            }
            if !buf.is_empty() && buf.len() + Self::record_len(&op) > chunk {
                self.send_batch(*t, buf, count, 0, 0, 0)?;
            }
            if buf.capacity() == 0 {
                *buf = self.engine().st.am.spare_buf();
            }
            self.record_into(op, buf)?;
            *count += 1;
        }
        let mut folded = Targets::new();
        if let Some((flag, targets)) = fold {
            for &(tr, token) in targets {
                let lock = self.lazy_lock.get().filter(|(lt, _)| *lt == tr);
                let has = batches.iter().any(|e| e.0 == tr && !e.1.is_empty());
                if !has && lock.is_none() && flag != rma::B_COMPLETE {
                    continue;
                }
                let (lflag, lkind) = match lock {
                    Some((_, k)) => (rma::B_LOCK, k),
                    None => (0, 0),
                };
                let i = slot(&mut batches, tr);
                let (t, buf, count) = &mut batches[i];
                self.send_batch(*t, buf, count, flag | lflag, lkind, token)?;
                if lock.is_some() {
                    self.lazy_lock.set(None);
                }
                folded.push(tr);
            }
        }
        for (t, buf, count) in &mut batches {
            self.send_batch(*t, buf, count, 0, 0, 0)?;
        }
        Ok(folded)
    }

    /// Whether `op` goes into a batch: small by `WEFT_RMA_AGG_MAX`, on the active-message
    /// path, and its record fits one active message of `chunk` bytes (so a batch never
    /// exceeds what the provider carries, whatever `WEFT_RMA_AGG_MAX` says).
    fn aggregatable(&self, op: &PendingOp, chunk: usize) -> bool {
        op.len <= self.agg_max && !self.is_native(op.kind) && Self::record_len(op) <= chunk
    }

    /// Bytes of `op`'s batch record: kind, offset and length, at most 11 bytes of operation
    /// fields, then the origin (and compare) data.
    fn record_len(op: &PendingOp) -> usize {
        let data = match op.kind {
            OpKind::Get => 0,
            _ if !op.compare.is_null() => 2 * op.len,
            _ => op.len,
        };
        13 + 11 + data
    }

    /// Append one operation's batch record to `r`; registers a wait for returned data.
    fn record_into(&self, op: PendingOp, r: &mut Vec<u8>) -> Result<()> {
        let target = self.world(op.trank);
        let (kind, token) = match op.kind {
            OpKind::Put => (rma::R_PUT, None),
            OpKind::Acc(..) => (rma::R_ACC, None),
            OpKind::Get => {
                let t = self.engine().st.rma.token(
                    Wait::Data {
                        ptr: op.result,
                        len: op.len,
                        got: 0,
                    },
                    target,
                );
                (rma::R_GET, Some(t))
            }
            OpKind::Rmw(..) => {
                let t = self.engine().st.rma.token(
                    Wait::Reply {
                        ptr: op.result,
                        len: op.len,
                        done: false,
                    },
                    target,
                );
                (rma::R_RMW, Some(t))
            }
        };
        if let Some(t) = token {
            self.tokens.borrow_mut().push(t);
        }
        r.push(kind);
        r.extend_from_slice(&(op.toff as u64).to_le_bytes());
        let cmp = !op.compare.is_null();
        let data_len = if cmp { op.len * 2 } else { op.len };
        let len_field = if matches!(op.kind, OpKind::Rmw(..)) {
            data_len
        } else {
            op.len
        };
        r.extend_from_slice(&(len_field as u32).to_le_bytes());
        match op.kind {
            OpKind::Put => {}
            OpKind::Get => r.extend_from_slice(&token.unwrap_or(0).to_le_bytes()),
            OpKind::Acc(o, ty) => {
                r.push(o as u8);
                r.push(ty as u8);
            }
            OpKind::Rmw(o, ty) => {
                r.push(o as u8);
                r.push(ty as u8);
                r.extend_from_slice(&token.unwrap_or(0).to_le_bytes());
                r.push(cmp as u8);
            }
        }
        if matches!(op.kind, OpKind::Put | OpKind::Acc(..) | OpKind::Rmw(..)) {
            // SAFETY: origin (and compare) buffers hold `len` bytes, borrowed by the epoch.
            unsafe {
                r.extend_from_slice(std::slice::from_raw_parts(op.origin, op.len));
                if cmp {
                    r.extend_from_slice(std::slice::from_raw_parts(op.compare, op.len));
                }
            }
        }
        Ok(())
    }

    /// Send a batch (if it has records or a sync flag).
    fn send_batch(
        &self,
        trank: u32,
        buf: &mut Vec<u8>,
        count: &mut u64,
        flags: u8,
        lock_kind: u8,
        token: u64,
    ) -> Result<()> {
        if buf.is_empty() && flags == 0 {
            return Ok(());
        }
        let target = self.world(trank);
        let mut h = Hdr::new(rma::H_BATCH);
        h.u32(self.id).u8(flags).u8(lock_kind).u64(token);
        let data = std::mem::take(buf);
        let mut eng = self.engine();
        eng.st.am.push_out(target, Out::Owned(h, data));
        if let Some(w) = eng.st.rma.wins.get_mut(&self.id) {
            *w.sent.entry(target).or_insert(0) += *count;
        }
        *count = 0;
        self.am_dirty.borrow_mut()[trank as usize] = true;
        eng.flush_out()?;
        Ok(())
    }

    /// Wait for every operation issued so far to complete at the origin (replies arrived,
    /// native operations done, the outbox drained), returning the first error.
    fn complete_local(&self) -> Result<()> {
        let mut toks = std::mem::take(&mut *self.tokens.borrow_mut());
        let id = self.id;
        let mut eng = self.engine();
        let mut cntr_err = None;
        let waited = eng.wait_until("RMA operations to complete", |e| {
            e.st.out_idle()
                && toks.iter().all(|t| e.st.rma.is_done(*t))
                && e.st
                    .rma
                    .wins
                    .get(&id)
                    .is_none_or(|w| w.native_done >= w.native_issued)
                && self.cntr_caught_up(e, &mut cntr_err)
        });
        if let Err(err) = waited {
            // The epoch's buffers go back to the caller with the error: nothing may land in
            // them later.
            let native_outstanding = eng
                .st
                .rma
                .wins
                .get(&id)
                .is_some_and(|w| w.native_done < w.native_issued)
                || (self.cntr.is_some() && self.cntr_seen.get().total() < self.cntr_issued.get());
            eng.quarantine_rma(&toks, native_outstanding);
            return Err(err);
        }
        let mut first = cntr_err;
        for t in toks.drain(..) {
            if let Err(err) = eng.st.rma.take(t) {
                first.get_or_insert(err);
            }
        }
        // Keep the list's capacity for the next epoch.
        let mut tokens = self.tokens.borrow_mut();
        if tokens.is_empty() {
            *tokens = toks;
        }
        first.map_or(Ok(()), Err)
    }

    /// Has the window's counter reached the number of operations issued on it? A failed
    /// operation, or the death of a rank a counted operation went to, ends the wait with an
    /// error in `err`.
    fn cntr_caught_up(&self, e: &mut Engine<P>, err: &mut Option<Error>) -> bool {
        let Some(c) = self.cntr else {
            return true;
        };
        let issued = self.cntr_issued.get();
        let seen = self.cntr_seen.get();
        if seen.total() >= issued {
            return true;
        }
        let v = match e.p.cntr_read(c) {
            Ok(v) => v,
            Err(x) => {
                err.get_or_insert(x);
                return true;
            }
        };
        self.cntr_seen.set(v);
        if v.err > seen.err {
            let rank = self.cntr_targets.borrow().first().copied().unwrap_or(0);
            err.get_or_insert(Error::from(ErrorDetail::RemoteAccess {
                rank,
                what: format!(
                    "{} RMA operation(s) of this window failed (provider counter)",
                    v.err - seen.err
                ),
            }));
        }
        if v.total() >= issued {
            self.cntr_targets.borrow_mut().clear();
            return true;
        }
        if let Some(&dead) = self
            .cntr_targets
            .borrow()
            .iter()
            .find(|r| e.st.peer_failure(**r).is_some())
        {
            let why = e.st.peer_failure(dead).unwrap_or_default();
            err.get_or_insert(Error::peer_failed(dead, &why));
            // The operations to the dead rank will never be counted.
            self.cntr_issued.set(v.total());
            return true;
        }
        false
    }

    /// Send a one-message sync (UNLOCK/FLUSH/LOCK) to `trank` and wait for its answer.
    fn roundtrip(&self, kind: u8, trank: u32, lock_kind: Option<u8>) -> Result<()> {
        let target = self.world(trank);
        let mut eng = self.engine();
        let t = eng.st.rma.token(
            Wait::Reply {
                ptr: std::ptr::null_mut(),
                len: 0,
                done: false,
            },
            target,
        );
        let mut h = Hdr::new(kind);
        h.u32(self.id);
        if let Some(k) = lock_kind {
            h.u8(k);
        }
        h.u64(t);
        eng.st.am.push_ctrl(target, h);
        drop(eng);
        self.wait_token(t)
    }

    /// Wait for the operation or reply of token `t`; if the wait fails, `t` is quarantined.
    fn wait_token(&self, t: u64) -> Result<()> {
        let mut eng = self.engine();
        let r = eng
            .flush_out()
            .and_then(|_| eng.wait_until("an RMA synchronisation reply", |e| e.st.rma.is_done(t)));
        if let Err(e) = r {
            eng.quarantine_rma(&[t], false);
            return Err(e);
        }
        eng.st.rma.take(t)
    }

    fn new_reply_token(&self, trank: u32) -> u64 {
        let target = self.world(trank);
        self.engine().st.rma.token(
            Wait::Reply {
                ptr: std::ptr::null_mut(),
                len: 0,
                done: false,
            },
            target,
        )
    }

    fn enter(&self, a: Access_) -> Result<()> {
        if self.freed.get() {
            return Err(Error::invalid("window already freed"));
        }
        if self.access.get() != Access_::None {
            return Err(Error::invalid(
                "an access epoch is already open on this window",
            ));
        }
        self.access.set(a);
        self.epoch_ops.set(0);
        Ok(())
    }

    // ------------------------------------------------------------------------------ fence

    /// A fence with no operations before it in this process (MPI_Win_fence).
    pub fn fence(&self, assert: Assert) -> Result<()> {
        self.enter(Access_::Fence)?;
        let r = self.close_fence(assert);
        self.access.set(Access_::None);
        r
    }

    /// Run `f`'s operations as one fence epoch: they complete, everywhere, at the fence that
    /// ends the call. Collective.
    pub fn fence_epoch<'e, R>(
        &'e self,
        assert: Assert,
        f: impl FnOnce(&Epoch<'e, 'w, P>) -> Result<R>,
    ) -> Result<R> {
        self.enter(Access_::Fence)?;
        let e = Epoch {
            win: self,
            _b: PhantomData,
        };
        let guard = Unwind { win: self, keep: 0 };
        let r = f(&e);
        std::mem::forget(guard);
        let c = self.close_fence(assert);
        self.access.set(Access_::None);
        let v = r?;
        c?;
        Ok(v)
    }

    fn close_fence(&self, assert: Assert) -> Result<()> {
        if assert.contains(Assert::NOPRECEDE) {
            if self.epoch_ops.get() > 0 {
                // Still complete what was issued, but report the misuse.
                let _ = self.drain_pending(None);
                let _ = self.complete_local();
                let _ = self.comm.barrier();
                return Err(Error::invalid(
                    "fence with NOPRECEDE after RMA operations in the epoch",
                ));
            }
            return self.comm.barrier();
        }
        self.drain_pending(None)?;
        self.complete_local()?;
        if self.native_put && self.native_get && self.native_atomics {
            // Every operation is complete at the origin, hence at the target: a barrier is
            // enough.
            return self.comm.barrier();
        }
        // Everybody learns how many active-message operations each origin sent it, then waits
        // until it has applied them (per origin, cumulative counts).
        let n = self.comm.size() as usize;
        let sent: SmallVec<[u64; 8]> = {
            let eng = self.engine();
            let w = eng.st.rma.wins.get(&self.id).expect("window registered");
            (0..n as u32)
                .map(|r| w.sent.get(&self.world(r)).copied().unwrap_or(0))
                .collect()
        };
        let mut incoming: SmallVec<[u64; 8]> = smallvec::smallvec![0u64; n];
        self.comm.alltoall(&sent, &mut incoming)?;
        let id = self.id;
        let mut eng = self.engine();
        // `applied` counts per window, not per origin; compare against the total.
        let total: u64 = incoming.iter().sum();
        eng.wait_until("fence: operations from other ranks", |e| {
            e.st.rma.wins.get(&id).is_some_and(|w| w.applied >= total)
        })?;
        drop(eng);
        // Nobody starts the next epoch before everybody has applied this one.
        self.comm.barrier()
    }

    // ------------------------------------------------------------------------------ PSCW

    /// Expose the window to `origins` (communicator ranks): MPI_Win_post.
    pub fn post(&self, origins: &[u32]) -> Result<()> {
        if !self.exposed.borrow().is_empty() {
            return Err(Error::invalid("an exposure epoch is already open"));
        }
        let mut eng = self.engine();
        for &o in origins {
            let w = self.comm.world_rank(o)?;
            let mut h = Hdr::new(rma::H_POST);
            h.u32(self.id);
            eng.st.am.push_ctrl(w, h);
        }
        eng.flush_out()?;
        drop(eng);
        let mut e = self.exposed.borrow_mut();
        e.clear();
        e.extend_from_slice(origins);
        Ok(())
    }

    /// End the exposure epoch once every origin of the post has completed: MPI_Win_wait.
    pub fn wait(&self) -> Result<()> {
        let worlds: SmallVec<[Rank; 4]> = {
            let mut e = self.exposed.borrow_mut();
            let w: Result<SmallVec<[Rank; 4]>> =
                e.iter().map(|o| self.comm.world_rank(*o)).collect();
            e.clear();
            w?
        };
        let id = self.id;
        let mut eng = self.engine();
        eng.wait_until("PSCW: complete from every origin", |e| {
            e.st.rma.wins.get(&id).is_some_and(|w| {
                worlds
                    .iter()
                    .all(|r| w.completes.get(r).copied().unwrap_or(0) > 0)
            })
        })?;
        if let Some(w) = eng.st.rma.wins.get_mut(&id) {
            for r in &worlds {
                if let Some(c) = w.completes.get_mut(r) {
                    *c -= 1;
                }
            }
        }
        Ok(())
    }

    /// Access `targets`' windows for the operations of `f` (MPI_Win_start ... MPI_Win_complete).
    pub fn start_epoch<'e, R>(
        &'e self,
        targets: &[u32],
        f: impl FnOnce(&Epoch<'e, 'w, P>) -> Result<R>,
    ) -> Result<R> {
        self.enter(Access_::Start)?;
        let r = self.start(targets).and_then(|_| {
            let e = Epoch {
                win: self,
                _b: PhantomData,
            };
            let guard = Unwind { win: self, keep: 0 };
            let r = f(&e);
            std::mem::forget(guard);
            r
        });
        let c = self.complete(targets);
        self.access.set(Access_::None);
        let v = r?;
        c?;
        Ok(v)
    }

    fn start(&self, targets: &[u32]) -> Result<()> {
        let worlds: SmallVec<[Rank; 4]> = targets
            .iter()
            .map(|t| self.comm.world_rank(*t))
            .collect::<Result<_>>()?;
        let id = self.id;
        let mut eng = self.engine();
        eng.wait_until("PSCW: post from every target", |e| {
            e.st.rma.wins.get(&id).is_some_and(|w| {
                worlds
                    .iter()
                    .all(|r| w.posts.get(r).copied().unwrap_or(0) > 0)
            })
        })?;
        if let Some(w) = eng.st.rma.wins.get_mut(&id) {
            for r in &worlds {
                if let Some(c) = w.posts.get_mut(r) {
                    *c -= 1;
                }
            }
        }
        drop(eng);
        let mut t = self.targets.borrow_mut();
        t.clear();
        t.extend_from_slice(targets);
        Ok(())
    }

    fn complete(&self, targets: &[u32]) -> Result<()> {
        let fold: SmallVec<[(u32, u64); 4]> = targets.iter().map(|t| (*t, 0)).collect();
        let folded = if self.sched.aggregates() {
            self.drain_pending(Some((rma::B_COMPLETE, &fold)))?
        } else {
            self.drain_pending(None)?;
            Targets::new()
        };
        // Gets and native operations must be complete before we say so.
        self.complete_local()?;
        let mut eng = self.engine();
        for &t in targets {
            if folded.contains(&t) {
                continue;
            }
            let w = self.comm.world_rank(t)?;
            let mut h = Hdr::new(rma::H_COMPLETE);
            h.u32(self.id);
            eng.st.am.push_ctrl(w, h);
        }
        eng.flush_out()?;
        drop(eng);
        self.targets.borrow_mut().clear();
        Ok(())
    }

    // ------------------------------------------------------------------------------ locks

    /// Run `f` in a passive-target epoch on `target` (MPI_Win_lock ... MPI_Win_unlock).
    pub fn lock_epoch<'e, R>(
        &'e self,
        target: u32,
        kind: LockKind,
        f: impl FnOnce(&Epoch<'e, 'w, P>) -> Result<R>,
    ) -> Result<R> {
        self.comm.world_rank(target)?;
        self.enter(Access_::Lock)?;
        let k = match kind {
            LockKind::Shared => rma::LOCK_SHARED,
            LockKind::Exclusive => rma::LOCK_EXCLUSIVE,
        };
        self.excl.set(kind == LockKind::Exclusive);
        let r = (|| {
            if self.native_locks {
                self.native_lock(target, k == rma::LOCK_EXCLUSIVE)?;
            } else if self.sched.aggregates() {
                // Lazy: the lock travels with the operations at unlock (or a flush).
                self.lazy_lock.set(Some((target, k)));
            } else {
                self.roundtrip(rma::H_LOCK, target, Some(k))?;
            }
            *self.targets.borrow_mut() = vec![target];
            let e = Epoch {
                win: self,
                _b: PhantomData,
            };
            let guard = Unwind { win: self, keep: 0 };
            let r = f(&e);
            std::mem::forget(guard);
            r
        })();
        let u = self.unlock_targets(&[target]);
        self.access.set(Access_::None);
        let v = r?;
        u?;
        Ok(v)
    }

    /// Run `f` with a shared lock on every rank's window (MPI_Win_lock_all ... unlock_all).
    pub fn lock_all_epoch<'e, R>(
        &'e self,
        f: impl FnOnce(&Epoch<'e, 'w, P>) -> Result<R>,
    ) -> Result<R> {
        self.enter(Access_::Lock)?;
        self.excl.set(false);
        let all: Vec<u32> = (0..self.comm.size()).collect();
        let r = (|| {
            for &t in &all {
                if self.native_locks {
                    self.native_lock(t, false)?;
                } else {
                    self.roundtrip(rma::H_LOCK, t, Some(rma::LOCK_SHARED))?;
                }
            }
            *self.targets.borrow_mut() = all.clone();
            let e = Epoch {
                win: self,
                _b: PhantomData,
            };
            let guard = Unwind { win: self, keep: 0 };
            let r = f(&e);
            std::mem::forget(guard);
            r
        })();
        let u = self.unlock_targets(&all);
        self.access.set(Access_::None);
        let v = r?;
        u?;
        Ok(v)
    }

    /// Take a lock through the provider, retrying with progress until it is free.
    fn native_lock(&self, trank: u32, exclusive: bool) -> Result<()> {
        let target = self.world(trank);
        let ra = self.keys.as_ref().expect("native locks need keys")[trank as usize];
        let mut eng = self.engine();
        let mut err = None;
        eng.wait_until("a window lock", |e| {
            match e.p.rma_try_lock(target, ra, exclusive) {
                Ok(got) => got,
                Err(x) => {
                    err = Some(x);
                    true
                }
            }
        })?;
        err.map_or(Ok(()), Err)
    }

    fn unlock_targets(&self, targets: &[u32]) -> Result<()> {
        if self.native_locks {
            self.drain_pending(None)?;
            let mut first = self.complete_local().err();
            for &t in targets {
                let ra = self.keys.as_ref().expect("native locks need keys")[t as usize];
                let target = self.world(t);
                // Exclusive when the epoch took it so (lock_all takes shared locks).
                let excl = self.excl.get();
                if let Err(e) = self.engine().p.rma_unlock(target, ra, excl) {
                    first.get_or_insert(e);
                }
            }
            self.targets.borrow_mut().clear();
            return first.map_or(Ok(()), Err);
        }
        let mut tokens: SmallVec<[(u32, u64); 4]> = SmallVec::new();
        let folded = if self.sched.aggregates() {
            let fold: SmallVec<[(u32, u64); 4]> = targets
                .iter()
                .map(|t| (*t, self.new_reply_token(*t)))
                .collect();
            tokens = fold.clone();
            // The batch carrying the unlock must hold everything: if the lazy lock could not be
            // folded (too much data for one message), take the lock explicitly first.
            let f = self.drain_pending(Some((rma::B_UNLOCK, &fold)))?;
            if let Some((t, k)) = self.lazy_lock.take() {
                // Nothing was folded for this target: plain lock + unlock.
                self.roundtrip(rma::H_LOCK, t, Some(k))?;
            }
            f
        } else {
            self.drain_pending(None)?;
            Targets::new()
        };
        let r = self.complete_local();
        let mut first = r.err();
        for &t in targets {
            let res = match tokens.iter().find(|(tr, _)| *tr == t) {
                Some((_, tok)) if folded.contains(&t) => self.wait_token(*tok),
                Some((_, tok)) => {
                    self.engine().st.rma.take(*tok).ok();
                    self.roundtrip(rma::H_UNLOCK, t, None)
                }
                None => self.roundtrip(rma::H_UNLOCK, t, None),
            };
            if let Err(e) = res {
                first.get_or_insert(e);
            }
            self.am_dirty.borrow_mut()[t as usize] = false;
        }
        self.targets.borrow_mut().clear();
        first.map_or(Ok(()), Err)
    }

    /// Free the window (MPI_Win_free). Collective; completes nothing by itself.
    pub fn free(self) -> Result<()> {
        self.free_inner()
    }

    fn free_inner(&self) -> Result<()> {
        if self.freed.replace(true) {
            return Ok(());
        }
        let b = self.comm.barrier();
        let mut eng = self.engine();
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

/// On unwinding out of an epoch closure: forget operations not issued yet (their buffers are
/// about to go) and complete the issued ones, so nothing refers to freed memory afterwards.
struct Unwind<'a, 'w, P: Provider> {
    win: &'a Window<'w, P>,
    keep: usize,
}

impl<P: Provider> Drop for Unwind<'_, '_, P> {
    fn drop(&mut self) {
        self.win.pending.borrow_mut().truncate(self.keep);
        let r = &self.win.released;
        r.set(r.get().min(self.keep));
        if let Err(e) = self.win.complete_local() {
            tracing::warn!("completing RMA operations while unwinding: {e}");
        }
        self.win.access.set(Access_::None);
    }
}

/// An open access epoch: operations borrow their buffers until the epoch ends.
pub struct Epoch<'e, 'w, P: Provider> {
    win: &'e Window<'w, P>,
    _b: PhantomData<&'e mut &'e ()>,
}

/// A request-based RMA operation (MPI_Rput and friends): completes locally (put, accumulate)
/// or when its data has arrived (get, get-accumulate).
#[must_use = "wait for the request to know the operation completed"]
pub struct RmaRequest<'e, 'w, P: Provider> {
    win: &'e Window<'w, P>,
    token: Option<u64>,
}

impl<P: Provider> RmaRequest<'_, '_, P> {
    pub fn wait(mut self) -> Result<()> {
        match self.token.take() {
            Some(t) => {
                self.win.tokens.borrow_mut().retain(|x| *x != t);
                self.win.wait_token(t)
            }
            None => Ok(()),
        }
    }

    pub fn test(&mut self) -> Result<bool> {
        match self.token {
            None => Ok(true),
            Some(t) => {
                let done = {
                    let mut eng = self.win.engine();
                    eng.progress()?;
                    eng.st.rma.is_done(t)
                };
                if done {
                    self.token = None;
                    self.win.tokens.borrow_mut().retain(|x| *x != t);
                    self.win.engine().st.rma.take(t)?;
                }
                Ok(done)
            }
        }
    }
}

impl<'e, 'w, P: Provider> Epoch<'e, 'w, P> {
    fn op(&self, kind: OpKind, trank: u32, disp: usize, len: usize) -> Result<PendingOp> {
        let w = self.win;
        let unit = w
            .peers
            .get(trank as usize)
            .map(|p| p.disp_unit)
            .ok_or_else(|| {
                Error::from(ErrorDetail::InvalidRank {
                    rank: trank as i64,
                    size: w.comm.size(),
                })
            })?;
        let toff = disp
            .checked_mul(unit)
            .ok_or_else(|| Error::invalid("target displacement overflows"))?;
        w.check_target(trank, toff, len)?;
        Ok(PendingOp {
            kind,
            trank,
            toff,
            len,
            origin: std::ptr::null(),
            result: std::ptr::null_mut(),
            compare: std::ptr::null(),
        })
    }

    /// Write `origin` into `target`'s window at element `disp` (MPI_Put).
    pub fn put<T: Element>(&self, origin: &'e [T], target: u32, disp: usize) -> Result<()> {
        let mut op = self.op(OpKind::Put, target, disp, std::mem::size_of_val(origin))?;
        op.origin = origin.as_ptr() as *const u8;
        if op.len == 0 {
            return Ok(());
        }
        self.win.submit(op, true)
    }

    /// Read `target`'s window at element `disp` into `origin` (MPI_Get); the data is there when
    /// the epoch (or a flush) completes.
    pub fn get<T: Element>(&self, origin: &'e mut [T], target: u32, disp: usize) -> Result<()> {
        let mut op = self.op(OpKind::Get, target, disp, std::mem::size_of_val(origin))?;
        op.result = origin.as_mut_ptr() as *mut u8;
        if op.len == 0 {
            return Ok(());
        }
        self.win.submit(op, true)
    }

    /// `target[disp..] = target[disp..] op origin`, element-wise and atomically per element
    /// (MPI_Accumulate).
    pub fn accumulate<T: Element>(
        &self,
        origin: &'e [T],
        target: u32,
        disp: usize,
        op: Op,
    ) -> Result<()> {
        check_op(op, T::TYPE)?;
        let mut o = self.op(
            OpKind::Acc(op, T::TYPE),
            target,
            disp,
            std::mem::size_of_val(origin),
        )?;
        o.origin = origin.as_ptr() as *const u8;
        if o.len == 0 {
            return Ok(());
        }
        self.win.submit(o, true)
    }

    /// Accumulate and return the previous values (MPI_Get_accumulate).
    pub fn get_accumulate<T: Element>(
        &self,
        origin: &'e [T],
        result: &'e mut [T],
        target: u32,
        disp: usize,
        op: Op,
    ) -> Result<()> {
        check_op(op, T::TYPE)?;
        if origin.len() != result.len() {
            return Err(Error::invalid(
                "get_accumulate origin and result lengths differ",
            ));
        }
        let mut o = self.op(
            OpKind::Rmw(op, T::TYPE),
            target,
            disp,
            std::mem::size_of_val(origin),
        )?;
        o.origin = origin.as_ptr() as *const u8;
        o.result = result.as_mut_ptr() as *mut u8;
        if o.len == 0 {
            return Ok(());
        }
        self.win.submit(o, true)
    }

    /// One-element get-accumulate (MPI_Fetch_and_op).
    pub fn fetch_and_op<T: Element>(
        &self,
        origin: &'e T,
        result: &'e mut T,
        target: u32,
        disp: usize,
        op: Op,
    ) -> Result<()> {
        self.get_accumulate(
            std::slice::from_ref(origin),
            std::slice::from_mut(result),
            target,
            disp,
            op,
        )
    }

    /// Replace the target element with `origin` if it equals `compare`; the old value lands in
    /// `result` (MPI_Compare_and_swap).
    pub fn compare_and_swap<T: Element>(
        &self,
        origin: &'e T,
        compare: &'e T,
        result: &'e mut T,
        target: u32,
        disp: usize,
    ) -> Result<()> {
        let mut o = self.op(
            OpKind::Rmw(Op::Cswap, T::TYPE),
            target,
            disp,
            std::mem::size_of::<T>(),
        )?;
        o.origin = origin as *const T as *const u8;
        o.compare = compare as *const T as *const u8;
        o.result = result as *mut T as *mut u8;
        self.win.submit(o, true)
    }

    /// Put with derived datatypes on both sides: `ocount` instances of `odt` from `origin`
    /// into `tcount` instances of `tdt` at byte displacement `tdisp` (in target disp units).
    #[allow(clippy::too_many_arguments)]
    pub fn put_typed(
        &self,
        origin: &'e [u8],
        ocount: usize,
        odt: &Datatype,
        target: u32,
        tdisp: usize,
        tcount: usize,
        tdt: &Datatype,
    ) -> Result<()> {
        let n = odt.check_fits(ocount, origin.len())?;
        if n != tdt.size() * tcount {
            return Err(Error::invalid(
                "origin and target type signatures differ in size",
            ));
        }
        // Walk the target's contiguous pieces against the packed origin stream.
        let pieces = self.typed_pieces(target, tdisp, tcount, tdt)?;
        let mut opieces = Vec::new();
        odt.for_range(ocount, 0, n, |o, l| opieces.push((o, l)))?;
        let mut oi = 0usize;
        let mut oat = 0usize;
        for (toff, tlen) in pieces {
            let mut left = tlen;
            let mut t = toff;
            while left > 0 {
                let (ooff, olen) = opieces[oi];
                let take = (olen - oat).min(left);
                let mut op = self.op(OpKind::Put, target, 0, 0)?;
                op.toff = t;
                op.len = take;
                // SAFETY: within `origin` (checked by check_fits).
                op.origin = unsafe { origin.as_ptr().offset(ooff).add(oat) };
                self.win.check_target(target, t, take)?;
                self.win.submit(op, true)?;
                left -= take;
                t += take;
                oat += take;
                if oat == olen {
                    oi += 1;
                    oat = 0;
                }
            }
        }
        Ok(())
    }

    /// Get with derived datatypes on both sides (see [`Epoch::put_typed`]).
    #[allow(clippy::too_many_arguments)]
    pub fn get_typed(
        &self,
        origin: &'e mut [u8],
        ocount: usize,
        odt: &Datatype,
        target: u32,
        tdisp: usize,
        tcount: usize,
        tdt: &Datatype,
    ) -> Result<()> {
        let n = odt.check_fits(ocount, origin.len())?;
        if n != tdt.size() * tcount {
            return Err(Error::invalid(
                "origin and target type signatures differ in size",
            ));
        }
        let pieces = self.typed_pieces(target, tdisp, tcount, tdt)?;
        let mut opieces = Vec::new();
        odt.for_range(ocount, 0, n, |o, l| opieces.push((o, l)))?;
        let base = origin.as_mut_ptr();
        let mut oi = 0usize;
        let mut oat = 0usize;
        for (toff, tlen) in pieces {
            let mut left = tlen;
            let mut t = toff;
            while left > 0 {
                let (ooff, olen) = opieces[oi];
                let take = (olen - oat).min(left);
                let mut op = self.op(OpKind::Get, target, 0, 0)?;
                op.toff = t;
                op.len = take;
                // SAFETY: within `origin` (checked by check_fits).
                op.result = unsafe { base.offset(ooff).add(oat) };
                self.win.check_target(target, t, take)?;
                self.win.submit(op, true)?;
                left -= take;
                t += take;
                oat += take;
                if oat == olen {
                    oi += 1;
                    oat = 0;
                }
            }
        }
        Ok(())
    }

    fn typed_pieces(
        &self,
        target: u32,
        tdisp: usize,
        tcount: usize,
        tdt: &Datatype,
    ) -> Result<Vec<(usize, usize)>> {
        let unit = self
            .win
            .peers
            .get(target as usize)
            .map(|p| p.disp_unit)
            .ok_or_else(|| Error::invalid("bad target rank"))?;
        let base = tdisp * unit;
        let mut v = Vec::new();
        let (lo, _) = tdt.span(tcount)?;
        if lo < 0 {
            return Err(Error::invalid(
                "target datatype with a negative lower bound",
            ));
        }
        tdt.for_range(tcount, 0, tdt.size() * tcount, |o, l| {
            v.push((base + o as usize, l))
        })?;
        Ok(v)
    }

    /// Run `f`'s operations in a nested scope that completes them locally when it returns
    /// (a `flush_local`): buffers declared inside the epoch can be used, and get results read
    /// right after.
    ///
    /// ```
    /// # weft_testing::world(2, |comm| {
    /// # let mut mem = vec![0u64; 1];
    /// # comm.win_create(&mut mem, weft::WinInfo::default(), |win| {
    /// win.lock_epoch(0, weft::LockKind::Exclusive, |e| {
    ///     let mut v = [0u64];
    ///     e.local(|l| l.get(&mut v, 0, 0))?;            // v holds the value now
    ///     let w = [v[0] + 1];
    ///     e.local(|l| l.put(&w, 0, 0))
    /// })?;
    /// # comm.barrier()
    /// # }).unwrap();
    /// # });
    /// ```
    pub fn local<'l, R>(&'l self, f: impl FnOnce(&Epoch<'l, 'w, P>) -> Result<R>) -> Result<R> {
        let guard = Unwind {
            win: self.win,
            keep: self.win.pending.borrow().len(),
        };
        let inner = Epoch {
            win: self.win,
            _b: PhantomData,
        };
        let r = f(&inner);
        std::mem::forget(guard);
        let c = self.flush_local_inner();
        let v = r?;
        c?;
        Ok(v)
    }

    fn flush_local_inner(&self) -> Result<()> {
        self.win.drain_pending_keep_lock()?;
        self.win.complete_local()
    }

    /// Issue a request-based operation now; its request completes with the operation (at
    /// once for zero bytes).
    fn request(&self, op: PendingOp) -> Result<RmaRequest<'e, 'w, P>> {
        let token = if op.len == 0 {
            None
        } else {
            self.win.issue(op, Some(()))?
        };
        Ok(RmaRequest {
            win: self.win,
            token,
        })
    }

    /// Request-based put (MPI_Rput): issued now; the request completes locally.
    pub fn rput<T: Element>(
        &self,
        origin: &'e [T],
        target: u32,
        disp: usize,
    ) -> Result<RmaRequest<'e, 'w, P>> {
        let mut op = self.op(OpKind::Put, target, disp, std::mem::size_of_val(origin))?;
        op.origin = origin.as_ptr() as *const u8;
        self.request(op)
    }

    /// Request-based get (MPI_Rget): the request completes when the data is in `origin`.
    pub fn rget<T: Element>(
        &self,
        origin: &'e mut [T],
        target: u32,
        disp: usize,
    ) -> Result<RmaRequest<'e, 'w, P>> {
        let mut op = self.op(OpKind::Get, target, disp, std::mem::size_of_val(origin))?;
        op.result = origin.as_mut_ptr() as *mut u8;
        self.request(op)
    }

    /// Request-based accumulate (MPI_Raccumulate).
    pub fn raccumulate<T: Element>(
        &self,
        origin: &'e [T],
        target: u32,
        disp: usize,
        op: Op,
    ) -> Result<RmaRequest<'e, 'w, P>> {
        check_op(op, T::TYPE)?;
        let mut o = self.op(
            OpKind::Acc(op, T::TYPE),
            target,
            disp,
            std::mem::size_of_val(origin),
        )?;
        o.origin = origin.as_ptr() as *const u8;
        self.request(o)
    }

    /// Request-based get-accumulate (MPI_Rget_accumulate).
    pub fn rget_accumulate<T: Element>(
        &self,
        origin: &'e [T],
        result: &'e mut [T],
        target: u32,
        disp: usize,
        op: Op,
    ) -> Result<RmaRequest<'e, 'w, P>> {
        check_op(op, T::TYPE)?;
        if origin.len() != result.len() {
            return Err(Error::invalid(
                "get_accumulate origin and result lengths differ",
            ));
        }
        let mut o = self.op(
            OpKind::Rmw(op, T::TYPE),
            target,
            disp,
            std::mem::size_of_val(origin),
        )?;
        o.origin = origin.as_ptr() as *const u8;
        o.result = result.as_mut_ptr() as *mut u8;
        self.request(o)
    }

    /// Complete every operation to `target`, remotely (MPI_Win_flush; passive-target epochs).
    pub fn flush(&self, target: u32) -> Result<()> {
        self.flush_targets(&[target])
    }

    /// Complete every operation, remotely (MPI_Win_flush_all).
    pub fn flush_all(&self) -> Result<()> {
        let t = self.win.targets.borrow().clone();
        self.flush_targets(&t)
    }

    /// Complete every operation locally: origin buffers may be reused, get results are in
    /// place (MPI_Win_flush_local_all; also serves MPI_Win_flush_local).
    pub fn flush_local(&self) -> Result<()> {
        self.flush_local_inner()
    }

    fn flush_targets(&self, targets: &[u32]) -> Result<()> {
        let w = self.win;
        if w.access.get() != Access_::Lock {
            return Err(Error::invalid("flush is for passive-target (lock) epochs"));
        }
        w.drain_pending_keep_lock()?;
        w.complete_local()?;
        for &t in targets {
            if std::mem::take(&mut w.am_dirty.borrow_mut()[t as usize]) {
                w.roundtrip(rma::H_FLUSH, t, None)?;
            }
        }
        Ok(())
    }
}

impl<P: Provider> Window<'_, P> {
    /// Issue deferred operations; a lazy lock is taken explicitly first.
    fn drain_pending_keep_lock(&self) -> Result<()> {
        if let Some((t, k)) = self.lazy_lock.take() {
            self.roundtrip(rma::H_LOCK, t, Some(k))?;
        }
        self.drain_pending(None).map(|_| ())
    }
}

fn check_op(op: Op, ty: BasicType) -> Result<()> {
    if !op.valid_for(ty) || op == Op::Cswap {
        return Err(Error::invalid(format!(
            "{} is not an accumulate operation on {}",
            op.name(),
            ty.name()
        )));
    }
    Ok(())
}

//! The public two-sided API: worlds, communicators, scopes and requests.
//!
//! A rank is single-threaded (like `MPI_THREAD_FUNNELED`): a [`World`] and its communicators are
//! neither `Send` nor `Sync`.
//!
//! Nonblocking operations live in a [`Scope`] (like `std::thread::scope`): their buffers must
//! outlive the scope, and the scope completes every request still running when it ends. That is
//! what makes the API sound: even a request that is leaked with `mem::forget` cannot leave the
//! provider writing into freed memory. Dropping a [`Request`] waits for it (a receive that has
//! not matched is cancelled instead).

use crate::am::ReqId;
use crate::bootstrap::Bootstrap;
use crate::datatype::Datatype;
use crate::engine::{Engine, EngineConfig};
use crate::p2p::{Layout, Lean, Posted, RecvBuf, SendBuf};
use crate::provider::{DynProvider, Provider};
use crate::types::{Rank, Status};
use crate::{Error, ErrorDetail, Result};
use bytemuck::Pod;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::rc::Rc;

mod coll;
mod nonblocking;
mod raw;

pub use nonblocking::{waitall, waitany, Request, Scope};
pub use raw::RawRequest;

/// A receive buffer that several pending receives may name at once
/// ([`Comm::irecv_shared`]). Receives borrow it shared for their scope; reading it needs
/// `&mut` ([`as_mut_slice`](Self::as_mut_slice)), so its bytes can only be looked at once no
/// receive into it is pending.
pub struct SharedBuf {
    // Owned allocation (from `Box<[u8]>`), held as a raw pointer so that handing its address
    // to the engine never creates a reference to the bytes: several pending receives may write
    // through their copies of it. Raw pointers also keep the type `!Send` and `!Sync`.
    ptr: *mut [u8],
}

impl SharedBuf {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> SharedBuf {
        SharedBuf {
            ptr: Box::into_raw(vec![0u8; len].into_boxed_slice()),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.ptr.len()
    }

    /// `true` for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, once no receive names the buffer (what several receives left is unspecified).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is the live allocation we own; `&mut self` means no scope still
        // borrows the buffer, so no receive can write into it while the slice lives.
        unsafe { &mut *self.ptr }
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
}

impl Drop for SharedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `Box::into_raw` and is freed only here; a receive naming the
        // buffer borrows it for its scope, which completes every request before it ends.
        drop(unsafe { Box::from_raw(self.ptr) });
    }
}

/// Largest valid tag.
pub const TAG_UB: i32 = i32::MAX;

/// Receive from any source.
pub const ANY_SOURCE: Source = Source::Any;
/// Receive with any tag.
pub const ANY_TAG: TagSel = TagSel::Any;

/// Source selector of a receive or probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Any,
    Rank(u32),
}

impl From<u32> for Source {
    fn from(r: u32) -> Self {
        Source::Rank(r)
    }
}
impl From<usize> for Source {
    fn from(r: usize) -> Self {
        Source::Rank(u32::try_from(r).unwrap_or(u32::MAX))
    }
}
impl From<i32> for Source {
    fn from(r: i32) -> Self {
        Source::Rank(u32::try_from(r).unwrap_or(u32::MAX))
    }
}

/// Tag selector of a receive or probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagSel {
    Any,
    Tag(i32),
}

impl From<i32> for TagSel {
    fn from(t: i32) -> Self {
        TagSel::Tag(t)
    }
}

/// The ranks of a communicator as world ranks.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) world_of: Vec<Rank>,
    /// World rank -> rank in this group, or `u32::MAX`.
    comm_of: Vec<u32>,
}

impl Group {
    fn new(world_of: Vec<Rank>, world_size: u32) -> Self {
        let mut comm_of = vec![u32::MAX; world_size as usize];
        for (i, w) in world_of.iter().enumerate() {
            comm_of[*w as usize] = i as u32;
        }
        Group { world_of, comm_of }
    }
}

pub(crate) struct Shared<P: Provider> {
    pub(crate) engine: RefCell<Engine<P>>,
    boot: RefCell<Box<dyn Bootstrap>>,
    next_ctx: Cell<u32>,
    next_scope: Cell<u64>,
    provider_name: String,
    /// World rank of this process.
    rank: u32,
    /// In `finalize` (see `Comm::complete_ctx`).
    finalizing: Cell<bool>,
    closed: Cell<bool>,
}

impl<P: Provider> Shared<P> {
    /// This process's world rank (without borrowing the engine).
    pub(crate) fn engine_rank(&self) -> u32 {
        self.rank
    }

    fn close(&self) -> Result<()> {
        if self.closed.replace(true) {
            return Ok(());
        }
        let mut e = self.engine.borrow_mut();
        e.st.am.closing = true;
        let q = e.quiesce();
        let e = &mut *e;
        e.st.am.mr.clear(&mut e.p);
        let c = e.p.close();
        let f = self.boot.borrow_mut().finalize();
        q.and(c).and(f)
    }
}

/// A communicator: a group of ranks and a context that keeps its messages apart.
pub struct Comm<P: Provider = DynProvider> {
    pub(crate) sh: Rc<Shared<P>>,
    /// Point-to-point context; collectives use `ctx + 1`.
    pub(crate) ctx: u32,
    pub(crate) group: Option<Rc<Group>>,
    rank: u32,
    size: u32,
}

/// The world: every rank of the job. Dereferences to its communicator.
pub struct World<P: Provider = DynProvider> {
    comm: Comm<P>,
}

impl<P: Provider> std::ops::Deref for World<P> {
    type Target = Comm<P>;
    fn deref(&self) -> &Comm<P> {
        &self.comm
    }
}

impl<P: Provider> World<P> {
    /// Build a world over an opened provider.
    pub fn from_parts(p: P, boot: Box<dyn Bootstrap>, cfg: EngineConfig) -> Result<Self> {
        let name = p.name().to_string();
        if p.size() != boot.size() || p.rank() != boot.rank() {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "provider '{name}' sees rank {}/{} but the bootstrap says {}/{}",
                p.rank(),
                p.size(),
                boot.rank(),
                boot.size()
            ))));
        }
        let rank = p.rank();
        let size = p.size();
        let mut cfg = cfg;
        let local = boot.nodes().local_ranks().len();
        let over = (cfg.spin_auto || cfg.sleep_auto) && crate::engine::oversubscribed(local);
        if cfg.spin_auto && over {
            tracing::debug!("{local} ranks on this host share fewer CPUs: waits yield at once");
            cfg.spin = 0;
        }
        if cfg.sleep_auto && over {
            cfg.sleep_after = Some(crate::engine::SLEEP_AFTER_AUTO);
        }
        let engine = Engine::new(p, cfg)?;
        let sh = Rc::new(Shared {
            engine: RefCell::new(engine),
            boot: RefCell::new(boot),
            next_ctx: Cell::new(2),
            next_scope: Cell::new(1),
            provider_name: name,
            rank,
            finalizing: Cell::new(false),
            closed: Cell::new(false),
        });
        Ok(World {
            comm: Comm {
                sh,
                ctx: 0,
                group: None,
                rank,
                size,
            },
        })
    }

    /// The world communicator.
    pub fn comm(&self) -> &Comm<P> {
        &self.comm
    }

    /// Which ranks share this host.
    pub fn node_map(&self) -> crate::bootstrap::NodeMap {
        self.comm.sh.boot.borrow().nodes().clone()
    }

    /// Orderly shutdown: a barrier, then every outgoing message drained and the provider closed.
    pub fn finalize(self) -> Result<()> {
        self.comm.sh.finalizing.set(true);
        let b = self.comm.barrier();
        let c = self.comm.sh.close();
        b.and(c)
    }

    /// Tell the launcher to end the whole job (MPI_Abort).
    pub fn abort(&self, code: i32, msg: &str) -> ! {
        self.comm.sh.boot.borrow_mut().abort(code, msg);
        eprintln!("weft: rank {} aborting: {msg}", self.comm.rank);
        std::process::exit(code)
    }
}

impl<P: Provider> Drop for World<P> {
    fn drop(&mut self) {
        if let Err(e) = self.comm.sh.close() {
            tracing::debug!("closing the world: {e}");
        }
    }
}

/// Translate a result's world source rank into the communicator's rank.
#[inline]
fn localize(group: &Option<Rc<Group>>, r: Result<Status>) -> Result<Status> {
    if group.is_none() {
        return r;
    }
    localize_in(group, r)
}

#[inline(never)]
fn localize_in(group: &Option<Rc<Group>>, r: Result<Status>) -> Result<Status> {
    match r {
        Ok(s) => Ok(Comm::<DynProvider>::local_status(group, s)),
        Err(e) => match e.truncated() {
            Some((status, capacity)) => Err(Error::from(ErrorDetail::Truncated {
                status: Comm::<DynProvider>::local_status(group, status),
                capacity,
            })),
            None => Err(e),
        },
    }
}

#[inline]
fn check_tag(tag: i32) -> Result<i32> {
    if tag < 0 {
        return Err(Error::from(ErrorDetail::InvalidTag {
            tag: tag as i64,
            max: TAG_UB,
        }));
    }
    Ok(tag)
}

fn bytes_of<T: Pod>(buf: &[T]) -> SendBuf {
    SendBuf {
        base: buf.as_ptr() as *const u8,
        len: std::mem::size_of_val(buf),
        layout: Layout::Contig,
    }
}

fn bytes_of_mut<T: Pod>(buf: &mut [T]) -> RecvBuf {
    RecvBuf {
        base: buf.as_mut_ptr() as *mut u8,
        cap: std::mem::size_of_val(buf),
        layout: Layout::Contig,
        shared: false,
    }
}

fn typed_send(buf: &[u8], count: usize, dt: &Datatype) -> Result<SendBuf> {
    let len = dt.check_fits(count, buf.len())?;
    Ok(SendBuf {
        base: buf.as_ptr(),
        len,
        layout: if dt.is_contiguous() {
            Layout::Contig
        } else {
            Layout::Typed(dt.clone(), count)
        },
    })
}

fn typed_recv(buf: &mut [u8], count: usize, dt: &Datatype) -> Result<RecvBuf> {
    let cap = dt.check_fits(count, buf.len())?;
    Ok(RecvBuf {
        base: buf.as_mut_ptr(),
        cap,
        layout: if dt.is_contiguous() {
            Layout::Contig
        } else {
            Layout::Typed(dt.clone(), count)
        },
        shared: false,
    })
}

impl<P: Provider> Comm<P> {
    /// This rank's number in the communicator.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// Name of the provider underneath.
    pub fn provider_name(&self) -> &str {
        &self.sh.provider_name
    }

    /// Capabilities of the provider underneath.
    pub fn provider_caps(&self) -> crate::provider::Caps {
        self.sh.engine.borrow().st.am.caps.clone()
    }

    /// World rank of communicator rank `r`.
    #[inline]
    pub fn world_rank(&self, r: u32) -> Result<Rank> {
        if r >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        Ok(match &self.group {
            None => r,
            Some(g) => g.world_of[r as usize],
        })
    }

    fn source(&self, s: Source) -> Result<Option<Rank>> {
        match s {
            Source::Any => Ok(None),
            Source::Rank(r) => self.world_rank(r).map(Some),
        }
    }

    fn tag_sel(t: TagSel) -> Result<Option<i32>> {
        match t {
            TagSel::Any => Ok(None),
            TagSel::Tag(t) => check_tag(t).map(Some),
        }
    }

    /// Translate a status's world source into this communicator's rank.
    pub(crate) fn local_status(group: &Option<Rc<Group>>, mut st: Status) -> Status {
        if let (Some(g), false) = (group, st.cancelled) {
            st.source = g
                .comm_of
                .get(st.source as usize)
                .copied()
                .unwrap_or(u32::MAX);
        }
        st
    }

    #[inline]
    fn finish(&self, r: Result<Status>) -> Result<Status> {
        localize(&self.group, r)
    }

    #[inline]
    fn post_send(
        &self,
        buf: SendBuf,
        dest: u32,
        tag: i32,
        sync: bool,
        ctx: u32,
        scope: u64,
    ) -> Result<Posted> {
        let w = self.world_rank(dest)?;
        let tag = check_tag(tag)?;
        if !sync {
            if let Some(data) = buf.contig_bytes() {
                return self.post_plain(data, w, tag, ctx, scope);
            }
        }
        self.sh
            .engine
            .borrow_mut()
            .isend_general(w, ctx, tag, buf, sync, scope, false)
    }

    /// A plain contiguous send to world rank `w` with a checked tag: the lean path first (the
    /// one place that tries it); a message the provider took at once is `Posted::Done` with
    /// nothing left to do.
    #[inline(always)]
    fn post_plain(&self, data: &[u8], w: Rank, tag: i32, ctx: u32, scope: u64) -> Result<Posted> {
        let lean = self.sh.engine.borrow_mut().send_lean(w, ctx, tag, data)?;
        if lean == Lean::Sent {
            return Ok(Posted::Done(Ok(Status {
                source: w,
                tag,
                bytes: data.len(),
                cancelled: false,
            })));
        }
        self.post_general(data, w, tag, ctx, scope, lean == Lean::Busy)
    }

    /// The rest of [`Self::post_plain`], out of line: the engine's general path.
    #[inline(never)]
    fn post_general(
        &self,
        data: &[u8],
        w: Rank,
        tag: i32,
        ctx: u32,
        scope: u64,
        busy: bool,
    ) -> Result<Posted> {
        self.sh
            .engine
            .borrow_mut()
            .isend_general(w, ctx, tag, bytes_of(data), false, scope, busy)
    }

    #[inline]
    fn post_recv(
        &self,
        buf: RecvBuf,
        src: Source,
        tag: TagSel,
        ctx: u32,
        scope: u64,
    ) -> Result<Posted> {
        let s = self.source(src)?;
        let t = Self::tag_sel(tag)?;
        self.sh.engine.borrow_mut().irecv(s, ctx, t, buf, scope)
    }

    #[inline]
    fn complete(&self, p: Posted) -> Result<Status> {
        match p {
            Posted::Done(r) => self.finish(r),
            Posted::Pending(id) => self.complete_pending(id),
        }
    }

    #[inline(never)]
    fn complete_pending(&self, id: ReqId) -> Result<Status> {
        let r = self.sh.engine.borrow_mut().wait(id);
        self.finish(r)
    }

    /// Complete an operation of context `ctx`. In a collective context (odd: `ctx + 1` of a
    /// communicator) the wait also ends when any member of the communicator has failed: a
    /// collective cannot finish without every member, and a rank that waits on a live peer
    /// which itself gave up would otherwise wait for good.
    fn complete_ctx(&self, p: Posted, ctx: u32) -> Result<Status> {
        let Posted::Pending(id) = p else {
            return self.complete(p);
        };
        // `finalize`'s barrier waits plainly: a peer that has finished it may close (and be
        // reported gone) while this rank still waits for its last messages, which arrive
        // first.
        if ctx % 2 == 0 || self.sh.finalizing.get() {
            return self.complete(p);
        }
        let group = self.group.clone();
        let member = move |r: Rank| match &group {
            None => true,
            Some(g) => g.comm_of.get(r as usize).is_some_and(|c| *c != u32::MAX),
        };
        let r = self
            .sh
            .engine
            .borrow_mut()
            .wait_or_member_failed(id, member);
        self.finish(r)
    }

    // ------------------------------------------------------------------ blocking two-sided

    /// Blocking send (MPI_Send): returns once `buf` may be reused.
    pub fn send<T: Pod>(&self, buf: &[T], dest: u32, tag: i32) -> Result<()> {
        let w = self.world_rank(dest)?;
        let tag = check_tag(tag)?;
        match self.post_plain(bytemuck::cast_slice(buf), w, tag, self.ctx, 0)? {
            // The lean path: a message the provider took at once needs nothing after it.
            Posted::Done(Ok(_)) => Ok(()),
            p => self.complete(p).map(|_| ()),
        }
    }

    /// Synchronous send (MPI_Ssend): returns once the receiver has matched the message.
    pub fn ssend<T: Pod>(&self, buf: &[T], dest: u32, tag: i32) -> Result<()> {
        let p = self.post_send(bytes_of(buf), dest, tag, true, self.ctx, 0)?;
        self.complete(p).map(|_| ())
    }

    /// Blocking receive (MPI_Recv). A message longer than `buf` is a [`Error::from(ErrorDetail::Truncated)`]
    /// error; nothing is written past `buf`.
    pub fn recv<T: Pod>(
        &self,
        buf: &mut [T],
        src: impl Into<Source>,
        tag: impl Into<TagSel>,
    ) -> Result<Status> {
        let s = self.source(src.into())?;
        let t = Self::tag_sel(tag.into())?;
        let r = self
            .sh
            .engine
            .borrow_mut()
            .recv_now(s, self.ctx, t, bytes_of_mut(buf));
        self.finish(r)
    }

    /// Send `count` instances of `dt` from `buf` (offsets relative to `buf`'s start).
    pub fn send_typed(
        &self,
        buf: &[u8],
        count: usize,
        dt: &Datatype,
        dest: u32,
        tag: i32,
    ) -> Result<()> {
        let p = self.post_send(typed_send(buf, count, dt)?, dest, tag, false, self.ctx, 0)?;
        self.complete(p).map(|_| ())
    }

    /// Receive into `count` instances of `dt` laid out in `buf`.
    pub fn recv_typed(
        &self,
        buf: &mut [u8],
        count: usize,
        dt: &Datatype,
        src: impl Into<Source>,
        tag: impl Into<TagSel>,
    ) -> Result<Status> {
        let rb = typed_recv(buf, count, dt)?;
        let p = self.post_recv(rb, src.into(), tag.into(), self.ctx, 0)?;
        self.complete(p)
    }

    /// Send and receive at once (MPI_Sendrecv); never deadlocks against a matching sendrecv.
    pub fn sendrecv<T: Pod, U: Pod>(
        &self,
        sbuf: &[T],
        dest: u32,
        stag: i32,
        rbuf: &mut [U],
        src: impl Into<Source>,
        rtag: impl Into<TagSel>,
    ) -> Result<Status> {
        self.sendrecv_ctx(
            bytes_of(sbuf),
            dest,
            stag,
            bytes_of_mut(rbuf),
            src.into(),
            rtag.into(),
            self.ctx,
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sendrecv_ctx(
        &self,
        sb: SendBuf,
        dest: u32,
        stag: i32,
        rb: RecvBuf,
        src: Source,
        rtag: TagSel,
        ctx: u32,
    ) -> Result<Status> {
        let r = self.post_recv(rb, src, rtag, ctx, 0)?;
        let s = match self.post_send(sb, dest, stag, false, ctx, 0) {
            Ok(s) => s,
            Err(e) => {
                if let Posted::Pending(id) = r {
                    let mut eng = self.sh.engine.borrow_mut();
                    let _ = eng.cancel(id);
                    let _ = eng.wait(id);
                }
                return Err(e);
            }
        };
        let rs = self.complete_ctx(r, ctx);
        let ss = self.complete_ctx(s, ctx);
        let st = rs?;
        ss?;
        Ok(st)
    }

    pub(crate) fn send_ctx(&self, buf: SendBuf, dest: u32, tag: i32, ctx: u32) -> Result<()> {
        let p = self.post_send(buf, dest, tag, false, ctx, 0)?;
        self.complete_ctx(p, ctx).map(|_| ())
    }

    pub(crate) fn recv_ctx(&self, buf: RecvBuf, src: u32, tag: i32, ctx: u32) -> Result<Status> {
        let p = self.post_recv(buf, Source::Rank(src), TagSel::Tag(tag), ctx, 0)?;
        self.complete_ctx(p, ctx)
    }

    /// Wait for a matching message and describe it without receiving it (MPI_Probe).
    pub fn probe(&self, src: impl Into<Source>, tag: impl Into<TagSel>) -> Result<Status> {
        let s = self.source(src.into())?;
        let t = Self::tag_sel(tag.into())?;
        let mut eng = self.sh.engine.borrow_mut();
        let mut found = None;
        let mut err = None;
        let ctx = self.ctx;
        eng.wait_until("a probe", |e| match e.iprobe(s, ctx, t) {
            Ok(Some(st)) => {
                found = Some(st);
                true
            }
            Ok(None) => false,
            Err(x) => {
                err = Some(x);
                true
            }
        })?;
        if let Some(e) = err {
            return Err(e);
        }
        Ok(Self::local_status(
            &self.group,
            found.expect("set when done"),
        ))
    }

    /// Is a matching message waiting? (MPI_Iprobe)
    pub fn iprobe(&self, src: impl Into<Source>, tag: impl Into<TagSel>) -> Result<Option<Status>> {
        let s = self.source(src.into())?;
        let t = Self::tag_sel(tag.into())?;
        let r = self.sh.engine.borrow_mut().iprobe(s, self.ctx, t)?;
        Ok(r.map(|st| Self::local_status(&self.group, st)))
    }

    /// Drive the provider once (useful while computing between nonblocking calls).
    pub fn progress(&self) -> Result<()> {
        self.sh.engine.borrow_mut().progress().map(|_| ())
    }

    // ------------------------------------------------------------------ communicators

    /// Allocate a context id agreed by every rank of this communicator.
    fn new_context(&self) -> Result<u32> {
        let mine = [self.sh.next_ctx.get()];
        let mut agreed = [0u32];
        self.allreduce(&mine, &mut agreed, crate::Op::Max)?;
        let ctx = agreed[0];
        if ctx > u32::MAX - 4 {
            return Err(Error::from(ErrorDetail::Unsupported(
                "out of communicator context ids".into(),
            )));
        }
        self.sh.next_ctx.set(ctx + 2);
        Ok(ctx)
    }

    /// A communicator with the same ranks and a new context (MPI_Comm_dup). Collective.
    pub fn dup(&self) -> Result<Comm<P>> {
        let ctx = self.new_context()?;
        Ok(Comm {
            sh: self.sh.clone(),
            ctx,
            group: self.group.clone(),
            rank: self.rank,
            size: self.size,
        })
    }

    /// Split into communicators by `color`, ordered by `key` then rank (MPI_Comm_split).
    /// `None` (MPI_UNDEFINED) takes part but gets no communicator. Collective.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Comm<P>>> {
        let me = [
            color.map_or(-1i64, |c| c as i64),
            key as i64,
            self.world_rank(self.rank)? as i64,
        ];
        let mut all = vec![0i64; 3 * self.size as usize];
        self.allgather(&me, &mut all)?;
        let ctx = self.new_context()?;
        let Some(c) = color else {
            return Ok(None);
        };
        let mut members: Vec<(i64, u32, Rank)> = all
            .chunks(3)
            .enumerate()
            .filter(|(_, v)| v[0] == c as i64)
            .map(|(i, v)| (v[1], i as u32, v[2] as Rank))
            .collect();
        members.sort();
        let world_of: Vec<Rank> = members.iter().map(|m| m.2).collect();
        let world_size = self.sh.engine.borrow().st.am.size;
        let group = Group::new(world_of, world_size);
        let my_world = self.world_rank(self.rank)?;
        let rank = group.comm_of[my_world as usize];
        let size = group.world_of.len() as u32;
        Ok(Some(Comm {
            sh: self.sh.clone(),
            ctx,
            group: Some(Rc::new(group)),
            rank,
            size,
        }))
    }

    /// Requests currently alive in the engine (diagnostics).
    pub fn live_requests(&self) -> usize {
        self.sh.engine.borrow().live_requests()
    }

    /// Bytes of payload the engine holds copies of while they wait to be sent (diagnostics).
    pub fn queued_bytes(&self) -> usize {
        self.sh.engine.borrow().st.am.out.queued_copies()
    }

    /// Bytes of eager messages waiting in the unexpected queue (diagnostics; each peer's
    /// share is bounded by `WEFT_EAGER_WINDOW`).
    pub fn unexpected_bytes(&self) -> usize {
        self.sh.engine.borrow().st.p2p.unexpected_bytes
    }

    /// Announced bytes of speculative messages held for receives not posted yet
    /// (diagnostics; never more than `WEFT_SPEC_BUFFER`).
    pub fn staged_bytes(&self) -> usize {
        self.sh.engine.borrow().st.p2p.spec_staged_bytes
    }

    /// Registrations the core holds for a provider that needs local descriptors, and how
    /// often its registration cache was hit and missed (diagnostics).
    pub fn registration_cache(&self) -> RegistrationStats {
        let e = self.sh.engine.borrow();
        let s = e.st.am.mr.stats;
        RegistrationStats {
            entries: e.st.am.mr.len(),
            hits: s.hits,
            misses: s.misses,
            evictions: s.evictions,
            stale: s.stale,
        }
    }

    /// The provider's own named counters ([`Provider::counters`]): what it carried, by path.
    pub fn provider_counters(&self) -> Vec<(&'static str, u64)> {
        self.sh.engine.borrow().p.counters()
    }

    /// Blocking receives of this rank that took the lean path (posted without a request and
    /// completed by an eager message), and those that became ordinary requests on the way (a
    /// rendezvous matched them, another receive was posted, a peer failed): diagnostics.
    pub fn lean_receives(&self) -> (u64, u64) {
        self.sh.engine.borrow().st.p2p.slot_counts()
    }

    /// Peers the core asked the provider to connect to, and connections the provider reported
    /// up (diagnostics: a lazily connecting provider connects only to the peers used).
    pub fn connections(&self) -> (u32, u32) {
        let e = self.sh.engine.borrow();
        (e.st.am.connects, e.st.am.connected_events)
    }
}

/// The registration cache's counters ([`Comm::registration_cache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegistrationStats {
    /// Registrations held now (in use or cached).
    pub entries: usize,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Cached registrations found stale (their pages had changed) and made anew.
    pub stale: u64,
}

/// Create a world from a bootstrap and an opened provider, with the core parameters.
pub(crate) fn world_from<P: Provider>(p: P, boot: Box<dyn Bootstrap>) -> Result<World<P>> {
    World::from_parts(p, boot, EngineConfig::from_env()?)
}

//! Requests without a scope, for bindings that give weft buffers by address and learn of their
//! completion later: weft's libfabric face (`export/libfabric`), a C API. The buffer contract
//! that [`Scope`](super::Scope) enforces with lifetimes is the caller's here, so the calls
//! that take an address are `unsafe`.
//!
//! A [`RawRequest`] names one operation. [`Comm::test_raw`] reports its completion once (then
//! the request is spent); [`Comm::cancel_raw`] asks a receive that has not matched to end
//! with `cancelled` set. A request that is never tested keeps its slot until the world is
//! finalized, which completes it.

use super::*;

/// The scope of raw requests: never drained by a scope's end (no scope has this id).
const DETACHED: u64 = u64::MAX;

/// An operation posted with [`Comm::isend_raw`] or [`Comm::irecv_raw`].
#[derive(Debug)]
pub struct RawRequest {
    state: RawState,
    recv: bool,
}

#[derive(Debug)]
enum RawState {
    Pending(ReqId),
    Done(Option<Result<Status>>),
}

impl RawRequest {
    fn new(p: Posted, recv: bool) -> Self {
        RawRequest {
            state: match p {
                Posted::Done(r) => RawState::Done(Some(r)),
                Posted::Pending(id) => RawState::Pending(id),
            },
            recv,
        }
    }

    /// A receive (which [`Comm::cancel_raw`] may cancel).
    pub fn is_recv(&self) -> bool {
        self.recv
    }
}

impl<P: Provider> Comm<P> {
    /// Nonblocking send of `len` bytes at `ptr` to `dest` with `tag` (`sync`: MPI_Issend).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be readable and stay valid and unchanged until [`Self::test_raw`]
    /// has reported the request complete (or the world is finalized).
    pub unsafe fn isend_raw(
        &self,
        ptr: *const u8,
        len: usize,
        dest: u32,
        tag: i32,
        sync: bool,
    ) -> Result<RawRequest> {
        let buf = SendBuf {
            base: if len == 0 { [].as_ptr() } else { ptr },
            len,
            layout: Layout::Contig,
        };
        let p = self.post_send(buf, dest, tag, sync, self.ctx, DETACHED)?;
        Ok(RawRequest::new(p, false))
    }

    /// Nonblocking receive into the `cap` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+cap` must be writable, not read or written by anyone else, and stay valid
    /// until [`Self::test_raw`] has reported the request complete (or the world is finalized).
    pub unsafe fn irecv_raw(
        &self,
        ptr: *mut u8,
        cap: usize,
        src: impl Into<Source>,
        tag: impl Into<TagSel>,
    ) -> Result<RawRequest> {
        let buf = RecvBuf {
            base: if cap == 0 { [].as_mut_ptr() } else { ptr },
            cap,
            layout: Layout::Contig,
            shared: false,
        };
        let p = self.post_recv(buf, src.into(), tag.into(), self.ctx, DETACHED)?;
        Ok(RawRequest::new(p, true))
    }

    /// [`Self::isend_raw`] of the bytes of `iov`, one entry after the other (a gather list:
    /// the message is their concatenation, sent from where they lie, as a byte type indexed by
    /// their addresses would be).
    ///
    /// # Safety
    /// Each `(ptr, len)` must be readable and stay valid and unchanged until
    /// [`Self::test_raw`] has reported the request complete (or the world is finalized).
    pub unsafe fn isendv_raw(
        &self,
        iov: &[(*const u8, usize)],
        dest: u32,
        tag: i32,
        sync: bool,
    ) -> Result<RawRequest> {
        let (base, len, dt) = match gather(iov.iter().map(|&(p, l)| (p.expose_provenance(), l)))? {
            // SAFETY: the one entry with bytes (or none), under this call's contract.
            Gather::One(i) => {
                return unsafe { self.isend_raw(iov[i].0, iov[i].1, dest, tag, sync) }
            }
            Gather::Empty => return unsafe { self.isend_raw([].as_ptr(), 0, dest, tag, sync) },
            Gather::Blocks(base, len, dt) => (base, len, dt),
        };
        let buf = SendBuf {
            base: std::ptr::with_exposed_provenance(base),
            len,
            layout: Layout::Typed(dt, 1),
        };
        let p = self.post_send(buf, dest, tag, sync, self.ctx, DETACHED)?;
        Ok(RawRequest::new(p, false))
    }

    /// [`Self::irecv_raw`] into the entries of `iov`, one after the other (a scatter list:
    /// the message fills the first, then the next...; its capacity is their sum).
    ///
    /// # Safety
    /// Each `(ptr, len)` must be writable, not read or written by anyone else, and stay valid
    /// until [`Self::test_raw`] has reported the request complete (or the world is finalized).
    pub unsafe fn irecvv_raw(
        &self,
        iov: &[(*mut u8, usize)],
        src: impl Into<Source>,
        tag: impl Into<TagSel>,
    ) -> Result<RawRequest> {
        let (src, tag) = (src.into(), tag.into());
        let (base, cap, dt) = match gather(iov.iter().map(|&(p, l)| (p.expose_provenance(), l)))? {
            // SAFETY: the one entry with room (or none), under this call's contract.
            Gather::One(i) => return unsafe { self.irecv_raw(iov[i].0, iov[i].1, src, tag) },
            Gather::Empty => return unsafe { self.irecv_raw([].as_mut_ptr(), 0, src, tag) },
            Gather::Blocks(base, cap, dt) => (base, cap, dt),
        };
        let buf = RecvBuf {
            base: std::ptr::with_exposed_provenance_mut(base),
            cap,
            layout: Layout::Typed(dt, 1),
            shared: false,
        };
        let p = self.post_recv(buf, src, tag, self.ctx, DETACHED)?;
        Ok(RawRequest::new(p, true))
    }

    /// Its result once it has completed (`Some`, once; the request is then spent and its
    /// buffer the caller's again), else `None` after one step of progress. Errors of the call
    /// itself (a spent request) are the outer `Err`.
    pub fn test_raw(&self, r: &mut RawRequest) -> Result<Option<Result<Status>>> {
        self.complete_raw(r, true)
    }

    /// As [`Self::test_raw`], without making progress: for a caller that tests many requests
    /// after one call of [`Comm::progress`].
    pub fn take_raw(&self, r: &mut RawRequest) -> Result<Option<Result<Status>>> {
        self.complete_raw(r, false)
    }

    fn complete_raw(&self, r: &mut RawRequest, progress: bool) -> Result<Option<Result<Status>>> {
        let out = match &mut r.state {
            RawState::Pending(id) => {
                let id = *id;
                let mut e = self.sh.engine.borrow_mut();
                let res = if progress {
                    e.test(id)?
                } else {
                    e.try_take(id)
                };
                match res {
                    None => return Ok(None),
                    Some(res) => res,
                }
            }
            RawState::Done(res) => match res.take() {
                Some(res) => res,
                None => return Err(Error::invalid("request already completed")),
            },
        };
        r.state = RawState::Done(None);
        Ok(Some(self.finish(out)))
    }

    /// Ask a receive that has not matched yet to complete as cancelled; a matched one
    /// completes normally. Sends cannot be cancelled.
    pub fn cancel_raw(&self, r: &RawRequest) -> Result<()> {
        if !r.recv {
            return Err(Error::invalid("only receives can be cancelled"));
        }
        match &r.state {
            RawState::Pending(id) => self.sh.engine.borrow_mut().cancel(*id),
            RawState::Done(_) => Ok(()),
        }
    }

    /// One step of progress, and how many arrivals and completions it handled (0: nothing
    /// happened that a caller polling its requests needs to look at, save what its own calls
    /// did since).
    pub fn progress_events(&self) -> Result<usize> {
        self.sh.engine.borrow_mut().progress()
    }

    /// How many peers have failed so far (cheap: a binding polls it to notice a new failure).
    pub fn failed_peers(&self) -> u32 {
        self.sh.engine.borrow().st.am.nfailed
    }

    /// Why world rank `r` failed, if it did.
    pub fn peer_failure(&self, r: Rank) -> Option<String> {
        self.sh
            .engine
            .borrow()
            .st
            .am
            .peer_failure(r)
            .map(str::to_string)
    }

    /// The launcher's name for this job: peers' names for a process carry it, so a name from
    /// another job is told apart.
    pub fn job_id(&self) -> String {
        self.sh.boot.borrow().job_id().to_string()
    }
}

/// What an iovec is to the core.
enum Gather {
    /// No entry holds bytes.
    Empty,
    /// Only entry `i` does: a plain buffer.
    One(usize),
    /// Several do: the lowest address, the bytes in all, and a byte type whose blocks are the
    /// entries with bytes, in their order, at their distances from it.
    Blocks(usize, usize, Datatype),
}

/// The layout of an iovec given as addresses (each entry's pointer exposed by its cast to an
/// address, and a base rebuilt from one, so the core's blocks at `base.wrapping_offset(d)` may
/// reach every entry's allocation).
fn gather(iov: impl Iterator<Item = (usize, usize)>) -> Result<Gather> {
    let full: Vec<(usize, usize, usize)> = iov
        .enumerate()
        .filter(|&(_, (_, l))| l > 0)
        .map(|(i, (p, l))| (i, p, l))
        .collect();
    match full.as_slice() {
        [] => return Ok(Gather::Empty),
        [(i, _, _)] => return Ok(Gather::One(*i)),
        _ => {}
    }
    let base = full
        .iter()
        .map(|&(_, p, _)| p)
        .min()
        .expect("two entries or more");
    let mut lens = Vec::with_capacity(full.len());
    let mut displs = Vec::with_capacity(full.len());
    let mut total = 0usize;
    for &(_, p, l) in &full {
        p.checked_add(l)
            .ok_or_else(|| Error::invalid("an iovec entry wraps the address space"))?;
        let d =
            isize::try_from(p - base).map_err(|_| Error::invalid("iovec entries too far apart"))?;
        total = total
            .checked_add(l)
            .ok_or_else(|| Error::invalid("an iovec of more bytes than memory holds"))?;
        lens.push(l);
        displs.push(d);
    }
    let dt = Datatype::blocks_apart(&lens, &displs)?;
    Ok(Gather::Blocks(base, total, dt))
}

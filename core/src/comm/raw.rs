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
        let buf = match gather(iov.iter().map(|&(p, l)| (p.expose_provenance(), l)))? {
            None => {
                let (ptr, len) = iov.first().copied().unwrap_or(([].as_ptr(), 0));
                SendBuf {
                    base: if len == 0 { [].as_ptr() } else { ptr },
                    len,
                    layout: Layout::Contig,
                }
            }
            Some((base, len, dt)) => SendBuf {
                base: std::ptr::with_exposed_provenance(base),
                len,
                layout: Layout::Typed(dt, 1),
            },
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
        let buf = match gather(iov.iter().map(|&(p, l)| (p.expose_provenance(), l)))? {
            None => {
                let (ptr, cap) = iov.first().copied().unwrap_or(([].as_mut_ptr(), 0));
                RecvBuf {
                    base: if cap == 0 { [].as_mut_ptr() } else { ptr },
                    cap,
                    layout: Layout::Contig,
                    shared: false,
                }
            }
            Some((base, cap, dt)) => RecvBuf {
                base: std::ptr::with_exposed_provenance_mut(base),
                cap,
                layout: Layout::Typed(dt, 1),
                shared: false,
            },
        };
        let p = self.post_recv(buf, src.into(), tag.into(), self.ctx, DETACHED)?;
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

/// The layout of an iovec of several non-empty entries, as addresses (each entry's pointer is
/// exposed by its cast to an address, and the base rebuilt from one, so the core's blocks at
/// `base.wrapping_offset(d)` may reach every entry's allocation): the lowest address,
/// the bytes in all, and a byte type whose blocks are the entries in their order at their
/// distances from it; `None` when at most one entry holds bytes (a plain buffer does).
fn gather(iov: impl Iterator<Item = (usize, usize)>) -> Result<Option<(usize, usize, Datatype)>> {
    let full: Vec<(usize, usize)> = iov.filter(|&(_, l)| l > 0).collect();
    if full.len() <= 1 {
        return Ok(None);
    }
    let base = full
        .iter()
        .map(|&(p, _)| p)
        .min()
        .expect("two entries or more");
    let mut lens = Vec::with_capacity(full.len());
    let mut displs = Vec::with_capacity(full.len());
    let mut total = 0usize;
    for &(p, l) in &full {
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
    let dt = Datatype::hindexed(&lens, &displs, &Datatype::bytes())?.commit();
    Ok(Some((base, total, dt)))
}

//! Nonblocking two-sided operations: scopes, requests, `waitall`/`waitany`.

use super::*;

impl<P: Provider> Comm<P> {
    /// Run `f` with a scope for nonblocking operations; every request still running when `f`
    /// returns (or panics) is completed before `scope` returns.
    pub fn scope<'env, R>(&self, f: impl for<'s> FnOnce(&'s Scope<'s, 'env, P>) -> R) -> R {
        let id = self.sh.next_scope.get();
        self.sh.next_scope.set(id + 1);
        // The guard completes the scope's requests when `f` returns or unwinds.
        let _guard = ScopeEnd {
            sh: self.sh.clone(),
            id,
        };
        let scope = Scope {
            sh: self.sh.clone(),
            id,
            _scope: PhantomData,
            _env: PhantomData,
        };
        f(&scope)
    }

    pub(super) fn check_scope(&self, s: &Scope<'_, '_, P>) -> Result<()> {
        if !Rc::ptr_eq(&self.sh, &s.sh) {
            return Err(Error::invalid("the scope belongs to another world"));
        }
        Ok(())
    }

    pub(super) fn request<'s>(
        &self,
        s: &'s Scope<'s, '_, P>,
        p: Posted,
        recv: bool,
    ) -> Request<'s, P> {
        Request {
            sh: &s.sh,
            state: match p {
                Posted::Done(r) => ReqState::Done(Some(r)),
                Posted::Pending(id) => ReqState::Pending(id),
            },
            group: self.group.clone(),
            recv,
            _buf: PhantomData,
        }
    }

    /// Nonblocking send (MPI_Isend). `buf` stays borrowed until the scope ends.
    pub fn isend<'s, T: Pod>(
        &self,
        s: &'s Scope<'s, '_, P>,
        buf: &'s [T],
        dest: u32,
        tag: i32,
    ) -> Result<Request<'s, P>> {
        self.check_scope(s)?;
        let w = self.world_rank(dest)?;
        let tag = check_tag(tag)?;
        let p = self.post_plain(bytemuck::cast_slice(buf), w, tag, self.ctx, s.id)?;
        Ok(self.request(s, p, false))
    }

    /// Nonblocking synchronous send (MPI_Issend).
    pub fn issend<'s, T: Pod>(
        &self,
        s: &'s Scope<'s, '_, P>,
        buf: &'s [T],
        dest: u32,
        tag: i32,
    ) -> Result<Request<'s, P>> {
        self.check_scope(s)?;
        let p = self.post_send(bytes_of(buf), dest, tag, true, self.ctx, s.id)?;
        Ok(self.request(s, p, false))
    }

    /// Nonblocking receive (MPI_Irecv). `buf` stays borrowed until the scope ends.
    pub fn irecv<'s, T: Pod>(
        &self,
        s: &'s Scope<'s, '_, P>,
        buf: &'s mut [T],
        src: impl Into<Source>,
        tag: impl Into<TagSel>,
    ) -> Result<Request<'s, P>> {
        self.check_scope(s)?;
        let p = self.post_recv(bytes_of_mut(buf), src.into(), tag.into(), self.ctx, s.id)?;
        Ok(self.request(s, p, true))
    }

    /// Nonblocking send of a derived datatype.
    pub fn isend_typed<'s>(
        &self,
        s: &'s Scope<'s, '_, P>,
        buf: &'s [u8],
        count: usize,
        dt: &Datatype,
        dest: u32,
        tag: i32,
    ) -> Result<Request<'s, P>> {
        self.check_scope(s)?;
        let p = self.post_send(
            typed_send(buf, count, dt)?,
            dest,
            tag,
            false,
            self.ctx,
            s.id,
        )?;
        Ok(self.request(s, p, false))
    }

    /// Nonblocking receive into a derived datatype.
    pub fn irecv_typed<'s>(
        &self,
        s: &'s Scope<'s, '_, P>,
        buf: &'s mut [u8],
        count: usize,
        dt: &Datatype,
        src: impl Into<Source>,
        tag: impl Into<TagSel>,
    ) -> Result<Request<'s, P>> {
        self.check_scope(s)?;
        let rb = typed_recv(buf, count, dt)?;
        let p = self.post_recv(rb, src.into(), tag.into(), self.ctx, s.id)?;
        Ok(self.request(s, p, true))
    }

    /// Nonblocking receive into a [`SharedBuf`], which other pending receives may name too:
    /// the convention of OSU's and ucx_perftest's bandwidth tests, which post a whole window of
    /// receives into one buffer. Matching, truncation and the returned [`Status`] are those of
    /// [`irecv`](Self::irecv); what the buffer holds after several receives is unspecified (any
    /// mix of their data), as MPI leaves it.
    pub fn irecv_shared<'s>(
        &self,
        s: &'s Scope<'s, '_, P>,
        buf: &'s SharedBuf,
        src: impl Into<Source>,
        tag: impl Into<TagSel>,
    ) -> Result<Request<'s, P>> {
        self.check_scope(s)?;
        let rb = RecvBuf {
            base: buf.as_ptr(),
            cap: buf.len(),
            layout: Layout::Contig,
            shared: true,
        };
        let p = self.post_recv(rb, src.into(), tag.into(), self.ctx, s.id)?;
        Ok(self.request(s, p, true))
    }
}

/// A region in which nonblocking operations may run; see [`Comm::scope`].
pub struct Scope<'scope, 'env: 'scope, P: Provider> {
    sh: Rc<Shared<P>>,
    id: u64,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

struct ScopeEnd<P: Provider> {
    sh: Rc<Shared<P>>,
    id: u64,
}

impl<P: Provider> Drop for ScopeEnd<P> {
    fn drop(&mut self) {
        // Complete whatever is still running (including leaked requests) before the borrowed
        // buffers can go away.
        let r = self.sh.engine.borrow_mut().drain_scope(self.id);
        if let Err(e) = r {
            tracing::warn!("a request completed with an error at the end of its scope: {e}");
        }
    }
}

enum ReqState {
    Pending(ReqId),
    Done(Option<Result<Status>>),
}

/// A nonblocking operation in flight. Complete it with [`Request::wait`] or [`Request::test`].
#[must_use = "a request is waited for when dropped; call wait() to see its status"]
pub struct Request<'s, P: Provider> {
    sh: &'s Rc<Shared<P>>,
    state: ReqState,
    group: Option<Rc<Group>>,
    recv: bool,
    _buf: PhantomData<&'s mut [u8]>,
}

impl<P: Provider> Request<'_, P> {
    fn localize(&self, r: Result<Status>) -> Result<Status> {
        localize(&self.group, r)
    }

    /// Block until the operation completes (MPI_Wait).
    pub fn wait(mut self) -> Result<Status> {
        let r = match std::mem::replace(&mut self.state, ReqState::Done(None)) {
            ReqState::Pending(id) => self.sh.engine.borrow_mut().wait(id),
            ReqState::Done(Some(r)) => r,
            ReqState::Done(None) => return Err(Error::invalid("request already completed")),
        };
        self.localize(r)
    }

    /// Has it completed? `Some(status)` once, then the request is spent (MPI_Test).
    pub fn test(&mut self) -> Result<Option<Status>> {
        let r = match &mut self.state {
            ReqState::Pending(id) => {
                let id = *id;
                match self.sh.engine.borrow_mut().test(id)? {
                    None => return Ok(None),
                    Some(r) => r,
                }
            }
            ReqState::Done(r) => match r.take() {
                Some(r) => r,
                None => return Err(Error::invalid("request already completed")),
            },
        };
        self.state = ReqState::Done(None);
        self.localize(r).map(Some)
    }

    /// Whether the operation has finished (without consuming its status).
    pub fn is_complete(&self) -> bool {
        match &self.state {
            ReqState::Pending(id) => self.sh.engine.borrow().is_done(*id),
            ReqState::Done(_) => true,
        }
    }

    /// Cancel a receive that has not matched yet (MPI_Cancel); its status then says
    /// `cancelled`. Sends cannot be cancelled.
    pub fn cancel(&mut self) -> Result<()> {
        if !self.recv {
            return Err(Error::invalid("only receives can be cancelled"));
        }
        match &self.state {
            ReqState::Pending(id) => self.sh.engine.borrow_mut().cancel(*id),
            ReqState::Done(_) => Ok(()),
        }
    }
}

impl<P: Provider> Drop for Request<'_, P> {
    fn drop(&mut self) {
        if let ReqState::Pending(id) = self.state {
            let mut e = self.sh.engine.borrow_mut();
            if self.recv {
                let _ = e.cancel(id);
            }
            if let Err(err) = e.wait(id) {
                tracing::warn!("a dropped request completed with an error: {err}");
            }
        }
    }
}

/// Wait for all requests (MPI_Waitall). Every request is completed even after an error; the
/// first error is returned.
pub fn waitall<'s, P: Provider>(
    reqs: impl IntoIterator<Item = Request<'s, P>>,
) -> Result<Vec<Status>> {
    let mut out = Vec::new();
    let mut first = None;
    for r in reqs {
        match r.wait() {
            Ok(s) => out.push(s),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    first.map_or(Ok(out), Err)
}

/// Wait for any one request (MPI_Waitany): returns its index and status and empties its slot;
/// `Ok(None)` when every slot is empty.
pub fn waitany<P: Provider>(
    reqs: &mut [Option<Request<'_, P>>],
) -> Result<Option<(usize, Status)>> {
    let Some(sh) = reqs.iter().flatten().next().map(|r| r.sh.clone()) else {
        return Ok(None);
    };
    let mut found = None;
    let mut err = None;
    sh.engine
        .borrow_mut()
        .wait_until("any of several requests", |e| {
            for (i, slot) in reqs.iter_mut().enumerate() {
                let Some(r) = slot else { continue };
                let done = match &r.state {
                    ReqState::Pending(id) => e.is_done(*id),
                    ReqState::Done(_) => true,
                };
                if done {
                    let res = match std::mem::replace(&mut r.state, ReqState::Done(None)) {
                        ReqState::Pending(id) => e
                            .try_take(id)
                            .unwrap_or_else(|| Err(Error::invalid("request vanished"))),
                        ReqState::Done(Some(x)) => x,
                        ReqState::Done(None) => Err(Error::invalid("request already completed")),
                    };
                    match r.localize(res) {
                        Ok(s) => found = Some((i, s)),
                        Err(x) => err = Some(x),
                    }
                    *slot = None;
                    return true;
                }
            }
            false
        })?;
    if let Some(e) = err {
        return Err(e);
    }
    Ok(found)
}

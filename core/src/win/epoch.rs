//! The operations of an open epoch: put, get, accumulates, typed transfers, request-based
//! operations and flushes.

use super::sync::Unwind;
use super::*;

/// An open access epoch: operations borrow their buffers until the epoch ends.
pub struct Epoch<'e, 'w, P: Provider> {
    pub(super) win: &'e Window<'w, P>,
    pub(super) _b: PhantomData<&'e mut &'e ()>,
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
        w.prove_delivery(Some(targets))?;
        for &t in targets {
            if std::mem::take(&mut w.am_dirty.borrow_mut()[t as usize]) {
                w.roundtrip(rma::H_FLUSH, t, None)?;
            }
        }
        Ok(())
    }
}

pub(super) fn check_op(op: Op, ty: BasicType) -> Result<()> {
    if !op.valid_for(ty) || op == Op::Cswap {
        return Err(Error::invalid(format!(
            "{} is not an accumulate operation on {}",
            op.name(),
            ty.name()
        )));
    }
    Ok(())
}

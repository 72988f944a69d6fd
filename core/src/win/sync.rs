//! Synchronisation: fence, post-start-complete-wait, passive-target locks, and unwinding
//! out of an epoch closure.

use super::*;

impl<'w, P: Provider> Window<'w, P> {
    pub(super) fn enter(&self, a: Access_) -> Result<()> {
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

    pub(super) fn close_fence(&self, assert: Assert) -> Result<()> {
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
        if self.native_put && self.native_get && self.native_atomics && !self.pack_native {
            self.drain_pending(None)?;
            self.complete_local()?;
            self.prove_delivery(None)?;
            // Every operation is complete at the origin, hence at the target: a barrier is
            // enough.
            return self.comm.barrier();
        }
        // Every rank tells every rank (itself included) that it has reached the fence with a
        // FENCE message sent after its operations, and waits for everybody's. Delivery is in
        // order per pair, so a rank that has every FENCE has applied every operation of the
        // epoch. With aggregation the FENCE rides on the last batch to each target. Holding
        // every FENCE says that everybody sent everything, not that everybody has applied
        // what it was sent, and a next-epoch operation must not overtake this epoch's at its
        // target (a get from C reaching B before D's put to B of this epoch; a native put
        // overtaking an active-message accumulate of the same origin still queued there). So
        // each rank then says DONE to every rank, and an operation of a later epoch waits for
        // its target's DONE (`await_done`), which has usually arrived by then. Together this
        // replaces an alltoall of operation counts and a barrier, with no round trip of its
        // own on the way out of the fence.
        let n = self.comm.size();
        let me = self.comm.rank();
        // This rank's FENCE to itself goes as a message only behind active messages it sent
        // itself (in order with them); otherwise it is counted here, without a message.
        let fold_self = self.am_dirty.borrow()[me as usize]
            || self.pending.borrow().iter().any(|o| o.trank == me);
        let all: SmallVec<[(u32, u64); 8]> = (0..n)
            .filter(|&t| t != me || fold_self)
            .map(|t| (t, 0))
            .collect();
        let folded = self.drain_folding(rma::B_FENCE, &all)?;
        // Deferred operations to this rank were issued by the drain just above.
        let to_self = std::mem::take(&mut self.am_dirty.borrow_mut()[me as usize]) || fold_self;
        self.complete_local()?;
        self.prove_delivery(None)?;
        let id = self.id;
        let seq = self.fences.get() + 1;
        self.fences.set(seq);
        let worlds: SmallVec<[Rank; 8]> = (0..n).map(|t| self.world(t)).collect();
        let mut eng = self.engine();
        for (t, &w) in worlds.iter().enumerate() {
            if t as u32 == me && !to_self {
                if let Some(win) = eng.st.rma.wins.get_mut(&id) {
                    *win.fences.entry(w).or_insert(0) += 1;
                }
            } else if !folded.contains(&(t as u32)) {
                let mut h = Hdr::new(rma::H_FENCE);
                h.u32(id);
                eng.st.am.push_ctrl(w, h);
            }
        }
        eng.flush_out()?;
        let mut failed = None;
        eng.wait_until("fence: every rank's FENCE", |e| {
            let Some(w) = e.st.rma.wins.get(&id) else {
                return true;
            };
            let mut all_in = true;
            for &r in &worlds {
                if w.fences.get(&r).copied().unwrap_or(0) < seq {
                    all_in = false;
                    if let Some(why) = e.st.am.peer_failure(r) {
                        failed = Some(Error::peer_failed(r, why));
                        return true;
                    }
                }
            }
            all_in
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        for (t, &w) in worlds.iter().enumerate() {
            if t as u32 == me {
                if let Some(win) = eng.st.rma.wins.get_mut(&id) {
                    *win.dones.entry(w).or_insert(0) += 1;
                }
            } else {
                let mut h = Hdr::new(rma::H_DONE);
                h.u32(id);
                eng.st.am.push_ctrl(w, h);
            }
        }
        eng.flush_out()?;
        Ok(())
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

    pub(super) fn start(&self, targets: &[u32]) -> Result<()> {
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

    /// Issue the deferred operations, folding sync `flag` into the last batch to each of
    /// `targets` where that is safe: under aggregation, and only where native writes complete
    /// on delivery (folded, the sync could overtake writes that complete at transmission,
    /// which are proven delivered before an unfolded sync goes). Returns the targets folded.
    fn drain_folding(&self, flag: u8, targets: &[(u32, u64)]) -> Result<Targets> {
        let delivery = self
            .engine()
            .st
            .am
            .caps
            .rma
            .is_none_or(|r| r.delivery_complete());
        if self.sched.aggregates() && delivery {
            self.drain_pending(Some((flag, targets)))
        } else {
            self.drain_pending(None)?;
            Ok(Targets::new())
        }
    }

    pub(super) fn complete(&self, targets: &[u32]) -> Result<()> {
        let fold: SmallVec<[(u32, u64); 4]> = targets.iter().map(|t| (*t, 0)).collect();
        let folded = self.drain_folding(rma::B_COMPLETE, &fold)?;
        // Gets and native operations must be complete before we say so.
        self.complete_local()?;
        // Where writes complete at transmission, a target that got only native writes learns
        // of the completion from a marker fenced behind them (remote completion data: no
        // round trip); any other target gets the writes proven delivered, then COMPLETE.
        let marker = self.engine().st.am.caps.rma.is_some_and(|r| {
            !r.delivery_complete() && r.fence && r.cq_data_size >= 4 && self.id <= rma::D_WIN_MAX
        });
        let mut by_marker: SmallVec<[u32; 4]> = SmallVec::new();
        if marker {
            let am = self.am_dirty.borrow();
            let mut w = self.written.borrow_mut();
            for &t in targets {
                if !folded.contains(&t) && !am[t as usize] && w[t as usize] {
                    w[t as usize] = false;
                    by_marker.push(t);
                }
            }
        }
        self.prove_delivery(Some(targets))?;
        let mut eng = self.engine();
        for &t in targets {
            if folded.contains(&t) {
                continue;
            }
            let w = self.comm.world_rank(t)?;
            if by_marker.contains(&t) {
                let ra = match &self.keys {
                    Some(k) => k[t as usize],
                    None => RemoteAddr {
                        addr: 0,
                        key: self.id as u64,
                    },
                };
                let data = rma::data_marker(rma::D_COMPLETE, self.id);
                let e = &mut *eng;
                // Nothing to keep valid: no local bytes. Completion is not waited for (the
                // next epoch's operations are fenced behind it by the provider anyway).
                // SAFETY: an empty local iovec.
                unsafe {
                    e.p.rma_write_data(w, &[], ra, data, Completion::default().fenced())?
                };
                continue;
            }
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
    pub(super) fn native_lock(&self, trank: u32, exclusive: bool) -> Result<()> {
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

    pub(super) fn unlock_targets(&self, targets: &[u32]) -> Result<()> {
        if self.native_locks {
            self.drain_pending(None)?;
            let mut first = self.complete_local().err();
            if first.is_none() {
                first = self.prove_delivery(Some(targets)).err();
            }
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
        let r = self
            .complete_local()
            .and_then(|_| self.prove_delivery(Some(targets)));
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
}

/// On unwinding out of an epoch closure: forget operations not issued yet (their buffers are
/// about to go) and complete the issued ones, so nothing refers to freed memory afterwards.
pub(super) struct Unwind<'a, 'w, P: Provider> {
    pub(super) win: &'a Window<'w, P>,
    pub(super) keep: usize,
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

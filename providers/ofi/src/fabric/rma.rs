//! RMA and atomics: per-window counter endpoints, the contexts and flags of each operation,
//! retries on `EAGAIN`, registrations; and the write rendezvous carried as exact-tag sends
//! into receives posted at registration (`wrecv_*`, `wsend`).
//!
//! The write rendezvous in active-message mode (`wrndv`). The core's receiver registers its
//! buffer for one peer's write of the whole message and sends the key; the sender writes, then
//! tells the receiver (`WFIN`), which deregisters before it hands the buffer back. Here the
//! registration posts the buffer as a tagged receive with an exact tag in the provider's data
//! context (the key: never a wildcard, and posted before the key leaves, so libfabric 1.17
//! shm's faults with unexpected messages cannot arise), and the write is a tagged send with
//! that tag: libfabric moves the data its own way (shm: one CMA copy or its pipelined
//! segments) with no copy through active-message buffers.

use super::*;

impl Ofi {
    /// The open counter (and its endpoint) of id `c`.
    pub(super) fn win_cntr(&self, c: CntrId) -> Result<&WinCntr> {
        c.checked_sub(1)
            .and_then(|i| self.cntrs.get(i as usize))
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid(format!("no open completion counter {c}")))
    }

    /// Report an operation that needs no libfabric call as finished, where `done` says.
    pub(super) fn finish_now(&mut self, done: &Completion) -> Result<()> {
        if let Some(c) = done.cntr {
            let w = self.win_cntr(c)?;
            // SAFETY: an open counter.
            check("fi_cntr_add", unsafe { fi_cntr_add(w.cntr, 1) })?;
        }
        if let Some(t) = done.cq {
            self.done.push_back((t, Ok(Completed::Done)));
        }
        Ok(())
    }

    pub(super) fn keep_cntr(&mut self, w: WinCntr) -> CntrId {
        let w = Some(w);
        let i = match self.cntrs.iter().position(Option::is_none) {
            Some(i) => {
                self.cntrs[i] = w;
                i
            }
            None => {
                self.cntrs.push(w);
                self.cntrs.len() - 1
            }
        };
        i as CntrId + 1
    }

    pub(super) fn peer_ok(&self, r: Rank) -> Result<()> {
        if r >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        Ok(())
    }

    /// The endpoint for an RMA operation: its window's (counted) or the main one.
    pub(super) fn rma_ep(&self, done: &Completion) -> Result<*mut fid_ep> {
        match done.cntr {
            None => Ok(self.ep),
            Some(c) => self.win_cntr(c).map(|w| w.ep),
        }
    }

    /// Context and flags for an RMA operation that reports as `done` says.
    pub(super) fn rma_ctx(
        &mut self,
        peer: Rank,
        done: &Completion,
    ) -> (*mut c_void, u64, Option<usize>) {
        let mut flags = if done.fence { FI_FENCE } else { 0 };
        match done.cq {
            Some(token) => {
                let op = self.new_op(Op::Rma { token, peer });
                flags |= FI_COMPLETION;
                (ctx(op), flags, Some(op))
            }
            None => (null_mut(), flags, None),
        }
    }

    /// Retry a post while the provider's queue is full (bounded).
    pub(super) fn retry(
        &mut self,
        what: &str,
        op: Option<usize>,
        mut post: impl FnMut() -> isize,
    ) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let rc = post();
            if rc == 0 {
                return Ok(());
            }
            if rc != EAGAIN || Instant::now() > deadline {
                if let Some(o) = op {
                    self.free_op(o);
                }
                return Err(fi_err(what, rc));
            }
            self.drive()?;
        }
    }

    pub(super) fn rma(
        &mut self,
        peer: Rank,
        write: bool,
        local: &[(usize, usize, u64)],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.peer_ok(peer)?;
        let ep = self.rma_ep(&done)?;
        let (context, mut flags, op) = self.rma_ctx(peer, &done);
        if write && self.delivery {
            flags |= FI_DELIVERY_COMPLETE;
        }
        let iov: SmallVec<[iovec; 4]> = local
            .iter()
            .map(|&(p, l, _)| iovec {
                iov_base: p as *mut c_void,
                iov_len: l,
            })
            .collect();
        let mut desc: SmallVec<[*mut c_void; 4]> =
            local.iter().map(|&(_, _, d)| d as *mut c_void).collect();
        let rio = fi_rma_iov {
            addr: remote.addr,
            len: local.iter().map(|x| x.1).sum(),
            key: remote.key,
        };
        let msg = fi_msg_rma {
            msg_iov: iov.as_ptr(),
            desc: desc.as_mut_ptr(),
            iov_count: iov.len(),
            addr: self.addrs[peer as usize],
            rma_iov: &rio,
            rma_iov_count: 1,
            context,
            data: 0,
        };
        if write {
            self.n_write += 1;
        } else {
            self.n_read += 1;
        }
        // SAFETY: the local iovecs stay valid until completion (the caller's contract); `msg`
        // and what it points at live across the call.
        self.retry(
            if write { "fi_writemsg" } else { "fi_readmsg" },
            op,
            || unsafe {
                if write {
                    fi_writemsg(ep, &msg, flags)
                } else {
                    fi_readmsg(ep, &msg, flags)
                }
            },
        )
    }

    pub(super) fn register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: Option<u64>,
    ) -> Result<MemRegion> {
        let mut acc = FI_SEND | FI_RECV | FI_READ | FI_WRITE;
        if access.remote_read || access.remote_atomic {
            acc |= FI_REMOTE_READ;
        }
        if access.remote_write || access.remote_atomic {
            acc |= FI_REMOTE_WRITE;
        }
        let requested = match key {
            Some(_) if self.prov_key => {
                return Err(Error::from(ErrorDetail::Unsupported(
                    "ofi: this fabric chooses its own keys (FI_MR_PROV_KEY)".into(),
                )))
            }
            Some(k) => k,
            None => self.take_key(),
        };
        let mut mr = null_mut();
        // SAFETY: the caller keeps `base..base+len` valid until deregistration.
        let rc = unsafe {
            fi_mr_reg(
                self.dom,
                base as *const c_void,
                len,
                acc,
                0,
                requested,
                0,
                &mut mr,
                null_mut(),
            )
        };
        check("fi_mr_reg", rc)?;
        // SAFETY: a registration just opened.
        let (k, d) = unsafe { ((*mr).key, (*mr).mem_desc) };
        Ok(MemRegion {
            key: k,
            addr: if self.virt_addr { base as u64 } else { 0 },
            len,
            handle: mr as u64,
            desc: d as u64,
        })
    }

    pub(super) fn wrecv_open(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        if access.remote_read || access.remote_atomic || !access.remote_write || len == 0 {
            return Err(am_mode("a registration serves the write rendezvous only"));
        }
        let id = self.next_data_id;
        self.next_data_id = id.wrapping_add(1);
        let key = self.layout.data_tag(self.rank, id);
        let op = self.new_op(Op::WRecv { done: None });
        self.post(Deferred {
            recv: true,
            iov: SmallVec::from_slice(&[(base as usize, len, 0)]),
            peer: FI_ADDR_UNSPEC,
            tag: key,
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        })?;
        Ok(MemRegion {
            key,
            addr: 0,
            len,
            handle: W_HANDLE | op as u64,
            desc: 0,
        })
    }

    /// Take write-rendezvous receive `i` back: once its data is in (the usual case: the
    /// sender's `WFIN` follows its completion), else cancelled. libfabric must answer within
    /// [`WRECV_WAIT`]; if it does not, the process ends, because returning would hand back a
    /// buffer libfabric may still write into.
    pub(super) fn wrecv_close(&mut self, i: usize) -> Result<()> {
        if !matches!(self.ops.get(i), Some(Op::WRecv { .. })) {
            return Err(Error::invalid(
                "ofi: deregistering a region it never registered",
            ));
        }
        if let Some(d) = self.deferred.iter().position(|d| d.op == i) {
            // Never reached libfabric.
            self.deferred.remove(d);
            self.free_op(i);
            return Ok(());
        }
        let start = Instant::now();
        let mut cancelled = false;
        loop {
            if let Op::WRecv { done: Some(err) } = self.ops[i] {
                self.free_op(i);
                if err != 0 && err != FI_ECANCELED as i32 {
                    tracing::warn!(
                        "ofi: a write-rendezvous receive failed: {}",
                        strerror(err as i64)
                    );
                }
                return Ok(());
            }
            let waited = start.elapsed();
            if !cancelled && waited > SYNC_POLL {
                // No data came: the sender failed or the receive was given up. A receive
                // that is already matched cannot be cancelled; its completion still comes.
                // SAFETY: `ep` is open; the context names one of its posted receives.
                unsafe { fi_cancel(&mut (*self.ep).fid, ctx(i)) };
                cancelled = true;
            }
            if waited > WRECV_WAIT {
                tracing::error!("ofi: libfabric kept a receive buffer after cancellation");
                eprintln!(
                    "weft: ofi: libfabric neither completed nor cancelled a receive into a buffer                      that is being given back ({} s); ending the process rather than let it                      write there",
                    WRECV_WAIT.as_secs()
                );
                std::process::abort();
            }
            self.drive()?;
        }
    }

    pub(super) fn wsend(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.peer_ok(dest)?;
        if remote.addr != 0 || !self.layout.is_data(remote.key) {
            return Err(Error::from(ErrorDetail::RemoteAccess {
                rank: dest,
                what: "not a write-rendezvous key of the ofi provider".into(),
            }));
        }
        let Some(token) = done.cq else {
            return Err(Error::invalid(
                "ofi: a write-rendezvous write reports through the completion queue",
            ));
        };
        if local.iter().map(|x| x.len).sum::<usize>() == 0 {
            return Err(Error::invalid("ofi: an empty write-rendezvous write"));
        }
        let op = self.new_op(Op::WSend { token, dest });
        self.n_wrndv += 1;
        self.post(Deferred {
            recv: false,
            iov: raw(local),
            peer: self.addrs[dest as usize],
            tag: remote.key,
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        })
    }
}

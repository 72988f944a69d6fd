//! Completions: reading the CQ in batches and its error entries, operations deferred while
//! libfabric said `EAGAIN` and retried, and `handle`, what each completion means by the
//! operation it belongs to.

use super::*;

impl Ofi {
    /// Read whatever the CQ holds (this is what makes a manual-progress provider progress).
    /// Without a sink: answers to probes and cancels are taken at once, the rest kept in
    /// `early` for `progress`.
    pub(super) fn drive(&mut self) -> Result<usize> {
        let mut n = 0;
        loop {
            let mut evs = SmallVec::new();
            self.read_batch(&mut evs)?;
            if evs.is_empty() {
                return Ok(n);
            }
            n += evs.len();
            for ev in evs {
                if !self.absorb(&ev) {
                    self.early.push_back(ev);
                }
            }
        }
    }

    /// The completions the CQ holds, up to 16 (one call: each read drives a manual-progress
    /// provider, a poll of its sockets on tcp), or one error entry.
    pub(super) fn read_batch(&mut self, out: &mut SmallVec<[Ev; 16]>) -> Result<()> {
        // Not zeroed: this runs on every poll, and 768 bytes of memset were a visible share of
        // an idle poll.
        let mut e = MaybeUninit::<[fi_cq_tagged_entry; 16]>::uninit();
        // SAFETY: room for 16 tagged entries (the CQ's format); libfabric writes at most that.
        let rc = unsafe { fi_cq_read(self.cq, e.as_mut_ptr().cast(), 16) };
        if rc > 0 {
            let n = (rc as usize).min(16);
            // SAFETY: fi_cq_read returned `rc` entries, all written, at the start of `e`.
            let e =
                unsafe { std::slice::from_raw_parts(e.as_ptr().cast::<fi_cq_tagged_entry>(), n) };
            out.extend(e.iter().map(|e| Ev {
                ctx: e.op_context as usize,
                flags: e.flags,
                len: e.len,
                data: e.data,
                tag: e.tag,
                err: 0,
                olen: 0,
                prov_errno: 0,
            }));
            return Ok(());
        }
        if let Some(ev) = self.read_error(rc)? {
            out.push(ev);
        }
        Ok(())
    }

    /// After a read that returned `rc` (no entries): the error entry, if one is waiting.
    pub(super) fn read_error(&mut self, rc: isize) -> Result<Option<Ev>> {
        if rc == EAGAIN || rc == 0 {
            return Ok(None);
        }
        if rc == -(FI_EAVAIL as isize) {
            let mut x = fi_cq_err_entry::default();
            // SAFETY: `x` is ours; libfabric fills it (err_data stays libfabric's; unused).
            let rc = unsafe { fi_cq_readerr(self.cq, &mut x, 0) };
            if rc == 1 {
                return Ok(Some(Ev {
                    ctx: x.op_context as usize,
                    flags: x.flags,
                    len: x.len,
                    data: x.data,
                    tag: x.tag,
                    // Positive by the documentation; some providers store it negated.
                    err: match x.err.unsigned_abs() {
                        0 => x.prov_errno.unsigned_abs().max(1) as i32,
                        e => e as i32,
                    },
                    olen: x.olen,
                    prov_errno: x.prov_errno,
                }));
            }
            return Ok(None);
        }
        Err(fi_err("fi_cq_read", rc))
    }

    /// Take a completion that needs no sink: a probe's answer, a cancelled receive.
    pub(super) fn absorb(&mut self, ev: &Ev) -> bool {
        let Some(i) = ev.ctx.checked_sub(1).filter(|i| *i < self.ops.len()) else {
            return false;
        };
        match self.ops[i] {
            Op::Peek(None) => {
                // A message was found: a success, or a truncation into the peek's empty buffer
                // (which some providers report); anything else (FI_ENOMSG) means none.
                let found = ev.err == 0 || ev.err == FI_ETRUNC as i32;
                let ans = found.then(|| {
                    let (source, tag) = self.layout.unpack(ev.tag);
                    // Some providers (tcp;ofi_rxm) leave FI_REMOTE_CQ_DATA out of a peek's
                    // flags but pass the data: a 1-byte message whose data says "announce".
                    let announce = is_announce(ev)
                        || (ev.len == 1 && ev.data & D_ANNOUNCE != 0 && ev.data & D_SYNC == 0);
                    let bytes = if announce {
                        (ev.data & ((1 << LEN_BITS) - 1)) as usize
                    } else {
                        ev.len + ev.olen
                    };
                    TaggedStatus { source, tag, bytes }
                });
                self.ops[i] = Op::Peek(Some(ans));
                true
            }
            Op::Orphan => {
                self.free_op(i);
                true
            }
            Op::Cancelling(_, _, b) if ev.err == FI_ECANCELED as i32 => {
                self.ops[i] = Op::Cancelled(b);
                true
            }
            Op::WRecv { done: None } => {
                self.ops[i] = Op::WRecv { done: Some(ev.err) };
                true
            }
            _ => false,
        }
    }

    /// Post (or queue behind earlier ones) a tagged send or receive.
    pub(super) fn post(&mut self, d: Deferred) -> Result<()> {
        if !self.deferred.is_empty() {
            self.deferred.push_back(d);
            return Ok(());
        }
        let mut rc = self.try_post(&d);
        if rc == EAGAIN {
            self.drive()?;
            rc = self.try_post(&d);
        }
        if rc == EAGAIN {
            self.deferred.push_back(d);
            return Ok(());
        }
        if rc != 0 {
            self.free_op(d.op);
            return Err(fi_err(
                if d.recv { "fi_trecvmsg" } else { "fi_tsendmsg" },
                rc,
            ));
        }
        Ok(())
    }

    pub(super) fn try_post(&mut self, d: &Deferred) -> isize {
        let iov: SmallVec<[iovec; 4]> = d
            .iov
            .iter()
            .map(|&(p, l, _)| iovec {
                iov_base: p as *mut c_void,
                iov_len: l,
            })
            .collect();
        let mut desc: SmallVec<[*mut c_void; 4]> =
            d.iov.iter().map(|&(_, _, x)| x as *mut c_void).collect();
        let msg = fi_msg_tagged {
            msg_iov: iov.as_ptr(),
            desc: desc.as_mut_ptr(),
            iov_count: iov.len(),
            addr: d.peer,
            tag: d.tag,
            ignore: d.ignore,
            context: ctx(d.op),
            data: d.data,
        };
        // SAFETY: the iovecs point at memory the core keeps valid until the operation's token
        // completes (the contract of tagged_send/tagged_recv); `msg` is read during the call.
        unsafe {
            if d.recv {
                fi_trecvmsg(self.ep, &msg, d.flags)
            } else {
                fi_tsendmsg(self.ep, &msg, d.flags)
            }
        }
    }

    pub(super) fn retry_deferred(&mut self) -> Result<usize> {
        let mut n = 0;
        while let Some(d) = self.deferred.pop_front() {
            let rc = self.try_post(&d);
            if rc == EAGAIN {
                self.deferred.push_front(d);
                break;
            }
            n += 1;
            if rc != 0 {
                let token = match self.ops[d.op] {
                    Op::Send { token, .. }
                    | Op::Recv { token, .. }
                    | Op::LSend { token, .. }
                    | Op::LRecv { token, .. }
                    | Op::WSend { token, .. } => Some(token),
                    _ => None,
                };
                if let Op::WRecv { .. } = self.ops[d.op] {
                    // Taken back (and freed) at deregistration; no write can land.
                    self.ops[d.op] = Op::WRecv {
                        done: Some(-(rc as i32)),
                    };
                    continue;
                }
                self.free_op(d.op);
                if let Some(t) = token {
                    self.done
                        .push_back((t, Err(fi_err("posting a deferred tagged operation", rc))));
                }
            }
        }
        Ok(n)
    }

    /// Handle one completion with the sink at hand.
    pub(super) fn handle(&mut self, ev: Ev, sink: &mut dyn Sink) -> Result<()> {
        let Some(i) = ev.ctx.checked_sub(1) else {
            if ev.err != 0 {
                // A counted operation (no CQ entry asked) failed: its counter's error count
                // says so to the window; nothing else to do here.
                tracing::debug!(
                    "ofi: a counted operation failed: {}",
                    strerror(ev.err as i64)
                );
            }
            return Ok(());
        };
        let Some(op) = self.ops.get(i).copied() else {
            tracing::warn!("ofi: completion for an unknown operation {i}");
            return Ok(());
        };
        let reason = || {
            format!(
                "{} (provider error {})",
                strerror(ev.err as i64),
                ev.prov_errno
            )
        };
        tracing::trace!(?op, ?ev, "ofi completion");
        match op {
            Op::AmRx(b) => {
                self.free_op(i);
                if ev.err == 0 {
                    let base = b as usize * self.slot;
                    let len = ev.len.min(self.slot);
                    // Borrow the buffer out of `self` while the sink runs.
                    let mem = std::mem::take(&mut self.rx_mem);
                    let delivered = self.on_am(&mem[base..base + len], false, sink);
                    self.rx_mem = mem;
                    if let Some(s) = delivered {
                        self.drain_held(s, sink);
                    }
                } else if ev.err != FI_ECANCELED as i32 {
                    tracing::warn!("ofi: active-message receive failed: {}", reason());
                }
                if ev.err != FI_ECANCELED as i32 {
                    self.rx_idle.push(b);
                    if self.rx_idle.len() >= REPOST_BATCH {
                        self.repost()?;
                    }
                }
            }
            Op::AmTx(b, dest) => {
                self.free_op(i);
                self.tx_free.push(b);
                if ev.err != 0 {
                    sink.peer_failed(dest, &format!("send failed: {}", reason()));
                }
            }
            Op::Send {
                token, dest, ack, ..
            } => {
                if ev.err != 0 {
                    self.free_op(i);
                    sink.complete(
                        token,
                        Err(Error::peer_failed(
                            dest,
                            format!("tagged send failed: {}", reason()),
                        )),
                    );
                } else if ack {
                    self.ops[i] = Op::Send {
                        token,
                        dest,
                        ack,
                        sent: true,
                    };
                } else {
                    self.free_op(i);
                    sink.complete(token, Ok(Completed::Done));
                }
            }
            Op::Recv { token, cap, bounce } | Op::Cancelling(token, cap, bounce)
                if is_announce(&ev) && (ev.err == 0 || ev.err == FI_ETRUNC as i32) =>
            {
                self.n_trecv += 1;
                self.release_bounce(bounce);
                self.on_announce(i, token, cap, &ev);
            }
            Op::Recv { token, cap, bounce } | Op::Cancelling(token, cap, bounce) => {
                if bounce != NO_BOUNCE {
                    if ev.err == 0 {
                        self.unbounce(bounce, i, ev.len.min(cap));
                    }
                    self.release_bounce(bounce);
                }
                self.free_op(i);
                self.n_trecv += 1;
                let (source, tag) = self.layout.unpack(ev.tag);
                let matched = ev.err == 0 || ev.err == FI_ETRUNC as i32;
                if matched && ev.flags & FI_REMOTE_CQ_DATA != 0 && ev.data & D_SYNC != 0 {
                    self.acks.push_back((source, ev.data & !D_SYNC));
                }
                let r = match ev.err {
                    0 => Ok(Completed::Received(TaggedStatus {
                        source,
                        tag,
                        bytes: ev.len,
                    })),
                    // Some providers (libfabric 1.17's tcp;ofi_rxm and shm) leave the length of
                    // a truncated message out: then all that is known is "more than fits".
                    e if e == FI_ETRUNC as i32 => Ok(Completed::Received(TaggedStatus {
                        source,
                        tag,
                        bytes: (ev.len + ev.olen).max(cap + 1),
                    })),
                    e if e == FI_ECANCELED as i32 => Ok(Completed::Cancelled),
                    _ => Err(fi_err("tagged receive", -(ev.err as isize))),
                };
                sink.complete(token, r);
            }
            Op::Rma { token, peer } => {
                self.free_op(i);
                let r = if ev.err == 0 {
                    Ok(Completed::Done)
                } else {
                    Err(Error::from(ErrorDetail::RemoteAccess {
                        rank: peer,
                        what: reason(),
                    }))
                };
                sink.complete(token, r);
            }
            Op::LSend {
                token,
                dest,
                owed,
                data,
                failed,
            } => {
                let owed = owed - 1;
                let failed = if ev.err != 0 && !failed {
                    sink.complete(
                        token,
                        Err(Error::peer_failed(
                            dest,
                            format!("tagged send failed: {}", reason()),
                        )),
                    );
                    true
                } else {
                    failed
                };
                if owed == 0 && (data || failed) {
                    if !failed {
                        sink.complete(token, Ok(Completed::Done));
                    }
                    self.free_op(i);
                } else {
                    self.ops[i] = Op::LSend {
                        token,
                        dest,
                        owed,
                        data,
                        failed,
                    };
                }
            }
            Op::LRecv {
                token,
                source,
                tag,
                len,
            } => {
                self.free_op(i);
                let r = if ev.err == 0 {
                    Ok(Completed::Received(TaggedStatus {
                        source,
                        tag,
                        bytes: len,
                    }))
                } else {
                    Err(Error::peer_failed(
                        source,
                        format!("large message data: {}", reason()),
                    ))
                };
                sink.complete(token, r);
            }
            Op::WSend { token, dest } => {
                self.free_op(i);
                let r = if ev.err == 0 {
                    Ok(Completed::Done)
                } else {
                    Err(Error::peer_failed(
                        dest,
                        format!("write-rendezvous data: {}", reason()),
                    ))
                };
                sink.complete(token, r);
            }
            Op::Peek(_) | Op::Orphan | Op::Cancelled(_) | Op::Free | Op::WRecv { .. } => {
                if !self.absorb(&ev) {
                    tracing::debug!("ofi: completion for finished operation {i}");
                }
            }
        }
        Ok(())
    }
}

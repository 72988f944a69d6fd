//! Posting receives (matching the unexpected queue first), probes, and the receiver's side of
//! the rendezvous: a `CTS` asking for the data, or one RMA read of the sender's registered
//! buffer.

use super::buf::{Layout, RecvBuf};
use super::{
    recv_result, status, Kind, P2pState, Posted, RecvPhase, RecvReq, Req, Unexp, H_CTS, H_WCTS,
};
use crate::am::{AmState, Hdr, ReqId};
use crate::matching::PostedHandle;
use crate::provider::{Access, Completion, Provider, RawIovMut, RemoteAddr};
use crate::types::Rank;
use crate::{Error, ErrorKind, Result, Status};
use smallvec::SmallVec;

impl P2pState {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn irecv<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: RecvBuf,
        scope: u64,
    ) -> Result<Posted> {
        // A blocking receive in the slot was posted first: it takes its place in the matcher
        // before this one does.
        self.demote_slot();
        // A failed source can still have sent messages that arrived before it failed: they
        // match as usual; only a receive nothing can satisfy fails.
        let dead = match src {
            Some(s) if !am.alive(s) => am.check_peer(s).err(),
            _ => None,
        };
        if let Some(e) = dead {
            if e.kind() != ErrorKind::PeerFailed
                || self.iprobe_local(p, am, src, ctx, tag)?.is_none()
            {
                return Err(e);
            }
        }
        if am.caps.tagged {
            return self.native_recv(p, am, src, ctx, tag, buf, scope);
        }
        let unexpected = if self.matcher.unexpected_len() == 0 {
            None
        } else {
            self.matcher.take_unexpected(ctx, src, tag)
        };
        if let Some((msrc, mtag, m)) = unexpected {
            match m {
                Unexp::Eager { data, sreq } => {
                    let n = data.len().min(buf.cap);
                    buf.write(0, &data[..n]);
                    let st = status(msrc, mtag, data.len());
                    self.unexpected_bytes -= data.len();
                    self.eager_matched(am, msrc, data.len(), sreq);
                    am.recycle(data);
                    if !am.out.is_empty() {
                        self.flush(p, am)?;
                    }
                    return Ok(Posted::Done(recv_result(st, buf.cap)));
                }
                Unexp::Rts {
                    total,
                    sreq,
                    remote,
                } => {
                    let id = self.reqs.insert(Req::new(
                        scope,
                        Kind::Recv(RecvReq {
                            src,
                            buf,
                            phase: RecvPhase::Posted(PostedHandle::dangling()),
                        }),
                    ));
                    self.start_rndv(am, id, msrc, mtag, total, sreq, remote);
                    self.issue_reads(p, am);
                    self.flush(p, am)?;
                    return Ok(Posted::Pending(id));
                }
                Unexp::Spec { total, sreq } => {
                    return self.recv_staged(am, msrc, mtag, total, sreq, buf, scope);
                }
            }
        }
        let matcher = &mut self.matcher;
        let id = self.reqs.insert_with(|id| {
            let h = matcher.post(ctx, src, tag, id);
            Req::new(
                scope,
                Kind::Recv(RecvReq {
                    src,
                    buf,
                    phase: RecvPhase::Posted(h),
                }),
            )
        });
        Ok(Posted::Pending(id))
    }

    /// A receive matched a staged speculative message: take what arrived; if more is due, it
    /// goes straight into `buf` from now on.
    #[allow(clippy::too_many_arguments)]
    fn recv_staged(
        &mut self,
        am: &AmState,
        src: Rank,
        tag: i32,
        total: usize,
        sreq: u64,
        buf: RecvBuf,
        scope: u64,
    ) -> Result<Posted> {
        let Some(i) = self
            .spec_staged
            .iter()
            .position(|e| e.src == src && e.sreq == sreq)
        else {
            // Released when its sender failed before all of it arrived.
            if let Some(why) = am.peer_failure(src) {
                return Err(Error::peer_failed(src, why));
            }
            return Err(Error::malformed(src, "staged speculative message lost"));
        };
        let staged = self.spec_staged.swap_remove(i);
        self.spec_staged_bytes -= staged.total;
        let expect = total.min(buf.cap);
        let have = staged.data.len().min(expect);
        buf.write(0, &staged.data[..have]);
        let complete = staged.data.len() == total;
        self.staging_give(staged.data);
        if complete || have == expect {
            return Ok(Posted::Done(recv_result(status(src, tag, total), buf.cap)));
        }
        if let Some(why) = am.peer_failure(src) {
            return Err(Error::peer_failed(src, why));
        }
        let id = self.reqs.insert(Req::new(
            scope,
            Kind::Recv(RecvReq {
                src: Some(src),
                buf,
                phase: RecvPhase::Stream {
                    got: have,
                    expect,
                    total,
                    src,
                    tag,
                },
            }),
        ));
        self.spec_rx.push((src, sreq, id));
        Ok(Posted::Pending(id))
    }

    #[allow(clippy::too_many_arguments)]
    fn native_recv<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: RecvBuf,
        scope: u64,
    ) -> Result<Posted> {
        let mut pieces: SmallVec<[RawIovMut; 8]> = SmallVec::new();
        let count = match &buf.layout {
            Layout::Contig => 1,
            Layout::Typed(dt, c) => dt.iovecs(*c)?.len(),
        };
        let mut tmp = None;
        if count > am.caps.max_iov {
            let mut v = vec![0u8; buf.cap];
            pieces.push(RawIovMut {
                desc: 0,
                ptr: v.as_mut_ptr(),
                len: v.len(),
            });
            tmp = Some(v);
        } else {
            buf.pieces(buf.cap, &mut pieces);
        }
        let span = match &tmp {
            Some(v) => (v.as_ptr(), v.len()),
            None => buf.span(buf.cap),
        };
        let id = self
            .reqs
            .insert(Req::new(scope, Kind::NRecv { src, buf, tmp }));
        let posted = self
            .describe(p, am, id, span, Access::LOCAL_WRITE)
            .and_then(|d| {
                pieces.iter_mut().for_each(|x| x.desc = d);
                // SAFETY: the pieces point into the user's buffer (uniquely borrowed by the
                // request until it completes or is cancelled) or into the request-owned `tmp`
                // (a Vec whose heap storage does not move when the request moves).
                unsafe { p.tagged_recv(src, ctx, tag, &pieces, id) }
            });
        if let Err(e) = posted {
            self.forget(am, id);
            return Err(e);
        }
        Ok(Posted::Pending(id))
    }

    /// A matching message that has already arrived (no progress, no liveness check).
    pub(crate) fn iprobe_local<P: Provider>(
        &mut self,
        p: &mut P,
        am: &AmState,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<Status>> {
        if am.caps.tagged {
            return Ok(p
                .tagged_probe(src, ctx, tag)?
                .map(|t| status(t.source, t.tag, t.bytes)));
        }
        Ok(self
            .matcher
            .peek_unexpected(ctx, src, tag)
            .map(|(s, t, m)| {
                let bytes = match m {
                    Unexp::Eager { data, .. } => data.len(),
                    Unexp::Rts { total, .. } | Unexp::Spec { total, .. } => *total,
                };
                status(s, t, bytes)
            }))
    }

    /// Issue the RMA reads of matched rendezvous receives.
    pub(super) fn issue_reads<P: Provider>(&mut self, p: &mut P, am: &mut AmState) -> usize {
        let mut n = 0;
        let reads = std::mem::take(&mut self.reads);
        for id in reads {
            let Some(Req {
                kind:
                    Kind::Recv(RecvReq {
                        phase: RecvPhase::Reading { src, remote, .. },
                        ..
                    }),
                done: None,
                ..
            }) = self.reqs.get(id)
            else {
                continue;
            };
            let (src, remote) = (*src, *remote);
            if let Err(e) = am.touch(p, src) {
                self.complete(am, id, Err(e));
                continue;
            }
            let Some(Req {
                kind:
                    Kind::Recv(RecvReq {
                        buf,
                        phase: RecvPhase::Reading { len, issued, .. },
                        ..
                    }),
                ..
            }) = self.reqs.get_mut(id)
            else {
                continue;
            };
            *issued = true;
            let mut pieces: SmallVec<[RawIovMut; 8]> = SmallVec::new();
            buf.pieces(*len, &mut pieces);
            let span = buf.span(*len);
            match self.describe(p, am, id, span, Access::LOCAL_WRITE) {
                Ok(d) => pieces.iter_mut().for_each(|x| x.desc = d),
                Err(e) => {
                    self.complete(am, id, Err(e));
                    continue;
                }
            }
            // SAFETY: the receive request uniquely borrows the buffer until it completes, which
            // happens only when the provider reports this token (or the peer fails).
            if let Err(e) = unsafe { p.rma_read(src, &pieces, remote, Completion::cq(id)) } {
                // As a failed read: FIN releases the sender, the receive fails.
                self.complete(am, id, Err(e));
            }
            n += 1;
        }
        n
    }

    /// Register the buffers of receives waiting for a write rendezvous and send each sender
    /// its `WCTS`; a receive whose buffer cannot be registered asks for `DATA` with a `CTS`.
    pub(super) fn issue_wcts<P: Provider>(&mut self, p: &mut P, am: &mut AmState) -> usize {
        let mut n = 0;
        for (id, sreq) in std::mem::take(&mut self.wcts) {
            let Some(Req {
                kind:
                    Kind::Recv(RecvReq {
                        buf,
                        phase: RecvPhase::Stream { expect, src, .. },
                        ..
                    }),
                done: None,
                ..
            }) = self.reqs.get(id)
            else {
                continue;
            };
            let (base, len, src, shared) = (buf.base, *expect, *src, buf.shared);
            if let Err(e) = am.touch(p, src) {
                self.finish(id, Err(e));
                continue;
            }
            let writable = am.narrow(src).is_some_and(|n| n.rma_write && !n.rma_read);
            let reg = if self.rma_write && writable {
                let access = Access {
                    shared,
                    ..Access::WRITE.union(Access::LOCAL_WRITE)
                };
                // SAFETY: the receive request uniquely borrows `[base, base + len)` (`len` is
                // at most its capacity) until its result is given out or it is quarantined;
                // both revoke this registration first (`finish` parks the result until
                // `after_progress` has deregistered; `quarantine` deregisters), so no peer
                // writes there once the buffer is the user's again.
                unsafe { p.mr_register(base, len, access) }
            } else {
                Err(Error::invalid("write rendezvous off"))
            };
            let mut h;
            match reg {
                Ok(m) => {
                    h = Hdr::new(H_WCTS);
                    h.u64(sreq).u64(id).u64(len as u64).u64(m.addr).u64(m.key);
                    self.wkeys.insert(id, m);
                }
                Err(e) => {
                    if e.kind() == ErrorKind::Unsupported {
                        tracing::debug!("write rendezvous off from now on: {e}");
                        self.rma_write = false;
                    }
                    h = Hdr::new(H_CTS);
                    h.u64(sreq).u64(id).u64(len as u64);
                }
            }
            am.push_ctrl(src, h);
            n += 1;
        }
        n
    }

    /// Receive `id` matched a rendezvous message: read its data when the sender's buffer is
    /// registered and the receive fits one read, else ask for it with a `CTS`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_rndv(
        &mut self,
        am: &mut AmState,
        id: ReqId,
        src: Rank,
        tag: i32,
        total: usize,
        sreq: u64,
        remote: Option<RemoteAddr>,
    ) {
        let rma_read = self.rma_read && am.narrow(src).is_none_or(|n| n.rma_read);
        // The write rendezvous is for peers that can be written to but not read from (a
        // provider's choice, `PeerCaps`), e.g. verbs-rc's `WEFT_VERBS_RC_RNDV=write`.
        // Decided in `issue_wcts` once the peer's capabilities are known (it may not have
        // been touched yet).
        let rma_write = self.rma_write
            && am.caps.per_peer
            && remote.is_none()
            && am.narrow(src).is_none_or(|n| n.rma_write && !n.rma_read);
        let max_iov = am.caps.rma.map_or(0, |r| r.max_iov);
        let Some(Req {
            kind: Kind::Recv(r),
            ..
        }) = self.reqs.get_mut(id)
        else {
            return;
        };
        let len = total.min(r.buf.cap);
        let pieces = match &r.buf.layout {
            Layout::Contig => 1,
            Layout::Typed(dt, c) => dt.iovecs(*c).map_or(usize::MAX, |v| v.len()),
        };
        if let (Some(remote), true, true, true) = (remote, rma_read, pieces <= max_iov, len > 0) {
            r.phase = RecvPhase::Reading {
                len,
                total,
                src,
                tag,
                sreq,
                remote,
                issued: false,
            };
            self.reads.push(id);
            self.work = true;
            return;
        }
        r.phase = RecvPhase::Stream {
            got: 0,
            expect: len,
            total,
            src,
            tag,
        };
        if rma_write && len > 0 && matches!(r.buf.layout, Layout::Contig) {
            // Registered and announced by `issue_wcts`, which has the provider.
            self.wcts.push((id, sreq));
            self.work = true;
            return;
        }
        let cap = r.buf.cap;
        let mut h = Hdr::new(H_CTS);
        h.u64(sreq).u64(id).u64(len as u64);
        // A sender that registered for a read we will not do releases it on this CTS.
        am.push_ctrl(src, h);
        if len == 0 {
            self.finish(id, recv_result(status(src, tag, total), cap));
        }
    }
}

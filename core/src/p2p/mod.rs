//! Two-sided communication: tagged send and receive with MPI matching, on active messages
//! (MPICH CH4's MPIDIG) or handed to a provider's native tagged messaging when it has one.
//!
//! Protocols on active messages:
//! * **eager** — payload up to the eager limit travels with the header; unexpected eager data
//!   is copied into the unexpected queue, bounded per peer by credits (`WEFT_EAGER_WINDOW`).
//!   `ssend` adds a sync flag and the receiver acknowledges the match (`SACK`).
//! * **rendezvous** — `RTS` (size, sender request id, and the sender buffer's key when the
//!   provider can do RMA reads). On a match the receiver either pulls the data with one RMA read
//!   straight into its buffer and answers `FIN`, or answers `CTS` and the sender streams `DATA`
//!   chunks of at most the provider's payload limit, flow-controlled by the provider (`Busy`).
//! * **write rendezvous** — towards a peer whose provider offers RMA writes but not reads
//!   (`PeerCaps`, e.g. verbs-rc's `WEFT_VERBS_RC_RNDV=write`, Aptus' RC-RDMA): the receiver
//!   registers its contiguous buffer for the peer's writes and answers `WCTS` with its key; the
//!   sender RMA-writes the data there and, once the write completed (delivery complete),
//!   sends `WFIN`. The key is revoked before the receive's result is given out (or when it is
//!   quarantined), so a late or stray write is refused. A sender that cannot write (a typed
//!   buffer of more pieces than one write takes) streams `DATA` into the same receive.
//! * **speculative rendezvous** (up to `WEFT_SPEC_LIMIT`, on by default where a round trip is a
//!   network's) — `SPEC` announces the message like `RTS` and carries its first chunk; `SDATA`
//!   chunks (keyed by the sender's request) follow without waiting for a `CTS`. A receiver that
//!   has the receive posted places them and answers `SACK`. One that has not stages the data
//!   (and answers `SACK`) while the staged total stays within `WEFT_SPEC_BUFFER`; beyond it, it
//!   keeps only the announcement (as an unexpected `RTS`), drops the data and answers `CTS`
//!   when a receive matches, so unexpected data stays bounded. The send completes when all its
//!   data is written and `SACK` came, or when the `CTS` stream finished. `ssend` never
//!   speculates (a staged message is acknowledged before it matches).
//!
//! Files: [`buf`] (buffers and copies), `send.rs` (posting sends, streaming data, eager
//! credits), `recv.rs` (posting receives, probes, RMA-read rendezvous), `handlers.rs` (the
//! eager and rendezvous messages), `spec.rs` (speculative rendezvous and direct placement).
//!
//! Everything here takes the active-message layer ([`AmState`]) as an argument: handlers queue
//! what they send in its outbox and report protocol errors to it; nothing here knows RMA.
//!
//! Size (over 800 lines): the request table and every step of a request's life — completion, zero-
//! copy pieces in flight, quarantine, peer failure, native dispatch — keep one set of invariants
//! about who may still touch a buffer; the protocols themselves are in send.rs, recv.rs,
//! handlers.rs and spec.rs.

pub(crate) mod buf;
mod handlers;
mod recv;
mod send;
mod slot;
mod spec;

pub(crate) use buf::{Layout, RecvBuf, SendBuf};
pub(crate) use send::Lean;
pub(crate) use slot::{Leaf, Slot};

use crate::am::mr_cache::MrRef;
use crate::am::outbox::Deferred;
use crate::am::{self, AmState, Hdr, Rd, ReqId, Slab};
use crate::matching::{Matcher, PostedHandle};
use crate::provider::{Access, Completed, MemRegion, MrDesc, Provider, RemoteAddr, SendOutcome};
use crate::types::Rank;
use crate::{Error, ErrorDetail, Result, Status};

// Handler ids, within `am::P2P_IDS`.
const H_EAGER: u8 = am::P2P_IDS.start;
const H_RTS: u8 = H_EAGER + 1;
const H_CTS: u8 = H_EAGER + 2;
const H_DATA: u8 = H_EAGER + 3;
const H_FIN: u8 = H_EAGER + 4;
const H_SACK: u8 = H_EAGER + 5;
const H_SPEC: u8 = H_EAGER + 6;
const H_SDATA: u8 = H_EAGER + 7;
const H_CREDIT: u8 = H_EAGER + 8;
const H_WCTS: u8 = H_EAGER + 9;
const H_WFIN: u8 = H_EAGER + 10;
const _: () = assert!(H_WFIN < am::P2P_IDS.end);

/// `WFIN` length of a write that failed: the receive fails instead of waiting.
const WFIN_FAILED: u64 = u64::MAX;

const F_SYNC: u8 = 1;
const F_REMOTE: u8 = 2;

/// Length of an `EAGER` header without the synchronous send's request: kind, flags, context,
/// tag.
const PLAIN_EAGER_LEN: usize = 10;

/// The start of every `EAGER` header: kind, flags, context, tag (`PLAIN_EAGER_LEN` bytes; the
/// lean arrival path, `P2pState::on_plain_eager`, reads this layout directly). A synchronous
/// send appends its request.
#[inline]
fn eager_hdr(flags: u8, ctx: u32, tag: i32) -> Hdr {
    let mut h = Hdr::new(H_EAGER);
    h.u8(flags).u32(ctx).u32(tag as u32);
    h
}

/// The plain `EAGER` header (flags 0) as bytes, for the lean send: the layout of
/// [`eager_hdr`] without building a [`Hdr`].
#[inline(always)]
fn plain_eager_bytes(ctx: u32, tag: i32) -> [u8; PLAIN_EAGER_LEN] {
    let (c, t) = (ctx.to_le_bytes(), (tag as u32).to_le_bytes());
    [H_EAGER, 0, c[0], c[1], c[2], c[3], t[0], t[1], t[2], t[3]]
}

/// The inverse of [`plain_eager_bytes`]: `(ctx, tag)` of a plain `EAGER` header, `None` for any
/// other header (the two lean arrival paths read it this way).
#[inline(always)]
fn parse_plain_eager(header: &[u8]) -> Option<(u32, i32)> {
    let h = <&[u8; PLAIN_EAGER_LEN]>::try_from(header).ok()?;
    if h[0] != H_EAGER || h[1] != 0 {
        return None;
    }
    let ctx = u32::from_le_bytes([h[2], h[3], h[4], h[5]]);
    let tag = u32::from_le_bytes([h[6], h[7], h[8], h[9]]) as i32;
    Some((ctx, tag))
}

/// Bytes an eager message counts against its peer's window besides its payload: the share of
/// an unexpected-queue entry and its header.
const EAGER_OVERHEAD: usize = 64;

/// The exact header length of message `kind` whose second byte is `flags` (for the kinds that
/// have a flags byte), or `None` for a kind that is not ours. Every handler's fields are
/// fixed, so a header of any other length is a protocol error, caught before anything is done.
#[inline]
pub(crate) fn header_len(kind: u8, flags: Option<u8>) -> Option<usize> {
    Some(match kind {
        H_EAGER => PLAIN_EAGER_LEN + if flags? & F_SYNC != 0 { 8 } else { 0 },
        H_RTS => 26 + if flags? & F_REMOTE != 0 { 16 } else { 0 },
        H_CTS => 25,
        H_WCTS => 41,
        H_DATA | H_SDATA | H_WFIN => 17,
        H_FIN | H_SACK | H_CREDIT => 9,
        H_SPEC => 26,
        _ => return None,
    })
}

#[derive(Debug)]
enum SendPhase {
    Queued,
    WaitAck,
    WaitCts,
    Stream {
        rreq: u64,
        off: usize,
        len: usize,
    },
    WaitFin,
    /// Write rendezvous: the receiver's `WCTS` gave its registered buffer; `len` bytes go
    /// there by one RMA write (`issued` once posted), then `WFIN` tells it.
    Writing {
        rreq: u64,
        len: usize,
        remote: RemoteAddr,
        issued: bool,
    },
    /// Speculative rendezvous: `off` bytes written (the `SPEC` frame is in the outbox while
    /// 0); `acked` once the receiver's `SACK` says its receive matched.
    Spec {
        off: usize,
        acked: bool,
    },
}

/// How a rendezvous send buffer is registered for the receiver's read.
#[derive(Debug)]
pub(crate) enum SendMr {
    /// For this send alone (deregistered when it no longer needs to be readable).
    Own(Box<MemRegion>),
    /// Through the registration cache (providers whose registration is costly:
    /// `Caps::mr_local` or `Caps::mr_pins`).
    Cached(MrRef),
}

#[derive(Debug)]
struct SendReq {
    dest: Rank,
    ctx: u32,
    tag: i32,
    buf: SendBuf,
    /// Bit 31: a synchronous send. Bits 0..31: zero-copy pieces (`am_isend`) the provider
    /// has not reported complete; until they are, it may still read the buffer, so the request
    /// cannot end (its result waits in `P2pState::parked`). One word, so that a request stays
    /// within the 128 bytes the compiler moves without a `memcpy` call.
    flags: u32,
    phase: SendPhase,
    /// Registration of the send buffer for a receiver-side RMA read (rare: boxed, to keep
    /// requests small).
    mr: Option<Box<SendMr>>,
}

impl SendReq {
    const SYNC: u32 = 1 << 31;

    #[inline]
    fn sync(&self) -> bool {
        self.flags & Self::SYNC != 0
    }

    #[inline]
    fn inflight(&self) -> u32 {
        self.flags & !Self::SYNC
    }
}

#[derive(Debug)]
enum RecvPhase {
    Posted(PostedHandle),
    Stream {
        got: usize,
        expect: usize,
        total: usize,
        src: Rank,
        tag: i32,
    },
    Reading {
        len: usize,
        total: usize,
        src: Rank,
        tag: i32,
        sreq: u64,
        remote: RemoteAddr,
        issued: bool,
    },
}

#[derive(Debug)]
struct RecvReq {
    src: Option<Rank>,
    buf: RecvBuf,
    phase: RecvPhase,
}

#[derive(Debug)]
enum Kind {
    Send(SendReq),
    Recv(RecvReq),
    /// A send handed to the provider's native tagged messaging (`tmp` holds packed data).
    NSend {
        dest: Rank,
        _tmp: Option<Vec<u8>>,
    },
    /// A receive handed to the provider (`tmp` receives packed data to unpack at the end).
    NRecv {
        src: Option<Rank>,
        buf: RecvBuf,
        tmp: Option<Vec<u8>>,
    },
}

#[derive(Debug)]
struct Req {
    scope: u64,
    done: Option<Result<Status>>,
    kind: Kind,
}

impl Req {
    fn new(scope: u64, kind: Kind) -> Self {
        Req {
            scope,
            done: None,
            kind,
        }
    }
}

/// What an unexpected message carries.
enum Unexp {
    Eager {
        data: Vec<u8>,
        sreq: Option<u64>,
    },
    Rts {
        total: usize,
        sreq: u64,
        remote: Option<RemoteAddr>,
    },
    /// A speculative message being staged (its data is in `P2pState::spec_staged`).
    Spec {
        total: usize,
        sreq: u64,
    },
}

/// An unexpected speculative message's data, as far as it has arrived.
struct Staged {
    src: Rank,
    sreq: u64,
    total: usize,
    data: Vec<u8>,
}

/// Result of posting an operation.
#[derive(Debug)]
pub(crate) enum Posted {
    /// Finished during the call (e.g. an eager send the provider took).
    Done(Result<Status>),
    Pending(ReqId),
}

/// Settings of the two-sided protocols (from `EngineConfig` and the provider's capabilities).
pub(crate) struct P2pConfig {
    pub eager_limit: usize,
    pub spec_limit: usize,
    pub spec_behind: bool,
    pub spec_buffer: usize,
    pub eager_window: usize,
    pub nt_copy_min: usize,
    pub rma_read: bool,
    pub rma_write: bool,
}

/// State of the two-sided protocols.
pub(crate) struct P2pState {
    eager_limit: usize,
    /// Rendezvous sends up to this size go speculatively (0: never).
    spec_limit: usize,
    /// Speculate behind other data to the same peer too (`EngineConfig::spec_behind`).
    spec_behind: bool,
    /// Speculative messages this rank matched whose data is still arriving: (source, sender's
    /// request, receive).
    spec_rx: Vec<(Rank, u64, ReqId)>,
    /// Unexpected speculative messages held for a receive (at most `spec_buffer` bytes of
    /// announced length in all); the unexpected queue has a `Unexp::Spec` for each.
    spec_staged: Vec<Staged>,
    pub(crate) spec_staged_bytes: usize,
    /// Buffers of received staged messages, for the next ones (`staging_buf`).
    staging_spare: Vec<Vec<u8>>,
    spec_buffer: usize,
    /// Eager flow control (see `EngineConfig::eager_window`): bytes sent to each peer and not
    /// yet credited back, and bytes received from each peer, matched, not yet credited.
    eager_window: usize,
    eager_out: Vec<usize>,
    eager_in: Vec<usize>,
    /// Bytes of eager payload waiting in the unexpected queue (diagnostics).
    pub(crate) unexpected_bytes: usize,
    nt_copy_min: usize,
    /// Rendezvous by a receiver-side RMA read of the registered send buffer.
    rma_read: bool,
    /// Rendezvous by a sender-side RMA write into the registered receive buffer, towards peers
    /// that cannot be read from but can be written to ([`crate::provider::PeerCaps`]).
    rma_write: bool,
    reqs: Slab<Req>,
    matcher: Matcher<ReqId, Unexp>,
    /// Sends with data to stream (`DATA` after a `CTS`, `SDATA` of speculative ones).
    streams: Vec<ReqId>,
    /// Receives whose RMA read is to be issued.
    reads: Vec<ReqId>,
    /// Sends whose RMA write (write rendezvous) is to be issued.
    writes: Vec<ReqId>,
    /// Receives matched to a write rendezvous whose buffer is to be registered and announced
    /// (`WCTS`), with the sender's request.
    wcts: Vec<(ReqId, u64)>,
    /// Receive buffers registered for a sender's RMA write, by receive. A peer holds the key,
    /// so the registration is revoked before the receive's result is given out: `finish`
    /// parks such results in `wdone` until `after_progress` has deregistered.
    wkeys: hashbrown::HashMap<ReqId, MemRegion>,
    wdone: Vec<(ReqId, Result<Status>)>,
    /// Registrations to release once `progress` returns.
    deregs: Vec<SendMr>,
    /// Something may be in `streams`, `reads`, `writes`, `wcts`, `wdone` or `deregs`: set by
    /// every push, recomputed when `flush` and `after_progress` have worked them off. The
    /// engine's progress round tests this one word instead of six lists (debug builds check
    /// that it never says "nothing" while a list holds something).
    work: bool,
    /// Results of sends finished while zero-copy pieces were still in flight (rare).
    parked: hashbrown::HashMap<ReqId, Result<Status>>,
    /// Registrations describing request buffers to a provider that needs local descriptors
    /// (`Caps::mr_local`), released when the request is removed. Kept beside the requests, not
    /// in them, so that requests stay small for every other provider.
    locals: hashbrown::HashMap<ReqId, (MrDesc, MrRef)>,
    /// A blocking receive posted without a request (slot.rs), and how many completed there
    /// and how many became requests.
    slot: slot::Slot,
    slot_done: u64,
    slot_demoted: u64,
}

#[inline]
fn status(source: Rank, tag: i32, bytes: usize) -> Status {
    Status {
        source,
        tag,
        bytes,
        cancelled: false,
    }
}

#[inline]
fn recv_result(st: Status, cap: usize) -> Result<Status> {
    if st.bytes > cap {
        Err(Error::from(ErrorDetail::Truncated {
            status: st,
            capacity: cap,
        }))
    } else {
        Ok(st)
    }
}

fn cancelled_status() -> Status {
    Status {
        source: 0,
        tag: 0,
        bytes: 0,
        cancelled: true,
    }
}

impl P2pState {
    pub(crate) fn new(size: u32, cfg: P2pConfig) -> Self {
        P2pState {
            eager_limit: cfg.eager_limit,
            spec_limit: cfg.spec_limit,
            spec_behind: cfg.spec_behind,
            spec_rx: Vec::new(),
            spec_staged: Vec::new(),
            spec_staged_bytes: 0,
            staging_spare: Vec::new(),
            spec_buffer: cfg.spec_buffer,
            eager_window: cfg.eager_window.max(2 * (cfg.eager_limit + EAGER_OVERHEAD)),
            eager_out: vec![0; size as usize],
            eager_in: vec![0; size as usize],
            unexpected_bytes: 0,
            nt_copy_min: cfg.nt_copy_min,
            rma_read: cfg.rma_read,
            rma_write: cfg.rma_write,
            reqs: Slab::default(),
            matcher: Matcher::new(),
            streams: Vec::new(),
            reads: Vec::new(),
            writes: Vec::new(),
            wcts: Vec::new(),
            wkeys: Default::default(),
            wdone: Vec::new(),
            deregs: Vec::new(),
            work: false,
            parked: Default::default(),
            locals: Default::default(),
            slot: slot::Slot::Idle,
            slot_done: 0,
            slot_demoted: 0,
        }
    }

    /// Number of live requests.
    #[inline]
    pub(crate) fn live(&self) -> usize {
        self.reqs.live()
    }

    /// No rendezvous data left to stream.
    #[inline]
    pub(crate) fn streams_idle(&self) -> bool {
        self.streams.is_empty()
    }

    /// Work for `after_progress`: streams to pump, reads to issue, registrations to release.
    #[inline]
    pub(crate) fn has_work(&self) -> bool {
        debug_assert!(
            self.work || !self.lists_hold_work(),
            "a p2p work list was filled without setting `work`"
        );
        self.work
    }

    /// Whether any work list holds something (what `work` stands for).
    fn lists_hold_work(&self) -> bool {
        !self.streams.is_empty()
            || !self.reads.is_empty()
            || !self.deregs.is_empty()
            || !self.writes.is_empty()
            || !self.wcts.is_empty()
            || !self.wdone.is_empty()
    }

    /// Send queued messages (the outbox, in per-destination order) and stream rendezvous data.
    pub(crate) fn flush<P: Provider>(&mut self, p: &mut P, am: &mut AmState) -> Result<usize> {
        let mut sent = am.flush(p, self);
        let r = self.pump_streams(p, am);
        self.work = self.lists_hold_work();
        sent += r?;
        Ok(sent)
    }

    /// After the provider's `progress`: issue RMA reads and writes, release registrations no
    /// longer needed, and finish the receives whose write key is now revoked.
    pub(crate) fn after_progress<P: Provider>(&mut self, p: &mut P, am: &mut AmState) -> usize {
        let mut n = 0;
        if !self.reads.is_empty() {
            n += self.issue_reads(p, am);
        }
        if !self.writes.is_empty() {
            n += self.issue_writes(p, am);
        }
        if !self.wcts.is_empty() && self.issue_wcts(p, am) > 0 {
            n += am.flush(p, self);
        }
        while let Some((id, res)) = self.wdone.pop() {
            self.revoke_wkey(p, id);
            self.finish(id, res);
            n += 1;
        }
        while let Some(m) = self.deregs.pop() {
            match m {
                SendMr::Own(m) => {
                    if let Err(e) = p.mr_deregister(&m) {
                        tracing::warn!("deregistration failed: {e}");
                    }
                }
                SendMr::Cached(r) => am.mr.release(r),
            }
        }
        self.work = self.lists_hold_work();
        n
    }

    // -------------------------------------------------------------------------- completion

    /// The result of a finished request, freeing it; `None` if still running.
    #[inline]
    pub(crate) fn try_take(&mut self, am: &mut AmState, id: ReqId) -> Option<Result<Status>> {
        // Still running (the first look of every wait): answered without a call.
        if let Some(Req { done: None, .. }) = self.reqs.get(id) {
            return None;
        }
        self.take_done(am, id)
    }

    #[inline(never)]
    fn take_done(&mut self, am: &mut AmState, id: ReqId) -> Option<Result<Status>> {
        match self.reqs.get_mut(id) {
            Some(Req {
                done: d @ Some(_), ..
            }) => {
                let r = d.take();
                self.forget(am, id);
                r
            }
            Some(_) => None,
            None => Some(Err(Error::invalid("request already completed"))),
        }
    }

    /// Drop request `id` where it lies (as [`Self::remove`], without handing it back).
    #[inline]
    fn forget(&mut self, am: &mut AmState, id: ReqId) {
        if self.reqs.discard(id) {
            self.release_side(am, id);
        }
    }

    /// What lives beside request `id` (its local registration, a parked result) goes with it.
    #[inline]
    fn release_side(&mut self, am: &mut AmState, id: ReqId) {
        if !self.locals.is_empty() || !self.parked.is_empty() {
            self.release_side_maps(am, id);
        }
    }

    #[cold]
    #[inline(never)]
    fn release_side_maps(&mut self, am: &mut AmState, id: ReqId) {
        if let Some((_, m)) = self.locals.remove(&id) {
            am.mr.release(m);
        }
        self.parked.remove(&id);
    }

    /// Remove request `id`, releasing the registration that described its buffer.
    #[inline]
    fn remove(&mut self, am: &mut AmState, id: ReqId) -> Option<Req> {
        let r = self.reqs.remove(id)?;
        self.release_side(am, id);
        Some(r)
    }

    /// The local descriptor of request `id`'s buffer `[ptr, ptr + len)` for a provider that
    /// needs one (registered through the cache on first use, kept until the request is
    /// removed); 0 for other providers.
    fn describe<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        id: ReqId,
        (ptr, len): (*const u8, usize),
        access: Access,
    ) -> Result<MrDesc> {
        if !am.caps.mr_local {
            return Ok(0);
        }
        if self.reqs.get(id).is_none() {
            return Ok(0);
        }
        if let Some((d, _)) = self.locals.get(&id) {
            return Ok(*d);
        }
        let (d, m) = am.mr.acquire(p, ptr, len, access)?;
        self.locals.insert(id, (d, m));
        Ok(d)
    }

    /// Deregister receive `id`'s buffer from the write rendezvous, if it is registered: no peer
    /// can write there afterwards.
    fn revoke_wkey<P: Provider>(&mut self, p: &mut P, id: ReqId) {
        if let Some(m) = self.wkeys.remove(&id) {
            if let Err(e) = p.mr_deregister(&m) {
                tracing::warn!("deregistration of a receive buffer failed: {e}");
            }
        }
    }

    #[inline]
    pub(crate) fn is_done(&self, id: ReqId) -> bool {
        !matches!(self.reqs.get(id), Some(Req { done: None, .. }))
    }

    /// Mark a request finished with `res`.
    #[inline]
    ///
    /// A send whose zero-copy pieces are still in flight keeps its result until the provider
    /// has reported them all: the buffer stays borrowed until then.
    fn finish(&mut self, id: ReqId, res: Result<Status>) {
        if !self.wkeys.is_empty() && self.wkeys.contains_key(&id) {
            // A peer may still write here: not until the key is revoked.
            self.wdone.push((id, res));
            self.work = true;
            return;
        }
        if let Some(r) = self.reqs.get_mut(id) {
            if r.done.is_some() {
                return;
            }
            if let Kind::Send(s) = &r.kind {
                if s.inflight() > 0 {
                    self.parked.entry(id).or_insert(res);
                    return;
                }
            }
            r.done = Some(res);
        }
    }

    /// Live requests of `scope`, and for each whether it is a receive.
    pub(crate) fn scope_requests(&self, scope: u64) -> Vec<(ReqId, bool)> {
        self.reqs
            .ids()
            .into_iter()
            .filter_map(|id| {
                let r = self.reqs.get(id)?;
                (r.scope == scope)
                    .then_some((id, matches!(r.kind, Kind::Recv(_) | Kind::NRecv { .. })))
            })
            .collect()
    }

    /// Cancel a receive that has not matched (MPI_Cancel). A send, or a receive that already
    /// matched, is left to complete normally.
    pub(crate) fn cancel<P: Provider>(&mut self, p: &mut P, id: ReqId) -> Result<()> {
        let Some(req) = self.reqs.get_mut(id) else {
            return Ok(());
        };
        if req.done.is_some() {
            return Ok(());
        }
        match &req.kind {
            Kind::Recv(RecvReq {
                phase: RecvPhase::Posted(h),
                ..
            }) => {
                let h = *h;
                if self.matcher.cancel(h).is_some() {
                    self.finish(id, Ok(cancelled_status()));
                }
                Ok(())
            }
            Kind::NRecv { .. } => {
                if p.tagged_cancel(id)? {
                    self.finish(id, Ok(cancelled_status()));
                }
                Ok(())
            }
            Kind::Recv(_) => Ok(()),
            _ => Err(Error::invalid("only receives can be cancelled")),
        }
    }

    /// Give up request `id` (see `Engine::quarantine`): drop it so that nothing touches its
    /// buffer any more. `Err(what)` when the provider holds a pointer into the buffer that it
    /// cannot hand back, and only ending the process is safe.
    pub(crate) fn quarantine<P: Provider>(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        id: ReqId,
    ) -> std::result::Result<(), &'static str> {
        let held = match self.reqs.get(id) {
            None => return Ok(()),
            Some(Req { done: Some(_), .. }) => {
                self.forget(am, id);
                return Ok(());
            }
            Some(Req { kind, .. }) => match kind {
                Kind::NSend { .. } => Some("a send whose buffer the provider may still read"),
                Kind::Send(s) if s.inflight() > 0 => {
                    Some("a send whose zero-copy data the provider may still read")
                }

                Kind::NRecv { .. } => match p.tagged_cancel(id) {
                    Ok(true) => None,
                    _ => Some("a matched receive the provider may still write into"),
                },
                Kind::Recv(RecvReq {
                    phase: RecvPhase::Reading { issued: true, .. },
                    ..
                }) => Some("an RMA read the provider is still performing into a receive buffer"),
                _ => None,
            },
        };
        if let Some(what) = held {
            return Err(what);
        }
        // A receive registered for the sender's write: revoke the key before the buffer goes.
        self.revoke_wkey(p, id);
        let Some(req) = self.remove(am, id) else {
            return Ok(());
        };
        match req.kind {
            Kind::Recv(r) => match r.phase {
                RecvPhase::Posted(h) => {
                    self.matcher.cancel(h);
                }
                RecvPhase::Stream { .. } => self.spec_done(id),
                RecvPhase::Reading { .. } => {}
            },
            Kind::Send(s) => {
                // The receiver may hold the key for a read: revoke it now.
                match s.mr.map(|b| *b) {
                    Some(SendMr::Own(m)) => {
                        if let Err(e) = p.mr_deregister(&m) {
                            tracing::warn!("deregistration failed: {e}");
                        }
                    }
                    Some(SendMr::Cached(r)) => {
                        am.mr.revoke(r);
                        am.mr.reap(p);
                    }
                    None => {}
                }
            }
            Kind::NSend { .. } | Kind::NRecv { .. } => {}
        }
        am.note_quarantined(id);
        Ok(())
    }

    /// A provider completion for request `token` (native sends and receives, RMA reads).
    pub(crate) fn complete(&mut self, am: &mut AmState, token: u64, result: Result<Completed>) {
        let Some(req) = self.reqs.get_mut(token) else {
            tracing::warn!(token, "completion for an unknown operation");
            return;
        };
        match &mut req.kind {
            Kind::Send(s) if matches!(s.phase, SendPhase::Writing { issued: true, .. }) => {
                let SendPhase::Writing { rreq, len, .. } = s.phase else {
                    return;
                };
                // The write counted as a piece in flight (the buffer stays borrowed until now).
                s.flags -= 1;
                let (dest, tag, total) = (s.dest, s.tag, s.buf.len);
                let mut f = Hdr::new(H_WFIN);
                f.u64(rreq);
                let mut res = match result {
                    Ok(_) => {
                        f.u64(len as u64);
                        Ok(status(dest, tag, total))
                    }
                    Err(e) => {
                        f.u64(WFIN_FAILED);
                        Err(e)
                    }
                };
                am.push_ctrl(dest, f);
                // Failed meanwhile (its peer): that result stands.
                if let Some(r) = self.parked.remove(&token) {
                    res = r;
                }
                self.finish(token, res);
            }
            Kind::Send(s) if s.inflight() > 0 => {
                s.flags -= 1;
                let dest = s.dest;
                if let Err(e) = result {
                    // A piece of the message is lost: the receiver would wait for it forever.
                    self.parked.insert(token, Err(e.clone()));
                    am.fail_peer(dest, &crate::am::outbox::failure_reason(&e));
                }
                if s.inflight() == 0 {
                    if let Some(res) = self.parked.remove(&token) {
                        req.done = Some(res);
                    }
                }
            }
            Kind::NSend { dest, .. } => {
                let d = *dest;
                self.finish(token, result.map(|_| status(d, 0, 0)));
            }
            Kind::NRecv { buf, tmp, .. } => {
                let res = match result {
                    Ok(Completed::Received(ts)) => {
                        let cap = buf.cap;
                        if let Some(t) = tmp.take() {
                            let n = ts.bytes.min(cap);
                            buf.write(0, &t[..n]);
                        }
                        recv_result(status(ts.source, ts.tag, ts.bytes), cap)
                    }
                    Ok(Completed::Cancelled) => Ok(cancelled_status()),
                    Ok(Completed::Done) => Err(Error::invalid(
                        "provider completed a receive without a status",
                    )),
                    Err(e) => Err(e),
                };
                self.finish(token, res);
            }
            Kind::Recv(RecvReq {
                phase:
                    RecvPhase::Reading {
                        total,
                        src,
                        tag,
                        sreq,
                        ..
                    },
                buf,
                ..
            }) => {
                let (total, src, tag, sreq, cap) = (*total, *src, *tag, *sreq, buf.cap);
                let mut f = Hdr::new(H_FIN);
                f.u64(sreq);
                am.push_ctrl(src, f);
                let res = match result {
                    Ok(_) => recv_result(status(src, tag, total), cap),
                    Err(e) => Err(e),
                };
                self.finish(token, res);
            }
            _ => tracing::warn!(token, "unexpected completion"),
        }
    }

    /// An active message of ours (`kind` in `am::P2P_IDS`, header length already checked);
    /// `None` if its fields do not parse.
    #[inline]
    pub(crate) fn on_am(
        &mut self,
        am: &mut AmState,
        src: Rank,
        kind: u8,
        rd: &mut Rd<'_>,
        payload: &[u8],
    ) -> Option<()> {
        match kind {
            H_EAGER => self.on_eager(am, src, rd, payload),
            H_RTS => self.on_rts(am, src, rd),
            H_CTS => self.on_cts(am, src, rd),
            H_DATA => self.on_data(am, src, rd, payload),
            H_FIN => self.on_fin(am, src, rd),
            H_SACK => self.on_sack(am, src, rd),
            H_SPEC => self.on_spec(am, src, rd, payload),
            H_SDATA => self.on_sdata(am, src, rd, payload),
            H_CREDIT => self.on_credit(am, src, rd),
            H_WCTS => self.on_wcts(am, src, rd),
            H_WFIN => self.on_wfin(am, src, rd),
            _ => None,
        }
    }

    /// `rank` failed (noted in `am`): every request that depends on it fails, and what is held
    /// for it is released.
    pub(crate) fn peer_failed(&mut self, am: &AmState, rank: Rank) {
        // A blocking receive in the slot is failed (or not) by the rules below, as a request.
        self.demote_slot();
        let reason = am.peer_failure(rank).unwrap_or("failed");
        self.spec_rx.retain(|e| e.0 != rank);
        // Speculative data staged from it that will never be complete: release it and its
        // share of WEFT_SPEC_BUFFER (a complete message stays: it can still be received).
        let mut freed = 0;
        self.spec_staged.retain(|e| {
            let keep = e.src != rank || e.data.len() == e.total;
            if !keep {
                freed += e.total;
            }
            keep
        });
        self.spec_staged_bytes -= freed;
        self.eager_out[rank as usize] = 0;
        self.eager_in[rank as usize] = 0;
        let all_others_gone = am.nfailed + 1 >= am.size;
        let err = || Error::peer_failed(rank, reason);
        let mut affected = 0usize;
        for id in self.reqs.ids() {
            let Some(req) = self.reqs.get_mut(id) else {
                continue;
            };
            if req.done.is_some() {
                continue;
            }
            let hit = match &req.kind {
                Kind::Send(s) => s.dest == rank,
                Kind::NSend { dest, .. } => *dest == rank,
                Kind::Recv(r) => match &r.phase {
                    RecvPhase::Posted(_) => {
                        r.src == Some(rank) || (r.src.is_none() && all_others_gone)
                    }
                    RecvPhase::Stream { src, .. } | RecvPhase::Reading { src, .. } => *src == rank,
                },
                Kind::NRecv { src, .. } => *src == Some(rank) || (src.is_none() && all_others_gone),
            };
            if !hit {
                continue;
            }
            match &mut req.kind {
                Kind::Recv(RecvReq {
                    phase: RecvPhase::Posted(h),
                    ..
                }) => {
                    let h = *h;
                    self.matcher.cancel(h);
                }
                Kind::Send(s) => {
                    if let Some(m) = s.mr.take() {
                        self.deregs.push(*m);
                        self.work = true;
                    }
                }
                _ => {}
            }
            self.finish(id, Err(err()));
            affected += 1;
        }
        // A peer that leaves while nothing waits for it has most likely finished normally.
        if affected > 0 && !am.closing {
            tracing::warn!(rank, affected, "peer failed: {reason}");
        } else {
            tracing::debug!(rank, "peer gone: {reason}");
        }
    }

    // ------------------------------------------------------------------------------ helpers

    #[inline]
    fn set_send_phase(&mut self, id: ReqId, phase: SendPhase) {
        if let Some(Req {
            kind: Kind::Send(s),
            ..
        }) = self.reqs.get_mut(id)
        {
            s.phase = phase;
        }
    }

    /// A send request in `phase`, owned by `scope`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn new_send(
        &mut self,
        scope: u64,
        dest: Rank,
        ctx: u32,
        tag: i32,
        buf: SendBuf,
        sync: bool,
        phase: SendPhase,
        mr: Option<SendMr>,
    ) -> ReqId {
        self.reqs.insert(Req::new(
            scope,
            Kind::Send(SendReq {
                dest,
                ctx,
                tag,
                buf,
                flags: if sync { SendReq::SYNC } else { 0 },
                phase,
                mr: mr.map(Box::new),
            }),
        ))
    }

    /// Nothing is queued or streaming to `dest`: data sent now leaves at once.
    #[inline]
    fn idle(&self, am: &AmState, dest: Rank) -> bool {
        am.out.is_empty_to(dest)
            && !self.streams.iter().any(|&id| {
                matches!(self.reqs.get(id), Some(Req { kind: Kind::Send(s), .. }) if s.dest == dest)
            })
    }
}

impl<P: Provider> Deferred<P> for P2pState {
    /// A queued eager send, or the first frame of a speculative one.
    fn send_deferred(
        &mut self,
        p: &mut P,
        am: &mut AmState,
        dest: Rank,
        id: ReqId,
    ) -> Result<SendOutcome> {
        match self.reqs.get(id) {
            Some(Req {
                kind: Kind::Send(r),
                done: None,
                ..
            }) => match r.phase {
                SendPhase::Spec { .. } => self.send_spec_head(p, am, id),
                _ => self.send_queued_eager(p, am, id),
            },
            // Failed or cancelled meanwhile: nothing to send.
            _ => {
                let _ = dest;
                Ok(SendOutcome::Sent)
            }
        }
    }

    fn deferred_failed(&mut self, id: ReqId, e: Error) {
        self.finish(id, Err(e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lean send writes the plain header without the builder; the receiver's lean and
    /// general paths both read the builder's layout, so the two must agree byte for byte.
    #[test]
    fn the_lean_send_header_is_the_plain_eager_header() {
        for (ctx, tag) in [
            (0, 0),
            (1, 7),
            (u32::MAX, i32::MAX),
            (0x0102_0304, 0x0a0b_0c0d),
        ] {
            let h = eager_hdr(0, ctx, tag);
            assert_eq!(h.bytes(), &plain_eager_bytes(ctx, tag)[..]);
            assert_eq!(header_len(H_EAGER, Some(0)), Some(PLAIN_EAGER_LEN));
        }
    }
}

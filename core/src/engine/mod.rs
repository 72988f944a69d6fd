//! The engine: one provider `P` and the protocol state of the core, [`State`] — the
//! active-message layer ([`crate::am`]), the two-sided protocols ([`crate::p2p`]) and the RMA
//! protocols ([`crate::rma`]).
//!
//! `State` is the [`Sink`] the provider reports into. It checks each message against the
//! handler-id table ([`am::owner`]) and the owning protocol's declared header length, hands it
//! to that protocol, and then *settles*: peers that failed meanwhile (a malformed message, a
//! refused send, the provider's report) are fanned out to every protocol, so each releases what
//! waits for them. Handlers never call the provider: what they send goes into the outbox,
//! flushed after `progress` returns.
//!
//! Above the engine sit the APIs ([`crate::comm`], [`crate::win`]); they reach it through
//! `Engine`'s methods and, for RMA, through `State::rma` and the outbox.

mod config;

pub use config::EngineConfig;
pub(crate) use config::{oversubscribed, SLEEP_AFTER_AUTO};

use crate::am::{self, AmState, Proto, Rd, ReqId};
use crate::p2p::{self, Layout, Leaf, Lean, P2pConfig, P2pState, Posted, RecvBuf, SendBuf, Slot};
use crate::provider::{Completed, ConnEvent, Provider, Sink, Token};
use crate::rma::{self, RmaState};
use crate::types::Rank;
use crate::{Error, ErrorDetail, Result, Status};
use std::time::Instant;
use weft_provider::backoff::Backoff;

/// Core state: everything but the provider. It is the provider's [`Sink`].
pub(crate) struct State {
    pub(crate) am: AmState,
    pub(crate) p2p: P2pState,
    pub(crate) rma: RmaState,
}

/// The exact header length of message `kind`, as declared by the protocol that owns it.
fn header_len(kind: u8, flags: Option<u8>) -> Option<usize> {
    match am::owner(kind)? {
        Proto::P2p => p2p::header_len(kind, flags),
        Proto::Rma => rma::header_len(kind),
    }
}

impl State {
    /// Tell every protocol about the peers that failed since the last call.
    #[inline]
    fn settle(&mut self) {
        while let Some(failed) = self.am.take_newly_failed() {
            for r in failed {
                self.p2p.peer_failed(&self.am, r);
                rma::peer_failed(&mut self.rma, &mut self.am, r);
            }
        }
    }

    /// Nothing queued for sending and no rendezvous stream running.
    pub(crate) fn out_idle(&self) -> bool {
        self.am.out.is_empty() && self.p2p.streams_idle()
    }

    /// Why `rank` failed, if it did.
    pub(crate) fn peer_failure(&self, rank: Rank) -> Option<String> {
        self.am.peer_failure(rank).map(str::to_string)
    }

    /// An arrival the slot's call-free path did not take: a plain eager message by the lean
    /// path, anything else by the general one (out of line, so that the call-free path pays
    /// no frame).
    #[inline(never)]
    fn am_plain(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        if self.p2p.on_plain_eager(&mut self.am, src, header, payload) {
            self.settle();
            return;
        }
        self.am_general(src, header, payload);
    }

    /// Any other active message: checked against the protocol's header lengths, then
    /// dispatched by kind (out of line: its frame would otherwise be paid by every plain eager
    /// arrival).
    #[inline(never)]
    fn am_general(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        if self.am.admit(src, header, payload, header_len) {
            let mut rd = Rd::new(header);
            let kind = rd.u8().unwrap_or(0);
            let ok = match am::owner(kind) {
                Some(Proto::P2p) => self.p2p.on_am(&mut self.am, src, kind, &mut rd, payload),
                Some(Proto::Rma) => {
                    let mut cx = rma::Ctx {
                        rma: &mut self.rma,
                        am: &mut self.am,
                    };
                    rma::on_am(&mut cx, src, kind, &mut rd, payload)
                }
                None => None,
            };
            if ok.is_none() {
                self.am
                    .malformed(src, &format!("a header of kind {kind} that does not parse"));
            }
        }
        self.settle();
    }
}

impl Sink for State {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        // A small message into the armed blocking receive, without a call; everything else
        // (and the credit it may make due) out of line.
        match self.p2p.slot_arrival(&self.am, src, header, payload) {
            Leaf::Taken => {}
            Leaf::CreditDue => self.p2p.return_credit(&mut self.am, src),
            Leaf::No => self.am_plain(src, header, payload),
        }
    }

    fn am_target(
        &mut self,
        src: Rank,
        header: &[u8],
        off: usize,
        n: usize,
    ) -> Option<std::ptr::NonNull<u8>> {
        // Only two-sided data is placed directly, and only from a well-formed header.
        let kind = *header.first()?;
        if src >= self.am.size
            || am::owner(kind) != Some(Proto::P2p)
            || header_len(kind, header.get(1).copied()) != Some(header.len())
        {
            return None;
        }
        self.p2p.am_target(&mut self.am, src, header, off, n)
    }

    fn am_placed(&mut self, src: Rank, header: &[u8], off: usize, k: usize) {
        self.p2p.am_placed(&mut self.am, src, header, off, k);
        self.settle();
    }

    fn complete(&mut self, token: Token, result: Result<Completed>) {
        match am::token_owner(token) {
            Proto::Rma => self.rma.complete(token, result.map(|_| ())),
            Proto::P2p => self.p2p.complete(&mut self.am, token, result),
        }
    }

    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        self.am.fail_peer(rank, reason);
        self.settle();
    }

    fn connection(&mut self, peer: Rank, event: ConnEvent) {
        self.am.connection(peer, event);
    }

    fn rma_data(&mut self, src: Rank, data: u64) {
        let mut cx = rma::Ctx {
            rma: &mut self.rma,
            am: &mut self.am,
        };
        rma::on_data(&mut cx, src, data);
        self.settle();
    }
}

/// The blocking receive's engine while its slot may hold the caller's buffer: dropped on
/// every way out of `recv_now`, a panic unwinding out of the wait (a provider's bug) included,
/// it takes whatever the wait left in the slot (`slot_unwound`: a receive still armed is
/// withdrawn, a request it became is quarantined) so that nothing refers to the buffer once the
/// call is over. On the normal way out the wait has taken the slot already and the drop only
/// looks. (A `catch_unwind` did the same at about ten instructions more per receive.)
struct SlotGuard<'a, P: Provider>(&'a mut Engine<P>);

impl<P: Provider> Drop for SlotGuard<'_, P> {
    #[inline]
    fn drop(&mut self) {
        if !self.0.st.p2p.slot_idle() {
            self.0.slot_unwound();
        }
    }
}

/// Progress rounds a wait makes before it starts the loop that yields and keeps time.
const FAST_ROUNDS: usize = 2;

/// Empty rounds a wait polls back to back before it paces itself with the CPU's spin-wait
/// hint (`pause` on x86). A message that lands during a `pause` is seen only when it ends
/// (tens of cycles on AMD, about 140 on recent Intel), a delay a small message's latency
/// shows: short waits, a ping-pong's, poll without it, as UCX's and Open MPI's progress loops
/// do; longer ones keep the hint (it frees the core's resources for a hyperthread sibling).
const EAGER_POLLS: u32 = 256;

/// The engine: a provider plus the core state.
pub(crate) struct Engine<P: Provider> {
    pub(crate) p: P,
    pub(crate) st: State,
    pub(crate) cfg: EngineConfig,
}

impl<P: Provider> Engine<P> {
    pub(crate) fn new(p: P, cfg: EngineConfig) -> Result<Self> {
        let caps = p.caps().clone();
        caps.check_contract(p.name())?;
        let size = p.size();
        let eager_limit = cfg
            .eager_limit
            .unwrap_or(caps.eager_limit)
            .min(caps.max_am_payload);
        let pc = P2pConfig {
            eager_limit,
            spec_limit: cfg
                .spec_limit
                .unwrap_or_else(|| config::spec_limit_auto(&caps)),
            spec_behind: cfg.spec_behind,
            spec_buffer: cfg.spec_buffer,
            eager_window: cfg.eager_window,
            nt_copy_min: cfg.nt_copy_min,
            // The zero-copy rendezvous registers the sender's buffer: user memory.
            rma_read: caps.rma.is_some_and(|r| r.read && r.user_memory),
            // The write rendezvous tells the receiver after the write completed locally: that
            // must mean the data is in its memory.
            rma_write: caps
                .rma
                .is_some_and(|r| r.write && r.user_memory && r.delivery_complete()),
        };
        let st = State {
            p2p: P2pState::new(size, pc),
            am: AmState::new(size, caps, cfg.mr_cache),
            rma: RmaState::default(),
        };
        Ok(Engine { p, st, cfg })
    }

    // ------------------------------------------------------------------------------ posting

    /// A send's first try, the lean path ([`P2pState::send_lean`]). It changes nothing a
    /// failure sweep would need to hear of, so it does not settle.
    #[inline(always)]
    pub(crate) fn send_lean(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        data: &[u8],
    ) -> Result<Lean> {
        self.st
            .p2p
            .send_lean(&mut self.p, &self.st.am, dest, ctx, tag, data)
    }

    /// A send the lean path did not take or was not tried for (`busy`: the provider refused
    /// it just now).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn isend_general(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        buf: SendBuf,
        sync: bool,
        scope: u64,
        busy: bool,
    ) -> Result<Posted> {
        let st = &mut self.st;
        let r = st.p2p.isend_general(
            &mut self.p,
            &mut st.am,
            dest,
            ctx,
            tag,
            buf,
            sync,
            scope,
            busy,
        );
        st.settle();
        r
    }

    #[inline]
    pub(crate) fn irecv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: RecvBuf,
        scope: u64,
    ) -> Result<Posted> {
        let st = &mut self.st;
        let r = st
            .p2p
            .irecv(&mut self.p, &mut st.am, src, ctx, tag, buf, scope);
        st.settle();
        r
    }

    /// Is a matching message waiting? (MPI_Iprobe)
    pub(crate) fn iprobe(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<Status>> {
        if let Some(s) = src {
            if s >= self.st.am.size {
                self.st.am.check_peer(s)?;
            }
        }
        self.progress()?;
        let found = self
            .st
            .p2p
            .iprobe_local(&mut self.p, &self.st.am, src, ctx, tag)?;
        // Nothing waiting from a source that failed: nothing ever will.
        if let (None, Some(s)) = (&found, src) {
            self.st.am.check_peer(s)?;
        }
        Ok(found)
    }

    // ------------------------------------------------------------------------------ progress

    /// One round: provider arrivals, then queued sends, streams and RMA reads. Inlined into
    /// the waits: a round that leaves nothing else to do costs the provider's call and one
    /// test of the engine's state, without a frame of its own; the rest is out of line.
    #[inline]
    pub(crate) fn progress(&mut self) -> Result<usize> {
        let n = self.p.progress(&mut self.st)?;
        // `has_work` covers the rendezvous streams too, the other half of `out_idle`.
        if self.st.am.provider_fault.is_none()
            && self.st.am.out.is_empty()
            && !self.st.p2p.has_work()
            && !self.st.am.needs_refresh()
            && !self.st.am.mr.has_dead()
        {
            return Ok(n);
        }
        self.after_progress(n)
    }

    /// What a progress round found to do besides the provider's arrivals (see `progress`).
    #[inline(never)]
    fn after_progress(&mut self, mut n: usize) -> Result<usize> {
        if let Some(why) = &self.st.am.provider_fault {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "provider '{}' is broken: it {why}",
                self.p.name()
            ))));
        }
        if !self.st.out_idle() {
            n += self.flush_out()?;
        }
        if self.st.p2p.has_work() {
            n += self.st.p2p.after_progress(&mut self.p, &mut self.st.am);
            self.st.settle();
        }
        if self.st.am.needs_refresh() {
            self.st.am.refresh_peers(&self.p);
        }
        if self.st.am.mr.has_dead() {
            self.st.am.mr.reap(&mut self.p);
        }
        Ok(n)
    }

    /// Send queued messages in per-destination order, then advance rendezvous streams (see
    /// `AmState::flush`).
    pub(crate) fn flush_out(&mut self) -> Result<usize> {
        let r = self.st.p2p.flush(&mut self.p, &mut self.st.am);
        self.st.settle();
        r
    }

    // ---------------------------------------------------------------------------- completion

    /// The result of a finished request, freeing it; `None` if still running.
    #[inline]
    pub(crate) fn try_take(&mut self, id: ReqId) -> Option<Result<Status>> {
        self.st.p2p.try_take(&mut self.st.am, id)
    }

    pub(crate) fn test(&mut self, id: ReqId) -> Result<Option<Result<Status>>> {
        if let Some(r) = self.try_take(id) {
            return Ok(Some(r));
        }
        self.progress()?;
        Ok(self.try_take(id))
    }

    pub(crate) fn is_done(&self, id: ReqId) -> bool {
        self.st.p2p.is_done(id)
    }

    /// Spin on progress until `done(self)` holds, yielding the CPU after `cfg.spin` idle rounds,
    /// and failing after `cfg.timeout`.
    #[inline]
    pub(crate) fn wait_until(
        &mut self,
        what: &str,
        mut done: impl FnMut(&mut Self) -> bool,
    ) -> Result<()> {
        let mut idle = 0u32;
        let mut rounds = 0u32;
        let mut nap = Backoff::default();
        // The clock is read after the second round, so a wait that ends within two rounds (the
        // common case: one progress call brings what it waits for) costs no clock read; the
        // timeout counts from there.
        let mut start: Option<Instant> = None;
        loop {
            if done(self) {
                return Ok(());
            }
            let n = self.progress()?;
            if n == 0 {
                idle = idle.saturating_add(1);
                if idle > self.cfg.spin {
                    nap.idle_round(self.cfg.sleep_after, idle - self.cfg.spin);
                } else if idle > EAGER_POLLS {
                    std::hint::spin_loop();
                }
            } else {
                idle = 0;
                nap.reset();
            }
            rounds = rounds.wrapping_add(1);
            if rounds == 2 && start.is_none() && self.cfg.timeout.is_some() {
                start = Some(Instant::now());
            }
            if rounds % 256 == 0 {
                if let (Some(limit), Some(t0)) = (self.cfg.timeout, start) {
                    if t0.elapsed() > limit {
                        return Err(Error::from(ErrorDetail::Timeout {
                            what: what.to_string(),
                            secs: limit.as_secs_f64(),
                        }));
                    }
                }
            }
        }
    }

    /// Wait for request `id`. If the wait itself fails (timeout, provider error) the request
    /// is quarantined: it gives up its buffer before the error is returned.
    #[inline]
    pub(crate) fn wait(&mut self, id: ReqId) -> Result<Status> {
        // The first rounds without the loop's bookkeeping: most waits end after one or two
        // progress calls (the answer is already in the provider's queue).
        for _ in 0..FAST_ROUNDS {
            if let Some(r) = self.try_take(id) {
                return r;
            }
            if let Err(e) = self.progress() {
                self.quarantine(id, Some(&e));
                return Err(e);
            }
        }
        self.wait_long(id)
    }

    /// A blocking receive into `buf` (`Comm::recv`, which holds the buffer's unique borrow for
    /// the whole call): through the slot (p2p/slot.rs) when no unexpected message matches it,
    /// the buffer is contiguous, the provider does not match tags itself and the source has not
    /// failed; otherwise posted and waited for as a request.
    #[inline]
    pub(crate) fn recv_now(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: RecvBuf,
    ) -> Result<Status> {
        let st = &mut self.st;
        // `src` is a valid world rank (`Comm::source`): alive unless some rank failed.
        let lean = !st.am.caps.tagged
            && st.p2p.slot_usable(ctx, src, tag)
            && matches!(buf.layout, Layout::Contig)
            && (st.am.nfailed == 0 || src.is_none_or(|s| st.am.alive(s)));
        if !lean {
            return self.recv_posted(src, ctx, tag, buf);
        }
        // SAFETY: `buf` is the caller's buffer, borrowed for this whole call; every way out of
        // this function takes the slot: a return through `slot_result` or `slot_abort` (which
        // withdraw a receive still armed, or hand a demoted one to `wait`/`quarantine`, the
        // request rules), and a panic unwinding out of the wait (a provider's bug) through
        // `SlotGuard`'s drop, which calls `slot_unwound` before the unwinding goes on.
        unsafe { st.p2p.arm(ctx, src, tag, buf.base, buf.cap) };
        SlotGuard(self).0.slot_wait()
    }

    /// A blocking receive that cannot take the slot: posted and waited for as a request. Out
    /// of line, so that the lean path inlined into `Comm::recv` does not carry it.
    #[inline(never)]
    fn recv_posted(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: RecvBuf,
    ) -> Result<Status> {
        match self.irecv(src, ctx, tag, buf, 0)? {
            Posted::Done(r) => r,
            Posted::Pending(id) => self.wait(id),
        }
    }

    /// Wait for the armed slot, then take its outcome (called through a [`SlotGuard`]).
    #[inline]
    fn slot_wait(&mut self) -> Result<Status> {
        for _ in 0..FAST_ROUNDS {
            if !self.st.p2p.slot_armed() {
                return self.slot_result();
            }
            if let Err(e) = self.progress() {
                return self.slot_abort(e);
            }
        }
        match self.wait_until("a receive", |e| !e.st.p2p.slot_armed()) {
            Ok(()) => self.slot_result(),
            Err(e) => self.slot_abort(e),
        }
    }

    /// A panic unwinds out of a blocking receive (or the slot is left behind some other way):
    /// nothing may refer to its buffer afterwards.
    #[cold]
    #[inline(never)]
    fn slot_unwound(&mut self) {
        if let Slot::Demoted(id) = self.st.p2p.take_slot() {
            self.quarantine(id, None);
        }
    }

    /// The blocking receive's outcome once its slot is no longer armed.
    #[inline]
    fn slot_result(&mut self) -> Result<Status> {
        match self.st.p2p.take_slot() {
            Slot::Done(r) => r,
            Slot::Demoted(id) => self.wait(id),
            Slot::Idle | Slot::Armed(_) => Err(Error::invalid(
                "internal: a blocking receive's slot was taken while armed",
            )),
        }
    }

    /// The wait for a blocking receive failed with `e`: withdraw it (armed) or quarantine the
    /// request it became, so that nothing writes into the buffer once this returns.
    #[inline(never)]
    fn slot_abort(&mut self, e: Error) -> Result<Status> {
        match self.st.p2p.take_slot() {
            // It completed before the wait gave up: the receive happened.
            Slot::Done(r) => r,
            Slot::Demoted(id) => {
                self.quarantine(id, Some(&e));
                Err(e)
            }
            Slot::Idle | Slot::Armed(_) => Err(e),
        }
    }

    #[inline(never)]
    fn wait_long(&mut self, id: ReqId) -> Result<Status> {
        let mut out = None;
        if let Err(e) = self.wait_until("a request", |e| {
            out = e.try_take(id);
            out.is_some()
        }) {
            self.quarantine(id, Some(&e));
            return Err(e);
        }
        out.expect("set when done")
    }

    /// Wait for request `id`, or until a rank that `member` accepts has failed (then `id` is
    /// given up and the error names that rank).
    pub(crate) fn wait_or_member_failed(
        &mut self,
        id: ReqId,
        member: impl Fn(Rank) -> bool,
    ) -> Result<Status> {
        let mut out = None;
        let mut dead = None;
        let waited = self.wait_until("a collective operation", |e| {
            out = e.try_take(id);
            if out.is_some() {
                return true;
            }
            if e.st.am.nfailed > 0 {
                dead = (0..e.st.am.size).find(|r| member(*r) && e.st.am.is_failed(*r));
            }
            dead.is_some()
        });
        if let Err(e) = waited {
            self.quarantine(id, Some(&e));
            return Err(e);
        }
        if let Some(r) = out {
            return r;
        }
        let _ = self.cancel(id);
        self.quarantine(id, None);
        let r = dead.expect("set when the wait ended without the request");
        let why = self.st.peer_failure(r).unwrap_or_default();
        Err(Error::peer_failed(
            r,
            format!("a member of the collective: {why}"),
        ))
    }

    /// Give up request `id` without waiting for it: once this returns, nothing writes into its
    /// buffer or reads from it, so the caller may free the memory.
    ///
    /// Where the engine performs every access itself (the active-message protocols), the
    /// request is dropped and whatever still arrives for it is discarded. Where the provider
    /// holds a pointer into the buffer that it cannot hand back (a native send or a matched
    /// native receive, an RMA read in flight), no safe way remains but to end the process, as
    /// MPI's default error handler does: waiting longer is a hang, and returning would let the
    /// provider write into memory the caller is about to free.
    /// `why`: the error the wait ended with, named in the message if the process must end.
    pub(crate) fn quarantine(&mut self, id: ReqId, why: Option<&Error>) {
        if let Err(what) = self.st.p2p.quarantine(&mut self.p, &mut self.st.am, id) {
            match why {
                Some(e) => fatal(self.p.rank(), &format!("{what} (the wait ended with: {e})")),
                None => fatal(self.p.rank(), what),
            }
        }
    }

    /// Cancel a receive that has not matched (MPI_Cancel). A send, or a receive that already
    /// matched, is left to complete normally.
    pub(crate) fn cancel(&mut self, id: ReqId) -> Result<()> {
        self.st.p2p.cancel(&mut self.p, id)
    }

    /// Complete every request of `scope` (receives that have not matched are cancelled). If a
    /// wait fails, the scope's remaining requests are quarantined without waiting (each would
    /// fail the same way), so the scope's buffers may go away when this returns, in any case.
    pub(crate) fn drain_scope(&mut self, scope: u64) -> Result<()> {
        if self.st.p2p.live() == 0 {
            return Ok(());
        }
        let mut first_err = None;
        let mut broken = false;
        for (id, is_recv) in self.st.p2p.scope_requests(scope) {
            if broken {
                self.quarantine(id, first_err.as_ref());
                continue;
            }
            if is_recv {
                let _ = self.cancel(id);
            }
            let mut out = None;
            match self.wait_until("a request at the end of its scope", |e| {
                out = e.try_take(id);
                out.is_some()
            }) {
                Ok(()) => {
                    if let Some(Err(e)) = out {
                        first_err.get_or_insert(e);
                    }
                }
                Err(e) => {
                    self.quarantine(id, Some(&e));
                    broken = true;
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Give up RMA operations whose completion wait failed (see [`Engine::quarantine`]):
    /// queued messages that still point at origin buffers get a copy of their data, and
    /// replies that arrive later for `tokens` are dropped. `native_outstanding`: the provider
    /// may still be performing native operations into this window's buffers, which only
    /// ending the process can stop.
    pub(crate) fn quarantine_rma(&mut self, tokens: &[u64], native_outstanding: bool) {
        self.st.am.own_raw_payloads();
        let native = tokens.iter().any(|t| {
            matches!(
                self.st.rma.waits.get(t),
                Some(rma::Wait::Native { pending: 1.., .. })
            )
        });
        if native || native_outstanding {
            fatal(
                self.p.rank(),
                "native RMA operations were still in flight into the epoch's buffers",
            );
        }
        for &t in tokens {
            let _ = self.st.rma.take(t);
            self.st.am.note_quarantined(t);
        }
    }

    /// Wait until nothing is queued for sending (used before shutdown).
    pub(crate) fn quiesce(&mut self) -> Result<()> {
        self.wait_until("outgoing messages to drain", |e| e.st.out_idle())
    }

    /// Number of live requests (diagnostics, tests).
    pub(crate) fn live_requests(&self) -> usize {
        self.st.p2p.live()
    }
}

/// End the process because `what` cannot be released safely (see [`Engine::quarantine`]).
pub(crate) fn fatal(rank: Rank, what: &str) -> ! {
    let msg = format!(
        "weft: rank {rank}: fatal: a wait failed while {what}; ending the process so that no \
         memory it no longer owns can be written (raise WEFT_TIMEOUT if the peer is only slow)"
    );
    tracing::error!("{msg}");
    eprintln!("{msg}");
    std::process::exit(1)
}

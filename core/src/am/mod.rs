//! The active-message layer: what every protocol of the core stands on.
//!
//! * the **handler-id table** — the first header byte names the protocol that handles a
//!   message; each protocol owns a range of ids ([`P2P_IDS`], [`RMA_IDS`]) and declares the
//!   exact header length of each of its messages, checked before any handler runs;
//! * the **token namespaces** — completion tokens handed to the provider are request ids of
//!   the two-sided protocols or, with [`TOKEN_RMA`] set, RMA tokens;
//! * the **outbox** ([`outbox`]) — per-destination queues flushed in order after `progress`;
//! * **requests** ([`slab`]) — generational ids, never reused for a live late reply;
//! * **peer health** — failed peers, peers that broke the protocol, and requests given up by
//!   a failed wait (whose late messages are dropped quietly).
//!
//! The layer knows no protocol: the engine dispatches by [`owner`], and a peer failure noted
//! here is fanned out to the protocols by the engine ([`AmState::take_newly_failed`]).

pub(crate) mod codec;
pub(crate) mod mr_cache;
pub(crate) mod outbox;

pub(crate) use codec::{Hdr, Rd};
pub(crate) use outbox::Out;
/// Request id: generation in bits 32..62, slot in the low 32 ([`weft_proto::slab`], 31
/// generation bits). Bit 63 is never set (that half of the token space belongs to RMA, see
/// [`TOKEN_RMA`]) and no id is 0 (which the C ABI reads as "no token").
pub(crate) type ReqId = weft_proto::slab::Id;
pub(crate) use weft_proto::slab::Slab;

use crate::provider::{Caps, ConnEvent, PeerCaps, Provider};
use crate::types::Rank;
use crate::{Error, ErrorDetail, Result};
use std::collections::VecDeque;
use std::ops::Range;

/// Handler ids of the two-sided protocols (eager, rendezvous, speculative, credits).
pub(crate) const P2P_IDS: Range<u8> = 1..16;
/// Handler ids of the one-sided (RMA) protocols.
pub(crate) const RMA_IDS: Range<u8> = 16..48;

/// The protocol a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proto {
    P2p,
    Rma,
}

/// The protocol that owns handler id `kind`, `None` for an id nobody owns.
#[inline]
pub(crate) fn owner(kind: u8) -> Option<Proto> {
    if P2P_IDS.contains(&kind) {
        Some(Proto::P2p)
    } else if RMA_IDS.contains(&kind) {
        Some(Proto::Rma)
    } else {
        None
    }
}

/// Completion tokens with this bit belong to RMA; the rest are request ids ([`ReqId`]).
pub(crate) const TOKEN_RMA: u64 = 1 << 63;

/// The protocol that owns completion token `t`.
#[inline]
pub(crate) fn token_owner(t: u64) -> Proto {
    if t & TOKEN_RMA != 0 {
        Proto::Rma
    } else {
        Proto::P2p
    }
}

/// Quarantined request ids remembered for dropping their late messages quietly.
const QUARANTINE_MEMORY: usize = 4096;

/// What the core knows of one peer's connection.
#[derive(Debug, Clone, Copy, Default)]
struct PeerState {
    /// `Provider::connect` was called for it.
    connected: bool,
    /// Its narrower capabilities (`Provider::peer_caps`), if any.
    narrow: Option<PeerCaps>,
    /// The lean send path may hand the provider a payload shorter than this for it in one
    /// copied active message ([`AmState::lean_below`]); 0 (nothing, not even an empty
    /// message) until connected and once failed.
    lean_below: usize,
}

/// The active-message layer's state: the outbox and the health of every peer.
pub(crate) struct AmState {
    pub(crate) size: u32,
    pub(crate) caps: Caps,
    pub(crate) out: outbox::Outbox,
    peers: Vec<PeerState>,
    /// Peers whose connection changed during `progress`: their capabilities are read again.
    refresh: Vec<Rank>,
    /// Connections the core asked for, and those the provider reported up (diagnostics).
    pub(crate) connects: u32,
    pub(crate) connected_events: u32,
    failed: Vec<Option<String>>,
    pub(crate) nfailed: u32,
    /// Peers failed since the engine last fanned failures out to the protocols.
    newly_failed: Vec<Rank>,
    /// Peers that sent something malformed: failed, and nothing more from them is taken.
    rogue: Vec<bool>,
    /// The provider reported something impossible (a message from outside the world):
    /// `progress` fails with this.
    pub(crate) provider_fault: Option<String>,
    /// Requests given up by a failed wait (the most recent ones): what still arrives for them
    /// is dropped quietly instead of being taken for a peer's protocol error.
    quarantined: VecDeque<u64>,
    /// Finalize passed its barrier: peers going away now is expected.
    pub(crate) closing: bool,
    /// Packing space for payloads with more pieces than the provider's iovec limit.
    pub(crate) scratch: Vec<u8>,
    /// Small payload buffers kept for reuse: of sent `Out::Owned` messages (RMA replies,
    /// batches) and of unexpected eager messages once received, which would otherwise cost an
    /// allocation each.
    spare: crate::BufPool,
    /// Local registrations of user buffers, for providers that need descriptors.
    pub(crate) mr: mr_cache::MrCache,
}

impl AmState {
    pub(crate) fn new(size: u32, caps: Caps, mr_cache: (usize, usize)) -> Self {
        AmState {
            mr: mr_cache::MrCache::new(mr_cache.0, mr_cache.1, caps.mr_pins),
            size,
            caps,
            out: outbox::Outbox::new(size),
            peers: vec![PeerState::default(); size as usize],
            refresh: Vec::new(),
            connects: 0,
            connected_events: 0,
            failed: vec![None; size as usize],
            nfailed: 0,
            newly_failed: Vec::new(),
            rogue: vec![false; size as usize],
            provider_fault: None,
            quarantined: VecDeque::new(),
            closing: false,
            scratch: Vec::new(),
            // 32 buffers of up to 32 KiB: a small-message epoch's replies and batches.
            spare: crate::BufPool::new(32, 32 << 10),
        }
    }

    /// The lean send path may send `peer` a payload shorter than this as one copied active
    /// message. 0 (nothing) for a rank outside the world, not connected yet or failed, and on a
    /// provider that matches tags itself; else one more than the provider's and
    /// the peer's payload and eager limits, and the inject size where a larger payload would
    /// go zero-copy (`am_isend`). The core's own eager limit and credit are checked apart.
    #[inline]
    pub(crate) fn lean_below(&self, peer: Rank) -> usize {
        self.peers.get(peer as usize).map_or(0, |s| s.lean_below)
    }

    /// Set `peer`'s narrower capabilities and what follows from them for the lean send.
    fn set_narrow(&mut self, peer: Rank, narrow: Option<PeerCaps>) {
        let c = &self.caps;
        let mut max = c.max_am_payload;
        let mut zcopy = c.am_isend;
        if let Some(n) = &narrow {
            max = max.min(n.max_am_payload).min(n.eager_limit);
            zcopy &= n.am_isend;
        }
        if zcopy {
            max = max.min(c.inject_size);
        }
        let alive = self.failed[peer as usize].is_none();
        let s = &mut self.peers[peer as usize];
        s.narrow = narrow;
        s.lean_below = if s.connected && alive && !c.tagged {
            max.saturating_add(1)
        } else {
            0
        };
    }

    /// `r` is a rank of the world that has not failed (the test of [`Self::check_peer`],
    /// without building its error).
    #[inline]
    pub(crate) fn alive(&self, r: Rank) -> bool {
        self.failed.get(r as usize).is_some_and(Option::is_none)
    }

    /// `r` is a rank of the world that has not failed.
    #[inline]
    pub(crate) fn check_peer(&self, r: Rank) -> Result<()> {
        if r >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        if let Some(why) = &self.failed[r as usize] {
            return Err(Error::peer_failed(r, why.clone()));
        }
        Ok(())
    }

    /// Make sure the provider was told about `peer` (`Provider::connect`, once per peer,
    /// before the first operation towards it). A refusal fails the peer.
    #[inline(always)]
    pub(crate) fn touch<P: Provider>(&mut self, p: &mut P, peer: Rank) -> Result<()> {
        match self.peers.get(peer as usize) {
            Some(s) if s.connected => self.check_peer(peer),
            Some(_) => self.connect(p, peer),
            None => self.check_peer(peer),
        }
    }

    #[cold]
    fn connect<P: Provider>(&mut self, p: &mut P, peer: Rank) -> Result<()> {
        self.check_peer(peer)?;
        self.peers[peer as usize].connected = true;
        self.connects += 1;
        if let Err(e) = p.connect(peer) {
            let why = format!("connecting to it failed: {e}");
            self.fail_peer(peer, &why);
            return Err(Error::peer_failed(peer, why));
        }
        self.set_narrow(peer, p.peer_caps(peer));
        Ok(())
    }

    /// The provider reported a connection event for `peer` (from inside `progress`).
    pub(crate) fn connection(&mut self, peer: Rank, ev: ConnEvent) {
        if peer >= self.size {
            return;
        }
        if ev == ConnEvent::Connected {
            self.connected_events += 1;
        }
        tracing::debug!(peer, ?ev, "connection event");
        self.refresh.push(peer);
    }

    /// Read again the capabilities of peers whose connection changed.
    pub(crate) fn refresh_peers<P: Provider>(&mut self, p: &P) {
        for peer in std::mem::take(&mut self.refresh) {
            self.set_narrow(peer, p.peer_caps(peer));
        }
    }

    /// Peers whose capabilities are to be read again.
    #[inline]
    pub(crate) fn needs_refresh(&self) -> bool {
        !self.refresh.is_empty()
    }

    /// `peer`'s narrower capabilities, if it has any.
    #[inline]
    pub(crate) fn narrow(&self, peer: Rank) -> Option<&PeerCaps> {
        self.peers.get(peer as usize)?.narrow.as_ref()
    }

    /// Largest payload towards `peer`.
    #[inline]
    pub(crate) fn chunk(&self, peer: Rank) -> usize {
        match self.narrow(peer) {
            None => self.caps.max_am_payload,
            Some(n) => n.max_am_payload.min(self.caps.max_am_payload),
        }
    }

    /// Why `rank` failed, if it did.
    #[inline]
    pub(crate) fn peer_failure(&self, rank: Rank) -> Option<&str> {
        self.failed.get(rank as usize)?.as_deref()
    }

    #[inline]
    pub(crate) fn is_failed(&self, rank: Rank) -> bool {
        self.peer_failure(rank).is_some()
    }

    /// Note that `rank` failed: nothing more is sent to it (its queue is dropped) and the
    /// protocols hear of it when the engine next settles ([`Self::take_newly_failed`]).
    pub(crate) fn fail_peer(&mut self, rank: Rank, reason: &str) {
        if rank >= self.size || self.failed[rank as usize].is_some() {
            return;
        }
        self.failed[rank as usize] = Some(reason.to_string());
        self.peers[rank as usize].lean_below = 0;
        self.nfailed += 1;
        // Owned payloads of messages that will never be sent go back to the pool.
        for o in self.out.drop_queue(rank) {
            if let Out::Owned(_, data) = o {
                self.spare.give(data);
            }
        }
        self.newly_failed.push(rank);
    }

    /// Peers failed since the last call, for the protocols to release what waits for them.
    #[inline]
    pub(crate) fn take_newly_failed(&mut self) -> Option<Vec<Rank>> {
        (!self.newly_failed.is_empty()).then(|| std::mem::take(&mut self.newly_failed))
    }

    /// A message from `src` breaks the protocol: that peer is failed (everything that waits
    /// for it ends with "peer failed: rank N (malformed message: ...)") and whatever else it
    /// sends is dropped. A protocol error never leaves a rank waiting for a message that will
    /// not come.
    pub(crate) fn malformed(&mut self, src: Rank, what: &str) {
        if src >= self.size {
            // Not a peer at all: the provider itself is broken.
            self.provider_fault
                .get_or_insert_with(|| format!("delivered a message from rank {src}: {what}"));
            return;
        }
        if !std::mem::replace(&mut self.rogue[src as usize], true) {
            tracing::error!(
                peer = src,
                "malformed message: {what}; the peer is treated as failed"
            );
        }
        self.fail_peer(src, &format!("malformed message: {what}"));
    }

    /// What [`Self::admit`] checks of a message whose header the caller has already checked:
    /// the source is a rank of the world that has not broken the protocol, and the payload is
    /// within the provider's limit. `false` sends the message down the general path, which
    /// reports what is wrong.
    #[inline]
    pub(crate) fn admits_plain(&self, src: Rank, payload_len: usize) -> bool {
        self.rogue.get(src as usize) == Some(&false) && payload_len <= self.caps.max_am_payload
    }

    /// Check an arriving message before any handler sees it: a peer of the world that has not
    /// broken the protocol, within the provider's limits, with a header of exactly the length
    /// its handler declares (`header_len`). `false`: the message is dropped (and its sender
    /// failed, if it is malformed).
    #[inline]
    pub(crate) fn admit(
        &mut self,
        src: Rank,
        header: &[u8],
        payload: &[u8],
        header_len: impl FnOnce(u8, Option<u8>) -> Option<usize>,
    ) -> bool {
        if src >= self.size {
            self.malformed(src, "a rank outside the world");
            return false;
        }
        if self.rogue[src as usize] {
            return false;
        }
        if header.len() > self.caps.max_am_header || payload.len() > self.caps.max_am_payload {
            let what = format!(
                "{}-byte header and {}-byte payload exceed the provider's limits ({} and {})",
                header.len(),
                payload.len(),
                self.caps.max_am_header,
                self.caps.max_am_payload
            );
            self.malformed(src, &what);
            return false;
        }
        let kind = header.first().copied();
        let want = kind.and_then(|k| header_len(k, header.get(1).copied()));
        if want != Some(header.len()) {
            let what = match want {
                None => format!("unknown or short header (kind {kind:?})"),
                Some(n) => format!(
                    "a header of kind {} with {} bytes instead of {n}",
                    kind.unwrap_or(0),
                    header.len()
                ),
            };
            self.malformed(src, &what);
            return false;
        }
        true
    }

    /// Remember a quarantined request or RMA token (bounded: the oldest are forgotten).
    pub(crate) fn note_quarantined(&mut self, id: u64) {
        if self.quarantined.len() >= QUARANTINE_MEMORY {
            self.quarantined.pop_front();
        }
        self.quarantined.push_back(id);
    }

    /// Was `id` given up by a failed wait? (Late messages for it are expected then.)
    #[inline]
    pub(crate) fn was_quarantined(&self, id: u64) -> bool {
        self.quarantined.contains(&id)
    }

    /// A message that names request or token `id`, which no longer exists: expected when `id`
    /// was quarantined (dropped quietly), a protocol error otherwise.
    pub(crate) fn stale(&mut self, src: Rank, id: u64, what: &str) {
        if self.was_quarantined(id) {
            tracing::debug!(peer = src, "dropping {what} for a request given up earlier");
        } else {
            self.malformed(src, &format!("{what} for an unknown request"));
        }
    }

    /// An empty buffer for an owned payload, reusing one of a message already sent.
    #[inline]
    pub(crate) fn spare_buf(&mut self) -> Vec<u8> {
        self.spare.take()
    }

    /// Give a payload buffer back for reuse.
    #[inline]
    pub(crate) fn recycle(&mut self, data: Vec<u8>) {
        self.spare.give(data);
    }

    #[inline]
    pub(crate) fn push_out(&mut self, dest: Rank, o: Out) {
        self.out.push(dest, o);
    }

    #[inline]
    pub(crate) fn push_ctrl(&mut self, dest: Rank, h: Hdr) {
        self.out.push(dest, Out::Ctrl(h));
    }

    #[inline]
    pub(crate) fn push_owned(&mut self, dest: Rank, h: Hdr, data: Vec<u8>) {
        self.out.push(dest, Out::Owned(h, data));
    }
}

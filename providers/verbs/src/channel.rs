//! The channels' composition interface: what a provider made of several verbs channels (the
//! hybrid provider; UCX's `ucp` over its `uct/ib/{rc,ud}` transports is the same shape) may ask
//! of them beyond the provider contract.
//!
//! A channel is a whole provider — [`crate::rc::VerbsRc`] (`verbs-rc`) and
//! [`crate::ud::VerbsUd`] (`verbs-ud`) implement `Provider` and run on their own — and these
//! traits are the rest of what a composition needs, declared in one place rather than reached
//! into: opening on the device the composition shares (one HCA per process, as on hardware:
//! one QP-context cache, one set of service threads), per-peer connection life (quiesce, quiet,
//! disconnect: the composition's connection budget closes and reopens connections), the
//! choice of RC-FP or RC-SR per message, and the sizes of the shared pools.
//!
//! **One sequencer.** A channel opened by a composition does not order what it delivers: a
//! composition numbers every message once, across all its channels, and restores that order on
//! receipt (`weft_proto::order`), so the RC channel hands on eager-ring records and
//! send/receive frames as they come instead of holding one behind the other a second time.
//! Opened on its own (`Provider::open`), verbs-rc orders them itself.

use crate::Hca;
use std::io::IoSlice;
use std::sync::Arc;
use weft_provider::bootstrap::Bootstrap;
use weft_provider::provider::{Provider, SendOutcome};
use weft_provider::types::Rank;
use weft_provider::Result;

/// Sizes a composition gives its RC channel ([`RcChannel::open_sized`]).
#[derive(Debug, Clone, Copy)]
pub struct Sizing {
    /// Peers with RC-FP slots at most (`WEFT_VERBS_RC_FP_PEERS`).
    pub fp_peers: usize,
    /// Messages received from a peer over RC before its slots are set up
    /// (`WEFT_VERBS_RC_FP_THRESHOLD`; 0: at connection).
    pub fp_threshold: u64,
    /// Active-message payload of one RC send (`WEFT_VERBS_RC_BUF`).
    pub buf: usize,
    /// Receive buffers in the shared receive queue, and send buffers
    /// (`WEFT_VERBS_RC_SRQ`, `WEFT_VERBS_RC_SEND_BUFS`).
    pub pool: usize,
    /// Connections the composition opens at most (its RC budget): the completion queue keeps
    /// room for that many keepalive probes rather than one per rank of the job. More
    /// connections still work; their keepalives then take turns.
    pub conns: usize,
    /// The largest active-message payload the composition sends through RC-FP: each slot is
    /// made large enough for it with the largest header and some slack
    /// ([`crate::rc::eager::Shape::fastpath_slot_for`]; `WEFT_VERBS_RC_FP_SIZE` instead when set). 0:
    /// that parameter's slots.
    pub fp_payload: usize,
    /// Slots of each RC-FP ring (`WEFT_VERBS_RC_FP_BUFS` instead when set; 0: that
    /// parameter's default): a composition may spread a memory budget over more peers with
    /// shallower rings.
    pub fp_bufs: usize,
    /// Send-queue depth of each RC queue pair (`WEFT_VERBS_RC_SQ` when set; 0: that
    /// parameter's default).
    pub sq: u32,
    /// Scatter-gather entries a work request needs at most: a composition that sends by copy
    /// and offers RMA on single buffers needs one, and each queue pair's send ring shrinks with
    /// it (0: as many as the device takes, up to 16).
    pub sges: usize,
}

/// An RC channel as a composition uses it ([`crate::rc::VerbsRc`]).
pub trait RcChannel: Provider + Sized {
    /// Open as one channel of a composition: the parameters of the environment, but RC-FP
    /// slots for at most `sizing.fp_peers` peers, and the slots' threshold, the eager buffer
    /// size and the shared pools' sizes given in `sizing` where the environment does not set
    /// them; delivery unordered (the composition sequences). `hca` is the device the
    /// composition's other channels use too.
    fn open_sized(boot: &mut dyn Bootstrap, sizing: Sizing, hca: Arc<dyn Hca>) -> Result<Self>;

    /// `None` while the RC connection to `peer` is not up, else whether its eager slots (RC-FP)
    /// are set up: one look at the peer's record, asked on every send.
    fn route(&self, peer: Rank) -> Option<bool>;
    /// The RC connection to `peer` is up.
    fn connected(&self, peer: Rank) -> bool {
        self.route(peer).is_some()
    }
    /// This process writes into an eager ring in `peer`'s memory.
    fn fast_path_to(&self, peer: Rank) -> bool;
    /// The largest active message (header and payload) an eager slot takes; 0 without slots.
    fn ring_max(&self) -> usize;
    /// Eager-ring memory of one peer, both directions, with the geometry in force.
    fn ring_bytes_per_peer(&self) -> u64;
    /// Set up RC-FP slots for the connected `peer` if it has none and the slot budget allows.
    fn open_fast_path(&mut self, peer: Rank) -> Result<()>;
    /// Send an active message through `dest`'s eager ring where `ring` allows and the ring
    /// takes it, else by RC send/receive.
    fn am_send_via(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
        ring: bool,
    ) -> Result<SendOutcome>;
    /// Stop posting anything to `peer`: sends are refused (`Busy`), no ring write, credit,
    /// offer or keepalive goes out, and an error completion no longer fails the peer; what it
    /// already wrote is still taken in. Then wait for [`RcChannel::quiet`].
    fn quiesce(&mut self, peer: Rank) -> Result<()>;
    /// RDMA operations towards `peer` can be posted (up, or closing with its QP still there).
    fn rdma_open(&self, peer: Rank) -> bool;
    /// Nothing of ours towards `peer` is in flight or queued.
    fn quiet(&self, peer: Rank) -> bool;
    /// Tear down the connection to `peer` (after [`RcChannel::quiesce`], once
    /// [`RcChannel::quiet`]): a later `connect` makes a fresh connection of a new generation.
    /// The caller makes sure both sides have taken in everything the other sent.
    fn disconnect(&mut self, peer: Rank) -> Result<()>;
}

/// A UD channel as a composition uses it ([`crate::ud::VerbsUd`]): the provider contract, opened
/// on the composition's device.
pub trait UdChannel: Provider + Sized {
    /// Open on `hca`, which the composition shares with its other channels.
    fn open_on(boot: &mut dyn Bootstrap, hca: Arc<dyn Hca>) -> Result<Self>;
}

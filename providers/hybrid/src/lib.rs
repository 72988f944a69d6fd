//! The `hybrid` provider (paper 001, MVAPICH-Aptus; issue 21): every InfiniBand channel of
//! verbs-rc and verbs-ud at once, chosen per message by a chain of send rules, with RC channels
//! opened lazily under per-process limits.
//!
//! Built so far, each without I/O and tested on its own:
//! - [`rules`]: the send-rule chain — parsing `WEFT_HYBRID_RULES`, the paper's default chain,
//!   the check that a peer reached by UD alone can be sent every message, and the choice of a
//!   channel for a message;
//! - [`order`]: per-peer sequence numbers across channels and the receiver's reordering, so
//!   that a message on a newly opened RC connection cannot overtake one still on UD-SR;
//! - [`budget`]: lazy RC allocation under `max_rc` / `max_fp` with the agreement of both
//!   sides (crossing requests make one connection), back-off after a refusal, and the
//!   rebalancing that closes an idle connection, both sides draining first, for a busier peer.
//!
//! - the provider (`Hybrid`, registered as `hybrid`) drives them over verbs-rc's and
//!   verbs-ud's channels;
//! - [`auto`]: `WEFT_HYBRID_RULES=auto`, a chain from channel costs measured per host (cached);
//! - [`scale`]: the synthetic scale run — one process holding the resources of a job of
//!   thousands of ranks (phantom peers), for the memory table.

pub mod auto;
pub mod budget;
mod provider;
pub mod rules;
pub mod scale;
pub mod wire;

pub use provider::{chain_in_force, limits_in_force, Hybrid};

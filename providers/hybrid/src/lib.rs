//! The `hybrid` provider (paper 001, MVAPICH-Aptus; issue 21): every InfiniBand channel of
//! verbs-rc and verbs-ud at once, chosen per message by a chain of send rules, with RC channels
//! opened lazily under per-process limits.
//!
//! Built so far: the send-rule chain ([`rules`]) — parsing `WEFT_HYBRID_RULES`, the paper's
//! default chain, the check that a peer reached by UD alone can be sent every message, and the
//! choice of a channel for a message. The provider itself (composing the channels, ordering
//! across them, lazy allocation) is not built yet and is not registered.

pub mod rules;

//! `verbs-ud`: weft's InfiniBand Unreliable Datagram provider — the UD channel of `weft-verbs`
//! ([`weft_verbs::ud`], where its design and code live) under the name `verbs-ud` in the
//! provider registry. One UD queue pair for every peer, constant memory per peer, reliability
//! and order by `weft_proto::reliable`, UD zero-copy for large messages; RMA and atomics by
//! the core's active-message path.
//!
//! The hybrid provider composes the same channel through [`weft_verbs::channel::UdChannel`].

pub use weft_verbs::ud::*;

weft_provider::register_provider!(
    VerbsUd,
    priority = 7,
    summary = "InfiniBand Unreliable Datagram on the verbs layer (soft HCA or rdma-core): one UD queue pair for every peer, constant memory per peer, reliability and order by a sans-IO engine; RMA and atomics by active messages"
);

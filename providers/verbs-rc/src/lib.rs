//! `verbs-rc`: weft's InfiniBand Reliable Connection provider — the RC channel of `weft-verbs`
//! ([`weft_verbs::rc`], where its design and code live) under the name `verbs-rc` in the
//! provider registry. Lazy RC connections, send/receive over a shared receive queue, eager
//! rings (MVAPICH's fast path, paper 000's designs), native RDMA read/write and HCA atomics,
//! read or write rendezvous; on the soft HCA or a real HCA through rdma-core.
//!
//! The hybrid provider composes the same channel through [`weft_verbs::channel::RcChannel`].

pub use weft_verbs::rc::*;

weft_provider::register_provider!(
    VerbsRc,
    priority = 8,
    summary = "InfiniBand Reliable Connection on the verbs layer (soft HCA or rdma-core): lazy RC connections, RC send/receive over a shared receive queue, native RDMA read/write and HCA atomics"
);

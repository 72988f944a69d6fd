//! # weft-proto
//!
//! weft's protocol layer for providers — what libfabric keeps in `prov/util`: mechanisms a
//! provider needs on top of its fabric that know nothing of any fabric, written once, without
//! I/O, and tested here so that every provider (built in or a third party's) gets them right
//! by using them.
//!
//! * [`reliable`] — reliability over unreliable datagrams, one [`reliable::Link`] per peer:
//!   sequence numbers, cumulative acknowledgements, retransmission with a measured timeout,
//!   in-order delivery, peer failure (verbs-ud's UD-SR, and so hybrid's).
//! * [`order`] — per-peer order across paths that may overtake each other:
//!   [`order::Sequencer`] on the sending side, [`order::Reorder`] and the bounded
//!   [`order::Holding`] on the receiving side (hybrid across its channels, ofi over a fabric
//!   that does not order completions, verbs-rc between its eager ring and send/receive).
//! * [`slab`] — a generational operation table ([`slab::Slab`]): ids that a late completion
//!   cannot mistake for the operation that reuses a slot (the core's requests, verbs-rc's
//!   RMA and atomic work requests).
//! * [`book`] — the address book: peers' published addresses, looked up at first contact, and
//!   the fabric's handle for each made once (verbs-rc's and verbs-ud's UD address handles).
//! * [`sim`] — a simulated network for tests of these engines and of providers' own: a seeded
//!   generator and a wire on virtual time that loses, duplicates and reorders from the seed.
//! * [`testkit`] — a provider's own tests with ranks as threads: a sink that keeps events,
//!   bounded waits, a job of `n` ranks.
//! * [`sync`] — the atomics and cells of lock-free structures, switched to loom's under
//!   `--cfg loom` (shm's queues and locks, the soft HCA's rings).
//!
//! It is a crate of its own rather than a module of `weft-provider` because `weft-provider` is
//! the contract, kept small and stable for every provider (C ones through the ABI included);
//! these are tools a provider may take or leave, and change as the providers learn. It depends
//! on `weft-provider` alone (for ranks, errors, the bootstrap and `PeerTable`); the core and
//! providers depend on it.

pub mod book;
pub mod order;
pub mod reliable;
pub mod sim;
pub mod slab;
pub mod sync;
pub mod testkit;

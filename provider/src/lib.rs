//! # weft-provider
//!
//! The contract between weft and a fabric provider, and what a provider needs to build on it —
//! nothing of the core. A provider crate depends on this crate alone; the core (`weft`) depends
//! on it too and re-exports it, so applications never name it.
//!
//! * [`provider`] — the contract: [`Provider`] (mandatory: active messages; optional: tagged
//!   matching, registration and RMA, atomics, counters), [`Sink`] (what `progress` reports into),
//!   [`Caps`], [`StaticProvider`] (how a built-in provider is probed and opened).
//! * [`bootstrap`] — what `open` is given: rank, size, node map and the job's key-value space.
//! * [`registry`] — [`register_provider!`] for built-in providers; [`param!`] ([`param`]) for
//!   their tunables; [`export_provider!`] ([`sdk`]) to ship a provider as a `.so` through the C
//!   ABI.
//! * [`types`], [`Error`] — ranks, element types, operations, the atomic capability table, and
//!   errors as values.
//! * Helpers providers share: [`shmem`] (named shared mappings, per-rank liveness by process
//!   handle), [`pool`] (recycled buffers).
//!
//! The contract itself is documented in [`provider`] and, for authors, in
//! `docs/writing-a-provider.md`.

pub mod backoff;
pub mod bootstrap;
pub mod bytes;
pub mod cma;
mod error;
pub mod param;
pub mod peers;
pub mod pool;
pub mod provider;
pub mod registry;
pub mod sdk;
pub mod shmem;
pub mod types;

pub use error::{Error, ErrorDetail, ErrorKind, Result};
pub use pool::BufPool;
pub use provider::*;
pub use types::{BasicType, Element, Op, Rank, Status};

#[doc(hidden)]
pub use linkme as __linkme;

//! Helpers of the in-process tests: ranks as threads of one process, each with its own soft
//! HCA; every wait bounded (`weft_proto::testkit`).
#![allow(dead_code, unused_imports)]

use std::sync::{Arc, Barrier};
use weft_provider::provider::StaticProvider;
use weft_verbs_ud::VerbsUd;

pub use weft_proto::testkit::{counter, send, until, Events, T};

/// Run `f` on `n` ranks, each with its own provider.
pub fn world<R: Send + 'static>(
    n: u32,
    f: impl Fn(VerbsUd, Arc<Barrier>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    weft_proto::testkit::world(n, |b| VerbsUd::open(b).unwrap(), f)
}

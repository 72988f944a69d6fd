//! Helpers of the in-process tests: ranks as threads of one process, each with its own soft
//! HCA; every wait bounded (`weft_proto::testkit`).
#![allow(dead_code, unused_imports)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use weft_provider::provider::{Provider, StaticProvider};
use weft_verbs_rc::VerbsRc;

pub use weft_proto::testkit::{counter, send, until, Events, T};

/// Run `f` on `n` ranks, each with its own provider.
pub fn world<R: Send + 'static>(
    n: u32,
    f: impl Fn(VerbsRc, Arc<Barrier>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    weft_proto::testkit::world(n, |b| VerbsRc::open(b).unwrap(), f)
}

/// A burst of `n` messages of 4 KiB from rank 0 to rank 1, which takes them in only once rank
/// 0 has posted them all: meanwhile its receives run out, or rank 0's sends pile up. `posted`
/// runs on rank 0 right after its last post; rank 0 then drives its HCA (which retries what
/// rank 1's queue refused) until rank 1 has checked every message, in order. `phase` starts
/// at 0 and is shared by the two ranks.
pub fn burst(
    p: &mut VerbsRc,
    ev: &mut Events,
    phase: &AtomicU32,
    n: usize,
    posted: impl FnOnce(&VerbsRc),
) {
    let t0 = Instant::now();
    if p.rank() == 0 {
        for i in 0..n {
            send(p, ev, 1, &(i as u32).to_le_bytes(), &[i as u8; 4096]);
        }
        posted(p);
        phase.store(1, Ordering::Release);
        while phase.load(Ordering::Acquire) < 2 {
            p.progress(ev).unwrap();
            assert!(t0.elapsed() < T, "rank 0: rank 1 never had the burst");
        }
    } else {
        // Not polling while rank 0 posts (its HCA places the messages; ours need not run).
        while phase.load(Ordering::Acquire) < 1 {
            std::thread::yield_now();
            assert!(t0.elapsed() < T, "rank 1: timed out waiting for the burst");
        }
        let before = ev.am.len();
        until(p, ev, "the burst", |e| e.am.len() == before + n);
        for (i, (src, h, d)) in ev.am[before..].iter().enumerate() {
            assert_eq!((*src, h.as_slice()), (0, &(i as u32).to_le_bytes()[..]));
            assert!(
                d.len() == 4096 && d.iter().all(|&b| b == i as u8),
                "message {i}"
            );
        }
        phase.store(2, Ordering::Release);
    }
}

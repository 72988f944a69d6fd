//! Helpers of the in-process tests: ranks as threads of one process, each with its own soft
//! HCA; every wait bounded.
#![allow(dead_code)]

use std::io::IoSlice;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::{
    Completed, ConnEvent, Provider, SendOutcome, Sink, StaticProvider, Token,
};
use weft_provider::{Rank, Result};
use weft_verbs_rc::VerbsRc;

pub const T: Duration = Duration::from_secs(20);

#[derive(Default)]
pub struct Events {
    pub am: Vec<(Rank, Vec<u8>, Vec<u8>)>,
    pub done: Vec<(Token, Result<Completed>)>,
    pub failed: Vec<(Rank, String)>,
    pub connected: Vec<Rank>,
}

impl Sink for Events {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        self.am.push((src, header.to_vec(), payload.to_vec()));
    }
    fn complete(&mut self, token: Token, result: Result<Completed>) {
        self.done.push((token, result));
    }
    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        self.failed.push((rank, reason.to_string()));
    }
    fn connection(&mut self, peer: Rank, e: ConnEvent) {
        if e == ConnEvent::Connected {
            self.connected.push(peer);
        }
    }
}

/// Progress until `cond` holds, at most `T`.
pub fn until(p: &mut VerbsRc, ev: &mut Events, what: &str, cond: impl Fn(&Events) -> bool) {
    let t0 = Instant::now();
    while !cond(ev) {
        p.progress(ev).unwrap();
        assert!(
            t0.elapsed() < T,
            "rank {}: timed out waiting for {what}",
            p.rank()
        );
    }
}

/// Send one active message, progressing while the provider says `Busy`.
pub fn send(p: &mut VerbsRc, ev: &mut Events, dest: Rank, h: &[u8], data: &[u8]) {
    let t0 = Instant::now();
    while p.am_send(dest, h, &[IoSlice::new(data)]).unwrap() == SendOutcome::Busy {
        p.progress(ev).unwrap();
        assert!(t0.elapsed() < T, "send to {dest} stayed busy");
    }
}

pub fn counter(p: &VerbsRc, name: &str) -> u64 {
    p.counters()
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |(_, v)| *v)
}

/// Run `f` on `n` ranks, each with its own provider.
pub fn world<R: Send + 'static>(
    n: u32,
    f: impl Fn(VerbsRc, Arc<Barrier>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let job = InProcessJob::new(n, T);
    let bar = Arc::new(Barrier::new(n as usize));
    let f = Arc::new(f);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let (job, bar, f) = (job.clone(), bar.clone(), f.clone());
            std::thread::spawn(move || {
                let p = VerbsRc::open(&mut job.rank(r)).unwrap();
                f(p, bar)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
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

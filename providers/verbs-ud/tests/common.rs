//! Helpers of the in-process tests: ranks as threads of one process, each with its own soft
//! HCA; every wait bounded.
#![allow(dead_code)]

use std::io::IoSlice;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::{
    Completed, ConnEvent, Provider, SendOutcome, Sink, StaticProvider, Token,
};
use weft_provider::{Rank, Result};
use weft_verbs_ud::VerbsUd;

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
pub fn until(p: &mut VerbsUd, ev: &mut Events, what: &str, cond: impl Fn(&Events) -> bool) {
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
pub fn send(p: &mut VerbsUd, ev: &mut Events, dest: Rank, h: &[u8], data: &[u8]) {
    let t0 = Instant::now();
    while p.am_send(dest, h, &[IoSlice::new(data)]).unwrap() == SendOutcome::Busy {
        p.progress(ev).unwrap();
        assert!(t0.elapsed() < T, "send to {dest} stayed busy");
    }
}

pub fn counter(p: &VerbsUd, name: &str) -> u64 {
    p.counters()
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |(_, v)| *v)
}

/// Run `f` on `n` ranks, each with its own provider.
pub fn world<R: Send + 'static>(
    n: u32,
    f: impl Fn(VerbsUd, Arc<Barrier>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let job = InProcessJob::new(n, T);
    let bar = Arc::new(Barrier::new(n as usize));
    let f = Arc::new(f);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let (job, bar, f) = (job.clone(), bar.clone(), f.clone());
            std::thread::spawn(move || {
                let p = VerbsUd::open(&mut job.rank(r)).unwrap();
                f(p, bar)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

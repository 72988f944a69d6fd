//! Helpers for a provider's own tests, ranks as threads of one process: a sink that keeps
//! what progress reports ([`Events`]), bounded waits ([`until`], [`wait`], [`send`]) that fail
//! loudly instead of hanging, a provider's counter by name, a job of `n` ranks
//! ([`world`]), and the CPU time a thread ran ([`thread_cpu_ticks`]). Every wait is bounded by [`T`].

use std::io::IoSlice;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weft_provider::bootstrap::{InProcess, InProcessJob};
use weft_provider::provider::{Completed, ConnEvent, Provider, SendOutcome, Sink, Token};
use weft_provider::{Rank, Result};

/// How long any wait of a test may take before it fails.
pub const T: Duration = Duration::from_secs(20);

/// What a provider's `progress` reported, kept in order.
#[derive(Default, Debug)]
pub struct Events {
    /// Active messages: source, header, payload.
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

impl Events {
    /// Take the completion of `t`, if it came.
    pub fn take(&mut self, t: Token) -> Option<Result<Completed>> {
        let i = self.done.iter().position(|d| d.0 == t)?;
        Some(self.done.remove(i).1)
    }
}

/// Progress `p` until `cond` holds; panics (naming `what`) after [`T`].
pub fn until<P: Provider + ?Sized>(
    p: &mut P,
    ev: &mut Events,
    what: &str,
    mut cond: impl FnMut(&mut Events) -> bool,
) {
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

/// Progress until the completion of `t` comes, and take it.
pub fn wait<P: Provider + ?Sized>(p: &mut P, ev: &mut Events, t: Token) -> Result<Completed> {
    let mut out = None;
    until(p, ev, &format!("token {t}"), |e| {
        out = e.take(t);
        out.is_some()
    });
    out.expect("until returned: the completion came")
}

/// Send one active message, progressing while the provider says `Busy`.
pub fn send<P: Provider + ?Sized>(p: &mut P, ev: &mut Events, dest: Rank, h: &[u8], data: &[u8]) {
    let t0 = Instant::now();
    while p.am_send(dest, h, &[IoSlice::new(data)]).unwrap() == SendOutcome::Busy {
        p.progress(ev).unwrap();
        assert!(t0.elapsed() < T, "send to {dest} stayed busy");
    }
}

/// The provider's counter `name` (0 if it has none of that name).
pub fn counter<P: Provider + ?Sized>(p: &P, name: &str) -> u64 {
    p.counters()
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |(_, v)| *v)
}

/// Run `f` on `n` ranks, threads of this process, each with the provider `open` makes from its
/// rank's bootstrap; the results in rank order.
pub fn world<P, R: Send + 'static>(
    n: u32,
    open: impl Fn(&mut InProcess) -> P + Send + Sync + 'static,
    f: impl Fn(P, Arc<Barrier>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let job = InProcessJob::new(n, T);
    let bar = Arc::new(Barrier::new(n as usize));
    let (open, f) = (Arc::new(open), Arc::new(f));
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let (job, bar, open, f) = (job.clone(), bar.clone(), open.clone(), f.clone());
            std::thread::spawn(move || f(open(&mut job.rank(r)), bar))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("a rank's thread panicked"))
        .collect()
}

/// CPU time the calling thread has run so far, in clock ticks (1/100 s), from
/// `/proc/thread-self/stat`: for tests that a wait leaves the CPU to others.
pub fn thread_cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("/proc/thread-self/stat");
    // The command name may hold spaces: the fields after it start at the last ')'.
    let rest = &stat[stat.rfind(')').expect("a command name") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime, fields 14 and 15 of the whole line.
    let tick = |i: usize| f[i].parse::<u64>().expect("a tick count");
    tick(11) + tick(12)
}

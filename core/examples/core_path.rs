//! The core's own cost per small message, for callgrind (issue 23's lean path).
//!
//! `core_path blocking|pair static|dynamic N` runs N iterations on a one-rank job over an
//! *echo* provider defined here: `am_send` copies the message into one fixed slot (no
//! allocation, no queue) and the next `progress` hands it back as an arrival from rank 0. The
//! provider's share is thus a few dozen instructions, attributed to its own functions
//! (`Echo::am_send`, `Echo::progress` minus the sink it calls), so that
//! `callgrind_annotate --inclusive=yes` separates the core from it:
//!
//! * `blocking`: an 8-byte `send` to self (`one_send`: the core's send on the static path, the
//!   provider takes the message at once), then a blocking `recv` (`one_recv`): the receive is
//!   posted before the message arrives (the provider holds it until `progress`), so it is
//!   matched from the arrival — the receive side — then completed.
//! * `isend`: as `blocking`, with the send an `isend` and its `wait` (`one_isend`), all in
//!   one scope.
//! * `pair`: an `irecv` + `isend` + both waits inside a scope (the nonblocking API).
//!
//! Per-message figures come from the difference of two runs (N and 2N), which removes set-up.

use std::io::IoSlice;
use std::time::Duration;
use weft::bootstrap::InProcessJob;
use weft::provider::{Caps, SendOutcome, Sink};
use weft::{Comm, DynProvider, EngineConfig, Provider, Rank, Result, World};

/// A one-rank provider that hands every active message back to its sender.
struct Echo {
    caps: Caps,
    hlen: usize,
    plen: usize,
    full: bool,
    slot: [u8; 256],
}

impl Echo {
    fn new() -> Self {
        Echo {
            caps: Caps::am_only(64, 128, 4),
            hlen: 0,
            plen: 0,
            full: false,
            slot: [0; 256],
        }
    }
}

impl Provider for Echo {
    fn name(&self) -> &str {
        "echo"
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        0
    }
    fn size(&self) -> u32 {
        1
    }
    #[inline(never)]
    fn am_send(
        &mut self,
        _dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        if self.full {
            return Ok(SendOutcome::Busy);
        }
        self.hlen = header.len();
        self.slot[..header.len()].copy_from_slice(header);
        let mut at = 64;
        for p in payload {
            self.slot[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        self.plen = at - 64;
        self.full = true;
        Ok(SendOutcome::Sent)
    }
    #[inline(never)]
    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        if !self.full {
            return Ok(0);
        }
        self.full = false;
        let (h, p) = self.slot.split_at(64);
        sink.am(0, &h[..self.hlen], &p[..self.plen]);
        Ok(1)
    }
}

#[inline(never)]
fn one_send<P: Provider>(c: &Comm<P>, out: &[u64; 1]) {
    c.send(out, 0, 1).unwrap();
}

#[inline(never)]
fn one_isend<'s, P: Provider>(c: &Comm<P>, s: &'s weft::Scope<'s, '_, P>, out: &'s [u64; 1]) {
    c.isend(s, out, 0, 1).unwrap().wait().unwrap();
}

#[inline(never)]
fn one_recv<P: Provider>(c: &Comm<P>, inb: &mut [u64; 1]) {
    c.recv(inb, 0u32, 1).unwrap();
}

fn run<P: Provider>(c: &Comm<P>, mode: &str, n: usize) {
    let out = [42u64];
    let mut inb = [0u64];
    match mode {
        "blocking" => {
            for _ in 0..n {
                one_send(c, &out);
                one_recv(c, &mut inb);
            }
            assert_eq!(inb, out);
        }
        "isend" => {
            c.scope(|s| {
                for _ in 0..n {
                    one_isend(c, s, &out);
                    one_recv(c, &mut inb);
                }
            });
            assert_eq!(inb, out);
        }
        _ => {
            for _ in 0..n {
                c.scope(|s| {
                    let r = c.irecv(s, &mut inb, 0u32, 1).unwrap();
                    c.isend(s, &out, 0, 1).unwrap().wait().unwrap();
                    r.wait().unwrap();
                });
            }
            assert_eq!(inb, out);
        }
    }
}

fn main() {
    let mut a = std::env::args().skip(1);
    let mode = a.next().unwrap_or_else(|| "pair".into());
    let path = a.next().unwrap_or_else(|| "static".into());
    let n: usize = a.next().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let job = InProcessJob::new(1, Duration::from_secs(10));
    let b = job.rank(0);
    let p = Echo::new();
    let t0 = std::time::Instant::now();
    if path == "dynamic" {
        let w = World::from_parts(
            Box::new(p) as DynProvider,
            Box::new(b),
            EngineConfig::default(),
        )
        .unwrap();
        run(w.comm(), &mode, n);
    } else {
        let w = World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap();
        run(w.comm(), &mode, n);
    }
    println!(
        "{mode} {path}: {:.1} ns per iteration",
        t0.elapsed().as_nanos() as f64 / n as f64
    );
}

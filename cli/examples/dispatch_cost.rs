//! Instruction-count probe for the core's per-message cost (used with valgrind/callgrind):
//! `dispatch_cost static|dynamic N` runs N 8-byte self-sends (irecv + isend + wait) on loopback.

use std::time::Duration;
use weft::bootstrap::InProcessJob;
use weft::{Comm, DynProvider, EngineConfig, Provider, World};
use weft_loopback::{Loopback, LoopbackConfig};

fn roundtrips<P: Provider>(c: &Comm<P>, n: usize) {
    let out = [42u64];
    let mut inb = [0u64];
    for _ in 0..n {
        c.scope(|s| {
            let r = c.irecv(s, &mut inb, 0u32, 1).unwrap();
            c.isend(s, &out, 0, 1).unwrap().wait().unwrap();
            r.wait().unwrap();
        });
    }
}

fn main() {
    let mut a = std::env::args().skip(1);
    let mode = a.next().unwrap_or_else(|| "static".into());
    let n: usize = a.next().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let job = InProcessJob::new(1, Duration::from_secs(10));
    let mut b = job.rank(0);
    let cfg = LoopbackConfig {
        eager: 16 << 10,
        depth: 4096,
        rma: false,
        ..Default::default()
    };
    let p = Loopback::open_with(&mut b, &cfg).unwrap();
    let t0 = std::time::Instant::now();
    if mode == "dynamic" {
        let w = World::from_parts(
            Box::new(p) as DynProvider,
            Box::new(b),
            EngineConfig::default(),
        )
        .unwrap();
        roundtrips(w.comm(), n);
    } else {
        let w = World::from_parts(p, Box::new(b), EngineConfig::default()).unwrap();
        roundtrips(w.comm(), n);
    }
    println!(
        "{mode}: {:.1} ns per message",
        t0.elapsed().as_nanos() as f64 / n as f64
    );
}

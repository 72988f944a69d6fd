//! Keepalive probes take turns when a process holds more connections than its completion queue
//! keeps room for probes (a composition's budget; verbs-rc alone: 256): each connection is still
//! probed, so a rank that only waits still finds a dead peer, whichever it is. (Its own test
//! binary: it sets environment variables.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::{Provider, SendOutcome};
use weft_verbs_rc::{RcChannel, Sizing, VerbsRc};

mod common;
use common::Events;

#[test]
fn probes_take_turns_and_find_the_last_peer_dead() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    // A round every 20 ms; a probe to a dead peer fails after 4 x 67 ms.
    std::env::set_var("WEFT_VERBS_RC_KEEPALIVE", "0.02");
    std::env::set_var("WEFT_VERBS_RC_TIMEOUT", "14");
    std::env::set_var("WEFT_VERBS_RC_RETRY", "3");
    let n = 5u32;
    let t = Duration::from_secs(30);
    let job = InProcessJob::new(n, t);
    let bar = Arc::new(Barrier::new(n as usize));
    let found = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let (job, bar, found) = (job.clone(), bar.clone(), found.clone());
            std::thread::spawn(move || {
                // A budget of one connection: room for two probes (one more for the
                // connection to ourselves), against rank 0's four connections.
                let sizing = Sizing {
                    fp_peers: 0,
                    fp_threshold: 0,
                    buf: 1024,
                    pool: 16,
                    conns: 1,
                    fp_payload: 0,
                    fp_bufs: 0,
                    sq: 16,
                    sges: 1,
                };
                let hca = weft_verbs::open_default().unwrap();
                let mut p = VerbsRc::open_sized(&mut job.rank(r), sizing, hca).unwrap();
                let mut seen = Events::default();
                let t0 = Instant::now();
                if r == 0 {
                    for d in 1..n {
                        while p.am_send(d, b"hi", &[]).unwrap() != SendOutcome::Sent {
                            p.progress(&mut seen).unwrap();
                            assert!(t0.elapsed() < t, "send to {d} stayed busy");
                        }
                    }
                } else {
                    while seen.am.is_empty() {
                        p.progress(&mut seen).unwrap();
                        assert!(t0.elapsed() < t, "rank {r}: no message");
                    }
                }
                // Rank 0's sends complete (so that nothing is in flight and the probes
                // start), then the last rank leaves without a word.
                let t1 = Instant::now();
                while t1.elapsed() < Duration::from_millis(50) {
                    p.progress(&mut seen).unwrap();
                }
                bar.wait();
                if r == n - 1 {
                    drop(p);
                    return (0, vec![]);
                }
                // Rank 0 only waits; the others keep their ends up until it has found the
                // dead one.
                let t0 = Instant::now();
                while !found.load(Ordering::Acquire) {
                    p.progress(&mut seen).unwrap();
                    if r == 0 && seen.failed.iter().any(|(f, _)| *f == n - 1) {
                        found.store(true, Ordering::Release);
                    }
                    assert!(
                        t0.elapsed() < t,
                        "rank {r}: the dead rank {} was not found",
                        n - 1
                    );
                }
                (
                    p.counters()
                        .iter()
                        .find(|(k, _)| *k == "keepalives")
                        .map_or(0, |(_, v)| *v),
                    seen.failed.iter().map(|(f, _)| *f).collect(),
                )
            })
        })
        .collect();
    let out: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(
        out[0].1,
        vec![n - 1],
        "rank 0 finds the dead rank, and only it"
    );
    assert!(
        out[0].0 >= u64::from(n - 1),
        "rank 0 probed in turns: {} probes",
        out[0].0
    );
}

//! A composition's send pool (`VerbsRc::open_sized`): one chunk of send buffers at the first
//! connection, more only when sends outpace their completions, never past the size asked for.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::Provider;
use weft_verbs_rc::{Sizing, VerbsRc};

mod common;
use common::*;

/// Sends rank 0 posts without polling: three chunks' worth.
const BURST: usize = 48;

#[test]
fn a_compositions_send_pool_starts_with_one_chunk_and_grows_with_the_sends_in_flight() {
    let job = InProcessJob::new(2, T);
    let bar = Arc::new(Barrier::new(2));
    let phase = Arc::new(AtomicU32::new(0));
    let sizing = Sizing {
        fp_peers: 0,
        fp_threshold: 0,
        buf: 8192,
        pool: 128,
        conns: 1,
        fp_payload: 0,
    };
    let hs: Vec<_> = (0..2u32)
        .map(|r| {
            let (job, bar, phase) = (job.clone(), bar.clone(), phase.clone());
            std::thread::spawn(move || {
                let hca = weft_verbs::open_default().unwrap();
                let mut p = VerbsRc::open_sized(&mut job.rank(r), sizing, hca).unwrap();
                let mut ev = Events::default();
                // No connection yet: a placeholder only.
                assert_eq!(counter(&p, "send_pool_slots"), 1, "rank {r}");
                bar.wait();
                send(&mut p, &mut ev, 1 - r, b"hello", &[]);
                until(&mut p, &mut ev, "hello", |e| !e.am.is_empty());
                assert_eq!(counter(&p, "send_pool_slots"), 16, "rank {r}: one chunk");
                let quiet = counter(&p, "mem_buffer_bytes");
                bar.wait();
                let t0 = Instant::now();
                if r == 0 {
                    // Posted without a progress call in between: every send holds its buffer.
                    for i in 0..BURST {
                        let h = (i as u32).to_le_bytes();
                        send(&mut p, &mut ev, 1, &h, &[i as u8; 4096]);
                    }
                    let slots = counter(&p, "send_pool_slots");
                    assert!(
                        (BURST as u64..=128).contains(&slots),
                        "{slots} send buffers for {BURST} sends in flight"
                    );
                    assert!(counter(&p, "send_pool_grows") >= 2);
                    let grown = counter(&p, "mem_buffer_bytes");
                    assert!(grown >= quiet + 32 * 8192, "{quiet} -> {grown} bytes");
                    phase.store(1, Ordering::Release);
                    while phase.load(Ordering::Acquire) < 2 {
                        p.progress(&mut ev).unwrap();
                        assert!(t0.elapsed() < T, "rank 0: rank 1 never had the burst");
                    }
                } else {
                    while phase.load(Ordering::Acquire) < 1 {
                        std::thread::yield_now();
                        assert!(t0.elapsed() < T, "rank 1: timed out waiting for the burst");
                    }
                    until(&mut p, &mut ev, "the burst", |e| e.am.len() == 1 + BURST);
                    for (i, (src, h, d)) in ev.am[1..].iter().enumerate() {
                        assert_eq!((*src, h.as_slice()), (0, &(i as u32).to_le_bytes()[..]));
                        assert!(
                            d.len() == 4096 && d.iter().all(|&b| b == i as u8),
                            "msg {i}"
                        );
                    }
                    // Rank 1 sent one message: its pool never grew.
                    assert_eq!(counter(&p, "send_pool_slots"), 16);
                    phase.store(2, Ordering::Release);
                }
                assert!(ev.failed.is_empty(), "{:?}", ev.failed);
                bar.wait();
                p.close().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

//! A composition's send pool (`VerbsRc::open_sized`): one chunk of send buffers at the first
//! connection, more only when sends outpace their completions, never past the size asked for.

use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Barrier};
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
                // Posted without a progress call in between: every send holds its buffer.
                burst(&mut p, &mut ev, &phase, BURST, |p| {
                    let slots = counter(p, "send_pool_slots");
                    assert!(
                        (BURST as u64..=128).contains(&slots),
                        "{slots} send buffers for {BURST} sends in flight"
                    );
                    assert!(counter(p, "send_pool_grows") >= 2);
                    let grown = counter(p, "mem_buffer_bytes");
                    assert!(grown >= quiet + 32 * 8192, "{quiet} -> {grown} bytes");
                });
                if r == 1 {
                    // Rank 1 sent one message: its pool never grew.
                    assert_eq!(counter(&p, "send_pool_slots"), 16);
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

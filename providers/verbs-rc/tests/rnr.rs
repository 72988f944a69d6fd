//! A shared receive queue that runs dry loses nothing: the sender's HCA retries after the RNR
//! timer until the receiver posts again, and counts it (`hca_rnr_naks`). Its own test binary:
//! it sets the queue's size in the environment.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;
use weft_provider::provider::Provider;

mod common;
use common::*;

/// More messages than the receiver has receives posted, fewer than a send queue holds.
const BURST: usize = 48;

#[test]
fn a_dry_shared_receive_queue_delays_but_loses_nothing() {
    std::env::set_var("WEFT_VERBS_RC_SRQ", "16");
    // Send/receive only: every message takes a receive from the shared queue.
    std::env::set_var("WEFT_VERBS_RC_FP_PEERS", "0");
    let phase = Arc::new(AtomicU32::new(0));
    world(2, move |mut p, bar| {
        let mut ev = Events::default();
        let r = p.rank();
        bar.wait();
        send(&mut p, &mut ev, 1 - r, b"hello", &[]);
        until(&mut p, &mut ev, "hello", |e| !e.am.is_empty());
        bar.wait();
        let t0 = Instant::now();
        if r == 0 {
            for i in 0..BURST {
                let h = (i as u32).to_le_bytes();
                send(&mut p, &mut ev, 1, &h, &[i as u8; 4096]);
            }
            phase.store(1, Ordering::Release);
            // Keep driving our HCA (it retries what rank 1's queue refused).
            while phase.load(Ordering::Acquire) < 2 {
                p.progress(&mut ev).unwrap();
                assert!(t0.elapsed() < T, "rank 0: rank 1 never had the burst");
            }
            assert!(counter(&p, "hca_rnr_naks") >= 1, "no RNR with 16 receives");
        } else {
            // Not polling while rank 0 posts: the 16 receives are used up (its HCA places
            // the messages; ours need not be driven).
            while phase.load(Ordering::Acquire) < 1 {
                std::thread::yield_now();
                assert!(t0.elapsed() < T, "rank 1: timed out waiting for the burst");
            }
            until(&mut p, &mut ev, "the burst", |e| e.am.len() == 1 + BURST);
            for (i, (src, h, d)) in ev.am[1..].iter().enumerate() {
                assert_eq!((*src, h.as_slice()), (0, &(i as u32).to_le_bytes()[..]));
                assert!(
                    d.len() == 4096 && d.iter().all(|&b| b == i as u8),
                    "message {i}"
                );
            }
            phase.store(2, Ordering::Release);
        }
        assert!(ev.failed.is_empty(), "{:?}", ev.failed);
        bar.wait();
        p.close().unwrap();
    });
}

//! A shared receive queue that runs dry loses nothing: the sender's HCA retries after the RNR
//! timer until the receiver posts again, and counts it (`hca_rnr_naks`). Its own test binary:
//! it sets the queue's size in the environment.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
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
        // Rank 1's 16 receives are used up while rank 0 posts.
        burst(&mut p, &mut ev, &phase, BURST, |_| {});
        if r == 0 {
            assert!(counter(&p, "hca_rnr_naks") >= 1, "no RNR with 16 receives");
        }
        assert!(ev.failed.is_empty(), "{:?}", ev.failed);
        bar.wait();
        p.close().unwrap();
    });
}

//! `close` after the final barrier: what a rank posted just before closing still reaches its
//! peer. With the soft HCA's timing model on, a request is executed only once its link
//! latency has passed, so a QP destroyed right after the post drops it — as a real HCA may
//! drop what is still in its send queue. (Its own test binary: it sets the timing model's
//! environment variable.)

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use weft_provider::provider::Provider;

mod common;
use common::*;

#[test]
fn a_message_posted_just_before_close_is_delivered() {
    // 2 ms per message: far more than posting and closing take.
    std::env::set_var("WEFT_VERBS_SOFT_LATENCY_US", "2000");
    // Send/receive only (no fast path): the last message is a plain RC send.
    std::env::set_var("WEFT_VERBS_RC_FP_PEERS", "0");
    let ready = Arc::new(AtomicU32::new(0));
    world(2, move |mut p, bar| {
        let mut ev = Events::default();
        let peer = 1 - p.rank();
        bar.wait();
        // Connected, and one message each way.
        send(&mut p, &mut ev, peer, b"hello", &[]);
        until(&mut p, &mut ev, "hello", |e| !e.am.is_empty());
        // Progress (no barrier) until both have theirs: a request runs only while its
        // process calls into its HCA, under the timing model.
        ready.fetch_add(1, Ordering::AcqRel);
        until(&mut p, &mut ev, "the peer's hello", |_| {
            ready.load(Ordering::Acquire) == 2
        });
        if p.rank() == 0 {
            send(&mut p, &mut ev, peer, b"last", &[7u8; 100]);
            p.close().unwrap();
            drop(p);
        } else {
            until(&mut p, &mut ev, "the last message", |e| e.am.len() == 2);
            assert_eq!(ev.am[1].1, b"last");
            assert!(ev.failed.is_empty(), "{:?}", ev.failed);
        }
    });
}

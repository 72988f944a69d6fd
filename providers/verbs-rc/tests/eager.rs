//! Every eager design (`WEFT_VERBS_RC_EAGER`) through the provider contract, ranks as threads
//! with their own soft HCAs: a flood both ways of messages of mixed sizes, some through the
//! ring and some (too large for a fast-path slot, or the ring full) through send/receive,
//! arrives complete and in order. (Its own test binary: it sets environment variables, one
//! design after the other.)

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_provider::provider::Provider;

mod common;
use common::*;

fn flood(design: &'static str, n: u32, max: usize) -> Vec<Vec<(String, u64)>> {
    std::env::set_var("WEFT_VERBS_RC_EAGER", design);
    let done = Arc::new(AtomicU32::new(0));
    world(2, move |mut p, bar| {
        let mut ev = Events::default();
        let peer = 1 - p.rank();
        bar.wait();
        let size = |i: u32| ((i as usize).wrapping_mul(2_654_435_761) >> 7) % max;
        let mut sent = 0;
        let t0 = Instant::now();
        while sent < n || ev.am.len() < n as usize {
            if sent < n {
                let data: Vec<u8> = (0..size(sent)).map(|k| (k as u32 ^ sent) as u8).collect();
                if p.am_send(peer, &sent.to_le_bytes(), &[std::io::IoSlice::new(&data)])
                    .unwrap()
                    == weft_provider::provider::SendOutcome::Sent
                {
                    sent += 1;
                }
            }
            p.progress(&mut ev).unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{design}: stuck at sent {sent}, received {}, failed {:?}: {:?}",
                ev.am.len(),
                ev.failed,
                p.counters()
            );
        }
        assert!(ev.failed.is_empty(), "{design}: {:?}", ev.failed);
        for (i, (src, h, d)) in ev.am.iter().enumerate() {
            let i = i as u32;
            assert_eq!(*src, peer);
            assert_eq!(h, &i.to_le_bytes(), "{design}: message {i} out of order");
            assert_eq!(d.len(), size(i), "{design}: message {i}");
            assert!(
                d.iter()
                    .enumerate()
                    .all(|(k, b)| *b == (k as u32 ^ i) as u8),
                "{design}: message {i} garbled"
            );
        }
        // Keep answering until the peer has everything too (no barrier: a peer that failed
        // must not leave this one waiting forever).
        done.fetch_add(1, Ordering::AcqRel);
        let t0 = Instant::now();
        while done.load(Ordering::Acquire) < 2 {
            p.progress(&mut ev).unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{design}: the peer never finished"
            );
        }
        p.counters()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    })
}

fn get(c: &[(String, u64)], k: &str) -> u64 {
    c.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v)
}

#[test]
fn every_eager_design_delivers_in_order_both_ways() {
    // A small ring, so that it fills and the designs' acknowledgements are exercised.
    std::env::set_var("WEFT_VERBS_RC_RING", "64K");
    std::env::set_var("WEFT_VERBS_RC_CHUNK", "1K");
    std::env::set_var("WEFT_VERBS_RC_FP_THRESHOLD", "8");
    for design in ["basic", "piggyback", "pipeline", "fastpath"] {
        let cs = flood(design, 3000, 9000);
        for c in &cs {
            let ring = get(c, "eager_ring");
            // (When the ring is full, messages that fit a send buffer go that way.)
            assert!(
                ring > 300,
                "{design}: only {ring} messages went by the ring: {c:?}"
            );
            match design {
                "basic" => assert!(get(c, "pointer_writes") > 0, "{c:?}"),
                // Messages larger than a 4 KiB slot, and the first 8, go by send/receive.
                "fastpath" => assert!(get(c, "eager_send_recv") > 8, "{c:?}"),
                _ => {}
            }
        }
    }
}

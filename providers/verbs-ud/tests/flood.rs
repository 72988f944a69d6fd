//! A flood both ways of messages of mixed sizes (one packet to many) between ranks as threads,
//! each with its own soft HCA, with datagrams dropped, duplicated and held back by the soft
//! HCA's fault injection: every message arrives once, in order, intact. (Its own test binary:
//! it sets the fault-injection environment variables.)

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_provider::provider::{Provider, SendOutcome};

#[path = "common.rs"]
mod common;
use common::*;

fn flood(n: u32, max: usize) -> Vec<Vec<(String, u64)>> {
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
                    == SendOutcome::Sent
                {
                    sent += 1;
                }
            }
            p.progress(&mut ev).unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "stuck at sent {sent}, received {}, failed {:?}: {:?}",
                ev.am.len(),
                ev.failed,
                p.counters()
            );
        }
        assert!(ev.failed.is_empty(), "{:?}", ev.failed);
        for (i, (src, h, d)) in ev.am.iter().enumerate() {
            let i = i as u32;
            assert_eq!(*src, peer);
            assert_eq!(h, &i.to_le_bytes(), "message {i} out of order");
            assert_eq!(d.len(), size(i), "message {i}");
            assert!(
                d.iter()
                    .enumerate()
                    .all(|(k, b)| *b == (k as u32 ^ i) as u8),
                "message {i} garbled"
            );
        }
        done.fetch_add(1, Ordering::AcqRel);
        let t0 = Instant::now();
        while done.load(Ordering::Acquire) < 2 || t0.elapsed() < Duration::from_millis(20) {
            p.progress(&mut ev).unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the peer never finished"
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
fn every_message_arrives_once_in_order_through_faults() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    std::env::set_var("WEFT_VERBS_SOFT_UD_DROP", "0.02");
    std::env::set_var("WEFT_VERBS_SOFT_UD_DUP", "0.02");
    std::env::set_var("WEFT_VERBS_SOFT_UD_REORDER", "0.05");
    let cs = flood(5000, 9000);
    for c in &cs {
        assert!(get(c, "resent") > 0, "{c:?}");
        assert_eq!(get(c, "malformed"), 0, "{c:?}");
    }
}

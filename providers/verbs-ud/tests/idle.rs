//! A progress call looks only at the links that have work. It used to walk every link the
//! process had ever made (draining, checking timers, trying to transmit on each), on every
//! call that had something to do and on every 16th idle one: a process that had talked to
//! 16,384 peers spent 34 µs per idle progress call on average (0.011 with one peer), and the
//! few messages of a rank that sends most of its traffic another way (the hybrid) paid the
//! walk each. Links now leave the busy set once idle (nothing unacknowledged, owed, to
//! deliver, or timed) and join it again when used.

use weft_provider::provider::Provider;

#[path = "common.rs"]
mod common;
use common::*;

/// Every rank sends to every other and receives from each: afterwards each has a link per
/// peer, and once the acknowledgements are through none of them is busy — and a new message
/// makes its link busy again until it too is acknowledged.
#[test]
fn links_leave_the_busy_set_once_idle_and_join_it_when_used() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    let n = 4u32;
    let out = world(n, move |mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        let me = p.rank();
        for r in (0..n).filter(|&r| r != me) {
            send(&mut p, &mut ev, r, b"hi", &[me as u8]);
        }
        until(&mut p, &mut ev, "a message from every peer", |e| {
            e.am.len() == n as usize - 1
        });
        let links = counter(&p, "links");
        let t0 = std::time::Instant::now();
        while counter(&p, "busy_links") > 0 {
            p.progress(&mut ev).unwrap();
            assert!(t0.elapsed() < T, "rank {me}: links stay busy");
        }
        bar.wait();
        // One more message around the ring: its link is busy while it is unacknowledged.
        let next = (me + 1) % n;
        send(&mut p, &mut ev, next, b"again", &[]);
        let busy_after_send = counter(&p, "busy_links");
        until(&mut p, &mut ev, "the second message", |e| {
            e.am.len() == n as usize
        });
        let t0 = std::time::Instant::now();
        while counter(&p, "busy_links") > 0 {
            p.progress(&mut ev).unwrap();
            assert!(t0.elapsed() < T, "rank {me}: links stay busy");
        }
        bar.wait();
        (links, busy_after_send, counter(&p, "links"))
    });
    for (r, &(links, busy_after_send, links_end)) in out.iter().enumerate() {
        assert_eq!(links, u64::from(n) - 1, "rank {r}: a link per peer");
        assert_eq!(links_end, links, "rank {r}: links are kept while idle");
        assert!(
            busy_after_send >= 1,
            "rank {r}: a link with a message in flight is busy"
        );
    }
}

//! verbs-rc driven directly through the provider contract, ranks as threads of one process
//! each with its own soft HCA (the same code path as separate processes: the HCAs reach each
//! other through their shared segments). Every wait is bounded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft_provider::provider::{Access, Completion, Provider, RawIov, RemoteAddr};
use weft_provider::ErrorKind;
use weft_verbs_rc::RcChannel;

mod common;
use common::*;

/// A connection is made on first use only, between the two ranks that talk; the third rank
/// never connects to anyone.
#[test]
fn connections_are_made_on_first_use_only() {
    let ups = world(3, |mut p, bar| {
        let mut ev = Events::default();
        match p.rank() {
            0 => send(&mut p, &mut ev, 1, b"hdr", b"hello"),
            1 => until(&mut p, &mut ev, "the message", |e| !e.am.is_empty()),
            _ => {}
        }
        if p.rank() == 1 {
            assert_eq!(ev.am[0], (0, b"hdr".to_vec(), b"hello".to_vec()));
            assert_eq!(ev.connected, vec![0]);
        }
        bar.wait();
        counter(&p, "connections_up")
    });
    assert_eq!(ups, vec![1, 1, 0]);
}

/// The connection timers look at the requests due, not at every peer touched: once every
/// pair is connected, idle progress calls look at none. (They walked every peer the process had
/// touched on every 256th call, 17 ns a peer: about 1 µs per progress call, averaged, for a
/// process connected to 16K peers.)
#[test]
fn connection_timers_look_only_at_requests_due() {
    let n = 4u32;
    let out = world(n, move |mut p, bar| {
        let mut ev = Events::default();
        let me = p.rank();
        for r in (0..n).filter(|&r| r != me) {
            send(&mut p, &mut ev, r, b"hi", &[]);
        }
        until(&mut p, &mut ev, "a message from every peer", |e| {
            e.am.len() == n as usize - 1
        });
        bar.wait();
        for _ in 0..256 * 64 {
            p.progress(&mut ev).unwrap();
        }
        bar.wait();
        (
            counter(&p, "cm_checked"),
            counter(&p, "connections_asked") + counter(&p, "cm_resends"),
        )
    });
    for (r, &(checked, requests)) in out.iter().enumerate() {
        assert!(
            checked <= requests,
            "rank {r}: the timers looked at {checked} requests, {requests} were made"
        );
    }
}

/// Both sides ask at once: one connection comes up (the higher rank answers) and messages
/// arrive complete and in order both ways.
#[test]
fn both_sides_connecting_at_once_get_one_connection_in_order() {
    let n = 200u32;
    world(2, move |mut p, bar| {
        let mut ev = Events::default();
        let peer = 1 - p.rank();
        bar.wait();
        for i in 0..n {
            let data = vec![i as u8; (i as usize * 97) % 16384];
            send(&mut p, &mut ev, peer, &i.to_le_bytes(), &data);
        }
        until(&mut p, &mut ev, "every message", |e| {
            e.am.len() == n as usize
        });
        for (i, (src, h, d)) in ev.am.iter().enumerate() {
            assert_eq!(*src, peer);
            assert_eq!(h, &(i as u32).to_le_bytes());
            assert_eq!(d.len(), (i * 97) % 16384);
            assert!(d.iter().all(|b| *b == i as u8));
        }
        assert_eq!(counter(&p, "connections_up"), 1);
        bar.wait();
        // Keep answering until the peer has everything too.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(50) {
            p.progress(&mut ev).unwrap();
        }
    });
}

/// An RDMA write with a wrong key touches nothing at the target and completes with a
/// remote-access error; the job's other pairs go on.
#[test]
fn a_wrong_key_touches_nothing_and_fails_the_write() {
    let region: Arc<Mutex<Option<(u64, u64)>>> = Arc::default();
    let seen = region.clone();
    let finished = Arc::new(AtomicBool::new(false));
    world(3, move |mut p, bar| {
        let mut ev = Events::default();
        let mut mem = vec![0x11u8; 4096];
        if p.rank() == 1 {
            // SAFETY: `mem` outlives the registration (deregistered below).
            let mr = unsafe { p.mr_register(mem.as_mut_ptr(), mem.len(), Access::WRITE) }.unwrap();
            *seen.lock().unwrap() = Some((mr.addr, mr.key));
            bar.wait();
            // The target answers the connection request, then does nothing with the write.
            until(&mut p, &mut ev, "rank 0 to finish", |_| {
                finished.load(Ordering::Acquire)
            });
            bar.wait();
            assert!(
                mem.iter().all(|b| *b == 0x11),
                "the target's memory changed"
            );
            p.mr_deregister(&mr).unwrap();
        } else if p.rank() == 0 {
            bar.wait();
            let (addr, key) = seen.lock().unwrap().unwrap();
            let src = [0x22u8; 64];
            // SAFETY: as above; `src` lives until the completion below.
            let lmr = unsafe { p.mr_register(src.as_ptr() as *mut u8, 64, Access::LOCAL) }.unwrap();
            let iov = [RawIov {
                ptr: src.as_ptr(),
                len: 64,
                desc: lmr.desc,
            }];
            let bad = RemoteAddr {
                addr,
                key: key ^ 0x5a5a,
            };
            // SAFETY: `src` stays valid until the completion arrives.
            unsafe { p.rma_write(1, &iov, bad, Completion::cq(7)) }.unwrap();
            until(&mut p, &mut ev, "the failed write", |e| !e.done.is_empty());
            let (t, r) = &ev.done[0];
            assert_eq!(*t, 7);
            let e = r.as_ref().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::RemoteAccess, "{e}");
            // Rank 2 is unaffected.
            send(&mut p, &mut ev, 2, b"h", b"still here");
            finished.store(true, Ordering::Release);
            bar.wait();
            p.mr_deregister(&lmr).unwrap();
        } else {
            bar.wait();
            until(&mut p, &mut ev, "rank 0's message", |e| !e.am.is_empty());
            assert_eq!(ev.am[0].2, b"still here");
            bar.wait();
        }
    });
}

/// A composition closes and reopens a connection (the hybrid's rebalancing): both sides
/// quiesce, wait until nothing of theirs is in flight, tear down (one side well before the
/// other, which stays draining meanwhile), then connect again. Each round's messages arrive
/// complete and in order, the torn-down queue pairs and rings are gone from the HCA's
/// accounting, and nobody is failed.
#[test]
fn a_connection_torn_down_and_made_again_carries_on_in_order() {
    let rounds = 4u32;
    let per = 50u32;
    world(2, move |mut p, bar| {
        let mut ev = Events::default();
        let peer = 1 - p.rank();
        let mut seen = 0usize;
        let mem0 = counter(&p, "mem_hca_bytes");
        for round in 0..rounds {
            bar.wait();
            for i in 0..per {
                let data = vec![(round + i) as u8; (i as usize * 131) % 9000];
                send(&mut p, &mut ev, peer, &[round as u8, i as u8], &data);
            }
            until(&mut p, &mut ev, "this round's messages", |e| {
                e.am.len() == seen + per as usize
            });
            for (i, (src, h, d)) in ev.am[seen..].iter().enumerate() {
                assert_eq!(*src, peer);
                assert_eq!(h, &[round as u8, i as u8]);
                assert_eq!(d.len(), (i * 131) % 9000);
            }
            seen += per as usize;
            assert!(p.connected(peer), "round {round}: not connected");
            assert_eq!(p.route(peer), Some(p.fast_path_to(peer)));
            // Close: stop posting, let what is in flight complete.
            bar.wait();
            p.quiesce(peer).unwrap();
            assert!(!p.connected(peer));
            assert_eq!(p.route(peer), None, "a draining connection takes no sends");
            let t0 = Instant::now();
            while !p.quiet(peer) {
                p.progress(&mut ev).unwrap();
                assert!(t0.elapsed() < T, "never quiet");
            }
            // Both quiet (the hybrid's `Closed` messages): rank 0 tears down at once, rank 1
            // keeps progressing a while first, its side draining.
            bar.wait();
            if p.rank() == 1 {
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_millis(20) {
                    p.progress(&mut ev).unwrap();
                }
            }
            p.disconnect(peer).unwrap();
            assert_eq!(counter(&p, "connections_up"), 0);
            assert_eq!(
                counter(&p, "mem_hca_bytes"),
                mem0,
                "round {round}: the connection's QP is still accounted"
            );
            bar.wait();
        }
        assert!(ev.failed.is_empty(), "{:?}", ev.failed);
        assert_eq!(counter(&p, "connections_closed"), rounds as u64);
        // Disconnecting twice, or from a peer never connected, does nothing; ourselves is
        // refused.
        p.disconnect(peer).unwrap();
        assert!(p.disconnect(p.rank()).is_err());
    });
}

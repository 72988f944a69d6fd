//! The provider on its own, ranks as threads of one process, over libfabric's `tcp;ofi_rxm`
//! and `shm`: tagged messaging (truncation, probe, cancel, synchronous sends), active messages
//! in order, RMA and counters. Every wait is bounded. Skipped (with the reason) where
//! libfabric or the provider is missing, unless WEFT_REQUIRE_TOOLS=1.

use std::io::IoSlice;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use weft_ofi::Ofi;
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::{
    Access, Completed, Completion, Provider, RawIov, RawIovMut, RemoteAddr, SendOutcome,
};
use weft_provider::Rank;

const FABRICS: [&str; 2] = ["shm", "tcp;ofi_rxm"];

use weft_proto::testkit::{until, wait, Events, T};

/// Whether libfabric offers `fab` here; else the reason to skip.
fn available(fab: &str) -> bool {
    let job = InProcessJob::new(1, T);
    match Ofi::open_on(&mut job.rank(0), fab, "") {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var("WEFT_REQUIRE_TOOLS").as_deref() != Ok("1"),
                "libfabric provider {fab} unavailable: {e}"
            );
            eprintln!("skipped on {fab}: {e}");
            false
        }
    }
}

/// Run `f` on `n` ranks over each libfabric provider of [`FABRICS`] that is available here.
fn each_fabric(n: u32, f: impl Fn(&'static str, Ofi, Arc<Barrier>) + Send + Sync + Copy + 'static) {
    each_fabric_as(n, None, f)
}

/// As [`each_fabric`], with `native` in place of `WEFT_OFI_NATIVE` when given.
fn each_fabric_as(
    n: u32,
    native: Option<bool>,
    f: impl Fn(&'static str, Ofi, Arc<Barrier>) + Send + Sync + Copy + 'static,
) {
    for fab in FABRICS {
        if available(fab) {
            world(fab, n, native, move |p, bar| f(fab, p, bar));
        }
    }
}

/// Run `f` on `n` ranks over libfabric provider `fab`.
fn world<R: Send + 'static>(
    fab: &'static str,
    n: u32,
    native: Option<bool>,
    f: impl Fn(Ofi, Arc<Barrier>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    weft_proto::testkit::world(n, move |b| Ofi::open_with(b, fab, "", native).unwrap(), f)
}

/// Send one active message, progressing while the provider is busy.
fn am(p: &mut Ofi, ev: &mut Events, dest: Rank, h: &[u8]) {
    let t0 = Instant::now();
    while p.am_send(dest, h, &[]).unwrap() == SendOutcome::Busy {
        p.progress(ev).unwrap();
        assert!(t0.elapsed() < T, "send to {dest} stayed busy");
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn truncation_reports_the_message_length_and_keeps_the_prefix() {
    each_fabric(2, |fab, mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        let sizes = [50usize, 200_000, 8000, 1 << 20, 16, 17, 5000];
        // Each size twice: the receive posted first, then the message arriving first
        // (unexpected). Active messages pace the two ranks.
        for (k, (n, recv_first)) in sizes
            .iter()
            .flat_map(|n| [(*n, true), (*n, false)])
            .enumerate()
        {
            let tag = k as i32;
            let data = pattern(n, k as u8);
            if p.rank() == 0 {
                if recv_first {
                    until(&mut p, &mut ev, "the receiver", |e| e.am.len() > k);
                }
                // SAFETY: `data` outlives the wait below.
                unsafe { p.tagged_send(1, 8, tag, &[RawIov::new(data.as_ptr(), n)], false, 1) }
                    .unwrap();
                if !recv_first {
                    am(&mut p, &mut ev, 1, b"sent");
                }
                assert_eq!(wait(&mut p, &mut ev, 1).unwrap(), Completed::Done, "{fab}");
                if recv_first {
                    am(&mut p, &mut ev, 1, b"done");
                } else {
                    until(&mut p, &mut ev, "the receiver", |e| e.am.len() > k);
                }
            } else {
                if !recv_first {
                    until(&mut p, &mut ev, "the sender", |e| e.am.len() > k);
                }
                let mut b = [0xAAu8; 32];
                // SAFETY: `b` outlives the wait below.
                unsafe {
                    p.tagged_recv(
                        Some(0),
                        8,
                        Some(tag),
                        &[RawIovMut::new(b.as_mut_ptr(), 16)],
                        2,
                    )
                }
                .unwrap();
                if recv_first {
                    am(&mut p, &mut ev, 0, b"posted");
                }
                let r = wait(&mut p, &mut ev, 2).unwrap();
                let Completed::Received(st) = r else {
                    panic!("{fab}: {r:?}")
                };
                assert_eq!((st.source, st.tag, st.bytes), (0, tag, n), "{fab}");
                let m = n.min(16);
                assert!(
                    b[m..].iter().all(|x| *x == 0xAA),
                    "{fab} {n}: wrote past the message or buffer"
                );
                assert_eq!(b[..m], data[..m], "{fab} {n}: the prefix differs");
                if recv_first {
                    until(&mut p, &mut ev, "the sender", |e| e.am.len() > k);
                } else {
                    am(&mut p, &mut ev, 0, b"done");
                }
            }
        }
        bar.wait();
    });
}

#[test]
fn active_messages_arrive_in_order() {
    each_fabric(2, |fab, mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        const N: usize = 2000;
        if p.rank() == 0 {
            for i in 0..N {
                let body = pattern(i % 3000, i as u8);
                let t0 = Instant::now();
                while p
                    .am_send(1, &(i as u32).to_le_bytes(), &[IoSlice::new(&body)])
                    .unwrap()
                    == SendOutcome::Busy
                {
                    p.progress(&mut ev).unwrap();
                    assert!(t0.elapsed() < T, "busy for ever");
                }
            }
            until(&mut p, &mut ev, "the ack", |e| !e.am.is_empty());
        } else {
            until(&mut p, &mut ev, "all messages", |e| e.am.len() == N);
            for (i, (src, h, body)) in ev.am.iter().enumerate() {
                assert_eq!((*src, h.as_slice()), (0, &(i as u32).to_le_bytes()[..]));
                assert_eq!(body, &pattern(i % 3000, i as u8), "{fab}: message {i}");
            }
            while p.am_send(0, b"ok", &[]).unwrap() == SendOutcome::Busy {
                p.progress(&mut ev).unwrap();
            }
        }
        p.close().unwrap();
        bar.wait();
    });
}

#[test]
fn wildcard_receives_match_every_source_and_tag() {
    each_fabric(3, |fab, mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        let r = p.rank();
        if r == 0 {
            let mut seen = [false; 3];
            for k in 0..2 {
                let mut b = [0u8; 4];
                // SAFETY: `b` outlives the wait below.
                unsafe { p.tagged_recv(None, 2, None, &[RawIovMut::new(b.as_mut_ptr(), 4)], k) }
                    .unwrap();
                let Completed::Received(st) = wait(&mut p, &mut ev, k).unwrap() else {
                    panic!("{fab}: not a receive")
                };
                assert_eq!((st.tag, st.bytes), (40 + st.source as i32, 4), "{fab}");
                assert_eq!(u32::from_le_bytes(b), st.source, "{fab}");
                seen[st.source as usize] = true;
            }
            assert_eq!(seen, [false, true, true], "{fab}");
            for d in 1..3 {
                am(&mut p, &mut ev, d, b"bye");
            }
        } else {
            let b = r.to_le_bytes();
            // SAFETY: `b` outlives the wait below.
            unsafe { p.tagged_send(0, 2, 40 + r as i32, &[RawIov::new(b.as_ptr(), 4)], false, 9) }
                .unwrap();
            assert_eq!(wait(&mut p, &mut ev, 9).unwrap(), Completed::Done, "{fab}");
            until(&mut p, &mut ev, "the end", |e| !e.am.is_empty());
        }
        bar.wait();
    });
}

/// A synchronous send completes only once its receive matched; probe reports a waiting
/// message's length (a large one's too, from its announcement) without taking it; a posted
/// receive that nothing matches is cancelled and reports so.
#[test]
fn ssend_waits_for_the_match_and_probe_and_cancel_work() {
    each_fabric(2, |fab, mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        let big = pattern(100_000, 3);
        if p.rank() == 0 {
            let small = [7u8; 8];
            // SAFETY: both buffers outlive the waits below.
            unsafe {
                p.tagged_send(1, 2, 5, &[RawIov::new(small.as_ptr(), 8)], true, 1)
                    .unwrap();
                p.tagged_send(1, 2, 6, &[RawIov::new(big.as_ptr(), big.len())], false, 2)
                    .unwrap();
            }
            // Nothing has been received yet: the synchronous send must not complete.
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(200) {
                p.progress(&mut ev).unwrap();
            }
            assert!(
                ev.take(1).is_none(),
                "{fab}: ssend completed before its match"
            );
            am(&mut p, &mut ev, 1, b"go");
            assert_eq!(wait(&mut p, &mut ev, 1).unwrap(), Completed::Done, "{fab}");
            assert_eq!(wait(&mut p, &mut ev, 2).unwrap(), Completed::Done, "{fab}");
            until(&mut p, &mut ev, "the end", |e| !e.am.is_empty());
        } else {
            until(&mut p, &mut ev, "go", |e| !e.am.is_empty());
            // Probe both, before receiving either. (libfabric 1.17's shm reports neither
            // the length nor the CQ data of a message it peeks at, and the peeked message
            // is not received afterwards: fixed upstream later; not probed there.)
            let probes: &[(i32, usize)] = if fab == "shm" {
                &[]
            } else {
                &[(5, 8), (6, 100_000)]
            };
            for &(tag, n) in probes {
                let t0 = Instant::now();
                let st = loop {
                    p.progress(&mut ev).unwrap();
                    if let Some(st) = p.tagged_probe(Some(0), 2, Some(tag)).unwrap() {
                        break st;
                    }
                    assert!(t0.elapsed() < T, "{fab}: probe found nothing");
                };
                assert_eq!((st.source, st.tag, st.bytes), (0, tag, n), "{fab}");
            }
            assert!(
                p.tagged_probe(Some(0), 2, Some(77)).unwrap().is_none(),
                "{fab}"
            );
            let mut a = [0u8; 8];
            let mut b = vec![0u8; 100_000];
            // SAFETY: the buffers outlive the waits below.
            unsafe {
                p.tagged_recv(Some(0), 2, Some(5), &[RawIovMut::new(a.as_mut_ptr(), 8)], 3)
                    .unwrap();
                p.tagged_recv(
                    Some(0),
                    2,
                    Some(6),
                    &[RawIovMut::new(b.as_mut_ptr(), b.len())],
                    4,
                )
                .unwrap();
            }
            assert!(matches!(
                wait(&mut p, &mut ev, 3).unwrap(),
                Completed::Received(_)
            ));
            assert!(matches!(
                wait(&mut p, &mut ev, 4).unwrap(),
                Completed::Received(_)
            ));
            assert_eq!(a, [7u8; 8], "{fab}");
            assert!(b == big, "{fab}: the large message differs");
            let mut never = [0u8; 8];
            // SAFETY: `never` outlives the receive: it is cancelled (checked) before the end.
            unsafe {
                p.tagged_recv(
                    Some(0),
                    2,
                    Some(78),
                    &[RawIovMut::new(never.as_mut_ptr(), 8)],
                    5,
                )
                .unwrap();
            }
            let cancelled = p.tagged_cancel(5).unwrap();
            let r = if cancelled {
                Completed::Cancelled
            } else {
                wait(&mut p, &mut ev, 5).unwrap()
            };
            assert_eq!(r, Completed::Cancelled, "{fab}");
            am(&mut p, &mut ev, 0, b"end");
        }
        p.close().unwrap();
        bar.wait();
    });
}

/// With active messages only (`WEFT_OFI_NATIVE=0`), a registration for remote writes is a
/// receive posted under the key it hands out and a "write" is a send to that key: the data
/// lands whole; a registration nobody wrote to is taken back at deregistration, and a late
/// write to its key lands nowhere (not in the buffer given back); a key that is not the
/// provider's is refused.
#[test]
fn write_rendezvous_without_native_rma() {
    each_fabric_as(2, Some(false), |fab, mut p, bar| {
        let mut ev = Events::default();
        let rma = p.caps().rma.expect("write rendezvous offered");
        assert!(rma.rndv_only && rma.write && !rma.read, "{fab}: {rma:?}");
        let n = 1 << 20;
        let data = pattern(n, 9);
        bar.wait();
        if p.rank() == 1 {
            let mut buf = vec![0u8; n];
            let mut spare = vec![0u8; 256];
            // SAFETY: both buffers outlive their registrations (deregistered below).
            let (m, s) = unsafe {
                (
                    p.mr_register(buf.as_mut_ptr(), n, Access::WRITE).unwrap(),
                    p.mr_register(spare.as_mut_ptr(), 256, Access::WRITE)
                        .unwrap(),
                )
            };
            let mut keys = m.key.to_le_bytes().to_vec();
            keys.extend_from_slice(&s.key.to_le_bytes());
            am(&mut p, &mut ev, 0, &keys);
            until(&mut p, &mut ev, "the writer's fin", |e| !e.am.is_empty());
            p.mr_deregister(&m).unwrap();
            assert!(buf == data, "{fab}: the written data differs");
            // Nobody wrote to the spare: deregistration cancels its receive, and a write that
            // comes afterwards must not reach the buffer.
            p.mr_deregister(&s).unwrap();
            am(&mut p, &mut ev, 0, b"revoked");
            until(&mut p, &mut ev, "the late write's fin", |e| e.am.len() == 2);
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(100) {
                p.progress(&mut ev).unwrap();
            }
            assert!(
                spare.iter().all(|b| *b == 0),
                "{fab}: a revoked key was written"
            );
            assert!(p.counters().contains(&("rndv_write", 0)), "{fab}");
            am(&mut p, &mut ev, 0, b"end");
        } else {
            until(&mut p, &mut ev, "the keys", |e| !e.am.is_empty());
            let k = &ev.am[0].1;
            let key = u64::from_le_bytes(k[..8].try_into().unwrap());
            let spare = u64::from_le_bytes(k[8..16].try_into().unwrap());
            let at = |key| RemoteAddr { addr: 0, key };
            // SAFETY: `data` outlives the waits below.
            unsafe {
                let bad = p.rma_write(
                    1,
                    &[RawIov::new(data.as_ptr(), 8)],
                    at(7),
                    Completion::cq(9),
                );
                assert!(bad.is_err(), "{fab}: a foreign key was taken");
                p.rma_write(
                    1,
                    &[RawIov::new(data.as_ptr(), n)],
                    at(key),
                    Completion::cq(1),
                )
                .unwrap();
            }
            assert_eq!(wait(&mut p, &mut ev, 1).unwrap(), Completed::Done, "{fab}");
            am(&mut p, &mut ev, 1, b"fin");
            until(&mut p, &mut ev, "revoked", |e| e.am.len() == 2);
            // SAFETY: as above. 64 bytes: an eager message that waits unexpected.
            unsafe {
                p.rma_write(
                    1,
                    &[RawIov::new(data.as_ptr(), 64)],
                    at(spare),
                    Completion::cq(2),
                )
                .unwrap();
            }
            assert_eq!(wait(&mut p, &mut ev, 2).unwrap(), Completed::Done, "{fab}");
            am(&mut p, &mut ev, 1, b"fin");
            assert!(p.counters().contains(&("rndv_write", 2)), "{fab}");
            until(&mut p, &mut ev, "the end", |e| e.am.len() == 3);
        }
        bar.wait();
    });
}

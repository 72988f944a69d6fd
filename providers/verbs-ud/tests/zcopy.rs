//! UD zero-copy through the provider contract, ranks as threads with their own soft HCAs and
//! datagrams dropped, duplicated and held back: a receiver registers its buffer for a write,
//! the sender "writes" it (pieces on the receiver's zero-copy QP), and every byte is in place
//! when the write completes; lost pieces are repaired by later rounds, pieces that landed
//! early are moved; a deregistered buffer is never written. (Its own test binary: it sets the
//! fault-injection environment variables, the same in every test.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use weft_provider::provider::{
    Access, Completed, Completion, MemRegion, Provider, RawIov, RemoteAddr,
};
use weft_provider::ErrorKind;

#[path = "common.rs"]
mod common;
use common::*;

fn faults() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    std::env::set_var("WEFT_VERBS_SOFT_UD_DROP", "0.03");
    std::env::set_var("WEFT_VERBS_SOFT_UD_DUP", "0.01");
    std::env::set_var("WEFT_VERBS_SOFT_UD_REORDER", "0.01");
}

fn pattern(i: usize, salt: u8) -> u8 {
    (i.wrapping_mul(131) >> 3) as u8 ^ salt
}

fn key_msg(m: &MemRegion) -> Vec<u8> {
    let mut v = m.addr.to_le_bytes().to_vec();
    v.extend_from_slice(&m.key.to_le_bytes());
    v
}

fn remote_of(b: &[u8]) -> RemoteAddr {
    RemoteAddr {
        addr: u64::from_le_bytes(b[..8].try_into().unwrap()),
        key: u64::from_le_bytes(b[8..16].try_into().unwrap()),
    }
}

/// Rank 1 receives `len`-byte messages by zero-copy, `n` times; rank 0 writes them. Returns
/// rank 1's counters.
fn transfers(len: usize, n: u32) -> Vec<(&'static str, u64)> {
    faults();
    let out = world(2, move |mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        if p.rank() == 1 {
            let mut buf = vec![0u8; len];
            for i in 0..n {
                buf.fill(0xee);
                // SAFETY: `buf` outlives the registration (deregistered below).
                let m = unsafe { p.mr_register(buf.as_mut_ptr(), len, Access::WRITE) }.unwrap();
                send(&mut p, &mut ev, 0, b"key", &key_msg(&m));
                until(&mut p, &mut ev, "the writer's word", |e| {
                    e.am.len() > i as usize
                });
                assert_eq!(ev.am[i as usize].1, b"written");
                p.mr_deregister(&m).unwrap();
                let bad = (0..len).find(|&k| buf[k] != pattern(k, i as u8));
                assert_eq!(bad, None, "transfer {i}: first wrong byte");
            }
            p.counters()
        } else {
            let mut src = vec![0u8; len];
            for i in 0..n {
                for (k, b) in src.iter_mut().enumerate() {
                    *b = pattern(k, i as u8);
                }
                until(&mut p, &mut ev, "a key", |e| e.am.len() > i as usize);
                let remote = remote_of(&ev.am[i as usize].2);
                // SAFETY: `src` outlives the registration and the write (waited for below).
                let l = unsafe { p.mr_register(src.as_mut_ptr(), len, Access::LOCAL) }.unwrap();
                let iov = [RawIov {
                    ptr: src.as_ptr(),
                    len,
                    desc: l.desc,
                }];
                // SAFETY: as above.
                unsafe { p.rma_write(1, &iov, remote, Completion::cq(7)) }.unwrap();
                until(&mut p, &mut ev, "the write", |e| !e.done.is_empty());
                let (t, r) = ev.done.pop().unwrap();
                assert_eq!(t, 7);
                assert!(matches!(r, Ok(Completed::Done)), "{r:?}");
                p.mr_deregister(&l).unwrap();
                send(&mut p, &mut ev, 1, b"written", b"");
            }
            // Answer until the receiver saw the last word (it may need a resend).
            let t0 = Instant::now();
            while t0.elapsed() < std::time::Duration::from_millis(300) {
                p.progress(&mut ev).unwrap();
            }
            p.counters()
        }
    });
    out.into_iter().nth(1).unwrap()
}

fn get(c: &[(&str, u64)], k: &str) -> u64 {
    c.iter().find(|(n, _)| *n == k).map_or(0, |(_, v)| *v)
}

#[test]
fn every_byte_lands_in_place_through_losses() {
    // 1 MiB: 512 pieces, one round when nothing is lost. 3% of them are lost here.
    let c = transfers(1 << 20, 12);
    assert_eq!(get(&c, "zcopy_recvs"), 12, "{c:?}");
    // (Losses are injected by the sender's HCA: here they show as rounds.)
    assert!(get(&c, "zcopy_rounds") > 0, "no piece was lost: {c:?}");
    // Pieces that landed a receive early were moved, not sent again.
    assert!(get(&c, "zcopy_moved") > 0, "{c:?}");
}

#[test]
fn a_message_longer_than_the_queue_goes_in_rounds() {
    // 3 MiB + 5 bytes: 1537 pieces of 2 KiB for receive queues of 1024.
    let c = transfers((3 << 20) + 5, 2);
    assert_eq!(get(&c, "zcopy_recvs"), 2, "{c:?}");
    assert!(get(&c, "zcopy_rounds") >= 2, "{c:?}");
}

/// The receiver deregisters its buffer before the sender writes: nothing lands there, and the
/// write fails with a remote-access error instead of hanging.
#[test]
fn a_write_after_deregistration_touches_nothing_and_fails() {
    faults();
    let len = 256 << 10;
    let seen = Arc::new(AtomicU64::new(0));
    let seen2 = seen.clone();
    world(2, move |mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        if p.rank() == 1 {
            let mut buf = vec![0x5au8; len];
            // SAFETY: `buf` outlives the registration.
            let m = unsafe { p.mr_register(buf.as_mut_ptr(), len, Access::WRITE) }.unwrap();
            p.mr_deregister(&m).unwrap();
            send(&mut p, &mut ev, 0, b"key", &key_msg(&m));
            until(&mut p, &mut ev, "the writer's word", |e| !e.am.is_empty());
            let touched = buf.iter().filter(|&&b| b != 0x5a).count();
            seen2.store(touched as u64, Ordering::SeqCst);
        } else {
            let src = vec![1u8; len];
            until(&mut p, &mut ev, "a key", |e| !e.am.is_empty());
            let remote = remote_of(&ev.am[0].2);
            let mut src = src;
            // SAFETY: `src` outlives the registration and the write.
            let l = unsafe { p.mr_register(src.as_mut_ptr(), len, Access::LOCAL) }.unwrap();
            let iov = [RawIov {
                ptr: src.as_ptr(),
                len,
                desc: l.desc,
            }];
            // SAFETY: as above.
            unsafe { p.rma_write(1, &iov, remote, Completion::cq(9)) }.unwrap();
            until(&mut p, &mut ev, "the write", |e| !e.done.is_empty());
            let (_, r) = ev.done.pop().unwrap();
            let e = r.expect_err("a write into a deregistered buffer succeeded");
            assert_eq!(e.kind(), ErrorKind::RemoteAccess, "{e}");
            p.mr_deregister(&l).unwrap();
            send(&mut p, &mut ev, 1, b"failed", b"");
            let t0 = Instant::now();
            while t0.elapsed() < std::time::Duration::from_millis(300) {
                p.progress(&mut ev).unwrap();
            }
        }
    });
    assert_eq!(
        seen.load(Ordering::SeqCst),
        0,
        "bytes written after deregistration"
    );
}

/// More concurrent receives than zero-copy QPs: the extra registrations are refused (the
/// core then asks for the data by copy), and a freed QP serves the next one.
#[test]
fn registrations_beyond_the_pool_are_refused_then_served() {
    faults();
    world(1, |mut p, _| {
        let mut bufs: Vec<Vec<u8>> = (0..5).map(|_| vec![0u8; 64 << 10]).collect();
        let mut ms = Vec::new();
        for b in bufs.iter_mut().take(4) {
            // SAFETY: the buffers outlive their registrations.
            ms.push(unsafe { p.mr_register(b.as_mut_ptr(), b.len(), Access::WRITE) }.unwrap());
        }
        let b4 = bufs[4].as_mut_ptr();
        // SAFETY: as above.
        let e = unsafe { p.mr_register(b4, 64 << 10, Access::WRITE) }.unwrap_err();
        assert_ne!(e.kind(), ErrorKind::Unsupported, "{e}");
        p.mr_deregister(&ms.pop().unwrap()).unwrap();
        // SAFETY: as above.
        let m = unsafe { p.mr_register(b4, 64 << 10, Access::WRITE) }.unwrap();
        p.mr_deregister(&m).unwrap();
        for m in ms {
            p.mr_deregister(&m).unwrap();
        }
        // Small buffers go by copy; windows (remote reads) are not for UD.
        // SAFETY: as above.
        let e = unsafe { p.mr_register(b4, 100, Access::WRITE) }.unwrap_err();
        assert_ne!(e.kind(), ErrorKind::Unsupported, "{e}");
        // SAFETY: as above.
        let e = unsafe { p.mr_register(b4, 64 << 10, Access::ALL) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    });
}

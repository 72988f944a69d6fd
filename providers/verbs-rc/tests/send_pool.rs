//! A composition's sizing (`VerbsRc::open_sized`): its send pool (one chunk of send buffers at
//! the first connection, more only when sends outpace their completions, never past the size
//! asked for) and its queue pairs (the send-queue depth and scatter-gather entries asked for).

use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Barrier};
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::Provider;
use weft_verbs_rc::{RcChannel, Sizing, VerbsRc};

mod common;
use common::*;

/// Sends rank 0 posts without polling: three chunks' worth.
const BURST: usize = 48;

/// A composition of one connection without RC-FP, its pools 16 buffers of 8 KiB, its queue
/// pairs verbs-rc's own.
const ONE_PEER: Sizing = Sizing {
    fp_peers: 0,
    fp_threshold: 0,
    buf: 8192,
    pool: 16,
    conns: 1,
    fp_payload: 0,
    fp_bufs: 0,
    sq: 0,
    sges: 0,
};

#[test]
fn a_compositions_send_pool_starts_with_one_chunk_and_grows_with_the_sends_in_flight() {
    let job = InProcessJob::new(2, T);
    let bar = Arc::new(Barrier::new(2));
    let phase = Arc::new(AtomicU32::new(0));
    let sizing = Sizing {
        pool: 128,
        ..ONE_PEER
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

/// A composition that asks for a shallow send queue and one scatter-gather entry gets queue
/// pairs of that size (the HCA's accounting), offers RMA on one piece per request, and its
/// messages still flow.
#[test]
fn a_compositions_queue_pairs_take_the_depth_and_entries_it_asks_for() {
    let qp_bytes = |sq: u32, sges: usize| -> (u64, usize) {
        let job = InProcessJob::new(2, T);
        let bar = Arc::new(Barrier::new(2));
        let sizing = Sizing {
            sq,
            sges,
            ..ONE_PEER
        };
        let hs: Vec<_> = (0..2u32)
            .map(|r| {
                let (job, bar) = (job.clone(), bar.clone());
                std::thread::spawn(move || {
                    let hca = weft_verbs::open_default().unwrap();
                    let mut p = VerbsRc::open_sized(&mut job.rank(r), sizing, hca.clone()).unwrap();
                    let mut ev = Events::default();
                    let before = hca.accounting().rc_qp_bytes;
                    bar.wait();
                    send(&mut p, &mut ev, 1 - r, b"hello", &[7; 3000]);
                    until(&mut p, &mut ev, "hello", |e| !e.am.is_empty());
                    assert_eq!(ev.am[0].2, [7; 3000]);
                    // The peer's queue pair and the one to ourselves.
                    let qps = hca.accounting().rc_qps;
                    let per_qp = (hca.accounting().rc_qp_bytes - before) / qps.max(1);
                    let iov = p.caps().rma.map_or(0, |r| r.max_iov);
                    bar.wait();
                    p.close().unwrap();
                    (per_qp, iov)
                })
            })
            .collect();
        let got: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(got[0], got[1]);
        got[0]
    };
    let (own, own_iov) = qp_bytes(0, 0);
    let (lean, lean_iov) = qp_bytes(64, 1);
    assert_eq!(lean_iov, 1);
    assert!(own_iov > 1, "{own_iov}");
    // 128 work requests of 192 bytes against 64 of 64 bytes, plus the fixed part.
    assert!(
        own >= 24 << 10 && lean <= 8 << 10,
        "{own} B per queue pair by default, {lean} B asked small"
    );
}

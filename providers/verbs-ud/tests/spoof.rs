//! A packet is taken as its claimed source rank's only if it came from that rank's published
//! QP on that rank's HCA (what the HCA stamps on a UD receive: the sender's QP number and, in
//! the GRH, its GID).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use weft_provider::bootstrap::{Bootstrap, InProcessJob};
use weft_provider::provider::{Provider, StaticProvider};
use weft_verbs::soft::SoftHca;
use weft_verbs::*;
use weft_verbs_ud::VerbsUd;

#[path = "common.rs"]
mod common;
use common::*;

fn qkey(job: &str) -> u32 {
    let h = job.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    });
    h & 0x7fff_ffff
}

/// From an HCA of its own, send rank 0 a first packet (sequence number 0) that claims to be
/// rank 1's. It used to be delivered as rank 1's message — and rank 1's own first message was
/// then dropped as a duplicate.
fn spoof(boot: &mut impl Bootstrap) {
    let h = SoftHca::with_config(Default::default()).unwrap();
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(16).unwrap();
    let qp = h
        .create_qp(
            pd,
            &QpInitAttr {
                qp_type: QpType::Ud,
                send_cq: cq,
                recv_cq: cq,
                srq: None,
                cap: QpCap::default(),
                sq_sig_all: true,
            },
        )
        .unwrap();
    let qk = qkey(boot.job_id());
    activate_ud(&h, qp, qk).unwrap();
    let to: Endpoint = boot.get("verbs-ud.0").unwrap().parse().unwrap();
    // kind DATA, first and last, header length 6, source rank 1, PSN 0, ack 0, payload 1.
    let mut pkt = vec![1u8, 3];
    pkt.extend_from_slice(&6u16.to_le_bytes());
    for v in [1u32, 0, 0, 1] {
        pkt.extend_from_slice(&v.to_le_bytes());
    }
    pkt.extend_from_slice(b"forgedz");
    // SAFETY: `pkt` outlives the send, which completes before it is dropped (polled below).
    let mr = unsafe { h.reg_mr(pd, pkt.as_mut_ptr(), pkt.len(), Access::LOCAL_WRITE) }.unwrap();
    let ah = h.create_ah(pd, &to.ah_attr()).unwrap();
    h.post_send(
        qp,
        &[SendWr::send(1, &[mr.sge(0, pkt.len())]).to(ah, to.qpn, qk)],
    )
    .unwrap();
    assert_eq!(wait_cq(&h, cq, 1, T).unwrap()[0].status, WcStatus::Success);
}

#[test]
fn a_packet_not_from_the_rank_it_names_is_dropped() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    let job = InProcessJob::new(3, T);
    let bar = Arc::new(Barrier::new(3));
    let phase = Arc::new(AtomicU32::new(0));
    let hs: Vec<_> = (0..3u32)
        .map(|r| {
            let (job, bar, phase) = (job.clone(), bar.clone(), phase.clone());
            std::thread::spawn(move || {
                let mut boot = job.rank(r);
                let mut p = VerbsUd::open(&mut boot).unwrap();
                let mut ev = Events::default();
                bar.wait();
                let out = match r {
                    2 => {
                        spoof(&mut boot);
                        phase.fetch_max(1, Ordering::AcqRel);
                        (Vec::new(), 0)
                    }
                    1 => {
                        let t0 = Instant::now();
                        while phase.load(Ordering::Acquire) < 2 {
                            std::thread::yield_now();
                            assert!(t0.elapsed() < T, "rank 0 never saw the forgery");
                        }
                        send(&mut p, &mut ev, 0, b"real", b"r");
                        until(&mut p, &mut ev, "rank 0 to have it", |_| {
                            phase.load(Ordering::Acquire) >= 3
                        });
                        (Vec::new(), 0)
                    }
                    _ => {
                        let t0 = Instant::now();
                        while counter(&p, "spoofed") == 0 {
                            p.progress(&mut ev).unwrap();
                            assert!(t0.elapsed() < T, "the forged packet never arrived");
                        }
                        phase.fetch_max(2, Ordering::AcqRel);
                        until(&mut p, &mut ev, "rank 1's message", |e| !e.am.is_empty());
                        phase.fetch_max(3, Ordering::AcqRel);
                        let am: Vec<_> = ev.am.iter().map(|(s, h, _)| (*s, h.clone())).collect();
                        (am, counter(&p, "spoofed"))
                    }
                };
                bar.wait();
                out
            })
        })
        .collect();
    let out: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(
        out[0].0,
        vec![(1, b"real".to_vec())],
        "only rank 1's own message"
    );
    assert_eq!(out[0].1, 1);
}

//! verbs-rc against a hostile job peer and a requester that disappears: the connection
//! manager connects to the endpoints the bootstrap published, never to one a datagram names,
//! and a request it cannot answer fails that peer alone.

use std::io::IoSlice;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use weft_provider::bootstrap::{Bootstrap, InProcessJob};
use weft_provider::provider::{Provider, SendOutcome, StaticProvider};
use weft_verbs::soft::SoftHca;
use weft_verbs::*;
use weft_verbs_rc::wire::{job_hash, CmKind, CmMsg, Frame, FrameKind, CM_LEN, FRAME_HDR};
use weft_verbs_rc::{RcChannel, Sizing, VerbsRc};

mod common;
use common::*;

const QKEY: u32 = 0x5746_5243;

/// A job peer (rank 2) sends rank 0 a connection request that claims to be rank 1's and
/// offers a QP of its own. Rank 0 used to connect to it: rank 0's messages for rank 1 then went
/// to the impostor. Now the datagram is dropped (it did not come from rank 1's published QP,
/// and the QP it offers is not on rank 1's HCA) and rank 1 gets what rank 0 sends it.
#[test]
fn a_forged_connection_request_is_dropped_and_the_real_peer_is_reached() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    let job = InProcessJob::new(3, T);
    let bar = Arc::new(Barrier::new(3));
    let phase = Arc::new(AtomicU32::new(0));
    let hs: Vec<_> = (0..3u32)
        .map(|r| {
            let (job, bar, phase) = (job.clone(), bar.clone(), phase.clone());
            std::thread::spawn(move || {
                let mut boot = job.rank(r);
                let mut p = VerbsRc::open(&mut boot).unwrap();
                let mut ev = Events::default();
                bar.wait();
                match r {
                    2 => {
                        forge_request(&mut boot, job.id());
                        phase.fetch_max(1, Ordering::AcqRel);
                        bar.wait();
                        0
                    }
                    0 => {
                        let t0 = Instant::now();
                        while counter(&p, "cm_forged") == 0 {
                            p.progress(&mut ev).unwrap();
                            assert!(t0.elapsed() < T, "the forged request never arrived");
                        }
                        let t0 = Instant::now();
                        while p.am_send(1, b"for-1", &[IoSlice::new(b"x")]).unwrap()
                            == SendOutcome::Busy
                        {
                            p.progress(&mut ev).unwrap();
                            assert!(t0.elapsed() < T, "send to 1 stayed busy");
                        }
                        let t0 = Instant::now();
                        while phase.load(Ordering::Acquire) < 2 {
                            p.progress(&mut ev).unwrap();
                            assert!(t0.elapsed() < T, "rank 1 never got rank 0's message");
                        }
                        bar.wait();
                        counter(&p, "cm_forged")
                    }
                    _ => {
                        until(&mut p, &mut ev, "rank 0's message", |e| {
                            e.am.iter().any(|(s, h, _)| *s == 0 && h == b"for-1")
                        });
                        phase.fetch_max(2, Ordering::AcqRel);
                        bar.wait();
                        0
                    }
                }
            })
        })
        .collect();
    let out: Vec<u64> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(out[0], 1, "rank 0 dropped the forged request");
}

/// From an HCA of its own, send rank 0 a REQ that names rank 1 as its source.
fn forge_request(boot: &mut impl Bootstrap, job: &str) {
    let h = SoftHca::with_config(Default::default()).unwrap();
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(16).unwrap();
    let init = |ty| QpInitAttr {
        qp_type: ty,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: QpCap::default(),
        sq_sig_all: true,
    };
    let ud = h.create_qp(pd, &init(QpType::Ud)).unwrap();
    activate_ud(&h, ud, QKEY).unwrap();
    let bait = h.create_qp(pd, &init(QpType::Rc)).unwrap();
    let to: Endpoint = boot.get("verbs-rc.0").unwrap().parse().unwrap();
    let m = CmMsg {
        kind: CmKind::Req,
        job: job_hash(job),
        src: 1,
        dst: 0,
        gen: 0,
        ep: Endpoint::of(&h, bait, 7),
    };
    let mut buf = m.encode().to_vec();
    assert_eq!(buf.len(), CM_LEN);
    // SAFETY: `buf` outlives the send, which completes before it is dropped (polled below).
    let mr = unsafe { h.reg_mr(pd, buf.as_mut_ptr(), CM_LEN, Access::LOCAL_WRITE) }.unwrap();
    let ah = h.create_ah(pd, &to.ah_attr()).unwrap();
    h.post_send(
        ud,
        &[SendWr::send(1, &[mr.sge(0, CM_LEN)]).to(ah, to.qpn, QKEY)],
    )
    .unwrap();
    let w = wait_cq(&h, cq, 1, T).unwrap();
    assert_eq!(w[0].status, WcStatus::Success);
}

/// Rank 1 asks rank 0 for a connection and is gone (its HCA closed) before rank 0 answers.
/// Rank 0's progress used to fail with "cannot reach the segment of process N (pidfd_getfd:
/// Bad file descriptor)" — naming no rank, skipping the repost of the datagram's buffer —
/// and every progress call after it failed the same way; now rank 1 alone is failed, and rank
/// 0 goes on (it reaches rank 2 afterwards).
#[test]
fn a_requester_gone_before_the_answer_fails_that_peer_only() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    let job = InProcessJob::new(3, T);
    let bar = Arc::new(Barrier::new(3));
    let phase = Arc::new(AtomicU32::new(0));
    let hs: Vec<_> = (0..3u32)
        .map(|r| {
            let (job, bar, phase) = (job.clone(), bar.clone(), phase.clone());
            std::thread::spawn(move || {
                let mut boot = job.rank(r);
                let mut p = VerbsRc::open(&mut boot).unwrap();
                let mut ev = Events::default();
                bar.wait();
                match r {
                    1 => {
                        // The request goes out with the first message; then the HCA closes.
                        let _ = p.am_send(0, b"hello", &[IoSlice::new(b"")]).unwrap();
                        drop(p);
                        phase.fetch_max(1, Ordering::AcqRel);
                        bar.wait();
                        (Vec::new(), 0)
                    }
                    0 => {
                        let t0 = Instant::now();
                        while phase.load(Ordering::Acquire) < 1 {
                            std::thread::yield_now();
                            assert!(t0.elapsed() < T, "rank 1 never asked");
                        }
                        until(&mut p, &mut ev, "rank 1 failed", |e| {
                            e.failed.iter().any(|(r, _)| *r == 1)
                        });
                        send(&mut p, &mut ev, 2, b"for-2", b"y");
                        let t0 = Instant::now();
                        while phase.load(Ordering::Acquire) < 2 {
                            p.progress(&mut ev).unwrap();
                            assert!(t0.elapsed() < T, "rank 2 never got rank 0's message");
                        }
                        bar.wait();
                        (ev.failed, 0)
                    }
                    _ => {
                        until(&mut p, &mut ev, "rank 0's message", |e| {
                            e.am.iter().any(|(s, h, _)| *s == 0 && h == b"for-2")
                        });
                        phase.fetch_max(2, Ordering::AcqRel);
                        bar.wait();
                        (Vec::new(), ev.failed.len())
                    }
                }
            })
        })
        .collect();
    let out: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let failed = &out[0].0;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        failed[0].0, 1,
        "the failure names the requester: {failed:?}"
    );
    assert_eq!(out[2].1, 0, "rank 2 saw no failure");
}

/// Rank 1, a hostile peer written with raw verbs, connects to rank 0 as the connection manager
/// asks (its own published UD QP, REQ, REP, RTU) and then sends active messages numbered from 1
/// on — never message 0. Rank 0 used to keep a copy of every one, waiting for message 0, for
/// as long as rank 1 went on: 8 KiB each, without a bound. Now what it holds of a peer is
/// bounded (`weft_proto::order::Bounds`: 64 MiB of one peer) and rank 1 is failed past it.
#[test]
fn a_peer_that_skips_a_number_cannot_pin_the_receivers_memory() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    let job = InProcessJob::new(2, T);
    let failed = Arc::new(AtomicU32::new(0));
    let (j0, f0) = (job.clone(), failed.clone());
    let r0 = std::thread::spawn(move || {
        let mut boot = j0.rank(0);
        let mut p = VerbsRc::open(&mut boot).unwrap();
        let mut ev = Events::default();
        let t0 = Instant::now();
        while ev.failed.is_empty() {
            p.progress(&mut ev).unwrap();
            assert!(
                t0.elapsed() < T,
                "rank 0 never failed rank 1 ({} messages held)",
                counter(&p, "overtaken")
            );
        }
        f0.store(1, Ordering::Release);
        // Stay (dropping what rank 1 still sends) until its sends in flight are done.
        let t0 = Instant::now();
        while f0.load(Ordering::Acquire) != 2 {
            p.progress(&mut ev).unwrap();
            assert!(t0.elapsed() < T, "rank 1 never finished");
        }
        assert!(ev.am.is_empty(), "nothing of rank 1 is delivered");
        (ev.failed[0].clone(), counter(&p, "overtaken"))
    });
    let mut boot = job.rank(1);
    skip_message_0(&mut boot, job.id(), &failed);
    failed.store(2, Ordering::Release);
    let ((who, why), held) = r0.join().unwrap();
    assert_eq!(who, 1);
    assert!(why.contains("wait for message 0"), "{why}");
    // As many 8,200-byte messages as fit in 64 MiB were held; the next one failed rank 1.
    assert_eq!(held, (64 << 20) / 8200, "{why}");
}

/// The same peer against the channel a composition opens (`RcChannel::open_sized`): there
/// the composition's own sequencer orders what all its channels deliver, so the RC channel
/// hands each frame on as it comes and holds none (one sequencer, not two: a hybrid's RC
/// channel used to hold frames behind eager records, which the hybrid then ordered again).
#[test]
fn a_compositions_channel_hands_frames_on_as_they_come() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    let job = InProcessJob::new(2, T);
    let failed = Arc::new(AtomicU32::new(0));
    let (j0, f0) = (job.clone(), failed.clone());
    let r0 = std::thread::spawn(move || {
        let mut boot = j0.rank(0);
        let sizing = Sizing {
            fp_peers: 0,
            fp_threshold: 0,
            buf: 8192,
            pool: 64,
            conns: 1,
            fp_payload: 0,
            fp_bufs: 0,
            sq: 0,
            sges: 0,
        };
        let hca = weft_verbs::open_default().unwrap();
        let mut p = VerbsRc::open_sized(&mut boot, sizing, hca).unwrap();
        let mut ev = Events::default();
        let t0 = Instant::now();
        while ev.am.len() < 500 {
            p.progress(&mut ev).unwrap();
            assert!(
                t0.elapsed() < T,
                "rank 0 delivered {} messages ({} held)",
                ev.am.len(),
                counter(&p, "overtaken")
            );
        }
        f0.store(1, Ordering::Release);
        let t0 = Instant::now();
        while f0.load(Ordering::Acquire) != 2 {
            p.progress(&mut ev).unwrap();
            assert!(t0.elapsed() < T, "rank 1 never finished");
        }
        assert!(ev.failed.is_empty(), "{:?}", ev.failed);
        let sizes = ev
            .am
            .iter()
            .all(|(src, h, b)| *src == 1 && h.len() == 8 && b.len() == 8192);
        (sizes, counter(&p, "overtaken"))
    });
    let mut boot = job.rank(1);
    skip_message_0(&mut boot, job.id(), &failed);
    failed.store(2, Ordering::Release);
    let (sizes, held) = r0.join().unwrap();
    assert!(sizes, "every message delivered whole, from rank 1");
    assert_eq!(held, 0, "nothing held for order");
}

/// Rank 1's side of the two tests above: messages 1, 2, ... until rank 0 says stop (or 12,000
/// of them, 96 MiB, went).
fn skip_message_0(boot: &mut impl Bootstrap, job: &str, failed: &AtomicU32) {
    const MSG: usize = FRAME_HDR + 8 + 8192;
    // Declared before the HCA, so dropped after it: if an assertion below unwinds with the
    // receive still posted, the HCA (and with it every work request) is gone before the bytes.
    let mut buf = vec![0u8; 4096 + 64 * MSG];
    let base = buf.as_mut_ptr();
    // The bytes `[off, off + len)` of `buf`, for one step while no work request names them.
    let bytes = |off: usize, len: usize| {
        assert!(off + len <= 4096 + 64 * MSG);
        // SAFETY: in bounds of `buf` (checked above), which lives to the end of this function;
        // every call below names a range no posted work request covers at that moment (the
        // receive at 0..40+CM_LEN has completed before it is read, a send slot is written only
        // after its previous send completed), and the slice is dropped within the statement.
        unsafe { std::slice::from_raw_parts_mut(base.add(off), len) }
    };
    let h = SoftHca::with_config(Default::default()).unwrap();
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(512).unwrap();
    let init = |ty| QpInitAttr {
        qp_type: ty,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: QpCap {
            max_send_wr: 128,
            max_recv_wr: 4,
            ..QpCap::default()
        },
        sq_sig_all: true,
    };
    let ud = h.create_qp(pd, &init(QpType::Ud)).unwrap();
    activate_ud(&h, ud, QKEY).unwrap();
    let rc = h.create_qp(pd, &init(QpType::Rc)).unwrap();
    // SAFETY: `buf` outlives the HCA (declared before it), so every work request posted on
    // the region ends before the memory goes, on return and on unwinding alike; while one may
    // run, the only references made to the region are `bytes`' ranges, which no request names.
    let mr = unsafe { h.reg_mr(pd, base, 4096 + 64 * MSG, Access::LOCAL_WRITE) }.unwrap();
    h.post_recv(ud, &[RecvWr::new(1, &[mr.sge(0, 40 + CM_LEN)])])
        .unwrap();
    boot.put("verbs-rc.1", &Endpoint::of(&h, ud, 0).to_string())
        .unwrap();
    boot.fence().unwrap();
    let to: Endpoint = boot.get("verbs-rc.0").unwrap().parse().unwrap();
    let ah = h.create_ah(pd, &to.ah_attr()).unwrap();
    let psn = 7;
    let req = CmMsg {
        kind: CmKind::Req,
        job: job_hash(job),
        src: 1,
        dst: 0,
        gen: 0,
        ep: Endpoint::of(&h, rc, psn),
    };
    bytes(1024, CM_LEN).copy_from_slice(&req.encode());
    h.post_send(
        ud,
        &[SendWr::send(2, &[mr.sge(1024, CM_LEN)]).to(ah, to.qpn, QKEY)],
    )
    .unwrap();
    let w = wait_cq(&h, cq, 2, T).unwrap();
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
    let rep = CmMsg::decode(bytes(40, CM_LEN)).expect("rank 0 answers with a REP");
    assert_eq!(rep.kind, CmKind::Rep);
    connect_rc(&h, rc, psn, &rep.ep, &RcParams::default()).unwrap();
    // RTU, then messages 1, 2, 3, ...: message 0 never comes.
    let frame = |kind, hlen, plen, seq, out: &mut [u8]| {
        Frame {
            kind,
            hlen,
            plen,
            seq,
            ack: 0,
        }
        .write(out)
    };
    frame(FrameKind::Rtu, 0, 0, 0, bytes(4096, FRAME_HDR));
    h.post_send(rc, &[SendWr::send(3, &[mr.sge(4096, FRAME_HDR)])])
        .unwrap();
    assert_eq!(wait_cq(&h, cq, 1, T).unwrap()[0].status, WcStatus::Success);
    let (mut seq, mut inflight) = (1u32, 0usize);
    let mut wcs = [Wc::EMPTY; 64];
    let t0 = Instant::now();
    while failed.load(Ordering::Acquire) == 0 && seq <= 12_000 {
        // RC completes in order, so with at most 64 in flight the slot of message `seq` was
        // last used by `seq - 64`, which has completed.
        while inflight < 64 && seq <= 12_000 {
            let off = 4096 + (seq as usize % 64) * MSG;
            frame(FrameKind::Am, 8, 8192, seq, bytes(off, MSG));
            h.post_send(rc, &[SendWr::send(u64::from(seq), &[mr.sge(off, MSG)])])
                .unwrap();
            (seq, inflight) = (seq + 1, inflight + 1);
        }
        let n = h.poll_cq(cq, &mut wcs).unwrap();
        inflight -= n;
        assert!(t0.elapsed() < T, "rank 1's sends stalled");
    }
    // Let what is in flight complete (or fail) before the HCA and then the buffer go.
    let t0 = Instant::now();
    while inflight > 0 {
        let n = h.poll_cq(cq, &mut wcs).unwrap();
        inflight -= n;
        assert!(t0.elapsed() < T, "rank 1's last sends never completed");
    }
    drop(h);
    drop(buf);
}

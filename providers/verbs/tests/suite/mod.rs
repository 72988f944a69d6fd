//! The soft HCA's semantics, one test per promise, on two HCA contexts of this process, each
//! with its own shared segment. `soft.rs` runs the suite with both on this host (the data path
//! is the same Cross-Memory Attach and shared mappings as between processes); `two_hosts.rs`
//! with the second context in another network namespace, reached over UDP. Cross-process runs
//! are in `weft bench verbs_*` and the CLI tests.

use super::open;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;
use weft_verbs::soft::model::Config;
use weft_verbs::soft::SoftHca;
use weft_verbs::*;

const T: Duration = Duration::from_secs(20);

fn small(cfg: Config) -> Config {
    Config {
        heap: 64 << 20,
        max_qp: 64,
        max_mr: 256,
        ..cfg
    }
}

/// A context on the first host (the initiators of the tests).
fn hca(cfg: Config) -> Arc<SoftHca> {
    Arc::new(open(0, small(cfg)))
}

/// A context on the second host (the targets).
fn hca_b(cfg: Config) -> Arc<SoftHca> {
    Arc::new(open(1, small(cfg)))
}

/// Wait until `n` UD datagrams were dropped, wherever that is counted (by the sender on one
/// host; by the receiver across hosts, where the datagram arrives after the send completed).
fn wait_dropped(a: &Side, b: &Side, n: u64) {
    let t0 = std::time::Instant::now();
    loop {
        let d = a.h.counters().ud_dropped + b.h.counters().ud_dropped;
        if d >= n {
            assert_eq!(d, n, "more datagrams dropped than expected");
            return;
        }
        assert!(t0.elapsed() < T, "only {d} of {n} drops within {T:?}");
        std::thread::yield_now();
    }
}

struct Side {
    h: Arc<SoftHca>,
    pd: Pd,
    cq: Cq,
    qp: Qp,
}

fn side(h: Arc<SoftHca>, ty: QpType, srq: Option<Srq>, pd: Option<Pd>) -> Side {
    let pd = pd.unwrap_or_else(|| h.alloc_pd().unwrap());
    let cq = h.create_cq(256).unwrap();
    let qp = h
        .create_qp(
            pd,
            &QpInitAttr {
                qp_type: ty,
                send_cq: cq,
                recv_cq: cq,
                srq,
                cap: QpCap::default(),
                sq_sig_all: false,
            },
        )
        .unwrap();
    Side { h, pd, cq, qp }
}

fn fast() -> RcParams {
    RcParams {
        timeout: 1,
        retry_cnt: 3,
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..RcParams::default()
    }
}

/// Two connected RC QPs on two HCAs.
fn rc_pair_with(ca: Config, cb: Config, p: RcParams) -> (Side, Side) {
    let a = side(hca(ca), QpType::Rc, None, None);
    let b = side(hca_b(cb), QpType::Rc, None, None);
    let ea = Endpoint::of(&*a.h, a.qp, 100);
    let eb = Endpoint::of(&*b.h, b.qp, 200);
    connect_rc(&*a.h, a.qp, 100, &eb, &p).unwrap();
    connect_rc(&*b.h, b.qp, 200, &ea, &p).unwrap();
    (a, b)
}

fn rc_pair() -> (Side, Side) {
    rc_pair_with(Config::default(), Config::default(), fast())
}

/// Two active UD QPs with `qkey` (`a`'s HCA configured by `ca`), and `a`'s handle for `b`.
fn ud_pair(ca: Config, qkey: u32) -> (Side, Side, Ah) {
    let a = side(hca(ca), QpType::Ud, None, None);
    let b = side(hca_b(Config::default()), QpType::Ud, None, None);
    activate_ud(&*a.h, a.qp, qkey).unwrap();
    activate_ud(&*b.h, b.qp, qkey).unwrap();
    let ah =
        a.h.create_ah(
            a.pd,
            &AhAttr {
                dgid: b.h.gid(),
                ..AhAttr::default()
            },
        )
        .unwrap();
    (a, b, ah)
}

/// A heap buffer registered with `access`; the Box stays alive as long as the MR.
fn buf(s: &Side, len: usize, fill: u8, access: Access) -> (Box<[u8]>, Mr) {
    let mut b = vec![fill; len].into_boxed_slice();
    // SAFETY: the box outlives every use of the MR in these tests (deregistered or leaked with
    // the HCA at the end), and the tests read it only once no request can write it.
    let mr = unsafe { s.h.reg_mr(s.pd, b.as_mut_ptr(), len, access) }.unwrap();
    (b, mr)
}

fn one(s: &Side) -> Wc {
    wait_cq(&*s.h, s.cq, 1, T).unwrap()[0]
}

fn no_completion(s: &Side) {
    let mut w = [one_dummy(); 4];
    for _ in 0..50 {
        assert_eq!(
            s.h.poll_cq(s.cq, &mut w).unwrap(),
            0,
            "unexpected {:?}",
            w[0]
        );
    }
}

fn one_dummy() -> Wc {
    Wc::EMPTY
}

/// `poll_cq` looks at an empty CQ without the context's lock; a CQ destroyed must still poll
/// as unknown, and its ring, kept for the next CQ of its size, must serve that one whole.
#[test]
fn a_destroyed_cq_polls_as_unknown_and_its_ring_serves_the_next_cq() {
    let h = hca(Config::default());
    let x = h.create_cq(256).unwrap();
    let mut wcs = [one_dummy(); 4];
    assert_eq!(h.poll_cq(x, &mut wcs).unwrap(), 0);
    h.destroy_cq(x).unwrap();
    assert!(
        h.poll_cq(x, &mut wcs).is_err(),
        "a destroyed CQ polls as unknown"
    );
    // The pair's CQ on this context (256 entries again) takes the kept ring.
    let a = side(h, QpType::Rc, None, None);
    let b = side(hca_b(Config::default()), QpType::Rc, None, None);
    let (ea, eb) = (
        Endpoint::of(&*a.h, a.qp, 100),
        Endpoint::of(&*b.h, b.qp, 200),
    );
    connect_rc(&*a.h, a.qp, 100, &eb, &fast()).unwrap();
    connect_rc(&*b.h, b.qp, 200, &ea, &fast()).unwrap();
    let (_src, smr) = buf(&a, 64, 7, Access::ALL);
    let (dst, dmr) = buf(&b, 64, 0, Access::ALL);
    for i in 0..600u64 {
        // More completions than the ring holds: it wraps, as a fresh ring would.
        let wr = SendWr::write(i, &[smr.sge(0, 64)], dmr.addr, dmr.rkey);
        a.h.post_send(a.qp, &[wr]).unwrap();
        let wc = one(&a);
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success));
    }
    assert!(dst.iter().all(|&x| x == 7));
    assert_eq!(a.h.poll_cq(a.cq, &mut wcs).unwrap(), 0);
}

#[test]
fn write_read_send_and_immediate_data() {
    let (a, b) = rc_pair();
    let (src, smr) = buf(&a, 10_000, 0, Access::ALL);
    let _ = src;
    // SAFETY: filling our own registered buffer while no request uses it.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (0..10_000u32)
                .map(|i| (i * 7) as u8)
                .collect::<Vec<_>>()
                .as_ptr(),
            smr.addr as *mut u8,
            10_000,
        )
    };
    let (dst, dmr) = buf(&b, 10_000, 0, Access::ALL);
    // Two SGEs gathered into one write.
    let wr = SendWr::write(
        1,
        &[smr.sge(0, 3000), smr.sge(3000, 7000)],
        dmr.addr,
        dmr.rkey,
    );
    a.h.post_send(a.qp, &[wr]).unwrap();
    let wc = one(&a);
    assert_eq!(
        (wc.status, wc.opcode, wc.byte_len),
        (WcStatus::Success, WcOpcode::RdmaWrite, 10_000)
    );
    assert!(dst
        .iter()
        .enumerate()
        .all(|(i, x)| *x == (i as u32 * 7) as u8));
    // Read it back into a different place.
    let (back, bmr) = buf(&a, 100, 0, Access::ALL);
    a.h.post_send(
        a.qp,
        &[SendWr::read(
            2,
            &[bmr.sge(0, 100)],
            dmr.addr + 500,
            dmr.rkey,
        )],
    )
    .unwrap();
    assert_eq!(one(&a).opcode, WcOpcode::RdmaRead);
    assert!(back
        .iter()
        .enumerate()
        .all(|(i, x)| *x == ((i as u32 + 500) * 7) as u8));
    // Send with immediate into two receive SGEs; write with immediate consumes a receive.
    let (rbuf, rmr) = buf(&b, 64, 0, Access::LOCAL_WRITE);
    b.h.post_recv(
        b.qp,
        &[
            RecvWr::new(7, &[rmr.sge(0, 10), rmr.sge(10, 54)]),
            RecvWr::new(8, &[]),
        ],
    )
    .unwrap();
    a.h.post_send(
        a.qp,
        &[SendWr::send_imm(3, &[smr.sge(0, 20)], 0xfeed).unsignaled()],
    )
    .unwrap();
    a.h.post_send(
        a.qp,
        &[SendWr::write_imm(
            4,
            &[smr.sge(0, 8)],
            dmr.addr,
            dmr.rkey,
            42,
        )],
    )
    .unwrap();
    let r = wait_cq(&*b.h, b.cq, 2, T).unwrap();
    assert_eq!(
        (
            r[0].wr_id,
            r[0].status,
            r[0].byte_len,
            r[0].imm,
            r[0].opcode
        ),
        (7, WcStatus::Success, 20, Some(0xfeed), WcOpcode::Recv)
    );
    assert_eq!(r[0].src_qp, a.qp.qpn);
    assert_eq!(
        (r[1].wr_id, r[1].opcode, r[1].imm, r[1].byte_len),
        (8, WcOpcode::RecvRdmaWithImm, Some(42), 8)
    );
    assert_eq!(
        &rbuf[..20],
        &(0..20u32).map(|i| (i * 7) as u8).collect::<Vec<_>>()[..]
    );
    // The unsignaled send completed silently; only the write-with-imm reports.
    assert_eq!(one(&a).wr_id, 4);
    no_completion(&a);
    let c = a.h.counters();
    assert_eq!(
        (
            c.op(WrOpcode::RdmaWrite),
            c.op(WrOpcode::RdmaRead),
            c.op(WrOpcode::SendWithImm)
        ),
        (1, 1, 1)
    );
    assert!(c.wire_bytes > c.payload_bytes);
}

#[test]
fn bad_keys_ranges_and_rights_touch_nothing_and_fail_the_qp() {
    for case in 0..4 {
        let (a, b) = rc_pair();
        let (_s, smr) = buf(&a, 64, 0xaa, Access::ALL);
        let (dst, dmr) = buf(
            &b,
            64,
            0x11,
            if case == 2 {
                Access::LOCAL_WRITE | Access::REMOTE_READ
            } else {
                Access::ALL
            },
        );
        let (addr, key) = match case {
            0 => (dmr.addr, dmr.rkey ^ 0x1_0000), // stale generation
            1 => (dmr.addr + 8, dmr.rkey),        // runs past the end
            2 => (dmr.addr, dmr.rkey),            // no REMOTE_WRITE right
            _ => (dmr.addr, dmr.rkey + 5),        // a key nobody registered
        };
        let (rb, rmr) = buf(&b, 64, 0, Access::LOCAL_WRITE);
        let _ = rb;
        b.h.post_recv(b.qp, &[RecvWr::new(50, &[rmr.sge(0, 64)])])
            .unwrap();
        a.h.post_send(
            a.qp,
            &[
                SendWr::write(1, &[smr.sge(0, 64)], addr, key),
                SendWr::write(2, &[smr.sge(0, 8)], dmr.addr, dmr.rkey),
                SendWr::send(3, &[smr.sge(0, 8)]).unsignaled(),
            ],
        )
        .unwrap();
        let w = wait_cq(&*a.h, a.cq, 3, T).unwrap();
        assert_eq!(w[0].status, WcStatus::RemAccessErr, "case {case}");
        assert_eq!((w[1].wr_id, w[1].status), (2, WcStatus::WrFlushErr));
        assert_eq!(
            (w[2].wr_id, w[2].status),
            (3, WcStatus::WrFlushErr),
            "flushed even unsignaled"
        );
        assert!(
            dst.iter().all(|x| *x == 0x11),
            "case {case}: target touched"
        );
        assert_eq!(a.h.query_qp_state(a.qp).unwrap(), QpState::Err);
        // The responder's QP went to error too, flushing its receive.
        assert_eq!(b.h.query_qp_state(b.qp).unwrap(), QpState::Err);
        let r = one(&b);
        assert_eq!((r.wr_id, r.status), (50, WcStatus::WrFlushErr));
        // Posting to a QP in error completes flushed.
        a.h.post_send(a.qp, &[SendWr::send(9, &[smr.sge(0, 8)])])
            .unwrap();
        assert_eq!(one(&a).status, WcStatus::WrFlushErr);
    }
}

#[test]
fn deregistered_memory_is_out_of_reach() {
    let (a, b) = rc_pair();
    let (_s, smr) = buf(&a, 64, 1, Access::ALL);
    let (dst, dmr) = buf(&b, 64, 0, Access::ALL);
    b.h.dereg_mr(dmr).unwrap();
    a.h.post_send(
        a.qp,
        &[SendWr::write(1, &[smr.sge(0, 64)], dmr.addr, dmr.rkey)],
    )
    .unwrap();
    assert_eq!(one(&a).status, WcStatus::RemAccessErr);
    assert!(dst.iter().all(|x| *x == 0));
}

/// Host memory registered while device memory exists (here a static, far below the heap
/// mapping) is host memory: registration neither confuses the two nor trips over the address
/// arithmetic (it panicked with "attempt to subtract with overflow" in debug builds).
#[test]
fn host_memory_registered_beside_device_memory() {
    struct Host(std::cell::UnsafeCell<[u8; 64]>);
    // SAFETY: only this test touches it: the HCA writes it, then the test reads it.
    unsafe impl Sync for Host {}
    static HOST: Host = Host(std::cell::UnsafeCell::new([0; 64]));
    let (a, b) = rc_pair();
    let dm = b.h.alloc_dm(8192).unwrap();
    let (_s, smr) = buf(&a, 64, 7, Access::ALL);
    let p = HOST.0.get() as *mut u8;
    assert!((p as u64) < dm.ptr as u64);
    // SAFETY: a static, valid for the whole run.
    let hmr = unsafe { b.h.reg_mr(b.pd, p, 64, Access::ALL) }.unwrap();
    a.h.post_send(
        a.qp,
        &[SendWr::write(1, &[smr.sge(0, 64)], hmr.addr, hmr.rkey)],
    )
    .unwrap();
    assert_eq!(one(&a).status, WcStatus::Success);
    // SAFETY: the write completed; nothing else writes the static.
    let got = unsafe { std::ptr::read_volatile(HOST.0.get()) };
    assert!(got.iter().all(|x| *x == 7));
    b.h.dereg_mr(hmr).unwrap();
    b.h.free_dm(dm).unwrap();
}

#[test]
fn rnr_retries_until_a_receive_is_posted_and_gives_up_when_told() {
    let (a, b) = rc_pair();
    let (_s, smr) = buf(&a, 8, 5, Access::ALL);
    let (rb, rmr) = buf(&b, 8, 0, Access::LOCAL_WRITE);
    a.h.post_send(a.qp, &[SendWr::send(1, &[smr.sge(0, 8)])])
        .unwrap();
    // Nothing posted: the sender sees RNR NAKs and keeps trying (rnr_retry 7 = for ever).
    let t0 = std::time::Instant::now();
    while a.h.counters().rnr_naks < 3 {
        a.h.progress();
        assert!(t0.elapsed() < T, "no RNR NAK seen");
    }
    no_completion(&a);
    b.h.post_recv(b.qp, &[RecvWr::new(9, &[rmr.sge(0, 8)])])
        .unwrap();
    assert_eq!(one(&a).status, WcStatus::Success);
    assert_eq!(one(&b).wr_id, 9);
    assert_eq!(&rb[..], &[5; 8]);

    let (a, _b) = rc_pair_with(
        Config::default(),
        Config::default(),
        RcParams {
            rnr_retry: 2,
            ..fast()
        },
    );
    let (_s, smr) = buf(&a, 8, 5, Access::ALL);
    a.h.post_send(
        a.qp,
        &[
            SendWr::send(1, &[smr.sge(0, 8)]),
            SendWr::send(2, &[smr.sge(0, 8)]),
        ],
    )
    .unwrap();
    let w = wait_cq(&*a.h, a.cq, 2, T).unwrap();
    assert_eq!(
        (w[0].status, w[1].status),
        (WcStatus::RnrRetryExcErr, WcStatus::WrFlushErr)
    );
    assert_eq!(a.h.counters().rnr_naks, 3, "the first try and two retries");
}

#[test]
fn rc_is_in_order_and_a_write_is_visible_when_the_following_send_arrives() {
    let (a, b) = rc_pair();
    let n = 500usize;
    let (_s, smr) = buf(&a, 8 * n, 0, Access::ALL);
    for i in 0..n {
        // SAFETY: our registered buffer, not in use by any request yet.
        unsafe { *(smr.addr as *mut u64).add(i) = i as u64 };
    }
    let (dst, dmr) = buf(&b, 8 * n, 0, Access::ALL);
    let (rb, rmr) = buf(&b, 8 * n, 0, Access::LOCAL_WRITE);
    let _ = rb;
    let mut done = 0;
    // Chunks that fit the send queue (64 requests), the last send of each signaled and
    // waited for, as a program with unsignaled requests must (requests to another host stay
    // queued until their answers arrive).
    const K: usize = 25;
    for chunk in 0..n / K {
        let recvs: Vec<RecvWr> = (0..K)
            .map(|k| {
                let i = chunk * K + k;
                RecvWr::new(i as u64, &[rmr.sge(8 * i, 8)])
            })
            .collect();
        b.h.post_recv(b.qp, &recvs).unwrap();
        for k in 0..K {
            let i = chunk * K + k;
            let send = SendWr::send(i as u64, &[smr.sge(8 * i, 8)]);
            a.h.post_send(
                a.qp,
                &[
                    SendWr::write(0, &[smr.sge(8 * i, 8)], dmr.addr + 8 * i as u64, dmr.rkey)
                        .unsignaled(),
                    if k + 1 == K { send } else { send.unsignaled() },
                ],
            )
            .unwrap();
        }
        assert_eq!(
            wait_cq(&*a.h, a.cq, 1, T).unwrap()[0].status,
            WcStatus::Success
        );
        for w in wait_cq(&*b.h, b.cq, K, T).unwrap() {
            assert_eq!(w.wr_id as usize, done, "in order");
            // The write posted before the send is in place when the send completes.
            assert_eq!(
                u64::from_ne_bytes(dst[8 * done..8 * done + 8].try_into().unwrap()),
                done as u64
            );
            done += 1;
        }
    }
    assert_eq!(done, n);
}

#[test]
fn a_gone_or_mute_peer_exhausts_the_transport_retries() {
    let (a, b) = rc_pair();
    let (_s, smr) = buf(&a, 8, 5, Access::ALL);
    let (_d, dmr) = buf(&b, 8, 0, Access::ALL);
    b.h.set_mute(true);
    a.h.post_send(
        a.qp,
        &[SendWr::write(1, &[smr.sge(0, 8)], dmr.addr, dmr.rkey)],
    )
    .unwrap();
    let w = one(&a);
    assert_eq!(w.status, WcStatus::RetryExcErr);
    assert!(a.h.counters().retries >= 4, "{:?}", a.h.counters());

    let (a, b) = rc_pair();
    let (_s, smr) = buf(&a, 8, 5, Access::ALL);
    drop(b);
    a.h.post_send(a.qp, &[SendWr::send(1, &[smr.sge(0, 8)])])
        .unwrap();
    assert_eq!(one(&a).status, WcStatus::RetryExcErr);
}

/// A silent peer holds up only the QPs that talk to it, by their own timeouts: no call into
/// the HCA waits for the network (a request to another host used to be a blocking round trip
/// made under the HCA's one lock: `post_send` took the whole ACK timeout, and so did another
/// thread's `poll_cq` of an unrelated, empty CQ).
#[test]
fn a_silent_peer_holds_up_only_its_own_qps() {
    use std::time::Instant;
    // ACK timeout code 18: about 1.07 s per attempt, three attempts.
    let slow = RcParams {
        timeout: 18,
        retry_cnt: 2,
        ..fast()
    };
    let (a, b) = rc_pair_with(Config::default(), Config::default(), slow);
    // A second pair: `a`'s HCA to a live HCA `c` on `b`'s host.
    let a2 = side(a.h.clone(), QpType::Rc, None, Some(a.pd));
    let c = side(hca_b(Config::default()), QpType::Rc, None, None);
    connect_rc(&*a.h, a2.qp, 1, &Endpoint::of(&*c.h, c.qp, 2), &fast()).unwrap();
    connect_rc(&*c.h, c.qp, 2, &Endpoint::of(&*a.h, a2.qp, 1), &fast()).unwrap();
    let (_s, smr) = buf(&a, 8, 5, Access::ALL);
    let (_d, dmr) = buf(&b, 8, 0, Access::ALL);
    let (_r, rmr) = buf(&c, 8, 0, Access::LOCAL_WRITE);
    let other = a.h.create_cq(16).unwrap();
    b.h.set_mute(true);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let slowest = std::thread::scope(|sc| {
        // Another thread polls an unrelated, empty CQ of the same HCA all along.
        let poller = sc.spawn(|| {
            let mut w = [one_dummy(); 4];
            let mut worst = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                assert_eq!(a.h.poll_cq(other, &mut w).unwrap(), 0);
                worst = worst.max(t.elapsed());
                std::thread::yield_now();
            }
            worst
        });
        let t0 = Instant::now();
        a.h.post_send(
            a.qp,
            &[SendWr::write(1, &[smr.sge(0, 8)], dmr.addr, dmr.rkey)],
        )
        .unwrap();
        let posted = t0.elapsed();
        // The live peer is reached at once, while the silent one's request waits.
        c.h.post_recv(c.qp, &[RecvWr::new(7, &[rmr.sge(0, 8)])])
            .unwrap();
        a.h.post_send(a2.qp, &[SendWr::send(2, &[smr.sge(0, 8)])])
            .unwrap();
        let got = one(&c);
        let live = t0.elapsed();
        assert_eq!((got.wr_id, got.status), (7, WcStatus::Success));
        let w = one(&a2);
        let sent = t0.elapsed();
        assert_eq!((w.wr_id, w.status), (2, WcStatus::Success));
        let mut none = [one_dummy(); 1];
        assert_eq!(
            a.h.poll_cq(a.cq, &mut none).unwrap(),
            0,
            "the silent peer's write is still being retried"
        );
        let w = one(&a);
        stop.store(true, Ordering::Relaxed);
        let worst = poller.join().unwrap();
        assert_eq!((w.wr_id, w.status), (1, WcStatus::RetryExcErr));
        (posted, live, sent, worst)
    });
    let (posted, live, sent, worst) = slowest;
    let bound = Duration::from_millis(500);
    assert!(posted < bound, "post_send took {posted:?}");
    assert!(live < bound, "the live peer's message took {live:?}");
    assert!(
        sent < bound,
        "the live peer's send completion took {sent:?}"
    );
    assert!(worst < bound, "another thread's poll_cq took {worst:?}");
}

#[test]
fn a_send_longer_than_the_receive_is_a_length_error_at_the_receiver() {
    let (a, b) = rc_pair();
    let (_s, smr) = buf(&a, 100, 5, Access::ALL);
    let (rb, rmr) = buf(&b, 100, 0, Access::LOCAL_WRITE);
    b.h.post_recv(
        b.qp,
        &[
            RecvWr::new(1, &[rmr.sge(0, 50)]),
            RecvWr::new(2, &[rmr.sge(50, 50)]),
        ],
    )
    .unwrap();
    a.h.post_send(a.qp, &[SendWr::send(1, &[smr.sge(0, 100)])])
        .unwrap();
    assert_eq!(one(&a).status, WcStatus::RemInvReqErr);
    let r = wait_cq(&*b.h, b.cq, 2, T).unwrap();
    assert_eq!((r[0].wr_id, r[0].status), (1, WcStatus::LocLenErr));
    assert_eq!((r[1].wr_id, r[1].status), (2, WcStatus::WrFlushErr));
    assert!(rb.iter().all(|x| *x == 0));
}

#[test]
fn atomics_are_atomic_aligned_and_checked() {
    // Two initiators hammer one counter in user memory and one in device memory.
    let b = hca_b(Config::default());
    let pd = b.alloc_pd().unwrap();
    let (tgt, tmr) = {
        let s = Side {
            h: b.clone(),
            pd,
            cq: b.create_cq(4).unwrap(),
            qp: Qp { handle: 0, qpn: 0 },
        };
        buf(&s, 16, 0, Access::ALL)
    };
    let dm = b.alloc_dm(4096).unwrap();
    // SAFETY: dm memory of this HCA, alive until free_dm, accessed only by the HCA.
    let dmr = unsafe { b.reg_mr(pd, dm.ptr, 4096, Access::ALL) }.unwrap();
    let n = 2000u64;
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let bh = b.clone();
            let (tmr, dmr) = (tmr, dmr);
            std::thread::spawn(move || {
                let a = side(hca(Config::default()), QpType::Rc, None, None);
                let bs = side(bh, QpType::Rc, None, Some(pd));
                connect_rc(&*a.h, a.qp, 0, &Endpoint::of(&*bs.h, bs.qp, 0), &fast()).unwrap();
                connect_rc(&*bs.h, bs.qp, 0, &Endpoint::of(&*a.h, a.qp, 0), &fast()).unwrap();
                let (res, rmr) = buf(&a, 16, 0, Access::ALL);
                let mut seen = vec![];
                for i in 0..n {
                    let (m, off) = if i % 2 == 0 { (tmr, 8) } else { (dmr, 0) };
                    a.h.post_send(
                        a.qp,
                        &[SendWr::fetch_add(i, rmr.sge(0, 8), m.addr + off, m.rkey, 1)],
                    )
                    .unwrap();
                    assert_eq!(one(&a).status, WcStatus::Success);
                    seen.push((i % 2, u64::from_ne_bytes(res[..8].try_into().unwrap())));
                }
                seen
            })
        })
        .collect();
    let mut all: Vec<(u64, u64)> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len() as u64, 2 * n, "every fetched value distinct");
    assert_eq!(u64::from_ne_bytes(tgt[8..16].try_into().unwrap()), n);
    // SAFETY: reading the counter in device memory after every request completed.
    assert_eq!(unsafe { std::ptr::read_volatile(dm.ptr as *const u64) }, n);

    let (a, b2) = rc_pair();
    let (_r, rmr) = buf(&a, 8, 0, Access::ALL);
    let (t2, t2mr) = buf(&b2, 16, 0, Access::ALL);
    a.h.post_send(
        a.qp,
        &[SendWr::cas(1, rmr.sge(0, 8), t2mr.addr, t2mr.rkey, 0, 77)],
    )
    .unwrap();
    assert_eq!(one(&a).status, WcStatus::Success);
    assert_eq!(u64::from_ne_bytes(t2[..8].try_into().unwrap()), 77);
    assert!(a
        .h
        .post_send(
            a.qp,
            &[SendWr::cas(3, rmr.sge(0, 4), t2mr.addr, t2mr.rkey, 0, 0)]
        )
        .is_err());
    a.h.post_send(
        a.qp,
        &[SendWr::cas(
            2,
            rmr.sge(0, 8),
            t2mr.addr + 4,
            t2mr.rkey,
            77,
            1,
        )],
    )
    .unwrap();
    assert_eq!(one(&a).status, WcStatus::RemInvReqErr, "misaligned");
}

#[test]
fn a_retried_atomic_is_not_executed_twice() {
    let lossy = Config {
        rc_loss: 0.3,
        seed: 9,
        ..Config::default()
    };
    let (a, b) = rc_pair_with(
        lossy,
        Config::default(),
        RcParams {
            retry_cnt: 7,
            ..fast()
        },
    );
    let (res, rmr) = buf(&a, 8, 0, Access::ALL);
    let (t, tmr) = buf(&b, 8, 0, Access::ALL);
    let mut seen = vec![];
    for i in 0..300 {
        a.h.post_send(
            a.qp,
            &[SendWr::fetch_add(i, rmr.sge(0, 8), tmr.addr, tmr.rkey, 1)],
        )
        .unwrap();
        assert_eq!(one(&a).status, WcStatus::Success);
        seen.push(u64::from_ne_bytes(res[..8].try_into().unwrap()));
    }
    assert_eq!(seen, (0..300).collect::<Vec<u64>>());
    assert_eq!(u64::from_ne_bytes(t[..].try_into().unwrap()), 300);
    let c = a.h.counters();
    assert!(c.duplicates > 20 && c.retries > c.duplicates, "{c:?}");
}

#[test]
fn the_last_byte_of_a_write_lands_last() {
    for dm in [false, true] {
        let (a, b) = rc_pair();
        let len = 256 << 10;
        let (_s, smr) = buf(&a, len, 0, Access::ALL);
        let (target, tmr, _keep) = if dm {
            let d = b.h.alloc_dm(len).unwrap();
            // SAFETY: device memory of b, alive until the HCA drops.
            let m = unsafe { b.h.reg_mr(b.pd, d.ptr, len, Access::ALL) }.unwrap();
            (d.ptr as usize, m, None)
        } else {
            let (bx, m) = buf(&b, len, 0, Access::ALL);
            (m.addr as usize, m, Some(bx))
        };
        let rounds = 40u8;
        let watcher = std::thread::spawn(move || {
            for r in 1..=rounds {
                // SAFETY: the last byte of registered memory that outlives the thread.
                let last = unsafe { AtomicU8::from_ptr((target + len - 1) as *mut u8) };
                let t0 = std::time::Instant::now();
                while last.load(Ordering::Acquire) < r {
                    assert!(t0.elapsed() < T, "round {r} never arrived");
                }
                // Everything before the last byte is from this round (or later).
                for off in (0..len - 1).step_by(4093) {
                    // SAFETY: as above.
                    let v = unsafe { AtomicU8::from_ptr((target + off) as *mut u8) }
                        .load(Ordering::Relaxed);
                    assert!(v >= r, "dm={dm} round {r}: byte {off} is {v}");
                }
            }
        });
        for r in 1..=rounds {
            // SAFETY: our registered source buffer; the previous write completed.
            unsafe { std::ptr::write_bytes(smr.addr as *mut u8, r, len) };
            a.h.post_send(
                a.qp,
                &[SendWr::write(
                    r as u64,
                    &[smr.sge(0, len)],
                    tmr.addr,
                    tmr.rkey,
                )],
            )
            .unwrap();
            assert_eq!(one(&a).status, WcStatus::Success);
        }
        watcher.join().unwrap();
    }
}

#[test]
fn moving_a_qp_to_error_flushes_everything_outstanding() {
    let (a, b) = rc_pair();
    let (_s, smr) = buf(&a, 8, 0, Access::ALL);
    let (_r, rmr) = buf(&a, 8, 0, Access::LOCAL_WRITE);
    a.h.post_recv(a.qp, &[RecvWr::new(100, &[rmr.sge(0, 8)])])
        .unwrap();
    // Stuck behind RNR (b posted nothing).
    a.h.post_send(
        a.qp,
        &[
            SendWr::send(1, &[smr.sge(0, 8)]),
            SendWr::send(2, &[smr.sge(0, 8)]).unsignaled(),
        ],
    )
    .unwrap();
    a.h.modify_qp(
        a.qp,
        &QpAttr {
            qp_state: Some(QpState::Err),
            ..QpAttr::default()
        },
    )
    .unwrap();
    let mut w = wait_cq(&*a.h, a.cq, 3, T).unwrap();
    w.sort_by_key(|w| w.wr_id);
    assert!(w.iter().all(|w| w.status == WcStatus::WrFlushErr), "{w:?}");
    assert_eq!(
        w.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![1, 2, 100]
    );
    let _ = b;
}

#[test]
fn the_state_machine_is_enforced() {
    let a = side(hca(Config::default()), QpType::Rc, None, None);
    let (_s, smr) = buf(&a, 8, 0, Access::ALL);
    assert!(
        a.h.post_send(a.qp, &[SendWr::send(1, &[smr.sge(0, 8)])])
            .is_err(),
        "RESET"
    );
    assert!(
        a.h.post_recv(a.qp, &[RecvWr::new(1, &[smr.sge(0, 8)])])
            .is_err(),
        "RESET"
    );
    let e =
        a.h.modify_qp(
            a.qp,
            &QpAttr {
                qp_state: Some(QpState::Rtr),
                ..QpAttr::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("not a legal transition"), "{e}");
    let e =
        a.h.modify_qp(
            a.qp,
            &QpAttr {
                qp_state: Some(QpState::Init),
                ..QpAttr::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("qp_access_flags"), "{e}");
    a.h.modify_qp(
        a.qp,
        &QpAttr {
            qp_state: Some(QpState::Init),
            qp_access_flags: Some(Access::ALL),
            ..QpAttr::default()
        },
    )
    .unwrap();
    a.h.post_recv(a.qp, &[RecvWr::new(1, &[smr.sge(0, 8)])])
        .unwrap();
    let e =
        a.h.modify_qp(
            a.qp,
            &QpAttr {
                qp_state: Some(QpState::Rtr),
                dest_qp_num: Some(1),
                ..QpAttr::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("ah_attr"), "{e}");
    assert!(
        a.h.post_send(a.qp, &[SendWr::send(1, &[smr.sge(0, 8)])])
            .is_err(),
        "INIT"
    );
    let too_many: Vec<Sge> = (0..5).map(|_| smr.sge(0, 1)).collect();
    let (a, b) = rc_pair();
    let (_s, _smr) = buf(&a, 8, 0, Access::ALL);
    let (tb, tmr) = buf(&b, 16, 0, Access::ALL);
    let e =
        a.h.post_send(a.qp, &[SendWr::send(1, &too_many)])
            .unwrap_err();
    assert!(
        e.to_string().contains("request 0") && e.to_string().contains("SGEs"),
        "{e}"
    );
    let big = [7u8; 4000];
    let sge = Sge {
        addr: big.as_ptr() as u64,
        length: 4000,
        lkey: 0,
    };
    // SAFETY: `big` is readable for the whole test and nothing writes it.
    let w = unsafe { SendWr::send(1, &[sge]).inlined() };
    assert!(
        a.h.post_send(a.qp, &[w]).is_err(),
        "inline above max_inline_data"
    );
    // Inline data needs no key: it is copied at post time.
    let mut local = [3u8; 16];
    let wr = SendWr::write(
        5,
        &[Sge {
            addr: local.as_mut_ptr() as u64,
            length: 16,
            lkey: 0,
        }],
        tmr.addr,
        tmr.rkey,
    );
    // SAFETY: `local` is readable during the post below, and written only after it.
    let wr = unsafe { wr.inlined() };
    a.h.post_send(a.qp, &[wr]).unwrap();
    local = [0; 16];
    assert_eq!(one(&a).status, WcStatus::Success);
    assert_eq!(&tb[..], &[3u8; 16], "the payload was taken at post time");
    // An inline request may carry zero-length SGEs at address 0, as UCX's rc_verbs posts
    // them: they add nothing (a NULL slice of them was undefined behaviour; seen failing).
    let sges = [
        Sge {
            addr: 0,
            length: 0,
            lkey: 0,
        },
        Sge {
            addr: local.as_ptr() as u64,
            length: 16,
            lkey: 0,
        },
    ];
    // SAFETY: the one SGE with bytes is `local`, readable during the post.
    let wr = unsafe { SendWr::write(7, &sges, tmr.addr, tmr.rkey).inlined() };
    a.h.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(one(&a).status, WcStatus::Success);
    assert_eq!(&tb[..], &[0u8; 16]);
    // A zero-length write needs no valid key.
    a.h.post_send(a.qp, &[SendWr::write(6, &[], 0, 0)]).unwrap();
    assert_eq!(one(&a).status, WcStatus::Success);
}

#[test]
fn ud_delivers_one_mtu_behind_a_grh_and_drops_silently() {
    let (a, b, ah) = ud_pair(Config::default(), 0x1111);
    let (_s, smr) = buf(&a, 4096, 9, Access::ALL);
    let (rb, rmr) = buf(&b, 4096, 0, Access::LOCAL_WRITE);
    // No receive posted: dropped, yet the send completes (UD has no RNR).
    a.h.post_send(
        a.qp,
        &[SendWr::send(1, &[smr.sge(0, 100)]).to(ah, b.qp.qpn, 0x1111)],
    )
    .unwrap();
    assert_eq!(one(&a).status, WcStatus::Success);
    wait_dropped(&a, &b, 1);
    b.h.post_recv(b.qp, &[RecvWr::new(1, &[rmr.sge(0, 2048 + 40)])])
        .unwrap();
    // Wrong qkey: dropped.
    a.h.post_send(
        a.qp,
        &[SendWr::send(2, &[smr.sge(0, 100)]).to(ah, b.qp.qpn, 0x2222)],
    )
    .unwrap();
    one(&a);
    wait_dropped(&a, &b, 2);
    no_completion(&b);
    // One MTU fits; the GRH comes first and counts in byte_len.
    a.h.post_send(
        a.qp,
        &[SendWr::send_imm(3, &[smr.sge(0, 2048)], 5).to(ah, b.qp.qpn, 0x1111)],
    )
    .unwrap();
    one(&a);
    let r = one(&b);
    assert_eq!(
        (r.status, r.byte_len, r.grh, r.src_qp, r.imm),
        (WcStatus::Success, 2088, true, a.qp.qpn, Some(5))
    );
    assert_eq!(rb[0] >> 4, 6, "GRH version");
    assert!(rb[40..2088].iter().all(|x| *x == 9));
    // Above the MTU: a local length error at the sender.
    a.h.post_send(
        a.qp,
        &[SendWr::send(4, &[smr.sge(0, 2049)]).to(ah, b.qp.qpn, 0x1111)],
    )
    .unwrap();
    assert_eq!(one(&a).status, WcStatus::LocLenErr);
    // A receive without room for GRH + payload completes with a length error; the QP lives on.
    b.h.post_recv(
        b.qp,
        &[
            RecvWr::new(5, &[rmr.sge(0, 100)]),
            RecvWr::new(6, &[rmr.sge(0, 200)]),
        ],
    )
    .unwrap();
    a.h.post_send(
        a.qp,
        &[
            SendWr::send(5, &[smr.sge(0, 100)]).to(ah, b.qp.qpn, 0x1111),
            SendWr::send(6, &[smr.sge(0, 100)]).to(ah, b.qp.qpn, 0x1111),
        ],
    )
    .unwrap();
    let r = wait_cq(&*b.h, b.cq, 2, T).unwrap();
    assert_eq!((r[0].wr_id, r[0].status), (5, WcStatus::LocLenErr));
    assert_eq!(
        (r[1].wr_id, r[1].status, r[1].byte_len),
        (6, WcStatus::Success, 140)
    );
    assert_eq!(a.h.counters().ud_dropped + b.h.counters().ud_dropped, 2);
}

/// Seeded loss, duplication and reordering: the same seed gives the same story.
#[test]
fn ud_faults_are_seeded() {
    let run = |seed: u64| {
        let cfg = Config {
            ud_drop: 0.1,
            ud_dup: 0.1,
            ud_reorder: 0.1,
            seed,
            ..Config::default()
        };
        let (a, b, ah) = ud_pair(cfg, 1);
        let (_s, smr) = buf(&a, 8 * 100, 0, Access::ALL);
        let (rb, rmr) = buf(&b, 48 * 128, 0, Access::LOCAL_WRITE);
        let recvs: Vec<RecvWr> = (0..128)
            .map(|i| RecvWr::new(i, &[rmr.sge(48 * i as usize, 48)]))
            .collect();
        b.h.post_recv(b.qp, &recvs).unwrap();
        for i in 0..100u64 {
            // SAFETY: our registered buffer, not in use by a request.
            unsafe { *(smr.addr as *mut u64).add(i as usize) = i };
            a.h.post_send(
                a.qp,
                &[SendWr::send(i, &[smr.sge(8 * i as usize, 8)])
                    .to(ah, b.qp.qpn, 1)
                    .unsignaled()],
            )
            .unwrap();
        }
        // A datagram held back for reordering leaves at the next progress after 1 ms.
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_millis(5) {
            a.h.progress();
        }
        // What arrives: every datagram not dropped, the duplicated ones twice (across hosts
        // they arrive after the sends completed).
        let c = a.h.counters();
        let want = (100 - c.ud_dropped + c.ud_duplicated) as usize;
        let mut got = vec![];
        let mut w = [one_dummy(); 64];
        while got.len() < want {
            assert!(
                t0.elapsed() < T,
                "{} of {want} datagrams arrived",
                got.len()
            );
            let n = b.h.poll_cq(b.cq, &mut w).unwrap();
            for x in &w[..n] {
                let o = 48 * x.wr_id as usize + 40;
                got.push(u64::from_ne_bytes(rb[o..o + 8].try_into().unwrap()));
            }
        }
        no_completion(&b);
        (got, c)
    };
    let (g1, c1) = run(3);
    let (g2, _) = run(3);
    let (g3, _) = run(4);
    assert_eq!(g1, g2, "same seed, same deliveries");
    assert_ne!(g1, g3);
    assert!(c1.ud_dropped > 3 && c1.ud_duplicated > 3, "{c1:?}");
    let mut sorted = g1.clone();
    sorted.sort();
    assert_ne!(sorted, g1, "some reordering");
    assert!(g1.windows(2).any(|w| w[0] == w[1]), "some duplicates");
}

/// Many datagrams of one post to one process are handed over together on one host (one
/// copy for the lot); each still fills its own receive, completes in order, and fails alone.
#[test]
fn ud_datagrams_of_one_post_each_land_in_their_own_receive() {
    const N: usize = 64;
    const P: usize = 256;
    let (a, b, ah) = ud_pair(Config::default(), 7);
    let (_s, smr) = buf(&a, N * P, 0, Access::ALL);
    for i in 0..N * P {
        // SAFETY: our registered buffer, not in use by a request.
        unsafe { *(smr.addr as *mut u8).add(i) = (i * 7 + i / P) as u8 };
    }
    // SAFETY: as above; read-only from here.
    let want = unsafe { std::slice::from_raw_parts(smr.addr as *const u8, N * P) }.to_vec();
    let send = |n: usize, len: usize, stride: usize| {
        let wrs: Vec<SendWr> = (0..n)
            .map(|i| {
                SendWr::send_imm(i as u64, &[smr.sge(i * stride, len)], i as u32)
                    .to(ah, b.qp.qpn, 7)
            })
            .collect();
        a.h.post_send(a.qp, &wrs).unwrap();
        let c = wait_cq(&*a.h, a.cq, n, T).unwrap();
        assert!(c.iter().all(|w| w.status == WcStatus::Success), "{c:?}");
        wait_cq(&*b.h, b.cq, n, T).unwrap()
    };
    let before = a.h.counters();

    // The zero-copy shape: every GRH into one scratch buffer, the pieces side by side.
    let (rb, rmr) = buf(&b, N * P, 0, Access::LOCAL_WRITE);
    let (grh, gmr) = buf(&b, GRH_LEN, 0, Access::LOCAL_WRITE);
    let recvs: Vec<RecvWr> = (0..N)
        .map(|i| RecvWr::new(i as u64, &[gmr.sge(0, GRH_LEN), rmr.sge(i * P, P)]))
        .collect();
    b.h.post_recv(b.qp, &recvs).unwrap();
    let got = send(N, P, P);
    for (i, w) in got.iter().enumerate() {
        assert_eq!(
            (w.wr_id, w.status, w.byte_len, w.imm),
            (
                i as u64,
                WcStatus::Success,
                (GRH_LEN + P) as u32,
                Some(i as u32)
            )
        );
    }
    assert!(rb[..] == want[..], "pieces in place");
    assert_eq!(grh[0] >> 4, 6, "GRH version");
    if super::ONE_HOST {
        let c = a.h.counters();
        assert_eq!(c.ud_batched - before.ud_batched, N as u64, "{c:?}");
        assert!(c.ud_batches - before.ud_batches <= N as u64 / 8, "{c:?}");
    }

    // Receives that overlap: the memory ends as if the datagrams landed one by one, in order.
    let (rb2, rmr2) = buf(&b, 4 * N + GRH_LEN + 8, 0, Access::LOCAL_WRITE);
    let recvs: Vec<RecvWr> = (0..N)
        .map(|i| RecvWr::new(i as u64, &[rmr2.sge(4 * i, GRH_LEN + 8)]))
        .collect();
    b.h.post_recv(b.qp, &recvs).unwrap();
    let got = send(N, 8, P);
    assert!(got.iter().all(|w| w.status == WcStatus::Success));
    let mut model = vec![0u8; rb2.len()];
    for i in 0..N {
        let at = 4 * i + GRH_LEN;
        // The GRH bytes are the same for every datagram of one sender and length.
        model[4 * i..at].copy_from_slice(&rb2[4 * (N - 1)..4 * (N - 1) + GRH_LEN]);
        model[at..at + 8].copy_from_slice(&want[i * P..i * P + 8]);
    }
    assert!(rb2[..] == model[..], "overlapping receives as in order");
    // Receives into one and the same place: the last datagram's bytes stay.
    let recvs: Vec<RecvWr> = (0..8)
        .map(|i| RecvWr::new(i as u64, &[rmr2.sge(0, GRH_LEN + 8)]))
        .collect();
    b.h.post_recv(b.qp, &recvs).unwrap();
    send(8, 8, P);
    assert!(
        rb2[GRH_LEN..GRH_LEN + 8] == want[7 * P..7 * P + 8],
        "the last one wins"
    );

    // A receive the kernel cannot write (registered, then made read-only): that datagram
    // completes with a protection error, its neighbours land.
    let page = 4096;
    // SAFETY: a fresh anonymous mapping, ours alone; unmapped below after its last use.
    let ro = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ro, libc::MAP_FAILED);
    // SAFETY: the mapping above, alive until munmap after the completions.
    let romr = unsafe { b.h.reg_mr(b.pd, ro as *mut u8, page, Access::LOCAL_WRITE) }.unwrap();
    // SAFETY: our mapping; made read-only so that a copy into it faults.
    assert_eq!(unsafe { libc::mprotect(ro, page, libc::PROT_READ) }, 0);
    let (rb3, rmr3) = buf(&b, 8 * P, 0, Access::LOCAL_WRITE);
    let recvs: Vec<RecvWr> = (0..8)
        .map(|i| {
            let m = if i == 3 { &romr } else { &rmr3 };
            RecvWr::new(i as u64, &[gmr.sge(0, GRH_LEN), m.sge(i * P % page, P)])
        })
        .collect();
    b.h.post_recv(b.qp, &recvs).unwrap();
    let got = send(8, P, P);
    for (i, w) in got.iter().enumerate() {
        let st = if i == 3 {
            WcStatus::LocProtErr
        } else {
            WcStatus::Success
        };
        assert_eq!((w.wr_id, w.status), (i as u64, st), "{got:?}");
        if i != 3 {
            assert!(rb3[i * P..(i + 1) * P] == want[i * P..(i + 1) * P]);
        }
    }
    b.h.dereg_mr(romr).unwrap();
    // SAFETY: the mapping above; its registration is gone and no request names it.
    unsafe { libc::munmap(ro, page) };
}

#[test]
fn srq_serves_many_qps_and_fires_its_limit_event_once() {
    let b = hca_b(Config::default());
    let pd = b.alloc_pd().unwrap();
    let srq = b.create_srq(pd, 16, 1).unwrap();
    let bs1 = side(b.clone(), QpType::Rc, Some(srq), Some(pd));
    let bs2 = side(b.clone(), QpType::Rc, Some(srq), Some(pd));
    let a1 = side(hca(Config::default()), QpType::Rc, None, None);
    let a2 = side(hca(Config::default()), QpType::Rc, None, None);
    for (a, bs) in [(&a1, &bs1), (&a2, &bs2)] {
        connect_rc(&*a.h, a.qp, 0, &Endpoint::of(&*bs.h, bs.qp, 0), &fast()).unwrap();
        connect_rc(&*bs.h, bs.qp, 0, &Endpoint::of(&*a.h, a.qp, 0), &fast()).unwrap();
    }
    let (_r, rmr) = buf(&bs1, 16 * 8, 0, Access::LOCAL_WRITE);
    let recvs: Vec<RecvWr> = (0..10)
        .map(|i| RecvWr::new(i, &[rmr.sge(8 * i as usize, 8)]))
        .collect();
    b.post_srq_recv(srq, &recvs).unwrap();
    assert!(
        b.post_recv(bs1.qp, &recvs[..1]).is_err(),
        "receives go to the SRQ"
    );
    b.arm_srq_limit(srq, 5).unwrap();
    assert_eq!(b.accounting().posted_recvs, 10);
    assert_eq!(b.accounting().posted_recv_bytes, 80);
    for (i, a) in [&a1, &a2, &a1, &a2, &a1, &a2].into_iter().enumerate() {
        let (_s, smr) = buf(a, 8, i as u8, Access::ALL);
        a.h.post_send(a.qp, &[SendWr::send(i as u64, &[smr.sge(0, 8)])])
            .unwrap();
        assert_eq!(one(a).status, WcStatus::Success);
        // Fires when fewer than 5 remain: after the sixth receive is taken.
        assert_eq!(b.srq_limit_reached(srq).unwrap(), i == 5, "after send {i}");
    }
    let w = wait_cq(&*b, bs1.cq, 3, T).unwrap();
    assert_eq!(w.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![0, 2, 4]);
    assert_eq!(wait_cq(&*b, bs2.cq, 3, T).unwrap().len(), 3);
    assert!(!b.srq_limit_reached(srq).unwrap(), "fires once");
}

#[test]
fn a_full_cq_is_an_overrun_error() {
    let (a, b) = rc_pair();
    let (_s, smr) = buf(&a, 8, 0, Access::ALL);
    let (_d, dmr) = buf(&b, 8, 0, Access::ALL);
    let cq = a.h.create_cq(3).unwrap(); // 4 entries
    let qp =
        a.h.create_qp(
            a.pd,
            &QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: cq,
                recv_cq: cq,
                srq: None,
                cap: QpCap::default(),
                sq_sig_all: true,
            },
        )
        .unwrap();
    let bq =
        b.h.create_qp(
            b.pd,
            &QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: b.cq,
                recv_cq: b.cq,
                srq: None,
                cap: QpCap::default(),
                sq_sig_all: false,
            },
        )
        .unwrap();
    connect_rc(&*a.h, qp, 0, &Endpoint::of(&*b.h, bq, 0), &fast()).unwrap();
    connect_rc(&*b.h, bq, 0, &Endpoint::of(&*a.h, qp, 0), &fast()).unwrap();
    let wrs: Vec<SendWr> = (0..6)
        .map(|i| SendWr::write(i, &[smr.sge(0, 8)], dmr.addr, dmr.rkey).unsignaled())
        .collect();
    a.h.post_send(qp, &wrs).unwrap();
    // The requests run on the HCA's time (across hosts, as the answers arrive): look (taking
    // no completion out, which would make room) until the CQ reports the overrun.
    let t0 = std::time::Instant::now();
    let e = loop {
        match a.h.poll_cq(cq, &mut []) {
            Err(e) => break e,
            Ok(n) => assert_eq!(n, 0),
        }
        assert!(t0.elapsed() < T, "no overrun within {T:?}");
        std::thread::yield_now();
    };
    assert!(e.to_string().contains("overrun"), "{e}");
}

#[test]
fn accounting_follows_the_documented_model() {
    let h = hca(Config::default());
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(255).unwrap();
    let base = h.accounting();
    assert_eq!((base.cqs, base.cq_bytes), (1, 64 + 64 + 256 * 64));
    let init = |ty| QpInitAttr {
        qp_type: ty,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: QpCap::default(),
        sq_sig_all: false,
    };
    let rcs: Vec<Qp> = (0..10)
        .map(|_| h.create_qp(pd, &init(QpType::Rc)).unwrap())
        .collect();
    let ud = h.create_qp(pd, &init(QpType::Ud)).unwrap();
    let a = h.accounting();
    let per_rc = weft_verbs::soft::model::qp_bytes(false, &QpCap::default(), false);
    assert_eq!((a.rc_qps, a.rc_qp_bytes), (10, 10 * per_rc));
    assert_eq!(
        (a.ud_qps, a.ud_qp_bytes),
        (
            1,
            weft_verbs::soft::model::qp_bytes(true, &QpCap::default(), false)
        )
    );
    let mut b = vec![0u8; 3 * 4096];
    // SAFETY: `b` outlives the registration (deregistered below).
    let mr = unsafe { h.reg_mr(pd, b.as_mut_ptr(), b.len(), Access::LOCAL_WRITE) }.unwrap();
    assert_eq!(h.accounting().mrs, 1);
    h.modify_qp(
        ud,
        &QpAttr {
            qp_state: Some(QpState::Init),
            qkey: Some(1),
            ..QpAttr::default()
        },
    )
    .unwrap();
    h.post_recv(
        ud,
        &[
            RecvWr::new(1, &[mr.sge(0, 1000)]),
            RecvWr::new(2, &[mr.sge(0, 24)]),
        ],
    )
    .unwrap();
    let a = h.accounting();
    assert_eq!((a.posted_recvs, a.posted_recv_bytes), (2, 1024));
    assert!(a.total() > a.rc_qp_bytes + a.ud_qp_bytes);
    for q in rcs {
        h.destroy_qp(q).unwrap();
    }
    h.destroy_qp(ud).unwrap();
    h.dereg_mr(mr).unwrap();
    assert_eq!(h.accounting(), base);
    assert!(h.destroy_cq(cq).is_ok() && h.dealloc_pd(pd).is_ok());
}

/// The timing model: a message arrives no earlier than the link latency after it was posted,
/// and the latencies of a window of requests overlap (each is stamped when posted), as on a
/// wire; before they were stamped one at a time, 16 writes took 16 latencies.
#[test]
fn timing_model_latencies_overlap_in_a_window() {
    let lat = Duration::from_millis(2);
    let slow = Config {
        latency: lat,
        ..Config::default()
    };
    let (a, b) = rc_pair_with(slow, Config::default(), fast());
    let (_src, smr) = buf(&a, 64, 1, Access::LOCAL_WRITE);
    let (_dst, dmr) = buf(&b, 8 * 16, 0, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let t0 = std::time::Instant::now();
    for i in 0..16u64 {
        let mut wr = SendWr::write(i, &[smr.sge(0, 8)], dmr.addr + 8 * i, dmr.rkey);
        wr.signaled = true;
        a.h.post_send(a.qp, &[wr]).unwrap();
    }
    let got = wait_cq(&*a.h, a.cq, 16, T).unwrap();
    let took = t0.elapsed();
    assert_eq!(got.len(), 16);
    assert!(got.iter().all(|w| w.status == WcStatus::Success));
    assert!(
        took >= lat,
        "completed after {took:?}, before the link latency"
    );
    // One latency after another would take at least 16 of them; anything less overlapped
    // (the margin below that is for a loaded machine: 8 latencies failed under CI's load).
    assert!(
        took < 16 * lat,
        "16 writes took {took:?}: latencies did not overlap"
    );
}

/// The QP-context cache of the timing model holds the sender's QP contexts: one UD QP that
/// sends to many destinations stays cached (the address travels in each work request, as
/// paper 001 says of UD-SR), while RC needs one QP per peer and misses once they outnumber
/// the cache.
#[test]
fn timing_model_caches_one_ud_qp_whatever_its_destinations() {
    let cfg = Config {
        qp_cache: 2,
        ..Config::default()
    };
    let a = side(hca(cfg.clone()), QpType::Ud, None, None);
    let hb = hca_b(Config::default());
    activate_ud(&*a.h, a.qp, 9).unwrap();
    let ah =
        a.h.create_ah(
            a.pd,
            &AhAttr {
                dgid: hb.gid(),
                ..AhAttr::default()
            },
        )
        .unwrap();
    let dests: Vec<Side> = (0..4)
        .map(|_| {
            let d = side(hb.clone(), QpType::Ud, None, None);
            activate_ud(&*d.h, d.qp, 9).unwrap();
            d
        })
        .collect();
    let (_s, smr) = buf(&a, 64, 1, Access::ALL);
    let before = a.h.counters().qp_cache_misses;
    // Round robin over four destinations with a cache of two: each would evict the next.
    for round in 0..3u64 {
        for (i, d) in dests.iter().enumerate() {
            let id = round * 4 + i as u64;
            let mut wr = SendWr::send(id, &[smr.sge(0, 8)]).to(ah, d.qp.qpn, 9);
            wr.signaled = true;
            a.h.post_send(a.qp, &[wr]).unwrap();
            assert_eq!(one(&a).status, WcStatus::Success);
        }
    }
    assert_eq!(
        a.h.counters().qp_cache_misses - before,
        1,
        "one UD QP misses once, at its first send"
    );

    // Four RC QPs of one context used in turn with a cache of two miss at every request.
    let ra = hca(cfg);
    let rb = hca_b(Config::default());
    let (pa, pb) = (ra.alloc_pd().unwrap(), rb.alloc_pd().unwrap());
    let (src, smr) = {
        let mut b = vec![1u8; 64].into_boxed_slice();
        // SAFETY: the box outlives the MR's use in this test (leaked with the HCA at the end).
        let mr = unsafe { ra.reg_mr(pa, b.as_mut_ptr(), 64, Access::ALL) }.unwrap();
        (b, mr)
    };
    let mut dst = vec![0u8; 64].into_boxed_slice();
    // SAFETY: as above.
    let dmr = unsafe { rb.reg_mr(pb, dst.as_mut_ptr(), 64, Access::ALL) }.unwrap();
    let cq = ra.create_cq(64).unwrap();
    let qps: Vec<Qp> = (0..4)
        .map(|i| {
            let init = |cq| QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: cq,
                recv_cq: cq,
                srq: None,
                cap: QpCap::default(),
                sq_sig_all: false,
            };
            let qa = ra.create_qp(pa, &init(cq)).unwrap();
            let cqb = rb.create_cq(4).unwrap();
            let qb = rb.create_qp(pb, &init(cqb)).unwrap();
            let ea = Endpoint::of(&*ra, qa, 300 + i);
            let eb = Endpoint::of(&*rb, qb, 400 + i);
            connect_rc(&*ra, qa, 300 + i, &eb, &fast()).unwrap();
            connect_rc(&*rb, qb, 400 + i, &ea, &fast()).unwrap();
            qa
        })
        .collect();
    let before = ra.counters().qp_cache_misses;
    for round in 0..3u64 {
        for (i, q) in qps.iter().enumerate() {
            let mut wr = SendWr::write(round * 4 + i as u64, &[smr.sge(0, 8)], dmr.addr, dmr.rkey);
            wr.signaled = true;
            ra.post_send(*q, &[wr]).unwrap();
            assert_eq!(
                wait_cq(&*ra, cq, 1, T).unwrap()[0].status,
                WcStatus::Success
            );
        }
    }
    assert_eq!(ra.counters().qp_cache_misses - before, 12);
    drop(src);
}

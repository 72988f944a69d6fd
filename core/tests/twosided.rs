//! Two-sided MPI semantics on the loopback provider, through the static path
//! (`Comm<Loopback>`) and the dynamic path (`Comm<Box<dyn Provider>>`, chosen by name).
//!
//! Size (over 800 lines): one test file per API area; every case here runs on both dispatch paths
//! through one macro, and splitting would duplicate it.

use weft::{Comm, Datatype, ErrorKind, Op, Provider, SharedBuf, ANY_SOURCE, ANY_TAG};
use weft_testing::{self as testing, Options};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Generate `static_<name>` and `dynamic_<name>` tests running `$body` on `$n` ranks.
macro_rules! both_paths {
    ($name:ident, $n:expr, $body:path) => {
        both_paths!($name, $n, $body, Options::default());
    };
    ($name:ident, $n:expr, $body:path, $opts:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn static_path() {
                testing::world_with($n, &$opts, |c| $body(c));
            }
            #[test]
            fn dynamic_path() {
                testing::world_dyn_with($n, "loopback", &$opts, |c| $body(c));
            }
        }
    };
}

const SIZES: &[usize] = &[
    0,
    1,
    8,
    1000,
    16383,
    16384,
    16385,
    100_000,
    1 << 20,
    (4 << 20) + 3,
];

fn pingpong<P: Provider>(c: &Comm<P>) {
    for (i, &n) in SIZES.iter().enumerate() {
        let tag = i as i32;
        if c.rank() == 0 {
            let data = pattern(n, i as u8);
            c.send(&data, 1, tag).unwrap();
            let mut back = vec![0u8; n];
            let st = c.recv(&mut back, 1, tag).unwrap();
            assert_eq!(st.bytes, n);
            assert_eq!(st.source, 1);
            assert_eq!(back, data, "size {n}");
        } else {
            let mut buf = vec![0u8; n];
            let st = c.recv(&mut buf, 0, tag).unwrap();
            assert_eq!((st.source, st.tag, st.bytes), (0, tag, n));
            assert_eq!(buf, pattern(n, i as u8));
            c.send(&buf, 0, tag).unwrap();
        }
    }
}
both_paths!(pingpong_all_sizes, 2, pingpong);

fn rma_opts() -> Options {
    let mut o = Options::default();
    o.loopback.rma = true;
    o
}
both_paths!(pingpong_rma_read_rendezvous, 2, pingpong, rma_opts());

fn tiny_mailbox() -> Options {
    let mut o = Options::default();
    o.loopback.depth = 2;
    o.loopback.eager = 512;
    o
}

fn many_outstanding<P: Provider>(c: &Comm<P>) {
    // 200 nonblocking messages each way through a 2-deep mailbox: the Busy path everywhere.
    let n = 200;
    let peer = 1 - c.rank();
    let sends: Vec<Vec<u8>> = (0..n).map(|i| pattern(i * 37 % 3000, i as u8)).collect();
    let mut recvs: Vec<Vec<u8>> = (0..n).map(|i| vec![0u8; i * 37 % 3000]).collect();
    c.scope(|s| {
        let mut reqs = Vec::new();
        for (i, b) in recvs.iter_mut().enumerate() {
            reqs.push(c.irecv(s, b, peer, i as i32).unwrap());
        }
        for (i, b) in sends.iter().enumerate() {
            reqs.push(c.isend(s, b, peer, i as i32).unwrap());
        }
        weft::waitall(reqs).unwrap();
    });
    for (i, r) in recvs.iter().enumerate() {
        assert_eq!(r, &sends[i]);
    }
}
both_paths!(flow_control_busy_paths, 2, many_outstanding, tiny_mailbox());

/// A window of receives into one `SharedBuf` (OSU's convention): identical messages of every
/// size leave that message in the buffer, messages of different lengths each report their own,
/// and one too long for the buffer fails alone with truncation.
fn shared_window<P: Provider>(c: &Comm<P>) {
    const WINDOW: usize = 8;
    let peer = 1 - c.rank();
    for (i, &n) in SIZES.iter().enumerate() {
        let tag = i as i32;
        if c.rank() == 0 {
            let data = pattern(n, i as u8);
            c.scope(|s| {
                let reqs: Vec<_> = (0..WINDOW)
                    .map(|_| c.isend(s, &data, peer, tag).unwrap())
                    .collect();
                weft::waitall(reqs).unwrap();
            });
        } else {
            let mut buf = SharedBuf::new(n);
            let sts = c.scope(|s| {
                let reqs: Vec<_> = (0..WINDOW)
                    .map(|_| c.irecv_shared(s, &buf, peer, tag).unwrap())
                    .collect();
                weft::waitall(reqs).unwrap()
            });
            assert!(sts
                .iter()
                .all(|st| (st.source, st.tag, st.bytes) == (0, tag, n)));
            assert_eq!(buf.as_mut_slice(), &pattern(n, i as u8)[..], "size {n}");
        }
    }
    // Different lengths into one buffer; the last is one byte too long.
    let lens = [10usize, 70_000, 3, 1 << 20, (1 << 20) + 1];
    let tag = 100;
    if c.rank() == 0 {
        for (j, &n) in lens.iter().enumerate() {
            c.send(&pattern(n, j as u8), peer, tag).unwrap();
        }
    } else {
        let buf = SharedBuf::new(1 << 20);
        c.scope(|s| {
            let reqs: Vec<_> = lens
                .iter()
                .map(|_| c.irecv_shared(s, &buf, peer, tag).unwrap())
                .collect();
            for (r, &n) in reqs.into_iter().zip(&lens) {
                match r.wait() {
                    Ok(st) => assert_eq!(st.bytes, n),
                    Err(e) => {
                        assert_eq!(n, (1 << 20) + 1);
                        assert_eq!(e.kind(), ErrorKind::Truncated);
                    }
                }
            }
        });
    }
}
both_paths!(window_into_one_buffer, 2, shared_window);
both_paths!(
    window_into_one_buffer_rma_read,
    2,
    shared_window,
    rma_opts()
);
both_paths!(
    window_into_one_buffer_busy_paths,
    2,
    shared_window,
    tiny_mailbox()
);

fn wildcards<P: Provider>(c: &Comm<P>) {
    let n = c.size();
    if c.rank() == 0 {
        let mut seen = vec![false; n as usize];
        for _ in 1..n {
            let mut b = [0u32; 2];
            let st = c.recv(&mut b, ANY_SOURCE, ANY_TAG).unwrap();
            assert_eq!(b[0], st.source);
            assert_eq!(st.tag as u32, 100 + st.source);
            assert_eq!(st.count::<u32>(), 2);
            seen[st.source as usize] = true;
        }
        assert!(seen[1..].iter().all(|x| *x));
        c.barrier().unwrap();
        // ANY_SOURCE with a fixed tag, ANY_TAG with a fixed source.
        let mut b = [0u32; 2];
        let st = c.recv(&mut b, ANY_SOURCE, 7).unwrap();
        assert_eq!(st.tag, 7);
        let st = c.recv(&mut b, 1, ANY_TAG).unwrap();
        assert_eq!((st.source, st.tag), (1, 8));
    } else {
        c.send(&[c.rank(), 0], 0, 100 + c.rank() as i32).unwrap();
        c.barrier().unwrap();
        if c.rank() == 1 {
            c.send(&[1u32, 1], 0, 7).unwrap();
            c.send(&[1u32, 2], 0, 8).unwrap();
        }
    }
}
both_paths!(wildcard_source_and_tag, 4, wildcards);

fn ordering<P: Provider>(c: &Comm<P>) {
    // Non-overtaking: mixed eager and rendezvous messages with one tag arrive in send order,
    // and a wildcard receive does not reorder them.
    let sizes = [8usize, 70_000, 16, 200_000, 0, 20_000, 3];
    if c.rank() == 0 {
        for (i, &n) in sizes.iter().enumerate() {
            let mut d = pattern(n, i as u8);
            if n > 0 {
                d[0] = i as u8;
            }
            c.send(&d, 1, 5).unwrap();
        }
    } else {
        for (i, &n) in sizes.iter().enumerate() {
            let mut b = vec![0u8; 200_000];
            let st = if i % 2 == 0 {
                c.recv(&mut b, 0, 5).unwrap()
            } else {
                c.recv(&mut b, ANY_SOURCE, ANY_TAG).unwrap()
            };
            assert_eq!(st.bytes, n, "message {i} out of order");
            if n > 0 {
                assert_eq!(b[0], i as u8);
            }
        }
    }
}
both_paths!(non_overtaking_order, 2, ordering);

fn truncation<P: Provider>(c: &Comm<P>) {
    for (tag, n) in [(1, 100usize), (2, 50_000)] {
        if c.rank() == 0 {
            c.send(&pattern(n, 1), 1, tag).unwrap();
        } else {
            let mut buf = [0xEEu8; 64];
            let e = c.recv(&mut buf[..10], 0, tag).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Truncated);
            let (status, capacity) = e.truncated().expect("a truncation error");
            assert_eq!((status.bytes, capacity, status.source), (n, 10, 0));
            assert_eq!(&buf[..10], &pattern(n, 1)[..10]);
            assert!(
                buf[10..].iter().all(|b| *b == 0xEE),
                "wrote past the buffer"
            );
        }
    }
    // Later messages still flow.
    if c.rank() == 0 {
        c.send(&[9u8], 1, 3).unwrap();
    } else {
        let mut b = [0u8];
        c.recv(&mut b, 0, 3).unwrap();
        assert_eq!(b[0], 9);
    }
}
both_paths!(truncation_is_an_error, 2, truncation);

fn probe_cancel<P: Provider>(c: &Comm<P>) {
    if c.rank() == 0 {
        c.send(&pattern(777, 3), 1, 42).unwrap();
        c.send(&pattern(30_000, 4), 1, 43).unwrap();
        let mut go = [0u8];
        c.recv(&mut go, 1, 1).unwrap();
    } else {
        let st = c.probe(0, 43).unwrap();
        assert_eq!((st.source, st.tag, st.bytes), (0, 43, 30_000));
        let st = c.probe(ANY_SOURCE, ANY_TAG).unwrap();
        assert_eq!(st.tag, 42);
        let mut b = vec![0u8; st.bytes];
        c.recv(&mut b, 0, 42).unwrap();
        assert_eq!(b, pattern(777, 3));
        assert!(c.iprobe(0, 99).unwrap().is_none());
        let mut b = vec![0u8; 30_000];
        c.recv(&mut b, 0, 43).unwrap();
        assert_eq!(b, pattern(30_000, 4));
        // Cancel a receive nobody will match.
        let mut never = [0u8; 4];
        c.scope(|s| {
            let mut r = c.irecv(s, &mut never, 0, 77).unwrap();
            r.cancel().unwrap();
            let st = r.wait().unwrap();
            assert!(st.cancelled);
        });
        assert_eq!(c.live_requests(), 0);
        c.send(&[1u8], 0, 1).unwrap();
    }
}
both_paths!(probe_iprobe_cancel, 2, probe_cancel);

fn ssend_waits_for_match<P: Provider>(c: &Comm<P>) {
    for n in [16usize, 100_000] {
        if c.rank() == 0 {
            let data = pattern(n, 9);
            c.scope(|s| {
                let mut r = c.issend(s, &data, 1, 10).unwrap();
                for _ in 0..200 {
                    assert!(
                        r.test().unwrap().is_none(),
                        "ssend completed before the match"
                    );
                }
                c.send(&[0u8], 1, 11).unwrap();
                r.wait().unwrap();
            });
        } else {
            let mut go = [0u8];
            c.recv(&mut go, 0, 11).unwrap();
            let mut b = vec![0u8; n];
            c.recv(&mut b, 0, 10).unwrap();
            assert_eq!(b, pattern(n, 9));
        }
    }
    if c.rank() == 0 {
        c.ssend(&[5u16; 3], 1, 12).unwrap();
    } else {
        let mut b = [0u16; 3];
        c.recv(&mut b, 0, 12).unwrap();
        assert_eq!(b, [5; 3]);
    }
}
both_paths!(ssend_is_synchronous, 2, ssend_waits_for_match);

fn waitany_waitall<P: Provider>(c: &Comm<P>) {
    let peer = 1 - c.rank();
    let mut a = [0u64; 4];
    let mut b = vec![0u8; 50_000];
    let big = pattern(50_000, 2);
    c.scope(|s| {
        let mut slots = vec![
            Some(c.irecv(s, &mut a, peer, 1).unwrap()),
            Some(c.irecv(s, &mut b, peer, 2).unwrap()),
        ];
        let s1 = c.isend(s, &[7u64; 4], peer, 1).unwrap();
        let s2 = c.isend(s, &big, peer, 2).unwrap();
        let mut got = vec![];
        while let Some((i, st)) = weft::waitany(&mut slots).unwrap() {
            got.push((i, st.bytes));
        }
        got.sort();
        assert_eq!(got, vec![(0, 32), (1, 50_000)]);
        weft::waitall([s1, s2]).unwrap();
    });
    assert_eq!(a, [7; 4]);
    assert_eq!(b, big);
}
both_paths!(waitany_and_waitall, 2, waitany_waitall);

fn drop_and_scope_end<P: Provider>(c: &Comm<P>) {
    let peer = 1 - c.rank();
    let data = pattern(60_000, 5);
    let mut inbox = vec![0u8; 60_000];
    c.scope(|s| {
        // Leaked requests are completed at the end of the scope.
        std::mem::forget(c.isend(s, &data, peer, 3).unwrap());
        std::mem::forget(c.irecv(s, &mut inbox, peer, 3).unwrap());
    });
    assert_eq!(inbox, data);
    // A dropped receive that never matches is cancelled, not waited for forever.
    let mut x = [0u8; 8];
    c.scope(|s| drop(c.irecv(s, &mut x, peer, 999).unwrap()));
    assert_eq!(c.live_requests(), 0);
}
both_paths!(dropped_requests_complete, 2, drop_and_scope_end);

fn bad_arguments<P: Provider>(c: &Comm<P>) {
    assert_eq!(
        c.send(&[1u8], 9, 0).unwrap_err().kind(),
        ErrorKind::InvalidRank
    );
    assert_eq!(
        c.send(&[1u8], 0, -3).unwrap_err().kind(),
        ErrorKind::InvalidTag
    );
    let mut b = [0u8];
    assert_eq!(
        c.recv(&mut b, 5u32, 0).unwrap_err().kind(),
        ErrorKind::InvalidRank
    );
    let v = Datatype::vector(4, 1, 2, &Datatype::of::<u32>())
        .unwrap()
        .commit();
    assert_eq!(
        c.send_typed(&[0u8; 16], 1, &v, 0, 0).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let uncommitted = Datatype::vector(2, 1, 2, &Datatype::of::<u8>()).unwrap();
    assert!(c.send_typed(&[0u8; 16], 1, &uncommitted, 0, 0).is_err());
}
both_paths!(bad_arguments_are_errors, 2, bad_arguments);

fn zero_bytes_and_self<P: Provider>(c: &Comm<P>) {
    // Messages to oneself and empty messages.
    let me = c.rank();
    let mut b = [0u8; 3];
    c.scope(|s| {
        let r = c.irecv(s, &mut b, me, 4).unwrap();
        c.send(&[1u8, 2, 3], me, 4).unwrap();
        assert_eq!(r.wait().unwrap().bytes, 3);
    });
    assert_eq!(b, [1, 2, 3]);
    let empty: [u8; 0] = [];
    c.send(&empty, me, 6).unwrap();
    let mut none: [u8; 0] = [];
    let st = c.recv(&mut none, me, 6).unwrap();
    assert_eq!(st.bytes, 0);
}
both_paths!(zero_byte_and_self_messages, 3, zero_bytes_and_self);

fn datatypes<P: Provider>(c: &Comm<P>) {
    // A column of a row-major matrix (vector type) against a contiguous receive, eager and
    // rendezvous sizes; and an indexed receive.
    for rows in [4usize, 3000] {
        let cols = 5;
        let col = Datatype::vector(rows, 1, cols as isize, &Datatype::of::<f64>())
            .unwrap()
            .commit();
        if c.rank() == 0 {
            let m: Vec<f64> = (0..rows * cols).map(|i| i as f64).collect();
            c.send_typed(bytemuck::cast_slice(&m[2..]), 1, &col, 1, 1)
                .unwrap();
        } else {
            let mut v = vec![0f64; rows];
            let st = c.recv(&mut v, 0, 1).unwrap();
            assert_eq!(st.bytes, rows * 8);
            for (r, x) in v.iter().enumerate() {
                assert_eq!(*x, (r * cols + 2) as f64);
            }
        }
        // Contiguous send into a strided receive.
        if c.rank() == 0 {
            let v: Vec<f64> = (0..rows).map(|i| -(i as f64)).collect();
            c.send(&v, 1, 2).unwrap();
        } else {
            let mut m = vec![0f64; rows * cols];
            c.recv_typed(bytemuck::cast_slice_mut(&mut m), 1, &col, 0, 2)
                .unwrap();
            for r in 0..rows {
                assert_eq!(m[r * cols], -(r as f64));
                assert_eq!(m[r * cols + 1], 0.0);
            }
        }
    }
}
both_paths!(derived_datatypes, 2, datatypes);

fn comms<P: Provider>(c: &Comm<P>) {
    let d = c.dup().unwrap();
    assert_eq!((d.rank(), d.size()), (c.rank(), c.size()));
    // The same (source, tag) in two communicators never cross.
    if c.rank() == 0 {
        c.send(&[1u8], 1, 0).unwrap();
        d.send(&[2u8], 1, 0).unwrap();
    } else if c.rank() == 1 {
        let mut b = [0u8];
        d.recv(&mut b, 0, 0).unwrap();
        assert_eq!(b[0], 2);
        c.recv(&mut b, 0, 0).unwrap();
        assert_eq!(b[0], 1);
    }
    // Split into even and odd ranks, reversed by key.
    let n = c.size();
    let s = c
        .split(Some(c.rank() % 2), -(c.rank() as i32))
        .unwrap()
        .unwrap();
    let expect_size = (n + 1 - c.rank() % 2) / 2;
    assert_eq!(s.size(), expect_size);
    let mut sum = [0u32];
    s.allreduce(&[c.rank()], &mut sum, Op::Sum).unwrap();
    let want: u32 = (0..n).filter(|r| r % 2 == c.rank() % 2).sum();
    assert_eq!(sum[0], want);
    // Highest old rank gets new rank 0.
    let mut top = [0u32];
    s.bcast(&mut top, 0).unwrap_or(());
    let mut mine = [c.rank()];
    s.bcast(&mut mine, 0).unwrap();
    assert_eq!(
        mine[0],
        (0..n).filter(|r| r % 2 == c.rank() % 2).max().unwrap()
    );
    // Status sources are ranks of the sub-communicator.
    if s.size() > 1 {
        if s.rank() == 1 {
            s.send(&[0u8], 0, 9).unwrap();
        } else if s.rank() == 0 {
            let mut b = [0u8];
            let st = s.recv(&mut b, ANY_SOURCE, 9).unwrap();
            assert_eq!(st.source, 1);
        }
    }
    assert!(c.split(None, 0).unwrap().is_none());
}
both_paths!(dup_and_split, 5, comms);

fn collectives<P: Provider>(c: &Comm<P>) {
    let n = c.size();
    let r = c.rank();
    c.barrier().unwrap();
    for root in 0..n {
        let mut b = if r == root {
            [root as u64 + 1, 9]
        } else {
            [0, 0]
        };
        c.bcast(&mut b, root).unwrap();
        assert_eq!(b, [root as u64 + 1, 9]);
    }
    let mut s = [0i64; 3];
    c.allreduce(&[r as i64, -(r as i64), 1], &mut s, Op::Sum)
        .unwrap();
    let tri = (n * (n - 1) / 2) as i64;
    assert_eq!(s, [tri, -tri, n as i64]);
    let mut m = [0f64; 2];
    c.allreduce(&[r as f64 * 0.5, -(r as f64)], &mut m, Op::Max)
        .unwrap();
    assert_eq!(m, [(n - 1) as f64 * 0.5, 0.0]);
    let mut mi = [0u32];
    c.allreduce(&[r + 10], &mut mi, Op::Min).unwrap();
    assert_eq!(mi, [10]);
    let send: Vec<u32> = (0..n).map(|j| r * 100 + j).collect();
    let mut recv = vec![0u32; n as usize];
    c.alltoall(&send, &mut recv).unwrap();
    for (j, x) in recv.iter().enumerate() {
        assert_eq!(*x, j as u32 * 100 + r);
    }
    let mut all = vec![0u32; n as usize];
    c.allgather(&[r * 3], &mut all).unwrap();
    assert_eq!(all, (0..n).map(|j| j * 3).collect::<Vec<_>>());
    c.barrier().unwrap();
}
both_paths!(collectives_1, 1, collectives);
both_paths!(collectives_2, 2, collectives);
both_paths!(collectives_3, 3, collectives);
both_paths!(collectives_5, 5, collectives);
both_paths!(collectives_8, 8, collectives);

#[test]
fn collectives_bad_arguments() {
    testing::world(2, |c| {
        let mut r = [0i32; 2];
        assert!(c.allreduce(&[1i32], &mut r, Op::Sum).is_err());
        assert!(c
            .allreduce(&[1.0f32, 2.0], &mut [0.0f32; 2], Op::Bxor)
            .is_err());
        assert!(c.alltoall(&[1u8; 3], &mut [0u8; 3]).is_err());
        assert!(c.bcast(&mut [0u8], 7).is_err());
    });
}

#[test]
fn peer_failure_fails_pending_requests() {
    use std::time::Duration;
    use weft::bootstrap::InProcessJob;
    use weft_loopback::{Loopback, LoopbackConfig};
    let job = InProcessJob::new(2, Duration::from_secs(30));
    let cfg = LoopbackConfig {
        eager: 1024,
        depth: 64,
        rma: false,
        ..Default::default()
    };
    let engine = weft::EngineConfig {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    std::thread::scope(|s| {
        let (j0, j1, c0, c1, e0, e1) = (
            job.clone(),
            job.clone(),
            cfg.clone(),
            cfg.clone(),
            engine.clone(),
            engine.clone(),
        );
        let a = s.spawn(move || {
            let mut b = j0.rank(0);
            let p = Loopback::open_with(&mut b, &c0).unwrap();
            let w = weft::World::from_parts(p, Box::new(b), e0).unwrap();
            let mut buf = [0u8; 16];
            // Rank 1 sends three messages, then disappears without finalizing.
            w.recv(&mut buf, 1, 1).unwrap();
            let e = w.recv(&mut buf, 1, 9).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::PeerFailed, "{e}");
            assert!(e.to_string().contains("peer failed: rank 1"), "{e}");
            // What it sent before it failed is still there to be received and probed.
            assert_eq!(w.iprobe(1, 3).unwrap().map(|s| s.bytes), Some(5));
            w.recv(&mut buf, 1, 2).unwrap();
            assert_eq!(buf[..3], [2u8; 3]);
            w.recv(&mut buf, 1, 3).unwrap();
            assert_eq!(buf[..5], [3u8; 5]);
            // Nothing more will come.
            assert_eq!(w.iprobe(1, 3).unwrap_err().kind(), ErrorKind::PeerFailed);
            assert_eq!(
                w.recv(&mut buf, 1, 3).unwrap_err().kind(),
                ErrorKind::PeerFailed
            );
            // Later operations on the dead peer fail at once.
            assert_eq!(
                w.send(&[1u8], 1, 0).unwrap_err().kind(),
                ErrorKind::PeerFailed
            );
            // A rendezvous send to it fails instead of hanging.
        });
        let b = s.spawn(move || {
            let mut b = j1.rank(1);
            let p = Loopback::open_with(&mut b, &c1).unwrap();
            let w = weft::World::from_parts(p, Box::new(b), e1).unwrap();
            w.send(&[7u8; 16], 0, 1).unwrap();
            w.send(&[2u8; 3], 0, 2).unwrap();
            w.send(&[3u8; 5], 0, 3).unwrap();
            drop(w);
        });
        a.join().unwrap();
        b.join().unwrap();
    });
}

#[test]
fn unknown_provider_is_an_error_listing_providers() {
    let (all, _) = weft::registry::providers();
    let Err(e) = weft::registry::candidates(
        &weft::registry::Selection::parse("nope").unwrap(),
        &all,
        None,
    ) else {
        panic!("'nope' was accepted");
    };
    assert_eq!(e.kind(), ErrorKind::UnknownProvider);
    assert!(e.to_string().contains("loopback"));
}

// ---------------------------------------------------------------- speculative rendezvous

/// Every message above a 4 KiB eager limit goes speculatively (`WEFT_SPEC_LIMIT`): the data
/// follows the announcement unasked. The same semantics must hold whether the receive was
/// posted first (data placed), or not: staged within `spec_buffer` (`stage`), or dropped and
/// asked for again with `CTS` when a receive matches (`drop`, no budget).
/// (`spec_behind`: also while other data to the same peer is queued or streaming.)
fn spec_opts(stage: bool) -> Options {
    let mut o = Options::default();
    o.engine.spec_limit = Some(usize::MAX);
    o.engine.spec_buffer = if stage { 64 << 20 } else { 0 };
    o.engine.spec_behind = true;
    o.engine.eager_limit = Some(4096);
    o
}

fn spec_tiny_mailbox(stage: bool) -> Options {
    let mut o = tiny_mailbox();
    o.engine.spec_limit = Some(usize::MAX);
    o.engine.spec_buffer = if stage { 64 << 20 } else { 0 };
    o.engine.spec_behind = true;
    o
}

macro_rules! spec_paths {
    ($name:ident, $n:expr, $body:path) => {
        mod $name {
            use super::*;
            both_paths!(stage, $n, $body, spec_opts(true));
            both_paths!(drop, $n, $body, spec_opts(false));
        }
    };
}

spec_paths!(spec_pingpong_all_sizes, 2, pingpong);
both_paths!(
    spec_stage_busy_paths,
    2,
    many_outstanding,
    spec_tiny_mailbox(true)
);
both_paths!(
    spec_drop_busy_paths,
    2,
    many_outstanding,
    spec_tiny_mailbox(false)
);
spec_paths!(spec_wildcard_source_and_tag, 4, wildcards);
spec_paths!(spec_non_overtaking_order, 2, ordering);
spec_paths!(spec_truncation_is_an_error, 2, truncation);
spec_paths!(spec_probe_iprobe_cancel, 2, probe_cancel);
spec_paths!(spec_ssend_is_synchronous, 2, ssend_waits_for_match);
spec_paths!(spec_waitany_and_waitall, 2, waitany_waitall);
spec_paths!(spec_derived_datatypes, 2, datatypes);
spec_paths!(spec_window_into_one_buffer, 2, shared_window);

/// Rank 0: start sending `pattern(n_i, i)` for each size to rank 1 with tag 3, tell it to go
/// (tag 4) before any has completed, then wait for them.
fn send_all_then_go<P: Provider>(c: &Comm<P>, sizes: &[usize]) {
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, i as u8))
        .collect();
    c.scope(|s| {
        let reqs: Vec<_> = data.iter().map(|d| c.isend(s, d, 1, 3).unwrap()).collect();
        c.send(&[1u8], 1, 4).unwrap();
        for r in reqs {
            r.wait().unwrap();
        }
    });
}

/// A speculative message that arrives before its receive is staged, and a receive posted
/// while its data still arrives takes the rest directly; over the budget the data is dropped
/// and sent again. Both give the data, in order with what follows.
fn spec_unexpected<P: Provider>(c: &Comm<P>) {
    let sizes = [5000usize, 100_000, 1 << 20, 7000];
    if c.rank() == 0 {
        send_all_then_go(c, &sizes);
    } else {
        // Everything was sent (and staged or dropped) before any receive is posted.
        let mut go = [0u8];
        c.recv(&mut go, 0, 4).unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            let mut b = vec![0u8; n];
            let st = c.recv(&mut b, 0, 3).unwrap();
            assert_eq!(st.bytes, n);
            assert!(b == pattern(n, i as u8), "message {i} ({n} B) corrupted");
        }
    }
}
spec_paths!(spec_unexpected_messages, 2, spec_unexpected);

/// What makes the protocol speculative: a message that fits one frame reaches a posted
/// receive while its sender does nothing after `isend` (no progress to answer a `CTS`); the
/// send then completes on the receiver's `SACK`.
#[test]
fn spec_data_needs_no_round_trip() {
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::time::{Duration, Instant};
    // 0: rank 1 still receiving, 1: it received, 2: it failed.
    let state = AtomicU8::new(0);
    let mut o = spec_opts(true);
    o.engine.timeout = Some(Duration::from_secs(20));
    let n = 10_000; // above the 4 KiB eager limit, within loopback's 16 KiB frame
    testing::world_with(2, &o, |c| {
        if c.rank() == 0 {
            let mut go = [0u8];
            c.recv(&mut go, 1, 1).unwrap();
            let data = pattern(n, 5);
            c.scope(|s| {
                let r = c.isend(s, &data, 1, 2).unwrap();
                // No weft call until rank 1 has its data (bounded; fails loudly).
                let deadline = Instant::now() + Duration::from_secs(20);
                while state.load(Ordering::Acquire) == 0 {
                    assert!(Instant::now() < deadline, "rank 1 never got the data");
                    std::thread::yield_now();
                }
                assert_eq!(state.load(Ordering::Acquire), 1, "rank 1's receive failed");
                r.wait().unwrap();
            });
        } else {
            let mut b = vec![0u8; n];
            c.scope(|s| {
                let r = c.irecv(s, &mut b, 0, 2).unwrap();
                c.send(&[1u8], 0, 1).unwrap();
                let res = r.wait();
                state.store(if res.is_ok() { 1 } else { 2 }, Ordering::Release);
                res.unwrap();
            });
            assert_eq!(b, pattern(n, 5));
        }
    });
}

/// Unexpected speculative data stays within `WEFT_SPEC_BUFFER`: of three unexpected 1 MiB
/// messages under a 1.5 MiB budget one is staged and two are dropped (and sent again on their
/// CTS); all three arrive intact, and nothing stays staged.
#[test]
fn spec_staging_is_bounded() {
    let mut o = spec_opts(true);
    o.engine.spec_buffer = 3 << 19;
    three_unexpected_mib(&o, 1 << 20);
}

/// Rank 0 sends three 1 MiB messages before rank 1 posts any receive; rank 1 checks that
/// `staged` bytes were held once all three had announced themselves, that all arrive intact,
/// and that nothing stays staged.
fn three_unexpected_mib(o: &Options, staged: usize) {
    let n = 1 << 20;
    testing::world_with(2, o, |c| {
        if c.rank() == 0 {
            send_all_then_go(c, &[n; 3]);
        } else {
            let mut go = [0u8];
            c.recv(&mut go, 0, 4).unwrap();
            // The three announcements came before "go".
            assert_eq!(c.staged_bytes(), staged);
            for i in 0..3 {
                let mut b = vec![0u8; n];
                c.recv(&mut b, 0, 3).unwrap();
                assert!(b == pattern(n, i as u8), "message {i} corrupted");
            }
            assert_eq!(c.staged_bytes(), 0);
        }
    });
}

/// By default a send speculates only onto an idle link: three 1 MiB sends in a row through a
/// 2-deep mailbox find the first still streaming, so only it speculates (and is staged); the
/// others announce themselves with `RTS` (`spec_behind` makes all three speculate).
#[test]
fn spec_only_onto_an_idle_link() {
    for (behind, staged) in [(false, 1 << 20), (true, 3 << 20)] {
        let mut o = spec_tiny_mailbox(true);
        o.engine.spec_behind = behind;
        three_unexpected_mib(&o, staged);
    }
}

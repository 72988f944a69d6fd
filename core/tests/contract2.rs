//! The core on the optional parts of provider contract 2, each switched on alone and all
//! together on the loopback provider: local descriptors (`mr_local`) and the registration
//! cache, zero-copy active messages above the inject size, transmit-complete writes with
//! remote completion data, lazy connections with narrower per-peer capabilities until they
//! are up, and an HCA's atomics (8-byte SUM and CSWAP only). The provider's own counters show
//! which path carried what. (The RMA synchronisation modes run on contract 2 in `rma.rs`.)

use weft::{BasicType, Comm, LockKind, Op, Provider, WinInfo, ANY_SOURCE};
use weft_loopback::LoopbackConfig;
use weft_testing::{self as testing, Options};

fn with(cfg: LoopbackConfig) -> Options {
    Options {
        loopback: cfg,
        ..Options::default()
    }
}

/// Each part alone (with RMA, so rendezvous reads and native windows are in play), then all.
fn modes() -> Vec<(&'static str, LoopbackConfig)> {
    let base = LoopbackConfig {
        rma: true,
        ..Default::default()
    };
    vec![
        (
            "zcopy",
            LoopbackConfig {
                zcopy: true,
                ..base.clone()
            },
        ),
        (
            "mr_local",
            LoopbackConfig {
                mr_local: true,
                ..base.clone()
            },
        ),
        (
            "transmit",
            LoopbackConfig {
                transmit: true,
                ..base.clone()
            },
        ),
        (
            "lazy",
            LoopbackConfig {
                lazy: true,
                ..base.clone()
            },
        ),
        (
            "hca_atomics",
            LoopbackConfig {
                hca_atomics: true,
                ..base.clone()
            },
        ),
        (
            "write_rndv",
            LoopbackConfig {
                write_rndv: true,
                mr_local: true,
                ..base
            },
        ),
        ("all", LoopbackConfig::contract2()),
    ]
}

fn counter<P: Provider>(c: &Comm<P>, name: &str) -> u64 {
    c.provider_counters()
        .into_iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("loopback has no counter {name}"))
        .1
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// Eager (below and above the inject size), rendezvous by RMA read, odd sizes; a ring of
/// nonblocking exchanges with wildcard receives; collectives.
fn traffic<P: Provider>(c: &Comm<P>, mode: &str) {
    let me = c.rank();
    let n = c.size();
    for (i, &len) in [0usize, 8, 256, 257, 4000, 16385, 100_000, (1 << 20) + 3]
        .iter()
        .enumerate()
    {
        if me == 0 {
            let data = pattern(len, i as u8);
            c.send(&data, 1, i as i32).unwrap();
            let mut back = vec![0u8; len];
            c.recv(&mut back, 1, i as i32).unwrap();
            assert_eq!(back, data, "{mode}: {len} bytes");
        } else if me == 1 {
            let mut buf = vec![0u8; len];
            let st = c.recv(&mut buf, 0, i as i32).unwrap();
            assert_eq!(st.bytes, len, "{mode}");
            c.send(&buf, 0, i as i32).unwrap();
        }
    }
    // Everyone sends 3 messages to its right neighbour, received from any source.
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    let out: Vec<Vec<u8>> = (0..3).map(|k| pattern(600 * k + 5, me as u8)).collect();
    let mut inb: Vec<Vec<u8>> = (0..3).map(|k| vec![0u8; 600 * k + 5]).collect();
    c.scope(|s| {
        let mut reqs = vec![];
        for (k, b) in inb.iter_mut().enumerate() {
            reqs.push(c.irecv(s, b, ANY_SOURCE, k as i32).unwrap());
        }
        for (k, b) in out.iter().enumerate() {
            reqs.push(c.isend(s, b, right, k as i32).unwrap());
        }
        for r in reqs {
            r.wait().unwrap();
        }
    });
    for (k, b) in inb.iter().enumerate() {
        assert_eq!(*b, pattern(600 * k + 5, left as u8), "{mode}");
    }
    let mut sum = [0u64];
    c.allreduce(&[me as u64 + 1], &mut sum, Op::Sum).unwrap();
    assert_eq!(sum[0], (n as u64) * (n as u64 + 1) / 2);
}

#[test]
fn two_sided_traffic_in_every_mode_on_both_paths() {
    for (mode, cfg) in modes() {
        testing::world_with(3, &with(cfg.clone()), |c| traffic(c, mode));
        testing::world_dyn_with(3, "loopback", &with(cfg), |c| traffic(c, mode));
    }
}

/// Peers that can be written to but not read from (`PeerCaps`): the rendezvous writes into the
/// receiver's registered buffer, one RMA write per message and no read. A typed send of more
/// pieces than one write takes streams into that buffer instead, a strided receive asks for
/// the data with a plain `CTS`, and a short receive reports truncation with its prefix filled.
#[test]
fn write_rendezvous_moves_large_messages_by_rma_write() {
    let cfg = LoopbackConfig {
        rma: true,
        write_rndv: true,
        mr_local: true,
        ..Default::default()
    };
    testing::world_with(2, &with(cfg), |c| {
        let len = 100_000;
        let (w0, r0) = (counter(c, "rma_write"), counter(c, "rma_read"));
        for k in 0..4u8 {
            if c.rank() == 0 {
                c.send(&pattern(len, k), 1, k as i32).unwrap();
            } else {
                let mut b = vec![0u8; len];
                assert_eq!(c.recv(&mut b, 0, k as i32).unwrap().bytes, len);
                assert_eq!(b, pattern(len, k));
            }
        }
        if c.rank() == 0 {
            assert_eq!(counter(c, "rma_write") - w0, 4, "one write per message");
        }
        assert_eq!(counter(c, "rma_read"), r0, "no reads");
        // Truncation: the receive's 60 000 bytes are written, the rest is not.
        if c.rank() == 0 {
            c.send(&pattern(len, 9), 1, 9).unwrap();
        } else {
            let mut b = vec![0u8; len];
            let e = c.recv(&mut b[..60_000], 0, 9).unwrap_err();
            assert_eq!(e.kind(), weft::ErrorKind::Truncated);
            assert_eq!(b[..60_000], pattern(len, 9)[..60_000]);
            assert!(
                b[60_000..].iter().all(|&x| x == 0),
                "written past the receive"
            );
        }
        // A column of 3000 doubles: 3000 pieces, more than one write takes; and the same
        // column as a strided receive.
        let (rows, cols) = (3000usize, 5usize);
        let col = weft::Datatype::vector(rows, 1, cols as isize, &weft::Datatype::of::<f64>())
            .unwrap()
            .commit();
        let m: Vec<f64> = (0..rows * cols).map(|i| i as f64).collect();
        if c.rank() == 0 {
            c.send_typed(bytemuck::cast_slice(&m[2..]), 1, &col, 1, 20)
                .unwrap();
            let v: Vec<f64> = (0..rows).map(|i| -(i as f64)).collect();
            c.send(&v, 1, 21).unwrap();
        } else {
            let mut v = vec![0f64; rows];
            c.recv(&mut v, 0, 20).unwrap();
            assert!(v
                .iter()
                .enumerate()
                .all(|(r, x)| *x == (r * cols + 2) as f64));
            let mut t = vec![0f64; rows * cols];
            c.recv_typed(bytemuck::cast_slice_mut(&mut t), 1, &col, 0, 21)
                .unwrap();
            assert!((0..rows).all(|r| t[r * cols] == -(r as f64) && t[r * cols + 1] == 0.0));
        }
        c.barrier().unwrap();
    });
}

#[test]
fn payloads_above_the_inject_size_go_zero_copy() {
    let cfg = LoopbackConfig {
        zcopy: true,
        inject: 256,
        ..Default::default()
    };
    testing::world_with(2, &with(cfg), |c| {
        c.barrier().unwrap();
        let before = counter(c, "am_isend");
        let small = [7u8; 200];
        let large = [9u8; 4000];
        for _ in 0..10 {
            if c.rank() == 0 {
                c.send(&small, 1, 1).unwrap();
            } else {
                let mut b = [0u8; 200];
                c.recv(&mut b, 0, 1).unwrap();
                assert_eq!(b, small);
            }
        }
        let after_small = counter(c, "am_isend");
        assert_eq!(
            after_small, before,
            "payloads under the inject size are copied"
        );
        for _ in 0..10 {
            if c.rank() == 0 {
                c.send(&large, 1, 2).unwrap();
            } else {
                let mut b = [0u8; 4000];
                c.recv(&mut b, 0, 2).unwrap();
                assert_eq!(b, large);
            }
        }
        if c.rank() == 0 {
            assert!(
                counter(c, "am_isend") >= after_small + 10,
                "4000-byte eager sends went zero-copy"
            );
        }
    });
}

#[test]
fn repeated_rendezvous_hits_the_registration_cache() {
    let cfg = LoopbackConfig {
        rma: true,
        mr_local: true,
        ..Default::default()
    };
    testing::world_with(2, &with(cfg), |c| {
        let mut buf = pattern(1 << 20, 3);
        for round in 0..6 {
            if c.rank() == 0 {
                c.send(&buf, 1, round).unwrap();
            } else {
                c.recv(&mut buf, 0, round).unwrap();
            }
        }
        assert_eq!(buf, pattern(1 << 20, 3));
        let st = c.registration_cache();
        // One registration of the buffer, reused by the five later rounds.
        assert!(st.hits >= 5, "{st:?}");
        assert!(st.misses <= 2, "{st:?}");
        assert_eq!(st.stale, 0, "{st:?}");
        assert!(counter(c, "rma_read") + counter(c, "rma_write") > 0 || c.rank() == 0);
    });
}

#[test]
fn lazy_connections_reach_only_the_peers_used() {
    let cfg = LoopbackConfig {
        lazy: true,
        ..Default::default()
    };
    testing::world_with(8, &with(cfg), |c| {
        // Nothing is connected at start: no all-to-all set-up.
        assert_eq!(c.connections(), (0, 0));
        assert_eq!(counter(c, "connects"), 0);
        // A dissemination barrier on 8 ranks sends to 3 peers (distance 1, 2, 4).
        c.barrier().unwrap();
        c.barrier().unwrap();
        let (asked, up) = c.connections();
        assert_eq!(asked, 3, "rank {}", c.rank());
        assert_eq!(counter(c, "connects"), 3);
        assert_eq!(up, 3, "every connection asked for was reported up");
        // A message to a peer not yet used connects it, once.
        let peer = (c.rank() + 3) % 8;
        let from = (c.rank() + 5) % 8;
        c.sendrecv(&[1u8], peer, 9, &mut [0u8], from, 9).unwrap();
        c.sendrecv(&[1u8], peer, 9, &mut [0u8], from, 9).unwrap();
        assert_eq!(c.connections().0, 4);
        assert_eq!(counter(c, "connects"), 4);
    });
}

/// An application that uses only fetch-and-add and compare-and-swap on i64 says so, and gets
/// an HCA's atomics; without the hint the window stays on active messages for all atomics.
#[test]
fn the_accumulate_ops_hint_gets_hca_atomics() {
    let cfg = LoopbackConfig::contract2();
    testing::world_with(3, &with(cfg), |c| {
        let mut mem = vec![0i64; 2];
        let hint = WinInfo {
            accumulate_ops: Some(vec![(Op::Sum, BasicType::I64), (Op::Cswap, BasicType::I64)]),
            sched: None,
            agg_max: None,
        };
        c.win_create(&mut mem, hint, |w| {
            assert!(w.native_paths().2, "the hinted window uses native atomics");
            let before = counter(c, "atomics");
            let one = 1i64;
            let mut olds = vec![];
            for _ in 0..50 {
                let mut old = 0i64;
                w.lock_epoch(0, LockKind::Shared, |e| {
                    e.fetch_and_op(&one, &mut old, 0, 0, Op::Sum)
                })?;
                olds.push(old);
            }
            // Exactly one rank wins the swap of slot 1 from 0 to its rank + 1.
            let mine = c.rank() as i64 + 1;
            let zero = 0i64;
            let mut seen = -1i64;
            w.lock_epoch(0, LockKind::Shared, |e| {
                e.compare_and_swap(&mine, &zero, &mut seen, 0, 1)
            })?;
            assert!(counter(c, "atomics") >= before + 51);
            assert!(olds.windows(2).all(|p| p[0] < p[1]), "{olds:?}");
            let won = (seen == 0) as u64;
            let mut winners = [0u64];
            c.allreduce(&[won], &mut winners, Op::Sum)?;
            assert_eq!(winners[0], 1);
            c.barrier()?;
            if c.rank() == 0 {
                let mut m = [0i64; 2];
                w.read_local(0, &mut m)?;
                assert_eq!(m[0], 150);
                assert!((1..=3).contains(&m[1]), "{m:?}");
            }
            Ok(())
        })
        .unwrap();
        // No hint: every (op, type) may be used, and the HCA has only two of them.
        c.win_create(&mut mem, WinInfo::default(), |w| {
            assert!(!w.native_paths().2);
            Ok(())
        })
        .unwrap();
    });
}

/// Post-start-complete-wait on transmit-complete writes: `complete` sends one zero-length
/// write with completion data per target, which the target counts instead of a message.
#[test]
fn complete_is_counted_from_remote_completion_data() {
    testing::world_with(3, &with(LoopbackConfig::contract2()), |c| {
        let n = c.size();
        let me = c.rank();
        let (left, right) = ((me + n - 1) % n, (me + 1) % n);
        let mut mem = vec![0u32; 4];
        c.win_create(&mut mem, WinInfo::default(), |w| {
            let before = counter(c, "rma_write_data");
            for round in 0..3u32 {
                w.post(&[left])?;
                let v = [me * 10 + round; 4];
                w.start_epoch(&[right], |e| e.put(&v, right, 0))?;
                w.wait()?;
                let mut m = [0u32; 4];
                w.read_local(0, &mut m)?;
                assert_eq!(m, [left * 10 + round; 4]);
            }
            assert_eq!(counter(c, "rma_write_data"), before + 3);
            Ok(())
        })
        .unwrap();
    });
}

//! One-sided communication: every synchronisation mode, every operation, both paths (active
//! messages on plain loopback; native put/get with scalable keys on loopback's RMA mode), every
//! scheduling policy, static and dynamic dispatch.

use weft::{
    Assert, BasicType, Comm, Element, ErrorKind, LockKind, Op, Provider, Sched, WinCompletion,
    WinInfo, Window,
};
use weft_shm as _;
use weft_testing::{self as testing, Options};

fn opts(native: bool) -> Options {
    let mut o = Options::default();
    o.loopback.rma = native;
    o
}

/// Native RMA without provider counters: one CQ entry per operation, counted by the core.
fn opts_queue() -> Options {
    let mut o = opts(true);
    o.loopback.counters = false;
    o
}

fn opts_contract2() -> Options {
    Options {
        loopback: weft_loopback::LoopbackConfig::contract2(),
        ..Options::default()
    }
}

fn info(s: Sched) -> WinInfo {
    WinInfo {
        accumulate_ops: None,
        sched: Some(s),
        agg_max: None,
    }
}

/// Run `f` on a window holding `mem`'s values: allocated by the library (`alloc`, then freed) or
/// created over `mem` for the duration of `f`.
fn with_window<T: Element, P: Provider, R>(
    c: &Comm<P>,
    mem: &mut [T],
    info: WinInfo,
    alloc: bool,
    f: impl FnOnce(&Window<'_, P>) -> R,
) -> R {
    if alloc {
        let w = c.win_allocate::<T>(mem.len(), info).unwrap();
        w.write_local(0, mem).unwrap();
        c.barrier().unwrap();
        let r = f(&w);
        w.free().unwrap();
        r
    } else {
        c.win_create(mem, info, |w| Ok(f(w))).unwrap()
    }
}

const SCHEDS: [Sched; 4] = [Sched::Off, Sched::Reorder, Sched::Aggregate, Sched::Full];

/// Run `$body(comm, sched)` on `$n` ranks for every path x policy x dispatch, and on the
/// loopback provider with every part of contract 2 on (local descriptors, transmit completion
/// proven by fenced reads, completion data, zero-copy messages, lazy connections, HCA atomics).
macro_rules! every_way {
    ($name:ident, $n:expr, $body:path) => {
        mod $name {
            use super::*;
            every_way!(@one static_am, world_with, $n, $body, opts(false));
            every_way!(@one static_native_counters, world_with, $n, $body, opts(true));
            every_way!(@one static_native_queue, world_with, $n, $body, opts_queue());
            every_way!(@one static_contract2, world_with, $n, $body, opts_contract2());
            every_way!(@one dynamic_am, world_dyn_with, $n, $body, opts(false));
            every_way!(@one dynamic_native, world_dyn_with, $n, $body, opts(true));
            every_way!(@one dynamic_contract2, world_dyn_with, $n, $body, opts_contract2());
        }
    };
    (@one $test:ident, world_with, $n:expr, $body:path, $opts:expr) => {
        #[test]
        fn $test() {
            for s in SCHEDS {
                testing::world_with($n, &$opts, |c| $body(c, s));
            }
        }
    };
    (@one $test:ident, world_dyn_with, $n:expr, $body:path, $opts:expr) => {
        #[test]
        fn $test() {
            for s in SCHEDS {
                testing::world_dyn_with($n, "loopback", &$opts, |c| $body(c, s));
            }
        }
    };
}

fn fence_put_get<P: Provider>(c: &Comm<P>, s: Sched) {
    let n = c.size();
    let me = c.rank();
    let mut mem = vec![0u64; 8 * n as usize];
    c.win_create(&mut mem, info(s), |win| {
        // Each rank writes its row into every other rank's window.
        let row: Vec<u64> = (0..8).map(|i| (me as u64) << 32 | i).collect();
        win.fence_epoch(Assert::NONE, |e| {
            for t in 0..n {
                e.put(&row, t, 8 * me as usize)?;
            }
            Ok(())
        })
        .unwrap();
        let mut mine = vec![0u64; 8 * n as usize];
        win.read_local(0, &mut mine).unwrap();
        for r in 0..n as u64 {
            for i in 0..8u64 {
                assert_eq!(mine[(r * 8 + i) as usize], r << 32 | i, "{s:?}");
            }
        }
        // Read the right neighbour's whole window back.
        let right = (me + 1) % n;
        let mut got = vec![0u64; 8 * n as usize];
        win.fence_epoch(Assert::NONE, |e| e.get(&mut got, right, 0))
            .unwrap();
        assert_eq!(got, mine, "{s:?}");
        // A fence with NOPRECEDE and no operations.
        win.fence(Assert::NOPRECEDE).unwrap();
        Ok(())
    })
    .unwrap();
}
every_way!(fence_put_and_get, 3, fence_put_get);

/// Many small gets in one epoch (fence, then a lock): under aggregation their data comes back
/// in reply batches, several of them when it exceeds one active message (loopback: 16 KiB),
/// each record to its own buffer; puts interleaved with them land too.
fn many_small_gets<P: Provider>(c: &Comm<P>, s: Sched) {
    let n = c.size();
    let me = c.rank();
    const GETS: usize = 96;
    const EACH: usize = 64; // u64s: 512 bytes per get, 48 KiB per epoch
    let mut mem: Vec<u64> = (0..(GETS * EACH + 8) as u64)
        .map(|i| ((me as u64) << 40) | i)
        .collect();
    c.win_create(&mut mem, info(s), |win| {
        let right = (me + 1) % n;
        let expect = |k: usize| -> Vec<u64> {
            (0..EACH as u64)
                .map(|i| ((right as u64) << 40) | ((k * EACH) as u64 + i))
                .collect()
        };
        let mut got = vec![vec![0u64; EACH]; GETS];
        let mark = [me as u64 + 1];
        win.fence_epoch(Assert::NONE, |e| {
            for (k, g) in got.iter_mut().enumerate() {
                e.get(g, right, k * EACH)?;
                if k % 16 == 0 {
                    e.put(&mark, right, GETS * EACH + k / 16)?;
                }
            }
            Ok(())
        })
        .unwrap();
        for (k, g) in got.iter().enumerate() {
            assert_eq!(*g, expect(k), "get {k} ({s:?})");
        }
        win.fence(Assert::NONE).unwrap();
        let mut tail = [0u64; 6];
        win.read_local(GETS * EACH, &mut tail).unwrap();
        let left = (me + n - 1) % n;
        assert_eq!(tail, [left as u64 + 1; 6], "{s:?}");
        c.barrier().unwrap();
        let mut got = vec![vec![0u64; EACH]; GETS];
        win.lock_epoch(right, LockKind::Shared, |e| {
            for (k, g) in got.iter_mut().enumerate() {
                e.get(g, right, k * EACH)?;
            }
            Ok(())
        })
        .unwrap();
        for (k, g) in got.iter().enumerate() {
            assert_eq!(*g, expect(k), "locked get {k} ({s:?})");
        }
        c.barrier().unwrap();
        Ok(())
    })
    .unwrap();
}
every_way!(many_small_gets_in_one_epoch, 3, many_small_gets);

fn pscw<P: Provider>(c: &Comm<P>, s: Sched) {
    // Ring: each rank accesses its right neighbour and exposes to its left one, 3 rounds.
    let n = c.size();
    let me = c.rank();
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let mut mem = vec![0i32; 4];
    c.win_create(&mut mem, info(s), |win| {
        for round in 0..3i32 {
            win.post(&[left]).unwrap();
            let v = [me as i32 * 10 + round; 2];
            let one = [1i32];
            let mut old = 0i32;
            win.start_epoch(&[right], |e| {
                e.put(&v, right, 0)?;
                e.accumulate(&one, right, 2, Op::Sum)?;
                e.fetch_and_op(&one[0], &mut old, right, 3, Op::Sum)
            })
            .unwrap();
            assert_eq!(old, round, "{s:?}");
            win.wait().unwrap();
            let mut m = [0i32; 4];
            win.read_local(0, &mut m).unwrap();
            assert_eq!(
                m,
                [
                    left as i32 * 10 + round,
                    left as i32 * 10 + round,
                    round + 1,
                    round + 1
                ]
            );
        }
        Ok(())
    })
    .unwrap();
}
every_way!(post_start_complete_wait, 3, pscw);

fn locks<P: Provider>(c: &Comm<P>, s: Sched) {
    let n = c.size();
    let me = c.rank();
    let mut mem = vec![0u64; 2];
    c.win_create(&mut mem, info(s), |win| {
        // Everybody increments a counter on rank 0 under an exclusive lock, 5 times, with a
        // get-modify-put (only correct if the lock excludes).
        for _ in 0..5 {
            win.lock_epoch(0, LockKind::Exclusive, |e| {
                let mut v = [0u64];
                e.local(|l| l.get(&mut v, 0, 0))?;
                let w = [v[0] + 1];
                e.local(|l| l.put(&w, 0, 0))?;
                e.flush(0)
            })
            .unwrap();
        }
        // Shared locks with atomic adds.
        let one = [1u64];
        win.lock_epoch(0, LockKind::Shared, |e| {
            e.accumulate(&one, 0, 1, Op::Sum)?;
            e.flush_all()
        })
        .unwrap();
        c.barrier().unwrap();
        if me == 0 {
            let mut m = [0u64; 2];
            win.read_local(0, &mut m).unwrap();
            assert_eq!(m, [5 * n as u64, n as u64], "{s:?}");
        }
        c.barrier().unwrap();
        // lock_all: read everyone's counter slot.
        let mut seen = vec![0u64; n as usize];
        win.lock_all_epoch(|e| {
            for (t, slot) in seen.iter_mut().enumerate() {
                e.get(std::slice::from_mut(slot), t as u32, 1)?;
            }
            e.flush_local()
        })
        .unwrap();
        assert_eq!(seen[0], n as u64);
        Ok(())
    })
    .unwrap();
}
every_way!(lock_unlock_flush, 3, locks);

/// A ping-pong in passive-target epochs, as `ucx_perftest`'s put latency runs it: each put
/// (then a flush) is answered once the target sees its last element in its own memory, read
/// with `sync_read_local` inside the epoch (which also drives the progress that lands puts
/// arriving as active messages). Every wait is bounded.
fn polled<P: Provider>(c: &Comm<P>, s: Sched) {
    let me = c.rank();
    let peer = 1 - me;
    for alloc in [false, true] {
        let mut mem = vec![0u64; 4];
        with_window(c, &mut mem, info(s), alloc, |win| {
            win.lock_epoch(peer, LockKind::Shared, |e| {
                for i in 1..=20u64 {
                    if me == 0 {
                        let v = [i, i * 10, i * 100];
                        e.local(|l| l.put(&v, peer, 1))?;
                        e.flush(peer)?;
                    }
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                    let mut got = [0u64; 3];
                    while got[2] != i * 100 {
                        assert!(
                            std::time::Instant::now() < deadline,
                            "rank {me}: put {i} never seen ({s:?}, alloc {alloc}): {got:?}"
                        );
                        win.sync_read_local(1, &mut got)?;
                    }
                    assert_eq!(got, [i, i * 10, i * 100], "{s:?}");
                    if me == 1 {
                        let v = [i, i * 10, i * 100];
                        e.local(|l| l.put(&v, peer, 1))?;
                        e.flush(peer)?;
                    }
                }
                Ok(())
            })
            .unwrap();
            // Outside epochs too; and a read past the window's end is an error, not a read.
            let mut m = [0u64; 4];
            win.sync_read_local(0, &mut m).unwrap();
            assert_eq!(m, [0, 20, 200, 2000]);
            let e = win.sync_read_local(2, &mut m).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            c.barrier().unwrap();
        });
    }
}
every_way!(polled_in_passive_epochs, 2, polled);

fn requests<P: Provider>(c: &Comm<P>, s: Sched) {
    let me = c.rank();
    let peer = 1 - me;
    let mut mem = vec![0u32; 16];
    c.win_create(&mut mem, info(s), |win| {
        let src: Vec<u32> = (0..16).map(|i| me * 100 + i).collect();
        let mut back = vec![0u32; 16];
        let mut old = [0u32; 2];
        let twos = [2u32; 2];
        win.lock_epoch(peer, LockKind::Exclusive, |e| {
            e.rput(&src, peer, 0)?.wait()?;
            e.flush(peer)?;
            let r = e.rget(&mut back, peer, 0)?;
            r.wait()?;
            e.raccumulate(&twos, peer, 0, Op::Prod)?.wait()?;
            e.flush(peer)?;
            let mut r = e.rget_accumulate(&twos, &mut old, peer, 0, Op::NoOp)?;
            while !r.test()? {}
            Ok(())
        })
        .unwrap();
        assert_eq!(back, src, "{s:?}");
        assert_eq!(old, [me * 100 * 2, (me * 100 + 1) * 2], "{s:?}");
        Ok(())
    })
    .unwrap();
}
every_way!(request_based_operations, 2, requests);

fn typed<P: Provider>(c: &Comm<P>, s: Sched) {
    use weft::Datatype;
    let me = c.rank();
    let peer = 1 - me;
    // The target is a 4x4 matrix of f64; put column 1 from a contiguous vector, then get the
    // diagonal into a strided buffer.
    let mut mem = vec![0f64; 16];
    c.win_create(&mut mem, info(s), |win| {
        let f64t = Datatype::of::<f64>();
        let col = Datatype::vector(4, 1, 4, &f64t).unwrap().commit();
        let contig = Datatype::contiguous(4, &f64t).unwrap().commit();
        let v = [1.5f64, 2.5, 3.5, 4.5];
        win.fence_epoch(Assert::NONE, |e| {
            e.put_typed(bytemuck::cast_slice(&v), 1, &contig, peer, 1, 1, &col)
        })
        .unwrap();
        let mut m = [0f64; 16];
        win.read_local(0, &mut m).unwrap();
        assert_eq!([m[1], m[5], m[9], m[13]], v, "{s:?}");
        let diag = Datatype::vector(4, 1, 5, &f64t).unwrap().commit();
        let mut out = [0f64; 8];
        let strided = Datatype::vector(4, 1, 2, &f64t).unwrap().commit();
        win.fence_epoch(Assert::NONE, |e| {
            e.get_typed(
                bytemuck::cast_slice_mut(&mut out),
                1,
                &strided,
                peer,
                0,
                1,
                &diag,
            )
        })
        .unwrap();
        assert_eq!(
            [out[0], out[2], out[4], out[6]],
            [0.0, 2.5, 0.0, 0.0],
            "{s:?}"
        );
        Ok(())
    })
    .unwrap();
}
every_way!(derived_datatypes, 2, typed);

fn errors<P: Provider>(c: &Comm<P>, s: Sched) {
    let mut mem = vec![0u8; 16];
    c.win_create(&mut mem, info(s), |win| {
        let big = [0u8; 17];
        let r = win.fence_epoch(Assert::NONE, |e| e.put(&big, 1 - c.rank(), 0));
        assert_eq!(r.unwrap_err().kind(), ErrorKind::RemoteAccess);
        let r = win.fence_epoch(Assert::NONE, |e| e.put(&big[..1], 7, 0));
        assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidRank);
        let f = [1.0f32];
        let r = win.fence_epoch(Assert::NONE, |e| {
            e.accumulate(&f[..], 1 - c.rank(), 0, Op::Bxor)
        });
        assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidArgument);
        // NOPRECEDE after operations is refused.
        let r = win.fence_epoch(Assert::NOPRECEDE, |e| e.put(&big[..1], 1 - c.rank(), 0));
        assert!(r.is_err());
        c.barrier().unwrap();
        Ok(())
    })
    .unwrap();
}
every_way!(bad_operations_are_errors, 2, errors);

// ------------------------------------------------------------------------- atomics matrix

/// Values exactly representable in every type, so float sums and products are exact.
fn val<T: Element + TryFrom<i8>>(x: i8) -> T {
    T::try_from(x).ok().expect("small value fits")
}

/// The expected result, from an implementation independent of the library's reductions.
fn reference<T: Element>(op: Op, a: T, b: T) -> T {
    testing::oracle(op, a, b)
}

fn atomics_for<T: Element + TryFrom<i8> + std::fmt::Debug, P: Provider>(
    c: &Comm<P>,
    s: Sched,
    alloc: bool,
) {
    let me = c.rank();
    let n = c.size();
    for op in Op::ALL {
        if !op.valid_for(T::TYPE) || op == Op::Cswap {
            continue;
        }
        let init: T = val(3);
        let mut mem = vec![init; 2];
        with_window(c, &mut mem, info(s), alloc, |win| {
            // Everyone but rank 0 accumulates into rank 0, element 0 (order-free for commutative
            // ops; Replace only from rank 1).
            let mine: T = val(me as i8 + 1);
            win.fence_epoch(Assert::NONE, |e| {
                if me != 0 && (op != Op::Replace || me == 1) {
                    e.accumulate(std::slice::from_ref(&mine), 0, 0, op)?;
                }
                Ok(())
            })
            .unwrap();
            if me == 0 {
                let mut expect = init;
                for r in 1..n {
                    if op != Op::Replace || r == 1 {
                        expect = reference(op, expect, val::<T>(r as i8 + 1));
                    }
                }
                let mut got = [init];
                win.read_local(0, &mut got).unwrap();
                assert_eq!(
                    got[0],
                    expect,
                    "accumulate {} on {}",
                    op.name(),
                    T::TYPE.name()
                );
            }
            // fetch_and_op from rank 1 only: deterministic old values.
            let mut old: T = val(0);
            let two: T = val(2);
            win.fence_epoch(Assert::NONE, |e| {
                if me == 1 {
                    e.fetch_and_op(&two, &mut old, 0, 1, op)?;
                }
                Ok(())
            })
            .unwrap();
            if me == 1 {
                assert_eq!(
                    old,
                    init,
                    "fetch_and_op {} on {}",
                    op.name(),
                    T::TYPE.name()
                );
            }
            if me == 0 {
                let mut got = [init];
                win.read_local(1, &mut got).unwrap();
                assert_eq!(
                    got[0],
                    reference(op, init, two),
                    "fetch_and_op {} {}",
                    op.name(),
                    T::TYPE.name()
                );
            }
        });
    }
    // compare_and_swap: succeeds once, then fails.
    let mut mem = vec![val::<T>(5)];
    with_window(c, &mut mem, info(s), alloc, |win| {
        let (new, cmp) = (val::<T>(9), val::<T>(5));
        let mut old1 = val::<T>(0);
        let mut old2 = val::<T>(0);
        if me == 1 {
            win.lock_epoch(0, LockKind::Exclusive, |e| {
                e.compare_and_swap(&new, &cmp, &mut old1, 0, 0)?;
                e.flush(0)?;
                e.compare_and_swap(&new, &cmp, &mut old2, 0, 0)
            })
            .unwrap();
            assert_eq!((old1, old2), (val(5), val(9)), "cas on {}", T::TYPE.name());
        }
        c.barrier().unwrap();
    });
}

fn atomics<P: Provider>(c: &Comm<P>, s: Sched, alloc: bool) {
    atomics_for::<i8, P>(c, s, alloc);
    atomics_for::<u8, P>(c, s, alloc);
    atomics_for::<i16, P>(c, s, alloc);
    atomics_for::<u16, P>(c, s, alloc);
    atomics_for::<i32, P>(c, s, alloc);
    atomics_for::<u32, P>(c, s, alloc);
    atomics_for::<i64, P>(c, s, alloc);
    atomics_for::<u64, P>(c, s, alloc);
    atomics_for::<f32, P>(c, s, alloc);
    atomics_for::<f64, P>(c, s, alloc);
}

#[test]
fn atomics_every_op_and_type() {
    for s in [Sched::Off, Sched::Full] {
        testing::world_with(3, &opts(false), |c| atomics(c, s, false));
    }
    testing::world_dyn_with(3, "loopback", &opts(true), |c| {
        atomics(c, Sched::Aggregate, false)
    });
}

/// shm: allocated windows are native (memory copies, CPU atomics, a lock word in shared
/// memory) and give the same results as the active-message path above.
/// What one epoch wrote anywhere is what the next epoch reads: rank 2 puts into rank 1's
/// window, and after the fence rank 0 gets it from there. On shm every pair has its own ring,
/// so rank 0's get can reach rank 1 before rank 2's put of the epoch before, unless the fence
/// keeps everybody until everybody has applied its epoch.
#[test]
fn a_fence_orders_epochs_across_three_ranks() {
    for s in [Sched::Off, Sched::Aggregate] {
        testing::world_dyn(3, "shm", |c| {
            let me = c.rank();
            let mut m = vec![0u64; 8];
            c.win_create(&mut m, info(s), |w| {
                for k in 1..=3000u64 {
                    let v = [k; 8];
                    w.fence_epoch(Assert::NONE, |e| {
                        if me == 2 {
                            e.put(&v, 1, 0)?;
                        }
                        Ok(())
                    })?;
                    let mut got = [0u64; 8];
                    w.fence_epoch(Assert::NONE, |e| {
                        if me == 0 {
                            e.get(&mut got, 1, 0)?;
                        }
                        Ok(())
                    })?;
                    if me == 0 {
                        assert_eq!(got, [k; 8], "epoch {k} ({s:?}): the get overtook the put");
                    }
                }
                Ok(())
            })
            .unwrap();
        });
    }
}

/// A window freed right after a fence: the fence's last messages (each rank's word that it
/// has applied the epoch) must not arrive for a window already gone, which would fail the
/// sender as malformed. Five ranks, so that the barrier of `free` does not hear from every
/// rank directly.
#[test]
fn a_window_freed_right_after_a_fence() {
    testing::world_dyn(5, "shm", |c| {
        let me = c.rank();
        for i in 0..150u64 {
            let mut m = vec![0u64; 8];
            let v = [i];
            c.win_create(&mut m, info(Sched::Off), |w| {
                w.fence_epoch(Assert::NONE, |e| e.put(&v, (me + 1) % 5, me as usize))
            })
            .unwrap();
            assert_eq!(m[((me + 4) % 5) as usize], i);
        }
    });
}

/// Native puts and active-message accumulates on one window (loopback's RMA mode): an
/// accumulate of one epoch may still be queued at its target when the fence returns at the
/// origin; a native put of the next epoch must not land before it (the result would be the
/// sum, not the value put).
#[test]
fn a_native_put_does_not_overtake_the_last_epochs_accumulate() {
    for s in [Sched::Off, Sched::Aggregate] {
        testing::world_with(2, &opts(true), |c| {
            let me = c.rank();
            let mut m = vec![0u64; 2];
            c.win_create(&mut m, info(s), |w| {
                assert_eq!(
                    w.native_paths(),
                    (true, true, false),
                    "put/get native, acc not"
                );
                for k in 1..=500u64 {
                    let one = [1u64];
                    let val = [10 * k];
                    w.fence_epoch(Assert::NONE, |e| {
                        if me == 0 {
                            e.accumulate(&one, 1, 0, Op::Sum)?;
                        }
                        Ok(())
                    })?;
                    w.fence_epoch(Assert::NONE, |e| {
                        if me == 0 {
                            e.put(&val, 1, 0)?;
                        }
                        Ok(())
                    })?;
                    if me == 1 {
                        let mut got = [0u64];
                        w.read_local(0, &mut got)?;
                        assert_eq!(
                            got[0],
                            10 * k,
                            "epoch {k} ({s:?}): the put overtook the sum"
                        );
                    }
                    c.barrier()?;
                }
                Ok(())
            })
            .unwrap();
        });
    }
}

/// Paper 002's aggregation on a native window: small puts and gets go packed in batches, large
/// ones natively, in the same epochs. The ranks need not agree on the policy (rank 0 aggregates,
/// the others do not): the window agrees that it packs, so nobody takes the all-native fence
/// (a barrier) while a batch of rank 0's is still on its way. With every rank `off`, nothing
/// is packed.
#[test]
fn a_native_window_packs_small_operations_when_any_rank_aggregates() {
    // Loopback's RMA mode (atomics by active messages), and contract 2 with HCA atomics and a
    // window that uses only those: every path native, the case with an all-native fence.
    for (o, acc) in [
        (opts(true), None),
        (opts_contract2(), Some(vec![(Op::Sum, BasicType::I64)])),
    ] {
        testing::world_with(3, &o, |c| {
            let (n, me) = (c.size(), c.rank());
            let s = if me == 0 {
                Sched::Aggregate
            } else {
                Sched::Off
            };
            let inf = WinInfo {
                accumulate_ops: acc.clone(),
                ..info(s)
            };
            let writes = || {
                let p = c.provider_counters();
                p.iter()
                    .find(|(k, _)| *k == "rma_write")
                    .map_or(0, |(_, v)| *v)
            };
            const BIG: usize = 512; // 4 KiB: past WEFT_RMA_AGG_MAX, so native
            let mut m = vec![0u64; 8 * n as usize + BIG + 1];
            let ctr = 8 * n as usize + BIG; // a counter no epoch above writes
            c.win_create(&mut m, inf, |w| {
                let all = w.native_paths() == (true, true, true);
                assert!(w.native_paths().0 && w.native_paths().1);
                assert_eq!(all, acc.is_some());
                assert!(w.packs_native(), "some rank aggregates");
                assert!(!w.native_locks());
                let before = writes();
                let right = (me + 1) % n;
                let left = (me + n - 1) % n;
                for ep in 1..=50u64 {
                    let row: Vec<u64> = (0..8).map(|i| ep << 40 | (me as u64) << 32 | i).collect();
                    let big = vec![ep << 40 | me as u64; BIG];
                    w.fence_epoch(Assert::NONE, |e| {
                        for t in 0..n {
                            e.put(&row, t, 8 * me as usize)?;
                        }
                        e.put(&big, right, 8 * n as usize)
                    })?;
                    let mut mine = vec![0u64; ctr];
                    w.read_local(0, &mut mine)?;
                    for r in 0..n as u64 {
                        for i in 0..8u64 {
                            let want = ep << 40 | r << 32 | i;
                            assert_eq!(mine[(r * 8 + i) as usize], want, "epoch {ep}");
                        }
                    }
                    assert!(mine[8 * n as usize..]
                        .iter()
                        .all(|v| *v == ep << 40 | left as u64));
                    // Small and large gets of the left neighbour's window in one epoch.
                    let mut small = vec![0u64; 8];
                    let mut large = vec![0u64; BIG];
                    w.fence_epoch(Assert::NONE, |e| {
                        e.get(&mut small, left, 8 * right as usize)?;
                        e.get(&mut large, left, 8 * n as usize)
                    })?;
                    let lrow: Vec<u64> = (0..8)
                        .map(|i| ep << 40 | (right as u64) << 32 | i)
                        .collect();
                    assert_eq!(small, lrow, "epoch {ep}");
                    let from = (left + n - 1) % n;
                    assert!(
                        large.iter().all(|v| *v == ep << 40 | from as u64),
                        "epoch {ep}"
                    );
                }
                // Rank 0 (aggregating) wrote natively only its large puts; the others all.
                let native = writes() - before;
                assert_eq!(native, if me == 0 { 50 } else { 50 * (n as u64 + 1) });
                // Passive target: a get-modify-put under an exclusive lock, by every rank.
                for _ in 0..5 {
                    w.lock_epoch(0, LockKind::Exclusive, |e| {
                        let mut v = [0u64];
                        e.local(|l| l.get(&mut v, 0, ctr))?;
                        let w1 = [v[0] + 1];
                        e.local(|l| l.put(&w1, 0, ctr))?;
                        e.flush(0)
                    })?;
                }
                c.barrier()?;
                if me == 0 {
                    let mut v = [0u64];
                    w.read_local(ctr, &mut v)?;
                    assert_eq!(v[0], 5 * n as u64);
                }
                c.barrier()?;
                Ok(())
            })
            .unwrap();
            let mut m = vec![0u64; 4];
            c.win_create(&mut m, info(Sched::Off), |w| {
                assert!(!w.packs_native(), "nobody aggregates");
                Ok(())
            })
            .unwrap();
        });
    }
}

/// Under aggregation the gets of an epoch leave first, in a batch of their own (the target
/// answers them while the origin packs the rest) — except towards a target whose lock is still
/// lazy: the lock rides on the epoch's one batch, and nothing may reach the target before it.
#[test]
fn packed_gets_go_first_but_never_ahead_of_a_lazy_lock() {
    testing::world_with(2, &opts(false), |c| {
        let me = c.rank();
        let sent = || {
            let p = c.provider_counters();
            p.iter()
                .find(|(k, _)| *k == "am_send")
                .map_or(0, |(_, v)| *v)
        };
        let mut m = vec![0u64; 8];
        c.win_create(&mut m, info(Sched::Aggregate), |w| {
            w.write_local(0, &[me as u64 + 10; 8])?;
            c.barrier()?;
            if me == 1 {
                let (mut a, mut b) = ([0u64; 2], [0u64; 2]);
                let before = sent();
                w.lock_epoch(0, LockKind::Exclusive, |e| {
                    e.put(&[7u64, 7], 0, 4)?;
                    e.get(&mut a, 0, 0)?;
                    e.put(&[8u64, 8], 0, 6)?;
                    e.get(&mut b, 0, 2)
                })?;
                assert_eq!(
                    sent() - before,
                    1,
                    "lock, operations and unlock in one batch"
                );
                assert_eq!((a, b), ([10, 10], [10, 10]));
            }
            c.barrier()?;
            if me == 0 {
                let mut v = [0u64; 8];
                w.read_local(0, &mut v)?;
                assert_eq!(v, [10, 10, 10, 10, 7, 7, 8, 8]);
            }
            c.barrier()?;
            Ok(())
        })
        .unwrap();
    });
}

#[test]
fn shm_native_atomics_agree_with_the_reference() {
    testing::world_dyn(3, "shm", |c| {
        let w = c.win_allocate::<u64>(4, WinInfo::default()).unwrap();
        assert_eq!(w.native_paths(), (true, true, true));
        assert!(w.native_locks());
        w.free().unwrap();
        let mut m = vec![0u64; 4];
        c.win_create(&mut m, WinInfo::default(), |w| {
            assert_eq!(w.native_paths(), (false, false, false));
            Ok(())
        })
        .unwrap();
        for s in [Sched::Off, Sched::Full] {
            atomics(c, s, true);
            atomics(c, s, false);
        }
    });
}

#[test]
fn scalable_keys_mean_no_key_table() {
    testing::world_with(2, &opts(true), |c| {
        let mut mem = vec![0u8; 8];
        c.win_create(&mut mem, WinInfo::default(), |win| {
            assert_eq!(win.native_paths(), (true, true, false));
            assert!(!win.has_key_table());
            assert_eq!(win.completion(), WinCompletion::Counter);
            Ok(())
        })
        .unwrap();
    });
    testing::world_with(2, &opts_queue(), |c| {
        let mut mem = vec![0u8; 8];
        c.win_create(&mut mem, WinInfo::default(), |win| {
            assert_eq!(win.completion(), WinCompletion::Queue);
            Ok(())
        })
        .unwrap();
    });
    testing::world_with(2, &opts(false), |c| {
        let mut mem = vec![0u8; 8];
        c.win_create(&mut mem, WinInfo::default(), |win| {
            assert_eq!(win.native_paths(), (false, false, false));
            assert_eq!(win.completion(), WinCompletion::ActiveMessages);
            Ok(())
        })
        .unwrap();
    });
}

/// Counters are per window and reused after a window is freed; operations on one window are
/// never counted on another's.
#[test]
fn counters_are_per_window() {
    testing::world_with(2, &opts(true), |c| {
        let (me, peer) = (c.rank(), 1 - c.rank());
        let mut a = vec![0u32; 4];
        let mut b = vec![0u32; 4];
        for round in 0..3u32 {
            c.win_create(&mut a, WinInfo::default(), |wa| {
                c.win_create(&mut b, WinInfo::default(), |wb| {
                    assert_eq!(wa.completion(), WinCompletion::Counter);
                    assert_eq!(wb.completion(), WinCompletion::Counter);
                    let va = [me * 10 + round; 4];
                    let vb = [me * 100 + round; 4];
                    wa.fence(Assert::NONE).unwrap();
                    wb.fence(Assert::NONE).unwrap();
                    wa.fence_epoch(Assert::NONE, |e| e.put(&va, peer, 0))
                        .unwrap();
                    wb.lock_epoch(peer, LockKind::Shared, |e| {
                        e.put(&vb[..2], peer, 0)?;
                        e.flush(peer)?;
                        e.put(&vb[2..], peer, 2)
                    })
                    .unwrap();
                    c.barrier().unwrap();
                    let mut got = [0u32; 4];
                    wa.read_local(0, &mut got).unwrap();
                    assert_eq!(got, [peer * 10 + round; 4]);
                    wb.read_local(0, &mut got).unwrap();
                    assert_eq!(got, [peer * 100 + round; 4]);
                    Ok(())
                })
            })
            .unwrap();
        }
    });
}

#[test]
fn allocated_windows() {
    testing::world(3, |c| {
        let win = c.win_allocate::<u32>(10, WinInfo::default()).unwrap();
        let me = c.rank();
        let v = [me + 1];
        win.fence_epoch(Assert::NONE, |e| e.accumulate(&v, 0, 9, Op::Sum))
            .unwrap();
        if me == 0 {
            let mut x = [0u32];
            win.read_local(9, &mut x).unwrap();
            assert_eq!(x[0], 6);
        }
        win.free().unwrap();
    });
}

// ------------------------------------------------------------ random epochs vs a reference

/// Deterministic generator shared by all ranks (each can compute everyone's operations).
use weft_proto::sim::Rng;

const SLOTS: usize = 48; // 0..24: puts (slot % n owned by one origin), 24..36: sums, 36..48: reads

#[derive(Clone, Copy, Debug)]
enum ROp {
    Put { t: u32, slot: usize, v: i64 },
    Acc { t: u32, slot: usize, v: i64 },
    Get { t: u32, slot: usize },
}

/// The operations rank `r` issues in epoch `ep`.
fn ops_of(seed: u64, ep: u64, r: u32, n: u32) -> Vec<ROp> {
    let mut g = Rng::new(seed ^ (ep * 7919 + r as u64 * 104_729 + 1));
    let k = 1 + g.below(6) as usize;
    let mut used = std::collections::HashSet::new();
    let mut v = vec![];
    for _ in 0..k {
        let t = g.below(n as u64) as u32;
        match g.below(3) {
            0 => {
                // A put slot owned by this origin, at most once per (target, slot) per epoch.
                let slot = (g.below(24 / n as u64) as usize) * n as usize + r as usize;
                if slot < 24 && used.insert((t, slot)) {
                    v.push(ROp::Put {
                        t,
                        slot,
                        v: g.below(1000) as i64,
                    });
                }
            }
            1 => v.push(ROp::Acc {
                t,
                slot: 24 + g.below(12) as usize,
                v: g.below(50) as i64 - 25,
            }),
            _ => v.push(ROp::Get {
                t,
                slot: 36 + g.below(12) as usize,
            }),
        }
    }
    v
}

/// Local stores between epochs (read slots get new values every epoch).
fn local_store(ep: u64, r: u32, slot: usize) -> i64 {
    (ep as i64 * 1000 + r as i64 * 100 + slot as i64) * 3
}

fn target_of(o: &ROp) -> u32 {
    match o {
        ROp::Put { t, .. } | ROp::Acc { t, .. } | ROp::Get { t, .. } => *t,
    }
}

/// Issue `ops` in epoch `e`; buffers (`gets`, `values`) outlive the epoch.
fn issue<'e, P: Provider>(
    e: &weft::Epoch<'e, '_, P>,
    ops: &[ROp],
    gets: &'e mut [i64],
    values: &'e [i64],
    only: Option<u32>,
) -> weft::Result<()> {
    for ((o, g), v) in ops.iter().zip(gets.iter_mut()).zip(values.iter()) {
        match *o {
            ROp::Put { t, slot, .. } if only.is_none_or(|x| x == t) => {
                e.put(std::slice::from_ref(v), t, slot)?
            }
            ROp::Acc { t, slot, .. } if only.is_none_or(|x| x == t) => {
                e.accumulate(std::slice::from_ref(v), t, slot, Op::Sum)?
            }
            ROp::Get { t, slot } if only.is_none_or(|x| x == t) => {
                e.get(std::slice::from_mut(g), t, slot)?
            }
            _ => {}
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Fence,
    LockAll,
    Pscw,
    LockEach,
}

fn random_epochs<P: Provider>(c: &Comm<P>, s: Sched, mode: Mode, seed: u64, alloc: bool) {
    let n = c.size();
    let me = c.rank();
    let mut mem = vec![0i64; SLOTS];
    with_window(c, &mut mem, info(s), alloc, |win| {
        let mut model = vec![vec![0i64; SLOTS]; n as usize];
        for ep in 0..12u64 {
            // Local stores to the read slots, then a barrier-like synchronisation.
            for slot in 36..SLOTS {
                let v = local_store(ep, me, slot);
                win.write_local(slot, &[v]).unwrap();
                for (r, m) in model.iter_mut().enumerate() {
                    m[slot] = local_store(ep, r as u32, slot);
                }
            }
            c.barrier().unwrap();
            let mine = ops_of(seed, ep, me, n);
            let mut values: Vec<i64> = mine
                .iter()
                .map(|o| match o {
                    ROp::Put { v, .. } | ROp::Acc { v, .. } => *v,
                    ROp::Get { .. } => 0,
                })
                .collect();
            let mut gets = vec![0i64; mine.len()];
            match mode {
                Mode::Fence => win
                    .fence_epoch(Assert::NONE, |e| issue(e, &mine, &mut gets, &values, None))
                    .unwrap(),
                Mode::LockAll => win
                    .lock_all_epoch(|e| {
                        issue(e, &mine, &mut gets, &values, None)?;
                        e.flush_all()
                    })
                    .unwrap(),
                Mode::Pscw => {
                    let all: Vec<u32> = (0..n).collect();
                    win.post(&all).unwrap();
                    win.start_epoch(&all, |e| issue(e, &mine, &mut gets, &values, None))
                        .unwrap();
                    win.wait().unwrap();
                }
                Mode::LockEach => {
                    // One exclusive epoch per target, each with its own operations and results.
                    for t in 0..n {
                        let idx: Vec<usize> = (0..mine.len())
                            .filter(|i| target_of(&mine[*i]) == t)
                            .collect();
                        let ops_t: Vec<ROp> = idx.iter().map(|i| mine[*i]).collect();
                        let vals_t: Vec<i64> = idx.iter().map(|i| values[*i]).collect();
                        let mut g = vec![0i64; ops_t.len()];
                        win.lock_epoch(t, LockKind::Exclusive, |e| {
                            issue(e, &ops_t, &mut g, &vals_t, None)
                        })
                        .unwrap();
                        for (k, i) in idx.iter().enumerate() {
                            gets[*i] = g[k];
                        }
                    }
                }
            }
            values.clear();
            // Everyone's epoch is over before anyone reads its window.
            c.barrier().unwrap();
            // The reference: apply every rank's operations (conflict-free, so order-free).
            for r in 0..n {
                for o in ops_of(seed, ep, r, n) {
                    match o {
                        ROp::Put { t, slot, v } => model[t as usize][slot] = v,
                        ROp::Acc { t, slot, v } => model[t as usize][slot] += v,
                        ROp::Get { .. } => {}
                    }
                }
            }
            let mut now = vec![0i64; SLOTS];
            win.read_local(0, &mut now).unwrap();
            assert_eq!(
                now, model[me as usize],
                "epoch {ep}, {mode:?}, {s:?}, seed {seed}"
            );
            for (o, g) in mine.iter().zip(&gets) {
                if let ROp::Get { t, slot } = o {
                    assert_eq!(
                        *g,
                        local_store(ep, *t, *slot),
                        "get in epoch {ep}, {mode:?}, {s:?}"
                    );
                }
            }
            c.barrier().unwrap();
        }
    });
}

#[test]
fn random_epochs_match_the_reference_model() {
    for (i, mode) in [Mode::Fence, Mode::LockAll, Mode::Pscw, Mode::LockEach]
        .into_iter()
        .enumerate()
    {
        for (j, s) in SCHEDS.into_iter().enumerate() {
            let seed = 0x5EED_0000 + (i * 4 + j) as u64;
            testing::world_with(4, &opts(false), |c| random_epochs(c, s, mode, seed, false));
            testing::world_dyn_with(3, "loopback", &opts(true), |c| {
                random_epochs(c, s, mode, seed + 99, false)
            });
            testing::world_with(3, &opts_queue(), |c| {
                random_epochs(c, s, mode, seed + 55, false)
            });
            testing::world_dyn(3, "shm", |c| random_epochs(c, s, mode, seed + 7, true));
            testing::world_dyn(2, "shm", |c| random_epochs(c, s, mode, seed + 8, false));
        }
    }
}

/// `WEFT_RMA_AGG_MAX` larger than what the provider carries in one message: operations whose
/// batch record would not fit are issued on their own, so the epoch, later collectives and
/// finalize work. (Before, a batch over the payload limit failed the epoch and left every later
/// send to that peer failing.)
#[test]
fn aggregation_never_exceeds_the_provider_payload() {
    testing::world_with(2, &opts(false), |c| {
        let me = c.rank();
        let peer = 1 - me;
        let mut mem = vec![0u8; 64 << 10];
        let info = WinInfo {
            accumulate_ops: None,
            sched: Some(Sched::Aggregate),
            agg_max: Some(1 << 20),
        };
        c.win_create(&mut mem, info, |win| {
            let big = vec![me as u8 + 1; 40 << 10]; // more than loopback's 16 KiB payload
            let small = [me as u8 + 10; 8];
            win.fence_epoch(Assert::NONE, |e| {
                e.put(&small, peer, 0)?;
                e.put(&big, peer, 8)?;
                e.put(&small, peer, 8 + big.len())
            })?;
            let mut got = vec![0u8; 16 + big.len()];
            win.read_local(0, &mut got)?;
            assert_eq!(got[..8], [peer as u8 + 10; 8]);
            assert!(got[8..8 + big.len()].iter().all(|&b| b == peer as u8 + 1));
            assert_eq!(got[8 + big.len()..], [peer as u8 + 10; 8]);
            c.barrier()
        })
        .unwrap();
    });
}

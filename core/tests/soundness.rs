//! Soundness under failure: no timeout, panic or misbehaving peer may let the library write into
//! memory it no longer owns.
//!
//! A request whose wait fails (here: `WEFT_TIMEOUT` runs out) must give up its buffer: once the
//! wait or the scope returns, nothing may write into that memory again, even if the peer sends
//! the data later. The receive buffers below are slices of an arena the test keeps, so a late
//! write shows up as changed bytes (before the fix it was a write into freed memory). Windows
//! likewise: a window lives in a closure and releases its memory when the closure ends, even by
//! a panic, after which a peer's native put is refused.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;
use std::time::Duration;
use weft::ErrorKind;
use weft_testing::{self as testing, Options};

const LEN: usize = 48 << 10;
/// Bound on one step of a test (a signal from the other rank): 30 s, or `WEFT_TEST_STEP_SECS`
/// (CI raises it for its valgrind run, which is 20-50 times slower).
static STEP: std::sync::LazyLock<Duration> = std::sync::LazyLock::new(|| {
    let s = std::env::var("WEFT_TEST_STEP_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    Duration::from_secs(s)
});

fn opts() -> Options {
    Options {
        // Short, since some waits here must run out; long enough that the others do not
        // on a loaded machine.
        timeout: Duration::from_millis(1500),
        ..Options::default()
    }
}

/// One-way signals between the two rank threads (bounded waits: a missing signal fails loudly).
struct Signals {
    to0: (Mutex<Sender<()>>, Mutex<Receiver<()>>),
    to1: (Mutex<Sender<()>>, Mutex<Receiver<()>>),
}

impl Signals {
    fn new() -> Self {
        let (a, b) = channel();
        let (c, d) = channel();
        Signals {
            to0: (Mutex::new(a), Mutex::new(b)),
            to1: (Mutex::new(c), Mutex::new(d)),
        }
    }
    fn tell(&self, rank: u32) {
        let s = if rank == 0 { &self.to0.0 } else { &self.to1.0 };
        s.lock().unwrap().send(()).unwrap();
    }
    fn expect(&self, rank: u32) {
        let r = if rank == 0 { &self.to0.1 } else { &self.to1.1 };
        r.lock()
            .unwrap()
            .recv_timeout(*STEP)
            .expect("the other rank did not signal");
    }
}

/// Rank 1 starts a 48 KiB rendezvous send and stalls; rank 0's receive matches it, then its wait
/// times out. Rank 1 then streams the data. Rank 0's arena must not change.
fn late_rendezvous_data(explicit_wait: bool) {
    let sig = Signals::new();
    testing::world_with(2, &opts(), |c| {
        if c.rank() == 0 {
            let mut arena = vec![0u8; 2 * LEN];
            sig.expect(0); // the RTS is on its way
            let r = c.scope(|s| {
                let req = c.irecv(s, &mut arena[..LEN], 1, 7).unwrap();
                // Match the RTS (and answer CTS), so the receive can no longer be cancelled.
                c.progress().unwrap();
                if explicit_wait {
                    req.wait().map(|_| ())
                } else {
                    std::mem::forget(req); // the scope's end must still take care of it
                    Ok(())
                }
            });
            if explicit_wait {
                assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
            }
            // The scope is over: the arena is ours again.
            arena.fill(0xAB);
            sig.tell(1);
            sig.expect(0);
            for _ in 0..10 {
                c.progress().unwrap();
            }
            assert!(
                arena.iter().all(|&b| b == 0xAB),
                "late rendezvous data was written into memory the scope had given back"
            );
        } else {
            let data = vec![0x5Au8; LEN];
            c.scope(|s| {
                let req = c.isend(s, &data, 0, 7).unwrap();
                sig.tell(0);
                sig.expect(1);
                // Now the receiver's CTS is read and every DATA chunk sent.
                req.wait().unwrap();
            });
            sig.tell(0);
        }
        c.barrier().unwrap();
    });
}

#[test]
fn late_data_after_a_failed_wait_goes_nowhere() {
    late_rendezvous_data(true);
}

#[test]
fn late_data_after_a_failed_scope_end_goes_nowhere() {
    late_rendezvous_data(false);
}

/// The write rendezvous hands the receive buffer's key to the sender. Rank 0's receive
/// registers its buffer and announces it, then its wait times out while rank 1 stalls; rank 1
/// then writes with the key it was given. The write must be refused (the key was revoked when
/// the receive was given up), rank 1's send must fail, and rank 0's arena must not change.
#[test]
fn a_late_rendezvous_write_after_a_failed_wait_is_refused() {
    let sig = Signals::new();
    let o = Options {
        loopback: weft_loopback::LoopbackConfig {
            rma: true,
            write_rndv: true,
            ..Default::default()
        },
        ..opts()
    };
    testing::world_with(2, &o, |c| {
        if c.rank() == 0 {
            let mut arena = vec![0u8; 2 * LEN];
            sig.expect(0); // the RTS is on its way
            let r = c.scope(|s| {
                let req = c.irecv(s, &mut arena[..LEN], 1, 7).unwrap();
                // Match the RTS, register the buffer and send its key.
                c.progress().unwrap();
                req.wait().map(|_| ())
            });
            assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
            arena.fill(0xAB);
            sig.tell(1);
            sig.expect(0);
            for _ in 0..10 {
                c.progress().unwrap();
            }
            assert!(
                arena.iter().all(|&b| b == 0xAB),
                "a rendezvous write landed in memory the receive had given back"
            );
        } else {
            let data = vec![0x5Au8; LEN];
            c.scope(|s| {
                let req = c.isend(s, &data, 0, 7).unwrap();
                sig.tell(0);
                sig.expect(1);
                // Now the receiver's WCTS is read and the write tried with its revoked key.
                let e = req.wait().unwrap_err();
                assert_eq!(e.kind(), ErrorKind::RemoteAccess, "{e}");
            });
            sig.tell(0);
        }
        c.barrier().unwrap();
    });
}

/// Blocking receives have the same hole: their buffer is the caller's again when `recv`
/// returns its timeout error.
#[test]
fn late_data_after_a_failed_blocking_recv_goes_nowhere() {
    let sig = Signals::new();
    testing::world_with(2, &opts(), |c| {
        if c.rank() == 0 {
            let mut arena = vec![0u8; 2 * LEN];
            sig.expect(0);
            let e = c.recv(&mut arena[..LEN], 1, 7).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout);
            arena.fill(0xAB);
            sig.tell(1);
            sig.expect(0);
            for _ in 0..10 {
                c.progress().unwrap();
            }
            assert!(
                arena.iter().all(|&b| b == 0xAB),
                "late write into a returned buffer"
            );
        } else {
            let data = vec![0x5Au8; LEN];
            c.scope(|s| {
                let req = c.isend(s, &data, 0, 7).unwrap();
                sig.tell(0);
                sig.expect(1);
                req.wait().unwrap();
            });
            sig.tell(0);
        }
        c.barrier().unwrap();
    });
}

/// RMA: a get whose epoch fails to complete (the target does not answer in time) must not
/// have its reply written into the origin buffer after the epoch returned.
#[test]
fn late_get_reply_after_a_failed_epoch_goes_nowhere() {
    let sig = Signals::new();
    testing::world_with(2, &opts(), |c| {
        let mut mem = vec![0x77u8; 4096];
        c.win_create(&mut mem, Default::default(), |win| {
            if c.rank() == 0 {
                let mut arena = vec![0u8; 8192];
                let r = win.lock_epoch(1, weft::LockKind::Shared, |e| {
                    // The lock is granted; rank 1 stops answering before the get leaves.
                    sig.tell(1);
                    sig.expect(0);
                    e.get(&mut arena[..4096], 1, 0)
                });
                assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
                arena.fill(0xAB);
                sig.tell(1);
                sig.expect(0);
                for _ in 0..10 {
                    c.progress().unwrap();
                }
                assert!(arena.iter().all(|&b| b == 0xAB), "late GET reply written");
            } else {
                // Grant the lock, then stall until rank 0 gave up, then answer everything.
                let rx = &sig.to1.1;
                let deadline = std::time::Instant::now() + *STEP;
                loop {
                    c.progress().unwrap();
                    if rx.lock().unwrap().try_recv().is_ok() {
                        break;
                    }
                    std::thread::yield_now();
                    assert!(
                        std::time::Instant::now() < deadline,
                        "no signal from rank 0"
                    );
                }
                sig.tell(0);
                sig.expect(1);
                for _ in 0..10 {
                    c.progress().unwrap();
                }
                sig.tell(0);
            }
            c.barrier().unwrap();
            Ok(())
        })
        .unwrap();
    });
}

/// A window whose closure panics is released locally on the way out: a peer's native put after
/// that is refused and the memory, the caller's again, keeps its bytes. (With a window that
/// could be leaked with `mem::forget`, as before windows lived in closures, the put landed.)
#[test]
fn a_released_window_refuses_native_puts() {
    let sig = Signals::new();
    let mut o = opts();
    o.loopback.rma = true;
    testing::world_with(2, &o, |c| {
        let mut mem = vec![0u8; 64];
        if c.rank() == 0 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                c.win_create(&mut mem, Default::default(), |_w| -> weft::Result<()> {
                    panic!("the application failed inside the window's closure")
                })
            }));
            assert!(r.is_err());
            mem.fill(0xAB);
            sig.tell(1);
            sig.expect(0);
            assert!(
                mem.iter().all(|&b| b == 0xAB),
                "a put landed in memory the window had given back"
            );
            sig.expect(0); // rank 1's window is gone too: the barrier below is prompt
        } else {
            let r = c.win_create(&mut mem, Default::default(), |w| {
                sig.expect(1);
                let put = w.fence_epoch(weft::Assert::NONE, |e| e.put(&[0x5Au8; 8], 0, 0));
                assert!(put.is_err(), "a put into a released window succeeded");
                sig.tell(0);
                Ok(())
            });
            // Freeing is collective and rank 0 is gone from this window: it times out.
            assert!(r.is_err());
            sig.tell(0);
        }
        c.barrier().unwrap();
    });
}

/// Local window access is bounds-checked without overflow (a displacement of `usize::MAX`
/// wrapped to one byte before the window in release builds) and refused during this rank's
/// own epochs on the window, when its operations may still be landing.
#[test]
fn local_window_access_is_checked() {
    testing::world(2, |c| {
        let mut mem = [7u8; 32];
        let me = c.rank();
        c.win_create(&mut mem[8..24], Default::default(), |w| {
            for disp in [usize::MAX, usize::MAX / 2 + 1, 16, 9] {
                let e = w.write_local(disp, &[1u8; 8]).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{disp}: {e}");
                let mut out = [0u8; 8];
                assert!(w.read_local(disp, &mut out).is_err());
            }
            w.write_local(8, &[1u8; 8]).unwrap();
            w.fence_epoch(weft::Assert::NONE, |_| {
                let mut out = [0u8; 1];
                assert!(w.read_local(0, &mut out).is_err(), "read during an epoch");
                assert!(w.write_local(0, &out).is_err(), "write during an epoch");
                Ok(())
            })?;
            w.post(&[1 - me])?;
            assert!(w.write_local(0, &[0u8]).is_err(), "write while exposed");
            w.start_epoch(&[1 - me], |_| Ok(()))?;
            w.wait()?;
            Ok(())
        })
        .unwrap();
        assert_eq!(mem[..8], [7u8; 8], "bytes before the window changed");
        assert_eq!(mem[16..24], [1u8; 8]);
        assert_eq!(mem[24..], [7u8; 8], "bytes after the window changed");
    });
}

/// A peer that sends far more small messages than the receiver has posted receives for can
/// make it hold at most `eager_window` bytes of them (the rest go by rendezvous and wait for
/// their receives); every message still arrives, in order. Before, the unexpected queue took
/// all of them (here 2,000 KiB against a 64 KiB window).
#[test]
fn unexpected_eager_data_is_bounded_per_peer() {
    const N: usize = 2000;
    const WINDOW: usize = 64 << 10;
    let sig = Signals::new();
    let mut o = Options {
        timeout: *STEP,
        ..Options::default()
    };
    o.engine.eager_window = WINDOW;
    testing::world_with(2, &o, |c| {
        let msg = |i: usize| vec![(i % 251) as u8; 1024];
        if c.rank() == 1 {
            let bufs: Vec<Vec<u8>> = (0..N).map(msg).collect();
            c.scope(|s| {
                let reqs: Vec<_> = bufs.iter().map(|b| c.isend(s, b, 0, 3).unwrap()).collect();
                sig.tell(0);
                weft::waitall(reqs).unwrap();
            });
        } else {
            sig.expect(0);
            for _ in 0..100 {
                c.progress().unwrap();
            }
            let held = c.unexpected_bytes();
            assert!(held > 0, "nothing arrived");
            assert!(held <= WINDOW, "{held} unexpected bytes held from one peer");
            let mut buf = vec![0u8; 1024];
            for i in 0..N {
                c.recv(&mut buf, 1, 3).unwrap();
                assert_eq!(buf, msg(i), "message {i}");
            }
            assert_eq!(c.unexpected_bytes(), 0);
        }
        c.barrier().unwrap();
    });
}

/// A large get on the active-message path is answered from the window as the target's outbox
/// drains, not copied into it at once: origins × window size of copies was a peer-controlled
/// allocation. Here the target holds at most a few chunks' worth of copies while an 8 MiB get
/// is stuck behind a 2-deep mailbox (before: all 8 MiB).
#[test]
fn a_large_am_get_is_not_copied_at_the_target() {
    const LEN: usize = 8 << 20;
    let sig = Signals::new();
    let mut o = Options {
        timeout: *STEP,
        ..Options::default()
    };
    o.loopback.depth = 2;
    testing::world_with(2, &o, |c| {
        let mut mem = vec![c.rank() as u8 + 1; LEN];
        c.win_create(&mut mem, Default::default(), |win| {
            if c.rank() == 1 {
                let mut got = vec![0u8; LEN];
                win.lock_epoch(0, weft::LockKind::Shared, |e| e.get(&mut got, 0, 0))?;
                assert!(got.iter().all(|&b| b == 1));
                sig.tell(0);
            } else {
                // Serve the get, watching what the outbox holds, until rank 1 has its data.
                let (mut most, mut rounds) = (0, 0u64);
                let deadline = std::time::Instant::now() + *STEP;
                while sig.to0.1.lock().unwrap().try_recv().is_err() {
                    c.progress()?;
                    most = most.max(c.queued_bytes());
                    rounds += 1;
                    assert!(
                        std::time::Instant::now() < deadline,
                        "rank 1 did not finish"
                    );
                }
                assert!(rounds > 0);
                assert!(most < 1 << 20, "{most} bytes of reply copies queued");
            }
            c.barrier()
        })
        .unwrap();
    });
}

/// A lock request whose wait runs out (`WEFT_TIMEOUT`) is withdrawn, not taken for an unlock
/// of a lock the rank never held: rank 1 holds rank 0's lock while rank 2's request times out;
/// rank 2 then locks again, and so does rank 1. Before, the target failed rank 2 as malformed
/// ("UNLOCK of a lock it does not hold") and its later lock went unanswered.
#[test]
fn a_lock_request_that_timed_out_is_withdrawn() {
    use std::sync::mpsc::sync_channel;
    let (locked_tx, locked_rx) = sync_channel::<()>(1);
    let (gave_up_tx, gave_up_rx) = sync_channel::<()>(1);
    let (done_tx, done_rx) = sync_channel::<u32>(2);
    let (locked_tx, locked_rx) = (Mutex::new(locked_tx), Mutex::new(locked_rx));
    let (gave_up_tx, gave_up_rx) = (Mutex::new(gave_up_tx), Mutex::new(gave_up_rx));
    let (done_tx, done_rx) = (Mutex::new(done_tx), Mutex::new(done_rx));
    testing::world_with(3, &opts(), |c| {
        let mut mem = vec![0u8; 64];
        c.win_create(&mut mem, Default::default(), |win| {
            match c.rank() {
                0 => {
                    // The target: serve the lock traffic until both origins are done.
                    let deadline = std::time::Instant::now() + 3 * *STEP;
                    let mut done = 0;
                    while done < 2 {
                        c.progress()?;
                        if done_rx.lock().unwrap().try_recv().is_ok() {
                            done += 1;
                        }
                        // The origins are threads of this process: let them run (under
                        // valgrind, whose scheduler is not fair, a spinning thread starves them).
                        std::thread::yield_now();
                        assert!(std::time::Instant::now() < deadline, "origins stuck");
                    }
                }
                1 => {
                    win.lock_epoch(0, weft::LockKind::Exclusive, |e| {
                        e.put(&[1u8; 8], 0, 0)?;
                        locked_tx.lock().unwrap().send(()).unwrap();
                        gave_up_rx
                            .lock()
                            .unwrap()
                            .recv_timeout(*STEP)
                            .expect("rank 2 did not give up");
                        Ok(())
                    })?;
                    // Rank 2's second epoch, then this one: the lock was handed on and back.
                    win.lock_epoch(0, weft::LockKind::Exclusive, |e| e.put(&[3u8; 8], 0, 16))?;
                    done_tx.lock().unwrap().send(1).unwrap();
                }
                _ => {
                    locked_rx
                        .lock()
                        .unwrap()
                        .recv_timeout(*STEP)
                        .expect("rank 1 did not lock");
                    let r =
                        win.lock_epoch(0, weft::LockKind::Exclusive, |e| e.put(&[9u8; 8], 0, 8));
                    assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
                    gave_up_tx.lock().unwrap().send(()).unwrap();
                    win.lock_epoch(0, weft::LockKind::Exclusive, |e| e.put(&[2u8; 8], 0, 8))
                        .expect("a lock after a withdrawn request");
                    done_tx.lock().unwrap().send(2).unwrap();
                }
            }
            Ok(())
        })
        .unwrap();
        if c.rank() == 0 {
            assert_eq!(&mem[..8], &[1u8; 8]);
            assert_eq!(&mem[8..16], &[2u8; 8], "rank 2's second epoch");
            assert_eq!(&mem[16..24], &[3u8; 8]);
        }
    });
}

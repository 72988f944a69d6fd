//! The lean receive path (core/src/p2p/slot.rs): a blocking `recv` posted without a request.
//!
//! Each case makes the message arrive while the receive is already posted: the receiver sends
//! "go" and then calls `recv`; loopback delivers only inside the receiver's own progress, which
//! runs in `recv` after the posting. `Comm::lean_receives` then proves which path was taken, so
//! a case cannot pass on the general path by accident.

use std::time::Duration;
use weft::{Comm, ErrorKind, Provider, ANY_SOURCE, ANY_TAG};
use weft_testing::{self as testing, Options};

const GO: i32 = 99;

fn go<P: Provider>(c: &Comm<P>, to: u32) {
    c.send(&[1u8], to, GO).unwrap();
}

fn wait_go<P: Provider>(c: &Comm<P>, from: u32) {
    let mut b = [0u8; 1];
    c.recv(&mut b, from, GO).unwrap();
}

#[test]
fn an_eager_message_completes_the_slot() {
    testing::world(2, |c| {
        if c.rank() == 0 {
            let before = c.lean_receives();
            let mut buf = [0u8; 64];
            go(c, 1);
            let st = c.recv(&mut buf, 1, 5).unwrap();
            assert_eq!((st.source, st.tag, st.bytes), (1, 5, 40));
            assert_eq!(&buf[..40], &[0x5Au8; 40]);
            assert_eq!(&buf[40..], &[0u8; 24], "nothing past the message");
            let after = c.lean_receives();
            assert_eq!(after.0, before.0 + 1, "completed in the slot");
            assert_eq!(after.1, before.1, "not demoted");
        } else {
            wait_go(c, 0);
            c.send(&[0x5Au8; 40], 0, 5).unwrap();
        }
    });
}

/// Messages of 0 to 16 bytes take the arrival's call-free path into the slot (`slot_arrival`):
/// every length lands whole, nothing past it is written, and the status is exact.
#[test]
fn small_messages_of_every_length_complete_the_slot() {
    testing::world(2, |c| {
        for n in 0..=16usize {
            if c.rank() == 0 {
                let before = c.lean_receives();
                let mut buf = [0xEEu8; 24];
                go(c, 1);
                let st = c.recv(&mut buf, 1, 6).unwrap();
                assert_eq!((st.source, st.tag, st.bytes), (1, 6, n));
                let want: Vec<u8> = (0..n as u8).map(|i| i ^ 0x3C).collect();
                assert_eq!(&buf[..n], &want[..], "{n} bytes");
                assert!(buf[n..].iter().all(|&b| b == 0xEE), "past {n} bytes");
                assert_eq!(c.lean_receives().0, before.0 + 1, "{n}: in the slot");
            } else {
                wait_go(c, 0);
                let msg: Vec<u8> = (0..n as u8).map(|i| i ^ 0x3C).collect();
                c.send(&msg, 0, 6).unwrap();
            }
        }
    });
}

/// The slot's call-free arrival counts the eager window like every other arrival and gives the
/// sender its credit back: with the smallest window, thousands of small messages in a row
/// still go eagerly into the slot (a lost credit would turn them into rendezvous messages,
/// each of which demotes the slot).
#[test]
fn small_messages_return_the_senders_credit() {
    let mut o = Options::default();
    o.engine.eager_limit = Some(64);
    o.engine.eager_window = 1;
    testing::world_with(2, &o, |c| {
        // Under Miri (CI's soundness run) a hundred: with a window of one, each message
        // already needs the credit of the one before; 3,000 took 165 s there.
        const N: usize = if cfg!(miri) { 100 } else { 3000 };
        if c.rank() == 0 {
            let before = c.lean_receives();
            for i in 0..N {
                let mut buf = [0u8; 16];
                go(c, 1);
                let st = c.recv(&mut buf, 1, 7).unwrap();
                assert_eq!(st.bytes, 16);
                assert_eq!(buf, [(i % 251) as u8; 16]);
            }
            let after = c.lean_receives();
            assert_eq!(after.0 - before.0, N as u64, "every message in the slot");
            assert_eq!(after.1, before.1, "none demoted: the credit came back");
        } else {
            for i in 0..N {
                wait_go(c, 0);
                c.send(&[(i % 251) as u8; 16], 0, 7).unwrap();
            }
        }
    });
}

#[test]
fn a_truncating_message_writes_the_prefix_only() {
    testing::world(2, |c| {
        if c.rank() == 0 {
            let mut arena = [0u8; 32];
            go(c, 1);
            let e = c.recv(&mut arena[..16], 1, 5).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Truncated, "{e}");
            assert_eq!(&arena[..16], &[7u8; 16]);
            assert_eq!(
                &arena[16..],
                &[0u8; 16],
                "a byte past the buffer was written"
            );
            assert_eq!(c.lean_receives(), (1, 0), "completed in the slot");
        } else {
            wait_go(c, 0);
            c.send(&[7u8; 24], 0, 5).unwrap();
        }
    });
}

#[test]
fn a_synchronous_send_is_acknowledged_from_the_slot() {
    testing::world(2, |c| {
        if c.rank() == 0 {
            let mut buf = [0u8; 8];
            go(c, 1);
            c.recv(&mut buf, 1, 5).unwrap();
            assert_eq!(buf, [3u8; 8]);
            assert_eq!(c.lean_receives(), (1, 0));
        } else {
            wait_go(c, 0);
            // Completes only once rank 0 matched it: the slot must acknowledge.
            c.ssend(&[3u8; 8], 0, 5).unwrap();
        }
    });
}

#[test]
fn wildcards_match_in_the_slot() {
    testing::world(3, |c| {
        if c.rank() == 0 {
            let mut buf = [0u8; 4];
            go(c, 2);
            let st = c.recv(&mut buf, ANY_SOURCE, ANY_TAG).unwrap();
            assert_eq!((st.source, st.tag, buf), (2, 11, [2u8; 4]));
            // A wildcard on one field only: the other must still match.
            go(c, 1);
            let st = c.recv(&mut buf, 1, ANY_TAG).unwrap();
            assert_eq!((st.source, st.tag, buf), (1, 12, [1u8; 4]));
            assert_eq!(c.lean_receives(), (2, 0));
        } else if c.rank() == 2 {
            wait_go(c, 0);
            c.send(&[2u8; 4], 0, 11).unwrap();
        } else {
            wait_go(c, 0);
            c.send(&[1u8; 4], 0, 12).unwrap();
        }
    });
}

/// A message that matches both an earlier nonblocking receive and the blocking one goes to the
/// earlier one (MPI's order), the next one to the slot.
#[test]
fn an_earlier_posted_receive_matches_first() {
    testing::world(2, |c| {
        if c.rank() == 0 {
            let mut first = [0u8; 4];
            let mut second = [0u8; 4];
            c.scope(|s| {
                let r = c.irecv(s, &mut first, 1, 5).unwrap();
                go(c, 1);
                c.recv(&mut second, 1, 5).unwrap();
                r.wait().unwrap();
            });
            assert_eq!((first, second), ([1u8; 4], [2u8; 4]));
            assert_eq!(c.lean_receives(), (1, 0), "the second message only");
        } else {
            wait_go(c, 0);
            c.send(&[1u8; 4], 0, 5).unwrap();
            c.send(&[2u8; 4], 0, 5).unwrap();
        }
    });
}

/// A rendezvous message matches the slot: the receive becomes a request and completes as one.
#[test]
fn a_rendezvous_message_demotes_the_slot() {
    // Under Miri a 4 KiB message over a 64-byte eager limit: the same rendezvous, where a
    // mebibyte outlasted the test's timeout.
    let mut o = Options::default();
    let n = if cfg!(miri) {
        o.engine.eager_limit = Some(64);
        4096
    } else {
        1 << 20
    };
    testing::world_with(2, &o, |c| {
        if c.rank() == 0 {
            let mut buf = vec![0u8; n + 8];
            go(c, 1);
            let st = c.recv(&mut buf, 1, 5).unwrap();
            assert_eq!(st.bytes, n);
            assert!(buf[..n].iter().enumerate().all(|(i, &b)| b == i as u8));
            assert_eq!(&buf[n..], &[0u8; 8]);
            assert_eq!(c.lean_receives(), (0, 1), "demoted by the rendezvous");
        } else {
            let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
            wait_go(c, 0);
            c.send(&data, 0, 5).unwrap();
        }
    });
}

/// The peer a blocking receive waits for dies: the receive fails with the peer, as a request
/// does.
#[test]
fn a_failed_source_fails_the_slot() {
    use weft::bootstrap::InProcessJob;
    use weft_loopback::{Loopback, LoopbackConfig};
    let job = InProcessJob::new(2, Duration::from_secs(30));
    let engine = weft::EngineConfig {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                let (job, engine) = (job.clone(), engine.clone());
                s.spawn(move || {
                    let mut b = job.rank(r);
                    let p = Loopback::open_with(&mut b, &LoopbackConfig::default()).unwrap();
                    let w = weft::World::from_parts(p, Box::new(b), engine).unwrap();
                    if r == 0 {
                        let mut buf = [0u8; 8];
                        go(&w, 1);
                        let e = w.recv(&mut buf, 1, 5).unwrap_err();
                        assert_eq!(e.kind(), ErrorKind::PeerFailed, "{e}");
                        assert_eq!(w.lean_receives(), (0, 1), "demoted by the failure");
                    } else {
                        wait_go(&w, 0);
                        // Rank 1 disappears without finalizing.
                        drop(w);
                    }
                })
            })
            .collect();
        for r in ranks {
            r.join().unwrap();
        }
    });
}

/// A blocking receive whose wait times out is withdrawn: a message arriving later goes to the
/// unexpected queue, not into the buffer the caller has back.
#[test]
fn a_timed_out_slot_is_withdrawn() {
    let o = Options {
        timeout: Duration::from_millis(300),
        ..Options::default()
    };
    // Rank 1 waits outside weft (its own waits would time out too).
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (tx, rx) = (std::sync::Mutex::new(tx), std::sync::Mutex::new(rx));
    testing::world_with(2, &o, |c| {
        if c.rank() == 0 {
            let mut arena = [0u8; 16];
            let e = c.recv(&mut arena, 1, 5).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert_eq!(
                c.lean_receives(),
                (0, 0),
                "withdrawn, neither done nor demoted"
            );
            arena.fill(0xAB);
            tx.lock().unwrap().send(()).unwrap();
            // The late message is there to be received, and only when asked for.
            let mut other = [0u8; 16];
            c.recv(&mut other, 1, 5).unwrap();
            assert_eq!(other, [9u8; 16]);
            assert_eq!(arena, [0xABu8; 16], "a late write into a returned buffer");
        } else {
            rx.lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(60))
                .expect("rank 0 did not time out");
            c.send(&[9u8; 16], 0, 5).unwrap();
        }
    });
}

/// A one-rank provider that hands every active message back to its sender, and panics in
/// `progress` when told to (a provider's bug).
struct Echo {
    caps: weft::provider::Caps,
    held: Option<(Vec<u8>, Vec<u8>)>,
    panic_next: std::rc::Rc<std::cell::Cell<bool>>,
}

impl Provider for Echo {
    fn name(&self) -> &str {
        "echo"
    }
    fn caps(&self) -> &weft::provider::Caps {
        &self.caps
    }
    fn rank(&self) -> weft::Rank {
        0
    }
    fn size(&self) -> u32 {
        1
    }
    fn am_send(
        &mut self,
        _dest: weft::Rank,
        header: &[u8],
        payload: &[std::io::IoSlice<'_>],
    ) -> weft::Result<weft::provider::SendOutcome> {
        if self.held.is_some() {
            return Ok(weft::provider::SendOutcome::Busy);
        }
        let p = payload.iter().flat_map(|s| s.iter().copied()).collect();
        self.held = Some((header.to_vec(), p));
        Ok(weft::provider::SendOutcome::Sent)
    }
    fn progress(&mut self, sink: &mut dyn weft::provider::Sink) -> weft::Result<usize> {
        if self.panic_next.replace(false) {
            panic!("the provider's bug");
        }
        match self.held.take() {
            Some((h, p)) => {
                sink.am(0, &h, &p);
                Ok(1)
            }
            None => Ok(0),
        }
    }
}

/// A panic that unwinds out of a blocking receive (here the provider's) withdraws the slot:
/// a message arriving afterwards must not be written into the buffer the caller has back.
#[test]
fn a_panic_during_the_wait_withdraws_the_slot() {
    let job = weft::bootstrap::InProcessJob::new(1, Duration::from_secs(10));
    let panic_next = std::rc::Rc::new(std::cell::Cell::new(false));
    let p = Echo {
        caps: weft::provider::Caps::am_only(64, 128, 4),
        held: None,
        panic_next: panic_next.clone(),
    };
    let w =
        weft::World::from_parts(p, Box::new(job.rank(0)), weft::EngineConfig::default()).unwrap();
    let mut arena = [0u8; 16];
    panic_next.set(true);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        w.recv(&mut arena[..8], 0, 5)
    }));
    assert!(r.is_err(), "the provider's panic unwinds out of recv");
    arena.fill(0xAB);
    w.send(&[9u8; 8], 0, 5).unwrap();
    for _ in 0..4 {
        w.progress().unwrap();
    }
    assert_eq!(arena, [0xABu8; 16], "a late write into a returned buffer");
    let mut other = [0u8; 8];
    w.recv(&mut other, 0, 5).unwrap();
    assert_eq!(other, [9u8; 8]);
    assert_eq!(
        w.lean_receives(),
        (0, 0),
        "the message went to the unexpected queue"
    );
}

//! Steady-state messaging and RMA epochs do not allocate per message: after a warm-up,
//! ping-pongs (eager and rendezvous), a large message received only after it arrived
//! (unexpected), PSCW epochs under every scheduling policy and fence epochs
//! of 16 puts and 16 gets run on shm and tcp-sim with fewer heap allocations than rounds. (Each
//! allocation per epoch cost 5-20% of a small-message RMA ping-pong on shm.) A few are allowed:
//! a bucket or pool that first grows in the measured rounds, because arrival order differs from
//! the warm-up's; any allocation per message or per epoch would show up at least once per
//! round.
//!
//! One test in this binary, so that nothing else allocates while the counter is on.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use weft::{Assert, Comm, DynProvider, Sched, WinInfo};
use weft_shm as _;
use weft_tcp_sim as _;
use weft_testing as testing;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; we only count.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static A: Counting = Counting;

/// One round of everything measured: returns nothing, allocates nothing once warm.
fn round(c: &Comm<DynProvider>, small: &mut [u8], large: &mut [u8], wins: &[WinOps<'_, '_>]) {
    let peer = 1 - c.rank();
    // Eager and rendezvous ping-pong.
    for buf in [&mut *small, &mut *large] {
        if c.rank() == 0 {
            c.send(buf, peer, 1).unwrap();
            c.recv(buf, peer, 1).unwrap();
        } else {
            c.recv(buf, peer, 1).unwrap();
            c.send(buf, peer, 1).unwrap();
        }
    }
    // A large message that arrives before its receive is posted (staged, on providers that
    // speculate; an unexpected RTS on the others): the path a loaded machine takes at random,
    // here every round. (It allocated a staging buffer per message, seen only under load.)
    if c.rank() == 0 {
        c.send(large, peer, 2).unwrap();
    } else {
        c.probe(peer, 2).unwrap();
        c.recv(large, peer, 2).unwrap();
    }
    for w in wins {
        w.epochs(c);
    }
}

struct WinOps<'a, 'w> {
    win: &'a weft::Window<'w, DynProvider>,
}

impl WinOps<'_, '_> {
    fn epochs(&self, c: &Comm<DynProvider>) {
        let peer = 1 - c.rank();
        let src = [7u64; 4];
        let mut dst = [0u64; 4];
        // PSCW ping-pong with a put and a get.
        let access = |dst: &mut [u64; 4]| {
            self.win
                .start_epoch(&[peer], |e| {
                    e.put(&src, peer, 0)?;
                    e.get(dst, peer, 8)
                })
                .unwrap();
        };
        if c.rank() == 0 {
            access(&mut dst);
            self.win.post(&[peer]).unwrap();
            self.win.wait().unwrap();
        } else {
            self.win.post(&[peer]).unwrap();
            self.win.wait().unwrap();
            access(&mut dst);
        }
        // A fence epoch of 16 puts and 16 gets from rank 0.
        let mut gets = [[0u64; 4]; 16];
        self.win
            .fence_epoch(Assert::NONE, |e| {
                if c.rank() == 0 {
                    for k in 0..16 {
                        e.put(&src, peer, 16 + 4 * k)?;
                    }
                    for (k, g) in gets.iter_mut().enumerate() {
                        e.get(g, peer, 80 + 4 * k)?;
                    }
                }
                Ok(())
            })
            .unwrap();
    }
}

fn steady_state_allocations(provider: &str) -> Vec<u64> {
    testing::world_dyn(2, provider, |c| {
        let mut small = vec![1u8; 8];
        let mut large = vec![2u8; 256 << 10];
        let info = |s| WinInfo {
            accumulate_ops: None,
            sched: Some(s),
            agg_max: None,
        };
        let mut mems: Vec<Vec<u64>> = (0..4).map(|_| vec![0u64; 160]).collect();
        let [m0, m1, m2, m3] = &mut mems[..] else {
            unreachable!()
        };
        c.win_create(m0, info(Sched::Off), |w0| {
            c.win_create(m1, info(Sched::Reorder), |w1| {
                c.win_create(m2, info(Sched::Aggregate), |w2| {
                    c.win_create(m3, info(Sched::Full), |w3| {
                        let wins = [w0, w1, w2, w3].map(|win| WinOps { win });
                        Ok(counted_rounds(c, &mut small, &mut large, &wins))
                    })
                })
            })
        })
        .unwrap()
    })
}

fn counted_rounds(
    c: &Comm<DynProvider>,
    small: &mut [u8],
    large: &mut [u8],
    wins: &[WinOps<'_, '_>],
) -> u64 {
    for _ in 0..200 {
        round(c, small, large, wins);
    }
    c.barrier().unwrap();
    if c.rank() == 0 {
        ALLOCS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
    }
    c.barrier().unwrap();
    for _ in 0..ROUNDS {
        round(c, small, large, wins);
    }
    c.barrier().unwrap();
    let n = ALLOCS.load(Ordering::SeqCst);
    c.barrier().unwrap();
    if c.rank() == 0 {
        COUNTING.store(false, Ordering::SeqCst);
    }
    n
}

const ROUNDS: u64 = 100;

#[test]
fn steady_state_messaging_and_rma_do_not_allocate() {
    for provider in ["shm", "tcp-sim"] {
        let n = steady_state_allocations(provider);
        eprintln!("{provider}: {} allocations in {ROUNDS} warm rounds", n[0]);
        assert!(
            n[0] < ROUNDS / 2,
            "{provider}: {} heap allocations in {ROUNDS} warm rounds (both ranks): something \
             allocates per message or per epoch",
            n[0]
        );
    }
}

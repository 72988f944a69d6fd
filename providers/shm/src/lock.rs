//! The passive-target lock of a window in the shared pool: taken and released by the origins
//! themselves, with no help from the target process, and taken over from a holder that died.
//!
//! State: one exclusive word (0, or the holder's local index + 1) and one shared flag per local
//! rank (written only by that rank, or cleared by whoever finds it dead). A reader raises its
//! flag, then looks at the exclusive word; a writer claims the exclusive word, then looks at
//! every flag. A sequentially consistent fence between each side's store and load means one
//! of any two contenders sees the other (Dekker's argument) and backs off, so readers and a
//! writer never hold the lock together; releases and the loads that find the lock free pair
//! up as release/acquire, so each holder sees what the previous one wrote.
//! Because every part of the state names its owner, a dead holder's part is cleared by the
//! next contender instead of blocking everyone for good (the old single counter could not say
//! whose share it was). Model-checked with loom below.

use crate::sync::{fence, AtomicU64, AtomicU8, Ordering};

const SC: Ordering = Ordering::SeqCst;
const ACQ: Ordering = Ordering::Acquire;
const RLX: Ordering = Ordering::Relaxed;

/// The lock state of one window, wherever it lives (shared memory, or a loom model).
pub struct LockView<'a> {
    pub excl: &'a AtomicU64,
    pub flags: &'a [AtomicU8],
}

impl LockView<'_> {
    /// Try to take the lock for local rank `me`; `alive(i)` says whether local rank `i` still
    /// runs. `false`: held by someone else now (retry after progress).
    pub fn try_lock(&self, me: usize, exclusive: bool, alive: impl Fn(usize) -> bool) -> bool {
        let mine = me as u64 + 1;
        if exclusive {
            if let Err(h) = self.excl.compare_exchange(0, mine, ACQ, RLX) {
                self.reclaim_excl(h, &alive);
                return false;
            }
            fence(SC);
            for (i, f) in self.flags.iter().enumerate() {
                if i != me && f.load(ACQ) != 0 {
                    if !alive(i) {
                        // A dead reader's share: nobody else writes its flag any more.
                        f.store(0, RLX);
                        continue;
                    }
                    self.excl.store(0, Ordering::Release);
                    return false;
                }
            }
            true
        } else {
            self.flags[me].store(1, RLX);
            fence(SC);
            let h = self.excl.load(ACQ);
            if h == 0 {
                return true;
            }
            self.flags[me].store(0, Ordering::Release);
            self.reclaim_excl(h, &alive);
            false
        }
    }

    /// Release what `try_lock` gave `me`.
    pub fn unlock(&self, me: usize, exclusive: bool) {
        if exclusive {
            self.excl.store(0, Ordering::Release);
        } else {
            self.flags[me].store(0, Ordering::Release);
        }
    }

    /// The exclusive word names `h`: if that holder is dead, clear it (only if it still names
    /// the dead holder, so a new holder's claim is never undone).
    fn reclaim_excl(&self, h: u64, alive: &impl Fn(usize) -> bool) {
        if h != 0 && !alive(h as usize - 1) && self.excl.compare_exchange(h, 0, ACQ, RLX).is_ok() {
            tracing::warn!(holder = h - 1, "took over a window lock from a dead rank");
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;
    use loom::thread;

    struct Win {
        excl: AtomicU64,
        flags: [AtomicU8; 3],
        /// Touched only under the lock: loom reports a data race if two hold it wrongly.
        data: UnsafeCell<u64>,
        dead: [AtomicBool; 3],
    }

    impl Win {
        fn new() -> Arc<Win> {
            Arc::new(Win {
                excl: AtomicU64::new(0),
                flags: [AtomicU8::new(0), AtomicU8::new(0), AtomicU8::new(0)],
                data: UnsafeCell::new(0),
                dead: [
                    AtomicBool::new(false),
                    AtomicBool::new(false),
                    AtomicBool::new(false),
                ],
            })
        }
        fn view(&self) -> LockView<'_> {
            LockView {
                excl: &self.excl,
                flags: &self.flags,
            }
        }
        /// A few attempts, as the core's retry loop makes them (the protocol is a try-lock:
        /// contenders may all back off; the model checks what happens to those that get in).
        fn lock(&self, me: usize, excl: bool) -> bool {
            for _ in 0..3 {
                if self.view().try_lock(me, excl, |i| !self.dead[i].load(SC)) {
                    return true;
                }
                thread::yield_now();
            }
            false
        }
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(f);
    }

    /// Two writers and a reader: a writer's update is never lost or overlapped, and the
    /// reader never overlaps a writer (loom's cell checks flag any overlap as a race).
    #[test]
    fn writers_exclude_each_other_and_readers() {
        model(|| {
            let w = Win::new();
            let hs: Vec<_> = (0..2)
                .map(|me| {
                    let w = w.clone();
                    thread::spawn(move || {
                        let got = w.lock(me, true);
                        if got {
                            w.data.with_mut(|d| unsafe { *d += 1 });
                            w.view().unlock(me, true);
                        }
                        got as u64
                    })
                })
                .collect();
            let r = w.clone();
            let reader = thread::spawn(move || {
                if r.lock(2, false) {
                    r.data.with(|d| unsafe { *d });
                    r.view().unlock(2, false);
                }
            });
            let got: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
            reader.join().unwrap();
            assert_eq!(w.data.with(|d| unsafe { *d }), got);
        });
    }

    /// A writer dies holding the lock (it stops without unlocking, then is seen dead); two
    /// others race to take it over: one gets it (the dead holder blocks nobody for good) and
    /// they never hold it together.
    #[test]
    fn a_dead_writers_lock_is_taken_over() {
        model(|| {
            let w = Win::new();
            assert!(w.view().try_lock(0, true, |_| true));
            w.dead[0].store(true, SC);
            let hs: Vec<_> = (1..3)
                .map(|me| {
                    let w = w.clone();
                    thread::spawn(move || {
                        let got = w.lock(me, true);
                        if got {
                            w.data.with_mut(|d| unsafe { *d += 1 });
                            w.view().unlock(me, true);
                        }
                        got
                    })
                })
                .collect();
            let got: Vec<bool> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            assert!(
                got.iter().any(|g| *g),
                "nobody took over the dead writer's lock"
            );
        });
    }

    /// A reader dies holding its share; a writer still gets the lock.
    #[test]
    fn a_dead_readers_share_is_reclaimed() {
        model(|| {
            let w = Win::new();
            assert!(w.view().try_lock(0, false, |_| true));
            w.dead[0].store(true, SC);
            let o = w.clone();
            let writer = thread::spawn(move || {
                if o.lock(1, true) {
                    o.view().unlock(1, true);
                }
            });
            let r = w.clone();
            let reader = thread::spawn(move || {
                if r.lock(2, false) {
                    r.view().unlock(2, false);
                }
            });
            reader.join().unwrap();
            writer.join().unwrap();
            // Once the live ones are done, the dead reader's share blocks no writer.
            assert!(w.lock(1, true), "a dead reader's share kept a writer out");
        });
    }
}

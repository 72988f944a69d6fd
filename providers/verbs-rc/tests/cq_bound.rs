//! More RMA requests than the completion queue could hold, all posted at once towards one peer
//! whose send queue is deep enough to take them (`WEFT_VERBS_RC_SQ`): the provider keeps the
//! excess queued, so the CQ never overruns and every request completes. (Its own test binary:
//! it sets an environment variable.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::{
    Access, Completed, Completion, Provider, RawIov, RemoteAddr, Sink, StaticProvider, Token,
};
use weft_provider::{Rank, Result};
use weft_verbs_rc::VerbsRc;

#[derive(Default)]
struct Done(Vec<(Token, bool)>);

impl Sink for Done {
    fn am(&mut self, _: Rank, _: &[u8], _: &[u8]) {}
    fn complete(&mut self, token: Token, result: Result<Completed>) {
        self.0.push((token, result.is_ok()));
    }
    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        panic!("rank {rank} failed: {reason}");
    }
}

#[test]
fn more_requests_than_the_cq_holds_all_complete() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    std::env::set_var("WEFT_VERBS_RC_SQ", "16384");
    const N: u64 = 12000;
    let t = Duration::from_secs(60);
    let job = InProcessJob::new(2, t);
    let region: Arc<Mutex<Option<(u64, u64)>>> = Arc::default();
    let finished = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let (job, region, finished) = (job.clone(), region.clone(), finished.clone());
            std::thread::spawn(move || {
                let mut p = VerbsRc::open(&mut job.rank(r)).unwrap();
                let mut done = Done::default();
                let mut mem = vec![0u8; 8 * N as usize];
                let t0 = Instant::now();
                if r == 1 {
                    // SAFETY: `mem` outlives the registration.
                    let mr = unsafe { p.mr_register(mem.as_mut_ptr(), mem.len(), Access::WRITE) }
                        .unwrap();
                    *region.lock().unwrap() = Some((mr.addr, mr.key));
                    while !finished.load(Ordering::Acquire) {
                        p.progress(&mut done).unwrap();
                        assert!(t0.elapsed() < t, "target timed out");
                    }
                    p.mr_deregister(&mr).unwrap();
                    assert!(mem
                        .chunks(8)
                        .enumerate()
                        .all(|(i, c)| c == (i as u64).to_le_bytes()));
                    return;
                }
                let (addr, key) = loop {
                    if let Some(x) = *region.lock().unwrap() {
                        break x;
                    }
                    assert!(t0.elapsed() < t, "no region published");
                };
                let src: Vec<u64> = (0..N).collect();
                // SAFETY: `src` lives until every completion arrived.
                let lmr = unsafe {
                    p.mr_register(src.as_ptr() as *mut u8, 8 * N as usize, Access::LOCAL)
                }
                .unwrap();
                for i in 0..N {
                    let iov = [RawIov {
                        ptr: src[i as usize..].as_ptr() as *const u8,
                        len: 8,
                        desc: lmr.desc,
                    }];
                    let at = RemoteAddr {
                        addr: addr + 8 * i,
                        key,
                    };
                    // SAFETY: as above.
                    unsafe { p.rma_write(1, &iov, at, Completion::cq(i)) }.unwrap();
                }
                while done.0.len() < N as usize {
                    p.progress(&mut done).unwrap();
                    assert!(t0.elapsed() < t, "{} of {N} completed", done.0.len());
                }
                assert!(done.0.iter().all(|(_, ok)| *ok));
                finished.store(true, Ordering::Release);
                p.mr_deregister(&lmr).unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

//! The notifier thread of a context: completion-channel events of armed CQs and SRQ limit events.

use crate::*;
use std::time::{Duration, Instant};

/// The notifier: raises completion events of armed CQs and SRQ limit events, and drives the
/// context's requests while anything is armed.
pub(crate) fn notify_loop(sh: &Shared) {
    // Sleeps of 20 µs, not the default 50 µs of timer slack more (an event's latency).
    // SAFETY: PR_SET_TIMERSLACK takes a number and affects this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let mut st = lock(&sh.st);
    // Rounds since a CQ was armed or fired: the first ones only yield (an event-driven program
    // is blocked in ibv_get_cq_event meanwhile, so the core is free), then growing sleeps.
    let (mut quiet, mut was_armed) = (0u32, 0usize);
    let mut checked = Instant::now();
    loop {
        if st.stop {
            return;
        }
        let mut raised = 0u64;
        if !st.qps.is_empty() && checked.elapsed() >= QP_CHECK {
            raised += watch_qps(sh, &mut st);
            checked = Instant::now();
        }
        if st.armed.is_empty() && st.srqs.is_empty() {
            if raised > 0 {
                bump(sh.async_fd, raised);
            }
            let idle = if st.qps.is_empty() {
                Duration::from_millis(200)
            } else {
                QP_IDLE_CHECK
            };
            st = sh
                .cv
                .wait_timeout(st, idle)
                .map(|r| r.0)
                .unwrap_or_else(|p| p.into_inner().0);
            continue;
        }
        if st.armed.len() > was_armed {
            quiet = 0;
        }
        let mut fired: SmallVec<[(usize, usize); 4]> = SmallVec::new();
        st.armed.retain(|&(cq, h, ch)| {
            let ready = sh.hca.cq_ready(h);
            if ready {
                fired.push((cq, ch));
            }
            !ready
        });
        let mut srqs = std::mem::take(&mut st.srqs);
        srqs.retain(|&(s, h)| {
            if sh.hca.srq_limit_reached(h).unwrap_or(false) {
                st.events.push_back((s, EVENT_SRQ_LIMIT_REACHED));
                raised += 1;
                false
            } else {
                true
            }
        });
        st.srqs = srqs;
        // Still under the watch lock, which ibv_destroy_cq and ibv_destroy_comp_channel take
        // too: neither the CQ nor its channel can go away before its event is queued (and a
        // queued event is taken back by ibv_destroy_cq).
        let fired_any = !fired.is_empty();
        for (cq, ch) in fired {
            // SAFETY: a channel outlives the CQs that name it (ibv_destroy_comp_channel refuses
            // while any does), and an armed CQ is unarmed, under this lock, before it is
            // destroyed.
            let chan = unsafe { &*(ch as *const Chan) };
            lock(&chan.q).push_back(cq);
            bump(chan.ch.fd, 1);
        }
        was_armed = st.armed.len();
        drop(st);
        if raised > 0 {
            bump(sh.async_fd, raised);
        }
        sh.hca.progress();
        if fired_any {
            quiet = 0;
        }
        quiet = quiet.saturating_add(1);
        match pause(quiet) {
            None => std::thread::yield_now(),
            Some(d) => std::thread::sleep(d),
        }
        st = lock(&sh.st);
    }
}

/// How often, at most, the notifier looks at the QPs' states while CQs are armed.
const QP_CHECK: Duration = Duration::from_millis(1);
/// How often it looks at them while nothing is armed: the latency of a QP's error events then.
const QP_IDLE_CHECK: Duration = Duration::from_millis(20);

/// Look for QPs that entered the error state since they were last told; raise their events.
/// Returns how many were queued (the caller bumps the async fd).
fn watch_qps(sh: &Shared, st: &mut Watch) -> u64 {
    let mut raised = 0;
    for i in 0..st.qps.len() {
        let w = st.qps[i];
        if !w.told && matches!(sh.hca.qp_watch(w.h), Some((QpState::Err, _))) {
            raised += tell(sh, st, i);
        }
    }
    raised
}

/// QP `st.qps[i]` is in the error state: queue its events, once per error state, as a
/// hardware HCA raises them — the fault's own event when a peer's request it refused put it
/// there (`IBV_EVENT_QP_ACCESS_ERR` for a key, range or rights violation,
/// `IBV_EVENT_QP_REQ_ERR` for an invalid request, `IBV_EVENT_QP_FATAL` otherwise), and
/// `IBV_EVENT_QP_LAST_WQE_REACHED` for a QP of an SRQ (it takes no more receives from it).
/// Returns how many were queued.
pub(crate) fn tell(sh: &Shared, st: &mut Watch, i: usize) -> u64 {
    let w = st.qps[i];
    if w.told {
        return 0;
    }
    st.qps[i].told = true;
    let mut n = 0;
    if let Some((_, Some(why))) = sh.hca.qp_watch(w.h) {
        let t = match why {
            WcStatus::RemAccessErr => EVENT_QP_ACCESS_ERR,
            WcStatus::RemInvReqErr => EVENT_QP_REQ_ERR,
            _ => EVENT_QP_FATAL,
        };
        st.events.push_back((w.qp, t));
        n += 1;
    }
    if w.srq {
        st.events.push_back((w.qp, EVENT_QP_LAST_WQE_REACHED));
        n += 1;
    }
    n
}

/// Notifier rounds that only yield after a CQ was armed or an event raised (about 100 µs).
pub(crate) const SPIN_ROUNDS: u32 = 200;

/// Rounds at each sleep length before the next doubling.
const ROUNDS_PER_STEP: u32 = 256;

/// The pause after `quiet` rounds without an event: none (a yield) for the first
/// `SPIN_ROUNDS`, then sleeps of 20 µs doubling every `ROUNDS_PER_STEP` rounds up to 1.28 ms
/// (after about 0.3 s of quiet). A CQ that stays armed and idle (UCX's ud_verbs arms its CQs
/// for its own timers and may see nothing for seconds) then costs a wake-up per millisecond,
/// not one per 20 µs: that was a quarter of a core here, taken from programs that poll.
pub(crate) fn pause(quiet: u32) -> Option<std::time::Duration> {
    let past = quiet.checked_sub(SPIN_ROUNDS)?;
    let step = (past / ROUNDS_PER_STEP).min(6);
    Some(std::time::Duration::from_micros(20 << step))
}

pub(crate) fn bump(fd: c_int, n: u64) {
    if n == 0 {
        return;
    }
    // SAFETY: writing 8 bytes from a local to an eventfd we own.
    unsafe { libc::write(fd, &n as *const u64 as *const c_void, 8) };
}

/// Take one count of a semaphore eventfd (blocking unless the program made it non-blocking).
pub(crate) fn take(fd: c_int) -> bool {
    let mut v = 0u64;
    // SAFETY: reading 8 bytes into a local.
    unsafe { libc::read(fd, &mut v as *mut u64 as *mut c_void, 8) == 8 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_pause_grows_from_a_yield_to_a_millisecond_and_stops_there() {
        assert_eq!(pause(0), None);
        assert_eq!(pause(SPIN_ROUNDS - 1), None);
        assert_eq!(pause(SPIN_ROUNDS), Some(Duration::from_micros(20)));
        assert_eq!(
            pause(SPIN_ROUNDS + ROUNDS_PER_STEP),
            Some(Duration::from_micros(40))
        );
        assert_eq!(pause(u32::MAX), Some(Duration::from_micros(1280)));
    }

    /// CPU time (utime + stime, in clock ticks) of this process's thread named `name`.
    fn thread_ticks(name: &str) -> u64 {
        let mut t = 0;
        for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            if comm.trim() != name {
                continue;
            }
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            // After the command's closing parenthesis: utime and stime are the 12th and 13th.
            let rest = stat.rsplit_once(')').map_or("", |r| r.1);
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|w| w.parse().unwrap_or(0))
                .collect();
            t += f.get(11).unwrap_or(&0) + f.get(12).unwrap_or(&0);
        }
        t
    }

    /// A CQ armed and then left idle (UCX's ud_verbs does this) must not cost the notifier a
    /// busy core: with a fixed 20 µs sleep it took a quarter of one (seen failing).
    #[test]
    fn an_armed_idle_cq_costs_the_notifier_little_cpu() {
        let hca = SoftHca::open_shared().unwrap();
        let cq = hca.create_cq(16).unwrap();
        // SAFETY: plain eventfd creation; closed below.
        let afd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(afd >= 0);
        let sh = Arc::new(Shared {
            hca,
            // The CQ never completes anything, so its CqBox and channel (never looked at
            // until it fires) need not exist.
            st: Mutex::new(Watch {
                armed: vec![(1, cq, 0)],
                ..Watch::default()
            }),
            cv: Condvar::new(),
            acked: Condvar::new(),
            async_fd: afd,
        });
        let w = sh.clone();
        let name = "weft-ntf-test"; // at most 15 bytes: the kernel truncates comm
        let t = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || notify_loop(&w))
            .unwrap();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let (t0, w0) = (thread_ticks(name), std::time::Instant::now());
        // The quiet interval being measured (no peer to wait for).
        std::thread::sleep(Duration::from_secs(2));
        let cpu = (thread_ticks(name) - t0) as f64 / hz;
        let wall = w0.elapsed().as_secs_f64();
        lock(&sh.st).stop = true;
        sh.cv.notify_all();
        t.join().unwrap();
        // SAFETY: our eventfd, closed once.
        unsafe { libc::close(afd) };
        assert!(
            cpu < 0.08 * wall,
            "the notifier of an idle armed CQ used {cpu:.3} s of CPU in {wall:.3} s"
        );
    }
}

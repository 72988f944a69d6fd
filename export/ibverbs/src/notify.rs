//! The notifier thread of a context: completion-channel events of armed CQs and SRQ limit events.

use crate::*;

/// The notifier: raises completion events of armed CQs and SRQ limit events, and drives the
/// context's requests while anything is armed.
pub(crate) fn notify_loop(sh: &Shared) {
    // Sleeps of 20 µs, not the default 50 µs of timer slack more (an event's latency).
    // SAFETY: PR_SET_TIMERSLACK takes a number and affects this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let mut st = lock(&sh.st);
    // Rounds since a CQ was armed or fired: the first ones only yield (an event-driven program
    // is blocked in ibv_get_cq_event meanwhile, so the core is free), then 20 µs sleeps.
    let (mut quiet, mut was_armed) = (0u32, 0usize);
    loop {
        if st.stop {
            return;
        }
        if st.armed.is_empty() && st.srqs.is_empty() {
            st = sh
                .cv
                .wait_timeout(st, std::time::Duration::from_millis(200))
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
        let mut raised = 0u64;
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
        if quiet < SPIN_ROUNDS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        st = lock(&sh.st);
    }
}

/// Notifier rounds that only yield after a CQ was armed or an event raised (about 100 µs).
pub(crate) const SPIN_ROUNDS: u32 = 200;

pub(crate) fn bump(fd: c_int, n: u64) {
    // SAFETY: writing 8 bytes from a local to an eventfd we own.
    unsafe { libc::write(fd, &n as *const u64 as *const c_void, 8) };
}

/// Take one count of a semaphore eventfd (blocking unless the program made it non-blocking).
pub(crate) fn take(fd: c_int) -> bool {
    let mut v = 0u64;
    // SAFETY: reading 8 bytes into a local.
    unsafe { libc::read(fd, &mut v as *mut u64 as *mut c_void, 8) == 8 }
}

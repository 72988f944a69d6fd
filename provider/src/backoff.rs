//! Pausing between the empty rounds of a wait loop: the core's waits and a provider's own
//! (a close that lingers for acknowledgements, a lock held by another process).
//!
//! A loop that only spins keeps its CPU for as long as it waits; on a host with more ranks
//! than CPUs that CPU is what the peer it waits for needs to answer, and a kernel without
//! preemption may not take it away for a long time (docs/providers.md, the verbs-ud stall).
//! [`Backoff::round`] yields after an empty round, and once it has yielded for
//! [`Backoff::YIELD_FOR`] without anything happening sleeps [`Backoff::NAP`] per round
//! instead, as the core's waits do on an oversubscribed host.

use std::time::{Duration, Instant};

/// The pause between empty rounds of a wait loop (see the module). The core's waits use it
/// through [`Backoff::idle_round`] with their own threshold (`WEFT_POLL_SLEEP`), a provider's
/// own loops through [`Backoff::round`].
#[derive(Debug, Default)]
pub struct Backoff {
    /// When the clock started: at the first look, on the 64th empty round.
    since: Option<Instant>,
    napping: bool,
    /// Empty rounds so far, for [`Backoff::round`].
    rounds: u32,
}

impl Backoff {
    /// [`Backoff::round`]'s threshold: empty rounds only yield for this long.
    pub const YIELD_FOR: Duration = Duration::from_millis(1);
    /// Then each empty round sleeps this long.
    pub const NAP: Duration = Duration::from_micros(100);

    pub fn new() -> Backoff {
        Backoff::default()
    }

    /// Something happened: the next empty round starts a new run of yields.
    pub fn reset(&mut self) {
        *self = Backoff::default();
    }

    /// Empty round `k` (from 1) of a wait: yield, or, once it has yielded for `sleep_after`
    /// (`None`: never), sleep [`Backoff::NAP`]. The clock is read on every 64th round only.
    #[inline]
    pub fn idle_round(&mut self, sleep_after: Option<Duration>, k: u32) {
        if self.napping {
            std::thread::sleep(Self::NAP);
            return;
        }
        std::thread::yield_now();
        if let (Some(after), 0) = (sleep_after, k % 64) {
            let t0 = *self.since.get_or_insert_with(Instant::now);
            self.napping = t0.elapsed() >= after;
        }
    }

    /// After a round of a provider's own wait loop: `progressed` if it did something (then
    /// nothing pauses), else an empty round with the threshold [`Backoff::YIELD_FOR`].
    pub fn round(&mut self, progressed: bool) {
        if progressed {
            self.reset();
            return;
        }
        self.rounds = self.rounds.wrapping_add(1);
        self.idle_round(Some(Self::YIELD_FOR), self.rounds);
    }

    /// Whether the current run of empty rounds has reached its sleeping phase.
    pub fn napping(&self) -> bool {
        self.napping
    }

    /// Whether the clock of the current run has started (its first look was taken).
    pub fn clock_started(&self) -> bool {
        self.since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_naps_once_it_has_yielded_for_sleep_after_and_not_before() {
        // Without a limit it never naps.
        let mut n = Backoff::default();
        for k in 1..=1000 {
            n.idle_round(None, k);
        }
        assert!(!n.napping());
        // With one, the clock starts at the 64th yield and napping begins at the first look
        // (every 64th) after `sleep_after` has passed.
        let mut n = Backoff::default();
        for k in 1..64 {
            n.idle_round(Some(Duration::ZERO), k);
            assert!(!n.napping(), "round {k}");
        }
        n.idle_round(Some(Duration::ZERO), 64);
        assert!(n.napping());
        let mut n = Backoff::default();
        for k in 1..=640 {
            n.idle_round(Some(Duration::from_secs(3600)), k);
        }
        assert!(!n.napping() && n.clock_started());
    }

    #[test]
    fn empty_rounds_yield_then_nap_and_progress_starts_over() {
        let mut b = Backoff::new();
        assert!(!b.napping(), "no empty round yet");
        // (Whether the next rounds still only yield depends on how long the scheduler keeps
        // this thread off its CPU at each yield, so it is not asserted.)
        b.round(false);
        let t0 = Instant::now();
        while !b.napping() {
            b.round(false);
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "never reached its naps"
            );
        }
        // A napping round sleeps at least NAP.
        let t = Instant::now();
        b.round(false);
        assert!(t.elapsed() >= Backoff::NAP);
        b.round(true);
        assert!(!b.napping(), "progress starts a new run of yields");
    }
}

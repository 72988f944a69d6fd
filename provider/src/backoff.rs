//! Pausing between the empty rounds of a provider's own wait loops (a close that lingers for
//! acknowledgements, say), outside the core's waits.
//!
//! A loop that only spins keeps its CPU for as long as it waits; on a host with more ranks
//! than CPUs that CPU is what the peer it waits for needs to answer, and a kernel without
//! preemption may not take it away for a long time (docs/providers.md, the verbs-ud stall).
//! [`Backoff::pause`] yields after an empty round, and once it has yielded for
//! [`Backoff::YIELD_FOR`] without anything happening sleeps [`Backoff::NAP`] per round
//! instead, as the core's waits do on an oversubscribed host.

use std::time::{Duration, Instant};

/// The pause between empty rounds of a wait loop (see the module).
#[derive(Debug, Default)]
pub struct Backoff {
    /// When the current run of empty rounds started.
    since: Option<Instant>,
}

impl Backoff {
    /// Empty rounds only yield for this long.
    pub const YIELD_FOR: Duration = Duration::from_millis(1);
    /// Then each empty round sleeps this long.
    pub const NAP: Duration = Duration::from_micros(100);

    pub fn new() -> Backoff {
        Backoff::default()
    }

    /// Something happened: the next empty round starts a new run of yields.
    pub fn reset(&mut self) {
        self.since = None;
    }

    /// After a round of the loop: `progressed` if it did something (then nothing pauses).
    pub fn round(&mut self, progressed: bool) {
        if progressed {
            self.reset();
            return;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() < Self::YIELD_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Self::NAP);
        }
    }

    /// Whether the current run of empty rounds has reached its sleeping phase.
    pub fn napping(&self) -> bool {
        self.since.is_some_and(|s| s.elapsed() >= Self::YIELD_FOR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

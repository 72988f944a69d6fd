//! The simulated network: per-peer departure times from the configured latency and
//! bandwidth, so frames leave when a link of that speed would let them.

use super::*;

pub(crate) struct Sim {
    pub(crate) delay: Duration,
    pub(crate) jitter: Duration,
    pub(crate) rate: Option<f64>,
    /// Frames wait in the connection's queue until their arrival time: this many bytes of them
    /// may be "on the wire" on top of `WEFT_TCP_SIM_QUEUE` (the bandwidth-delay product), as a
    /// real connection keeps its window in flight. Without it a 100 µs delay lets one or two
    /// frames through per delay; with much more, frames are copied long before they are
    /// written and have left the cache (both measured slower).
    pub(crate) in_flight: usize,
    pub(crate) nic_free: Instant,
    pub(crate) rng: weft_proto::sim::Rng,
}

impl Sim {
    pub(crate) fn due(&mut self, peer: &mut Peer, bytes: usize) -> Instant {
        let now = Instant::now();
        let mut depart = now;
        if let Some(r) = self.rate {
            depart = self.nic_free.max(now);
            self.nic_free = depart + Duration::from_secs_f64(bytes as f64 / r);
            depart = self.nic_free;
        }
        let mut due = depart + self.delay;
        if !self.jitter.is_zero() {
            due += Duration::from_nanos(self.rng.below(self.jitter.as_nanos() as u64 + 1));
        }
        if let Some(l) = peer.last_due {
            due = due.max(l);
        }
        peer.last_due = Some(due);
        due
    }
}

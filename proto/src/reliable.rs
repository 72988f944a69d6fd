// Over 800 lines: its unit tests, below the code (which is under 800), test it through its private state.
//! A reliability and reordering engine for one peer over an unreliable datagram channel,
//! written sans-IO: it never sends, receives or reads a clock. The caller feeds it arrivals
//! ([`Link::on_packet`]) and the time ([`Link::on_timeout`]), and takes from it what to send
//! ([`Link::poll_transmit`]), what to deliver in order ([`Link::poll_deliver`]), which sent
//! packets the peer has acknowledged ([`Link::poll_acked`], so their buffers can be reused) and
//! when to call again ([`Link::next_timeout`]). The verbs-ud provider drives one
//! `Link` per peer over a UD QP (and so hybrid, through the verbs-ud it composes); nothing here
//! knows about verbs, so any unreliable channel can.
//!
//! # Protocol
//! - Every data packet carries a 32-bit packet sequence number (PSN, wrapping) and every
//!   packet, data or not, the cumulative acknowledgement: the next PSN its sender expects.
//! - **Send window**: at most [`Config::window`] data packets are unacknowledged; `send` refuses
//!   more (the caller queues them).
//! - **Receive side**: packets within the window ahead of the next expected PSN are kept
//!   until the gap before them fills, then delivered in order; a packet already delivered or
//!   kept is a duplicate and dropped; one beyond the window is dropped (the sender cannot have
//!   sent it unless it is broken).
//! - **Acknowledgements** ride on every data packet going back. Without data to carry them, a
//!   pure acknowledgement goes once a quarter of the window is unacknowledged (MVAPICH's
//!   explicit ACK at window/4), after [`Config::ack_delay`] at most, and at once when a packet
//!   arrives out of order or twice (the sender learns of the gap or of its lost acknowledgement
//!   without waiting for its timer).
//! - **Retransmission**: the oldest unacknowledged packet is sent again when its timer runs
//!   out. The timeout follows the measured round trip (RFC 6298's smoothed estimate plus four
//!   deviations, plus the peer's acknowledgement delay, at least [`Config::rto_min`]; samples
//!   only from packets sent once, Karn's rule), [`Config::rto`] until there is one, doubling
//!   per retry up to [`Config::rto_max`] (MVAPICH and UCX use fixed ticks of 0.5 s and 10 ms;
//!   a measured timeout recovers a lost tail in about a millisecond instead), on the third pure acknowledgement that does not move (a gap at the
//!   peer: fast retransmit), and, while recovering, whenever an acknowledgement moves but not
//!   past everything sent (the next hole: NewReno's partial acknowledgement), so a window with
//!   several losses does not wait a timeout per loss.
//! - **Failure**: a peer that has not been heard from for [`Config::peer_timeout`] while data
//!   to it is unacknowledged is failed ([`Link::failed`]); an idle link never fails (the caller
//!   probes idle peers if it must know).
//!
//! Sequence arithmetic is modulo 2^32; the window must be far smaller (it is at most 2^16).

use std::collections::VecDeque;
use std::time::Duration;

/// The engine's clock: `quanta`'s, which reads the CPU's time-stamp counter where it is
/// invariant (9.5 ns a read on the reference VM, against 22 ns for `std::time::Instant`'s
/// `clock_gettime`) and the OS clock elsewhere. Every packet sent and every arrival reads
/// it, so it is on the small-message path.
pub use quanta::Instant;

/// The clock's time now. Read through a clock of the engine's own rather than
/// `quanta::Instant::now`, which looks at a thread-local override first: thread-locals are
/// gone while a process exits, and a provider may still be driven then (libfabric closes its
/// providers from an exit handler, after the main thread's thread-locals are destroyed).
#[inline]
pub fn now() -> Instant {
    static CLOCK: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new).now()
}

/// Tunables of a [`Link`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    /// Data packets in flight (unacknowledged) at most; also how far ahead of the next
    /// expected packet the receiver keeps arrivals. 1 to 65536.
    pub window: u32,
    /// Retransmission timeout before the round trip has been measured.
    pub rto: Duration,
    /// Shortest retransmission timeout, however short the measured round trip.
    pub rto_min: Duration,
    /// Longest retransmission timeout (the backoff stops there).
    pub rto_max: Duration,
    /// Longest a received packet waits for its acknowledgement.
    pub ack_delay: Duration,
    /// Silence from a peer that owes acknowledgements after which it is failed.
    pub peer_timeout: Duration,
}

impl Default for Config {
    /// UD defaults for one host or a cluster: a 256-packet window; 10 ms timeout until the
    /// round trip is measured (UCX's tick), then the measured one, at least 200 µs (a loss
    /// on one host or one switch waits no longer than that; a 1 ms floor cost bandwidth
    /// under loss: docs/history/benchmarks-notebook.md, "Measurements behind code
    /// decisions"), backing off to 1 s; acknowledgements within 100 µs; 30 s of silence
    /// (UCX ud).
    fn default() -> Config {
        Config {
            window: 256,
            rto: Duration::from_millis(10),
            rto_min: Duration::from_micros(200),
            rto_max: Duration::from_secs(1),
            ack_delay: Duration::from_micros(100),
            peer_timeout: Duration::from_secs(30),
        }
    }
}

/// The engine's fields of a packet header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// PSN of a data packet; `None` for a pure acknowledgement.
    pub psn: Option<u32>,
    /// Cumulative acknowledgement: every PSN before this one has arrived.
    pub ack: u32,
}

/// A packet to send now: the header, and the payload of a data packet (given to
/// [`Link::send`]; the same one again for a retransmission).
#[derive(Debug)]
pub struct Transmit<'a, S> {
    pub header: Header,
    pub payload: Option<&'a S>,
    /// A retransmission (for counters).
    pub resent: bool,
}

/// What became of an arriving data packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Next in order: delivered, with any kept packets it unblocked (their count, itself
    /// included).
    Delivered(u32),
    /// Ahead of a gap: kept until the gap fills.
    Kept,
    /// Already delivered or kept: dropped.
    Duplicate,
    /// Beyond the receive window: dropped.
    OutOfWindow,
    /// A pure acknowledgement (no data).
    AckOnly,
}

struct Unacked<S> {
    payload: S,
    /// When it was last sent; `None`: waiting for its first transmission.
    sent: Option<Instant>,
    /// Queued for sending again.
    resend: bool,
    /// Sent more than once: no round-trip sample from its acknowledgement.
    again: bool,
}

/// Counters of one link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub sent: u64,
    pub resent: u64,
    pub timeouts: u64,
    pub fast_resends: u64,
    pub pure_acks: u64,
    pub duplicates: u64,
    pub out_of_window: u64,
    pub kept: u64,
}

/// The reliable, ordered channel to one peer. `S` is what the caller sends (a buffer or a
/// handle to one: given back by `poll_transmit` for each (re)transmission and by `poll_acked`
/// once acknowledged), `R` what it receives (held while out of order, then delivered).
pub struct Link<S, R> {
    cfg: Config,
    // ---- sending
    /// PSN of `unacked[0]` (the oldest unacknowledged).
    send_base: u32,
    unacked: VecDeque<Unacked<S>>,
    /// Index into `unacked` of the next packet never transmitted.
    next_new: usize,
    acked: VecDeque<S>,
    rto: Duration,
    /// Smoothed round trip and its deviation, once measured.
    srtt: Option<(Duration, Duration)>,
    /// Same-valued pure acknowledgements in a row (fast retransmit on the third).
    dup_acks: u32,
    /// Recovering losses up to (not including) this PSN: partial acknowledgements resend.
    recover: Option<u32>,
    // ---- receiving
    /// Next PSN to deliver; what our acknowledgements say.
    expected: u32,
    /// Packets that arrived ahead of `expected`: slot `i` is PSN `expected + i` (slot 0 is
    /// always empty: that packet would have been delivered).
    early: VecDeque<Option<R>>,
    deliver: VecDeque<R>,
    /// Packets delivered or kept since our last acknowledgement went out, and since when.
    ack_pending: u32,
    ack_since: Option<Instant>,
    /// An acknowledgement must go at once (a gap or a duplicate was seen).
    ack_now: bool,
    // ---- liveness
    heard: Instant,
    failed: bool,
    stats: Stats,
}

#[inline]
fn diff(a: u32, b: u32) -> i64 {
    a.wrapping_sub(b) as i32 as i64
}

impl<S, R> Link<S, R> {
    /// A link whose first data packet in each direction carries `our_psn` (sending) and
    /// `their_psn` (receiving): both sides must agree on them.
    pub fn new(cfg: Config, now: Instant, our_psn: u32, their_psn: u32) -> Link<S, R> {
        let mut cfg = cfg;
        cfg.window = cfg.window.clamp(1, 1 << 16);
        Link {
            cfg,
            send_base: our_psn,
            unacked: VecDeque::new(),
            next_new: 0,
            acked: VecDeque::new(),
            rto: cfg.rto,
            srtt: None,
            dup_acks: 0,
            recover: None,
            expected: their_psn,
            early: VecDeque::new(),
            deliver: VecDeque::new(),
            ack_pending: 0,
            ack_since: None,
            ack_now: false,
            heard: now,
            failed: false,
            stats: Stats::default(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Heap bytes the link holds beyond its own size: its queues' storage, and what `held`
    /// says each received packet it holds owns.
    pub fn heap_bytes(&self, held: impl Fn(&R) -> usize) -> usize {
        self.unacked.capacity() * std::mem::size_of::<Unacked<S>>()
            + self.acked.capacity() * std::mem::size_of::<S>()
            + self.early.capacity() * std::mem::size_of::<Option<R>>()
            + self.deliver.capacity() * std::mem::size_of::<R>()
            + self
                .early
                .iter()
                .flatten()
                .chain(&self.deliver)
                .map(held)
                .sum::<usize>()
    }

    /// The peer owed acknowledgements and stayed silent for `peer_timeout`.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Data packets sent (or queued) and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.unacked.len()
    }

    /// Packets `send` takes now.
    pub fn room(&self) -> usize {
        if self.failed {
            return 0;
        }
        (self.cfg.window as usize).saturating_sub(self.unacked.len())
    }

    /// Room in the send window for another packet.
    pub fn can_send(&self) -> bool {
        !self.failed && (self.unacked.len() as u64) < self.cfg.window as u64
    }

    /// Queue a data packet; it goes out through `poll_transmit`. `Err(payload)` when the send
    /// window is full or the link failed.
    pub fn send(&mut self, payload: S) -> Result<u32, S> {
        if !self.can_send() {
            return Err(payload);
        }
        let psn = self.send_base.wrapping_add(self.unacked.len() as u32);
        self.unacked.push_back(Unacked {
            payload,
            sent: None,
            resend: false,
            again: false,
        });
        Ok(psn)
    }

    /// Whether packets of the peer's have been delivered or kept that no acknowledgement has
    /// covered yet (a delayed acknowledgement is pending).
    pub fn owes_ack(&self) -> bool {
        self.ack_now || self.ack_pending > 0
    }

    /// Make a pending acknowledgement due at once instead of after the delay (a closing
    /// endpoint: nothing later would send it).
    pub fn ack_at_once(&mut self) {
        if self.ack_pending > 0 {
            self.ack_now = true;
        }
    }

    /// The next packet to send: retransmissions first, then new data, then a pure
    /// acknowledgement if one is due. Every packet carries the current acknowledgement.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit<'_, S>> {
        if self.failed {
            return None;
        }
        let ack = self.expected;
        let pick = match self.unacked.iter().position(|u| u.resend) {
            Some(i) => Some((i, true)),
            None => (self.next_new < self.unacked.len()).then_some((self.next_new, false)),
        };
        if let Some((i, resent)) = pick {
            self.ack_sent();
            let u = &mut self.unacked[i];
            u.resend = false;
            u.again |= resent;
            u.sent = Some(now);
            if resent {
                self.stats.resent += 1;
            } else {
                self.next_new += 1;
                self.stats.sent += 1;
            }
            let psn = self.send_base.wrapping_add(i as u32);
            return Some(Transmit {
                header: Header {
                    psn: Some(psn),
                    ack,
                },
                payload: Some(&self.unacked[i].payload),
                resent,
            });
        }
        if self.ack_due(now) {
            self.ack_sent();
            self.stats.pure_acks += 1;
            return Some(Transmit {
                header: Header { psn: None, ack },
                payload: None,
                resent: false,
            });
        }
        None
    }

    fn ack_sent(&mut self) {
        self.ack_pending = 0;
        self.ack_since = None;
        self.ack_now = false;
    }

    fn ack_due(&self, now: Instant) -> bool {
        self.ack_now
            || (self.ack_pending > 0
                && (self.ack_pending >= (self.cfg.window / 4).max(1)
                    || self
                        .ack_since
                        .is_some_and(|t| now >= t + self.cfg.ack_delay)))
    }

    /// A packet from the peer: its header and, for a data packet, its payload.
    pub fn on_packet(&mut self, now: Instant, header: Header, payload: Option<R>) -> Arrival {
        if self.failed {
            return Arrival::Duplicate;
        }
        self.heard = now;
        self.on_ack(now, header.ack, header.psn.is_none());
        let (Some(psn), Some(payload)) = (header.psn, payload) else {
            return Arrival::AckOnly;
        };
        let d = diff(psn, self.expected);
        if d < 0 {
            // Delivered before: our acknowledgement was lost or is late; repeat it.
            self.stats.duplicates += 1;
            self.ack_now = true;
            return Arrival::Duplicate;
        }
        if d >= self.cfg.window as i64 {
            self.stats.out_of_window += 1;
            self.ack_now = true;
            return Arrival::OutOfWindow;
        }
        let i = d as usize;
        if i > 0 {
            if self.early.len() <= i {
                self.early.resize_with(i + 1, || None);
            }
            if self.early[i].is_some() {
                self.stats.duplicates += 1;
                self.ack_now = true;
                return Arrival::Duplicate;
            }
            self.early[i] = Some(payload);
            self.stats.kept += 1;
            // A gap: tell the sender now (its fast retransmit counts these). Every time: sending
            // only the first three per gap sent fewer pure acknowledgements but cost bandwidth
            // (docs/history/benchmarks-notebook.md, "Measurements behind code decisions").
            self.ack_now = true;
            self.note_pending(now);
            return Arrival::Kept;
        }
        // The expected packet: its (empty) slot goes, then every kept one that follows.
        self.early.pop_front();
        self.deliver.push_back(payload);
        self.expected = self.expected.wrapping_add(1);
        let mut n = 1;
        while let Some(Some(_)) = self.early.front() {
            if let Some(Some(r)) = self.early.pop_front() {
                self.deliver.push_back(r);
            }
            self.expected = self.expected.wrapping_add(1);
            n += 1;
        }
        self.note_pending(now);
        if n > 1 {
            // A gap filled: the sender learns at once (its window was held behind the gap).
            self.ack_now = true;
        }
        Arrival::Delivered(n)
    }

    /// The fast path for a data packet that is next in order while nothing waits ahead of it
    /// or for delivery: the link accounts for it (acknowledgement, sequence, liveness) exactly
    /// as [`on_packet`](Self::on_packet) would, and the caller consumes its payload at once
    /// instead of handing it over and taking it back from `poll_deliver` (no copy, no queue).
    /// `false`, with nothing changed, for any other packet: the caller then uses `on_packet`.
    #[inline]
    pub fn on_next_in_order(&mut self, now: Instant, header: Header) -> bool {
        if self.failed
            || header.psn != Some(self.expected)
            || !self.early.is_empty()
            || !self.deliver.is_empty()
        {
            return false;
        }
        self.heard = now;
        self.on_ack(now, header.ack, false);
        self.expected = self.expected.wrapping_add(1);
        self.note_pending(now);
        true
    }

    fn note_pending(&mut self, now: Instant) {
        self.ack_pending += 1;
        self.ack_since.get_or_insert(now);
    }

    fn on_ack(&mut self, now: Instant, ack: u32, pure: bool) {
        let d = diff(ack, self.send_base);
        let sent = self.next_new as i64;
        if d <= 0 || d > sent {
            // Nothing new (or claims packets never sent: ignored). A repeated pure
            // acknowledgement with data outstanding says the peer has a gap.
            if d == 0 && pure && self.next_new > 0 {
                self.dup_acks += 1;
                if self.dup_acks == 3 && self.recover.is_none() {
                    self.stats.fast_resends += 1;
                    self.unacked[0].resend = true;
                    self.recover = Some(self.send_base.wrapping_add(self.next_new as u32));
                }
            }
            return;
        }
        // A round-trip sample from the newest packet this acknowledges, unless the range
        // holds a packet sent again (the acknowledgement may answer that copy, and the packets
        // after a hole waited for it: Karn's rule) or losses are being recovered.
        let mut sample = None;
        let mut clean = self.recover.is_none();
        for _ in 0..d {
            if let Some(u) = self.unacked.pop_front() {
                clean &= !u.again;
                sample = u.sent.map(|t| now.saturating_duration_since(t));
                self.acked.push_back(u.payload);
            }
        }
        let sample = sample.filter(|_| clean);
        self.send_base = ack;
        self.next_new -= d as usize;
        self.dup_acks = 0;
        if let Some(r) = sample {
            let (srtt, var) = match self.srtt {
                None => (r, r / 2),
                Some((s, v)) => {
                    let dev = s.abs_diff(r);
                    ((s * 7 + r) / 8, (v * 3 + dev) / 4)
                }
            };
            self.srtt = Some((srtt, var));
        }
        self.rto = self.base_rto();
        if let Some(r) = self.recover {
            if diff(r, ack) > 0 && self.next_new > 0 {
                // A partial acknowledgement: the next hole is lost too.
                self.unacked[0].resend = true;
                self.stats.fast_resends += 1;
            } else {
                self.recover = None;
            }
        }
    }

    /// The timeout with no backoff: the measured round trip's, or the configured first one.
    fn base_rto(&self) -> Duration {
        match self.srtt {
            None => self.cfg.rto,
            Some((s, v)) => (s + 4 * v + self.cfg.ack_delay)
                .max(self.cfg.rto_min)
                .min(self.cfg.rto_max),
        }
    }

    /// Nothing for the caller to do on this link until a packet arrives from the peer or it
    /// sends: nothing unacknowledged or kept out of order, no acknowledgement owed, nothing to
    /// deliver or to give back, no timer running (a failed link is idle too).
    pub fn idle(&self) -> bool {
        self.failed
            || (self.unacked.is_empty()
                && self.acked.is_empty()
                && self.deliver.is_empty()
                && self.early.is_empty()
                && !self.owes_ack()
                && self.next_timeout().is_none())
    }

    /// When `on_timeout` must be called next (a retransmission, a delayed acknowledgement,
    /// or the peer's silence running out).
    pub fn next_timeout(&self) -> Option<Instant> {
        if self.failed {
            return None;
        }
        let rto = self
            .unacked
            .front()
            .and_then(|u| u.sent)
            .map(|t| t + self.rto);
        let ack = self.ack_since.map(|t| t + self.cfg.ack_delay);
        let silence = (self.next_new > 0).then(|| self.heard + self.cfg.peer_timeout);
        [rto, ack, silence].into_iter().flatten().min()
    }

    /// Check the timers at `now` (at any time: nothing happens unless one ran out; the
    /// simulated-link tests call it after every event): retransmit the oldest packet if its
    /// timer ran out, and fail the peer if it has been silent too long. Delayed
    /// acknowledgements become due by themselves (`poll_transmit`).
    pub fn on_timeout(&mut self, now: Instant) {
        if self.failed {
            return;
        }
        if self.next_new > 0 && now >= self.heard + self.cfg.peer_timeout {
            self.failed = true;
            return;
        }
        let Some(front) = self.unacked.front_mut() else {
            return;
        };
        if front.sent.is_some_and(|t| now >= t + self.rto) && !front.resend {
            front.resend = true;
            // Not sent again before the caller transmits it: the timer restarts then.
            front.sent = None;
            self.stats.timeouts += 1;
            self.rto = (self.rto * 2).min(self.cfg.rto_max);
            self.dup_acks = 0;
            self.recover = Some(self.send_base.wrapping_add(self.next_new as u32));
        }
    }

    /// The next packet delivered in order.
    pub fn poll_deliver(&mut self) -> Option<R> {
        self.deliver.pop_front()
    }

    /// The next sent packet the peer acknowledged (its buffer is free).
    pub fn poll_acked(&mut self) -> Option<S> {
        self.acked.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn message(i: u64) -> Vec<u8> {
        let len = 1 + (i.wrapping_mul(2_654_435_761) % 61) as usize;
        (0..len)
            .map(|k| (i as u8).wrapping_mul(31) ^ k as u8)
            .collect()
    }

    /// Faults of the simulated network.
    type Net = crate::sim::Faults;

    type L = Link<Vec<u8>, Vec<u8>>;
    /// Packets on their way to each side.
    type Wire = [Vec<(Header, Option<Vec<u8>>)>; 2];

    /// Two links exchanging `n` messages each way through `net` on a virtual clock. Returns
    /// the virtual time it took and both links' counters; panics if anything arrives twice,
    /// out of order, altered, or not at all.
    fn run(seed: u64, n: u64, net: Net, cfg: Config, psn0: u32) -> (Duration, [Stats; 2]) {
        run_with(seed, n, net, cfg, psn0, false)
    }

    /// `run`, the receivers taking every packet they can by `on_next_in_order` if `fast`.
    fn run_with(
        seed: u64,
        n: u64,
        net: Net,
        cfg: Config,
        psn0: u32,
        fast: bool,
    ) -> (Duration, [Stats; 2]) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut links: [L; 2] = [
            Link::new(cfg, now, psn0, psn0.wrapping_add(7)),
            Link::new(cfg, now, psn0.wrapping_add(7), psn0),
        ];
        let mut next = [0u64; 2];
        let mut got = [0u64; 2];
        let mut freed = [0u64; 2];
        // Payloads taken by the fast path: they precede whatever `poll_deliver` holds (the
        // fast path takes a packet only while that is empty).
        let mut direct: [std::collections::VecDeque<Vec<u8>>; 2] = Default::default();
        let mut wire = crate::sim::Wire::new(net, seed);
        let limit = t0 + Duration::from_secs(3600);
        loop {
            for s in 0..2 {
                while next[s] < n && links[s].can_send() {
                    links[s].send(message(next[s])).unwrap();
                    next[s] += 1;
                }
                while let Some(tx) = links[s].poll_transmit(now) {
                    wire.send(now, 1 - s, (tx.header, tx.payload.cloned()));
                }
                while let Some(m) = direct[s].pop_front().or_else(|| links[s].poll_deliver()) {
                    assert_eq!(
                        m,
                        message(got[s]),
                        "seed {seed}: message {} garbled",
                        got[s]
                    );
                    got[s] += 1;
                }
                while let Some(m) = links[s].poll_acked() {
                    assert_eq!(
                        m,
                        message(freed[s]),
                        "seed {seed}: acknowledged out of order"
                    );
                    freed[s] += 1;
                }
                assert!(!links[s].failed(), "seed {seed}: side {s} failed its peer");
            }
            if got == [n, n] && freed == [n, n] {
                return (now - t0, [links[0].stats(), links[1].stats()]);
            }
            // The next event: a packet landing or a timer.
            let timers = links.iter().filter_map(|l| l.next_timeout());
            let t = wire.next_at().into_iter().chain(timers).min();
            let t = t.unwrap_or_else(|| panic!("seed {seed}: stuck with nothing to wait for"));
            now = now.max(t);
            assert!(
                now < limit,
                "seed {seed}: no end in virtual time: got {got:?}"
            );
            while let Some((to, (header, payload))) = wire.pop_due(now) {
                let link = &mut links[to];
                if fast && payload.is_some() && link.on_next_in_order(now, header) {
                    direct[to].extend(payload);
                } else {
                    link.on_packet(now, header, payload);
                }
            }
            for l in &mut links {
                l.on_timeout(now);
            }
        }
    }

    fn lossy(loss: f64) -> Net {
        Net {
            loss,
            dup: loss / 3.0,
            delay: Duration::from_micros(5),
            jitter: Duration::from_micros(20),
        }
    }

    /// At least 10^6 messages in all, over seeds and loss rates from 0 to 30%, with
    /// duplication and reordering: every message is delivered once, in order, intact.
    #[test]
    fn every_message_arrives_once_in_order_through_loss_duplication_and_reordering() {
        let cfg = Config::default();
        let mut total = 0;
        for (k, loss) in [0.0, 0.001, 0.01, 0.05, 0.1, 0.2, 0.3]
            .into_iter()
            .enumerate()
        {
            for seed in 0..4u64 {
                let n = 40_000;
                // Odd seeds: the receivers take in-order packets by the fast path.
                let (t, st) = run_with(
                    seed + 10 * k as u64,
                    n,
                    lossy(loss),
                    cfg,
                    seed as u32,
                    seed % 2 == 1,
                );
                total += 2 * n;
                if loss == 0.0 {
                    // Reordering alone (jitter 4x the delay) makes a few spurious fast
                    // retransmissions (three acknowledgements of one gap), no timeouts.
                    let resent = st[0].resent + st[1].resent;
                    assert!(resent * 20 < 2 * n, "{resent} resent with no loss: {st:?}");
                    assert_eq!(st[0].timeouts + st[1].timeouts, 0, "{st:?}");
                }
                assert!(t < Duration::from_secs(600), "loss {loss}: {t:?}");
                if seed == 0 {
                    eprintln!(
                        "loss {loss}: {n} messages each way in {t:?} of virtual time, \
                         {} resent ({} after a timeout)",
                        st[0].resent + st[1].resent,
                        st[0].timeouts + st[1].timeouts
                    );
                }
            }
        }
        assert!(total >= 1_000_000);
    }

    /// Sequence numbers wrap around 2^32 without a hitch.
    #[test]
    fn sequence_numbers_wrap() {
        run(5, 5000, lossy(0.05), Config::default(), u32::MAX - 1000);
    }

    /// A small window and a long delay: the window bounds what is in flight and nothing
    /// stalls.
    #[test]
    fn a_window_of_one_still_gets_everything_through() {
        let cfg = Config {
            window: 1,
            ..Config::default()
        };
        run(3, 2000, lossy(0.1), cfg, 0);
    }

    /// Several losses in one window are recovered by fast retransmission and partial
    /// acknowledgements, not a timeout each: with 5% loss, far fewer timeouts than losses.
    #[test]
    fn losses_are_mostly_recovered_without_timeouts() {
        let (_, st) = run(9, 50_000, lossy(0.05), Config::default(), 0);
        let resent = st[0].resent + st[1].resent;
        let timeouts = st[0].timeouts + st[1].timeouts;
        assert!(resent > 1000, "{st:?}");
        assert!(
            timeouts * 4 < resent,
            "{timeouts} timeouts for {resent} resends: {st:?}"
        );
    }

    /// A peer that goes silent while it owes acknowledgements is failed once `peer_timeout`
    /// has passed since it was last heard, and not before.
    #[test]
    fn a_silent_peer_is_failed_after_the_peer_timeout() {
        let cfg = Config {
            peer_timeout: Duration::from_secs(2),
            ..Config::default()
        };
        let t0 = Instant::now();
        let mut a: L = Link::new(cfg, t0, 0, 0);
        a.send(vec![1]).unwrap();
        assert!(a.poll_transmit(t0).is_some());
        let mut now = t0;
        while !a.failed() {
            now = a
                .next_timeout()
                .expect("a timer while data is unacknowledged");
            a.on_timeout(now);
            while a.poll_transmit(now).is_some() {}
            assert!(
                now - t0 <= cfg.peer_timeout,
                "not failed after {:?}",
                now - t0
            );
        }
        assert_eq!(now - t0, cfg.peer_timeout);
        assert!(
            a.stats().timeouts >= 5,
            "retransmitted with backoff: {:?}",
            a.stats()
        );
        assert!(a.send(vec![2]).is_err(), "a failed link takes nothing");
        // An idle link never fails.
        let mut b: L = Link::new(cfg, t0, 0, 0);
        b.on_timeout(t0 + Duration::from_secs(3600));
        assert!(!b.failed() && b.next_timeout().is_none());
    }

    /// A link is idle only when nothing is left for its caller: not while a packet is
    /// unacknowledged or not given back, delivered data waits, or an acknowledgement is owed.
    #[test]
    fn a_link_is_idle_once_its_packets_are_acknowledged_delivered_and_acknowledged() {
        let cfg = Config::default();
        let t0 = Instant::now();
        let (mut a, mut b): (L, L) = (Link::new(cfg, t0, 0, 0), Link::new(cfg, t0, 0, 0));
        assert!(a.idle() && b.idle(), "new links");
        a.send(vec![7]).unwrap();
        assert!(!a.idle(), "a packet to transmit");
        let (h, p) = {
            let t = a.poll_transmit(t0).expect("the packet");
            (t.header, t.payload.cloned())
        };
        assert!(!a.idle(), "unacknowledged");
        b.on_packet(t0, h, p);
        assert!(!b.idle(), "data to deliver");
        assert_eq!(b.poll_deliver(), Some(vec![7]));
        assert!(!b.idle() && b.owes_ack(), "an acknowledgement owed");
        let later = t0 + cfg.ack_delay;
        let ack = b.poll_transmit(later).expect("the acknowledgement").header;
        assert!(b.idle(), "acknowledged");
        a.on_packet(later, ack, None);
        assert!(!a.idle(), "the acknowledged buffer not yet given back");
        assert_eq!(a.poll_acked(), Some(vec![7]));
        assert!(a.idle(), "all done");
    }

    /// Acknowledgements without data: one per quarter window, or after the delay.
    #[test]
    fn pure_acknowledgements_are_coalesced() {
        let cfg = Config {
            window: 16,
            ..Config::default()
        };
        let t0 = Instant::now();
        let mut a: L = Link::new(cfg, t0, 0, 0);
        let mut b: L = Link::new(cfg, t0, 0, 0);
        for i in 0..3 {
            a.send(vec![i]).unwrap();
        }
        while let Some(tx) = a.poll_transmit(t0) {
            let (h, p) = (tx.header, tx.payload.cloned());
            b.on_packet(t0, h, p);
        }
        assert!(b.poll_transmit(t0).is_none(), "3 of 16: not yet");
        a.send(vec![3]).unwrap();
        let tx = a.poll_transmit(t0).unwrap();
        let (h, p) = (tx.header, tx.payload.cloned());
        b.on_packet(t0, h, p);
        let ack = b.poll_transmit(t0).expect("4 of 16: a quarter");
        assert_eq!(ack.header, Header { psn: None, ack: 4 });
        a.send(vec![4]).unwrap();
        let tx = a.poll_transmit(t0).unwrap();
        let (h, p) = (tx.header, tx.payload.cloned());
        b.on_packet(t0, h, p);
        assert!(b.poll_transmit(t0).is_none());
        let due = b.next_timeout().unwrap();
        assert_eq!(due, t0 + cfg.ack_delay);
        assert_eq!(b.poll_transmit(due).unwrap().header.ack, 5);
    }

    /// The packet that fills a gap is acknowledged at once, with everything kept behind it:
    /// the sender's window is held by the packets behind the gap until it learns. (Left to
    /// the delayed rule, bandwidth under loss fell: docs/history/benchmarks-notebook.md,
    /// "Measurements behind code decisions".)
    #[test]
    fn a_filled_gap_is_acknowledged_at_once() {
        let cfg = Config::default();
        let t0 = Instant::now();
        let mut a: L = Link::new(cfg, t0, 0, 0);
        let mut b: L = Link::new(cfg, t0, 0, 0);
        for i in 0..3 {
            a.send(vec![i]).unwrap();
        }
        let mut sent = vec![];
        while let Some(tx) = a.poll_transmit(t0) {
            sent.push((tx.header, tx.payload.cloned()));
        }
        // Packet 0 is late: 1 and 2 are kept, each acknowledged at once (ack 0).
        for (h, p) in sent.drain(1..) {
            b.on_packet(t0, h, p);
            assert_eq!(b.poll_transmit(t0).expect("a gap").header.ack, 0);
        }
        let (h, p) = sent.pop().unwrap();
        b.on_packet(t0, h, p);
        let ack = b
            .poll_transmit(t0)
            .expect("the gap filled: acknowledged at once");
        assert_eq!(ack.header, Header { psn: None, ack: 3 });
    }

    #[derive(Debug, Clone)]
    enum Step {
        Send(usize),
        Land(usize, usize),
        Drop(usize, usize),
        Dup(usize, usize),
        Wait(usize, u16),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0..2usize).prop_map(Step::Send),
            (0..2usize, 0..64usize).prop_map(|(s, i)| Step::Land(s, i)),
            (0..2usize, 0..64usize).prop_map(|(s, i)| Step::Drop(s, i)),
            (0..2usize, 0..64usize).prop_map(|(s, i)| Step::Dup(s, i)),
            (0..2usize, 0..20_000u16).prop_map(|(s, us)| Step::Wait(s, us)),
        ]
    }

    proptest! {
        /// Any interleaving of sends, landings in any order, losses, duplicates and timers:
        /// what is delivered is always a prefix of what was sent, never twice; and once the
        /// network turns perfect, everything arrives.
        #[test]
        fn any_interleaving_delivers_a_prefix_and_then_everything(
            steps in proptest::collection::vec(step(), 1..400),
            psn0 in any::<u32>(),
        ) {
            let cfg = Config { window: 8, ..Config::default() };
            let t0 = Instant::now();
            let mut now = t0;
            let mut links: [L; 2] =
                [Link::new(cfg, now, psn0, psn0 ^ 1), Link::new(cfg, now, psn0 ^ 1, psn0)];
            // Packets on their way to side `s`.
            let mut wire: Wire = [vec![], vec![]];
            let (mut next, mut got) = ([0u64; 2], [0u64; 2]);
            let pump = |links: &mut [L; 2], wire: &mut Wire,
                        got: &mut [u64; 2], now: Instant| {
                for s in 0..2 {
                    while let Some(tx) = links[s].poll_transmit(now) {
                        wire[1 - s].push((tx.header, tx.payload.cloned()));
                    }
                    while let Some(m) = links[s].poll_deliver() {
                        assert_eq!(m, message(got[s]));
                        got[s] += 1;
                    }
                    while links[s].poll_acked().is_some() {}
                }
            };
            for st in steps {
                match st {
                    Step::Send(s) if links[s].send(message(next[s])).is_ok() => {
                        next[s] += 1;
                    }
                    Step::Land(s, i) if !wire[s].is_empty() => {
                        let (h, p) = wire[s].remove(i % wire[s].len());
                        // Half the cases take what they can by the fast path.
                        if psn0 % 2 == 1 && p.is_some() && links[s].on_next_in_order(now, h) {
                            prop_assert_eq!(p.unwrap(), message(got[s]));
                            got[s] += 1;
                        } else {
                            links[s].on_packet(now, h, p);
                        }
                    }
                    Step::Drop(s, i) if !wire[s].is_empty() => {
                        let k = i % wire[s].len();
                        wire[s].remove(k);
                    }
                    Step::Dup(s, i) if !wire[s].is_empty() => {
                        let k = i % wire[s].len();
                        let c = wire[s][k].clone();
                        wire[s].push(c);
                    }
                    Step::Wait(s, us) => {
                        now += Duration::from_micros(us as u64);
                        links[s].on_timeout(now);
                    }
                    _ => {}
                }
                pump(&mut links, &mut wire, &mut got, now);
                prop_assert!(got[0] <= next[1] && got[1] <= next[0]);
            }
            // A perfect network from here: deliver everything, run the timers.
            for _ in 0..100_000 {
                if got == [next[1], next[0]]
                    && links.iter().all(|l| l.in_flight() == 0)
                {
                    break;
                }
                for s in 0..2 {
                    for (h, p) in std::mem::take(&mut wire[s]) {
                        links[s].on_packet(now, h, p);
                    }
                }
                now += Duration::from_millis(5);
                for l in &mut links {
                    l.on_timeout(now);
                }
                pump(&mut links, &mut wire, &mut got, now);
                prop_assert!(links.iter().all(|l| !l.failed()));
            }
            prop_assert_eq!(got, [next[1], next[0]]);
        }
    }
}

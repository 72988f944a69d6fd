//! A simulated network for the tests of sans-IO engines (and the soft HCA's fault injection):
//! a seeded generator ([`Rng`]) and a wire on virtual time ([`Wire`]) that loses, duplicates
//! and delays what is sent on it from the seed, so a run that found a bug runs the same way
//! again. The engines never read a clock, so a test drives them from `Wire::next_at` and the
//! engines' own timers, as quinn-proto's tests do, and a minute of protocol time takes
//! milliseconds.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::ops::Add;
use std::time::Duration;

/// xorshift64*: small, fast, and the same sequence for the same seed on every machine.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p` (draws nothing when `p` is 0, so a fault left at 0 changes
    /// no other fault's sequence).
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

/// What the wire does to what is sent on it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Faults {
    /// Probability that a packet is lost.
    pub loss: f64,
    /// Probability that a packet not lost arrives twice.
    pub dup: f64,
    /// One-way delay of every packet.
    pub delay: Duration,
    /// A uniform extra delay on top, drawn per copy: packets overtake each other.
    pub jitter: Duration,
}

impl Faults {
    /// A perfect wire: no loss, no duplicates, no delay.
    pub const NONE: Faults = Faults {
        loss: 0.0,
        dup: 0.0,
        delay: Duration::ZERO,
        jitter: Duration::ZERO,
    };
}

struct InFlight<I, T> {
    at: I,
    order: u64,
    to: usize,
    item: T,
}

impl<I: Ord, T> PartialEq for InFlight<I, T> {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at && self.order == o.order
    }
}
impl<I: Ord, T> Eq for InFlight<I, T> {}
impl<I: Ord, T> PartialOrd for InFlight<I, T> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<I: Ord, T> Ord for InFlight<I, T> {
    // Earliest first out of the max-heap; equal times in sending order.
    fn cmp(&self, o: &Self) -> Ordering {
        (&o.at, o.order).cmp(&(&self.at, self.order))
    }
}

/// Packets `T` on their way to endpoints `0..`, on virtual time `I` (`std` or `quanta`
/// instants).
pub struct Wire<I, T> {
    faults: Faults,
    rng: Rng,
    heap: BinaryHeap<InFlight<I, T>>,
    order: u64,
    /// Packets sent, lost and duplicated so far.
    pub sent: u64,
    pub lost: u64,
    pub duplicated: u64,
}

impl<I, T> Wire<I, T>
where
    I: Ord + Copy + Add<Duration, Output = I>,
    T: Clone,
{
    /// A wire with `faults`, its draws from `seed`.
    pub fn new(faults: Faults, seed: u64) -> Self {
        Wire {
            faults,
            rng: Rng::new(seed),
            heap: BinaryHeap::new(),
            order: 0,
            sent: 0,
            lost: 0,
            duplicated: 0,
        }
    }

    /// Send `item` towards endpoint `to` at time `now`: lost, delivered once or twice, each
    /// copy after the delay and its own jitter.
    pub fn send(&mut self, now: I, to: usize, item: T) {
        self.sent += 1;
        let copies = if self.rng.chance(self.faults.loss) {
            self.lost += 1;
            0
        } else if self.rng.chance(self.faults.dup) {
            self.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let extra = self.faults.jitter.as_nanos() as u64;
            let j = if extra == 0 {
                0
            } else {
                self.rng.below(extra + 1)
            };
            self.order += 1;
            self.heap.push(InFlight {
                at: now + self.faults.delay + Duration::from_nanos(j),
                order: self.order,
                to,
                item: item.clone(),
            });
        }
    }

    /// When the next packet lands, if any is on its way.
    pub fn next_at(&self) -> Option<I> {
        self.heap.peek().map(|p| p.at)
    }

    /// The next packet landed by `now`, with the endpoint it is for.
    pub fn pop_due(&mut self, now: I) -> Option<(usize, T)> {
        if self.heap.peek().is_some_and(|p| p.at <= now) {
            self.heap.pop().map(|p| (p.to, p.item))
        } else {
            None
        }
    }

    /// Nothing on its way.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// The generator the wire draws from, for a test's own draws in the same sequence.
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_seed_gives_one_sequence() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let xs: Vec<u64> = (0..100).map(|_| a.next_u64()).collect();
        assert!(xs.iter().all(|&x| x == b.next_u64()));
        assert_ne!(Rng::new(8).next_u64(), xs[0]);
        let mut r = Rng::new(0);
        assert!((0..1000).all(|_| r.below(10) < 10));
        assert_eq!(r.below(0), 0);
        assert!(!r.chance(0.0));
        let f: Vec<f64> = (0..1000).map(|_| r.next_f64()).collect();
        assert!(f.iter().all(|x| (0.0..1.0).contains(x)));
    }

    /// What goes in comes out: in time order, lost and duplicated about as often as asked,
    /// reordered by the jitter, the same way for the same seed.
    #[test]
    fn the_wire_loses_duplicates_and_reorders_as_asked() {
        let t0 = Instant::now();
        let faults = Faults {
            loss: 0.1,
            dup: 0.05,
            delay: Duration::from_micros(5),
            jitter: Duration::from_micros(20),
        };
        let run = |seed| {
            let mut w = Wire::new(faults, seed);
            for i in 0..10_000u32 {
                w.send(
                    t0 + Duration::from_nanos(u64::from(i) * 100),
                    (i % 2) as usize,
                    i,
                );
            }
            let mut out = vec![];
            let mut last = t0;
            while let Some(at) = w.next_at() {
                assert!(at >= last, "in time order");
                last = at;
                while let Some((to, i)) = w.pop_due(at) {
                    assert_eq!(to, (i % 2) as usize);
                    out.push(i);
                }
            }
            (out, w.lost, w.duplicated)
        };
        let (out, lost, dup) = run(3);
        assert!((800..1200).contains(&lost), "{lost} lost");
        assert!((300..650).contains(&dup), "{dup} duplicated");
        assert_eq!(out.len() as u64, 10_000 - lost + dup);
        assert!(out.windows(2).any(|w| w[1] < w[0]), "jitter reorders");
        assert_eq!(run(3).0, out, "the same seed, the same run");
        let mut w: Wire<Instant, ()> = Wire::new(Faults::NONE, 1);
        w.send(t0, 0, ());
        assert_eq!(w.pop_due(t0), Some((0, ())));
        assert!(w.is_empty());
    }
}

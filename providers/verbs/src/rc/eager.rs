// Over 800 lines: its unit tests, below the code (which is under 800), test it through its private state.
//! The eager RDMA channels of verbs-rc, written sans-IO: which bytes of a ring a message
//! occupies, which RDMA writes carry it, when the receiver sees it complete, and when space is
//! handed back. The provider does the I/O (copies into staging memory, posts the writes, reads
//! the ring); the tests below drive a sender and a receiver through a simulated link.
//!
//! A *ring* lives in the receiver's registered memory; the sender keeps a mirror of it (its
//! staging memory, the source of the RDMA writes) and writes each record at the same offset
//! in both. Every record starts with an 8-byte *head word*: the body length in the low half,
//! a tag of the record's absolute position in the high half. A word left over from an earlier
//! lap carries an older tag, so it never reads as a new record, and the receiver never has to
//! clear the ring. The designs differ in how the receiver learns that a record is complete
//! and how the sender learns that space is free again:
//!
//! * [`Design::Basic`] (paper 000's first design): a byte ring; after the data the sender
//!   RDMA-writes its new *head pointer* into a word beside the receiver's ring, the receiver
//!   consumes up to it and RDMA-writes its *tail pointer* back after every poll that consumed
//!   something. Three RDMA writes per message.
//! * [`Design::Piggyback`]: the head word is the flag, and a copy of it closes the record as
//!   the *tail flag* (the soft HCA, like an HCA writing in address order, makes the last byte
//!   of a write visible last), so one write carries a message. The tail pointer goes back
//!   only when half the ring is unreported, and rides in the header of every frame going the
//!   other way.
//! * [`Design::Pipeline`]: piggyback, and a record larger than a chunk is written chunk by
//!   chunk, each posted as soon as it is copied.
//! * [`Design::Fastpath`] (MVAPICH's RC-FP): a ring of equal slots, one message per slot,
//!   flags as in piggyback; freed slots go back as credits in frame headers, or in an explicit
//!   credit message once half the slots are unreported.

use smallvec::SmallVec;

/// Bytes of a record's head word.
pub const HEAD: usize = 8;
/// Bytes of a record's tail flag (designs other than basic).
pub const TAIL: usize = 8;
/// At most this many 8-byte pads go between a body and its tail flag (see [`Tx::place`]).
const MAX_PAD: usize = 7;

/// An eager design.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Design {
    Basic,
    Piggyback,
    Pipeline,
    Fastpath,
}

impl Design {
    pub fn parse(s: &str) -> Option<Design> {
        Some(match s {
            "basic" => Design::Basic,
            "piggyback" => Design::Piggyback,
            "pipeline" => Design::Pipeline,
            "fastpath" => Design::Fastpath,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Design::Basic => "basic",
            Design::Piggyback => "piggyback",
            Design::Pipeline => "pipeline",
            Design::Fastpath => "fastpath",
        }
    }

    /// Records close with a tail flag (everything but basic).
    fn in_band(self) -> bool {
        self != Design::Basic
    }
}

/// The geometry of one ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub design: Design,
    /// Bytes of the ring (fastpath: slots × slot bytes); a multiple of 8, at most 8 MiB.
    pub size: usize,
    /// Fastpath: bytes of one slot (a multiple of 8). Unused otherwise.
    pub slot: usize,
    /// Pipeline: bytes per RDMA write (a multiple of 8). Unused otherwise.
    pub chunk: usize,
}

fn up8(n: usize) -> usize {
    (n + 7) & !7
}

/// Largest body length a head word can hold.
const LEN_MASK: u64 = (1 << 21) - 1;
/// The value part of a basic head or tail pointer word; the top byte is its flag.
const VALUE_MASK: u64 = (1 << 56) - 1;

impl Shape {
    /// Check the geometry: sizes multiples of 8, room for records.
    pub fn valid(&self) -> bool {
        let base = self.size % 8 == 0 && self.size >= 1024 && self.size <= 8 << 20;
        let ok = match self.design {
            Design::Fastpath => {
                self.slot % 8 == 0
                    && self.slot >= 128
                    && self.size % self.slot == 0
                    && self.size / self.slot >= 2
            }
            Design::Pipeline => self.chunk % 8 == 0 && self.chunk >= 64,
            _ => true,
        };
        base && ok
    }

    /// Bytes of the largest record: head, body, pads, tail.
    fn max_record(&self) -> usize {
        match self.design {
            Design::Fastpath => self.slot,
            // A quarter of the ring: the receiver hands space back at half, so a sender always
            // finds room once the receiver has consumed everything.
            _ => (self.size / 4) & !7,
        }
    }

    /// A fastpath slot for records of bodies up to `body` bytes: their size, and 512 bytes to
    /// spare, in 256-byte steps. A record that fills its slot (a 2 KiB message in slots of
    /// 2,304 bytes) took 6 % longer than in 4 KiB slots, one with 600 bytes to spare (2,816)
    /// did not: the slack keeps a record's tail flag off the cache lines of the next slot,
    /// which the next write and the receiver touch meanwhile.
    pub fn fastpath_slot_for(body: usize) -> usize {
        (HEAD + TAIL + 8 * MAX_PAD + body + 512).next_multiple_of(256)
    }

    /// The largest body one record carries.
    pub fn max_body(&self) -> usize {
        let over = HEAD
            + if self.design.in_band() {
                TAIL + 8 * MAX_PAD
            } else {
                0
            };
        self.max_record().saturating_sub(over)
    }

    /// Bytes of a record with a body of `len` and `pads` pads.
    fn record(&self, len: usize, pads: usize) -> usize {
        HEAD + up8(len)
            + if self.design.in_band() {
                8 * pads + TAIL
            } else {
                0
            }
    }

    /// Bytes of memory a ring takes (the same for its staging mirror): a byte ring is followed
    /// by room for one record, so that a record that starts near the end runs on past it
    /// instead of wrapping (no record is ever split, and none is skipped); basic's head
    /// pointer word comes last.
    pub fn mem_len(&self) -> usize {
        match self.design {
            Design::Fastpath => self.size,
            Design::Basic => self.size + self.max_record() + 8,
            _ => self.size + self.max_record(),
        }
    }

    /// Offset of basic's head pointer word in the receiver's memory.
    pub fn head_at(&self) -> usize {
        self.size + self.max_record()
    }

    /// Capacity in acknowledgement units: bytes, or slots for fastpath.
    pub fn units(&self) -> u64 {
        match self.design {
            Design::Fastpath => (self.size / self.slot) as u64,
            _ => self.size as u64,
        }
    }

    /// Offset in the ring of absolute position `abs` (units).
    fn offset(&self, abs: u64) -> usize {
        match self.design {
            Design::Fastpath => (abs % self.units()) as usize * self.slot,
            _ => (abs % self.size as u64) as usize,
        }
    }

    /// The tag of absolute position `abs`: 32 bits that differ from those of every record
    /// placed at the same offset within the 2^32 / (ring / 8) laps before.
    fn tag(&self, abs: u64) -> u64 {
        let t = match self.design {
            Design::Fastpath => abs,
            _ => abs >> 3,
        };
        t & 0xffff_ffff
    }
}

/// A record's head word: body length (21 bits), pads before the tail (3 bits), the tag of
/// its position (32 bits) and, on top, its check byte.
fn head_word(len: usize, pads: usize, tag: u64) -> u64 {
    len as u64 & LEN_MASK | (pads as u64) << 21 | tag << 24 | (check_byte(tag, pads) as u64) << 56
}

/// The check byte of a record with `pads` pads at a position of tag `tag`: never 0, and
/// known to the receiver without trusting anything it reads.
fn check_byte(tag: u64, pads: usize) -> u8 {
    let h = (tag ^ (pads as u64) << 32).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> 56) as u8 | 1
}

/// One RDMA write: `len` bytes at `off` of the staging mirror to the same offset of the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    pub off: usize,
    pub len: usize,
}

/// Where a record went and how it travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Offset of the body in the ring (and in the staging mirror).
    pub body: usize,
    pub len: usize,
    /// The writes, in order (more than one for pipeline's chunks).
    pub writes: SmallVec<[Write; 4]>,
    /// Basic: a head-pointer word to write into the receiver's head word after the data (at
    /// most one unanswered at a time; otherwise [`Tx::head_due`] hands it out later).
    pub head: Option<u64>,
}

/// A basic head or tail pointer word: the value, flagged as fresh by a nonzero top byte (the
/// byte that lands last); its reader zeroes the flag once it has read the value.
pub fn pointer_word(v: u64) -> u64 {
    v & VALUE_MASK | 1 << 56
}

/// The sender's side of a ring in the peer's memory.
#[derive(Debug, Clone)]
pub struct Tx {
    shape: Shape,
    /// Units placed since the start (absolute).
    sent: u64,
    /// Units the receiver has given back.
    acked: u64,
    /// Basic: the head pointer last written.
    head_written: u64,
}

impl Tx {
    pub fn new(shape: Shape) -> Tx {
        Tx {
            shape,
            sent: 0,
            acked: 0,
            head_written: 0,
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// Units in flight (placed, not given back).
    pub fn outstanding(&self) -> u64 {
        self.sent - self.acked
    }

    /// RDMA writes a record with a body of `len` bytes needs at most.
    pub fn writes_for(&self, len: usize) -> usize {
        match self.shape.design {
            Design::Basic => 3,
            Design::Piggyback => 2,
            Design::Pipeline => 1 + (len + HEAD + TAIL + 8 * MAX_PAD).div_ceil(self.shape.chunk),
            Design::Fastpath => 1,
        }
    }

    /// Place a record with a body of `len` bytes, write its head word (and tail flag) into
    /// `staging` (the mirror of the ring), and say where the body goes and which writes carry
    /// it. `None` when it does not fit now (nothing changes) or never (`len > max_body`).
    ///
    /// The last byte of a record is its check byte; the receiver knows what it must be, and
    /// the sender makes sure the ring does not hold that value there already (the mirror says
    /// what the ring holds): if it does, the tail moves on by 8 bytes, up to seven times.
    pub fn place(&mut self, staging: &mut [u8], len: usize) -> Option<Placed> {
        let sh = self.shape;
        if len == 0 || len > sh.max_body() || staging.len() < sh.mem_len() {
            return None;
        }
        let room = sh.units() - self.outstanding();
        let mut writes = SmallVec::new();
        let in_band = sh.design.in_band();
        let need = sh.record(len, if in_band { MAX_PAD } else { 0 });
        if match sh.design {
            Design::Fastpath => room == 0,
            _ => need as u64 > room,
        } {
            return None;
        }
        let start = self.sent;
        let off = sh.offset(start);
        let pads = if in_band {
            self.pads(staging, off, len, start)?
        } else {
            0
        };
        let h = head_word(len, pads, sh.tag(start));
        put(staging, off, h);
        let rec = sh.record(len, pads);
        if in_band {
            put(staging, off + rec - TAIL, h);
        }
        match sh.design {
            Design::Pipeline => {
                let mut o = 0;
                while o < rec {
                    let n = sh.chunk.min(rec - o);
                    writes.push(Write {
                        off: off + o,
                        len: n,
                    });
                    o += n;
                }
            }
            _ => writes.push(Write { off, len: rec }),
        }
        self.sent = start
            + match sh.design {
                Design::Fastpath => 1,
                _ => rec as u64,
            };
        Some(Placed {
            body: off + HEAD,
            len,
            writes,
            head: if sh.design == Design::Basic {
                self.head_due()
            } else {
                None
            },
        })
    }

    /// The pads that put the tail flag of a record (body `len`, at `off`, position `abs`) on
    /// a last byte the ring does not already hold.
    fn pads(&self, staging: &[u8], off: usize, len: usize, abs: u64) -> Option<usize> {
        let t = self.shape.tag(abs);
        (0..=MAX_PAD).find(|&p| {
            let last = off + HEAD + up8(len) + 8 * p + TAIL - 1;
            staging[last] != check_byte(t, p)
        })
    }

    /// The receiver has consumed `consumed` units (the low 32 bits of its absolute count). A
    /// value that is older than one already seen, or claims more than was sent, is ignored.
    pub fn ack(&mut self, consumed: u32) {
        let delta = consumed.wrapping_sub(self.acked as u32) as u64;
        if delta <= self.outstanding() {
            self.acked += delta;
        }
    }

    /// Basic: the tail word the receiver writes into our memory. When its flag is set, the
    /// value is whole: take it, and the caller zeroes the flag (returns true).
    pub fn tail_word(&mut self, raw: u64) -> bool {
        if raw >> 56 == 0 {
            return false;
        }
        self.ack(raw as u32);
        true
    }

    /// Basic: the head pointer to write now, if records wait for one and the receiver has
    /// answered the last (so it has zeroed the flag of its head word).
    pub fn head_due(&mut self) -> Option<u64> {
        if self.shape.design != Design::Basic
            || self.sent == self.head_written
            || self.acked != self.head_written
        {
            return None;
        }
        self.head_written = self.sent;
        Some(pointer_word(self.sent))
    }
}

fn put(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// The receiver's view of its ring memory: 8-byte loads that see a peer's writes (volatile,
/// with acquire ordering in the provider), and the zeroing of a pointer word's flag.
pub trait RingMem {
    fn load(&self, off: usize) -> u64;
    fn clear_flag(&mut self, off: usize);
}

impl RingMem for [u8] {
    fn load(&self, off: usize) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&self[off..off + 8]);
        u64::from_le_bytes(w)
    }

    fn clear_flag(&mut self, off: usize) {
        self[off + 7] = 0;
    }
}

/// What the receiver found at its position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peek {
    /// Nothing complete yet.
    Empty,
    /// A complete record: its body is `len` bytes at `off`; [`Rx::consume`] it once used.
    Body { off: usize, len: usize },
    /// The peer wrote something no sender following the protocol writes.
    Bad,
}

/// The receiver's side of a ring in its own memory ([`Shape::mem_len`] bytes; basic's head
/// word at [`Shape::head_at`]).
#[derive(Debug, Clone)]
pub struct Rx {
    shape: Shape,
    /// Units consumed since the start.
    pos: u64,
    /// Units the sender has been told about.
    reported: u64,
    /// Basic: the head pointer last read.
    limit: u64,
}

impl Rx {
    pub fn new(shape: Shape) -> Rx {
        Rx {
            shape,
            pos: 0,
            reported: 0,
            limit: 0,
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// Look for the next complete record.
    pub fn peek(&mut self, mem: &mut (impl RingMem + ?Sized)) -> Peek {
        let sh = self.shape;
        if sh.design == Design::Basic && self.pos == self.limit {
            let w = mem.load(sh.head_at());
            if w >> 56 == 0 {
                return Peek::Empty;
            }
            let v = w & VALUE_MASK;
            if v <= self.pos || v - self.pos > sh.size as u64 {
                return Peek::Bad;
            }
            // The flag landed last, so the value is whole; the sender writes the word again
            // only after our report, which follows this.
            self.limit = v;
            mem.clear_flag(sh.head_at());
        }
        let off = sh.offset(self.pos);
        let h = mem.load(off);
        let tag = sh.tag(self.pos);
        let len = (h & LEN_MASK) as usize;
        let pads = (h >> 21 & 7) as usize;
        let whole = (h >> 24) & 0xffff_ffff == tag && (h >> 56) as u8 == check_byte(tag, pads);
        let fits = len > 0 && len <= sh.max_body() && sh.record(len, pads) <= sh.max_record();
        if sh.design == Design::Basic {
            // The head pointer vouches for the record: anything else is the peer's doing.
            if !whole || !fits || pads != 0 || self.pos + sh.record(len, 0) as u64 > self.limit {
                return Peek::Bad;
            }
            return Peek::Body {
                off: off + HEAD,
                len,
            };
        }
        // In-band: the head word may still be landing (torn). Only a tail flag equal to it,
        // whose last byte is the check byte this position expects, says the record is whole
        // (the ring did not hold that byte there before: the sender saw to it).
        if !whole || !fits || mem.load(off + sh.record(len, pads) - TAIL) != h || mem.load(off) != h
        {
            return Peek::Empty;
        }
        Peek::Body {
            off: off + HEAD,
            len,
        }
    }

    /// The record just peeked (body `len`) has been used; its space may be reused.
    pub fn consume(&mut self, mem: &(impl RingMem + ?Sized), len: usize) {
        let units = match self.shape.design {
            Design::Fastpath => 1,
            _ => {
                let pads = (mem.load(self.shape.offset(self.pos)) >> 21 & 7) as usize;
                self.shape.record(len, pads) as u64
            }
        };
        self.pos += units;
    }

    /// Units consumed (what a report would say).
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Units consumed and not yet reported.
    pub fn unreported(&self) -> u64 {
        self.pos - self.reported
    }

    /// Whether the sender must be told now, rather than in the next frame going its way.
    pub fn ack_due(&self) -> bool {
        let n = self.unreported();
        match self.shape.design {
            Design::Basic => n > 0 && self.pos == self.limit,
            _ => n > 0 && n >= self.shape.units() / 2,
        }
    }

    /// Report: the value the sender's [`Tx::ack`] takes (basic: as a [`pointer_word`] written
    /// into the sender's tail word).
    pub fn report(&mut self) -> u64 {
        self.reported = self.pos;
        self.pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    use weft_proto::sim::Rng;

    const DESIGNS: [Design; 4] = [
        Design::Basic,
        Design::Piggyback,
        Design::Pipeline,
        Design::Fastpath,
    ];

    fn shape(design: Design) -> Shape {
        match design {
            Design::Fastpath => Shape {
                design,
                size: 16 * 256,
                slot: 256,
                chunk: 0,
            },
            _ => Shape {
                design,
                size: 4096,
                slot: 0,
                chunk: 128,
            },
        }
    }

    #[test]
    fn a_slot_sized_for_a_body_carries_it_with_room_to_spare() {
        for body in [1, 100, 2192, 4000, 8336, 65_680] {
            let slot = Shape::fastpath_slot_for(body);
            let s = Shape {
                design: Design::Fastpath,
                size: 16 * slot,
                slot,
                chunk: 0,
            };
            assert!(s.valid(), "{body}: slot {slot}");
            assert!(s.max_body() >= body + 512, "{body}: slot {slot}");
            assert!(s.max_body() < body + 512 + 256, "{body}: slot {slot}");
        }
    }

    /// An RDMA write in flight: its bytes land a few at a time, in any order but the last
    /// byte last, as the soft HCA places them; writes land one after the other (RC order).
    struct InFlight {
        off: usize,
        data: Vec<u8>,
        /// Indexes of `data` in the order they land.
        order: Vec<usize>,
        done: usize,
        /// The absolute end (units) of the placement the write belongs to.
        end: u64,
    }

    impl InFlight {
        fn new(rng: &mut Rng, off: usize, data: Vec<u8>, end: u64) -> InFlight {
            let mut order: Vec<usize> = (0..data.len() - 1).collect();
            for k in (1..order.len()).rev() {
                order.swap(k, rng.below(k as u64 + 1) as usize);
            }
            order.push(data.len() - 1);
            InFlight {
                off,
                data,
                order,
                done: 0,
                end,
            }
        }

        /// Land up to `n` more bytes into `mem`; true when all have landed.
        fn land(&mut self, mem: &mut [u8], n: usize) -> bool {
            let n = n.min(self.data.len() - self.done);
            for &k in &self.order[self.done..self.done + n] {
                mem[self.off + k] = self.data[k];
            }
            self.done += n;
            self.done == self.data.len()
        }
    }

    /// Run `msgs` messages through a sender and a receiver joined by a link that delays
    /// writes and lands their bytes in any order (the last last), with acknowledgements that
    /// come late (basic: the tail word written back the same way; the others: frame headers
    /// and credit messages, some stale). Every message must arrive once, in order, byte for
    /// byte, and no write may land on a record the receiver has not consumed. Returns how
    /// often the sender found the ring full.
    fn run(design: Design, seed: u64, msgs: usize) -> u64 {
        let sh = shape(design);
        let mut rng = Rng::new(seed);
        let mut tx = Tx::new(sh);
        let mut rx = Rx::new(sh);
        // Memory starts out full of old bytes, the same on both sides (the mirror's promise).
        let mut staging: Vec<u8> = (0..sh.mem_len()).map(|_| rng.next_u64() as u8).collect();
        if design == Design::Basic {
            let h = sh.head_at();
            staging[h..h + 8].fill(0);
        }
        let mut ring = staging.clone();
        let mut link: VecDeque<InFlight> = VecDeque::new();
        // Basic's tail word in the sender's memory, and the writes of it on the way back.
        let mut tail_word = [0u8; 8];
        let mut back: VecDeque<InFlight> = VecDeque::new();
        // The others' acknowledgements: (arrives at step, value).
        let mut acks: VecDeque<(u64, u64)> = VecDeque::new();
        let (mut sent, mut got, mut step, mut fills) = (0usize, 0usize, 0u64, 0u64);
        let body = |i: usize, len: usize| -> Vec<u8> {
            (0..len).map(|k| (i * 31 + k * 7) as u8).collect()
        };
        let mut lens = Vec::new();
        let head_write = |rng: &mut Rng, link: &mut VecDeque<InFlight>, w: u64, end: u64| {
            link.push_back(InFlight::new(
                rng,
                sh.head_at(),
                w.to_le_bytes().to_vec(),
                end,
            ));
        };
        while got < msgs {
            step += 1;
            assert!(
                step < 20_000_000,
                "{design:?} seed {seed}: stuck at {got} of {msgs}"
            );
            match rng.below(5) {
                0 if sent < msgs => {
                    let len = 1 + rng.below(sh.max_body() as u64) as usize;
                    let len = if rng.below(3) == 0 { len.min(40) } else { len };
                    let Some(p) = tx.place(&mut staging, len) else {
                        fills += 1;
                        continue;
                    };
                    staging[p.body..p.body + len].copy_from_slice(&body(sent, len));
                    for w in &p.writes {
                        let data = staging[w.off..w.off + w.len].to_vec();
                        link.push_back(InFlight::new(&mut rng, w.off, data, tx.sent));
                    }
                    if let Some(h) = p.head {
                        head_write(&mut rng, &mut link, h, tx.sent);
                    }
                    lens.push(len);
                    sent += 1;
                }
                1 => {
                    if let Some(w) = link.front_mut() {
                        // Nothing lands on a record the receiver has not consumed.
                        assert!(w.end <= rx.pos + sh.units(), "{design:?}: overwrote");
                        let n = 1 + rng.below(24) as usize;
                        if w.land(&mut ring, n) {
                            link.pop_front();
                        }
                    }
                }
                2 => loop {
                    match rx.peek(&mut ring[..]) {
                        Peek::Empty => break,
                        Peek::Bad => panic!("{design:?} seed {seed}: bad record at {got}"),
                        Peek::Body { off, len } => {
                            assert_eq!(len, lens[got], "{design:?} seed {seed}: length {got}");
                            assert_eq!(
                                ring[off..off + len],
                                body(got, len)[..],
                                "{design:?} seed {seed}: message {got}"
                            );
                            rx.consume(&ring[..], len);
                            got += 1;
                        }
                    }
                    if design == Design::Basic {
                        if rx.ack_due() {
                            let v = pointer_word(rx.report());
                            back.push_back(InFlight::new(&mut rng, 0, v.to_le_bytes().to_vec(), 0));
                        }
                    } else if rx.ack_due() || rng.below(8) == 0 {
                        let v = rx.report();
                        acks.push_back((step + rng.below(50), v));
                    }
                },
                3 => {
                    if let Some(w) = back.front_mut() {
                        if w.land(&mut tail_word, 1 + rng.below(8) as usize) {
                            back.pop_front();
                        }
                    }
                }
                _ => {
                    if design == Design::Basic {
                        if tx.tail_word(u64::from_le_bytes(tail_word)) {
                            tail_word[7] = 0;
                        }
                        if let Some(h) = tx.head_due() {
                            head_write(&mut rng, &mut link, h, tx.sent);
                        }
                        continue;
                    }
                    while acks.front().is_some_and(|a| a.0 <= step) {
                        let (_, v) = acks.pop_front().unwrap();
                        tx.ack(v as u32);
                    }
                    if rng.below(16) == 0 {
                        if let Some(&(_, v)) = acks.back() {
                            // A stale copy of an old report changes nothing harmful.
                            tx.ack(v.wrapping_sub(sh.units()) as u32);
                        }
                    }
                }
            }
            assert!(tx.outstanding() <= sh.units());
        }
        fills
    }

    #[test]
    fn every_design_delivers_in_order_through_a_slow_torn_link() {
        for d in DESIGNS {
            let mut fills = 0;
            for seed in 1..=8 {
                fills += run(d, seed * 7919, 3000);
            }
            assert!(
                fills > 0,
                "{d:?}: the ring never filled, flow control untested"
            );
        }
    }

    #[test]
    fn a_full_ring_refuses_and_reopens_after_the_report() {
        let sh = shape(Design::Piggyback);
        let mut tx = Tx::new(sh);
        let mut rx = Rx::new(sh);
        let mut st = vec![0u8; sh.mem_len()];
        let len = sh.max_body();
        let mut n = 0;
        while let Some(p) = tx.place(&mut st, len) {
            assert_eq!(p.writes.len(), 1);
            n += 1;
        }
        assert!(
            (4..=5).contains(&n),
            "about four quarter-ring records, got {n}"
        );
        let mut ring = st.clone();
        for _ in 0..n {
            let Peek::Body { len: l, .. } = rx.peek(&mut ring[..]) else {
                panic!("a written record is complete");
            };
            rx.consume(&ring[..], l);
        }
        assert_eq!(rx.peek(&mut ring[..]), Peek::Empty);
        assert!(rx.ack_due());
        tx.ack(rx.report() as u32);
        assert!(tx.place(&mut st, len).is_some());
    }

    #[test]
    fn a_record_is_not_complete_before_its_last_byte() {
        for d in [Design::Piggyback, Design::Fastpath] {
            let sh = shape(d);
            let mut tx = Tx::new(sh);
            let mut rx = Rx::new(sh);
            let mut st = vec![0u8; sh.mem_len()];
            let p = tx.place(&mut st, 100).unwrap();
            let mut ring = vec![0u8; sh.mem_len()];
            let w = p.writes[0];
            let last = w.off + w.len - 1;
            ring[w.off..last].copy_from_slice(&st[w.off..last]);
            assert_eq!(rx.peek(&mut ring[..]), Peek::Empty, "{d:?}");
            ring[last] = st[last];
            assert_eq!(rx.peek(&mut ring[..]), Peek::Body { off: 8, len: 100 });
        }
    }

    #[test]
    fn a_tail_whose_old_byte_is_the_check_byte_moves_on() {
        let sh = shape(Design::Fastpath);
        let mut st = vec![0u8; sh.mem_len()];
        // The byte where a 100-byte body's tail flag ends holds the check byte already.
        let last = HEAD + up8(100) + TAIL - 1;
        st[last] = check_byte(sh.tag(0), 0);
        let p = Tx::new(sh).place(&mut st, 100).unwrap();
        assert_eq!(p.writes[0].len, HEAD + up8(100) + 8 + TAIL, "one pad");
        let mut ring = vec![0u8; sh.mem_len()];
        ring[last] = st[last];
        // Everything but the new last byte: not complete, although the old byte is there.
        let w = p.writes[0];
        ring[..w.len - 1].copy_from_slice(&st[..w.len - 1]);
        assert_eq!(Rx::new(sh).peek(&mut ring[..]), Peek::Empty);
        ring[w.len - 1] = st[w.len - 1];
        assert_eq!(
            Rx::new(sh).peek(&mut ring[..]),
            Peek::Body { off: 8, len: 100 }
        );
    }

    #[test]
    fn a_record_from_an_earlier_lap_is_not_new() {
        for d in DESIGNS.into_iter().skip(1) {
            let sh = shape(d);
            let mut tx = Tx::new(sh);
            let mut rx = Rx::new(sh);
            let mut st = vec![0u8; sh.mem_len()];
            let mut ring = st.clone();
            for _ in 0..sh.units() as usize * 2 {
                let Some(p) = tx.place(&mut st, 16) else {
                    break;
                };
                ring.copy_from_slice(&st);
                let Peek::Body { len, .. } = rx.peek(&mut ring[..]) else {
                    panic!("complete")
                };
                assert_eq!(len, p.len);
                rx.consume(&ring[..], len);
                tx.ack(rx.report() as u32);
            }
            // The ring holds more than a lap of old records; none of them is new.
            assert_eq!(rx.peek(&mut ring[..]), Peek::Empty, "{d:?}");
        }
    }

    #[test]
    fn pipeline_cuts_records_into_chunks() {
        let sh = shape(Design::Pipeline);
        let mut tx = Tx::new(sh);
        let mut st = vec![0u8; sh.mem_len()];
        let p = tx.place(&mut st, 900).unwrap();
        let rec = HEAD + 904 + TAIL;
        assert_eq!(p.writes.len(), rec.div_ceil(128));
        assert!(p.writes.len() <= tx.writes_for(900));
        assert_eq!(p.writes.iter().map(|w| w.len).sum::<usize>(), rec);
    }

    #[test]
    fn basic_takes_one_head_pointer_at_a_time_and_refuses_a_wild_one() {
        let sh = shape(Design::Basic);
        let mut tx = Tx::new(sh);
        let mut st = vec![0u8; sh.mem_len()];
        let h1 = tx.place(&mut st, 10).unwrap().head.unwrap();
        assert_eq!(
            tx.place(&mut st, 10).unwrap().head,
            None,
            "the first is unanswered"
        );
        let mut ring = st.clone();
        let mut rx = Rx::new(sh);
        assert_eq!(rx.peek(&mut ring[..]), Peek::Empty, "no head pointer yet");
        ring[sh.head_at()..][..8].copy_from_slice(&h1.to_le_bytes());
        assert_eq!(rx.peek(&mut ring[..]), Peek::Body { off: 8, len: 10 });
        assert_eq!(ring[sh.head_at() + 7], 0, "flag taken");
        rx.consume(&ring[..], 10);
        assert!(rx.ack_due());
        assert!(tx.tail_word(pointer_word(rx.report())));
        let h2 = tx
            .head_due()
            .expect("answered: the next head pointer may go");
        assert_eq!(h2 & VALUE_MASK, 48, "both records");
        // A head pointer beyond a lap: the peer's doing.
        let mut bad = ring.clone();
        bad[sh.head_at()..][..8].copy_from_slice(&pointer_word(1 << 20).to_le_bytes());
        assert_eq!(rx.clone().peek(&mut bad[..]), Peek::Bad);
    }

    proptest! {
        /// Whatever a peer writes into the ring, the receiver says Empty, Bad or a body that
        /// lies inside its memory; it never panics.
        #[test]
        fn arbitrary_ring_contents_are_safe(
            seed in any::<u64>(),
            d in 0usize..4,
        ) {
            let sh = shape(DESIGNS[d]);
            let mut rng = Rng::new(seed);
            let mut mem: Vec<u8> = (0..sh.mem_len()).map(|_| rng.next_u64() as u8).collect();
            let mut rx = Rx::new(sh);
            for _ in 0..8 {
                match rx.peek(&mut mem[..]) {
                    Peek::Body { off, len } => {
                        prop_assert!(off + len <= sh.mem_len());
                        rx.consume(&mem[..], len);
                    }
                    _ => break,
                }
            }
        }

        #[test]
        fn seeded_runs(seed in 1u64..u64::MAX, d in 0usize..4) {
            run(DESIGNS[d], seed, 300);
        }
    }
}

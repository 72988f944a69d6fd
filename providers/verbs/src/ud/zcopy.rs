//! UD zero-copy (MVAPICH-Aptus' UD-ZCopy), the parts without I/O: the key a receiver hands
//! out, the immediate data that names a piece, the control messages, and the receive side's
//! bookkeeping — which posted receive got which piece, which pieces are in place, what the
//! next round asks for.
//!
//! A large message is cut into pieces of the path MTU. The receiver takes a UD queue pair from
//! a small pool and posts its user buffer there, one receive per piece (the GRH goes to a
//! scratch buffer ahead of it); the sender sends the pieces with the piece's number in the
//! immediate data. A datagram queue pair consumes its receives in order, so a piece lands in
//! its own place unless an earlier one was lost (or a stray datagram arrived): then every
//! later piece of the round lands one receive early.
//!
//! Aptus retries the whole transfer on a loss. Here the transfer goes in **rounds**: after a
//! round the sender says `Done`; the receiver checks each completion's immediate data against
//! the piece its receive was posted for, **moves** pieces that landed early to their place
//! (a copy of only those, once no receive is posted over the target), and grants a next
//! round of exactly the pieces still missing — receives left over from the round first, in
//! their order, then new ones. One lost packet costs one piece sent again, not the message.
//!
//! A receive into memory other pending receives may write too (`Access::shared`: a window of
//! receives into one buffer) never moves: what it would read back may be another receive's
//! by then, and copied to another place it would leave bytes of the wrong offset behind. It
//! asks for every piece that landed out of place again (a loss then costs the rest of its
//! round), so each place is last written by the wire with its own piece.

use std::collections::VecDeque;

/// Bits of the piece number in the immediate data (a transfer has at most 2^20 pieces).
pub const PIECE_BITS: u32 = 20;
pub const MAX_PIECES: u32 = 1 << PIECE_BITS;
/// Transfer numbers are 12 bits: enough to tell a stray datagram of an earlier transfer.
pub const XFER_MASK: u32 = 0xfff;

/// The remote key of a zero-copy receive: the receiver's queue pair, the transfer, how many
/// pieces the first round takes (posted before the key is handed out), and the piece size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub qpn: u32,
    pub xfer: u32,
    pub first: u32,
    pub piece: usize,
}

impl Key {
    const TAG: u64 = 1 << 63;

    pub fn encode(&self) -> u64 {
        Self::TAG
            | (self.piece.trailing_zeros() as u64) << 56
            | ((self.qpn & 0xff_ffff) as u64) << 32
            | ((self.xfer & XFER_MASK) as u64) << PIECE_BITS
            | (self.first & (MAX_PIECES - 1)) as u64
    }

    pub fn decode(k: u64) -> Option<Key> {
        let shift = (k >> 56) & 0x7f;
        if k & Self::TAG == 0 || !(8..=12).contains(&shift) {
            return None;
        }
        Some(Key {
            qpn: ((k >> 32) & 0xff_ffff) as u32,
            xfer: ((k >> PIECE_BITS) as u32) & XFER_MASK,
            first: (k as u32) & (MAX_PIECES - 1),
            piece: 1 << shift,
        })
    }
}

/// The immediate data of piece `piece` of transfer `xfer`.
pub fn imm(xfer: u32, piece: u32) -> u32 {
    (xfer & XFER_MASK) << PIECE_BITS | piece
}

/// (transfer, piece) of an immediate.
pub fn split_imm(imm: u32) -> (u32, u32) {
    (imm >> PIECE_BITS, imm & (MAX_PIECES - 1))
}

/// Control messages, carried reliably and in order by the peers' link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ctl {
    /// Sender → receiver: every piece of `round` was posted.
    Done { xfer: u32, round: u32 },
    /// Receiver → sender: send these pieces, in this order, as round `round`.
    Grant {
        xfer: u32,
        round: u32,
        pieces: Vec<u32>,
    },
    /// Receiver → sender: every piece is in place.
    Fin { xfer: u32 },
    /// Receiver → sender: the transfer is gone (its receive ended, or too many rounds failed).
    Abort { xfer: u32 },
}

const C_DONE: u8 = 1;
const C_GRANT: u8 = 2;
const C_FIN: u8 = 3;
const C_ABORT: u8 = 4;
const GRANT_HDR: usize = 11;

/// Ranges of consecutive pieces in `pieces`.
fn ranges(pieces: &[u32]) -> Vec<(u32, u32)> {
    let mut v: Vec<(u32, u32)> = Vec::new();
    for &p in pieces {
        match v.last_mut() {
            Some((s, n)) if *s + *n == p => *n += 1,
            _ => v.push((p, 1)),
        }
    }
    v
}

/// How many ranges a grant of `room` bytes holds.
pub fn max_ranges(room: usize) -> usize {
    room.saturating_sub(GRANT_HDR) / 8
}

impl Ctl {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16);
        let (k, x) = match self {
            Ctl::Done { xfer, .. } => (C_DONE, xfer),
            Ctl::Grant { xfer, .. } => (C_GRANT, xfer),
            Ctl::Fin { xfer } => (C_FIN, xfer),
            Ctl::Abort { xfer } => (C_ABORT, xfer),
        };
        b.push(k);
        b.extend_from_slice(&x.to_le_bytes());
        match self {
            Ctl::Done { round, .. } => b.extend_from_slice(&round.to_le_bytes()),
            Ctl::Grant { round, pieces, .. } => {
                b.extend_from_slice(&round.to_le_bytes());
                let r = ranges(pieces);
                b.extend_from_slice(&(r.len() as u16).to_le_bytes());
                for (s, n) in r {
                    b.extend_from_slice(&s.to_le_bytes());
                    b.extend_from_slice(&n.to_le_bytes());
                }
            }
            _ => {}
        }
        b
    }

    /// `None` for anything malformed (a piece number past [`MAX_PIECES`] included).
    pub fn decode(b: &[u8]) -> Option<Ctl> {
        let u = |o: usize| -> Option<u32> {
            Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
        };
        let xfer = u(1)?;
        Some(match *b.first()? {
            C_DONE => Ctl::Done { xfer, round: u(5)? },
            C_FIN => Ctl::Fin { xfer },
            C_ABORT => Ctl::Abort { xfer },
            C_GRANT => {
                let round = u(5)?;
                let nr = u16::from_le_bytes(b.get(9..11)?.try_into().ok()?) as usize;
                let mut pieces = Vec::new();
                for i in 0..nr {
                    let (s, n) = (u(GRANT_HDR + 8 * i)?, u(GRANT_HDR + 8 * i + 4)?);
                    if s as u64 + n as u64 > MAX_PIECES as u64
                        || pieces.len() + n as usize > MAX_PIECES as usize
                    {
                        return None;
                    }
                    pieces.extend(s..s + n);
                }
                Ctl::Grant {
                    xfer,
                    round,
                    pieces,
                }
            }
            _ => return None,
        })
    }
}

/// What the receiver does after a round.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Every piece is in place: tell the sender (`Fin`).
    Finished,
    /// Post receives for `new` (in this order, after those still posted), then grant
    /// `pieces` as round `round`.
    Grant {
        round: u32,
        new: Vec<u32>,
        pieces: Vec<u32>,
    },
    /// Rounds stopped making progress: give up (`Abort`).
    Stuck,
}

/// A piece that landed in another piece's place: (the place it landed in, the piece, bytes).
type Landing = (u32, u32, usize);
/// A copy to make: (from piece place, to piece place, bytes).
pub type Move = (u32, u32, usize);

/// The receive side of one transfer.
#[derive(Debug)]
pub struct Recv {
    pub xfer: u32,
    len: usize,
    piece: usize,
    n: u32,
    good: Vec<bool>,
    ngood: u32,
    /// Pieces whose receives are posted, in posting (= consumption) order.
    posted: VecDeque<u32>,
    is_posted: Vec<bool>,
    landed: Vec<Landing>,
    round: u32,
    depth: usize,
    max_ranges: usize,
    idle_rounds: u32,
    /// Pieces in place at the end of the previous round.
    good_then: u32,
    /// Pieces that landed early may be copied to their place (the memory is this receive's
    /// alone).
    moves: bool,
    /// Pieces moved into place, pieces asked for again.
    pub moved: u64,
    pub regranted: u64,
}

/// Rounds in a row that may put no new piece in place before the transfer is given up.
const MAX_IDLE_ROUNDS: u32 = 32;

impl Recv {
    /// A transfer of `len` bytes in pieces of `piece`; at most `depth` receives posted at once
    /// and `max_ranges` ranges per grant. Without `moves` (memory shared with other receives)
    /// a piece out of place is asked for again instead of copied.
    pub fn new(
        xfer: u32,
        len: usize,
        piece: usize,
        depth: usize,
        max_ranges: usize,
        moves: bool,
    ) -> Recv {
        let n = len.div_ceil(piece) as u32;
        Recv {
            xfer,
            len,
            piece,
            n,
            good: vec![false; n as usize],
            ngood: 0,
            posted: VecDeque::new(),
            is_posted: vec![false; n as usize],
            landed: Vec::new(),
            round: 0,
            depth,
            max_ranges: max_ranges.max(1),
            idle_rounds: 0,
            good_then: 0,
            moves,
            moved: 0,
            regranted: 0,
        }
    }

    #[cfg(test)]
    pub fn pieces(&self) -> u32 {
        self.n
    }

    #[cfg(test)]
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Byte offset and length of piece `k`'s place.
    pub fn region(&self, k: u32) -> (usize, usize) {
        let off = k as usize * self.piece;
        (off, self.piece.min(self.len - off))
    }

    pub fn has_posted(&self) -> bool {
        !self.posted.is_empty()
    }

    /// Missing pieces without a posted receive, ascending, that the next round takes: room
    /// for `depth` receives and for the ranges of one grant (those still posted first).
    fn take_new(&mut self) -> Vec<u32> {
        let room = self.depth.saturating_sub(self.posted.len());
        let mut all: Vec<u32> = self.posted.iter().copied().collect();
        let mut nr = ranges(&all).len();
        let mut new = Vec::new();
        for k in 0..self.n {
            if new.len() >= room {
                break;
            }
            if self.good[k as usize] || self.is_posted[k as usize] {
                continue;
            }
            let extends = all.last().is_some_and(|&l| l + 1 == k);
            if !extends {
                if nr >= self.max_ranges {
                    break;
                }
                nr += 1;
            }
            all.push(k);
            new.push(k);
        }
        for &k in &new {
            self.is_posted[k as usize] = true;
            self.posted.push_back(k);
        }
        new
    }

    /// The receives of the first round (posted before the key goes out).
    pub fn first(&mut self) -> Vec<u32> {
        self.take_new()
    }

    /// The next posted receive completed: with `got` = (the piece its immediate named, bytes)
    /// when data arrived, `None` on an error completion. Returns the piece the receive was
    /// posted for (`None`: no receive was posted — a completion that is not ours).
    pub fn on_landed(&mut self, got: Option<(u32, u32, usize)>) -> Option<u32> {
        let k = self.posted.pop_front()?;
        self.is_posted[k as usize] = false;
        if let Some((xfer, p, bytes)) = got {
            if xfer == self.xfer && p < self.n {
                if p == k && bytes == self.region(k).1 {
                    if !self.good[k as usize] {
                        self.good[k as usize] = true;
                        self.ngood += 1;
                    }
                } else if bytes == self.region(p).1 {
                    self.landed.push((k, p, bytes));
                }
            }
        }
        Some(k)
    }

    /// The sender finished round `round`. Returns the copies to make now — (from piece
    /// place, to piece place, bytes), in this order, before anything else touches the buffer
    /// — and what comes next; `None` for a stale round.
    pub fn on_done(&mut self, round: u32) -> Option<(Vec<Move>, Next)> {
        if round != self.round {
            return None;
        }
        // Progress since the last round's end: pieces that landed in place, then those moved.
        let before = self.good_then;
        // A piece that landed early (in a place before its own) is copied to its place if that
        // is still missing and has no receive posted (nothing else writes there then). From
        // the highest place down: a place is read before anything is copied into it.
        let mut landed = std::mem::take(&mut self.landed);
        landed.sort_unstable_by_key(|l| std::cmp::Reverse(l.0));
        let mut moves = Vec::new();
        for (at, p, bytes) in landed {
            if self.moves && p > at && !self.good[p as usize] && !self.is_posted[p as usize] {
                self.good[p as usize] = true;
                self.ngood += 1;
                self.moved += 1;
                moves.push((at, p, bytes));
            }
        }
        self.good_then = self.ngood;
        if self.ngood == self.n {
            return Some((moves, Next::Finished));
        }
        if self.ngood == before {
            self.idle_rounds += 1;
            if self.idle_rounds >= MAX_IDLE_ROUNDS {
                return Some((moves, Next::Stuck));
            }
        } else {
            self.idle_rounds = 0;
        }
        self.round += 1;
        let new = self.take_new();
        self.regranted += self.posted.len() as u64;
        let pieces = self.posted.iter().copied().collect();
        Some((
            moves,
            Next::Grant {
                round: self.round,
                new,
                pieces,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_and_immediates_round_trip() {
        let k = Key {
            qpn: 0xab_cdef,
            xfer: 0x123,
            first: 512,
            piece: 2048,
        };
        assert_eq!(Key::decode(k.encode()), Some(k));
        assert_eq!(Key::decode(0x1234), None, "a key without the tag");
        assert_eq!(split_imm(imm(0x123, 77)), (0x123, 77));
    }

    #[test]
    fn control_messages_round_trip_and_reject_garbage() {
        for c in [
            Ctl::Done { xfer: 3, round: 9 },
            Ctl::Fin { xfer: 4 },
            Ctl::Abort { xfer: 5 },
            Ctl::Grant {
                xfer: 6,
                round: 2,
                pieces: vec![7, 8, 9, 1, 2, 40],
            },
        ] {
            assert_eq!(Ctl::decode(&c.encode()), Some(c));
        }
        assert_eq!(Ctl::decode(&[]), None);
        assert_eq!(Ctl::decode(&[9, 0, 0, 0, 0]), None);
        let mut g = Ctl::Grant {
            xfer: 1,
            round: 1,
            pieces: vec![1],
        }
        .encode();
        g[11..15].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Ctl::decode(&g), None, "a range past the last piece");
    }

    /// Simulate rounds: the sender sends what was granted, `lose(round, i)` drops the i-th
    /// datagram of a round; a buffer of piece numbers stands for the user's memory.
    fn run(
        n_bytes: usize,
        piece: usize,
        depth: usize,
        lose: impl Fn(u32, usize) -> bool,
    ) -> (Recv, u32) {
        run_with(n_bytes, piece, depth, true, lose)
    }

    /// As [`run`]; `moves` off also checks that no place is ever read back.
    fn run_with(
        n_bytes: usize,
        piece: usize,
        depth: usize,
        moves: bool,
        lose: impl Fn(u32, usize) -> bool,
    ) -> (Recv, u32) {
        let mut r = Recv::new(1, n_bytes, piece, depth, 8, moves);
        let mut mem: Vec<Option<u32>> = vec![None; r.pieces() as usize];
        let mut grant = r.first();
        let mut rounds = 0;
        loop {
            rounds += 1;
            let sent: Vec<u32> = grant.clone();
            for (i, p) in sent.iter().enumerate() {
                if lose(rounds, i) {
                    continue;
                }
                let bytes = r.region(*p).1;
                // The datagram consumes the next posted receive, if any.
                let Some(&at) = r.posted.front() else { break };
                if bytes <= r.region(at).1 {
                    mem[at as usize] = Some(*p);
                    r.on_landed(Some((1, *p, bytes)));
                } else {
                    r.on_landed(None);
                }
            }
            let (copies, next) = r.on_done(r.round()).expect("current round");
            assert!(
                moves || copies.is_empty(),
                "a shared receive copied {copies:?}"
            );
            for (from, to, _) in copies {
                assert_eq!(mem[from as usize], Some(to));
                mem[to as usize] = mem[from as usize];
            }
            match next {
                Next::Finished => break,
                Next::Stuck => panic!("stuck"),
                Next::Grant { pieces, .. } => grant = pieces,
            }
            assert!(rounds < 1000);
        }
        for (k, m) in mem.iter().enumerate() {
            assert_eq!(*m, Some(k as u32), "piece {k}");
        }
        (r, rounds)
    }

    #[test]
    fn no_loss_takes_one_round() {
        let (r, rounds) = run(1 << 20, 2048, 1024, |_, _| false);
        assert_eq!((rounds, r.moved, r.regranted), (1, 0, 0));
    }

    #[test]
    fn one_loss_costs_one_piece_not_the_message() {
        // Piece 10 of 512 lost: pieces 11..=511 land one receive early, and 11..=510 are
        // moved to their places; the last piece's receive is still posted, so piece 511 is
        // asked for again into it, with piece 10 into a new one.
        let (r, rounds) = run(1 << 20, 2048, 1024, |round, i| round == 1 && i == 10);
        assert_eq!(rounds, 2);
        assert_eq!(
            r.moved, 500,
            "pieces 11..=510 moved from the place before theirs"
        );
        assert!(r.regranted <= 2, "resent {}", r.regranted);
    }

    #[test]
    fn a_shared_receive_asks_again_for_what_landed_out_of_place() {
        // The same loss as above into shared memory: nothing is copied; pieces 11..=510,
        // which landed one place early, are asked for again with piece 10 (and 511 into the
        // receive still posted for it), and land in their own places in the second round.
        let (r, rounds) = run_with(1 << 20, 2048, 1024, false, |round, i| round == 1 && i == 10);
        assert_eq!((rounds, r.moved), (2, 0));
        assert_eq!(r.regranted, 502, "pieces 10..=511 sent again");
    }

    #[test]
    fn pieces_landing_in_place_count_as_progress() {
        // Every round loses its last datagram, so nothing ever lands early and nothing is
        // moved: progress is only what landed in place, round after round (more than the 32
        // rounds without progress after which a transfer is given up).
        let (r, rounds) = run(1 << 20, 2048, 4, |_, i| i == 3);
        assert!(rounds > 100, "{rounds} rounds");
        assert_eq!(r.moved, 0);
    }

    #[test]
    fn a_message_larger_than_the_depth_goes_in_several_rounds() {
        let (_, rounds) = run(1 << 20, 2048, 100, |_, _| false);
        assert_eq!(rounds, 6);
    }

    /// Whether piece `i` of round `round` is lost: `loss` % of them, drawn from `seed`, the
    /// round and the piece (the same answer however often it is asked).
    fn lossy(seed: u64, loss: u32) -> impl Fn(u32, usize) -> bool {
        move |round: u32, i: usize| {
            let mut rng = weft_proto::sim::Rng::new(seed ^ (round as u64) << 32 ^ i as u64);
            rng.below(100) < loss as u64
        }
    }

    proptest! {
        /// A peer's control message: any bytes decode to a message or `None`, never a panic,
        /// and what decodes encodes back to the same message.
        #[test]
        fn ctl_decode_never_panics_and_round_trips(
            b in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            if let Some(c) = Ctl::decode(&b) {
                prop_assert_eq!(Ctl::decode(&c.encode()), Some(c));
            }
        }

        #[test]
        fn every_piece_arrives_whatever_is_lost(
            len in 1usize..200_000,
            depth in 4usize..300,
            seed in any::<u64>(),
            loss in 0u32..40,
        ) {
            let h = lossy(seed, loss);
            run(len, 1024, depth, h);
        }

        #[test]
        fn every_piece_arrives_in_shared_memory_without_copies(
            len in 1usize..200_000,
            depth in 4usize..300,
            seed in any::<u64>(),
            loss in 0u32..40,
        ) {
            let h = lossy(seed, loss);
            run_with(len, 1024, depth, false, h);
        }
    }
}

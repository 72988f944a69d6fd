// Over 800 lines: its unit tests, below the code (which is under 800), test it through its private state.
//! Lazy RC allocation under per-process limits, without I/O (paper 001, section on channel
//! allocation; issue 21).
//!
//! Every peer starts on UD alone. A peer that exchanges `threshold` messages with this process
//! earns an RC connection if this process and the peer both have one to spare (`max_rc` each);
//! each process offers RC-FP rings to at most `max_fp` of its RC peers. The two sides agree by
//! control messages that the provider carries over UD-SR (in order per peer):
//!
//! - `Ask` → `Yes` (both sides count the connection, then connect) or `No` (the asker backs
//!   off: it asks again after twice as many messages). Two processes that ask each other at
//!   once both answer `Yes` to the other's `Ask` and end with one connection, counted once on
//!   each side — Aptus allowed up to two extra connections in that race; here there are none.
//! - With `fair`, a process at its limit that refuses an asker holding fewer connections than
//!   one of its own RC peers asks that peer to yield: `Ask` carries the asker's count of
//!   connections to others, `Yield` passes it on, and the peer compares it with its own. If the
//!   peer holds more, it closes the connection (`Close`, as below) and the process, its slot
//!   free, asks the starved asker itself; otherwise the peer answers `Keep` with its count,
//!   which the process remembers when picking the next peer to ask. Each swap moves a
//!   connection from a process to one with fewer, so the sum of the squares of the counts
//!   falls and the swaps end; a greedy agreement can instead leave a process that asked late
//!   with most of its peers on UD while theirs are all taken (docs/history/benchmarks-notebook.md).
//! - With `rebalance`, a process at its limit that sees a busier peer closes its least-recently
//!   used connection, if that one has been idle for `threshold` messages: `Close`, each side
//!   stops sending on RC to the other and waits until what it sent there has completed
//!   ([`Budget::drained`]), then sends `Closed`; each side tears down once it has drained and
//!   received `Closed`. Messages sent meanwhile go over UD and the receiver's reordering
//!   ([`weft_proto::order`]) puts them after the ones still on RC, so none is lost or reordered.
//!
//! The provider feeds it [`Budget::note`] for each message to or from a peer, the control
//! messages that arrive ([`Budget::on_ctrl`]) and drain notices, and carries out the
//! [`Action`]s it returns.

use weft_provider::peers::PeerTable;

/// Peer rank.
pub type Rank = u32;

/// The limits (`WEFT_HYBRID_RC_THRESHOLD`, `WEFT_HYBRID_MAX_RC`, `WEFT_HYBRID_MAX_FP`,
/// `WEFT_HYBRID_REBALANCE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Messages exchanged with a peer before it earns an RC connection (MVAPICH: 100).
    pub threshold: u64,
    /// RC connections per process (paper 001: 16).
    pub max_rc: usize,
    /// RC-FP rings offered per process (paper 001: 8).
    pub max_fp: usize,
    /// Give the least-recently-used connection to a busier peer when at the limit.
    pub rebalance: bool,
    /// At the limit, ask a peer holding more connections than a refused asker to yield its
    /// connection to it.
    pub fair: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            threshold: 100,
            max_rc: 16,
            max_fp: 8,
            rebalance: false,
            fair: true,
        }
    }
}

/// A count of RC connections on the wire (saturating).
pub type Count = u16;

/// A control message between the budgets of two processes. The counts are of RC slots held
/// towards processes other than the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ctrl {
    /// May we connect? With the asker's count.
    Ask(Count),
    Yes,
    No,
    Close,
    Closed,
    /// Would you give our connection to a process that holds this many?
    Yield(Count),
    /// No: I hold this many.
    Keep(Count),
}

impl Ctrl {
    /// The kind's byte on the wire.
    pub fn code(self) -> u8 {
        match self {
            Ctrl::Ask(_) => 1,
            Ctrl::Yes => 2,
            Ctrl::No => 3,
            Ctrl::Close => 4,
            Ctrl::Closed => 5,
            Ctrl::Yield(_) => 6,
            Ctrl::Keep(_) => 7,
        }
    }

    /// The count it carries, if its kind carries one (two bytes after the code).
    pub fn count(self) -> Option<Count> {
        match self {
            Ctrl::Ask(n) | Ctrl::Yield(n) | Ctrl::Keep(n) => Some(n),
            _ => None,
        }
    }

    /// Whether the kind `code` carries a count; `None` for no kind.
    pub fn takes_count(code: u8) -> Option<bool> {
        if Ctrl::from_parts(code, Some(0)).is_some() {
            Some(true)
        } else {
            Ctrl::from_parts(code, None).map(|_| false)
        }
    }

    /// Undo [`Ctrl::code`] and [`Ctrl::count`]: `None` for no kind, or a count where the kind
    /// takes none or none where it takes one.
    pub fn from_parts(code: u8, count: Option<Count>) -> Option<Ctrl> {
        Some(match (code, count) {
            (1, Some(n)) => Ctrl::Ask(n),
            (2, None) => Ctrl::Yes,
            (3, None) => Ctrl::No,
            (4, None) => Ctrl::Close,
            (5, None) => Ctrl::Closed,
            (6, Some(n)) => Ctrl::Yield(n),
            (7, Some(n)) => Ctrl::Keep(n),
            _ => return None,
        })
    }
}

/// What the provider must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Send this control message to the peer (over UD-SR).
    Send(Rank, Ctrl),
    /// Both sides agreed: make the RC connection (the connection manager settles who answers
    /// whom) and send over it from now on.
    Connect(Rank),
    /// Stop sending to the peer over RC; call [`Budget::drained`] once every RC send to it has
    /// completed.
    Drain(Rank),
    /// Both sides drained: take in what already arrived over RC, then destroy the connection.
    Teardown(Rank),
    /// Offer the peer an RC-FP ring (receive buffers dedicated to it).
    OpenFp(Rank),
    /// Withdraw the peer's RC-FP ring (before its connection goes).
    CloseFp(Rank),
}

/// The RC state towards one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RcState {
    /// UD only.
    #[default]
    Ud,
    /// `Ask` sent, no answer yet (a slot is held for it).
    Asked,
    /// Connected (or connecting): sends may use RC.
    Up,
    /// Tearing down: no new RC sends.
    Closing { drained: bool, closed: bool },
}

/// The budget's part of a peer's record, 8 bytes: a job has one per peer talked to. The
/// time of last use is kept only for the few peers holding an RC slot ([`Budget`]'s list).
#[derive(Debug, Default, Clone, Copy)]
pub struct Link {
    /// Messages exchanged since the peer last went to UD or was refused (saturating: far past
    /// any threshold that means something).
    msgs: u32,
    rc: RcState,
    /// `No`s since the last connection (the wait before asking again doubles with each).
    refusals: u8,
    fp: bool,
}

/// A per-peer record that holds the budget's [`Link`]: a provider widens it with its own
/// per-peer fields, so that one table and one lookup serve both.
pub trait Record: Default {
    fn link(&self) -> &Link;
    fn link_mut(&mut self) -> &mut Link;
}

impl Link {
    /// The RC state this link records.
    #[inline]
    pub fn state(&self) -> RcState {
        self.rc
    }
}

impl Record for Link {
    fn link(&self) -> &Link {
        self
    }
    fn link_mut(&mut self) -> &mut Link {
        self
    }
}

/// A peer holding an RC slot (asked, up or closing).
#[derive(Debug, Clone, Copy)]
struct Conn {
    peer: Rank,
    /// The budget's message clock at the last message with the peer (rebalancing).
    last_use: u64,
    /// The connections the peer holds to others, as its last `Keep` said (`UNKNOWN` before):
    /// whom to ask to yield first.
    others: Count,
}

/// A peer's count of connections not yet heard.
const UNKNOWN: Count = Count::MAX;

/// Counts for `WEFT_HYBRID_STATS`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BudgetStats {
    pub asked: u64,
    pub refused: u64,
    pub opened: u64,
    pub closed: u64,
    pub fp_opened: u64,
    pub fp_closed: u64,
    /// `Yield`s sent for a refused asker, and connections given up when asked.
    pub yields_asked: u64,
    pub yielded: u64,
}

/// One process's RC and RC-FP budget, and the per-peer records (`R`) it keeps.
#[derive(Debug)]
pub struct Budget<R: Record = Link> {
    me: Rank,
    limits: Limits,
    /// Per-peer records (four bytes per rank of the job, a record per peer talked to).
    peers: PeerTable<R>,
    /// The peers holding an RC slot: at most `max_rc` (each side counts a connection once).
    conns: Vec<Conn>,
    clock: u64,
    stats: BudgetStats,
    /// The `Yield` awaiting an answer: (the peer asked to yield, the refused asker its slot
    /// goes to). One at a time.
    yielding: Option<(Rank, Rank)>,
}

impl<R: Record> Budget<R> {
    /// The budget of rank `me` in a job of `size` ranks.
    pub fn new(me: Rank, size: u32, limits: Limits) -> Self {
        Budget {
            me,
            limits,
            peers: PeerTable::new(size as usize),
            conns: Vec::new(),
            clock: 0,
            stats: BudgetStats::default(),
            yielding: None,
        }
    }

    /// Bytes of per-peer state (every peer talked to) and of the RC list.
    pub fn bytes(&self) -> usize {
        self.peers.bytes() + self.conns.capacity() * std::mem::size_of::<Conn>()
    }

    /// `peer`'s record (the idle one if never touched); `None` past the end.
    #[inline]
    pub fn peer(&self, peer: Rank) -> Option<&R> {
        self.peers.get(peer as usize)
    }

    /// `peer`'s record, made at first touch; `None` past the end.
    #[inline]
    pub fn peer_mut(&mut self, peer: Rank) -> Option<&mut R> {
        self.peers.get_mut(peer as usize)
    }

    /// `peer`'s record only if it was touched (no allocation).
    pub fn touched_mut(&mut self, peer: Rank) -> Option<&mut R> {
        self.peers.touched_mut(peer as usize)
    }

    /// Make `peer`'s record (first contact), counting nothing.
    pub fn touch(&mut self, peer: Rank) {
        if peer != self.me {
            self.peers.get_mut(peer as usize);
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn stats(&self) -> BudgetStats {
        self.stats
    }

    fn link(&self, peer: Rank) -> Option<&Link> {
        self.peers.get(peer as usize).map(Record::link)
    }

    fn link_mut(&mut self, peer: Rank) -> Option<&mut Link> {
        self.peers.touched_mut(peer as usize).map(Record::link_mut)
    }

    /// The RC state towards `peer`.
    #[inline]
    pub fn state(&self, peer: Rank) -> RcState {
        self.link(peer).map_or(RcState::Ud, |p| p.rc)
    }

    /// Sends to `peer` may use RC (and RC-FP where [`Budget::has_fp`]).
    pub fn rc_open(&self, peer: Rank) -> bool {
        self.state(peer) == RcState::Up
    }

    /// This process offered `peer` an RC-FP ring.
    pub fn has_fp(&self, peer: Rank) -> bool {
        self.link(peer).is_some_and(|p| p.fp)
    }

    /// RC slots in use: asked, up or closing.
    pub fn rc_used(&self) -> usize {
        self.conns.len()
    }

    /// RC slots held towards others than `peer` (saturating to the wire's count).
    fn others_than(&self, peer: Rank) -> Count {
        let n = self.conns.iter().filter(|c| c.peer != peer).count();
        Count::try_from(n).unwrap_or(Count::MAX - 1)
    }

    /// RC-FP rings offered.
    pub fn fp_used(&self) -> usize {
        self.conns.iter().filter(|c| self.has_fp(c.peer)).count()
    }

    /// The message count from which `p` asks for RC: the threshold, doubled for each refusal
    /// (saturating).
    fn ask_at(&self, p: &Link) -> u32 {
        let t = self.limits.threshold.max(1);
        let wait = t.saturating_mul(1 << p.refusals.min(16));
        u32::try_from(wait).unwrap_or(u32::MAX)
    }

    /// Give `peer` an RC slot (it had none), in state `rc`.
    fn hold(&mut self, peer: Rank, rc: RcState) {
        let clock = self.clock;
        if let Some(p) = self.link_mut(peer) {
            p.rc = rc;
        }
        self.conns.push(Conn {
            peer,
            last_use: clock,
            others: UNKNOWN,
        });
    }

    /// `peer` goes back to UD: its slot is free.
    fn release(&mut self, peer: Rank) {
        if let Some(p) = self.link_mut(peer) {
            p.rc = RcState::Ud;
            p.msgs = 0;
        }
        self.conns.retain(|c| c.peer != peer);
    }

    /// A message was sent to or received from `peer`.
    pub fn note(&mut self, peer: Rank, out: &mut Vec<Action>) {
        self.note_if(peer, || true, out);
    }

    /// [`Budget::note`] for a message that counts only if `counts()` (asked only when the
    /// count can still decide something, i.e. not for a connected peer without rebalancing).
    #[inline]
    pub fn note_if(&mut self, peer: Rank, counts: impl FnOnce() -> bool, out: &mut Vec<Action>) {
        if peer == self.me || peer as usize >= self.peers.len() {
            return;
        }
        let rebalance = self.limits.rebalance;
        let p = self.peers[peer as usize].link_mut();
        // Past `Ud` the count decides nothing, and the time of last use only picks what
        // rebalancing closes: without it, a connected peer's messages need no bookkeeping.
        if (!rebalance && p.rc != RcState::Ud) || !counts() {
            return;
        }
        self.clock += 1;
        if p.rc != RcState::Ud {
            let clock = self.clock;
            if let Some(c) = self.conns.iter_mut().find(|c| c.peer == peer) {
                c.last_use = clock;
            }
            return;
        }
        p.msgs = p.msgs.saturating_add(1);
        let p = *p;
        if p.msgs < self.ask_at(&p) {
            return;
        }
        if self.rc_used() < self.limits.max_rc {
            self.ask(peer, out);
        } else {
            self.evict_for(peer, out);
        }
    }

    /// Hold a slot for `peer` (on UD, a slot free) and ask it.
    fn ask(&mut self, peer: Rank, out: &mut Vec<Action>) {
        self.hold(peer, RcState::Asked);
        self.stats.asked += 1;
        out.push(Action::Send(peer, Ctrl::Ask(self.others_than(peer))));
    }

    /// With `fair` on, at the limit, `asker` (holding `held` connections to others) was
    /// refused: ask the RC peer most likely to hold more than it to yield. Whether it does is
    /// its call, on its own count; `false` if none was asked.
    fn ask_to_yield(&mut self, asker: Rank, held: Count, out: &mut Vec<Action>) -> bool {
        if !self.limits.fair || self.yielding.is_some() {
            return false;
        }
        let victim = self
            .conns
            .iter()
            .filter(|c| c.peer != asker && c.others > held && self.state(c.peer) == RcState::Up)
            .max_by_key(|c| (c.others, std::cmp::Reverse(c.last_use), c.peer))
            .map(|c| c.peer);
        let Some(v) = victim else {
            return false;
        };
        self.yielding = Some((v, asker));
        self.stats.yields_asked += 1;
        out.push(Action::Send(v, Ctrl::Yield(held)));
        true
    }

    /// `peer` failed: a `Yield` sent to it or for it will not be answered.
    pub fn peer_failed(&mut self, peer: Rank) {
        if self.yielding.is_some_and(|(v, a)| v == peer || a == peer) {
            self.yielding = None;
        }
    }

    /// With rebalancing on, start closing the least-recently-used connection that has been
    /// idle for `threshold` messages, to make room for `busier`.
    fn evict_for(&mut self, busier: Rank, out: &mut Vec<Action>) {
        if !self.limits.rebalance {
            return;
        }
        let idle = self.limits.threshold.max(1);
        let victim = self
            .conns
            .iter()
            .filter(|c| {
                c.peer != busier
                    && self.state(c.peer) == RcState::Up
                    && self.clock - c.last_use >= idle
            })
            .min_by_key(|c| (c.last_use, c.peer))
            .map(|c| c.peer);
        if let Some(v) = victim {
            self.start_close(v, out);
            out.push(Action::Send(v, Ctrl::Close));
        }
    }

    fn start_close(&mut self, peer: Rank, out: &mut Vec<Action>) {
        let Some(p) = self.link_mut(peer) else {
            return;
        };
        p.rc = RcState::Closing {
            drained: false,
            closed: false,
        };
        if std::mem::take(&mut p.fp) {
            self.stats.fp_closed += 1;
            out.push(Action::CloseFp(peer));
        }
        out.push(Action::Drain(peer));
    }

    /// `peer` (asked, or asking with a slot free) is up.
    fn go_up(&mut self, peer: Rank, out: &mut Vec<Action>) {
        if self.state(peer) == RcState::Ud {
            self.hold(peer, RcState::Up);
        }
        let fp_free = self.fp_used() < self.limits.max_fp;
        let Some(p) = self.link_mut(peer) else {
            return;
        };
        p.rc = RcState::Up;
        p.refusals = 0;
        p.fp = fp_free;
        self.stats.opened += 1;
        out.push(Action::Connect(peer));
        if fp_free {
            self.stats.fp_opened += 1;
            out.push(Action::OpenFp(peer));
        }
    }

    /// A control message from `peer` arrived.
    pub fn on_ctrl(&mut self, peer: Rank, msg: Ctrl, out: &mut Vec<Action>) {
        if peer == self.me || peer as usize >= self.peers.len() {
            return;
        }
        // A control message is the first contact with a peer that never sent data.
        self.touch(peer);
        let state = self.state(peer);
        match (msg, state) {
            (Ctrl::Ask(_), RcState::Up) => out.push(Action::Send(peer, Ctrl::Yes)),
            // Both asked at once: each says yes to the other; one connection, one slot each.
            (Ctrl::Ask(_), RcState::Asked) => {
                out.push(Action::Send(peer, Ctrl::Yes));
                self.go_up(peer, out);
            }
            (Ctrl::Ask(held), RcState::Ud) => {
                if self.rc_used() < self.limits.max_rc {
                    out.push(Action::Send(peer, Ctrl::Yes));
                    self.go_up(peer, out);
                } else {
                    self.stats.refused += 1;
                    out.push(Action::Send(peer, Ctrl::No));
                    // Make room: for this asker if a peer holds more connections than it, or
                    // for next time if it is busier than an idle connection.
                    if !self.ask_to_yield(peer, held, out) {
                        self.evict_for(peer, out);
                    }
                }
            }
            (Ctrl::Ask(_), RcState::Closing { .. }) => {
                self.stats.refused += 1;
                out.push(Action::Send(peer, Ctrl::No));
            }
            (Ctrl::Yes, RcState::Asked) => self.go_up(peer, out),
            (Ctrl::No, RcState::Asked) => {
                self.release(peer);
                if let Some(p) = self.link_mut(peer) {
                    p.refusals = p.refusals.saturating_add(1);
                }
            }
            (Ctrl::Close, RcState::Up) => self.start_close(peer, out),
            // Give our connection to a process holding fewer than we do (counting neither
            // this one nor the one it would gain), else say how many we hold.
            (Ctrl::Yield(held), s) => {
                let mine = self.others_than(peer);
                if s == RcState::Up && mine > held {
                    self.stats.yielded += 1;
                    self.start_close(peer, out);
                    out.push(Action::Send(peer, Ctrl::Close));
                } else {
                    out.push(Action::Send(peer, Ctrl::Keep(mine)));
                }
            }
            (Ctrl::Keep(n), _) => {
                if let Some(c) = self.conns.iter_mut().find(|c| c.peer == peer) {
                    c.others = n;
                }
                if self.yielding.is_some_and(|(v, _)| v == peer) {
                    self.yielding = None;
                }
            }
            (Ctrl::Closed, RcState::Closing { drained, .. }) => {
                if let Some(p) = self.link_mut(peer) {
                    p.rc = RcState::Closing {
                        drained,
                        closed: true,
                    };
                }
                self.finish_close(peer, out);
            }
            // Crossing or stale messages: a Yes after the crossing asks, a Close from a peer
            // that is closing too (both send Closed once drained), answers that raced a close.
            _ => {}
        }
    }

    /// Every RC send to `peer` has completed since [`Action::Drain`].
    pub fn drained(&mut self, peer: Rank, out: &mut Vec<Action>) {
        if let RcState::Closing {
            drained: false,
            closed,
        } = self.state(peer)
        {
            if let Some(p) = self.link_mut(peer) {
                p.rc = RcState::Closing {
                    drained: true,
                    closed,
                };
            }
            out.push(Action::Send(peer, Ctrl::Closed));
            self.finish_close(peer, out);
        }
    }

    fn finish_close(&mut self, peer: Rank, out: &mut Vec<Action>) {
        let both = RcState::Closing {
            drained: true,
            closed: true,
        };
        if self.state(peer) != both {
            return;
        }
        self.release(peer);
        self.stats.closed += 1;
        out.push(Action::Teardown(peer));
        // The slot a `Yield` freed (or any close while one was awaited) goes to the asker it
        // was for, if that one is still on UD here.
        if let Some((v, asker)) = self.yielding {
            if v == peer {
                self.yielding = None;
                if self.state(asker) == RcState::Ud && self.rc_used() < self.limits.max_rc {
                    self.ask(asker, out);
                }
            }
        }
        // A freed RC-FP ring goes to the most recently used connection without one.
        if self.fp_used() < self.limits.max_fp {
            let next = self
                .conns
                .iter()
                .filter(|c| self.state(c.peer) == RcState::Up && !self.has_fp(c.peer))
                .max_by_key(|c| (c.last_use, std::cmp::Reverse(c.peer)))
                .map(|c| c.peer);
            if let Some(r) = next {
                if let Some(p) = self.link_mut(r) {
                    p.fp = true;
                }
                self.stats.fp_opened += 1;
                out.push(Action::OpenFp(r));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, VecDeque};

    /// A job of 16K ranks holds one of these per peer talked to.
    #[test]
    fn a_peers_link_takes_8_bytes() {
        assert_eq!(std::mem::size_of::<Link>(), 8);
    }

    /// A refused peer asks again after twice as many messages each time, however large the
    /// threshold: the wait saturates instead of wrapping.
    #[test]
    fn the_wait_after_refusals_saturates() {
        let limits = Limits {
            threshold: u64::MAX / 2,
            ..Limits::default()
        };
        let mut b: Budget = Budget::new(0, 2, limits);
        let mut out = vec![];
        b.touch(1);
        b.hold(1, RcState::Asked);
        b.on_ctrl(1, Ctrl::No, &mut out);
        let link = *b.link(1).unwrap();
        assert_eq!(b.ask_at(&link), u32::MAX);
        assert_eq!(b.state(1), RcState::Ud);
        assert_eq!(b.rc_used(), 0);
    }

    /// `note_if` counts only the messages it is told count, and does not ask about a
    /// connected peer's messages unless rebalancing needs their time of use.
    #[test]
    fn note_if_counts_what_counts_and_asks_only_while_it_matters() {
        let limits = Limits {
            threshold: 3,
            ..Limits::default()
        };
        let mut b: Budget = Budget::new(0, 2, limits);
        let mut out = vec![];
        for _ in 0..5 {
            b.note_if(1, || false, &mut out);
        }
        assert!(out.is_empty(), "messages that do not count asked for RC");
        for _ in 0..2 {
            b.note_if(1, || true, &mut out);
        }
        assert!(out.is_empty(), "asked below the threshold");
        b.note_if(1, || true, &mut out);
        assert_eq!(out, vec![Action::Send(1, Ctrl::Ask(0))]);
        b.note_if(1, || panic!("asked about an RC peer's message"), &mut out);
        let mut r: Budget = Budget::new(
            0,
            2,
            Limits {
                rebalance: true,
                ..limits
            },
        );
        r.touch(1);
        r.hold(1, RcState::Up);
        let mut asked = false;
        r.note_if(
            1,
            || {
                asked = true;
                true
            },
            &mut out,
        );
        assert!(asked, "rebalancing needs a connected peer's time of use");
    }

    /// Processes whose control messages travel in order per (from, to) pair, delivered in an
    /// order the test chooses; RC sends drain when the test says so.
    struct Job {
        b: Vec<Budget<Link>>,
        links: HashMap<(Rank, Rank), VecDeque<Ctrl>>,
        draining: Vec<(Rank, Rank)>,
        connected: HashMap<(Rank, Rank), bool>,
        torn: Vec<(Rank, Rank)>,
    }

    impl Job {
        fn new(n: u32, limits: Limits) -> Self {
            Job {
                b: (0..n).map(|r| Budget::new(r, n, limits)).collect(),
                links: HashMap::new(),
                draining: vec![],
                connected: HashMap::new(),
                torn: vec![],
            }
        }

        fn apply(&mut self, me: Rank, acts: Vec<Action>) {
            for a in acts {
                match a {
                    Action::Send(to, c) => self.links.entry((me, to)).or_default().push_back(c),
                    Action::Connect(p) => {
                        self.connected.insert((me, p), true);
                    }
                    Action::Drain(p) => self.draining.push((me, p)),
                    Action::Teardown(p) => {
                        // Only after both sides drained: the peer is not sending on RC.
                        assert!(
                            !self.draining.contains(&(p, me)),
                            "{me} tore down {p} early"
                        );
                        assert!(!self.draining.contains(&(me, p)));
                        self.connected.remove(&(me, p));
                        self.torn.push((me, p));
                    }
                    Action::OpenFp(p) => assert!(self.b[me as usize].rc_open(p)),
                    Action::CloseFp(_) => {}
                }
            }
            let b = &self.b[me as usize];
            assert!(b.rc_used() <= b.limits.max_rc, "{me} over its RC limit");
            assert!(b.fp_used() <= b.limits.max_fp, "{me} over its FP limit");
            // The list of slot holders is exactly the peers not on UD.
            let mut holders: Vec<Rank> = b
                .peers
                .iter()
                .filter(|(_, p)| p.rc != RcState::Ud)
                .map(|(r, _)| r as Rank)
                .collect();
            let mut listed: Vec<Rank> = b.conns.iter().map(|c| c.peer).collect();
            holders.sort_unstable();
            listed.sort_unstable();
            assert_eq!(holders, listed, "{me}'s RC list");
            let fp = b.peers.iter().filter(|(_, p)| p.fp).count();
            assert_eq!(fp, b.fp_used(), "{me}'s RC-FP count");
        }

        /// A message between `a` and `b` (both note it).
        fn traffic(&mut self, a: Rank, b: Rank) {
            for (x, y) in [(a, b), (b, a)] {
                let mut out = vec![];
                self.b[x as usize].note(y, &mut out);
                self.apply(x, out);
            }
        }

        /// Deliver the next control message on link `k`, if any.
        fn deliver(&mut self, k: (Rank, Rank)) -> bool {
            let Some(c) = self.links.get_mut(&k).and_then(|q| q.pop_front()) else {
                return false;
            };
            let mut out = vec![];
            self.b[k.1 as usize].on_ctrl(k.0, c, &mut out);
            self.apply(k.1, out);
            true
        }

        fn drain_one(&mut self, i: usize) {
            if i < self.draining.len() {
                let (me, p) = self.draining.remove(i);
                let mut out = vec![];
                self.b[me as usize].drained(p, &mut out);
                self.apply(me, out);
            }
        }

        /// Deliver everything, drains included, in a fixed order.
        fn settle(&mut self) {
            loop {
                let keys: Vec<_> = self.links.keys().copied().collect();
                let mut moved = false;
                for k in keys {
                    moved |= self.deliver(k);
                }
                if !self.draining.is_empty() {
                    self.drain_one(0);
                    moved = true;
                }
                if !moved {
                    break;
                }
            }
        }

        /// Both sides agree on every pair, and no transient state is left.
        fn check_agreement(&self) {
            let n = self.b.len() as u32;
            for a in 0..n {
                for b in 0..n {
                    let (sa, sb) = (self.b[a as usize].state(b), self.b[b as usize].state(a));
                    assert!(
                        matches!(sa, RcState::Ud | RcState::Up),
                        "{a}->{b} left in {sa:?}"
                    );
                    assert_eq!(sa, sb, "{a} and {b} disagree");
                    assert_eq!(
                        sa == RcState::Up,
                        self.connected.contains_key(&(a, b)),
                        "{a}->{b}"
                    );
                }
            }
        }
    }

    /// Limits without the fair agreement (first come, first served), unless a test turns it on.
    fn limits(threshold: u64, max_rc: usize, max_fp: usize, rebalance: bool) -> Limits {
        Limits {
            threshold,
            max_rc,
            max_fp,
            rebalance,
            fair: false,
        }
    }

    #[test]
    fn a_peer_earns_rc_at_the_threshold_and_fp_within_its_limit() {
        let mut j = Job::new(3, limits(5, 4, 1, false));
        for _ in 0..4 {
            j.traffic(0, 1);
        }
        j.settle();
        assert_eq!(j.b[0].state(1), RcState::Ud);
        j.traffic(0, 1);
        j.settle();
        j.check_agreement();
        assert!(j.b[0].rc_open(1) && j.b[1].rc_open(0));
        assert!(j.b[0].has_fp(1));
        for _ in 0..5 {
            j.traffic(0, 2);
        }
        j.settle();
        j.check_agreement();
        assert!(j.b[0].rc_open(2));
        assert!(!j.b[0].has_fp(2), "max_fp = 1");
        assert_eq!(j.b[0].stats().opened, 2);
    }

    #[test]
    fn asks_that_cross_make_one_connection() {
        let mut j = Job::new(2, limits(1, 1, 1, false));
        // Both note the message before either hears the other's ask.
        j.traffic(0, 1);
        assert_eq!(j.b[0].state(1), RcState::Asked);
        assert_eq!(j.b[1].state(0), RcState::Asked);
        j.settle();
        j.check_agreement();
        assert!(j.b[0].rc_open(1));
        assert_eq!(j.b[0].rc_used(), 1);
        assert_eq!(j.b[1].rc_used(), 1);
        assert_eq!(j.b[0].stats().opened, 1);
    }

    #[test]
    fn the_limit_refuses_and_the_asker_backs_off() {
        let mut j = Job::new(3, limits(2, 1, 0, false));
        j.traffic(0, 1);
        j.traffic(0, 1);
        j.settle();
        assert!(j.b[0].rc_open(1));
        // Rank 2 wants rank 0, which is full.
        for _ in 0..2 {
            j.traffic(2, 0);
        }
        j.settle();
        j.check_agreement();
        assert_eq!(j.b[0].state(2), RcState::Ud);
        assert_eq!(j.b[0].stats().refused, 1);
        // Backs off: no new ask for the next 2<<1 messages.
        for _ in 0..3 {
            j.traffic(2, 0);
        }
        assert!(j.links.values().all(|q| q.is_empty()));
        assert_eq!(j.b[2].stats().asked, 1);
    }

    #[test]
    fn rebalance_gives_an_idle_connection_to_a_busier_peer() {
        let mut j = Job::new(3, limits(3, 1, 1, true));
        for _ in 0..3 {
            j.traffic(0, 1);
        }
        j.settle();
        assert!(j.b[0].rc_open(1) && j.b[0].has_fp(1));
        // Rank 2 gets busy with rank 0; rank 1 goes quiet.
        for _ in 0..20 {
            j.traffic(0, 2);
            j.settle();
        }
        j.check_agreement();
        assert!(j.b[0].rc_open(2), "the busier peer got the connection");
        assert!(!j.b[0].rc_open(1), "the idle one was closed");
        assert!(j.b[0].has_fp(2));
        assert!(j.torn.contains(&(0, 1)) && j.torn.contains(&(1, 0)));
        assert_eq!(j.b[0].stats().closed, 1);
    }

    #[test]
    fn a_close_waits_for_both_sides_to_drain() {
        let mut j = Job::new(2, limits(1, 1, 0, false));
        j.traffic(0, 1);
        j.settle();
        assert!(j.b[0].rc_open(1));
        let mut out = vec![];
        j.b[0].start_close(1, &mut out);
        out.push(Action::Send(1, Ctrl::Close));
        j.apply(0, out);
        assert!(j.deliver((0, 1)));
        // Rank 1 drained and said so; rank 0 has not drained: no teardown yet anywhere.
        let i = j.draining.iter().position(|&d| d == (1, 0)).unwrap();
        j.drain_one(i);
        assert!(j.deliver((1, 0)));
        assert!(j.torn.is_empty());
        assert!(!j.b[0].rc_open(1) && !j.b[1].rc_open(0));
        j.settle();
        j.check_agreement();
        assert_eq!(j.torn.len(), 2);
    }

    /// A process at its limit that refuses an asker holding no connection asks a peer holding
    /// more to yield; that peer gives up its connection and the asker gets the slot. Without
    /// `fair` the asker stays on UD.
    #[test]
    fn a_refused_asker_gets_the_slot_of_a_peer_holding_more() {
        for fair in [false, true] {
            let mut j = Job::new(
                4,
                Limits {
                    fair,
                    ..limits(1, 2, 2, false)
                },
            );
            // 0-1, 0-2, 1-2: ranks 0, 1 and 2 are full.
            for (a, b) in [(0, 1), (0, 2), (1, 2)] {
                j.traffic(a, b);
                j.settle();
            }
            j.traffic(3, 0);
            j.settle();
            j.check_agreement();
            assert_eq!(j.b[0].stats().refused, 1);
            if fair {
                assert!(j.b[0].rc_open(3), "the starved asker got rank 0's slot");
                assert_eq!(j.b[0].stats().yields_asked, 1);
                // Rank 0 asked the peer it knew least about, rank 1 (unknown, older); rank 1
                // held one connection to others (to 2), more than rank 3's none.
                assert_eq!(j.b[1].stats().yielded, 1);
                assert!(!j.b[0].rc_open(1) && j.b[0].rc_open(2));
                assert_eq!(j.b[3].rc_used(), 1);
            } else {
                assert_eq!(j.b[3].rc_used(), 0);
                assert_eq!(j.b[0].stats().yields_asked, 0);
            }
        }
    }

    /// A peer holding no more connections than the asker keeps its own and says how many it
    /// holds; the process remembers, and does not ask it again for an asker holding as many.
    #[test]
    fn a_peer_holding_no_more_keeps_its_connection() {
        let mut j = Job::new(
            4,
            Limits {
                fair: true,
                ..limits(1, 1, 1, false)
            },
        );
        // 0-1 (both full); then rank 2, holding no connection, asks 0.
        j.traffic(0, 1);
        j.settle();
        let mut out = vec![];
        j.b[0].on_ctrl(2, Ctrl::Ask(0), &mut out);
        assert_eq!(
            out,
            vec![Action::Send(2, Ctrl::No), Action::Send(1, Ctrl::Yield(0))]
        );
        j.apply(0, out);
        j.settle();
        j.check_agreement();
        assert!(j.b[0].rc_open(1), "rank 1 holds none to others: it keeps 0");
        assert_eq!(j.b[1].stats().yielded, 0);
        let mut out = vec![];
        j.b[0].on_ctrl(2, Ctrl::Ask(0), &mut out);
        assert_eq!(
            out,
            vec![Action::Send(2, Ctrl::No)],
            "known to hold no more"
        );
    }

    /// Ranks of a 32-rank job that each want 18 peers (a ring with 9 neighbours on each side)
    /// and may hold 16, two of them late to talk (as the two of `mixed` at 32 ranks that asked
    /// last, docs/history/benchmarks-notebook.md): first come, first served leaves those with a few while their
    /// peers are full; the fair agreement leaves every rank with 15 or 16.
    #[test]
    fn the_fair_agreement_leaves_no_rank_starved() {
        let n = 32u32;
        let pairs: Vec<(Rank, Rank)> = (0..n)
            .flat_map(|a| (1..=9).map(move |d| (a, (a + d) % n)))
            .collect();
        let run = |fair: bool| {
            let mut j = Job::new(
                n,
                Limits {
                    fair,
                    ..limits(4, 16, 8, false)
                },
            );
            // The order the pairs talk in: a fixed shuffle, settling now and then, as the
            // control messages of a real job lag its traffic.
            let mut x = 0x2545_f491_u64;
            for round in 0..40 {
                let mut order = pairs.clone();
                for i in (1..order.len()).rev() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    order.swap(i, (x % (i as u64 + 1)) as usize);
                }
                let late = |r: Rank| round < 20 && (r == 0 || r == 16);
                for (k, &(a, b)) in order.iter().enumerate() {
                    if late(a) || late(b) {
                        continue;
                    }
                    j.traffic(a, b);
                    if (k + round) % 16 == 0 {
                        j.settle();
                    }
                }
            }
            j.settle();
            j.check_agreement();
            let held: Vec<usize> = j.b.iter().map(|b| b.rc_used()).collect();
            let yielded: u64 = j.b.iter().map(|b| b.stats().yielded).sum();
            (held, yielded)
        };
        let (greedy, none) = run(false);
        let (fair, yielded) = run(true);
        assert_eq!(none, 0);
        assert!(
            greedy.iter().min() <= Some(&4),
            "this schedule starves a rank first come, first served: {greedy:?}"
        );
        assert!(
            fair.iter().all(|&h| h >= 15),
            "every rank holds 15 or 16: {fair:?}"
        );
        assert!(yielded > 0);
    }

    #[test]
    fn ctrl_codes_round_trip() {
        for c in [
            Ctrl::Ask(3),
            Ctrl::Yes,
            Ctrl::No,
            Ctrl::Close,
            Ctrl::Closed,
            Ctrl::Yield(0),
            Ctrl::Keep(Count::MAX),
        ] {
            assert_eq!(Ctrl::takes_count(c.code()), Some(c.count().is_some()));
            assert_eq!(Ctrl::from_parts(c.code(), c.count()), Some(c));
        }
        assert_eq!(Ctrl::takes_count(0), None);
        assert_eq!(Ctrl::takes_count(8), None);
        assert_eq!(Ctrl::from_parts(1, None), None, "an Ask without its count");
        assert_eq!(Ctrl::from_parts(2, Some(1)), None, "a Yes with a count");
    }

    proptest! {
        /// Any traffic among 5 processes, control messages and drains in any order: limits
        /// hold at every step, nobody tears down before both sides drained, and once quiet
        /// both sides of every pair agree (each state Ud or Up on both).
        #[test]
        fn any_schedule_keeps_limits_and_ends_in_agreement(
            steps in prop::collection::vec((0u8..4, 0u32..5, 0u32..5, any::<u8>()), 1..400),
            max_rc in 1usize..4,
            rebalance in any::<bool>(),
            fair in any::<bool>(),
        ) {
            let mut j = Job::new(5, Limits { fair, ..limits(3, max_rc, 1, rebalance) });
            for (kind, a, b, k) in steps {
                match kind {
                    0 | 1 if a != b => j.traffic(a, b),
                    2 => {
                        let keys: Vec<_> = j.links.iter().filter(|(_, q)| !q.is_empty()).map(|(k, _)| *k).collect();
                        if !keys.is_empty() {
                            j.deliver(keys[k as usize % keys.len()]);
                        }
                    }
                    3 if !j.draining.is_empty() => {
                        let i = k as usize % j.draining.len();
                        j.drain_one(i);
                    }
                    _ => {}
                }
            }
            j.settle();
            j.check_agreement();
        }
    }
}

//! The connection manager's decisions, without I/O: what a `REQ` or `REP` datagram, a resend
//! timer or an `RTU` means for a pair, from the pair's state alone. `cm.rs` carries them out
//! (QPs, datagrams, frames); the tests below run two managers against each other through a
//! lossy, reordering exchange, deterministically.
//!
//! The protocol: the requester makes its QP and sends `REQ` (its QP) until answered; the
//! responder connects a QP to it and answers `REP` (its QP), and answers a repeated `REQ` for
//! the same QP with the same `REP` (the first was lost); the requester connects and sends
//! `RTU`, its first RC message, and the responder is up when it arrives. When both ask at
//! once, the higher rank answers with the QP it already made and the lower one ignores the
//! higher's `REQ`. Every datagram carries the pair's connection generation (raised at each
//! teardown, `disconnect`): one of another generation is stale and never answered, so a late
//! datagram of a torn-down connection cannot leave one side half-connected.

use super::{CmKind, CmMsg, Conn, Rank};
use std::time::{Duration, Instant};

/// The longest wait between two resends of a `REQ`.
pub(super) const MAX_RESEND: Duration = Duration::from_secs(1);

/// What to do with a connection-manager datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OnCm {
    /// Not for this pair, or the pair is failed or being closed: nothing.
    Ignore,
    /// Of another connection generation: counted, never answered.
    Stale,
    /// A request to answer: connect our QP (made if there is none) to the requester's, send
    /// `REP`; the pair is then `Accepted` until `RTU` comes.
    Accept,
    /// A request already answered, for the QP we connected to: our `REP` was lost; send it
    /// again.
    RepeatRep,
    /// The answer to our request: connect our QP to the responder's, send `RTU`; up.
    Complete,
}

/// The decision for datagram `m` arriving at rank `me` (of a job of `size`, id hash `job`),
/// whose pair with `m.src` is in state `conn` at generation `gen`; `answered` is the QP
/// number our QP was connected to when we answered a `REQ` of this pair (with a `REP` kept
/// for a repeat).
pub(super) fn on_cm(
    me: Rank,
    size: u32,
    job: u64,
    conn: Conn,
    gen: u32,
    answered: Option<u32>,
    m: &CmMsg,
) -> OnCm {
    if m.job != job || m.dst != me || m.src >= size || m.src == me {
        return OnCm::Ignore;
    }
    match (m.kind, conn) {
        (_, Conn::Failed | Conn::Draining) => OnCm::Ignore,
        (CmKind::Req | CmKind::Rep, Conn::Idle | Conn::Requesting { .. }) if m.gen != gen => {
            OnCm::Stale
        }
        (CmKind::Req, Conn::Idle) => OnCm::Accept,
        // Both asked: the higher rank answers, with the QP it already made.
        (CmKind::Req, Conn::Requesting { .. }) if me > m.src => OnCm::Accept,
        (CmKind::Req, Conn::Requesting { .. }) => OnCm::Ignore,
        (CmKind::Req, Conn::Accepted | Conn::Up) if answered == Some(m.ep.qpn) => OnCm::RepeatRep,
        (CmKind::Req, Conn::Accepted | Conn::Up) => OnCm::Ignore,
        (CmKind::Rep, Conn::Requesting { .. }) => OnCm::Complete,
        (CmKind::Rep, _) => OnCm::Ignore,
    }
}

/// What a pair's resend timer, set for `at`, means at `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OnTimer {
    /// Not requesting any more, or a later timer replaced this one: nothing.
    Skip,
    /// Unanswered for longer than the connect timeout: the peer is failed.
    Fail,
    /// Send the `REQ` again; the pair's state becomes `conn`, its next resend due at `due`
    /// (after a wait twice the last, at most [`MAX_RESEND`]).
    Resend { conn: Conn, due: Instant },
}

/// The decision for the resend timer of a pair in state `conn`.
pub(super) fn on_timer(conn: Conn, at: Instant, now: Instant, timeout: Duration) -> OnTimer {
    let Conn::Requesting { first, next, wait } = conn else {
        return OnTimer::Skip;
    };
    if next != at {
        return OnTimer::Skip;
    }
    if now.saturating_duration_since(first) > timeout {
        return OnTimer::Fail;
    }
    let wait = (wait * 2).min(MAX_RESEND);
    let due = now + wait;
    OnTimer::Resend {
        conn: Conn::Requesting {
            first,
            next: due,
            wait,
        },
        due,
    }
}

/// Whether `RTU` makes the pair up: only a pair that answered a request waits for one.
pub(super) fn on_rtu(conn: Conn) -> bool {
    conn == Conn::Accepted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rc::REQ_RESEND;
    use crate::{Endpoint, Gid};
    use std::collections::VecDeque;
    use weft_proto::sim::Rng;

    const JOB: u64 = 77;

    /// One side of a pair as `cm.rs` keeps it, the decisions carried out as it carries them
    /// out, its datagrams and RTU frames into `out`.
    struct Side {
        me: Rank,
        peer: Rank,
        conn: Conn,
        gen: u32,
        qpn: Option<u32>,
        /// The QP our QP is connected to, and whether we keep a REP for a repeat.
        remote: Option<u32>,
        rep: Option<CmMsg>,
        connected: u32,
        stale: u32,
    }

    #[derive(Debug, Clone, Copy)]
    enum Wire {
        Cm(CmMsg),
        Rtu,
    }

    impl Side {
        fn new(me: Rank, peer: Rank) -> Side {
            Side {
                me,
                peer,
                conn: Conn::Idle,
                gen: 0,
                qpn: None,
                remote: None,
                rep: None,
                connected: 0,
                stale: 0,
            }
        }
        fn ep(&self) -> Endpoint {
            Endpoint {
                gid: Gid([self.me as u8; 16]),
                qpn: self.qpn.expect("a QP exists"),
                psn: 0,
                lid: 0,
            }
        }
        fn msg(&self, kind: CmKind) -> CmMsg {
            CmMsg {
                kind,
                job: JOB,
                src: self.me,
                dst: self.peer,
                gen: self.gen,
                ep: self.ep(),
            }
        }
        fn start(&mut self, now: Instant, out: &mut Vec<Wire>) {
            assert_eq!(self.conn, Conn::Idle);
            self.qpn = Some(100 * (self.me + 1) + self.gen);
            self.conn = Conn::Requesting {
                first: now,
                next: now + REQ_RESEND,
                wait: REQ_RESEND,
            };
            out.push(Wire::Cm(self.msg(CmKind::Req)));
        }
        fn on(&mut self, w: Wire, out: &mut Vec<Wire>) {
            let m = match w {
                Wire::Rtu => {
                    if on_rtu(self.conn) {
                        self.conn = Conn::Up;
                        self.connected += 1;
                    }
                    return;
                }
                Wire::Cm(m) => m,
            };
            let answered = self.rep.and(self.remote);
            match on_cm(self.me, 2, JOB, self.conn, self.gen, answered, &m) {
                OnCm::Ignore => {}
                OnCm::Stale => self.stale += 1,
                OnCm::Accept => {
                    if self.qpn.is_none() {
                        self.qpn = Some(100 * (self.me + 1) + self.gen);
                    }
                    self.remote = Some(m.ep.qpn);
                    let mut rep = self.msg(CmKind::Rep);
                    rep.gen = m.gen;
                    self.rep = Some(rep);
                    self.conn = Conn::Accepted;
                    out.push(Wire::Cm(rep));
                }
                OnCm::RepeatRep => out.push(Wire::Cm(self.rep.expect("kept"))),
                OnCm::Complete => {
                    self.remote = Some(m.ep.qpn);
                    self.conn = Conn::Up;
                    self.connected += 1;
                    out.push(Wire::Rtu);
                }
            }
        }
        fn timer(&mut self, now: Instant, out: &mut Vec<Wire>) -> bool {
            let Conn::Requesting { next, .. } = self.conn else {
                return false;
            };
            match on_timer(self.conn, next, now, Duration::from_secs(30)) {
                OnTimer::Skip => false,
                OnTimer::Fail => {
                    self.conn = Conn::Failed;
                    false
                }
                OnTimer::Resend { conn, .. } => {
                    self.conn = conn;
                    out.push(Wire::Cm(self.msg(CmKind::Req)));
                    true
                }
            }
        }
        /// Torn down (a composition's `disconnect`): the next connection is a new generation.
        fn teardown(&mut self) {
            self.conn = Conn::Idle;
            self.gen += 1;
            (self.qpn, self.remote, self.rep) = (None, None, None);
        }
        /// Connected to the other side's QP.
        fn up_with(&self, o: &Side) -> bool {
            self.conn == Conn::Up && self.remote == o.qpn && self.connected == 1
        }
    }

    /// Run two sides until quiet: datagrams delivered in a seeded order, `drop` deciding which
    /// to lose (by their number in sending order); resend timers fire when nothing is on its
    /// way. Returns the rounds it took.
    fn exchange(
        a: &mut Side,
        b: &mut Side,
        mut wire: VecDeque<(usize, Wire)>,
        seed: u64,
        drop: impl Fn(u32, &Wire) -> bool,
    ) -> u32 {
        let mut rng = Rng::new(seed);
        let mut now = Instant::now();
        let (mut sent, mut rounds) = (0u32, 0u32);
        loop {
            rounds += 1;
            assert!(rounds < 1000, "no end: {:?} / {:?}", a.conn, b.conn);
            if wire.is_empty() {
                now += MAX_RESEND;
                let mut out = vec![];
                let ta = a.timer(now, &mut out);
                wire.extend(out.drain(..).map(|w| (1, w)));
                let tb = b.timer(now, &mut out);
                wire.extend(out.drain(..).map(|w| (0, w)));
                if !ta && !tb {
                    return rounds;
                }
                continue;
            }
            // Any datagram on its way may come next (UD does not order them).
            let k = rng.below(wire.len() as u64) as usize;
            let (to, w) = wire.remove(k).expect("in range");
            sent += 1;
            if drop(sent, &w) {
                continue;
            }
            let mut out = vec![];
            let back = if to == 0 {
                a.on(w, &mut out);
                1
            } else {
                b.on(w, &mut out);
                0
            };
            wire.extend(out.into_iter().map(|w| (back, w)));
        }
    }

    fn started(a: &mut Side, b: &mut Side, both: bool) -> VecDeque<(usize, Wire)> {
        let now = Instant::now();
        let mut out = vec![];
        a.start(now, &mut out);
        let mut wire: VecDeque<_> = out.drain(..).map(|w| (1, w)).collect();
        if both {
            b.start(now, &mut out);
            wire.extend(out.drain(..).map(|w| (0, w)));
        }
        wire
    }

    /// Both ranks ask at once, their datagrams in every order the seeds give: one
    /// connection, the higher rank's answer, each side up once and connected to the other's
    /// QP. (The in-process test of the same case depends on thread timing; this does not.)
    #[test]
    fn crossing_requests_make_one_connection() {
        for seed in 0..200 {
            let (mut a, mut b) = (Side::new(0, 1), Side::new(1, 0));
            let wire = started(&mut a, &mut b, true);
            exchange(&mut a, &mut b, wire, seed, |_, _| false);
            assert!(a.up_with(&b) && b.up_with(&a), "seed {seed}");
            assert!(
                b.rep.is_some() && a.rep.is_none(),
                "the higher rank answered"
            );
        }
    }

    /// The first REP (or the first REQ, or both) is lost: the requester's timer sends REQ
    /// again, the responder repeats the REP it kept for that QP, and the pair comes up once.
    #[test]
    fn a_lost_rep_is_repeated_and_the_pair_comes_up() {
        for lose in [
            |n: u32, w: &Wire| n == 2 && matches!(w, Wire::Cm(m) if m.kind == CmKind::Rep),
            |n: u32, _: &Wire| n == 1,
            |n: u32, _: &Wire| n <= 3,
        ] {
            for seed in 0..20 {
                let (mut a, mut b) = (Side::new(0, 1), Side::new(1, 0));
                let wire = started(&mut a, &mut b, false);
                exchange(&mut a, &mut b, wire, seed, lose);
                assert!(a.up_with(&b) && b.up_with(&a), "seed {seed}");
            }
        }
    }

    /// A datagram of an earlier connection (before a teardown) arrives late: it is stale on
    /// either side, answered by neither, and the next connection comes up clean.
    #[test]
    fn stale_generations_are_never_answered() {
        let (mut a, mut b) = (Side::new(0, 1), Side::new(1, 0));
        let wire = started(&mut a, &mut b, false);
        exchange(&mut a, &mut b, wire, 1, |_, _| false);
        assert!(a.up_with(&b) && b.up_with(&a));
        let (old_req, old_rep) = (a.msg(CmKind::Req), b.rep.expect("kept"));
        a.teardown();
        b.teardown();
        let mut out = vec![];
        b.on(Wire::Cm(old_req), &mut out);
        a.on(Wire::Cm(old_rep), &mut out);
        assert!(out.is_empty(), "nothing answered: {out:?}");
        assert_eq!((a.stale, b.stale), (1, 1));
        assert_eq!((a.conn, b.conn), (Conn::Idle, Conn::Idle));
        // The late REQ again while the new connection is being asked for: still stale.
        let mut wire = started(&mut a, &mut b, false);
        wire.push_front((1, Wire::Cm(old_req)));
        a.connected = 0;
        b.connected = 0;
        exchange(&mut a, &mut b, wire, 2, |_, _| false);
        assert!(a.up_with(&b) && b.up_with(&a));
        assert_eq!(b.stale, 2);
    }

    /// Datagrams not for this pair are ignored; a failed or draining pair answers nothing; a
    /// REQ for a QP other than the one answered is not answered; an unanswered request fails
    /// after the timeout and waits twice as long between resends, at most a second.
    #[test]
    fn what_is_ignored_and_when_a_request_gives_up() {
        let me = Side::new(1, 0);
        let mut m = Side::new(0, 1);
        m.qpn = Some(5);
        let req = m.msg(CmKind::Req);
        let d = |conn, m: &CmMsg| on_cm(1, 2, JOB, conn, 0, Some(9), m);
        assert_eq!(d(Conn::Idle, &req), OnCm::Accept);
        for bad in [
            CmMsg { job: 1, ..req },
            CmMsg { dst: 0, ..req },
            CmMsg { src: 2, ..req },
            CmMsg {
                src: 1,
                dst: 1,
                ..req
            },
        ] {
            assert_eq!(d(Conn::Idle, &bad), OnCm::Ignore, "{bad:?}");
        }
        assert_eq!(d(Conn::Failed, &req), OnCm::Ignore);
        assert_eq!(d(Conn::Draining, &req), OnCm::Ignore);
        assert_eq!(d(Conn::Up, &req), OnCm::Ignore, "another QP than answered");
        assert_eq!(
            d(
                Conn::Up,
                &CmMsg {
                    ep: Endpoint { qpn: 9, ..req.ep },
                    ..req
                }
            ),
            OnCm::RepeatRep
        );
        assert_eq!(
            d(
                Conn::Accepted,
                &CmMsg {
                    kind: CmKind::Rep,
                    ..req
                }
            ),
            OnCm::Ignore
        );
        let _ = me;
        let t0 = Instant::now();
        let mut c = Conn::Requesting {
            first: t0,
            next: t0 + REQ_RESEND,
            wait: REQ_RESEND,
        };
        let timeout = Duration::from_secs(3);
        let mut now = t0;
        let mut waits = vec![];
        loop {
            let Conn::Requesting { next, .. } = c else {
                unreachable!()
            };
            assert_eq!(
                on_timer(c, next - Duration::from_nanos(1), next, timeout),
                OnTimer::Skip
            );
            now = now.max(next);
            match on_timer(c, next, now, timeout) {
                OnTimer::Resend { conn, due } => {
                    let Conn::Requesting { wait, next, .. } = conn else {
                        unreachable!()
                    };
                    assert_eq!(next, due);
                    waits.push(wait);
                    c = conn;
                }
                OnTimer::Fail => break,
                OnTimer::Skip => unreachable!(),
            }
        }
        assert!(now - t0 > timeout && now - t0 <= timeout + MAX_RESEND);
        assert!(
            waits.windows(2).all(|w| w[1] == (w[0] * 2).min(MAX_RESEND)),
            "{waits:?}"
        );
        assert_eq!(on_timer(Conn::Up, now, now, timeout), OnTimer::Skip);
        assert!(on_rtu(Conn::Accepted) && !on_rtu(Conn::Up) && !on_rtu(Conn::Idle));
    }
}

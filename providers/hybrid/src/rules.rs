//! Send rules (paper 001, §5.3): an ordered chain of `{condition: channel}` pairs; a message
//! takes the first rule whose condition holds and whose channel is already open to the peer.
//! Rules say which open channel to use, not which channel to open.
//!
//! The text form (`WEFT_HYBRID_RULES`) is the paper's, a little relaxed:
//!
//! ```text
//! {size<=2048: RC-FP}, {size<=2008: UD-SR}, {size<=8192: RC-SR}, {size<=8192: UD-SR},
//! {true: RC-RDMA}, {true: UD-ZCOPY}
//! ```
//!
//! Braces are optional; inside them the condition and the channel may also be separated by a
//! comma (`{ MSG_SIZE <= 2048, RC-FP }`, as the paper prints it); rules are separated by commas
//! or semicolons. A condition is `true` or comparisons joined by `&`: `size` (or `msg_size`,
//! the message's bytes) and `ranks` (or `num_ranks`, the job's size, the paper's other
//! variable) against a number with an optional K/M/G suffix, with `<=`, `<`, `>=`, `>` or `==`.
//! Channel names ignore case, and `_` stands for `-`.
//!
//! A chain is checked when the job's size is known ([`Chain::for_job`]): rules whose `ranks`
//! condition fails are dropped, and every message size must still have a rule on a UD channel,
//! since every peer starts with UD alone (the paper asks for a last rule `{true: UD-...}`; any
//! set of UD rules that covers every size will do).

use std::fmt;

/// The message channels of paper 001.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// UD send/receive through the shared receive pool (copy), with the reliability engine.
    UdSr,
    /// UD zero-copy: the receiver posts its buffer as MTU pieces on a pooled QP.
    UdZcopy,
    /// RC send/receive through a shared receive queue.
    RcSr,
    /// RC fast path: per-peer RDMA-written eager slots.
    RcFp,
    /// RC rendezvous by RDMA (read or write).
    RcRdma,
}

impl Channel {
    pub const ALL: [Channel; 5] = [
        Channel::UdSr,
        Channel::UdZcopy,
        Channel::RcSr,
        Channel::RcFp,
        Channel::RcRdma,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Channel::UdSr => "UD-SR",
            Channel::UdZcopy => "UD-ZCOPY",
            Channel::RcSr => "RC-SR",
            Channel::RcFp => "RC-FP",
            Channel::RcRdma => "RC-RDMA",
        }
    }

    /// Whether the channel rides on the one UD QP every peer has from the start.
    pub fn is_ud(self) -> bool {
        matches!(self, Channel::UdSr | Channel::UdZcopy)
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }

    fn parse(word: &str) -> Option<Channel> {
        let w = word.to_ascii_uppercase().replace('_', "-");
        Channel::ALL.into_iter().find(|c| c.name() == w)
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The channels open to one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Open(u8);

impl Open {
    /// What every peer has from the start.
    pub const UD: Open = Open(1 << Channel::UdSr as u8 | 1 << Channel::UdZcopy as u8);
    /// Every channel.
    pub const ALL: Open = Open(0x1f);

    pub fn with(self, c: Channel) -> Open {
        Open(self.0 | c.bit())
    }

    pub fn without(self, c: Channel) -> Open {
        Open(self.0 & !c.bit())
    }

    pub fn has(self, c: Channel) -> bool {
        self.0 & c.bit() != 0
    }
}

/// A closed interval `[lo, hi]` of a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub lo: u64,
    pub hi: u64,
}

impl Range {
    pub const ALL: Range = Range {
        lo: 0,
        hi: u64::MAX,
    };

    pub fn contains(self, v: u64) -> bool {
        self.lo <= v && v <= self.hi
    }

    fn meet(self, o: Range) -> Range {
        Range {
            lo: self.lo.max(o.lo),
            hi: self.hi.min(o.hi),
        }
    }

    fn is_empty(self) -> bool {
        self.lo > self.hi
    }

    fn show(self, var: &str, out: &mut Vec<String>) {
        match (self.lo, self.hi) {
            (0, u64::MAX) => {}
            (lo, hi) if lo == hi => out.push(format!("{var}=={lo}")),
            (0, hi) => out.push(format!("{var}<={hi}")),
            (lo, u64::MAX) => out.push(format!("{var}>={lo}")),
            (lo, hi) => out.push(format!("{var}>={lo}&{var}<={hi}")),
        }
    }
}

/// A rule's condition: the message sizes and job sizes it holds for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cond {
    pub size: Range,
    pub ranks: Range,
}

impl Cond {
    pub const TRUE: Cond = Cond {
        size: Range::ALL,
        ranks: Range::ALL,
    };

    /// `size <= n`.
    pub const fn size_le(n: u64) -> Cond {
        Cond {
            size: Range { lo: 0, hi: n },
            ranks: Range::ALL,
        }
    }
}

impl fmt::Display for Cond {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        self.size.show("size", &mut parts);
        self.ranks.show("ranks", &mut parts);
        if parts.is_empty() {
            f.write_str("true")
        } else {
            f.write_str(&parts.join("&"))
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub cond: Cond,
    pub channel: Channel,
}

/// A send-rule chain, as written (before the job's size is known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain(pub Vec<Rule>);

/// Paper 001's default chain.
pub const DEFAULT: &[Rule] = &[
    Rule {
        cond: Cond::size_le(2048),
        channel: Channel::RcFp,
    },
    Rule {
        cond: Cond::size_le(2008),
        channel: Channel::UdSr,
    },
    Rule {
        cond: Cond::size_le(8192),
        channel: Channel::RcSr,
    },
    Rule {
        cond: Cond::size_le(8192),
        channel: Channel::UdSr,
    },
    Rule {
        cond: Cond::TRUE,
        channel: Channel::RcRdma,
    },
    Rule {
        cond: Cond::TRUE,
        channel: Channel::UdZcopy,
    },
];

impl Default for Chain {
    fn default() -> Chain {
        Chain(DEFAULT.to_vec())
    }
}

impl fmt::Display for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{{{}: {}}}", r.cond, r.channel)?;
        }
        Ok(())
    }
}

/// Why a chain was refused: where (byte offset into the text, rule number from 1) and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleError {
    pub at: usize,
    pub rule: usize,
    pub what: String,
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rule == 0 {
            write!(f, "{}", self.what)
        } else {
            write!(f, "rule {} (at byte {}): {}", self.rule, self.at, self.what)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok<'a> {
    Open,
    Close,
    Comma,
    Colon,
    Semi,
    And,
    Op(&'static str),
    Word(&'a str),
    End,
}

fn describe(t: Tok) -> String {
    match t {
        Tok::Open => "`{`".into(),
        Tok::Close => "`}`".into(),
        Tok::Comma => "`,`".into(),
        Tok::Colon => "`:`".into(),
        Tok::Semi => "`;`".into(),
        Tok::And => "`&`".into(),
        Tok::Op(o) => format!("`{o}`"),
        Tok::Word(w) => format!("`{w}`"),
        Tok::End => "the end".into(),
    }
}

/// Tokens with their byte offsets; an unexpected character is an error at its offset.
fn lex(s: &str) -> Result<Vec<(usize, Tok<'_>)>, (usize, char)> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let two = |x: u8| b.get(i + 1) == Some(&x);
        let (t, n) = match c {
            b' ' | b'\t' | b'\n' | b'\r' => {
                i += 1;
                continue;
            }
            b'{' => (Tok::Open, 1),
            b'}' => (Tok::Close, 1),
            b',' => (Tok::Comma, 1),
            b':' => (Tok::Colon, 1),
            b';' => (Tok::Semi, 1),
            b'&' if two(b'&') => (Tok::And, 2),
            b'&' => (Tok::And, 1),
            b'<' if two(b'=') => (Tok::Op("<="), 2),
            b'<' => (Tok::Op("<"), 1),
            b'>' if two(b'=') => (Tok::Op(">="), 2),
            b'>' => (Tok::Op(">"), 1),
            b'=' if two(b'=') => (Tok::Op("=="), 2),
            b'=' => (Tok::Op("=="), 1),
            c if c.is_ascii_alphanumeric() || c == b'_' || c == b'-' => {
                let n = b[i..]
                    .iter()
                    .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_' || **c == b'-')
                    .count();
                (Tok::Word(&s[i..i + n]), n)
            }
            _ => return Err((i, s[i..].chars().next().unwrap_or('?'))),
        };
        out.push((i, t));
        i += n;
    }
    out.push((s.len(), Tok::End));
    Ok(out)
}

struct Parser<'a> {
    toks: Vec<(usize, Tok<'a>)>,
    pos: usize,
    rule: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> (usize, Tok<'a>) {
        self.toks[self.pos.min(self.toks.len() - 1)]
    }

    fn next(&mut self) -> (usize, Tok<'a>) {
        let t = self.peek();
        self.pos += 1;
        t
    }

    fn err(&self, at: usize, what: String) -> RuleError {
        RuleError {
            at,
            rule: self.rule,
            what,
        }
    }

    fn expected(&self, (at, t): (usize, Tok), what: &str) -> RuleError {
        self.err(at, format!("expected {what}, found {}", describe(t)))
    }

    fn term(&mut self, c: &mut Cond) -> Result<(), RuleError> {
        let (at, t) = self.next();
        let Tok::Word(w) = t else {
            return Err(self.expected((at, t), "a condition (true, size or ranks)"));
        };
        let var = match w.to_ascii_lowercase().as_str() {
            "true" => return Ok(()),
            "size" | "msg_size" => 0,
            "ranks" | "num_ranks" => 1,
            _ => return Err(self.expected((at, t), "a condition (true, size or ranks)")),
        };
        let (oat, op) = self.next();
        let Tok::Op(op) = op else {
            return Err(self.expected((oat, op), "a comparison (<=, <, >=, >, ==)"));
        };
        let (nat, n) = self.next();
        let v = match n {
            Tok::Word(w) => weft_provider::param::parse_size(w).map(|v| v as u64),
            _ => None,
        }
        .ok_or_else(|| self.expected((nat, n), "a number (optionally with K, M or G)"))?;
        let r = match op {
            "<=" => Range { lo: 0, hi: v },
            "<" if v == 0 => Range { lo: 1, hi: 0 },
            "<" => Range { lo: 0, hi: v - 1 },
            ">=" => Range {
                lo: v,
                hi: u64::MAX,
            },
            ">" if v == u64::MAX => Range { lo: 1, hi: 0 },
            ">" => Range {
                lo: v + 1,
                hi: u64::MAX,
            },
            _ => Range { lo: v, hi: v },
        };
        if var == 0 {
            c.size = c.size.meet(r);
        } else {
            c.ranks = c.ranks.meet(r);
        }
        Ok(())
    }

    fn rule(&mut self) -> Result<Rule, RuleError> {
        let start = self.peek().0;
        let braced = self.peek().1 == Tok::Open;
        if braced {
            self.next();
        }
        let mut cond = Cond::TRUE;
        self.term(&mut cond)?;
        while self.peek().1 == Tok::And {
            self.next();
            self.term(&mut cond)?;
        }
        let sep = self.next();
        if !(sep.1 == Tok::Colon || braced && sep.1 == Tok::Comma) {
            return Err(self.expected(sep, "`&` or `:` before the channel"));
        }
        let (at, t) = self.next();
        let channel = match t {
            Tok::Word(w) => Channel::parse(w),
            _ => None,
        }
        .ok_or_else(|| {
            self.expected(
                (at, t),
                "a channel (UD-SR, UD-ZCOPY, RC-SR, RC-FP, RC-RDMA)",
            )
        })?;
        if braced {
            let c = self.next();
            if c.1 != Tok::Close {
                return Err(self.expected(c, "`}`"));
            }
        }
        if cond.size.is_empty() || cond.ranks.is_empty() {
            return Err(self.err(start, format!("`{cond}` never holds")));
        }
        Ok(Rule { cond, channel })
    }
}

impl Chain {
    /// Parse the text form (see the module docs).
    pub fn parse(s: &str) -> Result<Chain, RuleError> {
        let toks = lex(s).map_err(|(at, c)| RuleError {
            at,
            rule: 0,
            what: format!("unexpected character `{c}` at byte {at}"),
        })?;
        let mut p = Parser {
            toks,
            pos: 0,
            rule: 1,
        };
        let mut rules = Vec::new();
        loop {
            rules.push(p.rule()?);
            let t = p.next();
            match t.1 {
                Tok::End => break,
                Tok::Comma | Tok::Semi if p.peek().1 != Tok::End => p.rule += 1,
                Tok::Comma | Tok::Semi => {
                    p.rule += 1;
                    return Err(p.expected(p.peek(), "another rule"));
                }
                // No separator where one belongs: the fault is at the token found instead.
                _ => return Err(p.expected(t, "`,` or `;` between rules")),
            }
        }
        Ok(Chain(rules))
    }

    /// The chain for a job of `ranks`: the rules whose `ranks` condition holds, checked so that
    /// a peer reached by UD alone can be sent a message of any size.
    pub fn for_job(&self, ranks: u64) -> Result<JobChain, RuleError> {
        let rules: Vec<Rule> = self
            .0
            .iter()
            .filter(|r| r.cond.ranks.contains(ranks))
            .copied()
            .collect();
        if let Some(gap) = uncovered(&rules) {
            let span = match gap {
                Range { lo, hi: u64::MAX } => format!("of {lo} bytes or more"),
                Range { lo, hi } if lo == hi => format!("of {lo} bytes"),
                Range { lo, hi } => format!("of {lo} to {hi} bytes"),
            };
            return Err(RuleError {
                at: 0,
                rule: 0,
                what: format!(
                    "in a job of {ranks} ranks, messages {span} match no rule on a UD channel, so \
                     they could not be sent to a peer that has only UD open (every peer starts \
                     so); end the chain with {{true: UD-ZCOPY}} or {{true: UD-SR}}"
                ),
            });
        }
        Ok(JobChain(rules))
    }
}

/// The first span of message sizes no UD rule covers.
fn uncovered(rules: &[Rule]) -> Option<Range> {
    let mut ud: Vec<Range> = rules
        .iter()
        .filter(|r| r.channel.is_ud())
        .map(|r| r.cond.size)
        .collect();
    ud.sort_by_key(|r| r.lo);
    let mut next = 0u64;
    for r in ud {
        if r.lo > next {
            return Some(Range {
                lo: next,
                hi: r.lo - 1,
            });
        }
        if r.hi == u64::MAX {
            return None;
        }
        next = next.max(r.hi + 1);
    }
    Some(Range {
        lo: next,
        hi: u64::MAX,
    })
}

/// A chain checked for one job: every message has a channel once UD is open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobChain(Vec<Rule>);

impl JobChain {
    /// The channel for a message of `size` bytes to a peer with `open` channels: the first
    /// rule that holds and whose channel is open. Always `Some` when `open` includes UD.
    pub fn pick(&self, size: u64, open: Open) -> Option<Channel> {
        self.0
            .iter()
            .find(|r| r.cond.size.contains(size) && open.has(r.channel))
            .map(|r| r.channel)
    }

    pub fn rules(&self) -> &[Rule] {
        &self.0
    }

    /// The largest message size any rule naming `c` covers (`u64::MAX` for an unbounded
    /// one), or `None` if no rule names it: an upper bound on what `c` is ever asked to carry.
    pub fn reach(&self, c: Channel) -> Option<u64> {
        self.0
            .iter()
            .filter(|r| r.channel == c)
            .map(|r| r.cond.size.hi)
            .max()
    }

    /// The largest size up to which a peer with only UD open is sent every message by UD-SR
    /// (`None`: not even the smallest). Sizes beyond go by UD-ZCOPY.
    pub fn ud_sr_upto(&self) -> Option<u64> {
        // The answer changes only where some rule's range begins or ends.
        let mut edges: Vec<u64> = vec![0];
        for r in &self.0 {
            edges.push(r.cond.size.lo);
            if r.cond.size.hi < u64::MAX {
                edges.push(r.cond.size.hi + 1);
            }
        }
        edges.sort_unstable();
        edges.dedup();
        let mut upto = None;
        for (k, &e) in edges.iter().enumerate() {
            if self.pick(e, Open::UD) != Some(Channel::UdSr) {
                return upto;
            }
            upto = Some(edges.get(k + 1).map_or(u64::MAX, |n| n - 1));
        }
        upto
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PAPER: &str = "{size<=2048: RC-FP}, {size<=2008: UD-SR}, {size<=8192: RC-SR}, \
                         {size<=8192: UD-SR}, {TRUE: RC-RDMA}, {TRUE: UD-ZCOPY}";

    #[test]
    fn ud_sr_reach() {
        let j = |t: &str| Chain::parse(t).unwrap().for_job(4).unwrap().ud_sr_upto();
        assert_eq!(
            Chain::default().for_job(4).unwrap().ud_sr_upto(),
            Some(8192)
        );
        assert_eq!(j("{true: UD-SR}"), Some(u64::MAX));
        assert_eq!(j("{true: UD-ZCOPY}"), None);
        assert_eq!(j("{size<=100: UD-SR}, {true: UD-ZCOPY}"), Some(100));
        assert_eq!(
            j("{size<=100: UD-SR}, {size<=50: UD-ZCOPY}, {true: UD-SR}"),
            Some(u64::MAX)
        );
        assert_eq!(j("{size<100: UD-ZCOPY}, {true: UD-SR}"), None);
    }

    #[test]
    fn the_issue_and_the_paper_spell_the_default_chain() {
        assert_eq!(Chain::parse(PAPER).unwrap(), Chain::default());
        let paper = "{ MSG_SIZE <= 2048, RC-FP }, { MSG_SIZE <= 2008, UD-SR }, \
                     { MSG_SIZE <= 8192, RC-SR }, { MSG_SIZE <= 8192, UD-SR }, \
                     { TRUE, RC-RDMA }, { TRUE, UD-ZCOPY }";
        assert_eq!(Chain::parse(paper).unwrap(), Chain::default());
        let bare = "size<=2K:rc_fp; size<=2008:ud-sr; size<=8K:rc-sr; size<=8K:ud-sr; \
                    true:rc-rdma; true:ud-zcopy";
        assert_eq!(Chain::parse(bare).unwrap(), Chain::default());
        assert_eq!(
            Chain::default().to_string(),
            "{size<=2048: RC-FP}, {size<=2008: UD-SR}, {size<=8192: RC-SR}, \
             {size<=8192: UD-SR}, {true: RC-RDMA}, {true: UD-ZCOPY}"
        );
    }

    #[test]
    fn the_default_chain_picks_as_the_paper_says() {
        let c = Chain::default().for_job(512).unwrap();
        let all = Channel::ALL.iter().fold(Open::default(), |o, c| o.with(*c));
        assert_eq!(c.pick(8, all), Some(Channel::RcFp));
        assert_eq!(c.pick(2048, all), Some(Channel::RcFp));
        assert_eq!(
            c.pick(2048, all.without(Channel::RcFp)),
            Some(Channel::RcSr)
        );
        assert_eq!(c.pick(2000, Open::UD), Some(Channel::UdSr));
        assert_eq!(c.pick(4096, Open::UD), Some(Channel::UdSr));
        assert_eq!(c.pick(8193, Open::UD), Some(Channel::UdZcopy));
        assert_eq!(c.pick(1 << 20, all), Some(Channel::RcRdma));
        assert_eq!(c.pick(8, Open::default()), None);
    }

    #[test]
    fn malformed_chains_name_the_rule_the_place_and_what_was_expected() {
        let e = |s: &str| Chain::parse(s).unwrap_err().to_string();
        assert_eq!(
            e("{size<=2048: RC-FAST}"),
            "rule 1 (at byte 13): expected a channel (UD-SR, UD-ZCOPY, RC-SR, RC-FP, RC-RDMA), \
             found `RC-FAST`"
        );
        assert_eq!(
            e("{size<=2K: RC-FP}, {size 8K: UD-SR}"),
            "rule 2 (at byte 25): expected a comparison (<=, <, >=, >, ==), found `8K`"
        );
        assert_eq!(
            e("{size<=lots: UD-SR}"),
            "rule 1 (at byte 7): expected a number (optionally with K, M or G), found `lots`"
        );
        assert_eq!(
            e("{true: UD-SR"),
            "rule 1 (at byte 12): expected `}`, found the end"
        );
        assert_eq!(
            e("true: UD-SR,"),
            "rule 2 (at byte 12): expected another rule, found the end"
        );
        assert_eq!(
            e("{size<8 & size>100: UD-SR}"),
            "rule 1 (at byte 0): `size>=101&size<=7` never holds"
        );
        assert_eq!(e("true: UD-SR $"), "unexpected character `$` at byte 12");
        // A missing separator is placed at the token found instead of it (byte 15 and byte
        // 21, the start of the next token and the end, were named).
        assert_eq!(
            e("{true: UD-SR} {true: UD-SR}"),
            "rule 1 (at byte 14): expected `,` or `;` between rules, found `{`"
        );
        assert_eq!(
            e("{true: UD-SR} garbage"),
            "rule 1 (at byte 14): expected `,` or `;` between rules, found `garbage`"
        );
        assert_eq!(
            e(""),
            "rule 1 (at byte 0): expected a condition (true, size or ranks), found the end"
        );
    }

    #[test]
    fn a_chain_that_leaves_ud_only_peers_without_a_channel_is_refused() {
        let e = |s: &str, n| Chain::parse(s).unwrap().for_job(n).unwrap_err().to_string();
        assert!(e("{true: RC-SR}", 4).contains("messages of 0 bytes or more match no rule"));
        assert!(
            e("{size<=8K: UD-SR}, {true: RC-RDMA}", 4).contains("messages of 8193 bytes or more")
        );
        assert!(e("{size<=8K: UD-SR}, {size>=16K: UD-ZCOPY}", 4)
            .contains("messages of 8193 to 16383 bytes"));
        // A ranks condition that drops the closing UD rule in large jobs.
        let c = "{size<=2K: UD-SR}, {ranks<=64: UD-ZCOPY}, {true: RC-RDMA}";
        assert!(Chain::parse(c).unwrap().for_job(64).is_ok());
        assert!(e(c, 65).contains("in a job of 65 ranks, messages of 2049 bytes or more"));
    }

    fn rule() -> impl Strategy<Value = Rule> {
        let range = (any::<u64>(), any::<u64>(), 0..4u8).prop_map(|(a, b, k)| {
            let (lo, hi) = (a.min(b) >> 40, a.max(b) >> 40);
            match k {
                0 => Range::ALL,
                1 => Range { lo: 0, hi },
                2 => Range { lo, hi: u64::MAX },
                _ => Range { lo, hi },
            }
        });
        (range.clone(), range, 0..5usize).prop_map(|(size, ranks, c)| Rule {
            cond: Cond { size, ranks },
            channel: Channel::ALL[c],
        })
    }

    proptest! {
        /// What a chain prints parses back to the same chain.
        #[test]
        fn printing_round_trips(rules in proptest::collection::vec(rule(), 1..8)) {
            let c = Chain(rules);
            prop_assert_eq!(Chain::parse(&c.to_string()).unwrap(), c);
        }

        /// No input makes the parser panic; an error points inside the text.
        #[test]
        fn any_text_parses_or_fails_cleanly(s in "[{}:,;&<>= a-zA-Z0-9_-]{0,60}") {
            if let Err(e) = Chain::parse(&s) {
                prop_assert!(e.at <= s.len());
            }
        }

        /// A chain accepted for a job gives every size a channel once UD is open, and the
        /// first rule that holds among the open channels.
        #[test]
        fn an_accepted_chain_always_has_a_ud_channel(
            rules in proptest::collection::vec(rule(), 1..8),
            size in any::<u64>(),
            ranks in 1u64..100_000,
            more in 0..32u8,
        ) {
            let c = Chain(rules.clone());
            let open = Channel::ALL
                .iter()
                .enumerate()
                .filter(|(i, _)| more & (1 << i) != 0)
                .fold(Open::UD, |o, (_, c)| o.with(*c));
            match c.for_job(ranks) {
                Ok(j) => {
                    let got = j.pick(size, open);
                    prop_assert!(got.is_some());
                    let want = rules
                        .iter()
                        .find(|r| r.cond.ranks.contains(ranks)
                            && r.cond.size.contains(size)
                            && open.has(r.channel))
                        .map(|r| r.channel);
                    prop_assert_eq!(got, want);
                }
                Err(_) => {
                    // Refused: some size has no UD rule for this job.
                    let ud: Vec<_> = rules
                        .iter()
                        .filter(|r| r.channel.is_ud() && r.cond.ranks.contains(ranks))
                        .collect();
                    let gap = uncovered(&ud.into_iter().copied().collect::<Vec<_>>());
                    prop_assert!(gap.is_some());
                }
            }
        }
    }
}

//! Active messages that arrived ahead of their turn, held until the ones before them arrive
//! (libfabric does not promise that completions of one sender come in send order).
//!
//! What a peer can make the receiver hold is bounded: a message more than [`WINDOW`] ahead of
//! the next expected one, more than [`PER_PEER`] messages or [`PER_PEER_BYTES`] of one peer, or
//! more than [`TOTAL_BYTES`] of all peers, is a protocol violation — a peer that skips a number
//! can no longer pin the receiver's memory (it could stash any message up to 2^31 ahead). The
//! provider then fails the peer and drops what it held ([`Stash::forget`]).

use std::collections::HashMap;
use weft_provider::Rank;

/// How far ahead of the next expected message one may arrive: a sender has at most its send
/// buffers' worth in flight (4096 at most, `WEFT_OFI_AM_RX`), and injected ones besides.
pub const WINDOW: u32 = 1 << 16;
/// Messages of one peer held at most.
pub const PER_PEER: u32 = 1 << 13;
/// Bytes of one peer held at most.
pub const PER_PEER_BYTES: usize = 64 << 20;
/// Bytes held at most, all peers together.
pub const TOTAL_BYTES: usize = 256 << 20;

/// Why a message cannot be held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooMuch(pub String);

#[derive(Debug, Default)]
pub struct Stash {
    map: HashMap<(Rank, u32), Vec<u8>>,
    per: HashMap<Rank, (u32, usize)>,
    bytes: usize,
}

impl Stash {
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Hold `m`, message `seq` of `src`, while `expected` is the next one due from it.
    pub fn hold(&mut self, src: Rank, seq: u32, expected: u32, m: &[u8]) -> Result<(), TooMuch> {
        let ahead = seq.wrapping_sub(expected);
        if ahead >= WINDOW {
            return Err(TooMuch(format!(
                "active message {seq} is more than {WINDOW} ahead of {expected}"
            )));
        }
        let (n, b) = self.per.get(&src).copied().unwrap_or((0, 0));
        if n + 1 > PER_PEER || b + m.len() > PER_PEER_BYTES || self.bytes + m.len() > TOTAL_BYTES {
            return Err(TooMuch(format!(
                "{n} active messages ({b} bytes) wait for message {expected}, which never came"
            )));
        }
        if self.map.insert((src, seq), m.to_vec()).is_some() {
            return Err(TooMuch(format!("active message {seq} arrived twice")));
        }
        self.per.insert(src, (n + 1, b + m.len()));
        self.bytes += m.len();
        Ok(())
    }

    /// Take `src`'s message `seq`, if held.
    pub fn take(&mut self, src: Rank, seq: u32) -> Option<Vec<u8>> {
        let m = self.map.remove(&(src, seq))?;
        self.bytes -= m.len();
        if let Some(e) = self.per.get_mut(&src) {
            e.0 -= 1;
            e.1 -= m.len();
            if e.0 == 0 {
                self.per.remove(&src);
            }
        }
        Some(m)
    }

    /// Drop everything held of `src` (a failed peer).
    pub fn forget(&mut self, src: Rank) {
        self.map.retain(|&(r, _), _| r != src);
        if let Some((_, b)) = self.per.remove(&src) {
            self.bytes -= b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_cannot_pin_more_than_its_bounds() {
        let mut s = Stash::default();
        assert!(s.hold(1, WINDOW, 0, b"x").is_err(), "too far ahead");
        assert!(s.hold(1, u32::MAX, 0, b"x").is_err(), "behind: a duplicate");
        for q in 1..=PER_PEER {
            s.hold(1, q, 0, b"ab").unwrap();
        }
        assert!(s.hold(1, PER_PEER + 1, 0, b"ab").is_err(), "count per peer");
        assert_eq!(s.bytes(), 2 * PER_PEER as usize);
        let big = vec![0u8; PER_PEER_BYTES];
        s.hold(2, 1, 0, &big).unwrap();
        assert!(s.hold(2, 2, 0, b"z").is_err(), "bytes per peer");
        for p in 3..5 {
            s.hold(p, 1, 0, &big).unwrap();
        }
        assert!(s.hold(5, 1, 0, &big).is_err(), "bytes of all peers");
        s.forget(2);
        s.hold(6, 1, 0, b"z").unwrap();
        assert!(s.hold(6, 1, 0, b"z").is_err(), "twice");
        assert_eq!(s.take(1, 1).as_deref(), Some(&b"ab"[..]));
        assert_eq!(s.take(1, 1), None);
        s.forget(1);
        s.forget(3);
        s.forget(4);
        assert_eq!(s.take(6, 1).as_deref(), Some(&b"z"[..]));
        assert!(s.is_empty() && s.bytes() == 0);
    }
}

//! libfabric's message matching, over weft's messages: what `FI_TAGGED` and `FI_MSG` promise
//! (64-bit tags with any ignore mask, `FI_DIRECTED_RECV`, remote CQ data, `FI_PEEK`,
//! `FI_CLAIM`, `FI_DISCARD`) is wider than MPI's matching, which weft's core implements (31-bit
//! tags, a tag or any tag). So weft-fi matches libfabric's way itself, as libfabric's `rxm`
//! does over `FI_MSG` endpoints: every libfabric message travels as one weft message with a
//! small header (its tag, CQ data and length) on a control tag, received into bounce buffers
//! that weft-fi keeps posted; a message larger than [`EAGER`] sends only its header there and
//! its data as a second weft message on a tag of its own, which the receiver asks for once
//! the header has matched — straight into the application's buffer, by whatever rendezvous
//! the weft provider uses.
//!
//! This module is the part without I/O: the header's codec and the posted and unexpected
//! queues (in arrival and posting order, so the first match wins as libfabric requires).

use std::collections::VecDeque;
use std::os::raw::c_void;
use std::sync::Arc;

/// Header bytes in front of every message on the control tag.
pub const HDR: usize = 32;
/// Payloads up to this size travel inside the control message (copied once at each end);
/// larger ones as a second weft message straight between the applications' buffers.
pub const EAGER: usize = 8192;

const MAGIC: u8 = 0xf1;
const F_TAGGED: u8 = 1;
const F_DATA: u8 = 2;
const F_LONG: u8 = 4;

/// What a message's header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hdr {
    /// `FI_TAGGED` (else `FI_MSG`).
    pub tagged: bool,
    pub tag: u64,
    /// Remote CQ data (`fi_senddata`, `fi_tsenddata`, ...).
    pub data: Option<u64>,
    /// Payload bytes.
    pub len: u64,
    /// For a message whose payload follows separately: the weft tag it comes on.
    pub long: Option<u32>,
}

impl Hdr {
    pub fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0] = MAGIC;
        b[1] = (if self.tagged { F_TAGGED } else { 0 })
            | (if self.data.is_some() { F_DATA } else { 0 })
            | (if self.long.is_some() { F_LONG } else { 0 });
        b[4..8].copy_from_slice(&self.long.unwrap_or(0).to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.data.unwrap_or(0).to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The header of a control message and its inline payload; `None` for anything malformed
    /// (a wrong magic, unknown flags, a payload that is not the length the header says).
    pub fn decode(b: &[u8]) -> Option<(Hdr, &[u8])> {
        if b.len() < HDR || b[0] != MAGIC || b[1] & !(F_TAGGED | F_DATA | F_LONG) != 0 {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let f = b[1];
        let len = u64_at(24);
        let payload = &b[HDR..];
        let long = (f & F_LONG != 0).then(|| u32::from_le_bytes(b[4..8].try_into().expect("4")));
        match long {
            Some(_) if !payload.is_empty() || len <= EAGER as u64 => return None,
            None if payload.len() as u64 != len => return None,
            _ => {}
        }
        Some((
            Hdr {
                tagged: f & F_TAGGED != 0,
                tag: u64_at(8),
                data: (f & F_DATA != 0).then(|| u64_at(16)),
                len,
                long,
            },
            payload,
        ))
    }
}

/// The entries of an iovec of several buffers, as (address, length), in the caller's order.
pub type Parts = Option<Arc<[(usize, usize)]>>;

/// A posted receive.
#[derive(Clone, Debug)]
pub struct Recv {
    pub ep: usize,
    /// Its buffer (the first entry of an iovec of several), and the bytes it takes in all.
    pub buf: *mut c_void,
    pub len: usize,
    /// An iovec of several entries: all of them, in order (`None`: `buf` alone).
    pub parts: Parts,
    /// `FI_DIRECTED_RECV`: only from this world rank.
    pub src: Option<u32>,
    pub tag: u64,
    pub ignore: u64,
    pub ctx: *mut c_void,
    /// Report its completion (not a selective completion left out).
    pub report: bool,
}

impl Recv {
    /// Whether a message from `src` with `tag` matches (an untagged receive: any tag).
    pub fn matches(&self, src: u32, tag: u64) -> bool {
        self.src.is_none_or(|s| s == src) && (tag ^ self.tag) & !self.ignore == 0
    }
}

/// A message that arrived before a receive for it.
#[derive(Debug)]
pub struct Arrived {
    pub src: u32,
    pub hdr: Hdr,
    /// The inline payload (empty for a long message, whose data the weft provider holds).
    pub payload: Vec<u8>,
    /// The context of the `FI_PEEK | FI_CLAIM` that claimed it.
    pub claimed: Option<usize>,
}

/// The posted and unexpected queues of one kind (tagged or untagged).
#[derive(Default)]
pub struct Queues {
    posted: VecDeque<Recv>,
    unexpected: VecDeque<Arrived>,
}

impl Queues {
    /// A message arrived: the first posted receive it matches, taken off the queue.
    pub fn arrive(&mut self, src: u32, tag: u64) -> Option<Recv> {
        let i = self.posted.iter().position(|r| r.matches(src, tag))?;
        self.posted.remove(i)
    }

    /// Keep a message no receive was posted for.
    pub fn stash(&mut self, a: Arrived) {
        self.unexpected.push_back(a);
    }

    /// Post a receive (after [`Self::take_unexpected`] found nothing for it).
    pub fn post(&mut self, r: Recv) {
        self.posted.push_back(r);
    }

    fn find(&self, r: &Recv) -> Option<usize> {
        self.unexpected
            .iter()
            .position(|a| a.claimed.is_none() && r.matches(a.src, a.hdr.tag))
    }

    /// The earliest unclaimed message `r` matches, taken off the queue.
    pub fn take_unexpected(&mut self, r: &Recv) -> Option<Arrived> {
        let i = self.find(r)?;
        self.unexpected.remove(i)
    }

    /// `FI_PEEK`: the earliest unclaimed message `r` matches, left queued; with `claim`, it is
    /// set aside for a later `FI_CLAIM` receive with the same context.
    pub fn peek(&mut self, r: &Recv, claim: bool) -> Option<(u32, Hdr)> {
        let i = self.find(r)?;
        let a = &mut self.unexpected[i];
        if claim {
            a.claimed = Some(r.ctx as usize);
        }
        Some((a.src, a.hdr))
    }

    /// `FI_CLAIM`: the message claimed with context `ctx`, taken off the queue.
    pub fn take_claimed(&mut self, ctx: *mut c_void) -> Option<Arrived> {
        let i = self
            .unexpected
            .iter()
            .position(|a| a.claimed == Some(ctx as usize))?;
        self.unexpected.remove(i)
    }

    /// Take back the receive posted on `ep` with `ctx` (`fi_cancel`).
    pub fn cancel(&mut self, ep: usize, ctx: *mut c_void) -> Option<Recv> {
        let i = self
            .posted
            .iter()
            .position(|r| r.ep == ep && r.ctx == ctx)?;
        self.posted.remove(i)
    }

    /// Take back every receive posted on `ep`.
    pub fn drain_ep(&mut self, ep: usize) -> Vec<Recv> {
        self.take_posted(|r| r.ep == ep)
    }

    /// Take back the receives that can only be matched by `rank` (now failed); with
    /// `any_too`, also those from any source (no peer is left).
    pub fn fail_source(&mut self, rank: u32, any_too: bool) -> Vec<Recv> {
        self.take_posted(|r| r.src == Some(rank) || (any_too && r.src.is_none()))
    }

    fn take_posted(&mut self, pick: impl Fn(&Recv) -> bool) -> Vec<Recv> {
        let (gone, kept): (VecDeque<Recv>, VecDeque<Recv>) =
            std::mem::take(&mut self.posted).into_iter().partition(pick);
        self.posted = kept;
        gone.into()
    }

    /// Drop the unexpected messages of a failed peer whose data will never come.
    pub fn forget_long_from(&mut self, rank: u32) {
        self.unexpected
            .retain(|a| a.src != rank || a.hdr.long.is_none());
    }

    pub fn posted_len(&self) -> usize {
        self.posted.len()
    }

    pub fn unexpected_len(&self) -> usize {
        self.unexpected.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr::null_mut;

    fn recv(src: Option<u32>, tag: u64, ignore: u64, ctx: usize) -> Recv {
        Recv {
            ep: 1,
            buf: null_mut(),
            len: 0,
            parts: None,
            src,
            tag,
            ignore,
            ctx: ctx as *mut c_void,
            report: true,
        }
    }

    fn arrived(src: u32, tag: u64) -> Arrived {
        Arrived {
            src,
            hdr: Hdr {
                tagged: true,
                tag,
                data: None,
                len: 0,
                long: None,
            },
            payload: vec![],
            claimed: None,
        }
    }

    #[test]
    fn headers_round_trip_and_malformed_ones_are_refused() {
        let h = Hdr {
            tagged: true,
            tag: 0xdead_beef_0000_0001,
            data: Some(7),
            len: 3,
            long: None,
        };
        let mut m = h.encode().to_vec();
        m.extend_from_slice(b"abc");
        assert_eq!(Hdr::decode(&m), Some((h, &b"abc"[..])));
        // Payload shorter than the header says, a bad magic, unknown flags, a short header.
        assert_eq!(Hdr::decode(&m[..HDR + 2]), None);
        let mut bad = m.clone();
        bad[0] = 0;
        assert_eq!(Hdr::decode(&bad), None);
        bad = m.clone();
        bad[1] |= 0x80;
        assert_eq!(Hdr::decode(&bad), None);
        assert_eq!(Hdr::decode(&m[..HDR - 1]), None);
        // A long message carries no inline payload and is longer than EAGER.
        let l = Hdr {
            tagged: false,
            tag: 0,
            data: None,
            len: 1 << 20,
            long: Some(9),
        };
        assert_eq!(Hdr::decode(&l.encode()), Some((l, &[][..])));
        let small = Hdr { len: 5, ..l };
        assert_eq!(Hdr::decode(&small.encode()), None);
    }

    #[test]
    fn partial_ignore_masks_and_directed_sources_match_as_libfabric_says() {
        let mut q = Queues::default();
        // Ignore the low 32 bits (an MPI "any tag" in the low half), from rank 2 only.
        q.post(recv(Some(2), 0x0001_0000_0000_0000, 0xffff_ffff, 1));
        q.post(recv(None, 0x0001_0000_0000_0005, 0, 2));
        assert!(q.arrive(3, 0x0001_0000_0000_0007).is_none());
        assert_eq!(
            q.arrive(3, 0x0001_0000_0000_0005).map(|r| r.ctx as usize),
            Some(2)
        );
        assert!(q.arrive(2, 0x0002_0000_0000_0005).is_none());
        assert_eq!(
            q.arrive(2, 0x0001_0000_1234_5678).map(|r| r.ctx as usize),
            Some(1)
        );
        assert_eq!(q.posted_len(), 0);
    }

    #[test]
    fn the_earliest_posted_and_the_earliest_arrived_win() {
        let mut q = Queues::default();
        q.post(recv(None, 0, u64::MAX, 1));
        q.post(recv(None, 5, 0, 2));
        assert_eq!(q.arrive(0, 5).map(|r| r.ctx as usize), Some(1));
        q.stash(arrived(0, 5));
        q.stash(arrived(1, 5));
        let a = q.take_unexpected(&recv(None, 5, 0, 3)).unwrap();
        assert_eq!(a.src, 0);
    }

    #[test]
    fn peek_claim_and_discard() {
        let mut q = Queues::default();
        q.stash(arrived(0, 1));
        q.stash(arrived(1, 1));
        let r = recv(None, 1, 0, 10);
        assert_eq!(q.peek(&r, false).map(|p| p.0), Some(0));
        assert_eq!(q.peek(&r, true).map(|p| p.0), Some(0));
        // The claimed message is invisible to others: the next peek finds the second one.
        assert_eq!(q.peek(&recv(None, 1, 0, 11), false).map(|p| p.0), Some(1));
        assert!(q.take_claimed(11 as *mut c_void).is_none());
        assert_eq!(q.take_claimed(10 as *mut c_void).map(|a| a.src), Some(0));
        assert_eq!(q.unexpected_len(), 1);
    }

    #[test]
    fn cancel_drain_and_failed_sources_take_receives_back() {
        let mut q = Queues::default();
        q.post(recv(Some(1), 0, 0, 1));
        q.post(recv(None, 0, 0, 2));
        q.post(recv(Some(2), 0, 0, 3));
        assert_eq!(
            q.cancel(1, 3 as *mut c_void).map(|r| r.ctx as usize),
            Some(3)
        );
        assert!(q.cancel(1, 3 as *mut c_void).is_none());
        assert_eq!(q.fail_source(1, false).len(), 1);
        assert_eq!(q.fail_source(1, true).len(), 1);
        q.post(recv(None, 0, 0, 4));
        assert_eq!(q.drain_ep(1).len(), 1);
        assert_eq!(q.posted_len(), 0);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 2048,
            failure_persistence: None,
            rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
            ..Default::default()
        })]

        /// Any bytes a peer sends decode to a header whose payload is what it says, or to
        /// nothing; never a panic.
        #[test]
        fn decoding_peer_bytes_never_panics(b in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            if let Some((h, p)) = Hdr::decode(&b) {
                match h.long {
                    Some(_) => proptest::prop_assert!(p.is_empty() && h.len > EAGER as u64),
                    None => proptest::prop_assert_eq!(p.len() as u64, h.len),
                }
            }
        }

        /// Every header a sender builds decodes to itself.
        #[test]
        fn headers_round_trip(tag: u64, data: Option<u64>, tagged: bool, len in 0u64..64, long: Option<u32>) {
            let h = Hdr { tagged, tag, data, len: if long.is_some() { len + EAGER as u64 + 1 } else { len }, long };
            let mut m = h.encode().to_vec();
            if long.is_none() {
                m.resize(HDR + len as usize, 3);
            }
            proptest::prop_assert_eq!(Hdr::decode(&m).map(|x| x.0), Some(h));
        }
    }
}

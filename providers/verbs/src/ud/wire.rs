//! verbs-ud's packet header: the 20 bytes in front of every datagram's payload (after the
//! GRH the HCA puts in front of a UD receive). A receiver checks it before it trusts anything
//! in the packet: what a peer sends must never index past a buffer or name a rank that is not
//! in the job (`decode`; fuzzed by `fuzz/fuzz_targets/verbs_ud_packet.rs`).
//!
//! ```text
//! 0      1       2       4     8     12    16      20
//! | kind | flags | hlen  | src | psn | ack | total | payload ...
//! ```
//! All integers little-endian. `kind` is data or a pure acknowledgement; `flags` mark the
//! first and last packet of a message, a keepalive probe and a zero-copy control message;
//! `hlen` is the active-message header's length and `total` the message's (header excluded),
//! carried in every packet of it; `psn` and `ack` are the reliability engine's sequence number
//! (data only) and cumulative acknowledgement, written when the packet is transmitted.

/// Bytes of the header.
pub const PKT: usize = 20;
/// A packet of a message (or a probe, or a control message).
pub const KIND_DATA: u8 = 1;
/// An acknowledgement alone.
pub const KIND_ACK: u8 = 2;
/// The message's first packet.
pub const F_FIRST: u8 = 1;
/// The message's last packet.
pub const F_LAST: u8 = 2;
/// A keepalive probe: acknowledged like data, delivered to no one.
pub const F_PING: u8 = 4;
/// A zero-copy control message ([`crate::ud::zcopy::Ctl`]).
pub const F_CTRL: u8 = 8;

fn put_u16(b: &mut [u8], v: u16) {
    b.copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], v: u32) {
    b.copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn get_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Write the fields of a data packet that are known when it is built (`b` holds at least
/// [`PKT`] bytes); its sequence fields follow at transmission ([`put_seq`]).
pub fn put_data(b: &mut [u8], flags: u8, hlen: u16, src: u32, total: u32) {
    b[0] = KIND_DATA;
    b[1] = flags;
    put_u16(&mut b[2..4], hlen);
    put_u32(&mut b[4..8], src);
    put_u32(&mut b[16..20], total);
}

/// Write the sequence number and acknowledgement of a packet being transmitted.
pub fn put_seq(b: &mut [u8], psn: u32, ack: u32) {
    put_u32(&mut b[8..12], psn);
    put_u32(&mut b[12..16], ack);
}

/// Write a whole pure acknowledgement from `src`.
pub fn put_ack(b: &mut [u8], src: u32, ack: u32) {
    b[..PKT].fill(0);
    b[0] = KIND_ACK;
    put_u32(&mut b[4..8], src);
    put_u32(&mut b[12..16], ack);
}

/// A packet header that passed [`decode`]'s checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pkt {
    pub kind: u8,
    pub flags: u8,
    pub hlen: usize,
    pub src: u32,
    pub psn: u32,
    pub ack: u32,
    pub total: u32,
}

/// The header of a received packet `b` in a job of `size` ranks, or `None` if it is malformed:
/// shorter than a header, of an unknown kind, from a rank outside the job, or announcing a
/// header or message longer than this receiver accepts (`max_hdr`, `max_payload`).
pub fn decode(b: &[u8], size: u32, max_hdr: usize, max_payload: usize) -> Option<Pkt> {
    if b.len() < PKT {
        return None;
    }
    let p = Pkt {
        kind: b[0],
        flags: b[1],
        hlen: get_u16(&b[2..4]) as usize,
        src: get_u32(&b[4..8]),
        psn: get_u32(&b[8..12]),
        ack: get_u32(&b[12..16]),
        total: get_u32(&b[16..20]),
    };
    let ok = p.src < size
        && (p.kind == KIND_DATA || p.kind == KIND_ACK)
        && p.hlen <= max_hdr
        && p.total as usize <= max_payload;
    ok.then_some(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn what_a_sender_writes_a_receiver_reads() {
        let mut b = [0xffu8; PKT + 4];
        put_data(&mut b, F_FIRST | F_LAST, 12, 3, 4000);
        put_seq(&mut b, 77, 76);
        assert_eq!(
            decode(&b, 4, 128, 65536),
            Some(Pkt {
                kind: KIND_DATA,
                flags: F_FIRST | F_LAST,
                hlen: 12,
                src: 3,
                psn: 77,
                ack: 76,
                total: 4000,
            })
        );
        put_ack(&mut b, 2, 9);
        let a = decode(&b, 4, 128, 65536).unwrap();
        assert_eq!(
            (a.kind, a.src, a.ack, a.psn, a.flags),
            (KIND_ACK, 2, 9, 0, 0)
        );
    }

    #[test]
    fn malformed_headers_are_refused() {
        let mut b = [0u8; PKT];
        put_data(&mut b, 0, 0, 1, 0);
        assert!(decode(&b[..PKT - 1], 4, 128, 65536).is_none(), "short");
        assert!(decode(&b, 1, 128, 65536).is_none(), "rank outside the job");
        put_data(&mut b, 0, 129, 0, 0);
        assert!(decode(&b, 4, 128, 65536).is_none(), "header too long");
        put_data(&mut b, 0, 0, 0, 65537);
        assert!(decode(&b, 4, 128, 65536).is_none(), "message too long");
        b[0] = 3;
        assert!(decode(&b, 4, 128, 65536).is_none(), "unknown kind");
    }

    proptest! {
        /// Any bytes from a peer: a header within the limits, or `None`; never a panic.
        #[test]
        fn decode_never_panics_and_keeps_its_limits(
            b in proptest::collection::vec(any::<u8>(), 0..64),
            size in 1u32..100_000,
        ) {
            if let Some(p) = decode(&b, size, 128, 65536) {
                prop_assert!(p.src < size && p.hlen <= 128 && p.total <= 65536);
                prop_assert!(p.kind == KIND_DATA || p.kind == KIND_ACK);
            }
        }

        #[test]
        fn data_headers_round_trip(
            flags in 0u8..16, hlen in 0u16..=128, src in 0u32..1000, psn: u32, ack: u32,
            total in 0u32..=65536,
        ) {
            let mut b = [0u8; PKT];
            put_data(&mut b, flags, hlen, src, total);
            put_seq(&mut b, psn, ack);
            let p = decode(&b, 1000, 128, 65536).unwrap();
            prop_assert_eq!(p, Pkt { kind: KIND_DATA, flags, hlen: hlen as usize, src, psn, ack, total });
        }
    }
}

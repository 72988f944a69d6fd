//! What the hybrid provider puts in front of the core's header on every channel, and its
//! budget's control messages: the bytes a peer sends it, checked in one place (`decode`;
//! fuzzed by `fuzz/fuzz_targets/hybrid_message.rs`).
//!
//! ```text
//! data:    | 0 | seq (u32) | the core's header ...       (PREFIX = 5 bytes before it)
//! control: | 1 | code | count (u16)                       Ask, Yield, Keep
//!          | 1 | code |                                   Yes, No, Close
//!          | 1 | code | next seq (u32)                    Closed
//! ```
//! Integers little-endian. `seq` numbers a peer's messages across channels, for the reorder
//! stage (`order.rs`); `Closed` carries the sender's next sequence number, so everything it
//! sent before (over RC too) is delivered before the connection goes.

use crate::budget::{Count, Ctrl};

/// Kind byte of a data message.
pub const K_DATA: u8 = 0;
/// Kind byte of a budget control message.
pub const K_CTRL: u8 = 1;
/// Bytes in front of the core's header in a data message.
pub const PREFIX: usize = 5;
/// The longest control message.
pub const CTRL_MAX: usize = 6;

/// A message from a peer, as [`decode`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg<'a> {
    /// The peer's `seq`-th message, with the core's header.
    Data { seq: u32, header: &'a [u8] },
    /// A budget control message; `seq` is the sender's next sequence number for `Closed`, 0
    /// for the others.
    Ctrl { ctrl: Ctrl, seq: u32 },
}

/// Write the data prefix for the `seq`-th message into `hdr[..PREFIX]`.
#[inline]
pub fn put_data(hdr: &mut [u8], seq: u32) {
    hdr[0] = K_DATA;
    hdr[1..PREFIX].copy_from_slice(&seq.to_le_bytes());
}

/// Encode control message `c` into `m`; `next` is the sender's next sequence number (carried
/// by `Closed` only). Returns the length.
pub fn put_ctrl(m: &mut [u8; CTRL_MAX], c: Ctrl, next: u32) -> usize {
    m[0] = K_CTRL;
    m[1] = c.code();
    if c == Ctrl::Closed {
        m[2..6].copy_from_slice(&next.to_le_bytes());
        6
    } else if let Some(n) = c.count() {
        m[2..4].copy_from_slice(&n.to_le_bytes());
        4
    } else {
        2
    }
}

/// The message `header` holds, or why it is malformed (the provider then fails the peer).
#[inline]
pub fn decode(header: &[u8]) -> Result<Msg<'_>, String> {
    match header {
        [K_DATA, a, b, c, d, h @ ..] => Ok(Msg::Data {
            seq: u32::from_le_bytes([*a, *b, *c, *d]),
            header: h,
        }),
        [K_CTRL, code, rest @ ..] => {
            let closed = *code == Ctrl::Closed.code();
            let got = match (Ctrl::takes_count(*code), rest) {
                (Some(true), &[a, b]) => {
                    Ctrl::from_parts(*code, Some(Count::from_le_bytes([a, b]))).map(|c| (c, 0))
                }
                (Some(false), &[a, b, c, d]) if closed => {
                    Some((Ctrl::Closed, u32::from_le_bytes([a, b, c, d])))
                }
                (Some(false), []) if !closed => Ctrl::from_parts(*code, None).map(|c| (c, 0)),
                _ => None,
            };
            got.map(|(ctrl, seq)| Msg::Ctrl { ctrl, seq })
                .ok_or_else(|| format!("control code {code} with {} bytes after it", rest.len()))
        }
        _ => Err(format!("a header of {} bytes", header.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn every_ctrl() -> Vec<Ctrl> {
        vec![
            Ctrl::Ask(259),
            Ctrl::Yes,
            Ctrl::No,
            Ctrl::Close,
            Ctrl::Closed,
            Ctrl::Yield(3),
            Ctrl::Keep(65535),
        ]
    }

    #[test]
    fn control_messages_round_trip() {
        for c in every_ctrl() {
            let mut m = [0u8; CTRL_MAX];
            let n = put_ctrl(&mut m, c, 7);
            let seq = if c == Ctrl::Closed { 7 } else { 0 };
            assert_eq!(decode(&m[..n]), Ok(Msg::Ctrl { ctrl: c, seq }), "{c:?}");
            // One byte more or less is malformed.
            assert!(decode(&m[..n - 1]).is_err(), "{c:?} short");
            let mut long = m[..n].to_vec();
            long.push(0);
            assert!(decode(&long).is_err(), "{c:?} long");
        }
        assert!(decode(&[K_CTRL, 99])
            .unwrap_err()
            .contains("control code 99"));
        assert!(decode(&[7, 1, 2])
            .unwrap_err()
            .contains("a header of 3 bytes"));
        assert!(
            decode(&[K_DATA, 1, 2, 3]).is_err(),
            "a data prefix cut short"
        );
    }

    #[test]
    fn a_data_prefix_carries_its_sequence_number() {
        let mut b = [0u8; PREFIX + 3];
        put_data(&mut b, 0x0102_0304);
        b[PREFIX..].copy_from_slice(b"abc");
        assert_eq!(
            decode(&b),
            Ok(Msg::Data {
                seq: 0x0102_0304,
                header: b"abc"
            })
        );
    }

    proptest! {
        /// Any bytes from a peer: a message or a reason, never a panic; what decodes as a
        /// control message encodes back to the same bytes.
        #[test]
        fn decode_never_panics_and_controls_round_trip(
            b in proptest::collection::vec(any::<u8>(), 0..12),
        ) {
            if let Ok(Msg::Ctrl { ctrl, seq }) = decode(&b) {
                let mut m = [0u8; CTRL_MAX];
                let n = put_ctrl(&mut m, ctrl, seq);
                prop_assert_eq!(&m[..n], &b[..]);
            }
        }
    }
}

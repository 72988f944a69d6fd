//! What the ofi provider sends in its own active messages over `FI_MSG`: a 12-byte prefix in
//! front of every one, and the bodies of its two control messages (a synchronous send's
//! acknowledgement, a large message's clear-to-send). A receiver checks them here before it
//! trusts a length or a rank (fuzzed by `fuzz/fuzz_targets/ofi_message.rs`).
//!
//! ```text
//! prefix: | kind | 0 | hlen (u16) | src (u32) | seq (u32) | header (hlen) | payload ...
//! SYNC_ACK header: | op (u64) |                     the sender's operation index
//! CTS header:      | op (u64) | id (u32) | take (u64) |   which large message, how much of it
//! ```
//! Integers little-endian; `seq` numbers a source's active messages for per-pair order.

/// Bytes before the header.
pub const PREFIX: usize = 12;
/// Largest active-message header.
pub const MAX_HDR: usize = 128;
/// An active message from the core.
pub const K_AM: u8 = 0;
/// Acknowledgement of a synchronous send's match.
pub const K_SYNC_ACK: u8 = 1;
/// A large message's receiver asks for its data.
pub const K_CTS: u8 = 2;
/// Bytes of a clear-to-send header.
pub const CTS: usize = 20;

/// A prefix that passed [`decode`]'s checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    pub kind: u8,
    pub hlen: usize,
    pub src: u32,
    pub seq: u32,
}

/// Why [`decode`] refused a message: `src` is the rank it claims to be from, when that rank is
/// in the job (the provider fails that peer), `None` when the message names none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub src: Option<u32>,
    pub why: String,
}

/// Write the prefix of a message of `kind` with a header of `hlen` bytes, the `seq`-th from
/// `src`, into `buf[..PREFIX]`.
#[inline]
pub fn put_prefix(buf: &mut [u8], kind: u8, hlen: u16, src: u32, seq: u32) {
    buf[0] = kind;
    buf[1] = 0;
    buf[2..4].copy_from_slice(&hlen.to_le_bytes());
    buf[4..8].copy_from_slice(&src.to_le_bytes());
    buf[8..12].copy_from_slice(&seq.to_le_bytes());
}

/// The source rank a message claims (for the reorder stash), if it holds a prefix.
#[inline]
pub fn src_of(m: &[u8]) -> Option<u32> {
    (m.len() >= PREFIX).then(|| u32::from_le_bytes([m[4], m[5], m[6], m[7]]))
}

/// The prefix of message `m` in a job of `size` ranks: its header is `m[PREFIX..][..hlen]`.
#[inline]
pub fn decode(m: &[u8], size: u32) -> Result<Prefix, Malformed> {
    if m.len() < PREFIX {
        return Err(Malformed {
            src: None,
            why: format!(
                "a {}-byte active message is shorter than its prefix",
                m.len()
            ),
        });
    }
    let p = Prefix {
        kind: m[0],
        hlen: u16::from_le_bytes([m[2], m[3]]) as usize,
        src: u32::from_le_bytes([m[4], m[5], m[6], m[7]]),
        seq: u32::from_le_bytes([m[8], m[9], m[10], m[11]]),
    };
    if p.src >= size || PREFIX + p.hlen > m.len() || p.hlen > MAX_HDR {
        return Err(Malformed {
            src: (p.src < size).then_some(p.src),
            why: format!(
                "malformed active message (source {}, header {} of {} bytes)",
                p.src,
                p.hlen,
                m.len()
            ),
        });
    }
    Ok(p)
}

/// A clear-to-send's header: the sender's operation index, the data id, the bytes taken.
pub fn put_cts(op: u64, id: u32, take: u64) -> [u8; CTS] {
    let mut h = [0u8; CTS];
    h[..8].copy_from_slice(&op.to_le_bytes());
    h[8..12].copy_from_slice(&id.to_le_bytes());
    h[12..].copy_from_slice(&take.to_le_bytes());
    h
}

/// Undo [`put_cts`]; `None` unless `h` is exactly a clear-to-send header.
pub fn cts(h: &[u8]) -> Option<(u64, u32, u64)> {
    let h: &[u8; CTS] = h.try_into().ok()?;
    Some((
        u64::from_le_bytes(h[..8].try_into().ok()?),
        u32::from_le_bytes(h[8..12].try_into().ok()?),
        u64::from_le_bytes(h[12..].try_into().ok()?),
    ))
}

/// A synchronous send's acknowledgement header: the sender's operation index.
pub fn sync_ack(h: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(h.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn what_a_sender_writes_a_receiver_reads() {
        let mut m = vec![0u8; PREFIX + 3 + 5];
        put_prefix(&mut m, K_AM, 3, 2, 9);
        assert_eq!(
            decode(&m, 4),
            Ok(Prefix {
                kind: K_AM,
                hlen: 3,
                src: 2,
                seq: 9
            })
        );
        assert_eq!(src_of(&m), Some(2));
        assert_eq!(cts(&put_cts(7, 8, 9)), Some((7, 8, 9)));
        assert_eq!(cts(&put_cts(7, 8, 9)[..19]), None);
        assert_eq!(sync_ack(&5u64.to_le_bytes()), Some(5));
        assert_eq!(sync_ack(&[0; 7]), None);
    }

    #[test]
    fn malformed_prefixes_say_whom_to_blame() {
        let mut m = vec![0u8; PREFIX + 2];
        assert_eq!(decode(&m[..PREFIX - 1], 4).unwrap_err().src, None);
        put_prefix(&mut m, K_AM, 3, 1, 0);
        assert_eq!(
            decode(&m, 4).unwrap_err().src,
            Some(1),
            "header past the end"
        );
        put_prefix(&mut m, K_AM, 0, 4, 0);
        assert_eq!(
            decode(&m, 4).unwrap_err().src,
            None,
            "a rank outside the job"
        );
        let mut big = vec![0u8; PREFIX + MAX_HDR + 1];
        put_prefix(&mut big, K_AM, MAX_HDR as u16 + 1, 0, 0);
        assert!(decode(&big, 4).is_err(), "header too long");
    }

    proptest! {
        /// Any bytes from a peer: a prefix whose header lies inside the message and names a
        /// rank of the job, or a refusal; never a panic.
        #[test]
        fn decode_never_panics_and_keeps_its_limits(
            m in proptest::collection::vec(any::<u8>(), 0..200),
            size in 1u32..10_000,
        ) {
            match decode(&m, size) {
                Ok(p) => prop_assert!(p.src < size && PREFIX + p.hlen <= m.len() && p.hlen <= MAX_HDR),
                Err(e) => prop_assert!(e.src.is_none_or(|s| s < size)),
            }
            let _ = (cts(&m), sync_ack(&m), src_of(&m));
        }
    }
}

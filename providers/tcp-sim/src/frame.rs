//! tcp-sim wire framing: an 8-byte versioned header, then the active-message header, then the
//! payload.
//!
//! ```text
//! byte 0      version (1)
//! byte 1      kind: 1 = active message, 2 = hello, 3 = hello-ack
//! bytes 2..4  header length (little endian)
//! bytes 4..8  payload length (little endian)
//! ```
//! The decoder never allocates and never trusts a length: a frame longer than the configured
//! limits, an unknown version or kind is an error, and the connection is closed.

/// Wire version.
pub const VERSION: u8 = 1;
/// Bytes of the fixed frame header.
pub const FRAME_HDR: usize = 8;

pub const K_AM: u8 = 1;
pub const K_HELLO: u8 = 2;
pub const K_ACK: u8 = 3;

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: u8,
    pub hdr_len: usize,
    pub payload_len: usize,
}

impl FrameHeader {
    /// Bytes of the whole frame.
    pub fn total(&self) -> usize {
        FRAME_HDR + self.hdr_len + self.payload_len
    }

    pub fn encode(&self) -> [u8; FRAME_HDR] {
        let mut b = [0u8; FRAME_HDR];
        b[0] = VERSION;
        b[1] = self.kind;
        b[2..4].copy_from_slice(&(self.hdr_len as u16).to_le_bytes());
        b[4..8].copy_from_slice(&(self.payload_len as u32).to_le_bytes());
        b
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    Version(u8),
    Kind(u8),
    HeaderTooLong(usize, usize),
    PayloadTooLong(usize, usize),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Version(v) => write!(f, "unknown frame version {v} (expected {VERSION})"),
            FrameError::Kind(k) => write!(f, "unknown frame kind {k}"),
            FrameError::HeaderTooLong(n, m) => write!(f, "frame header of {n} bytes exceeds {m}"),
            FrameError::PayloadTooLong(n, m) => write!(f, "frame payload of {n} bytes exceeds {m}"),
        }
    }
}

/// Limits a decoder enforces.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_hdr: usize,
    pub max_payload: usize,
}

/// Decode the frame at the start of `buf`: `Ok(None)` when more bytes are needed, `Ok(Some)`
/// when a whole frame is present (its bytes are `buf[..h.total()]`).
pub fn decode(buf: &[u8], lim: Limits) -> Result<Option<FrameHeader>, FrameError> {
    match decode_header(buf, lim)? {
        Some(h) if buf.len() >= h.total() => Ok(Some(h)),
        _ => Ok(None),
    }
}

/// Decode and check the fixed header at the start of `buf` as soon as its 8 bytes are present,
/// whether or not the rest of the frame has arrived (for reading a payload in place).
pub fn decode_header(buf: &[u8], lim: Limits) -> Result<Option<FrameHeader>, FrameError> {
    if buf.len() < FRAME_HDR {
        return Ok(None);
    }
    if buf[0] != VERSION {
        return Err(FrameError::Version(buf[0]));
    }
    let kind = buf[1];
    if !matches!(kind, K_AM | K_HELLO | K_ACK) {
        return Err(FrameError::Kind(kind));
    }
    let hdr_len = u16::from_le_bytes([buf[2], buf[3]]) as usize;
    let payload_len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    if hdr_len > lim.max_hdr {
        return Err(FrameError::HeaderTooLong(hdr_len, lim.max_hdr));
    }
    if payload_len > lim.max_payload {
        return Err(FrameError::PayloadTooLong(payload_len, lim.max_payload));
    }
    Ok(Some(FrameHeader {
        kind,
        hdr_len,
        payload_len,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIM: Limits = Limits {
        max_hdr: 64,
        max_payload: 1 << 20,
    };

    #[test]
    fn roundtrip_and_partial() {
        let h = FrameHeader {
            kind: K_AM,
            hdr_len: 20,
            payload_len: 100,
        };
        let mut b = h.encode().to_vec();
        assert_eq!(decode(&b, LIM), Ok(None));
        b.resize(h.total(), 7);
        assert_eq!(decode(&b, LIM), Ok(Some(h)));
        assert_eq!(decode(&b[..5], LIM), Ok(None));
    }

    #[test]
    fn refuses_bad_frames() {
        let mut b = FrameHeader {
            kind: K_AM,
            hdr_len: 65,
            payload_len: 0,
        }
        .encode();
        assert_eq!(decode(&b, LIM), Err(FrameError::HeaderTooLong(65, 64)));
        b[2] = 0;
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&b, LIM),
            Err(FrameError::PayloadTooLong(..))
        ));
        b[0] = 9;
        assert_eq!(decode(&b, LIM), Err(FrameError::Version(9)));
        b[0] = VERSION;
        b[1] = 77;
        assert_eq!(decode(&b, LIM), Err(FrameError::Kind(77)));
    }

    #[test]
    fn header_is_known_before_the_payload() {
        let lim = Limits {
            max_hdr: 64,
            max_payload: 1 << 20,
        };
        let h = FrameHeader {
            kind: K_AM,
            hdr_len: 10,
            payload_len: 100_000,
        };
        let mut b = h.encode().to_vec();
        assert_eq!(decode_header(&b[..7], lim), Ok(None));
        assert_eq!(decode_header(&b, lim), Ok(Some(h)));
        b.extend_from_slice(&[0; 10 + 50_000]);
        assert_eq!(decode(&b, lim), Ok(None), "half the payload is not a frame");
        assert_eq!(decode_header(&b, lim), Ok(Some(h)));
        let big = FrameHeader {
            payload_len: 2 << 20,
            ..h
        };
        assert_eq!(
            decode_header(&big.encode(), lim),
            Err(FrameError::PayloadTooLong(2 << 20, 1 << 20))
        );
    }

    proptest! {
        /// Arbitrary bytes: never a panic, and an accepted frame always fits the buffer and the
        /// limits.
        #[test]
        fn decoder_is_total(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(Some(h)) = decode(&b, LIM) {
                prop_assert!(h.total() <= b.len());
                prop_assert!(h.hdr_len <= LIM.max_hdr && h.payload_len <= LIM.max_payload);
            }
        }

        /// A stream of valid frames cut anywhere decodes back to the same frames.
        #[test]
        fn stream_decodes(frames in proptest::collection::vec((0usize..64, 0usize..300), 1..8),
                          cut in 0usize..2000) {
            let mut stream = vec![];
            for (h, p) in &frames {
                let fh = FrameHeader { kind: K_AM, hdr_len: *h, payload_len: *p };
                stream.extend_from_slice(&fh.encode());
                stream.extend(std::iter::repeat_n(0xAB, h + p));
            }
            let cut = cut.min(stream.len());
            let mut got = vec![];
            let mut at = 0;
            // First only the bytes before the cut are available, then all of them.
            for avail in [cut, stream.len()] {
                while let Some(h) = decode(&stream[at..avail], LIM).unwrap() {
                    got.push((h.hdr_len, h.payload_len));
                    at += h.total();
                }
            }
            prop_assert_eq!(got, frames);
        }
    }
}

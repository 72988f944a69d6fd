//! What crosses the wire: the connection manager's datagrams (over the UD QP) and the frame
//! at the front of every RC send buffer. Both come from peers, so decoding checks every field
//! and never panics (property-tested below, fuzzed by `fuzz/verbs_rc_wire`).

use crate::{Endpoint, Gid};

/// "WFRC": a datagram that is not from a weft verbs-rc connection manager is dropped.
pub const CM_MAGIC: u32 = 0x5746_5243;
/// Bytes of a connection-manager datagram.
pub const CM_LEN: usize = 56;

/// Connection-manager message kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmKind {
    /// "Here is my QP for you; connect yours to it and answer."
    Req = 1,
    /// "Done; here is mine." The requester then connects and sends `RTU` on the new QP.
    Rep = 2,
}

/// One connection-manager datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmMsg {
    pub kind: CmKind,
    /// A hash of the job id: datagrams from another job are ignored.
    pub job: u64,
    pub src: u32,
    pub dst: u32,
    /// Connection generation (0 for the first connection of a pair).
    pub gen: u32,
    /// The sender's RC queue pair towards the receiver.
    pub ep: Endpoint,
}

impl CmMsg {
    pub fn encode(&self) -> [u8; CM_LEN] {
        let mut b = [0u8; CM_LEN];
        b[0..4].copy_from_slice(&CM_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.job.to_le_bytes());
        b[16..20].copy_from_slice(&self.src.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst.to_le_bytes());
        b[24..28].copy_from_slice(&self.gen.to_le_bytes());
        b[28..32].copy_from_slice(&self.ep.qpn.to_le_bytes());
        b[32..36].copy_from_slice(&self.ep.psn.to_le_bytes());
        b[36..38].copy_from_slice(&self.ep.lid.to_le_bytes());
        b[40..56].copy_from_slice(&self.ep.gid.0);
        b
    }

    /// Decode a datagram's payload; `None` for anything that is not a well-formed message.
    pub fn decode(b: &[u8]) -> Option<CmMsg> {
        if b.len() < CM_LEN {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u32_at(0) != CM_MAGIC {
            return None;
        }
        let kind = match b[4] {
            1 => CmKind::Req,
            2 => CmKind::Rep,
            _ => return None,
        };
        let (qpn, psn) = (u32_at(28), u32_at(32));
        if qpn > 0xff_ffff || psn > 0xff_ffff {
            return None;
        }
        let mut job = [0u8; 8];
        job.copy_from_slice(&b[8..16]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[40..56]);
        Some(CmMsg {
            kind,
            job: u64::from_le_bytes(job),
            src: u32_at(16),
            dst: u32_at(20),
            gen: u32_at(24),
            ep: Endpoint {
                gid: Gid(gid),
                qpn,
                psn,
                lid: u16::from_le_bytes([b[36], b[37]]),
            },
        })
    }
}

/// Bytes of the frame header at the front of every RC send and every eager-ring record.
pub const FRAME_HDR: usize = 16;
/// Bytes of an `Offer` frame's payload.
pub const OFFER_LEN: usize = 24;

/// RC frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// An active message: header then payload.
    Am = 0,
    /// "Ready to use": the requester's first message on a new connection; the responder
    /// sends nothing before it arrives (its QP could reach a requester QP not yet ready).
    Rtu = 1,
    /// "Write your eager messages here": a ring in the sender's memory ([`Offer`]).
    Offer = 2,
    /// Only an acknowledgement (the header's `ack`): space freed in the sender's ring.
    Credit = 3,
}

/// The frame header: kind, active-message header length, payload length, the sequence
/// number of an active message (per pair and direction, over the send/receive channel and the
/// eager ring alike, so the receiver restores the order between the two), and the
/// acknowledgement of the reverse eager ring (units consumed, low 32 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub hlen: usize,
    pub plen: usize,
    pub seq: u32,
    pub ack: u32,
}

impl Frame {
    pub fn write(&self, out: &mut [u8]) {
        out[0] = self.kind as u8;
        out[1] = 0;
        out[2..4].copy_from_slice(&(self.hlen as u16).to_le_bytes());
        out[4..8].copy_from_slice(&(self.plen as u32).to_le_bytes());
        out[8..12].copy_from_slice(&self.seq.to_le_bytes());
        out[12..16].copy_from_slice(&self.ack.to_le_bytes());
    }

    /// Read the frame of a received buffer of `got` bytes whose header may be at most
    /// `max_hdr` long: the lengths must add up to exactly what arrived.
    pub fn read(b: &[u8], max_hdr: usize) -> Option<Frame> {
        if b.len() < FRAME_HDR {
            return None;
        }
        let kind = match b[0] {
            0 => FrameKind::Am,
            1 => FrameKind::Rtu,
            2 => FrameKind::Offer,
            3 => FrameKind::Credit,
            _ => return None,
        };
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let hlen = u16::from_le_bytes([b[2], b[3]]) as usize;
        let plen = u32_at(4) as usize;
        if hlen > max_hdr || FRAME_HDR.checked_add(hlen)?.checked_add(plen)? != b.len() {
            return None;
        }
        let ok = match kind {
            FrameKind::Am => true,
            FrameKind::Rtu | FrameKind::Credit => (hlen | plen) == 0,
            FrameKind::Offer => hlen == 0 && plen == OFFER_LEN,
        };
        ok.then_some(Frame {
            kind,
            hlen,
            plen,
            seq: u32_at(8),
            ack: u32_at(12),
        })
    }
}

/// An eager ring offered to the peer: where it is, and its geometry (the receiver's; the
/// sender checks it is the design it runs too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    pub addr: u64,
    pub rkey: u32,
    /// 0 basic, 1 piggyback, 2 pipeline, 3 fastpath.
    pub design: u8,
    /// Ring bytes (fastpath: slots × slot bytes).
    pub size: u32,
    /// Fastpath slot bytes.
    pub slot: u32,
}

impl Offer {
    pub fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[12] = self.design;
        b[16..20].copy_from_slice(&self.size.to_le_bytes());
        b[20..24].copy_from_slice(&self.slot.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Offer> {
        if b.len() != OFFER_LEN || b[12] > 3 {
            return None;
        }
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[0..8]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Offer {
            addr: u64::from_le_bytes(a),
            rkey: u32_at(8),
            design: b[12],
            size: u32_at(16),
            slot: u32_at(20),
        })
    }
}

/// A stable 64-bit hash of the job id (FNV-1a): cheap, and the same in every process.
pub fn job_hash(job: &str) -> u64 {
    job.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cm_messages_round_trip() {
        let m = CmMsg {
            kind: CmKind::Rep,
            job: job_hash("kvs_1"),
            src: 3,
            dst: 7,
            gen: 2,
            ep: Endpoint {
                gid: Gid([9; 16]),
                qpn: 0x12_3456,
                psn: 0xab_cdef,
                lid: 17,
            },
        };
        assert_eq!(CmMsg::decode(&m.encode()), Some(m));
        let mut bad = m.encode();
        bad[0] ^= 1;
        assert_eq!(CmMsg::decode(&bad), None);
        assert_eq!(CmMsg::decode(&m.encode()[..CM_LEN - 1]), None);
    }

    #[test]
    fn frames_must_add_up() {
        let mut b = vec![0u8; FRAME_HDR + 3 + 5];
        let f = Frame {
            kind: FrameKind::Am,
            hlen: 3,
            plen: 5,
            seq: 7,
            ack: 0xdead_beef,
        };
        f.write(&mut b);
        assert_eq!(Frame::read(&b, 64), Some(f));
        assert_eq!(Frame::read(&b[..b.len() - 1], 64), None);
        assert_eq!(Frame::read(&b, 2), None, "header longer than allowed");
    }

    #[test]
    fn offers_round_trip_and_control_frames_carry_nothing() {
        let o = Offer {
            addr: 0x7f00_1234_5000,
            rkey: 77,
            design: 3,
            size: 65536,
            slot: 4096,
        };
        assert_eq!(Offer::decode(&o.encode()), Some(o));
        let mut bad = o.encode();
        bad[12] = 4;
        assert_eq!(Offer::decode(&bad), None, "unknown design");
        let mut b = vec![0u8; FRAME_HDR + 1];
        Frame {
            kind: FrameKind::Credit,
            hlen: 0,
            plen: 1,
            seq: 0,
            ack: 5,
        }
        .write(&mut b);
        assert_eq!(Frame::read(&b, 64), None, "a credit frame has no payload");
    }

    proptest! {
        #[test]
        fn decoding_never_panics(b in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = CmMsg::decode(&b);
            let _ = Frame::read(&b, 64);
            let _ = Offer::decode(&b);
        }
    }
}

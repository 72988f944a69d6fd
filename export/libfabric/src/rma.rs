//! libfabric's RMA and atomics (`FI_RMA`, `FI_ATOMIC`) over weft messages: the part without
//! I/O.
//!
//! A remote write, read or atomic is a control message to the target's weft-fi (on the same
//! control tag as messages, told apart by its first byte), which checks the key, the bounds
//! and the rights against the target's registered regions and carries the operation out in
//! the target's progress — the core's active-message RMA, read in reverse, as libfabric's
//! `rxm` emulates RMA over `FI_MSG`. Small payloads travel inside the control message; a
//! write or read larger than [`INLINE`] moves its data as a second weft message on a tag of
//! its own, straight between the origin's buffer and the target's region (by the weft
//! provider's own rendezvous: single copy on limic, RDMA read on verbs-rc). Every operation
//! is answered by a [`Kind::Reply`] (with the fetched bytes of a small read or an atomic), so
//! an origin's completion means the target's memory holds the result (`FI_DELIVERY_COMPLETE`).
//! Atomics are atomic with respect to each other: one target applies them one at a time,
//! under weft-fi's lock.
//!
//! This module holds the control message's codec, the registered regions and their checks,
//! and the atomic operations.

use crate::matching::{EAGER, HDR};
use weft_ofi_sys as fi;

/// Bytes of an RMA control message's header.
pub const RHDR: usize = 56;
/// Writes and reads up to this size carry their data inside control messages (one copy at
/// each end); larger ones as a message of their own.
pub const INLINE: usize = 4096;
/// Bytes of operand an atomic may carry (a compare carries twice as many: operand and
/// comparand), so that every control message fits a bounce buffer.
pub const ATOMIC_MAX: usize = 2048;

const _: () = assert!(RHDR + 2 * ATOMIC_MAX <= HDR + EAGER && RHDR + INLINE <= HDR + EAGER);

/// The first byte of an RMA control message (message headers begin with another).
pub const MAGIC: u8 = 0xf2;
const F_DATA: u8 = 1;
const F_LONG: u8 = 2;

/// What an RMA control message asks or answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Write = 1,
    Read = 2,
    /// An atomic without a result (`fi_atomic`).
    Atomic = 3,
    /// An atomic that returns the target's old value (`fi_fetch_atomic`).
    Fetch = 4,
    /// A compare atomic (`fi_compare_atomic`): operand, then comparand.
    Compare = 5,
    /// The target's answer: a status and, for a small read or a fetching atomic, the bytes.
    Reply = 6,
}

impl Kind {
    fn of(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Write,
            2 => Kind::Read,
            3 => Kind::Atomic,
            4 => Kind::Fetch,
            5 => Kind::Compare,
            6 => Kind::Reply,
            _ => return None,
        })
    }
}

/// An RMA control message's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RHdr {
    pub kind: Kind,
    /// `fi_op` and `fi_datatype` of an atomic.
    pub op: u8,
    pub dtype: u8,
    /// Remote CQ data (`fi_writedata`).
    pub data: Option<u64>,
    /// For data that travels as a message of its own: its weft tag.
    pub long: Option<u32>,
    /// A reply's status: 0 or a positive libfabric error code.
    pub status: u32,
    /// The origin's operation, echoed by the reply.
    pub id: u64,
    pub key: u64,
    /// The target address (virtual, or an offset into the region: the domain's MR mode).
    pub addr: u64,
    /// Bytes the operation touches at the target.
    pub len: u64,
}

impl RHdr {
    /// A header of `kind` with everything else empty.
    pub fn new(kind: Kind, id: u64) -> RHdr {
        RHdr {
            kind,
            op: 0,
            dtype: 0,
            data: None,
            long: None,
            status: 0,
            id,
            key: 0,
            addr: 0,
            len: 0,
        }
    }

    pub fn encode(&self) -> [u8; RHDR] {
        let mut b = [0u8; RHDR];
        b[0] = MAGIC;
        b[1] = self.kind as u8;
        b[2] = self.op;
        b[3] = self.dtype;
        b[4] = (if self.data.is_some() { F_DATA } else { 0 })
            | (if self.long.is_some() { F_LONG } else { 0 });
        b[8..12].copy_from_slice(&self.long.unwrap_or(0).to_le_bytes());
        b[12..16].copy_from_slice(&self.status.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..32].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.addr.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b[48..56].copy_from_slice(&self.data.unwrap_or(0).to_le_bytes());
        b
    }

    /// The header and payload of an RMA control message; `None` for anything malformed: a
    /// wrong magic, kind or flags, an atomic of an unknown type or operation, a payload that
    /// is not what the kind and length say.
    pub fn decode(b: &[u8]) -> Option<(RHdr, &[u8])> {
        if b.len() < RHDR || b[0] != MAGIC || b[4] & !(F_DATA | F_LONG) != 0 {
            return None;
        }
        let kind = Kind::of(b[1])?;
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let h = RHdr {
            kind,
            op: b[2],
            dtype: b[3],
            data: (b[4] & F_DATA != 0).then(|| u64_at(48)),
            long: (b[4] & F_LONG != 0).then(|| u32_at(8)),
            status: u32_at(12),
            id: u64_at(16),
            key: u64_at(24),
            addr: u64_at(32),
            len: u64_at(40),
        };
        let p = &b[RHDR..];
        let n = p.len() as u64;
        let ok = match kind {
            Kind::Write => match h.long {
                Some(_) => n == 0 && h.len > INLINE as u64,
                None => n == h.len && h.len <= INLINE as u64,
            },
            Kind::Read => n == 0 && (h.long.is_some() || h.len <= INLINE as u64),
            Kind::Atomic | Kind::Fetch | Kind::Compare => {
                let per = if kind == Kind::Compare { 2 } else { 1 };
                h.long.is_none()
                    && h.len <= ATOMIC_MAX as u64
                    && n == per * h.len
                    && valid(kind, h.op as u32, h.dtype as u32)
                    && h.len % size_of(h.dtype as u32).unwrap_or(1) as u64 == 0
            }
            Kind::Reply => h.long.is_none() && n <= INLINE as u64,
        };
        ok.then_some((h, p))
    }
}

/// A registered region, as its target checks remote accesses against it.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub base: usize,
    pub len: usize,
    /// `FI_REMOTE_READ`, `FI_REMOTE_WRITE` (0 at registration means every right).
    pub access: u64,
    /// Remote addresses are virtual addresses (`FI_MR_VIRT_ADDR`); else offsets from
    /// `offset`, the value given at registration.
    pub virt: bool,
    pub offset: u64,
}

impl Region {
    /// The address in this process of `len` bytes at remote address `addr`, if they lie in
    /// the region and `need` (`FI_REMOTE_READ` and/or `FI_REMOTE_WRITE`) is granted; else
    /// the positive error code the origin gets (`FI_EACCES`).
    pub fn resolve(&self, addr: u64, len: u64, need: u64) -> Result<usize, u64> {
        if self.access & need != need {
            return Err(fi::FI_EACCES);
        }
        let start = if self.virt {
            self.base as u64
        } else {
            self.offset
        };
        let rel = addr.checked_sub(start).ok_or(fi::FI_EACCES)?;
        match rel.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(self.base + rel as usize),
            _ => Err(fi::FI_EACCES),
        }
    }
}

/// Bytes of one element of `dtype` (the complex and long double types are not offered).
pub fn size_of(dtype: u32) -> Option<usize> {
    Some(match dtype {
        fi::FI_INT8 | fi::FI_UINT8 => 1,
        fi::FI_INT16 | fi::FI_UINT16 => 2,
        fi::FI_INT32 | fi::FI_UINT32 | fi::FI_FLOAT => 4,
        fi::FI_INT64 | fi::FI_UINT64 | fi::FI_DOUBLE => 8,
        _ => return None,
    })
}

fn is_float(dtype: u32) -> bool {
    matches!(dtype, fi::FI_FLOAT | fi::FI_DOUBLE)
}

/// Whether `op` on `dtype` is offered for the call `kind` (`fi_atomicvalid`,
/// `fi_fetch_atomicvalid`, `fi_compare_atomicvalid`).
pub fn valid(kind: Kind, op: u32, dtype: u32) -> bool {
    if size_of(dtype).is_none() {
        return false;
    }
    let bits = matches!(
        op,
        fi::FI_LOR | fi::FI_LAND | fi::FI_BOR | fi::FI_BAND | fi::FI_LXOR | fi::FI_BXOR
    );
    let ok_type = !(is_float(dtype) && (bits || op == fi::FI_MSWAP));
    ok_type
        && match kind {
            Kind::Atomic => op <= fi::FI_BXOR || op == fi::FI_ATOMIC_WRITE,
            Kind::Fetch => op <= fi::FI_ATOMIC_WRITE,
            Kind::Compare => (fi::FI_CSWAP..=fi::FI_MSWAP).contains(&op),
            _ => false,
        }
}

/// The elements an atomic works on.
trait Elem: Copy + PartialOrd {
    const SIZE: usize;
    fn get(b: &[u8]) -> Self;
    fn put(self, b: &mut [u8]);
    fn op(self, o: Self, op: u32) -> Self;
    fn is_zero(self) -> bool;
    fn one_if(c: bool) -> Self;
    /// `(o & mask) | (t & !mask)` (integers only: `valid` refuses MSWAP on floats).
    fn mswap(self, o: Self, mask: Self) -> Self;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b[..Self::SIZE].try_into().expect("element"))
            }
            fn put(self, b: &mut [u8]) {
                b[..Self::SIZE].copy_from_slice(&self.to_le_bytes());
            }
            fn op(self, o: Self, op: u32) -> Self {
                match op {
                    fi::FI_MIN => self.min(o),
                    fi::FI_MAX => self.max(o),
                    fi::FI_SUM => self.wrapping_add(o),
                    fi::FI_PROD => self.wrapping_mul(o),
                    fi::FI_LOR => Self::one_if(!self.is_zero() || !o.is_zero()),
                    fi::FI_LAND => Self::one_if(!self.is_zero() && !o.is_zero()),
                    fi::FI_LXOR => Self::one_if(self.is_zero() != o.is_zero()),
                    fi::FI_BOR => self | o,
                    fi::FI_BAND => self & o,
                    fi::FI_BXOR => self ^ o,
                    fi::FI_ATOMIC_WRITE => o,
                    _ => self,
                }
            }
            fn is_zero(self) -> bool { self == 0 }
            fn one_if(c: bool) -> Self { c as $t }
            fn mswap(self, o: Self, mask: Self) -> Self { (o & mask) | (self & !mask) }
        }
    )*};
}
int_elem!(i8, u8, i16, u16, i32, u32, i64, u64);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b[..Self::SIZE].try_into().expect("element"))
            }
            fn put(self, b: &mut [u8]) {
                b[..Self::SIZE].copy_from_slice(&self.to_le_bytes());
            }
            fn op(self, o: Self, op: u32) -> Self {
                match op {
                    fi::FI_MIN => self.min(o),
                    fi::FI_MAX => self.max(o),
                    fi::FI_SUM => self + o,
                    fi::FI_PROD => self * o,
                    fi::FI_ATOMIC_WRITE => o,
                    _ => self,
                }
            }
            fn is_zero(self) -> bool { self == 0.0 }
            fn one_if(c: bool) -> Self { if c { 1.0 } else { 0.0 } }
            fn mswap(self, _: Self, _: Self) -> Self { self }
        }
    )*};
}
float_elem!(f32, f64);

/// Apply `op` element by element to `target` (the bytes read from the target's memory,
/// written back by the caller) with `operand` and, for compares, `compare`. `target` holds
/// the old value on entry and the new one on return.
fn apply_as<T: Elem>(op: u32, target: &mut [u8], operand: &[u8], compare: &[u8]) {
    for (i, t) in target.chunks_exact_mut(T::SIZE).enumerate() {
        let at = i * T::SIZE..(i + 1) * T::SIZE;
        let old = T::get(t);
        let o = T::get(&operand[at.clone()]);
        let new = if op >= fi::FI_CSWAP {
            let c = T::get(&compare[at]);
            let swap = match op {
                fi::FI_CSWAP => c == old,
                fi::FI_CSWAP_NE => c != old,
                fi::FI_CSWAP_LE => c <= old,
                fi::FI_CSWAP_LT => c < old,
                fi::FI_CSWAP_GE => c >= old,
                fi::FI_CSWAP_GT => c > old,
                fi::FI_MSWAP => {
                    old.mswap(o, c).put(t);
                    continue;
                }
                _ => false,
            };
            if swap {
                o
            } else {
                old
            }
        } else {
            old.op(o, op)
        };
        new.put(t);
    }
}

/// An atomic on `target` (its current bytes in, the new ones out); the caller checked the
/// operation with [`valid`] and the lengths (`operand` and `compare` as long as `target`, a
/// whole number of elements).
pub fn apply(op: u32, dtype: u32, target: &mut [u8], operand: &[u8], compare: &[u8]) {
    match dtype {
        fi::FI_INT8 => apply_as::<i8>(op, target, operand, compare),
        fi::FI_UINT8 => apply_as::<u8>(op, target, operand, compare),
        fi::FI_INT16 => apply_as::<i16>(op, target, operand, compare),
        fi::FI_UINT16 => apply_as::<u16>(op, target, operand, compare),
        fi::FI_INT32 => apply_as::<i32>(op, target, operand, compare),
        fi::FI_UINT32 => apply_as::<u32>(op, target, operand, compare),
        fi::FI_INT64 => apply_as::<i64>(op, target, operand, compare),
        fi::FI_UINT64 => apply_as::<u64>(op, target, operand, compare),
        fi::FI_FLOAT => apply_as::<f32>(op, target, operand, compare),
        fi::FI_DOUBLE => apply_as::<f64>(op, target, operand, compare),
        _ => {}
    }
}

#[cfg(test)]
mod t {
    use super::*;
    use proptest::prelude::*;

    fn u64s(v: &[u64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn atomics_compute_what_libfabric_says() {
        let mut t = u64s(&[5, 7]);
        apply(
            fi::FI_SUM,
            fi::FI_UINT64,
            &mut t,
            &u64s(&[1, u64::MAX]),
            &[],
        );
        assert_eq!(t, u64s(&[6, 6]), "sums wrap");
        apply(
            fi::FI_CSWAP,
            fi::FI_UINT64,
            &mut t,
            &u64s(&[9, 9]),
            &u64s(&[6, 0]),
        );
        assert_eq!(t, u64s(&[9, 6]), "swap only where the comparand equals");
        apply(
            fi::FI_CSWAP_GT,
            fi::FI_UINT64,
            &mut t,
            &u64s(&[1, 1]),
            &u64s(&[10, 5]),
        );
        assert_eq!(t, u64s(&[1, 6]), "swap where comparand > target");
        apply(
            fi::FI_MSWAP,
            fi::FI_UINT64,
            &mut t,
            &u64s(&[0xff, 0xff]),
            &u64s(&[0x0f, 0]),
        );
        assert_eq!(
            t,
            u64s(&[0x0f, 6]),
            "the masked bits from the operand, the rest kept"
        );
        let mut f = 1.5f64.to_le_bytes().to_vec();
        apply(
            fi::FI_PROD,
            fi::FI_DOUBLE,
            &mut f,
            &2.0f64.to_le_bytes(),
            &[],
        );
        assert_eq!(f, 3.0f64.to_le_bytes());
        let mut i = (-3i32).to_le_bytes().to_vec();
        apply(
            fi::FI_MAX,
            fi::FI_INT32,
            &mut i,
            &(-7i32).to_le_bytes(),
            &[],
        );
        assert_eq!(i, (-3i32).to_le_bytes(), "signed comparison");
        apply(fi::FI_LXOR, fi::FI_INT32, &mut i, &0i32.to_le_bytes(), &[]);
        assert_eq!(i, 1i32.to_le_bytes());
    }

    #[test]
    fn calls_offer_their_operations_only() {
        assert!(valid(Kind::Atomic, fi::FI_SUM, fi::FI_UINT64));
        assert!(!valid(Kind::Atomic, fi::FI_ATOMIC_READ, fi::FI_UINT64));
        assert!(valid(Kind::Fetch, fi::FI_ATOMIC_READ, fi::FI_UINT32));
        assert!(!valid(Kind::Fetch, fi::FI_CSWAP, fi::FI_UINT32));
        assert!(valid(Kind::Compare, fi::FI_CSWAP, fi::FI_INT64));
        assert!(!valid(Kind::Compare, fi::FI_SUM, fi::FI_INT64));
        assert!(
            !valid(Kind::Atomic, fi::FI_BOR, fi::FI_DOUBLE),
            "bits of floats"
        );
        assert!(!valid(Kind::Compare, fi::FI_MSWAP, fi::FI_FLOAT));
        assert!(!valid(Kind::Atomic, fi::FI_SUM, fi::FI_LONG_DOUBLE));
        assert!(!valid(Kind::Atomic, fi::FI_SUM, fi::FI_DATATYPE_LAST));
    }

    #[test]
    fn regions_refuse_what_lies_outside_or_is_not_granted() {
        let r = Region {
            base: 0x1000,
            len: 64,
            access: fi::FI_REMOTE_READ,
            virt: true,
            offset: 0,
        };
        assert_eq!(r.resolve(0x1000, 64, fi::FI_REMOTE_READ), Ok(0x1000));
        assert_eq!(r.resolve(0x1010, 8, fi::FI_REMOTE_READ), Ok(0x1010));
        let no = Err(fi::FI_EACCES);
        assert_eq!(
            r.resolve(0x1000, 65, fi::FI_REMOTE_READ),
            no,
            "past the end"
        );
        assert_eq!(
            r.resolve(0xfff, 1, fi::FI_REMOTE_READ),
            no,
            "before the start"
        );
        assert_eq!(
            r.resolve(0x1000, u64::MAX, fi::FI_REMOTE_READ),
            no,
            "overflow"
        );
        assert_eq!(r.resolve(0x1000, 8, fi::FI_REMOTE_WRITE), no, "not granted");
        let o = Region {
            virt: false,
            offset: 100,
            ..r
        };
        assert_eq!(
            o.resolve(100, 64, fi::FI_REMOTE_READ),
            Ok(0x1000),
            "offsets"
        );
        assert_eq!(o.resolve(0x1000, 1, fi::FI_REMOTE_READ), no);
    }

    #[test]
    fn malformed_control_messages_are_refused() {
        let mut h = RHdr::new(Kind::Write, 7);
        h.len = 3;
        let mut m = h.encode().to_vec();
        m.extend_from_slice(&[1, 2, 3]);
        assert_eq!(RHdr::decode(&m).map(|(h, p)| (h, p.len())), Some((h, 3)));
        assert!(RHdr::decode(&m[..m.len() - 1]).is_none(), "short payload");
        let mut bad = m.clone();
        bad[1] = 9;
        assert!(RHdr::decode(&bad).is_none(), "unknown kind");
        let mut a = RHdr::new(Kind::Fetch, 1);
        a.op = fi::FI_SUM as u8;
        a.dtype = fi::FI_UINT64 as u8;
        a.len = 12;
        let mut m = a.encode().to_vec();
        m.extend_from_slice(&[0; 12]);
        assert!(RHdr::decode(&m).is_none(), "not a whole number of elements");
        let mut r = RHdr::new(Kind::Read, 2);
        r.len = INLINE as u64 + 1;
        assert!(
            RHdr::decode(&r.encode()).is_none(),
            "a long read names its tag"
        );
        r.long = Some(5);
        assert!(RHdr::decode(&r.encode()).is_some());
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = RHdr::decode(&b);
        }

        #[test]
        fn headers_round_trip(kind in 1u8..=6, id: u64, key: u64, addr: u64, data: Option<u64>) {
            let kind = Kind::of(kind).unwrap();
            let mut h = RHdr::new(kind, id);
            h.key = key;
            h.addr = addr;
            h.data = data;
            if kind == Kind::Read {
                h.long = Some(3);
                h.len = 1 << 20;
            }
            if matches!(kind, Kind::Atomic | Kind::Fetch | Kind::Compare) {
                // An atomic of no elements: an operation each call offers.
                h.op = if kind == Kind::Compare { fi::FI_CSWAP } else { fi::FI_SUM } as u8;
                h.dtype = fi::FI_UINT64 as u8;
            }
            let m = h.encode();
            let (d, p) = RHdr::decode(&m).unwrap();
            prop_assert_eq!(d, h);
            prop_assert!(p.is_empty());
        }
    }
}

//! Basic element types, reduction/atomic operations and the per-(op, type) capability table.

use crate::{Error, Result};

/// A rank: an index into a communicator (or, inside providers, into the world).
pub type Rank = u32;

/// What a completed receive (or probe) tells: source rank in the communicator, tag, and the
/// message length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    pub source: u32,
    pub tag: i32,
    /// Length of the message in bytes.
    pub bytes: usize,
    /// The request was cancelled (MPI_Test_cancelled).
    pub cancelled: bool,
}

impl Status {
    /// Number of whole `T` elements in the message (MPI_Get_count).
    pub fn count<T>(&self) -> usize {
        self.bytes / std::mem::size_of::<T>().max(1)
    }
}

/// The basic element types that datatypes, reductions and atomics are built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum BasicType {
    I8 = 0,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    F32,
    F64,
}

impl BasicType {
    pub const ALL: [BasicType; 10] = [
        BasicType::I8,
        BasicType::U8,
        BasicType::I16,
        BasicType::U16,
        BasicType::I32,
        BasicType::U32,
        BasicType::I64,
        BasicType::U64,
        BasicType::F32,
        BasicType::F64,
    ];

    /// Size in bytes.
    pub const fn size(self) -> usize {
        match self {
            BasicType::I8 | BasicType::U8 => 1,
            BasicType::I16 | BasicType::U16 => 2,
            BasicType::I32 | BasicType::U32 | BasicType::F32 => 4,
            BasicType::I64 | BasicType::U64 | BasicType::F64 => 8,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            BasicType::I8 => "i8",
            BasicType::U8 => "u8",
            BasicType::I16 => "i16",
            BasicType::U16 => "u16",
            BasicType::I32 => "i32",
            BasicType::U32 => "u32",
            BasicType::I64 => "i64",
            BasicType::U64 => "u64",
            BasicType::F32 => "f32",
            BasicType::F64 => "f64",
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, BasicType::F32 | BasicType::F64)
    }

    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.get(v as usize).copied()
    }
}

/// Rust types that correspond to a [`BasicType`]; messages and windows are slices of these.
pub trait Element: bytemuck::Pod + PartialOrd + Send + Sync + 'static {
    const TYPE: BasicType;
}

macro_rules! element {
    ($($t:ty => $b:ident),*) => { $(impl Element for $t { const TYPE: BasicType = BasicType::$b; })* };
}
element!(i8 => I8, u8 => U8, i16 => I16, u16 => U16, i32 => I32, u32 => U32,
         i64 => I64, u64 => U64, f32 => F32, f64 => F64);

/// Reduction and accumulate operations (MPI_Op), plus compare-and-swap for the atomic table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Op {
    Sum = 0,
    Prod,
    Min,
    Max,
    Band,
    Bor,
    Bxor,
    Land,
    Lor,
    Lxor,
    Replace,
    NoOp,
    Cswap,
}

impl Op {
    pub const ALL: [Op; 13] = [
        Op::Sum,
        Op::Prod,
        Op::Min,
        Op::Max,
        Op::Band,
        Op::Bor,
        Op::Bxor,
        Op::Land,
        Op::Lor,
        Op::Lxor,
        Op::Replace,
        Op::NoOp,
        Op::Cswap,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Op::Sum => "sum",
            Op::Prod => "prod",
            Op::Min => "min",
            Op::Max => "max",
            Op::Band => "band",
            Op::Bor => "bor",
            Op::Bxor => "bxor",
            Op::Land => "land",
            Op::Lor => "lor",
            Op::Lxor => "lxor",
            Op::Replace => "replace",
            Op::NoOp => "no_op",
            Op::Cswap => "cswap",
        }
    }

    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.get(v as usize).copied()
    }

    /// Whether the operation is defined on the type (bitwise ops are not defined on floats).
    pub const fn valid_for(self, t: BasicType) -> bool {
        !(t.is_float() && matches!(self, Op::Band | Op::Bor | Op::Bxor))
    }
}

/// Which (operation, type) pairs a provider performs natively, like libfabric's
/// `fi_query_atomic`. One bit per basic type for each operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AtomicTable {
    bits: [u16; 13],
}

impl AtomicTable {
    pub const NONE: AtomicTable = AtomicTable { bits: [0; 13] };

    /// Every valid pair.
    pub fn all() -> Self {
        let mut t = Self::NONE;
        for op in Op::ALL {
            for ty in BasicType::ALL {
                if op.valid_for(ty) {
                    t.set(op, ty, true);
                }
            }
        }
        t
    }

    pub fn set(&mut self, op: Op, ty: BasicType, native: bool) {
        let bit = 1u16 << (ty as u8);
        if native {
            self.bits[op as usize] |= bit;
        } else {
            self.bits[op as usize] &= !bit;
        }
    }

    /// `fi_query_atomic`: is `op` on `ty` native?
    pub fn query(&self, op: Op, ty: BasicType) -> bool {
        self.bits[op as usize] & (1 << (ty as u8)) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|b| *b == 0)
    }

    /// Raw bitmask of `op` (bit i = `BasicType` i), for the C ABI.
    pub fn mask(&self, op: Op) -> u16 {
        self.bits[op as usize]
    }

    pub fn from_masks(bits: [u16; 13]) -> Self {
        AtomicTable { bits }
    }
}

/// Apply `op` element-wise: `target[i] = target[i] op origin[i]`, over raw little-endian bytes of
/// type `ty`. `Cswap` is not a reduction and is rejected here.
pub fn apply_op(op: Op, ty: BasicType, target: &mut [u8], origin: &[u8]) -> Result<()> {
    if target.len() != origin.len() || target.len() % ty.size() != 0 {
        return Err(Error::invalid(format!(
            "reduction over {} and {} bytes of {}",
            target.len(),
            origin.len(),
            ty.name()
        )));
    }
    if !op.valid_for(ty) || op == Op::Cswap {
        return Err(Error::invalid(format!(
            "operation {} is not defined on {}",
            op.name(),
            ty.name()
        )));
    }
    macro_rules! run {
        ($t:ty, $int:tt) => {{
            let n = target.len() / std::mem::size_of::<$t>();
            for i in 0..n {
                let s = i * std::mem::size_of::<$t>();
                let e = s + std::mem::size_of::<$t>();
                let a = <$t>::from_le_bytes(target[s..e].try_into().unwrap());
                let b = <$t>::from_le_bytes(origin[s..e].try_into().unwrap());
                let r: $t = run!(@op $t, $int, a, b);
                target[s..e].copy_from_slice(&r.to_le_bytes());
            }
        }};
        (@op $t:ty, int, $a:ident, $b:ident) => {
            match op {
                Op::Sum => $a.wrapping_add($b),
                Op::Prod => $a.wrapping_mul($b),
                Op::Min => if $b < $a { $b } else { $a },
                Op::Max => if $b > $a { $b } else { $a },
                Op::Band => $a & $b,
                Op::Bor => $a | $b,
                Op::Bxor => $a ^ $b,
                Op::Land => ((($a != 0) && ($b != 0)) as u8) as $t,
                Op::Lor => ((($a != 0) || ($b != 0)) as u8) as $t,
                Op::Lxor => ((($a != 0) != ($b != 0)) as u8) as $t,
                Op::Replace => $b,
                Op::NoOp | Op::Cswap => $a,
            }
        };
        (@op $t:ty, float, $a:ident, $b:ident) => {
            match op {
                Op::Sum => $a + $b,
                Op::Prod => $a * $b,
                Op::Min => if $b < $a { $b } else { $a },
                Op::Max => if $b > $a { $b } else { $a },
                Op::Land => ((($a != 0.0) && ($b != 0.0)) as u8) as $t,
                Op::Lor => ((($a != 0.0) || ($b != 0.0)) as u8) as $t,
                Op::Lxor => ((($a != 0.0) != ($b != 0.0)) as u8) as $t,
                Op::Replace => $b,
                Op::Band | Op::Bor | Op::Bxor | Op::NoOp | Op::Cswap => $a,
            }
        };
    }
    match ty {
        BasicType::I8 => run!(i8, int),
        BasicType::U8 => run!(u8, int),
        BasicType::I16 => run!(i16, int),
        BasicType::U16 => run!(u16, int),
        BasicType::I32 => run!(i32, int),
        BasicType::U32 => run!(u32, int),
        BasicType::I64 => run!(i64, int),
        BasicType::U64 => run!(u64, int),
        BasicType::F32 => run!(f32, float),
        BasicType::F64 => run!(f64, float),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_and_logical_ops() {
        let mut t = bytemuck::cast_slice::<i32, u8>(&[1, -2, 0]).to_vec();
        let o = bytemuck::cast_slice::<i32, u8>(&[5, 7, 3]).to_vec();
        apply_op(Op::Sum, BasicType::I32, &mut t, &o).unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&t), &[6, 5, 3]);
        apply_op(Op::Land, BasicType::I32, &mut t, &[0u8; 12]).unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&t), &[0, 0, 0]);
        let mut f = bytemuck::cast_slice::<f64, u8>(&[1.5, 2.0]).to_vec();
        let g = bytemuck::cast_slice::<f64, u8>(&[0.5, 9.0]).to_vec();
        apply_op(Op::Max, BasicType::F64, &mut f, &g).unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f64>(&f), &[1.5, 9.0]);
    }

    #[test]
    fn bad_reductions_are_errors() {
        let mut t = vec![0u8; 8];
        assert!(apply_op(Op::Band, BasicType::F64, &mut t, &[0u8; 8]).is_err());
        assert!(apply_op(Op::Sum, BasicType::I32, &mut t, &[0u8; 4]).is_err());
        assert!(apply_op(Op::Sum, BasicType::I32, &mut t[..6], &[0u8; 6]).is_err());
    }

    #[test]
    fn atomic_table_query() {
        let mut t = AtomicTable::NONE;
        assert!(!t.query(Op::Sum, BasicType::U64));
        t.set(Op::Sum, BasicType::U64, true);
        assert!(t.query(Op::Sum, BasicType::U64));
        assert!(!t.query(Op::Sum, BasicType::I64));
        let all = AtomicTable::all();
        assert!(!all.query(Op::Bxor, BasicType::F32));
        assert!(all.query(Op::Cswap, BasicType::F32));
    }
}

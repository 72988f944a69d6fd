//! Window memory in shared memory: one pool per host, created with the message segment and
//! unlinked as soon as every local rank has mapped it. Each local rank owns an equal slice and
//! allocates its windows there, each preceded by a 64-byte header holding the window's lock
//! word. Pages are only backed when touched, so a large pool costs nothing until used.
//!
//! Native RMA on these windows is a memory copy; atomics are CPU atomics (integers directly,
//! floating point through compare-and-swap loops); passive-target locks live in the window's
//! header ([`crate::lock`]: an exclusive word and a flag per local rank, taken over from a
//! holder that died) — no help from the target process is needed.

use crate::lock::LockView;
use crate::segment::Mapping;
use crate::sync::{AtomicU64, AtomicU8, Ordering};
use weft_provider::{BasicType, Error, ErrorDetail, Op, Result};

/// Key of every pool region.
pub const POOL_KEY: u64 = 0x5745_4654_504f_4f4c; // "WEFTPOOL"
const HDR: usize = 4096;

#[repr(C)]
struct PoolHeader {
    magic: AtomicU64,
    per: AtomicU64,
    nlocal: AtomicU64,
    mapped: AtomicU64,
}

/// The mapped pool and this rank's allocator.
pub struct Pool {
    map: Mapping,
    per: usize,
    nlocal: usize,
    me: usize,
    next: usize,
    free: Vec<(usize, usize)>,
}

fn round(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl Pool {
    /// Create the pool for `nlocal` ranks of `per_rank` bytes each (first local rank).
    pub fn create(name: &str, nlocal: usize, per_rank: usize, me: usize) -> Result<Pool> {
        let per = round(per_rank.max(4096), 4096);
        let map = Mapping::create(name, HDR + per * nlocal, false)?;
        // SAFETY: offset 0 of a fresh mapping of at least HDR bytes; nobody else has it yet.
        let h = unsafe { &*(map.base() as *const PoolHeader) };
        h.per.store(per as u64, Ordering::Relaxed);
        h.nlocal.store(nlocal as u64, Ordering::Relaxed);
        h.magic.store(POOL_KEY, Ordering::Release);
        Ok(Pool {
            map,
            per,
            nlocal,
            me,
            next: 0,
            free: Vec::new(),
        })
    }

    /// Open a pool another rank created.
    pub fn open(name: &str, me: usize) -> Result<Pool> {
        let map = Mapping::open(name, HDR, false)?;
        // SAFETY: the mapping has at least HDR bytes (checked by open).
        let h = unsafe { &*(map.base() as *const PoolHeader) };
        if h.magic.load(Ordering::Acquire) != POOL_KEY {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "{name} is not a weft window pool"
            ))));
        }
        let per = h.per.load(Ordering::Relaxed) as usize;
        let nlocal = h.nlocal.load(Ordering::Relaxed) as usize;
        if HDR + per * nlocal > map.len() || me >= nlocal {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "{name} has an inconsistent layout"
            ))));
        }
        Ok(Pool {
            map,
            per,
            nlocal,
            me,
            next: 0,
            free: Vec::new(),
        })
    }

    /// Count this rank as mapped; the last one removes the name.
    pub fn mark_mapped(&mut self) {
        // SAFETY: header at offset 0 (see create/open).
        let h = unsafe { &*(self.map.base() as *const PoolHeader) };
        if h.mapped.fetch_add(1, Ordering::AcqRel) as usize + 1 >= self.nlocal {
            self.map.unlink();
        }
    }

    /// Bytes of a window's header: the lock's exclusive word on a line of its own, then one
    /// shared flag per local rank.
    fn win_hdr(&self) -> usize {
        64 + round(self.nlocal, 64)
    }

    fn region(&self, li: usize) -> (usize, usize) {
        let start = HDR + li * self.per;
        (start, start + self.per)
    }

    /// Allocate `len` bytes; returns the pool offset of the data (its header precedes it).
    pub fn alloc(&mut self, len: usize) -> Result<usize> {
        let hdr = self.win_hdr();
        let need = hdr + round(len.max(1), 64);
        let (start, end) = self.region(self.me);
        let rel = if let Some(i) = self.free.iter().position(|(_, l)| *l >= need) {
            let (o, l) = self.free.swap_remove(i);
            if l > need {
                self.free.push((o + need, l - need));
            }
            o
        } else {
            let o = self.next;
            if start + o + need > end {
                return Err(Error::from(ErrorDetail::Unsupported(format!(
                    "window pool exhausted: {need} more bytes do not fit this rank's {} (WEFT_SHM_WIN_POOL)",
                    self.per
                ))));
            }
            self.next += need;
            o
        };
        let data = start + rel + hdr;
        // A fresh lock.
        let l = self.lock(data);
        for f in l.flags {
            f.store(0, Ordering::Relaxed);
        }
        l.excl.store(0, Ordering::Release);
        Ok(data)
    }

    /// Return an allocation made by [`Pool::alloc`].
    pub fn free(&mut self, data: usize, len: usize) {
        let (start, _) = self.region(self.me);
        let hdr = self.win_hdr();
        if data < start + hdr {
            return;
        }
        let rel = data - hdr - start;
        let need = hdr + round(len.max(1), 64);
        if rel + need == self.next {
            self.next = rel;
        } else {
            self.free.push((rel, need));
        }
    }

    pub fn ptr(&self, off: usize) -> *mut u8 {
        // SAFETY: callers pass offsets checked by `check`.
        unsafe { self.map.base().add(off) }
    }

    /// Check that `[addr, addr + n)` lies in the data area of local rank `li`'s slice.
    pub fn check(&self, li: usize, key: u64, addr: u64, n: usize) -> Result<usize> {
        let (start, end) = self.region(li);
        let a = addr as usize;
        if key != POOL_KEY || a < start + self.win_hdr() || a.checked_add(n).is_none_or(|e| e > end)
        {
            return Err(Error::from(ErrorDetail::RemoteAccess {
                rank: li as u32,
                what: format!(
                    "{n} bytes at pool offset {addr} with key {key:#x} are outside the window pool"
                ),
            }));
        }
        Ok(a)
    }

    /// The lock in the header of the window whose data starts at `data`.
    fn lock(&self, data: usize) -> LockView<'_> {
        let hdr = self.map.base().wrapping_add(data - self.win_hdr());
        // SAFETY: `data - win_hdr` is the 64-byte-aligned header of an allocation (callers check
        // `data` with `check`, which guarantees `data >= start + win_hdr`): an 8-byte word,
        // then `nlocal` flag bytes at offset 64, all in the mapping and only ever accessed
        // atomically (by every process mapping the pool).
        unsafe {
            LockView {
                excl: &*(hdr as *const AtomicU64),
                flags: std::slice::from_raw_parts(hdr.add(64) as *const AtomicU8, self.nlocal),
            }
        }
    }

    /// Try to take the lock of the window at `data` for this rank; `alive(i)`: whether local
    /// rank `i` still runs (a dead holder's share is taken over).
    pub fn try_lock(&self, data: usize, exclusive: bool, alive: impl Fn(usize) -> bool) -> bool {
        self.lock(data).try_lock(self.me, exclusive, alive)
    }

    pub fn unlock(&self, data: usize, exclusive: bool) {
        self.lock(data).unlock(self.me, exclusive)
    }
}

/// Apply `op` atomically to each of `count` elements of `ty` at `target`, reading operands at
/// `origin` (and `compare` for compare-and-swap), writing old values to `result` when it is
/// not null.
///
/// # Safety
/// `target` must be aligned for `ty` and valid for `count` elements of shared memory that is
/// only accessed atomically by others during the operation; `origin`, `compare` (when used)
/// and `result` (when not null) must be valid for `count` elements.
pub unsafe fn apply(
    op: Op,
    ty: BasicType,
    count: usize,
    target: *mut u8,
    origin: *const u8,
    compare: *const u8,
    result: *mut u8,
) -> Result<()> {
    use std::sync::atomic::{
        AtomicI16, AtomicI32, AtomicI64, AtomicI8, AtomicU16, AtomicU32, AtomicU64, AtomicU8,
    };
    if (target as usize) % ty.size() != 0 {
        return Err(Error::from(ErrorDetail::RemoteAccess {
            rank: 0,
            what: format!("atomic on {} at a misaligned address", ty.name()),
        }));
    }
    let sc = Ordering::SeqCst;
    macro_rules! int {
        ($A:ty, $T:ty) => {{
            for i in 0..count {
                let a = <$A>::from_ptr((target as *mut $T).add(i));
                let o = (origin as *const $T).add(i).read_unaligned();
                let logic = |f: fn(bool, bool) -> bool| {
                    let mut cur = a.load(sc);
                    loop {
                        let new = f(cur != 0, o != 0) as $T;
                        match a.compare_exchange(cur, new, sc, sc) {
                            Ok(v) => break v,
                            Err(v) => cur = v,
                        }
                    }
                };
                let old = match op {
                    Op::Sum => a.fetch_add(o, sc),
                    Op::Prod => {
                        let mut cur = a.load(sc);
                        loop {
                            match a.compare_exchange(cur, cur.wrapping_mul(o), sc, sc) {
                                Ok(v) => break v,
                                Err(v) => cur = v,
                            }
                        }
                    }
                    Op::Min => a.fetch_min(o, sc),
                    Op::Max => a.fetch_max(o, sc),
                    Op::Band => a.fetch_and(o, sc),
                    Op::Bor => a.fetch_or(o, sc),
                    Op::Bxor => a.fetch_xor(o, sc),
                    Op::Land => logic(|x, y| x && y),
                    Op::Lor => logic(|x, y| x || y),
                    Op::Lxor => logic(|x, y| x != y),
                    Op::Replace => a.swap(o, sc),
                    Op::NoOp => a.load(sc),
                    Op::Cswap => {
                        let c = (compare as *const $T).add(i).read_unaligned();
                        match a.compare_exchange(c, o, sc, sc) {
                            Ok(v) | Err(v) => v,
                        }
                    }
                };
                if !result.is_null() {
                    (result as *mut $T).add(i).write_unaligned(old);
                }
            }
        }};
    }
    macro_rules! float {
        ($A:ty, $B:ty, $F:ty) => {{
            for i in 0..count {
                let a = <$A>::from_ptr((target as *mut $B).add(i));
                let o = (origin as *const $F).add(i).read_unaligned();
                let mut cur = a.load(sc);
                let old = loop {
                    let x = <$F>::from_bits(cur);
                    let new: $F = match op {
                        Op::Sum => x + o,
                        Op::Prod => x * o,
                        Op::Min => {
                            if o < x {
                                o
                            } else {
                                x
                            }
                        }
                        Op::Max => {
                            if o > x {
                                o
                            } else {
                                x
                            }
                        }
                        Op::Land => ((x != 0.0 && o != 0.0) as u8) as $F,
                        Op::Lor => ((x != 0.0 || o != 0.0) as u8) as $F,
                        Op::Lxor => (((x != 0.0) != (o != 0.0)) as u8) as $F,
                        Op::Replace => o,
                        Op::NoOp => x,
                        Op::Cswap => {
                            let c = (compare as *const $B).add(i).read_unaligned();
                            if cur == c {
                                o
                            } else {
                                x
                            }
                        }
                        Op::Band | Op::Bor | Op::Bxor => {
                            return Err(Error::invalid("bitwise operation on a float"))
                        }
                    };
                    if matches!(op, Op::NoOp) {
                        break cur;
                    }
                    match a.compare_exchange(cur, new.to_bits(), sc, sc) {
                        Ok(v) => break v,
                        Err(v) => cur = v,
                    }
                };
                if !result.is_null() {
                    (result as *mut $B).add(i).write_unaligned(old);
                }
            }
        }};
    }
    match ty {
        BasicType::I8 => int!(AtomicI8, i8),
        BasicType::U8 => int!(AtomicU8, u8),
        BasicType::I16 => int!(AtomicI16, i16),
        BasicType::U16 => int!(AtomicU16, u16),
        BasicType::I32 => int!(AtomicI32, i32),
        BasicType::U32 => int!(AtomicU32, u32),
        BasicType::I64 => int!(AtomicI64, i64),
        BasicType::U64 => int!(AtomicU64, u64),
        BasicType::F32 => float!(AtomicU32, u32, f32),
        BasicType::F64 => float!(AtomicU64, u64, f64),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_atomics_match_the_reference() {
        for ty in BasicType::ALL {
            for op in Op::ALL {
                if !op.valid_for(ty) || op == Op::Cswap {
                    continue;
                }
                let n = 3;
                let sz = ty.size();
                // Aligned target buffer.
                let mut store = vec![0u64; 4];
                let tgt = store.as_mut_ptr() as *mut u8;
                let init: Vec<u8> = (0..n * sz).map(|i| (i as u8 % 5) + 1).collect();
                let orig: Vec<u8> = (0..n * sz).map(|i| (i as u8 % 3) + 2).collect();
                let (init, orig) = match ty {
                    BasicType::F32 => (
                        bytemuck_f32(&[1.5, -2.0, 3.0]),
                        bytemuck_f32(&[2.0, 4.0, -1.0]),
                    ),
                    BasicType::F64 => (
                        bytemuck_f64(&[1.5, -2.0, 3.0]),
                        bytemuck_f64(&[2.0, 4.0, -1.0]),
                    ),
                    _ => (init, orig),
                };
                // SAFETY: the buffers hold n elements; the target is u64-aligned.
                unsafe { std::ptr::copy_nonoverlapping(init.as_ptr(), tgt, n * sz) };
                let mut old = vec![0u8; n * sz];
                // SAFETY: as above.
                unsafe {
                    apply(
                        op,
                        ty,
                        n,
                        tgt,
                        orig.as_ptr(),
                        std::ptr::null(),
                        old.as_mut_ptr(),
                    )
                    .unwrap()
                };
                let mut expect = init.clone();
                match op {
                    Op::Replace => expect.copy_from_slice(&orig),
                    Op::NoOp => {}
                    _ => weft_provider::types::apply_op(op, ty, &mut expect, &orig).unwrap(),
                }
                // SAFETY: reading back n elements.
                let got = unsafe { std::slice::from_raw_parts(tgt, n * sz) };
                assert_eq!(got, &expect[..], "{} {}", op.name(), ty.name());
                assert_eq!(old, init, "old values of {} {}", op.name(), ty.name());
            }
        }
    }

    fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    fn bytemuck_f64(v: &[f64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

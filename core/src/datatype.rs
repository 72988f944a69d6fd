//! Derived datatypes: contiguous, vector, indexed and struct types over the basic types.
//!
//! A datatype is built as a small tree and flattened once, at [`Datatype::commit`], into the
//! merged list of `(offset, length)` segments of one instance, in type-map order. Everything that
//! moves data — iovec generation, pack, unpack, the chunked rendezvous — works on that list.
//!
//! Extents follow MPI (lb = lowest displacement, ub = highest end) except that struct types get
//! no alignment padding: use [`Datatype::resized`] to set an extent explicitly.

use crate::types::BasicType;
use crate::{Error, Result};
use std::sync::Arc;

/// One contiguous piece of a datatype: `len` bytes at `off` from the start of the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub off: isize,
    pub len: usize,
}

#[derive(Debug)]
enum Kind {
    Basic(BasicType),
    /// Blocks of `len` copies of `child` at byte displacement `disp`.
    Blocks {
        blocks: Vec<(usize, isize)>,
        child: Datatype,
    },
    Struct {
        blocks: Vec<(usize, isize, Datatype)>,
    },
    Resized {
        child: Datatype,
    },
}

#[derive(Debug)]
struct Flat {
    segs: Vec<Segment>,
    /// prefix[i] = bytes of data before segment i.
    prefix: Vec<usize>,
    /// Segments that touch are never merged: each may be an allocation of its own (a gather
    /// or scatter list by address), and one access must not span two allocations.
    apart: bool,
}

#[derive(Debug)]
struct Inner {
    kind: Kind,
    size: usize,
    lb: isize,
    ub: isize,
    /// The single basic type this datatype consists of, if homogeneous.
    basic: Option<BasicType>,
    flat: Option<Flat>,
}

/// A (possibly derived) datatype. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Datatype(Arc<Inner>);

fn ovf() -> Error {
    Error::invalid("datatype size or displacement overflows")
}

impl Datatype {
    /// A basic type; basic types are committed from the start.
    pub fn basic(t: BasicType) -> Self {
        let mut inner = Inner {
            kind: Kind::Basic(t),
            size: t.size(),
            lb: 0,
            ub: t.size() as isize,
            basic: Some(t),
            flat: None,
        };
        inner.flat = Some(flatten(&inner));
        Datatype(Arc::new(inner))
    }

    /// The datatype of a Rust element type.
    pub fn of<T: crate::Element>() -> Self {
        Self::basic(T::TYPE)
    }

    /// Bytes as a datatype.
    pub fn bytes() -> Self {
        Self::basic(BasicType::U8)
    }

    fn blocks(blocks: Vec<(usize, isize)>, child: &Datatype) -> Result<Self> {
        let ext = child.extent();
        let mut size = 0usize;
        let (mut lb, mut ub) = (isize::MAX, isize::MIN);
        for &(n, d) in &blocks {
            if n == 0 {
                continue;
            }
            size = n
                .checked_mul(child.size())
                .and_then(|b| b.checked_add(size))
                .ok_or_else(ovf)?;
            let span = (n as isize - 1).checked_mul(ext).ok_or_else(ovf)?;
            let l = d
                .checked_add(child.lb())
                .and_then(|x| x.checked_add(span.min(0)))
                .ok_or_else(ovf)?;
            let u = d
                .checked_add(child.ub())
                .and_then(|x| x.checked_add(span.max(0)))
                .ok_or_else(ovf)?;
            lb = lb.min(l);
            ub = ub.max(u);
        }
        if lb > ub {
            lb = 0;
            ub = 0;
        }
        Ok(Datatype(Arc::new(Inner {
            kind: Kind::Blocks {
                blocks,
                child: child.clone(),
            },
            size,
            lb,
            ub,
            basic: child.0.basic,
            flat: None,
        })))
    }

    /// `count` consecutive copies of `t`.
    pub fn contiguous(count: usize, t: &Datatype) -> Result<Self> {
        Self::blocks(vec![(count, 0)], t)
    }

    /// `count` blocks of `blocklen` copies of `t`, block starts `stride` elements (extents of
    /// `t`) apart.
    pub fn vector(count: usize, blocklen: usize, stride: isize, t: &Datatype) -> Result<Self> {
        let s = stride.checked_mul(t.extent()).ok_or_else(ovf)?;
        Self::hvector(count, blocklen, s, t)
    }

    /// Like [`Self::vector`] with the stride in bytes.
    pub fn hvector(
        count: usize,
        blocklen: usize,
        stride_bytes: isize,
        t: &Datatype,
    ) -> Result<Self> {
        let blocks = (0..count)
            .map(|i| {
                (i as isize)
                    .checked_mul(stride_bytes)
                    .map(|d| (blocklen, d))
                    .ok_or_else(ovf)
            })
            .collect::<Result<Vec<_>>>()?;
        Self::blocks(blocks, t)
    }

    /// Blocks of `blocklens[i]` copies of `t` at `displs[i]` elements.
    pub fn indexed(blocklens: &[usize], displs: &[isize], t: &Datatype) -> Result<Self> {
        let ext = t.extent();
        let d = displs
            .iter()
            .map(|&d| d.checked_mul(ext).ok_or_else(ovf))
            .collect::<Result<Vec<_>>>()?;
        Self::hindexed(blocklens, &d, t)
    }

    /// Like [`Self::indexed`] with displacements in bytes.
    pub fn hindexed(blocklens: &[usize], displs_bytes: &[isize], t: &Datatype) -> Result<Self> {
        if blocklens.len() != displs_bytes.len() {
            return Err(Error::invalid(format!(
                "indexed type with {} block lengths and {} displacements",
                blocklens.len(),
                displs_bytes.len()
            )));
        }
        Self::blocks(
            blocklens
                .iter()
                .copied()
                .zip(displs_bytes.iter().copied())
                .collect(),
            t,
        )
    }

    /// A struct type: `blocklens[i]` copies of `types[i]` at byte displacement `displs[i]`.
    pub fn structure(blocklens: &[usize], displs: &[isize], types: &[Datatype]) -> Result<Self> {
        if blocklens.len() != displs.len() || blocklens.len() != types.len() {
            return Err(Error::invalid(
                "struct type needs as many block lengths, displacements and types",
            ));
        }
        let mut size = 0usize;
        let (mut lb, mut ub) = (isize::MAX, isize::MIN);
        let mut basic: Option<Option<BasicType>> = None;
        for ((&n, &d), t) in blocklens.iter().zip(displs).zip(types) {
            if n == 0 {
                continue;
            }
            size = n
                .checked_mul(t.size())
                .and_then(|b| b.checked_add(size))
                .ok_or_else(ovf)?;
            let span = (n as isize - 1).checked_mul(t.extent()).ok_or_else(ovf)?;
            lb = lb.min(d + t.lb() + span.min(0));
            ub = ub.max(d + t.ub() + span.max(0));
            basic = Some(match basic {
                None => t.0.basic,
                Some(b) if b == t.0.basic => b,
                Some(_) => None,
            });
        }
        if lb > ub {
            lb = 0;
            ub = 0;
        }
        Ok(Datatype(Arc::new(Inner {
            kind: Kind::Struct {
                blocks: blocklens
                    .iter()
                    .zip(displs)
                    .zip(types)
                    .map(|((&n, &d), t)| (n, d, t.clone()))
                    .collect(),
            },
            size,
            lb,
            ub,
            basic: basic.flatten(),
            flat: None,
        })))
    }

    /// `t` with lower bound `lb` and extent `extent`.
    pub fn resized(t: &Datatype, lb: isize, extent: isize) -> Result<Self> {
        Ok(Datatype(Arc::new(Inner {
            kind: Kind::Resized { child: t.clone() },
            size: t.size(),
            lb,
            ub: lb.checked_add(extent).ok_or_else(ovf)?,
            basic: t.0.basic,
            flat: None,
        })))
    }

    /// Bytes at `displs_bytes[i]` of `blocklens[i]` each, in this order, committed with its
    /// blocks kept apart even where one ends where the next begins (a gather or scatter list
    /// whose entries are separate allocations: an access must stay within one).
    pub(crate) fn blocks_apart(blocklens: &[usize], displs_bytes: &[isize]) -> Result<Self> {
        let mut inner =
            match Arc::try_unwrap(Self::hindexed(blocklens, displs_bytes, &Self::bytes())?.0) {
                Ok(i) => i,
                Err(_) => unreachable!("a type just made has one owner"),
            };
        let segs: Vec<Segment> = blocklens
            .iter()
            .zip(displs_bytes)
            .filter(|(&l, _)| l > 0)
            .map(|(&len, &off)| Segment { off, len })
            .collect();
        let mut prefix = Vec::with_capacity(segs.len());
        let mut acc = 0;
        for s in &segs {
            prefix.push(acc);
            acc += s.len;
        }
        inner.flat = Some(Flat {
            segs,
            prefix,
            apart: true,
        });
        Ok(Datatype(Arc::new(inner)))
    }

    /// Flatten into merged segments. Idempotent; communication requires a committed type.
    pub fn commit(self) -> Self {
        if self.0.flat.is_some() {
            return self;
        }
        let mut inner = match Arc::try_unwrap(self.0) {
            Ok(i) => i,
            Err(shared) => Inner {
                kind: clone_kind(&shared.kind),
                size: shared.size,
                lb: shared.lb,
                ub: shared.ub,
                basic: shared.basic,
                flat: None,
            },
        };
        inner.flat = Some(flatten(&inner));
        Datatype(Arc::new(inner))
    }

    pub fn is_committed(&self) -> bool {
        self.0.flat.is_some()
    }

    fn flat(&self) -> Result<&Flat> {
        self.0
            .flat
            .as_ref()
            .ok_or_else(|| Error::invalid("datatype used before commit()"))
    }

    /// Bytes of data in one instance.
    pub fn size(&self) -> usize {
        self.0.size
    }

    pub fn lb(&self) -> isize {
        self.0.lb
    }

    pub fn ub(&self) -> isize {
        self.0.ub
    }

    pub fn extent(&self) -> isize {
        self.0.ub - self.0.lb
    }

    /// The basic type, if the datatype is built from one only.
    pub fn basic_type(&self) -> Option<BasicType> {
        self.0.basic
    }

    /// Segments of one instance (committed types only).
    pub fn segments(&self) -> Result<&[Segment]> {
        Ok(&self.flat()?.segs)
    }

    /// True when `count` instances are one contiguous run starting at offset 0.
    pub fn is_contiguous(&self) -> bool {
        match &self.0.flat {
            Some(f) => {
                f.segs.is_empty()
                    || (f.segs.len() == 1
                        && f.segs[0].off == 0
                        && f.segs[0].len as isize == self.extent())
            }
            None => false,
        }
    }

    /// The byte range `[lo, hi)` touched by `count` instances, relative to the buffer start.
    pub fn span(&self, count: usize) -> Result<(isize, isize)> {
        let f = self.flat()?;
        if count == 0 || f.segs.is_empty() {
            return Ok((0, 0));
        }
        let lo = f.segs.iter().map(|s| s.off).min().unwrap_or(0);
        let hi = f
            .segs
            .iter()
            .map(|s| s.off + s.len as isize)
            .max()
            .unwrap_or(0);
        let last = (count as isize - 1)
            .checked_mul(self.extent())
            .ok_or_else(ovf)?;
        Ok((lo + last.min(0), hi + last.max(0)))
    }

    /// Check that `count` instances fit a buffer of `len` bytes; returns the data size in bytes.
    pub fn check_fits(&self, count: usize, len: usize) -> Result<usize> {
        let (lo, hi) = self.span(count)?;
        if lo < 0 || hi as usize > len {
            return Err(Error::invalid(format!(
                "{count} instances of the datatype touch bytes {lo}..{hi} of a {len}-byte buffer"
            )));
        }
        self.size().checked_mul(count).ok_or_else(ovf)
    }

    /// Visit the segments holding packed-stream bytes `[start, start+len)` of `count` instances,
    /// as `(buffer offset, length)` pairs in order, merging neighbours.
    pub fn for_range(
        &self,
        count: usize,
        start: usize,
        len: usize,
        mut f: impl FnMut(isize, usize),
    ) -> Result<()> {
        let flat = self.flat()?;
        let size = self.size();
        if len == 0 || size == 0 {
            return Ok(());
        }
        let total = size * count;
        if start + len > total {
            return Err(Error::invalid("range beyond the datatype's data"));
        }
        let ext = self.extent();
        let mut inst = start / size;
        let mut within = start % size;
        let mut left = len;
        // Segment index holding `within`.
        let mut si = match flat.prefix.binary_search(&within) {
            Ok(i) => i,
            Err(i) => i - 1,
        };
        let mut pending: Option<(isize, usize)> = None;
        while left > 0 {
            // Skip empty segments (none after merging, but be safe).
            let seg = flat.segs[si];
            let skip = within - flat.prefix[si];
            let take = (seg.len - skip).min(left);
            let off = inst as isize * ext + seg.off + skip as isize;
            match &mut pending {
                Some((po, pl)) if !flat.apart && *po + *pl as isize == off => *pl += take,
                _ => {
                    if let Some((po, pl)) = pending.take() {
                        f(po, pl);
                    }
                    pending = Some((off, take));
                }
            }
            left -= take;
            within += take;
            si += 1;
            if si == flat.segs.len() {
                si = 0;
                within = 0;
                inst += 1;
            }
        }
        if let Some((po, pl)) = pending {
            f(po, pl);
        }
        Ok(())
    }

    /// All `(offset, length)` pieces of `count` instances, merged, in order.
    pub fn iovecs(&self, count: usize) -> Result<Vec<(isize, usize)>> {
        let mut v = Vec::new();
        self.for_range(count, 0, self.size() * count, |o, l| v.push((o, l)))?;
        Ok(v)
    }

    /// Gather `count` instances from `src` into the contiguous `dst`; returns bytes written.
    pub fn pack(&self, src: &[u8], count: usize, dst: &mut [u8]) -> Result<usize> {
        let n = self.check_fits(count, src.len())?;
        if dst.len() < n {
            return Err(Error::invalid(format!(
                "pack needs {n} bytes, the output has {}",
                dst.len()
            )));
        }
        let mut at = 0;
        self.for_range(count, 0, n, |o, l| {
            dst[at..at + l].copy_from_slice(&src[o as usize..o as usize + l]);
            at += l;
        })?;
        Ok(n)
    }

    /// Scatter the contiguous `src` into `count` instances in `dst`; returns bytes read.
    pub fn unpack(&self, src: &[u8], count: usize, dst: &mut [u8]) -> Result<usize> {
        let n = self.check_fits(count, dst.len())?;
        if src.len() < n {
            return Err(Error::invalid(format!(
                "unpack needs {n} bytes, the input has {}",
                src.len()
            )));
        }
        let mut at = 0;
        self.for_range(count, 0, n, |o, l| {
            dst[o as usize..o as usize + l].copy_from_slice(&src[at..at + l]);
            at += l;
        })?;
        Ok(n)
    }
}

fn clone_kind(k: &Kind) -> Kind {
    match k {
        Kind::Basic(b) => Kind::Basic(*b),
        Kind::Blocks { blocks, child } => Kind::Blocks {
            blocks: blocks.clone(),
            child: child.clone(),
        },
        Kind::Struct { blocks } => Kind::Struct {
            blocks: blocks.clone(),
        },
        Kind::Resized { child } => Kind::Resized {
            child: child.clone(),
        },
    }
}

fn push_seg(out: &mut Vec<Segment>, off: isize, len: usize) {
    if len == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.off + last.len as isize == off {
            last.len += len;
            return;
        }
    }
    out.push(Segment { off, len });
}

/// Emit the segments of one instance of `t` displaced by `base`.
fn emit(t: &Inner, base: isize, out: &mut Vec<Segment>) {
    match &t.kind {
        Kind::Basic(b) => push_seg(out, base, b.size()),
        Kind::Blocks { blocks, child } => {
            for &(n, d) in blocks {
                emit_copies(child, n, base + d, out);
            }
        }
        Kind::Struct { blocks } => {
            for (n, d, c) in blocks {
                emit_copies(c, *n, base + d, out);
            }
        }
        Kind::Resized { child } => emit(&child.0, base, out),
    }
}

fn emit_copies(child: &Datatype, n: usize, base: isize, out: &mut Vec<Segment>) {
    let ext = child.extent();
    // A dense child (one segment filling its extent) repeats into one run.
    if let Some(f) = &child.0.flat {
        if f.segs.len() == 1 && f.segs[0].len as isize == ext {
            push_seg(out, base + f.segs[0].off, f.segs[0].len * n);
            return;
        }
        for i in 0..n {
            let b = base + i as isize * ext;
            for s in &f.segs {
                push_seg(out, b + s.off, s.len);
            }
        }
        return;
    }
    for i in 0..n {
        emit(&child.0, base + i as isize * ext, out);
    }
}

fn flatten(t: &Inner) -> Flat {
    let mut segs = Vec::new();
    emit(t, 0, &mut segs);
    let mut prefix = Vec::with_capacity(segs.len());
    let mut acc = 0;
    for s in &segs {
        prefix.push(acc);
        acc += s.len;
    }
    Flat {
        segs,
        prefix,
        apart: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn i32t() -> Datatype {
        Datatype::basic(BasicType::I32)
    }

    /// Blocks that touch stay apart in a list by address (each may be its own allocation),
    /// where an indexed type merges them.
    #[test]
    fn blocks_apart_are_never_merged() {
        let merged = Datatype::hindexed(&[10, 10], &[0, 10], &Datatype::bytes())
            .unwrap()
            .commit();
        assert_eq!(merged.iovecs(1).unwrap(), vec![(0, 20)]);
        let apart = Datatype::blocks_apart(&[10, 0, 10], &[0, 5, 10]).unwrap();
        assert_eq!(apart.iovecs(1).unwrap(), vec![(0, 10), (10, 10)]);
        let mut got = Vec::new();
        apart.for_range(1, 5, 10, |o, l| got.push((o, l))).unwrap();
        assert_eq!(got, vec![(5, 5), (10, 5)]);
        assert_eq!(apart.size(), 20);
    }

    #[test]
    fn vector_layout() {
        let v = Datatype::vector(3, 2, 4, &i32t()).unwrap().commit();
        assert_eq!(v.size(), 24);
        assert_eq!(v.extent(), (2 * 4 + 2) * 4);
        assert_eq!(
            v.segments().unwrap(),
            &[
                Segment { off: 0, len: 8 },
                Segment { off: 16, len: 8 },
                Segment { off: 32, len: 8 }
            ]
        );
        // Two instances: the second starts at one extent (40 bytes).
        assert_eq!(
            v.iovecs(2).unwrap(),
            vec![(0, 8), (16, 8), (32, 16), (56, 8), (72, 8)]
        );
    }

    #[test]
    fn contiguous_merges() {
        let c = Datatype::contiguous(100, &i32t()).unwrap().commit();
        assert_eq!(c.segments().unwrap().len(), 1);
        assert!(c.is_contiguous());
        assert_eq!(c.iovecs(3).unwrap(), vec![(0, 1200)]);
    }

    #[test]
    fn struct_and_resized() {
        let s = Datatype::structure(
            &[1, 2],
            &[0, 8],
            &[
                Datatype::basic(BasicType::U8),
                Datatype::basic(BasicType::F64),
            ],
        )
        .unwrap();
        assert_eq!(s.size(), 17);
        assert_eq!(s.extent(), 24);
        assert_eq!(s.basic_type(), None);
        let r = Datatype::resized(&s, 0, 32).unwrap().commit();
        assert_eq!(
            r.iovecs(2).unwrap(),
            vec![(0, 1), (8, 16), (32, 1), (40, 16)]
        );
    }

    #[test]
    fn uncommitted_and_out_of_bounds_are_errors() {
        let v = Datatype::vector(2, 1, 2, &i32t()).unwrap();
        assert!(v.iovecs(1).is_err());
        let v = v.commit();
        assert!(v.check_fits(2, 16).is_err()); // needs 0..24? (extent 12, 2 instances -> 0..16+4)
        assert_eq!(v.check_fits(2, 24).unwrap(), 16);
        let neg = Datatype::hindexed(&[1], &[-4], &i32t()).unwrap().commit();
        assert!(neg.check_fits(1, 100).is_err());
    }

    #[test]
    fn range_in_middle() {
        let v = Datatype::vector(2, 3, 5, &Datatype::bytes())
            .unwrap()
            .commit();
        // instance: bytes 0..3 and 5..8; extent 8
        let mut got = vec![];
        v.for_range(2, 2, 6, |o, l| got.push((o, l))).unwrap();
        assert_eq!(got, vec![(2, 1), (5, 5)]); // 5..8 and the next instance's 8..10 merge
    }

    /// A reference expansion: every byte offset of `count` instances, in type-map order.
    fn reference_bytes(t: &Datatype, count: usize) -> Vec<isize> {
        let mut v = vec![];
        for (o, l) in t.iovecs(count).unwrap() {
            for k in 0..l {
                v.push(o + k as isize);
            }
        }
        v
    }

    fn naive_bytes(t: &Inner, base: isize, out: &mut Vec<isize>) {
        match &t.kind {
            Kind::Basic(b) => out.extend((0..b.size() as isize).map(|k| base + k)),
            Kind::Blocks { blocks, child } => {
                for &(n, d) in blocks {
                    for i in 0..n {
                        naive_bytes(&child.0, base + d + i as isize * child.extent(), out);
                    }
                }
            }
            Kind::Struct { blocks } => {
                for (n, d, c) in blocks {
                    for i in 0..*n {
                        naive_bytes(&c.0, base + d + i as isize * c.extent(), out);
                    }
                }
            }
            Kind::Resized { child } => naive_bytes(&child.0, base, out),
        }
    }

    fn arb_type() -> impl Strategy<Value = Datatype> {
        let leaf = prop_oneof![
            Just(Datatype::basic(BasicType::U8)),
            Just(Datatype::basic(BasicType::I32)),
            Just(Datatype::basic(BasicType::F64)),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                (0usize..4, inner.clone()).prop_map(|(c, t)| Datatype::contiguous(c, &t).unwrap()),
                (0usize..4, 0usize..3, 0isize..5, inner.clone())
                    .prop_map(|(c, b, s, t)| Datatype::vector(c, b, s, &t).unwrap()),
                (
                    proptest::collection::vec((0usize..3, 0isize..6), 0..4),
                    inner.clone()
                )
                    .prop_map(|(bl, t)| {
                        let (l, d): (Vec<_>, Vec<_>) = bl.into_iter().unzip();
                        Datatype::indexed(&l, &d, &t).unwrap()
                    }),
                (
                    proptest::collection::vec((0usize..3, 0isize..40), 1..3),
                    inner.clone()
                )
                    .prop_map(|(bl, t)| {
                        let n = bl.len();
                        let (l, d): (Vec<_>, Vec<_>) = bl.into_iter().unzip();
                        Datatype::structure(&l, &d, &vec![t; n]).unwrap()
                    }),
                (inner, 0isize..64).prop_map(|(t, e)| Datatype::resized(&t, 0, e).unwrap()),
            ]
        })
    }

    proptest! {
        #[cfg_attr(miri, ignore)] // hundreds of cases under Miri take hours; file I/O is isolated
        #[test]
        fn iovecs_cover_type_bytes_in_order(t in arb_type(), count in 0usize..4) {
            let t = t.commit();
            let mut naive = vec![];
            for i in 0..count {
                naive_bytes(&t.0, i as isize * t.extent(), &mut naive);
            }
            prop_assert_eq!(reference_bytes(&t, count), naive);
            // Pieces are maximal: no two neighbours touch.
            let iov = t.iovecs(count).unwrap();
            for w in iov.windows(2) {
                prop_assert!(w[0].0 + w[0].1 as isize != w[1].0);
            }
            prop_assert_eq!(iov.iter().map(|p| p.1).sum::<usize>(), t.size() * count);
        }

        #[cfg_attr(miri, ignore)] // hundreds of cases under Miri take hours; file I/O is isolated
        #[test]
        fn pack_then_unpack_is_identity(t in arb_type(), count in 0usize..4, seed in any::<u8>()) {
            let t = t.commit();
            let (lo, hi) = t.span(count).unwrap();
            prop_assume!(lo >= 0);
            let len = hi as usize;
            let src: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let mut packed = vec![0u8; t.size() * count];
            prop_assert_eq!(t.pack(&src, count, &mut packed).unwrap(), packed.len());
            let mut back = vec![0u8; len];
            t.unpack(&packed, count, &mut back).unwrap();
            // Every byte the type covers is restored; others stay zero.
            let covered = reference_bytes(&t, count);
            for &o in &covered {
                prop_assert_eq!(back[o as usize], src[o as usize]);
            }
            let mut again = vec![0u8; packed.len()];
            t.pack(&back, count, &mut again).unwrap();
            prop_assert_eq!(again, packed);
        }

        #[cfg_attr(miri, ignore)] // hundreds of cases under Miri take hours; file I/O is isolated
        #[test]
        fn ranges_concatenate(t in arb_type(), count in 1usize..4, cut in 0usize..64) {
            let t = t.commit();
            let total = t.size() * count;
            let cut = cut.min(total);
            let mut a = vec![];
            t.for_range(count, 0, cut, |o, l| a.extend((0..l).map(|k| o + k as isize))).unwrap();
            t.for_range(count, cut, total - cut, |o, l| a.extend((0..l).map(|k| o + k as isize))).unwrap();
            prop_assert_eq!(a, reference_bytes(&t, count));
        }
    }
}

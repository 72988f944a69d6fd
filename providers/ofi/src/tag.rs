//! weft's (context, source rank, tag) in libfabric's 64-bit tag, as MPICH's OFI netmod packs
//! them, with the widths chosen per job:
//!
//! ```text
//!  63 ........ 48 | 47 ...... 48-r | tag bits (47-r .. 0)
//!   context (16)  | source (r bits) |  tag
//! ```
//!
//! `r` is the fewest bits that number every rank of the job (at least 1), so the tag keeps
//! `48 - r` bits: the whole of weft's tag range (`0..=i32::MAX`, 31 bits) for jobs up to
//! 131,072 ranks, 28 bits at a million. The source is in the tag because a receive from any source must
//! still report who sent, and a directed receive needs no `FI_DIRECTED_RECV` support: a receive
//! from rank `s` matches the source bits, one from any source ignores them. Nothing else is in
//! the tag: synchronous sends and large-message announcements are told apart by their remote CQ
//! data (libfabric 1.17's shm does not match a message that arrived before its receive when the
//! message sets tag bits the receive ignores beyond the source and tag fields). Context
//! [`DATA_CTX`] is the provider's own (large messages' data), never the core's.
//!
//! Overflow is an error, never a wrap: a tag beyond [`Layout::tag_max`] is refused at the send or
//! receive (`invalid tag`), and a context beyond 16 bits likewise. (Ranks are 32-bit, so the
//! source always fits and the tag keeps at least 15 bits.)

use weft_provider::{Error, ErrorDetail, Rank, Result};

/// Bits for the context id.
pub const CTX_BITS: u32 = 16;
/// The context of large messages' data (the core's contexts stay below it).
pub const DATA_CTX: u32 = (1 << CTX_BITS) - 1;

/// The tag layout of one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    rank_bits: u32,
}

impl Layout {
    /// The layout for a job of `size` ranks.
    pub fn for_job(size: u32) -> Layout {
        let rank_bits = (32 - size.saturating_sub(1).leading_zeros()).max(1);
        Layout { rank_bits }
    }

    fn tag_bits(&self) -> u32 {
        64 - CTX_BITS - self.rank_bits
    }

    /// Bits the source rank takes.
    pub fn rank_bits(&self) -> u32 {
        self.rank_bits
    }

    /// The largest tag this layout carries.
    pub fn tag_max(&self) -> i32 {
        if self.tag_bits() >= 31 {
            i32::MAX
        } else {
            ((1u64 << self.tag_bits()) - 1) as i32
        }
    }

    fn check(&self, ctx: u32, tag: i32) -> Result<()> {
        self.check_tag(tag)?;
        if ctx >= DATA_CTX {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "context id {ctx} does not fit the ofi provider's {CTX_BITS}-bit context field \
                 (too many communicators and windows alive at once)"
            ))));
        }
        Ok(())
    }

    fn check_tag(&self, tag: i32) -> Result<()> {
        if tag < 0 || tag > self.tag_max() {
            return Err(Error::from(ErrorDetail::InvalidTag {
                tag: tag as i64,
                max: self.tag_max(),
            }));
        }
        Ok(())
    }

    /// The tag of the data of a large message from `src`: its data id in [`DATA_CTX`].
    pub fn data_tag(&self, src: Rank, id: u32) -> u64 {
        self.raw(DATA_CTX, src, (id % (self.tag_max() as u32 + 1)) as i32)
    }

    /// Whether `bits` lie in the provider's data context (a key handed out for a write).
    pub fn is_data(&self, bits: u64) -> bool {
        bits >> (64 - CTX_BITS) == DATA_CTX as u64
    }

    fn raw(&self, ctx: u32, src: Rank, tag: i32) -> u64 {
        let tb = self.tag_bits();
        ((ctx as u64) << (tb + self.rank_bits)) | ((src as u64) << tb) | tag as u64
    }

    /// The tag a message from `src` carries.
    pub fn pack(&self, ctx: u32, src: Rank, tag: i32) -> Result<u64> {
        self.check(ctx, tag)?;
        Ok(self.raw(ctx, src, tag))
    }

    /// The (tag, ignore) pair of a receive; `None` source or tag is a wildcard.
    pub fn matcher(&self, ctx: u32, src: Option<Rank>, tag: Option<i32>) -> Result<(u64, u64)> {
        self.check(ctx, tag.unwrap_or(0))?;
        let tb = self.tag_bits();
        let mut ignore = 0;
        if src.is_none() {
            ignore |= ((1u64 << self.rank_bits) - 1) << tb;
        }
        if tag.is_none() {
            ignore |= (1u64 << tb) - 1;
        }
        let bits = self.pack(ctx, src.unwrap_or(0), tag.unwrap_or(0))?;
        Ok((bits & !ignore, ignore))
    }

    /// (source, tag) of a received tag.
    pub fn unpack(&self, bits: u64) -> (Rank, i32) {
        let tb = self.tag_bits();
        let src = ((bits >> tb) & ((1u64 << self.rank_bits) - 1)) as Rank;
        let tag = (bits & ((1u64 << tb) - 1)) as i32;
        (src, tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn widths_follow_the_job_size() {
        assert_eq!(Layout::for_job(1).rank_bits(), 1);
        assert_eq!(Layout::for_job(2).rank_bits(), 1);
        assert_eq!(Layout::for_job(3).rank_bits(), 2);
        assert_eq!(Layout::for_job(131_072).rank_bits(), 17);
        assert_eq!(Layout::for_job(131_072).tag_max(), i32::MAX);
        assert_eq!(Layout::for_job(131_073).tag_max(), (1 << 30) - 1);
        assert_eq!(Layout::for_job(1 << 20).tag_max(), (1 << 28) - 1);
    }

    #[test]
    fn overflow_is_an_error_naming_the_limit() {
        let l = Layout::for_job(1 << 20);
        let e = l.pack(2, 0, 1 << 28).unwrap_err().to_string();
        assert!(e.contains("268435455"), "{e}");
        assert!(l.pack(DATA_CTX, 0, 0).is_err());
        assert!(l.is_data(l.data_tag(3, 77)));
        assert!(!l.is_data(l.pack(DATA_CTX - 1, 3, 77).unwrap()));
        assert!(l.pack(2, 0, -1).is_err());
        assert!(l.matcher(2, None, Some(1 << 28)).is_err());
    }

    proptest! {
        /// Every packed tag unpacks to what went in, and matches exactly the receives that
        /// should match it (libfabric's rule: `(sent ^ want) & !ignore == 0`).
        #[test]
        fn pack_unpack_and_match(size in 1u32..5_000_000, ctx in 0u32..65_534, seed: u64,
                                 tag_raw: u32, any_src: bool, any_tag: bool) {
            let l = Layout::for_job(size);
            let src = (seed % size as u64) as Rank;
            let tag = (tag_raw % (l.tag_max() as u32 + 1)) as i32;
            let bits = l.pack(ctx, src, tag).unwrap();
            prop_assert_eq!(l.unpack(bits), (src, tag));
            let (want, ignore) = l.matcher(ctx, (!any_src).then_some(src),
                                           (!any_tag).then_some(tag)).unwrap();
            prop_assert_eq!((bits ^ want) & !ignore, 0);
            // The provider's data context never matches a core receive.
            prop_assert_ne!((l.data_tag(src, tag as u32) ^ want) & !ignore, 0);
            // Another context never matches; another source or tag only through a wildcard.
            let other = l.pack(ctx ^ 1, src, tag).unwrap();
            prop_assert_ne!((other ^ want) & !ignore, 0);
            if size > 1 {
                let s2 = (src + 1) % size;
                let m = l.pack(ctx, s2, tag).unwrap();
                prop_assert_eq!((m ^ want) & !ignore == 0, any_src);
            }
            if l.tag_max() > 0 {
                let t2 = if tag == l.tag_max() { tag - 1 } else { tag + 1 };
                let m = l.pack(ctx, src, t2).unwrap();
                prop_assert_eq!((m ^ want) & !ignore == 0, any_tag);
            }
        }
    }
}

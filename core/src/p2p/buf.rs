//! Message buffers of the two-sided protocols: a user buffer seen as packed bytes in a
//! contiguous or derived-datatype layout, and the copies into it (with non-temporal stores for
//! messages too large to stay in cache).

use crate::datatype::Datatype;
use crate::provider::{RawIov, RawIovMut};
use crate::{Error, ErrorDetail, Result};
use smallvec::SmallVec;

/// The memory layout of a message buffer.
#[derive(Clone, Debug)]
pub(crate) enum Layout {
    Contig,
    Typed(Datatype, usize),
}

/// A send buffer: `len` packed bytes at `base` in `layout`. The creator has checked bounds and
/// the request that holds it borrows the memory until completion.
#[derive(Clone, Debug)]
pub(crate) struct SendBuf {
    pub base: *const u8,
    pub len: usize,
    pub layout: Layout,
}

/// A receive buffer with room for `cap` packed bytes.
#[derive(Clone, Debug)]
pub(crate) struct RecvBuf {
    pub base: *mut u8,
    pub cap: usize,
    pub layout: Layout,
    /// Other pending receives may name the same memory ([`crate::SharedBuf`]): registrations
    /// for it carry [`Access::shared`](crate::provider::Access).
    pub shared: bool,
}

impl SendBuf {
    /// The bytes of a contiguous buffer as one slice; `None` for a typed layout.
    #[inline]
    pub(crate) fn contig_bytes(&self) -> Option<&[u8]> {
        match self.layout {
            Layout::Contig if self.len == 0 => Some(&[]),
            // SAFETY: `base..base+len` is the buffer the request holding this `SendBuf`
            // borrows (bounds checked by its creator); the slice lives no longer than `self`.
            Layout::Contig => Some(unsafe { std::slice::from_raw_parts(self.base, self.len) }),
            Layout::Typed(..) => None,
        }
    }

    /// iovec pieces for packed bytes `[off, off+len)`, as raw `(ptr, len)`.
    #[inline]
    pub(crate) fn pieces(&self, off: usize, len: usize, out: &mut SmallVec<[RawIov; 8]>) {
        match &self.layout {
            Layout::Contig => out.push(RawIov {
                desc: 0,
                // SAFETY: off+len <= self.len, checked by callers; base..base+len is the
                // borrowed buffer.
                ptr: unsafe { self.base.add(off) },
                len,
            }),
            Layout::Typed(dt, count) => {
                let _ = dt.for_range(*count, off, len, |o, l| {
                    out.push(RawIov {
                        desc: 0,
                        // The span was checked against the buffer; `wrapping_offset` because a
                        // gather list's blocks (`Comm::isendv_raw`) lie in allocations of their
                        // own, at distances from a base made from an address.
                        ptr: self.base.wrapping_offset(o),
                        len: l,
                    })
                });
            }
        }
    }

    #[inline]
    pub(crate) fn piece_count(&self, max: usize) -> usize {
        match &self.layout {
            Layout::Contig => 1,
            Layout::Typed(dt, count) => {
                let mut n = 0;
                let _ = dt.for_range(*count, 0, self.len, |_, _| n += 1);
                n.min(max + 1)
            }
        }
    }
}

crate::param!(NT_COPY_MIN: Str = "", "NT_COPY_MIN", "auto",
    "messages at least this long are copied into receive buffers with non-temporal stores: a size, 0 (never) or auto (3/4 of one core's share of the last-level cache, glibc's rule)");

/// `WEFT_NT_COPY_MIN` in bytes (`usize::MAX`: never).
pub(crate) fn nt_copy_min_from_env() -> Result<usize> {
    let raw = NT_COPY_MIN.raw();
    let v = raw.trim();
    if v.eq_ignore_ascii_case("auto") {
        return Ok(nt_copy_auto());
    }
    match crate::param::parse_size(v) {
        Some(0) => Ok(usize::MAX),
        Some(n) => Ok(n),
        None => Err(Error::from(ErrorDetail::Param {
            var: NT_COPY_MIN.env_name(),
            value: raw,
            expected: "auto, 0 or a size such as 16M".into(),
        })),
    }
}

/// Streaming stores pay once the destination cannot stay in the cache anyway: from 3/4 of the
/// last-level cache divided among the CPUs that share it (what glibc's memcpy uses for its own
/// non-temporal threshold). Unknown cache: 16 MiB.
pub(crate) fn nt_copy_auto() -> usize {
    // The caches do not change while we run: read sysfs once per process.
    static AUTO: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AUTO.get_or_init(read_nt_copy_auto)
}

fn read_nt_copy_auto() -> usize {
    let dir = "/sys/devices/system/cpu/cpu0/cache";
    let mut best: Option<(u32, usize, usize)> = None; // (level, bytes, sharing CPUs)
    for i in 0..8 {
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/index{i}/{f}")).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let level: u32 = level.trim().parse().unwrap_or(0);
        let Some(bytes) = crate::param::parse_size(size.trim()) else {
            continue;
        };
        let sharing = read("shared_cpu_list").map_or(1, |l| cpu_list_len(l.trim()));
        if best.is_none_or(|(l, ..)| level > l) {
            best = Some((level, bytes, sharing.max(1)));
        }
    }
    match best {
        Some((_, bytes, sharing)) if bytes > 0 => (bytes / sharing) * 3 / 4,
        _ => 16 << 20,
    }
}

/// Number of CPUs in a sysfs CPU list such as `0-3,8,10-11`.
fn cpu_list_len(list: &str) -> usize {
    list.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 1,
            },
            None => 1,
        })
        .sum()
}

/// Copy `src` to `dst` with non-temporal stores where the platform has them.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and not overlap `src`.
unsafe fn copy_nt(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = src.len();
        // Head up to 16-byte alignment of the destination, then 16-byte streaming stores.
        let head = dst.align_offset(16).min(n);
        // SAFETY: both ranges are within the caller's guarantee.
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        let mut i = head;
        while i + 64 <= n {
            for k in 0..4 {
                let at = i + 16 * k;
                // SAFETY: at + 16 <= n; dst + at is 16-byte aligned (head aligned it); SSE2 is
                // part of x86_64.
                let v = _mm_loadu_si128(src.as_ptr().add(at) as *const __m128i);
                _mm_stream_si128(dst.add(at) as *mut __m128i, v);
            }
            i += 64;
        }
        // SAFETY: the tail is within both ranges.
        std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), n - i);
        // Order the streaming stores before whatever publishes completion.
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
}

impl RecvBuf {
    /// Copy `data` to packed offset `off`. Caller guarantees `off + data.len() <= cap`.
    #[inline]
    pub(crate) fn write(&self, off: usize, data: &[u8]) {
        debug_assert!(off + data.len() <= self.cap);
        match &self.layout {
            Layout::Contig => {
                // SAFETY: off+len <= cap = the borrowed buffer's length; the request holds the
                // unique borrow, and `data` (provider or unexpected memory) cannot overlap it.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(off), data.len())
                }
            }
            Layout::Typed(dt, count) => {
                let mut at = 0;
                let _ = dt.for_range(*count, off, data.len(), |o, l| {
                    // SAFETY: the datatype's span was checked against the buffer (each block
                    // `[o, o + l)` is memory the request borrows; a scatter list's blocks are in
                    // allocations of their own, hence `wrapping_offset` from the base address);
                    // `data` is provider or unexpected memory, which cannot overlap it.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr().add(at),
                            self.base.wrapping_offset(o),
                            l,
                        )
                    };
                    at += l;
                });
            }
        }
    }

    /// Like `write`, with non-temporal stores for a contiguous buffer: the bytes go to memory
    /// without first reading the destination lines into the cache (for messages too large to
    /// stay in cache anyway).
    #[inline]
    pub(crate) fn write_nt(&self, off: usize, data: &[u8]) {
        match &self.layout {
            // SAFETY: as in `write`: off + len <= cap, the request holds the unique borrow.
            Layout::Contig => unsafe { copy_nt(self.base.add(off), data) },
            Layout::Typed(..) => self.write(off, data),
        }
    }

    #[inline]
    pub(crate) fn pieces(&self, len: usize, out: &mut SmallVec<[RawIovMut; 8]>) {
        match &self.layout {
            Layout::Contig => out.push(RawIovMut {
                desc: 0,
                ptr: self.base,
                len,
            }),
            Layout::Typed(dt, count) => {
                let _ = dt.for_range(*count, 0, len, |o, l| {
                    out.push(RawIovMut {
                        desc: 0,
                        // Within the checked span of the borrowed buffer; `wrapping_offset`
                        // as for sends (a scatter list's blocks are separate allocations).
                        ptr: self.base.wrapping_offset(o),
                        len: l,
                    })
                });
            }
        }
    }
}

/// The smallest contiguous range holding every piece: what one registration must cover.
fn span_of(pieces: impl Iterator<Item = (usize, usize)>) -> (usize, usize) {
    let (mut lo, mut hi) = (usize::MAX, 0usize);
    for (p, l) in pieces {
        lo = lo.min(p);
        hi = hi.max(p + l);
    }
    if lo > hi {
        (0, 0)
    } else {
        (lo, hi - lo)
    }
}

impl SendBuf {
    /// Start and length of the memory the buffer's packed bytes live in.
    pub(crate) fn span(&self) -> (*const u8, usize) {
        if let Layout::Contig = self.layout {
            return (self.base, self.len);
        }
        let mut v: SmallVec<[RawIov; 8]> = SmallVec::new();
        self.pieces(0, self.len, &mut v);
        let (p, l) = span_of(v.iter().map(|x| (x.ptr as usize, x.len)));
        (p as *const u8, l)
    }
}

impl RecvBuf {
    /// Start and length of the memory the buffer's first `len` packed bytes go to.
    pub(crate) fn span(&self, len: usize) -> (*const u8, usize) {
        if let Layout::Contig = self.layout {
            return (self.base, len);
        }
        let mut v: SmallVec<[RawIovMut; 8]> = SmallVec::new();
        self.pieces(len, &mut v);
        let (p, l) = span_of(v.iter().map(|x| (x.ptr as usize, x.len)));
        (p as *const u8, l)
    }
}

/// Copy a send buffer's packed bytes into `out`.
pub(crate) fn gather(buf: &SendBuf, out: &mut [u8]) {
    let mut pieces: SmallVec<[RawIov; 8]> = SmallVec::new();
    buf.pieces(0, buf.len, &mut pieces);
    let mut at = 0;
    for p in pieces {
        // SAFETY: pieces lie within the borrowed send buffer (bounds checked at creation).
        let s = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
        out[at..at + p.len].copy_from_slice(s);
        at += p.len;
    }
}

#[cfg(test)]
mod tests {
    use super::{copy_nt, cpu_list_len, nt_copy_auto};
    #[test]
    fn cpu_lists_count_their_cpus() {
        assert_eq!(cpu_list_len("0"), 1);
        assert_eq!(cpu_list_len("0-1"), 2);
        assert_eq!(cpu_list_len("0-3,8,10-11"), 7);
        assert_eq!(cpu_list_len(""), 0);
        assert!(nt_copy_auto() >= 1 << 20, "{}", nt_copy_auto());
    }

    #[test]
    fn streaming_copy_matches_memcpy_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for dst_off in 0..17 {
            for src_off in [0usize, 1, 5, 16] {
                for len in [0usize, 1, 15, 16, 17, 63, 64, 65, 200, 4096, 4900] {
                    let mut dst = vec![0xAAu8; 5100];
                    let s = &src[src_off..src_off + len];
                    // SAFETY: dst has room for dst_off + len bytes; the vectors are distinct.
                    unsafe { copy_nt(dst.as_mut_ptr().add(dst_off), s) };
                    assert_eq!(&dst[dst_off..dst_off + len], s, "{dst_off} {src_off} {len}");
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xAA));
                    assert!(dst[dst_off + len..].iter().all(|&b| b == 0xAA));
                }
            }
        }
    }
}

//! The wire codec of the core's active messages: fixed-size little-endian headers built with
//! [`Hdr`] and read back with the bounds-checked [`Rd`] (a short or garbled header is an error
//! value, never a panic).

/// Header bytes the core needs from every provider: the contract's ([`crate::provider`]).
use weft_provider::provider::MIN_AM_HEADER;

/// A fixed-size header under construction.
#[derive(Clone, Copy)]
pub(crate) struct Hdr {
    buf: [u8; MIN_AM_HEADER],
    len: u8,
}

impl Hdr {
    #[inline(always)]
    pub(crate) fn new(kind: u8) -> Self {
        let mut h = Hdr {
            buf: [0; MIN_AM_HEADER],
            len: 0,
        };
        h.u8(kind);
        h
    }
    #[inline(always)]
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf[self.len as usize] = v;
        self.len += 1;
        self
    }
    #[inline(always)]
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        let l = self.len as usize;
        self.buf[l..l + 4].copy_from_slice(&v.to_le_bytes());
        self.len += 4;
        self
    }
    #[inline(always)]
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        let l = self.len as usize;
        self.buf[l..l + 8].copy_from_slice(&v.to_le_bytes());
        self.len += 8;
        self
    }
    #[inline(always)]
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

/// Bounds-checked header reader: a short or garbled header from a peer is an error value.
pub(crate) struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    #[inline]
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Rd { b, at: 0 }
    }
    #[inline]
    pub(crate) fn u8(&mut self) -> Option<u8> {
        let v = *self.b.get(self.at)?;
        self.at += 1;
        Some(v)
    }
    #[inline]
    pub(crate) fn u32(&mut self) -> Option<u32> {
        let v = self.b.get(self.at..self.at + 4)?;
        self.at += 4;
        Some(u32::from_le_bytes(v.try_into().ok()?))
    }
    #[inline]
    pub(crate) fn u64(&mut self) -> Option<u64> {
        let v = self.b.get(self.at..self.at + 8)?;
        self.at += 8;
        Some(u64::from_le_bytes(v.try_into().ok()?))
    }
    /// The next `n` bytes.
    #[inline]
    pub(crate) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let v = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(v)
    }
    /// Everything not read yet.
    #[inline]
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let v = &self.b[self.at.min(self.b.len())..];
        self.at = self.b.len();
        v
    }
    #[inline]
    pub(crate) fn remaining(&self) -> usize {
        self.b.len().saturating_sub(self.at)
    }
}

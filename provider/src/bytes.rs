//! Byte copies for providers' small-message paths.

/// Copy `src` into the start of `dst`, as `dst[..src.len()].copy_from_slice(src)` does
/// (panicking the same way if `dst` is shorter), but with copies of up to 16 bytes done inline
/// by two fixed-size moves that may overlap in the middle instead of a call into `memcpy`: a
/// small message's header and payload are copied that way on its sender's critical path.
#[inline(always)]
pub fn copy_small(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    let dst = &mut dst[..n];
    if (8..=16).contains(&n) {
        let a: [u8; 8] = src[..8].try_into().expect("8 bytes");
        let b: [u8; 8] = src[n - 8..].try_into().expect("8 bytes");
        dst[..8].copy_from_slice(&a);
        dst[n - 8..].copy_from_slice(&b);
    } else if (4..8).contains(&n) {
        let a: [u8; 4] = src[..4].try_into().expect("4 bytes");
        let b: [u8; 4] = src[n - 4..].try_into().expect("4 bytes");
        dst[..4].copy_from_slice(&a);
        dst[n - 4..].copy_from_slice(&b);
    } else if n < 4 {
        // Three byte moves that cover 1, 2 or 3 bytes (a loop here was vectorised, and its
        // registers cost the frame of every caller).
        if n > 0 {
            dst[0] = src[0];
            dst[n / 2] = src[n / 2];
            dst[n - 1] = src[n - 1];
        }
    } else {
        dst.copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::copy_small;

    #[test]
    fn small_copies_match_copy_from_slice_at_every_length() {
        let src: Vec<u8> = (0..64u32).map(|i| (i * 29 + 7) as u8).collect();
        for len in 0..=40 {
            for at in [0usize, 1, 5, 13] {
                let mut dst = [0x55u8; 64];
                copy_small(&mut dst[at..], &src[3..3 + len]);
                assert_eq!(&dst[at..at + len], &src[3..3 + len], "len {len}");
                assert!(dst[..at].iter().all(|&b| b == 0x55), "len {len}: before");
                assert!(
                    dst[at + len..].iter().all(|&b| b == 0x55),
                    "len {len}: after"
                );
            }
        }
    }
}

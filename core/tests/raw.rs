//! Requests without a scope (`isend_raw`/`irecv_raw`/`test_raw`/`take_raw`/`cancel_raw`), the
//! API weft's libfabric face stands on: data arrives, a request reports once, truncation and
//! cancellation come back as they do for scoped requests.

use std::time::{Duration, Instant};
use weft::{Comm, RawRequest, Source, Status, TagSel};
use weft_testing::world;

fn until_done(c: &Comm<weft_loopback::Loopback>, r: &mut RawRequest) -> weft::Result<Status> {
    let t0 = Instant::now();
    loop {
        if let Some(res) = c.test_raw(r).expect("a live request") {
            return res;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "a raw request never completed"
        );
    }
}

#[test]
fn raw_requests_carry_data_and_report_once() {
    world(2, |c| {
        if c.rank() == 0 {
            let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
            // SAFETY: `data` outlives the request, which is waited for below.
            let mut s = unsafe { c.isend_raw(data.as_ptr(), data.len(), 1, 7, false) }.unwrap();
            until_done(c, &mut s).unwrap();
            assert!(
                c.test_raw(&mut s).is_err(),
                "a spent request reports no second time"
            );
            let small = [1u8; 64];
            // SAFETY: as above.
            let mut s = unsafe { c.isend_raw(small.as_ptr(), small.len(), 1, 8, false) }.unwrap();
            until_done(c, &mut s).unwrap();
        } else {
            let mut buf = vec![0u8; 100_000];
            // SAFETY: `buf` outlives the request, waited for below.
            let mut r =
                unsafe { c.irecv_raw(buf.as_mut_ptr(), buf.len(), Source::Any, TagSel::Tag(7)) }
                    .unwrap();
            let st = until_done(c, &mut r).unwrap();
            assert_eq!((st.source, st.tag, st.bytes), (0, 7, 100_000));
            assert!(buf.iter().enumerate().all(|(i, b)| *b == i as u8));
            // Too small: truncation, with the message's length.
            let mut tiny = [0u8; 16];
            // SAFETY: as above.
            let mut r =
                unsafe { c.irecv_raw(tiny.as_mut_ptr(), tiny.len(), Source::Rank(0), TagSel::Any) }
                    .unwrap();
            let e = until_done(c, &mut r).unwrap_err();
            let (st, cap) = e.truncated().expect("a truncation");
            assert_eq!((st.bytes, cap), (64, 16));
            // A receive nothing will match, cancelled.
            let mut none = [0u8; 8];
            // SAFETY: as above.
            let mut r =
                unsafe { c.irecv_raw(none.as_mut_ptr(), 8, Source::Rank(0), TagSel::Tag(99)) }
                    .unwrap();
            c.cancel_raw(&r).unwrap();
            assert!(until_done(c, &mut r).unwrap().cancelled);
        }
    });
}

/// Gather and scatter lists (`isendv_raw`, `irecvv_raw`): the message is the concatenation of
/// the send's entries in their order (not their addresses'), and fills the receive's entries
/// one after the other, whatever the two splits — small (eager) and large (rendezvous), with
/// empty entries, and with the bytes around every receive entry untouched; a message longer
/// than the receive's entries together is a truncation.
#[test]
fn iovec_raw_requests_gather_and_scatter() {
    world(2, |c| {
        // Under Miri a smaller long message (still past the eager limit): it is slow.
        let long = if cfg!(miri) { 80_000 } else { 3 << 20 };
        for (tag, total) in [(1, 1000usize), (2, long)] {
            let want: Vec<u8> = (0..total).map(|i| (i * 7 + tag) as u8).collect();
            if c.rank() == 0 {
                // Three pieces, the last first in memory: order is the list's.
                let (a, b) = (total / 3, total / 3 + 11);
                let first = total - b + 64;
                let mut mem = vec![0u8; first + a];
                mem[..total - b].copy_from_slice(&want[b..]);
                mem[first..].copy_from_slice(&want[..a]);
                let mid = want[a..b].to_vec();
                let iov = [
                    (mem[first..].as_ptr(), a),
                    (std::ptr::null(), 0),
                    (mid.as_ptr(), mid.len()),
                    (mem.as_ptr(), total - b),
                ];
                // SAFETY: `mem` and `mid` outlive the request, waited for below, unchanged.
                let mut s = unsafe { c.isendv_raw(&iov, 1, tag as i32, false) }.unwrap();
                until_done(c, &mut s).unwrap();
            } else {
                // Four pieces of another split, each with guard bytes around it.
                let cuts = [0, 5, total / 2, total / 2 + 1, total];
                let mut bufs: Vec<Vec<u8>> = cuts
                    .windows(2)
                    .map(|w| vec![0xEEu8; w[1] - w[0] + 16])
                    .collect();
                let iov: Vec<(*mut u8, usize)> = bufs
                    .iter_mut()
                    .map(|v| {
                        let n = v.len() - 16;
                        // SAFETY: 8 bytes into a vector of n + 16.
                        (unsafe { v.as_mut_ptr().add(8) }, n)
                    })
                    .collect();
                // SAFETY: `bufs` outlive the request, waited for below, and are not touched
                // meanwhile.
                let mut r = unsafe { c.irecvv_raw(&iov, Source::Rank(0), TagSel::Tag(tag as i32)) }
                    .unwrap();
                let st = until_done(c, &mut r).unwrap();
                assert_eq!(st.bytes, total);
                let mut got = Vec::new();
                for v in &bufs {
                    let n = v.len() - 16;
                    assert!(v[..8].iter().chain(&v[8 + n..]).all(|&g| g == 0xEE));
                    got.extend_from_slice(&v[8..8 + n]);
                }
                assert!(got == want, "{total} bytes scattered out of order");
            }
        }
        // Longer than the receive's entries together: truncated.
        if c.rank() == 0 {
            let data = [9u8; 40];
            let iov = [(data.as_ptr(), 20), (data[20..].as_ptr(), 20)];
            // SAFETY: `data` outlives the request, waited for below.
            let mut s = unsafe { c.isendv_raw(&iov, 1, 3, false) }.unwrap();
            until_done(c, &mut s).unwrap();
        } else {
            let (mut x, mut y) = ([0u8; 10], [0u8; 10]);
            let iov = [(x.as_mut_ptr(), 10), (y.as_mut_ptr(), 10)];
            // SAFETY: `x` and `y` outlive the request, waited for below.
            let mut r = unsafe { c.irecvv_raw(&iov, Source::Rank(0), TagSel::Tag(3)) }.unwrap();
            let e = until_done(c, &mut r).unwrap_err();
            let (st, cap) = e.truncated().expect("a truncation");
            assert_eq!((st.bytes, cap), (40, 20));
            assert_eq!((x, y), ([9u8; 10], [9u8; 10]));
        }
    });
}

/// A list with one entry that holds bytes, behind empty ones, is that buffer: the whole
/// message goes and lands (the empty entries' addresses are never used).
#[test]
fn an_iovec_with_one_full_entry_is_that_buffer() {
    world(2, |c| {
        let long = if cfg!(miri) { 80_000 } else { 200_000 };
        for (tag, n) in [(1, 100usize), (2, long)] {
            let want: Vec<u8> = (0..n).map(|i| (i * 3 + tag) as u8).collect();
            if c.rank() == 0 {
                let iov = [
                    (std::ptr::null(), 0),
                    (want.as_ptr(), n),
                    (std::ptr::null(), 0),
                ];
                // SAFETY: `want` outlives the request, waited for below.
                let mut s = unsafe { c.isendv_raw(&iov, 1, tag as i32, false) }.unwrap();
                until_done(c, &mut s).unwrap();
            } else {
                let mut got = vec![0u8; n];
                let iov = [(std::ptr::null_mut(), 0), (got.as_mut_ptr(), n)];
                // SAFETY: `got` outlives the request, waited for below.
                let mut r = unsafe { c.irecvv_raw(&iov, Source::Rank(0), TagSel::Tag(tag as i32)) }
                    .unwrap();
                assert_eq!(until_done(c, &mut r).unwrap().bytes, n);
                assert!(got == want, "{n} bytes");
            }
        }
    });
}

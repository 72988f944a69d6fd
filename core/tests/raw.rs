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

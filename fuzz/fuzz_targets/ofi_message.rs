//! The ofi provider's own active messages over `FI_MSG` (`weft_ofi::wire`): the 12-byte prefix
//! a receiver reads first, and the synchronous-send acknowledgement and clear-to-send bodies.
//! Decoding any bytes must never panic, an accepted prefix's header lies inside the message
//! and names a rank of the job, and a refusal blames only a rank of the job.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_ofi::wire::{cts, decode, put_cts, src_of, sync_ack, MAX_HDR, PREFIX};

fuzz_target!(|data: &[u8]| {
    let size = data.first().map_or(1, |&b| b as u32 + 1);
    let m = data.get(1..).unwrap_or(&[]);
    match decode(m, size) {
        Ok(p) => {
            assert!(p.src < size && p.hlen <= MAX_HDR && PREFIX + p.hlen <= m.len());
            assert_eq!(src_of(m), Some(p.src));
        }
        Err(e) => assert!(e.src.is_none_or(|s| s < size)),
    }
    if let Some((op, id, take)) = cts(m) {
        assert_eq!(&put_cts(op, id, take)[..], m);
    }
    let _ = sync_ack(m);
});

//! verbs-ud's packet header (`weft_verbs::ud::wire`), the first thing a receiver reads of every
//! datagram a peer sends: decoding any bytes must never panic, and a header that decodes names
//! a rank of the job and lengths within the receiver's limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_verbs::ud::wire::{decode, KIND_ACK, KIND_DATA};

fuzz_target!(|data: &[u8]| {
    let size = data.first().map_or(1, |&b| b as u32 + 1);
    if let Some(p) = decode(data.get(1..).unwrap_or(&[]), size, 128, 65536) {
        assert!(p.src < size && p.hlen <= 128 && p.total <= 65536);
        assert!(p.kind == KIND_DATA || p.kind == KIND_ACK);
    }
});

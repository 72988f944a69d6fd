//! The soft HCA's wire packets (what a peer on another host sends to the wire service) on
//! arbitrary input: an error or a packet, never a panic, and a decoded packet encodes back to
//! the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_verbs::soft::wire::Msg;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Msg::decode(data) {
        let mut b = Vec::new();
        m.encode(&mut b);
        assert_eq!(b, data, "a decoded packet encodes back to its bytes");
    }
});

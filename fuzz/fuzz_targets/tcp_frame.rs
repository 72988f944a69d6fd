//! The tcp-sim frame decoder on an arbitrary byte stream, fed the way the provider reads a
//! socket: it must never panic, never accept a frame beyond the limits, and never claim more
//! bytes than it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_tcp_sim::frame::{decode, Limits};

fuzz_target!(|data: &[u8]| {
    let lim = Limits {
        max_hdr: 64,
        max_payload: 4096,
    };
    let mut at = 0;
    while at < data.len() {
        match decode(&data[at..], lim) {
            Ok(Some(h)) => {
                assert!(h.hdr_len <= lim.max_hdr && h.payload_len <= lim.max_payload);
                assert!(h.total() <= data.len() - at);
                at += h.total();
            }
            Ok(None) | Err(_) => break,
        }
    }
});

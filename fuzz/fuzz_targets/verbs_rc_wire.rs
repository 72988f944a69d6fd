//! verbs-rc's connection-manager datagrams and RC frame headers on arbitrary input: `None` or
//! a value, never a panic; a decoded datagram survives encoding, and a frame's lengths add up
//! to the bytes that arrived.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_verbs_rc::wire::{CmMsg, Frame, FRAME_HDR};

fuzz_target!(|data: &[u8]| {
    if let Some(m) = CmMsg::decode(data) {
        assert_eq!(CmMsg::decode(&m.encode()), Some(m));
    }
    if let Some(f) = Frame::read(data, 128) {
        assert_eq!(FRAME_HDR + f.hlen + f.plen, data.len());
    }
});

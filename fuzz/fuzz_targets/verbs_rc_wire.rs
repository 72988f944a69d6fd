//! verbs-rc's connection-manager datagrams, RC frame headers and eager-ring offers on arbitrary
//! input: `None` or a value, never a panic; a decoded datagram or offer survives encoding, and
//! a frame's lengths add up to the bytes that arrived.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_verbs::rc::wire::{CmMsg, Frame, Offer, FRAME_HDR};

fuzz_target!(|data: &[u8]| {
    if let Some(m) = CmMsg::decode(data) {
        assert_eq!(CmMsg::decode(&m.encode()), Some(m));
    }
    if let Some(f) = Frame::read(data, 128) {
        assert_eq!(FRAME_HDR + f.hlen + f.plen, data.len());
    }
    if let Some(o) = Offer::decode(data) {
        assert_eq!(Offer::decode(&o.encode()), Some(o));
    }
});

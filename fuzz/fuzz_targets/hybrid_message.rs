//! What the hybrid provider reads in front of every message a peer sends it
//! (`weft_hybrid::wire`: the data prefix with its sequence number, or a budget control
//! message): decoding any bytes must never panic, a data message's header is the input after
//! the prefix, and a control message encodes back to the bytes it came from.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_hybrid::wire::{decode, put_ctrl, Msg, CTRL_MAX, PREFIX};

fuzz_target!(|data: &[u8]| {
    match decode(data) {
        Ok(Msg::Data { header, .. }) => assert_eq!(header, &data[PREFIX..]),
        Ok(Msg::Ctrl { ctrl, seq }) => {
            let mut m = [0u8; CTRL_MAX];
            let n = put_ctrl(&mut m, ctrl, seq);
            assert_eq!(&m[..n], data);
        }
        Err(_) => {}
    }
});

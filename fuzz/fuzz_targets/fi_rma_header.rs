//! weft-fi's RMA and atomic control messages (`weft_fi::rma::RHdr`), which the target of an
//! `fi_write`/`fi_read`/`fi_atomic` decodes from its peer before it looks up a memory region:
//! decoding any bytes must never panic, the payload returned is the input after the header,
//! and a header that decodes encodes to one that decodes to the same header again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_fi::rma::{RHdr, RHDR};

fuzz_target!(|data: &[u8]| {
    if let Some((h, payload)) = RHdr::decode(data) {
        assert_eq!(payload.len(), data.len() - RHDR);
        let again = [&h.encode()[..], payload].concat();
        let (h2, p2) = RHdr::decode(&again).expect("a decoded header encodes to a valid one");
        assert_eq!(h2.encode(), h.encode());
        assert_eq!(p2, payload);
    }
});

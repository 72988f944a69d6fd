//! verbs-ud's UD zero-copy control messages (`weft_verbs::ud::zcopy::Ctl`: done, grant with its
//! piece ranges, fin, abort), which a peer sends: decoding any bytes must never panic, a grant
//! never names more pieces than a transfer has, and what decodes encodes back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_verbs::ud::zcopy::{Ctl, MAX_PIECES};

fuzz_target!(|data: &[u8]| {
    if let Some(c) = Ctl::decode(data) {
        if let Ctl::Grant { pieces, .. } = &c {
            assert!(pieces.len() <= MAX_PIECES as usize);
            assert!(pieces.iter().all(|&p| p < MAX_PIECES));
        }
        assert_eq!(Ctl::decode(&c.encode()), Some(c));
    }
});

//! The verbs endpoint parser (what RC connection set-up reads from a peer over the bootstrap)
//! on arbitrary input: an error or an endpoint, never a panic, and a parsed endpoint survives
//! formatting and parsing again unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_verbs::Endpoint;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(e) = s.parse::<Endpoint>() {
        let again: Endpoint = e.to_string().parse().expect("a formatted endpoint parses");
        assert_eq!(again, e);
    }
});

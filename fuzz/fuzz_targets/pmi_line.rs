//! The PMI-1 line parser on arbitrary input: it must return an error or a line, never panic,
//! and a parsed line must survive formatting and parsing again unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft::bootstrap::pmi::{parse_line, unescape};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(line) = parse_line(s) {
        let again = parse_line(&line.to_wire()).expect("a formatted line parses");
        assert_eq!(again, line);
        for (_, v) in &line.fields {
            let _ = unescape(v);
        }
    }
});

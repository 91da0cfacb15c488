//! Cursor parsing never panics, and whatever it accepts formats to a cursor that parses back to
//! the same value and is safe to write as an SSE `id:`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use posthorn::model::Cursor;

fuzz_target!(|input: &[u8]| {
    let Ok(text) = std::str::from_utf8(input) else {
        return;
    };
    if let Ok(cursor) = Cursor::parse(text) {
        let formatted = cursor.to_string();
        assert!(!formatted.contains(['\r', '\n', '\0']), "{formatted:?}");
        assert_eq!(Cursor::parse(&formatted).as_ref(), Ok(&cursor));
    }
});

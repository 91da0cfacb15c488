//! The SSE encoder never lets a payload inject a field or an event: what a WHATWG parser (the
//! reference client's) reads back from a frame is exactly one event with our id and type, and
//! the payload with its line breaks turned into LF.
#![no_main]

use libfuzzer_sys::fuzz_target;
use posthorn::{
    client::parser::{Parsed, Parser},
    sse::frame,
};

fuzz_target!(|input: &[u8]| {
    let data = String::from_utf8_lossy(input);
    let bytes = frame::event("e0.1.2-3", "kind", &data);
    let events: Vec<_> = Parser::new()
        .feed(&bytes)
        .into_iter()
        .filter_map(|parsed| match parsed {
            Parsed::Event(event) => Some(event),
            _ => None,
        })
        .collect();
    assert_eq!(events.len(), 1, "{bytes:?}");
    assert_eq!(events[0].id.as_deref(), Some("e0.1.2-3"));
    assert_eq!(events[0].event_type, "kind");
    assert_eq!(
        events[0].data,
        data.replace("\r\n", "\n").replace('\r', "\n")
    );
});

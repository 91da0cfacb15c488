//! SSE framing (WHATWG "server-sent events"), pure functions producing shared `Bytes`.
//!
//! The id and event type come from validated alphabets. The payload is split on every line break
//! (CRLF, CR, LF) into `data:` lines, so a client reads it back with LF line ends and no payload
//! can start a new field or event.

use bytes::{BufMut, Bytes, BytesMut};

use crate::model::{Cursor, ResyncReason};

pub const PING: Bytes = Bytes::from_static(b": ping\n\n");

/// `retry:` plus a comment, the first bytes of every stream: the comment tells the client (and
/// any proxy) that the stream is open before the first event.
pub fn prelude(retry_ms: u32) -> Bytes {
    Bytes::from(format!("retry: {retry_ms}\n: posthorn\n\n"))
}

pub fn retry(retry_ms: u32) -> Bytes {
    Bytes::from(format!("retry: {retry_ms}\n\n"))
}

/// One event: `id:`, `event:`, one `data:` line per payload line, blank line.
pub fn event(id: &str, event_type: &str, data: &str) -> Bytes {
    debug_assert!(!id.contains(['\r', '\n', '\0']) && !event_type.contains(['\r', '\n']));
    let mut out = BytesMut::with_capacity(id.len() + event_type.len() + data.len() + 32);
    out.put_slice(b"id: ");
    out.put_slice(id.as_bytes());
    out.put_u8(b'\n');
    type_and_data(&mut out, event_type, data);
    out.freeze()
}

/// An event without an `id:` (the fleet event stream is not resumable).
pub fn named_event(event_type: &str, data: &str) -> Bytes {
    let mut out = BytesMut::with_capacity(event_type.len() + data.len() + 32);
    type_and_data(&mut out, event_type, data);
    out.freeze()
}

/// `event:`, one `data:` line per payload line, and the blank line that ends an event.
fn type_and_data(out: &mut BytesMut, event_type: &str, data: &str) {
    out.put_slice(b"event: ");
    out.put_slice(event_type.as_bytes());
    out.put_u8(b'\n');
    for line in payload_lines(data) {
        out.put_slice(b"data: ");
        out.put_slice(line.as_bytes());
        out.put_u8(b'\n');
    }
    out.put_u8(b'\n');
}

/// `event: resync` with the position the client continues from as its `id:`.
pub fn resync(continue_after: &Cursor, reason: ResyncReason) -> Bytes {
    let data = format!("{{\"reason\":\"{}\"}}", reason.label());
    event(&continue_after.to_string(), "resync", &data)
}

/// Splits on CRLF, CR and LF, the three line ends an SSE parser honours.
fn payload_lines(data: &str) -> impl Iterator<Item = &str> {
    let mut rest = Some(data);
    std::iter::from_fn(move || {
        let text = rest?;
        match memchr::memchr2(b'\r', b'\n', text.as_bytes()) {
            Some(at) => {
                let skip = if text[at..].starts_with("\r\n") { 2 } else { 1 };
                rest = Some(&text[at + skip..]);
                Some(&text[..at])
            }
            None => {
                rest = None;
                Some(text)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal WHATWG event-stream parser, as a browser's EventSource would read our bytes.
    /// Returns (id, event type, data) per dispatched event.
    fn parse(stream: &[u8]) -> Vec<(Option<String>, String, String)> {
        let text = std::str::from_utf8(stream).unwrap();
        let text = text.replace("\r\n", "\n").replace('\r', "\n");
        let mut events = Vec::new();
        let (mut id, mut event, mut data): (Option<String>, String, Option<String>) =
            (None, String::new(), None);
        for line in text.split('\n') {
            if line.is_empty() {
                if let Some(d) = data.take() {
                    let kind = if event.is_empty() {
                        "message".to_string()
                    } else {
                        event.clone()
                    };
                    events.push((id.clone(), kind, d));
                }
                event.clear();
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "id" => id = Some(value.to_string()),
                "event" => event = value.to_string(),
                "data" => match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_string()),
                },
                _ => {}
            }
        }
        events
    }

    /// A single-line payload is framed as one event with id, type and data.
    #[test]
    fn frames_a_simple_event() {
        assert_eq!(
            &event("e.1.2-3", "order.paid", "{\"total\":5}")[..],
            b"id: e.1.2-3\nevent: order.paid\ndata: {\"total\":5}\n\n"
        );
    }

    /// LF, CR and CRLF all become separate `data:` lines and read back as LF.
    #[test]
    fn multi_line_payloads_read_back_with_lf() {
        let frame = event("i", "t", "a\nb\rc\r\nd");
        assert_eq!(
            &frame[..],
            b"id: i\nevent: t\ndata: a\ndata: b\ndata: c\ndata: d\n\n"
        );
        assert_eq!(
            parse(&frame),
            vec![(Some("i".into()), "t".into(), "a\nb\nc\nd".into())]
        );
    }

    /// Payloads that try to smuggle fields or whole events stay inside their own `data`.
    #[test]
    fn payload_cannot_inject_fields() {
        for hostile in [
            "x\nid: forged\nevent: admin\ndata: pwned\n\n",
            "x\r\n\r\nevent: resync\r\ndata: {}",
            "\rretry: 1\r",
            "\n\n\n",
            " leading space\nid:",
            "trailing\n",
            "nul\0inside",
        ] {
            let frame = event("real", "kind", hostile);
            let parsed = parse(&frame);
            let expected = hostile.replace("\r\n", "\n").replace('\r', "\n");
            assert_eq!(
                parsed,
                vec![(Some("real".into()), "kind".into(), expected)],
                "{hostile:?}"
            );
        }
    }

    /// The prelude sets the reconnect delay and dispatches no event.
    #[test]
    fn prelude_sets_retry_without_an_event() {
        let bytes = prelude(3000);
        assert!(bytes.starts_with(b"retry: 3000\n"));
        assert!(parse(&bytes).is_empty());
        assert!(parse(&PING).is_empty());
    }
}

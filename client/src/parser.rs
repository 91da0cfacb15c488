//! An event-stream parser following the WHATWG rules, for clients (the hub writes, this reads).
//!
//! Two levels, one set of rules. [`Lines`] splits a stream into lines and fields without
//! allocating (the load tester reads ten thousand streams with it); [`Parser`] builds on it and
//! hands out whole events (the reference client, `posthorn tail`, the test harness).
//!
//! Lines end in CRLF, LF or CR (a CR at the end of one chunk and an LF at the start of the next
//! are one line end); a leading BOM is dropped; `field: value` loses one optional space; lines
//! starting with `:` are comments; `data` lines join with LF; an event with no data is not
//! dispatched; an `id` containing NUL is ignored; `retry` takes ASCII digits only.

const BOM: &[u8] = "\u{feff}".as_bytes();

/// One line of an event stream, borrowed from the bytes fed (or from the partial line kept
/// between reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line<'a> {
    /// A blank line: the event gathered so far is complete.
    Dispatch,
    /// `:comment`, without the colon and one optional space.
    Comment(&'a [u8]),
    /// `name: value`, the value without one optional leading space; a line without a colon is
    /// a field with an empty value.
    Field { name: &'a [u8], value: &'a [u8] },
}

/// Splits an event stream into [`Line`]s. Keeps only the unfinished line between reads.
#[derive(Debug, Default)]
pub struct Lines {
    partial: Vec<u8>,
    /// The previous chunk ended in CR: an LF at the start of the next one belongs to it.
    after_cr: bool,
    /// The first line has been read (a leading BOM is dropped from it).
    started: bool,
}

impl Lines {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands every line completed by `bytes` to `on_line`, in order.
    pub fn feed(&mut self, mut bytes: &[u8], mut on_line: impl FnMut(Line<'_>)) {
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
        }
        while let Some(end) = memchr::memchr2(b'\r', b'\n', bytes) {
            if self.partial.is_empty() {
                self.emit(&bytes[..end], &mut on_line);
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(&bytes[..end]);
                self.emit(&line, &mut on_line);
                line.clear();
                self.partial = line;
            }
            let cr = bytes[end] == b'\r';
            bytes = &bytes[end + 1..];
            if cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        self.partial.extend_from_slice(bytes);
    }

    fn emit(&mut self, mut line: &[u8], on_line: &mut impl FnMut(Line<'_>)) {
        // A BOM may open the stream; it can arrive split over reads, so it is removed from the
        // first complete line.
        if !self.started {
            self.started = true;
            line = line.strip_prefix(BOM).unwrap_or(line);
        }
        on_line(match line {
            [] => Line::Dispatch,
            [b':', comment @ ..] => Line::Comment(comment.strip_prefix(b" ").unwrap_or(comment)),
            _ => match memchr::memchr(b':', line) {
                Some(colon) => {
                    let value = &line[colon + 1..];
                    Line::Field {
                        name: &line[..colon],
                        value: value.strip_prefix(b" ").unwrap_or(value),
                    }
                }
                None => Line::Field {
                    name: line,
                    value: b"",
                },
            },
        });
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched {
    /// The last event id after this event (the id a client resumes from).
    pub id: Option<String>,
    /// Whether this event's own block had an `id:` line: the hub's own last words
    /// (`token_expired`, `revoked`) have none, every stored event has one.
    pub own_id: bool,
    pub event_type: String,
    pub data: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    Event(Dispatched),
    /// A `retry:` field: the reconnection time the server asks for.
    Retry(u64),
    Comment(String),
}

/// Whole events, with the state the WHATWG rules keep between them (the last id).
#[derive(Debug, Default)]
pub struct Parser {
    lines: Lines,
    event: EventState,
}

#[derive(Debug, Default)]
struct EventState {
    data: Option<String>,
    event_type: String,
    last_id: Option<String>,
    /// The block being read has an `id:` line.
    block_has_id: bool,
}

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn last_id(&self) -> Option<&str> {
        self.event.last_id.as_deref()
    }

    pub fn feed(&mut self, bytes: &[u8]) -> Vec<Parsed> {
        let mut out = Vec::new();
        let event = &mut self.event;
        self.lines.feed(bytes, |line| event.line(line, &mut out));
        out
    }
}

impl EventState {
    fn line(&mut self, line: Line<'_>, out: &mut Vec<Parsed>) {
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        match line {
            Line::Dispatch => {
                if let Some(data) = self.data.take() {
                    out.push(Parsed::Event(Dispatched {
                        id: self.last_id.clone(),
                        own_id: self.block_has_id,
                        event_type: if self.event_type.is_empty() {
                            "message".into()
                        } else {
                            std::mem::take(&mut self.event_type)
                        },
                        data,
                    }));
                }
                self.event_type.clear();
                self.block_has_id = false;
            }
            Line::Comment(comment) => out.push(Parsed::Comment(text(comment))),
            Line::Field { name, value } => match name {
                b"event" => self.event_type = text(value),
                b"data" => match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(&String::from_utf8_lossy(value));
                    }
                    None => self.data = Some(text(value)),
                },
                b"id" if !value.contains(&0) => {
                    self.last_id = Some(text(value));
                    self.block_has_id = true;
                }
                b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                    if let Ok(ms) = std::str::from_utf8(value).unwrap_or("").parse() {
                        out.push(Parsed::Retry(ms));
                    }
                }
                _ => {}
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(parsed: &[Parsed]) -> Vec<(Option<&str>, &str, &str)> {
        parsed
            .iter()
            .filter_map(|p| match p {
                Parsed::Event(e) => Some((e.id.as_deref(), e.event_type.as_str(), e.data.as_str())),
                _ => None,
            })
            .collect()
    }

    /// CRLF, CR and LF line ends, split anywhere across chunks, give the same events.
    #[test]
    fn line_ends_and_chunk_boundaries() {
        let stream = "\u{feff}retry: 3000\r\n: hi\r\n\r\nid: a\revent: t\rdata: x\rdata: y\r\rid: b\ndata: z\n\n";
        let whole = Parser::new().feed(stream.as_bytes());
        for split in 1..stream.len() {
            let mut parser = Parser::new();
            let mut parsed = parser.feed(&stream.as_bytes()[..split]);
            parsed.extend(parser.feed(&stream.as_bytes()[split..]));
            assert_eq!(parsed, whole, "split at {split}");
        }
        assert_eq!(
            events(&whole),
            vec![(Some("a"), "t", "x\ny"), (Some("b"), "message", "z")]
        );
        assert!(whole.contains(&Parsed::Retry(3000)));
        assert!(whole.contains(&Parsed::Comment("hi".into())));
    }

    /// The line splitter keeps nothing but the unfinished line, and hands out fields without
    /// their one optional space.
    #[test]
    fn lines_are_borrowed_fields() {
        let mut lines = Lines::new();
        let mut seen = Vec::new();
        let mut record = |line: Line<'_>| {
            seen.push(match line {
                Line::Dispatch => "dispatch".to_string(),
                Line::Comment(c) => format!("comment {}", String::from_utf8_lossy(c)),
                Line::Field { name, value } => format!(
                    "{}={}",
                    String::from_utf8_lossy(name),
                    String::from_utf8_lossy(value)
                ),
            })
        };
        lines.feed(b"da", &mut record);
        lines.feed(b"ta:  two spaces\r", &mut record);
        lines.feed(b"\nid\n:ping\n\n", &mut record);
        assert_eq!(
            seen,
            ["data= two spaces", "id=", "comment ping", "dispatch"]
        );
        assert!(lines.partial.is_empty() && !lines.after_cr);
    }

    /// Events without data are not dispatched; ids persist; bad retry values are ignored.
    #[test]
    fn whatwg_edge_cases() {
        let parsed = Parser::new()
            .feed(b"id: 1\n\nevent: x\n\ndata\n\nretry: 12a\nretry: -5\nid: n\0l\ndata: v\n\n");
        assert_eq!(
            events(&parsed),
            vec![(Some("1"), "message", ""), (Some("1"), "message", "v")]
        );
        assert!(!parsed.iter().any(|p| matches!(p, Parsed::Retry(_))));
    }
}

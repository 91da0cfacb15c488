//! An event-stream parser following the WHATWG rules, for clients (the hub writes, this reads).
//!
//! Lines end in CRLF, LF or CR (a CR at the end of one chunk and an LF at the start of the next
//! are one line end); a leading BOM is dropped; `field: value` loses one optional space; lines
//! starting with `:` are comments; `data` lines join with LF; an event with no data is not
//! dispatched; an `id` containing NUL is ignored; `retry` takes ASCII digits only.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched {
    /// The last event id after this event (the id a client resumes from).
    pub id: Option<String>,
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

#[derive(Debug, Default)]
pub struct Parser {
    line: Vec<u8>,
    /// The previous chunk ended in CR: an LF at the start of the next one belongs to it.
    after_cr: bool,
    /// The first line has been read (a leading BOM is dropped from it).
    started: bool,
    data: Option<String>,
    event_type: String,
    last_id: Option<String>,
}

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn last_id(&self) -> Option<&str> {
        self.last_id.as_deref()
    }

    pub fn feed(&mut self, bytes: &[u8]) -> Vec<Parsed> {
        let mut out = Vec::new();
        for &byte in bytes {
            if self.after_cr {
                self.after_cr = false;
                if byte == b'\n' {
                    continue;
                }
            }
            match byte {
                b'\r' => {
                    self.after_cr = true;
                    self.end_line(&mut out);
                }
                b'\n' => self.end_line(&mut out),
                _ => self.line.push(byte),
            }
        }
        out
    }

    fn end_line(&mut self, out: &mut Vec<Parsed>) {
        let mut line = String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
        // A BOM may open the stream; it can arrive split over reads, so it is removed from the
        // first complete line.
        if !self.started {
            self.started = true;
            if let Some(rest) = line.strip_prefix('\u{feff}') {
                line = rest.to_string();
            }
        }
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                out.push(Parsed::Event(Dispatched {
                    id: self.last_id.clone(),
                    event_type: if self.event_type.is_empty() {
                        "message".into()
                    } else {
                        std::mem::take(&mut self.event_type)
                    },
                    data,
                }));
            }
            self.event_type.clear();
            return;
        }
        if let Some(comment) = line.strip_prefix(':') {
            out.push(Parsed::Comment(
                comment.strip_prefix(' ').unwrap_or(comment).to_string(),
            ));
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_str(), ""),
        };
        match field {
            "event" => self.event_type = value.to_string(),
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            },
            "id" if !value.contains('\0') => self.last_id = Some(value.to_string()),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                if let Ok(ms) = value.parse() {
                    out.push(Parsed::Retry(ms));
                }
            }
            _ => {}
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

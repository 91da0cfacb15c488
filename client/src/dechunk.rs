//! `Transfer-Encoding: chunked` decoding, incremental and without buffering: the bytes of a read
//! go in, the body bytes they carry come out through a callback. Shared by the reference client
//! and the load tool (whose 10,000 readers must not allocate per read).

use thiserror::Error;

/// The body is not valid chunked framing: a size line that is not hexadecimal (or does not fit
/// a `usize`), or chunk data not followed by its line end. A server bug, never a slow network.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BadChunk {
    #[error("bad chunk size line (byte {0:?})")]
    Size(char),
    #[error("chunk data not followed by CRLF (byte {0:?})")]
    DataEnd(char),
}

/// The decoder, fed with whatever a read returned.
#[derive(Debug, Default)]
pub struct Dechunk {
    state: ChunkState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Reading a size line; the digits so far, and whether an extension (`;...`) started.
    Size {
        size: usize,
        extension: bool,
    },
    Data(usize),
    /// After a chunk's data: its CR (optional, as most decoders allow) and LF.
    DataEnd {
        cr: bool,
    },
    /// After the last chunk: trailer lines up to an empty one.
    Trailer {
        line_start: bool,
    },
    Finished,
}

impl Default for ChunkState {
    fn default() -> Self {
        ChunkState::Size {
            size: 0,
            extension: false,
        }
    }
}

impl Dechunk {
    /// Passes the body bytes in `input` to `out`; returns how many input bytes were consumed
    /// (all of them unless the last chunk ended inside `input`).
    pub fn feed(&mut self, input: &[u8], mut out: impl FnMut(&[u8])) -> Result<usize, BadChunk> {
        let mut at = 0;
        while at < input.len() {
            self.state = match self.state {
                ChunkState::Finished => return Ok(at),
                ChunkState::Data(remaining) => {
                    let take = remaining.min(input.len() - at);
                    out(&input[at..at + take]);
                    at += take;
                    if take == remaining {
                        ChunkState::DataEnd { cr: false }
                    } else {
                        ChunkState::Data(remaining - take)
                    }
                }
                ChunkState::DataEnd { cr } => {
                    at += 1;
                    match input[at - 1] {
                        b'\n' => ChunkState::default(),
                        b'\r' if !cr => ChunkState::DataEnd { cr: true },
                        byte => return Err(BadChunk::DataEnd(byte as char)),
                    }
                }
                ChunkState::Trailer { line_start } => {
                    at += 1;
                    match input[at - 1] {
                        b'\n' if line_start => ChunkState::Finished,
                        b'\n' => ChunkState::Trailer { line_start: true },
                        b'\r' => ChunkState::Trailer { line_start },
                        _ => ChunkState::Trailer { line_start: false },
                    }
                }
                ChunkState::Size { size, extension } => {
                    let byte = input[at];
                    at += 1;
                    match (byte, extension) {
                        (b'\n', _) if size == 0 => ChunkState::Trailer { line_start: true },
                        (b'\n', _) => ChunkState::Data(size),
                        (b';', _) | (_, true) => ChunkState::Size {
                            size,
                            extension: true,
                        },
                        (b'\r' | b' ' | b'\t', _) => ChunkState::Size { size, extension },
                        _ => {
                            let digit = (byte as char)
                                .to_digit(16)
                                .ok_or(BadChunk::Size(byte as char))?;
                            let size = size
                                .checked_mul(16)
                                .and_then(|size| size.checked_add(digit as usize))
                                .ok_or(BadChunk::Size(byte as char))?;
                            ChunkState::Size {
                                size,
                                extension: false,
                            }
                        }
                    }
                }
            };
        }
        Ok(at)
    }

    /// The last chunk and the trailer have been read: the body is complete.
    pub fn finished(&self) -> bool {
        self.state == ChunkState::Finished
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunked bodies decode the same whatever the read boundaries.
    #[test]
    fn dechunk_handles_sizes_split_across_reads() {
        let body = b"5\r\nhello\r\n1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\n\r\n";
        for split in 0..body.len() {
            let mut decoder = Dechunk::default();
            let mut out = Vec::new();
            let first = decoder
                .feed(&body[..split], |b| out.extend_from_slice(b))
                .unwrap();
            assert_eq!(first, split);
            assert!(!decoder.finished());
            let rest = decoder
                .feed(&body[split..], |b| out.extend_from_slice(b))
                .unwrap();
            assert_eq!(rest, body.len() - split, "the whole trailer is consumed");
            assert_eq!(out, b"hello world!", "split at {split}");
            assert!(decoder.finished());
        }
    }

    #[test]
    fn dechunk_sizes_are_hex() {
        let mut body = b"1a\r\n".to_vec();
        body.extend_from_slice(&[b'x'; 26]);
        body.extend_from_slice(b"\r\n0\r\n\r\n");
        let mut decoder = Dechunk::default();
        let mut out = Vec::new();
        decoder.feed(&body, |b| out.extend_from_slice(b)).unwrap();
        assert_eq!(out.len(), 26);
        assert!(decoder.finished());
    }

    #[test]
    fn bad_sizes_are_errors() {
        let mut decoder = Dechunk::default();
        assert_eq!(decoder.feed(b"zz\r\n", |_| {}), Err(BadChunk::Size('z')));
        let mut decoder = Dechunk::default();
        assert!(decoder.feed(b"fffffffffffffffff\r\n", |_| {}).is_err());
    }

    /// A chunk longer than its size line says is a framing error, not data.
    #[test]
    fn data_past_its_size_is_an_error() {
        let mut decoder = Dechunk::default();
        assert_eq!(
            decoder.feed(b"2\r\nabc\r\n", |_| {}),
            Err(BadChunk::DataEnd('c'))
        );
    }
}

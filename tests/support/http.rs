//! Minimal HTTP/1.1 client over a raw tokio `TcpStream` (or, through [`exchange`], any stream:
//! `tls.rs` runs it over TLS), plus the pieces the
//! SSE client shares with it: response-head parsing and body framing (the
//! chunked decoder is the reference client's).
//!
//! Written by hand rather than pulling in an HTTP crate so that tests see
//! exactly what the server put on the wire (framing, header spelling).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::IO_TIMEOUT;

/// A response head larger than this is treated as a server bug rather than
/// buffered forever.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// A fully read response. Header names are lowercased; values are trimmed.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// First value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// Every value of header `name`, in wire order (e.g. `set-cookie`).
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Body parsed as JSON; panics with the status and raw body otherwise,
    /// because a non-JSON answer is always a test failure worth seeing.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}); status {}, body {:?}",
                self.status,
                self.text()
            )
        })
    }
}

pub(crate) fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Status line and headers of a response.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub status: u16,
    pub headers: Vec<(String, String)>,
}

/// Serialises a request. Adds `Host` and, when there is a body,
/// `Content-Length`, unless the caller supplied them.
pub fn encode_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Vec<u8> {
    let has = |name: &str| headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !has("host") {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        if !has("content-length") && !has("transfer-encoding") {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body.unwrap_or_default());
    out
}

/// Parses `HTTP/1.1 200 OK\r\nName: value\r\n...` (without the blank line).
pub fn parse_head(head: &[u8]) -> io::Result<ResponseHead> {
    let text = std::str::from_utf8(head).map_err(|e| invalid(format!("non-UTF-8 head: {e}")))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(invalid(format!("bad status line {status_line:?}")));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| invalid(format!("bad status line {status_line:?}")))?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| invalid(format!("bad header line {line:?}")))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    Ok(ResponseHead { status, headers })
}

/// Reads until the end of a final (non-1xx) response head. `buf` carries
/// bytes across calls: on return it holds whatever body bytes were read
/// together with the head.
pub async fn read_head(
    stream: &mut (impl AsyncRead + Unpin),
    buf: &mut Vec<u8>,
) -> io::Result<ResponseHead> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let head = parse_head(&buf[..end])?;
            buf.drain(..end + 4);
            // Interim responses (100 Continue, 103 Early Hints) precede the
            // real one; 101 is final because the protocol changes after it.
            if (100..200).contains(&head.status) && head.status != 101 {
                continue;
            }
            return Ok(head);
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(invalid(format!(
                "response head exceeds {MAX_HEAD_BYTES} bytes"
            )));
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed before a complete response head; got {:?}",
                    String::from_utf8_lossy(buf)
                ),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// How the end of a response body is found (RFC 9112 §6.3).
#[derive(Debug)]
pub enum BodyFraming {
    Chunked(ChunkedDecoder),
    /// Bytes still expected per `Content-Length`.
    Length(u64),
    UntilEof,
}

impl BodyFraming {
    pub fn for_response(method: &str, head: &ResponseHead) -> io::Result<Self> {
        if method.eq_ignore_ascii_case("HEAD")
            || (100..200).contains(&head.status)
            || head.status == 204
            || head.status == 304
        {
            return Ok(Self::Length(0));
        }
        if let Some(te) = find_header(&head.headers, "transfer-encoding") {
            // Only the last coding decides framing; anything else would be
            // a gzip-style coding this client deliberately does not support.
            let last = te.rsplit(',').next().unwrap_or_default().trim();
            if last.eq_ignore_ascii_case("chunked") {
                return Ok(Self::Chunked(ChunkedDecoder::new()));
            }
            return Ok(Self::UntilEof);
        }
        if let Some(cl) = find_header(&head.headers, "content-length") {
            let n = cl
                .parse::<u64>()
                .map_err(|_| invalid(format!("bad content-length {cl:?}")))?;
            return Ok(Self::Length(n));
        }
        Ok(Self::UntilEof)
    }

    /// Appends the payload carried by `input` to `out`.
    pub fn decode(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        match self {
            Self::Chunked(dec) => out.extend(dec.feed(input).map_err(invalid)?),
            Self::Length(remaining) => {
                let take = input
                    .len()
                    .min(usize::try_from(*remaining).unwrap_or(usize::MAX));
                out.extend_from_slice(&input[..take]);
                *remaining -= take as u64;
            }
            Self::UntilEof => out.extend_from_slice(input),
        }
        Ok(())
    }

    /// True once the framing says the body has ended (never for `UntilEof`).
    pub fn is_complete(&self) -> bool {
        match self {
            Self::Chunked(dec) => dec.is_done(),
            Self::Length(remaining) => *remaining == 0,
            Self::UntilEof => false,
        }
    }
}

/// Incremental decoder for `Transfer-Encoding: chunked`: the reference client's (one chunked
/// decoder in the project), behind the interface the tests use. Input may be split anywhere.
#[derive(Debug, Default)]
pub struct ChunkedDecoder(posthorn_client::dechunk::Dechunk);

impl ChunkedDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// True after the terminating zero-size chunk and its trailer section.
    pub fn is_done(&self) -> bool {
        self.0.finished()
    }

    /// Feeds raw wire bytes; returns the payload bytes they completed.
    /// Errors describe the framing violation, which is a server bug.
    pub fn feed(&mut self, input: &[u8]) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        self.0
            .feed(input, |bytes| out.extend_from_slice(bytes))
            .map_err(|error| error.to_string())?;
        Ok(out)
    }
}

pub(crate) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Sends one request on a fresh connection and reads the whole response,
/// returning an error (including `TimedOut`) instead of panicking. Used
/// where failure is expected, e.g. polling `/healthz` during start-up.
pub async fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<HttpResponse> {
    let exchange = async {
        let stream = TcpStream::connect(addr).await?;
        exchange(stream, addr, method, path, headers, body).await
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{method} {path} on {addr}: no complete response within {timeout:?}"),
            ))
        })
}

/// One request and its whole response on `stream` (plain or TLS), closed after it.
pub async fn exchange(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> io::Result<HttpResponse> {
    // One connection per request keeps tests independent of keep-alive
    // behaviour and lets "read to EOF" bodies terminate.
    let mut all_headers = Vec::with_capacity(headers.len() + 1);
    if !headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("connection"))
    {
        all_headers.push(("Connection", "close"));
    }
    all_headers.extend_from_slice(headers);
    stream
        .write_all(&encode_request(addr, method, path, &all_headers, body))
        .await?;

    let mut buf = Vec::new();
    let head = read_head(&mut stream, &mut buf).await?;
    let mut framing = BodyFraming::for_response(method, &head)?;
    let mut body = Vec::new();
    framing.decode(&buf, &mut body)?;
    let mut chunk = [0u8; 8192];
    while !framing.is_complete() {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            if matches!(framing, BodyFraming::UntilEof) {
                break;
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("connection closed mid-body ({framing:?})"),
            ));
        }
        framing.decode(&chunk[..n], &mut body)?;
    }
    Ok(HttpResponse {
        status: head.status,
        headers: head.headers,
        body,
    })
}

/// Like [`try_request`] with the harness timeout, panicking on any failure.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    try_request(addr, method, path, headers, body, IO_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("HTTP {method} {path} to {addr} failed: {e}"))
}

pub async fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    request(addr, "GET", path, &[], None).await
}

pub async fn post_json(addr: SocketAddr, path: &str, value: &serde_json::Value) -> HttpResponse {
    let body = serde_json::to_vec(value).expect("serialise JSON body");
    post_raw(addr, path, "application/json", &body).await
}

pub async fn post_raw(
    addr: SocketAddr,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> HttpResponse {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", content_type)],
        Some(body),
    )
    .await
}

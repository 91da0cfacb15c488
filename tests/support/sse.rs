//! Server-Sent-Events client over a raw tokio `TcpStream`: an [`SseDecoder`]
//! on the reference client's WHATWG line splitter, an [`SseClient`] that undoes
//! HTTP body framing (actix streams SSE chunked) and feeds it, and raw
//! never-reading sockets for slow-consumer tests.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

use posthorn_client::parser::{Line, Lines};

use super::http::{encode_request, find_header, read_head, BodyFraming};
use super::IO_TIMEOUT;

/// One dispatched event.
///
/// `id` is the `id:` field seen in this event's own block, not the
/// WHATWG "last event ID" that carries over between events (that one is
/// [`SseDecoder::last_id`]): tests about framing need to know what the
/// server actually wrote for each event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: String,
    pub data: String,
}

/// Outcome of waiting for the next event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseNext {
    Event(SseEvent),
    Timeout,
    /// The server ended the body or closed/reset the connection.
    Closed,
}

/// Incremental event-stream decoder: the reference client's line splitter (one parser of the
/// rules in the project: line ends split anywhere, BOM, field syntax), plus what tests want to
/// see of each event that a client does not keep (the id of the event's own block, every
/// comment, the last `retry:`).
#[derive(Debug, Default)]
pub struct SseDecoder {
    lines: Lines,
    block: Block,
}

#[derive(Debug, Default)]
struct Block {
    data: Option<String>,
    event_type: String,
    block_id: Option<String>,
    last_id: String,
    retry: Option<u64>,
    comments: Vec<String>,
    new_comments: usize,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds decoded body bytes; returns the events they completed.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        let block = &mut self.block;
        self.lines.feed(bytes, |line| {
            if let Some(event) = block.line(line) {
                events.push(event);
            }
        });
        events
    }

    /// The WHATWG last event ID (persists across events; `None` when unset
    /// or reset by an empty `id:`, which is what a browser would send).
    pub fn last_id(&self) -> Option<&str> {
        (!self.block.last_id.is_empty()).then_some(self.block.last_id.as_str())
    }

    /// Last valid `retry:` value, recorded even if no event was dispatched.
    pub fn retry(&self) -> Option<u64> {
        self.block.retry
    }

    /// Comment lines seen so far, without the leading ':' and one optional
    /// space, so a `: ping` keep-alive reads as `"ping"`.
    pub fn comments(&self) -> &[String] {
        &self.block.comments
    }

    /// Comments added since the previous call.
    pub fn take_new_comments(&mut self) -> &[String] {
        let start = self.block.comments.len() - self.block.new_comments;
        self.block.new_comments = 0;
        &self.block.comments[start..]
    }
}

impl Block {
    fn line(&mut self, line: Line<'_>) -> Option<SseEvent> {
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        match line {
            Line::Dispatch => return self.dispatch(),
            Line::Comment(comment) => {
                self.comments.push(text(comment));
                self.new_comments += 1;
            }
            Line::Field { name, value } => match name {
                b"data" => match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(&text(value));
                    }
                    None => self.data = Some(text(value)),
                },
                b"event" => self.event_type = text(value),
                // An id containing NUL is ignored by the spec.
                b"id" if !value.contains(&0) => {
                    self.last_id = text(value);
                    self.block_id = Some(text(value));
                }
                b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                    self.retry = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
                }
                _ => {}
            },
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let event_type = std::mem::take(&mut self.event_type);
        let id = self.block_id.take();
        // No `data:` line at all (not even an empty one) means nothing to
        // dispatch; buffers are reset regardless.
        let data = self.data.take()?;
        Some(SseEvent {
            id,
            event: if event_type.is_empty() {
                "message".to_string()
            } else {
                event_type
            },
            data,
        })
    }
}

/// A live SSE subscription. Construct with [`SseClient::connect`].
pub struct SseClient {
    stream: TcpStream,
    addr: SocketAddr,
    path: String,
    status: u16,
    headers: Vec<(String, String)>,
    framing: BodyFraming,
    decoder: SseDecoder,
    pending: VecDeque<SseEvent>,
    closed: bool,
    /// Last valid `retry:` value seen.
    pub retry: Option<u64>,
    /// All comment lines seen (see [`SseDecoder::comments`]).
    pub comments: Vec<String>,
    /// Every body byte seen so far with HTTP framing removed, for tests that
    /// check the exact event-stream encoding.
    pub raw: Vec<u8>,
}

impl std::fmt::Debug for SseClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseClient")
            .field("addr", &self.addr)
            .field("path", &self.path)
            .field("status", &self.status)
            .field("closed", &self.closed)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl SseClient {
    /// Subscribes and reads the response head; panics on network failure.
    /// A non-200 answer is not a failure: check [`SseClient::status`].
    pub async fn connect(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> SseClient {
        Self::try_connect(addr, path, headers)
            .await
            .unwrap_or_else(|e| panic!("SSE connect to {addr}{path} failed: {e}"))
    }

    pub async fn try_connect(
        addr: SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
    ) -> io::Result<SseClient> {
        let connect = async {
            let mut stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let mut all_headers = Vec::with_capacity(headers.len() + 1);
            if !headers
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case("accept"))
            {
                all_headers.push(("Accept", "text/event-stream"));
            }
            all_headers.extend_from_slice(headers);
            stream
                .write_all(&encode_request(addr, "GET", path, &all_headers, None))
                .await?;
            Self::read_response(stream, addr, path).await
        };
        tokio::time::timeout(IO_TIMEOUT, connect)
            .await
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no SSE response head from {addr}{path} within {IO_TIMEOUT:?}"),
                ))
            })
    }

    /// Starts reading a stream opened with [`SseClient::connect_raw_never_read`] (the request
    /// is sent, nothing was read yet): the response head, then events as usual.
    pub async fn connect_raw_reader(stream: TcpStream) -> SseClient {
        let addr = stream.peer_addr().expect("a connected stream");
        tokio::time::timeout(IO_TIMEOUT, Self::read_response(stream, addr, ""))
            .await
            .unwrap_or_else(|_| panic!("no SSE response head from {addr} within {IO_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("SSE response head from {addr}: {e}"))
    }

    /// Reads the response head of a request sent on `stream` and whatever body came with it.
    async fn read_response(
        mut stream: TcpStream,
        addr: SocketAddr,
        path: &str,
    ) -> io::Result<SseClient> {
        let mut leftover = Vec::new();
        let head = read_head(&mut stream, &mut leftover).await?;
        let framing = BodyFraming::for_response("GET", &head)?;
        let mut client = SseClient {
            stream,
            addr,
            path: path.to_string(),
            status: head.status,
            headers: head.headers,
            framing,
            decoder: SseDecoder::new(),
            pending: VecDeque::new(),
            closed: false,
            retry: None,
            comments: Vec::new(),
            raw: Vec::new(),
        };
        client.ingest(&leftover);
        Ok(client)
    }

    pub fn status(&self) -> u16 {
        self.status
    }

    /// First value of response header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// WHATWG last event ID, i.e. what a reconnecting browser would send as
    /// `Last-Event-ID`.
    pub fn last_id(&self) -> Option<&str> {
        self.decoder.last_id()
    }

    /// True once the server ended the body or the connection.
    pub fn is_closed(&self) -> bool {
        self.closed && self.pending.is_empty()
    }

    /// True when the body ended by its own framing (terminating chunk or
    /// full Content-Length) rather than by a bare close or reset.
    pub fn body_complete(&self) -> bool {
        self.framing.is_complete()
    }

    pub fn raw_text(&self) -> String {
        String::from_utf8_lossy(&self.raw).into_owned()
    }

    /// Next event, or why there is none within `timeout`.
    pub async fn next_event(&mut self, timeout: Duration) -> SseNext {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 8192];
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return SseNext::Event(ev);
            }
            if self.closed {
                return SseNext::Closed;
            }
            match tokio::time::timeout_at(deadline, self.stream.read(&mut buf)).await {
                Err(_) => return SseNext::Timeout,
                // A reset counts as closed: for a subscriber both mean the
                // server dropped it.
                Ok(Ok(0)) | Ok(Err(_)) => self.closed = true,
                Ok(Ok(n)) => self.ingest(&buf[..n]),
            }
        }
    }

    /// Next event, panicking with what happened instead (and the stream so
    /// far) if there is none.
    pub async fn expect_event(&mut self, timeout: Duration) -> SseEvent {
        match self.next_event(timeout).await {
            SseNext::Event(ev) => ev,
            other => panic!(
                "expected an SSE event on {}{} within {timeout:?}, got {other:?}; body so far: {:?}",
                self.addr,
                self.path,
                self.raw_text()
            ),
        }
    }

    /// Exactly `n` events, all within one overall `timeout`.
    pub async fn expect_events(&mut self, n: usize, timeout: Duration) -> Vec<SseEvent> {
        let deadline = Instant::now() + timeout;
        let mut events = Vec::with_capacity(n);
        while events.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_event(left).await {
                SseNext::Event(ev) => events.push(ev),
                other => panic!(
                    "expected {n} SSE events on {}{} within {timeout:?}, got {} then {other:?}: {events:?}",
                    self.addr,
                    self.path,
                    events.len()
                ),
            }
        }
        events
    }

    /// Reads until the server closes, returning the events not consumed
    /// yet; panics if it stays open past `timeout`.
    pub async fn read_to_close(&mut self, timeout: Duration) -> Vec<SseEvent> {
        let deadline = Instant::now() + timeout;
        let mut events = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_event(left).await {
                SseNext::Event(ev) => events.push(ev),
                SseNext::Closed => return events,
                SseNext::Timeout => panic!(
                    "SSE stream {}{} still open after {timeout:?}; body so far: {:?}",
                    self.addr,
                    self.path,
                    self.raw_text()
                ),
            }
        }
    }

    /// Discards events until the server closes; false if still open after
    /// `timeout`.
    pub async fn wait_closed(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_event(left).await {
                SseNext::Event(_) => {}
                SseNext::Closed => return true,
                SseNext::Timeout => return false,
            }
        }
    }

    fn ingest(&mut self, wire: &[u8]) {
        let mut body = Vec::new();
        if let Err(e) = self.framing.decode(wire, &mut body) {
            panic!(
                "bad HTTP body framing on SSE stream {}{}: {e}",
                self.addr, self.path
            );
        }
        self.raw.extend_from_slice(&body);
        self.pending.extend(self.decoder.feed(&body));
        self.comments
            .extend_from_slice(self.decoder.take_new_comments());
        self.retry = self.decoder.retry();
        if self.framing.is_complete() {
            self.closed = true;
        }
    }

    /// Sends a subscription request and returns the socket without reading
    /// anything, so the server's send buffer fills up. The receive buffer is
    /// shrunk before connecting (it cannot grow the advertised window after
    /// the handshake) to make the server hit back-pressure quickly.
    pub async fn connect_raw_never_read(addr: SocketAddr, path: &str) -> TcpStream {
        Self::connect_raw_never_read_with_headers(addr, path, &[]).await
    }

    pub async fn connect_raw_never_read_with_headers(
        addr: SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
    ) -> TcpStream {
        let connect = async {
            let socket = if addr.is_ipv4() {
                TcpSocket::new_v4()?
            } else {
                TcpSocket::new_v6()?
            };
            socket.set_recv_buffer_size(4096)?;
            let mut stream = socket.connect(addr).await?;
            let mut all_headers = vec![("Accept", "text/event-stream")];
            all_headers.extend_from_slice(headers);
            stream
                .write_all(&encode_request(addr, "GET", path, &all_headers, None))
                .await?;
            io::Result::Ok(stream)
        };
        match tokio::time::timeout(IO_TIMEOUT, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => panic!("raw SSE connect to {addr}{path} failed: {e}"),
            Err(_) => panic!("raw SSE connect to {addr}{path} timed out after {IO_TIMEOUT:?}"),
        }
    }
}

/// Reads and discards from `stream` until EOF or an error (true: the peer
/// closed or reset it) or until `timeout` passes (false: still open).
pub async fn is_closed_within(stream: &mut TcpStream, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// The `reason` of a `resync` event; fails the test on any other event.
pub fn resync_reason(event: &SseEvent) -> String {
    assert_eq!(event.event, "resync", "expected a resync, got {event:?}");
    let data: serde_json::Value = serde_json::from_str(&event.data).expect("resync data is JSON");
    data["reason"].as_str().expect("reason").to_string()
}

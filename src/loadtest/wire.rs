//! The load tool's HTTP/1.1 and SSE client, written against raw sockets so that one connection
//! costs one socket, one read buffer and a few counters: ten thousand of them must not make the
//! tool the bottleneck. Parses chunked bodies properly (a chunk boundary may split an SSE line)
//! and reads SSE fields without allocating per event, with the reference client's decoder and
//! line splitter (`posthorn-client`: one parser in the product).

use std::{
    io,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    task::{Context, Poll},
};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf},
    net::{TcpSocket, TcpStream},
};
use tokio_rustls::client::TlsStream;

use super::{payload, Endpoint};
use posthorn_client::{
    dechunk::Dechunk,
    parser::{Line, Lines},
};

/// Longest response head accepted from a server under test.
const MAX_HEAD: usize = 16 * 1024;
pub const READ_BUFFER: usize = 16 * 1024;

/// Opens a TCP connection from `source` (a loopback address of the spread) to `addr`.
pub async fn connect(
    addr: SocketAddr,
    source: Option<IpAddr>,
    receive_buffer: Option<u32>,
) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(bytes) = receive_buffer {
        // Before connect, so the advertised window is small from the first segment.
        socket.set_recv_buffer_size(bytes)?;
    }
    if let Some(source) = source {
        defer_port_choice(&socket)?;
        socket.bind(SocketAddr::new(source, 0))?;
    }
    let stream = socket.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// A connection to the server under test: plain TCP, or TLS over it (an `https://` target).
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// Connects to `endpoint` from `source`, with the TLS handshake when the endpoint asks for it.
pub async fn open(
    endpoint: &Endpoint,
    source: Option<IpAddr>,
    receive_buffer: Option<u32>,
) -> io::Result<Conn> {
    let stream = connect(endpoint.addr, source, receive_buffer).await?;
    match &endpoint.tls {
        None => Ok(Conn::Plain(stream)),
        Some(tls) => Ok(Conn::Tls(Box::new(
            tls.connector.connect(tls.name.clone(), stream).await?,
        ))),
    }
}

impl Conn {
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(stream) => stream,
            Conn::Tls(stream) => stream.get_ref().0,
        }
    }

    /// The TLS 1.3 or 1.2 suite and key exchange this connection negotiated, for the record.
    pub fn tls_parameters(&self) -> Option<String> {
        let Conn::Tls(stream) = self else {
            return None;
        };
        let session = stream.get_ref().1;
        Some(format!(
            "{:?} {:?} {:?}",
            session.protocol_version()?,
            session.negotiated_cipher_suite()?.suite(),
            session.negotiated_key_exchange_group()?.name(),
        ))
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Lets the kernel pick the source port at `connect` (`IP_BIND_ADDRESS_NO_PORT`), where only the
/// whole 4-tuple must be unique. A `bind` to port 0 must instead find a port unused by every
/// socket of that address, TIME_WAIT ones included: right after thousands of connections closed
/// (a storm) that search made the tool, not the server, the bottleneck, with one thread at 99 %
/// for seconds.
fn defer_port_choice(socket: &TcpSocket) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let on: libc::c_int = 1;
    // SAFETY: the option value is a c_int that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `TCP_ESTABLISHED` of linux/include/net/tcp_states.h (not exported by libc).
const TCP_ESTABLISHED: u8 = 1;

/// Whether the kernel still holds the connection as established. A client that never reads
/// learns of the server closing (or resetting) its stream only this way.
pub fn established(conn: &Conn) -> bool {
    use std::os::fd::AsRawFd;
    let stream = conn.tcp();
    // SAFETY: tcp_info is plain data; getsockopt writes at most `length` bytes into it.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut length = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let rc = libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut length,
        );
        rc == 0 && info.tcpi_state == TCP_ESTABLISHED
    }
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: u16,
    pub chunked: bool,
    pub content_length: Option<usize>,
}

/// Reads a response head; bytes after it stay in `buf`.
pub async fn read_head(stream: &mut Conn, buf: &mut Vec<u8>) -> io::Result<Head> {
    loop {
        if let Some(end) = memchr::memmem::find(buf, b"\r\n\r\n") {
            let head = parse_head(&buf[..end])?;
            buf.drain(..end + 4);
            return Ok(head);
        }
        if buf.len() > MAX_HEAD {
            return Err(invalid("response head longer than 16 KiB"));
        }
        fill(stream, buf, "closed before the response head").await?;
    }
}

fn parse_head(head: &[u8]) -> io::Result<Head> {
    let text = std::str::from_utf8(head).map_err(|_| invalid("response head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| invalid("no status line"))?;
    let mut chunked = false;
    let mut content_length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            content_length = value.parse().ok();
        }
    }
    Ok(Head {
        status,
        chunked,
        content_length,
    })
}

fn invalid(message: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.to_string())
}

/// Sends one request and reads the whole response (keep-alive connections of publishers and
/// the admin calls). Returns status and body.
pub async fn request(
    stream: &mut Conn,
    buf: &mut Vec<u8>,
    raw_request: &[u8],
) -> io::Result<(u16, Vec<u8>)> {
    stream.write_all(raw_request).await?;
    read_response(stream, buf).await
}

/// Reads one complete response with a `Content-Length` or chunked body.
pub async fn read_response(stream: &mut Conn, buf: &mut Vec<u8>) -> io::Result<(u16, Vec<u8>)> {
    let head = read_head(stream, buf).await?;
    let mut body = Vec::new();
    if head.chunked {
        let mut decoder = Dechunk::default();
        loop {
            let consumed = decoder
                .feed(buf, |bytes| body.extend_from_slice(bytes))
                .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
            buf.drain(..consumed);
            if decoder.finished() {
                return Ok((head.status, body));
            }
            fill(stream, buf, "closed inside a response").await?;
        }
    }
    let length = head.content_length.unwrap_or(0);
    while buf.len() < length {
        fill(stream, buf, "closed inside a response").await?;
    }
    body.extend(buf.drain(..length));
    Ok((head.status, body))
}

/// Appends one read to `buf`; the end of the stream is an error that says where it happened.
async fn fill(stream: &mut Conn, buf: &mut Vec<u8>, eof: &'static str) -> io::Result<()> {
    let mut chunk = [0u8; 4096];
    let n = stream.read(&mut chunk).await?;
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, eof));
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// What one SSE connection saw, besides the deliveries handed to the caller.
#[derive(Debug, Default, Clone)]
pub struct SseCounters {
    /// Events whose data is not a load-test payload (e.g. `resync`).
    pub foreign_events: u64,
    pub resyncs: u64,
    pub comments: u64,
    pub last_id: String,
    /// The last `retry:` value, and how many were seen.
    pub last_retry: Option<u64>,
    pub retries_seen: u64,
}

/// An SSE stream after its response head: a body decoder and a field parser that keeps only
/// what the scenarios need.
pub struct SseStream {
    pub stream: Conn,
    pending: Vec<u8>,
    dechunk: Option<Dechunk>,
    lines: Lines,
    event: PartialEvent,
    pub counters: SseCounters,
}

#[derive(Debug, Default)]
struct PartialEvent {
    delivery: Option<payload::Stamp>,
    has_data: bool,
    resync: bool,
}

/// Opens `GET path` as an event stream (with an `Authorization` header when one is given);
/// succeeds once the server answered 200.
pub async fn open_sse(
    endpoint: &Endpoint,
    source: Option<IpAddr>,
    path: &str,
    last_event_id: Option<&str>,
    authorization: Option<&str>,
    receive_buffer: Option<u32>,
) -> io::Result<SseStream> {
    let mut stream = open(endpoint, source, receive_buffer).await?;
    let mut request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nAccept: text/event-stream\r\n",
        endpoint.host
    );
    if let Some(id) = last_event_id {
        request.push_str("Last-Event-ID: ");
        request.push_str(id);
        request.push_str("\r\n");
    }
    if let Some(authorization) = authorization {
        request.push_str("Authorization: ");
        request.push_str(authorization);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut pending = Vec::with_capacity(1024);
    let head = read_head(&mut stream, &mut pending).await?;
    if head.status != 200 {
        return Err(io::Error::other(format!("status {}", head.status)));
    }
    Ok(SseStream {
        stream,
        pending,
        dechunk: head.chunked.then(Dechunk::default),
        lines: Lines::new(),
        event: PartialEvent::default(),
        counters: SseCounters::default(),
    })
}

impl SseStream {
    /// Reads once (or consumes what the head left over) and hands every complete load-test
    /// event to `deliver`. Returns `Ok(false)` when the server closed the stream.
    pub async fn read_events(
        &mut self,
        buf: &mut [u8],
        mut deliver: impl FnMut(payload::Stamp),
    ) -> io::Result<bool> {
        let n = if self.pending.is_empty() {
            let n = self.stream.read(buf).await?;
            if n == 0 {
                return Ok(false);
            }
            n
        } else {
            let n = self.pending.len().min(buf.len());
            buf[..n].copy_from_slice(&self.pending[..n]);
            self.pending.drain(..n);
            n
        };
        let input = &buf[..n];
        let Some(mut decoder) = self.dechunk.take() else {
            self.parse(input, &mut deliver);
            return Ok(true);
        };
        let fed = decoder.feed(input, |bytes| self.parse(bytes, &mut deliver));
        let open = !decoder.finished();
        self.dechunk = Some(decoder);
        fed.map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
        Ok(open)
    }

    fn parse(&mut self, bytes: &[u8], deliver: &mut impl FnMut(payload::Stamp)) {
        let (event, counters) = (&mut self.event, &mut self.counters);
        self.lines
            .feed(bytes, |line| event.line(line, counters, deliver));
    }
}

impl PartialEvent {
    /// Keeps of each line only what the scenarios count; hands a complete load-test event to
    /// `deliver`.
    fn line(
        &mut self,
        line: Line<'_>,
        counters: &mut SseCounters,
        deliver: &mut impl FnMut(payload::Stamp),
    ) {
        match line {
            Line::Dispatch => {
                let event = std::mem::take(self);
                if event.resync {
                    counters.resyncs += 1;
                }
                match event.delivery {
                    Some(stamp) if !event.resync => deliver(stamp),
                    _ if event.has_data => counters.foreign_events += 1,
                    _ => {}
                }
            }
            Line::Comment(_) => counters.comments += 1,
            Line::Field { name, value } => match name {
                b"data" => {
                    // A multi-line payload is never a load-test payload.
                    self.delivery = if self.has_data {
                        None
                    } else {
                        payload::Stamp::parse(value)
                    };
                    self.has_data = true;
                }
                b"id" => {
                    counters.last_id.clear();
                    counters.last_id.push_str(&String::from_utf8_lossy(value));
                }
                b"event" => self.resync = value == b"resync",
                b"retry" => {
                    if let Some(ms) = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok()) {
                        counters.last_retry = Some(ms);
                        counters.retries_seen += 1;
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

    #[test]
    fn head_parsing() {
        let head = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX: y").unwrap();
        assert_eq!(head.status, 200);
        assert!(head.chunked);
        let head = parse_head(b"HTTP/1.1 201 Created\r\ncontent-length: 12").unwrap();
        assert_eq!((head.status, head.content_length), (201, Some(12)));
        assert!(parse_head(b"garbage").is_err());
    }
}

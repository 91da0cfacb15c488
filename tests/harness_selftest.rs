//! Self-tests of the black-box harness pieces that do not need a running
//! hub: SSE and chunked decoding, Prometheus parsing, and the raw HTTP/SSE
//! clients against tiny in-test TCP servers.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use support::http::{self, ChunkedDecoder};
use support::metrics::Scrape;
use support::sse::{self, SseClient, SseDecoder, SseEvent, SseNext};

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(5);

fn ev(id: Option<&str>, event: &str, data: &str) -> SseEvent {
    SseEvent {
        id: id.map(str::to_string),
        event: event.to_string(),
        data: data.to_string(),
    }
}

/// A stream exercising every line ending, comments, retry, ids, named
/// events, multi-line data and a data-less block.
const MIXED_STREAM: &[u8] = b": ping\r\n\
retry: 2500\r\n\r\n\
id: 1\nevent: order\ndata: {\"a\":1}\n\n\
data: line one\rdata:line two\r\rid: 2\r\n\
data\r\ndata:  two spaces\r\n\r\n\
:no-space comment\n\
event: ignored-without-data\nid: 3\n\n\
data: after\n\n";

fn mixed_expected() -> Vec<SseEvent> {
    vec![
        ev(Some("1"), "order", "{\"a\":1}"),
        ev(None, "message", "line one\nline two"),
        ev(Some("2"), "message", "\n two spaces"),
        ev(None, "message", "after"),
    ]
}

fn decode_in_pieces(pieces: &[&[u8]]) -> (Vec<SseEvent>, SseDecoder) {
    let mut dec = SseDecoder::new();
    let events = pieces.iter().flat_map(|p| dec.feed(p)).collect();
    (events, dec)
}

/// The SSE decoder gives the same events however the bytes are split,
/// including between the CR and LF of a CRLF.
#[test]
fn sse_decoder_is_split_invariant() {
    for cut in 0..=MIXED_STREAM.len() {
        let (a, b) = MIXED_STREAM.split_at(cut);
        let (events, _) = decode_in_pieces(&[a, b]);
        assert_eq!(events, mixed_expected(), "split at byte {cut}");
    }
    let bytes: Vec<&[u8]> = MIXED_STREAM.chunks(1).collect();
    let (events, dec) = decode_in_pieces(&bytes);
    assert_eq!(events, mixed_expected(), "byte at a time");
    assert_eq!(dec.retry(), Some(2500));
    assert_eq!(dec.comments(), ["ping", "no-space comment"]);
    assert_eq!(
        dec.last_id(),
        Some("3"),
        "id in a data-less block still counts"
    );
}

/// A CR at the end of one read followed by LF at the start of the next is
/// one line ending, not an extra blank line that would split the event.
#[test]
fn sse_decoder_joins_crlf_across_feeds() {
    let mut dec = SseDecoder::new();
    assert!(dec.feed(b"data: a\r").is_empty());
    assert!(dec.feed(b"\ndata: b\r").is_empty());
    assert_eq!(dec.feed(b"\n\r\n"), vec![ev(None, "message", "a\nb")]);
}

/// Blocks without a data line are not dispatched, yet `retry` alone is
/// recorded and the event type does not leak into the next event.
#[test]
fn sse_decoder_skips_dataless_blocks() {
    let mut dec = SseDecoder::new();
    assert!(dec.feed(b"retry: 100\n\nevent: x\n\n").is_empty());
    assert_eq!(dec.retry(), Some(100));
    assert!(dec.feed(b"retry: soon\n\n").is_empty());
    assert_eq!(dec.retry(), Some(100), "non-numeric retry is ignored");
    assert_eq!(dec.feed(b"data: y\n\n"), vec![ev(None, "message", "y")]);
    assert!(dec.feed(b"data: unterminated\n").is_empty());
}

/// `last_id` follows the WHATWG carry-over rules (an empty `id:` resets it)
/// while each event reports only the id in its own block.
#[test]
fn sse_decoder_tracks_last_event_id() {
    let mut dec = SseDecoder::new();
    assert_eq!(dec.last_id(), None);
    let events = dec.feed(b"id: 7\ndata: a\n\ndata: b\n\nid\ndata: c\n\n");
    assert_eq!(
        events,
        vec![
            ev(Some("7"), "message", "a"),
            ev(None, "message", "b"),
            ev(Some(""), "message", "c"),
        ]
    );
    assert_eq!(dec.last_id(), None);
}

/// A UTF-8 byte-order mark at the start of the stream is not part of the
/// first field name.
#[test]
fn sse_decoder_strips_leading_bom() {
    let mut dec = SseDecoder::new();
    assert_eq!(
        dec.feed(b"\xEF\xBB\xBFdata: x\n\n"),
        vec![ev(None, "message", "x")]
    );
}

const CHUNKED: &[u8] =
    b"5;ext=1\r\nhello\r\n1A\r\n, abcdefghijklmnopqrstuvwx\r\n0\r\nX-Trailer: t\r\n\r\n";
const CHUNKED_PAYLOAD: &[u8] = b"hello, abcdefghijklmnopqrstuvwx";

/// The chunked decoder yields the payload (ignoring extensions and
/// trailers) for every split of the input and notices the last chunk.
#[test]
fn chunked_decoder_is_split_invariant() {
    for cut in 0..=CHUNKED.len() {
        let mut dec = ChunkedDecoder::new();
        let mut out = dec.feed(&CHUNKED[..cut]).unwrap();
        assert!(!dec.is_done() || cut == CHUNKED.len());
        out.extend(dec.feed(&CHUNKED[cut..]).unwrap());
        assert_eq!(out, CHUNKED_PAYLOAD, "split at byte {cut}");
        assert!(dec.is_done(), "split at byte {cut}");
    }
    let mut dec = ChunkedDecoder::new();
    let out: Vec<u8> = CHUNKED
        .iter()
        .flat_map(|b| dec.feed(std::slice::from_ref(b)).unwrap())
        .collect();
    assert_eq!(out, CHUNKED_PAYLOAD);
    assert!(dec.is_done());
}

/// Framing violations are reported rather than silently mis-decoded.
#[test]
fn chunked_decoder_rejects_bad_framing() {
    assert!(ChunkedDecoder::new().feed(b"zz\r\n").is_err());
    assert!(ChunkedDecoder::new().feed(b"2\r\nabc\r\n").is_err());
}

/// SSE carried in chunks split mid-event decodes as if it were contiguous.
#[test]
fn chunked_then_sse_decoding_composes() {
    let body = b"data: one\n\nid: 2\ndata: t";
    let body2 = b"wo\n\n";
    let mut wire = format!("{:x}\r\n", body.len()).into_bytes();
    wire.extend_from_slice(body);
    wire.extend_from_slice(format!("\r\n{:x}\r\n", body2.len()).as_bytes());
    wire.extend_from_slice(body2);
    wire.extend_from_slice(b"\r\n0\r\n\r\n");

    let mut chunked = ChunkedDecoder::new();
    let mut sse = SseDecoder::new();
    let mut events = Vec::new();
    for piece in wire.chunks(3) {
        events.extend(sse.feed(&chunked.feed(piece).unwrap()));
    }
    assert_eq!(
        events,
        vec![ev(None, "message", "one"), ev(Some("2"), "message", "two")]
    );
}

const METRICS: &str = r#"# HELP posthorn_events_total Events published.
# TYPE posthorn_events_total counter
posthorn_events_total{topic="a",source="http"} 3
posthorn_events_total{topic="b",source="http"} 4
posthorn_events_total{topic="a",source="redis"} 5 1700000000000
# HELP posthorn_subscribers Connected subscribers.
# TYPE posthorn_subscribers gauge
posthorn_subscribers 2
# TYPE posthorn_latency_seconds histogram
posthorn_latency_seconds_bucket{le="0.1"} 1
posthorn_latency_seconds_bucket{le="+Inf"} 9
posthorn_label_escapes{path="a\"b\\c\nd", empty=""} 1.5e3
"#;

/// Label-subset lookups sum every matching sample, and HELP/TYPE lines and
/// escaped label values are understood.
#[test]
fn prometheus_parser_matches_label_subsets() {
    let s = Scrape::parse(METRICS);
    assert_eq!(s.value("posthorn_events_total", &[]), Some(12.0));
    assert_eq!(
        s.value("posthorn_events_total", &[("topic", "a")]),
        Some(8.0)
    );
    assert_eq!(
        s.value(
            "posthorn_events_total",
            &[("topic", "a"), ("source", "http")]
        ),
        Some(3.0)
    );
    assert_eq!(s.value("posthorn_events_total", &[("topic", "zz")]), None);
    assert_eq!(s.value("posthorn_subscribers", &[]), Some(2.0));
    assert_eq!(s.value("posthorn_missing", &[]), None);
    assert_eq!(s.value_or_zero("posthorn_missing", &[]), 0.0);
    assert_eq!(
        s.value("posthorn_latency_seconds_bucket", &[("le", "+Inf")]),
        Some(9.0)
    );
    assert_eq!(
        s.value(
            "posthorn_label_escapes",
            &[("path", "a\"b\\c\nd"), ("empty", "")]
        ),
        Some(1500.0)
    );
    assert!(s.has_help("posthorn_events_total"));
    assert!(s.has_help("posthorn_subscribers"));
    assert!(!s.has_help("posthorn_latency_seconds"));
    assert_eq!(s.metric_type("posthorn_latency_seconds"), Some("histogram"));
    assert_eq!(
        s.help("posthorn_subscribers"),
        Some("Connected subscribers.")
    );
    assert_eq!(s.text, METRICS);
}

/// Accepts one connection, reads one request (head plus Content-Length
/// body) and hands its bytes back at once, then writes `pieces` with pauses
/// so the client sees split reads. With `hold_open` it then keeps the
/// socket open instead of closing it.
fn serve_once(pieces: Vec<Vec<u8>>, hold_open: bool) -> (SocketAddr, oneshot::Receiver<Vec<u8>>) {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let addr = std_listener.local_addr().unwrap();
    let listener = TcpListener::from_std(std_listener).unwrap();
    let (req_tx, req_rx) = oneshot::channel();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut req = Vec::new();
        let mut buf = [0u8; 4096];
        let head_end = loop {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "client closed before sending a request");
            req.extend_from_slice(&buf[..n]);
            if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        let head = String::from_utf8_lossy(&req[..head_end]).to_ascii_lowercase();
        let body_len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap())
            .unwrap_or(0);
        while req.len() < head_end + body_len {
            let n = sock.read(&mut buf).await.unwrap();
            req.extend_from_slice(&buf[..n]);
        }
        let _ = req_tx.send(req);
        for piece in pieces {
            sock.write_all(&piece).await.unwrap();
            sock.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        if hold_open {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
    });
    (addr, req_rx)
}

fn bytes(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// A Content-Length body is read exactly, headers come back lowercased,
/// and requests carry `Connection: close`.
#[tokio::test]
async fn http_client_reads_content_length_body() {
    let (addr, server) = serve_once(
        vec![
            bytes("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Mixed-Case: Yes\r\nContent-Len"),
            bytes("gth: 11\r\n\r\n{\"ok\":"),
            bytes("true}"),
        ],
        true,
    );
    let resp = http::get(addr, "/status?x=1").await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("x-mixed-case"), Some("Yes"));
    assert_eq!(resp.header("X-MIXED-CASE"), Some("Yes"));
    assert!(resp.headers.iter().any(|(n, _)| n == "content-type"));
    assert_eq!(resp.json(), serde_json::json!({ "ok": true }));
    let req = String::from_utf8(server.await.unwrap()).unwrap();
    assert!(req.starts_with("GET /status?x=1 HTTP/1.1\r\n"), "{req}");
    assert!(req.contains("Connection: close\r\n"), "{req}");
    assert!(req.contains(&format!("Host: {addr}\r\n")), "{req}");
}

/// A chunked body is de-chunked, and an interim 100 Continue is skipped.
#[tokio::test]
async fn http_client_reads_chunked_body() {
    let (addr, server) = serve_once(
        vec![
            bytes("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"),
            bytes("4\r\nab"),
            bytes("cd\r\n3\r\nefg\r\n"),
            bytes("0\r\n\r\n"),
        ],
        true,
    );
    let payload = serde_json::json!({ "topic": "t", "n": 1 });
    let resp = http::post_json(addr, "/publish", &payload).await;
    assert_eq!(resp.status, 201);
    assert_eq!(resp.body, b"abcdefg");
    let req = server.await.unwrap();
    let text = String::from_utf8(req).unwrap();
    let body = serde_json::to_string(&payload).unwrap();
    assert!(text.starts_with("POST /publish HTTP/1.1\r\n"), "{text}");
    assert!(
        text.contains("Content-Type: application/json\r\n"),
        "{text}"
    );
    assert!(
        text.contains(&format!("Content-Length: {}\r\n", body.len())),
        "{text}"
    );
    assert!(text.ends_with(&format!("\r\n\r\n{body}")), "{text}");
}

/// Without Content-Length or chunking, the body runs to EOF; HEAD-like
/// statuses such as 204 have no body at all.
#[tokio::test]
async fn http_client_reads_to_eof_and_handles_empty_bodies() {
    let (addr, _server) = serve_once(
        vec![
            bytes("HTTP/1.1 503 Service Unavailable\r\n\r\nbusy"),
            bytes(" now"),
        ],
        false,
    );
    let resp = http::post_raw(addr, "/x", "text/plain", b"hi").await;
    assert_eq!((resp.status, resp.text().as_str()), (503, "busy now"));

    let (addr, _server) = serve_once(vec![bytes("HTTP/1.1 204 No Content\r\n\r\n")], true);
    let resp = http::get(addr, "/").await;
    assert_eq!(resp.status, 204);
    assert!(resp.body.is_empty());
}

/// A silent server yields a `TimedOut` error from `try_request` instead of
/// hanging the test.
#[tokio::test]
async fn http_try_request_times_out() {
    let (addr, _server) = serve_once(vec![], true);
    let err = http::try_request(addr, "GET", "/", &[], None, SHORT)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
}

/// The SSE client undoes chunking, exposes status and headers, reports
/// Timeout while the stream is idle and Closed after the last chunk.
#[tokio::test]
async fn sse_client_reads_chunked_stream() {
    // Chunk boundaries fall mid-line and mid-field; the wire is then cut
    // into reads that also ignore chunk boundaries.
    let mut wire = bytes(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    for chunk in [
        "retry: 1000\n: ping\nid: 4",
        "2\n",
        "data: first\ndata:",
        " two\n\n",
        "event: bye\ndata: \n\n",
    ] {
        wire.extend(format!("{:x}\r\n{chunk}\r\n", chunk.len()).into_bytes());
    }
    wire.extend(b"0\r\n\r\n");
    let (addr, server) = serve_once(wire.chunks(7).map(<[u8]>::to_vec).collect(), false);
    let mut client = SseClient::connect(addr, "/sse?topics=a", &[("Last-Event-ID", "3")]).await;
    assert_eq!(client.status(), 200);
    assert_eq!(client.header("Content-Type"), Some("text/event-stream"));
    assert_eq!(
        client.expect_event(LONG).await,
        ev(Some("42"), "message", "first\ntwo")
    );
    assert_eq!(client.retry, Some(1000));
    assert_eq!(client.comments, ["ping"]);
    assert_eq!(client.last_id(), Some("42"));
    assert_eq!(
        client.next_event(LONG).await,
        SseNext::Event(ev(None, "bye", ""))
    );
    assert_eq!(client.next_event(LONG).await, SseNext::Closed);
    assert!(client.body_complete());
    assert_eq!(
        client.raw_text(),
        "retry: 1000\n: ping\nid: 42\ndata: first\ndata: two\n\nevent: bye\ndata: \n\n"
    );
    let req = String::from_utf8(server.await.unwrap()).unwrap();
    assert!(req.contains("Accept: text/event-stream\r\n"), "{req}");
    assert!(req.contains("Last-Event-ID: 3\r\n"), "{req}");
}

/// An idle but open stream gives Timeout, not Closed.
#[tokio::test]
async fn sse_client_times_out_on_idle_stream() {
    let (addr, _server) = serve_once(
        vec![bytes(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        )],
        true,
    );
    let mut client = SseClient::connect(addr, "/sse", &[]).await;
    assert_eq!(client.next_event(SHORT).await, SseNext::Timeout);
    assert!(!client.wait_closed(SHORT).await);
}

/// A non-SSE error answer is readable through the same client.
#[tokio::test]
async fn sse_client_exposes_error_responses() {
    let (addr, _server) = serve_once(
        vec![bytes(
            "HTTP/1.1 429 Too Many Requests\r\ncontent-length: 9\r\nretry-after: 1\r\n\r\ntoo many\n",
        )],
        true,
    );
    let mut client = SseClient::connect(addr, "/sse", &[]).await;
    assert_eq!(client.status(), 429);
    assert_eq!(client.header("retry-after"), Some("1"));
    assert!(client.read_to_close(LONG).await.is_empty());
    assert_eq!(client.raw_text(), "too many\n");
}

/// `is_closed_within` tells a server that hung up from one that stays
/// silent, and the never-reading socket still sends its request.
#[tokio::test]
async fn raw_socket_close_detection() {
    let (addr, server) = serve_once(vec![bytes("HTTP/1.1 200 OK\r\n\r\n")], false);
    let mut stream = SseClient::connect_raw_never_read(addr, "/sse?topics=slow").await;
    let req = String::from_utf8(server.await.unwrap()).unwrap();
    assert!(
        req.starts_with("GET /sse?topics=slow HTTP/1.1\r\n"),
        "{req}"
    );
    assert!(sse::is_closed_within(&mut stream, LONG).await);

    let (addr, _server) = serve_once(vec![], true);
    let mut stream = SseClient::connect_raw_never_read(addr, "/sse").await;
    assert!(!sse::is_closed_within(&mut stream, SHORT).await);
}

/// `free_port` returns a port that can be bound right away.
#[test]
fn free_port_is_bindable() {
    let port = support::free_port();
    assert_ne!(port, 0);
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("port from free_port is bindable");
}

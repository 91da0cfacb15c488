//! Black-box tests of `GET /v1/devices/{device}/events` (docs/http-api.md) on the memory backend:
//! headers and prelude, framing, heartbeats, takeover and limits. Resume, resync and broadcast,
//! which every backend must do alike, are the conformance suite's (tests/conformance/).

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{http, metrics, stream_path, Hub, SseClient, SseNext};

const WAIT: Duration = Duration::from_secs(10);

/// Publishes one event and returns the id the hub answered with.
async fn publish(hub: &Hub, event: Value) -> String {
    let response = http::post_json(hub.addr(), "/v1/events", &event).await;
    assert_eq!(response.status, 201, "{}", response.text());
    response.json()["results"][0]["id"]
        .as_str()
        .expect("id")
        .to_string()
}

async fn publish_to(hub: &Hub, device: &str, data: &str) -> String {
    publish(
        hub,
        json!({ "device": device, "type": "test", "data": data }),
    )
    .await
}

/// The stream answers 200 with the documented headers and flushes `retry:` and a comment before any
/// event exists, so a client knows at once that it is connected.
#[tokio::test]
async fn stream_opens_with_headers_and_an_immediate_prelude() {
    let hub = Hub::builder().start().await;
    let mut client = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[]).await;
    assert_eq!(client.status(), 200);
    assert_eq!(client.header("content-type"), Some("text/event-stream"));
    assert_eq!(client.header("cache-control"), Some("no-cache"));
    assert_eq!(client.header("x-accel-buffering"), Some("no"));
    assert!(matches!(
        client.next_event(Duration::from_millis(700)).await,
        SseNext::Timeout
    ));
    assert_eq!(client.retry, Some(3000));
    assert!(
        !client.comments.is_empty(),
        "a comment line must be flushed at once"
    );
    assert!(
        client.raw_text().starts_with("retry: 3000\n"),
        "{:?}",
        client.raw_text()
    );
}

/// Live events arrive in order with the id, type and data that publishing reported, and payload
/// line breaks (CR, LF, CRLF) come back as LF lines that cannot inject fields.
#[tokio::test]
async fn live_events_carry_published_ids_and_safe_multiline_data() {
    let hub = Hub::builder().start().await;
    let mut client = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[]).await;
    let first = publish_to(&hub, "pos-1", "one").await;
    let hostile = "a\r\nb\rc\nid: forged\nevent: resync\n\ndata: x";
    let second = publish_to(&hub, "pos-1", hostile).await;
    let events = client.expect_events(2, WAIT).await;
    assert_eq!(events[0].id.as_deref(), Some(first.as_str()));
    assert_eq!(
        (events[0].event.as_str(), events[0].data.as_str()),
        ("test", "one")
    );
    assert_eq!(events[1].id.as_deref(), Some(second.as_str()));
    assert_eq!(events[1].event, "test");
    assert_eq!(
        events[1].data,
        "a\nb\nc\nid: forged\nevent: resync\n\ndata: x"
    );
}

/// A client that has read the response head gets an event published right after it, even when
/// hundreds connect at once and the Router's mailbox is busy: the hub queues the registration
/// ahead of any later event before it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_published_right_after_the_head_is_never_missed() {
    let hub = std::sync::Arc::new(Hub::builder().start().await);
    let clients: Vec<_> = (0..200)
        .map(|i| {
            let hub = hub.clone();
            tokio::spawn(async move {
                let device = format!("burst-{i}");
                let mut client = SseClient::connect(hub.addr(), &stream_path(&device), &[]).await;
                assert_eq!(client.status(), 200, "{device}");
                let id = publish_to(&hub, &device, "right after").await;
                let events = client.expect_events(1, WAIT).await;
                assert_eq!(events[0].id.as_deref(), Some(id.as_str()), "{device}");
            })
        })
        .collect();
    for client in clients {
        client.await.expect("client task");
    }
}

/// Heartbeats are `: ping` comments at the configured interval, never carrying an id.
#[tokio::test]
async fn heartbeats_are_ping_comments_without_ids() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__HEARTBEAT", "200ms")
        .start()
        .await;
    let mut client = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[]).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while client
        .comments
        .iter()
        .filter(|c| c.as_str() == "ping")
        .count()
        < 3
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no pings: {:?}",
            client.raw_text()
        );
        assert!(matches!(
            client.next_event(Duration::from_millis(100)).await,
            SseNext::Timeout
        ));
    }
    assert!(
        !client.raw_text().contains("id:"),
        "{:?}",
        client.raw_text()
    );
    let scrape = metrics::scrape(hub.addr()).await;
    assert!(scrape.value("sse_heartbeats_sent_total", &[]).unwrap() >= 3.0);
}

/// A second connection for the same device replaces the first, which is closed and counted.
#[tokio::test]
async fn second_connection_for_a_device_takes_over() {
    let hub = Hub::builder().start().await;
    let mut first = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[]).await;
    let mut second = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[]).await;
    assert!(
        first.wait_closed(WAIT).await,
        "the replaced connection must be closed"
    );
    publish_to(&hub, "pos-1", "to the newest").await;
    assert_eq!(second.expect_event(WAIT).await.data, "to the newest");
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("sse_connections_closed_total", &[("reason", "takeover")]),
        Some(1.0)
    );
    assert_eq!(scrape.value("sse_connections", &[]), Some(1.0));
}

/// Invalid device ids are refused with 400 and a JSON error naming the problem.
#[tokio::test]
async fn invalid_device_ids_are_rejected() {
    let hub = Hub::builder().start().await;
    let long = "a".repeat(129);
    for path_device in [
        "a%20b",
        "%2A",
        "k%C3%A9",
        "a%0Ab",
        "a%0Db",
        long.as_str(),
        "a:b%2Fc",
    ] {
        let response = http::get(hub.addr(), &stream_path(path_device)).await;
        assert_eq!(response.status, 400, "{path_device}: {}", response.text());
        let body = response.json();
        assert_eq!(body["error"], "invalid_device", "{body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("invalid device id"),
            "{body}"
        );
    }
    let ok = "a".repeat(128);
    let client = SseClient::connect(hub.addr(), &stream_path(&ok), &[]).await;
    assert_eq!(client.status(), 200);
}

/// Every chunk of a stream is framed as RFC 9112 writes it, with the size in upper-case hex
/// without leading zeros: the hub writes chunk sizes by hand (a patch to the vendored
/// actix-http), so sizes of two to four hex digits are checked against `{:X}` on the raw bytes.
/// The last event is small and follows one of 60 KB: after writing that, the connection's write
/// buffer is released (patch 6), and the stream goes on in a new one.
#[tokio::test]
async fn chunk_sizes_are_canonical_hex_on_the_wire() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let hub = Hub::builder().start().await;
    let mut socket = tokio::net::TcpStream::connect(hub.addr()).await.unwrap();
    let request = http::encode_request(hub.addr(), "GET", &stream_path("pos-1"), &[], None);
    socket.write_all(&request).await.unwrap();
    let mut wire = Vec::new();
    let head = http::read_head(&mut socket, &mut wire).await.unwrap();
    assert_eq!(head.status, 200);

    // The prelude (24 bytes) is a chunk of its own; frames of tens of bytes up to 60 KB follow.
    let sizes = [1usize, 200, 3_000, 60_000, 100];
    let data_of = |index: usize| format!("{index}{}", "x".repeat(sizes[index] - 1));
    for index in 0..4 {
        publish_to(&hub, "pos-1", &data_of(index)).await;
    }
    let mut last_published = false;
    let mut payload = Vec::new();
    let mut chunk_sizes = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Take every complete chunk off the front of `wire`.
        while let Some(line_end) = wire.windows(2).position(|pair| pair == b"\r\n") {
            let line = std::str::from_utf8(&wire[..line_end]).expect("ASCII size line");
            let size = usize::from_str_radix(line, 16).expect("a bare hex size");
            assert_eq!(line, format!("{size:X}"), "chunk size line {line:?}");
            let end = line_end + 2 + size + 2;
            if wire.len() < end {
                break;
            }
            assert_eq!(
                &wire[end - 2..end],
                b"\r\n",
                "chunk of {size} bytes not closed"
            );
            payload.extend_from_slice(&wire[line_end + 2..end - 2]);
            chunk_sizes.push(size);
            wire.drain(..end);
        }
        let text = String::from_utf8_lossy(&payload);
        if text.contains(&format!("data: {}\n", data_of(4))) {
            break;
        }
        if !last_published && text.contains(&format!("data: {}\n", data_of(3))) {
            publish_to(&hub, "pos-1", &data_of(4)).await;
            last_published = true;
        }
        let n = tokio::time::timeout_at(deadline, socket.read(&mut buf))
            .await
            .expect("every event within the wait")
            .unwrap();
        assert!(n > 0, "the stream ended");
        wire.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&payload);
    for (index, size) in sizes.iter().enumerate() {
        assert!(
            text.contains(&format!("data: {}\n", data_of(index))),
            "event {index} of {size} bytes missing"
        );
    }
    assert!(
        chunk_sizes.iter().any(|&size| size < 0x100)
            && chunk_sizes.iter().any(|&size| size >= 0x1000),
        "no two-digit or no four-digit chunk among {chunk_sizes:?}"
    );
}

/// A query string that does not parse (here a repeated `last_event_id`) is a 400 JSON error.
#[tokio::test]
async fn a_malformed_query_string_is_rejected() {
    let hub = Hub::builder().start().await;
    let path = format!("{}?last_event_id=a&last_event_id=b", stream_path("pos-1"));
    let response = http::get(hub.addr(), &path).await;
    assert_eq!(response.status, 400, "{}", response.text());
    let body = response.json();
    assert_eq!(body["error"], "invalid_request", "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("invalid query string"),
        "{body}"
    );
}

/// A device id in the path is percent-decoded (RFC 3986: `%2D` is `-`), so an escaped id opens
/// the stream of the same device.
#[tokio::test]
async fn an_escaped_device_id_is_the_same_device() {
    let hub = Hub::builder().start().await;
    let mut client = SseClient::connect(hub.addr(), &stream_path("pos%2D1"), &[]).await;
    assert_eq!(client.status(), 200);
    let id = publish_to(&hub, "pos-1", "escaped").await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(event.id.as_deref(), Some(id.as_str()));
    assert_eq!(event.data, "escaped");
}

/// Beyond `limits.max_connections` new streams get 503 with Retry-After while existing ones keep
/// working, and a closed stream frees its slot.
#[tokio::test]
async fn connection_limit_refuses_extra_streams_only() {
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_CONNECTIONS", "2")
        .start()
        .await;
    let mut first = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[]).await;
    let second = SseClient::connect(hub.addr(), &stream_path("pos-2"), &[]).await;
    let refused = http::get(hub.addr(), &stream_path("pos-3")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json()["error"], "too_many_connections");
    assert!(refused.header("retry-after").is_some());
    publish_to(&hub, "pos-1", "still served").await;
    assert_eq!(first.expect_event(WAIT).await.data, "still served");

    drop(second);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let client = SseClient::connect(hub.addr(), &stream_path("pos-3"), &[]).await;
        if client.status() == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "slot was never released"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An empty payload is valid text: it is accepted and arrives as an event with empty data (a
/// `data:` line with nothing after it is still dispatched by WHATWG parsers).
#[tokio::test]
async fn empty_payload_is_delivered() {
    let hub = Hub::builder().start().await;
    let mut client = SseClient::connect(hub.addr(), &stream_path("pos-1"), &[]).await;
    let id = publish_to(&hub, "pos-1", "").await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(
        (event.id.as_deref(), event.data.as_str()),
        (Some(id.as_str()), "")
    );
}

/// Opens a connection and sends `request` 100 bytes at a time with a pause after each piece (and
/// `TCP_NODELAY`), so the pieces most likely arrive, and are read, one by one. Returns the socket,
/// the response head and the bytes read after it.
async fn request_in_pieces(
    hub: &Hub,
    request: &[u8],
) -> (tokio::net::TcpStream, http::ResponseHead, Vec<u8>) {
    use tokio::io::AsyncWriteExt;

    let mut socket = tokio::net::TcpStream::connect(hub.addr()).await.unwrap();
    socket.set_nodelay(true).unwrap();
    for piece in request.chunks(100) {
        socket.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut after_head = Vec::new();
    let head = tokio::time::timeout(WAIT, http::read_head(&mut socket, &mut after_head))
        .await
        .expect("a response head within the wait")
        .unwrap();
    (socket, head, after_head)
}

/// Requests that arrive in small pieces and outgrow a connection's first read buffer are read
/// whole. The vendored actix-http starts that buffer at 1 KiB and grows it only when nearly full
/// (patch 5 in vendor/actix-http/POSTHORN-PATCH.md), so these requests are read into a buffer
/// that is grown between reads, each time partly filled. A stream request with a 3 KiB header
/// and a 20 KiB publish, each sent 100 bytes at a time, are answered, and the event arrives
/// whole on the stream. (A dispatcher that stopped reading once it held 2,000 bytes failed it.)
#[tokio::test]
async fn requests_arriving_in_pieces_beyond_the_first_read_buffer_are_read_whole() {
    use tokio::io::AsyncReadExt;

    let hub = Hub::builder().start().await;
    let padding = "p".repeat(3 * 1024);
    let request = http::encode_request(
        hub.addr(),
        "GET",
        &stream_path("pos-pieces"),
        &[("Accept", "text/event-stream"), ("X-Padding", &padding)],
        None,
    );
    let (mut stream, head, wire) = request_in_pieces(&hub, &request).await;
    assert_eq!(head.status, 200);

    let data = "d".repeat(20 * 1024);
    let body = serde_json::to_vec(&json!({ "device": "pos-pieces", "data": data })).unwrap();
    let request = http::encode_request(
        hub.addr(),
        "POST",
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Connection", "close"),
        ],
        Some(&body),
    );
    let (_publisher, published, _) = request_in_pieces(&hub, &request).await;
    assert_eq!(published.status, 201);

    let mut framing = http::BodyFraming::for_response("GET", &head).unwrap();
    let mut payload = Vec::new();
    framing.decode(&wire, &mut payload).unwrap();
    let expected = format!("data: {data}\n");
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut buf = vec![0u8; 64 * 1024];
    while !String::from_utf8_lossy(&payload).contains(&expected) {
        let n = tokio::time::timeout_at(deadline, stream.read(&mut buf))
            .await
            .expect("the event within the wait")
            .unwrap();
        assert!(n > 0, "the stream ended");
        framing.decode(&buf[..n], &mut payload).unwrap();
    }
}

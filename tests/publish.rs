//! Black-box tests of `POST /v1/events` (docs/http-api.md, docs/stream-format.md): the answer's
//! shape, validation errors, limits, CORS and the publish metrics. Batches, broadcasts and
//! idempotency, which every backend must store and deliver alike, are the conformance suite's
//! (tests/conformance/).

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::http::{self, HttpResponse};
use support::{live_stream, metrics, stream_path, Hub, SseClient, SseEvent, SseNext};

/// Failure guard for anything the hub should do "at once".
const WAIT: Duration = Duration::from_secs(10);

async fn publish(hub: &Hub, body: &Value) -> HttpResponse {
    http::post_json(hub.addr(), "/v1/events", body).await
}

async fn publish_raw(hub: &Hub, body: &str) -> HttpResponse {
    http::post_raw(
        hub.addr(),
        "/v1/events",
        "application/json",
        body.as_bytes(),
    )
    .await
}

/// Asserts a 201 and returns `(id, duplicate)` per result, checking the body has exactly the
/// documented shape.
fn results(resp: &HttpResponse) -> Vec<(String, bool)> {
    assert_eq!(
        resp.status,
        201,
        "publish answered {}: {}",
        resp.status,
        resp.text()
    );
    let body = resp.json();
    let object = body.as_object().expect("publish answer is an object");
    assert_eq!(object.len(), 1, "only `results` in {body}");
    body["results"]
        .as_array()
        .unwrap_or_else(|| panic!("no results array in {body}"))
        .iter()
        .map(|r| {
            assert_eq!(r.as_object().map(|o| o.len()), Some(2), "result {r}");
            let id = r["id"].as_str().unwrap_or_else(|| panic!("id in {r}"));
            assert!(!id.is_empty(), "empty id in {r}");
            let dup = r["duplicate"]
                .as_bool()
                .unwrap_or_else(|| panic!("duplicate in {r}"));
            (id.to_string(), dup)
        })
        .collect()
}

async fn publish_ok(hub: &Hub, body: &Value) -> Vec<(String, bool)> {
    results(&publish(hub, body).await)
}

/// Asserts an error answer: status, `error` code, and that `message` contains every needle.
/// Returns the JSON body for further checks.
fn assert_error(resp: &HttpResponse, status: u16, code: &str, message_has: &[&str]) -> Value {
    assert_eq!(resp.status, status, "answer: {}", resp.text());
    let content_type = resp.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("application/json"),
        "error content-type {content_type:?}"
    );
    let body = resp.json();
    assert_eq!(body["error"], code, "error code in {body}");
    let message = body["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no message in {body}"));
    for needle in message_has {
        assert!(
            message.contains(needle),
            "message {message:?} does not mention {needle:?}"
        );
    }
    body
}

/// Asserts a 400 for item `index` of a batch, naming `field`.
fn assert_item_error(resp: &HttpResponse, index: usize, field: &str) -> Value {
    let item = format!("item {index}");
    let body = assert_error(resp, 400, "invalid_request", &[&item, field]);
    assert_eq!(body["index"], index, "index in {body}");
    assert_eq!(body["field"], field, "field in {body}");
    body
}

/// Publishes a marker to `device` and asserts it is the very next event on `client`: proof
/// that nothing else (a duplicate, a rejected item) was delivered before it.
async fn assert_next_is_marker(hub: &Hub, client: &mut SseClient, device: &str, marker: &str) {
    let id = publish_ok(
        hub,
        &json!({"device": device, "type": "marker", "data": marker}),
    )
    .await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(
        event,
        SseEvent {
            id: Some(id[0].0.clone()),
            event: "marker".into(),
            data: marker.into(),
        },
        "expected the marker as the next event on {device}"
    );
}

/// A single event object is answered 201 with one result, and that result's id is the `id:`
/// the device's stream shows for the event, with the published type and data.
#[tokio::test]
async fn single_event_id_matches_stream_id() {
    let hub = Hub::builder().start().await;
    let mut client = live_stream(&hub, "pos-17").await;

    let resp = publish(
        &hub,
        &json!({"device": "pos-17", "type": "order.paid", "data": "paid 12.50"}),
    )
    .await;
    let results = results(&resp);
    assert_eq!(results.len(), 1);
    let (id, duplicate) = &results[0];
    assert!(!duplicate);
    assert_eq!(
        resp.json(),
        json!({"results": [{"id": id, "duplicate": false}]})
    );

    let event = client.expect_event(WAIT).await;
    assert_eq!(
        event,
        SseEvent {
            id: Some(id.clone()),
            event: "order.paid".into(),
            data: "paid 12.50".into(),
        }
    );
}

/// Without `type` the event is a `message`, and line breaks in a string payload arrive as
/// several `data:` lines read back with LF.
#[tokio::test]
async fn default_type_and_multiline_data() {
    let hub = Hub::builder().start().await;
    let mut client = live_stream(&hub, "pos-2").await;
    let ids = publish_ok(&hub, &json!({"device": "pos-2", "data": "a\r\nb\rc\nd"})).await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(
        event,
        SseEvent {
            id: Some(ids[0].0.clone()),
            event: "message".into(),
            data: "a\nb\nc\nd".into(),
        }
    );
    assert!(
        client
            .raw_text()
            .contains("data: a\ndata: b\ndata: c\ndata: d\n\n"),
        "{:?}",
        client.raw_text()
    );
}

/// A device id of exactly 128 characters from the whole alphabet is accepted and delivered.
#[tokio::test]
async fn longest_device_id_is_accepted() {
    let hub = Hub::builder().start().await;
    let device = format!("Az09._:-{}", "x".repeat(120));
    assert_eq!(device.len(), 128);
    let mut client = live_stream(&hub, &device).await;
    let ids = publish_ok(&hub, &json!({"device": device, "data": "edge"})).await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(event.id.as_deref(), Some(ids[0].0.as_str()));
    assert_eq!(event.data, "edge");
}

/// Bodies that are not JSON, not an object or array, or an empty array are 400 with the
/// documented codes.
#[tokio::test]
async fn malformed_and_non_object_bodies_are_rejected() {
    let hub = Hub::builder().start().await;

    let resp = publish_raw(&hub, r#"{"device": "pos-1", "data": "#).await;
    assert_error(&resp, 400, "malformed_json", &[]);
    let resp = publish_raw(&hub, "not json").await;
    assert_error(&resp, 400, "malformed_json", &[]);

    let resp = publish_raw(&hub, "42").await;
    assert_error(&resp, 400, "invalid_request", &["object"]);
    let resp = publish_raw(&hub, r#""text""#).await;
    assert_error(&resp, 400, "invalid_request", &["object"]);

    let resp = publish_raw(&hub, "[]").await;
    assert_error(&resp, 400, "invalid_request", &["empty"]);
}

/// A batch item that is not an object is 400 naming the item, with `index` like every other
/// per-item error.
#[tokio::test]
async fn non_object_item_is_rejected_with_its_index() {
    let hub = Hub::builder().start().await;
    let resp = publish(&hub, &json!([{"device": "pos-1", "data": "x"}, 5])).await;
    let body = assert_error(&resp, 400, "invalid_request", &["item 1", "object"]);
    assert_eq!(body["index"], 1, "index in {body}");
}

/// Unknown fields, a missing or empty `data`, a bad `type`, a broadcast with a device, a
/// non-string `key` and a non-boolean `broadcast` are 400 naming the item index and field.
#[tokio::test]
async fn invalid_fields_name_index_and_field() {
    let hub = Hub::builder().start().await;
    let ok = json!({"device": "pos-1", "data": "fine"});

    let resp = publish(
        &hub,
        &json!([ok, {"device": "pos-1", "data": "x", "extra": 1}]),
    )
    .await;
    let body = assert_error(&resp, 400, "invalid_request", &["item 1", "\"extra\""]);
    assert_eq!(body["index"], 1, "{body}");

    let resp = publish(&hub, &json!([ok, {"device": "pos-1", "type": "t"}])).await;
    assert_item_error(&resp, 1, "data");

    for bad_type in ["bad type", "", "é", &"t".repeat(65)] {
        let resp = publish(
            &hub,
            &json!([ok, {"device": "pos-1", "type": bad_type, "data": "x"}]),
        )
        .await;
        assert_item_error(&resp, 1, "type");
    }

    let resp = publish(
        &hub,
        &json!([ok, {"broadcast": true, "device": "pos-1", "data": "x"}]),
    )
    .await;
    assert_item_error(&resp, 1, "device");

    let resp = publish(&hub, &json!([ok, {"data": "x"}])).await;
    assert_item_error(&resp, 1, "device");

    let resp = publish(
        &hub,
        &json!([ok, {"device": "pos-1", "data": "x", "key": 5}]),
    )
    .await;
    assert_item_error(&resp, 1, "key");

    let resp = publish(&hub, &json!([ok, {"broadcast": "yes", "data": "x"}])).await;
    assert_item_error(&resp, 1, "broadcast");

    // A single object (not an array) has no index, but still names the field.
    let resp = publish(
        &hub,
        &json!({"device": "pos-1", "type": "a b", "data": "x"}),
    )
    .await;
    let body = assert_error(&resp, 400, "invalid_request", &["type"]);
    assert_eq!(body["field"], "type");
    assert!(body.get("index").is_none(), "{body}");
}

/// A `ttl` beyond the longest duration (36500d) is refused and stores nothing. Regression: a
/// ttl of `18446744073709552s` wrapped around in the conversion to milliseconds and was accepted
/// with an expiry 384 ms away, so an acknowledged event was silently never delivered. The
/// longest ttl is accepted and its event delivered.
#[tokio::test]
async fn a_ttl_beyond_the_longest_duration_is_refused() {
    let hub = Hub::builder().start().await;
    let mut client = live_stream(&hub, "pos-ttl").await;
    let ok = json!({"device": "pos-ttl", "type": "t", "data": "fine"});
    for ttl in ["18446744073709552s", "36501d", "9223372036854775808ms"] {
        let resp = publish(
            &hub,
            &json!([ok, {"device": "pos-ttl", "type": "t", "data": "x", "ttl": ttl}]),
        )
        .await;
        let body = assert_item_error(&resp, 1, "ttl");
        assert!(
            body["message"].as_str().unwrap().contains("36500d"),
            "the message names the limit: {body}"
        );
    }
    let longest = publish_ok(
        &hub,
        &json!({"device": "pos-ttl", "type": "t", "data": "kept", "ttl": "36500d"}),
    )
    .await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(
        (event.id.as_deref(), event.data.as_str()),
        (Some(longest[0].0.as_str()), "kept"),
        "the refused batches stored nothing; the longest ttl is delivered"
    );
}

/// Device ids outside 1–128 characters of `[A-Za-z0-9._:-]` are 400 naming the item index and
/// `field: "device"`.
#[tokio::test]
async fn invalid_device_ids_are_rejected() {
    let hub = Hub::builder().start().await;
    let too_long = "d".repeat(129);
    let bad = [
        "pos 1",
        "ké",
        "*",
        &too_long,
        "a\r\nb",
        "a\nb",
        "a/b",
        "",
        "pos-1\u{0}",
    ];
    for device in bad {
        let resp = publish(
            &hub,
            &json!([{"device": "pos-1", "data": "x"}, {"device": device, "data": "x"}]),
        )
        .await;
        let body = assert_item_error(&resp, 1, "device");
        assert!(
            body["message"]
                .as_str()
                .unwrap_or_default()
                .contains("device"),
            "{device:?}: {body}"
        );
    }
    let resp = publish(&hub, &json!([{"device": too_long, "data": "x"}])).await;
    let body = assert_item_error(&resp, 0, "device");
    assert!(
        body["message"].as_str().unwrap_or_default().contains("129"),
        "{body}"
    );
}

/// Data larger than `limits.max_event_bytes` is 413 `payload_too_large` naming the item and
/// `data`; data of exactly the limit is accepted.
#[tokio::test]
async fn oversized_event_data_is_413() {
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_EVENT_BYTES", "1000")
        .start()
        .await;
    let exact = "x".repeat(1000);
    let over = "x".repeat(1001);

    let resp = publish(
        &hub,
        &json!([{"device": "pos-1", "data": exact}, {"device": "pos-1", "data": over}]),
    )
    .await;
    let body = assert_error(&resp, 413, "payload_too_large", &["item 1", "data", "1000"]);
    assert_eq!(body["index"], 1, "{body}");
    assert_eq!(body["field"], "data", "{body}");

    // Bytes, not characters: 501 two-byte characters are 1002 bytes.
    let resp = publish(&hub, &json!({"device": "pos-1", "data": "é".repeat(501)})).await;
    let body = assert_error(&resp, 413, "payload_too_large", &["data"]);
    assert_eq!(body["field"], "data", "{body}");

    let results = publish_ok(&hub, &json!({"device": "pos-1", "data": exact})).await;
    assert_eq!(results.len(), 1);
}

/// A batch with more than `limits.max_batch` items is 413; exactly the limit is accepted.
#[tokio::test]
async fn oversized_batch_is_413() {
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_BATCH", "5")
        .start()
        .await;
    let item = json!({"device": "pos-1", "data": "x"});
    let resp = publish(&hub, &Value::Array(vec![item.clone(); 6])).await;
    assert_error(&resp, 413, "payload_too_large", &["max_batch"]);

    let results = publish_ok(&hub, &Value::Array(vec![item; 5])).await;
    assert_eq!(results.len(), 5);
}

/// Writes `head` then `body_prefix` on a fresh connection and reads the response, without ever
/// sending the rest of the body the head announces.
async fn partial_request(addr: SocketAddr, head: &str, body_prefix: &[u8]) -> HttpResponse {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(head.as_bytes()).await.expect("write head");
        stream.write_all(body_prefix).await.expect("write body");
        read_response(&mut stream).await
    };
    tokio::time::timeout(WAIT, exchange)
        .await
        .expect("no response to a partial request")
}

/// Reads one response with a Content-Length body (what the hub's errors carry).
async fn read_response<R: AsyncReadExt + Unpin>(reader: &mut R) -> HttpResponse {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = reader.read(&mut chunk).await.expect("read response");
        assert!(n > 0, "connection closed before a response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = http::parse_head(&buf[..head_end]).expect("parse response head");
    let mut body = buf[head_end + 4..].to_vec();
    let length: usize = head
        .headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map(|(_, v)| v.parse().expect("numeric content-length"))
        .expect("error responses carry a content-length");
    while body.len() < length {
        let n = reader.read(&mut chunk).await.expect("read body");
        assert!(n > 0, "connection closed mid-body");
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    HttpResponse {
        status: head.status,
        headers: head.headers,
        body,
    }
}

/// A body whose Content-Length exceeds `limits.max_body_bytes` is 413 before the body is sent.
#[tokio::test]
async fn oversized_body_by_content_length_is_413_early() {
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_BODY_BYTES", "100000")
        .start()
        .await;
    let addr = hub.addr();
    let head = format!(
        "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 100001\r\nConnection: close\r\n\r\n"
    );
    let resp = partial_request(addr, &head, b"[{\"device\":\"pos-1\",\"data\":\"").await;
    assert_error(&resp, 413, "payload_too_large", &["max_body_bytes"]);
}

/// A chunked body that keeps growing past `limits.max_body_bytes` is answered 413 while the
/// client is still sending, i.e. the hub never buffers it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_chunked_body_is_413_while_sending() {
    /// Far more than any socket buffers hold, so finishing means the hub read it all.
    const LIMIT_SENT: usize = 256 * 1024 * 1024;
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_BODY_BYTES", "100000")
        .start()
        .await;
    let addr = hub.addr();
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    let head = format!(
        "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    writer.write_all(head.as_bytes()).await.expect("write head");

    let answered = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let (answered_w, sent_w) = (answered.clone(), sent.clone());
    let sender = tokio::spawn(async move {
        let payload = vec![b' '; 16 * 1024];
        let mut chunk = format!("{:x}\r\n", payload.len()).into_bytes();
        chunk.extend_from_slice(&payload);
        chunk.extend_from_slice(b"\r\n");
        while !answered_w.load(Ordering::Acquire) && sent_w.load(Ordering::Acquire) < LIMIT_SENT {
            if writer.write_all(&chunk).await.is_err() {
                return false;
            }
            sent_w.fetch_add(payload.len(), Ordering::AcqRel);
        }
        if answered_w.load(Ordering::Acquire) {
            return false;
        }
        // Everything was accepted: finish the body properly (the test fails below).
        writer.write_all(b"0\r\n\r\n").await.is_ok()
    });

    let resp = tokio::time::timeout(Duration::from_secs(30), read_response(&mut reader))
        .await
        .expect("no answer to an endless chunked body");
    answered.store(true, Ordering::Release);
    let finished = sender.await.expect("sender task");
    let sent_when_answered = sent.load(Ordering::Acquire);
    assert!(
        !finished && sent_when_answered < LIMIT_SENT,
        "the hub read the whole {sent_when_answered}-byte body before answering"
    );
    assert_error(&resp, 413, "payload_too_large", &["max_body_bytes"]);
}

/// A small chunked body is read normally (so the 413 above is about size, not encoding).
#[tokio::test]
async fn small_chunked_body_is_accepted() {
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_BODY_BYTES", "100000")
        .start()
        .await;
    let mut client = live_stream(&hub, "pos-chunked").await;
    let addr = hub.addr();
    let part1 = r#"{"device":"pos-chunked","#;
    let part2 = r#""data":"via chunks"}"#;
    let request = format!(
        "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
         {:x}\r\n{part1}\r\n{:x}\r\n{part2}\r\n0\r\n\r\n",
        part1.len(),
        part2.len()
    );
    let resp = partial_request(addr, &request, b"").await;
    let results = results(&resp);
    let event = client.expect_event(WAIT).await;
    assert_eq!(event.id.as_deref(), Some(results[0].0.as_str()));
    assert_eq!(event.data, "via chunks");
}

/// A batch with one invalid item appends nothing: the valid item's device receives nothing
/// before a marker published afterwards.
#[tokio::test]
async fn invalid_batch_appends_nothing() {
    let hub = Hub::builder().start().await;
    let mut client = live_stream(&hub, "pos-atomic").await;
    let resp = publish(
        &hub,
        &json!([
            {"device": "pos-atomic", "data": "must not arrive"},
            {"broadcast": true, "data": "must not arrive either"},
            {"device": "pos atomic", "data": "x"},
        ]),
    )
    .await;
    assert_item_error(&resp, 2, "device");

    // The same with an oversized item.
    let resp = publish(
        &hub,
        &json!([
            {"device": "pos-atomic", "data": "must not arrive"},
            {"device": "pos-atomic", "data": "y".repeat(65_537)},
        ]),
    )
    .await;
    assert_error(&resp, 413, "payload_too_large", &["item 1"]);

    assert_next_is_marker(&hub, &mut client, "pos-atomic", "marker").await;
    assert_eq!(
        client.next_event(Duration::from_millis(200)).await,
        SseNext::Timeout
    );
}

/// With `server.cors_origins` set, an allowed origin gets `Access-Control-Allow-Origin` on
/// publish answers (success and error) and on the stream, and a preflight naming methods and
/// headers; another origin gets no CORS header.
#[tokio::test]
async fn cors_for_configured_origin_only() {
    let hub = Hub::builder()
        .env("POSTHORN_SERVER__CORS_ORIGINS", "https://pos.example")
        .start()
        .await;
    let addr = hub.addr();
    let body = br#"{"device":"pos-1","data":"x"}"#;
    let post = |origin: &'static str, body: &'static [u8]| async move {
        http::request(
            addr,
            "POST",
            "/v1/events",
            &[("Content-Type", "application/json"), ("Origin", origin)],
            Some(body),
        )
        .await
    };

    let resp = post("https://pos.example", body).await;
    assert_eq!(resp.status, 201, "{}", resp.text());
    assert_eq!(
        resp.header("access-control-allow-origin"),
        Some("https://pos.example")
    );
    let resp = post("https://pos.example", b"{").await;
    assert_eq!(resp.status, 400);
    assert_eq!(
        resp.header("access-control-allow-origin"),
        Some("https://pos.example"),
        "a browser can only read the error with the CORS grant"
    );

    // With auth none an origin that is not listed may not publish at all (tests/browser.rs).
    let resp = post("https://evil.example", body).await;
    assert_eq!(resp.status, 403, "{}", resp.text());
    assert_eq!(resp.header("access-control-allow-origin"), None);

    let resp = http::request(
        addr,
        "OPTIONS",
        "/v1/events",
        &[
            ("Origin", "https://pos.example"),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "content-type, authorization",
            ),
        ],
        None,
    )
    .await;
    assert_eq!(resp.status, 204);
    assert_eq!(
        resp.header("access-control-allow-origin"),
        Some("https://pos.example")
    );
    let methods = resp
        .header("access-control-allow-methods")
        .unwrap_or_default()
        .to_ascii_uppercase();
    assert!(methods.contains("POST"), "allow-methods {methods:?}");
    let headers = resp
        .header("access-control-allow-headers")
        .unwrap_or_default()
        .to_ascii_lowercase();
    for needed in ["content-type", "authorization"] {
        assert!(headers.contains(needed), "allow-headers {headers:?}");
    }

    let resp = http::request(
        addr,
        "OPTIONS",
        "/v1/events",
        &[
            ("Origin", "https://evil.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        None,
    )
    .await;
    assert!(
        resp.headers
            .iter()
            .all(|(n, _)| !n.starts_with("access-control-")),
        "{:?}",
        resp.headers
    );

    let resp = http::request(
        addr,
        "OPTIONS",
        &stream_path("pos-1"),
        &[
            ("Origin", "https://pos.example"),
            ("Access-Control-Request-Method", "GET"),
            ("Access-Control-Request-Headers", "last-event-id"),
        ],
        None,
    )
    .await;
    assert_eq!(resp.status, 204, "{}", resp.text());
    assert_eq!(
        resp.header("access-control-allow-origin"),
        Some("https://pos.example")
    );
    assert!(resp
        .header("access-control-allow-headers")
        .unwrap_or_default()
        .contains("last-event-id"));

    let client = SseClient::connect(
        addr,
        &stream_path("pos-1"),
        &[("Origin", "https://pos.example")],
    )
    .await;
    assert_eq!(client.status(), 200);
    assert_eq!(
        client.header("access-control-allow-origin"),
        Some("https://pos.example")
    );
}

/// Without `server.cors_origins` no response carries any CORS header, preflight included.
#[tokio::test]
async fn no_cors_headers_without_configuration() {
    let hub = Hub::builder().start().await;
    let addr = hub.addr();
    let resp = http::request(
        addr,
        "POST",
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Origin", "https://pos.example"),
        ],
        Some(br#"{"device":"pos-1","data":"x"}"#),
    )
    .await;
    // Refused: with auth none no origin may publish unless listed (tests/browser.rs).
    assert_eq!(resp.status, 403, "{}", resp.text());
    let preflight = http::request(
        addr,
        "OPTIONS",
        "/v1/events",
        &[
            ("Origin", "https://pos.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        None,
    )
    .await;
    for resp in [&resp, &preflight] {
        assert!(
            resp.headers
                .iter()
                .all(|(n, _)| !n.starts_with("access-control-")),
            "{:?}",
            resp.headers
        );
    }
}

/// `publish_events_total{result}` counts accepted, duplicate and rejected events exactly as
/// published.
#[tokio::test]
async fn publish_metrics_match_what_was_published() {
    let hub = Hub::builder().start().await;
    let before = metrics::scrape(hub.addr()).await;
    for result in ["accepted", "duplicate", "rejected", "failed"] {
        assert_eq!(
            before.value_or_zero("publish_events_total", &[("result", result)]),
            0.0,
            "{result} on a fresh hub"
        );
    }

    // 1 + 3 accepted.
    publish_ok(&hub, &json!({"device": "pos-1", "data": "a", "key": "m-1"})).await;
    publish_ok(
        &hub,
        &json!([
            {"device": "pos-1", "data": "b"},
            {"device": "pos-2", "data": "c", "key": "m-2"},
            {"broadcast": true, "data": "d"},
        ]),
    )
    .await;
    // 1 duplicate, then 1 accepted + 2 duplicates in one batch.
    publish_ok(&hub, &json!({"device": "pos-1", "data": "a", "key": "m-1"})).await;
    let mixed = publish_ok(
        &hub,
        &json!([
            {"device": "pos-3", "data": "e", "key": "m-3"},
            {"device": "pos-3", "data": "e", "key": "m-3"},
            {"device": "pos-2", "data": "c", "key": "m-2"},
        ]),
    )
    .await;
    assert_eq!(
        mixed.iter().map(|r| r.1).collect::<Vec<_>>(),
        [false, true, true]
    );
    // 3 rejected requests of one event each.
    publish_raw(&hub, "{").await;
    publish(&hub, &json!({"device": "bad device", "data": "x"})).await;
    publish(&hub, &json!({"device": "pos-1"})).await;

    let after = metrics::scrape(hub.addr()).await;
    let value = |result| after.value_or_zero("publish_events_total", &[("result", result)]);
    assert_eq!(value("accepted"), 5.0);
    assert_eq!(value("duplicate"), 3.0);
    assert_eq!(value("rejected"), 3.0);
    assert_eq!(value("failed"), 0.0);
}

/// A publish refused for an oversized body is counted as rejected like every other refusal.
#[tokio::test]
async fn oversized_body_counts_as_rejected() {
    let hub = Hub::builder()
        .env("POSTHORN_LIMITS__MAX_BODY_BYTES", "100000")
        .start()
        .await;
    let addr = hub.addr();
    let head = format!(
        "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 100001\r\nConnection: close\r\n\r\n"
    );
    let resp = partial_request(addr, &head, b"[").await;
    assert_error(&resp, 413, "payload_too_large", &["max_body_bytes"]);
    let after = metrics::scrape(hub.addr()).await;
    assert_eq!(
        after.value_or_zero("publish_events_total", &[("result", "rejected")]),
        1.0
    );
}

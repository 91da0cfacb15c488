//! Hostile input at the HTTP edge: oversized headers, requests that never finish their
//! headers, and entries external producers wrote with invalid UTF-8. The hub refuses or skips
//! them and keeps serving everyone else.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{http, live_stream, metrics, redis::RedisServer, sse::is_closed_within, Hub};
use tokio::{io::AsyncWriteExt, net::TcpStream};

const WAIT: Duration = Duration::from_secs(20);

/// A request whose headers are far beyond the server's limit is refused (431) and dropped; a
/// connected client is not affected.
#[tokio::test]
async fn huge_headers_are_refused() {
    let hub = Hub::builder().start().await;
    let mut client = live_stream(&hub, "pos-1").await;
    let huge = "x".repeat(200 * 1024);
    let response = http::try_request(
        hub.addr(),
        "GET",
        "/healthz",
        &[("X-Huge", &huge)],
        None,
        WAIT,
    )
    .await;
    match response {
        Ok(response) => assert_eq!(response.status, 431, "{}", response.text()),
        // Refusing may also mean closing before the client finished sending.
        Err(error) => assert!(
            matches!(
                error.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            ),
            "{error}"
        ),
    }
    let published = http::post_json(
        hub.addr(),
        "/v1/events",
        &json!({ "device": "pos-1", "data": "still here" }),
    )
    .await;
    assert_eq!(published.status, 201);
    assert_eq!(client.expect_event(WAIT).await.data, "still here");
}

/// A client that starts a request and never finishes its headers is disconnected by the
/// server's header timeout instead of holding a connection forever.
#[tokio::test]
async fn unfinished_headers_time_out() {
    let hub = Hub::builder().start().await;
    let mut stream = TcpStream::connect(hub.addr()).await.unwrap();
    stream
        .write_all(b"GET /v1/devices/pos-1/events HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    assert!(
        is_closed_within(&mut stream, WAIT).await,
        "the half-sent request must be dropped"
    );
}

/// Entries with invalid UTF-8 data written by an external producer are skipped and counted; the
/// tail keeps running and delivers the next valid entry.
#[tokio::test]
async fn invalid_utf8_entries_are_skipped() {
    let redis = RedisServer::start().await;
    let hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .start()
        .await;
    let mut client = live_stream(&hub, "pos-1").await;
    let key = format!("pos-ev:{}", crc32fast::hash(b"pos-1") % 64);
    let mut producer = redis.client().await;
    producer
        .cmd_bytes(&[
            b"XADD",
            key.as_bytes(),
            b"*",
            b"dev",
            b"pos-1",
            b"data",
            &[0xff, 0xfe, 0x00],
        ])
        .await;
    producer
        .cmd_bytes(&[
            b"XADD",
            key.as_bytes(),
            b"*",
            b"dev",
            &[0xc3, 0x28],
            b"data",
            b"x",
        ])
        .await;
    producer
        .xadd(&key, &[("dev", "pos-1"), ("data", "valid")])
        .await;
    assert_eq!(client.expect_event(WAIT).await.data, "valid");
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(scrape.value("tail_entries_skipped_total", &[]), Some(2.0));
}

/// Out of file descriptors, the hub cannot accept: new connections wait in the listen queue
/// instead of failing, the open streams keep working, and once streams close and free
/// descriptors, the waiting connection is accepted and becomes a working stream.
#[tokio::test]
async fn out_of_file_descriptors_new_connections_wait_until_some_are_free() {
    const OPEN_FILES: u64 = 64;
    let hub = Hub::builder().open_files_limit(OPEN_FILES).start().await;
    let mut streams = Vec::new();
    let (mut waiting, mut head) = loop {
        assert!(
            (streams.len() as u64) < OPEN_FILES,
            "{} streams opened under a limit of {OPEN_FILES} open files",
            streams.len()
        );
        let mut stream = TcpStream::connect(hub.addr()).await.unwrap();
        let path = format!("/v1/devices/pos-{}/events", streams.len());
        stream
            .write_all(&http::encode_request(hub.addr(), "GET", &path, &[], None))
            .await
            .unwrap();
        let mut buf = Vec::new();
        match tokio::time::timeout(
            Duration::from_secs(1),
            http::read_head(&mut stream, &mut buf),
        )
        .await
        {
            Ok(head) => {
                assert_eq!(head.unwrap().status, 200);
                streams.push(stream);
            }
            // Not accepted: the hub has no descriptor left for it.
            Err(_) => break (stream, buf),
        }
    };
    assert!(
        streams.len() > 5,
        "only {} streams before the limit",
        streams.len()
    );
    assert!(
        hub.wait_for_log("cannot accept a connection", WAIT).await,
        "the hub says why it does not accept"
    );
    // Closing some streams frees their descriptors; the waiting connection gets its answer.
    streams.truncate(streams.len() - 5);
    let response = tokio::time::timeout(WAIT, http::read_head(&mut waiting, &mut head))
        .await
        .expect("the waiting connection is accepted once descriptors are free")
        .unwrap();
    assert_eq!(response.status, 200);
    let device = format!("pos-{}", streams.len() + 5);
    let published = http::post_json(
        hub.addr(),
        "/v1/events",
        &json!({ "device": device, "data": "after the shortage" }),
    )
    .await;
    assert_eq!(published.status, 201);
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + WAIT;
    while !String::from_utf8_lossy(&received).contains("after the shortage") {
        let n = tokio::time::timeout_at(
            deadline,
            tokio::io::AsyncReadExt::read(&mut waiting, &mut chunk),
        )
        .await
        .expect("the event reaches the stream accepted late")
        .unwrap();
        assert!(n > 0, "the stream ended");
        received.extend_from_slice(&chunk[..n]);
    }
}

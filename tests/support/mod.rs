//! Black-box test harness for the `posthorn` binary: process control
//! ([`hub`]), a raw HTTP/1.1 client ([`http`]), an SSE client and decoder
//! ([`sse`]), a Prometheus text scraper ([`metrics`]), and the servers it
//! runs against: headless Chromium ([`chromium`]), Redis standalone and cluster ([`redis`]), NATS JetStream
//! alone ([`nats`]) or clustered ([`nats_cluster`]), nginx ([`nginx`]), Prometheus scraping hubs
//! ([`prometheus`]), and the certificates of TLS tests ([`tls`]).
//!
//! Every test binary does `mod support;` and uses a different subset, hence
//! the blanket `dead_code` allowance.
#![allow(dead_code)]

pub mod chromium;
pub mod http;
pub mod hub;
pub mod metrics;
pub mod nats;
pub mod nats_cluster;
pub mod nginx;
pub mod prometheus;
pub mod redis;
pub mod sse;
pub mod tls;

use std::net::{Ipv4Addr, TcpListener};
use std::time::Duration;

// Shortcuts for the common case; like the rest, unused in some binaries.
#[allow(unused_imports)]
pub use hub::Hub;
#[allow(unused_imports)]
pub use nginx::Nginx;
#[allow(unused_imports)]
pub use redis::{RedisCluster, RedisServer, RedisSnapshot, RespClient, RespValue};
#[allow(unused_imports)]
pub use sse::{SseClient, SseEvent, SseNext};

/// Upper bound for any single network operation of the harness; a test that
/// hangs longer than this is reported as a failure instead of stalling CI.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A port that was free a moment ago. Another process may grab it before the
/// hub binds it; [`hub::HubBuilder::start`] retries on "address in use".
pub fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}

/// Path of the SSE stream of `device`.
pub fn stream_path(device: &str) -> String {
    format!("/v1/devices/{device}/events")
}

/// Opens the stream of `device` without a cursor and checks it was accepted. The hub answers only
/// once the connection's registration is queued ahead of any later event, so every event
/// published after this returns is delivered to it.
pub async fn live_stream(hub: &Hub, device: &str) -> SseClient {
    let client = SseClient::connect(hub.addr(), &stream_path(device), &[]).await;
    assert_eq!(client.status(), 200, "stream for {device}");
    client
}

/// Publishes one event of type `test` to `device` through `hub`; returns its SSE id.
pub async fn publish_to(hub: &Hub, device: &str, data: &str) -> String {
    let response = http::post_json(
        hub.addr(),
        "/v1/events",
        &serde_json::json!({ "device": device, "type": "test", "data": data }),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    response.json()["results"][0]["id"]
        .as_str()
        .expect("id")
        .to_string()
}

/// Polls `check` every 50 ms until it holds; panics naming `what` once `timeout` has passed. For
/// a test that waits for something to have happened (a stream registered, a tail blocked in its
/// read, a drain under way) rather than for time to pass.
pub async fn wait_until(timeout: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {timeout:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fresh directory under the system temp dir for one server's files (`kind` names the server).
pub fn unique_temp_dir(kind: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    let dir = std::env::temp_dir().join(format!(
        "posthorn-{kind}-{}-{n}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    dir
}

/// The largest char boundary at or below `i`, to cut the tail of a log without splitting a char.
pub fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

//! The drain (docs/operations.md) across pods: two hubs on one Redis behind a real nginx (proxy buffering
//! off). Clients connect through the proxy and follow the reference-client rules (resume with
//! `Last-Event-ID`, honour `retry:`); hub A is drained while events keep coming; every client
//! ends on hub B with every event exactly once and in order, and hub A exits inside its grace.

mod support;

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use support::{http, nginx::Nginx, redis::RedisServer, stream_path, Hub, SseClient, SseNext};

const DEVICES: usize = 24;
const WAIT: Duration = Duration::from_secs(30);

fn hub(redis: &RedisServer) -> support::hub::HubBuilder {
    Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .env("POSTHORN_DRAIN__GRACE", "10s")
        .env("POSTHORN_DRAIN__CLOSE_RATE", "5")
        .env("POSTHORN_DRAIN__RETRY_MIN", "1s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "3s")
}

/// What one client saw.
struct Followed {
    /// Sequence numbers in arrival order.
    received: Vec<u64>,
    /// `retry:` values that ended a stream (drain closes).
    closing_retries: Vec<u64>,
}

/// A client following the docs/client-contract.md rules through the proxy until it has seen `until` events.
async fn follow(
    proxy: SocketAddr,
    device: String,
    until: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
) -> Followed {
    let mut followed = Followed {
        received: Vec::new(),
        closing_retries: Vec::new(),
    };
    let mut cursor: Option<String> = None;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        assert!(
            Instant::now() < deadline,
            "{device}: never caught up: {:?}",
            followed.received.last()
        );
        let headers: Vec<(&str, &str)> = cursor
            .iter()
            .map(|c| ("Last-Event-ID", c.as_str()))
            .collect();
        let mut client = match SseClient::try_connect(proxy, &stream_path(&device), &headers).await
        {
            Ok(client) if client.status() == 200 => client,
            _ => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let first_retry = client.retry;
        loop {
            if done.load(Ordering::Acquire)
                && followed.received.len() as u64 >= until.load(Ordering::Acquire)
            {
                return followed;
            }
            match client.next_event(Duration::from_millis(200)).await {
                SseNext::Event(event) => {
                    assert_eq!(event.event, "seq", "{device}: unexpected {event:?}");
                    followed
                        .received
                        .push(event.data.parse().expect("sequence number"));
                    cursor = event.id;
                }
                SseNext::Timeout => {}
                SseNext::Closed => {
                    // The closing retry differs from the stream's opening one (sse.retry_ms).
                    let retry = client
                        .retry
                        .filter(|r| Some(*r) != first_retry)
                        .unwrap_or(1000);
                    if client.retry != first_retry {
                        followed.closing_retries.push(retry);
                    }
                    tokio::time::sleep(Duration::from_millis(retry)).await;
                    break;
                }
            }
        }
    }
}

/// Drains hub A while a publisher keeps sending numbered events to every device through hub B:
/// clients of A are closed with their own retry, reconnect through nginx, land on B, resume from
/// their cursors and see every event once and in order; A exits 0 within its grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_a_pod_hands_its_clients_over_without_loss() {
    let redis = RedisServer::start().await;
    let mut pod_a = hub(&redis).start().await;
    let pod_b = hub(&redis).start().await;
    let proxy = Nginx::start(&[pod_a.addr(), pod_b.addr()]).await;
    let devices: Vec<String> = (0..DEVICES).map(|i| format!("fleet-{i}")).collect();

    let published = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let followers: Vec<_> = devices
        .iter()
        .map(|device| {
            tokio::spawn(follow(
                proxy.addr(),
                device.clone(),
                published.clone(),
                done.clone(),
            ))
        })
        .collect();
    // Every follower holds a stream on one of the pods before publishing starts.
    let deadline = Instant::now() + WAIT;
    loop {
        let on_a = http::get(pod_a.addr(), "/admin/status").await.json()["connections"]
            .as_u64()
            .unwrap();
        let on_b = http::get(pod_b.addr(), "/admin/status").await.json()["connections"]
            .as_u64()
            .unwrap();
        if on_a + on_b == DEVICES as u64 {
            assert!(
                on_a > 0 && on_b > 0,
                "the proxy should spread clients: {on_a} on A, {on_b} on B"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "clients did not connect: {on_a} + {on_b}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let addr_b = pod_b.addr();
    let batch_for = |seq: u64| -> Value {
        Value::Array(
            devices
                .iter()
                .map(|d| json!({ "device": d, "type": "seq", "data": seq.to_string() }))
                .collect(),
        )
    };
    let mut seq = 0;
    for _ in 0..10 {
        assert_eq!(
            http::post_json(addr_b, "/v1/events", &batch_for(seq))
                .await
                .status,
            201
        );
        seq += 1;
        published.store(seq, Ordering::Release);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let drain = http::request(pod_a.addr(), "POST", "/admin/drain", &[], None).await;
    assert_eq!(drain.status, 202);
    let drain_started = Instant::now();
    // Keep publishing through the drain, A's exit and the reconnections.
    while drain_started.elapsed() < Duration::from_secs(8) {
        assert_eq!(
            http::post_json(addr_b, "/v1/events", &batch_for(seq))
                .await
                .status,
            201
        );
        seq += 1;
        published.store(seq, Ordering::Release);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = pod_a
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("hub A exits");
    assert_eq!(status.code(), Some(0));
    assert!(
        pod_a.stderr_log().contains("drain finished"),
        "A must finish inside its grace"
    );
    // Every client ends on hub B.
    let deadline = Instant::now() + WAIT;
    while http::get(pod_b.addr(), "/admin/status").await.json()["connections"] != DEVICES {
        assert!(
            Instant::now() < deadline,
            "not every client reconnected to B"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done.store(true, Ordering::Release);

    let mut drained_clients = 0;
    for (device, follower) in devices.iter().zip(followers) {
        let followed = follower.await.expect("follower");
        let expected: Vec<u64> = (0..seq).collect();
        assert_eq!(
            followed.received, expected,
            "{device}: every event once, in order"
        );
        if !followed.closing_retries.is_empty() {
            drained_clients += 1;
            assert!(
                followed
                    .closing_retries
                    .iter()
                    .all(|r| (1000..=3000).contains(r)),
                "{device}: closing retry outside the drain range: {:?}",
                followed.closing_retries
            );
        }
    }
    assert!(
        drained_clients > 0,
        "some clients must have been drained from A"
    );
}

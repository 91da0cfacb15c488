//! Resumes under load: replays run in a bounded number of slots, the others wait
//! with their stream open and start in order of arrival; the resumes of one shard share their
//! backend reads.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{http, metrics, redis::RedisServer, stream_path, Hub, SseClient};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(20);

/// Publishes `events` in batches of up to 1000; returns the ids in order.
async fn publish_all(hub: &Hub, events: Vec<serde_json::Value>) -> Vec<String> {
    let mut ids = Vec::new();
    for batch in events.chunks(1000) {
        let response = http::post_json(hub.addr(), "/v1/events", &json!(batch)).await;
        assert_eq!(response.status, 201, "{}", response.text());
        for result in response.json()["results"].as_array().unwrap() {
            ids.push(result["id"].as_str().unwrap().to_string());
        }
    }
    ids
}

/// The value of a gauge or counter without labels.
async fn metric(hub: &Hub, name: &str) -> f64 {
    metrics::scrape(hub.addr())
        .await
        .value(name, &[])
        .unwrap_or_else(|| panic!("{name} is not exported"))
}

/// Waits until `name` reads `value`.
async fn wait_metric(hub: &Hub, name: &str, value: f64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = metric(hub, name).await;
        if now == value {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} stayed at {now}, expected {value}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether anything beyond the stream's opening bytes (response head, `retry:` and a comment,
/// written at once) has arrived after `wait`.
async fn receives_within(stream: &mut TcpStream, wait: Duration) -> bool {
    const PRELUDE_END: &[u8] = b": posthorn\n\n";
    let mut buf = vec![0u8; 1 << 20];
    tokio::time::sleep(wait).await;
    let seen = tokio::time::timeout(WAIT, stream.peek(&mut buf))
        .await
        .expect("the stream opens at once")
        .expect("peek");
    let opening = buf[..seen]
        .windows(PRELUDE_END.len())
        .position(|window| window == PRELUDE_END)
        .map(|at| at + PRELUDE_END.len())
        .expect("the stream opens with its prelude");
    // The prelude is the first chunk; what follows it is a chunk-size line and more.
    seen > opening + "\r\n".len()
}

/// With `replay.max_concurrent = 2`, six streams resuming a long backlog while their clients do
/// not read: every stream is open at once (200 and its first bytes), two replays run, four wait;
/// when one client reads its replay to the end, the earliest waiting stream starts, and only
/// that one; every client then gets its whole backlog, in order.
#[tokio::test]
async fn replays_wait_their_turn_in_order_with_the_stream_open() {
    let hub = Hub::builder()
        .env("POSTHORN_REPLAY__MAX_CONCURRENT", "2")
        .env("POSTHORN_SSE__STALL_TIMEOUT", "60s")
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .env("POSTHORN_SSE__QUEUE_LIMIT", "2000")
        .start()
        .await;
    const DEVICES: usize = 6;
    const BACKLOG: usize = 600;
    let devices: Vec<String> = (0..DEVICES).map(|i| format!("pos-{i}")).collect();
    let first: Vec<serde_json::Value> = devices
        .iter()
        .map(|device| json!({"device": device, "data": "cursor"}))
        .collect();
    let cursors = publish_all(&hub, first).await;
    let payload = "w".repeat(300);
    let backlog: Vec<serde_json::Value> = (0..BACKLOG)
        .flat_map(|i| {
            let payload = payload.clone();
            devices
                .iter()
                .map(move |device| json!({"device": device, "data": format!("{i}:{payload}")}))
        })
        .collect();
    publish_all(&hub, backlog).await;

    let mut streams = Vec::new();
    for (device, cursor) in devices.iter().zip(&cursors) {
        streams.push(
            SseClient::connect_raw_never_read_with_headers(
                hub.addr(),
                &stream_path(device),
                &[("Last-Event-ID", cursor)],
            )
            .await,
        );
        // Arrival order is the order in which replays ask for a slot.
        let arrived = streams.len() as f64;
        wait_metric(&hub, "replays_in_flight", arrived.min(2.0)).await;
        wait_metric(&hub, "replays_waiting", (arrived - 2.0).max(0.0)).await;
    }
    for stream in &mut streams[2..] {
        assert!(
            !receives_within(stream, Duration::from_millis(200)).await,
            "a waiting stream got replay data"
        );
    }
    // The first client reads everything: its slot goes to the third stream, not a later one.
    let mut reader = SseClient::connect_raw_reader(streams.remove(0)).await;
    assert_eq!(reader.expect_events(BACKLOG, WAIT).await.len(), BACKLOG);
    wait_metric(&hub, "replays_waiting", 3.0).await;
    assert!(
        receives_within(&mut streams[1], Duration::from_millis(500)).await,
        "the earliest waiting stream starts"
    );
    for stream in &mut streams[2..] {
        assert!(
            !receives_within(stream, Duration::from_millis(200)).await,
            "a later stream started first"
        );
    }
    for stream in streams {
        let mut reader = SseClient::connect_raw_reader(stream).await;
        let events = reader.expect_events(BACKLOG, WAIT).await;
        for (i, event) in events.iter().enumerate() {
            assert!(
                event.data.starts_with(&format!("{i}:")),
                "event {i} out of order"
            );
        }
    }
    wait_metric(&hub, "replays_in_flight", 0.0).await;
}

/// Forty devices of one shard resume at once, each from its own cursor, through Redis: each gets
/// exactly its backlog, and the backend entries the replays read are at most twice what they
/// delivered (each device reading the whole shard for itself read forty times as much).
#[tokio::test]
async fn resumes_of_one_shard_share_their_backend_reads() {
    let redis = RedisServer::start().await;
    let hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .start()
        .await;
    const DEVICES: usize = 40;
    const BACKLOG: usize = 30;
    let shard = crc32fast::hash(b"pos-1") % 64;
    let devices: Vec<String> = (0..)
        .map(|i| format!("pos-{i}"))
        .filter(|device| crc32fast::hash(device.as_bytes()) % 64 == shard)
        .take(DEVICES)
        .collect();
    let first: Vec<serde_json::Value> = devices
        .iter()
        .map(|device| json!({"device": device, "data": "cursor"}))
        .collect();
    let cursors = publish_all(&hub, first).await;
    let backlog: Vec<serde_json::Value> = (0..BACKLOG)
        .flat_map(|i| {
            devices
                .iter()
                .map(move |device| json!({"device": device, "data": i.to_string()}))
        })
        .collect();
    publish_all(&hub, backlog).await;
    let read_before = metric(&hub, "replay_entries_read_total").await;

    let addr = hub.addr();
    let clients = futures_util::future::join_all(devices.iter().zip(&cursors).map(
        |(device, cursor)| async move {
            SseClient::connect(addr, &stream_path(device), &[("Last-Event-ID", cursor)]).await
        },
    ))
    .await;
    for mut client in clients {
        let data: Vec<String> = client
            .expect_events(BACKLOG, WAIT)
            .await
            .into_iter()
            .map(|event| event.data)
            .collect();
        let expected: Vec<String> = (0..BACKLOG).map(|i| i.to_string()).collect();
        assert_eq!(data, expected);
    }
    let delivered = (DEVICES * BACKLOG) as f64;
    let read = metric(&hub, "replay_entries_read_total").await - read_before;
    assert!(
        read <= 2.0 * delivered,
        "the replays read {read} entries to deliver {delivered}"
    );
    assert_eq!(metric(&hub, "sse_replayed_events_total").await, delivered);
}

/// A stream waiting for a replay slot hears a `: ping` every heartbeat: the body reads only the
/// replay channel until the replay ends, and a client that follows the contract takes three
/// missed heartbeats for a dead connection.
#[tokio::test]
async fn a_stream_waiting_for_its_replay_gets_heartbeats() {
    let hub = Hub::builder()
        .env("POSTHORN_REPLAY__MAX_CONCURRENT", "1")
        .env("POSTHORN_SSE__HEARTBEAT", "300ms")
        .env("POSTHORN_SSE__STALL_TIMEOUT", "60s")
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .start()
        .await;
    let cursors = publish_all(
        &hub,
        vec![
            json!({"device": "pos-1", "data": "cursor"}),
            json!({"device": "pos-2", "data": "cursor"}),
        ],
    )
    .await;
    let payload = "h".repeat(500);
    let backlog = (0..2000)
        .map(|i| json!({"device": "pos-1", "data": format!("{i}:{payload}")}))
        .collect();
    publish_all(&hub, backlog).await;
    // Holds the only slot: its client reads nothing, so its replay cannot finish.
    let _holder = SseClient::connect_raw_never_read_with_headers(
        hub.addr(),
        &stream_path("pos-1"),
        &[("Last-Event-ID", &cursors[0])],
    )
    .await;
    wait_metric(&hub, "replays_in_flight", 1.0).await;
    let mut waiting = SseClient::connect(
        hub.addr(),
        &stream_path("pos-2"),
        &[("Last-Event-ID", &cursors[1])],
    )
    .await;
    wait_metric(&hub, "replays_waiting", 1.0).await;
    assert!(matches!(
        waiting.next_event(Duration::from_millis(1500)).await,
        support::SseNext::Timeout
    ));
    let pings = waiting
        .comments
        .iter()
        .filter(|c| c.trim() == "ping")
        .count();
    assert!(pings >= 3, "{pings} pings in 1.5 s: {:?}", waiting.comments);
}

//! Drain details (docs/operations.md, "Drain timeline") beyond the basic sequence in ops.rs: what is queued is flushed before
//! a close, and a signal still ends a pod that was drained without exiting.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{http, live_stream, Hub, SseClient};

const WAIT: Duration = Duration::from_secs(15);

/// A client that has not read for a while still gets every queued event, then the jittered
/// `retry:`, then a clean end of the stream when its connection is closed by a drain.
#[tokio::test]
async fn drain_flushes_queued_events_before_closing() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__RETRY_MS", "1500")
        .env("POSTHORN_DRAIN__RETRY_MIN", "2s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "4s")
        .env("POSTHORN_SSE__QUEUE_LIMIT", "256")
        .start()
        .await;
    // Connected and registered, but not reading until after the drain has closed it.
    let mut client = SseClient::connect(hub.addr(), "/v1/devices/pos-1/events", &[]).await;
    const EVENTS: usize = 200;
    let payload = "z".repeat(512);
    for i in 0..EVENTS {
        let event = json!({ "device": "pos-1", "data": format!("{i}:{payload}") });
        assert_eq!(
            http::post_json(hub.addr(), "/v1/events", &event)
                .await
                .status,
            201
        );
    }
    // A 201 means stored, not yet routed: the tail and the Router deliver it a moment later. An
    // event still on its way when the drain closes the stream is not in the queue (the client
    // gets it on resume), so the drain starts once all of them are queued.
    support::metrics::wait_for(
        hub.addr(),
        "router_events_total",
        &[("result", "delivered")],
        EVENTS as f64,
        WAIT,
    )
    .await;
    let drain = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202);
    let events = client.read_to_close(WAIT).await;
    assert_eq!(
        events.len(),
        EVENTS,
        "every queued event is written before the close"
    );
    for (i, event) in events.iter().enumerate() {
        assert!(
            event.data.starts_with(&format!("{i}:")),
            "event {i} out of order"
        );
    }
    assert!(
        client.body_complete(),
        "a drain ends the response cleanly, it does not reset it"
    );
    let retry = client.retry.expect("a retry value");
    assert!(
        (2000..=4000).contains(&retry),
        "closing retry {retry} outside the drain range"
    );
}

/// After `POST /admin/drain?exit=false`, one SIGTERM ends the process with exit code 0.
#[tokio::test]
async fn signal_after_a_drain_without_exit_ends_the_process() {
    let mut hub = Hub::builder().start().await;
    let drain = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202);
    let deadline = tokio::time::Instant::now() + WAIT;
    while http::get(hub.addr(), "/admin/status").await.json()["drain"]["phase"] != "drained" {
        assert!(
            tokio::time::Instant::now() < deadline,
            "drain never finished"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(hub.is_running(), "exit=false keeps the process up");
    hub.signal("TERM");
    let status = hub
        .wait_exit(WAIT)
        .await
        .expect("the process exits after SIGTERM");
    assert_eq!(status.code(), Some(0));
}

/// Every connection gets its own `retry:` drawn uniformly from `[drain.retry_min,
/// drain.retry_max]`, and the closes are spread over time at `drain.close_rate`. With 600
/// connections each quarter of the range expects 150 values (standard deviation about 11); the
/// test asks for 90, a bound missed with a probability far below one in a million.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_spreads_retries_and_closes() {
    const CONNECTIONS: usize = 600;
    let hub = Hub::builder()
        .env("POSTHORN_DRAIN__RETRY_MIN", "1s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "5s")
        .env("POSTHORN_DRAIN__CLOSE_RATE", "100")
        .env("POSTHORN_DRAIN__GRACE", "20s")
        .start()
        .await;
    let mut clients = Vec::with_capacity(CONNECTIONS);
    for i in 0..CONNECTIONS {
        clients.push(live_stream(&hub, &format!("spread-{i}")).await);
    }
    let started = std::time::Instant::now();
    let drain = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202);
    let readers: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            tokio::spawn(async move {
                client.read_to_close(Duration::from_secs(40)).await;
                (started.elapsed(), client.retry.expect("a closing retry"))
            })
        })
        .collect();
    let mut closes = Vec::with_capacity(CONNECTIONS);
    let mut retries = Vec::with_capacity(CONNECTIONS);
    for reader in readers {
        let (closed_at, retry) = reader.await.expect("reader");
        closes.push(closed_at);
        retries.push(retry);
    }
    assert!(
        retries.iter().all(|r| (1000..=5000).contains(r)),
        "retry outside the range"
    );
    let mut quarters = [0usize; 4];
    for retry in &retries {
        quarters[(((retry - 1000) * 4) / 4001) as usize] += 1;
    }
    assert!(
        quarters.iter().all(|&n| n >= 90),
        "retries not spread uniformly: {quarters:?}"
    );
    let distinct: std::collections::HashSet<_> = retries.iter().collect();
    assert!(
        distinct.len() > CONNECTIONS / 2,
        "retries are not drawn per connection"
    );
    // 600 closes at 100/s take about 6 s; being slow can only stretch that, never shrink it.
    let first = closes.iter().min().unwrap();
    let last = closes.iter().max().unwrap();
    assert!(
        *last - *first >= Duration::from_secs(3),
        "closes were not spread: {first:?}..{last:?}"
    );
    let scrape = support::metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("sse_connections_closed_total", &[("reason", "drain")]),
        Some(CONNECTIONS as f64)
    );
}

/// Once a drain begins, every connection is sent its jittered `retry:` right away, not
/// only at its own close, so a client whose connection breaks while it waits still comes back at
/// its own time.
#[tokio::test]
async fn retry_is_announced_before_the_close() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__RETRY_MS", "1500")
        .env("POSTHORN_DRAIN__RETRY_MIN", "2s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "4s")
        // One close per second: the second connection waits about 2 s for its turn.
        .env("POSTHORN_DRAIN__CLOSE_RATE", "1")
        .env("POSTHORN_DRAIN__GRACE", "20s")
        .start()
        .await;
    let mut first = live_stream(&hub, "pos-1").await;
    let mut second = live_stream(&hub, "pos-2").await;
    assert_eq!(second.retry, Some(1500));
    let drain = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(900);
    while second.retry == Some(1500) && tokio::time::Instant::now() < deadline {
        assert!(matches!(
            second.next_event(Duration::from_millis(50)).await,
            support::SseNext::Timeout
        ));
    }
    let announced = second.retry.expect("a retry");
    assert!(
        (2000..=4000).contains(&announced),
        "announced retry {announced} within 0.9 s"
    );
    assert!(
        !second.is_closed(),
        "announced before the close, not with it"
    );
    first.read_to_close(WAIT).await;
    second.read_to_close(WAIT).await;
    assert_eq!(
        second.retry,
        Some(announced),
        "the close repeats the announced value"
    );
}

/// Bug pinned: a connection closed by the drain whose client stopped reading left the
/// Router, so no stall check saw it any more, and its full socket held the drain until
/// `drain.grace`, which then exited 1. Now such a connection is cut off in time and the drain
/// ends within its grace with exit code 0.
#[tokio::test]
async fn a_client_that_stopped_reading_does_not_hold_the_drain() {
    let mut hub = Hub::builder()
        .env("POSTHORN_DRAIN__GRACE", "4s")
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .start()
        .await;
    let _stalled =
        SseClient::connect_raw_never_read(hub.addr(), "/v1/devices/stalled/events").await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while http::get(hub.addr(), "/admin/status").await.json()["connections"] != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stalled stream never registered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // About 100 KB queued: more than socket buffers take, less than the 256-event queue.
    let payload = "q".repeat(1024);
    for i in 0..100 {
        let event = json!({ "device": "stalled", "data": format!("{i}:{payload}") });
        assert_eq!(
            http::post_json(hub.addr(), "/v1/events", &event)
                .await
                .status,
            201
        );
    }
    let started = tokio::time::Instant::now();
    hub.signal("TERM");
    let status = hub.wait_exit(WAIT).await.expect("the hub exits");
    let took = started.elapsed();
    assert_eq!(status.code(), Some(0), "{}", hub.stderr_log());
    assert!(
        took <= Duration::from_secs(4),
        "the drain took {took:?}, beyond its grace"
    );
    // Exit code 0 already rules out a forced drain (which exits 1); the line says the drain
    // ended by itself with the stalled stream among those it closed.
    let log = hub.stderr_log();
    assert!(
        log.contains("drain finished: 1 connections closed"),
        "{log}"
    );
}

/// Reads `stream` until the server closes it and returns the SSE events of the response.
async fn events_until_close(stream: &mut tokio::net::TcpStream) -> Vec<support::SseEvent> {
    use tokio::io::AsyncReadExt;
    let mut raw = Vec::new();
    let read = tokio::time::timeout(WAIT, stream.read_to_end(&mut raw)).await;
    assert!(read.is_ok(), "the drain never closed the stream");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let mut chunks = support::http::ChunkedDecoder::new();
    let body = chunks.feed(&raw[split + 4..]).expect("a chunked body");
    support::sse::SseDecoder::new().feed(&body)
}

/// Bug pinned: a drain that reached a connection while it replayed a backlog dropped
/// the replay, and the body took "replay channel closed" for "replay done" and wrote the queued
/// live events: the client's cursor jumped past every event it had not been sent yet. Now the
/// client receives a gapless prefix of the backlog, and a live event only after all of it.
#[tokio::test]
async fn a_drain_mid_replay_never_skips_events() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .env("POSTHORN_SSE__QUEUE_LIMIT", "1000")
        .env("POSTHORN_DRAIN__RETRY_MIN", "1s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "1s")
        .start()
        .await;
    const BACKLOG: usize = 3000;
    let payload = "r".repeat(200);
    let batch: Vec<_> = (0..BACKLOG)
        .map(|i| json!({ "device": "pos-r", "data": format!("{i}:{payload}") }))
        .collect();
    let mut cursor = None;
    for chunk in batch.chunks(1000) {
        let response = http::post_json(hub.addr(), "/v1/events", &json!(chunk)).await;
        assert_eq!(response.status, 201, "{}", response.text());
        cursor.get_or_insert(
            response.json()["results"][0]["id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    let cursor = cursor.unwrap();
    // Resumes after event 0 and reads nothing: the replay stalls on the full socket.
    let mut stream = SseClient::connect_raw_never_read_with_headers(
        hub.addr(),
        "/v1/devices/pos-r/events",
        &[("Last-Event-ID", &cursor)],
    )
    .await;
    // The replay runs once the connection's registration is queued: the live event below then
    // goes to this connection's queue, behind the stalled replay.
    support::metrics::wait_for(hub.addr(), "replays_in_flight", &[], 1.0, WAIT).await;
    let live = json!({ "device": "pos-r", "data": "live" });
    assert_eq!(
        http::post_json(hub.addr(), "/v1/events", &live)
            .await
            .status,
        201
    );
    support::metrics::wait_for(
        hub.addr(),
        "router_events_total",
        &[("result", "delivered")],
        1.0,
        WAIT,
    )
    .await;
    let drain = http::request(hub.addr(), "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202);
    // Reading starts only once the drain has reached the connection, so that it meets the
    // replay still stalled.
    support::wait_until(WAIT, "the drain asked the stream to close", async || {
        let status = http::get(hub.addr(), "/admin/status").await.json();
        status["drain"]["closed"]
            .as_u64()
            .is_some_and(|closed| closed >= 1)
    })
    .await;
    let events = events_until_close(&mut stream).await;
    let mut expected = 1;
    for event in &events {
        if event.data == "live" {
            assert_eq!(
                expected,
                BACKLOG,
                "the live event came after {} of {} replayed events",
                expected - 1,
                BACKLOG - 1
            );
            continue;
        }
        let index: usize = event.data.split(':').next().unwrap().parse().unwrap();
        assert_eq!(index, expected, "a gap in the replayed backlog");
        expected += 1;
    }
}

/// A `drain.readiness_delay` that leaves no time to spread the closes within `drain.grace` is
/// refused at start-up, naming the key.
#[tokio::test]
async fn readiness_delay_must_leave_time_for_closes() {
    let (code, log) = Hub::builder()
        .env("POSTHORN_DRAIN__GRACE", "10s")
        .env("POSTHORN_DRAIN__READINESS_DELAY", "9s")
        .run_to_exit(Duration::from_secs(20))
        .await;
    assert_eq!(code, Some(64), "{log}");
    assert!(log.contains("drain.readiness_delay"), "{log}");
}

/// A drain that reaches a connection mid-replay whose client stopped reading cuts it off after
/// about 2 s without progress, not at the end of the grace period (the queue's stall clock does
/// not run while a body replays, so the drain watches the body's writes).
#[tokio::test]
async fn a_stopped_reader_mid_replay_is_cut_off_soon() {
    let mut hub = Hub::builder()
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .env("POSTHORN_DRAIN__GRACE", "30s")
        .start()
        .await;
    let payload = "c".repeat(500);
    let batch: Vec<_> = (0..1000)
        .map(|i| json!({ "device": "pos-c", "data": format!("{i}:{payload}") }))
        .collect();
    let response = http::post_json(hub.addr(), "/v1/events", &json!(batch)).await;
    assert_eq!(response.status, 201);
    let cursor = response.json()["results"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let _stalled = SseClient::connect_raw_never_read_with_headers(
        hub.addr(),
        "/v1/devices/pos-c/events",
        &[("Last-Event-ID", &cursor)],
    )
    .await;
    support::metrics::wait_for(hub.addr(), "replays_in_flight", &[], 1.0, WAIT).await;
    let started = tokio::time::Instant::now();
    hub.signal("TERM");
    let status = hub
        .wait_exit(Duration::from_secs(40))
        .await
        .expect("the hub exits");
    assert_eq!(status.code(), Some(0), "{}", hub.stderr_log());
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "the stopped reader held the drain for {took:?}"
    );
}

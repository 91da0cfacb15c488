//! Drain details of SPEC 7 beyond the basic sequence in ops.rs: what is queued is flushed before
//! a close, and a signal still ends a pod that was drained without exiting.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{http, Hub, SseClient};

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

//! Slow-consumer eviction (docs/ARCHITECTURE.md): a client that stops reading fills its bounded queue
//! and is dropped at once, healthy clients lose nothing, and evicted connections give their
//! memory back.

mod support;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use serde_json::json;
use support::{http, metrics, sse::is_closed_within, Hub, SseClient};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(15);

async fn broadcast(hub: &Hub, data: &str) {
    let response = http::post_json(
        hub.addr(),
        "/v1/events",
        &json!({ "broadcast": true, "data": data }),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
}

/// Waits until `name` reaches `value` on `hub`'s `/metrics`.
async fn wait_for_metric(hub: &Hub, name: &str, labels: &[(&str, &str)], value: f64) {
    metrics::wait_for(hub.addr(), name, labels, value, WAIT).await;
}

/// A raw TCP client that never reads is evicted (counted as slow_consumer, socket closed) while a
/// healthy client of the same broadcasts receives every one of them, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_never_reads_is_evicted_and_healthy_client_loses_nothing() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__QUEUE_LIMIT", "64")
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        // This test is about the queue limit; the stall sweep is tested below.
        .env("POSTHORN_SSE__STALL_TIMEOUT", "0s")
        .start()
        .await;
    let mut stalled =
        SseClient::connect_raw_never_read(hub.addr(), "/v1/devices/stalled-1/events").await;
    let mut healthy = SseClient::connect(hub.addr(), "/v1/devices/healthy-1/events", &[]).await;
    wait_for_metric(&hub, "sse_connections", &[], 2.0).await;

    // About 400 KB in all: far beyond what the stalled client's queue (64 events) plus socket and
    // actix buffers (about 50 KB) can hold. The publisher stays at most WINDOW events ahead of the
    // healthy reader, so the healthy client is never slower than its queue allows, even when the
    // test process and the hub compete for the two cores.
    const EVENTS: usize = 400;
    const WINDOW: usize = 32;
    let received = Arc::new(AtomicUsize::new(0));
    let reader = {
        let received = received.clone();
        tokio::spawn(async move {
            let mut events = Vec::with_capacity(EVENTS);
            while events.len() < EVENTS {
                events.push(healthy.expect_event(WAIT).await);
                received.store(events.len(), Ordering::Release);
            }
            (healthy, events)
        })
    };
    let payload = "x".repeat(1024);
    for i in 0..EVENTS {
        while i >= received.load(Ordering::Acquire) + WINDOW {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        broadcast(&hub, &format!("{i}:{payload}")).await;
    }
    // The healthy client stays connected until the end: it must not be counted as evicted.
    let (_healthy, events) = reader.await.expect("reader");
    for (i, event) in events.iter().enumerate() {
        assert!(
            event.data.starts_with(&format!("{i}:")),
            "event {i} out of order"
        );
    }

    wait_for_metric(&hub, "sse_slow_consumer_disconnects_total", &[], 1.0).await;
    assert!(
        is_closed_within(&mut stalled, WAIT).await,
        "the evicted socket must be closed"
    );
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("sse_slow_consumer_disconnects_total", &[]),
        Some(1.0)
    );
    assert_eq!(
        scrape.value(
            "sse_connections_closed_total",
            &[("reason", "slow_consumer")]
        ),
        Some(1.0)
    );
    assert_eq!(
        scrape.value("router_events_total", &[("result", "queue_full")]),
        Some(1.0)
    );
    assert_eq!(scrape.value("sse_connections", &[]), Some(1.0));
}

/// At a low event rate a client that stopped reading would need minutes to fill its queue; the
/// stall sweep drops it once queued events have waited `sse.stall_timeout` without being
/// written, long before the queue is full. With the sweep off, the same client stays connected:
/// so it is the sweep that evicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_stopped_reading_is_evicted_by_the_stall_timeout_before_its_queue_fills() {
    for (stall_timeout, evicted) in [("1s", true), ("0s", false)] {
        let hub = Hub::builder()
            .env("POSTHORN_SSE__SEND_BUFFER", "4096")
            .env("POSTHORN_SSE__STALL_TIMEOUT", stall_timeout)
            .start()
            .await;
        let mut stalled =
            SseClient::connect_raw_never_read(hub.addr(), "/v1/devices/stalled-2/events").await;
        let mut healthy = SseClient::connect(hub.addr(), "/v1/devices/healthy-2/events", &[]).await;
        wait_for_metric(&hub, "sse_connections", &[], 2.0).await;
        // 40 events of 4 KB: about three times what the kernel and actix buffers of the stalled
        // connection absorb, and far below its queue limit of 256.
        let payload = "z".repeat(4096);
        for i in 0..40 {
            broadcast(&hub, &format!("{i}:{payload}")).await;
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        for i in 0..40 {
            let event = healthy.expect_event(WAIT).await;
            assert!(event.data.starts_with(&format!("{i}:")), "event {i}");
        }
        if evicted {
            wait_for_metric(&hub, "sse_slow_consumer_disconnects_total", &[], 1.0).await;
            assert!(is_closed_within(&mut stalled, WAIT).await);
            let scrape = metrics::scrape(hub.addr()).await;
            assert_eq!(
                scrape.value_or_zero("router_events_total", &[("result", "queue_full")]),
                0.0,
                "evicted by the stall sweep, not by a full queue"
            );
        } else {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let scrape = metrics::scrape(hub.addr()).await;
            assert_eq!(scrape.value("sse_connections", &[]), Some(2.0));
            assert_eq!(
                scrape.value_or_zero("sse_slow_consumer_disconnects_total", &[]),
                0.0
            );
        }
        assert_eq!(
            metrics::scrape(hub.addr())
                .await
                .value_or_zero("sse_connections_closed_total", &[("reason", "client")]),
            0.0
        );
    }
}

/// Round after round of clients that never read are evicted, and the hub's resident memory stops
/// growing once the allocator has reached its working set: what each evicted connection had
/// queued is released. A leak of the queues alone would add about 80 MB per round here (40
/// clients × 64 queued events × 32 KB), so four late rounds would add over 300 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_connections_release_their_memory() {
    const ROUNDS: usize = 8;
    const CLIENTS: usize = 40;
    const QUEUE: usize = 64;
    let hub = Hub::builder()
        .env("POSTHORN_SSE__QUEUE_LIMIT", QUEUE.to_string())
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        // Keep the log's own share small (150 broadcasts of 32 KB at most).
        .env("POSTHORN_MEMORY__MAX_LEN", "150")
        .start()
        .await;
    let payload = "y".repeat(32 * 1024);
    let mut rss = Vec::new();
    for round in 0..ROUNDS {
        let mut stalled: Vec<TcpStream> = Vec::new();
        for i in 0..CLIENTS {
            stalled.push(
                SseClient::connect_raw_never_read(
                    hub.addr(),
                    &format!("/v1/devices/stall-{round}-{i}/events"),
                )
                .await,
            );
        }
        wait_for_metric(&hub, "sse_connections", &[], CLIENTS as f64).await;
        // Enough to overflow every queue: QUEUE events queued plus what socket buffers hold.
        for i in 0..QUEUE + 40 {
            broadcast(&hub, &format!("{round}-{i}:{payload}")).await;
        }
        let evicted = ((round + 1) * CLIENTS) as f64;
        wait_for_metric(&hub, "sse_slow_consumer_disconnects_total", &[], evicted).await;
        for stream in &mut stalled {
            assert!(is_closed_within(stream, WAIT).await);
        }
        wait_for_metric(
            &hub,
            "sse_connections_closed_total",
            &[("reason", "slow_consumer")],
            evicted,
        )
        .await;
        rss.push(hub.rss_bytes());
    }
    // The first rounds grow the allocator's working set (freed memory is kept for reuse, and
    // jemalloc returns unused pages only after its decay time), so later rounds may still add
    // some tens of MB without any leak; a leak of the evicted queues would add over 300 MB here.
    let growth = rss[ROUNDS - 1].saturating_sub(rss[ROUNDS - 5]);
    assert!(
        growth < 120 * 1024 * 1024,
        "RSS grew by {} MB over the last four rounds: {rss:?}",
        growth / (1024 * 1024)
    );
}

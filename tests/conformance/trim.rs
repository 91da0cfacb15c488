//! Trimming that overtakes a reader: entries removed (by the length cap or an operator's trim)
//! before the tail or a replay read them are a gap the client hears of as `resync` `expired`,
//! never a silent jump.

use std::time::Duration;

use serde_json::{json, Value};

use crate::env::{neighbour, Env, Fault};
use crate::support::{live_stream, SseClient, SseEvent, SseNext};
use crate::{publish_ok, resume, resync_reason, WAIT};

/// How long a stream must stay silent before the scenario takes it as finished.
const SETTLED: Duration = Duration::from_secs(2);

/// Events whose data are `first, first + 1, ...` in publish order: what the client read,
/// checked for the promise "every event once, in order, or an explicit resync" (from the first
/// event on). Returns the numbers received and how many `expired` resyncs came.
fn check_numbered(events: &[SseEvent], first: u64) -> (Vec<u64>, usize) {
    let mut received = Vec::new();
    let mut resyncs = 0;
    let mut resynced = false;
    let mut next = first;
    for event in events {
        if event.event == "resync" {
            assert_eq!(resync_reason(event), "expired", "{event:?}");
            resyncs += 1;
            resynced = true;
            continue;
        }
        let n: u64 = event
            .data
            .split('-')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("not a numbered event: {event:?}"));
        assert!(
            n == next || (resynced && n > next),
            "event {n} came where {next} was due, without a resync before it"
        );
        received.push(n);
        next = n + 1;
        resynced = false;
    }
    (received, resyncs)
}

/// Reads `client` until it has been silent for [`SETTLED`].
async fn read_until_settled(client: &mut SseClient) -> Vec<SseEvent> {
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT * 3;
    loop {
        match client.next_event(SETTLED).await {
            SseNext::Event(event) => events.push(event),
            SseNext::Timeout => return events,
            other => panic!("the stream ended: {other:?} after {} events", events.len()),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream never settled"
        );
    }
}

/// One publish request appends far more entries to one device than the length cap keeps, so
/// that by the time the tail reads, most of them are gone: the live client gets the ones still
/// there, with `resync` `expired` before the first one after the gap, then live events again.
pub async fn trimming_ahead_of_the_tail_gives_expired(env: &mut Env) {
    if !env.part("one batch longer than the length cap", &[Fault::LengthCap]) {
        // JetStream keeps by age only; its tail's sequence checks are tested in nats_backend.
        return;
    }
    let hub = env
        .hub_with_length_cap(5)
        .env("POSTHORN_SSE__QUEUE_LIMIT", "1000")
        .start()
        .await;
    let device = "pos-trimmed-live";
    let mut client = live_stream(&hub, device).await;
    let batch: Vec<Value> = (0..300)
        .map(|n| json!({ "device": device, "type": "test", "data": n.to_string() }))
        .collect();
    publish_ok(&hub, &json!(batch)).await;
    let events = read_until_settled(&mut client).await;
    let (received, resyncs) = check_numbered(&events, 0);
    assert_eq!(received.last(), Some(&299), "the newest entry arrives");
    assert!(
        received.len() == 300 || resyncs > 0,
        "{} of 300 events arrived and no resync said why",
        received.len()
    );
    publish_ok(
        &hub,
        &json!({ "device": device, "type": "test", "data": "300" }),
    )
    .await;
    let next = client.expect_event(WAIT).await;
    assert_eq!(next.data, "300", "live events follow");
}

/// A replay is half-way through its backlog (its client stopped reading inside the first page)
/// when the rest of the backlog is trimmed away: the client gets the events it was being sent,
/// then `resync` `expired` instead of a silent jump or a silent end, then live events.
pub async fn trimming_during_a_replay_gives_expired(env: &mut Env) {
    env.ran("the backlog is trimmed while its replay waits for the client");
    let hub = env.start_hub().await;
    let device = "pos-trimmed-replay";
    // 1,000 events of 16 KB: the first replay page (500 entries, 8 MB) cannot fit in the
    // socket buffers of a client that does not read, so the replay waits inside it.
    let padding = "x".repeat(16 * 1024);
    let mut first = None;
    for chunk in (0..1000u64).collect::<Vec<_>>().chunks(100) {
        let batch: Vec<Value> = chunk
            .iter()
            .map(|n| json!({ "device": device, "type": "test", "data": format!("{n}-{padding}") }))
            .collect();
        let results = publish_ok(&hub, &json!(batch)).await;
        first.get_or_insert_with(|| results[0]["id"].as_str().expect("id").to_string());
    }
    // The tail must have routed the whole backlog before the client resumes: entries it read
    // later would reach the client's queue live while the client does not read, and fill it
    // (an eviction, which is right for such a client but not what this scenario is about). A
    // marker for another device of the same shard comes after all of them.
    let marker_device = neighbour(device);
    let mut marker = live_stream(&hub, &marker_device).await;
    publish_ok(
        &hub,
        &json!({ "device": marker_device, "type": "test", "data": "marker" }),
    )
    .await;
    assert_eq!(marker.expect_event(WAIT).await.data, "marker");
    let mut client = resume(&hub, device, first.as_deref().expect("published")).await;
    let opening = client.expect_event(WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.trim(&hub, device, 0).await;

    let mut events = vec![opening];
    events.extend(read_until_settled(&mut client).await);
    let (received, resyncs) = check_numbered(&events, 1);
    assert_eq!(
        received.first(),
        Some(&1),
        "the replay starts after the cursor"
    );
    assert!(
        received.len() < 999,
        "the whole backlog arrived: the trim came too late to test anything"
    );
    assert!(
        resyncs > 0,
        "{} of 999 events arrived and no resync said why",
        received.len()
    );
    publish_ok(
        &hub,
        &json!({ "device": device, "type": "test", "data": "1000" }),
    )
    .await;
    let next = client.expect_event(WAIT).await;
    assert_eq!(next.data, "1000", "live events follow");
}

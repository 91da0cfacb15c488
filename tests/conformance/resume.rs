//! Resuming after a cursor: what is replayed, what a cursor that cannot be resumed answers, and
//! moving between pods.

use serde_json::{json, Value};

use crate::env::{device_on_shard, neighbour, Env, Fault};
use crate::support::{live_stream, metrics, stream_path, SseClient};
use crate::{assert_quiet, data_of, epoch_of, publish_ok, publish_to, resume, resync_reason, WAIT};

/// Reconnecting with `Last-Event-ID` replays exactly the device's missed events and its shard's
/// broadcasts (and, where producers exist, an external entry), in order, and nothing of another
/// device, of its shard or not; `?last_event_id=` works the same way. Live events follow the
/// replay without a gap or a duplicate, and a cursor at the head replays nothing and goes live.
pub async fn resume_replays_exactly_what_was_missed(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = device_on_shard("pos", 27);
    let other = device_on_shard("pos", 33);
    let mut client = live_stream(&hub, &device).await;
    publish_to(&hub, &device, "e1").await;
    let cursor = publish_to(&hub, &device, "e2").await;
    let seen = client.expect_events(2, WAIT).await;
    assert_eq!(seen[1].id.as_deref(), Some(cursor.as_str()));
    drop(client);

    publish_to(&hub, &device, "e3").await;
    publish_to(&hub, &other, "not for us").await;
    publish_to(&hub, &neighbour(&device), "not for us either").await;
    publish_ok(
        &hub,
        &json!({ "broadcast": true, "type": "notice", "data": "b1" }),
    )
    .await;
    let mut expected = vec!["e3", "b1"];
    if env.part(
        "an external entry in the backlog",
        &[Fault::ExternalProducer],
    ) {
        env.produce(&device, None, "external").await;
        expected.push("external");
    }
    let head = publish_to(&hub, &device, "e4").await;
    expected.push("e4");

    let by_header = [("Last-Event-ID", cursor.as_str())];
    let by_query = format!("{}?last_event_id={cursor}", stream_path(&device));
    for (path, headers) in [(stream_path(&device), &by_header[..]), (by_query, &[][..])] {
        // One after the other: a second stream of the device would take the first one over.
        let mut resumed = SseClient::connect(hub.addr(), &path, headers).await;
        let replayed = resumed.expect_events(expected.len(), WAIT).await;
        assert_eq!(data_of(&replayed), expected, "{path}");
        assert_eq!(replayed[1].event, "notice");
        assert_eq!(replayed.last().unwrap().id.as_deref(), Some(head.as_str()));
        assert_quiet(&mut resumed, "nothing more to replay").await;
    }
    env.ran("replay by header and by query");

    let mut resumed = resume(&hub, &device, &cursor).await;
    resumed.expect_events(expected.len(), WAIT).await;
    let e5 = publish_to(&hub, &device, "e5").await;
    assert_eq!(resumed.expect_event(WAIT).await.data, "e5");
    assert_quiet(&mut resumed, "no duplicate after the replay").await;
    drop(resumed);
    env.ran("live after the replay");

    let mut current = resume(&hub, &device, &e5).await;
    assert_quiet(&mut current, "a cursor at the head replays nothing").await;
    publish_to(&hub, &device, "e6").await;
    assert_eq!(current.expect_event(WAIT).await.data, "e6");
    env.ran("a cursor at the head");

    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("sse_replayed_events_total", &[]),
        Some((3 * expected.len()) as f64)
    );
}

/// A resume whose backlog spans several replay pages (500 entries) of entries the device must
/// not see — another device's events on its shard and, where producers exist, entries nobody
/// can deliver — gets every one of its own events (more than a page of them) and its shard's
/// broadcast, and nothing else: a page without a deliverable entry does not end the replay (nor
/// does the live tail stop at them).
pub async fn replay_reads_past_entries_it_cannot_deliver(env: &mut Env) {
    // The whole burst fits in a stream's queue: this client reads only once everything is
    // published, and beyond `sse.queue_limit` (256) it would be evicted as a slow consumer.
    let hub = env
        .hub()
        .env("POSTHORN_SSE__QUEUE_LIMIT", "2048")
        .start()
        .await;
    let device = "pos-9";
    let mut live = live_stream(&hub, device).await;
    let cursor = publish_to(&hub, device, "before").await;
    assert_eq!(live.expect_event(WAIT).await.data, "before");
    if env.part(
        "undeliverable entries in the backlog",
        &[Fault::ExternalProducer],
    ) {
        env.produce_undeliverable(device).await;
    }
    let other = neighbour(device);
    let others: Vec<Value> = (0..1_200)
        .map(|i| json!({ "device": other, "data": format!("other {i}") }))
        .collect();
    for batch in others.chunks(1_000) {
        publish_ok(&hub, &json!(batch)).await;
    }
    publish_ok(&hub, &json!({ "broadcast": true, "data": "all" })).await;
    const EVENTS: usize = 700;
    let own: Vec<Value> = (0..EVENTS)
        .map(|i| json!({ "device": device, "data": i.to_string() }))
        .collect();
    publish_ok(&hub, &json!(own)).await;
    env.ran("a backlog of 1,200 entries of another device, then 701 of its own");
    let expected: Vec<String> = std::iter::once("all".to_string())
        .chain((0..EVENTS).map(|i| i.to_string()))
        .collect();
    // Once the live stream has all of it, the tail has read past the backlog too.
    assert_eq!(
        data_of(&live.expect_events(EVENTS + 1, WAIT).await),
        expected
    );
    drop(live);

    let mut resumed = resume(&hub, device, &cursor).await;
    let replayed = data_of(&resumed.expect_events(EVENTS + 1, WAIT).await);
    assert_eq!(replayed, expected);
    assert_quiet(&mut resumed, "nothing else").await;
}

/// Percent-encodes everything but unreserved characters, for a cursor in a query string.
fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A cursor that cannot be resumed yields one `resync` with its reason and the shard's head id,
/// then only live events; the resync id itself is a valid cursor afterwards. Unparsable cursors
/// and a cursor of another shard are `invalid`, one of another epoch is `data_lost`, and one
/// older than what was trimmed is `expired`; each is counted by reason.
pub async fn unusable_cursors_get_resync_with_reason_and_head_id(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = device_on_shard("pos", 27);
    let other = device_on_shard("pos", 33);
    let oldest = publish_to(&hub, &device, "old").await;
    for i in 0..5 {
        publish_to(&hub, &device, &format!("n{i}")).await;
    }
    let other_shard = publish_to(&hub, &other, "x").await;
    env.trim(&hub, &device, 1).await;
    let mut head = publish_to(&hub, &device, "after the trim").await;
    let (epoch, rest) = oldest.split_once('.').expect("epoch.shard.position");
    let cases = [
        ("garbage", "invalid".to_string()),
        (&"9".repeat(10_000), "invalid".to_string()),
        ("-1", "invalid".to_string()),
        ("ünïcödé.1.2-3", "invalid".to_string()),
        (&other_shard, "invalid".to_string()),
        (&format!("zz{epoch}.{rest}"), "data_lost".to_string()),
        (&oldest, "expired".to_string()),
    ];
    for (cursor, reason) in &cases {
        let path = format!(
            "{}?last_event_id={}",
            stream_path(&device),
            urlencode(cursor)
        );
        let mut client = SseClient::connect(hub.addr(), &path, &[]).await;
        assert_eq!(client.status(), 200);
        let event = client.expect_event(WAIT).await;
        assert_eq!(&resync_reason(&event), reason, "cursor {cursor:?}");
        assert_eq!(
            event.id.as_deref(),
            Some(head.as_str()),
            "resync carries the head id"
        );
        let live = publish_to(&hub, &device, "after").await;
        let next = client.expect_event(WAIT).await;
        assert_eq!(
            (next.id.as_deref(), next.data.as_str()),
            (Some(live.as_str()), "after")
        );
        head = live;
    }
    let mut client = resume(&hub, &device, &head).await;
    assert_quiet(&mut client, "the last id is a valid cursor").await;
    let scrape = metrics::scrape(hub.addr()).await;
    for (reason, count) in [("invalid", 5.0), ("data_lost", 1.0), ("expired", 1.0)] {
        assert_eq!(
            scrape.value("sse_resyncs_total", &[("reason", reason)]),
            Some(count),
            "{reason}"
        );
    }
}

/// Entries removed by trimming (as retention and the length cap do) are not skipped silently:
/// a cursor older than what was removed gets `resync` `expired` carrying the head id, then only
/// live events, and that id resumes normally afterwards; a cursor at the entry that was kept
/// resumes without a resync.
pub async fn trimmed_entries_give_expired(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = "pos-1";
    let e1 = publish_to(&hub, device, "e1").await;
    publish_to(&hub, device, "e2").await;
    publish_to(&hub, device, "e3").await;
    let e4 = publish_to(&hub, device, "e4").await;
    env.trim(&hub, device, 1).await;

    let mut kept = resume(&hub, device, &e4).await;
    assert_quiet(&mut kept, "a cursor at the kept entry missed nothing").await;
    drop(kept);

    let mut expired = resume(&hub, device, &e1).await;
    let resync = expired.expect_event(WAIT).await;
    assert_eq!(resync_reason(&resync), "expired");
    let resync_id = resync.id.clone().expect("a resync carries the head id");
    assert_eq!(
        epoch_of(&resync_id),
        epoch_of(&e1),
        "no loss, the same life"
    );
    publish_to(&hub, device, "e5").await;
    assert_eq!(
        expired.expect_event(WAIT).await.data,
        "e5",
        "only live events after the resync"
    );
    drop(expired);

    let mut after = resume(&hub, device, &resync_id).await;
    assert_eq!(after.expect_event(WAIT).await.data, "e5");
    assert_quiet(&mut after, "the resync id resumes after the head").await;
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("sse_resyncs_total", &[("reason", "expired")]),
        Some(1.0)
    );
}

/// Two hub pods on one backend: a client reads part of its events on pod A, disconnects,
/// resumes on pod B from its cursor with no loss and no duplicate, then gets live events
/// published through pod A. A memory backend belongs to its pod, so there a cursor of pod A is
/// of another life on pod B: `data_lost`, then pod B's events.
pub async fn a_client_moves_between_pods_without_loss(env: &mut Env) {
    let pod_a = env.start_hub().await;
    let pod_b = env.start_hub().await;
    let device = "pos-5";
    let mut on_a = live_stream(&pod_a, device).await;
    for i in 0..5 {
        publish_to(&pod_a, device, &i.to_string()).await;
    }
    let seen = on_a.expect_events(5, WAIT).await;
    let cursor = seen[2].id.clone().expect("id");
    drop(on_a);
    if env.part("one store behind two pods", &[Fault::SharedStore]) {
        for i in 5..8 {
            publish_to(&pod_b, device, &i.to_string()).await;
        }
        let mut on_b = resume(&pod_b, device, &cursor).await;
        let data = data_of(&on_b.expect_events(5, WAIT).await);
        assert_eq!(data, ["3", "4", "5", "6", "7"]);
        publish_to(&pod_a, device, "8").await;
        assert_eq!(on_b.expect_event(WAIT).await.data, "8");
        assert_quiet(&mut on_b, "no duplicate").await;
    } else {
        let mut on_b = resume(&pod_b, device, &cursor).await;
        let resync = on_b.expect_event(WAIT).await;
        assert_eq!(resync_reason(&resync), "data_lost");
        assert_ne!(epoch_of(resync.id.as_deref().unwrap()), epoch_of(&cursor));
        publish_to(&pod_b, device, "on b").await;
        assert_eq!(on_b.expect_event(WAIT).await.data, "on b");
        env.ran("instead: a cursor of another pod's memory is data_lost");
    }
}

//! Appends and live delivery: order, ids, broadcast copies, and where a tail starts.

use serde_json::json;

use crate::env::{device_on_shard, shard, Env, Fault, SHARDS};
use crate::support::{http, live_stream, metrics, SseEvent};
use crate::{assert_quiet, data_of, publish_ok, publish_to, WAIT};

/// Two devices on different shards, neither on shard 0.
fn devices_on_two_shards() -> (String, String) {
    let (a, b) = (device_on_shard("pos-a", 5), device_on_shard("pos-b", 40));
    assert_ne!(shard(&a), shard(&b));
    (a, b)
}

/// Live events arrive in the order they were appended, each with the id, type and data the
/// publish answered: single items and a batch for two devices on different shards (answered in
/// input order; string data as its text, other JSON values compact; CR, LF and CRLF come back
/// as LF lines), with a broadcast between them; nothing else arrives. The tail reports its lag
/// from these events (`<backend>_tail_lag_seconds`).
pub async fn live_events_arrive_in_order_as_published(env: &mut Env) {
    let hub = env.start_hub().await;
    let (a, b) = devices_on_two_shards();
    let mut on_a = live_stream(&hub, &a).await;
    let mut on_b = live_stream(&hub, &b).await;

    let one = publish_ok(
        &hub,
        &json!({"device": a, "type": "order.paid", "data": "paid 12.50"}),
    )
    .await;
    // Raw text, so that the object payload carries whitespace the hub must compact.
    let body = format!(
        r#"[
            {{"device": "{a}", "data": "plain text"}},
            {{"device": "{b}", "type": "t.b", "data": {{"a": [1, 2]}}}},
            {{"device": "{a}", "type": "t.num", "data": 42}},
            {{"device": "{a}", "data": "line 1\r\nline 2\rline 3\nid: forged"}}
        ]"#
    );
    let response = http::post_raw(
        hub.addr(),
        "/v1/events",
        "application/json",
        body.as_bytes(),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    let batch = response.json()["results"].clone();
    assert_eq!(batch.as_array().map(Vec::len), Some(4), "{batch}");
    let broadcast = publish_ok(
        &hub,
        &json!({"broadcast": true, "type": "notice", "data": "to all"}),
    )
    .await;
    let last_b = publish_to(&hub, &b, "last b").await;
    let last_a = publish_to(&hub, &a, "last a").await;
    let id = |result: &serde_json::Value| Some(result["id"].as_str().expect("id").to_string());
    let event = |id: Option<String>, event: &str, data: &str| SseEvent {
        id,
        event: event.into(),
        data: data.into(),
    };

    let seen_a = on_a.expect_events(6, WAIT).await;
    assert_eq!(
        seen_a,
        [
            event(id(&one[0]), "order.paid", "paid 12.50"),
            event(id(&batch[0]), "message", "plain text"),
            event(id(&batch[2]), "t.num", "42"),
            event(
                id(&batch[3]),
                "message",
                "line 1\nline 2\nline 3\nid: forged"
            ),
            event(seen_a[4].id.clone(), "notice", "to all"),
            event(Some(last_a), "test", "last a"),
        ]
    );
    let seen_b = on_b.expect_events(3, WAIT).await;
    assert_eq!(
        seen_b,
        [
            event(id(&batch[1]), "t.b", r#"{"a":[1,2]}"#),
            event(seen_b[1].id.clone(), "notice", "to all"),
            event(Some(last_b), "test", "last b"),
        ]
    );
    // A broadcast answers with its copy on shard 0; each device sees its own shard's copy.
    assert!(broadcast[0]["id"].is_string(), "{broadcast:?}");
    assert_ne!(seen_a[4].id, seen_b[1].id, "one copy per shard");
    assert_quiet(&mut on_a, "nothing else for a").await;
    assert_quiet(&mut on_b, "nothing else for b").await;
    env.ran("order, ids, types and data of single and batch publishes");

    let scrape = metrics::scrape(hub.addr()).await;
    let lag = format!("{}_tail_lag_seconds", env.kind().config_kind());
    let groups = scrape.matching(&lag, &[]);
    assert!(!groups.is_empty(), "no {lag}");
    for sample in groups {
        assert!((0.0..5.0).contains(&sample.value), "{lag}: {sample:?}");
    }
    env.ran("tail lag");
}

/// A broadcast is one copy per shard: a device on each of the 64 shards receives it exactly
/// once (a marker after it is its next event), and the backend stores one entry per shard.
pub async fn a_broadcast_reaches_every_shard_once(env: &mut Env) {
    let hub = env.start_hub().await;
    let devices: Vec<String> = (0..SHARDS).map(|on| device_on_shard("b", on)).collect();
    let mut clients = Vec::new();
    for device in &devices {
        clients.push(live_stream(&hub, device).await);
    }
    publish_ok(
        &hub,
        &json!({"broadcast": true, "type": "price.update", "data": {"sku": 7}}),
    )
    .await;
    for device in &devices {
        publish_to(&hub, device, "marker").await;
    }
    for (client, device) in clients.iter_mut().zip(&devices) {
        let events = client.expect_events(2, WAIT).await;
        assert_eq!(
            (events[0].event.as_str(), events[0].data.as_str()),
            ("price.update", r#"{"sku":7}"#),
            "on {device}"
        );
        assert_eq!(events[1].data, "marker", "one copy on {device}");
    }
    env.ran("every shard's device receives one copy");
    if env.part("one stored entry per shard", &[Fault::InspectStore]) {
        assert_eq!(
            env.stored_entries().await,
            u64::from(SHARDS) * 2,
            "64 broadcast copies and 64 markers"
        );
    }
}

/// Tails start at "now": a hub delivers only entries appended after its tail opened, so a
/// stream opened without a cursor gets no backlog: not what an external producer appended
/// before the hub started, not what the device was sent before (and received on an earlier
/// stream), and, on a pod started later, nothing other pods appended before it started.
pub async fn a_tail_starts_at_now(env: &mut Env) {
    let device = "pos-3";
    if env.part(
        "entries appended while no hub ran",
        &[Fault::ExternalProducer],
    ) {
        // A first hub creates what the backend needs (a JetStream stream does not exist before).
        drop(env.start_hub().await);
        env.produce(device, None, "while no hub ran").await;
    }
    let hub = env.start_hub().await;
    // Received on a first stream, so the tail has read it before the second stream opens (an
    // event the tail reads after a stream registered is that stream's, whenever it was
    // published).
    let mut first = live_stream(&hub, device).await;
    publish_to(&hub, device, "before the stream").await;
    assert_eq!(first.expect_event(WAIT).await.data, "before the stream");
    drop(first);
    let mut client = live_stream(&hub, device).await;
    let after = publish_to(&hub, device, "after").await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(
        (event.id.as_deref(), event.data.as_str()),
        (Some(after.as_str()), "after")
    );
    assert_quiet(&mut client, "nothing from before the stream").await;
    env.ran("no backlog for a stream without a cursor");

    if env.part("a pod started later", &[Fault::SharedStore]) {
        drop(client);
        let later = env.start_hub().await;
        let mut on_later = live_stream(&later, device).await;
        publish_to(&hub, device, "through the first pod").await;
        publish_to(&later, device, "through the later pod").await;
        let events = on_later.expect_events(2, WAIT).await;
        assert_eq!(
            data_of(&events),
            ["through the first pod", "through the later pod"]
        );
        assert_quiet(&mut on_later, "nothing from before the later pod").await;
    }
}

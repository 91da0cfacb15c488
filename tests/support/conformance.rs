//! Scenarios every backend must pass the same way (memory, Redis, NATS): each backend's test file
//! starts a hub on its backend and calls the scenario, so one text states the contract once.

use std::time::Duration;

use serde_json::{json, Value};

use super::{http, live_stream, Hub, SseNext};

const WAIT: Duration = Duration::from_secs(20);

/// Publishes `item` and returns its result object (`id`, `duplicate`).
async fn publish_one(hub: &Hub, item: Value) -> Value {
    let response = http::post_json(hub.addr(), "/v1/events", &item).await;
    assert_eq!(response.status, 201, "{item}: {}", response.text());
    response.json()["results"][0].clone()
}

/// Two devices on different shards (of 64).
const DEVICE: &str = "pos-1";
const OTHER: &str = "pos-17";

/// An idempotency key is the producer's own, scoped to the item's target (one device, or the
/// broadcast): the same key for a broadcast and a unicast, for two devices, or one that looks
/// like a key the hub might derive for a broadcast's copies (`k:3`) never collides; a repeat for
/// the same target is a duplicate answered with the original id (the original's shard), and
/// nothing is appended twice.
pub async fn idempotency_keys_are_scoped_to_their_target(hub: &Hub) {
    assert_ne!(
        crc32fast::hash(DEVICE.as_bytes()) % 64,
        crc32fast::hash(OTHER.as_bytes()) % 64
    );
    let mut client = live_stream(hub, DEVICE).await;
    let broadcast = publish_one(hub, json!({"broadcast": true, "data": "b", "key": "k"})).await;
    let unicast = publish_one(hub, json!({"device": DEVICE, "data": "u", "key": "k"})).await;
    let other = publish_one(hub, json!({"device": OTHER, "data": "o", "key": "k"})).await;
    let lookalikes = [
        publish_one(hub, json!({"device": DEVICE, "data": "k0", "key": "k:0"})).await,
        publish_one(hub, json!({"device": DEVICE, "data": "k3", "key": "k:3"})).await,
    ];
    for first in [&broadcast, &unicast, &other, &lookalikes[0], &lookalikes[1]] {
        assert_eq!(
            first["duplicate"], false,
            "a first use is no duplicate: {first}"
        );
    }
    let repeats = [
        (
            publish_one(hub, json!({"broadcast": true, "data": "b2", "key": "k"})).await,
            &broadcast,
        ),
        (
            publish_one(hub, json!({"device": DEVICE, "data": "u2", "key": "k"})).await,
            &unicast,
        ),
        (
            publish_one(hub, json!({"device": OTHER, "data": "o2", "key": "k"})).await,
            &other,
        ),
    ];
    for (repeat, original) in &repeats {
        assert_eq!(repeat["duplicate"], true, "{repeat}");
        assert_eq!(
            repeat["id"], original["id"],
            "a duplicate carries the original id"
        );
    }
    // One batch that repeats its own key: the second item is the first's duplicate.
    let response = http::post_json(
        hub.addr(),
        "/v1/events",
        &json!([
            {"device": DEVICE, "data": "in batch", "key": "batch"},
            {"device": DEVICE, "data": "in batch again", "key": "batch"},
        ]),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    let results = response.json()["results"].clone();
    assert_eq!(results[1]["duplicate"], true, "{results}");
    assert_eq!(results[1]["id"], results[0]["id"]);

    let data: Vec<String> = client
        .expect_events(5, WAIT)
        .await
        .into_iter()
        .map(|event| event.data)
        .collect();
    assert_eq!(data, ["b", "u", "k0", "k3", "in batch"]);
    assert!(
        matches!(
            client.next_event(Duration::from_millis(500)).await,
            SseNext::Timeout
        ),
        "nothing was appended twice"
    );
}

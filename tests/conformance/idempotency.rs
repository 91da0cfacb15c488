//! Idempotency keys: scoped to their target, atomic with the append, and forgotten with the life
//! of the stream that holds their event.

use std::time::Duration;

use serde_json::{json, Value};

use crate::env::{shard, Env, Fault};
use crate::loss::{lose, Loss};
use crate::support::{live_stream, Hub, SseNext};
use crate::{epoch_of, expect_resync, publish, publish_ok, resume, resync_reason, WAIT};

/// Publishes `item` and returns its result object (`id`, `duplicate`).
async fn publish_one(hub: &Hub, item: Value) -> Value {
    publish_ok(hub, &item).await[0].clone()
}

/// Publishes `item` until the hub answers 201 (503 while the backend has no stream to append
/// to), and returns its result object.
async fn publish_one_until_accepted(hub: &Hub, item: &Value) -> Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let response = publish(hub, item).await;
        if response.status == 201 {
            return response.json()["results"][0].clone();
        }
        assert_eq!(response.status, 503, "{}", response.text());
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            response.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Bug pinned: an idempotency key collided across targets. On memory a key was
/// global, so the same key for another device or for a broadcast was answered `duplicate` and
/// never appended; on Redis keys were remembered per node group (a unicast after a broadcast
/// with the same key was a duplicate in group 0 only), and a duplicate's id was rebuilt with
/// the new item's shard; on NATS a broadcast's copies used message ids `{key}:{shard}`, so a
/// later unicast with key `k:3` was answered `duplicate` and never appended.
///
/// Now a key is the producer's own, scoped to the item's target (one device, or the broadcast):
/// the same key for a broadcast and a unicast, for two devices, or one that looks like a key the
/// hub might derive for a broadcast's copies (`k:3`) never collides; a repeat for the same
/// target, in a later request or in the same batch, is a duplicate answered with the original
/// id (the original's shard), another key in that batch is appended, and nothing is appended
/// twice.
pub async fn idempotency_keys_are_scoped_to_their_target(env: &mut Env) {
    const DEVICE: &str = "pos-1";
    const OTHER: &str = "pos-17";
    assert_ne!(shard(DEVICE), shard(OTHER));
    let hub = env.start_hub().await;
    let mut client = live_stream(&hub, DEVICE).await;
    let broadcast = publish_one(&hub, json!({"broadcast": true, "data": "b", "key": "k"})).await;
    let unicast = publish_one(&hub, json!({"device": DEVICE, "data": "u", "key": "k"})).await;
    let other = publish_one(&hub, json!({"device": OTHER, "data": "o", "key": "k"})).await;
    let lookalikes = [
        publish_one(&hub, json!({"device": DEVICE, "data": "k0", "key": "k:0"})).await,
        publish_one(&hub, json!({"device": DEVICE, "data": "k3", "key": "k:3"})).await,
    ];
    for first in [&broadcast, &unicast, &other, &lookalikes[0], &lookalikes[1]] {
        assert_eq!(
            first["duplicate"], false,
            "a first use is no duplicate: {first}"
        );
    }
    let repeats = [
        (
            publish_one(&hub, json!({"broadcast": true, "data": "b2", "key": "k"})).await,
            &broadcast,
        ),
        (
            publish_one(&hub, json!({"device": DEVICE, "data": "u2", "key": "k"})).await,
            &unicast,
        ),
        (
            publish_one(&hub, json!({"device": OTHER, "data": "o2", "key": "k"})).await,
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
    let results = publish_ok(
        &hub,
        &json!([
            {"device": DEVICE, "data": "in batch", "key": "batch"},
            {"device": DEVICE, "data": "in batch again", "key": "batch"},
            {"device": DEVICE, "data": "other key", "key": "batch 2"},
        ]),
    )
    .await;
    assert_eq!(results[0]["duplicate"], false, "{results:?}");
    assert_eq!(results[1]["duplicate"], true, "{results:?}");
    assert_eq!(results[1]["id"], results[0]["id"]);
    assert_eq!(results[2]["duplicate"], false, "{results:?}");
    assert_ne!(results[2]["id"], results[0]["id"]);

    let events = client.expect_events(6, WAIT).await;
    let data: Vec<&str> = events.iter().map(|event| event.data.as_str()).collect();
    assert_eq!(data, ["b", "u", "k0", "k3", "in batch", "other key"]);
    assert_eq!(events[1].id.as_deref(), unicast["id"].as_str());
    assert!(
        matches!(
            client.next_event(Duration::from_millis(500)).await,
            SseNext::Timeout
        ),
        "nothing was appended twice"
    );
    env.ran("keys per target, repeats across requests and within a batch");
}

/// Bug pinned (found while documenting): a key answered in a life of the stream that was lost
/// afterwards (DEL) kept answering `duplicate` with the lost event's id, and the pod took that
/// old id for a position it had stored, so it ended the stream's healthy new life about 2 s
/// later (a second `data_lost`). Now the key is forgotten with its life: the retry is stored
/// anew, and the client hears of the loss once. Where one stream cannot be lost alone, all data
/// is (NATS: the stream is deleted), or the hub restarts (memory: the retry is stored anew in the
/// new process's life).
pub async fn a_key_answered_in_a_lost_life_is_forgotten(env: &mut Env) {
    let mut hub = env.start_hub().await;
    let device = "pos-9";
    let mut connected = live_stream(&hub, device).await;
    let event = json!({ "device": device, "data": "keyed", "key": "k-9" });
    let first = publish_one(&hub, event.clone()).await;
    assert_eq!(connected.expect_event(WAIT).await.data, "keyed");

    let lost = lose(env, &mut hub, device, &[Loss::OneStream, Loss::AllData]).await;
    if lost.hub_survived() {
        let resync = expect_resync(&mut connected, lost.notice()).await;
        assert_eq!(resync_reason(&resync), "data_lost");
    }
    let retry = publish_one_until_accepted(&hub, &event).await;
    assert_eq!(retry["duplicate"], false, "{retry}");
    assert_ne!(retry["id"], first["id"]);
    let retry_id = retry["id"].as_str().expect("id");
    assert_ne!(epoch_of(retry_id), epoch_of(first["id"].as_str().unwrap()));
    if lost.hub_survived() {
        assert_eq!(connected.expect_event(WAIT).await.data, "keyed");
        assert!(
            matches!(
                connected.next_event(Duration::from_secs(4)).await,
                SseNext::Timeout
            ),
            "no second resync: the new life is healthy"
        );
    } else {
        let mut back = resume(&hub, device, retry_id).await;
        assert!(
            matches!(
                back.next_event(Duration::from_secs(4)).await,
                SseNext::Timeout
            ),
            "the retry's id is a cursor of the new life"
        );
    }
}

/// Found in review: a retried broadcast whose key was remembered with its copy on the group's
/// first stream was appended to every stream again when that one stream had lost its life (a
/// DEL): devices on the other shards got it twice. A broadcast's key now stands; a device's key
/// is forgotten with its stream's life (`a_key_answered_in_a_lost_life_is_forgotten`). Where one
/// stream cannot be lost alone (NATS, memory), the retry runs without a loss. With
/// `publish.dedupe_window = 0s` nothing is remembered and a keyed publish still works.
pub async fn a_broadcast_key_stands_when_one_of_its_streams_is_lost(env: &mut Env) {
    let hub = env.start_hub().await;
    assert_ne!(shard("pos-17"), 0);
    let mut other_shard = live_stream(&hub, "pos-17").await;
    let broadcast = json!({ "broadcast": true, "data": "once", "key": "b-1" });
    publish_ok(&hub, &broadcast).await;
    assert_eq!(other_shard.expect_event(WAIT).await.data, "once");
    if env.part("shard 0's stream deleted", &[Fault::LoseOneStream]) {
        env.lose_stream_of_shard(0).await;
    }
    let retry = publish_one(&hub, broadcast).await;
    assert_eq!(retry["duplicate"], true, "{retry}");
    assert!(
        matches!(
            other_shard.next_event(Duration::from_secs(1)).await,
            SseNext::Timeout
        ),
        "no second copy"
    );
    env.ran("a retried broadcast is a duplicate");

    if env.part(
        "dedupe_window = 0s remembers nothing",
        &[Fault::ZeroDedupeWindow],
    ) {
        let forgetful = env
            .hub()
            .env("POSTHORN_PUBLISH__DEDUPE_WINDOW", "0s")
            .start()
            .await;
        for _ in 0..2 {
            let keyed = publish_one(
                &forgetful,
                json!({ "device": "pos-2", "data": "x", "key": "k" }),
            )
            .await;
            assert_eq!(keyed["duplicate"], false, "{keyed}");
        }
    }
}

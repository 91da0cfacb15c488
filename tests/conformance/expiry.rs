//! Expiry (`ttl`, stored as `exp`) and supersede (`supersede`, stored as `sup`) of events
//! (docs/http-api.md, docs/stream-format.md): an expired event is neither delivered live nor
//! replayed; on replay only the newest event of a (target, supersede name) is sent, while live
//! delivery sends every version.
//!
//! The scenarios are registered here rather than in main.rs, so that `-- expiry::` selects
//! exactly them: `expiry::<scenario>::<backend>`.

use std::time::Duration;

use serde_json::json;

// `env` too: the generated scenario modules reach it as `super::env`.
use crate::env::{self, device_on_shard, neighbour, Env, Fault};
use crate::support::{live_stream, metrics, Hub};
use crate::{assert_quiet, data_of, publish_ok, publish_to, resume, WAIT};

// Lets the scenario modules the macro generates name this file's scenarios as `expiry::...`.
use crate::expiry;

conformance! {
    expiry::an_expired_event_is_not_delivered_live,
    expiry::events_that_expired_while_away_are_not_replayed,
    expiry::only_the_newest_of_a_name_is_replayed,
    expiry::live_delivery_sends_every_version,
    expiry::external_producers_set_exp_and_sup,
}

/// An `exp` long past, in Unix ms.
const PAST: &str = "1000";

/// Publishes one `test` event for `device` with the item options `extra` (`ttl`, `supersede`);
/// returns its id.
async fn publish_with(hub: &Hub, device: &str, data: &str, extra: serde_json::Value) -> String {
    let mut item = json!({ "device": device, "type": "test", "data": data });
    for (key, value) in extra.as_object().expect("options are an object") {
        item[key] = value.clone();
    }
    publish_ok(hub, &item).await[0]["id"]
        .as_str()
        .expect("id")
        .to_string()
}

/// Publishes one broadcast of type `notice` with `supersede` `name`.
async fn broadcast_versioned(hub: &Hub, data: &str, name: &str) {
    publish_ok(
        hub,
        &json!({ "broadcast": true, "type": "notice", "data": data, "supersede": name }),
    )
    .await;
}

/// `events_expired_total{path}` and `events_superseded_total` as scraped.
async fn counts(hub: &Hub) -> (f64, f64, f64) {
    let scrape = metrics::scrape(hub.addr()).await;
    (
        scrape.value_or_zero("events_expired_total", &[("path", "live")]),
        scrape.value_or_zero("events_expired_total", &[("path", "replay")]),
        scrape.value_or_zero("events_superseded_total", &[]),
    )
}

/// An event whose `exp` has passed when the tail reads it is not delivered live, and is counted
/// in `events_expired_total{path="live"}`; an event with a `ttl` that has not passed is
/// delivered. The hub's own `ttl` is at least 1 ms after the publish, so an event that arrives
/// expired comes from an external producer that wrote an `exp` in the past; memory, which has
/// none, checks that a fresh `ttl` event is delivered and that the counter is exported at 0
/// (the drop itself is unit-tested in src/actors/stream_tail.rs).
pub async fn an_expired_event_is_not_delivered_live(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = "pos-7";
    let mut client = live_stream(&hub, device).await;
    let mut expired = 0.0;
    if env.part(
        "an entry written with an exp in the past",
        &[Fault::ExternalProducer],
    ) {
        env.produce_with(device, "print receipt", Some(PAST), None)
            .await;
        expired = 1.0;
    }
    publish_with(&hub, device, "fresh", json!({ "ttl": "10m" })).await;
    let event = client.expect_event(WAIT).await;
    assert_eq!(event.data, "fresh", "the expired entry came first");
    assert_quiet(&mut client, "nothing else").await;
    assert_eq!(counts(&hub).await.0, expired);
    env.ran("only the fresh event arrives live");
}

/// Events whose `ttl` passed while the device was away are not replayed (unicast and
/// broadcast); the others are, in order, also those with a `ttl` still running, and the expired
/// ones are counted in `events_expired_total{path="replay"}`. Where producers exist, an entry
/// with an `exp` of its own is judged the same way.
pub async fn events_that_expired_while_away_are_not_replayed(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = device_on_shard("pos", 11);
    let cursor = publish_to(&hub, &device, "before").await;
    publish_to(&hub, &device, "keep 1").await;
    publish_with(&hub, &device, "print receipt", json!({ "ttl": "1s" })).await;
    publish_with(&hub, &device, "keep 2", json!({ "ttl": "10m" })).await;
    publish_ok(
        &hub,
        &json!({ "broadcast": true, "type": "notice", "data": "short notice", "ttl": "1s" }),
    )
    .await;
    let mut expected = vec!["keep 1", "keep 2"];
    let mut expired = 2.0;
    if env.part(
        "entries with an exp of their own",
        &[Fault::ExternalProducer],
    ) {
        env.produce_with(&device, "external past", Some(PAST), None)
            .await;
        let later = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("the clock is after 1970")
            .as_millis()
            + 600_000)
            .to_string();
        env.produce_with(&device, "external future", Some(&later), None)
            .await;
        expected.push("external future");
        expired += 1.0;
    }
    publish_to(&hub, &device, "keep 3").await;
    expected.push("keep 3");
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let mut resumed = resume(&hub, &device, &cursor).await;
    let replayed = resumed.expect_events(expected.len(), WAIT).await;
    assert_eq!(data_of(&replayed), expected);
    assert_quiet(&mut resumed, "nothing expired follows").await;
    assert_eq!(counts(&hub).await.1, expired);
    env.ran("expired events are left out of the replay");
}

/// On replay, of the events after the cursor with one supersede name, only the newest is sent;
/// events without a name, and of other names, are untouched and keep their order. The name is
/// scoped to the target: the device's unicast versions and the broadcast versions of the same
/// name each keep their newest, and another device's version on the same shard supersedes
/// nothing of ours. A cursor after the newest version replays none of them.
pub async fn only_the_newest_of_a_name_is_replayed(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = device_on_shard("pos", 21);
    let cursor = publish_to(&hub, &device, "before").await;
    let prices = json!({ "supersede": "prices" });
    publish_with(&hub, &device, "prices v1", prices.clone()).await;
    publish_to(&hub, &device, "order 1").await;
    broadcast_versioned(&hub, "all prices v1", "prices").await;
    publish_with(&hub, &device, "prices v2", prices.clone()).await;
    publish_with(&hub, &device, "menu v1", json!({ "supersede": "menu" })).await;
    let newest = publish_with(&hub, &device, "prices v3", prices.clone()).await;
    publish_with(&hub, &neighbour(&device), "their prices", prices.clone()).await;
    broadcast_versioned(&hub, "all prices v2", "prices").await;
    publish_to(&hub, &device, "order 2").await;

    let mut resumed = resume(&hub, &device, &cursor).await;
    let expected = [
        "order 1",
        "menu v1",
        "prices v3",
        "all prices v2",
        "order 2",
    ];
    let replayed = resumed.expect_events(expected.len(), WAIT).await;
    assert_eq!(data_of(&replayed), expected);
    assert_eq!(replayed[2].id.as_deref(), Some(newest.as_str()));
    assert_quiet(&mut resumed, "no older version follows").await;
    drop(resumed);
    assert_eq!(counts(&hub).await.2, 3.0, "prices v1, v2 and all prices v1");
    env.ran("only the newest version per target is replayed");

    let mut resumed = resume(&hub, &device, &newest).await;
    let replayed = resumed.expect_events(2, WAIT).await;
    assert_eq!(data_of(&replayed), ["all prices v2", "order 2"]);
    assert_quiet(&mut resumed, "nothing more").await;
    env.ran("a cursor after the newest version");
}

/// Supersede changes replays only: a live stream gets every version of a name, in order.
pub async fn live_delivery_sends_every_version(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = "pos-31";
    let mut client = live_stream(&hub, device).await;
    for version in ["prices v1", "prices v2", "prices v3"] {
        publish_with(&hub, device, version, json!({ "supersede": "prices" })).await;
    }
    broadcast_versioned(&hub, "all prices v1", "prices").await;
    broadcast_versioned(&hub, "all prices v2", "prices").await;
    let events = client.expect_events(5, WAIT).await;
    assert_eq!(
        data_of(&events),
        [
            "prices v1",
            "prices v2",
            "prices v3",
            "all prices v1",
            "all prices v2"
        ]
    );
    assert_quiet(&mut client, "nothing else").await;
    assert_eq!(counts(&hub).await.2, 0.0);
    env.ran("every version arrives live");
}

/// Entries of external producers that set `exp` and `sup` themselves (Redis fields, NATS
/// headers): an expired one is neither replayed nor delivered live. Their supersede names do
/// not move the index (docs/stream-format.md), so all their versions are replayed, until the
/// hub appends a newer version of the name, which then replaces every older one, theirs too.
pub async fn external_producers_set_exp_and_sup(env: &mut Env) {
    if !env.part("external exp and sup", &[Fault::ExternalProducer]) {
        return;
    }
    let hub = env.start_hub().await;
    let device = device_on_shard("pos", 40);
    let cursor = publish_to(&hub, &device, "before").await;
    env.produce_with(&device, "ext v1", None, Some("prices"))
        .await;
    env.produce_with(&device, "ext expired", Some(PAST), None)
        .await;
    env.produce_with(&device, "ext v2", None, Some("prices"))
        .await;
    let mut resumed = resume(&hub, &device, &cursor).await;
    let replayed = resumed.expect_events(2, WAIT).await;
    assert_eq!(data_of(&replayed), ["ext v1", "ext v2"]);
    assert_eq!(replayed[0].event, "ext");
    assert_quiet(&mut resumed, "the expired entry is not replayed").await;
    env.ran("external versions are all replayed, the expired one is not");

    env.produce_with(&device, "ext live expired", Some(PAST), Some("prices"))
        .await;
    publish_with(&hub, &device, "hub v3", json!({ "supersede": "prices" })).await;
    let live = resumed.expect_event(WAIT).await;
    assert_eq!(live.data, "hub v3", "the expired entry came first live");
    drop(resumed);
    let mut resumed = resume(&hub, &device, &cursor).await;
    assert_eq!(resumed.expect_event(WAIT).await.data, "hub v3");
    assert_quiet(&mut resumed, "older versions are superseded").await;
    env.ran("the hub's newer version supersedes the external ones");
}

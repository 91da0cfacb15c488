//! The backend conformance suite: every scenario of the backend contract (`src/backend/mod.rs`,
//! docs/stream-format.md) is written once, as `async fn(&mut Env)`, and runs as one test per
//! backend: `<scenario>::memory`, `<scenario>::redis_standalone`, `<scenario>::redis_cluster`
//! and `<scenario>::nats`. A new backend is one more [`env::Kind`] (and a line in the macro
//! below), and it gets every scenario.
//!
//! A scenario checks the hub from outside, as a device and a producer would: HTTP publishes,
//! SSE streams, and faults injected into the backend's real servers ([`env::Env`]). Where a
//! backend cannot do a fault (memory has no external producers and no outage), the scenario
//! checks what it says instead, and the test prints which parts ran:
//! `cargo test --test conformance -- --nocapture` shows the whole matrix; `-- ::nats` runs one
//! backend's part, `-- resume::` one scenario on every backend.
//!
//! What only one backend has stays in its own file: Redis' several instances, hash tags, RDB
//! snapshots, clock and trim lease (tests/redis_backend.rs); JetStream's stream specifics and
//! clustering (tests/nats_backend.rs, tests/cluster_harness.rs).

#[path = "../support/mod.rs"]
mod support;

mod env;
mod fleet;
mod groups;
mod idempotency;
mod identity;
mod loss;
mod order;
mod outage;
mod producers;
mod resume;
mod trim;

use std::time::Duration;

use serde_json::Value;
use support::{http, stream_path, Hub, SseClient, SseEvent, SseNext};

/// Upper bound for anything the hub should do promptly.
pub const WAIT: Duration = Duration::from_secs(20);
/// How long a client may wait for the resync that reports a loss (docs/stream-format.md: within
/// 10 s of the loss). [`loss::Lost::notice`] adds a margin after a restart of the store.
pub const LOSS_NOTICE: Duration = Duration::from_secs(10);

/// `POST /v1/events` with `body` (one item or a batch).
pub async fn publish(hub: &Hub, body: &Value) -> http::HttpResponse {
    http::post_json(hub.addr(), "/v1/events", body).await
}

/// Publishes `body`, asserts 201, and returns its `results`.
pub async fn publish_ok(hub: &Hub, body: &Value) -> Vec<Value> {
    let response = publish(hub, body).await;
    assert_eq!(response.status, 201, "{body}: {}", response.text());
    response.json()["results"]
        .as_array()
        .expect("results")
        .clone()
}

/// Publishes a `test` event with `data` to `device`; returns its id.
pub async fn publish_to(hub: &Hub, device: &str, data: &str) -> String {
    support::publish_to(hub, device, data).await
}

/// Publishes `data` to `device` with an idempotency key, retrying while the hub answers 503 (a
/// backend that is away, or a JetStream stream the hub has not created again yet); returns the
/// id. The key makes a retry of an append that did happen a duplicate, not a second event.
pub async fn publish_until_accepted(hub: &Hub, device: &str, data: &str) -> String {
    let item = serde_json::json!({
        "device": device,
        "type": "test",
        "data": data,
        "key": format!("retried {data}"),
    });
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let response = publish(hub, &item).await;
        if response.status == 201 {
            return response.json()["results"][0]["id"]
                .as_str()
                .expect("id")
                .to_string();
        }
        assert_eq!(response.status, 503, "{}", response.text());
        assert!(
            tokio::time::Instant::now() < deadline,
            "publishing never recovered: {}",
            response.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The reason of a `resync` event (panics on anything else).
pub use support::sse::resync_reason;

/// The epoch part of a cursor (`<epoch>.<shard>.<position>`).
pub fn epoch_of(id: &str) -> &str {
    id.split('.').next().expect("a cursor has an epoch")
}

/// The data of `events`, in order.
pub fn data_of(events: &[SseEvent]) -> Vec<String> {
    events.iter().map(|event| event.data.clone()).collect()
}

/// Opens the stream of `device` resuming after `cursor`.
pub async fn resume(hub: &Hub, device: &str, cursor: &str) -> SseClient {
    let client = SseClient::connect(
        hub.addr(),
        &stream_path(device),
        &[("Last-Event-ID", cursor)],
    )
    .await;
    assert_eq!(client.status(), 200, "resume of {device} after {cursor}");
    client
}

/// Asserts that nothing more arrives on `client` for a while.
pub async fn assert_quiet(client: &mut SseClient, why: &str) {
    match client.next_event(Duration::from_millis(500)).await {
        SseNext::Timeout => {}
        other => panic!("{why}: got {other:?}"),
    }
}

/// Skips events published before a loss that the client may still receive (their data starts
/// with `before`), and returns the resync; fails if none arrives `within`.
pub async fn expect_resync(client: &mut SseClient, within: Duration) -> SseEvent {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match client.next_event(left).await {
            SseNext::Event(event) if event.event == "resync" => return event,
            SseNext::Event(event) => assert!(
                event.data.starts_with("before"),
                "an event after the loss came first: {event:?}"
            ),
            other => panic!("no resync within {within:?}: {other:?}"),
        }
    }
}

/// One test per backend for each `group::scenario`: `mod scenario { fn memory, fn
/// redis_standalone, fn redis_cluster, fn nats }`, so a failure names both.
macro_rules! conformance {
    ($($group:ident :: $scenario:ident),* $(,)?) => {$(
        #[allow(non_snake_case)]
        mod $scenario {
            use super::env::{Env, Kind};

            async fn run(kind: Kind) {
                let mut env = Env::start(kind, stringify!($scenario)).await;
                super::$group::$scenario(&mut env).await;
            }

            #[doc = concat!("Runs [`super::", stringify!($group), "::", stringify!($scenario),
                "`] on the memory backend.")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                run(Kind::Memory).await
            }

            #[doc = concat!("Runs [`super::", stringify!($group), "::", stringify!($scenario),
                "`] on one Redis server (AOF on).")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis_standalone() {
                run(Kind::RedisStandalone).await
            }

            #[doc = concat!("Runs [`super::", stringify!($group), "::", stringify!($scenario),
                "`] on a 3-master Redis Cluster with 4 hash-tag groups (AOF on).")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis_cluster() {
                run(Kind::RedisCluster).await
            }

            #[doc = concat!("Runs [`super::", stringify!($group), "::", stringify!($scenario),
                "`] on one nats-server with JetStream.")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn nats() {
                run(Kind::Nats).await
            }
        }
    )*};
}

// After the macro: its scenarios invoke it (see the file).
mod expiry;

conformance! {
    fleet::presence_follows_a_session,
    fleet::the_last_sent_id_outlives_its_session,
    fleet::a_killed_pods_devices_go_offline_within_ttl,
    fleet::the_fleet_pages_through_1000_devices,
    fleet::fleet_events_are_debounced,
    fleet::acks_only_move_forward,
    fleet::the_fleet_api_checks_tokens,
    fleet::the_unacknowledged_are_listed,
    fleet::the_fleet_knows_the_groups,
    fleet::a_new_stream_takes_over_across_pods,
    fleet::a_double_connect_leaves_one_stream,
    fleet::presence_written_during_an_outage_lands_after_it,
    fleet::a_drained_pods_devices_go_offline_at_once,
    fleet::changes_during_an_outage_reach_other_pods_fleet_events,
    fleet::a_store_restarted_empty_hears_again_of_the_connected_devices,
    fleet::a_pod_drained_while_its_store_is_away_exits_in_time,
    order::live_events_arrive_in_order_as_published,
    order::a_broadcast_reaches_every_shard_once,
    order::a_tail_starts_at_now,
    producers::external_entries_are_delivered_and_bad_ones_skipped,
    resume::resume_replays_exactly_what_was_missed,
    resume::replay_reads_past_entries_it_cannot_deliver,
    resume::unusable_cursors_get_resync_with_reason_and_head_id,
    resume::trimmed_entries_give_expired,
    resume::a_client_moves_between_pods_without_loss,
    idempotency::idempotency_keys_are_scoped_to_their_target,
    idempotency::a_key_answered_in_a_lost_life_is_forgotten,
    idempotency::a_broadcast_key_stands_when_one_of_its_streams_is_lost,
    loss::a_loss_of_all_data_gives_data_lost,
    loss::a_resumed_stream_hears_of_a_flushall,
    loss::a_deleted_stream_gives_data_lost,
    loss::a_restart_without_the_store_gives_data_lost,
    outage::an_outage_loses_nothing,
    outage::an_unreachable_backend_fails_start_up,
    trim::trimming_ahead_of_the_tail_gives_expired,
    trim::trimming_during_a_replay_gives_expired,
    identity::a_stream_ends_when_its_token_does,
    identity::a_revocation_reaches_every_pod,
    identity::revocations_hold_through_a_store_outage,
    identity::groups_come_from_the_token,
    groups::a_group_event_reaches_its_members_only,
    groups::a_group_event_is_stored_only_where_its_members_are,
    groups::a_member_resumes_group_events_in_order_with_its_own,
    groups::memberships_and_group_publishes_are_checked,
}

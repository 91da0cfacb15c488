//! Black-box tests of `backend.kind = "nats"` (issue 8) against a real `nats-server -js` that
//! each test starts on a free port with its own store: publishing, external producers, resume,
//! expiry, a recreated stream, a NATS restart, a conflicting stream and two hub pods.

mod support;

use std::time::Duration;

use async_nats::{
    jetstream::{self, stream},
    HeaderMap,
};
use serde_json::{json, Value};
use support::{
    http, live_stream, metrics, nats::NatsServer, publish_to, stream_path, Hub, SseClient,
    SseEvent, SseNext,
};

const WAIT: Duration = Duration::from_secs(20);
const STREAM: &str = "POSTHORN";

fn nats_hub(url: &str) -> support::hub::HubBuilder {
    Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "nats")
        .env("POSTHORN_NATS__URL", url)
}

async fn publish(hub: &Hub, event: Value) -> http::HttpResponse {
    http::post_json(hub.addr(), "/v1/events", &event).await
}

fn resync_reason(event: &SseEvent) -> String {
    assert_eq!(event.event, "resync", "expected a resync, got {event:?}");
    let data: Value = serde_json::from_str(&event.data).expect("resync data is JSON");
    data["reason"].as_str().expect("reason").to_string()
}

fn shard(device: &str) -> u32 {
    crc32fast::hash(device.as_bytes()) % 64
}

fn subject(device: &str) -> String {
    format!("posthorn.ev.{}", shard(device))
}

/// A device other than `device` on the same shard.
fn neighbour(device: &str) -> String {
    (0..)
        .map(|i| format!("n-{i}"))
        .find(|d| d != device && shard(d) == shard(device))
        .expect("some device shares the shard")
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in pairs {
        headers.insert(*name, *value);
    }
    headers
}

/// Publishes as an external producer would (the NATS format of docs/stream-format.md, not through the hub) and waits
/// for JetStream's ack; returns the stream sequence.
async fn produce(
    js: &jetstream::Context,
    subject: &str,
    pairs: &[(&str, &str)],
    body: &[u8],
) -> u64 {
    js.publish_with_headers(subject.to_string(), headers(pairs), body.to_vec().into())
        .await
        .expect("publish")
        .await
        .expect("ack")
        .sequence
}

async fn stream_state(js: &jetstream::Context) -> stream::State {
    js.get_stream(STREAM)
        .await
        .expect("the stream exists")
        .info()
        .await
        .expect("stream info")
        .state
        .clone()
}

async fn wait_for_readiness(hub: &Hub, status: u16) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while http::get(hub.addr(), "/readyz").await.status != status {
        assert!(
            tokio::time::Instant::now() < deadline,
            "readiness never became {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Events published over HTTP and by an external producer writing the documented headers reach
/// the device in order; messages without `Posthorn-Dev` or with a non-UTF-8 body are skipped and
/// counted while the tail keeps running; idempotency keys and broadcasts work on JetStream; the
/// tail's lag comes from message timestamps (a position carries no time).
#[tokio::test]
async fn delivers_published_and_external_events() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    let mut client = live_stream(&hub, "pos-17").await;
    let first = publish(
        &hub,
        json!({ "device": "pos-17", "type": "order.paid", "data": {"total": 5}, "key": "k-1" }),
    )
    .await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = publish(
        &hub,
        json!({ "device": "pos-17", "data": "retry", "key": "k-1" }),
    )
    .await;
    assert_eq!(again.json()["results"][0]["duplicate"], true);
    assert_eq!(
        again.json()["results"][0]["id"],
        first.json()["results"][0]["id"]
    );

    let js = nats.jetstream().await;
    let subject = subject("pos-17");
    produce(&js, &subject, &[("Posthorn-Type", "x")], b"no device").await;
    produce(&js, &subject, &[("Posthorn-Dev", "pos-17")], &[0xff, 0xfe]).await;
    // Matches the stream's filter but names no shard.
    produce(
        &js,
        "posthorn.ev.x",
        &[("Posthorn-Dev", "pos-17")],
        b"no shard",
    )
    .await;
    produce(
        &js,
        &subject,
        &[("Posthorn-Dev", "pos-17"), ("Posthorn-Type", "ext")],
        b"line 1\nline 2",
    )
    .await;
    // A plain (non-JetStream) publish is captured by the stream just the same.
    let core = nats.client().await;
    core.publish_with_headers(
        subject.clone(),
        headers(&[("Posthorn-Dev", "pos-17")]),
        "core".into(),
    )
    .await
    .unwrap();
    core.flush().await.unwrap();
    let events = client.expect_events(3, WAIT).await;
    publish(&hub, json!({ "broadcast": true, "data": "to all" })).await;
    let broadcast = client.expect_event(WAIT).await;

    assert_eq!(
        events[0].id.as_deref(),
        first.json()["results"][0]["id"].as_str()
    );
    assert_eq!(
        (events[0].event.as_str(), events[0].data.as_str()),
        ("order.paid", r#"{"total":5}"#)
    );
    assert_eq!(
        (events[1].event.as_str(), events[1].data.as_str()),
        ("ext", "line 1\nline 2")
    );
    assert_eq!(
        (events[2].event.as_str(), events[2].data.as_str()),
        ("message", "core")
    );
    assert_eq!(broadcast.data, "to all");
    assert!(matches!(
        client.next_event(Duration::from_millis(500)).await,
        SseNext::Timeout
    ));
    // 1 + 3 skipped + 2 external + 64 broadcast copies, one per shard subject.
    assert_eq!(stream_state(&js).await.messages, 70);
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(scrape.value("tail_entries_skipped_total", &[]), Some(3.0));
    assert!(scrape.has_help("nats_tail_lag_seconds"));
    assert!(scrape.has_help("nats_tail_reconnects_total"));
    let lag = scrape
        .value("nats_tail_lag_seconds", &[("group", "0")])
        .expect("lag of group 0");
    assert!((0.0..5.0).contains(&lag), "lag {lag}");
    assert_eq!(
        scrape.value("nats_tail_reconnects_total", &[("group", "0")]),
        Some(0.0)
    );
}

/// Resume by Last-Event-ID replays exactly the missed events of the device and its shard's
/// broadcasts, across several replay pages full of other devices' events and undeliverable
/// messages.
#[tokio::test]
async fn resume_replays_exactly_what_was_missed() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    let mut client = live_stream(&hub, "pos-1").await;
    publish_to(&hub, "pos-1", "e1").await;
    let cursor = publish_to(&hub, "pos-1", "e2").await;
    client.expect_events(2, WAIT).await;
    drop(client);

    publish_to(&hub, "pos-1", "e3").await;
    // More than two replay pages (500) of messages the device must not see.
    let js = nats.jetstream().await;
    let other = neighbour("pos-1");
    let mut acks = Vec::new();
    for i in 0..1200 {
        let pairs: &[(&str, &str)] = if i % 2 == 0 {
            &[("Posthorn-Dev", other.as_str())]
        } else {
            &[("Posthorn-Type", "no-device")]
        };
        acks.push(
            js.publish_with_headers(subject("pos-1"), headers(pairs), "x".into())
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
    publish(&hub, json!({ "broadcast": true, "data": "all" })).await;
    let head = publish_to(&hub, "pos-1", "e4").await;

    let mut resumed = SseClient::connect(
        hub.addr(),
        &stream_path("pos-1"),
        &[("Last-Event-ID", &cursor)],
    )
    .await;
    let replayed = resumed.expect_events(3, WAIT).await;
    let data: Vec<&str> = replayed.iter().map(|e| e.data.as_str()).collect();
    assert_eq!(data, ["e3", "all", "e4"]);
    assert_eq!(replayed[2].id.as_deref(), Some(head.as_str()));
    // Live events follow without a gap or a duplicate.
    let e5 = publish_to(&hub, "pos-1", "e5").await;
    assert_eq!(resumed.expect_event(WAIT).await.data, "e5");
    assert!(matches!(
        resumed.next_event(Duration::from_millis(500)).await,
        SseNext::Timeout
    ));
    drop(resumed);

    // A cursor at the head replays nothing and goes live.
    let mut current =
        SseClient::connect(hub.addr(), &stream_path("pos-1"), &[("Last-Event-ID", &e5)]).await;
    assert!(matches!(
        current.next_event(Duration::from_millis(500)).await,
        SseNext::Timeout
    ));
    publish_to(&hub, "pos-1", "e6").await;
    assert_eq!(current.expect_event(WAIT).await.data, "e6");
}

/// A cursor older than what was removed from its shard gets `resync` `expired` with the head
/// as its id, whether the removal moved the stream's first sequence or only left a hole inside
/// the stream (another shard holds older messages); a cursor at the last removed message
/// resumes normally.
#[tokio::test]
async fn removed_messages_give_expired() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    let js = nats.jetstream().await;
    let stream = js.get_stream(STREAM).await.unwrap();

    // Front: only this shard has messages; purging it moves the stream's first sequence.
    let e1 = publish_to(&hub, "pos-1", "e1").await;
    let e2 = publish_to(&hub, "pos-1", "e2").await;
    let e3 = publish_to(&hub, "pos-1", "e3").await;
    stream
        .purge()
        .filter(subject("pos-1"))
        .keep(1)
        .await
        .unwrap();
    let mut expired =
        SseClient::connect(hub.addr(), &stream_path("pos-1"), &[("Last-Event-ID", &e1)]).await;
    let event = expired.expect_event(WAIT).await;
    assert_eq!(resync_reason(&event), "expired");
    assert_eq!(event.id.as_deref(), Some(e3.as_str()));
    let mut fine =
        SseClient::connect(hub.addr(), &stream_path("pos-1"), &[("Last-Event-ID", &e2)]).await;
    assert_eq!(fine.expect_event(WAIT).await.data, "e3");

    // Hole: another shard's older message keeps the stream's first sequence where it is.
    let device = (0..)
        .map(|i| format!("h-{i}"))
        .find(|d| shard(d) != shard("pos-1") && shard(d) != shard("pos-2"))
        .unwrap();
    // pos-1 is on shard 27, pos-2 on shard 33.
    publish_to(&hub, &device, "old").await;
    let h1 = publish_to(&hub, "pos-2", "h1").await;
    let h2 = publish_to(&hub, "pos-2", "h2").await;
    publish_to(&hub, "pos-2", "h3").await;
    stream
        .purge()
        .filter(subject("pos-2"))
        .keep(1)
        .await
        .unwrap();
    let state = stream_state(&js).await;
    assert!(state.first_sequence <= 4, "{state:?}");
    let mut expired =
        SseClient::connect(hub.addr(), &stream_path("pos-2"), &[("Last-Event-ID", &h1)]).await;
    assert_eq!(resync_reason(&expired.expect_event(WAIT).await), "expired");
    let mut fine =
        SseClient::connect(hub.addr(), &stream_path("pos-2"), &[("Last-Event-ID", &h2)]).await;
    assert_eq!(fine.expect_event(WAIT).await.data, "h3");
}

/// Deleting the stream loses its data: the hub creates a new one (a new epoch), a connected
/// client is told `data_lost`, a client coming back with an older cursor gets `data_lost`, and
/// delivery continues on the new stream.
#[tokio::test]
async fn recreated_stream_gives_data_lost() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    let mut connected = live_stream(&hub, "pos-9").await;
    let old = publish_to(&hub, "pos-9", "before").await;
    assert_eq!(connected.expect_event(WAIT).await.data, "before");

    let js = nats.jetstream().await;
    js.delete_stream(STREAM).await.unwrap();
    let event = connected.expect_event(WAIT).await;
    assert_eq!(resync_reason(&event), "data_lost");
    assert_ne!(
        event.id.as_deref().and_then(|id| id.split('.').next()),
        old.split('.').next(),
        "the resync carries the new epoch"
    );
    // The same device coming back (on the same pod this replaces the connection above).
    drop(connected);
    let mut back = SseClient::connect(
        hub.addr(),
        &stream_path("pos-9"),
        &[("Last-Event-ID", &old)],
    )
    .await;
    assert_eq!(resync_reason(&back.expect_event(WAIT).await), "data_lost");
    let fresh = publish_to(&hub, "pos-9", "after").await;
    assert_ne!(fresh.split('.').next(), old.split('.').next());
    assert_eq!(back.expect_event(WAIT).await.data, "after");
}

/// nats-server restarts with its store while a publisher keeps publishing (retrying with its
/// idempotency key until the hub answers 201): the connected client receives every event exactly
/// once, in order, without a resync, including those an external producer published right after
/// the restart, before the tail had a new consumer (it resumes after its last sequence, not from
/// "new"); readiness reports the outage while it lasts, and the tail counts its reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_with_store_loses_nothing() {
    let Some(mut nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    let mut client = live_stream(&hub, "pos-7").await;
    const EVENTS: usize = 60;
    for i in 0..EVENTS {
        if i == EVENTS / 2 {
            nats.stop().await;
            wait_for_readiness(&hub, 503).await;
            nats.start_again().await;
            let js = nats.jetstream().await;
            for k in 0..5 {
                let data = format!("x{k}");
                produce(
                    &js,
                    &subject("pos-7"),
                    &[("Posthorn-Dev", "pos-7")],
                    data.as_bytes(),
                )
                .await;
            }
        }
        let event = json!({ "device": "pos-7", "data": i.to_string(), "key": format!("seq-{i}") });
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let response = publish(&hub, event.clone()).await;
            if response.status == 201 {
                break;
            }
            assert_eq!(response.status, 503, "{}", response.text());
            assert!(
                tokio::time::Instant::now() < deadline,
                "publishing never recovered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let expected = (0..EVENTS / 2)
        .map(|i| i.to_string())
        .chain((0..5).map(|k| format!("x{k}")))
        .chain((EVENTS / 2..EVENTS).map(|i| i.to_string()));
    for (n, data) in expected.enumerate() {
        let event = client.expect_event(WAIT).await;
        assert_eq!(event.event, "message", "no resync: {event:?}");
        assert_eq!(event.data, data, "gap or duplicate at event {n}");
    }
    assert!(matches!(
        client.next_event(Duration::from_millis(500)).await,
        SseNext::Timeout
    ));
    wait_for_readiness(&hub, 200).await;
    let scrape = metrics::scrape(hub.addr()).await;
    let reconnects = scrape.value_or_zero("nats_tail_reconnects_total", &[("group", "0")]);
    assert!(reconnects >= 1.0, "reconnects {reconnects}");
}

/// A stream of the configured name whose subjects are not ours stops start-up with exit code 1
/// (like any backend that cannot start) and a message naming the conflict; the stream is left
/// alone.
#[tokio::test]
async fn conflicting_stream_stops_start_up() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let js = nats.jetstream().await;
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["orders.*".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let (code, log) = nats_hub(&nats.url())
        .run_to_exit(Duration::from_secs(30))
        .await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains("cannot start the backend"), "{log}");
    assert!(
        log.contains("cannot be used") && log.contains("orders.*"),
        "{log}"
    );
    let mut stream = js.get_stream(STREAM).await.unwrap();
    assert_eq!(stream.info().await.unwrap().config.subjects, ["orders.*"]);
}

/// A hub that cannot reach NATS at start-up exits with a clear error instead of serving.
#[tokio::test]
async fn unreachable_nats_fails_start_up() {
    let port = support::free_port();
    let (code, log) = nats_hub(&format!("nats://127.0.0.1:{port}"))
        .run_to_exit(Duration::from_secs(30))
        .await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains("cannot start the backend"), "{log}");
}

/// Two hub pods on one stream: a client reads part of its events on pod A, disconnects, and
/// resumes on pod B from its cursor with no loss and no duplicate, then gets live events
/// published through pod A.
#[tokio::test]
async fn client_moves_between_pods_without_loss() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let pod_a = nats_hub(&nats.url()).start().await;
    let pod_b = nats_hub(&nats.url()).start().await;
    support::assert_client_moves_between_pods(&pod_a, &pod_b).await;
}

/// `posthorn shard-key` prints the subject a producer must publish to under the NATS backend.
#[test]
fn shard_key_prints_the_subject() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_posthorn"))
        .args(["shard-key", "pos-17"])
        .env("POSTHORN_BACKEND__KIND", "nats")
        .env("POSTHORN_NATS__SUBJECT_PREFIX", "pos.events")
        .output()
        .expect("run posthorn");
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("shard={0} subject=pos.events.{0}", shard("pos-17"))
    );
}

/// Bug pinned (issue 19.1): a stream opened with a cursor dropped the tail's `resync` and, since
/// a new stream restarts at sequence 1, every later event below the old cursor: it received
/// nothing for the rest of its life while heartbeats kept it looking healthy. Now it gets
/// `data_lost` within 10 s, then the new stream's events.
#[tokio::test]
async fn a_resumed_stream_hears_of_a_recreated_stream() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    // A cursor well above the first sequences of the new stream.
    for i in 0..20 {
        publish_to(&hub, "pos-8", &format!("before {i}")).await;
    }
    let cursor = publish_to(&hub, "pos-8", "before last").await;
    let mut resumed = SseClient::connect(
        hub.addr(),
        &stream_path("pos-8"),
        &[("Last-Event-ID", &cursor)],
    )
    .await;
    assert_eq!(resumed.status(), 200);
    // Past its (empty) replay: a stream that is deleted while it is replayed fails the replay,
    // and the client comes back (to a `data_lost` resume).
    tokio::time::sleep(Duration::from_millis(300)).await;
    nats.jetstream().await.delete_stream(STREAM).await.unwrap();
    let event = resumed.expect_event(Duration::from_secs(10)).await;
    assert_eq!(resync_reason(&event), "data_lost");
    let id = publish_to(&hub, "pos-8", "after").await;
    eprintln!(
        "DEBUG after id {id} state {:?}",
        stream_state(&nats.jetstream().await).await
    );
    assert_eq!(resumed.expect_event(WAIT).await.data, "after");
}

/// A nats-server that restarts without its store lost the stream: connected and resumed streams
/// get `data_lost`, a cursor from before gets `data_lost` on resume, and delivery goes on.
#[tokio::test]
async fn a_restart_without_the_store_gives_data_lost() {
    let Some(mut nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    let mut connected = live_stream(&hub, "pos-6").await;
    let cursor = publish_to(&hub, "pos-6", "before").await;
    assert_eq!(connected.expect_event(WAIT).await.data, "before");
    let other = publish_to(&hub, "pos-7", "before").await;
    let mut resumed = SseClient::connect(
        hub.addr(),
        &stream_path("pos-7"),
        &[("Last-Event-ID", &other)],
    )
    .await;
    nats.stop().await;
    std::fs::remove_dir_all(nats.dir().join("store")).expect("remove the store");
    nats.start_again().await;
    for client in [&mut connected, &mut resumed] {
        let event = client.expect_event(Duration::from_secs(15)).await;
        assert_eq!(resync_reason(&event), "data_lost");
    }
    let mut back = SseClient::connect(
        hub.addr(),
        &stream_path("pos-6"),
        &[("Last-Event-ID", &cursor)],
    )
    .await;
    assert_eq!(resync_reason(&back.expect_event(WAIT).await), "data_lost");
    publish_to(&hub, "pos-6", "after").await;
    assert_eq!(back.expect_event(WAIT).await.data, "after");
}

/// Bug pinned (issue 19.6), NATS: a broadcast's copies used message ids `{key}:{shard}`, so a
/// later unicast with key `k:3` was answered `duplicate` and never appended.
#[tokio::test]
async fn idempotency_keys_are_scoped_to_their_target() {
    let Some(nats) = NatsServer::start().await else {
        return;
    };
    let hub = nats_hub(&nats.url()).start().await;
    support::conformance::idempotency_keys_are_scoped_to_their_target(&hub).await;
}

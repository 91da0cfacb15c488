//! Black-box tests of what only `backend.kind = "nats"` has, against a real
//! `nats-server -js` that each test starts on a free port with its own store: core NATS
//! publishes, subjects without a shard, a hole a purge leaves inside the one stream, a
//! conflicting stream, and the subject `shard-key` prints. What every backend must do (order,
//! resume, expiry, data loss, outages, idempotency, external producers, two pods) is the
//! conformance suite's, which runs it on NATS too (tests/conformance/).

mod support;

use support::nats::{shard, subject};
use support::sse::resync_reason;

use std::time::Duration;

use async_nats::jetstream::stream;
use support::{
    live_stream, metrics,
    nats::{headers, produce, stream_state, NatsServer},
    publish_to, stream_path, Hub, SseClient, SseNext,
};

const WAIT: Duration = Duration::from_secs(20);
const STREAM: &str = "POSTHORN";

fn nats_hub(url: &str) -> support::hub::HubBuilder {
    Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "nats")
        .env("POSTHORN_NATS__URL", url)
}

/// JetStream specifics of external producers (what every backend does with them is the
/// conformance suite's): a plain core NATS publish, which gets no ack, is captured by the stream
/// and delivered like any other, and a message on a subject of the stream's filter that names no
/// shard (`posthorn.ev.x`) is skipped and counted. The tail's lag comes from message timestamps
/// (a position carries no time).
#[tokio::test]
async fn a_core_publish_is_delivered_and_a_subject_without_a_shard_skipped() {
    let nats = NatsServer::start().await;
    let hub = nats_hub(&nats.url()).start().await;
    let mut client = live_stream(&hub, "pos-17").await;
    let js = nats.jetstream().await;
    // Matches the stream's filter but names no shard.
    produce(
        &js,
        "posthorn.ev.x",
        &[("Posthorn-Dev", "pos-17")],
        b"no shard",
    )
    .await;
    let core = nats.client().await;
    core.publish_with_headers(
        subject("pos-17"),
        headers(&[("Posthorn-Dev", "pos-17")]),
        "core".into(),
    )
    .await
    .unwrap();
    core.flush().await.unwrap();
    // A core publish is stored by the server after it was received, with no ack to wait for:
    // read it before publishing through the hub, or the two may be stored in either order.
    let core_event = client.expect_event(WAIT).await;
    assert_eq!(
        (core_event.event.as_str(), core_event.data.as_str()),
        ("message", "core")
    );
    publish_to(&hub, "pos-17", "through the hub").await;
    assert_eq!(client.expect_event(WAIT).await.data, "through the hub");
    assert!(matches!(
        client.next_event(Duration::from_millis(500)).await,
        SseNext::Timeout
    ));
    assert_eq!(stream_state(&js, STREAM).await.messages, 3);
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(scrape.value("tail_entries_skipped_total", &[]), Some(1.0));
    let lag = scrape
        .value("nats_tail_lag_seconds", &[("group", "0")])
        .expect("lag of group 0");
    assert!((0.0..5.0).contains(&lag), "lag {lag}");
}

/// A purge of one shard's subject that leaves a hole inside the stream (another shard holds
/// older messages, so the stream's first sequence stays where it was) still gives a cursor from
/// before the hole `resync` `expired`, with the head as its id; a cursor at the last removed
/// message resumes normally (a JetStream cursor is exact; Redis answers `expired` there,
/// docs/stream-format.md). Trimming in general is the conformance suite's.
#[tokio::test]
async fn a_hole_left_by_a_purge_gives_expired() {
    let nats = NatsServer::start().await;
    let hub = nats_hub(&nats.url()).start().await;
    let js = nats.jetstream().await;
    let stream = js.get_stream(STREAM).await.unwrap();
    let device = (0..)
        .map(|i| format!("h-{i}"))
        .find(|d| shard(d) != shard("pos-2"))
        .unwrap();
    publish_to(&hub, &device, "old").await;
    let h1 = publish_to(&hub, "pos-2", "h1").await;
    let h2 = publish_to(&hub, "pos-2", "h2").await;
    let h3 = publish_to(&hub, "pos-2", "h3").await;
    stream
        .purge()
        .filter(subject("pos-2"))
        .keep(1)
        .await
        .unwrap();
    let state = stream_state(&js, STREAM).await;
    assert_eq!(state.first_sequence, 1, "{state:?}");
    let mut expired =
        SseClient::connect(hub.addr(), &stream_path("pos-2"), &[("Last-Event-ID", &h1)]).await;
    let event = expired.expect_event(WAIT).await;
    assert_eq!(resync_reason(&event), "expired");
    assert_eq!(event.id.as_deref(), Some(h3.as_str()));
    drop(expired);
    let mut fine =
        SseClient::connect(hub.addr(), &stream_path("pos-2"), &[("Last-Event-ID", &h2)]).await;
    assert_eq!(fine.expect_event(WAIT).await.data, "h3");
}

/// A stream of the configured name whose subjects are not ours stops start-up with exit code 1
/// (like any backend that cannot start) and a message naming the conflict; the stream is left
/// alone.
#[tokio::test]
async fn conflicting_stream_stops_start_up() {
    let nats = NatsServer::start().await;
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

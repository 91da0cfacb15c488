//! A backend that goes away: at start-up, and while clients are connected.

use std::time::Duration;

use serde_json::json;

use crate::env::{device_on_shard, wait_for_readiness, Env, Fault};
use crate::support::{http, live_stream, metrics};
use crate::{assert_quiet, publish, publish_to, WAIT};

/// The backend goes away and comes back with its data (Redis with AOF, every node of a cluster,
/// nats-server with its store) while a publisher keeps publishing, retrying each event with its
/// idempotency key until the hub answers 201: the connected client receives every event exactly
/// once, in order, without a resync — including entries an external producer appended right
/// after the backend came back, before the tail read again (it resumes after its last position,
/// not from "now"). Readiness reports the outage while it lasts; afterwards every tail delivers
/// again, those of idle node groups too, and the tails count their reconnect. Memory is never
/// away: the same publisher and clients run, and readiness stays up.
pub async fn an_outage_loses_nothing(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = "pos-7";
    let mut client = live_stream(&hub, device).await;
    // One more stream on each quarter of the shards (each node group of the cluster), idle
    // until the outage is over.
    let idle: Vec<String> = (0..4)
        .map(|q| device_on_shard("idle", q * 16 + 1))
        .collect();
    let mut idle_clients = Vec::new();
    for other in &idle {
        idle_clients.push(live_stream(&hub, other).await);
    }
    const EVENTS: usize = 60;
    let mut expected: Vec<String> = Vec::new();
    let mut outage = false;
    for i in 0..EVENTS {
        if i == EVENTS / 2 {
            outage = env.part("an outage in the middle", &[Fault::Outage]);
            if outage {
                env.outage_begin().await;
                wait_for_readiness(&hub, 503, WAIT).await;
                env.outage_end().await;
            } else {
                assert_eq!(http::get(hub.addr(), "/readyz").await.status, 200);
            }
            if outage
                && env.part(
                    "external entries before the tail reads again",
                    &[Fault::ExternalProducer],
                )
            {
                for k in 0..5 {
                    let data = format!("x{k}");
                    env.produce(device, None, &data).await;
                    expected.push(data);
                }
            }
        }
        let event = json!({ "device": device, "data": i.to_string(), "key": format!("seq-{i}") });
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let response = publish(&hub, &event).await;
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
        expected.push(i.to_string());
    }
    for (n, data) in expected.iter().enumerate() {
        let event = client.expect_event(WAIT).await;
        assert_eq!(event.event, "message", "no resync: {event:?}");
        assert_eq!(&event.data, data, "gap or duplicate at event {n}");
    }
    assert_quiet(&mut client, "nothing twice").await;
    wait_for_readiness(&hub, 200, WAIT).await;
    env.ran("every event once, in order, without a resync");
    for (other, idle_client) in idle.iter().zip(&mut idle_clients) {
        publish_to(&hub, other, "after the outage").await;
        let event = idle_client.expect_event(WAIT).await;
        assert_eq!(event.data, "after the outage", "{other}: {event:?}");
    }
    env.ran("every tail delivers again, idle ones too");
    if outage {
        // Counted once a tail that failed reads again.
        let name = format!("{}_tail_reconnects_total", env.kind().config_kind());
        metrics::wait_for(hub.addr(), &name, &[], 1.0, WAIT).await;
        env.ran("the tail counts its reconnect");
    }
}

/// A hub that cannot reach its backend at start-up exits with code 1 and a clear error instead
/// of serving. Memory needs no service: a memory hub is ready at once.
pub async fn an_unreachable_backend_fails_start_up(env: &mut Env) {
    if env.part("a closed port", &[Fault::Unreachable]) {
        let (code, log) = env
            .unreachable_hub()
            .run_to_exit(Duration::from_secs(30))
            .await;
        assert_eq!(code, Some(1), "{log}");
        assert!(log.contains("cannot start the backend"), "{log}");
    } else {
        let hub = env.start_hub().await;
        assert_eq!(http::get(hub.addr(), "/readyz").await.status, 200);
        env.ran("instead: a memory hub is ready without any service");
    }
}

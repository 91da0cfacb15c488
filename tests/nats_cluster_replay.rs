//! Replays on a NATS cluster read what was just appended: on a 3-node cluster with the event
//! stream replicated to all three, an event appended through one node is in the page that
//! `read_after` answers at once through another. A replay that read from a replica behind the
//! tail's would end short of an event the tail had already routed, and the client would never get
//! it. The replay's ephemeral consumer may sit on such a replica: before the replay read through
//! the leader's last entry of the shard, this missed 2 or 3 of its 300 appends in 3 of 4 runs.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use posthorn::{
    backend::{
        nats::{NatsAccess, NatsBackend, NatsSettings},
        Backend, NewEvent,
    },
    config::{Config, RedactedUrl},
    model::{shard_of, DeviceId, EventType, Position, Target},
};
use support::nats_cluster::NatsCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_is_read_back_at_once_through_any_node() {
    let cluster = NatsCluster::start(3).await;
    let mut backends = Vec::new();
    for node in 0..3 {
        let mut config = Config::default();
        config.nats.url = vec![RedactedUrl::new(cluster.url(node))];
        config.nats.replicas = 3;
        let access = NatsAccess::load(&config.nats).expect("access");
        backends.push(
            NatsBackend::connect(
                NatsSettings {
                    nats: config.nats.clone(),
                    dedupe_window: Duration::from_secs(60),
                },
                access,
            )
            .await
            .expect("connect"),
        );
    }
    let backend = &backends[0];
    let device = DeviceId::parse("pos-probe").unwrap();
    let shard = shard_of(device.as_str(), backend.shards());
    let mut misses = Vec::new();
    for round in 0..300 {
        let outcome = backend
            .append(vec![NewEvent {
                target: Target::Device(device.clone()),
                event_type: EventType::message(),
                data: format!("{round}"),
                key: None,
                expires_ms: None,
                supersede: None,
                only_shards: None,
            }])
            .await
            .expect("append");
        let cursor = outcome[0].clone().expect("appended").cursor;
        // NATS positions are stream sequences (ms 0).
        let after = Position::new(0, cursor.position.seq - 1);
        let page = backends[1 + round % 2]
            .read_after(shard, after, 10)
            .await
            .expect("read");
        if !page.events.iter().any(|e| e.position == cursor.position) {
            misses.push(round);
        }
    }
    assert!(
        misses.is_empty(),
        "appends not read back at once: rounds {misses:?}"
    );
}

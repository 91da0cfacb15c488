//! Self-tests of the fault-injection pieces of the harness: Redis restarts
//! from an older snapshot of a server's files or from none, a Redis Cluster
//! with replicas that fails over when a master is killed (`support::redis`),
//! and a three-node NATS JetStream cluster (`support::nats_cluster`), all
//! real processes driven without the hub.

mod support;

use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage, stream};
use tokio::time::Instant;

use support::nats_cluster::NatsCluster;
use support::redis::RedisServer;
use support::{http, RedisCluster, RespClient, RespValue};

async fn get(client: &mut RespClient, key: &str) -> Option<String> {
    let reply = client.cmd(&["GET", key]).await;
    match reply {
        RespValue::Bulk(None) => None,
        other => Some(other.as_str().expect("GET returns text").to_string()),
    }
}

async fn dbsize(client: &mut RespClient) -> i64 {
    client.cmd(&["DBSIZE"]).await.as_int().expect("DBSIZE")
}

/// Writes before and after a snapshot, restarts from it, and checks that
/// exactly the later writes are gone, that a plain restart neither rolls
/// back nor (without AOF) keeps anything, and that the snapshot restores
/// again after further writes.
async fn assert_snapshot_rolls_back(server: &mut RedisServer, aof: bool) {
    let mut client = server.client().await;
    assert!(client.cmd(&["SET", "before", "1"]).await.is_ok());
    assert!(client.cmd(&["SET", "changed", "old"]).await.is_ok());
    client.xadd("pos:events", &[("n", "1")]).await;
    client.xadd("pos:events", &[("n", "2")]).await;

    let snapshot = server.snapshot().await;
    assert_eq!(snapshot.is_aof(), aof, "{snapshot:?}");
    let names: Vec<String> = snapshot
        .files()
        .iter()
        .map(|f| f.display().to_string())
        .collect();
    if aof {
        assert!(
            names.iter().any(|n| n.ends_with(".manifest"))
                && names.iter().any(|n| n.contains(".base.")),
            "{names:?}"
        );
    } else {
        assert_eq!(names, ["dump.rdb"]);
        // The SAVE's file is not left behind for a plain restart to load.
        assert!(!server.dir().join("dump.rdb").exists());
    }

    let mut client = server.client().await;
    assert!(client.cmd(&["SET", "after", "1"]).await.is_ok());
    assert!(client.cmd(&["SET", "changed", "new"]).await.is_ok());
    client.xadd("pos:events", &[("n", "3")]).await;
    drop(client);

    server.restart().await;
    let mut client = server.client().await;
    if aof {
        assert_eq!(get(&mut client, "changed").await.as_deref(), Some("new"));
        assert_eq!(client.xlen("pos:events").await, 3);
    } else {
        assert_eq!(dbsize(&mut client).await, 0, "a plain restart loses all");
    }
    assert!(client.cmd(&["SET", "later", "1"]).await.is_ok());
    drop(client);

    for round in 0..2 {
        server.restart_from(&snapshot).await;
        let mut client = server.client().await;
        assert_eq!(get(&mut client, "before").await.as_deref(), Some("1"));
        assert_eq!(get(&mut client, "changed").await.as_deref(), Some("old"));
        assert_eq!(get(&mut client, "after").await, None, "round {round}");
        assert_eq!(get(&mut client, "later").await, None, "round {round}");
        assert_eq!(client.xlen("pos:events").await, 2, "round {round}");
        assert_eq!(dbsize(&mut client).await, 3, "round {round}");
        // Writable, and (with AOF) persisted again from the restored files.
        assert!(client.cmd(&["SET", "after", "2"]).await.is_ok());
    }
    if aof {
        server.restart().await;
        let mut client = server.client().await;
        assert_eq!(get(&mut client, "after").await.as_deref(), Some("2"));
        assert_eq!(dbsize(&mut client).await, 4);
    }
}

/// Without AOF, `snapshot` SAVEs an RDB file aside and `restart_from` brings
/// back exactly the keys written before it; a plain restart still loses
/// everything.
#[tokio::test]
async fn snapshot_restore_rolls_back_without_aof() {
    let mut server = RedisServer::start().await;
    assert_snapshot_rolls_back(&mut server, false).await;
}

/// With AOF, `snapshot` copies the rewritten multi-part AOF (base, incr,
/// manifest) and `restart_from` brings back exactly the keys written before
/// it, although a plain restart keeps every later write.
#[tokio::test]
async fn snapshot_restore_rolls_back_with_aof() {
    let mut server = RedisServer::builder().appendonly(true).start().await;
    assert_snapshot_rolls_back(&mut server, true).await;
}

/// `restart_without_data` loses every key although AOF is on (and a
/// snapshot exists), and the server persists new writes again afterwards.
#[tokio::test]
async fn restart_without_data_loses_everything_even_with_aof() {
    let mut server = RedisServer::builder().appendonly(true).start().await;
    let mut client = server.client().await;
    client.xadd("pos:events", &[("n", "1")]).await;
    assert!(client.cmd(&["SET", "k", "v"]).await.is_ok());
    drop(client);
    server.snapshot().await;
    server.restart().await;
    assert_eq!(dbsize(&mut server.client().await).await, 2);

    server.restart_without_data().await;
    let mut client = server.client().await;
    assert_eq!(dbsize(&mut client).await, 0);
    assert!(client.cmd(&["SET", "fresh", "1"]).await.is_ok());
    drop(client);
    server.restart().await;
    let mut client = server.client().await;
    assert_eq!(get(&mut client, "fresh").await.as_deref(), Some("1"));
    assert_eq!(dbsize(&mut client).await, 1);
}

/// A cluster of 3 masters with a replica each forms; killing the master of a
/// key promotes its replica, which has the key's acknowledged entries and
/// takes writes; the killed node restarts as a replica of the new master and
/// gets the writes made meanwhile.
#[tokio::test]
async fn cluster_replica_takes_over_a_killed_master_and_the_master_rejoins() {
    let started = Instant::now();
    let mut cluster = RedisCluster::start_with_replicas(3, 1).await;
    let formed = started.elapsed();
    assert_eq!(cluster.nodes().len(), 6);
    let masters = cluster.masters().await;
    assert_eq!(masters.len(), 3, "{masters:?}");
    let key = "posthorn:{g0}:events";
    let old_master = cluster.master_of_slot_of(key).await;
    assert!(masters.contains(&old_master));

    let mut client = RespClient::connect(old_master).await;
    client.xadd(key, &[("n", "1")]).await;
    // The entry is on the replica before the master dies: WAIT says how many
    // replicas acknowledged the writes of this connection.
    assert_eq!(client.cmd(&["WAIT", "1", "5000"]).await, RespValue::Int(1));
    drop(client);

    let killed = cluster.kill_master_of(key).await;
    assert_eq!(cluster.node(killed).addr(), old_master);
    let killed_at = Instant::now();
    let promoted = cluster.wait_failover(killed).await;
    let failover = killed_at.elapsed();
    assert_ne!(promoted, killed);
    let new_master = cluster.node(promoted).addr();
    assert_eq!(cluster.master_of_slot_of(key).await, new_master);
    let masters = cluster.masters().await;
    assert_eq!(masters.len(), 3, "{masters:?}");
    assert!(masters.contains(&new_master) && !masters.contains(&old_master));

    // Routed by the cluster's new view, then straight to the new master.
    cluster.xadd(key, &[("n", "2")]).await;
    let mut client = RespClient::connect(new_master).await;
    assert_eq!(client.xlen(key).await, 2);
    client.xadd(key, &[("n", "3")]).await;

    let restarting = Instant::now();
    cluster.restart_node(killed).await;
    let rejoin = restarting.elapsed();
    let info = cluster
        .node(killed)
        .client()
        .await
        .info_map(&["INFO", "replication"])
        .await;
    let get = |k: &str| {
        info.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(get("role").as_deref(), Some("slave"), "{info:?}");
    assert_eq!(
        get("master_port"),
        Some(new_master.port().to_string()),
        "{info:?}"
    );
    assert_eq!(
        cluster.masters().await,
        masters,
        "the restarted node did not take its slots back"
    );
    // Entry 3 (and 2, earlier in the replication stream) reached the
    // rejoined replica, which serves reads of its master's slots once told
    // READONLY.
    assert_eq!(
        client.cmd(&["WAIT", "1", "5000"]).await,
        RespValue::Int(1),
        "the rejoined replica acknowledges"
    );
    let mut replica = cluster.node(killed).client().await;
    assert!(replica.cmd(&["READONLY"]).await.is_ok());
    assert_eq!(replica.xlen(key).await, 3);
    eprintln!("cluster formed in {formed:?}, failover took {failover:?}, rejoin {rejoin:?}");
}

/// Publishes message `n` to `EVENTS` with a message id (so a retry after a lost ack is not
/// stored twice) until it is acknowledged; returns how long that took. Panics after 20 s.
async fn publish_acked(js: &jetstream::Context, n: usize) -> Duration {
    const PUBLISH_DEADLINE: Duration = Duration::from_secs(20);
    let started = Instant::now();
    loop {
        let message = PublishMessage::build()
            .payload(n.to_string().into())
            .message_id(format!("msg-{n}"));
        let acked = match js.send_publish(format!("events.pos-{n}"), message).await {
            Ok(ack) => ack.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match acked {
            Ok(ack) => {
                assert_eq!(ack.stream, "EVENTS");
                return started.elapsed();
            }
            Err(e) if started.elapsed() >= PUBLISH_DEADLINE => {
                panic!("message {n} not acknowledged within {PUBLISH_DEADLINE:?}: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Three nodes form a JetStream cluster with a meta leader; `urls` joins every node's URL
/// with commas, which async-nats 0.46 cannot parse, while `server_urls` connects; a client
/// given one URL learns the other nodes from the server.
#[tokio::test]
async fn nats_cluster_forms_and_names_its_nodes() {
    let started = Instant::now();
    let cluster = NatsCluster::start(3).await;
    let formed = started.elapsed();
    assert_eq!(cluster.node_count(), 3);
    let urls = cluster.server_urls();
    assert_eq!(urls.len(), 3);
    assert_eq!(cluster.urls(), urls.join(","));
    assert_eq!(
        urls[1],
        format!("nats://127.0.0.1:{}", cluster.addr(1).port())
    );
    assert_eq!(cluster.url(2), urls[2]);

    let error = cluster
        .urls()
        .parse::<async_nats::ServerAddr>()
        .expect_err("async-nats 0.46 takes one URL per string");
    assert!(error.to_string().contains("invalid port"), "{error}");
    let client = cluster.client().await;
    client.flush().await.expect("flush");

    let single = async_nats::connect(cluster.url(0)).await.expect("connect");
    let discovered = single.server_info().connect_urls;
    for i in 1..3 {
        let addr = cluster.addr(i).to_string();
        assert!(
            discovered.iter().any(|u| u.ends_with(&addr)),
            "{addr} not in {discovered:?}"
        );
    }

    let mut leaders = Vec::new();
    for i in 0..3 {
        let jsz = http::get(cluster.monitor_addr(i), "/jsz").await.json();
        assert_eq!(jsz["meta_cluster"]["name"], "posthorn", "{jsz}");
        leaders.push(
            jsz["meta_cluster"]["leader"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        );
    }
    assert!(
        cluster.index_of(&leaders[0]).is_some() && leaders.iter().all(|l| *l == leaders[0]),
        "meta leaders {leaders:?}"
    );
    eprintln!(
        "NATS cluster formed in {formed:?}, meta leader {}",
        leaders[0]
    );
}

/// An R3 stream keeps acknowledging publishes after the node leading it is SIGKILLed (a new
/// leader is elected, the client moves to a live node), no message is lost or stored twice,
/// and once the node restarts with its store the stream reports three current replicas again.
#[tokio::test]
async fn nats_cluster_r3_stream_survives_a_killed_node() {
    let mut cluster = NatsCluster::start(3).await;
    let mut stream = cluster
        .create_replicated_stream(stream::Config {
            name: "EVENTS".into(),
            subjects: vec!["events.>".into()],
            ..Default::default()
        })
        .await;
    let info = stream.info().await.expect("stream info");
    assert_eq!(info.config.num_replicas, 3);
    let replicas = &info.cluster.as_ref().expect("clustered").replicas;
    assert_eq!(replicas.len(), 2, "{replicas:?}");

    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(2))
        .build(cluster.client().await);
    for n in 0..10 {
        publish_acked(&js, n).await;
    }
    let leader = cluster.stream_leader("EVENTS").await;
    cluster.kill(leader);
    let mut slowest = Duration::ZERO;
    for n in 10..40 {
        slowest = slowest.max(publish_acked(&js, n).await);
    }
    let new_leader = cluster.stream_leader("EVENTS").await;
    assert_ne!(new_leader, leader);
    let info = js
        .get_stream("EVENTS")
        .await
        .expect("stream")
        .get_info()
        .await
        .expect("info");
    assert_eq!(info.state.messages, 40);
    let peers = info.cluster.expect("clustered").replicas;
    let dead = cluster.server_name(leader);
    assert!(
        peers.iter().any(|p| p.name == dead && !p.current),
        "the killed node still looks current: {peers:?}"
    );

    let restarting = Instant::now();
    cluster.restart(leader).await;
    let rejoined = restarting.elapsed();
    let info = cluster.wait_stream_current("EVENTS").await;
    let current = restarting.elapsed();
    assert_eq!(info.state.messages, 40);
    assert_eq!(info.state.last_sequence, 40);
    let peers = info.cluster.expect("clustered").replicas;
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert!(peers.iter().all(|p| p.current && !p.offline), "{peers:?}");
    // And it serves clients again: a publish through it alone is stored by the cluster.
    let through_restarted = jetstream::new(
        async_nats::connect(cluster.url(leader))
            .await
            .expect("connect to the restarted node"),
    );
    publish_acked(&through_restarted, 40).await;
    eprintln!(
        "slowest ack after the kill {slowest:?}; restarted node back in {rejoined:?}, \
         stream current after {current:?}"
    );
}

/// A client given only the URL of one node keeps publishing after that node is killed: it
/// reconnects to a node it learnt from the server's `connect_urls`, as the hub (which takes
/// one `nats.url`) would.
#[tokio::test]
async fn nats_cluster_single_url_client_fails_over_to_discovered_nodes() {
    let mut cluster = NatsCluster::start(3).await;
    cluster
        .create_replicated_stream(stream::Config {
            name: "EVENTS".into(),
            subjects: vec!["events.>".into()],
            ..Default::default()
        })
        .await;
    let client = async_nats::connect(cluster.url(0)).await.expect("connect");
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(2))
        .build(client.clone());
    publish_acked(&js, 0).await;
    cluster.kill(0);
    let took = publish_acked(&js, 1).await;
    let now_on = client.server_info().port;
    assert_ne!(now_on, cluster.addr(0).port());
    eprintln!("single-URL client re-acknowledged after {took:?}, now on port {now_on}");
}

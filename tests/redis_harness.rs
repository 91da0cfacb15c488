//! Self-tests of the Redis pieces of the harness (`support::redis`): real
//! `redis-server` processes (standalone, AOF, cluster) driven through the
//! in-test RESP connection (redis-protocol's codec), without the hub.

mod support;

use std::net::SocketAddr;

use support::redis::{self, RespValue};
use support::{RedisCluster, RedisServer, RespClient};

fn bulk(s: &str) -> RespValue {
    RespValue::Bulk(Some(s.as_bytes().to_vec()))
}

/// A standalone server starts on a free port, answers PING, and the client
/// can XADD and read the entries back with XRANGE; error and null replies
/// come back as values.
#[tokio::test]
async fn standalone_ping_xadd_xrange() {
    let server = RedisServer::start().await;
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    let mut client = server.client().await;
    assert_eq!(
        client.cmd(&["PING"]).await,
        RespValue::Simple("PONG".into())
    );

    let first = client
        .xadd("pos:stream", &[("type", "sale"), ("amount", "12.50")])
        .await;
    let second = client.xadd("pos:stream", &[("type", "void")]).await;
    assert_ne!(first, second);
    assert_eq!(client.xlen("pos:stream").await, 2);

    let range = client.cmd(&["XRANGE", "pos:stream", "-", "+"]).await;
    let entries = range.as_array().expect("XRANGE array");
    assert_eq!(entries.len(), 2);
    let entry = entries[0].as_array().expect("entry");
    assert_eq!(entry[0].as_str(), Some(first.as_str()));
    assert_eq!(
        entry[1],
        RespValue::Array(Some(vec![
            bulk("type"),
            bulk("sale"),
            bulk("amount"),
            bulk("12.50")
        ]))
    );
    let entry = entries[1].as_array().expect("entry");
    assert_eq!(entry[0].as_str(), Some(second.as_str()));

    let binary = client
        .cmd_bytes(&[b"SET", b"bin", &[0xff, 0x00, b'\r', b'\n']])
        .await;
    assert!(binary.is_ok(), "{binary:?}");
    assert_eq!(
        client.cmd(&["GET", "bin"]).await.as_bytes(),
        Some(&[0xff, 0x00, b'\r', b'\n'][..])
    );

    assert!(client.cmd(&["GET", "missing"]).await.is_null());
    let err = client.cmd(&["XADD", "pos:stream"]).await;
    assert!(
        err.as_error().is_some_and(|e| e.contains("wrong number")),
        "{err:?}"
    );
    assert!(client
        .cmd(&["CONFIG", "SET", "maxmemory", "64mb"])
        .await
        .is_ok());

    client.flushall().await;
    assert_eq!(client.xlen("pos:stream").await, 0);
}

/// With AOF (`appendfsync always`) every acknowledged XADD survives a
/// SIGKILL and restart on the same port.
#[tokio::test]
async fn aof_restart_keeps_stream() {
    let mut server = RedisServer::builder().appendonly(true).start().await;
    let port = server.port();
    let mut client = server.client().await;
    for i in 0..3 {
        client.xadd("aof:stream", &[("n", &i.to_string())]).await;
    }
    assert_eq!(client.xlen("aof:stream").await, 3);
    drop(client);

    server.restart().await;
    assert_eq!(server.port(), port);
    assert!(server.dir().join("appendonlydir").is_dir());
    assert_eq!(server.client().await.xlen("aof:stream").await, 3);
}

/// Without persistence a restart on the same port comes back empty.
#[tokio::test]
async fn restart_without_aof_loses_stream() {
    let mut server = RedisServer::start().await;
    let port = server.port();
    let mut client = server.client().await;
    client.xadd("volatile:stream", &[("n", "1")]).await;
    assert_eq!(client.xlen("volatile:stream").await, 1);
    drop(client);

    server.restart().await;
    assert_eq!(server.port(), port);
    assert_eq!(server.client().await.xlen("volatile:stream").await, 0);
}

/// `stop` leaves nothing listening on the port (an outage, as the hub sees
/// it) and `start_again` brings the server back on the same address.
#[tokio::test]
async fn stop_then_start_again_on_same_port() {
    let mut server = RedisServer::start().await;
    let addr = server.addr();
    server.stop().await;
    assert!(!server.is_running());
    assert!(RespClient::try_connect(addr).await.is_err());

    server.start_again().await;
    assert_eq!(server.addr(), addr);
    assert!(server.is_running());
    let mut client = RespClient::connect(addr).await;
    assert_eq!(client.cmd(&["PING"]).await.as_str(), Some("PONG"));
}

fn cluster_info(info: &[(String, String)], key: &str) -> String {
    info.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key} in CLUSTER INFO: {info:?}"))
}

/// Three masters form a cluster (every node `cluster_state:ok`, 3 masters
/// serving slots); the local slot function agrees with CLUSTER KEYSLOT; a
/// raw XADD to a non-owner gets `-MOVED` to the owner, and `xadd` through the
/// cluster lands on the owning node of each hash tag.
#[tokio::test]
async fn cluster_of_three_routes_hash_tags_to_owners() {
    let cluster = RedisCluster::start(3).await;
    let nodes = cluster.nodes();
    assert_eq!(nodes.len(), 3);
    assert_eq!(cluster.seed_url(), format!("redis://{}", nodes[0]));

    for &node in &nodes {
        let mut client = RespClient::connect(node).await;
        let info = client.info_map(&["CLUSTER", "INFO"]).await;
        assert_eq!(cluster_info(&info, "cluster_state"), "ok", "{node}");
        assert_eq!(cluster_info(&info, "cluster_size"), "3", "{node}");
        let listing = client.cmd(&["CLUSTER", "NODES"]).await;
        let masters = listing
            .as_str()
            .expect("CLUSTER NODES text")
            .lines()
            .filter(|l| l.split(' ').nth(2).is_some_and(|f| f.contains("master")))
            .count();
        assert_eq!(masters, 3, "{node}: {listing:?}");
    }

    let mut seed = RespClient::connect(nodes[0]).await;
    for key in [
        "{g0}",
        "{g1}",
        "posthorn:{g0}:events",
        "plain",
        "{}x",
        "a{b}c{d}",
    ] {
        let reply = seed.cmd(&["CLUSTER", "KEYSLOT", key]).await;
        assert_eq!(
            reply.as_int(),
            Some(i64::from(redis::key_slot(key))),
            "{key}"
        );
    }

    for tag in ["g0", "g1"] {
        let key = format!("posthorn:{{{tag}}}:events");
        let owner = cluster.owner_of(&key).await;
        assert!(nodes.contains(&owner), "{owner} not in {nodes:?}");

        let other = *nodes.iter().find(|&&n| n != owner).expect("a non-owner");
        let reply = RespClient::connect(other)
            .await
            .cmd(&["XADD", &key, "*", "f", "v"])
            .await;
        let (slot, target) = redis::redirect_target(&reply)
            .unwrap_or_else(|| panic!("expected MOVED from {other}: {reply:?}"));
        assert_eq!(slot, redis::key_slot(&key));
        assert_eq!(target, owner);

        let id = cluster.xadd(&key, &[("tag", tag)]).await;
        assert!(id.contains('-'), "{id}");
        assert_eq!(RespClient::connect(owner).await.xlen(&key).await, 1);
        let mut routed = cluster.client_for_key(&key).await;
        assert_eq!(routed.addr(), owner);
        assert_eq!(routed.xlen(&key).await, 1);
    }

    cluster.flushall().await;
    for tag in ["g0", "g1"] {
        let key = format!("posthorn:{{{tag}}}:events");
        assert_eq!(cluster.client_for_key(&key).await.xlen(&key).await, 0);
    }
}

/// Fewer than three masters (which `redis-cli --cluster create` refuses)
/// are formed by hand and still cover every slot.
#[tokio::test]
async fn cluster_of_two_is_formed_by_hand() {
    let cluster = RedisCluster::start(2).await;
    let owners: Vec<SocketAddr> = vec![
        cluster.owner_of("{a}").await, // slot 15495
        cluster.owner_of("{b}").await, // slot 3300
    ];
    assert_ne!(owners[0], owners[1]);
    assert_eq!(
        cluster.cmd_for_key("{a}", &["SET", "{a}", "1"]).await,
        RespValue::Simple("OK".into())
    );
}

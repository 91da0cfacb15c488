//! Black-box tests of what only `backend.kind = "redis"` has, against real
//! redis-server processes: several standalone instances, hash-tag groups on a 3-master cluster,
//! a tail's blocked XREAD, the trim lease and periodic trim, restarts from older RDB snapshots,
//! the epoch marker, libfaketime's clock, a batch half appended across instances. What every
//! backend must do (order, resume, expiry, data loss, outages, idempotency, external producers,
//! two pods) is the conformance suite's, which runs it on Redis standalone and Redis Cluster
//! too (tests/conformance/).

mod support;

use support::sse::resync_reason;

use std::time::Duration;

use serde_json::{json, Value};
use support::{
    http, live_stream, publish_to,
    redis::{RedisCluster, RedisServer},
    stream_path, Hub, SseClient, SseEvent, SseNext,
};

const WAIT: Duration = Duration::from_secs(20);

fn redis_hub(url: &str) -> support::hub::HubBuilder {
    Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", url)
        // Short blocks keep shutdown and checks quick in tests; behaviour is the same.
        .env("POSTHORN_REDIS__BLOCK", "1s")
}

async fn publish(hub: &Hub, event: Value) -> http::HttpResponse {
    http::post_json(hub.addr(), "/v1/events", &event).await
}

fn crc_shard(device: &str, shards: u32) -> u32 {
    crc32fast::hash(device.as_bytes()) % shards
}

/// With `redis.urls` shards are split evenly over the instances in order: each device's events
/// land on the instance of its shard, and every device is served, broadcasts included.
#[tokio::test]
async fn several_standalone_instances_split_the_shards() {
    let first = RedisServer::start().await;
    let second = RedisServer::start().await;
    let hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env(
            "POSTHORN_REDIS__URLS",
            format!("{},{}", first.url(), second.url()),
        )
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .start()
        .await;
    // pos-17 is on shard 2 (first instance), find a device on the second half.
    let low = "pos-17";
    let high = (0..)
        .map(|i| format!("dev-{i}"))
        .find(|d| crc_shard(d, 64) >= 32)
        .unwrap();
    let mut low_client = live_stream(&hub, low).await;
    let mut high_client = live_stream(&hub, &high).await;
    publish_to(&hub, low, "low").await;
    publish_to(&hub, &high, "high").await;
    publish(&hub, json!({ "broadcast": true, "data": "all" })).await;
    assert_eq!(low_client.expect_event(WAIT).await.data, "low");
    assert_eq!(high_client.expect_event(WAIT).await.data, "high");
    assert_eq!(low_client.expect_event(WAIT).await.data, "all");
    assert_eq!(high_client.expect_event(WAIT).await.data, "all");
    let low_key = format!("pos-ev:{}", crc_shard(low, 64));
    let high_key = format!("pos-ev:{}", crc_shard(&high, 64));
    assert_eq!(first.client().await.xlen(&low_key).await, 2);
    assert_eq!(second.client().await.xlen(&low_key).await, 0);
    assert_eq!(second.client().await.xlen(&high_key).await, 2);
    assert_eq!(first.client().await.xlen(&high_key).await, 0);
}

/// On a real 3-master cluster with hash-tag groups, publishing, external producers and resume all
/// work: every group's keys share a slot (no CROSSSLOT), whichever node owns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_with_hash_tag_groups() {
    let cluster = RedisCluster::start(3).await;
    let hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", cluster.seed_url())
        .env("POSTHORN_REDIS__CLUSTER", "true")
        .env("POSTHORN_REDIS__GROUPS", "4")
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .start()
        .await;
    let devices: Vec<String> = (0..4)
        .map(|group| {
            (0..)
                .map(|i| format!("c-{i}"))
                .find(|d| crc_shard(d, 64) / 16 == group)
                .unwrap()
        })
        .collect();
    let mut clients = Vec::new();
    for device in &devices {
        clients.push(live_stream(&hub, device).await);
    }
    let mut cursors = Vec::new();
    for device in &devices {
        cursors.push(publish_to(&hub, device, "hub").await);
        let shard = crc_shard(device, 64);
        let key = format!("pos-ev:{{g{}}}:{shard}", shard / 16);
        cluster
            .xadd(&key, &[("dev", device.as_str()), ("data", "external")])
            .await;
    }
    publish(&hub, json!({ "broadcast": true, "data": "all" })).await;
    for client in &mut clients {
        let data: Vec<String> = client
            .expect_events(3, WAIT)
            .await
            .into_iter()
            .map(|e| e.data)
            .collect();
        assert_eq!(data, ["hub", "external", "all"]);
    }
    drop(clients);
    for (device, cursor) in devices.iter().zip(&cursors) {
        let mut resumed = SseClient::connect(
            hub.addr(),
            &stream_path(device),
            &[("Last-Event-ID", cursor)],
        )
        .await;
        let data: Vec<String> = resumed
            .expect_events(2, WAIT)
            .await
            .into_iter()
            .map(|e| e.data)
            .collect();
        assert_eq!(data, ["external", "all"], "resume on {device}");
    }
    assert_eq!(http::get(hub.addr(), "/readyz").await.status, 200);
    assert!(!hub.stderr_log().contains("CROSSSLOT"));
}

/// SIGTERM ends the hub promptly although its tail is blocked in a 30 s XREAD: stopping a tail
/// abandons the blocked read instead of waiting for the block timeout.
#[tokio::test]
async fn shutdown_does_not_wait_for_a_blocked_read() {
    let redis = RedisServer::start().await;
    let mut hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__BLOCK", "30s")
        .start()
        .await;
    // The tail is in its blocking read once Redis lists a client blocked (flag `b`) in XREAD.
    let mut admin = redis.client().await;
    support::wait_until(WAIT, "the tail blocked in XREAD", async || {
        let clients = admin.cmd(&["CLIENT", "LIST"]).await;
        clients.as_str().is_some_and(|text| {
            text.lines().any(|client| {
                let fields: Vec<&str> = client.split(' ').collect();
                fields.contains(&"cmd=xread")
                    && fields
                        .iter()
                        .any(|field| field.starts_with("flags=") && field.contains('b'))
            })
        })
    })
    .await;
    let started = std::time::Instant::now();
    hub.signal("TERM");
    let status = hub
        .wait_exit(Duration::from_secs(20))
        .await
        .expect("the hub exits");
    assert_eq!(status.code(), Some(0));
    // Shutdown itself waits at most the 2 s server shutdown timeout; 30 s would mean the read
    // was awaited.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
}

/// Streams written only by an external producer that never trims stay bounded: the hub's
/// periodic trim applies `redis.max_len` and `redis.retention` to every shard of its group.
#[tokio::test]
async fn periodic_trim_bounds_external_streams() {
    // One entry per stream node, so `~` trimming is exact enough to observe.
    let redis = RedisServer::builder()
        .config("stream-node-max-entries", "1")
        .start()
        .await;
    let hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .env("POSTHORN_REDIS__MAX_LEN", "5")
        // Retention 2 s: the trim runs every second (retention / 2, at least 1 s).
        .env("POSTHORN_REDIS__RETENTION", "2s")
        .start()
        .await;
    let mut client = redis.client().await;
    for i in 0..40 {
        client
            .xadd("pos-ev:3", &[("dev", "x-1"), ("data", &i.to_string())])
            .await;
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    while client.xlen("pos-ev:3").await > 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "length cap never applied"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Then age: everything is older than the retention after a few seconds.
    while client.xlen("pos-ev:3").await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "retention never applied"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(hub);
}

/// The supersede index (`pos-ev:sup:<shard>`, docs/stream-format.md) stays as large as what is
/// stored: the trim pass forgets a name whose newest entry the length cap removed, keeps a name
/// whose entry is still stored, and removes the index once retention emptied the stream.
#[tokio::test]
async fn the_trim_pass_prunes_the_supersede_index() {
    // One entry per stream node, so `~` trimming by length is exact.
    let redis = RedisServer::builder()
        .config("stream-node-max-entries", "1")
        .start()
        .await;
    // Retention 6 s: a trim pass every 3 s; entries age out after 6 s.
    let hub = redis_hub(&redis.url())
        .env("POSTHORN_REDIS__MAX_LEN", "3")
        .env("POSTHORN_REDIS__RETENTION", "6s")
        .start()
        .await;
    let versioned =
        |data: &str, name: &str| json!({ "device": "pos-17", "data": data, "supersede": name });
    assert_eq!(
        publish(&hub, versioned("prices", "prices")).await.status,
        201
    );
    for n in 0..3 {
        publish_to(&hub, "pos-17", &format!("plain {n}")).await;
    }
    assert_eq!(publish(&hub, versioned("menu", "menu")).await.status, 201);
    let mut client = redis.client().await;
    let index = "pos-ev:sup:2";
    let hlen = |reply: support::redis::RespValue| reply.as_int().expect("HLEN");
    assert_eq!(hlen(client.cmd(&["HLEN", index]).await), 2);
    let deadline = tokio::time::Instant::now() + WAIT;
    while hlen(client.cmd(&["HLEN", index]).await) > 1 {
        assert!(tokio::time::Instant::now() < deadline, "never pruned");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kept = client.cmd(&["HEXISTS", index, "pos-17/menu"]).await;
    assert_eq!(
        kept.as_int(),
        Some(1),
        "pruned by name: the trimmed one goes, the stored one stays"
    );
    while client.cmd(&["EXISTS", index]).await.as_int() != Some(0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the index outlived its stream's entries"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(hub);
}

/// A shard whose entries all aged out (the tail had read them) and that then gets a new one
/// missed nothing: its live stream gets the new event, not a needless `resync` `expired`,
/// although the tail's last position is no longer stored.
#[tokio::test]
async fn a_stream_that_aged_out_goes_on_without_resync() {
    let redis = RedisServer::builder()
        .config("stream-node-max-entries", "1")
        .start()
        .await;
    let hub = redis_hub(&redis.url())
        .env("POSTHORN_REDIS__RETENTION", "2s")
        .start()
        .await;
    let device = "pos-idle";
    let mut client = live_stream(&hub, device).await;
    publish_to(&hub, device, "e1").await;
    assert_eq!(client.expect_event(WAIT).await.data, "e1");
    let key = format!("pos-ev:{}", crc_shard(device, 64));
    let mut admin = redis.client().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while admin.xlen(&key).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "retention never applied"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A duration, not a synchronisation: more than one period of the tail's check (every 2 s)
    // must pass with nothing stored, and nothing outside the hub tells a check from an empty read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    publish_to(&hub, device, "e2").await;
    let next = client.expect_event(WAIT).await;
    assert_eq!(
        (next.event.as_str(), next.data.as_str()),
        ("test", "e2"),
        "the live stream goes on"
    );
    let scrape = support::metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape
            .value("sse_resyncs_total", &[("reason", "expired")])
            .unwrap_or(0.0),
        0.0,
        "no resync was sent"
    );
}

/// A connection break that fred may ride out by itself (it reconnects and sends a read that was
/// queued or in flight again, so no read of the tail fails) still counts as a reconnect of the
/// tail, every time, and the stream goes on without a gap. Three outages of different lengths,
/// each of which must raise the count.
#[tokio::test]
async fn every_outage_is_counted_as_a_reconnect() {
    let mut redis = RedisServer::builder().appendonly(true).start().await;
    let hub = redis_hub(&redis.url()).start().await;
    let mut client = live_stream(&hub, "pos-6").await;
    for outage in 1..=3 {
        let before = support::metrics::scrape(hub.addr())
            .await
            .value_or_zero("redis_tail_reconnects_total", &[("group", "0")]);
        redis.stop().await;
        // The outage's length, different each time: a duration, not a synchronisation.
        tokio::time::sleep(Duration::from_millis(300 * outage)).await;
        redis.start_again().await;
        let data = format!("after outage {outage}");
        let deadline = tokio::time::Instant::now() + WAIT;
        while publish(
            &hub,
            json!({ "device": "pos-6", "type": "test", "data": data }),
        )
        .await
        .status
            != 201
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "publish never recovered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(client.expect_event(WAIT).await.data, data);
        // Each outage counts (a second count for one outage is harmless, a missing one is not).
        support::metrics::wait_for(
            hub.addr(),
            "redis_tail_reconnects_total",
            &[("group", "0")],
            before + 1.0,
            WAIT,
        )
        .await;
    }
}

/// Entries appended and trimmed away while the tail could not read (here its user lost the
/// XREAD permission for a while) are not silently skipped: the connections of that shard get
/// `resync` `expired`, then the events that are still there.
#[tokio::test]
async fn entries_trimmed_during_an_outage_give_resync() {
    let redis = RedisServer::start().await;
    let hub = redis_hub(&redis.url()).start().await;
    let mut client = live_stream(&hub, "pos-4").await;
    let mut admin = redis.client().await;
    assert!(admin
        .cmd(&["ACL", "SETUSER", "producer", "on", ">pw", "~*", "&*", "+@all"])
        .await
        .is_ok());
    let mut producer = redis.client().await;
    assert!(producer.cmd(&["AUTH", "producer", "pw"]).await.is_ok());
    // The hub connects as the default user: take its XREAD away, and let its blocked read end.
    assert!(admin
        .cmd(&["ACL", "SETUSER", "default", "-xread"])
        .await
        .is_ok());
    admin
        .cmd(&[
            "CLIENT", "KILL", "TYPE", "normal", "USER", "default", "SKIPME", "yes",
        ])
        .await;
    // The entries below must come while the tail cannot read: once its read was refused.
    support::wait_until(WAIT, "the tail refused its XREAD", async || {
        let status = http::get(hub.addr(), "/admin/status").await.json();
        status["tails"][0]["state"] == "retrying"
    })
    .await;
    let key = format!("pos-ev:{}", crc_shard("pos-4", 64));
    for i in 0..5 {
        producer
            .xadd(&key, &[("dev", "pos-4"), ("data", &format!("missed-{i}"))])
            .await;
    }
    producer.cmd(&["XTRIM", &key, "MAXLEN", "1"]).await;
    assert!(admin
        .cmd(&["ACL", "SETUSER", "default", "+xread"])
        .await
        .is_ok());
    let event = client.expect_event(WAIT).await;
    assert_eq!(resync_reason(&event), "expired", "{event:?}");
    assert_eq!(
        client.expect_event(WAIT).await.data,
        "missed-4",
        "what remains is delivered"
    );
}

// ---------------------------------------------------------------------------------------------
// Data loss the epoch key does not see. Every open stream of an affected shard gets
// one `resync` `data_lost` within 10 s of the loss, then live events; a cursor from before the
// loss gets `data_lost` on resume.
// ---------------------------------------------------------------------------------------------

/// How long a client may wait for the resync that reports a loss (docs/stream-format.md: within 10 s).
const LOSS_NOTICE: Duration = Duration::from_secs(10);

/// Opens the stream of `device` resuming after `cursor`.
async fn resume(hub: &Hub, device: &str, cursor: &str) -> SseClient {
    let client = SseClient::connect(
        hub.addr(),
        &stream_path(device),
        &[("Last-Event-ID", cursor)],
    )
    .await;
    assert_eq!(client.status(), 200);
    client
}

/// Skips events published before the loss that the client may still receive, and returns the
/// resync; fails if none arrives within [`LOSS_NOTICE`].
async fn expect_resync(client: &mut SseClient) -> SseEvent {
    let deadline = tokio::time::Instant::now() + LOSS_NOTICE;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match client.next_event(left).await {
            SseNext::Event(event) if event.event == "resync" => return event,
            SseNext::Event(event) => {
                assert!(
                    event.data.starts_with("before"),
                    "an event after the loss came first: {event:?}"
                )
            }
            other => panic!("no resync within {LOSS_NOTICE:?}: {other:?}"),
        }
    }
}

/// Bug pinned: a Redis that restarts from an older RDB snapshot keeps the epoch key
/// it had then, and the streams went back in time: cursors from after the snapshot replayed
/// whatever came next, cursors from before it replayed past the lost events, and the tail never
/// noticed that a stream's last id went backwards. Now all of them get `data_lost`.
#[tokio::test]
async fn a_restart_from_an_older_snapshot_gives_data_lost() {
    let mut redis = RedisServer::start().await;
    let hub = redis_hub(&redis.url()).start().await;
    let before_snapshot = publish_to(&hub, "pos-3", "before 1").await;
    let snapshot = redis.snapshot().await;
    let mut connected = live_stream(&hub, "pos-3").await;
    let after_snapshot = publish_to(&hub, "pos-3", "before 2").await;
    publish_to(&hub, "pos-3", "before 3").await;
    connected.expect_events(2, WAIT).await;

    redis.restart_from(&snapshot).await;
    assert_eq!(
        resync_reason(&expect_resync(&mut connected).await),
        "data_lost"
    );
    publish_to(&hub, "pos-3", "new life 1").await;
    assert_eq!(connected.expect_event(WAIT).await.data, "new life 1");
    // The device comes back with a cursor from before the loss (each replaces the stream
    // before it), whether its entry survived in the snapshot or not.
    for cursor in [&before_snapshot, &after_snapshot] {
        let mut back = resume(&hub, "pos-3", cursor).await;
        assert_eq!(
            resync_reason(&back.expect_event(WAIT).await),
            "data_lost",
            "cursor {cursor}"
        );
        publish_to(&hub, "pos-3", "new life 2").await;
        assert_eq!(back.expect_event(WAIT).await.data, "new life 2");
    }
}

/// libfaketime, which runs a hub with its wall clock shifted (Debian package `libfaketime`,
/// installed by scripts/test).
fn libfaketime() -> String {
    let found = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ]
    .iter()
    .map(|dir| format!("{dir}/faketime/libfaketimeMT.so.1"))
    .find(|path| std::path::Path::new(path).is_file());
    found.expect(
        "libfaketime is not installed (Debian package libfaketime; scripts/test installs it)",
    )
}

/// Bug pinned: retention was applied with the pod's clock against Redis ids, which
/// carry Redis' clock: a pod whose clock ran ahead by more than the retention trimmed what it had
/// just acknowledged. A pod an hour ahead now keeps every event of a 15-minute window, for live
/// clients and for resumes alike.
#[tokio::test]
async fn retention_follows_the_redis_clock() {
    let redis = RedisServer::start().await;
    let hub = redis_hub(&redis.url())
        .env("LD_PRELOAD", libfaketime())
        .env("FAKETIME", "+1h")
        // Timers and timeouts keep the real pace; only the wall clock is off.
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .env("POSTHORN_REDIS__RETENTION", "15m")
        .start()
        .await;
    let mut client = live_stream(&hub, "pos-5").await;
    let first = publish_to(&hub, "pos-5", "1").await;
    publish_to(&hub, "pos-5", "2").await;
    publish_to(&hub, "pos-5", "3").await;
    let live: Vec<String> = client
        .expect_events(3, WAIT)
        .await
        .into_iter()
        .map(|event| event.data)
        .collect();
    assert_eq!(live, ["1", "2", "3"]);
    let mut resumed = resume(&hub, "pos-5", &first).await;
    let replayed: Vec<String> = resumed
        .expect_events(2, WAIT)
        .await
        .into_iter()
        .map(|event| event.data)
        .collect();
    assert_eq!(replayed, ["2", "3"], "nothing was trimmed");
    let key = format!("pos-ev:{}", crc_shard("pos-5", 64));
    assert_eq!(redis.client().await.xlen(&key).await, 3);
}

/// A device on the `group`-th half of 64 shards split over two instances.
fn device_in_group(group: u32) -> String {
    (0..)
        .map(|i| format!("d-{i}"))
        .find(|device| crc_shard(device, 64) / 32 == group)
        .expect("some device lands in each half")
}

/// Bug pinned: a batch that failed after part of it was appended (one of two
/// `redis.urls` down) answered a bare 503, so the producer's retry appended the first part again
/// (items without keys) and a broadcast could stay on half the shards. Now the answer is 207 and
/// names per item the id of what was appended and an error for what was not; retrying the batch
/// with its keys completes it without appending anything twice.
#[tokio::test]
async fn a_half_appended_batch_names_each_item() {
    let first = RedisServer::start().await;
    // With AOF: what the second instance has survives its outage.
    let mut second = RedisServer::builder().appendonly(true).start().await;
    let hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env(
            "POSTHORN_REDIS__URLS",
            format!("{},{}", first.url(), second.url()),
        )
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .start()
        .await;
    let (up, down) = (device_in_group(0), device_in_group(1));
    let mut up_client = live_stream(&hub, &up).await;
    let mut down_client = live_stream(&hub, &down).await;
    let batch = json!([
        {"device": up, "data": "up", "key": "a"},
        {"device": down, "data": "down", "key": "b"},
        {"broadcast": true, "data": "all", "key": "c"},
    ]);
    second.stop().await;
    let response = publish(&hub, batch.clone()).await;
    assert_eq!(response.status, 207, "{}", response.text());
    let results = response.json()["results"].clone();
    let appended = results[0]["id"]
        .as_str()
        .expect("the first item was appended")
        .to_string();
    assert_eq!(results[0]["duplicate"], false);
    for failed in [&results[1], &results[2]] {
        assert!(failed.get("id").is_none(), "{results}");
        assert!(failed["error"].is_string(), "{results}");
        assert!(failed["message"].is_string(), "{results}");
    }
    let up_events: Vec<String> = up_client
        .expect_events(2, WAIT)
        .await
        .into_iter()
        .map(|event| event.data)
        .collect();
    assert_eq!(
        up_events,
        ["up", "all"],
        "what was appended is delivered at once"
    );

    second.start_again().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let retried = loop {
        let response = publish(&hub, batch.clone()).await;
        if response.status == 201 {
            break response.json()["results"].clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            response.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(retried[0]["duplicate"], true);
    assert_eq!(retried[0]["id"], appended.as_str());
    assert_eq!(retried[1]["duplicate"], false);
    let down_events: Vec<String> = down_client
        .expect_events(2, WAIT)
        .await
        .into_iter()
        .map(|event| event.data)
        .collect();
    assert_eq!(down_events, ["down", "all"]);
    for client in [&mut up_client, &mut down_client] {
        assert!(matches!(
            client.next_event(Duration::from_millis(500)).await,
            SseNext::Timeout
        ));
    }
    // Regression: the broadcast completed by its retry was never recorded (the first answer
    // had only half its copies, the retry's duplicate none), so the not-acknowledged query
    // answered 404 for a broadcast published through the API. Both devices still owe its ack.
    let broadcast = retried[2]["id"].as_str().expect("the broadcast's id");
    let response = http::get(
        hub.addr(),
        &format!("/v1/fleet/unacknowledged?event={broadcast}&limit=1000"),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let mut unacked: Vec<String> = response.json()["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|record| record["device"].as_str().unwrap().to_string())
        .collect();
    unacked.sort();
    let mut expected = vec![up.clone(), down.clone()];
    expected.sort();
    assert_eq!(unacked, expected);
}

/// One instance of several answering the append script with something the hub cannot read (here
/// a life marker whose name is no epoch, so the cursor it yields does not parse) fails the items
/// of that instance only: the batch is answered 207 with the other instance's ids, not a 503
/// that hides what was appended. Regression: the malformed reply was an error of the whole
/// request.
#[tokio::test]
async fn a_malformed_reply_of_one_instance_fails_its_items_only() {
    let first = RedisServer::start().await;
    let second = RedisServer::start().await;
    let hub = Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env(
            "POSTHORN_REDIS__URLS",
            format!("{},{}", first.url(), second.url()),
        )
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .start()
        .await;
    let (good, bad) = (device_in_group(0), device_in_group(1));
    let mut good_client = live_stream(&hub, &good).await;
    // '!' sorts before every epoch the hub draws, so this marker names the stream's life.
    let key = format!("pos-ev:{}", crc_shard(&bad, 64));
    let created = second
        .client()
        .await
        .cmd(&[
            "XGROUP",
            "CREATE",
            &key,
            "posthorn:epoch:!bad",
            "0",
            "MKSTREAM",
        ])
        .await;
    assert!(created.is_ok(), "{created:?}");
    let response = publish(
        &hub,
        json!([
            {"device": good, "data": "good", "key": "g"},
            {"device": bad, "data": "bad", "key": "b"},
        ]),
    )
    .await;
    assert_eq!(response.status, 207, "{}", response.text());
    let results = response.json()["results"].clone();
    let id = results[0]["id"].as_str().expect("the first item's id");
    assert_eq!(results[1]["error"], "outcome_unknown", "{results}");
    assert!(results[1].get("id").is_none(), "{results}");
    let event = good_client.expect_event(WAIT).await;
    assert_eq!(
        (event.id.as_deref(), event.data.as_str()),
        (Some(id), "good")
    );
}

/// A stream's life is named by a consumer group on the stream itself (`posthorn:epoch:<epoch>`,
/// docs/stream-format.md); losing that name is a loss too: connected clients get `data_lost`,
/// and so does a cursor from before.
#[tokio::test]
async fn a_lost_epoch_marker_gives_data_lost() {
    let redis = RedisServer::start().await;
    let hub = redis_hub(&redis.url()).start().await;
    let mut connected = live_stream(&hub, "pos-4").await;
    let cursor = publish_to(&hub, "pos-4", "before").await;
    connected.expect_event(WAIT).await;
    let epoch = cursor.split('.').next().unwrap();
    let key = format!("pos-ev:{}", crc_shard("pos-4", 64));
    let mut admin = redis.client().await;
    let destroyed = admin
        .cmd(&[
            "XGROUP",
            "DESTROY",
            &key,
            &format!("posthorn:epoch:{epoch}"),
        ])
        .await;
    assert_eq!(destroyed.as_int(), Some(1), "{destroyed:?}");
    assert_eq!(
        resync_reason(&expect_resync(&mut connected).await),
        "data_lost"
    );
    drop(connected);
    let mut back = resume(&hub, "pos-4", &cursor).await;
    assert_eq!(resync_reason(&back.expect_event(WAIT).await), "data_lost");
}

/// Bug pinned (found by the chaos checker, seed 7 of `redis-rdb`): a restart from a snapshot
/// taken before a DEL brought back a life of the stream that the pods had already left; the
/// tail took it for a new life, resynced clients to its start and sent its old events again,
/// and a cursor of that old life resumed as if nothing had happened. Now the pods remember the
/// lives they left: the stream gets a new life, connected clients get `data_lost` and then only
/// new events, and the old life's cursor gets `data_lost` too.
#[tokio::test]
async fn a_restart_from_a_snapshot_older_than_a_loss_gives_data_lost() {
    let mut redis = RedisServer::start().await;
    let hub = redis_hub(&redis.url()).start().await;
    let mut connected = live_stream(&hub, "pos-6").await;
    let old_life = publish_to(&hub, "pos-6", "before 1").await;
    let snapshot = redis.snapshot().await;
    let mut admin = redis.client().await;
    publish_to(&hub, "pos-6", "before 2").await;
    connected.expect_events(2, WAIT).await;
    let key = format!("pos-ev:{}", crc_shard("pos-6", 64));
    assert_eq!(admin.cmd(&["DEL", &key]).await.as_int(), Some(1));
    publish_to(&hub, "pos-6", "second life").await;
    assert_eq!(
        resync_reason(&expect_resync(&mut connected).await),
        "data_lost"
    );
    assert_eq!(connected.expect_event(WAIT).await.data, "second life");

    redis.restart_from(&snapshot).await;
    let resync = connected.expect_event(WAIT).await;
    assert_eq!(resync_reason(&resync), "data_lost");
    let epoch = |id: &str| id.split('.').next().unwrap().to_string();
    assert_ne!(
        epoch(resync.id.as_deref().unwrap()),
        epoch(&old_life),
        "the old life does not come back"
    );
    publish_to(&hub, "pos-6", "third life").await;
    assert_eq!(
        connected.expect_event(WAIT).await.data,
        "third life",
        "nothing of the old life is sent again"
    );
    drop(connected);
    let mut back = resume(&hub, "pos-6", &old_life).await;
    assert_eq!(resync_reason(&back.expect_event(WAIT).await), "data_lost");
}

/// Periodic trimming runs in one pod at a time: the pods of one Redis share a lease key per
/// node group (`{prefix}:trim-lease`) that names its holder; a pod that stops gives the lease
/// up at once (a token-checked delete), and another pod takes it over at its next trim.
#[tokio::test]
async fn one_pod_at_a_time_trims_and_hands_over_when_it_stops() {
    let redis = RedisServer::start().await;
    // Retention 6 s: each pod tries to trim every 3 s, and a lease lasts 9 s.
    let pod = || redis_hub(&redis.url()).env("POSTHORN_REDIS__RETENTION", "6s");
    let mut first = pod().start().await;
    let mut admin = redis.client().await;
    let holder = |reply: support::RespValue| reply.as_str().map(str::to_string);
    let deadline = tokio::time::Instant::now() + WAIT;
    let first_token = loop {
        if let Some(token) = holder(admin.cmd(&["GET", "pos-ev:trim-lease"]).await) {
            break token;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no pod took the trim lease"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let second = pod().start().await;
    // A duration, not a synchronisation: the second pod tries to trim every 3 s, so within 4 s
    // it has tried at least once, and the lease must still be the first pod's.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        holder(admin.cmd(&["GET", "pos-ev:trim-lease"]).await).as_deref(),
        Some(first_token.as_str()),
        "the first pod keeps the lease while it runs"
    );
    first.signal("TERM");
    assert_eq!(first.wait_exit(WAIT).await.and_then(|s| s.code()), Some(0));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match holder(admin.cmd(&["GET", "pos-ev:trim-lease"]).await) {
            Some(token) if token != first_token => break,
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second pod did not take the lease over within 5 s (its next trim, within 3 s; \
             a lease left to expire lasts up to 9 s)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(second);
}

/// A group event retried with its key on fewer shards (the group's index read failed the first
/// time, so every shard got a copy; the retry knows the members' shards) is a duplicate: the
/// answer is the first attempt's id and no shard gets a second copy. The append script used to
/// take a node group with one stream of the retry for a device's event and check the stored
/// answer against that stream's life, which is another shard's: it appended again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_event_retried_on_fewer_shards_is_a_duplicate() {
    use posthorn::{
        backend::{
            redis::{ConnectionSetup, RedisBackend, RedisSettings},
            Backend, NewEvent,
        },
        config::{Config, RedactedUrl},
        model::{EventType, GroupName, Target},
    };
    let redis = RedisServer::start().await;
    let mut config = Config::default();
    config.redis.url = RedactedUrl::new(redis.url());
    let setup = ConnectionSetup::read(&config.redis).expect("redis setup");
    let backend = RedisBackend::connect(
        RedisSettings {
            redis: config.redis.clone(),
            dedupe_window: Duration::from_secs(60),
        },
        &setup,
    )
    .await
    .expect("connect to redis");
    let event = |only_shards: Option<Vec<u32>>| NewEvent {
        target: Target::Group(GroupName::parse("store-17").unwrap()),
        event_type: EventType::parse("price").unwrap(),
        data: "2.40".into(),
        key: Some("price-1".into()),
        expires_ms: None,
        supersede: None,
        only_shards,
    };
    let first = backend.append(vec![event(None)]).await.expect("append");
    let first = first[0].as_ref().expect("stored");
    assert!(!first.duplicate);
    assert_eq!(first.copies.len(), 64, "every shard: {first:?}");
    let retried = backend
        .append(vec![event(Some(vec![17]))])
        .await
        .expect("append");
    let retried = retried[0].as_ref().expect("stored");
    assert!(retried.duplicate, "{retried:?}");
    assert_eq!(retried.cursor, first.cursor);
    let mut client = redis.client().await;
    assert_eq!(client.xlen("pos-ev:17").await, 1, "one copy on shard 17");
}

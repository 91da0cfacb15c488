//! The backends the suite runs on, as one type: [`Env`] holds the servers of one backend (none
//! for memory), starts hubs configured for them, and injects the faults a scenario asks for.
//!
//! A backend that cannot do a fault says so in [`Env::lacks`]; a scenario asks with
//! [`Env::part`] before each part that needs one, which records whether that part ran, and the
//! test prints the record when it ends (`cargo test --test conformance -- --nocapture` shows
//! the whole matrix). Calling a fault hook the backend lacks panics: no part is skipped without
//! being declared.
//!
//! | fault | memory | Redis standalone | Redis Cluster | NATS |
//! |---|---|---|---|---|
//! | external producer | — | XADD | XADD on the slot's owner | JetStream publish with headers |
//! | trim a shard | appends past `memory.max_len` | XTRIM MAXLEN | XTRIM MAXLEN | purge the subject |
//! | lose all data, hub running | — | FLUSHALL | FLUSHALL on every master | delete the stream |
//! | lose one shard's stream | — | DEL | DEL | — (one stream holds every shard) |
//! | outage keeping the data | — | stop, start (AOF) | stop, start every node (AOF) | stop, start |
//! | restart losing the data | restart the hub | restart without the AOF | every node without its AOF | restart without the store |
//! | count stored entries | — | XLEN | XLEN | stream info |
//! | two pods on one store | — | yes | yes | yes |
//! | unreachable at start-up | — | closed port | closed port | closed port |
//! | `publish.dedupe_window = 0s` | yes | yes | yes | yes |

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::{
    free_port, http,
    hub::HubBuilder,
    nats::{produce, stream_state, NatsServer},
    redis::RedisServer,
    Hub, RedisCluster, RespValue,
};

/// Shards of every backend in the suite (the default).
pub const SHARDS: u32 = 64;
/// `memory.max_len` of every memory hub in the suite: the length cap that [`Env::trim`] pushes
/// old entries out with. Above what any scenario appends to one shard otherwise.
const MEMORY_MAX_LEN: usize = 3_000;
/// `redis.groups` in cluster mode: shards 0–15 share hash tag `{g0}`, 16–31 `{g1}`, ...
const CLUSTER_GROUPS: u32 = 4;
/// Masters of the Redis Cluster: slots, hence groups, spread over three nodes.
const CLUSTER_MASTERS: usize = 3;
const NATS_STREAM: &str = "POSTHORN";
/// `limits.max_batch`: filler for [`Env::trim`] on memory goes in batches of this size.
const MAX_BATCH: usize = 1_000;

/// One of the four backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Memory,
    RedisStandalone,
    RedisCluster,
    Nats,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Memory => "memory",
            Kind::RedisStandalone => "redis_standalone",
            Kind::RedisCluster => "redis_cluster",
            Kind::Nats => "nats",
        }
    }

    /// `backend.kind`, which also prefixes the tail metrics (`redis_tail_lag_seconds`).
    pub fn config_kind(self) -> &'static str {
        match self {
            Kind::Memory => "memory",
            Kind::RedisStandalone | Kind::RedisCluster => "redis",
            Kind::Nats => "nats",
        }
    }
}

/// What a scenario may ask of a backend besides serving a hub: faults to inject, and a few
/// settings not every backend honours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Append entries in the documented format without the hub (docs/stream-format.md).
    ExternalProducer,
    /// Read what the backend stores, to count entries.
    InspectStore,
    /// Lose every stored entry while the hub keeps running.
    LoseAllData,
    /// Lose the stream of one shard while the others stay.
    LoseOneStream,
    /// Become unreachable and come back with every acknowledged entry.
    Outage,
    /// Restart the store so that it comes back empty while the hub keeps running (the memory
    /// backend's store is the hub: restarting it takes the hub's streams down too).
    RestartLosingDataUnderTheHub,
    /// Serve several pods from one store.
    SharedStore,
    /// Cap the entries kept per shard (`memory.max_len`, `redis.max_len`), applied as the hub
    /// appends.
    LengthCap,
    /// Be unreachable when a hub starts.
    Unreachable,
    /// Remember no idempotency key when `publish.dedupe_window` is 0 s.
    ZeroDedupeWindow,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::ExternalProducer => "external producer",
            Fault::InspectStore => "store inspection",
            Fault::LoseAllData => "loss of all data",
            Fault::LoseOneStream => "loss of one stream",
            Fault::Outage => "outage",
            Fault::RestartLosingDataUnderTheHub => "restart losing the data under a running hub",
            Fault::SharedStore => "pods sharing a store",
            Fault::LengthCap => "a length cap applied on append",
            Fault::Unreachable => "unreachable backend",
            Fault::ZeroDedupeWindow => "a dedupe window of 0 s",
        }
    }
}

/// The servers of a backend.
enum Servers {
    Memory,
    Redis(RedisServer),
    Cluster(RedisCluster),
    Nats(NatsServer),
}

/// One backend for one scenario: its servers, the hubs it starts, and a record of which parts
/// of the scenario ran.
pub struct Env {
    kind: Kind,
    servers: Servers,
    scenario: &'static str,
    /// `(part, None)` ran; `(part, Some(why))` did not, for that reason.
    parts: Vec<(String, Option<&'static str>)>,
}

impl Env {
    /// Starts the servers of `kind` (none for memory); panics when their binary is not installed.
    pub async fn start(kind: Kind, scenario: &'static str) -> Env {
        let servers = match kind {
            Kind::Memory => Servers::Memory,
            // AOF, so that an outage keeps what was acknowledged; a loss removes the files.
            Kind::RedisStandalone => {
                Servers::Redis(RedisServer::builder().appendonly(true).start().await)
            }
            Kind::RedisCluster => {
                Servers::Cluster(RedisCluster::start_persistent(CLUSTER_MASTERS).await)
            }
            Kind::Nats => Servers::Nats(NatsServer::start().await),
        };
        Env {
            kind,
            servers,
            scenario,
            parts: Vec::new(),
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Why this backend cannot do `fault`, or `None` if it can.
    pub fn lacks(&self, fault: Fault) -> Option<&'static str> {
        use Fault::*;
        match (self.kind, fault) {
            (Kind::Memory, ExternalProducer) => Some("only the hub appends to the memory backend"),
            (Kind::Memory, InspectStore) => Some("the memory backend's store is inside the hub"),
            (Kind::Memory, LoseAllData | LoseOneStream | RestartLosingDataUnderTheHub) => {
                Some("the memory backend loses its data only with the hub's process")
            }
            (Kind::Nats, LoseOneStream) => {
                Some("one JetStream stream holds every shard: losing it loses them all")
            }
            (Kind::Nats, LengthCap) => {
                Some("the hub's JetStream stream keeps messages by age only")
            }
            (Kind::Memory, Outage) => Some("the memory backend is never unreachable"),
            (Kind::Memory, SharedStore) => Some("a memory backend belongs to one pod"),
            (Kind::Memory, Unreachable) => Some("the memory backend is never unreachable"),
            _ => None,
        }
    }

    /// Records whether the part of the scenario named `part`, which needs `faults`, runs on this
    /// backend, and returns that. A scenario checks something else instead when it cannot (its
    /// doc says what).
    pub fn part(&mut self, part: &str, faults: &[Fault]) -> bool {
        let lacking = faults
            .iter()
            .find_map(|fault| self.lacks(*fault).map(|why| (fault.name(), why)));
        match lacking {
            None => {
                self.parts.push((part.to_string(), None));
                true
            }
            Some((fault, why)) => {
                self.parts
                    .push((format!("{part} (needs {fault})"), Some(why)));
                false
            }
        }
    }

    /// Records a part that runs on every backend.
    pub fn ran(&mut self, part: &str) {
        self.parts.push((part.to_string(), None));
    }

    /// What ran and what did not, one line per part.
    pub fn report(&self) -> String {
        let mut text = format!("conformance {} on {}:", self.scenario, self.kind.name());
        for (part, not_run) in &self.parts {
            match not_run {
                None => write!(text, "\n  ran      {part}"),
                Some(why) => write!(text, "\n  NOT RUN  {part}: {why}"),
            }
            .expect("writing to a String");
        }
        text
    }

    // -----------------------------------------------------------------------------------------
    // Hubs
    // -----------------------------------------------------------------------------------------

    /// A hub configured for this backend's servers; add settings and start it.
    pub fn hub(&self) -> HubBuilder {
        let builder = Hub::builder().env("POSTHORN_BACKEND__KIND", self.kind.config_kind());
        match &self.servers {
            Servers::Memory => builder.env("POSTHORN_MEMORY__MAX_LEN", MEMORY_MAX_LEN.to_string()),
            Servers::Redis(redis) => builder
                .env("POSTHORN_REDIS__URL", redis.url())
                // Short blocks keep shutdown and checks quick; behaviour is the same.
                .env("POSTHORN_REDIS__BLOCK", "1s"),
            Servers::Cluster(cluster) => builder
                .env("POSTHORN_REDIS__URL", cluster.seed_url())
                .env("POSTHORN_REDIS__CLUSTER", "true")
                .env("POSTHORN_REDIS__GROUPS", CLUSTER_GROUPS.to_string())
                .env("POSTHORN_REDIS__BLOCK", "1s"),
            Servers::Nats(nats) => builder.env("POSTHORN_NATS__URL", nats.url()),
        }
    }

    /// A hub that keeps at most about `cap` entries per shard, trimming as it appends (Redis
    /// trims whole stream nodes, so it keeps up to a node more).
    pub fn hub_with_length_cap(&self, cap: usize) -> HubBuilder {
        let key = match self.kind {
            Kind::Memory => "POSTHORN_MEMORY__MAX_LEN",
            Kind::RedisStandalone | Kind::RedisCluster => "POSTHORN_REDIS__MAX_LEN",
            Kind::Nats => self.cannot(Fault::LengthCap),
        };
        self.hub().env(key, cap.to_string())
    }

    /// A hub on this backend with its default settings.
    pub async fn start_hub(&self) -> Hub {
        self.hub().start().await
    }

    /// A hub whose backend keeps events for `retention` (`memory.retention`, `redis.retention`,
    /// `nats.retention`).
    pub fn hub_with_event_retention(&self, retention: &str) -> HubBuilder {
        let key = match self.kind {
            Kind::Memory => "POSTHORN_MEMORY__RETENTION",
            Kind::RedisStandalone | Kind::RedisCluster => "POSTHORN_REDIS__RETENTION",
            Kind::Nats => "POSTHORN_NATS__RETENTION",
        };
        self.hub().env(key, retention)
    }

    /// A hub pointed at a closed port of this backend's kind.
    pub fn unreachable_hub(&self) -> HubBuilder {
        let url = match self.kind {
            Kind::RedisStandalone | Kind::RedisCluster => {
                format!("redis://127.0.0.1:{}", free_port())
            }
            Kind::Nats => format!("nats://127.0.0.1:{}", free_port()),
            Kind::Memory => self.cannot(Fault::Unreachable),
        };
        let builder = Hub::builder().env("POSTHORN_BACKEND__KIND", self.kind.config_kind());
        match self.kind {
            Kind::Nats => builder.env("POSTHORN_NATS__URL", url),
            Kind::RedisCluster => builder
                .env("POSTHORN_REDIS__URL", url)
                .env("POSTHORN_REDIS__CLUSTER", "true")
                .env("POSTHORN_REDIS__GROUPS", CLUSTER_GROUPS.to_string()),
            _ => builder.env("POSTHORN_REDIS__URL", url),
        }
    }

    // -----------------------------------------------------------------------------------------
    // External producers
    // -----------------------------------------------------------------------------------------

    /// Appends an entry for `device` on its shard's stream in the documented format, without
    /// the hub; `event_type` `None` leaves the type out.
    pub async fn produce(&mut self, device: &str, event_type: Option<&str>, data: &str) {
        self.produce_on(shard(device), device, event_type, data)
            .await
    }

    /// Like [`Env::produce`], on the stream of shard `on`: with `device` `*`, a broadcast's copy
    /// for that shard.
    pub async fn produce_on(
        &mut self,
        on: u32,
        device: &str,
        event_type: Option<&str>,
        data: &str,
    ) {
        match &self.servers {
            Servers::Redis(_) | Servers::Cluster(_) => {
                let mut fields = vec![("dev", device)];
                if let Some(event_type) = event_type {
                    fields.push(("type", event_type));
                }
                fields.push(("data", data));
                self.xadd(on, &fields).await;
            }
            Servers::Nats(nats) => {
                let mut headers = vec![("Posthorn-Dev", device)];
                if let Some(event_type) = event_type {
                    headers.push(("Posthorn-Type", event_type));
                }
                let js = nats.jetstream().await;
                produce(&js, &nats_subject(on), &headers, data.as_bytes()).await;
            }
            Servers::Memory => self.cannot(Fault::ExternalProducer),
        }
    }

    /// Appends a group event's entry for `group` on the stream of shard `on` in the documented
    /// format, without the hub: Redis field `grp`, NATS header `Posthorn-Group`. Its type is
    /// `ext`.
    pub async fn produce_for_group(&mut self, on: u32, group: &str, data: &str) {
        match &self.servers {
            Servers::Redis(_) | Servers::Cluster(_) => {
                self.xadd(on, &[("grp", group), ("type", "ext"), ("data", data)])
                    .await;
            }
            Servers::Nats(nats) => {
                let headers = [("Posthorn-Group", group), ("Posthorn-Type", "ext")];
                let js = nats.jetstream().await;
                produce(&js, &nats_subject(on), &headers, data.as_bytes()).await;
            }
            Servers::Memory => self.cannot(Fault::ExternalProducer),
        }
    }

    /// Appends an entry for `device` (on its shard) that sets the expiry (`exp`, Unix ms) and
    /// supersede name (`sup`) itself, as docs/stream-format.md documents: Redis fields `exp` and
    /// `sup`, NATS headers `Posthorn-Exp` and `Posthorn-Supersede`. Its type is `ext`.
    pub async fn produce_with(
        &mut self,
        device: &str,
        data: &str,
        exp: Option<&str>,
        sup: Option<&str>,
    ) {
        let on = shard(device);
        match &self.servers {
            Servers::Redis(_) | Servers::Cluster(_) => {
                let mut fields = vec![("dev", device), ("type", "ext"), ("data", data)];
                fields.extend(exp.map(|exp| ("exp", exp)));
                fields.extend(sup.map(|sup| ("sup", sup)));
                self.xadd(on, &fields).await;
            }
            Servers::Nats(nats) => {
                let mut headers = vec![("Posthorn-Dev", device), ("Posthorn-Type", "ext")];
                headers.extend(exp.map(|exp| ("Posthorn-Exp", exp)));
                headers.extend(sup.map(|sup| ("Posthorn-Supersede", sup)));
                let js = nats.jetstream().await;
                produce(&js, &nats_subject(on), &headers, data.as_bytes()).await;
            }
            Servers::Memory => self.cannot(Fault::ExternalProducer),
        }
    }

    /// Appends, on `device`'s shard, entries the backend's format documents as undeliverable:
    /// a missing device, missing data, an invalid type, a body that is not UTF-8. Returns how
    /// many, which the hub counts in `tail_entries_skipped_total`.
    pub async fn produce_undeliverable(&mut self, device: &str) -> usize {
        let on = shard(device);
        match &self.servers {
            Servers::Redis(_) | Servers::Cluster(_) => {
                let entries: [&[(&str, &str)]; 3] = [
                    &[("data", "no device")],
                    &[("dev", device)],
                    &[("dev", device), ("type", "a space"), ("data", "bad type")],
                ];
                for fields in entries {
                    self.xadd(on, fields).await;
                }
                entries.len()
            }
            Servers::Nats(nats) => {
                let js = nats.jetstream().await;
                let subject = nats_subject(on);
                produce(&js, &subject, &[("Posthorn-Type", "x")], b"no device").await;
                produce(&js, &subject, &[("Posthorn-Dev", device)], &[0xff, 0xfe]).await;
                produce(
                    &js,
                    &subject,
                    &[("Posthorn-Dev", device), ("Posthorn-Type", "a space")],
                    b"bad type",
                )
                .await;
                3
            }
            Servers::Memory => self.cannot(Fault::ExternalProducer),
        }
    }

    /// `XADD` on the stream of shard `on` (Redis standalone or cluster).
    async fn xadd(&self, on: u32, fields: &[(&str, &str)]) {
        match &self.servers {
            Servers::Redis(redis) => {
                redis.client().await.xadd(&redis_key(on), fields).await;
            }
            Servers::Cluster(cluster) => {
                cluster.xadd(&cluster_key(on), fields).await;
            }
            _ => panic!("XADD on {}", self.kind.name()),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Faults
    // -----------------------------------------------------------------------------------------

    /// Removes every entry of `device`'s shard but the last `keep` (trimming, as retention
    /// does). Memory has no trim on demand: `hub` appends `memory.max_len - keep` entries for
    /// another device of the shard, which pushes the older ones out of the length cap.
    pub async fn trim(&mut self, hub: &Hub, device: &str, keep: usize) {
        let on = shard(device);
        let keep_text = keep.to_string();
        match &self.servers {
            Servers::Redis(redis) => {
                let key = redis_key(on);
                let reply = redis
                    .client()
                    .await
                    .cmd(&["XTRIM", &key, "MAXLEN", &keep_text])
                    .await;
                assert!(reply.as_int().is_some(), "XTRIM {key}: {reply:?}");
            }
            Servers::Cluster(cluster) => {
                let key = cluster_key(on);
                let reply = cluster
                    .cmd_for_key(&key, &["XTRIM", &key, "MAXLEN", &keep_text])
                    .await;
                assert!(reply.as_int().is_some(), "XTRIM {key}: {reply:?}");
            }
            Servers::Nats(nats) => {
                let js = nats.jetstream().await;
                js.get_stream(NATS_STREAM)
                    .await
                    .expect("the stream exists")
                    .purge()
                    .filter(nats_subject(on))
                    .keep(keep as u64)
                    .await
                    .expect("purge the shard's subject");
            }
            Servers::Memory => {
                let filler = neighbour(device);
                let items: Vec<Value> = (0..MEMORY_MAX_LEN - keep)
                    .map(|_| json!({ "device": filler, "data": "filler" }))
                    .collect();
                for batch in items.chunks(MAX_BATCH) {
                    let response = http::post_json(hub.addr(), "/v1/events", &json!(batch)).await;
                    assert_eq!(response.status, 201, "{}", response.text());
                }
            }
        }
    }

    /// Every stored entry is lost while the hub keeps running: FLUSHALL, or a deleted JetStream
    /// stream (which the hub creates again).
    pub async fn lose_all_data(&mut self) {
        match &self.servers {
            Servers::Redis(redis) => redis.client().await.flushall().await,
            Servers::Cluster(cluster) => cluster.flushall().await,
            Servers::Nats(nats) => nats
                .jetstream()
                .await
                .delete_stream(NATS_STREAM)
                .await
                .map(|_| ())
                .expect("delete the stream"),
            Servers::Memory => self.cannot(Fault::LoseAllData),
        }
    }

    /// The stream of `device`'s shard is deleted (with what marks its life) while every other
    /// shard keeps its data.
    pub async fn lose_stream(&mut self, device: &str) {
        self.lose_stream_of_shard(shard(device)).await
    }

    /// Like [`Env::lose_stream`], by shard.
    pub async fn lose_stream_of_shard(&mut self, on: u32) {
        let deleted = match &self.servers {
            Servers::Redis(redis) => redis.client().await.cmd(&["DEL", &redis_key(on)]).await,
            Servers::Cluster(cluster) => {
                let key = cluster_key(on);
                cluster.cmd_for_key(&key, &["DEL", &key]).await
            }
            Servers::Nats(_) | Servers::Memory => self.cannot(Fault::LoseOneStream),
        };
        assert_eq!(deleted.as_int(), Some(1), "DEL of shard {on}: {deleted:?}");
    }

    /// The backend goes away, keeping its data; [`Env::outage_end`] brings it back.
    pub async fn outage_begin(&mut self) {
        match &mut self.servers {
            Servers::Redis(redis) => redis.stop().await,
            Servers::Cluster(cluster) => {
                for i in 0..cluster.nodes().len() {
                    cluster.node_mut(i).stop().await;
                }
            }
            Servers::Nats(nats) => nats.stop().await,
            Servers::Memory => self.cannot(Fault::Outage),
        }
    }

    /// Ends [`Env::outage_begin`]: the backend answers again with all it had.
    pub async fn outage_end(&mut self) {
        match &mut self.servers {
            Servers::Redis(redis) => redis.start_again().await,
            Servers::Cluster(cluster) => {
                for i in 0..cluster.nodes().len() {
                    cluster.node_mut(i).start_again().await;
                }
                cluster.wait_ok().await;
            }
            Servers::Nats(nats) => nats.start_again().await,
            Servers::Memory => self.cannot(Fault::Outage),
        }
    }

    /// The store restarts without its data: Redis without its AOF (every node of a cluster),
    /// nats-server without its store directory. For memory the store is the hub, so `hub` is
    /// killed and started again on its port: its streams are cut, and the new process is a new
    /// life.
    pub async fn restart_losing_data(&mut self, hub: &mut Hub) {
        match &mut self.servers {
            Servers::Redis(redis) => redis.restart_without_data().await,
            Servers::Cluster(cluster) => {
                for i in 0..cluster.nodes().len() {
                    cluster.node_mut(i).restart_without_data().await;
                }
                cluster.wait_ok().await;
            }
            Servers::Nats(nats) => {
                nats.stop().await;
                std::fs::remove_dir_all(nats.dir().join("store")).expect("remove the store");
                nats.start_again().await;
            }
            Servers::Memory => {
                let port = hub.port();
                hub.kill();
                *hub = self.hub().port(port).start().await;
            }
        }
    }

    /// How many entries the backend stores over all shards.
    pub async fn stored_entries(&mut self) -> u64 {
        match &self.servers {
            Servers::Redis(redis) => {
                let mut client = redis.client().await;
                let mut total = 0;
                for on in 0..SHARDS {
                    total += client.xlen(&redis_key(on)).await;
                }
                u64::try_from(total).expect("XLEN is not negative")
            }
            Servers::Cluster(cluster) => {
                let mut total = 0;
                for on in 0..SHARDS {
                    let key = cluster_key(on);
                    let reply = cluster.cmd_for_key(&key, &["XLEN", &key]).await;
                    total += reply
                        .as_int()
                        .unwrap_or_else(|| panic!("XLEN {key}: {reply:?}"));
                }
                u64::try_from(total).expect("XLEN is not negative")
            }
            Servers::Nats(nats) => {
                let js = nats.jetstream().await;
                stream_state(&js, NATS_STREAM).await.messages
            }
            Servers::Memory => self.cannot(Fault::InspectStore),
        }
    }

    /// How many entries the backend was ever appended over all shards (what trimming removed
    /// since counts): Redis' `entries-added` of each stream, the JetStream stream's last
    /// sequence.
    pub async fn appended_entries(&mut self) -> u64 {
        fn entries_added(reply: &RespValue, key: &str) -> u64 {
            if reply.as_error().is_some() {
                return 0; // No such stream yet.
            }
            let fields = reply
                .as_array()
                .unwrap_or_else(|| panic!("XINFO STREAM {key}: {reply:?}"));
            fields
                .chunks(2)
                .find(|pair| pair[0].as_str() == Some("entries-added"))
                .and_then(|pair| pair[1].as_int())
                .and_then(|added| u64::try_from(added).ok())
                .unwrap_or_else(|| panic!("XINFO STREAM {key}: no entries-added in {reply:?}"))
        }
        match &self.servers {
            Servers::Redis(redis) => {
                let mut client = redis.client().await;
                let mut total = 0;
                for on in 0..SHARDS {
                    let key = redis_key(on);
                    total += entries_added(&client.cmd(&["XINFO", "STREAM", &key]).await, &key);
                }
                total
            }
            Servers::Cluster(cluster) => {
                let mut total = 0;
                for on in 0..SHARDS {
                    let key = cluster_key(on);
                    let reply = cluster.cmd_for_key(&key, &["XINFO", "STREAM", &key]).await;
                    total += entries_added(&reply, &key);
                }
                total
            }
            Servers::Nats(nats) => {
                let js = nats.jetstream().await;
                stream_state(&js, NATS_STREAM).await.last_sequence
            }
            Servers::Memory => self.cannot(Fault::InspectStore),
        }
    }

    fn cannot(&self, fault: Fault) -> ! {
        panic!(
            "{} cannot do {}: {}; ask Env::part first",
            self.kind.name(),
            fault.name(),
            self.lacks(fault)
                .unwrap_or("(declared able: a hook is missing)")
        )
    }
}

impl Drop for Env {
    /// Prints which parts ran (shown with `--nocapture`, and for a failing test).
    fn drop(&mut self) {
        eprintln!("{}", self.report());
    }
}

/// The shard of `device` among [`SHARDS`].
pub fn shard(device: &str) -> u32 {
    crc32fast::hash(device.as_bytes()) % SHARDS
}

/// A device other than `device` on the same shard.
pub fn neighbour(device: &str) -> String {
    (0..)
        .map(|i| format!("n-{i}"))
        .find(|d| d != device && shard(d) == shard(device))
        .expect("some device shares the shard")
}

/// A device on shard `on`, named after `prefix`.
pub fn device_on_shard(prefix: &str, on: u32) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|d| shard(d) == on)
        .expect("some device lands on every shard")
}

fn redis_key(on: u32) -> String {
    format!("pos-ev:{on}")
}

fn cluster_key(on: u32) -> String {
    format!("pos-ev:{{g{}}}:{on}", on * CLUSTER_GROUPS / SHARDS)
}

fn nats_subject(on: u32) -> String {
    format!("posthorn.ev.{on}")
}

/// Waits until `/readyz` answers `status`.
pub async fn wait_for_readiness(hub: &Hub, status: u16, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while http::get(hub.addr(), "/readyz").await.status != status {
        assert!(
            tokio::time::Instant::now() < deadline,
            "readiness never became {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

//! The system under test (hubs behind nginx on one backend) and the faults injected into it.
//!
//! A schedule is drawn from a seed ([`schedule`]): every kind applicable to the backend once,
//! in a shuffled order, then kinds at random, each after a random pause. Faults are applied one
//! at a time: [`System::aim`] picks the target (a hub, a shard; the devices' [`Board`] helps aim
//! where a fault can hurt), then [`System::inject`] strikes and returns once the system is whole
//! again (restarted processes answer), with a line saying what happened.
//!
//! Topologies ([`BackendKind`]): Redis standalone with AOF (`redis`) or without persistence
//! (`redis-rdb`: only the snapshots' SAVEd RDB files), a Redis Cluster of 3 masters with one
//! replica each (`redis-cluster`, hubs with `redis.cluster` and [`GROUPS`] groups), one
//! `nats-server -js` (`nats`), or a 3-node JetStream cluster with an R3 stream the hubs create
//! (`nats-cluster`). On a standalone Redis with [`FaultKind::RedisRollback`] in the plan the
//! scenario takes a snapshot in the middle of every pause ([`System::take_snapshot`]); a rollback
//! restarts Redis from one of them.
//!
//! Adding a fault kind: a new [`FaultKind`] variant with its label and topologies, an arm in
//! [`System::inject`] (and in [`System::aim`] if it has a target), and, for a new topology, a
//! [`BackendKind`] and [`Backend`] variant started by [`System::start`].

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use rand::seq::SliceRandom;
use rand::{rngs::StdRng, Rng};
use tokio::time::Instant;

use super::device::{Board, Endpoints};
use super::history::{show_time, Clock, Micros};
use crate::support::hub::HubBuilder;
use crate::support::nats::NatsServer;
use crate::support::nats_cluster::NatsCluster;
use crate::support::redis::{RedisCluster, RedisServer, RedisSnapshot};
use crate::support::{http, Hub, Nginx};

/// The backend topology of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// One Redis with AOF (`appendfsync always`).
    Redis,
    /// One Redis without persistence; snapshots are SAVEd RDB files.
    RedisRdb,
    /// A Redis Cluster: 3 masters with a replica each, no persistence, 1 s node timeout.
    RedisCluster,
    /// One `nats-server -js`.
    Nats,
    /// 3 clustered `nats-server -js`; the hubs get every node's URL and create an R3 stream.
    NatsCluster,
}

impl BackendKind {
    pub const ALL: [BackendKind; 5] = [
        BackendKind::Redis,
        BackendKind::RedisRdb,
        BackendKind::RedisCluster,
        BackendKind::Nats,
        BackendKind::NatsCluster,
    ];

    pub fn label(self) -> &'static str {
        match self {
            BackendKind::Redis => "redis",
            BackendKind::RedisRdb => "redis-rdb",
            BackendKind::RedisCluster => "redis-cluster",
            BackendKind::Nats => "nats",
            BackendKind::NatsCluster => "nats-cluster",
        }
    }

    pub fn parse(label: &str) -> Option<BackendKind> {
        Self::ALL.into_iter().find(|k| k.label() == label)
    }

    pub fn is_redis(self) -> bool {
        matches!(
            self,
            BackendKind::Redis | BackendKind::RedisRdb | BackendKind::RedisCluster
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// SIGKILL Redis and start it again from its AOF (`appendfsync always`): no loss expected.
    RedisRestartAof,
    /// SIGKILL Redis and start it again without its files: every stream, epoch and dedupe
    /// record is gone (what a restart without persistence does).
    RedisRestartEmpty,
    /// SIGKILL Redis and start it again from one of the snapshots taken earlier in the run (AOF
    /// or RDB files): the data goes back in time, keeping the old epochs on older data.
    /// Snapshots taken after the chosen one are dropped (they never happened now).
    RedisRollback,
    /// `FLUSHALL` on the running Redis (every master of a cluster).
    RedisFlushAll,
    /// `DEL` of one shard's stream key (a shard with devices).
    RedisDelStream,
    /// Redis Cluster: SIGKILL the master of a group's slot (a group with devices), wait until
    /// its replica is promoted, then start the old master again: it rejoins as a replica,
    /// empty, and syncs in full. Writes not yet replicated when the master died are lost.
    RedisFailover,
    /// SIGKILL one hub and start it again on the same port.
    HubKill,
    /// `POST /admin/drain` to one hub; it closes its streams and exits; start it again on the
    /// same port.
    HubDrain,
    /// Delete the JetStream stream; the hubs re-create it.
    NatsStreamDelete,
    /// Stop nats-server (SIGTERM) and start it again with its store.
    NatsRestart,
    /// Stop nats-server, delete its `store/`, start it again.
    NatsRestartEmpty,
    /// NATS cluster: SIGKILL (now and then SIGTERM) one node, the stream's leader and a
    /// follower in turn, and start it again with its store after up to 3 s; healed once the
    /// stream has a leader and every replica is current.
    NatsNodeKill,
}

impl FaultKind {
    pub const ALL: [FaultKind; 12] = [
        FaultKind::RedisRestartAof,
        FaultKind::RedisRestartEmpty,
        FaultKind::RedisRollback,
        FaultKind::RedisFlushAll,
        FaultKind::RedisDelStream,
        FaultKind::RedisFailover,
        FaultKind::HubKill,
        FaultKind::HubDrain,
        FaultKind::NatsStreamDelete,
        FaultKind::NatsRestart,
        FaultKind::NatsRestartEmpty,
        FaultKind::NatsNodeKill,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FaultKind::RedisRestartAof => "redis-restart-aof",
            FaultKind::RedisRestartEmpty => "redis-restart-empty",
            FaultKind::RedisRollback => "redis-rollback",
            FaultKind::RedisFlushAll => "redis-flushall",
            FaultKind::RedisDelStream => "redis-del-stream",
            FaultKind::RedisFailover => "redis-failover",
            FaultKind::HubKill => "hub-kill",
            FaultKind::HubDrain => "hub-drain",
            FaultKind::NatsStreamDelete => "nats-stream-delete",
            FaultKind::NatsRestart => "nats-restart",
            FaultKind::NatsRestartEmpty => "nats-restart-empty",
            FaultKind::NatsNodeKill => "nats-node-kill",
        }
    }

    /// Whether it can strike a system of that topology.
    pub fn applies_to(self, backend: BackendKind) -> bool {
        use BackendKind as B;
        match self {
            FaultKind::RedisRestartAof => backend == B::Redis,
            FaultKind::RedisRestartEmpty | FaultKind::RedisRollback => {
                matches!(backend, B::Redis | B::RedisRdb)
            }
            FaultKind::RedisFlushAll | FaultKind::RedisDelStream => backend.is_redis(),
            FaultKind::RedisFailover => backend == B::RedisCluster,
            FaultKind::HubKill | FaultKind::HubDrain => true,
            // Not on the cluster: nats-server 2.9.10 then brings a node killed soon after the
            // re-creation back with the old stream's assignment ("detected duplicate assignment
            // for stream"), and that replica never gets current again.
            FaultKind::NatsStreamDelete => backend == B::Nats,
            FaultKind::NatsRestart | FaultKind::NatsRestartEmpty => backend == B::Nats,
            FaultKind::NatsNodeKill => backend == B::NatsCluster,
        }
    }

    /// Whether it takes acknowledged entries away from the hubs for sure (the failover only
    /// loses what was not replicated yet, which may be nothing): devices on the struck data then
    /// get a `resync`.
    pub fn loses_data(self) -> bool {
        matches!(
            self,
            FaultKind::RedisRestartEmpty
                | FaultKind::RedisRollback
                | FaultKind::RedisFlushAll
                | FaultKind::RedisDelStream
                | FaultKind::NatsStreamDelete
                | FaultKind::NatsRestartEmpty
        )
    }

    pub fn applicable(backend: BackendKind) -> Vec<FaultKind> {
        Self::ALL
            .into_iter()
            .filter(|k| k.applies_to(backend))
            .collect()
    }

    /// The deck of a long run's segment: the applicable kinds, those that only this topology
    /// has twice, so that across the topologies of a long run they gather about as many faults
    /// as the kinds several topologies share.
    pub fn long_deck(backend: BackendKind) -> Vec<FaultKind> {
        let mut deck = Vec::new();
        for kind in Self::applicable(backend) {
            let only_here = BackendKind::ALL
                .iter()
                .all(|&b| b == backend || !kind.applies_to(b));
            deck.push(kind);
            if only_here {
                deck.push(kind);
            }
        }
        deck
    }
}

/// One scheduled fault: the pause before it (after the previous one healed), its kind, and a
/// random number choosing its target (which hub, which shard).
#[derive(Clone, Copy, Debug)]
pub struct Fault {
    pub pause: Duration,
    pub kind: FaultKind,
    pub pick: u64,
}

/// `count` faults dealt from decks: each deck holds every entry of `kinds` once (an entry listed
/// twice comes twice), shuffled; pauses uniform in `pause`. Every kind is struck as often as
/// the others, give or take one deck.
pub fn schedule(
    rng: &mut StdRng,
    kinds: &[FaultKind],
    count: usize,
    pause: (Duration, Duration),
) -> Vec<Fault> {
    let mut deck: Vec<FaultKind> = Vec::new();
    (0..count)
        .map(|_| {
            if deck.is_empty() {
                deck = kinds.to_vec();
                deck.shuffle(rng);
                deck.reverse();
            }
            let kind = deck.pop().expect("a refilled deck");
            Fault {
                pause: Duration::from_secs_f64(
                    rng.random_range(pause.0.as_secs_f64()..=pause.1.as_secs_f64()),
                ),
                kind,
                pick: rng.random(),
            }
        })
        .collect()
}

/// Where a fault strikes (what applies to its kind) and why there.
#[derive(Clone, Debug, Default)]
pub struct Aim {
    pub hub: usize,
    pub shard: u32,
    pub note: String,
}

/// A snapshot of a standalone Redis and when it was taken.
pub struct Snapshot {
    pub files: RedisSnapshot,
    pub taken: Micros,
}

/// The backend processes.
pub enum Backend {
    Redis {
        server: RedisServer,
        /// The snapshots still in the current timeline, oldest first (at most
        /// [`KEPT_SNAPSHOTS`]).
        snapshots: Vec<Snapshot>,
    },
    RedisCluster(RedisCluster),
    Nats(NatsServer),
    NatsCluster(NatsCluster),
}

/// Where external producers append.
pub enum External {
    /// Redis nodes (one standalone, or every cluster node: MOVED redirects are followed).
    Redis(Vec<SocketAddr>),
    /// NATS server URLs.
    Nats(Vec<String>),
}

/// Stream shards of the hubs (`REDIS__SHARDS` / `NATS__SHARDS`).
pub const SHARDS: u32 = 8;
/// Hash-tag groups of the hubs on a Redis Cluster (`REDIS__GROUPS`): `{g0}`, `{g1}` and `{g2}`
/// hash to slots of three different masters of a 3-master cluster.
pub const GROUPS: u32 = 3;
const DRAIN_GRACE: Duration = Duration::from_secs(5);
const STREAM: &str = "POSTHORN";
/// Snapshots a standalone Redis keeps for rollbacks (older ones are dropped).
const KEPT_SNAPSHOTS: usize = 4;

pub fn shard_of(device: &str) -> u32 {
    crc32fast::hash(device.as_bytes()) % SHARDS
}

/// The group of a shard on a Redis Cluster (docs/stream-format.md).
pub fn group_of(shard: u32) -> u32 {
    shard * GROUPS / SHARDS
}

/// The Redis stream key of a shard in that topology.
pub fn stream_key(backend: BackendKind, shard: u32) -> String {
    match backend {
        BackendKind::RedisCluster => format!("pos-ev:{{g{}}}:{shard}", group_of(shard)),
        _ => format!("pos-ev:{shard}"),
    }
}

/// Hubs behind nginx on one backend.
pub struct System {
    pub kind: BackendKind,
    pub backend: Backend,
    builder: HubBuilder,
    /// `None` while a hub is down.
    hubs: Vec<Option<Hub>>,
    ports: Vec<u16>,
    pub nginx: Nginx,
    /// NATS node kills so far (they strike the stream leader and a follower in turn).
    node_kills: u64,
}

impl System {
    pub async fn start(kind: BackendKind, hubs: usize) -> System {
        let (backend, builder) = match kind {
            BackendKind::Redis | BackendKind::RedisRdb => {
                let server = RedisServer::builder()
                    .appendonly(kind == BackendKind::Redis)
                    .start()
                    .await;
                let builder = redis_hub(server.url());
                (
                    Backend::Redis {
                        server,
                        snapshots: Vec::new(),
                    },
                    builder,
                )
            }
            BackendKind::RedisCluster => {
                let cluster = RedisCluster::start_with_replicas(3, 1).await;
                // Every node as a seed: a hub restarted while a node is down still finds the
                // cluster.
                let nodes = cluster.nodes();
                let others: Vec<String> = nodes[1..].iter().map(|a| format!("node={a}")).collect();
                let url = format!("redis://{}?{}", nodes[0], others.join("&"));
                let builder = redis_hub(url)
                    .env("POSTHORN_REDIS__CLUSTER", "true")
                    .env("POSTHORN_REDIS__GROUPS", GROUPS.to_string());
                (Backend::RedisCluster(cluster), builder)
            }
            BackendKind::Nats => {
                let nats = NatsServer::start().await;
                let builder = nats_hub(nats.url());
                (Backend::Nats(nats), builder)
            }
            BackendKind::NatsCluster => {
                let cluster = NatsCluster::start(3).await;
                let builder = nats_hub(cluster.urls()).env("POSTHORN_NATS__REPLICAS", "3");
                (Backend::NatsCluster(cluster), builder)
            }
        };
        let mut started = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..hubs {
            let hub = builder.clone().start().await;
            ports.push(hub.port());
            started.push(Some(hub));
        }
        let addrs: Vec<SocketAddr> = started.iter().flatten().map(Hub::addr).collect();
        let nginx = Nginx::start(&addrs).await;
        System {
            kind,
            backend,
            builder,
            hubs: started,
            ports,
            nginx,
            node_kills: 0,
        }
    }

    pub fn endpoints(&self) -> Endpoints {
        Endpoints {
            nginx: self.nginx.addr(),
            hubs: self
                .ports
                .iter()
                .map(|&p| SocketAddr::from(([127, 0, 0, 1], p)))
                .collect(),
        }
    }

    /// Where external producers reach the backend.
    pub fn external(&self) -> External {
        match &self.backend {
            Backend::Redis { server, .. } => External::Redis(vec![server.addr()]),
            Backend::RedisCluster(cluster) => External::Redis(cluster.nodes()),
            Backend::Nats(nats) => External::Nats(vec![nats.url()]),
            Backend::NatsCluster(cluster) => External::Nats(cluster.server_urls()),
        }
    }

    /// Takes a snapshot of a standalone Redis for later rollbacks (nothing on other backends);
    /// says what it did.
    pub async fn take_snapshot(&mut self, clock: &Clock) -> Option<String> {
        let Backend::Redis { server, snapshots } = &mut self.backend else {
            return None;
        };
        let taken = clock.now();
        let files = server.snapshot().await;
        snapshots.push(Snapshot { files, taken });
        if snapshots.len() > KEPT_SNAPSHOTS {
            snapshots.remove(0);
        }
        Some(format!(
            "snapshot at {} ({} kept)",
            show_time(taken),
            snapshots.len()
        ))
    }

    /// Starts hub `i` again on its port (retrying while the port is still held).
    async fn restart_hub(&mut self, i: usize) -> String {
        let port = self.ports[i];
        for attempt in 1..=20 {
            match self.builder.clone().port(port).try_start().await {
                Ok(hub) => {
                    self.hubs[i] = Some(hub);
                    return if attempt == 1 {
                        String::new()
                    } else {
                        format!(" (start attempt {attempt})")
                    };
                }
                Err(exit) => {
                    if attempt == 20 {
                        panic!(
                            "hub{i} did not start again on port {port}: {}\n{}",
                            exit.status, exit.stderr
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// Chooses the target of a fault (a hub, a shard), using the board where it helps: a drain
    /// waits up to `drain_wait` for a hub where a slow reader has just resumed (its long replay
    /// is likely still running), a DEL and a failover prefer the shard of a device that is away
    /// (it will replay).
    pub async fn aim(
        &self,
        fault: &Fault,
        device_shards: &[u32],
        board: &Board,
        drain_wait: Duration,
    ) -> Aim {
        let any_hub = ((fault.pick >> 32) % self.hubs.len() as u64) as usize;
        match fault.kind {
            FaultKind::HubKill => Aim {
                hub: any_hub,
                ..Aim::default()
            },
            FaultKind::HubDrain => match resuming_hub(board, drain_wait).await {
                Some((hub, ago)) => Aim {
                    hub,
                    note: format!(" (a slow reader resumed there {} ms ago)", ago.as_millis()),
                    ..Aim::default()
                },
                None => Aim {
                    hub: any_hub,
                    ..Aim::default()
                },
            },
            FaultKind::RedisDelStream | FaultKind::RedisFailover => {
                let away = away_shards(board);
                if away.is_empty() {
                    let i = (fault.pick % device_shards.len() as u64) as usize;
                    Aim {
                        shard: device_shards[i],
                        ..Aim::default()
                    }
                } else {
                    let i = (fault.pick % away.len() as u64) as usize;
                    Aim {
                        shard: away[i],
                        note: " (a device of that shard is away)".into(),
                        ..Aim::default()
                    }
                }
            }
            _ => Aim::default(),
        }
    }

    /// Applies one fault at its target and waits until the system is whole again; says what
    /// happened.
    pub async fn inject(&mut self, fault: &Fault, aim: &Aim, clock: &Clock) -> String {
        let note = &aim.note;
        match fault.kind {
            FaultKind::HubKill => {
                let i = aim.hub;
                if let Some(mut hub) = self.hubs[i].take() {
                    hub.kill();
                }
                let down = Duration::from_millis(fault.pick % 1500);
                tokio::time::sleep(down).await;
                let again = self.restart_hub(i).await;
                format!("hub{i}{note} SIGKILLed, down {down:?}, restarted{again}")
            }
            FaultKind::HubDrain => {
                let i = aim.hub;
                let mut hub = self.hubs[i].take().expect("every hub runs between faults");
                let answer = http::try_request(
                    hub.addr(),
                    "POST",
                    "/admin/drain",
                    &[],
                    None,
                    Duration::from_secs(5),
                )
                .await;
                let answer = match answer {
                    Ok(r) => r.status.to_string(),
                    Err(e) => e.to_string(),
                };
                let exit = hub.wait_exit(DRAIN_GRACE + Duration::from_secs(5)).await;
                let log = hub.stderr_log();
                let how = if log.contains("drain finished") {
                    "drain finished"
                } else if log.contains("drain forced") {
                    "drain forced"
                } else {
                    "no drain line in the log"
                };
                let exit = match exit {
                    Some(status) => format!("exited {status}"),
                    None => {
                        hub.kill();
                        "still running after grace + 5 s: killed".to_string()
                    }
                };
                drop(hub);
                let again = self.restart_hub(i).await;
                format!("hub{i}{note} drain answered {answer}, {how}, {exit}; restarted{again}")
            }
            FaultKind::RedisRestartAof => {
                let (server, _) = self.redis();
                server.restart().await;
                "redis SIGKILLed and restarted from its AOF".into()
            }
            FaultKind::RedisRestartEmpty => {
                let (server, _) = self.redis();
                server.restart_without_data().await;
                "redis SIGKILLed, its files removed, restarted empty".into()
            }
            FaultKind::RedisRollback => {
                let now = clock.now();
                let (server, snapshots) = self.redis();
                if snapshots.is_empty() {
                    let files = server.snapshot().await;
                    snapshots.push(Snapshot { files, taken: now });
                }
                let n = snapshots.len();
                let i = (fault.pick % n as u64) as usize;
                // The later ones describe a future that no longer happens.
                snapshots.truncate(i + 1);
                let snapshot = &snapshots[i];
                let what = if snapshot.files.is_aof() {
                    "AOF"
                } else {
                    "RDB"
                };
                server.restart_from(&snapshot.files).await;
                format!(
                    "redis SIGKILLed and restarted from snapshot {} of {n} ({what}, taken at {}, \
                     {:.1} s earlier)",
                    i + 1,
                    show_time(snapshot.taken),
                    now.saturating_sub(snapshot.taken) as f64 / 1e6
                )
            }
            FaultKind::RedisFlushAll => match &mut self.backend {
                Backend::Redis { server, .. } => {
                    server.client().await.flushall().await;
                    "FLUSHALL".into()
                }
                Backend::RedisCluster(cluster) => {
                    cluster.flushall().await;
                    "FLUSHALL on every master".into()
                }
                _ => panic!("a Redis fault on a NATS system"),
            },
            FaultKind::RedisDelStream => {
                let key = stream_key(self.kind, aim.shard);
                let reply = match &mut self.backend {
                    Backend::Redis { server, .. } => {
                        server.client().await.cmd(&["DEL", &key]).await
                    }
                    Backend::RedisCluster(cluster) => {
                        cluster.cmd_for_key(&key, &["DEL", &key]).await
                    }
                    _ => panic!("a Redis fault on a NATS system"),
                };
                format!("DEL {key}{note} -> {reply:?}")
            }
            FaultKind::RedisFailover => {
                let key = stream_key(self.kind, aim.shard);
                let Backend::RedisCluster(cluster) = &mut self.backend else {
                    panic!("a Redis Cluster fault on another system");
                };
                let master = cluster.master_of_slot_of(&key).await;
                let began = Instant::now();
                let killed = cluster.kill_master_of(&key).await;
                let promoted = cluster.wait_failover(killed).await;
                let failover = began.elapsed();
                let down = Duration::from_millis(fault.pick % 2000);
                tokio::time::sleep(down).await;
                cluster.restart_node(killed).await;
                format!(
                    "node{killed} ({master}), master of {key}{note}, SIGKILLed; node{promoted} \
                     ({}) took over after {:.1} s; node{killed} restarted {:.1} s later, back as \
                     a replica after {:.1} s in all",
                    cluster.node(promoted).addr(),
                    failover.as_secs_f64(),
                    down.as_secs_f64(),
                    began.elapsed().as_secs_f64()
                )
            }
            FaultKind::NatsStreamDelete => {
                let js = match &self.backend {
                    Backend::Nats(nats) => nats.jetstream().await,
                    Backend::NatsCluster(cluster) => cluster.jetstream().await,
                    _ => panic!("a NATS fault on a Redis system"),
                };
                match js.delete_stream(STREAM).await {
                    Ok(status) => format!("stream {STREAM} deleted ({})", status.success),
                    Err(error) => format!("stream {STREAM} not deleted: {error}"),
                }
            }
            FaultKind::NatsRestart => {
                self.nats().restart().await;
                "nats-server stopped and started again with its store".into()
            }
            FaultKind::NatsRestartEmpty => {
                let nats = self.nats();
                nats.stop().await;
                let removed = remove_all(nats.dir(), &["store"]);
                nats.start_again().await;
                format!("nats-server stopped, {removed} removed, started again")
            }
            FaultKind::NatsNodeKill => {
                self.node_kills += 1;
                let at_leader = self.node_kills % 2 == 1;
                let Backend::NatsCluster(cluster) = &mut self.backend else {
                    panic!("a NATS cluster fault on another system");
                };
                let nodes = cluster.node_count();
                let leader = leader_of(cluster).await;
                let (target, role) = match leader {
                    Some(l) if at_leader => (l, "the stream leader"),
                    Some(l) => (
                        (l + 1 + (fault.pick % (nodes as u64 - 1)) as usize) % nodes,
                        "a follower",
                    ),
                    None => (
                        (fault.pick % nodes as u64) as usize,
                        "a node (no leader known)",
                    ),
                };
                let gentle = (fault.pick >> 8).is_multiple_of(4);
                let began = Instant::now();
                if gentle {
                    cluster.stop(target).await;
                } else {
                    cluster.kill(target);
                }
                let down = Duration::from_millis(200 + (fault.pick >> 16) % 2800);
                tokio::time::sleep(down).await;
                cluster.restart(target).await;
                let info = cluster.wait_stream_current(STREAM).await;
                let now_leader = info
                    .cluster
                    .and_then(|c| c.leader)
                    .unwrap_or_else(|| "?".into());
                format!(
                    "n{target}, {role}, {}, down {down:?}, restarted; stream current after {:.1} \
                     s in all, leader {now_leader}",
                    if gentle {
                        "stopped (SIGTERM)"
                    } else {
                        "SIGKILLed"
                    },
                    began.elapsed().as_secs_f64()
                )
            }
        }
    }

    fn redis(&mut self) -> (&mut RedisServer, &mut Vec<Snapshot>) {
        match &mut self.backend {
            Backend::Redis { server, snapshots } => (server, snapshots),
            _ => panic!("a standalone Redis fault on another system"),
        }
    }

    fn nats(&mut self) -> &mut NatsServer {
        match &mut self.backend {
            Backend::Nats(nats) => nats,
            _ => panic!("a single-server NATS fault on another system"),
        }
    }

    /// Hub logs lines that matter for triage (warnings and errors), per hub.
    pub fn hub_warnings(&self, limit: usize) -> String {
        let mut out = String::new();
        for (i, hub) in self.hubs.iter().enumerate() {
            let Some(hub) = hub else { continue };
            let log = hub.stderr_log();
            let lines: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                .collect();
            for line in lines.iter().rev().take(limit).rev() {
                out.push_str(&format!("  hub{i}: {line}\n"));
            }
        }
        out
    }
}

/// The index of the node leading the hubs' stream, if one answers within a few seconds (the
/// stream may be between a deletion and its re-creation).
async fn leader_of(cluster: &NatsCluster) -> Option<usize> {
    let ask = async {
        let js = cluster.jetstream().await;
        let stream = js.get_stream(STREAM).await.ok()?;
        let info = stream.get_info().await.ok()?;
        let name = info.cluster.as_ref()?.leader.clone()?;
        cluster.index_of(&name)
    };
    tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .ok()
        .flatten()
}

fn redis_hub(url: String) -> HubBuilder {
    base_hub()
        .env("POSTHORN_BACKEND__KIND", "redis")
        .env("POSTHORN_REDIS__URL", url)
        .env("POSTHORN_REDIS__SHARDS", SHARDS.to_string())
        .env("POSTHORN_REDIS__BLOCK", "1s")
        .env("POSTHORN_REDIS__RETENTION", "1h")
}

fn nats_hub(url: String) -> HubBuilder {
    base_hub()
        .env("POSTHORN_BACKEND__KIND", "nats")
        .env("POSTHORN_NATS__URL", url)
        .env("POSTHORN_NATS__SHARDS", SHARDS.to_string())
        .env("POSTHORN_NATS__RETENTION", "1h")
}

/// Shards of the devices that have no stream (their events wait in the backend, and they
/// will replay them); failing that, of devices that do not read theirs.
fn away_shards(board: &Board) -> Vec<u32> {
    let board = board.lock().unwrap_or_else(|e| e.into_inner());
    let mut shards: Vec<u32> = board
        .iter()
        .filter(|p| !p.connected)
        .map(|p| p.shard)
        .collect();
    if shards.is_empty() {
        shards = board
            .iter()
            .filter(|p| !p.reading)
            .map(|p| p.shard)
            .collect();
    }
    shards.sort_unstable();
    shards.dedup();
    shards
}

/// Waits up to `wait` for a slow reader back from a pause to open a resumed stream straight on a
/// hub (its replay, more than the 64 entries the hub buffers ahead of the client, is then
/// likely still running); that hub and how long ago.
async fn resuming_hub(board: &Board, wait: Duration) -> Option<(usize, Duration)> {
    let deadline = Instant::now() + wait;
    loop {
        let found = {
            let board = board.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            board
                .iter()
                .filter(|p| p.resumed && p.sluggish_until.is_some_and(|until| until > now))
                .filter_map(|p| Some((p.hub?, p.opened?.elapsed())))
                .filter(|(_, ago)| *ago < Duration::from_millis(1500))
                .min_by_key(|(_, ago)| *ago)
        };
        if found.is_some() || Instant::now() >= deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The hub settings every chaos run uses: short timings, a small queue and send buffer (slow
/// readers get evicted), one worker (2 cores for everything).
fn base_hub() -> HubBuilder {
    Hub::builder()
        .env("POSTHORN_SERVER__WORKERS", "1")
        .env("POSTHORN_SSE__RETRY_MS", "200")
        .env("POSTHORN_SSE__QUEUE_LIMIT", "64")
        .env("POSTHORN_SSE__STALL_TIMEOUT", "2s")
        .env("POSTHORN_SSE__HEARTBEAT", "1s")
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .env("POSTHORN_DRAIN__GRACE", "5s")
        .env("POSTHORN_DRAIN__RETRY_MIN", "100ms")
        .env("POSTHORN_DRAIN__RETRY_MAX", "1s")
}

/// Removes the named entries of `dir`; says which existed.
fn remove_all(dir: &Path, names: &[&str]) -> String {
    let mut removed = Vec::new();
    for name in names {
        let path = dir.join(name);
        let result = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if result.is_ok() {
            removed.push(*name);
        }
    }
    if removed.is_empty() {
        "nothing".into()
    } else {
        removed.join(" and ")
    }
}

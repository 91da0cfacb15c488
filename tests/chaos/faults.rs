//! The system under test (hubs behind nginx on one backend) and the faults injected into it.
//!
//! A schedule is drawn from a seed ([`schedule`]): every kind applicable to the backend once,
//! in a shuffled order, then kinds at random, each after a random pause. Faults are applied one
//! at a time: [`System::aim`] picks the target (a hub, a shard; the devices' [`Board`] helps aim
//! where a fault can hurt), then [`System::inject`] strikes and returns once the system is whole
//! again (restarted processes answer), with a line saying what happened.
//!
//! Adding a fault kind (a Redis snapshot rollback, a Redis Cluster failover, a NATS cluster
//! node loss): a new [`FaultKind`] variant with its label and backend, an arm in
//! [`System::inject`] (and in [`System::aim`] if it has a target), and, for a new topology, a
//! [`Backend`] variant started by [`System::start`].

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use rand::seq::SliceRandom;
use rand::{rngs::StdRng, Rng};
use tokio::time::Instant;

use super::device::{Board, Endpoints};
use crate::support::hub::HubBuilder;
use crate::support::nats::NatsServer;
use crate::support::redis::RedisServer;
use crate::support::{http, Hub, Nginx};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Redis,
    Nats,
}

impl BackendKind {
    pub fn label(self) -> &'static str {
        match self {
            BackendKind::Redis => "redis",
            BackendKind::Nats => "nats",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// SIGKILL Redis and start it again from its AOF (`appendfsync always`): no loss expected.
    RedisRestartAof,
    /// SIGKILL Redis and start it again without its AOF: every stream, epoch and dedupe record
    /// is gone (what a restart without persistence does).
    RedisRestartEmpty,
    /// `FLUSHALL` on the running Redis.
    RedisFlushAll,
    /// `DEL` of one shard's stream key (a shard with devices).
    RedisDelStream,
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
}

impl FaultKind {
    pub const ALL: [FaultKind; 9] = [
        FaultKind::RedisRestartAof,
        FaultKind::RedisRestartEmpty,
        FaultKind::RedisFlushAll,
        FaultKind::RedisDelStream,
        FaultKind::HubKill,
        FaultKind::HubDrain,
        FaultKind::NatsStreamDelete,
        FaultKind::NatsRestart,
        FaultKind::NatsRestartEmpty,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FaultKind::RedisRestartAof => "redis-restart-aof",
            FaultKind::RedisRestartEmpty => "redis-restart-empty",
            FaultKind::RedisFlushAll => "redis-flushall",
            FaultKind::RedisDelStream => "redis-del-stream",
            FaultKind::HubKill => "hub-kill",
            FaultKind::HubDrain => "hub-drain",
            FaultKind::NatsStreamDelete => "nats-stream-delete",
            FaultKind::NatsRestart => "nats-restart",
            FaultKind::NatsRestartEmpty => "nats-restart-empty",
        }
    }

    /// The backend it needs; `None`: any.
    pub fn backend(self) -> Option<BackendKind> {
        match self {
            FaultKind::RedisRestartAof
            | FaultKind::RedisRestartEmpty
            | FaultKind::RedisFlushAll
            | FaultKind::RedisDelStream => Some(BackendKind::Redis),
            FaultKind::HubKill | FaultKind::HubDrain => None,
            FaultKind::NatsStreamDelete | FaultKind::NatsRestart | FaultKind::NatsRestartEmpty => {
                Some(BackendKind::Nats)
            }
        }
    }

    pub fn applicable(backend: BackendKind) -> Vec<FaultKind> {
        Self::ALL
            .into_iter()
            .filter(|k| k.backend().is_none_or(|b| b == backend))
            .collect()
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

/// `count` faults: each kind of `kinds` once in a shuffled order, then kinds at random; pauses
/// uniform in `pause`.
pub fn schedule(
    rng: &mut StdRng,
    kinds: &[FaultKind],
    count: usize,
    pause: (Duration, Duration),
) -> Vec<Fault> {
    let mut deck = kinds.to_vec();
    deck.shuffle(rng);
    (0..count)
        .map(|i| {
            let kind = deck
                .get(i)
                .copied()
                .unwrap_or_else(|| kinds[rng.random_range(0..kinds.len())]);
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

/// The backend processes.
pub enum Backend {
    Redis(RedisServer),
    Nats(NatsServer),
}

/// Stream shards of the hubs (`REDIS__SHARDS` / `NATS__SHARDS`).
pub const SHARDS: u32 = 8;
const DRAIN_GRACE: Duration = Duration::from_secs(5);
const STREAM: &str = "POSTHORN";

pub fn shard_of(device: &str) -> u32 {
    crc32fast::hash(device.as_bytes()) % SHARDS
}

/// Hubs behind nginx on one backend.
pub struct System {
    pub backend: Backend,
    builder: HubBuilder,
    /// `None` while a hub is down.
    hubs: Vec<Option<Hub>>,
    ports: Vec<u16>,
    pub nginx: Nginx,
}

impl System {
    pub async fn start(kind: BackendKind, hubs: usize) -> System {
        let (backend, builder) = match kind {
            BackendKind::Redis => {
                let redis = RedisServer::builder().appendonly(true).start().await;
                let builder = base_hub()
                    .env("POSTHORN_BACKEND__KIND", "redis")
                    .env("POSTHORN_REDIS__URL", redis.url())
                    .env("POSTHORN_REDIS__SHARDS", SHARDS.to_string())
                    .env("POSTHORN_REDIS__BLOCK", "1s")
                    .env("POSTHORN_REDIS__RETENTION", "1h");
                (Backend::Redis(redis), builder)
            }
            BackendKind::Nats => {
                let nats = NatsServer::start()
                    .await
                    .expect("nats-server is needed for the NATS chaos run");
                let builder = base_hub()
                    .env("POSTHORN_BACKEND__KIND", "nats")
                    .env("POSTHORN_NATS__URL", nats.url())
                    .env("POSTHORN_NATS__SHARDS", SHARDS.to_string())
                    .env("POSTHORN_NATS__RETENTION", "1h");
                (Backend::Nats(nats), builder)
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
            backend,
            builder,
            hubs: started,
            ports,
            nginx,
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

    pub fn redis_addr(&self) -> Option<SocketAddr> {
        match &self.backend {
            Backend::Redis(redis) => Some(redis.addr()),
            Backend::Nats(_) => None,
        }
    }

    pub fn nats_url(&self) -> Option<String> {
        match &self.backend {
            Backend::Nats(nats) => Some(nats.url()),
            Backend::Redis(_) => None,
        }
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
    /// waits up to 10 s for a hub where a slow reader has just resumed (its long replay is likely
    /// still running), a DEL prefers the shard of a device that is away (it will replay).
    pub async fn aim(&self, fault: &Fault, device_shards: &[u32], board: &Board) -> Aim {
        let any_hub = ((fault.pick >> 32) % self.hubs.len() as u64) as usize;
        match fault.kind {
            FaultKind::HubKill => Aim {
                hub: any_hub,
                ..Aim::default()
            },
            FaultKind::HubDrain => match resuming_hub(board, Duration::from_secs(10)).await {
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
            FaultKind::RedisDelStream => {
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
    pub async fn inject(&mut self, fault: &Fault, aim: &Aim) -> String {
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
                let redis = self.redis();
                redis.restart().await;
                "redis SIGKILLed and restarted from its AOF".into()
            }
            FaultKind::RedisRestartEmpty => {
                let redis = self.redis();
                redis.stop().await;
                let removed = remove_all(redis.dir(), &["appendonlydir", "dump.rdb"]);
                redis.start_again().await;
                format!("redis SIGKILLed, {removed} removed, restarted empty")
            }
            FaultKind::RedisFlushAll => {
                let mut client = self.redis().client().await;
                client.flushall().await;
                "FLUSHALL".into()
            }
            FaultKind::RedisDelStream => {
                let key = format!("pos-ev:{}", aim.shard);
                let mut client = self.redis().client().await;
                let reply = client.cmd(&["DEL", &key]).await;
                format!("DEL {key}{note} -> {reply:?}")
            }
            FaultKind::NatsStreamDelete => {
                let js = self.nats().jetstream().await;
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
        }
    }

    fn redis(&mut self) -> &mut RedisServer {
        match &mut self.backend {
            Backend::Redis(redis) => redis,
            Backend::Nats(_) => panic!("a Redis fault on a NATS system"),
        }
    }

    fn nats(&mut self) -> &mut NatsServer {
        match &mut self.backend {
            Backend::Nats(nats) => nats,
            Backend::Redis(_) => panic!("a NATS fault on a Redis system"),
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

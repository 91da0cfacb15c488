//! The Redis Streams backend: one stream per shard, one StreamTail per node group
//! (docs/stream-format.md has the keys and fields).
//!
//! Topologies: one standalone instance (`redis.url`, one group), several standalone instances
//! (`redis.urls`, one group each, shards split evenly in order), or a Redis Cluster
//! (`redis.cluster`, `redis.groups` hash-tag groups). See [`Layout`] for the keys.
//!
//! - **Append** is one Lua script per group and request ([`scripts::APPEND`]): it checks each
//!   idempotency key (scoped to the item's target), `XADD`s with `MINID ~` (age, on Redis' clock)
//!   and `XTRIM MAXLEN ~` (length cap), and remembers the key with the cursor it answered, all
//!   atomically; a retried publish never appends twice. A broadcast is one item per group (a copy
//!   on each of the group's shards), deduplicated per group, so a retry after a partial failure
//!   completes the missing groups. Groups fail independently: each item is answered on its own.
//! - **Epochs live in the streams** ([`scripts`]): a consumer group `posthorn:epoch:<epoch>` on
//!   each stream names its life. Whatever removes a stream (FLUSHALL, a restart without
//!   persistence, DEL, eviction) removes its name too, and the next touch names a new life.
//! - **Going back in time** (a restart from an older snapshot, a failover to a lagging replica)
//!   keeps the old name on older data. Every pod remembers, per shard, the newest position it
//!   knows was stored (what it appended and what its tail read: [`Watermarks`]); a check that
//!   finds it neither stored nor trimmed starts a new life ([`scripts::START_NEW_LIFE`]). A
//!   resume also looks for the cursor's own entry: missing and not trimmed means `data_lost`.
//! - **Resume** reads pages with [`scripts::READ`] (XRANGE plus the life it read in and what
//!   trimming had removed: [`trimming`]).
//! - **Trimming** runs on Redis' clock under a lease, one pod per group at a time; it also drops
//!   supersede index entries whose entry was trimmed.
//! - **Supersede**: the append script sets `<dev>/<sup>` of the shard's index hash
//!   ([`Layout::supersede_key`]) to `<epoch> <id>` with the entry; a replay reads it with `HMGET`.

mod fleet;
mod layout;
mod reply;
mod revocation;
mod scripts;
mod setup;
mod tail;
mod tls;
mod trimming;

use std::{
    collections::VecDeque,
    ops::Range,
    sync::{Arc, Mutex},
    time::Duration,
};

use fred::{
    prelude::{Builder, Client, ClientLike, Config, ReconnectPolicy},
    types::{ClusterHash, CustomCommand, Value},
    util::redis_keyslot,
};
use futures_util::{future::BoxFuture, FutureExt};
use trimming::Trimming;

pub use fleet::RedisFleet;
pub use layout::Layout;
pub use revocation::RedisRevocations;
pub use setup::{ConnectionSetup, SetupError};

use super::{
    fleet::FleetSettings, trim_interval, Appended, Backend, BackendError, BackendResult,
    ItemFailure, ItemOutcome, NewEvent, ReadPage, ShardState, SupersedeKey, Tail,
};
use crate::{
    config::RedisConfig,
    model::{Cursor, Epoch, Position},
    report::Report,
};

/// How long start-up waits for each Redis connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for any command but the tails' blocking reads.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// The validated `[redis]` section plus the idempotency window of `[publish]`.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub redis: RedisConfig,
    pub dedupe_window: Duration,
}

impl RedisSettings {
    pub fn layout(&self) -> Layout {
        layout_of(&self.redis)
    }
}

/// Where shards live for a `[redis]` configuration (also used by `posthorn shard-key`).
pub fn layout_of(redis: &RedisConfig) -> Layout {
    Layout {
        prefix: redis.prefix.clone(),
        shards: redis.shards,
        groups: if redis.cluster {
            redis.groups
        } else {
            redis.urls.len().max(1) as u32
        },
        cluster: redis.cluster,
    }
}

pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    layout: Layout,
    /// One client per instance; a cluster has one client for all groups.
    clients: Vec<Client>,
    settings: RedisSettings,
    watermarks: Watermarks,
    /// This pod's name in trim leases.
    trim_token: String,
}

/// Per shard, the newest position this pod knows was stored, and in which life: what it appended
/// and what its tail read. If a check later finds it neither stored nor trimmed, the stream went
/// back in time. Also the lives this pod has seen end: a stream that shows one of them again
/// went back to data older than a loss (a restart from a snapshot taken before a DEL or a
/// FLUSHALL), which loses everything of the lives after it.
#[derive(Default)]
struct Watermarks(Mutex<Vec<ShardMarks>>);

#[derive(Default, Clone)]
struct ShardMarks {
    newest: Option<(Epoch, Position)>,
    /// Lives that ended, newest last (a few: older ones are unlikely to come back).
    ended: VecDeque<Epoch>,
}

/// How many ended lives a pod remembers per shard.
const ENDED_LIVES: usize = 8;

impl Watermarks {
    fn new(shards: u32) -> Self {
        Self(Mutex::new(vec![ShardMarks::default(); shards as usize]))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<ShardMarks>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records that `position` of life `epoch` is stored on `shard`; a newer life replaces an
    /// older one, which this pod then remembers as ended.
    fn saw(&self, shard: u32, epoch: &Epoch, position: Position) {
        let mut marks = self.lock();
        let marks = &mut marks[shard as usize];
        if marks.ended.contains(epoch) {
            // A late answer of a life that has ended since (an append that ran before a DEL):
            // it must not make that life current again, nor end the one that replaced it.
            return;
        }
        match &mut marks.newest {
            Some((known, newest)) if known == epoch => *newest = (*newest).max(position),
            newest => {
                if let Some((ended, _)) = newest.replace((epoch.clone(), position)) {
                    if marks.ended.len() == ENDED_LIVES {
                        marks.ended.pop_front();
                    }
                    marks.ended.push_back(ended);
                }
            }
        }
    }

    /// The position to look for on `shard` if the stream is (still) in its life.
    fn of(&self, shard: u32) -> Option<(Epoch, Position)> {
        self.lock()[shard as usize].newest.clone()
    }

    /// Whether this pod has seen life `epoch` of `shard` end.
    fn ended(&self, shard: u32, epoch: &Epoch) -> bool {
        self.lock()[shard as usize].ended.contains(epoch)
    }
}

fn unavailable(error: fred::error::Error) -> BackendError {
    BackendError::unavailable_by("redis", error)
}

fn build_client(config: Config) -> Result<Client, BackendError> {
    Builder::from_config(config)
        .with_connection_config(|connection| {
            connection.connection_timeout = Duration::from_secs(5);
            connection.internal_command_timeout = Duration::from_secs(5);
            connection.tcp.nodelay = Some(true);
            // Never re-send a command whose connection died in flight: an append script may have
            // run already. The caller sees an error (outcome unknown) and retries with its key.
            connection.max_command_attempts = 1;
        })
        // During an outage a publish answers after this, instead of waiting for Redis.
        .with_performance_config(|performance| {
            performance.default_command_timeout = COMMAND_TIMEOUT;
        })
        // fred sets no reconnect policy by default; without one an outage is permanent.
        .set_policy(ReconnectPolicy::new_exponential(0, 100, 5_000, 2))
        .build()
        .map_err(unavailable)
}

impl RedisBackend {
    /// Connects every client; fails when Redis cannot be reached within [`CONNECT_TIMEOUT`], its
    /// certificate does not verify, or it refuses the credentials.
    /// `setup` is [`ConnectionSetup::read`] of the same `[redis]` section.
    pub async fn connect(settings: RedisSettings, setup: &ConnectionSetup) -> BackendResult<Self> {
        let redis = &settings.redis;
        // `urls_in_use` is the seed alone in a cluster (the configuration refuses both).
        let urls = redis.urls_in_use();
        let clients = urls
            .iter()
            .map(|url| build_client(setup.config(url, redis.cluster).map_err(unavailable)?))
            .collect::<Result<Vec<_>, _>>()?;
        for (client, url) in clients.iter().zip(&urls) {
            // Which of several instances failed, without its password.
            init(client, &format!("redis at {}", url.redacted())).await?;
        }
        let layout = settings.layout();
        let backend = Self {
            inner: Arc::new(Inner {
                watermarks: Watermarks::new(layout.shards),
                layout,
                clients,
                settings,
                trim_token: Epoch::random().as_str().to_string(),
            }),
        };
        // Fail at start-up, not on the first publish, when keys would cross slots or the server
        // lacks what we need (Redis 7 for XINFO's entries-added and max-deleted-entry-id). This
        // also names the life of every stream that has none yet.
        for group in 0..backend.inner.layout.groups as usize {
            let shards: Vec<u32> = backend.inner.layout.shards_of(group).collect();
            backend.inner.check(group, &shards, &[]).await?;
        }
        Ok(backend)
    }
}

impl RedisBackend {
    /// The fleet store on the backend's first client (the first instance of `redis.urls`, or
    /// the cluster): the same TLS, user and password (docs/fleet.md).
    pub async fn fleet(&self, settings: FleetSettings) -> BackendResult<RedisFleet> {
        RedisFleet::new(
            self.inner.clients[0].clone(),
            self.inner.layout.cluster,
            self.inner.layout.prefix.clone(),
            settings,
        )
        .await
    }

    /// The revocation store on the backend's first client, like the fleet store's.
    pub fn revocations(&self, retention: Duration) -> RedisRevocations {
        RedisRevocations::new(
            self.inner.clients[0].clone(),
            &self.inner.layout.prefix,
            retention,
        )
    }
}

/// Connects `client`; `what` names the server in the error.
async fn init(client: &Client, what: &str) -> BackendResult<()> {
    match tokio::time::timeout(CONNECT_TIMEOUT, client.init()).await {
        Ok(Ok(_connection_task)) => Ok(()),
        Ok(Err(error)) => Err(BackendError::unavailable_by(what, error)),
        Err(_) => Err(BackendError::unavailable(format!(
            "{what}: no connection within {}s",
            CONNECT_TIMEOUT.as_secs()
        ))),
    }
}

/// What [`scripts::CHECK`] found about one stream, plus how a resume or a tail must treat it.
#[derive(Debug, Clone)]
struct StreamCheck {
    shard: u32,
    epoch: Epoch,
    start: Position,
    trimming: Trimming,
    /// Whether the cursor's position asked about is stored.
    cursor_found: Option<bool>,
}

impl StreamCheck {
    fn state(&self) -> ShardState {
        ShardState {
            epoch: self.epoch.clone(),
            start: self.start,
            head: self.trimming.head,
            trimmed_through: self.trimming.removed_through(),
            probe: self.cursor_found,
        }
    }
}

/// The script call of one group: its keys, arguments, and which request item each answer is for.
struct GroupCall {
    keys: Vec<String>,
    args: Vec<Value>,
    /// Per script item: the request index it answers (None: a broadcast's copies outside group 0).
    answers: Vec<Option<usize>>,
    /// Per script item: the request index it belongs to.
    items: Vec<usize>,
}

impl GroupCall {
    fn new() -> Self {
        Self {
            keys: Vec::new(),
            args: Vec::new(),
            answers: Vec::new(),
            items: Vec::new(),
        }
    }

    /// 1-based index of `key` in KEYS, added if new.
    fn key(&mut self, key: String) -> usize {
        match self.keys.iter().position(|known| *known == key) {
            Some(index) => index + 1,
            None => {
                self.keys.push(key);
                self.keys.len()
            }
        }
    }

    fn push(
        &mut self,
        layout: &Layout,
        group: usize,
        event: &NewEvent,
        shards: Vec<u32>,
        item: usize,
        answers: Option<usize>,
    ) {
        let dedupe = event.key.as_ref().map_or(0, |key| {
            self.key(layout.dedupe_key(group, &event.target.as_field(), key))
        });
        let streams: Vec<(usize, u32, usize)> = shards
            .into_iter()
            .map(|shard| {
                let stream = self.key(layout.stream_key(shard));
                let index = match event.supersede {
                    Some(_) => self.key(layout.supersede_key(shard)),
                    None => 0,
                };
                (stream, shard, index)
            })
            .collect();
        self.args.extend([
            Value::from(dedupe as i64),
            Value::from(event.target.as_field().as_ref()),
            Value::from(event.event_type.as_str()),
            Value::from(event.data.as_str()),
            Value::from(event.key.as_deref().unwrap_or("")),
            Value::from(
                event
                    .expires_ms
                    .map(|ms| ms.to_string())
                    .unwrap_or_default(),
            ),
            Value::from(event.supersede.as_ref().map_or("", |name| name.as_str())),
            Value::from(streams.len() as i64),
        ]);
        for (stream, shard, index) in streams {
            self.args.push(Value::from(stream as i64));
            self.args.push(Value::from(i64::from(shard)));
            self.args.push(Value::from(index as i64));
        }
        self.answers.push(answers);
        self.items.push(item);
    }
}

impl Inner {
    fn client(&self, group: usize) -> &Client {
        &self.clients[if self.layout.cluster { 0 } else { group }]
    }

    /// Routes a command to the slot of the group's hash tag (cluster) or to its instance.
    fn hash(&self, group: usize) -> ClusterHash {
        if self.layout.cluster {
            ClusterHash::Custom(redis_keyslot(self.layout.group_key(group).as_bytes()))
        } else {
            ClusterHash::FirstKey
        }
    }

    async fn command(
        &self,
        group: usize,
        name: &'static str,
        args: Vec<Value>,
    ) -> BackendResult<Value> {
        let command = CustomCommand::new_static(name, self.hash(group), false);
        self.client(group)
            .custom::<Value, Value>(command, args)
            .await
            .map_err(unavailable)
    }

    async fn eval(
        &self,
        group: usize,
        script: &str,
        keys: Vec<String>,
        args: Vec<Value>,
    ) -> BackendResult<Value> {
        let mut all = Vec::with_capacity(2 + keys.len() + args.len());
        all.push(Value::from(script));
        all.push(Value::from(keys.len() as i64));
        all.extend(keys.into_iter().map(Value::from));
        all.extend(args);
        self.command(group, "EVAL", all).await
    }

    /// The life and state of `shards` (all of `group`), looking for each shard's position in
    /// `cursors` (same order; missing = none). A stream that went back in time behind this pod's
    /// watermark gets a new life here, before anything is answered from it.
    async fn check(
        &self,
        group: usize,
        shards: &[u32],
        cursors: &[Option<Position>],
    ) -> BackendResult<Vec<StreamCheck>> {
        let marks: Vec<Option<(Epoch, Position)>> = shards
            .iter()
            .map(|shard| self.watermarks.of(*shard))
            .collect();
        let mut args = vec![Value::from(Epoch::random().as_str())];
        for (index, shard) in shards.iter().enumerate() {
            let cursor = cursors.get(index).copied().flatten();
            let mark = marks[index].as_ref().map(|(_, position)| *position);
            args.push(Value::from(i64::from(*shard)));
            args.push(probe_arg(cursor));
            args.push(probe_arg(mark));
        }
        let keys = shards.iter().map(|s| self.layout.stream_key(*s)).collect();
        let reply = self.eval(group, scripts::CHECK, keys, args).await?;
        let rows = reply::items(&reply);
        if rows.len() != shards.len() {
            return Err(bad_reply("check"));
        }
        let mut checks = Vec::with_capacity(shards.len());
        for ((row, shard), mark) in rows.iter().zip(shards).zip(marks) {
            let (mut check, mark_found) = parse_check(*shard, row)?;
            let lost = match mark {
                _ if self.watermarks.ended(*shard, &check.epoch) => {
                    log::warn!(
                        "redis stream {} is back in a life that had ended (a restart from data \
                         older than a loss): a new life begins",
                        self.layout.stream_key(*shard)
                    );
                    Some(None)
                }
                Some((epoch, position))
                    if epoch == check.epoch
                        && mark_found == Some(false)
                        && position > check.trimming.removed_through() =>
                {
                    log::warn!(
                        "redis stream {} lost position {position} it had stored (a restart from \
                         older data or a failover to a lagging replica): a new life begins",
                        self.layout.stream_key(*shard)
                    );
                    Some(Some(position))
                }
                _ => None,
            };
            if let Some(missing) = lost {
                let (epoch, start) = self
                    .start_new_life(group, *shard, &check.epoch, missing)
                    .await?;
                check.epoch = epoch;
                check.start = start;
                // The cursor was judged against the old life; the epoch alone now decides.
                check.cursor_found = None;
            }
            self.watermarks.saw(*shard, &check.epoch, check.start);
            checks.push(check);
        }
        Ok(checks)
    }

    /// Replaces life `lost` of `shard` by a new one, if it is still the stream's life (and
    /// `missing` is still not stored).
    async fn start_new_life(
        &self,
        group: usize,
        shard: u32,
        lost: &Epoch,
        missing: Option<Position>,
    ) -> BackendResult<(Epoch, Position)> {
        let fresh = format!("{}{shard}", Epoch::random().as_str());
        let reply = self
            .eval(
                group,
                scripts::START_NEW_LIFE,
                vec![self.layout.stream_key(shard)],
                vec![
                    Value::from(lost.as_str()),
                    Value::from(fresh.as_str()),
                    probe_arg(missing),
                ],
            )
            .await?;
        match reply::items(&reply) {
            [epoch, start] => Ok((
                parse_epoch(epoch)?,
                reply::position(start).ok_or_else(|| bad_reply("new life start"))?,
            )),
            _ => Err(bad_reply("new life")),
        }
    }

    async fn append(&self, events: Vec<NewEvent>) -> BackendResult<Vec<ItemOutcome>> {
        let layout = &self.layout;
        let groups = layout.groups as usize;
        let mut calls: Vec<GroupCall> = (0..groups).map(|_| GroupCall::new()).collect();
        // Per request item: the node groups it was sent to, and how many copies it has.
        let mut spans: Vec<Vec<usize>> = Vec::with_capacity(events.len());
        let mut expected: Vec<usize> = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            let stored_in = event.stored_in(layout.shards);
            let mut span = Vec::new();
            for (group, call) in calls.iter_mut().enumerate() {
                let shards: Vec<u32> = stored_in
                    .iter()
                    .copied()
                    .filter(|&shard| layout.group_of(shard) == group)
                    .collect();
                if shards.is_empty() {
                    continue;
                }
                // The first node group's first copy answers for the item.
                let answers = span.is_empty().then_some(index);
                call.push(layout, group, event, shards, index, answers);
                span.push(group);
            }
            spans.push(span);
            expected.push(stored_in.len());
        }
        let mut answered: Vec<Option<Appended>> = vec![None; events.len()];
        // Every copy of each broadcast appended now, from all groups.
        let mut copies: Vec<Vec<Cursor>> = vec![Vec::new(); events.len()];
        let mut failed: Vec<Option<BackendError>> = vec![None; groups];
        for (group, call) in calls.into_iter().enumerate() {
            if call.answers.is_empty() {
                continue;
            }
            let mut args = vec![
                Value::from(Epoch::random().as_str()),
                Value::from(self.settings.redis.retention.as_millis() as i64),
                Value::from(self.settings.redis.max_len as i64),
                Value::from(self.settings.dedupe_window.as_millis() as i64),
                Value::from(call.answers.len() as i64),
            ];
            args.extend(call.args);
            let reply = match self.eval(group, scripts::APPEND, call.keys, args).await {
                Ok(reply) => reply,
                Err(error) => {
                    failed[group] = Some(error);
                    continue;
                }
            };
            // A reply the hub cannot read fails this group's items only: the script ran, so
            // they may be stored (outcome unknown), while other groups' answers stand.
            let parsed = match parse_append(&reply, call.answers.len()) {
                Ok(parsed) => parsed,
                Err(error) => {
                    failed[group] = Some(error);
                    continue;
                }
            };
            for ((answers, item), (cursor, duplicate, group_copies)) in
                call.answers.iter().zip(&call.items).zip(parsed)
            {
                copies[*item].extend(group_copies);
                // What this request stored; a duplicate's entry may be long trimmed.
                if !duplicate {
                    self.watermarks
                        .saw(cursor.shard, &cursor.epoch, cursor.position);
                }
                if let Some(index) = answers {
                    answered[*index] = Some(Appended {
                        cursor,
                        duplicate,
                        copies: Vec::new(),
                    });
                }
            }
        }
        for ((answer, mut copies), expected) in answered.iter_mut().zip(copies).zip(&expected) {
            if let Some(answer) = answer.as_mut().filter(|_| copies.len() == *expected) {
                copies.sort_by_key(|copy| copy.shard);
                answer.copies = copies;
            }
        }
        if failed.iter().all(Option::is_none) {
            return answered
                .into_iter()
                .map(|item| item.map(Ok).ok_or_else(|| bad_reply("append answers")))
                .collect();
        }
        let calls_made = (0..groups)
            .filter(|group| spans.iter().any(|span| span.contains(group)))
            .count();
        if failed.iter().flatten().count() == calls_made {
            // Nothing is known to be stored: the request failed as a whole.
            let error = failed.into_iter().flatten().next();
            return Err(error.unwrap_or_else(|| bad_reply("append")));
        }
        Ok(answered
            .into_iter()
            .zip(spans)
            .map(|(item, span)| {
                let failures: Vec<Option<BackendError>> =
                    span.iter().map(|&group| failed[group].clone()).collect();
                item_outcome(item, &failures)
            })
            .collect())
    }

    async fn read_after(
        &self,
        shard: u32,
        after: Position,
        limit: usize,
    ) -> BackendResult<ReadPage> {
        let group = self.layout.group_of(shard);
        let reply = self
            .eval(
                group,
                scripts::READ,
                vec![self.layout.stream_key(shard)],
                vec![
                    Value::from(format!("({after}")),
                    Value::from(limit as i64),
                    Value::from(format!("{}{shard}", Epoch::random().as_str())),
                ],
            )
            .await?;
        let [epoch, entries, trimming] = reply::items(&reply) else {
            return Err(bad_reply("read"));
        };
        let epoch = parse_epoch(epoch)?;
        let page = reply::entries(shard, &epoch, entries);
        Ok(ReadPage {
            epoch,
            read: page.positions.len(),
            last: page.last,
            events: page.events,
            trimmed_through: Trimming::parse(trimming)?.removed_through(),
        })
    }

    async fn trim(&self, group: usize) -> BackendResult<()> {
        let retention = self.settings.redis.retention;
        let mut keys = vec![self.layout.trim_lease_key(group)];
        for shard in self.layout.shards_of(group) {
            keys.push(self.layout.stream_key(shard));
            keys.push(self.layout.supersede_key(shard));
        }
        let lease = trim_interval(retention) * 3;
        self.eval(
            group,
            scripts::TRIM,
            keys,
            vec![
                Value::from(self.trim_token.as_str()),
                Value::from(lease.as_millis() as i64),
                Value::from(retention.as_millis() as i64),
                Value::from(self.settings.redis.max_len as i64),
            ],
        )
        .await
        .map(|_| ())
    }

    /// `HMGET` of the shard's supersede index; values of another life count as unknown.
    async fn newest_of(
        &self,
        shard: u32,
        epoch: &Epoch,
        keys: Vec<SupersedeKey>,
    ) -> BackendResult<Vec<Option<Position>>> {
        let group = self.layout.group_of(shard);
        let mut args = vec![Value::from(self.layout.supersede_key(shard))];
        args.extend(keys.iter().map(|key| Value::from(key.field())));
        let reply = self.command(group, "HMGET", args).await?;
        let values = reply::items(&reply);
        if values.len() != keys.len() {
            return Err(bad_reply("supersede index"));
        }
        Ok(values
            .iter()
            .map(|value| {
                let (life, position) = reply::text(value)?.split_once(' ')?;
                (life == epoch.as_str())
                    .then(|| position.parse().ok())
                    .flatten()
            })
            .collect())
    }

    async fn stop_trimming(&self, group: usize) {
        let released = self
            .eval(
                group,
                scripts::RELEASE_TRIM,
                vec![self.layout.trim_lease_key(group)],
                vec![Value::from(self.trim_token.as_str())],
            )
            .await;
        if let Err(error) = released {
            log::debug!(
                "the trim lease of group {group} is left to expire: {}",
                Report(&error)
            );
        }
    }
}

/// How many group calls a request made (those whose failure could matter).
/// The answer of one group's [`scripts::APPEND`]: per script item its cursor, whether it was a
/// duplicate, and a broadcast's copies in the group.
fn parse_append(reply: &Value, count: usize) -> BackendResult<Vec<(Cursor, bool, Vec<Cursor>)>> {
    let items = reply::items(reply);
    if items.len() != 3 * count {
        return Err(bad_reply("append"));
    }
    let cursor = |value: &Value, what: &str| {
        reply::text(value)
            .and_then(|text| Cursor::parse(text).ok())
            .ok_or_else(|| bad_reply(what))
    };
    items
        .chunks(3)
        .map(|triple| {
            let copies = reply::items(&triple[2])
                .iter()
                .map(|copy| cursor(copy, "append copy"))
                .collect::<BackendResult<Vec<_>>>()?;
            Ok((
                cursor(&triple[0], "append cursor")?,
                matches!(triple[1], Value::Integer(1)),
                copies,
            ))
        })
        .collect()
}

/// The answer for one item of a request some of whose group calls failed.
fn item_outcome(item: Option<Appended>, failures: &[Option<BackendError>]) -> ItemOutcome {
    let failure = failures.iter().flatten().next();
    match (item, failure) {
        (Some(appended), None) => Ok(appended),
        (_, Some(error)) => {
            let reached = failures.iter().filter(|f| f.is_none()).count();
            if reached > 0 {
                Err(ItemFailure::Incomplete(format!(
                    "the broadcast reached {reached} of {} node groups ({}); retry it with its \
                     key to complete it",
                    failures.len(),
                    Report(error)
                )))
            } else {
                Err(ItemFailure::Unknown(format!(
                    "{}; it may or may not be stored: retry it with its key",
                    Report(error)
                )))
            }
        }
        (None, None) => Err(ItemFailure::Unknown("no answer from redis".into())),
    }
}

fn probe_arg(position: Option<Position>) -> Value {
    Value::from(position.map(|p| p.to_string()).unwrap_or_default())
}

/// Reads one row of [`scripts::CHECK`]; also returns whether the watermark was found.
fn parse_check(shard: u32, row: &Value) -> BackendResult<(StreamCheck, Option<bool>)> {
    let [epoch, start, trimming, cursor_found, mark_found] = reply::items(row) else {
        return Err(bad_reply("check"));
    };
    let found = |value: &Value| match value {
        Value::Integer(1) => Some(true),
        Value::Integer(0) => Some(false),
        _ => None,
    };
    Ok((
        StreamCheck {
            shard,
            epoch: parse_epoch(epoch)?,
            start: reply::position(start).ok_or_else(|| bad_reply("start"))?,
            trimming: Trimming::parse(trimming)?,
            cursor_found: found(cursor_found),
        },
        found(mark_found),
    ))
}

fn parse_epoch(reply: &Value) -> BackendResult<Epoch> {
    reply::text(reply)
        .and_then(|text| Epoch::new(text).ok())
        .ok_or_else(|| BackendError::rejected(format!("a stream's epoch marker holds {reply:?}")))
}

fn bad_reply(what: &str) -> BackendError {
    BackendError::rejected(format!("unexpected redis reply to {what}"))
}

impl Backend for RedisBackend {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn shards(&self) -> u32 {
        self.inner.layout.shards
    }

    fn groups(&self) -> Vec<Range<u32>> {
        (0..self.inner.layout.groups as usize)
            .map(|group| self.inner.layout.shards_of(group))
            .collect()
    }

    fn append(&self, events: Vec<NewEvent>) -> BoxFuture<'_, BackendResult<Vec<ItemOutcome>>> {
        self.inner.append(events).boxed()
    }

    fn open_tail(&self, group: usize) -> BoxFuture<'_, BackendResult<Box<dyn Tail>>> {
        let inner = self.inner.clone();
        async move {
            let tail: Box<dyn Tail> = Box::new(tail::RedisTail::open(inner, group).await?);
            Ok(tail)
        }
        .boxed()
    }

    fn read_after(
        &self,
        shard: u32,
        after: Position,
        limit: usize,
    ) -> BoxFuture<'_, BackendResult<ReadPage>> {
        self.inner.read_after(shard, after, limit).boxed()
    }

    fn shard_state(
        &self,
        shard: u32,
        probe: Option<Position>,
    ) -> BoxFuture<'_, BackendResult<ShardState>> {
        async move {
            let group = self.inner.layout.group_of(shard);
            let checks = self.inner.check(group, &[shard], &[probe]).await?;
            Ok(checks[0].state())
        }
        .boxed()
    }

    fn trim(&self, group: usize) -> BoxFuture<'_, BackendResult<()>> {
        self.inner.trim(group).boxed()
    }

    fn stop_trimming(&self, group: usize) -> BoxFuture<'_, ()> {
        self.inner.stop_trimming(group).boxed()
    }

    fn newest_of(
        &self,
        shard: u32,
        epoch: &Epoch,
        keys: Vec<SupersedeKey>,
    ) -> BoxFuture<'_, BackendResult<Vec<Option<Position>>>> {
        let epoch = epoch.clone();
        async move { self.inner.newest_of(shard, &epoch, keys).await }.boxed()
    }

    fn ping(&self) -> BoxFuture<'_, BackendResult<()>> {
        async move {
            // Every group: in a cluster that reaches each node that owns one of our slots.
            for group in 0..self.inner.layout.groups as usize {
                self.inner.command(group, "PING", Vec::new()).await?;
            }
            Ok(())
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A newer life ends the older one; a late word of an ended life changes nothing.
    #[test]
    fn watermarks_follow_lives_forward_only() {
        let marks = Watermarks::new(1);
        let (e1, e2) = (Epoch::new("e1").unwrap(), Epoch::new("e2").unwrap());
        marks.saw(0, &e1, Position::new(5, 0));
        marks.saw(0, &e1, Position::new(3, 0));
        assert_eq!(marks.of(0), Some((e1.clone(), Position::new(5, 0))));
        marks.saw(0, &e2, Position::new(1, 0));
        assert!(marks.ended(0, &e1));
        marks.saw(0, &e1, Position::new(9, 0));
        assert_eq!(marks.of(0), Some((e2.clone(), Position::new(1, 0))));
        assert!(!marks.ended(0, &e2));
    }
}

//! The Redis Streams backend (SPEC 3): one stream per shard, one StreamTail per node group.
//!
//! Topologies: one standalone instance (`redis.url`, one group), several standalone instances
//! (`redis.urls`, one group each, shards split evenly in order), or a Redis Cluster
//! (`redis.cluster`, `redis.groups` hash-tag groups). See [`Layout`] for the keys.
//!
//! - **Append** is one Lua script per group and request: it makes sure the group has an epoch,
//!   checks each idempotency key, `XADD`s with `MINID ~` (age) and `XTRIM MAXLEN ~` (length cap),
//!   and remembers the key with the id it got, all atomically; a retried publish never appends
//!   twice. A broadcast is one item per group (a copy on each of the group's shards), deduplicated
//!   per group, so a retry after a partial failure completes the missing groups.
//! - **Epoch**: a random name stored under the group's epoch key (`SET` if missing). A Redis that
//!   lost its data (restart without persistence, FLUSHALL) lost that key too, so the next hub to
//!   touch the group writes a new one and every older cursor answers `resync` `data_lost`.
//! - **Resume** reads `XRANGE key (after + COUNT n` page by page; `XINFO STREAM` gives the head
//!   (`last-generated-id`) and what trimming removed (`max-deleted-entry-id`, Redis 7).

mod layout;
mod reply;
mod tail;

use std::{
    ops::Range,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use fred::{
    prelude::{Builder, Client, ClientLike, Config, ReconnectPolicy},
    types::{ClusterHash, CustomCommand, Value},
    util::redis_keyslot,
};
use futures_util::{future::BoxFuture, FutureExt};

pub use layout::Layout;

use super::{
    Appended, Backend, BackendError, BackendResult, NewEvent, ShardState, StoredEvent, Tail,
};
use crate::{
    config::RedisConfig,
    model::{Cursor, Epoch, Position, Target},
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
}

fn unavailable(error: fred::error::Error) -> BackendError {
    BackendError::Unavailable(format!("redis: {error}"))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn build_client(config: Config) -> Result<Client, BackendError> {
    Builder::from_config(config)
        .with_connection_config(|connection| {
            connection.connection_timeout = Duration::from_secs(5);
            connection.internal_command_timeout = Duration::from_secs(5);
            connection.tcp.nodelay = Some(true);
            // Never re-send a command whose connection died in flight: an append script may have
            // run already. The caller sees an error (503) and retries with its idempotency key.
            connection.max_command_attempts = 1;
        })
        // During an outage a publish answers 503 after this, instead of waiting for Redis.
        .with_performance_config(|performance| {
            performance.default_command_timeout = COMMAND_TIMEOUT;
        })
        // fred sets no reconnect policy by default; without one an outage is permanent.
        .set_policy(ReconnectPolicy::new_exponential(0, 100, 5_000, 2))
        .build()
        .map_err(unavailable)
}

impl RedisBackend {
    /// Connects every client; fails when Redis cannot be reached within [`CONNECT_TIMEOUT`].
    pub async fn connect(settings: RedisSettings) -> BackendResult<Self> {
        let redis = &settings.redis;
        let clients = if redis.cluster {
            let config = Config::from_url_clustered(&redis.url).map_err(unavailable)?;
            vec![build_client(config)?]
        } else if redis.urls.is_empty() {
            vec![build_client(
                Config::from_url_centralized(&redis.url).map_err(unavailable)?,
            )?]
        } else {
            redis
                .urls
                .iter()
                .map(|url| build_client(Config::from_url_centralized(url).map_err(unavailable)?))
                .collect::<Result<_, _>>()?
        };
        for client in &clients {
            init(client).await?;
        }
        let backend = Self {
            inner: Arc::new(Inner {
                layout: settings.layout(),
                clients,
                settings,
            }),
        };
        // Fail at start-up, not on the first publish, when keys would cross slots or the server
        // lacks what we need (Redis 7 for XINFO's max-deleted-entry-id).
        for group in 0..backend.inner.layout.groups as usize {
            backend.inner.ensure_epoch(group).await?;
        }
        Ok(backend)
    }
}

async fn init(client: &Client) -> BackendResult<()> {
    match tokio::time::timeout(CONNECT_TIMEOUT, client.init()).await {
        Ok(Ok(_connection_task)) => Ok(()),
        Ok(Err(error)) => Err(unavailable(error)),
        Err(_) => Err(BackendError::Unavailable(format!(
            "redis: no connection within {}s",
            CONNECT_TIMEOUT.as_secs()
        ))),
    }
}

/// Reads the group's epoch (`KEYS[1]`), writing the fresh one in `ARGV[1]` when it is missing:
/// a Redis that lost its data lost this key too. Shared by both scripts below.
macro_rules! ensure_epoch_lua {
    () => {
        r#"
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  redis.call('SET', KEYS[1], ARGV[1])
  epoch = ARGV[1]
end
"#
    };
}

const ENSURE_EPOCH: &str = concat!(ensure_epoch_lua!(), "return epoch\n");

/// KEYS[1] = epoch key, then every stream and dedupe key the items refer to (one slot).
/// ARGV: new epoch, MINID threshold, MAXLEN cap, dedupe window (ms), item count, then per item:
/// dedupe key index (0 = none), dev, type, data, key, stream count, stream key indexes...
/// Returns {epoch, id, duplicate (0/1), id, duplicate, ...}: the first stream's id per item.
const APPEND: &str = concat!(
    ensure_epoch_lua!(),
    r#"
local out = {epoch}
local at = 6
for _ = 1, tonumber(ARGV[5]) do
  local dedupe = tonumber(ARGV[at])
  local dev, kind, data, key = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  local streams = tonumber(ARGV[at + 5])
  local first = at + 6
  at = first + streams
  local previous = false
  if dedupe > 0 then previous = redis.call('GET', KEYS[dedupe]) end
  if previous then
    table.insert(out, previous)
    table.insert(out, 1)
  else
    local id0 = false
    for s = 0, streams - 1 do
      local stream = KEYS[tonumber(ARGV[first + s])]
      local id
      if key ~= '' then
        id = redis.call('XADD', stream, 'MINID', '~', ARGV[2], '*', 'dev', dev, 'type', kind, 'data', data, 'key', key)
      else
        id = redis.call('XADD', stream, 'MINID', '~', ARGV[2], '*', 'dev', dev, 'type', kind, 'data', data)
      end
      redis.call('XTRIM', stream, 'MAXLEN', '~', ARGV[3])
      if not id0 then id0 = id end
    end
    if dedupe > 0 then redis.call('SET', KEYS[dedupe], id0, 'PX', ARGV[4]) end
    table.insert(out, id0)
    table.insert(out, 0)
  end
end
return out
"#
);

/// The script call of one group: its keys, arguments, and which request item each answer is for.
struct GroupCall {
    keys: Vec<String>,
    args: Vec<Value>,
    /// Per script item: the request index it answers (None: a broadcast's copies outside group 0)
    /// and the shard of its first stream.
    answers: Vec<(Option<usize>, u32)>,
}

impl GroupCall {
    fn new(epoch_key: String) -> Self {
        Self {
            keys: vec![epoch_key],
            args: Vec::new(),
            answers: Vec::new(),
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
        shards: Range<u32>,
        answers: Option<usize>,
    ) {
        let dedupe = event
            .key
            .as_ref()
            .map_or(0, |key| self.key(layout.dedupe_key(group, key)));
        let streams: Vec<usize> = shards
            .clone()
            .map(|shard| self.key(layout.stream_key(shard)))
            .collect();
        self.args.extend([
            Value::from(dedupe as i64),
            Value::from(event.target.as_field()),
            Value::from(event.event_type.as_str()),
            Value::from(event.data.as_str()),
            Value::from(event.key.as_deref().unwrap_or("")),
            Value::from(streams.len() as i64),
        ]);
        self.args
            .extend(streams.into_iter().map(|index| Value::from(index as i64)));
        self.answers.push((answers, shards.start));
    }
}

impl Inner {
    fn client(&self, group: usize) -> &Client {
        &self.clients[if self.layout.cluster { 0 } else { group }]
    }

    /// Routes a command to the slot of the group's hash tag (cluster) or to its instance.
    fn hash(&self, group: usize) -> ClusterHash {
        if self.layout.cluster {
            ClusterHash::Custom(redis_keyslot(self.layout.epoch_key(group).as_bytes()))
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

    async fn ensure_epoch(&self, group: usize) -> BackendResult<Epoch> {
        let reply = self
            .eval(
                group,
                ENSURE_EPOCH,
                vec![self.layout.epoch_key(group)],
                vec![Value::from(Epoch::random().as_str())],
            )
            .await?;
        parse_epoch(&reply)
    }

    /// Head (`last-generated-id`) of a shard's stream and the highest position that may have been
    /// removed from it (`ShardState::trimmed_through`); zeros when the stream does not exist.
    async fn stream_info(&self, shard: u32) -> BackendResult<(Position, Position)> {
        let group = self.layout.group_of(shard);
        let key = self.layout.stream_key(shard);
        match self
            .command(
                group,
                "XINFO",
                vec![Value::from("STREAM"), Value::from(key)],
            )
            .await
        {
            Ok(info) => {
                let head = reply::field(&info, "last-generated-id")
                    .and_then(reply::position)
                    .unwrap_or_default();
                Ok((head, removed_through(&info, head)?))
            }
            Err(BackendError::Unavailable(message)) if message.contains("no such key") => {
                Ok(Default::default())
            }
            Err(error) => Err(error),
        }
    }

    fn minid(&self) -> String {
        now_ms()
            .saturating_sub(self.settings.redis.retention.as_millis() as u64)
            .to_string()
    }

    async fn append(&self, events: Vec<NewEvent>) -> BackendResult<Vec<Appended>> {
        let layout = &self.layout;
        let groups = layout.groups as usize;
        let mut calls: Vec<GroupCall> = (0..groups)
            .map(|g| GroupCall::new(layout.epoch_key(g)))
            .collect();
        for (index, event) in events.iter().enumerate() {
            match &event.target {
                Target::Device(device) => {
                    let shard = crate::model::shard_of(device.as_str(), layout.shards);
                    let group = layout.group_of(shard);
                    calls[group].push(layout, group, event, shard..shard + 1, Some(index));
                }
                Target::Broadcast => {
                    for (group, call) in calls.iter_mut().enumerate() {
                        let answers = (group == 0).then_some(index);
                        call.push(layout, group, event, layout.shards_of(group), answers);
                    }
                }
            }
        }
        let mut results: Vec<Option<Appended>> = vec![None; events.len()];
        for (group, call) in calls.into_iter().enumerate() {
            if call.answers.is_empty() {
                continue;
            }
            let mut args = vec![
                Value::from(Epoch::random().as_str()),
                Value::from(self.minid()),
                Value::from(self.settings.redis.max_len as i64),
                Value::from(self.settings.dedupe_window.as_millis() as i64),
                Value::from(call.answers.len() as i64),
            ];
            args.extend(call.args);
            let reply = self.eval(group, APPEND, call.keys, args).await?;
            let items = reply::items(&reply);
            let epoch = items
                .first()
                .map(parse_epoch)
                .transpose()?
                .ok_or_else(|| bad_reply("append"))?;
            for ((answers, shard), pair) in call.answers.iter().zip(items[1..].chunks(2)) {
                let (Some(index), [id, duplicate]) = (answers, pair) else {
                    continue;
                };
                let position = reply::position(id).ok_or_else(|| bad_reply("append id"))?;
                results[*index] = Some(Appended {
                    cursor: Cursor::new(epoch.clone(), *shard, position),
                    duplicate: matches!(duplicate, Value::Integer(1)),
                });
            }
        }
        results
            .into_iter()
            .map(|result| result.ok_or_else(|| bad_reply("append answers")))
            .collect()
    }

    async fn read_after(
        &self,
        shard: u32,
        after: Position,
        limit: usize,
    ) -> BackendResult<Vec<StoredEvent>> {
        let group = self.layout.group_of(shard);
        let mut events = Vec::new();
        let mut after = after;
        // Entries that cannot be delivered are skipped, so one XRANGE may yield fewer than it
        // read; the caller takes a short page for the end of the stream, so read on until the
        // page is full or the stream really ended.
        loop {
            let wanted = limit - events.len();
            let args = vec![
                Value::from(self.layout.stream_key(shard)),
                Value::from(format!("({after}")),
                Value::from("+"),
                Value::from("COUNT"),
                Value::from(wanted as i64),
            ];
            let reply = self.command(group, "XRANGE", args).await?;
            let page = reply::entries(shard, &reply);
            let read = page.events.len() as u64 + page.skipped;
            events.extend(page.events);
            match page.last {
                Some(last) if read == wanted as u64 && events.len() < limit => after = last,
                _ => return Ok(events),
            }
        }
    }

    async fn trim(&self, group: usize) -> BackendResult<()> {
        let minid = self.minid();
        for shard in self.layout.shards_of(group) {
            let key = self.layout.stream_key(shard);
            for (strategy, threshold) in [
                ("MINID", Value::from(minid.as_str())),
                ("MAXLEN", Value::from(self.settings.redis.max_len as i64)),
            ] {
                let args = vec![
                    Value::from(key.as_str()),
                    Value::from(strategy),
                    Value::from("~"),
                    threshold,
                ];
                self.command(group, "XTRIM", args).await?;
            }
        }
        Ok(())
    }
}

/// What an XINFO STREAM reply says was removed: XDEL is tracked exactly (`max-deleted-entry-id`),
/// trimming is not (Redis 7.0 does not update that field when it trims). When fewer entries remain
/// than were ever added, everything before the first remaining entry may be gone, so its
/// predecessor counts as removed (the whole stream, up to the head, when none remains). A cursor
/// that is exactly the last trimmed entry is thereby reported `expired` although it missed
/// nothing: a needless resync, never a silent gap.
fn removed_through(info: &Value, head: Position) -> BackendResult<Position> {
    let deleted = reply::field(info, "max-deleted-entry-id")
        .and_then(reply::position)
        .ok_or_else(|| {
            BackendError::Rejected(
                "XINFO STREAM lacks max-deleted-entry-id: Redis 7 or newer is required".into(),
            )
        })?;
    let integer = |name| match reply::field(info, name) {
        Some(Value::Integer(n)) => *n,
        _ => 0,
    };
    if integer("entries-added") <= integer("length") {
        return Ok(deleted);
    }
    let first = reply::field(info, "first-entry")
        .and_then(|entry| reply::items(entry).first())
        .and_then(reply::position);
    let trimmed = match first {
        Some(first) if first.seq > 0 => Position::new(first.ms, first.seq - 1),
        Some(first) if first.ms > 0 => Position::new(first.ms - 1, u64::MAX),
        Some(_) => Position::ZERO,
        None => head,
    };
    Ok(deleted.max(trimmed))
}

fn parse_epoch(reply: &Value) -> BackendResult<Epoch> {
    reply::text(reply)
        .and_then(|text| Epoch::new(text).ok())
        .ok_or_else(|| {
            BackendError::Rejected(format!("the epoch key holds {reply:?}, not an epoch"))
        })
}

fn bad_reply(what: &str) -> BackendError {
    BackendError::Rejected(format!("unexpected redis reply to {what}"))
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

    fn append(&self, events: Vec<NewEvent>) -> BoxFuture<'_, BackendResult<Vec<Appended>>> {
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
    ) -> BoxFuture<'_, BackendResult<Vec<StoredEvent>>> {
        self.inner.read_after(shard, after, limit).boxed()
    }

    fn shard_state(&self, shard: u32) -> BoxFuture<'_, BackendResult<ShardState>> {
        async move {
            let epoch = self
                .inner
                .ensure_epoch(self.inner.layout.group_of(shard))
                .await?;
            let (head, trimmed_through) = self.inner.stream_info(shard).await?;
            Ok(ShardState {
                epoch,
                head,
                trimmed_through,
            })
        }
        .boxed()
    }

    fn trim(&self, group: usize) -> BoxFuture<'_, BackendResult<()>> {
        self.inner.trim(group).boxed()
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

//! The fleet store on Redis (docs/fleet.md, "Redis keys"): one hash per device, the pods' beats
//! and a device index under one hash tag, broadcast copies as strings, a hash per group (the
//! shards where its members were seen), and the pub/sub channel `{prefix}:fleet`. The contract
//! is the module doc of `backend::fleet`.
//!
//! - **Where.** Fleet keys live on the backend's first client: the first instance of
//!   `redis.urls`, or the cluster. In a cluster a device's hash hashes by its whole name (devices
//!   spread over the slots); the beats and the index share the tag `{fleet}`, so the scripts that
//!   read them with Redis' clock keep to one slot.
//! - **Round trips.** A batch of presence writes is one pipeline: one [`WRITE`] script per slot
//!   of the batch's devices (standalone: one script), one [`INDEX`] script and one
//!   [`MARK_GROUP`] per group whose members it marks (`backend::fleet::groups`). A reconnect
//!   storm of 10,000 devices written in batches of hundreds costs a round trip per batch.
//! - **Clock.** Beats are stamped and liveness judged with Redis' `TIME`, on the node of the
//!   `{fleet}` slot: pods' clocks do not matter.

use std::{
    collections::{BTreeMap, HashMap},
    sync::atomic::{AtomicU64, Ordering},
};

use fred::{
    prelude::{Client, ClientLike, EventInterface, PubsubInterface},
    types::{ClusterHash, CustomCommand, Value},
    util::redis_keyslot,
};
use futures_util::{future::BoxFuture, stream::BoxStream, FutureExt, StreamExt};

use super::{bad_reply, init, reply, unavailable};
use crate::{
    backend::{
        fleet::{
            groups::{seen_window, GroupIndex, GroupMarks},
            last_seen_ms, AckOutcome, DeviceFilter, DevicePage, DeviceRecord, FleetMessage,
            FleetSettings, FleetStore, Heard, PresenceWrite, RACE_WINDOW,
        },
        BackendError, BackendResult,
    },
    model::{unix_ms, Cursor, DeviceId, GroupName, Groups},
    report::Report,
};

/// Channel messages (one per flush of a pod) the subscriber may fall behind by.
const SUBSCRIBER_BACKLOG: usize = 4096;

/// Applies presence changes to device hashes (all of one slot). KEYS: the device hashes.
/// ARGV: retention (ms), change count, race window (ms), then 11 per change: key index, kind
/// (`on`, `refresh`, `off`, `sent`), instance, session, pod, connected_ms, remote, user agent,
/// ended at (ms), last sent (or ''), groups (comma-separated). `on` replaces the hash's session as
/// `backend::fleet::replaces` says, `refresh` as `backend::fleet::refreshes` says (the same
/// session again only refreshes its expiry, a `refresh` only while it is open); `off` and
/// `sent` apply only while the hash names the same instance and session, `sent` only while it
/// is open.
pub const WRITE: &str = r#"
local retention, race = ARGV[1], tonumber(ARGV[3])
-- (connected_ms, instance, session) of a greater than of b: the rank of a race.
local function outranks(a_ms, a_instance, a_session, b_ms, b_instance, b_session)
  if a_ms ~= b_ms then return a_ms > b_ms end
  if a_instance ~= b_instance then return a_instance > b_instance end
  return a_session > b_session
end
for i = 0, tonumber(ARGV[2]) - 1 do
  local at = 4 + i * 11
  local key = KEYS[tonumber(ARGV[at])]
  local kind = ARGV[at + 1]
  local current = redis.call('HMGET', key, 'instance', 'session', 'connected_ms', 'ended_ms')
  local same = current[1] == ARGV[at + 2] and current[2] == ARGV[at + 3]
  if kind == 'on' or kind == 'refresh' then
    local replace = not same
    if replace and current[1] then
      local new_ms, old_ms = tonumber(ARGV[at + 5]), tonumber(current[3])
      local newer = outranks(new_ms, ARGV[at + 2], tonumber(ARGV[at + 3]),
        old_ms, current[1], tonumber(current[2]))
      if kind == 'refresh' then
        replace = newer
      elseif not current[4] and math.abs(new_ms - old_ms) < race then
        replace = newer
      end
    end
    if replace then
      -- The ack and the last position outlive the session they were written in.
      redis.call('HDEL', key, 'ended_ms')
      redis.call('HSET', key, 'instance', ARGV[at + 2], 'session', ARGV[at + 3],
        'pod', ARGV[at + 4], 'connected_ms', ARGV[at + 5], 'remote', ARGV[at + 6],
        'user_agent', ARGV[at + 7], 'groups', ARGV[at + 10])
    end
    if replace or (same and not (kind == 'refresh' and current[4])) then
      redis.call('PEXPIRE', key, retention)
    end
  elseif same and not (kind == 'sent' and current[4]) then
    if kind == 'off' then redis.call('HSET', key, 'ended_ms', ARGV[at + 8]) end
    if ARGV[at + 9] ~= '' then redis.call('HSET', key, 'last_sent', ARGV[at + 9]) end
    redis.call('PEXPIRE', key, retention)
  end
end
return #ARGV
"#;

/// Lists devices in the index and forgets those not written for the retention. KEYS: the index
/// by name (all scores 0, read BYLEX), the index by last write (score: Redis ms). ARGV:
/// retention (ms), then device ids. At most 1,000 old names go per call, so a call stays short
/// however many devices went quiet at once.
pub const INDEX: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 0, ARGV[i])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
end
local old = redis.call('ZRANGE', KEYS[2], '-inf', now - tonumber(ARGV[1]), 'BYSCORE',
  'LIMIT', 0, 1000)
for _, device in ipairs(old) do
  redis.call('ZREM', KEYS[1], device)
  redis.call('ZREM', KEYS[2], device)
end
return #old
"#;

/// Records a beat on Redis' clock. KEYS: the beats hash. ARGV: instance, '1' when stopping,
/// retention (ms). A stopping instance's field holds minus its last beat. Fields older than the
/// retention go: the records that could name them are gone too.
pub const BEAT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local value = now
if ARGV[2] == '1' then value = -now end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', value))
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if now - math.abs(tonumber(all[i + 1])) > tonumber(ARGV[3]) then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return 1
"#;

/// Marks a group's members seen in some shards now (Redis' clock), and notes when its index
/// began unless it has (in the same hash: whatever loses the marks loses the note). KEYS[1]: the
/// group's hash. ARGV: its expiry (ms), then the shards.
pub const MARK_GROUP: &str = r#"
local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('HSETNX', KEYS[1], 'since', now)
for i = 2, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], now) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"#;

/// Redis' clock and a group's hash (`since` and a mark per shard). KEYS[1]: the hash.
/// Returns `{ms, fields (HGETALL)}`.
pub const GROUP_INDEX: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {string.format('%.0f', now), redis.call('HGETALL', KEYS[1])}
"#;

/// Redis' clock, every beat, and (with a limit) a page of the index. KEYS: the beats hash, the
/// index by name. ARGV: '' (no page) or the BYLEX start, then the count.
/// Returns `{ms, beats (HGETALL), names}`.
pub const STATE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local names = {}
if ARGV[1] ~= '' then
  names = redis.call('ZRANGE', KEYS[2], ARGV[1], '+', 'BYLEX', 'LIMIT', 0, tonumber(ARGV[2]))
end
return {string.format('%.0f', now), redis.call('HGETALL', KEYS[1]), names}
"#;

/// Moves a device's ack forward. KEYS: the device hash. ARGV: epoch, shard, ms, seq, cursor
/// text, acked at (ms), retention (ms). Same epoch and shard: only a greater position moves it
/// (decimal text compared by length, then bytes: no float rounding); otherwise it is replaced.
/// A device without a hash gets one with an ended, empty session. Returns 1 if it moved.
pub const ACK: &str = r#"
local function greater(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local key = KEYS[1]
local stored = redis.call('HMGET', key, 'ack_epoch', 'ack_shard', 'ack_ms', 'ack_seq')
if stored[1] and stored[1] == ARGV[1] and stored[2] == ARGV[2] then
  local newer = greater(ARGV[3], stored[3]) or (ARGV[3] == stored[3] and greater(ARGV[4], stored[4]))
  if not newer then return 0 end
end
if redis.call('EXISTS', key) == 0 then
  redis.call('HSET', key, 'instance', '', 'session', '0', 'pod', '', 'connected_ms', '0',
    'remote', '', 'user_agent', '', 'ended_ms', ARGV[6])
end
redis.call('HSET', key, 'ack_epoch', ARGV[1], 'ack_shard', ARGV[2], 'ack_ms', ARGV[3],
  'ack_seq', ARGV[4], 'acked', ARGV[5], 'acked_ms', ARGV[6])
redis.call('PEXPIRE', key, ARGV[7])
return 1
"#;

/// Names of the fleet's keys and channel (docs/fleet.md).
#[derive(Debug, Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn device(&self, device: &str) -> String {
        format!("{}:fleet:dev:{device}", self.prefix)
    }
    fn beats(&self) -> String {
        format!("{}:{{fleet}}:pods", self.prefix)
    }
    fn names(&self) -> String {
        format!("{}:{{fleet}}:names", self.prefix)
    }
    fn written(&self) -> String {
        format!("{}:{{fleet}}:written", self.prefix)
    }
    fn broadcast(&self, id: &str) -> String {
        format!("{}:fleet:bc:{id}", self.prefix)
    }
    fn group(&self, group: &str) -> String {
        format!("{}:fleet:grp:{group}", self.prefix)
    }
    fn channel(&self) -> String {
        format!("{}:fleet", self.prefix)
    }
}

pub struct RedisFleet {
    client: Client,
    /// Keys of different devices may be on different slots.
    cluster: bool,
    keys: Keys,
    settings: FleetSettings,
    /// Exchanges with Redis so far (a pipeline counts once): what tests hold writes to.
    round_trips: AtomicU64,
    marks: GroupMarks,
}

/// One command of a pipeline: name, slot key, arguments.
struct Call {
    name: &'static str,
    slot_key: String,
    args: Vec<Value>,
}

fn eval(script: &str, keys: Vec<String>, args: Vec<Value>) -> Call {
    let slot_key = keys.first().cloned().unwrap_or_default();
    let mut all = Vec::with_capacity(2 + keys.len() + args.len());
    all.push(Value::from(script));
    all.push(Value::from(keys.len() as i64));
    all.extend(keys.into_iter().map(Value::from));
    all.extend(args);
    Call {
        name: "EVAL",
        slot_key,
        args: all,
    }
}

fn ms_arg(duration: std::time::Duration) -> Value {
    Value::from(duration.as_millis().min(i64::MAX as u128) as i64)
}

impl RedisFleet {
    /// The store on `client` (the backend's first client); checks that Redis answers.
    pub(super) async fn new(
        client: Client,
        cluster: bool,
        prefix: String,
        settings: FleetSettings,
    ) -> BackendResult<Self> {
        let fleet = Self {
            client,
            cluster,
            keys: Keys { prefix },
            marks: GroupMarks::new(settings.shards, settings.retention),
            settings,
            round_trips: AtomicU64::new(0),
        };
        fleet.state(None).await?;
        Ok(fleet)
    }

    /// Exchanges with Redis so far; a pipeline counts as one.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// Sends `calls` as one pipeline (each routed to the slot of its key) and answers in order.
    async fn exchange(&self, calls: Vec<Call>) -> BackendResult<Vec<Value>> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let pipeline = self.client.pipeline();
        for call in calls {
            let hash = ClusterHash::Custom(redis_keyslot(call.slot_key.as_bytes()));
            let command = CustomCommand::new_static(call.name, hash, false);
            let () = pipeline
                .custom(command, call.args)
                .await
                .map_err(unavailable)?;
        }
        pipeline
            .try_all::<Value>()
            .await
            .into_iter()
            .map(|answer| answer.map_err(unavailable))
            .collect()
    }

    async fn one(&self, call: Call) -> BackendResult<Value> {
        self.exchange(vec![call])
            .await?
            .pop()
            .ok_or_else(|| bad_reply("fleet"))
    }

    fn state_call(&self, page: Option<(&str, usize)>) -> Call {
        let (start, count) = page.unwrap_or(("", 0));
        eval(
            STATE,
            vec![self.keys.beats(), self.keys.names()],
            vec![Value::from(start), Value::from(count as i64)],
        )
    }

    async fn state(&self, page: Option<(&str, usize)>) -> BackendResult<State> {
        let reply = self.one(self.state_call(page)).await?;
        State::parse(&reply)
    }

    fn index_call(&self, devices: impl IntoIterator<Item = String>) -> Call {
        let mut args = vec![ms_arg(self.settings.retention)];
        args.extend(devices.into_iter().map(Value::from));
        eval(INDEX, vec![self.keys.names(), self.keys.written()], args)
    }

    async fn write(&self, changes: Vec<PresenceWrite>) -> BackendResult<()> {
        if changes.is_empty() {
            return Ok(());
        }
        // Per slot, in the batch's order (a device's changes share its slot, so stay in order).
        let mut slots: BTreeMap<u16, SlotCall> = BTreeMap::new();
        let mut devices = Vec::with_capacity(changes.len());
        for change in &changes {
            let (device, args) = write_args(change);
            let key = self.keys.device(device.as_str());
            devices.push(device.to_string());
            // Standalone: one script for the batch; a cluster: one per slot.
            let slot = if self.cluster {
                redis_keyslot(key.as_bytes())
            } else {
                0
            };
            let call = slots.entry(slot).or_default();
            let index = call.key(key);
            call.changes += 1;
            call.args.push(Value::from(index as i64));
            call.args.extend(args);
        }
        devices.sort();
        devices.dedup();
        let mut calls: Vec<Call> = slots
            .into_values()
            .map(|slot| {
                let mut args = vec![
                    ms_arg(self.settings.retention),
                    Value::from(slot.changes as i64),
                    ms_arg(RACE_WINDOW),
                ];
                args.extend(slot.args);
                eval(WRITE, slot.keys, args)
            })
            .collect();
        calls.push(self.index_call(devices));
        let expiry = ms_arg(seen_window(
            self.settings.retention,
            self.settings.broadcast_retention,
        ));
        let now = unix_ms();
        let due = self.marks.due(&changes, now);
        for (group, shards) in &due {
            let mut args = vec![expiry.clone()];
            args.extend(shards.iter().map(|&shard| Value::from(i64::from(shard))));
            calls.push(eval(
                MARK_GROUP,
                vec![self.keys.group(group.as_str())],
                args,
            ));
        }
        self.exchange(calls).await?;
        // Only now: the marks of a write that failed or was dropped are owed again.
        self.marks.written(&due, now);
        Ok(())
    }

    async fn group_index(&self, group: &GroupName) -> BackendResult<Option<GroupIndex>> {
        let reply = self
            .one(eval(
                GROUP_INDEX,
                vec![self.keys.group(group.as_str())],
                Vec::new(),
            ))
            .await?;
        let bad = || bad_reply("fleet group index");
        let [now, fields] = reply::items(&reply) else {
            return Err(bad());
        };
        let number = |value: &Value| reply::text(value).and_then(|text| text.parse::<u64>().ok());
        let now_ms = number(now).ok_or_else(bad)?;
        let mut since_ms = None;
        let mut marks = Vec::new();
        for pair in reply::items(fields).chunks(2) {
            let [name, value] = pair else {
                return Err(bad());
            };
            let name = reply::text(name).ok_or_else(bad)?;
            let value = number(value).ok_or_else(bad)?;
            match name {
                "since" => since_ms = Some(value),
                shard => marks.push((shard.parse::<u32>().map_err(|_| bad())?, value)),
            }
        }
        Ok(since_ms.map(|since_ms| GroupIndex {
            since_ms,
            marks,
            now_ms,
        }))
    }

    async fn beat(&self, instance: &str, stopping: bool) -> BackendResult<()> {
        self.one(eval(
            BEAT,
            vec![self.keys.beats()],
            vec![
                Value::from(instance),
                Value::from(if stopping { "1" } else { "0" }),
                ms_arg(self.settings.retention),
            ],
        ))
        .await
        .map(|_| ())
    }

    async fn device(&self, device: &DeviceId) -> BackendResult<Option<DeviceRecord>> {
        let mut answers = self
            .exchange(vec![
                self.state_call(None),
                Call {
                    name: "HGETALL",
                    slot_key: self.keys.device(device.as_str()),
                    args: vec![Value::from(self.keys.device(device.as_str()))],
                },
            ])
            .await?;
        let hash = answers.pop().ok_or_else(|| bad_reply("fleet device"))?;
        let state = State::parse(&answers.pop().ok_or_else(|| bad_reply("fleet state"))?)?;
        Ok(parse_hash(&hash).and_then(|fields| state.record(device, &fields, self.settings)))
    }

    async fn list(
        &self,
        filter: &DeviceFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> BackendResult<DevicePage> {
        let limit = limit.max(1);
        // A cursor that is no device id starts from the beginning, as in memory.
        let start = match cursor.map(DeviceId::parse) {
            Some(Ok(after)) => format!("({after}"),
            _ => "-".to_owned(),
        };
        let state = self.state(Some((&start, limit + 1))).await?;
        let more = state.names.len() > limit;
        let names: Vec<&String> = state.names.iter().take(limit).collect();
        let calls = names
            .iter()
            .map(|name| {
                let key = self.keys.device(name);
                Call {
                    name: "HGETALL",
                    slot_key: key.clone(),
                    args: vec![Value::from(key)],
                }
            })
            .collect();
        let hashes = self.exchange(calls).await?;
        let mut devices = Vec::new();
        for (name, hash) in names.iter().zip(&hashes) {
            // A name left by a record that expired since: skipped (the index forgets it later).
            let Ok(device) = DeviceId::parse(name) else {
                continue;
            };
            let Some(fields) = parse_hash(hash) else {
                continue;
            };
            if let Some(record) = state.record(&device, &fields, self.settings) {
                if filter.admits(&record) {
                    devices.push(record);
                }
            }
        }
        let next = names.last().filter(|_| more).map(|last| last.to_string());
        Ok(DevicePage { devices, next })
    }

    async fn ack(
        &self,
        device: &DeviceId,
        cursor: &Cursor,
        at_ms: u64,
    ) -> BackendResult<AckOutcome> {
        let answers = self
            .exchange(vec![
                eval(
                    ACK,
                    vec![self.keys.device(device.as_str())],
                    vec![
                        Value::from(cursor.epoch.as_str()),
                        Value::from(cursor.shard.to_string()),
                        Value::from(cursor.position.ms.to_string()),
                        Value::from(cursor.position.seq.to_string()),
                        Value::from(cursor.to_string()),
                        Value::from(at_ms.to_string()),
                        ms_arg(self.settings.retention),
                    ],
                ),
                self.index_call([device.to_string()]),
            ])
            .await?;
        match answers.first() {
            Some(Value::Integer(1)) => Ok(AckOutcome::Moved),
            Some(Value::Integer(0)) => Ok(AckOutcome::Stale),
            _ => Err(bad_reply("fleet ack")),
        }
    }

    async fn record_broadcast(&self, copies: Vec<Cursor>) -> BackendResult<()> {
        let Some(id) = copies.first() else {
            return Ok(());
        };
        let key = self.keys.broadcast(&id.to_string());
        let text = copies
            .iter()
            .map(Cursor::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        self.one(Call {
            name: "SET",
            slot_key: key.clone(),
            args: vec![
                Value::from(key),
                Value::from(text),
                Value::from("PX"),
                ms_arg(self.settings.broadcast_retention),
            ],
        })
        .await
        .map(|_| ())
    }

    async fn broadcast_copies(&self, id: &Cursor) -> BackendResult<Option<Vec<Cursor>>> {
        let key = self.keys.broadcast(&id.to_string());
        let reply = self
            .one(Call {
                name: "GET",
                slot_key: key.clone(),
                args: vec![Value::from(key)],
            })
            .await?;
        if matches!(reply, Value::Null) {
            return Ok(None);
        }
        let text = reply::text(&reply).ok_or_else(|| bad_reply("fleet broadcast"))?;
        text.split(' ')
            .map(|copy| Cursor::parse(copy).map_err(|_| bad_reply("fleet broadcast copy")))
            .collect::<BackendResult<Vec<_>>>()
            .map(Some)
    }

    async fn announce(&self, messages: Vec<FleetMessage>) -> BackendResult<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let text = serde_json::to_string(&messages)
            .map_err(|error| BackendError::rejected(format!("fleet message: {error}")))?;
        let channel = self.keys.channel();
        self.one(Call {
            name: "PUBLISH",
            slot_key: channel.clone(),
            args: vec![Value::from(channel), Value::from(text)],
        })
        .await
        .map(|_| ())
    }

    /// A connection of its own (same settings as the backend's) subscribed to the channel, and
    /// subscribed again after every reconnection.
    async fn subscribe(&self) -> BackendResult<BoxStream<'static, Heard>> {
        // RESP3: messages arrive as push frames, which fred never takes for the answer of a
        // command in flight (with RESP2 a message arriving while a SUBSCRIBE waits for its
        // answer could be taken for it and lost).
        let mut config = self.client.client_config();
        config.version = fred::types::RespVersion::RESP3;
        // fred keeps 32 messages for a subscriber by default; more than that while the Fleet is
        // busy is a gap, which costs every pod a read of the devices online.
        let mut performance = self.client.perf_config();
        performance.broadcast_channel_capacity = SUBSCRIBER_BACKLOG;
        let subscriber = Client::new(
            config,
            Some(performance),
            Some(self.client.connection_config().clone()),
            self.client.client_reconnect_policy(),
        );
        let mut reconnects = subscriber.reconnect_rx();
        let messages = subscriber.message_rx();
        init(&subscriber, "redis (fleet channel)").await?;
        let channel = self.keys.channel();
        subscriber
            .subscribe(channel.clone())
            .await
            .map_err(unavailable)?;
        // The events so far are the connections just made (one per node in a cluster), which
        // the SUBSCRIBE above covers; later ones are reconnections, after which the server
        // has forgotten the subscription.
        while reconnects.try_recv().is_ok() {}
        // One gap stands for any number of resubscriptions not yet taken from the stream.
        let (gaps, gaps_heard) = tokio::sync::mpsc::channel::<()>(1);
        let resubscriber = subscriber.clone();
        let resubscribe = tokio::spawn(async move {
            loop {
                match reconnects.recv().await {
                    Ok(_) => match resubscriber.subscribe(channel.clone()).await {
                        // What was announced while the link was down is lost: a gap.
                        Ok(()) => {
                            let _ = gaps.try_send(());
                        }
                        // The next reconnection tries again; meanwhile liveness decides.
                        Err(error) => log::warn!(
                            "redis: cannot subscribe to the fleet channel again: {}",
                            Report(&error)
                        ),
                    },
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        let guard = Subscription {
            client: subscriber,
            resubscribe,
        };
        let stream = futures_util::stream::unfold(
            (messages, gaps_heard, guard),
            |(mut messages, mut gaps_heard, guard)| async move {
                loop {
                    let heard = tokio::select! {
                        Some(()) = gaps_heard.recv() => vec![Heard::Gap],
                        received = messages.recv() => match received {
                            Ok(message) => match decode(&message.value) {
                                Some(batch) => batch.into_iter().map(Heard::Message).collect(),
                                None => continue,
                            },
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                                vec![Heard::Gap]
                            }
                            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                        },
                    };
                    return Some((heard, (messages, gaps_heard, guard)));
                }
            },
        )
        .flat_map(futures_util::stream::iter)
        .boxed();
        Ok(stream)
    }
}

/// The messages of one channel message; `None` for anything that is not ours (logged).
fn decode(value: &Value) -> Option<Vec<FleetMessage>> {
    let text = reply::text(value)?;
    match serde_json::from_str::<Vec<FleetMessage>>(text) {
        Ok(batch) => Some(batch),
        Err(error) => {
            log::warn!("redis: a fleet channel message that is not ours: {error}");
            None
        }
    }
}

/// Keeps the subscriber connection and its resubscribing task while the stream lives.
struct Subscription {
    client: Client,
    resubscribe: tokio::task::JoinHandle<()>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.resubscribe.abort();
        let client = self.client.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = client.quit().await;
            });
        }
    }
}

#[derive(Default)]
struct SlotCall {
    keys: Vec<String>,
    /// Key → its 1-based index in `keys`: a batch may name 10,000 keys, too many to search.
    indices: HashMap<String, usize>,
    args: Vec<Value>,
    changes: usize,
}

impl SlotCall {
    /// 1-based index of `key` in KEYS, added if new.
    fn key(&mut self, key: String) -> usize {
        if let Some(&index) = self.indices.get(&key) {
            return index;
        }
        self.keys.push(key.clone());
        self.indices.insert(key, self.keys.len());
        self.keys.len()
    }
}

/// The device a change is about and its 10 arguments after the key index (see [`WRITE`]).
fn write_args(change: &PresenceWrite) -> (&DeviceId, Vec<Value>) {
    let text = |s: &str| Value::from(s.to_owned());
    match change {
        PresenceWrite::Online(session) | PresenceWrite::Refresh(session) => (
            &session.device,
            vec![
                text(match change {
                    PresenceWrite::Refresh(_) => "refresh",
                    _ => "on",
                }),
                text(&session.instance),
                Value::from(session.session.to_string()),
                text(&session.pod),
                Value::from(session.connected_ms.to_string()),
                text(&session.remote),
                text(&session.user_agent),
                text(""),
                text(""),
                text(&session.groups.to_list()),
            ],
        ),
        PresenceWrite::Offline {
            session,
            at_ms,
            last_sent,
        } => (
            &session.device,
            vec![
                text("off"),
                text(&session.instance),
                Value::from(session.session.to_string()),
                text(""),
                text(""),
                text(""),
                text(""),
                Value::from(at_ms.to_string()),
                Value::from(
                    last_sent
                        .as_ref()
                        .map(Cursor::to_string)
                        .unwrap_or_default(),
                ),
                text(""),
            ],
        ),
        PresenceWrite::Sent { session, last_sent } => (
            &session.device,
            vec![
                text("sent"),
                text(&session.instance),
                Value::from(session.session.to_string()),
                text(""),
                text(""),
                text(""),
                text(""),
                text(""),
                Value::from(last_sent.to_string()),
                text(""),
            ],
        ),
    }
}

/// A hash read with HGETALL; `None` when it does not exist.
fn parse_hash(value: &Value) -> Option<HashMap<String, String>> {
    let mut fields = HashMap::new();
    match value {
        Value::Array(items) => {
            for pair in items.chunks(2) {
                if let [name, value] = pair {
                    fields.insert(
                        reply::text(name)?.to_owned(),
                        reply::text(value)?.to_owned(),
                    );
                }
            }
        }
        Value::Map(map) => {
            for (name, value) in map.clone().inner() {
                fields.insert(name.as_str()?.to_owned(), reply::text(&value)?.to_owned());
            }
        }
        _ => return None,
    }
    (!fields.is_empty()).then_some(fields)
}

/// Redis' clock, the beats, and a page of the index, as [`STATE`] answers them.
struct State {
    now_ms: u64,
    /// Instance → last beat (ms), negative once it said it stops.
    beats: HashMap<String, i64>,
    names: Vec<String>,
}

impl State {
    fn parse(reply: &Value) -> BackendResult<Self> {
        let [now, beats, names] = reply::items(reply) else {
            return Err(bad_reply("fleet state"));
        };
        let now_ms = reply::text(now)
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| bad_reply("fleet clock"))?;
        let beats = parse_hash(beats)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(instance, beat)| Some((instance, beat.parse().ok()?)))
            .collect();
        let names = reply::items(names)
            .iter()
            .filter_map(|name| reply::text(name).map(str::to_owned))
            .collect();
        Ok(Self {
            now_ms,
            beats,
            names,
        })
    }

    /// The record of `device` from its hash's `fields`; `None` if they are not a record.
    fn record(
        &self,
        device: &DeviceId,
        fields: &HashMap<String, String>,
        settings: FleetSettings,
    ) -> Option<DeviceRecord> {
        let text = |name: &str| fields.get(name).cloned().unwrap_or_default();
        let number = |name: &str| fields.get(name).and_then(|value| value.parse::<u64>().ok());
        let cursor = |name: &str| fields.get(name).and_then(|value| Cursor::parse(value).ok());
        let instance = fields.get("instance")?.clone();
        let ended_ms = number("ended_ms");
        let beat = self.beats.get(&instance).copied();
        let alive = beat.is_some_and(|beat| {
            beat > 0 && self.now_ms.saturating_sub(beat as u64) < settings.ttl.as_millis() as u64
        });
        let online = ended_ms.is_none() && alive;
        let connected_ms = number("connected_ms").unwrap_or(0);
        let last_seen_ms = last_seen_ms(
            ended_ms,
            online,
            self.now_ms,
            beat.map(i64::unsigned_abs),
            connected_ms,
        );
        Some(DeviceRecord {
            device: device.clone(),
            online,
            pod: text("pod"),
            instance,
            session: number("session").unwrap_or(0),
            connected_ms,
            last_seen_ms,
            remote: text("remote"),
            user_agent: text("user_agent"),
            // Written by this hub, so well-formed; a record without it is in no group.
            groups: Groups::parse_list(&text("groups")).unwrap_or_default(),
            last_sent: cursor("last_sent"),
            acked: cursor("acked"),
            acked_ms: number("acked_ms"),
        })
    }
}

impl FleetStore for RedisFleet {
    fn write(&self, changes: Vec<PresenceWrite>) -> BoxFuture<'_, BackendResult<()>> {
        self.write(changes).boxed()
    }

    fn beat(&self, _pod: &str, instance: &str, stopping: bool) -> BoxFuture<'_, BackendResult<()>> {
        let instance = instance.to_owned();
        async move { self.beat(&instance, stopping).await }.boxed()
    }

    fn device(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Option<DeviceRecord>>> {
        let device = device.clone();
        async move { self.device(&device).await }.boxed()
    }

    fn list(
        &self,
        filter: &DeviceFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> BoxFuture<'_, BackendResult<DevicePage>> {
        let (filter, cursor) = (filter.clone(), cursor.map(str::to_owned));
        async move { self.list(&filter, limit, cursor.as_deref()).await }.boxed()
    }

    fn ack(
        &self,
        device: &DeviceId,
        cursor: &Cursor,
        at_ms: u64,
    ) -> BoxFuture<'_, BackendResult<AckOutcome>> {
        let (device, cursor) = (device.clone(), cursor.clone());
        async move { self.ack(&device, &cursor, at_ms).await }.boxed()
    }

    fn record_broadcast(&self, copies: Vec<Cursor>) -> BoxFuture<'_, BackendResult<()>> {
        self.record_broadcast(copies).boxed()
    }

    fn broadcast_copies(&self, id: &Cursor) -> BoxFuture<'_, BackendResult<Option<Vec<Cursor>>>> {
        let id = id.clone();
        async move { self.broadcast_copies(&id).await }.boxed()
    }

    fn group_index(&self, group: &GroupName) -> BoxFuture<'_, BackendResult<Option<GroupIndex>>> {
        let group = group.clone();
        async move { self.group_index(&group).await }.boxed()
    }

    fn announce(&self, messages: Vec<FleetMessage>) -> BoxFuture<'_, BackendResult<()>> {
        self.announce(messages).boxed()
    }

    fn subscribe(&self) -> BoxFuture<'_, BackendResult<BoxStream<'static, Heard>>> {
        self.subscribe().boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_call_names_each_key_once_by_its_position() {
        let mut call = SlotCall::default();
        let indices: Vec<usize> = ["a", "b", "a", "c", "b"]
            .into_iter()
            .map(|key| call.key(key.to_owned()))
            .collect();
        assert_eq!(indices, vec![1, 2, 1, 3, 2]);
        assert_eq!(call.keys, vec!["a", "b", "c"]);
    }
}

//! The fleet store on NATS (docs/fleet.md, "NATS buckets and subject"): three KV buckets named
//! after `nats.stream` and a core NATS subject for the pods' channel. The contract is the module
//! doc of `backend::fleet`.
//!
//! - **Buckets.** `{stream}_devices` (one JSON record per device, max age = retention),
//!   `{stream}_pods` (one entry per instance: its last beat, max age = retention) and
//!   `{stream}_broadcasts` (the copies of a broadcast, max age = `nats.retention`); `{stream}_groups`
//!   (per group, since when it is indexed and the shards where its members were seen, max age =
//!   `groups::seen_window`). Created or
//!   updated at start-up, and created again when a failed request finds one gone. A key is read from
//!   the bucket's stream leader (`STREAM.MSG.GET`), never by direct get, which a replica that
//!   has not applied the last write may answer: a pod reads back what it or any other pod
//!   just wrote (the clock probe, compare-and-set, the API). Listings read through an ephemeral
//!   consumer, which the server may place on a replica: a page can miss what was written a
//!   moment before (docs/fleet.md, "Known limits").
//! - **Keys.** KV keys take neither `:` nor a `.` at either end, which device ids may hold: a
//!   device's key escapes `.` as `=2E` and `:` as `=3A` (`=` is no device id character).
//! - **Clock.** nats-server 2.9 has no per-key TTL, so liveness compares an instance's last beat
//!   (the server's timestamp of its entry) with the server's time now, which this store
//!   estimates as its own clock plus the offset measured at its last beat (a put read back).
//! - **Compare and set.** Every change of a device record reads the entry and writes it back
//!   with the revision it read (`Nats-Expected-Last-Subject-Sequence`), retrying on a conflict:
//!   acks only move forward, and a late `Offline` of a replaced session changes nothing.
//! - **Channel.** `{subject_prefix}.fleet.pods`: two tokens after the prefix, so the event
//!   stream's filter `{subject_prefix}.*` does not capture it.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use async_nats::jetstream::{
    self,
    consumer::{pull, AckPolicy, DeliverPolicy},
    kv::{self, UpdateErrorKind},
    message::StreamMessage,
    stream::LastRawMessageError,
};
use bytes::Bytes;
use futures_util::{future::BoxFuture, stream::BoxStream, FutureExt, StreamExt};
use serde::{Deserialize, Serialize};

use super::{found, is_not_found, unavailable, Inner, RecreateWait, RECREATE_AFTER};
use crate::{
    backend::{
        fleet::{
            ack_moves,
            groups::{seen_window, GroupIndex, GroupMarks},
            last_seen_ms, refreshes, replaces, AckOutcome, DeviceFilter, DevicePage, DeviceRecord,
            FleetMessage, FleetSettings, FleetStore, Heard, PresenceWrite, Session,
        },
        BackendError, BackendResult,
    },
    model::{unix_ms, Cursor, DeviceId, GroupName},
};

/// Tries of one compare-and-set before the change fails (each loses only to another writer of
/// the same device, which then made progress).
const CAS_TRIES: usize = 16;
/// Messages per fetch of a listing's consumer.
const FETCH_MAX: usize = 1000;
/// At most one look for missing buckets after failures per this (and each no longer).
const BUCKET_CHECK_EVERY: Duration = Duration::from_secs(1);
/// A listing consumer whose deletion failed is removed by the server after this.
const LIST_CONSUMER_IDLE: Duration = Duration::from_secs(10);
/// Longest listing read.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// What a look for a bucket's stream found.
enum Lookup<'a> {
    Found,
    Missing(&'a jetstream::stream::Config),
    Unknown,
}

/// A device's record as stored (JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Stored {
    session: Session,
    ended_ms: Option<u64>,
    last_sent: Option<String>,
    acked: Option<String>,
    acked_ms: Option<u64>,
}

/// A group's index as stored (JSON), times by the server's clock (ms): since when it is kept, and
/// per shard the last mark of a member there.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredGroup {
    since_ms: u64,
    marks: BTreeMap<u32, u64>,
}

/// An instance's beat as stored (JSON); when is the entry's timestamp.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Beat {
    pod: String,
    stopping: bool,
}

pub struct NatsFleet {
    client: async_nats::Client,
    /// How many times the client has connected or dropped a slow subscriber's messages: a
    /// change is a gap in the channel.
    interruptions: tokio::sync::watch::Receiver<u64>,
    jetstream: jetstream::Context,
    devices: kv::Store,
    pods: kv::Store,
    broadcasts: kv::Store,
    groups: kv::Store,
    marks: GroupMarks,
    devices_stream: String,
    pods_stream: String,
    /// The buckets' streams as created at start-up, to create again when they are gone.
    bucket_streams: Vec<jetstream::stream::Config>,
    /// Since when a bucket's stream has been found gone.
    missing_since: RecreateWait,
    /// When the buckets were last looked for after a failure.
    last_bucket_check: Mutex<Option<Instant>>,
    subject: String,
    settings: FleetSettings,
    /// The server's clock minus ours (ms), as measured at the last beat.
    offset_ms: AtomicI64,
    /// Waves of requests so far (requests sent together and awaited together count once).
    round_trips: AtomicU64,
}

/// The key of `device` in the devices bucket.
fn device_key(device: &str) -> String {
    device.replace('.', "=2E").replace(':', "=3A")
}

fn device_of_key(key: &str) -> Option<DeviceId> {
    DeviceId::parse(&key.replace("=3A", ":").replace("=2E", ".")).ok()
}

/// Unix ms of a server timestamp in ns.
fn ms_of(nanos: i128) -> i64 {
    (nanos / 1_000_000) as i64
}

fn bad(what: &str) -> BackendError {
    BackendError::rejected(format!("nats: unexpected {what} in the fleet store"))
}

/// The stream of KV bucket `{stream}_{name}` as async-nats would create it, made by the hub:
/// async-nats' `create_key_value` first asks for the account's info, whose answer from
/// nats-server 2.9 it cannot read.
pub(super) fn bucket_stream(
    inner: &Inner,
    name: &str,
    description: &str,
    max_age: Duration,
) -> jetstream::stream::Config {
    let stream = &inner.layout.stream;
    jetstream::stream::Config {
        name: format!("KV_{stream}_{name}"),
        description: Some(description.to_owned()),
        subjects: vec![format!("$KV.{stream}_{name}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage: jetstream::stream::StorageType::File,
        num_replicas: inner.settings.nats.replicas,
        allow_rollup: true,
        deny_delete: true,
        // Left as earlier versions made it: turning it off would cut off their pods' reads
        // during a rolling upgrade. This store never reads by direct get (`Leader`).
        allow_direct: true,
        discard: jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    }
}

/// A bucket's entry as its stream leader answers it (`STREAM.MSG.GET`, whatever the bucket's
/// `allow_direct`; async-nats' `Store::entry` would use a direct get where it is allowed).
struct Leader {
    value: Bytes,
    revision: u64,
    /// The server's timestamp of the entry (ms).
    created_ms: i64,
    /// A value, not a delete or purge marker.
    put: bool,
}

impl Leader {
    /// The latest entry of `key`, `None` if it has none.
    async fn last(bucket: &kv::Store, key: &str) -> Result<Option<Leader>, LastRawMessageError> {
        let subject = format!("{}{key}", bucket.prefix);
        let last = found(
            bucket
                .stream
                .get_last_raw_message_by_subject(&subject)
                .await,
        )?;
        Ok(last.map(Leader::of))
    }

    /// The entry of `key` at `revision`, `None` if that revision is gone or of another key.
    async fn at(
        bucket: &kv::Store,
        key: &str,
        revision: u64,
    ) -> Result<Option<Leader>, LastRawMessageError> {
        let subject = format!("{}{key}", bucket.prefix);
        let entry = found(bucket.stream.get_raw_message(revision).await)?;
        Ok(entry
            .filter(|message| message.subject.as_str() == subject)
            .map(Leader::of))
    }

    fn of(message: StreamMessage) -> Leader {
        let marker = |name: &str| message.headers.get(name).is_some();
        Leader {
            put: !marker("KV-Operation") && !marker("Nats-Marker-Reason"),
            revision: message.sequence,
            created_ms: ms_of(message.time.unix_timestamp_nanos()),
            value: message.payload,
        }
    }
}

impl NatsFleet {
    pub(super) async fn new(inner: &Inner, settings: FleetSettings) -> BackendResult<Self> {
        let stream = &inner.layout.stream;
        let bucket = |name: &str, description: &str, max_age| {
            bucket_stream(inner, name, description, max_age)
        };
        let open = |config: jetstream::stream::Config| {
            let jetstream = inner.jetstream.clone();
            async move {
                let name = config.name.clone();
                jetstream
                    .create_or_update_stream(config)
                    .await
                    .map_err(|error| unavailable(&format!("bucket stream {name}"), error))?;
                let bucket = name.trim_start_matches("KV_").to_owned();
                jetstream
                    .get_key_value(&bucket)
                    .await
                    .map_err(|error| unavailable(&format!("bucket {bucket}"), error))
            }
        };
        let bucket_streams = vec![
            bucket(
                "devices",
                "posthorn fleet: device records",
                settings.retention,
            ),
            bucket(
                "pods",
                "posthorn fleet: beats of pod instances",
                settings.retention,
            ),
            // A broadcast trimmed from the event stream cannot be asked about.
            bucket(
                "broadcasts",
                "posthorn fleet: broadcast copies",
                settings.broadcast_retention,
            ),
            bucket(
                "groups",
                "posthorn fleet: where the members of groups were seen",
                seen_window(settings.retention, settings.broadcast_retention),
            ),
        ];
        let devices = open(bucket_streams[0].clone()).await?;
        let pods = open(bucket_streams[1].clone()).await?;
        let broadcasts = open(bucket_streams[2].clone()).await?;
        let groups = open(bucket_streams[3].clone()).await?;
        let fleet = Self {
            client: inner.client.clone(),
            interruptions: inner.interruptions.clone(),
            jetstream: inner.jetstream.clone(),
            devices,
            pods,
            broadcasts,
            groups,
            marks: GroupMarks::new(settings.shards, settings.retention),
            devices_stream: format!("KV_{stream}_devices"),
            pods_stream: format!("KV_{stream}_pods"),
            bucket_streams,
            missing_since: RecreateWait::default(),
            last_bucket_check: Mutex::new(None),
            subject: format!("{}.fleet.pods", inner.layout.prefix),
            settings,
            offset_ms: AtomicI64::new(0),
            round_trips: AtomicU64::new(0),
        };
        fleet.measure_clock().await?;
        Ok(fleet)
    }

    /// After a failed request: a bucket's stream may be gone (a nats-server that restarted
    /// without its store directory, a bucket deleted by hand), and then every later request
    /// would fail too. The missing ones are created again, [`RECREATE_AFTER`] after they were
    /// first found gone, as the event stream is (nats-server 2.9 removes a deleted stream's
    /// files in the background). Their records are lost; the pods write those of their open
    /// streams again when their channel comes back (`actors::fleet`). At most one look per
    /// [`BUCKET_CHECK_EVERY`], its lookups together and no longer than that: a failing store is
    /// not asked more, and a failure is not answered much later for it.
    async fn restore_buckets(&self) {
        // Away from the server (an outage) nothing can be found out, only waited for.
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return;
        }
        {
            let mut last = self
                .last_bucket_check
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if last.is_some_and(|at| at.elapsed() < BUCKET_CHECK_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let lookups = self.bucket_streams.iter().map(|config| async move {
            let found =
                tokio::time::timeout(BUCKET_CHECK_EVERY, self.jetstream.get_stream(&config.name))
                    .await;
            match found {
                Ok(Ok(_)) => Lookup::Found,
                Ok(Err(error)) if is_not_found(&error) => Lookup::Missing(config),
                // The server cannot tell now.
                _ => Lookup::Unknown,
            }
        });
        let lookups = futures_util::future::join_all(lookups).await;
        let missing: Vec<&jetstream::stream::Config> = lookups
            .iter()
            .filter_map(|lookup| match lookup {
                Lookup::Missing(config) => Some(*config),
                _ => None,
            })
            .collect();
        let all_found = lookups.iter().all(|lookup| matches!(lookup, Lookup::Found));
        if missing.is_empty() {
            // Only an answer for every bucket ends a wait: a slow server must not restart it.
            if all_found {
                self.missing_since.clear();
            }
            return;
        }
        let due = self.missing_since.due(|| {
            log::warn!(
                "nats: fleet bucket streams gone ({}): their records are lost; creating them \
                 again in {}s",
                missing
                    .iter()
                    .map(|config| config.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                RECREATE_AFTER.as_secs()
            )
        });
        if !due {
            return;
        }
        let mut created = 0;
        for config in &missing {
            match self
                .jetstream
                .create_or_update_stream((*config).clone())
                .await
            {
                Ok(_) => {
                    created += 1;
                    log::info!("nats: fleet bucket stream {} created again", config.name);
                }
                Err(error) => log::warn!(
                    "nats: cannot create fleet bucket stream {} again: {error}",
                    config.name
                ),
            }
        }
        if created == missing.len() {
            self.missing_since.clear();
        }
    }

    /// `result`, after [`NatsFleet::restore_buckets`] if it is a failure.
    async fn restoring<T>(&self, result: BackendResult<T>) -> BackendResult<T> {
        if result.is_err() {
            self.restore_buckets().await;
        }
        result
    }

    /// Waves of requests so far: a batch of presence writes is two (reads, then writes).
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    fn trip(&self) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
    }

    /// The server's time now (ms), from our clock and the measured offset.
    fn server_now(&self) -> i64 {
        unix_ms() as i64 + self.offset_ms.load(Ordering::Relaxed)
    }

    /// Puts the clock probe and reads it back: its timestamp is the server's time.
    async fn measure_clock(&self) -> BackendResult<()> {
        self.stamp("clock", Bytes::from_static(b"{}"))
            .await
            .map(|_| ())
    }

    /// Puts `value` under `key` of the pods bucket, reads back the server's timestamp, updates
    /// the offset and returns the timestamp (ms).
    async fn stamp(&self, key: &str, value: Bytes) -> BackendResult<i64> {
        let before = unix_ms() as i64;
        self.trip();
        let revision = self
            .pods
            .put(key, value)
            .await
            .map_err(|error| unavailable("beat", error))?;
        self.trip();
        let entry = Leader::at(&self.pods, key, revision)
            .await
            .map_err(|error| unavailable("beat", error))?
            .ok_or_else(|| bad("missing beat"))?;
        let after = unix_ms() as i64;
        let stamped = entry.created_ms;
        self.offset_ms
            .store(stamped - (before + after) / 2, Ordering::Relaxed);
        Ok(stamped)
    }

    /// The device's stored record and its revision (`None`: none, or deleted).
    async fn read(&self, key: &str) -> BackendResult<(Option<Stored>, Option<u64>)> {
        let entry = Leader::last(&self.devices, key)
            .await
            .map_err(|error| unavailable("device read", error))?;
        Ok(match entry {
            Some(entry) if entry.put => (
                serde_json::from_slice(&entry.value).ok(),
                Some(entry.revision),
            ),
            Some(entry) => (None, Some(entry.revision)),
            None => (None, None),
        })
    }

    /// Applies `change` to the device's record with compare-and-set; `change` answers the new
    /// record (or `None`: nothing to write) and a value handed back to the caller.
    async fn modify<T>(
        &self,
        key: &str,
        change: impl Fn(Option<Stored>) -> (Option<Stored>, T),
    ) -> BackendResult<T> {
        for _ in 0..CAS_TRIES {
            let (stored, revision) = self.read(key).await?;
            let (new, answer) = change(stored);
            let Some(new) = new else {
                return Ok(answer);
            };
            let value = Bytes::from(
                serde_json::to_vec(&new).map_err(|error| unavailable("device record", error))?,
            );
            let written = match revision {
                Some(revision) => self.devices.update(key, value, revision).await,
                None => self
                    .devices
                    .create(key, value)
                    .await
                    .map_err(|error| match error.kind() {
                        kv::CreateErrorKind::AlreadyExists => {
                            kv::UpdateError::new(UpdateErrorKind::WrongLastRevision)
                        }
                        _ => kv::UpdateError::with_source(UpdateErrorKind::Other, error),
                    }),
            };
            match written {
                Ok(_) => return Ok(answer),
                // Another writer came first: read again.
                Err(error) if error.kind() == UpdateErrorKind::WrongLastRevision => continue,
                Err(error) => return Err(unavailable("device write", error)),
            }
        }
        Err(BackendError::unavailable(format!(
            "nats: device record {key} kept changing under {CAS_TRIES} tries"
        )))
    }

    async fn write(&self, changes: Vec<PresenceWrite>) -> BackendResult<()> {
        let now = unix_ms();
        let due = self.marks.due(&changes, now);
        let (marked, written) =
            futures_util::join!(self.mark_groups(&due), self.write_records(changes));
        // Only now: the marks of a write that failed or was dropped are owed again (the batch
        // is retried whole).
        marked.and(written)?;
        self.marks.written(&due, now);
        Ok(())
    }

    async fn write_records(&self, changes: Vec<PresenceWrite>) -> BackendResult<()> {
        // Per device, its changes in order; devices in parallel (one wave of reads, one of
        // writes, plus one per conflict).
        let mut per_device: BTreeMap<DeviceId, Vec<PresenceWrite>> = BTreeMap::new();
        for change in changes {
            let device = match &change {
                PresenceWrite::Online(session) | PresenceWrite::Refresh(session) => {
                    session.device.clone()
                }
                PresenceWrite::Offline { session, .. } | PresenceWrite::Sent { session, .. } => {
                    session.device.clone()
                }
            };
            per_device.entry(device).or_default().push(change);
        }
        if per_device.is_empty() {
            return Ok(());
        }
        self.trip();
        self.trip();
        let writes = per_device.into_iter().map(|(device, changes)| async move {
            let key = device_key(device.as_str());
            self.modify(&key, |stored| {
                let mut record = stored;
                let mut changed = false;
                for change in &changes {
                    changed |= apply(&mut record, change);
                }
                (if changed { record } else { None }, ())
            })
            .await
        });
        for result in futures_util::future::join_all(writes).await {
            result?;
        }
        Ok(())
    }

    /// Marks groups seen in shards, one compare-and-set per group, together; a group's entry
    /// begins with its first mark (`since_ms`), and its marks older than the window go.
    async fn mark_groups(&self, due: &BTreeMap<GroupName, Vec<u32>>) -> BackendResult<()> {
        if due.is_empty() {
            return Ok(());
        }
        self.trip();
        let window = seen_window(self.settings.retention, self.settings.broadcast_retention);
        let marks = due.iter().map(|(group, shards)| async move {
            let key = device_key(group.as_str());
            for _ in 0..CAS_TRIES {
                let now = self.server_now().max(0) as u64;
                let entry = Leader::last(&self.groups, &key)
                    .await
                    .map_err(|error| unavailable("group index read", error))?;
                let (stored, revision) = match entry {
                    Some(entry) => (
                        serde_json::from_slice::<StoredGroup>(&entry.value)
                            .ok()
                            .filter(|_| entry.put),
                        Some(entry.revision),
                    ),
                    None => (None, None),
                };
                let mut index = stored.unwrap_or(StoredGroup {
                    since_ms: now,
                    marks: BTreeMap::new(),
                });
                for &shard in shards {
                    index.marks.insert(shard, now);
                }
                let unseen = now.saturating_sub(window.as_millis() as u64);
                index.marks.retain(|_, marked| *marked >= unseen);
                let value = Bytes::from(
                    serde_json::to_vec(&index)
                        .map_err(|error| unavailable("group index", error))?,
                );
                let written = match revision {
                    Some(revision) => self.groups.update(&key, value, revision).await,
                    None => {
                        self.groups.create(&key, value).await.map(|_| 0).map_err(
                            |error| match error.kind() {
                                kv::CreateErrorKind::AlreadyExists => {
                                    kv::UpdateError::new(UpdateErrorKind::WrongLastRevision)
                                }
                                _ => kv::UpdateError::with_source(UpdateErrorKind::Other, error),
                            },
                        )
                    }
                };
                match written {
                    Ok(_) => return Ok(()),
                    Err(error) if error.kind() == UpdateErrorKind::WrongLastRevision => continue,
                    Err(error) => return Err(unavailable("group index write", error)),
                }
            }
            Err(BackendError::unavailable(format!(
                "nats: group index {key} kept changing under {CAS_TRIES} tries"
            )))
        });
        futures_util::future::join_all(marks)
            .await
            .into_iter()
            .collect()
    }

    async fn group_index(&self, group: &GroupName) -> BackendResult<Option<GroupIndex>> {
        let entry = Leader::last(&self.groups, &device_key(group.as_str()))
            .await
            .map_err(|error| unavailable("group index read", error))?
            .filter(|entry| entry.put);
        let Some(entry) = entry else {
            return Ok(None);
        };
        let stored: StoredGroup =
            serde_json::from_slice(&entry.value).map_err(|_| bad("group index"))?;
        let now_ms = self.server_now().max(0) as u64;
        Ok(Some(GroupIndex {
            since_ms: stored.since_ms,
            marks: stored.marks.into_iter().collect(),
            now_ms,
        }))
    }

    async fn beat(&self, pod: &str, instance: &str, stopping: bool) -> BackendResult<()> {
        let value = serde_json::to_vec(&Beat {
            pod: pod.to_owned(),
            stopping,
        })
        .map_err(|error| unavailable("beat", error))?;
        self.stamp(instance, Bytes::from(value)).await.map(|_| ())
    }

    /// An instance's last beat (server ms) and whether it said it stops.
    async fn beat_of(&self, instance: &str) -> BackendResult<Option<(i64, bool)>> {
        if instance.is_empty() {
            return Ok(None);
        }
        let entry = Leader::last(&self.pods, instance)
            .await
            .map_err(|error| unavailable("beat read", error))?;
        Ok(entry.filter(|entry| entry.put).and_then(|entry| {
            let beat: Beat = serde_json::from_slice(&entry.value).ok()?;
            Some((entry.created_ms, beat.stopping))
        }))
    }

    async fn device(&self, device: &DeviceId) -> BackendResult<Option<DeviceRecord>> {
        let (stored, _) = self.read(&device_key(device.as_str())).await?;
        let Some(stored) = stored else {
            return Ok(None);
        };
        let beat = self.beat_of(&stored.session.instance).await?;
        Ok(Some(self.record(device, stored, beat)))
    }

    fn record(&self, device: &DeviceId, stored: Stored, beat: Option<(i64, bool)>) -> DeviceRecord {
        let now = self.server_now();
        let alive = beat.is_some_and(|(at, stopping)| {
            !stopping && now - at < self.settings.ttl.as_millis() as i64
        });
        let online = stored.ended_ms.is_none() && alive;
        let last_seen_ms = last_seen_ms(
            stored.ended_ms,
            online,
            now.max(0) as u64,
            beat.map(|(at, _)| at.max(0) as u64),
            stored.session.connected_ms,
        );
        let cursor = |text: &Option<String>| text.as_deref().and_then(|t| Cursor::parse(t).ok());
        DeviceRecord {
            device: device.clone(),
            online,
            pod: stored.session.pod.clone(),
            instance: stored.session.instance.clone(),
            session: stored.session.session,
            connected_ms: stored.session.connected_ms,
            last_seen_ms,
            remote: stored.session.remote.clone(),
            user_agent: stored.session.user_agent.clone(),
            groups: stored.session.groups.clone(),
            last_sent: cursor(&stored.last_sent),
            acked: cursor(&stored.acked),
            acked_ms: stored.acked_ms,
        }
    }

    /// The latest value of every key of a bucket's stream (subject `$KV.{bucket}.{key}`) and
    /// its timestamp, read through one ephemeral pull consumer.
    async fn read_all(&self, stream: &str) -> BackendResult<Vec<(String, Bytes, i64)>> {
        self.trip();
        let consumer = self
            .jetstream
            .create_consumer_on_stream(
                pull::Config {
                    deliver_policy: DeliverPolicy::LastPerSubject,
                    // Required with last-per-subject: every key of the bucket.
                    filter_subject: format!("$KV.{}.>", stream.trim_start_matches("KV_")),
                    ack_policy: AckPolicy::None,
                    memory_storage: true,
                    inactive_threshold: LIST_CONSUMER_IDLE,
                    ..Default::default()
                },
                stream,
            )
            .await
            .map_err(|error| unavailable("create a listing consumer", error))?;
        let info = consumer.cached_info();
        let name = info.name.clone();
        let mut pending = info.num_pending;
        let mut entries = Vec::with_capacity(pending as usize);
        let fetched = async {
            while pending > 0 {
                let want = pending.min(FETCH_MAX as u64) as usize;
                let mut batch = consumer
                    .fetch()
                    .max_messages(want)
                    .messages()
                    .await
                    .map_err(|error| unavailable("fetch", error))?;
                let mut got = 0;
                while let Some(message) = batch.next().await {
                    let message = message.map_err(|error| unavailable("fetch", error))?;
                    got += 1;
                    let deleted = message
                        .headers
                        .as_ref()
                        .is_some_and(|headers| headers.get("KV-Operation").is_some());
                    let published = message
                        .info()
                        .map_err(|error| unavailable("message info", error))?
                        .published;
                    // `$KV.{bucket}.{key}`: the key is everything after the second dot.
                    let key = message.subject.splitn(3, '.').nth(2).map(str::to_owned);
                    if let (Some(key), false) = (key, deleted) {
                        entries.push((
                            key,
                            message.payload.clone(),
                            ms_of(published.unix_timestamp_nanos()),
                        ));
                    }
                }
                if got == 0 {
                    // Max age removed what was pending when the consumer was created.
                    break;
                }
                pending = pending.saturating_sub(got);
            }
            Ok::<_, BackendError>(())
        };
        let outcome = tokio::time::timeout(LIST_TIMEOUT, fetched).await;
        if let Err(error) = self
            .jetstream
            .delete_consumer_from_stream(&name, stream)
            .await
        {
            log::debug!("nats: listing consumer {name} is left to expire: {error}");
        }
        match outcome {
            Ok(Ok(())) => Ok(entries),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(BackendError::unavailable(
                "nats: a fleet listing did not complete in time",
            )),
        }
    }

    async fn list(
        &self,
        filter: &DeviceFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> BackendResult<DevicePage> {
        let limit = limit.max(1);
        let after = cursor.and_then(|cursor| DeviceId::parse(cursor).ok());
        // Every record, then every beat: a page costs a read of the whole bucket (docs/fleet.md).
        let (records, beats) = futures_util::future::try_join(
            self.read_all(&self.devices_stream),
            self.read_all(&self.pods_stream),
        )
        .await?;
        let beats: std::collections::HashMap<String, (i64, bool)> = beats
            .into_iter()
            .filter_map(|(instance, value, at)| {
                let beat: Beat = serde_json::from_slice(&value).ok()?;
                Some((instance, (at, beat.stopping)))
            })
            .collect();
        let mut devices: BTreeMap<DeviceId, Stored> = records
            .into_iter()
            .filter_map(|(key, value, _)| {
                Some((device_of_key(&key)?, serde_json::from_slice(&value).ok()?))
            })
            .collect();
        if let Some(after) = &after {
            devices = devices.split_off(after);
            devices.remove(after);
        }
        let more = devices.len() > limit;
        let mut page = Vec::new();
        let mut last = None;
        for (device, stored) in devices.into_iter().take(limit) {
            let beat = beats.get(&stored.session.instance).copied();
            let record = self.record(&device, stored, beat);
            if filter.admits(&record) {
                page.push(record);
            }
            last = Some(device);
        }
        Ok(DevicePage {
            devices: page,
            next: last.filter(|_| more).map(|device| device.to_string()),
        })
    }

    async fn ack(
        &self,
        device: &DeviceId,
        cursor: &Cursor,
        at_ms: u64,
    ) -> BackendResult<AckOutcome> {
        let text = cursor.to_string();
        self.modify(&device_key(device.as_str()), |stored| {
            let mut stored = stored.unwrap_or_else(|| Stored {
                session: Session::unknown(device),
                ended_ms: Some(at_ms),
                last_sent: None,
                acked: None,
                acked_ms: None,
            });
            let current = stored.acked.as_deref().and_then(|t| Cursor::parse(t).ok());
            if !ack_moves(current.as_ref(), cursor) {
                return (None, AckOutcome::Stale);
            }
            stored.acked = Some(text.clone());
            stored.acked_ms = Some(at_ms);
            (Some(stored), AckOutcome::Moved)
        })
        .await
    }

    async fn record_broadcast(&self, copies: Vec<Cursor>) -> BackendResult<()> {
        let Some(id) = copies.first() else {
            return Ok(());
        };
        let text = copies
            .iter()
            .map(Cursor::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        self.broadcasts
            .put(id.to_string(), Bytes::from(text))
            .await
            .map(|_| ())
            .map_err(|error| unavailable("broadcast copies", error))
    }

    async fn broadcast_copies(&self, id: &Cursor) -> BackendResult<Option<Vec<Cursor>>> {
        let Some(value) = Leader::last(&self.broadcasts, &id.to_string())
            .await
            .map_err(|error| unavailable("broadcast copies", error))?
            .filter(|entry| entry.put)
            .map(|entry| entry.value)
        else {
            return Ok(None);
        };
        let text = std::str::from_utf8(&value).map_err(|_| bad("broadcast copies"))?;
        text.split(' ')
            .map(|copy| Cursor::parse(copy).map_err(|_| bad("broadcast copy")))
            .collect::<BackendResult<Vec<_>>>()
            .map(Some)
    }

    /// One JSON array per publish, as many publishes as the server's `max_payload` needs: a
    /// connect storm's flush (each session with its user agent and groups) can outgrow one
    /// message, which the client would refuse whole.
    async fn announce(&self, messages: Vec<FleetMessage>) -> BackendResult<()> {
        let limit = self.client.server_info().max_payload.max(1024);
        for payload in json_arrays(&messages, limit)? {
            self.client
                .publish(self.subject.clone(), Bytes::from(payload))
                .await
                .map_err(|error| unavailable("fleet channel", error))?;
        }
        Ok(())
    }

    /// A core subscription: the client subscribes again by itself after a reconnection, which
    /// the stream reports as a gap, as it does when the client dropped messages of a subscriber
    /// that fell behind.
    async fn subscribe(&self) -> BackendResult<BoxStream<'static, Heard>> {
        // Taken before the SUB: an interruption from here on is a gap (at worst one too many).
        let mut interruptions = self.interruptions.clone();
        interruptions.borrow_and_update();
        let subscriber = self
            .client
            .subscribe(self.subject.clone())
            .await
            .map_err(|error| unavailable("fleet channel", error))?;
        // The server handles a connection's messages in order: once it answered a request sent
        // after the SUB, it has the interest, and whatever any pod announces from now on
        // reaches it. (`flush` only empties the client's buffer.) After a reconnection the
        // client sends the SUB before anything else, so what the subscriber asks after hearing
        // of the gap is answered with the interest in place too.
        self.trip();
        Leader::last(&self.pods, "clock")
            .await
            .map_err(|error| unavailable("fleet channel", error))?;
        let stream = futures_util::stream::unfold(
            (subscriber, interruptions),
            |(mut subscriber, mut interruptions)| async move {
                loop {
                    let heard: Vec<Heard> = tokio::select! {
                        Ok(()) = interruptions.changed() => {
                            interruptions.borrow_and_update();
                            vec![Heard::Gap]
                        }
                        message = subscriber.next() => {
                            match serde_json::from_slice::<Vec<FleetMessage>>(&message?.payload) {
                                Ok(batch) => batch.into_iter().map(Heard::Message).collect(),
                                Err(error) => {
                                    log::warn!(
                                        "nats: a fleet channel message that is not ours: {error}"
                                    );
                                    continue;
                                }
                            }
                        }
                    };
                    return Some((heard, (subscriber, interruptions)));
                }
            },
        );
        Ok(stream.flat_map(futures_util::stream::iter).boxed())
    }
}

/// Applies one change to a device's record; answers whether it changed it.
fn apply(record: &mut Option<Stored>, change: &PresenceWrite) -> bool {
    let same = |stored: &Stored, instance: &str, session: u64| {
        stored.session.instance == instance && stored.session.session == session
    };
    match change {
        PresenceWrite::Online(session) | PresenceWrite::Refresh(session) => {
            if let Some(stored) = record.as_ref() {
                let open = stored.ended_ms.is_none();
                let writes = match change {
                    PresenceWrite::Refresh(_) => refreshes(session, &stored.session, open),
                    _ => replaces(session, &stored.session, open),
                };
                if !writes {
                    return false;
                }
                // The same session again is a refresh: written as it is (a KV record's age
                // counts from its last write).
                if stored.session.is(session) {
                    return true;
                }
            }
            // The ack and the last position outlive the session they were written in.
            let (acked, acked_ms, last_sent) = record
                .as_ref()
                .map(|stored| {
                    (
                        stored.acked.clone(),
                        stored.acked_ms,
                        stored.last_sent.clone(),
                    )
                })
                .unwrap_or_default();
            *record = Some(Stored {
                session: session.clone(),
                ended_ms: None,
                last_sent,
                acked,
                acked_ms,
            });
            true
        }
        PresenceWrite::Offline {
            session,
            at_ms,
            last_sent,
        } => match record {
            Some(stored) if same(stored, &session.instance, session.session) => {
                stored.ended_ms = Some(*at_ms);
                if let Some(last_sent) = last_sent {
                    stored.last_sent = Some(last_sent.to_string());
                }
                true
            }
            _ => false,
        },
        PresenceWrite::Sent { session, last_sent } => match record {
            Some(stored)
                if same(stored, &session.instance, session.session)
                    && stored.ended_ms.is_none() =>
            {
                stored.last_sent = Some(last_sent.to_string());
                true
            }
            _ => false,
        },
    }
}

/// `items` as JSON arrays of at most `limit` bytes each (an item larger than that alone in its
/// array), in order; none for no item.
fn json_arrays<T: Serialize>(items: &[T], limit: usize) -> BackendResult<Vec<Vec<u8>>> {
    let mut arrays = Vec::new();
    let mut array = Vec::new();
    for item in items {
        let text = serde_json::to_vec(item)
            .map_err(|error| BackendError::rejected(format!("fleet message: {error}")))?;
        // The comma before the item and the closing bracket after it.
        if !array.is_empty() && array.len() + text.len() + 2 > limit {
            array.push(b']');
            arrays.push(std::mem::take(&mut array));
        }
        array.push(if array.is_empty() { b'[' } else { b',' });
        array.extend_from_slice(&text);
    }
    if !array.is_empty() {
        array.push(b']');
        arrays.push(array);
    }
    Ok(arrays)
}

impl FleetStore for NatsFleet {
    fn write(&self, changes: Vec<PresenceWrite>) -> BoxFuture<'_, BackendResult<()>> {
        async move { self.restoring(self.write(changes).await).await }.boxed()
    }

    fn beat(&self, pod: &str, instance: &str, stopping: bool) -> BoxFuture<'_, BackendResult<()>> {
        let (pod, instance) = (pod.to_owned(), instance.to_owned());
        async move {
            self.restoring(self.beat(&pod, &instance, stopping).await)
                .await
        }
        .boxed()
    }

    fn device(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Option<DeviceRecord>>> {
        let device = device.clone();
        async move { self.restoring(self.device(&device).await).await }.boxed()
    }

    fn list(
        &self,
        filter: &DeviceFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> BoxFuture<'_, BackendResult<DevicePage>> {
        let (filter, cursor) = (filter.clone(), cursor.map(str::to_owned));
        async move {
            self.restoring(self.list(&filter, limit, cursor.as_deref()).await)
                .await
        }
        .boxed()
    }

    fn ack(
        &self,
        device: &DeviceId,
        cursor: &Cursor,
        at_ms: u64,
    ) -> BoxFuture<'_, BackendResult<AckOutcome>> {
        let (device, cursor) = (device.clone(), cursor.clone());
        async move {
            self.restoring(self.ack(&device, &cursor, at_ms).await)
                .await
        }
        .boxed()
    }

    fn record_broadcast(&self, copies: Vec<Cursor>) -> BoxFuture<'_, BackendResult<()>> {
        async move { self.restoring(self.record_broadcast(copies).await).await }.boxed()
    }

    fn broadcast_copies(&self, id: &Cursor) -> BoxFuture<'_, BackendResult<Option<Vec<Cursor>>>> {
        let id = id.clone();
        async move { self.restoring(self.broadcast_copies(&id).await).await }.boxed()
    }

    fn group_index(&self, group: &GroupName) -> BoxFuture<'_, BackendResult<Option<GroupIndex>>> {
        let group = group.clone();
        async move { self.restoring(self.group_index(&group).await).await }.boxed()
    }

    fn announce(&self, messages: Vec<FleetMessage>) -> BoxFuture<'_, BackendResult<()>> {
        self.announce(messages).boxed()
    }

    fn subscribe(&self) -> BoxFuture<'_, BackendResult<BoxStream<'static, Heard>>> {
        async move { self.restoring(self.subscribe().await).await }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flush too large for one message goes as several arrays, each within the limit, that
    /// read back to every message in order.
    #[test]
    fn announcements_split_at_the_payload_limit() {
        let items: Vec<String> = (0..100).map(|n| format!("{n:0>40}")).collect();
        assert!(json_arrays(&items[..0], 100).unwrap().is_empty());
        let arrays = json_arrays(&items, 200).unwrap();
        assert!(arrays.len() > 1, "{}", arrays.len());
        let mut read = Vec::new();
        for array in &arrays {
            assert!(array.len() <= 200, "{}", array.len());
            read.extend(serde_json::from_slice::<Vec<String>>(array).unwrap());
        }
        assert_eq!(read, items);
        let alone = json_arrays(&["x".repeat(300)], 200).unwrap();
        assert_eq!(alone.len(), 1, "an item above the limit goes alone");
    }

    /// Every device id has a valid KV key that reads back to it; escaped keys do not collide.
    #[test]
    fn device_keys_round_trip() {
        for id in ["pos-17", "a.b", ".x.", "a:b", "a=2Eb", "store:1.lane_2"] {
            let Ok(device) = DeviceId::parse(id) else {
                continue;
            };
            let key = device_key(id);
            assert!(!key.contains(':') && !key.starts_with('.') && !key.ends_with('.'));
            assert_eq!(device_of_key(&key), Some(device), "{id}");
        }
        assert_ne!(device_key("a.b"), device_key("a:b"));
    }
}

//! The NATS JetStream backend (docs/stream-format.md): one stream (`nats.stream`) over the subjects
//! `{subject_prefix}.{shard}`, read by one StreamTail (one group: all shards).
//!
//! Written for nats-server 2.9 (what Debian and CI ship): one filter subject per consumer, no
//! multi-filter consumers, no batched direct gets.
//!
//! - **Connection** ([`connect`]): the servers of `nats.url`, TLS and at most one kind of
//!   credentials, all from `[nats]`; the files are read and checked before connecting.
//! - **Stream**: created at start-up when missing: subjects `{prefix}.*`, file storage, limits
//!   retention, max age `nats.retention`, duplicate window `publish.dedupe_window`. An existing
//!   stream is adopted, and its max age and duplicate window are set to ours, unless it
//!   conflicts with the format or with resuming (other subjects, a retention policy that deletes
//!   consumed messages, no acks, sealed, a mirror): then start-up stops, naming the difference.
//!   A stream deleted at run time is created again by the next tail check or resume, two
//!   seconds after it was found gone (nats-server removes the old files in the background).
//! - **Positions** are stream sequences (`Position { ms: 0, seq }`, see [`layout`]); the tail
//!   reports message timestamps in `StoredEvent::appended_ms`, for the lag metrics.
//! - **Epoch**: the stream's creation time ([`layout::epoch_of`]), kept in the store, so a
//!   restart with its store directory keeps every cursor valid, and a recreated stream answers
//!   older cursors `resync` `data_lost`. Appends stamp the epoch last seen (at start-up, by the
//!   tail's check every 2 s, by resumes).
//! - **Head** of every shard is the stream's last sequence. All shards share the sequence space,
//!   so "nothing after it" holds for each of them, and a cursor the hub hands out in a `resync`
//!   (the tail continues after the stream's last sequence when it finds a loss) is never above
//!   the head of its shard.
//! - **Trimmed through**: retention removes messages by age from the front of the *stream*, so
//!   for a shard all we know is that every sequence below the stream's first one may be gone:
//!   `trimmed_through = first_seq - 1`, for every shard. This is conservative: a device whose
//!   shard had no message between its cursor and the stream's first sequence gets `expired`
//!   although it missed nothing. When sequences inside the retained range are missing too
//!   (per-subject limits, deleted or purged messages), the shard's own first retained message
//!   bounds it instead (`first retained on the subject - 1`, or the head when none is left).
//!   Not detected: an operator deleting single messages *between* two retained messages of one
//!   subject.
//! - **Append** publishes with headers `Posthorn-Dev`, `Posthorn-Type` and `Nats-Msg-Id` (the
//!   idempotency key scoped to the item's target, [`message::message_id`]), sends a window of
//!   publishes and then awaits their acks. JetStream deduplicates within the duplicate window and
//!   answers a duplicate with the original sequence, which becomes the original cursor (the
//!   original has the same target, so the same shard). Each item is answered on its own: a
//!   publish that failed or was never acknowledged fails its item only.
//! - **Replay** (`read_after`) asks the stream leader for the shard's last entry, creates an
//!   ephemeral pull consumer filtered on the shard's subject from `after + 1` and fetches the
//!   page (at least through that entry: on a cluster the consumer may sit on a replica behind
//!   the leader), then deletes the consumer and reads the stream's epoch: five round trips per
//!   page whatever its size, and the server does the filtering.
//!   Direct gets would cost one round trip per message (batched direct gets need nats-server
//!   2.11). The epoch read after the fetch labels the page: a consumer lives and dies with the
//!   stream it was created on, so a page read from a stream that was re-created before the
//!   consumer was is labelled with the new stream's epoch, and the replay starts over.
//! - **Supersede index** ([`supersede`]): a second stream, `{stream}_SUP`, keeps the newest
//!   position per shard and supersede key; written after a publish ack (newest wins), read by
//!   replays one message get per key. Created at start-up when missing.
//! - **Lives**: a stream's life starts at sequence 0 (everything in a new stream is new).
//! - **Trim**: JetStream applies `max_age` itself, to messages from any producer, so the
//!   periodic trim has nothing to do.

mod connect;
mod fleet;
mod layout;
mod message;
mod revocation;
mod supersede;
mod tail;

use std::{
    cmp::min,
    ops::Range,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use async_nats::{
    connection::State as ConnectionState,
    jetstream::{
        self,
        consumer::{pull, AckPolicy, DeliverPolicy},
        context::{GetStreamErrorKind, PublishErrorKind},
        stream::{
            self, LastRawMessageErrorKind, RetentionPolicy, State as StreamState, StorageType,
        },
    },
    HeaderMap,
};
use bytes::Bytes;
use futures_util::{future::BoxFuture, FutureExt, StreamExt};

pub use connect::{NatsAccess, NatsFileError};
pub use fleet::NatsFleet;
pub use layout::{layout_of, Layout};
pub use revocation::NatsRevocations;

use super::{
    Appended, Backend, BackendError, BackendResult, ItemFailure, ItemOutcome, NewEvent, ReadPage,
    ShardState, StoredEvent, SupersedeKey, Tail,
};
use crate::{
    config::NatsConfig,
    model::{Cursor, Epoch, Position, Target},
};

/// How long start-up waits for the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for a JetStream API request or a publish acknowledgement.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Publishes sent before awaiting their acks: bounds what one append holds in flight.
const PUBLISH_WINDOW: usize = 256;
/// Messages per replay fetch request.
const FETCH_MAX: usize = 1000;
/// How long one pull of a replay waits for a replica to catch up with its leader.
const CATCH_UP_WAIT: Duration = Duration::from_millis(100);
/// A replay consumer whose deletion failed is removed by the server after this.
const REPLAY_CONSUMER_IDLE: Duration = Duration::from_secs(10);
/// How long a stream found gone stays gone before the hub creates it again (see
/// [`RecreateWait`]).
const RECREATE_AFTER: Duration = Duration::from_secs(2);

/// When a stream found gone (the event stream, a fleet bucket's) may be created again.
/// nats-server 2.9 removes a deleted stream's files in the background: a stream of the same
/// name created at once can have its first message blocks removed under it, and then loses
/// acknowledged messages (seen in tests: "error opening msg block file ... 1.blk"). So it is
/// created again only [`RECREATE_AFTER`] after it was first found gone.
#[derive(Debug, Default)]
struct RecreateWait(Mutex<Option<Instant>>);

impl RecreateWait {
    /// Whether what is gone may be created now; `first_seen` runs when it is first found gone.
    fn due(&self, first_seen: impl FnOnce()) -> bool {
        let mut since = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let since = *since.get_or_insert_with(|| {
            first_seen();
            Instant::now()
        });
        since.elapsed() >= RECREATE_AFTER
    }

    /// Created again, or found there after all: a later loss waits its own time.
    fn clear(&self) {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }
}

/// The validated `[nats]` section plus the idempotency window of `[publish]`.
#[derive(Debug, Clone)]
pub struct NatsSettings {
    pub nats: NatsConfig,
    pub dedupe_window: Duration,
}

pub struct NatsBackend {
    inner: Arc<Inner>,
}

struct Inner {
    layout: Layout,
    settings: NatsSettings,
    client: async_nats::Client,
    /// How many times `client` has connected or dropped a slow subscriber's messages (see
    /// [`connect::Connected`]).
    interruptions: tokio::sync::watch::Receiver<u64>,
    jetstream: jetstream::Context,
    /// The stream's epoch as last seen; stamped on the cursors of appends.
    epoch: Mutex<Epoch>,
    /// Since when the stream is known to be gone, until it is created again.
    missing_since: RecreateWait,
}

/// A message read from a stream's leader (`STREAM.MSG.GET`), `None` where the stream has no
/// such message: "not found" is an answer, not a failure.
fn found(
    read: Result<jetstream::message::StreamMessage, stream::LastRawMessageError>,
) -> Result<Option<jetstream::message::StreamMessage>, stream::LastRawMessageError> {
    match read {
        Ok(message) => Ok(Some(message)),
        Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(error) => Err(error),
    }
}

fn unavailable(
    what: &str,
    error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> BackendError {
    BackendError::unavailable_by(format!("nats: {what}"), error)
}

impl NatsBackend {
    /// Connects (with the TLS and credentials of `[nats]`, see [`connect`]) and creates or
    /// adopts the stream; fails when a TLS or credentials file cannot be used, NATS cannot be
    /// reached within [`CONNECT_TIMEOUT`] or refuses the hub, or the existing stream conflicts
    /// with ours.
    pub async fn connect(settings: NatsSettings, access: NatsAccess) -> BackendResult<Self> {
        let connect::Connected {
            client,
            interruptions,
        } = connect::connect(&settings.nats, access).await?;
        let jetstream = jetstream::ContextBuilder::new()
            .timeout(REQUEST_TIMEOUT)
            .build(client.clone());
        let layout = layout_of(&settings.nats);
        let inner = Inner {
            layout,
            settings,
            client,
            interruptions,
            jetstream,
            // Replaced below, before anything reads it.
            epoch: Mutex::new(layout::epoch_of(0)),
            missing_since: RecreateWait::default(),
        };
        let info = inner.adopt_or_create_stream().await?;
        supersede::ensure(&inner.jetstream, &inner.layout, &inner.settings).await?;
        inner.set_epoch(layout::epoch_of(info.created.unix_timestamp_nanos()));
        Ok(Self {
            inner: Arc::new(inner),
        })
    }
}

impl NatsBackend {
    /// The fleet store on the backend's connection: KV buckets named after `nats.stream`,
    /// created or updated here, and the channel subject (docs/fleet.md).
    pub async fn fleet(&self, settings: super::fleet::FleetSettings) -> BackendResult<NatsFleet> {
        NatsFleet::new(&self.inner, settings).await
    }

    /// The revocation store: a KV bucket beside the fleet's.
    pub async fn revocations(&self, retention: Duration) -> BackendResult<NatsRevocations> {
        NatsRevocations::new(&self.inner, retention).await
    }
}

/// The stream posthorn needs (docs/stream-format.md).
fn wanted_stream(layout: &Layout, settings: &NatsSettings) -> stream::Config {
    stream::Config {
        name: layout.stream.clone(),
        subjects: vec![layout.filter()],
        max_age: settings.nats.retention,
        duplicate_window: settings.dedupe_window,
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        num_replicas: settings.nats.replicas,
        description: Some("posthorn events: one subject per shard".into()),
        ..Default::default()
    }
}

/// Why an existing stream cannot carry posthorn's events, if it cannot.
fn conflict(existing: &stream::Config, wanted: &stream::Config) -> Option<String> {
    if existing.subjects != wanted.subjects {
        return Some(format!(
            "it has subjects {:?}, posthorn needs exactly {:?}",
            existing.subjects, wanted.subjects
        ));
    }
    if existing.retention != RetentionPolicy::Limits {
        return Some(format!(
            "its retention policy is {:?}, which deletes messages a consumer has seen; posthorn \
             needs limits retention to resume devices",
            existing.retention
        ));
    }
    if existing.no_ack {
        return Some("it does not acknowledge publishes (no_ack)".into());
    }
    if existing.sealed {
        return Some("it is sealed".into());
    }
    if existing.mirror.is_some() {
        return Some("it is a mirror, which accepts no publishes".into());
    }
    None
}

fn is_not_found(error: &jetstream::context::GetStreamError) -> bool {
    matches!(error.kind(), GetStreamErrorKind::JetStream(e) if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

impl Inner {
    fn epoch(&self) -> Epoch {
        self.epoch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn set_epoch(&self, epoch: Epoch) {
        *self
            .epoch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = epoch;
    }

    /// Start-up: uses the existing stream when it is compatible (aligning its max age and
    /// duplicate window with the configuration), creates it when it is missing.
    async fn adopt_or_create_stream(&self) -> BackendResult<stream::Info> {
        let wanted = wanted_stream(&self.layout, &self.settings);
        match self.jetstream.get_stream(&self.layout.stream).await {
            Ok(mut stream) => {
                let info = stream
                    .info()
                    .await
                    .map_err(|error| unavailable("stream info", error))?
                    .clone();
                if let Some(reason) = conflict(&info.config, &wanted) {
                    return Err(BackendError::rejected(format!(
                        "nats: the existing stream {} cannot be used: {reason}; delete it or \
                         choose another nats.stream",
                        self.layout.stream
                    )));
                }
                // A wanted window of 0 is the server's default there (see `append`).
                if info.config.max_age == wanted.max_age
                    && (info.config.duplicate_window == wanted.duplicate_window
                        || wanted.duplicate_window.is_zero())
                {
                    return Ok(info);
                }
                log::info!(
                    "nats: setting max age {:?} and duplicate window {:?} on stream {}",
                    wanted.max_age,
                    wanted.duplicate_window,
                    self.layout.stream
                );
                let config = stream::Config {
                    max_age: wanted.max_age,
                    duplicate_window: wanted.duplicate_window,
                    ..info.config
                };
                self.jetstream.update_stream(config).await.map_err(|error| {
                    BackendError::rejected(format!(
                        "nats: cannot update stream {}: {error}",
                        self.layout.stream
                    ))
                })
            }
            Err(error) if is_not_found(&error) => self.create_stream(wanted).await,
            Err(error) => Err(unavailable("stream info", error)),
        }
    }

    async fn create_stream(&self, config: stream::Config) -> BackendResult<stream::Info> {
        log::info!(
            "nats: creating stream {} over {}",
            self.layout.stream,
            self.layout.filter()
        );
        let mut stream = self
            .jetstream
            .create_stream(config)
            .await
            .map_err(|error| {
                BackendError::rejected(format!(
                    "nats: cannot create stream {}: {error}",
                    self.layout.stream
                ))
            })?;
        Ok(stream
            .info()
            .await
            .map_err(|error| unavailable("stream info", error))?
            .clone())
    }

    /// The stream's current info, creating the stream when it has been deleted (its data is
    /// gone either way; a new stream is a new epoch). Refreshes the epoch stamped on appends.
    async fn stream_info(&self) -> BackendResult<stream::Info> {
        if self.client.connection_state() != ConnectionState::Connected {
            return Err(BackendError::unavailable("nats: not connected"));
        }
        let info = match self.jetstream.get_stream(&self.layout.stream).await {
            Ok(mut stream) => stream
                .info()
                .await
                .map_err(|error| unavailable("stream info", error))?
                .clone(),
            Err(error) if is_not_found(&error) => {
                self.wait_before_recreating()?;
                let info = self
                    .create_stream(wanted_stream(&self.layout, &self.settings))
                    .await?;
                self.missing_since.clear();
                info
            }
            Err(error) => return Err(unavailable("stream info", error)),
        };
        self.set_epoch(layout::epoch_of(info.created.unix_timestamp_nanos()));
        Ok(info)
    }

    /// A stream found gone is created again only once its [`RecreateWait`] is over; until then
    /// callers see the backend as unavailable.
    fn wait_before_recreating(&self) -> BackendResult<()> {
        let due = self.missing_since.due(|| {
            log::warn!(
                "nats: stream {} is gone: its events are lost; creating it again in {}s",
                self.layout.stream,
                RECREATE_AFTER.as_secs()
            )
        });
        if !due {
            return Err(BackendError::unavailable(format!(
                "nats: stream {} is gone and is created again shortly",
                self.layout.stream
            )));
        }
        Ok(())
    }

    async fn append(&self, events: Vec<NewEvent>) -> BackendResult<Vec<ItemOutcome>> {
        let epoch = self.epoch();
        let shards = self.layout.shards;
        // Each payload is copied once; its copies share it.
        let payloads: Vec<Bytes> = events
            .iter()
            .map(|event| Bytes::from(event.data.clone()))
            .collect();
        // (request index, shard): a broadcast has one copy per shard, a group event one per
        // shard it is given; answered by the copy on the first.
        let mut copies = Vec::with_capacity(events.len());
        let mut items: Vec<ItemTally> = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            let stored_in = event.stored_in(shards);
            copies.extend(stored_in.iter().map(|&shard| (index, shard)));
            items.push(ItemTally {
                copies: stored_in.len(),
                answered_by: stored_in[0],
                ..ItemTally::default()
            });
        }
        let mut window = Vec::with_capacity(PUBLISH_WINDOW);
        let mut silent: Option<String> = None;
        // Stored copies with a supersede name, recorded in the index once acknowledged.
        let mut indexed: Vec<(u32, SupersedeKey, Position)> = Vec::new();
        for chunk in copies.chunks(PUBLISH_WINDOW) {
            if let Some(reason) = &silent {
                // NATS stopped answering: nothing more is sent.
                for &(index, _) in chunk {
                    items[index].fail(ItemFailure::NotAppended(reason.clone()));
                }
                continue;
            }
            for &(index, shard) in chunk {
                let event = &events[index];
                let mut headers = HeaderMap::new();
                match &event.target {
                    Target::Group(group) => headers.insert(message::GROUP_HEADER, group.as_str()),
                    target => headers.insert(message::DEV_HEADER, target.as_field().as_ref()),
                }
                headers.insert(message::TYPE_HEADER, event.event_type.as_str());
                if let Some(expires_ms) = event.expires_ms {
                    headers.insert(message::EXP_HEADER, expires_ms.to_string().as_str());
                }
                if let Some(name) = &event.supersede {
                    headers.insert(message::SUPERSEDE_HEADER, name.as_str());
                }
                // A dedupe window of 0 remembers no key. JetStream cannot be told so (it takes a
                // duplicate window of 0 for its default of 2 min), so the hub sends no message id.
                if let Some(key) = event
                    .key
                    .as_ref()
                    .filter(|_| !self.settings.dedupe_window.is_zero())
                {
                    headers.insert(
                        message::MSG_ID_HEADER,
                        message::message_id(&event.target, shard, key),
                    );
                }
                match self
                    .jetstream
                    .publish_with_headers(
                        self.layout.subject(shard),
                        headers,
                        payloads[index].clone(),
                    )
                    .await
                {
                    Ok(ack) => window.push((index, shard, ack)),
                    Err(error) => items[index].fail(publish_failure(error, false)),
                }
            }
            let mut acked = 0;
            // Awaited together: an ack's timeout starts when it is first polled, so awaiting one
            // after the other would let a silent server hold a request for the window's length
            // times the timeout.
            let acks = futures_util::future::join_all(
                window
                    .drain(..)
                    .map(|(index, shard, ack)| async move { (index, shard, ack.await) }),
            )
            .await;
            for (index, shard, ack) in acks {
                match ack {
                    Ok(ack) => {
                        acked += 1;
                        let item = &mut items[index];
                        item.stored += 1;
                        let cursor =
                            Cursor::new(epoch.clone(), shard, layout::position(ack.sequence));
                        let target = &events[index].target;
                        if target.is_per_shard() {
                            item.copy_cursors.push(cursor.clone());
                        }
                        if let Some(name) =
                            events[index].supersede.as_ref().filter(|_| !ack.duplicate)
                        {
                            indexed.push((
                                shard,
                                SupersedeKey {
                                    target: events[index].target.clone(),
                                    name: name.clone(),
                                },
                                layout::position(ack.sequence),
                            ));
                        }
                        if shard == item.answered_by {
                            item.answer = Some(Appended {
                                cursor,
                                duplicate: ack.duplicate,
                                copies: Vec::new(),
                            });
                        }
                    }
                    Err(error) => {
                        let failure = publish_failure(error, true);
                        if acked == 0 && silent.is_none() {
                            silent = Some(failure.message().to_string());
                        }
                        items[index].fail(failure);
                    }
                }
            }
            if acked > 0 {
                silent = None;
            }
        }
        self.record_newest(&epoch, indexed).await;
        let outcomes: Vec<ItemOutcome> = items.into_iter().map(ItemTally::outcome).collect();
        if outcomes
            .iter()
            .all(|outcome| matches!(outcome, Err(failure) if !matches!(failure, ItemFailure::Incomplete(_))))
        {
            let message = outcomes
                .iter()
                .find_map(|outcome| outcome.as_ref().err())
                .map(|failure| failure.message().to_string())
                .unwrap_or_default();
            return Err(BackendError::unavailable(message));
        }
        Ok(outcomes)
    }

    /// Writes the supersede index for stored copies (concurrently). A failed write is logged and
    /// leaves the item stored: its replays then send older versions too, never lose this one.
    async fn record_newest(&self, epoch: &Epoch, indexed: Vec<(u32, SupersedeKey, Position)>) {
        let writes = indexed.iter().map(|(shard, key, position)| {
            supersede::record(&self.jetstream, &self.layout, *shard, key, epoch, *position)
        });
        for (result, (shard, key, _)) in futures_util::future::join_all(writes)
            .await
            .into_iter()
            .zip(&indexed)
        {
            if let Err(error) = result {
                log::warn!(
                    "nats: the supersede index of {} on shard {shard} was not updated, so \
                     replays send its older versions too: {}",
                    key.field(),
                    crate::report::Report(&error)
                );
            }
        }
    }

    async fn read_after(&self, shard: u32, after: u64, limit: usize) -> BackendResult<ReadPage> {
        // The shard's last entry as the stream leader has it. The consumer may be placed on a
        // replica that has not applied it yet, and a page that ended short of it would end a
        // replay before an entry the tail may already have routed: the client would never get
        // it. So the page reads at least through it.
        let target = self
            .last_of_shard(shard)
            .await?
            .filter(|&last| last > after);
        let consumer = self
            .jetstream
            .create_consumer_on_stream(
                pull::Config {
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: after.saturating_add(1),
                    },
                    ack_policy: AckPolicy::None,
                    filter_subject: self.layout.subject(shard),
                    memory_storage: true,
                    inactive_threshold: REPLAY_CONSUMER_IDLE,
                    ..Default::default()
                },
                &self.layout.stream,
            )
            .await
            .map_err(|error| unavailable("create a replay consumer", error))?;
        let info = consumer.cached_info();
        let name = info.name.clone();
        let mut pending = info.num_pending;
        // Labels the messages until the page's epoch is known (read after the fetch).
        let reading = self.epoch();
        let mut events: Vec<StoredEvent> = Vec::new();
        let mut read = 0;
        let mut last = None;
        // Skipped messages do not count against `limit`: a short page tells the caller that the
        // shard has nothing more, so it must only be short at the end.
        let behind = |last: Option<Position>| {
            target.is_some_and(|target| last.is_none_or(|last| last.seq < target))
        };
        let fetched = async {
            while events.len() < limit && (pending > 0 || behind(last)) {
                let room = min(limit - events.len(), FETCH_MAX);
                let mut batch = if pending > 0 {
                    consumer
                        .fetch()
                        .max_messages(min(room as u64, pending) as usize)
                        .messages()
                        .await
                } else {
                    // Waits for the replica to catch up with the leader.
                    consumer
                        .batch()
                        .max_messages(room)
                        .expires(CATCH_UP_WAIT)
                        .messages()
                        .await
                }
                .map_err(|error| unavailable("fetch", error))?;
                let mut got = 0;
                while let Some(message) = batch.next().await {
                    let message = message.map_err(|error| unavailable("fetch", error))?;
                    got += 1;
                    let info = message
                        .info()
                        .map_err(|error| unavailable("message info", error))?;
                    let sequence = info.stream_sequence;
                    let published_ms =
                        (info.published.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
                    let parsed = message::event(
                        shard,
                        &reading,
                        sequence,
                        published_ms,
                        message.headers.as_ref(),
                        &message.payload,
                    );
                    read += 1;
                    last = Some(layout::position(sequence));
                    events.extend(parsed);
                }
                if got == 0 && !behind(last) {
                    // Retention removed what was pending when the consumer was created.
                    break;
                }
                pending = pending.saturating_sub(got);
            }
            Ok::<_, BackendError>(())
        };
        let outcome = tokio::time::timeout(REQUEST_TIMEOUT, fetched).await;
        if let Err(error) = self
            .jetstream
            .delete_consumer_from_stream(&name, &self.layout.stream)
            .await
        {
            log::debug!("nats: replay consumer {name} is left to expire: {error}");
        }
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(error),
            Err(_) => {
                return Err(BackendError::unavailable(
                    "nats: replay fetch did not complete in time",
                ))
            }
        }
        // Read after the fetch: retention only moves forward, so what it had not removed by now
        // it had not removed while the page was read either.
        let info = self.stream_info().await?;
        let epoch = layout::epoch_of(info.created.unix_timestamp_nanos());
        let trimmed = self.trimmed_through(shard, &info.state).await?;
        if epoch != reading {
            for event in &mut events {
                event.epoch = epoch.clone();
            }
        }
        Ok(ReadPage {
            epoch,
            events,
            read,
            last,
            trimmed_through: layout::position(trimmed),
        })
    }

    async fn shard_state(&self, shard: u32) -> BackendResult<ShardState> {
        let info = self.stream_info().await?;
        let epoch = layout::epoch_of(info.created.unix_timestamp_nanos());
        let state = &info.state;
        let trimmed = self.trimmed_through(shard, state).await?;
        Ok(ShardState {
            epoch,
            start: Position::ZERO,
            head: layout::position(state.last_sequence),
            trimmed_through: layout::position(trimmed),
            probe: None,
        })
    }

    /// The highest sequence that may have been removed from `shard` (the module doc says how).
    /// The sequence of the shard's last entry, from the stream leader (`None`: it has none).
    async fn last_of_shard(&self, shard: u32) -> BackendResult<Option<u64>> {
        let stream = self
            .jetstream
            .get_stream_no_info(&self.layout.stream)
            .await
            .map_err(|error| unavailable("stream", error))?;
        let last = found(
            stream
                .get_last_raw_message_by_subject(&self.layout.subject(shard))
                .await,
        )
        .map_err(|error| unavailable("last message of a shard", error))?;
        Ok(last.map(|message| message.sequence))
    }

    async fn trimmed_through(&self, shard: u32, state: &StreamState) -> BackendResult<u64> {
        Ok(
            match Removed::of(state.first_sequence, state.last_sequence, state.messages) {
                Removed::Through(sequence) => sequence,
                Removed::Interior { front, last } => {
                    let stream = self
                        .jetstream
                        .get_stream_no_info(&self.layout.stream)
                        .await
                        .map_err(|error| unavailable("stream", error))?;
                    let first_of_shard = found(
                        stream
                            .get_first_raw_message_by_subject(self.layout.subject(shard), front + 1)
                            .await,
                    )
                    .map_err(|error| unavailable("first message of a shard", error))?
                    .map(|message| message.sequence);
                    Removed::shard_through(front, last, first_of_shard)
                }
            },
        )
    }

    async fn ping(&self) -> BackendResult<()> {
        // Fails at once while disconnected, instead of waiting for a request to time out.
        if self.client.connection_state() != ConnectionState::Connected {
            return Err(BackendError::unavailable("nats: not connected"));
        }
        match self.jetstream.get_stream(&self.layout.stream).await {
            Ok(_) => Ok(()),
            Err(error) => Err(unavailable("stream info", error)),
        }
    }
}

/// What a failed publish means for its item: refused by JetStream (certainly not stored), or a
/// lost or unanswered publish (`acking`: it was sent, so it may be stored).
fn publish_failure(error: jetstream::context::PublishError, acking: bool) -> ItemFailure {
    match error.kind() {
        PublishErrorKind::Other | PublishErrorKind::WrongLastMessageId => {
            ItemFailure::NotAppended(format!("nats: publish refused: {error}"))
        }
        _ if acking => ItemFailure::Unknown(format!(
            "nats: publish not acknowledged ({error}); it may or may not be stored: retry it \
             with its key"
        )),
        _ => ItemFailure::NotAppended(format!("nats: publish failed: {error}")),
    }
}

/// What happened to the copies of one item.
#[derive(Default)]
struct ItemTally {
    copies: usize,
    /// The shard whose copy answers for it (its first).
    answered_by: u32,
    stored: usize,
    /// Of a broadcast: the cursor of each copy acknowledged.
    copy_cursors: Vec<Cursor>,
    answer: Option<Appended>,
    failure: Option<ItemFailure>,
}

impl ItemTally {
    fn fail(&mut self, failure: ItemFailure) {
        // An unknown outcome says more than a refusal.
        if !self
            .failure
            .as_ref()
            .is_some_and(|known| matches!(known, ItemFailure::Unknown(_)))
        {
            self.failure = Some(failure);
        }
    }

    fn outcome(self) -> ItemOutcome {
        match (self.failure, self.answer) {
            (None, Some(mut answer)) if self.stored == self.copies => {
                let mut copies = self.copy_cursors;
                if copies.len() == self.copies && !copies.is_empty() {
                    copies.sort_by_key(|copy| copy.shard);
                    answer.copies = copies;
                }
                Ok(answer)
            }
            (None, _) => Err(ItemFailure::Unknown("nats: an event got no ack".into())),
            (Some(failure), _) if self.stored > 0 => Err(ItemFailure::Incomplete(format!(
                "the broadcast reached {} of {} shards ({}); retry it with its key to complete it",
                self.stored,
                self.copies,
                failure.message()
            ))),
            (Some(failure), _) => Err(failure),
        }
    }
}

/// What retention and deletions removed from the stream, from its state.
#[derive(Debug, PartialEq, Eq)]
enum Removed {
    /// Nothing is missing inside the retained range: exactly the sequences up to this one are
    /// gone (all of them when the stream is empty).
    Through(u64),
    /// Sequences inside `front + 1 ..= last` are missing too (per-subject limits, deleted or
    /// purged messages): where a shard's first retained message is decides.
    Interior { front: u64, last: u64 },
}

impl Removed {
    fn of(first: u64, last: u64, messages: u64) -> Self {
        if messages == 0 {
            return Removed::Through(last);
        }
        let front = first.saturating_sub(1);
        if messages >= last.saturating_sub(front) {
            Removed::Through(front)
        } else {
            Removed::Interior { front, last }
        }
    }

    /// A shard's trimmed-through sequence when the stream has interior gaps: anything before the
    /// shard's first retained message may be gone; with none retained, everything may be.
    fn shard_through(front: u64, last: u64, first_of_shard: Option<u64>) -> u64 {
        match first_of_shard {
            Some(first) => first.saturating_sub(1).max(front),
            None => last,
        }
    }
}

impl Backend for NatsBackend {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn shards(&self) -> u32 {
        self.inner.layout.shards
    }

    fn groups(&self) -> Vec<Range<u32>> {
        // One ordered consumer reads every shard subject through the stream's one filter.
        std::iter::once(0..self.inner.layout.shards).collect()
    }

    fn append(&self, events: Vec<NewEvent>) -> BoxFuture<'_, BackendResult<Vec<ItemOutcome>>> {
        self.inner.append(events).boxed()
    }

    fn open_tail(&self, _group: usize) -> BoxFuture<'_, BackendResult<Box<dyn Tail>>> {
        let inner = self.inner.clone();
        async move {
            let tail: Box<dyn Tail> = Box::new(tail::NatsTail::open(inner).await?);
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
        self.inner.read_after(shard, after.seq, limit).boxed()
    }

    /// JetStream cannot tell cheaply whether one sequence is stored: `probe` is not looked at.
    fn shard_state(
        &self,
        shard: u32,
        _probe: Option<Position>,
    ) -> BoxFuture<'_, BackendResult<ShardState>> {
        self.inner.shard_state(shard).boxed()
    }

    fn trim(&self, _group: usize) -> BoxFuture<'_, BackendResult<()>> {
        // JetStream enforces the stream's max age itself, on every producer's messages.
        async { Ok(()) }.boxed()
    }

    fn newest_of(
        &self,
        shard: u32,
        epoch: &Epoch,
        keys: Vec<SupersedeKey>,
    ) -> BoxFuture<'_, BackendResult<Vec<Option<Position>>>> {
        let epoch = epoch.clone();
        async move {
            supersede::newest_of(
                &self.inner.jetstream,
                &self.inner.layout,
                shard,
                &epoch,
                &keys,
            )
            .await
        }
        .boxed()
    }

    fn ping(&self) -> BoxFuture<'_, BackendResult<()>> {
        self.inner.ping().boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stream state tells exactly what was removed when nothing is missing inside it, and
    /// defers to the shard's first retained message when something is.
    #[test]
    fn removed_sequences_from_stream_state() {
        // A fresh, empty stream: nothing removed.
        assert_eq!(Removed::of(0, 0, 0), Removed::Through(0));
        // 1..=10 all present.
        assert_eq!(Removed::of(1, 10, 10), Removed::Through(0));
        // Age removed 1..=4.
        assert_eq!(Removed::of(5, 10, 6), Removed::Through(4));
        // Everything aged out (NATS reports first = last + 1).
        assert_eq!(Removed::of(11, 10, 0), Removed::Through(10));
        // 5..=10 with two interior holes.
        let interior = Removed::of(5, 10, 4);
        assert_eq!(interior, Removed::Interior { front: 4, last: 10 });
        assert_eq!(Removed::shard_through(4, 10, Some(8)), 7);
        assert_eq!(Removed::shard_through(4, 10, Some(5)), 4);
        assert_eq!(Removed::shard_through(4, 10, None), 10);
    }

    fn settings() -> NatsSettings {
        NatsSettings {
            nats: crate::config::Config::default().nats,
            dedupe_window: Duration::from_secs(600),
        }
    }

    /// An existing stream is usable unless it breaks the format or resuming; limits such as max
    /// age are ours to set, and other limits are the operator's.
    #[test]
    fn conflicting_streams_are_named() {
        let settings = settings();
        let wanted = wanted_stream(&layout_of(&settings.nats), &settings);
        assert_eq!(wanted.subjects, ["posthorn.ev.*"]);
        let compatible = stream::Config {
            max_age: Duration::from_secs(1),
            max_messages_per_subject: 5,
            storage: StorageType::Memory,
            ..wanted.clone()
        };
        assert_eq!(conflict(&compatible, &wanted), None);
        let cases = [
            (
                stream::Config {
                    subjects: vec!["posthorn.ev.*".into(), "other".into()],
                    ..wanted.clone()
                },
                "subjects",
            ),
            (
                stream::Config {
                    retention: RetentionPolicy::WorkQueue,
                    ..wanted.clone()
                },
                "retention",
            ),
            (
                stream::Config {
                    no_ack: true,
                    ..wanted.clone()
                },
                "no_ack",
            ),
            (
                stream::Config {
                    sealed: true,
                    ..wanted.clone()
                },
                "sealed",
            ),
        ];
        for (existing, word) in cases {
            let reason = conflict(&existing, &wanted).expect("a conflict");
            assert!(reason.contains(word), "{reason}");
        }
    }
}

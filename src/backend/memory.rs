//! The embedded backend: one in-process ring per shard, for a single pod with no external service.
//!
//! Positions are Redis-shaped `(ms, seq)` ids from the wall clock, so lag and retention work as
//! with Redis. The epoch is drawn at process start: every cursor from a previous run of the
//! process answers `resync` `data_lost`, because the log did not survive the restart. Everything
//! sits behind one mutex; appends and reads hold it for microseconds. The supersede index is a
//! map per shard, written under the same lock as the entry, and pruned by the periodic trim.

use std::{
    collections::{HashMap, VecDeque},
    ops::Range,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use futures_util::{future::BoxFuture, FutureExt};
use tokio::sync::Notify;

use super::{
    Appended, Backend, BackendResult, Gap, ItemOutcome, NewEvent, ReadPage, ShardState,
    StoredEvent, SupersedeKey, Tail, TailBatch,
};
use crate::model::{unix_ms, Cursor, Epoch, Position, ResyncReason};

#[derive(Debug, Clone)]
pub struct MemorySettings {
    pub shards: u32,
    pub retention: Duration,
    pub max_len: usize,
    pub tail_count: usize,
    pub dedupe_window: Duration,
}

pub struct MemoryBackend {
    inner: Arc<Inner>,
}

struct Inner {
    epoch: Epoch,
    settings: MemorySettings,
    state: Mutex<LogState>,
    /// Wakes every tail after an append.
    appended: Notify,
}

struct LogState {
    shards: Vec<ShardLog>,
    /// Accepted idempotency keys (per target) and what they were answered with: the cursor and,
    /// for a broadcast, every copy (a retry reports them as the first answer did).
    dedupe: HashMap<DedupeKey, (Instant, Cursor, Vec<Cursor>)>,
    /// Keys in acceptance order, so expiry pops from the front instead of scanning the map.
    dedupe_order: VecDeque<(Instant, DedupeKey)>,
}

/// An idempotency key is the producer's own, scoped to the item's target.
#[derive(Clone, PartialEq, Eq, Hash)]
struct DedupeKey {
    /// The `dev` field: a device id, or `*` for a broadcast.
    target: Arc<str>,
    key: String,
}

#[derive(Default)]
struct ShardLog {
    entries: VecDeque<StoredEvent>,
    last: Position,
    trimmed_through: Position,
    /// Newest position per supersede key; entries at or below `trimmed_through` are dropped
    /// by the periodic trim, so it holds at most one entry per stored event.
    newest: HashMap<SupersedeKey, Position>,
}

impl ShardLog {
    fn next_position(&self, now_ms: u64) -> Position {
        if now_ms > self.last.ms {
            Position::new(now_ms, 0)
        } else {
            Position::new(self.last.ms, self.last.seq + 1)
        }
    }

    fn trim(&mut self, now_ms: u64, retention: Duration, max_len: usize) {
        let oldest_kept_ms = now_ms.saturating_sub(retention.as_millis() as u64);
        while let Some(front) = self.entries.front() {
            if front.position.ms >= oldest_kept_ms && self.entries.len() <= max_len {
                break;
            }
            self.trimmed_through = front.position;
            self.entries.pop_front();
        }
    }

    /// Forgets supersede entries whose event is trimmed away: nothing older is left to skip.
    fn prune_newest(&mut self) {
        let trimmed_through = self.trimmed_through;
        self.newest
            .retain(|_, position| *position > trimmed_through);
    }

    /// Index of the first entry strictly after `after`.
    fn first_after(&self, after: Position) -> usize {
        self.entries
            .partition_point(|entry| entry.position <= after)
    }
}

impl MemoryBackend {
    pub fn new(settings: MemorySettings) -> Self {
        let shards = (0..settings.shards).map(|_| ShardLog::default()).collect();
        Self {
            inner: Arc::new(Inner {
                epoch: Epoch::random(),
                settings,
                state: Mutex::new(LogState {
                    shards,
                    dedupe: HashMap::new(),
                    dedupe_order: VecDeque::new(),
                }),
                appended: Notify::new(),
            }),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, LogState> {
        // A panic while holding the lock cannot leave the log half-written in a way later readers
        // would misread (every mutation is a single push/pop), so poisoning is ignored.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn append(&self, events: Vec<NewEvent>) -> Vec<ItemOutcome> {
        let now = Instant::now();
        let wall_ms = unix_ms();
        let settings = &self.settings;
        let mut state = self.lock();
        while let Some((at, _)) = state.dedupe_order.front() {
            if now.duration_since(*at) < settings.dedupe_window {
                break;
            }
            if let Some((_, key)) = state.dedupe_order.pop_front() {
                if state
                    .dedupe
                    .get(&key)
                    .is_some_and(|(t, ..)| now.duration_since(*t) >= settings.dedupe_window)
                {
                    state.dedupe.remove(&key);
                }
            }
        }
        let mut results = Vec::with_capacity(events.len());
        for event in events {
            let dedupe = event.key.as_ref().map(|key| DedupeKey {
                target: Arc::from(event.target.as_field()),
                key: key.clone(),
            });
            if let Some((_, cursor, copies)) = dedupe.as_ref().and_then(|key| state.dedupe.get(key))
            {
                results.push(Ok(Appended {
                    cursor: cursor.clone(),
                    duplicate: true,
                    copies: copies.clone(),
                }));
                continue;
            }
            let shards = event.stored_in(settings.shards);
            let data: Arc<str> = Arc::from(event.data);
            let mut copies = Vec::new();
            for shard in shards {
                let log = &mut state.shards[shard as usize];
                let position = log.next_position(wall_ms);
                log.last = position;
                let stored = StoredEvent {
                    shard,
                    epoch: self.epoch.clone(),
                    position,
                    appended_ms: position.ms,
                    target: event.target.clone(),
                    event_type: event.event_type.clone(),
                    data: data.clone(),
                    expires_ms: event.expires_ms,
                    supersede: event.supersede.clone(),
                };
                if let Some(key) = stored.supersede_key() {
                    log.newest.insert(key, position);
                }
                log.entries.push_back(stored);
                log.trim(wall_ms, settings.retention, settings.max_len);
                copies.push(Cursor::new(self.epoch.clone(), shard, position));
            }
            // A device target always yields one shard, the others at least one (shards >= 1, and
            // a group event is given at least one).
            // Copies are kept for a broadcast or a group event: the fleet API's
            // not-acknowledged query.
            let cursor = copies[0].clone();
            if !event.target.is_per_shard() {
                copies.clear();
            }
            if let Some(key) = dedupe {
                state
                    .dedupe
                    .insert(key.clone(), (now, cursor.clone(), copies.clone()));
                state.dedupe_order.push_back((now, key));
            }
            results.push(Ok(Appended {
                cursor,
                duplicate: false,
                copies,
            }));
        }
        drop(state);
        self.appended.notify_waiters();
        results
    }
}

impl Backend for MemoryBackend {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn shards(&self) -> u32 {
        self.inner.settings.shards
    }

    fn groups(&self) -> Vec<Range<u32>> {
        // One group: the whole log is read by a single tail.
        std::iter::once(0..self.inner.settings.shards).collect()
    }

    fn append(&self, events: Vec<NewEvent>) -> BoxFuture<'_, BackendResult<Vec<ItemOutcome>>> {
        let results = self.inner.append(events);
        async move { Ok(results) }.boxed()
    }

    fn open_tail(&self, _group: usize) -> BoxFuture<'_, BackendResult<Box<dyn Tail>>> {
        let last = self
            .inner
            .lock()
            .shards
            .iter()
            .map(|log| log.last)
            .collect();
        let tail: Box<dyn Tail> = Box::new(MemoryTail {
            inner: self.inner.clone(),
            last,
            next_shard: 0,
        });
        async move { Ok(tail) }.boxed()
    }

    fn read_after(
        &self,
        shard: u32,
        after: Position,
        limit: usize,
    ) -> BoxFuture<'_, BackendResult<ReadPage>> {
        let (events, trimmed_through) = {
            let state = self.inner.lock();
            let log = &state.shards[shard as usize];
            let start = log.first_after(after);
            let events: Vec<StoredEvent> =
                log.entries.range(start..).take(limit).cloned().collect();
            (events, log.trimmed_through)
        };
        let page = ReadPage {
            epoch: self.inner.epoch.clone(),
            read: events.len(),
            last: events.last().map(|event| event.position),
            events,
            trimmed_through,
        };
        async move { Ok(page) }.boxed()
    }

    fn shard_state(
        &self,
        shard: u32,
        probe: Option<Position>,
    ) -> BoxFuture<'_, BackendResult<ShardState>> {
        let state = {
            let state = self.inner.lock();
            let log = &state.shards[shard as usize];
            ShardState {
                epoch: self.inner.epoch.clone(),
                start: Position::ZERO,
                head: log.last,
                trimmed_through: log.trimmed_through,
                probe: probe.map(|position| {
                    let index = log.first_after(position);
                    index > 0 && log.entries[index - 1].position == position
                }),
            }
        };
        async move { Ok(state) }.boxed()
    }

    fn trim(&self, _group: usize) -> BoxFuture<'_, BackendResult<()>> {
        let wall_ms = unix_ms();
        let settings = &self.inner.settings;
        for log in self.inner.lock().shards.iter_mut() {
            log.trim(wall_ms, settings.retention, settings.max_len);
            log.prune_newest();
        }
        async { Ok(()) }.boxed()
    }

    fn newest_of(
        &self,
        shard: u32,
        _epoch: &Epoch,
        keys: Vec<SupersedeKey>,
    ) -> BoxFuture<'_, BackendResult<Vec<Option<Position>>>> {
        // One life per process: every position the index holds is of the current epoch.
        let newest = {
            let state = self.inner.lock();
            let log = &state.shards[shard as usize];
            keys.iter()
                .map(|key| log.newest.get(key).copied())
                .collect()
        };
        async move { Ok(newest) }.boxed()
    }

    fn ping(&self) -> BoxFuture<'_, BackendResult<()>> {
        async { Ok(()) }.boxed()
    }
}

struct MemoryTail {
    inner: Arc<Inner>,
    /// Last position read per shard.
    last: Vec<Position>,
    /// Where the next read starts, rotated so one busy shard cannot starve the others.
    next_shard: usize,
}

impl MemoryTail {
    fn read_ready(&mut self) -> TailBatch {
        let count = self.inner.settings.tail_count;
        let mut batch = TailBatch::default();
        let state = self.inner.lock();
        let shards = state.shards.len();
        for offset in 0..shards {
            let shard = (self.next_shard + offset) % shards;
            let log = &state.shards[shard];
            let last = &mut self.last[shard];
            if log.trimmed_through > *last {
                *last = log.trimmed_through;
                batch.gaps.push(Gap {
                    cursor: Cursor::new(self.inner.epoch.clone(), shard as u32, *last),
                    reason: ResyncReason::Expired,
                });
            }
            let start = log.first_after(*last);
            let room = count.saturating_sub(batch.events.len());
            batch
                .events
                .extend(log.entries.range(start..).take(room).cloned());
            if let Some(newest) = batch.events.last().filter(|e| e.shard == shard as u32) {
                *last = newest.position;
            }
            if batch.events.len() >= count {
                break;
            }
        }
        self.next_shard = (self.next_shard + 1) % shards;
        batch
    }
}

impl Tail for MemoryTail {
    fn next_batch(&mut self) -> BoxFuture<'_, BackendResult<TailBatch>> {
        async move {
            loop {
                let inner = self.inner.clone();
                let notified = inner.appended.notified();
                tokio::pin!(notified);
                // Registered before looking, so an append between the look and the wait wakes us.
                notified.as_mut().enable();
                let batch = self.read_ready();
                if !batch.events.is_empty() || !batch.gaps.is_empty() {
                    return Ok(batch);
                }
                notified.await;
            }
        }
        .boxed()
    }

    fn last_positions(&self) -> Vec<(u32, Position)> {
        self.last
            .iter()
            .enumerate()
            .map(|(shard, position)| (shard as u32, *position))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DeviceId, EventType, Target};

    fn backend(max_len: usize) -> MemoryBackend {
        MemoryBackend::new(MemorySettings {
            shards: 4,
            retention: Duration::from_secs(900),
            max_len,
            tail_count: 100,
            dedupe_window: Duration::from_secs(600),
        })
    }

    fn unicast(device: &str, data: &str, key: Option<&str>) -> NewEvent {
        NewEvent {
            target: Target::Device(DeviceId::parse(device).unwrap()),
            event_type: EventType::message(),
            data: data.into(),
            key: key.map(String::from),
            expires_ms: None,
            supersede: None,
            only_shards: None,
        }
    }

    /// A key accepted once is answered with the original cursor and not appended again.
    #[tokio::test]
    async fn idempotency_key_returns_the_original_cursor() {
        let log = backend(100);
        let first = log
            .append(vec![unicast("pos-1", "a", Some("k1"))])
            .await
            .unwrap();
        let again = log
            .append(vec![
                unicast("pos-1", "b", Some("k1")),
                unicast("pos-1", "c", Some("k1")),
            ])
            .await
            .unwrap();
        let first = first[0].as_ref().unwrap();
        assert!(!first.duplicate);
        assert!(again.iter().all(|a| {
            let a = a.as_ref().unwrap();
            a.duplicate && a.cursor == first.cursor
        }));
        let shard = first.cursor.shard;
        assert_eq!(
            log.read_after(shard, Position::ZERO, 10)
                .await
                .unwrap()
                .events
                .len(),
            1
        );
    }

    /// A broadcast retried with its key answers every copy, as its first answer did (and as the
    /// Redis and NATS backends do), so the fleet API can record a broadcast from its retry.
    #[tokio::test]
    async fn a_duplicate_broadcast_answers_its_copies() {
        let log = backend(100);
        let broadcast = NewEvent {
            target: Target::Broadcast,
            ..unicast("x", "hello", Some("bk"))
        };
        let first = log.append(vec![broadcast.clone()]).await.unwrap();
        let again = log.append(vec![broadcast]).await.unwrap();
        let (first, again) = (first[0].as_ref().unwrap(), again[0].as_ref().unwrap());
        assert_eq!(first.copies.len(), 4);
        assert!(again.duplicate);
        assert_eq!(again.cursor, first.cursor);
        assert_eq!(again.copies, first.copies);
    }

    /// A broadcast lands once on every shard, and the length cap records what it trimmed.
    #[tokio::test]
    async fn broadcast_copies_and_length_trim() {
        let log = backend(2);
        let broadcast = NewEvent {
            target: Target::Broadcast,
            ..unicast("x", "hello", None)
        };
        for _ in 0..3 {
            log.append(vec![broadcast.clone()]).await.unwrap();
        }
        for shard in 0..4 {
            let entries = log
                .read_after(shard, Position::ZERO, 10)
                .await
                .unwrap()
                .events;
            assert_eq!(entries.len(), 2);
            let state = log.shard_state(shard, None).await.unwrap();
            assert!(state.trimmed_through > Position::ZERO);
            assert!(state.trimmed_through < entries[0].position);
        }
    }

    /// The supersede index holds the newest position per (target, name): a unicast and a
    /// broadcast of one name are apart, and entries whose event was trimmed are pruned.
    #[tokio::test]
    async fn supersede_index_keeps_the_newest_per_target_and_name() {
        let log = backend(3);
        let name = EventType::parse("prices").unwrap();
        let versioned = |target: Target, data: &str| NewEvent {
            target,
            supersede: Some(name.clone()),
            only_shards: None,
            ..unicast("pos-1", data, None)
        };
        let device = Target::Device(DeviceId::parse("pos-1").unwrap());
        let shard = crate::model::shard_of("pos-1", 4);
        let key = |target: Target| SupersedeKey {
            target,
            name: name.clone(),
        };
        let appended = log
            .append(vec![
                versioned(device.clone(), "v1"),
                versioned(device.clone(), "v2"),
                versioned(Target::Broadcast, "all v1"),
            ])
            .await
            .unwrap();
        let v2 = appended[1].as_ref().unwrap().cursor.position;
        let all = log
            .read_after(shard, Position::ZERO, 10)
            .await
            .unwrap()
            .events[2]
            .position;
        let epoch = log.inner.epoch.clone();
        let newest = log
            .newest_of(
                shard,
                &epoch,
                vec![key(device.clone()), key(Target::Broadcast)],
            )
            .await
            .unwrap();
        assert_eq!(newest, [Some(v2), Some(all)]);
        // Three more entries push every indexed one out of the length cap.
        for i in 0..3 {
            log.append(vec![unicast("pos-1", &i.to_string(), None)])
                .await
                .unwrap();
        }
        log.trim(0).await.unwrap();
        let newest = log
            .newest_of(shard, &epoch, vec![key(device), key(Target::Broadcast)])
            .await
            .unwrap();
        assert_eq!(newest, [None, None]);
    }

    /// A tail starts at "now", sees later appends, and reports entries trimmed before it read them.
    #[tokio::test]
    async fn tail_reads_new_entries_and_reports_gaps() {
        let log = backend(2);
        log.append(vec![unicast("pos-1", "old", None)])
            .await
            .unwrap();
        let mut tail = log.open_tail(0).await.unwrap();
        log.append(vec![unicast("pos-1", "new", None)])
            .await
            .unwrap();
        let batch = tail.next_batch().await.unwrap();
        assert_eq!(batch.events.len(), 1);
        assert_eq!(&*batch.events[0].data, "new");
        assert!(batch.gaps.is_empty());
        for i in 0..5 {
            log.append(vec![unicast("pos-1", &i.to_string(), None)])
                .await
                .unwrap();
        }
        let batch = tail.next_batch().await.unwrap();
        assert_eq!(batch.gaps.len(), 1);
        let data: Vec<&str> = batch.events.iter().map(|e| &*e.data).collect();
        assert_eq!(data, ["3", "4"]);
    }
}

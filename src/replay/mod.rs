//! Resumes: the replay of what a client missed after its cursor, bounded and shared.
//!
//! Owns the pod's replay slots (`replay.max_concurrent`, a fair semaphore: a stream that resumes
//! while every slot is busy is open at once and waits its turn in order of arrival) and one
//! [`Window`] per shard that has replays, waiting or running: the shard's entries read so far,
//! so that the resumes of one shard read each entry from the backend once instead of once per
//! device (`replay.cache_entries` bounds all windows together; beyond it replays read directly).
//!
//! Not an actor: each Connection runs its own replay as a future, and they meet here. A replay
//! sends either every retained event of its device after the cursor, or one `resync`, through
//! the connection's replay channel, then `ReplayEnd`; it leaves out what has expired by the
//! pod's clock (`exp`) and what a newer event of the same supersede name (and target) replaces,
//! asking the backend's supersede index once per page; when trimming overtakes it midway (a
//! client reading slowly at the edge of retention), a `resync` `expired` where entries were
//! removed, then what is left. A replay whose client takes nothing for
//! `sse.stall_timeout` gives its slot up (the Connection evicts the client). While it waits for a
//! slot, its stream gets a `: ping` every `sse.heartbeat` through the replay channel (the body
//! reads nothing else before the replay ends), so a waiting client does not take the silence
//! for a dead connection.

mod window;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use thiserror::Error;
use tokio::sync::{mpsc, Semaphore};

use crate::{
    backend::{Backend, BackendError, StoredEvent},
    metrics::Metrics,
    model::{unix_ms, Addressee, Cursor, Epoch, ResyncReason},
    report::Report,
    sse::{frame, QueueItem},
};
use window::{CacheBudget, Window};

/// Entries read from the backend per replay request.
pub const REPLAY_PAGE: usize = 500;

#[derive(Debug, Error)]
pub enum ReplayError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("client went away during replay")]
    ClientGone,
    #[error("client took nothing of its replay for {0:?}")]
    Stalled(Duration),
}

pub struct Replayer {
    backend: Arc<dyn Backend>,
    metrics: Arc<Metrics>,
    slots: Semaphore,
    /// Windows of the shards with replays, and how many replays use each.
    windows: Mutex<HashMap<u32, (Arc<Window>, usize)>>,
    budget: Arc<CacheBudget>,
    /// A client that takes nothing of its replay for this long is stalled (zero: never).
    stall_timeout: Duration,
    /// `sse.heartbeat`, kept while a replay waits for its slot.
    heartbeat: Duration,
}

impl Replayer {
    pub fn new(
        backend: Arc<dyn Backend>,
        metrics: Arc<Metrics>,
        max_concurrent: usize,
        cache_entries: usize,
        stall_timeout: Duration,
        heartbeat: Duration,
    ) -> Self {
        Self {
            backend,
            metrics,
            slots: Semaphore::new(max_concurrent),
            windows: Mutex::new(HashMap::new()),
            budget: Arc::new(CacheBudget::new(cache_entries)),
            stall_timeout,
            heartbeat,
        }
    }

    /// Replays the events for `addressee` after `cursor_text` through `out`, once a slot is
    /// free: its device's, the broadcasts and its groups' of its device's shard.
    /// `registered` is when the stream joined the Router: what is stored after it arrives live.
    pub async fn replay(
        &self,
        addressee: Addressee<'_>,
        shard: u32,
        cursor_text: &str,
        registered: Instant,
        out: &mpsc::Sender<QueueItem>,
    ) -> Result<(), ReplayError> {
        let window = WindowUse::new(self, shard);
        let waiting = GaugeGuard::new(&self.metrics.replays_waiting);
        // One acquire for the whole wait: its place in the queue is its order of arrival.
        let acquire = self.slots.acquire();
        tokio::pin!(acquire);
        let mut heartbeat =
            tokio::time::interval_at(tokio::time::Instant::now() + self.heartbeat, self.heartbeat);
        let _slot = loop {
            tokio::select! {
                slot = &mut acquire => break slot.expect("the replay semaphore is never closed"),
                _ = heartbeat.tick() => {
                    // A full channel already has something for the client to read.
                    let _ = out.try_send(QueueItem::Ping);
                }
            }
        };
        drop(waiting);
        let _running = GaugeGuard::new(&self.metrics.replays_in_flight);
        let result = self
            .run(
                addressee,
                shard,
                cursor_text,
                registered,
                &window.window,
                out,
            )
            .await;
        self.metrics
            .replay_duration_seconds
            .observe(registered.elapsed().as_secs_f64());
        result
    }

    async fn run(
        &self,
        addressee: Addressee<'_>,
        shard: u32,
        cursor_text: &str,
        registered: Instant,
        window: &Window,
        out: &mpsc::Sender<QueueItem>,
    ) -> Result<(), ReplayError> {
        let send = |item| self.send(out, item);
        let cursor = Cursor::parse(cursor_text)
            .ok()
            .filter(|cursor| cursor.shard == shard);
        let state = self
            .backend
            .shard_state(shard, cursor.as_ref().map(|cursor| cursor.position))
            .await?;
        let verdict = match &cursor {
            None => Err(ResyncReason::Invalid),
            Some(cursor) => state.judge(cursor),
        };
        let (mut epoch, mut after) = match verdict {
            Ok(position) => (state.epoch, position),
            Err(reason) => {
                // Only live events follow: from the head on.
                send(resync(&Cursor::new(state.epoch, shard, state.head), reason)).await?;
                return send(QueueItem::ReplayEnd).await;
            }
        };
        send(QueueItem::Floor {
            epoch: epoch.id(),
            position: after,
        })
        .await?;
        loop {
            let page = window
                .page_after(&*self.backend, &self.metrics, &epoch, after, registered)
                .await?;
            if page.epoch != epoch {
                // Lost while replaying: the client moves to the start of the new life, whose
                // events all follow (a tail that finds the same loss sends the same resync, which
                // the body drops).
                let state = self.backend.shard_state(shard, None).await?;
                let start = Cursor::new(state.epoch, shard, state.start);
                send(resync(&start, ResyncReason::DataLost)).await?;
                (epoch, after) = (start.epoch, start.position);
                continue;
            }
            if let Some(removed_through) = page.overtaken {
                // Trimming overtook the replay (the client read slowly at the edge of retention):
                // what it missed is said, and the replay goes on with what is left.
                let overtaken = Cursor::new(epoch.clone(), shard, removed_through);
                send(resync(&overtaken, ResyncReason::Expired)).await?;
                after = removed_through;
                continue;
            }
            let mine: Vec<&StoredEvent> = page
                .events
                .iter()
                .filter(|event| event.target.reaches(addressee))
                .collect();
            for event in self.deliverable(shard, &epoch, mine).await {
                let id = Cursor::new(epoch.clone(), shard, event.position).to_string();
                send(QueueItem::Event {
                    epoch: epoch.id(),
                    position: event.position,
                    appended_ms: event.appended_ms,
                    frame: frame::event(&id, event.event_type.as_str(), &event.data),
                })
                .await?;
                self.metrics.sse_replayed_events.inc();
            }
            match page.last {
                Some(last) if !page.done => after = last,
                _ => return send(QueueItem::ReplayEnd).await,
            }
        }
    }

    /// What of `events` (one page, one device) is sent: not expired, and not replaced by a
    /// newer event of its supersede key. When the index cannot be read, nothing is left out for
    /// supersede: a replay may send old versions, never lose the newest.
    async fn deliverable<'e>(
        &self,
        shard: u32,
        epoch: &Epoch,
        events: Vec<&'e StoredEvent>,
    ) -> Vec<&'e StoredEvent> {
        let now_ms = unix_ms();
        let before = events.len();
        let mut events: Vec<&StoredEvent> = events
            .into_iter()
            .filter(|event| !event.expired_at(now_ms))
            .collect();
        self.metrics
            .events_expired_replay
            .inc_by((before - events.len()) as u64);
        let mut keys: Vec<_> = events
            .iter()
            .filter_map(|event| event.supersede_key())
            .collect();
        keys.sort_by_key(|key| key.field());
        keys.dedup();
        if keys.is_empty() {
            return events;
        }
        let newest = match self.backend.newest_of(shard, epoch, keys.clone()).await {
            Ok(newest) => newest,
            Err(error) => {
                log::warn!(
                    "replay of shard {shard} sends every version of its supersede names: the \
                     index could not be read ({})",
                    Report(&error)
                );
                return events;
            }
        };
        let newest: std::collections::HashMap<_, _> = keys.into_iter().zip(newest).collect();
        let before = events.len();
        events.retain(|event| {
            let replaced = event
                .supersede_key()
                .and_then(|key| newest.get(&key).copied().flatten())
                .is_some_and(|newest| newest > event.position);
            !replaced
        });
        self.metrics
            .events_superseded
            .inc_by((before - events.len()) as u64);
        events
    }

    async fn send(
        &self,
        out: &mpsc::Sender<QueueItem>,
        item: QueueItem,
    ) -> Result<(), ReplayError> {
        if self.stall_timeout.is_zero() {
            return out.send(item).await.map_err(|_| ReplayError::ClientGone);
        }
        match tokio::time::timeout(self.stall_timeout, out.send(item)).await {
            Ok(sent) => sent.map_err(|_| ReplayError::ClientGone),
            Err(_) => Err(ReplayError::Stalled(self.stall_timeout)),
        }
    }
}

/// `event: resync` telling the client to continue after `continue_after`.
fn resync(continue_after: &Cursor, reason: ResyncReason) -> QueueItem {
    QueueItem::Resync {
        epoch: continue_after.epoch.id(),
        position: continue_after.position,
        reason,
        frame: frame::resync(continue_after, reason),
    }
}

/// One replay's use of its shard's window: the window lives while any replay of the shard,
/// waiting or running, uses it.
struct WindowUse<'a> {
    replayer: &'a Replayer,
    shard: u32,
    window: Arc<Window>,
}

impl<'a> WindowUse<'a> {
    fn new(replayer: &'a Replayer, shard: u32) -> Self {
        let mut windows = replayer
            .windows
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (window, users) = windows
            .entry(shard)
            .or_insert_with(|| (Arc::new(Window::new(shard, replayer.budget.clone())), 0));
        *users += 1;
        Self {
            replayer,
            shard,
            window: window.clone(),
        }
    }
}

impl Drop for WindowUse<'_> {
    fn drop(&mut self) {
        let mut windows = self
            .replayer
            .windows
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, users)) = windows.get_mut(&self.shard) {
            *users -= 1;
            if *users == 0 {
                windows.remove(&self.shard);
            }
        }
    }
}

/// Counts one replay in a gauge while it lives (also when its future is dropped).
struct GaugeGuard<'a>(&'a prometheus::IntGauge);

impl<'a> GaugeGuard<'a> {
    fn new(gauge: &'a prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;

    use futures_util::{future::BoxFuture, FutureExt};

    use super::*;
    use crate::{
        backend::{
            memory::MemorySettings, BackendResult, ItemOutcome, MemoryBackend, NewEvent, ReadPage,
            ShardState, SupersedeKey, Tail,
        },
        model::{shard_of, DeviceId, EventType, Position, Target},
    };

    /// The memory backend whose supersede index cannot be read.
    struct IndexDown(MemoryBackend);

    impl Backend for IndexDown {
        fn kind(&self) -> &'static str {
            self.0.kind()
        }
        fn shards(&self) -> u32 {
            self.0.shards()
        }
        fn groups(&self) -> Vec<Range<u32>> {
            self.0.groups()
        }
        fn append(&self, events: Vec<NewEvent>) -> BoxFuture<'_, BackendResult<Vec<ItemOutcome>>> {
            self.0.append(events)
        }
        fn open_tail(&self, group: usize) -> BoxFuture<'_, BackendResult<Box<dyn Tail>>> {
            self.0.open_tail(group)
        }
        fn read_after(
            &self,
            shard: u32,
            after: Position,
            limit: usize,
        ) -> BoxFuture<'_, BackendResult<ReadPage>> {
            self.0.read_after(shard, after, limit)
        }
        fn shard_state(
            &self,
            shard: u32,
            probe: Option<Position>,
        ) -> BoxFuture<'_, BackendResult<ShardState>> {
            self.0.shard_state(shard, probe)
        }
        fn trim(&self, group: usize) -> BoxFuture<'_, BackendResult<()>> {
            self.0.trim(group)
        }
        fn newest_of(
            &self,
            _shard: u32,
            _epoch: &Epoch,
            _keys: Vec<SupersedeKey>,
        ) -> BoxFuture<'_, BackendResult<Vec<Option<Position>>>> {
            async { Err(BackendError::unavailable("index down")) }.boxed()
        }
        fn ping(&self) -> BoxFuture<'_, BackendResult<()>> {
            self.0.ping()
        }
    }

    fn memory() -> MemoryBackend {
        MemoryBackend::new(MemorySettings {
            shards: 4,
            retention: Duration::from_secs(900),
            max_len: 100,
            tail_count: 100,
            dedupe_window: Duration::from_secs(600),
        })
    }

    fn replayer(backend: Arc<dyn Backend>) -> Replayer {
        let metrics = Arc::new(Metrics::new(prometheus::Registry::new(), "memory"));
        Replayer::new(
            backend,
            metrics,
            4,
            100,
            Duration::ZERO,
            Duration::from_secs(30),
        )
    }

    fn event(target: Target, data: &str, expires_ms: Option<u64>, sup: Option<&str>) -> NewEvent {
        NewEvent {
            target,
            event_type: EventType::message(),
            data: data.into(),
            key: None,
            expires_ms,
            supersede: sup.map(|name| EventType::parse(name).unwrap()),
            only_shards: None,
        }
    }

    /// Appends a mixed backlog for `pos-1` and returns what `deliverable` keeps of it.
    async fn kept(backend: Arc<dyn Backend>) -> (Vec<String>, Arc<Metrics>) {
        let device = DeviceId::parse("pos-1").unwrap();
        let me = Target::Device(device.clone());
        let now = unix_ms();
        backend
            .append(vec![
                event(me.clone(), "prices v1", None, Some("prices")),
                event(me.clone(), "expired", Some(now - 1), None),
                event(Target::Broadcast, "all prices v1", None, Some("prices")),
                event(me.clone(), "prices v2", Some(now + 60_000), Some("prices")),
                event(me.clone(), "menu", None, Some("menu")),
                event(Target::Broadcast, "all prices v2", None, Some("prices")),
                event(me.clone(), "plain", None, None),
            ])
            .await
            .unwrap();
        let shard = shard_of("pos-1", 4);
        let page = backend
            .read_after(shard, Position::ZERO, 100)
            .await
            .unwrap();
        let replayer = replayer(backend);
        let mine = page
            .events
            .iter()
            .filter(|event| event.target.reaches(Addressee::device(&device)))
            .collect();
        let kept = replayer
            .deliverable(shard, &page.epoch, mine)
            .await
            .into_iter()
            .map(|event| event.data.to_string())
            .collect();
        (kept, replayer.metrics.clone())
    }

    /// Expired events are left out; of each (target, name) only the newest is kept, the
    /// unicast and the broadcast names apart; the rest keeps its order; both are counted.
    #[tokio::test]
    async fn expired_and_superseded_events_are_left_out() {
        let (kept, metrics) = kept(Arc::new(memory())).await;
        assert_eq!(kept, ["prices v2", "menu", "all prices v2", "plain"]);
        assert_eq!(metrics.events_expired_replay.get(), 1);
        assert_eq!(metrics.events_superseded.get(), 2);
    }

    /// When the index cannot be read, every version is sent (never lose the newest); expiry
    /// still applies.
    #[tokio::test]
    async fn an_unreadable_index_supersedes_nothing() {
        let (kept, metrics) = kept(Arc::new(IndexDown(memory()))).await;
        assert_eq!(
            kept,
            [
                "prices v1",
                "all prices v1",
                "prices v2",
                "menu",
                "all prices v2",
                "plain"
            ]
        );
        assert_eq!(metrics.events_superseded.get(), 0);
    }
}

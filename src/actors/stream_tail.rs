//! `StreamTail`: one actor per backend node group, reading new entries and feeding the Router.
//!
//! Owns: the backend [`Tail`] of its group (for Redis: a dedicated connection running one blocking
//! multi-key XREAD), the per-shard last positions inside it, and its [`TailStatus`].
//! Receives: [`StopTail`] (Shutdown, after the last connection closed).
//! Sends: [`RouteBatch`] to the Router: framed events (each framed once, shared by every
//! connection that gets it) and `resync` frames for shards with a gap.
//! Backpressure: waits on the Router's bounded mailbox (`send().await`); the Router never waits on
//! anything, so there is no cycle.
//! Failures: a tail opens at "now" once, then keeps its positions across backend errors and
//! retries with jittered exponential backoff (reset after a good read), so an outage leaves no gap.
//! Stop: the loop selects on the stop signal, so a read blocked in the backend is abandoned at once.
//! Expiry: events whose `exp` has passed by this pod's clock are dropped before routing and
//! counted (`events_expired_total{path="live"}`): an expired event is never delivered live.
//! Trimming: also applies retention to its group periodically (at least every 30 s), so streams
//! written by external producers stay bounded.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use actix::prelude::*;
use serde::Serialize;
use tokio::sync::watch;

use super::router::{RouteBatch, RoutedEvent, RoutedResync};
use crate::{
    backend::{trim_interval, Backend, StoredEvent, Tail, TailBatch},
    metrics::Metrics,
    model::{unix_ms, Cursor, Position},
    report::Report,
    sse::frame,
    stop::sleep_or_stop,
};

#[derive(Message)]
#[rtype(result = "()")]
pub struct StopTail;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TailState {
    Starting,
    Running,
    Retrying,
    Stopped,
}

/// What `/admin/status` shows of a tail.
#[derive(Debug, Clone, Serialize)]
pub struct TailStatus {
    pub group: usize,
    pub state: TailState,
    /// Last position read per shard, shown as `ms-seq`. Formatted only when the status is read:
    /// the tail updates it after every batch, also the empty ones of an idle stream.
    #[serde(serialize_with = "positions_as_ids")]
    pub last_ids: Vec<(u32, Position)>,
    pub lag_seconds: f64,
    pub batches: u64,
    pub events: u64,
    pub last_error: Option<String>,
}

pub type SharedTailStatus = Arc<Mutex<TailStatus>>;

fn positions_as_ids<S: serde::Serializer>(
    positions: &[(u32, Position)],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(
        positions
            .iter()
            .map(|(shard, position)| (shard, position.to_string())),
    )
}

/// Jittered exponential backoff between retries; reset after a successful read.
#[derive(Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            next: min,
        }
    }

    /// A delay drawn uniformly from [next/2, next], then doubles `next` up to `max`.
    pub fn next_delay(&mut self) -> Duration {
        use rand::Rng;
        let ceiling = self.next;
        self.next = (self.next * 2).min(self.max);
        let low = ceiling / 2;
        low + (ceiling - low).mul_f64(rand::rng().random::<f64>())
    }

    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

pub struct StreamTail {
    group: usize,
    backend: Arc<dyn Backend>,
    router: Recipient<RouteBatch>,
    metrics: Arc<Metrics>,
    status: SharedTailStatus,
    trim_every: Duration,
    /// Flipped to `true` by [`StopTail`]; the read loop selects on it.
    stop: watch::Sender<bool>,
}

impl StreamTail {
    pub fn new(
        group: usize,
        backend: Arc<dyn Backend>,
        router: Recipient<RouteBatch>,
        metrics: Arc<Metrics>,
        retention: Duration,
    ) -> Self {
        let status = Arc::new(Mutex::new(TailStatus {
            group,
            state: TailState::Starting,
            last_ids: Vec::new(),
            lag_seconds: 0.0,
            batches: 0,
            events: 0,
            last_error: None,
        }));
        Self {
            group,
            backend,
            router,
            metrics,
            status,
            trim_every: trim_interval(retention),
            stop: watch::channel(false).0,
        }
    }

    pub fn status(&self) -> SharedTailStatus {
        self.status.clone()
    }
}

impl Actor for StreamTail {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let reader = TailLoop {
            group: self.group,
            backend: self.backend.clone(),
            router: self.router.clone(),
            metrics: self.metrics.clone(),
            status: self.status.clone(),
        };
        // Trimming runs beside the read loop, never inside its select: abandoning a blocked XREAD
        // to trim would lose the entries that read was about to return.
        let trimmer = trim_periodically(
            self.group,
            self.backend.clone(),
            self.trim_every,
            self.stop.subscribe(),
        );
        ctx.spawn(trimmer.into_actor(self));
        let me = ctx.address();
        let stop = self.stop.subscribe();
        actix::spawn(async move {
            reader.run(stop).await;
            me.do_send(TailEnded);
        });
    }
}

/// Sent by the read loop to its own actor when it has ended (stopped, or the Router is gone).
#[derive(Message)]
#[rtype(result = "()")]
struct TailEnded;

impl Handler<TailEnded> for StreamTail {
    type Result = ();

    fn handle(&mut self, _: TailEnded, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

impl Handler<StopTail> for StreamTail {
    type Result = ();

    fn handle(&mut self, _: StopTail, _: &mut Context<Self>) {
        self.stop.send_replace(true);
    }
}

struct TailLoop {
    group: usize,
    backend: Arc<dyn Backend>,
    router: Recipient<RouteBatch>,
    metrics: Arc<Metrics>,
    status: SharedTailStatus,
}

impl TailLoop {
    fn update(&self, change: impl FnOnce(&mut TailStatus)) {
        change(
            &mut self
                .status
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
    }

    async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let mut tail = loop {
            let opened = tokio::select! {
                _ = stop.wait_for(|stopped| *stopped) => return self.update(|s| s.state = TailState::Stopped),
                opened = self.backend.open_tail(self.group) => opened,
            };
            match opened {
                Ok(tail) => break tail,
                Err(error) => {
                    log::warn!(
                        "tail of group {} cannot start: {}",
                        self.group,
                        Report(&error)
                    );
                    self.update(|s| {
                        s.state = TailState::Retrying;
                        s.last_error = Some(Report(&error).to_string());
                    });
                    if sleep_or_stop(backoff.next_delay(), &mut stop).await {
                        return self.update(|s| s.state = TailState::Stopped);
                    }
                }
            }
        };
        backoff.reset();
        self.update(|s| s.state = TailState::Running);
        loop {
            let batch = tokio::select! {
                biased;
                _ = stop.wait_for(|stopped| *stopped) => break,
                batch = tail.next_batch() => batch,
            };
            match batch {
                Ok(batch) => {
                    // Both asked: `reconnected` also clears what the tail noted.
                    if tail.reconnected() | backoff_was_used(&backoff) {
                        self.metrics.tail_reconnected(self.group);
                        log::info!("tail of group {} reconnected", self.group);
                    }
                    backoff.reset();
                    if !self.deliver(batch, &*tail).await {
                        break;
                    }
                }
                Err(error) => {
                    log::warn!("tail of group {} failed: {}", self.group, Report(&error));
                    self.update(|s| {
                        s.state = TailState::Retrying;
                        s.last_error = Some(Report(&error).to_string());
                    });
                    if sleep_or_stop(backoff.next_delay(), &mut stop).await {
                        break;
                    }
                }
            }
        }
        self.update(|s| s.state = TailState::Stopped);
    }

    /// Frames a batch and hands it to the Router; false when the Router is gone.
    async fn deliver(&self, batch: TailBatch, tail: &dyn Tail) -> bool {
        let TailBatch {
            gaps,
            events,
            skipped,
        } = batch;
        if skipped > 0 {
            self.metrics.tail_entries_skipped.inc_by(skipped);
            log::warn!(
                "tail of group {} skipped {skipped} entries with missing or invalid fields",
                self.group
            );
        }
        let newest_ms = events.iter().map(|event| event.appended_ms).max();
        let count = events.len() as u64;
        if count > 0 {
            self.metrics.tail_batch(self.group, events.len());
        }
        let mut events = events;
        let expired = drop_expired(&mut events, unix_ms());
        if expired > 0 {
            self.metrics.events_expired_live.inc_by(expired as u64);
        }
        let events: Vec<RoutedEvent> = events
            .into_iter()
            .map(|event| {
                let id = Cursor::new(event.epoch.clone(), event.shard, event.position).to_string();
                RoutedEvent {
                    frame: frame::event(&id, event.event_type.as_str(), &event.data),
                    shard: event.shard,
                    target: event.target,
                    epoch: event.epoch.id(),
                    position: event.position,
                    appended_ms: event.appended_ms,
                }
            })
            .collect();
        let resyncs: Vec<RoutedResync> = gaps
            .into_iter()
            .map(|gap| {
                log::warn!(
                    "tail of group {} lost entries of shard {} ({}): its connections get resync",
                    self.group,
                    gap.cursor.shard,
                    gap.reason.label()
                );
                RoutedResync {
                    shard: gap.cursor.shard,
                    epoch: gap.cursor.epoch.id(),
                    position: gap.cursor.position,
                    reason: gap.reason,
                    frame: frame::resync(&gap.cursor, gap.reason),
                }
            })
            .collect();
        // An empty read (a BLOCK timeout) means the tail has caught up: no lag.
        let lag = newest_ms.map_or(0.0, |ms| unix_ms().saturating_sub(ms) as f64 / 1000.0);
        self.metrics.tail_lag(self.group, lag);
        let last_ids = tail.last_positions();
        self.update(|s| {
            s.state = TailState::Running;
            s.batches += 1;
            s.events += count;
            s.last_ids = last_ids;
            s.lag_seconds = lag;
        });
        if events.is_empty() && resyncs.is_empty() {
            return true;
        }
        self.router
            .send(RouteBatch { events, resyncs })
            .await
            .is_ok()
    }
}

/// Drops the events whose `exp` has passed at `now_ms` (the pod's clock); returns how many.
fn drop_expired(events: &mut Vec<StoredEvent>, now_ms: u64) -> usize {
    let before = events.len();
    events.retain(|event| !event.expired_at(now_ms));
    before - events.len()
}

async fn trim_periodically(
    group: usize,
    backend: Arc<dyn Backend>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        if sleep_or_stop(every, &mut stop).await {
            // Another pod takes over the group's trimming at once.
            backend.stop_trimming(group).await;
            return;
        }
        if let Err(error) = backend.trim(group).await {
            log::warn!("trimming group {group} failed: {}", Report(&error));
        }
    }
}

fn backoff_was_used(backoff: &Backoff) -> bool {
    backoff.next != backoff.min
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Backoff delays stay within [next/2, next], double up to the cap, and reset.
    #[test]
    fn backoff_grows_with_jitter_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let delays: Vec<Duration> = (0..6).map(|_| backoff.next_delay()).collect();
        let ceilings = [100, 200, 400, 800, 800, 800];
        for (delay, ceiling) in delays.iter().zip(ceilings) {
            let ceiling = Duration::from_millis(ceiling);
            assert!(
                *delay >= ceiling / 2 && *delay <= ceiling,
                "{delay:?} vs {ceiling:?}"
            );
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }

    /// Events expired at the tail's clock are dropped (an `exp` equal to now included); events
    /// without one, or expiring later, stay in order.
    #[test]
    fn expired_events_are_dropped_before_routing() {
        use crate::model::{Epoch, EventType, Target};
        let event = |seq: u64, expires_ms: Option<u64>| StoredEvent {
            shard: 0,
            epoch: Epoch::new("e").unwrap(),
            position: Position::new(1, seq),
            appended_ms: 1,
            target: Target::Broadcast,
            event_type: EventType::message(),
            data: Arc::from("x"),
            expires_ms,
            supersede: None,
        };
        let mut events = vec![
            event(0, None),
            event(1, Some(999)),
            event(2, Some(1_000)),
            event(3, Some(1_001)),
        ];
        assert_eq!(drop_expired(&mut events, 1_000), 2);
        let kept: Vec<u64> = events.iter().map(|event| event.position.seq).collect();
        assert_eq!(kept, [0, 3]);
    }
}

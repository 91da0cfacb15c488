//! `Router`: knows the connections of this pod and hands them their events.
//!
//! Owns: one map per shard from device to its connection's queue sender (the same queue its SSE
//! body drains), plus the rotation that schedules heartbeats and stall checks.
//! Receives: [`Membership`] (joins and leaves of streams, batched per HTTP worker: see
//! `stream/membership.rs`); [`RouteBatch`] from StreamTails (its
//! bounded mailbox is the tails' backpressure); [`Snapshot`] from Shutdown and the
//! status page.
//! Sends: events and pings by `try_send` into connection queues (never a wait, never a mailbox);
//! [`Close`] to a Connection whose queue overflowed (`SlowConsumer`) or that a newer connection of
//! the same device replaced (`Takeover`).
//! Backpressure: a full queue is a slow client, evicted at once. So is a client whose queue has
//! had events waiting for `sse.stall_timeout` without the body taking any (it stopped reading: at
//! low event rates its queue would take minutes to fill), found by a check that visits every
//! connection once per second. The Router itself never awaits.
//! Drain: keeps routing until the last connection has closed; the Shutdown actor stops the tails.
//! Heartbeats and the stall check: one timer for the whole pod, ticking every 25 ms; each tick
//! pings one small slice of the connections and checks a few slices for stalls ([`Rotation`]),
//! so neither comes as a burst and no connection owns a timer.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;
use bytes::Bytes;

use super::rotation::{Member, Rotation};
use crate::{
    metrics::{Metrics, RouteResult},
    model::{CloseReason, DeviceId, EpochId, Position, ResyncReason, Target},
    sse::QueueItem,
    stream::{Change, Close, DrainTarget, Membership, Register, Route, TrySendError, Unregister},
};

/// How often every queue is checked for a stalled client.
const STALL_SWEEP: Duration = Duration::from_secs(1);

/// One framed event from a tail, ready to queue.
#[derive(Debug, Clone)]
pub struct RoutedEvent {
    pub shard: u32,
    pub target: Target,
    pub epoch: EpochId,
    pub position: Position,
    pub frame: Bytes,
}

/// A framed `resync` for every connection of a shard whose tail saw a gap.
#[derive(Debug, Clone)]
pub struct RoutedResync {
    pub shard: u32,
    pub epoch: EpochId,
    pub position: Position,
    pub reason: ResyncReason,
    pub frame: Bytes,
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct RouteBatch {
    pub events: Vec<RoutedEvent>,
    /// Queued before `events`: a tail reports a gap before anything after it.
    pub resyncs: Vec<RoutedResync>,
}

/// Control handles of every connection, in registration order (for a drain).
#[derive(Message)]
#[rtype(result = "Vec<DrainTarget>")]
pub struct Snapshot;

pub struct Router {
    /// Connections per shard, so a broadcast copy visits only the devices of its shard.
    shards: Vec<HashMap<DeviceId, Route>>,
    /// Every connection, in slices: one slice is pinged per tick.
    rotation: Rotation,
    ticks: usize,
    /// Evict a client whose queued events waited this long without progress (zero: never).
    stall_timeout: Duration,
    /// Slices checked for stalls per tick, so that all are checked once per `STALL_SWEEP`.
    stall_slices_per_tick: usize,
    metrics: Arc<Metrics>,
}

impl Router {
    pub fn new(
        shards: u32,
        heartbeat: Duration,
        stall_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let rotation = Rotation::new(heartbeat);
        let stall_slices_per_tick = rotation.slices_per_tick(STALL_SWEEP);
        Self {
            shards: (0..shards).map(|_| HashMap::new()).collect(),
            rotation,
            ticks: 0,
            stall_timeout,
            stall_slices_per_tick,
            metrics,
        }
    }

    /// Queues `item`; a full or closed queue removes the route (and evicts on full).
    fn offer(&mut self, shard: u32, device: &DeviceId, item: QueueItem) -> RouteResult {
        let Some(route) = self.shards[shard as usize].get(device) else {
            return RouteResult::NotConnected;
        };
        match route.queue.try_send(item) {
            Ok(()) => RouteResult::Delivered,
            Err(TrySendError::Full) => {
                self.evict(shard, device);
                RouteResult::QueueFull
            }
            Err(TrySendError::Closed) => {
                self.remove(shard, device);
                RouteResult::Closed
            }
        }
    }

    /// Queues `item` (made anew per connection: a clone of shared bytes) on every connection of
    /// `shard`.
    fn offer_to_shard(&mut self, shard: u32, item: impl Fn() -> QueueItem) {
        let mut delivered = 0;
        let mut overflowed = Vec::new();
        let mut closed = Vec::new();
        for (device, route) in &self.shards[shard as usize] {
            match route.queue.try_send(item()) {
                Ok(()) => delivered += 1,
                Err(TrySendError::Full) => overflowed.push(device.clone()),
                Err(TrySendError::Closed) => closed.push(device.clone()),
            }
        }
        self.metrics.routed(RouteResult::Delivered, delivered);
        self.metrics
            .routed(RouteResult::QueueFull, overflowed.len() as u64);
        self.metrics
            .routed(RouteResult::Closed, closed.len() as u64);
        for device in overflowed {
            self.evict(shard, &device);
        }
        for device in closed {
            self.remove(shard, &device);
        }
    }

    fn evict(&mut self, shard: u32, device: &DeviceId) {
        if let Some(route) = self.remove(shard, device) {
            route
                .control
                .close
                .do_send(Close::now(CloseReason::SlowConsumer));
        }
    }

    fn remove(&mut self, shard: u32, device: &DeviceId) -> Option<Route> {
        self.shards[shard as usize].remove(device)
    }

    /// One tick: pings the next slice, and checks the next few slices for stalled clients.
    fn tick(&mut self) {
        let slices = self.rotation.slices();
        self.ping_slice(self.ticks % slices);
        if !self.stall_timeout.is_zero() {
            let now = Instant::now();
            let first = self.ticks * self.stall_slices_per_tick;
            for index in first..first + self.stall_slices_per_tick {
                self.evict_stalled(index % slices, now);
            }
        }
        self.ticks = self.ticks.wrapping_add(1);
    }

    /// Visits slice `index` of the rotation; `judge` decides for each live route. Members whose
    /// connection is gone leave the rotation.
    fn sweep(&mut self, index: usize, mut judge: impl FnMut(&Route) -> Verdict) {
        let shards = &self.shards;
        let mut evict = Vec::new();
        let mut remove = Vec::new();
        self.rotation.visit(index, |member| {
            let Some(route) = shards[member.shard as usize]
                .get(&member.device)
                .filter(|route| route.connection_id == member.connection_id)
            else {
                return false;
            };
            match judge(route) {
                Verdict::Keep => return true,
                Verdict::Evict => evict.push((member.shard, member.device.clone())),
                Verdict::Remove => remove.push((member.shard, member.device.clone())),
            }
            false
        });
        for (shard, device) in evict {
            self.evict(shard, &device);
        }
        for (shard, device) in remove {
            self.remove(shard, &device);
        }
    }

    fn ping_slice(&mut self, index: usize) {
        self.sweep(index, |route| match route.queue.try_send(QueueItem::Ping) {
            Ok(()) => Verdict::Keep,
            Err(TrySendError::Full) => Verdict::Evict,
            Err(TrySendError::Closed) => Verdict::Remove,
        });
    }

    fn evict_stalled(&mut self, index: usize, now: Instant) {
        let stall_timeout = self.stall_timeout;
        self.sweep(index, |route| {
            let waited = route.queue.stalled_for(now);
            if waited.is_some_and(|waited| waited >= stall_timeout) {
                Verdict::Evict
            } else {
                Verdict::Keep
            }
        });
    }
}

/// What a sweep does with a route.
enum Verdict {
    Keep,
    /// A slow client: closed with `SlowConsumer`.
    Evict,
    /// Its body is gone already.
    Remove,
}

impl Actor for Router {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Tails wait on this mailbox when the Router falls behind; a few batches in flight suffice.
        ctx.set_mailbox_capacity(64);
        ctx.run_interval(self.rotation.tick_interval(), |router, _| router.tick());
    }
}

impl Handler<RouteBatch> for Router {
    type Result = ();

    fn handle(&mut self, batch: RouteBatch, _: &mut Context<Self>) {
        for resync in &batch.resyncs {
            self.offer_to_shard(resync.shard, || QueueItem::Resync {
                epoch: resync.epoch,
                position: resync.position,
                reason: resync.reason,
                frame: resync.frame.clone(),
            });
        }
        for RoutedEvent {
            shard,
            target,
            epoch,
            position,
            frame,
        } in batch.events
        {
            match target {
                Target::Device(device) => {
                    let item = QueueItem::Event {
                        epoch,
                        position,
                        frame,
                    };
                    let result = self.offer(shard, &device, item);
                    self.metrics.routed(result, 1);
                }
                Target::Broadcast => self.offer_to_shard(shard, || QueueItem::Event {
                    epoch,
                    position,
                    frame: frame.clone(),
                }),
            }
        }
    }
}

impl Handler<Membership> for Router {
    type Result = ();

    fn handle(&mut self, Membership(changes): Membership, _: &mut Context<Self>) {
        for change in changes {
            match change {
                Change::Join(register) => self.join(register),
                Change::Leave(unregister) => self.leave(unregister),
            }
        }
    }
}

impl Router {
    fn join(&mut self, register: Register) {
        self.rotation.join(Member {
            shard: register.shard,
            device: register.device.clone(),
            connection_id: register.route.connection_id,
        });
        if let Some(previous) =
            self.shards[register.shard as usize].insert(register.device, register.route)
        {
            previous
                .control
                .close
                .do_send(Close::now(CloseReason::Takeover));
        }
    }

    fn leave(&mut self, unregister: Unregister) {
        let routes = &self.shards[unregister.shard as usize];
        // A connection replaced by a takeover must not remove its successor.
        if routes
            .get(&unregister.device)
            .is_some_and(|route| route.connection_id == unregister.connection_id)
        {
            self.remove(unregister.shard, &unregister.device);
        }
    }
}

impl Handler<Snapshot> for Router {
    type Result = MessageResult<Snapshot>;

    fn handle(&mut self, _: Snapshot, _: &mut Context<Self>) -> Self::Result {
        let mut routes: Vec<&Route> = self.shards.iter().flat_map(HashMap::values).collect();
        routes.sort_by_key(|route| route.connection_id);
        MessageResult(
            routes
                .into_iter()
                .map(|route| route.control.clone())
                .collect(),
        )
    }
}

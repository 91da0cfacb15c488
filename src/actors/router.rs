//! `Router`: knows the connections of this pod and hands them their events.
//!
//! Owns: one map per shard from device to its connection's queue sender (the same queue its SSE
//! body drains), plus the heartbeat schedule.
//! Receives: [`Register`] / [`Unregister`] from Connections; [`RouteBatch`] from StreamTails (its
//! bounded mailbox is the tails' backpressure); [`Snapshot`] from Shutdown and the
//! status page.
//! Sends: events and pings by `try_send` into connection queues (never a wait, never a mailbox);
//! [`Close`] to a Connection whose queue overflowed (`SlowConsumer`) or that a newer connection of
//! the same device replaced (`Takeover`).
//! Backpressure: a full queue is a slow client, evicted at once. So is a client whose queue has
//! had events waiting for `sse.stall_timeout` without the body taking any (it stopped reading: at
//! low event rates its queue would take minutes to fill), found by a sweep once per second. The
//! Router itself never awaits.
//! Drain: keeps routing until the last connection has closed; the Shutdown actor stops the tails.
//! Heartbeats: one timer for the whole pod, ticking ten times per interval and pinging one tenth
//! of the connections each tick, so pings are spread over time and no connection owns a timer.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;
use bytes::Bytes;

use super::{
    close_reason::CloseReason,
    connection::{Close, DrainTarget},
};
use crate::{
    metrics::{Metrics, RouteResult},
    model::{DeviceId, Position, Target},
    sse::{
        queue::{QueueSender, TrySendError},
        QueueItem,
    },
};

const HEARTBEAT_SLICES: u64 = 10;
/// How often queues are checked for stalled clients.
const STALL_SWEEP: Duration = Duration::from_secs(1);

/// One framed event from a tail, ready to queue.
#[derive(Debug, Clone)]
pub struct RoutedEvent {
    pub shard: u32,
    pub target: Target,
    pub position: Position,
    pub frame: Bytes,
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct RouteBatch {
    pub events: Vec<RoutedEvent>,
    /// `resync` frames for every connection of a shard whose tail saw a gap.
    pub resyncs: Vec<RoutedEvent>,
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct Register {
    pub device: DeviceId,
    pub shard: u32,
    pub connection_id: u64,
    pub queue: QueueSender,
    pub control: DrainTarget,
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct Unregister {
    pub device: DeviceId,
    pub shard: u32,
    pub connection_id: u64,
}

/// Control handles of every connection, in registration order (for a drain).
#[derive(Message)]
#[rtype(result = "Vec<DrainTarget>")]
pub struct Snapshot;

struct Route {
    connection_id: u64,
    queue: QueueSender,
    control: DrainTarget,
}

pub struct Router {
    /// Connections per shard, so a broadcast copy visits only the devices of its shard.
    shards: Vec<HashMap<DeviceId, Route>>,
    heartbeat: Duration,
    /// Counts heartbeat slices; connection ids modulo `HEARTBEAT_SLICES` pick their slice.
    heartbeat_tick: u64,
    /// Evict a client whose queued events waited this long without progress (zero: never).
    stall_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Router {
    pub fn new(
        shards: u32,
        heartbeat: Duration,
        stall_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            shards: (0..shards).map(|_| HashMap::new()).collect(),
            heartbeat,
            heartbeat_tick: 0,
            stall_timeout,
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

    fn offer_to_shard(&mut self, event: &RoutedEvent) {
        let shard = event.shard as usize;
        let mut delivered = 0;
        let mut overflowed = Vec::new();
        let mut closed = Vec::new();
        for (device, route) in &self.shards[shard] {
            let item = QueueItem::Event {
                position: event.position,
                frame: event.frame.clone(),
            };
            match route.queue.try_send(item) {
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
            self.evict(event.shard, &device);
        }
        for device in closed {
            self.remove(event.shard, &device);
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

    fn evict_stalled(&mut self) {
        let now = Instant::now();
        let mut stalled = Vec::new();
        for (shard, routes) in self.shards.iter().enumerate() {
            for (device, route) in routes {
                if route
                    .queue
                    .stalled_for(now)
                    .is_some_and(|waited| waited >= self.stall_timeout)
                {
                    stalled.push((shard as u32, device.clone()));
                }
            }
        }
        for (shard, device) in stalled {
            self.evict(shard, &device);
        }
    }

    fn ping_slice(&mut self) {
        let slice = self.heartbeat_tick % HEARTBEAT_SLICES;
        self.heartbeat_tick += 1;
        let mut overflowed = Vec::new();
        let mut closed = Vec::new();
        for (shard, routes) in self.shards.iter().enumerate() {
            for (device, route) in routes {
                if route.connection_id % HEARTBEAT_SLICES != slice {
                    continue;
                }
                match route.queue.try_send(QueueItem::Ping) {
                    Ok(()) => {}
                    Err(TrySendError::Full) => overflowed.push((shard as u32, device.clone())),
                    Err(TrySendError::Closed) => closed.push((shard as u32, device.clone())),
                }
            }
        }
        for (shard, device) in overflowed {
            self.evict(shard, &device);
        }
        for (shard, device) in closed {
            self.remove(shard, &device);
        }
    }
}

impl Actor for Router {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Tails wait on this mailbox when the Router falls behind; a few batches in flight suffice.
        ctx.set_mailbox_capacity(64);
        ctx.run_interval(self.heartbeat / HEARTBEAT_SLICES as u32, |router, _| {
            router.ping_slice()
        });
        if !self.stall_timeout.is_zero() {
            ctx.run_interval(STALL_SWEEP, |router, _| router.evict_stalled());
        }
    }
}

impl Handler<RouteBatch> for Router {
    type Result = ();

    fn handle(&mut self, batch: RouteBatch, _: &mut Context<Self>) {
        for resync in &batch.resyncs {
            self.offer_to_shard(resync);
        }
        for event in batch.events {
            match &event.target {
                Target::Device(device) => {
                    let item = QueueItem::Event {
                        position: event.position,
                        frame: event.frame,
                    };
                    let result = self.offer(event.shard, device, item);
                    self.metrics.routed(result, 1);
                }
                Target::Broadcast => self.offer_to_shard(&event),
            }
        }
    }
}

impl Handler<Register> for Router {
    type Result = ();

    fn handle(&mut self, register: Register, _: &mut Context<Self>) {
        let route = Route {
            connection_id: register.connection_id,
            queue: register.queue,
            control: register.control,
        };
        if let Some(previous) = self.shards[register.shard as usize].insert(register.device, route)
        {
            previous
                .control
                .close
                .do_send(Close::now(CloseReason::Takeover));
        }
    }
}

impl Handler<Unregister> for Router {
    type Result = ();

    fn handle(&mut self, unregister: Unregister, _: &mut Context<Self>) {
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

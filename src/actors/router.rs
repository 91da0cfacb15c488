//! `Router`: knows the connections of this pod and hands them their events.
//!
//! Owns: one map per shard from device to its connection's queue sender (the same queue its SSE
//! body drains), one index per shard from group to its connected members (a group event visits
//! its members only), plus the rotation that schedules heartbeats and stall checks.
//! Receives: [`Membership`] (joins and leaves of streams, batched per HTTP worker: see
//! `stream/membership.rs`); [`RouteBatch`] from StreamTails (its
//! bounded mailbox is the tails' backpressure); [`Snapshot`] from Shutdown and the
//! status page.
//! Sends: events and pings into connection queues (`QueueSender::offer`: never a wait, never a
//! mailbox; the bodies' wakes go to their workers in batches, `stream/queue.rs`);
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
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;
use bytes::Bytes;

use super::{
    deadlines::Deadlines,
    fleet::{SessionChange, SessionChanges},
    rotation::Rotation,
};
use crate::{
    backend::{fleet::RACE_WINDOW, revocation::Revoked},
    metrics::{Metrics, RouteResult},
    model::{
        shard_of, unix_ms, CloseReason, DeviceId, EpochId, GroupName, Groups, Position,
        ResyncReason, Target,
    },
    sse::QueueItem,
    stream::{
        Change, Close, DrainTarget, Membership, QueueWatch, Register, Route, TrySendError,
        Unregister, Waiting, WakeBatch,
    },
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
    pub appended_ms: u64,
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

/// Hands the joins and leaves of streams to the Fleet actor from now on, and names this
/// pod's instance for takeovers across pods.
#[derive(Message)]
#[rtype(result = "()")]
pub struct AttachFleet {
    pub fleet: Recipient<SessionChanges>,
    pub instance: String,
}

/// Another pod announced a stream of `device` opened at `opened_ms`: the stream of it here
/// closes (`takeover`) unless both opened within [`RACE_WINDOW`] of each other and ours ranks
/// higher by `(opened_ms, instance, session)`: every pod compares the same two triples, so of two
/// streams opened at once on two pods exactly one survives.
#[derive(Message)]
#[rtype(result = "()")]
pub struct CloseOlder {
    pub device: DeviceId,
    pub shard: u32,
    pub opened_ms: u64,
    pub instance: String,
    pub session: u64,
}

/// The tokens of `device` issued until `at_ms` are revoked: its streams that came with such a
/// token (or with none, auth `none`) close with `event: revoked`.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct CloseRevoked {
    pub device: DeviceId,
    pub at_ms: u64,
}

/// What the rotation keeps of a connection.
#[derive(Debug)]
struct Member {
    shard: u32,
    device: DeviceId,
    connection_id: u64,
    queue: QueueWatch,
}

/// Control handles of every connection, in registration order (for a drain).
#[derive(Message)]
#[rtype(result = "Vec<DrainTarget>")]
pub struct Snapshot;

pub struct Router {
    /// Connections per shard, so a broadcast copy visits only the devices of its shard.
    shards: Vec<HashMap<DeviceId, Route>>,
    /// Per shard, the devices of each group with a route in `shards` (a route's groups are its
    /// credential's), so a group event costs its connected members, not the shard.
    members: Vec<HashMap<GroupName, HashSet<DeviceId>>>,
    /// Every connection, in slices: one slice is pinged per tick.
    rotation: Rotation<Member>,
    ticks: usize,
    /// Evict a client whose queued events waited this long without progress (zero: never).
    stall_timeout: Duration,
    /// Slices checked for stalls per tick, so that all are checked once per `STALL_SWEEP`.
    stall_slices_per_tick: usize,
    metrics: Arc<Metrics>,
    /// Where joins and leaves go for presence, and this pod's instance.
    fleet: Option<AttachFleet>,
    /// When the streams that came with a token must end.
    deadlines: Deadlines,
    /// The pod's view of the revocations: a stream that registers with a revoked token (its
    /// check passed just before the revocation was known) closes at once.
    revoked: Arc<Revoked>,
}

/// How a Router ends streams whose token ends: `auth.leeway` after `exp`, and at revocations.
pub struct TokenRules {
    pub leeway: Duration,
    pub revoked: Arc<Revoked>,
}

/// The default leeway, and no revocation.
impl Default for TokenRules {
    fn default() -> Self {
        Self {
            leeway: Duration::from_secs(30),
            revoked: Revoked::new(),
        }
    }
}

impl Router {
    pub fn new(
        shards: u32,
        heartbeat: Duration,
        stall_timeout: Duration,
        metrics: Arc<Metrics>,
        tokens: TokenRules,
    ) -> Self {
        let rotation = Rotation::new(heartbeat);
        let stall_slices_per_tick = rotation.slices_per_tick(STALL_SWEEP);
        Self {
            shards: (0..shards).map(|_| HashMap::new()).collect(),
            members: (0..shards).map(|_| HashMap::new()).collect(),
            rotation,
            ticks: 0,
            stall_timeout,
            stall_slices_per_tick,
            metrics,
            fleet: None,
            deadlines: Deadlines::new(tokens.leeway.as_millis() as u64),
            revoked: tokens.revoked,
        }
    }

    /// Queues `item`; a full or closed queue removes the route (and evicts on full). The body's
    /// wake goes into `wakes`, done by its worker once the batch is handed over.
    fn offer(
        &mut self,
        shard: u32,
        device: &DeviceId,
        item: QueueItem,
        wakes: &mut WakeBatch,
    ) -> RouteResult {
        let Some(route) = self.shards[shard as usize].get(device) else {
            return RouteResult::NotConnected;
        };
        match route.queue.offer(item, wakes) {
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
    fn offer_to_shard(&mut self, shard: u32, item: impl Fn() -> QueueItem, wakes: &mut WakeBatch) {
        let offered = offer_each(self.shards[shard as usize].iter(), item, wakes);
        self.settle(shard, offered);
    }

    /// Queues `item` on every connection of `shard` whose device is a member of `group`.
    fn offer_to_group(
        &mut self,
        shard: u32,
        group: &GroupName,
        item: impl Fn() -> QueueItem,
        wakes: &mut WakeBatch,
    ) {
        let Some(members) = self.members[shard as usize].get(group) else {
            return;
        };
        let routes = &self.shards[shard as usize];
        let connected = members
            .iter()
            .filter_map(|device| routes.get_key_value(device));
        let offered = offer_each(connected, item, wakes);
        self.settle(shard, offered);
    }

    /// Counts what `offer_each` did and lets go of the connections it could not reach: a full
    /// queue is a slow client (evicted), a closed one a stream already gone.
    fn settle(&mut self, shard: u32, offered: Offered) {
        self.metrics
            .routed(RouteResult::Delivered, offered.delivered);
        self.metrics
            .routed(RouteResult::QueueFull, offered.overflowed.len() as u64);
        self.metrics
            .routed(RouteResult::Closed, offered.closed.len() as u64);
        for device in offered.overflowed {
            self.evict(shard, &device);
        }
        for device in offered.closed {
            self.remove(shard, &device);
        }
    }

    /// Makes `device` a connected member of each of `groups`.
    fn index_groups(&mut self, shard: u32, device: &DeviceId, groups: &Groups) {
        let members = &mut self.members[shard as usize];
        for group in groups.iter() {
            members
                .entry(group.clone())
                .or_default()
                .insert(device.clone());
        }
    }

    /// Takes `device` out of each of `groups` but those of `keep` (its successor's).
    fn unindex_groups(&mut self, shard: u32, device: &DeviceId, groups: &Groups, keep: &Groups) {
        let members = &mut self.members[shard as usize];
        for group in groups.iter().filter(|group| !keep.contains(group)) {
            if let Some(devices) = members.get_mut(group) {
                devices.remove(device);
                if devices.is_empty() {
                    members.remove(group);
                }
            }
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
        let route = self.shards[shard as usize].remove(device)?;
        self.forget_deadline(&route);
        self.unindex_groups(shard, device, &route.credential.groups, &Groups::default());
        Some(route)
    }

    fn forget_deadline(&mut self, route: &Route) {
        if let Some(exp) = route.credential.expires {
            self.deadlines.remove(route.connection_id, exp);
        }
    }

    /// Ends the route of `device` (if it is still `connection_id`'s) with `close`.
    fn close_route(&mut self, shard: u32, device: &DeviceId, connection_id: u64, close: Close) {
        let current = self.shards[shard as usize]
            .get(device)
            .is_some_and(|route| route.connection_id == connection_id);
        if current {
            if let Some(route) = self.remove(shard, device) {
                route.control.close.do_send(close);
            }
        }
    }

    /// Ends the streams whose token ended.
    fn expire_tokens(&mut self) {
        if self.deadlines.is_empty() {
            return;
        }
        for due in self.deadlines.take_due(unix_ms()) {
            self.close_route(
                due.shard,
                &due.device,
                due.connection_id,
                Close::token_expired(due.exp),
            );
        }
    }

    /// One tick: pings the next slice, checks the next few slices for stalled clients, and ends
    /// the streams whose token ended.
    fn tick(&mut self) {
        self.expire_tokens();
        let slices = self.rotation.slices();
        let now = Instant::now();
        self.ping_slice(self.ticks % slices, now);
        if !self.stall_timeout.is_zero() {
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

    /// Pings the streams of slice `index` that wrote nothing for half a heartbeat: one that
    /// carries events needs no ping to stay alive, and each ping is a wake-up and a write. A
    /// slice is visited once per heartbeat, so a stream is never silent for more than 1.5
    /// heartbeats (docs/http-api.md, Heartbeats).
    fn ping_slice(&mut self, index: usize, now: Instant) {
        let quiet_enough = self.rotation.period() / 2;
        let mut wakes = WakeBatch::default();
        self.sweep(index, |route| {
            if route.progress.quiet_for(now) < quiet_enough {
                return Verdict::Keep;
            }
            match route.queue.offer(QueueItem::Ping, &mut wakes) {
                Ok(()) => Verdict::Keep,
                Err(TrySendError::Full) => Verdict::Evict,
                Err(TrySendError::Closed) => Verdict::Remove,
            }
        });
    }

    /// Evicts the streams of slice `index` whose queues have stalled. Runs for every stream once
    /// a second, so it asks each queue directly and looks a route up only to evict it.
    fn evict_stalled(&mut self, index: usize, now: Instant) {
        let stall_timeout = self.stall_timeout;
        let mut stalled = Vec::new();
        self.rotation
            .visit(index, |member| match member.queue.waiting(now) {
                Waiting::BodyGone => false,
                Waiting::For(waited) if waited >= stall_timeout => {
                    stalled.push((member.shard, member.device.clone(), member.connection_id));
                    false
                }
                Waiting::For(_) | Waiting::Nothing => true,
            });
        for (shard, device, connection_id) in stalled {
            // Not the stream of another connection that took the device over since.
            let current = self.shards[shard as usize]
                .get(&device)
                .is_some_and(|route| route.connection_id == connection_id);
            if current {
                self.evict(shard, &device);
            }
        }
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
        // Dropped at the end: every wake owed is handed to its worker.
        let mut wakes = WakeBatch::default();
        for resync in &batch.resyncs {
            self.offer_to_shard(
                resync.shard,
                || QueueItem::Resync {
                    epoch: resync.epoch,
                    position: resync.position,
                    reason: resync.reason,
                    frame: resync.frame.clone(),
                },
                &mut wakes,
            );
        }
        for RoutedEvent {
            shard,
            target,
            epoch,
            position,
            appended_ms,
            frame,
        } in batch.events
        {
            match target {
                Target::Device(device) => {
                    let item = QueueItem::Event {
                        epoch,
                        position,
                        appended_ms,
                        frame,
                    };
                    let result = self.offer(shard, &device, item, &mut wakes);
                    self.metrics.routed(result, 1);
                }
                Target::Broadcast => self.offer_to_shard(
                    shard,
                    || QueueItem::Event {
                        epoch,
                        position,
                        appended_ms,
                        frame: frame.clone(),
                    },
                    &mut wakes,
                ),
                Target::Group(group) => self.offer_to_group(
                    shard,
                    &group,
                    || QueueItem::Event {
                        epoch,
                        position,
                        appended_ms,
                        frame: frame.clone(),
                    },
                    &mut wakes,
                ),
            }
        }
    }
}

impl Handler<Membership> for Router {
    type Result = ();

    fn handle(&mut self, Membership(changes): Membership, _: &mut Context<Self>) {
        let mut sessions = Vec::new();
        for change in changes {
            match change {
                Change::Join(mut register) => {
                    if self.fleet.is_some() {
                        sessions.push(SessionChange::Opened {
                            device: register.device.clone(),
                            connection_id: register.route.connection_id,
                            opened_ms: register.route.opened_ms,
                            // The Router keeps nothing of it.
                            peer: std::mem::take(&mut register.peer),
                            progress: register.route.progress.clone(),
                        });
                    }
                    self.join(register);
                }
                Change::Leave(unregister) => {
                    if self.fleet.is_some() {
                        sessions.push(SessionChange::Closed {
                            device: unregister.device.clone(),
                            connection_id: unregister.connection_id,
                            at_ms: unregister.at_ms,
                            last_sent: unregister.last_sent.clone(),
                        });
                    }
                    self.leave(unregister);
                }
            }
        }
        if let Some(fleet) = self.fleet.as_ref().filter(|_| !sessions.is_empty()) {
            fleet.fleet.do_send(SessionChanges(sessions));
        }
    }
}

impl Handler<AttachFleet> for Router {
    type Result = ();

    fn handle(&mut self, attach: AttachFleet, _: &mut Context<Self>) {
        self.fleet = Some(attach);
    }
}

impl Handler<CloseRevoked> for Router {
    type Result = ();

    fn handle(&mut self, revoked: CloseRevoked, _: &mut Context<Self>) {
        let shard = shard_of(revoked.device.as_str(), self.shards.len() as u32);
        let Some(route) = self.shards[shard as usize].get(&revoked.device) else {
            return;
        };
        // Without a token (auth `none`) the stream closes too: there is nothing else to end.
        let covered = !route.credential.has_token() || route.credential.revoked_by(revoked.at_ms);
        if covered {
            let connection_id = route.connection_id;
            self.close_route(
                shard,
                &revoked.device,
                connection_id,
                Close::revoked(revoked.at_ms / 1000),
            );
        }
    }
}

impl Handler<CloseOlder> for Router {
    type Result = ();

    fn handle(&mut self, newer: CloseOlder, _: &mut Context<Self>) {
        let Some(instance) = self.fleet.as_ref().map(|fleet| fleet.instance.as_str()) else {
            return;
        };
        let Some(route) = self.shards[newer.shard as usize].get(&newer.device) else {
            return;
        };
        let race = route.opened_ms.abs_diff(newer.opened_ms) < RACE_WINDOW.as_millis() as u64;
        let ours = (route.opened_ms, instance, route.connection_id);
        if !race || ours < (newer.opened_ms, newer.instance.as_str(), newer.session) {
            if let Some(route) = self.remove(newer.shard, &newer.device) {
                route
                    .control
                    .close
                    .do_send(Close::now(CloseReason::Takeover));
            }
        }
    }
}

impl Router {
    fn join(&mut self, register: Register) {
        let (shard, connection_id, credential) = (
            register.shard,
            register.route.connection_id,
            register.route.credential.clone(),
        );
        self.rotation.join(Member {
            shard,
            device: register.device.clone(),
            connection_id,
            queue: register.route.queue.watch(),
        });
        if let Some(exp) = credential.expires {
            self.deadlines
                .insert(shard, register.device.clone(), connection_id, exp);
        }
        let device = register.device.clone();
        self.index_groups(shard, &device, &credential.groups);
        if let Some(previous) = self.shards[shard as usize].insert(register.device, register.route)
        {
            self.forget_deadline(&previous);
            self.unindex_groups(
                shard,
                &device,
                &previous.credential.groups,
                &credential.groups,
            );
            previous
                .control
                .close
                .do_send(Close::now(CloseReason::Takeover));
        }
        if credential.has_token() {
            if let Some(at_ms) = self
                .revoked
                .of(device.as_str())
                .filter(|at_ms| credential.revoked_by(*at_ms))
            {
                self.close_route(shard, &device, connection_id, Close::revoked(at_ms / 1000));
            }
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

/// What offering one item to a set of connections did.
struct Offered {
    delivered: u64,
    overflowed: Vec<DeviceId>,
    closed: Vec<DeviceId>,
}

/// Offers `item` to each of `routes`; the Router settles the outcome once the borrow of its
/// maps has ended.
fn offer_each<'a>(
    routes: impl Iterator<Item = (&'a DeviceId, &'a Route)>,
    item: impl Fn() -> QueueItem,
    wakes: &mut WakeBatch,
) -> Offered {
    let mut offered = Offered {
        delivered: 0,
        overflowed: Vec::new(),
        closed: Vec::new(),
    };
    for (device, route) in routes {
        match route.queue.offer(item(), wakes) {
            Ok(()) => offered.delivered += 1,
            Err(TrySendError::Full) => offered.overflowed.push(device.clone()),
            Err(TrySendError::Closed) => offered.closed.push(device.clone()),
        }
    }
    offered
}

#[cfg(test)]
mod tests {
    use std::{
        sync::Mutex,
        task::{Context as TaskContext, Poll, Waker},
    };

    use prometheus::Registry;

    use super::*;
    use crate::{
        model::Epoch,
        stream::{
            queue::{self, QueueReceiver},
            AnnounceRetry, Progress,
        },
    };

    /// Closes received by the peers, in order: (connection id, reason).
    type CloseLog = Arc<Mutex<Vec<(u64, CloseReason)>>>;

    /// Stands in for a Connection: logs the closes it is sent.
    struct Peer {
        connection_id: u64,
        log: CloseLog,
    }

    impl Actor for Peer {
        type Context = Context<Self>;
    }

    impl Handler<Close> for Peer {
        type Result = ();

        fn handle(&mut self, close: Close, _: &mut Context<Self>) {
            self.log
                .lock()
                .unwrap()
                .push((self.connection_id, close.reason));
        }
    }

    impl Handler<AnnounceRetry> for Peer {
        type Result = ();

        fn handle(&mut self, _: AnnounceRetry, _: &mut Context<Self>) {}
    }

    /// Answered after everything sent to the peer before it.
    #[derive(Message)]
    #[rtype(result = "()")]
    struct Flush;

    impl Handler<Flush> for Peer {
        type Result = ();

        fn handle(&mut self, _: Flush, _: &mut Context<Self>) {}
    }

    /// A connection as the Router sees it, from the body's side.
    struct Conn {
        id: u64,
        device: DeviceId,
        shard: u32,
        queue: QueueReceiver,
        progress: Progress,
    }

    impl Conn {
        /// What is queued, described.
        fn take(&mut self) -> Vec<String> {
            let mut context = TaskContext::from_waker(Waker::noop());
            let mut items = Vec::new();
            while let Poll::Ready(Some(item)) = self.queue.poll_recv(&mut context) {
                items.push(match item {
                    QueueItem::Event { position, .. } => format!("event {}", position.seq),
                    QueueItem::Resync { reason, .. } => format!("resync {}", reason.label()),
                    QueueItem::Ping => "ping".into(),
                    other => format!("{other:?}"),
                });
            }
            items
        }
    }

    /// A Router driven by direct calls of its handlers (no timer runs), with peers for its
    /// connections.
    struct Fixture {
        router: Router,
        /// Never run: the handlers under test do not use it.
        context: Context<Router>,
        metrics: Arc<Metrics>,
        peers: Vec<Addr<Peer>>,
        closes: CloseLog,
        next_id: u64,
    }

    impl Fixture {
        fn new(shards: u32) -> Self {
            Self::with(shards, Duration::from_secs(20), Duration::ZERO)
        }

        fn with(shards: u32, heartbeat: Duration, stall_timeout: Duration) -> Self {
            let metrics = Arc::new(Metrics::new(Registry::new(), "memory"));
            Self {
                router: Router::new(
                    shards,
                    heartbeat,
                    stall_timeout,
                    metrics.clone(),
                    TokenRules::default(),
                ),
                context: Context::new(),
                metrics,
                peers: Vec::new(),
                closes: CloseLog::default(),
                next_id: 0,
            }
        }

        /// A new connection of `device` (its register, not yet sent) with a queue of `limit`.
        fn connection(&mut self, device: &str, shard: u32, limit: usize) -> (Register, Conn) {
            let id = self.next_id;
            self.next_id += 1;
            let peer = Peer {
                connection_id: id,
                log: self.closes.clone(),
            }
            .start();
            self.peers.push(peer.clone());
            let (sender, receiver) = queue::channel(limit);
            let device = DeviceId::parse(device).unwrap();
            let progress = Progress::default();
            let register = Register {
                device: device.clone(),
                shard,
                route: Route {
                    connection_id: id,
                    queue: sender,
                    control: DrainTarget {
                        announce: peer.clone().recipient(),
                        close: peer.recipient(),
                    },
                    opened_ms: 0,
                    progress: progress.clone(),
                    credential: Default::default(),
                },
                peer: Default::default(),
            };
            let conn = Conn {
                id,
                device,
                shard,
                queue: receiver,
                progress,
            };
            (register, conn)
        }

        /// Connects `device` as a member of `groups` (comma-separated).
        fn connect_in(&mut self, device: &str, shard: u32, limit: usize, groups: &str) -> Conn {
            let (mut register, conn) = self.connection(device, shard, limit);
            register.route.credential.groups = Groups::parse_list(groups).unwrap();
            self.membership(vec![Change::Join(register)]);
            conn
        }

        fn membership(&mut self, changes: Vec<Change>) {
            Handler::<Membership>::handle(&mut self.router, Membership(changes), &mut self.context);
        }

        fn connect(&mut self, device: &str, shard: u32, limit: usize) -> Conn {
            let (register, conn) = self.connection(device, shard, limit);
            self.membership(vec![Change::Join(register)]);
            conn
        }

        fn leave(&mut self, conn: &Conn) {
            self.membership(vec![Change::Leave(unregister(conn))]);
        }

        fn route(&mut self, events: Vec<RoutedEvent>, resyncs: Vec<RoutedResync>) {
            Handler::<RouteBatch>::handle(
                &mut self.router,
                RouteBatch { events, resyncs },
                &mut self.context,
            );
        }

        fn unicast(&mut self, conn: &Conn, seq: u64) {
            let event = unicast(conn.shard, conn.device.as_str(), seq);
            self.route(vec![event], Vec::new());
        }

        fn snapshot(&mut self) -> Vec<DrainTarget> {
            Handler::<Snapshot>::handle(&mut self.router, Snapshot, &mut self.context).0
        }

        /// The closes the peers received so far.
        async fn closes(&self) -> Vec<(u64, CloseReason)> {
            for peer in &self.peers {
                peer.send(Flush).await.unwrap();
            }
            self.closes.lock().unwrap().clone()
        }

        /// `router_events_total{result}`.
        fn routed(&self, result: RouteResult) -> u64 {
            let series = format!("router_events_total{{result=\"{}\"}} ", result.label());
            self.metrics
                .render()
                .lines()
                .find_map(|line| line.strip_prefix(&series))
                .map_or(0, |value| value.parse().unwrap())
        }
    }

    fn unregister(conn: &Conn) -> Unregister {
        Unregister {
            device: conn.device.clone(),
            shard: conn.shard,
            connection_id: conn.id,
            at_ms: 0,
            last_sent: None,
        }
    }

    fn alpha() -> EpochId {
        Epoch::new("alpha").unwrap().id()
    }

    fn unicast(shard: u32, device: &str, seq: u64) -> RoutedEvent {
        RoutedEvent {
            shard,
            target: Target::Device(DeviceId::parse(device).unwrap()),
            epoch: alpha(),
            position: Position::new(1, seq),
            appended_ms: 1,
            frame: Bytes::from(format!("unicast {seq}")),
        }
    }

    fn broadcast(shard: u32, seq: u64, frame: &Bytes) -> RoutedEvent {
        RoutedEvent {
            shard,
            target: Target::Broadcast,
            epoch: alpha(),
            position: Position::new(1, seq),
            appended_ms: 1,
            frame: frame.clone(),
        }
    }

    fn group_event(shard: u32, group: &str, seq: u64) -> RoutedEvent {
        RoutedEvent {
            target: Target::Group(GroupName::parse(group).unwrap()),
            ..unicast(shard, "unused", seq)
        }
    }

    fn resync(shard: u32, reason: ResyncReason) -> RoutedResync {
        RoutedResync {
            shard,
            epoch: alpha(),
            position: Position::new(1, 0),
            reason,
            frame: Bytes::from_static(b"resync"),
        }
    }

    #[actix_rt::test]
    async fn a_joined_connection_is_routed_until_it_leaves() {
        let mut fixture = Fixture::new(2);
        let mut conn = fixture.connect("pos-1", 1, 8);
        fixture.unicast(&conn, 1);
        assert_eq!(conn.take(), ["event 1"]);
        fixture.leave(&conn);
        fixture.unicast(&conn, 2);
        assert!(conn.take().is_empty());
        assert_eq!(fixture.routed(RouteResult::Delivered), 1);
        assert_eq!(fixture.routed(RouteResult::NotConnected), 1);
        assert!(fixture.snapshot().is_empty());
        assert!(fixture.closes().await.is_empty(), "a leave closes nothing");
    }

    #[actix_rt::test]
    async fn a_unicast_reaches_its_device_only() {
        let mut fixture = Fixture::new(2);
        let mut first = fixture.connect("pos-1", 0, 8);
        let mut second = fixture.connect("pos-2", 0, 8);
        let mut other_shard = fixture.connect("pos-3", 1, 8);
        fixture.unicast(&second, 7);
        assert!(first.take().is_empty());
        assert_eq!(second.take(), ["event 7"]);
        assert!(other_shard.take().is_empty());
        // A device with no connection on this pod.
        fixture.route(vec![unicast(0, "pos-9", 8)], Vec::new());
        assert_eq!(fixture.routed(RouteResult::NotConnected), 1);
        assert_eq!(fixture.routed(RouteResult::Delivered), 1);
    }

    /// A broadcast copy goes to every connection of its shard, as the same shared bytes.
    #[actix_rt::test]
    async fn a_broadcast_reaches_every_connection_of_its_shard_only() {
        let mut fixture = Fixture::new(2);
        let mut conns: Vec<Conn> = ["pos-1", "pos-2", "pos-3"]
            .into_iter()
            .map(|device| fixture.connect(device, 0, 8))
            .collect();
        let mut other_shard = fixture.connect("pos-4", 1, 8);
        let frame = Bytes::from_static(b"framed once");
        fixture.route(vec![broadcast(0, 3, &frame)], Vec::new());
        let mut context = TaskContext::from_waker(Waker::noop());
        for conn in &mut conns {
            match conn.queue.poll_recv(&mut context) {
                Poll::Ready(Some(QueueItem::Event {
                    frame: queued,
                    position,
                    ..
                })) => {
                    assert_eq!(position.seq, 3);
                    assert_eq!(queued.as_ptr(), frame.as_ptr(), "not a copy");
                }
                other => panic!("expected the broadcast, got {other:?}"),
            }
        }
        assert!(other_shard.take().is_empty());
        assert_eq!(fixture.routed(RouteResult::Delivered), 3);
    }

    /// A group event reaches the connections of its shard whose device is a member, and
    /// follows membership: a takeover with other groups moves the device between them, the
    /// predecessor's late leave keeps the successor's, and the last leave empties the index.
    #[actix_rt::test]
    async fn a_group_event_reaches_the_members_of_its_shard_only() {
        let mut fixture = Fixture::new(2);
        let mut member = fixture.connect_in("pos-1", 0, 8, "store-17,merchant-9");
        let mut other = fixture.connect_in("pos-2", 0, 8, "store-18");
        let mut alone = fixture.connect("pos-3", 0, 8);
        let mut member_elsewhere = fixture.connect_in("pos-4", 1, 8, "store-17");
        fixture.route(vec![group_event(0, "store-17", 1)], Vec::new());
        assert_eq!(member.take(), ["event 1"]);
        assert!(other.take().is_empty());
        assert!(alone.take().is_empty());
        assert!(member_elsewhere.take().is_empty(), "another shard's copy");
        assert_eq!(fixture.routed(RouteResult::Delivered), 1);

        let mut successor = fixture.connect_in("pos-1", 0, 8, "merchant-9");
        fixture.route(
            vec![
                group_event(0, "store-17", 2),
                group_event(0, "merchant-9", 3),
            ],
            Vec::new(),
        );
        assert_eq!(successor.take(), ["event 3"]);
        assert!(member.take().is_empty());
        fixture.leave(&member);
        fixture.route(vec![group_event(0, "merchant-9", 4)], Vec::new());
        assert_eq!(successor.take(), ["event 4"]);

        for conn in [&successor, &other, &member_elsewhere] {
            fixture.leave(conn);
        }
        assert!(
            fixture.router.members.iter().all(HashMap::is_empty),
            "{:?}",
            fixture.router.members
        );
    }

    /// A full queue is a slow client: its route goes at once, and its Connection is closed.
    #[actix_rt::test]
    async fn a_full_queue_evicts_the_connection() {
        let mut fixture = Fixture::new(2);
        let mut slow = fixture.connect("pos-1", 0, 1);
        let mut fast = fixture.connect("pos-2", 0, 8);
        fixture.unicast(&slow, 1);
        fixture.unicast(&slow, 2);
        assert_eq!(
            fixture.closes().await,
            [(slow.id, CloseReason::SlowConsumer)]
        );
        fixture.unicast(&slow, 3);
        assert_eq!(slow.take(), ["event 1"], "nothing after the overflow");
        assert_eq!(fixture.routed(RouteResult::QueueFull), 1);
        assert_eq!(fixture.routed(RouteResult::NotConnected), 1);

        // The same for a broadcast copy; the others still get theirs.
        let mut slow = fixture.connect("pos-3", 1, 1);
        let mut fast_too = fixture.connect("pos-4", 1, 8);
        fixture.unicast(&slow, 4);
        let frame = Bytes::from_static(b"b");
        fixture.route(vec![broadcast(1, 5, &frame)], Vec::new());
        assert_eq!(fast_too.take(), ["event 5"]);
        assert_eq!(slow.take(), ["event 4"]);
        assert_eq!(
            fixture.closes().await.last(),
            Some(&(slow.id, CloseReason::SlowConsumer))
        );
        fixture.route(vec![broadcast(1, 6, &frame)], Vec::new());
        assert!(slow.take().is_empty(), "evicted from the shard");
        assert_eq!(fast_too.take(), ["event 6"]);
        assert!(fast.take().is_empty());
        assert_eq!(fixture.routed(RouteResult::QueueFull), 2);
        assert_eq!(fixture.snapshot().len(), 2);
    }

    /// A connection whose body is gone is removed, without a close (it is closing already).
    #[actix_rt::test]
    async fn a_closed_queue_removes_the_route_without_a_close() {
        let mut fixture = Fixture::new(1);
        let gone = fixture.connect("pos-1", 0, 8);
        drop(gone.queue);
        fixture.route(vec![unicast(0, "pos-1", 1)], Vec::new());
        assert_eq!(fixture.routed(RouteResult::Closed), 1);
        fixture.route(vec![unicast(0, "pos-1", 2)], Vec::new());
        assert_eq!(fixture.routed(RouteResult::NotConnected), 1);
        assert!(fixture.closes().await.is_empty());
        assert!(fixture.snapshot().is_empty());
    }

    /// A second stream of the same device takes over: the first is closed, and its late leave
    /// does not remove the second.
    #[actix_rt::test]
    async fn a_takeover_closes_the_first_and_keeps_the_second() {
        let mut fixture = Fixture::new(1);
        let (first_register, mut first) = fixture.connection("pos-1", 0, 8);
        let (second_register, mut second) = fixture.connection("pos-1", 0, 8);
        fixture.membership(vec![
            Change::Join(first_register),
            Change::Join(second_register),
        ]);
        assert_eq!(fixture.closes().await, [(first.id, CloseReason::Takeover)]);
        fixture.leave(&first);
        fixture.unicast(&second, 1);
        assert!(first.take().is_empty());
        assert_eq!(second.take(), ["event 1"]);
        assert_eq!(fixture.snapshot().len(), 1);
        fixture.leave(&second);
        fixture.unicast(&second, 2);
        assert_eq!(fixture.routed(RouteResult::NotConnected), 1);
        assert_eq!(fixture.closes().await.len(), 1, "a leave closes nothing");
    }

    /// A tail reports a gap before anything after it: the batch's resyncs are queued first.
    #[actix_rt::test]
    async fn resyncs_are_queued_before_the_events_of_their_batch() {
        let mut fixture = Fixture::new(2);
        let mut conn = fixture.connect("pos-1", 0, 8);
        let mut other_shard = fixture.connect("pos-2", 1, 8);
        let frame = Bytes::from_static(b"b");
        fixture.route(
            vec![unicast(0, "pos-1", 5), broadcast(0, 6, &frame)],
            vec![
                resync(0, ResyncReason::Expired),
                resync(1, ResyncReason::DataLost),
            ],
        );
        assert_eq!(conn.take(), ["resync expired", "event 5", "event 6"]);
        assert_eq!(other_shard.take(), ["resync data_lost"]);
    }

    /// Shutdown closes connections in the order they registered (oldest first).
    #[actix_rt::test]
    async fn a_snapshot_lists_the_connections_in_registration_order() {
        let mut fixture = Fixture::new(3);
        let conns: Vec<Conn> = (0..20)
            .map(|n| fixture.connect(&format!("pos-{n}"), n % 3, 8))
            .collect();
        fixture.leave(&conns[3]);
        // A takeover: the newest connection of pos-5 comes last.
        let newest = fixture.connect("pos-5", 5 % 3, 8);
        let targets = fixture.snapshot();
        for target in &targets {
            target
                .close
                .send(Close::now(CloseReason::Drain))
                .await
                .unwrap();
        }
        let order: Vec<u64> = fixture
            .closes()
            .await
            .into_iter()
            .filter(|(_, reason)| *reason == CloseReason::Drain)
            .map(|(id, _)| id)
            .collect();
        let mut expected: Vec<u64> = (0..20).filter(|id| ![3, 5].contains(id)).collect();
        expected.push(newest.id);
        assert_eq!(order, expected);
    }

    /// The stall check evicts a queue whose oldest item waited `stall_timeout` without progress;
    /// not an empty one, and not one whose body replays (those items wait on purpose).
    #[actix_rt::test]
    async fn the_stall_sweep_evicts_a_queue_that_made_no_progress() {
        let stall = Duration::from_secs(10);
        let mut fixture = Fixture::with(1, Duration::from_secs(20), stall);
        let mut stalled = fixture.connect("pos-1", 0, 8);
        let mut idle = fixture.connect("pos-2", 0, 8);
        let mut replaying = fixture.connect("pos-3", 0, 8);
        replaying.queue.set_replaying(true);
        fixture.unicast(&stalled, 1);
        fixture.unicast(&replaying, 2);
        let sweep = |fixture: &mut Fixture, now: Instant| {
            for index in 0..fixture.router.rotation.slices() {
                fixture.router.evict_stalled(index, now);
            }
        };
        sweep(&mut fixture, Instant::now() + stall / 2);
        assert!(fixture.closes().await.is_empty(), "not yet");
        sweep(&mut fixture, Instant::now() + stall);
        assert_eq!(
            fixture.closes().await,
            [(stalled.id, CloseReason::SlowConsumer)]
        );
        fixture.unicast(&stalled, 3);
        fixture.unicast(&idle, 4);
        fixture.unicast(&replaying, 5);
        assert_eq!(stalled.take(), ["event 1"]);
        assert_eq!(idle.take(), ["event 4"]);
        assert_eq!(replaying.take(), ["event 2", "event 5"]);
    }

    /// A stream that stalled after another connection took its device over is not the
    /// device's stream any more: the sweep must not evict its successor, which reads.
    #[actix_rt::test]
    async fn the_stall_sweep_spares_the_successor_of_a_stalled_stream() {
        let stall = Duration::from_secs(10);
        let mut fixture = Fixture::with(1, Duration::from_secs(20), stall);
        let old = fixture.connect("pos-1", 0, 8);
        fixture.unicast(&old, 1);
        let mut new = fixture.connect("pos-1", 0, 8);
        let later = Instant::now() + 2 * stall;
        for index in 0..fixture.router.rotation.slices() {
            fixture.router.evict_stalled(index, later);
        }
        assert_eq!(fixture.closes().await, [(old.id, CloseReason::Takeover)]);
        fixture.unicast(&new, 2);
        assert_eq!(new.take(), ["event 2"]);
    }

    /// The same, driven by the Router's own timer: a short heartbeat and stall timeout.
    #[actix_rt::test]
    async fn the_running_router_evicts_a_stalled_client_within_its_timeout() {
        let mut fixture = Fixture::new(1);
        let (register, mut conn) = fixture.connection("pos-1", 0, 64);
        let metrics = fixture.metrics.clone();
        // 4 slices of 25 ms: every connection is checked for stalls on every tick.
        let router = Router::new(
            1,
            Duration::from_millis(100),
            Duration::from_millis(40),
            metrics,
            TokenRules::default(),
        )
        .start();
        router.do_send(Membership(vec![Change::Join(register)]));
        let started = Instant::now();
        router
            .send(RouteBatch {
                events: vec![unicast(0, "pos-1", 1)],
                resyncs: Vec::new(),
            })
            .await
            .unwrap();
        while fixture.closes().await.is_empty() {
            assert!(started.elapsed() < Duration::from_secs(1), "not evicted");
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(
            fixture.closes().await,
            [(conn.id, CloseReason::SlowConsumer)]
        );
        assert_eq!(conn.take().first().map(String::as_str), Some("event 1"));
        assert!(router.send(Snapshot).await.unwrap().is_empty());
    }

    /// Heartbeats go through the queue: a full queue on a ping evicts, a gone body is removed.
    #[actix_rt::test]
    async fn a_tick_pings_through_the_queue() {
        // One slice: a tick pings every connection.
        let heartbeat = Duration::from_millis(20);
        let mut fixture = Fixture::with(1, heartbeat, Duration::ZERO);
        let mut reading = fixture.connect("pos-1", 0, 8);
        let full = fixture.connect("pos-2", 0, 1);
        let gone = fixture.connect("pos-3", 0, 8);
        fixture.unicast(&full, 1);
        drop(gone.queue);
        // Streams that wrote nothing for half a heartbeat (these never wrote).
        actix_rt::time::sleep(heartbeat).await;
        fixture.router.tick();
        assert_eq!(reading.take(), ["ping"]);
        assert_eq!(
            fixture.closes().await,
            [(full.id, CloseReason::SlowConsumer)]
        );
        assert_eq!(fixture.snapshot().len(), 1);
    }

    /// A stream that wrote within half a heartbeat is not pinged: it is evidently alive.
    #[actix_rt::test]
    async fn only_quiet_streams_are_pinged() {
        let heartbeat = Duration::from_millis(200);
        let ping_all = |fixture: &mut Fixture, now: Instant| {
            for index in 0..fixture.router.rotation.slices() {
                fixture.router.ping_slice(index, now);
            }
        };
        let mut fixture = Fixture::with(1, heartbeat, Duration::ZERO);
        let mut busy = fixture.connect("pos-1", 0, 8);
        let mut quiet = fixture.connect("pos-2", 0, 8);
        actix_rt::time::sleep(heartbeat * 3 / 4).await;
        busy.progress.wrote();
        let now = Instant::now();
        ping_all(&mut fixture, now);
        assert_eq!(quiet.take(), ["ping"], "quiet for over half a heartbeat");
        assert!(busy.take().is_empty(), "it has just written");
        ping_all(&mut fixture, now + heartbeat * 3 / 4);
        assert_eq!(busy.take(), ["ping"], "quiet since");
    }
}

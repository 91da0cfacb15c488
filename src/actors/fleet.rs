//! `Fleet`: this pod's part of the fleet API (docs/fleet.md).
//!
//! Owns: the fleet store; the presence writes and announcements waiting for the next flush; the
//! streams of this pod (device → connection, its progress) and the rotation that visits them
//! for progress samples and refreshes of their records; this pod's view of the whole fleet
//! (which device is online on which instance, and what the fleet event stream last said of it);
//! the instances heard from; connects other pods announced within [`RACE_WINDOW`]; the
//! subscribers of `GET /v1/fleet/events`.
//! Receives: [`SessionChanges`] from the Router (one message per batch of joins and leaves); the
//! channel's [`FleetMessage`]s from every pod, this one included, and its gaps (messages may have
//! been lost: the devices online are read from the store again, and what changed is reported;
//! the store may have lost its records too, so this pod's open sessions are written again over
//! one sampling round);
//! [`SubscribeEvents`] from the HTTP edge; [`Farewell`] from the hub once the HTTP server has
//! stopped.
//! Sends: presence writes and announcements to the store, in batches every [`FLUSH_EVERY`]
//! (never one round trip per connection: a reconnect storm of 10,000 devices is a few dozen
//! writes); [`CloseOlder`] to the Router when another pod announces a stream of a device that
//! has one here, or a read of the store after a gap finds a newer one (takeover); framed events
//! into each subscriber's bounded channel.
//! When full: a fleet event subscriber whose channel is full is dropped (its stream ends; it
//! reconnects). While a flush is in flight, or the store fails, writes wait (progress samples
//! of one session coalesce), at most [`MAX_PENDING`]; beyond that the oldest are dropped and
//! logged. A flush that takes longer than [`FLUSH_TIMEOUT`] counts as failed. The announcements
//! of failed writes are sent again once the writes are stored (connects only of streams still
//! open).
//! Draining: nothing changes until [`Farewell`]: it waits for a flush in flight (at most
//! [`FAREWELL_FLUSH_WAIT`]), writes what is pending, and the instance says it stops, so its
//! devices show offline at once instead of after `presence.ttl`; no timer flushes or beats after
//! it.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;
use bytes::Bytes;
use tokio::sync::mpsc;

use super::{rotation::Rotation, router::CloseOlder};
use crate::{
    backend::{
        fleet::{
            groups::refresh_every, replaces, DeviceFilter, DeviceRecord, FleetMessage, FleetStore,
            Heard, OnlineFilter, PresenceWrite, Session, SessionRef, RACE_WINDOW,
        },
        BackendError,
    },
    config::PresenceConfig,
    metrics::Metrics,
    model::{shard_of, unix_ms, Cursor, DeviceId},
    report::Report,
    stream::{Peer, Progress},
};

/// How often collected presence writes and announcements go to the store.
const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// A flush not done by then has failed (its writes are kept for the next).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// After a gap, a failed beat is tried again this often, at most [`GAP_BEAT_TRIES`] times.
const GAP_BEAT_RETRY: Duration = Duration::from_secs(1);
const GAP_BEAT_TRIES: u32 = 10;
/// How long the farewell waits for a flush in flight (the hub gives the farewell 3 s in all).
const FAREWELL_FLUSH_WAIT: Duration = Duration::from_secs(1);
/// Writes kept while a flush is in flight or the store is unreachable.
const MAX_PENDING: usize = 200_000;
/// News of a device heard this long before the devices online are read from the store is newer
/// than what the store says: its pod writes and announces a change at the same time, and the
/// write may take until its flush times out.
const NEWS_FRESH: Duration = Duration::from_millis(5_100);
/// How long a failed read of the devices online waits before it is tried again.
const RELOAD_RETRY: Duration = Duration::from_secs(2);
/// How often due debounce decisions and silent instances are looked at.
const EVALUATE_EVERY: Duration = Duration::from_millis(250);
/// How often the last sent id of an open stream is written (if it changed). Streams are sampled
/// a small slice at a time, each once per period: 10,000 writes at once held the store (a Redis
/// script over 10,000 keys, which the tails' reads waited behind) and a core for milliseconds,
/// and the p99 of events published meanwhile grew several-fold (docs/BENCHMARKS.md, tenth run).
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// An instance silent this many `presence.ttl`s is forgotten with the devices it held.
const FORGET_AFTER_TTLS: u32 = 20;
/// Frames a fleet event subscriber may fall behind by.
const SUBSCRIBER_QUEUE: usize = 4096;
/// A comment to every fleet event subscriber this often, so proxies keep the stream open.
const SUBSCRIBER_PING: Duration = Duration::from_secs(15);

/// A stream of this pod opened or ended (from the Router).
pub enum SessionChange {
    Opened {
        device: DeviceId,
        connection_id: u64,
        opened_ms: u64,
        peer: Peer,
        progress: Progress,
    },
    Closed {
        device: DeviceId,
        connection_id: u64,
        at_ms: u64,
        last_sent: Option<Cursor>,
    },
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct SessionChanges(pub Vec<SessionChange>);

/// Opens a `GET /v1/fleet/events` stream: the receiver of its frames.
#[derive(Message)]
#[rtype(result = "mpsc::Receiver<Bytes>")]
pub struct SubscribeEvents;

/// At exit: flush, then tell the fleet this instance is gone.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Farewell;

/// A stream of this pod.
struct Local {
    session: Session,
    connection_id: u64,
    progress: Progress,
    /// The progress counter when last written.
    written: u64,
    /// When its progress was last sampled.
    sampled: Instant,
    /// When its session's record was last queued for writing (see [`refresh_every`]).
    refreshed: Instant,
    /// The store may have lost its record (the channel had a gap): written again whole, with
    /// the last sent id, at the next visit.
    write_again: bool,
}

/// One device in this pod's view of the fleet.
struct Seen {
    session: Session,
    /// Its session has not ended (its instance may still be dead).
    open: bool,
    /// What the fleet event stream last said: online or not.
    reported: bool,
}

struct InstanceSeen {
    last_heard: Instant,
    /// It said it stops: its devices are offline at once.
    said_goodbye: bool,
    /// It fell silent for `presence.ttl` and its devices were queued for evaluation.
    silent: bool,
}

pub struct Fleet {
    store: Arc<dyn FleetStore>,
    router: Recipient<CloseOlder>,
    metrics: Arc<Metrics>,
    config: PresenceConfig,
    shards: u32,
    pod: String,
    instance: String,
    /// Presence writes for the next flush, in order.
    pending_writes: Vec<PresenceWrite>,
    /// Announcements for the next flush, in order.
    pending_messages: Vec<FleetMessage>,
    /// The last flush's writes failed: once they are stored, their announcements go again
    /// (the first may have been lost with the channel, and a pod that read the store before the
    /// writes landed would never hear of them), but for connects of ended streams.
    replay_writes: bool,
    flushing: bool,
    /// Notified at the end of every flush: the farewell waits for the one in flight.
    flushed: Arc<tokio::sync::Notify>,
    /// Beats after a gap are being tried (see [`Fleet::beat_after_gap`]).
    beating_after_gap: bool,
    /// The farewell has begun: no more flushes or beats of the timers (one landing after the
    /// goodbye would say this instance is alive again).
    leaving: bool,
    local: HashMap<DeviceId, Local>,
    /// The local streams (device, connection), visited a slice per tick for their progress
    /// samples and session refreshes; a member whose stream is gone leaves at its visit.
    sampling: Rotation<(DeviceId, u64)>,
    next_slice: usize,
    /// How often an open session is written again, so that retention does not forget it.
    refresh_every: Duration,
    /// The fleet as this pod hears it.
    view: HashMap<DeviceId, Seen>,
    /// A device's `reported` may have changed since `fleet_devices_online` was counted: the
    /// count walks the whole view, too much for every evaluation with 10,000 devices.
    recount_online: bool,
    instances: HashMap<String, InstanceSeen>,
    /// Devices whose state changed, with when their debounce ends (in order of that time).
    due: VecDeque<(Instant, DeviceId)>,
    /// Newest connect announced by another pod per device, and when it arrived.
    remote_connects: HashMap<DeviceId, (Session, Instant)>,
    /// Devices heard of (connects and ends), in the order heard, within [`NEWS_FRESH`] (and
    /// during a load): their news is newer than what a load reads.
    news: VecDeque<(Instant, DeviceId)>,
    /// When the load of the devices online in progress began.
    loading: Option<Instant>,
    /// A gap was heard during a load: load again once it is done.
    load_again: bool,
    /// The first load is done: what later loads find is news, reported as events.
    loaded: bool,
    subscribers: Vec<mpsc::Sender<Bytes>>,
}

impl Fleet {
    pub fn new(
        store: Arc<dyn FleetStore>,
        router: Recipient<CloseOlder>,
        metrics: Arc<Metrics>,
        config: PresenceConfig,
        shards: u32,
        instance: String,
    ) -> Self {
        let refresh_every = refresh_every(config.retention);
        Self {
            store,
            router,
            metrics,
            refresh_every,
            pod: config.effective_pod_name(),
            config,
            shards,
            instance,
            pending_writes: Vec::new(),
            pending_messages: Vec::new(),
            replay_writes: false,
            flushing: false,
            flushed: Arc::new(tokio::sync::Notify::new()),
            beating_after_gap: false,
            leaving: false,
            local: HashMap::new(),
            // A retention under 20 s needs its refreshes sooner than every 5 s.
            sampling: Rotation::new(PROGRESS_EVERY.min(refresh_every)),
            next_slice: 0,
            view: HashMap::new(),
            recount_online: true,
            instances: HashMap::new(),
            due: VecDeque::new(),
            remote_connects: HashMap::new(),
            news: VecDeque::new(),
            loading: None,
            load_again: false,
            loaded: false,
            subscribers: Vec::new(),
        }
    }

    fn session_ref(&self, device: DeviceId, connection_id: u64) -> SessionRef {
        SessionRef {
            device,
            instance: self.instance.clone(),
            session: connection_id,
        }
    }

    fn local_change(&mut self, change: SessionChange) {
        match change {
            SessionChange::Opened {
                device,
                connection_id,
                opened_ms,
                peer,
                progress,
            } => {
                let session = Session {
                    device: device.clone(),
                    pod: self.pod.clone(),
                    instance: self.instance.clone(),
                    session: connection_id,
                    connected_ms: opened_ms,
                    remote: peer.remote,
                    user_agent: peer.user_agent,
                    groups: peer.groups,
                };
                // Another pod announced a stream opened at nearly the same time, before ours
                // joined: the race is decided by rank, as that pod decides it.
                if let Some((remote, heard)) = self.remote_connects.get(&device) {
                    let race =
                        remote.connected_ms.abs_diff(opened_ms) < RACE_WINDOW.as_millis() as u64;
                    if race && heard.elapsed() < RACE_WINDOW {
                        self.close_older(remote);
                    }
                }
                self.sampling.join((device.clone(), connection_id));
                self.local.insert(
                    device,
                    Local {
                        session: session.clone(),
                        connection_id,
                        progress,
                        written: 0,
                        sampled: Instant::now(),
                        refreshed: Instant::now(),
                        write_again: false,
                    },
                );
                self.pending_writes
                    .push(PresenceWrite::Online(session.clone()));
                self.pending_messages
                    .push(FleetMessage::Connected(session.clone()));
                // Heard at once, not only through the channel: the view stays right when the
                // announcement is lost.
                self.heard(FleetMessage::Connected(session));
            }
            SessionChange::Closed {
                device,
                connection_id,
                at_ms,
                last_sent,
            } => {
                if self
                    .local
                    .get(&device)
                    .is_some_and(|local| local.connection_id == connection_id)
                {
                    self.local.remove(&device);
                }
                let session = self.session_ref(device, connection_id);
                self.pending_writes.push(PresenceWrite::Offline {
                    session: session.clone(),
                    at_ms,
                    last_sent,
                });
                let message = FleetMessage::Disconnected { session, at_ms };
                self.pending_messages.push(message.clone());
                self.heard(message);
            }
        }
    }

    fn close_older(&self, newer: &Session) {
        self.router.do_send(CloseOlder {
            shard: shard_of(newer.device.as_str(), self.shards),
            device: newer.device.clone(),
            opened_ms: newer.connected_ms,
            instance: newer.instance.clone(),
            session: newer.session,
        });
    }

    /// A message of the channel (from any pod, this one included), or a change of this pod.
    fn heard(&mut self, message: FleetMessage) {
        let now = Instant::now();
        match message {
            FleetMessage::Connected(session) => {
                self.hear_of_instance(&session.instance, now);
                self.news.push_back((now, session.device.clone()));
                if session.instance != self.instance {
                    if self.local.contains_key(&session.device) {
                        self.close_older(&session);
                    }
                    let newer = self
                        .remote_connects
                        .get(&session.device)
                        .is_none_or(|(known, _)| known.rank() < session.rank());
                    if newer {
                        self.remote_connects
                            .insert(session.device.clone(), (session.clone(), now));
                    }
                }
                let device = session.device.clone();
                match self.view.get_mut(&device) {
                    Some(seen) if !replaces(&session, &seen.session, seen.open) => return,
                    Some(seen) => {
                        seen.session = session;
                        seen.open = true;
                    }
                    None => {
                        self.view.insert(
                            device.clone(),
                            Seen {
                                session,
                                open: true,
                                reported: false,
                            },
                        );
                    }
                }
                self.due.push_back((now + self.config.debounce, device));
            }
            FleetMessage::Disconnected { session, .. } => {
                self.news.push_back((now, session.device.clone()));
                if let Some(seen) = self.view.get_mut(&session.device) {
                    if seen.session.instance == session.instance
                        && seen.session.session == session.session
                        && seen.open
                    {
                        seen.open = false;
                        self.due
                            .push_back((now + self.config.debounce, session.device));
                    }
                }
            }
            FleetMessage::Alive {
                instance, stopping, ..
            } => {
                self.hear_of_instance(&instance, now);
                if stopping {
                    if let Some(known) = self.instances.get_mut(&instance) {
                        known.said_goodbye = true;
                    }
                    self.queue_devices_of(&instance, now + self.config.debounce);
                }
            }
        }
    }

    fn hear_of_instance(&mut self, instance: &str, now: Instant) {
        let known = self
            .instances
            .entry(instance.to_owned())
            .or_insert(InstanceSeen {
                last_heard: now,
                said_goodbye: false,
                silent: false,
            });
        known.last_heard = now;
        if known.silent {
            // Back after an outage of its link: its devices may be online again.
            known.silent = false;
            self.queue_devices_of(instance, now);
        }
    }

    fn queue_devices_of(&mut self, instance: &str, at: Instant) {
        let devices: Vec<DeviceId> = self
            .view
            .iter()
            .filter(|(_, seen)| seen.session.instance == instance)
            .map(|(device, _)| device.clone())
            .collect();
        for device in devices {
            self.due.push_back((at, device));
        }
    }

    fn alive(&self, instance: &str, now: Instant) -> bool {
        self.instances.get(instance).is_some_and(|known| {
            !known.said_goodbye && now.duration_since(known.last_heard) < self.config.ttl
        })
    }

    /// Reports what the debounce let through; notices instances that fell silent.
    fn evaluate(&mut self) {
        let now = Instant::now();
        let ttl = self.config.ttl;
        let mut fell_silent = Vec::new();
        let mut forgotten = Vec::new();
        for (instance, known) in &mut self.instances {
            let silence = now.duration_since(known.last_heard);
            if silence >= ttl * FORGET_AFTER_TTLS {
                forgotten.push(instance.clone());
            } else if silence >= ttl && !known.silent {
                known.silent = true;
                fell_silent.push(instance.clone());
            }
        }
        for instance in &fell_silent {
            // It died without a goodbye: its devices went offline when it fell silent, so they
            // are decided now, ahead of the debounce queue's order.
            let devices: Vec<DeviceId> = self
                .view
                .iter()
                .filter(|(_, seen)| &seen.session.instance == instance)
                .map(|(device, _)| device.clone())
                .collect();
            for device in devices {
                self.decide(&device, now);
            }
        }
        for instance in forgotten {
            self.instances.remove(&instance);
            self.view
                .retain(|_, seen| seen.session.instance != instance || seen.reported);
        }
        while self.due.front().is_some_and(|(at, _)| *at <= now) {
            let (_, device) = self.due.pop_front().expect("checked");
            self.decide(&device, now);
        }
        if std::mem::take(&mut self.recount_online) {
            self.metrics
                .fleet_devices_online
                .set(self.view.values().filter(|seen| seen.reported).count() as i64);
        }
        self.remote_connects
            .retain(|_, (_, heard)| heard.elapsed() < RACE_WINDOW);
        let keep_since = self.loading.unwrap_or(now).checked_sub(NEWS_FRESH);
        while self
            .news
            .front()
            .is_some_and(|(at, _)| keep_since.is_some_and(|since| *at < since))
        {
            self.news.pop_front();
        }
    }

    /// Reports `device`'s state if it differs from what was last reported.
    fn decide(&mut self, device: &DeviceId, now: Instant) {
        let Some(seen) = self.view.get(device) else {
            return;
        };
        let online = seen.open && self.alive(&seen.session.instance, now);
        let open = seen.open;
        self.recount_online = true;
        if online != seen.reported {
            let frame = event_frame(online, device, &seen.session.pod);
            self.publish(frame);
        }
        // An ended session is forgotten once decided: the view holds the devices online and
        // those in their debounce. A device of a silent instance stays, in case it comes back.
        if !online && !open {
            self.view.remove(device);
        } else if let Some(seen) = self.view.get_mut(device) {
            seen.reported = online;
        }
    }

    fn publish(&mut self, frame: Bytes) {
        self.subscribers
            .retain(|subscriber| subscriber.try_send(frame.clone()).is_ok());
    }

    /// Visits the next slice of local streams: queues the session of those not written for
    /// `refresh_every`, and the last sent id of those that wrote since their last sample (at
    /// most once per [`PROGRESS_EVERY`], also when a short retention turns the rotation faster).
    fn sample_slice(&mut self, now: Instant) {
        let index = self.next_slice;
        self.next_slice = (index + 1) % self.sampling.slices();
        let period = self.sampling.period();
        let Self {
            sampling,
            local,
            view,
            pending_writes,
            refresh_every,
            ..
        } = self;
        sampling.visit(index, |(device, connection_id)| {
            let Some(local) = local
                .get_mut(device)
                .filter(|local| local.connection_id == *connection_id)
            else {
                return false;
            };
            // The record before the sample: a record the store lost is written again whole,
            // then the sample lands on it. A refresh never takes the record from a session
            // that connected later (the store checks, `fleet::refreshes`: this pod's view may
            // be stale after a gap); one the view already names (this stream is being closed
            // by the takeover) is not even sent. (Looked up only when due: a sample is most
            // visits.)
            let write_again = std::mem::take(&mut local.write_again);
            if (write_again || now.saturating_duration_since(local.refreshed) >= *refresh_every)
                && view
                    .get(device)
                    .is_none_or(|seen| seen.session.is(&local.session))
            {
                local.refreshed = now;
                pending_writes.push(PresenceWrite::Refresh(local.session.clone()));
            }
            if !write_again
                && now.saturating_duration_since(local.sampled) + period < PROGRESS_EVERY
            {
                return true;
            }
            local.sampled = now;
            let (last_sent, changes) = local.progress.last_sent();
            if write_again || changes != local.written {
                local.written = changes;
                if let Some(last_sent) = last_sent {
                    let session = local.session.reference();
                    pending_writes.push(PresenceWrite::Sent { session, last_sent });
                }
            }
            true
        });
    }

    /// After a gap in the channel: the store may have lost what it had (a Redis restarted
    /// without persistence, a failover that dropped writes, a nats-server that lost its store
    /// directory), and its clients reconnected, which is the gap. Records of the streams open
    /// here are written again over the next sampling round (the refresh's path, spread like it;
    /// the caller beats at once), so that its devices are online again within one round instead
    /// of at their next refresh (up to an hour). In a store that kept everything these writes
    /// only refresh the records.
    fn write_local_again(&mut self) {
        for local in self.local.values_mut() {
            local.write_again = true;
        }
    }

    /// Keeps the pending writes within [`MAX_PENDING`]: progress samples and refreshes
    /// superseded by a later one of their session go first, then the oldest writes.
    fn bound_pending(&mut self) {
        if self.pending_writes.len() <= MAX_PENDING {
            return;
        }
        let mut newest_sample: HashSet<SessionRef> = HashSet::new();
        let mut newest_refresh: HashSet<SessionRef> = HashSet::new();
        let mut kept: Vec<PresenceWrite> = Vec::with_capacity(self.pending_writes.len());
        for write in std::mem::take(&mut self.pending_writes).into_iter().rev() {
            let superseded = match &write {
                PresenceWrite::Sent { session, .. } => !newest_sample.insert(session.clone()),
                PresenceWrite::Refresh(session) => !newest_refresh.insert(session.reference()),
                _ => false,
            };
            if !superseded {
                kept.push(write);
            }
        }
        kept.reverse();
        let excess = kept.len().saturating_sub(MAX_PENDING);
        if excess > 0 {
            log::warn!("presence: {excess} writes dropped: the backend does not keep up");
            kept.drain(..excess);
        }
        self.pending_writes = kept;
    }

    fn flush(&mut self, ctx: &mut Context<Self>) {
        self.bound_pending();
        if self.leaving
            || self.flushing
            || (self.pending_writes.is_empty() && self.pending_messages.is_empty())
        {
            return;
        }
        self.flushing = true;
        let writes = std::mem::take(&mut self.pending_writes);
        let messages = std::mem::take(&mut self.pending_messages);
        let replay = self.replay_of(&writes);
        let stored = self.as_stored(&writes);
        let store = self.store.clone();
        let work = async move {
            let write = async {
                if stored.is_empty() {
                    return Ok(());
                }
                match tokio::time::timeout(FLUSH_TIMEOUT, store.write(stored)).await {
                    Ok(written) => written,
                    Err(_) => Err(BackendError::unavailable("presence writes timed out")),
                }
            };
            let announce = |messages: Vec<FleetMessage>| {
                let store = store.clone();
                async move {
                    if messages.is_empty() {
                        return Ok(());
                    }
                    match tokio::time::timeout(FLUSH_TIMEOUT, store.announce(messages)).await {
                        Ok(announced) => announced,
                        Err(_) => Err(BackendError::unavailable("announcements timed out")),
                    }
                }
            };
            // Announced at the same time as the writes, not after them: takeovers on other pods
            // wait for the announcement only, also while the writes fail.
            let (written, announced) = futures_util::join!(write, announce(messages));
            // Earlier writes failed: once stored, their announcements go again.
            let replayed = match written {
                Ok(()) => announce(replay).await,
                Err(_) => Ok(()),
            };
            (writes, written, announced.and(replayed))
        };
        ctx.spawn(
            work.into_actor(self)
                .map(|(writes, written, announced), fleet, _| {
                    fleet.flushing = false;
                    fleet.replay_writes = written.is_err();
                    if let Err(error) = written {
                        log::warn!(
                            "presence: {} writes failed, kept for the next flush: {}",
                            writes.len(),
                            Report(&error)
                        );
                        let mut kept = writes;
                        kept.append(&mut fleet.pending_writes);
                        fleet.pending_writes = kept;
                    } else if let Err(error) = announced {
                        // Other pods miss these changes until they read the store again (after a
                        // gap in their channel) or liveness decides (ttl).
                        log::warn!("presence: announcements lost: {}", Report(&error));
                    }
                    fleet.flushed.notify_waiters();
                }),
        );
    }

    /// What `writes` go to the store as. Written again after a failure, their order against
    /// other pods' writes says nothing any more (another pod may have written a later connect of
    /// the device meanwhile, and beyond the race window the `Online` that lands last would win):
    /// a connect then goes as a [`PresenceWrite::Refresh`], which keeps the record with the
    /// session that connected later.
    fn as_stored(&self, writes: &[PresenceWrite]) -> Vec<PresenceWrite> {
        writes
            .iter()
            .cloned()
            .map(|write| match write {
                PresenceWrite::Online(session) if self.replay_writes => {
                    PresenceWrite::Refresh(session)
                }
                write => write,
            })
            .collect()
    }

    /// The announcements of `writes` to send again once they are stored, if an earlier flush
    /// of them failed ([`Fleet::replay_writes`]): the ends, and the connects of streams still
    /// open (a stale connect heard after the device's newer one on another pod would take that
    /// one over).
    fn replay_of(&self, writes: &[PresenceWrite]) -> Vec<FleetMessage> {
        if !self.replay_writes {
            return Vec::new();
        }
        writes
            .iter()
            .filter_map(|write| match write {
                PresenceWrite::Online(session) => self
                    .local
                    .get(&session.device)
                    .is_some_and(|local| local.session.is(session))
                    .then(|| FleetMessage::Connected(session.clone())),
                PresenceWrite::Offline { session, at_ms, .. } => Some(FleetMessage::Disconnected {
                    session: session.clone(),
                    at_ms: *at_ms,
                }),
                PresenceWrite::Refresh(_) | PresenceWrite::Sent { .. } => None,
            })
            .collect()
    }

    /// Beats and announces it; answers whether the beat was stored.
    fn beat(&self, stopping: bool) -> impl std::future::Future<Output = bool> + 'static {
        let store = self.store.clone();
        let (pod, instance) = (self.pod.clone(), self.instance.clone());
        let message = FleetMessage::Alive {
            pod: pod.clone(),
            instance: instance.clone(),
            at_ms: unix_ms(),
            stopping,
        };
        async move {
            let stored = store.beat(&pod, &instance, stopping).await;
            if let Err(error) = &stored {
                log::warn!("presence: beat failed: {}", Report(error));
            }
            if let Err(error) = store.announce(vec![message]).await {
                log::warn!("presence: beat not announced: {}", Report(&error));
            }
            stored.is_ok()
        }
    }

    /// After a gap: beats now, and again every [`GAP_BEAT_RETRY`] until a beat is stored (a
    /// store that restarted empty lost this instance's beat, without which its devices read
    /// offline; on NATS its bucket comes back a moment after the first failures). One chain of
    /// tries at a time: a gap during the tries adds none.
    fn beat_after_gap(&mut self, ctx: &mut Context<Self>) {
        if !std::mem::replace(&mut self.beating_after_gap, true) {
            self.beat_until_stored(ctx, GAP_BEAT_TRIES);
        }
    }

    fn beat_until_stored(&mut self, ctx: &mut Context<Self>, tries_left: u32) {
        if self.leaving {
            self.beating_after_gap = false;
            return;
        }
        ctx.spawn(
            self.beat(false)
                .into_actor(self)
                .map(move |stored, fleet, ctx| {
                    if stored || tries_left <= 1 {
                        fleet.beating_after_gap = false;
                    } else {
                        ctx.run_later(GAP_BEAT_RETRY, move |fleet, ctx| {
                            fleet.beat_until_stored(ctx, tries_left - 1)
                        });
                    }
                }),
        );
    }

    fn subscribe(&mut self, ctx: &mut Context<Self>) {
        let store = self.store.clone();
        ctx.spawn(async move { store.subscribe().await }.into_actor(self).map(
            |subscribed, fleet, ctx| match subscribed {
                Ok(heard) => {
                    ctx.add_stream(heard);
                    // What was announced before (at start) or while away (after the
                    // subscription ended) is not on the channel: take the devices online from
                    // the store.
                    fleet.load_online(ctx, true);
                }
                Err(error) => {
                    log::warn!(
                        "fleet channel: cannot subscribe, retrying in 2s: {}",
                        Report(&error)
                    );
                    ctx.run_later(Duration::from_secs(2), |fleet, ctx| fleet.subscribe(ctx));
                }
            },
        ));
    }

    /// Brings the view in line with the devices the store says are online: adds those not
    /// known, ends those it no longer lists (a goodbye lost with the channel) where the listing
    /// shows their instance alive, except devices with fresher news (heard within
    /// [`NEWS_FRESH`] before the load began, or during it) and this instance's own, which it
    /// knows better than the store. What the first load finds was online before this pod heard
    /// of it: only later loads (after a gap in the channel) report what they find. A device left
    /// out for its fresh news is read again once that news is no longer fresh (`follow_up`: once
    /// per gap, not again after that second read).
    fn load_online(&mut self, ctx: &mut Context<Self>, follow_up: bool) {
        if self.loading.is_some() {
            self.load_again = true;
            return;
        }
        let started = Instant::now();
        self.loading = Some(started);
        let store = self.store.clone();
        let work = async move {
            let mut online = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                let page = store
                    .list(
                        &DeviceFilter {
                            online: OnlineFilter::Online,
                            group: None,
                        },
                        1000,
                        cursor.as_deref(),
                    )
                    .await?;
                online.extend(page.devices);
                match page.next {
                    Some(next) => cursor = Some(next),
                    None => break,
                }
            }
            Ok::<_, BackendError>(online)
        };
        ctx.spawn(work.into_actor(self).map(move |loaded, fleet, ctx| {
            fleet.loading = None;
            match loaded {
                Ok(records) => {
                    let left_out_fresh = fleet.take_online(records, started);
                    fleet.loaded = true;
                    if std::mem::take(&mut fleet.load_again) {
                        fleet.load_online(ctx, true);
                    } else if left_out_fresh && follow_up {
                        ctx.run_later(NEWS_FRESH, |fleet, ctx| fleet.load_online(ctx, false));
                    }
                }
                Err(error) => {
                    log::warn!(
                        "presence: cannot load the devices online, trying again in {:?}: {}",
                        RELOAD_RETRY,
                        Report(&error)
                    );
                    fleet.load_again = false;
                    ctx.run_later(RELOAD_RETRY, move |fleet, ctx| {
                        fleet.load_online(ctx, follow_up)
                    });
                }
            }
        }));
    }

    /// See [`Fleet::load_online`]. Answers whether it left out a device for its fresh news.
    fn take_online(&mut self, records: Vec<DeviceRecord>, started: Instant) -> bool {
        let fresh_since = started.checked_sub(NEWS_FRESH).unwrap_or(started);
        let fresh: HashSet<DeviceId> = self
            .news
            .iter()
            .rev()
            .take_while(|(at, _)| *at >= fresh_since)
            .map(|(_, device)| device.clone())
            .collect();
        let listed: HashSet<&DeviceId> = records.iter().map(|record| &record.device).collect();
        // A device is listed only while the store has a recent beat of its instance: after an
        // outage longer than a beat's period, or a store that lost its data, a live pod's devices
        // are missing for that reason alone. So only the absent devices of an instance the
        // listing shows alive are ended; a dead instance's are left to `ttl`.
        let alive_in_store: HashSet<&str> = records
            .iter()
            .map(|record| record.instance.as_str())
            .collect();
        let mut left_out_fresh = false;
        let mut ended = Vec::new();
        for (device, seen) in &self.view {
            if !seen.open || listed.contains(device) || seen.session.instance == self.instance {
                continue;
            }
            if fresh.contains(device) {
                left_out_fresh = true;
            } else if alive_in_store.contains(seen.session.instance.as_str()) {
                ended.push(device.clone());
            }
        }
        // This pod knows its own streams, and fresher news, better than the store.
        let taken: Vec<Session> = records
            .into_iter()
            .filter(|record| record.instance != self.instance)
            .filter(|record| {
                let is_fresh = fresh.contains(&record.device);
                left_out_fresh |= is_fresh;
                !is_fresh
            })
            .map(DeviceRecord::into_session)
            .collect();

        let now = Instant::now();
        self.recount_online = true;
        // Online before this pod heard of it: nothing to report, unless the first load is done.
        let reported = !self.loaded;
        for session in taken {
            // Known instances keep what this pod heard of them (a load must not bring back one
            // it found silent); others are new to it.
            self.instances
                .entry(session.instance.clone())
                .or_insert(InstanceSeen {
                    last_heard: now,
                    said_goodbye: false,
                    silent: false,
                });
            // A connect this pod did not hear of: takeover, as if it had.
            if self
                .local
                .get(&session.device)
                .is_some_and(|local| local.session.rank() < session.rank())
            {
                self.close_older(&session);
            }
            let device = session.device.clone();
            self.view
                .entry(device.clone())
                .and_modify(|seen| {
                    seen.session = session.clone();
                    seen.open = true;
                })
                .or_insert(Seen {
                    session,
                    open: true,
                    reported,
                });
            self.due.push_back((now, device));
        }
        for device in ended {
            if let Some(seen) = self.view.get_mut(&device) {
                seen.open = false;
            }
            self.due.push_back((now, device));
        }
        left_out_fresh
    }
}

/// `event: device.online` or `device.offline` with the device and its pod.
fn event_frame(online: bool, device: &DeviceId, pod: &str) -> Bytes {
    let name = if online {
        "device.online"
    } else {
        "device.offline"
    };
    let data = serde_json::json!({
        "device": device.as_str(),
        "pod": pod,
        "at": unix_ms(),
    });
    crate::sse::frame::named_event(name, &data.to_string())
}

impl Actor for Fleet {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.subscribe(ctx);
        ctx.spawn(self.beat(false).into_actor(self).map(|_, _, _| ()));
        ctx.run_interval(self.config.ttl / 3, |fleet, ctx| {
            if !fleet.leaving {
                ctx.spawn(fleet.beat(false).into_actor(fleet).map(|_, _, _| ()));
            }
        });
        ctx.run_interval(FLUSH_EVERY, |fleet, ctx| fleet.flush(ctx));
        ctx.run_interval(EVALUATE_EVERY, |fleet, _| fleet.evaluate());
        ctx.run_interval(SUBSCRIBER_PING, |fleet, _| {
            fleet.publish(crate::sse::frame::PING);
        });
        ctx.run_interval(self.sampling.tick_interval(), |fleet, _| {
            fleet.sample_slice(Instant::now());
        });
    }
}

impl Handler<SessionChanges> for Fleet {
    type Result = ();

    fn handle(&mut self, SessionChanges(changes): SessionChanges, _: &mut Context<Self>) {
        for change in changes {
            self.local_change(change);
        }
    }
}

impl StreamHandler<Heard> for Fleet {
    fn handle(&mut self, heard: Heard, ctx: &mut Context<Self>) {
        match heard {
            Heard::Message(message) => self.heard(message),
            Heard::Gap => {
                log::info!(
                    "fleet channel: messages may have been lost, reading the devices online"
                );
                self.load_online(ctx, true);
                self.write_local_again();
                self.beat_after_gap(ctx);
            }
        }
    }

    fn finished(&mut self, ctx: &mut Context<Self>) {
        log::warn!("fleet channel: subscription ended, subscribing again");
        ctx.run_later(Duration::from_secs(1), |fleet, ctx| fleet.subscribe(ctx));
    }
}

impl Handler<SubscribeEvents> for Fleet {
    type Result = MessageResult<SubscribeEvents>;

    fn handle(&mut self, _: SubscribeEvents, _: &mut Context<Self>) -> Self::Result {
        let (sender, receiver) = mpsc::channel(SUBSCRIBER_QUEUE);
        // The stream opens with a comment, like a device's.
        let _ = sender.try_send(Bytes::from_static(b": posthorn fleet events\n\n"));
        self.subscribers.push(sender);
        MessageResult(receiver)
    }
}

impl Handler<Farewell> for Fleet {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: Farewell, _: &mut Context<Self>) -> Self::Result {
        self.leaving = true;
        // A flush in flight may carry the exact ends of the streams the drain just closed; if it
        // fails, they are pending again once it is done. So it is waited for, briefly: the hub
        // gives the whole farewell 3 s, and the goodbye must still go.
        let in_flight = self.flushing.then(|| self.flushed.clone().notified_owned());
        let flush_done = async move {
            if let Some(flushed) = in_flight {
                let _ = tokio::time::timeout(FAREWELL_FLUSH_WAIT, flushed).await;
            }
        };
        Box::pin(flush_done.into_actor(self).then(|(), fleet, _| {
            let writes = std::mem::take(&mut fleet.pending_writes);
            let mut messages = fleet.replay_of(&writes);
            messages.append(&mut fleet.pending_messages);
            let writes = fleet.as_stored(&writes);
            let store = fleet.store.clone();
            let goodbye = fleet.beat(true);
            // The goodbye does not wait for the writes: it alone takes the devices offline, and
            // a slow store must not use up the hub's limit before it is sent.
            let last_writes = async move {
                if !writes.is_empty() {
                    if let Err(error) = store.write(writes).await {
                        log::warn!("presence: last writes failed: {}", Report(&error));
                    }
                }
                if !messages.is_empty() {
                    let _ = store.announce(messages).await;
                }
            };
            async move {
                futures_util::join!(last_writes, goodbye);
            }
            .into_actor(fleet)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{
        fleet::{memory::MemoryFleet, AckOutcome, DevicePage, FleetSettings},
        BackendResult,
    };
    use crate::model::Groups;
    use futures_util::{future::BoxFuture, stream::BoxStream, FutureExt, StreamExt};

    struct NoRouter;

    impl Actor for NoRouter {
        type Context = Context<Self>;
    }

    impl Handler<CloseOlder> for NoRouter {
        type Result = ();

        fn handle(&mut self, _: CloseOlder, _: &mut Context<Self>) {}
    }

    fn fleet() -> Fleet {
        fleet_keeping(Duration::from_secs(3600))
    }

    fn fleet_keeping(retention: Duration) -> Fleet {
        let config = PresenceConfig {
            enabled: true,
            pod_name: "pod-a".into(),
            ttl: Duration::from_secs(1),
            retention,
            debounce: Duration::from_secs(2),
        };
        let store = Arc::new(MemoryFleet::new(
            FleetSettings {
                shards: 8,
                ttl: config.ttl,
                retention: config.retention,
                broadcast_retention: config.retention,
            },
            1_000,
        ));
        let metrics = Arc::new(Metrics::new(prometheus::Registry::new(), "memory"));
        let router = NoRouter.start().recipient();
        Fleet::new(store, router, metrics, config, 8, "instance-a".into())
    }

    fn open(fleet: &mut Fleet, device: &str, connection_id: u64) -> Progress {
        let progress = Progress::default();
        fleet.local_change(SessionChange::Opened {
            device: DeviceId::parse(device).unwrap(),
            connection_id,
            opened_ms: unix_ms(),
            peer: Peer::default(),
            progress: progress.clone(),
        });
        progress
    }

    /// The writes of one round of visits, and the largest number of writes one visit queued.
    fn one_round(fleet: &mut Fleet, now: Instant) -> (Vec<PresenceWrite>, usize) {
        let mut writes = Vec::new();
        let mut largest = 0;
        for _ in 0..fleet.sampling.slices() {
            fleet.sample_slice(now);
            largest = largest.max(fleet.pending_writes.len());
            writes.append(&mut fleet.pending_writes);
        }
        (writes, largest)
    }

    /// The `Sent` writes among `writes`, as (device, connection, last sent id), sorted.
    fn samples(writes: Vec<PresenceWrite>) -> Vec<(String, u64, String)> {
        let mut sent: Vec<_> = writes
            .into_iter()
            .filter_map(|write| match write {
                PresenceWrite::Sent { session, last_sent } => Some((
                    session.device.to_string(),
                    session.session,
                    last_sent.to_string(),
                )),
                _ => None,
            })
            .collect();
        sent.sort();
        sent
    }

    #[actix::test]
    async fn progress_is_sampled_a_small_slice_at_a_time() {
        let mut fleet = fleet();
        let slices = fleet.sampling.slices();
        assert_eq!(slices, 200, "one slice per 25 ms of {PROGRESS_EVERY:?}");
        let streams: Vec<Progress> = (0..1000)
            .map(|n| open(&mut fleet, &format!("dev-{n:04}"), n))
            .collect();
        for (n, progress) in streams.iter().enumerate() {
            progress.sent(&crate::sse::frame::event(&format!("e1.0.{n}-0"), "m", "x"));
        }
        fleet.pending_writes.clear();

        let now = Instant::now();
        let (writes, largest) = one_round(&mut fleet, now);
        let sent = samples(writes);
        assert_eq!(sent.len(), 1000);
        assert_eq!(sent[7], ("dev-0007".into(), 7, "e1.0.7-0".into()));
        assert_eq!(
            largest,
            1000_usize.div_ceil(slices),
            "no visit queues more than its slice"
        );

        // Nothing new was sent: nothing is written again.
        assert!(one_round(&mut fleet, now).0.is_empty());

        // A stream that ended is not sampled; a new stream of a device is, under its own session.
        streams[3].sent(&crate::sse::frame::event("e1.0.1003-0", "m", "x"));
        fleet.local_change(SessionChange::Closed {
            device: DeviceId::parse("dev-0003").unwrap(),
            connection_id: 3,
            at_ms: unix_ms(),
            last_sent: None,
        });
        let newer = open(&mut fleet, "dev-0003", 5000);
        newer.sent(&crate::sse::frame::event("e1.0.2003-0", "m", "x"));
        fleet.pending_writes.clear();
        assert_eq!(
            samples(one_round(&mut fleet, now).0),
            vec![("dev-0003".into(), 5000, "e1.0.2003-0".into())]
        );
        let members: usize = (0..slices)
            .map(|index| {
                let mut count = 0;
                fleet.sampling.visit(index, |_| {
                    count += 1;
                    true
                });
                count
            })
            .sum();
        assert_eq!(members, 1000, "the ended stream's member left at its visit");
    }

    #[actix::test]
    async fn open_sessions_are_written_again_before_retention_forgets_them() {
        let mut fleet = fleet();
        for n in 0..400 {
            open(&mut fleet, &format!("dev-{n:04}"), n);
        }
        // A stream of this pod replaced by a newer one of the same device on this pod, and one
        // replaced by a newer one on another pod (its close by the takeover is on its way).
        open(&mut fleet, "dev-0001", 1001);
        let elsewhere = Session {
            device: DeviceId::parse("dev-0002").unwrap(),
            pod: "pod-b".into(),
            instance: "instance-b".into(),
            session: 7,
            connected_ms: unix_ms() + 10_000,
            remote: String::new(),
            user_agent: String::new(),
            groups: Groups::default(),
        };
        fleet.heard(FleetMessage::Connected(elsewhere));
        fleet.pending_writes.clear();

        let later = Instant::now() + fleet.refresh_every;
        let (writes, largest) = one_round(&mut fleet, later);
        let mut refreshed = HashMap::new();
        for write in writes {
            let PresenceWrite::Refresh(session) = write else {
                panic!("only refreshes are due");
            };
            assert_eq!(session.instance, "instance-a");
            assert!(refreshed
                .insert(session.device.to_string(), session.session)
                .is_none());
        }
        assert_eq!(refreshed.len(), 399, "all but the one superseded elsewhere");
        assert_eq!(refreshed["dev-0001"], 1001, "the newer stream's session");
        assert_eq!(refreshed["dev-0399"], 399);
        assert!(!refreshed.contains_key("dev-0002"));
        assert!(largest <= 3);
        // Refreshed once per `refresh_every`, not at every visit.
        fleet.sample_slice(later + PROGRESS_EVERY);
        assert!(fleet.pending_writes.is_empty());
    }

    #[actix::test]
    async fn after_a_gap_every_open_session_is_written_again_with_its_last_sent_id() {
        let mut fleet = fleet();
        let streams: Vec<Progress> = (0..300)
            .map(|n| open(&mut fleet, &format!("dev-{n:04}"), n))
            .collect();
        for (n, progress) in streams.iter().enumerate().skip(1) {
            progress.sent(&crate::sse::frame::event(&format!("e1.0.{n}-0"), "m", "x"));
        }
        let now = Instant::now();
        one_round(&mut fleet, now);
        fleet.pending_writes.clear();
        assert!(one_round(&mut fleet, now).0.is_empty(), "nothing is due");

        fleet.write_local_again();
        let (writes, largest) = one_round(&mut fleet, now);
        let online: Vec<u64> = writes
            .iter()
            .filter_map(|write| match write {
                PresenceWrite::Refresh(session) => Some(session.session),
                _ => None,
            })
            .collect();
        assert_eq!(online.len(), 300, "every open session once");
        let sent = samples(writes);
        assert_eq!(sent.len(), 299, "every stream that was sent something");
        assert_eq!(sent[0], ("dev-0001".into(), 1, "e1.0.1-0".into()));
        assert!(largest <= 2 * 300_usize.div_ceil(fleet.sampling.slices()));
        assert!(
            one_round(&mut fleet, now).0.is_empty(),
            "written again once"
        );
    }

    #[actix::test]
    async fn a_short_retention_is_refreshed_in_time() {
        // The shortest retention the configuration takes: its `ttl`, here 1 s.
        let retention = Duration::from_secs(1);
        let mut fleet = fleet_keeping(retention);
        let progress = open(&mut fleet, "dev-short", 1);
        fleet.pending_writes.clear();
        let start = Instant::now();
        let tick = fleet.sampling.tick_interval();
        let mut last_written = start;
        let mut longest_gap = Duration::ZERO;
        let mut samples = 0;
        for n in 1..=400 {
            // Something sent before every visit: samples are due whenever the visit allows.
            progress.sent(&crate::sse::frame::event(&format!("e1.0.{n}-0"), "m", "x"));
            let now = start + tick * n;
            fleet.sample_slice(now);
            for write in fleet.pending_writes.drain(..) {
                match write {
                    PresenceWrite::Refresh(_) => {
                        longest_gap = longest_gap.max(now - last_written);
                        last_written = now;
                    }
                    PresenceWrite::Sent { .. } => samples += 1,
                    PresenceWrite::Online(_) | PresenceWrite::Offline { .. } => {
                        panic!("only refreshes and samples: {write:?}")
                    }
                }
            }
        }
        let end = start + tick * 400;
        longest_gap = longest_gap.max(end - last_written);
        assert!(
            longest_gap <= retention / 2,
            "the record went {longest_gap:?} without a write, retention {retention:?}"
        );
        let most = (end - start).as_millis() / PROGRESS_EVERY.as_millis();
        assert!(
            (1..=most).contains(&(samples as u128)),
            "{samples} samples in {:?}: progress is still sampled once per {PROGRESS_EVERY:?}",
            end - start
        );
    }

    /// A memory store whose writes fail while `away`, and whose announcements are then lost
    /// (as with a client that takes a publish while disconnected as sent). While `stuck`, a
    /// write waits for `release`, then fails (a flush in flight when the store went away).
    struct Flaky {
        inner: MemoryFleet,
        away: std::sync::atomic::AtomicBool,
        stuck: std::sync::atomic::AtomicBool,
        release: tokio::sync::Notify,
    }

    impl Flaky {
        fn new(away: bool) -> Self {
            Self {
                inner: MemoryFleet::new(
                    FleetSettings {
                        shards: 8,
                        ttl: Duration::from_secs(30),
                        retention: Duration::from_secs(3600),
                        broadcast_retention: Duration::from_secs(900),
                    },
                    1_000,
                ),
                away: away.into(),
                stuck: false.into(),
                release: tokio::sync::Notify::new(),
            }
        }

        fn away(&self) -> bool {
            self.away.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl FleetStore for Flaky {
        fn write(&self, changes: Vec<PresenceWrite>) -> BoxFuture<'_, BackendResult<()>> {
            if self.stuck.load(std::sync::atomic::Ordering::SeqCst) {
                let released = self.release.notified();
                return async move {
                    released.await;
                    Err(BackendError::unavailable("gone while writing"))
                }
                .boxed();
            }
            if self.away() {
                return async { Err(BackendError::unavailable("away")) }.boxed();
            }
            self.inner.write(changes)
        }
        fn beat(
            &self,
            pod: &str,
            instance: &str,
            stopping: bool,
        ) -> BoxFuture<'_, BackendResult<()>> {
            self.inner.beat(pod, instance, stopping)
        }
        fn device(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Option<DeviceRecord>>> {
            self.inner.device(device)
        }
        fn list(
            &self,
            filter: &DeviceFilter,
            limit: usize,
            cursor: Option<&str>,
        ) -> BoxFuture<'_, BackendResult<DevicePage>> {
            self.inner.list(filter, limit, cursor)
        }
        fn ack(
            &self,
            device: &DeviceId,
            cursor: &Cursor,
            at_ms: u64,
        ) -> BoxFuture<'_, BackendResult<AckOutcome>> {
            self.inner.ack(device, cursor, at_ms)
        }
        fn record_broadcast(&self, copies: Vec<Cursor>) -> BoxFuture<'_, BackendResult<()>> {
            self.inner.record_broadcast(copies)
        }
        fn broadcast_copies(
            &self,
            id: &Cursor,
        ) -> BoxFuture<'_, BackendResult<Option<Vec<Cursor>>>> {
            self.inner.broadcast_copies(id)
        }
        fn group_index(
            &self,
            group: &crate::model::GroupName,
        ) -> BoxFuture<'_, BackendResult<Option<crate::backend::fleet::groups::GroupIndex>>>
        {
            self.inner.group_index(group)
        }
        fn announce(&self, messages: Vec<FleetMessage>) -> BoxFuture<'_, BackendResult<()>> {
            if self.away() {
                return async { Ok(()) }.boxed();
            }
            self.inner.announce(messages)
        }
        fn subscribe(&self) -> BoxFuture<'_, BackendResult<BoxStream<'static, Heard>>> {
            self.inner.subscribe()
        }
    }

    /// Connection 1 of `device` opened at `opened_ms`.
    fn opened(device: &DeviceId, opened_ms: u64) -> SessionChange {
        SessionChange::Opened {
            device: device.clone(),
            connection_id: 1,
            opened_ms,
            peer: Peer::default(),
            progress: Progress::default(),
        }
    }

    /// A started Fleet writing to `store`.
    fn fleet_on(store: Arc<dyn FleetStore>) -> Addr<Fleet> {
        let mut fleet = fleet();
        fleet.store = store;
        fleet.start()
    }

    /// Changes whose writes failed are announced again once the writes land, in their order,
    /// but for connects of streams that have ended since.
    #[actix::test]
    async fn announcements_of_failed_writes_go_again_in_order_once_stored() {
        let store = Arc::new(Flaky::new(true));
        let mut heard = store.inner.subscribe().await.unwrap();
        let fleet = fleet_on(store.clone());
        let change = |device: &str, connection_id: u64, open: bool| {
            let device = DeviceId::parse(device).unwrap();
            if open {
                SessionChange::Opened {
                    device,
                    connection_id,
                    opened_ms: unix_ms(),
                    peer: Peer::default(),
                    progress: Progress::default(),
                }
            } else {
                SessionChange::Closed {
                    device,
                    connection_id,
                    at_ms: unix_ms(),
                    last_sent: None,
                }
            }
        };
        fleet
            .send(SessionChanges(vec![change("dev-1", 1, true)]))
            .await
            .unwrap();
        tokio::time::sleep(FLUSH_EVERY * 3).await;
        fleet
            .send(SessionChanges(vec![
                change("dev-1", 1, false),
                change("dev-2", 2, true),
            ]))
            .await
            .unwrap();
        tokio::time::sleep(FLUSH_EVERY * 3).await;
        store.away.store(false, std::sync::atomic::Ordering::SeqCst);
        // Back: a change now is announced after those of the outage.
        tokio::time::sleep(FLUSH_EVERY / 2).await;
        fleet
            .send(SessionChanges(vec![change("dev-3", 3, true)]))
            .await
            .unwrap();

        let mut changes = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while changes.len() < 3 {
            let next = tokio::time::timeout_at(deadline, heard.next()).await;
            let heard = match next.unwrap_or_else(|_| panic!("after the outage: only {changes:?}"))
            {
                None => panic!("the channel ended"),
                Some(heard) => heard,
            };
            match heard {
                Heard::Message(FleetMessage::Connected(session)) => {
                    changes.push(format!("+{}", session.device.as_str()))
                }
                Heard::Message(FleetMessage::Disconnected { session, .. }) => {
                    changes.push(format!("-{}", session.device.as_str()))
                }
                _ => {}
            }
        }
        // dev-1's connect is not announced again: its stream has ended since. dev-3's goes
        // at once, beside the replay.
        changes.retain(|change| change != "+dev-3");
        assert_eq!(changes, ["-dev-1", "+dev-2"]);
        let dev = |name: &str| DeviceId::parse(name).unwrap();
        let record = store.inner.device(&dev("dev-1")).await.unwrap().unwrap();
        assert!(!record.online, "dev-1's end is stored");
        let record = store.inner.device(&dev("dev-2")).await.unwrap().unwrap();
        assert!(record.online, "dev-2's connect is stored");
    }

    /// A drain closes a stream while a flush is in flight; that flush fails once the farewell
    /// has begun. The farewell waits for it and writes the stream's end, with its exact last
    /// sent id, before it says goodbye: the hub stops the Fleet once the farewell is done, and
    /// a later flush would never come.
    #[actix::test]
    async fn the_farewell_writes_what_a_flush_in_flight_failed_to() {
        let store = Arc::new(Flaky::new(false));
        let fleet = fleet_on(store.clone());
        let device = DeviceId::parse("dev-1").unwrap();
        fleet
            .send(SessionChanges(vec![opened(&device, unix_ms())]))
            .await
            .unwrap();
        tokio::time::sleep(FLUSH_EVERY * 3).await;
        assert!(store.inner.device(&device).await.unwrap().is_some());

        store.stuck.store(true, std::sync::atomic::Ordering::SeqCst);
        let last = Cursor::parse("e1.0.9-0").unwrap();
        fleet
            .send(SessionChanges(vec![SessionChange::Closed {
                device: device.clone(),
                connection_id: 1,
                at_ms: unix_ms(),
                last_sent: Some(last.clone()),
            }]))
            .await
            .unwrap();
        tokio::time::sleep(FLUSH_EVERY * 3).await;
        let farewell = fleet.send(Farewell);
        tokio::time::sleep(FLUSH_EVERY).await;
        store
            .stuck
            .store(false, std::sync::atomic::Ordering::SeqCst);
        store.release.notify_waiters();
        // Woken by the flush's end, not by the wait's limit.
        tokio::time::timeout(FAREWELL_FLUSH_WAIT / 2, farewell)
            .await
            .expect("the farewell ends once the flush in flight has")
            .unwrap();

        let record = store.inner.device(&device).await.unwrap().unwrap();
        assert_eq!(
            record.last_sent.as_ref(),
            Some(&last),
            "the end is stored when the farewell is done: {record:?}"
        );
        assert!(!record.online);
    }

    /// A connect whose write failed is written again after the store is back; meanwhile the
    /// device connected later on another pod, whose write landed first. The retried write must
    /// not take the record: after a failure the order of writes says nothing about the order of
    /// the connects.
    #[actix::test]
    async fn a_retried_connect_does_not_undo_a_later_one() {
        let store = Arc::new(Flaky::new(true));
        let fleet = fleet_on(store.clone());
        let device = DeviceId::parse("dev-1").unwrap();
        fleet
            .send(SessionChanges(vec![opened(&device, unix_ms() - 10_000)]))
            .await
            .unwrap();
        tokio::time::sleep(FLUSH_EVERY * 3).await;
        let later = Session {
            device: device.clone(),
            pod: "pod-b".into(),
            instance: "instance-b".into(),
            session: 7,
            connected_ms: unix_ms(),
            remote: String::new(),
            user_agent: String::new(),
            groups: Groups::default(),
        };
        store
            .inner
            .beat("pod-b", "instance-b", false)
            .await
            .unwrap();
        store
            .inner
            .write(vec![PresenceWrite::Online(later)])
            .await
            .unwrap();
        store.away.store(false, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(FLUSH_EVERY * 5).await;

        let record = store.inner.device(&device).await.unwrap().unwrap();
        assert_eq!(
            (record.instance.as_str(), record.session),
            ("instance-b", 7),
            "{record:?}"
        );
    }

    fn record(device: &str, instance: &str, session: u64) -> DeviceRecord {
        DeviceRecord {
            device: DeviceId::parse(device).unwrap(),
            online: true,
            pod: format!("pod-{instance}"),
            instance: instance.into(),
            session,
            connected_ms: 1_000 + session,
            last_seen_ms: 2_000,
            remote: String::new(),
            user_agent: String::new(),
            groups: Groups::default(),
            last_sent: None,
            acked: None,
            acked_ms: None,
        }
    }

    /// What a read of the devices online after a gap changes in the view, and what it leaves.
    #[actix::test]
    async fn a_read_after_a_gap_repairs_the_view_where_the_store_can_tell() {
        let mut fleet = fleet();
        fleet.loaded = true;
        let now = Instant::now();
        let old = now - NEWS_FRESH * 2;
        for (device, instance) in [("gone", "b"), ("dead-pod", "c"), ("fresh", "b")] {
            fleet.view.insert(
                DeviceId::parse(device).unwrap(),
                Seen {
                    session: record(device, instance, 1).into_session(),
                    open: true,
                    reported: true,
                },
            );
        }
        open(&mut fleet, "mine", 7);
        fleet.news.clear();
        fleet
            .news
            .push_back((old, DeviceId::parse("gone").unwrap()));
        fleet
            .news
            .push_back((now, DeviceId::parse("fresh").unwrap()));
        fleet.due.clear();

        // The store lists a device this pod never heard of on b, none of c's (its beat is stale
        // in the store), not "gone" nor "fresh", and not this pod's own stream.
        let left_out_fresh = fleet.take_online(vec![record("new", "b", 2)], now);

        assert!(left_out_fresh, "fresh news is read again later");
        let seen = |fleet: &Fleet, device: &str| {
            let seen = fleet.view.get(&DeviceId::parse(device).unwrap());
            seen.map(|seen| (seen.open, seen.reported))
        };
        assert_eq!(
            seen(&fleet, "gone"),
            Some((false, true)),
            "b is alive: ended"
        );
        assert_eq!(
            seen(&fleet, "dead-pod"),
            Some((true, true)),
            "c is not in the listing: left to ttl"
        );
        assert_eq!(
            seen(&fleet, "fresh"),
            Some((true, true)),
            "its news is newer"
        );
        assert_eq!(
            seen(&fleet, "mine"),
            Some((true, false)),
            "its own, as it was"
        );
        assert_eq!(
            seen(&fleet, "new"),
            Some((true, false)),
            "to be reported after the first load"
        );

        // At start-up, what the store lists was online before: nothing to report.
        let mut starting = super::tests::fleet();
        starting.take_online(vec![record("new", "b", 2)], Instant::now());
        assert_eq!(seen(&starting, "new"), Some((true, true)));
    }
}

//! `Fleet`: this pod's part of the fleet API (docs/fleet.md).
//!
//! Owns: the fleet store, the presence writes waiting for the next flush, this pod's view of the
//! whole fleet (which device is online on which instance, and what the fleet event stream last
//! said of it), the instances heard from, recent connects announced by other pods, and the
//! subscribers of `GET /v1/fleet/events`.
//! Receives: [`SessionChanges`] from the Router (one message per batch of joins and leaves);
//! the channel's [`FleetMessage`]s from every pod, this one included; [`SubscribeEvents`] from the
//! HTTP edge; [`Farewell`] from Shutdown once the drain is over.
//! Sends: presence writes and announcements to the store, in batches every [`FLUSH_EVERY`]
//! (never one round trip per connection: a reconnect storm of 10,000 devices is a few dozen
//! writes); [`CloseOlder`] to the Router when another pod announces a newer stream of a device
//! that may be connected here (takeover); framed events into each subscriber's bounded channel.
//! When full: a fleet event subscriber whose channel is full is dropped (its stream ends; it
//! reconnects). Writes that fail are kept and retried with the next flush, up to
//! [`MAX_PENDING`]; beyond that the oldest are dropped and counted.
//! Draining: nothing changes until Shutdown sends [`Farewell`]: the last writes are flushed and
//! the instance says it stops, so its devices show offline at once instead of after `ttl`.

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;
use bytes::Bytes;
use futures_util::FutureExt;
use tokio::sync::mpsc;

use super::router::{CloseOlder, Router, SampleProgress};
use crate::{
    backend::fleet::{FleetMessage, FleetStore, PresenceWrite, Session, SessionRef},
    config::PresenceConfig,
    metrics::Metrics,
    model::{shard_of, unix_ms, Cursor, DeviceId},
    stream::Peer,
};

/// How often collected presence writes and announcements go to the store.
const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// Writes kept while the store is unreachable.
const MAX_PENDING: usize = 200_000;
/// How often due debounce decisions and dead instances are looked at.
const EVALUATE_EVERY: Duration = Duration::from_millis(250);
/// How often the last sent id of open streams is written.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How long a connect announced by another pod is remembered, for a local stream that joins
/// after the announcement arrived (the double-connect race).
const RACE_WINDOW: Duration = Duration::from_secs(10);
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

/// From Shutdown after the drain: flush, then tell the fleet this instance is gone.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Farewell;

/// One device in this pod's view of the fleet.
struct Seen {
    pod: String,
    instance: String,
    session: u64,
    /// Its session has not ended (its instance may still be dead).
    open: bool,
    /// What the fleet event stream last said: online or not.
    reported: bool,
}

struct InstanceSeen {
    last_heard: Instant,
    stopped: bool,
}

pub struct Fleet {
    store: Arc<dyn FleetStore>,
    router: Addr<Router>,
    metrics: Arc<Metrics>,
    config: PresenceConfig,
    shards: u32,
    pod: String,
    instance: String,
    pending_writes: Vec<PresenceWrite>,
    pending_messages: Vec<FleetMessage>,
    flushing: bool,
    /// Sessions of this pod still open, per device: for progress and the goodbye of a session.
    view: HashMap<DeviceId, Seen>,
    instances: HashMap<String, InstanceSeen>,
    /// Devices whose state changed, with when their debounce ends.
    due: VecDeque<(Instant, DeviceId)>,
    /// Newest connect announced by another pod per device, and when it arrived.
    remote_connects: HashMap<DeviceId, ((u64, String, u64), Instant)>,
    subscribers: Vec<mpsc::Sender<Bytes>>,
}

impl Fleet {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Arc<dyn FleetStore>,
        router: Addr<Router>,
        metrics: Arc<Metrics>,
        config: PresenceConfig,
        shards: u32,
        instance: String,
    ) -> Self {
        Self {
            store,
            router,
            metrics,
            pod: config.effective_pod_name(),
            config,
            shards,
            instance,
            pending_writes: Vec::new(),
            pending_messages: Vec::new(),
            flushing: false,
            view: HashMap::new(),
            instances: HashMap::new(),
            due: VecDeque::new(),
            remote_connects: HashMap::new(),
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

    fn local(&mut self, change: SessionChange) {
        match change {
            SessionChange::Opened {
                device,
                connection_id,
                opened_ms,
                peer,
            } => {
                let session = Session {
                    device: device.clone(),
                    pod: self.pod.clone(),
                    instance: self.instance.clone(),
                    session: connection_id,
                    connected_ms: opened_ms,
                    remote: peer.remote,
                    user_agent: peer.user_agent,
                };
                // Another pod announced a newer stream before ours joined: ours is the older.
                if let Some(((at, instance, session_id), heard)) =
                    self.remote_connects.get(&device).cloned()
                {
                    if heard.elapsed() < RACE_WINDOW {
                        self.close_older(&device, at, instance, session_id);
                    }
                }
                self.pending_writes
                    .push(PresenceWrite::Online(session.clone()));
                self.pending_messages.push(FleetMessage::Connected(session));
            }
            SessionChange::Closed {
                device,
                connection_id,
                at_ms,
                last_sent,
            } => {
                let session = self.session_ref(device, connection_id);
                self.pending_writes.push(PresenceWrite::Offline {
                    session: session.clone(),
                    at_ms,
                    last_sent,
                });
                self.pending_messages
                    .push(FleetMessage::Disconnected { session, at_ms });
            }
        }
    }

    fn close_older(&self, device: &DeviceId, at: u64, instance: String, session: u64) {
        self.router.do_send(CloseOlder {
            shard: shard_of(device.as_str(), self.shards),
            device: device.clone(),
            opened_ms: at,
            instance,
            session,
        });
    }

    /// A message of the channel (from any pod, this one included).
    fn heard(&mut self, message: FleetMessage) {
        let now = Instant::now();
        match message {
            FleetMessage::Connected(session) => {
                if session.instance != self.instance {
                    let tuple = (
                        session.connected_ms,
                        session.instance.clone(),
                        session.session,
                    );
                    self.close_older(&session.device, tuple.0, tuple.1.clone(), tuple.2);
                    let newer = self
                        .remote_connects
                        .get(&session.device)
                        .is_none_or(|(known, _)| *known < tuple);
                    if newer {
                        self.remote_connects
                            .insert(session.device.clone(), (tuple, now));
                    }
                }
                self.hear_of_instance(&session.instance, now);
                let reported = self
                    .view
                    .get(&session.device)
                    .is_some_and(|seen| seen.reported);
                self.view.insert(
                    session.device.clone(),
                    Seen {
                        pod: session.pod,
                        instance: session.instance,
                        session: session.session,
                        open: true,
                        reported,
                    },
                );
                self.due
                    .push_back((now + self.config.debounce, session.device));
            }
            FleetMessage::Disconnected { session, .. } => {
                if let Some(seen) = self.view.get_mut(&session.device) {
                    if seen.instance == session.instance && seen.session == session.session {
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
                        known.stopped = true;
                    }
                    let gone: Vec<DeviceId> = self
                        .view
                        .iter()
                        .filter(|(_, seen)| seen.instance == instance)
                        .map(|(device, _)| device.clone())
                        .collect();
                    for device in gone {
                        self.due.push_back((now + self.config.debounce, device));
                    }
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
                stopped: false,
            });
        known.last_heard = now;
    }

    fn alive(&self, instance: &str, now: Instant) -> bool {
        self.instances.get(instance).is_some_and(|known| {
            !known.stopped && now.duration_since(known.last_heard) < self.config.ttl
        })
    }

    /// Reports what the debounce let through; notices instances that fell silent.
    fn evaluate(&mut self) {
        let now = Instant::now();
        let ttl = self.config.ttl;
        let silent: Vec<String> = self
            .instances
            .iter_mut()
            .filter(|(_, known)| !known.stopped && now.duration_since(known.last_heard) >= ttl)
            .map(|(instance, known)| {
                // Reported once: from now on its devices count as offline.
                known.stopped = true;
                instance.clone()
            })
            .collect();
        if !silent.is_empty() {
            let devices: Vec<DeviceId> = self
                .view
                .iter()
                .filter(|(_, seen)| silent.contains(&seen.instance))
                .map(|(device, _)| device.clone())
                .collect();
            for device in devices {
                // Its pod died without a goodbye: it went offline when the pod fell silent.
                self.due.push_back((now, device));
            }
        }
        while self.due.front().is_some_and(|(at, _)| *at <= now) {
            let (_, device) = self.due.pop_front().expect("checked");
            let Some(seen) = self.view.get(&device) else {
                continue;
            };
            let online = seen.open && self.alive(&seen.instance, now);
            if online == seen.reported {
                continue;
            }
            let frame = event_frame(online, &device, &seen.pod);
            if let Some(seen) = self.view.get_mut(&device) {
                seen.reported = online;
                if !online {
                    // Keeps the view bounded by the devices online (and those in their debounce).
                    self.view.remove(&device);
                }
            }
            self.publish(frame);
        }
        self.metrics
            .fleet_devices_online
            .set(self.view.values().filter(|seen| seen.reported).count() as i64);
        self.remote_connects
            .retain(|_, (_, heard)| heard.elapsed() < RACE_WINDOW);
    }

    fn publish(&mut self, frame: Bytes) {
        self.subscribers
            .retain(|subscriber| subscriber.try_send(frame.clone()).is_ok());
    }

    fn flush(&mut self, ctx: &mut Context<Self>) {
        if self.flushing || (self.pending_writes.is_empty() && self.pending_messages.is_empty()) {
            return;
        }
        self.flushing = true;
        let writes = std::mem::take(&mut self.pending_writes);
        let messages = std::mem::take(&mut self.pending_messages);
        let store = self.store.clone();
        let work = async move {
            let written = if writes.is_empty() {
                Ok(())
            } else {
                store.write(writes.clone()).await
            };
            let announced = if messages.is_empty() {
                Ok(())
            } else {
                store.announce(messages).await
            };
            (writes, written, announced)
        };
        ctx.spawn(
            work.into_actor(self)
                .map(|(writes, written, announced), fleet, _| {
                    fleet.flushing = false;
                    if let Err(error) = written {
                        log::warn!(
                            "presence: {} writes failed, kept for the next flush: {}",
                            writes.len(),
                            crate::report::Report(&error)
                        );
                        let mut kept = writes;
                        kept.append(&mut fleet.pending_writes);
                        let excess = kept.len().saturating_sub(MAX_PENDING);
                        kept.drain(..excess);
                        fleet.pending_writes = kept;
                    }
                    if let Err(error) = announced {
                        // Other pods miss these connects: their takeover and events fall back on
                        // liveness (ttl).
                        log::warn!(
                            "presence: announcements lost: {}",
                            crate::report::Report(&error)
                        );
                    }
                }),
        );
    }

    fn beat(&mut self, stopping: bool) -> impl std::future::Future<Output = ()> + 'static {
        let store = self.store.clone();
        let (pod, instance) = (self.pod.clone(), self.instance.clone());
        let message = FleetMessage::Alive {
            pod: pod.clone(),
            instance: instance.clone(),
            at_ms: unix_ms(),
            stopping,
        };
        async move {
            if let Err(error) = store.beat(&pod, &instance, stopping).await {
                log::warn!("presence: beat failed: {}", crate::report::Report(&error));
            }
            if let Err(error) = store.announce(vec![message]).await {
                log::warn!(
                    "presence: beat not announced: {}",
                    crate::report::Report(&error)
                );
            }
        }
    }

    fn subscribe(&mut self, ctx: &mut Context<Self>) {
        let store = self.store.clone();
        ctx.spawn(async move { store.subscribe().await }.into_actor(self).map(
            |subscribed, _, ctx| match subscribed {
                Ok(messages) => {
                    ctx.add_stream(messages);
                }
                Err(error) => {
                    log::warn!(
                        "fleet channel: cannot subscribe, retrying in 2s: {}",
                        crate::report::Report(&error)
                    );
                    ctx.run_later(Duration::from_secs(2), |fleet, ctx| fleet.subscribe(ctx));
                }
            },
        ));
    }

    /// Devices online when this pod starts, so that their going offline is reported too.
    fn load_online(&mut self, ctx: &mut Context<Self>) {
        let store = self.store.clone();
        let work = async move {
            let mut online = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                let page = store
                    .list(
                        crate::backend::fleet::OnlineFilter::Online,
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
            Ok::<_, crate::backend::BackendError>(online)
        };
        ctx.spawn(work.into_actor(self).map(|loaded, fleet, _| match loaded {
            Ok(devices) => {
                let now = Instant::now();
                for record in devices {
                    fleet.hear_of_instance(&record.instance, now);
                    fleet.view.entry(record.device).or_insert(Seen {
                        pod: record.pod,
                        instance: record.instance,
                        session: record.session,
                        open: true,
                        reported: true,
                    });
                }
            }
            Err(error) => log::warn!(
                "presence: cannot load the devices online: {}",
                crate::report::Report(&error)
            ),
        }));
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
        self.load_online(ctx);
        ctx.spawn(self.beat(false).into_actor(self));
        ctx.run_interval(self.config.ttl / 3, |fleet, ctx| {
            ctx.spawn(fleet.beat(false).into_actor(fleet));
        });
        ctx.run_interval(FLUSH_EVERY, |fleet, ctx| fleet.flush(ctx));
        ctx.run_interval(EVALUATE_EVERY, |fleet, _| fleet.evaluate());
        ctx.run_interval(SUBSCRIBER_PING, |fleet, _| {
            fleet.publish(crate::sse::frame::PING);
        });
        ctx.run_interval(PROGRESS_EVERY, |fleet, ctx| {
            let sample = fleet.router.send(SampleProgress);
            ctx.spawn(sample.into_actor(fleet).map(|sampled, fleet, _| {
                for (device, connection_id, last_sent) in sampled.unwrap_or_default() {
                    let session = fleet.session_ref(device, connection_id);
                    fleet
                        .pending_writes
                        .push(PresenceWrite::Sent { session, last_sent });
                }
            }));
        });
    }
}

impl Handler<SessionChanges> for Fleet {
    type Result = ();

    fn handle(&mut self, SessionChanges(changes): SessionChanges, _: &mut Context<Self>) {
        for change in changes {
            self.local(change);
        }
    }
}

impl StreamHandler<FleetMessage> for Fleet {
    fn handle(&mut self, message: FleetMessage, _: &mut Context<Self>) {
        self.heard(message);
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
        let writes = std::mem::take(&mut self.pending_writes);
        let messages = std::mem::take(&mut self.pending_messages);
        let store = self.store.clone();
        let goodbye = self.beat(true);
        Box::pin(
            async move {
                if !writes.is_empty() {
                    if let Err(error) = store.write(writes).await {
                        log::warn!(
                            "presence: last writes failed: {}",
                            crate::report::Report(&error)
                        );
                    }
                }
                if !messages.is_empty() {
                    let _ = store.announce(messages).await;
                }
                goodbye.await;
            }
            .boxed_local()
            .into_actor(self),
        )
    }
}

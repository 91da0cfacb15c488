//! The fleet store: what every pod records about the devices it serves (presence and
//! acknowledgements) and the channel on which pods tell each other about connects, disconnects
//! and their own liveness. Implemented by the memory backend (this pod only), Redis (shared keys
//! and a pub/sub channel) and NATS (KV buckets and a core subject); docs/fleet.md describes the
//! keys, and `tests/fleet_store.rs` holds every implementation to this contract.
//!
//! # Contract
//! - **Sessions.** A device's record names its latest session: the pod (display name), the pod
//!   *instance* (random per process, so a restarted pod with the same name does not revive the
//!   sessions of its previous life), the session id (unique within the instance), when it
//!   connected, the remote address and the user agent. `Online` replaces the record's session
//!   when [`replaces`] says so (the order of two writes is not the order of the connects: the
//!   pods flush in batches); `Online` of the session the record already names only refreshes
//!   it. `Refresh` writes a session still open on its pod again (so that retention never
//!   forgets a connected device, and a store that lost its records learns it again): it
//!   creates a record that is gone, refreshes one naming the same open session, and replaces
//!   another session only if it ranks higher ([`refreshes`]: whatever the writing pod's view
//!   of the fleet, a refresh never undoes a later connect). `Offline` ends the session only if
//!   the record still names that same instance and session (a late goodbye of a replaced
//!   session changes nothing), and `Sent` applies only to that session while it is open. A
//!   session that replaces another keeps the record's ack and last sent id (until it sends
//!   something itself): both say where the device is, not what one session did.
//! - **Liveness.** A device is online iff its record names a session that has not ended and whose
//!   instance has beaten (`beat`) within `ttl`, measured on the store's clock where it has one
//!   (Redis `TIME`, the NATS server's timestamps). So the devices of a pod that died without a
//!   goodbye turn offline within `ttl`, with no writer. `last_seen_at` is then the instance's last
//!   beat; for an ended session its end; for an online device the time of the read.
//! - **Retention.** A record not written for `retention` may be forgotten (404). Stores bound
//!   their size by it.
//! - **Listing** pages in a stable order (by device id) with an opaque `next` cursor; a page may
//!   hold fewer than `limit` devices (a filter dropped some) and still have a `next`. A device
//!   added or removed between two pages may or may not appear; no device present throughout is
//!   skipped or repeated.
//! - **Acks** only move forward: within one epoch of the device's shard, a position at or below
//!   the stored one changes nothing; a cursor of another epoch replaces the stored one (the
//!   stream began a new life, whose positions say nothing about the old one's). Atomic with
//!   respect to concurrent acks of the same device (a Lua compare, a KV revision check, a lock).
//!   An ack creates the record when none exists (the device never connected through a hub).
//! - **Broadcast copies.** The hub records, for every broadcast or group event it appends, the
//!   cursor of each copy (every shard's, or a group event's members' shards'), keyed by the id
//!   it answered (the first copy), for
//!   `broadcast_retention` (the memory store also keeps at most as many as its log keeps
//!   entries per shard).
//! - **Group index.** Sessions written online or refreshed mark their groups in their device's
//!   shard ([`groups::GroupMarks`], at most once per period per pod, confirmed only once
//!   written); `group_index` answers a group's marks with when its index began (kept with the
//!   marks) and the store's clock now; `None` for a group without one. Marks older than the seen
//!   window may be forgotten, and an index none of whose marks is fresh with them
//!   ([`groups::shards_to_write`] says what a publish does with it).
//! - **Channel.** `announce` reaches every subscriber of every pod, this one included, at most
//!   once and in order per publisher; `subscribe` is resubscribed by the store after an outage,
//!   and then yields [`Heard::Gap`]: messages sent meanwhile may be lost, so the subscriber reads
//!   the store again. So does one that fell behind.

pub mod groups;
pub mod memory;

use std::time::Duration;

use futures_util::{future::BoxFuture, stream::BoxStream};
use serde::{Deserialize, Serialize};

use super::BackendResult;
use crate::model::{Cursor, DeviceId, GroupName, Groups};

/// What every store is built with (`[presence]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetSettings {
    /// The backend's shards: a group's members are indexed by their device's shard.
    pub shards: u32,
    /// An instance that has not beaten for this long is dead, and its sessions offline.
    pub ttl: Duration,
    /// Records not written for this long may be forgotten.
    pub retention: Duration,
    /// Broadcast copies are kept this long: the backend's event retention, beyond which the
    /// broadcast itself is trimmed and cannot be asked about.
    pub broadcast_retention: Duration,
}

/// One session of a device on one pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub device: DeviceId,
    /// The pod's display name (`presence.pod_name`).
    pub pod: String,
    /// Random per process: liveness is per instance.
    pub instance: String,
    /// Unique within the instance (the connection id).
    pub session: u64,
    /// Unix ms, the pod's clock.
    pub connected_ms: u64,
    pub remote: String,
    pub user_agent: String,
    /// The device's groups in this session (absent in what a pod of an older version sent).
    #[serde(default)]
    pub groups: Groups,
}

/// Names one session without its details.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SessionRef {
    pub device: DeviceId,
    pub instance: String,
    pub session: u64,
}

/// A change to the presence records, written in batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PresenceWrite {
    /// The device's latest session began.
    Online(Session),
    /// A session still open on its pod, written again: so that retention does not forget it,
    /// and so that a store that lost its records learns it again. See [`refreshes`].
    Refresh(Session),
    /// The session ended at `at_ms` (the pod's clock) having last written `last_sent`.
    Offline {
        session: SessionRef,
        at_ms: u64,
        last_sent: Option<Cursor>,
    },
    /// The session has written events up to `last_sent`.
    Sent {
        session: SessionRef,
        last_sent: Cursor,
    },
}

/// What a store knows of one device, as `GET /v1/devices/{device}` answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRecord {
    pub device: DeviceId,
    pub online: bool,
    pub pod: String,
    /// The session's instance and id (not shown by the API: what a pod starting up needs to
    /// follow the devices already online).
    pub instance: String,
    pub session: u64,
    pub connected_ms: u64,
    /// Unix ms: the read for an online device; the session's end, or its pod's last beat.
    pub last_seen_ms: u64,
    pub remote: String,
    pub user_agent: String,
    pub groups: Groups,
    pub last_sent: Option<Cursor>,
    pub acked: Option<Cursor>,
    pub acked_ms: Option<u64>,
}

impl DeviceRecord {
    /// The session the record names.
    pub fn into_session(self) -> Session {
        Session {
            device: self.device,
            pod: self.pod,
            instance: self.instance,
            session: self.session,
            connected_ms: self.connected_ms,
            remote: self.remote,
            user_agent: self.user_agent,
            groups: self.groups,
        }
    }
}

/// Which devices a listing returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnlineFilter {
    Any,
    Online,
    Offline,
}

impl OnlineFilter {
    pub fn admits(self, online: bool) -> bool {
        match self {
            OnlineFilter::Any => true,
            OnlineFilter::Online => online,
            OnlineFilter::Offline => !online,
        }
    }
}

/// Which devices a listing returns: online or not, and in a group or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFilter {
    pub online: OnlineFilter,
    /// Only the devices whose latest session was in this group.
    pub group: Option<GroupName>,
}

impl DeviceFilter {
    pub const ANY: DeviceFilter = DeviceFilter {
        online: OnlineFilter::Any,
        group: None,
    };

    pub fn admits(&self, record: &DeviceRecord) -> bool {
        self.online.admits(record.online)
            && self
                .group
                .as_ref()
                .is_none_or(|group| record.groups.contains(group))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePage {
    pub devices: Vec<DeviceRecord>,
    /// Where the next page starts; `None` after the last page.
    pub next: Option<String>,
}

/// What an ack did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckOutcome {
    /// Stored: it was ahead of the stored ack (or of another epoch, or the first).
    Moved,
    /// At or behind the stored ack: nothing changed.
    Stale,
}

/// What pods tell each other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FleetMessage {
    /// A stream opened; any older stream of the device on another pod closes (`takeover`).
    Connected(Session),
    /// A stream ended.
    Disconnected { session: SessionRef, at_ms: u64 },
    /// An instance is alive; sent every `ttl / 3`. `stopping`: its last word before exiting
    /// (its sessions ended with it).
    Alive {
        pod: String,
        instance: String,
        at_ms: u64,
        stopping: bool,
    },
}

/// What a subscription to the channel yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    Message(FleetMessage),
    /// Messages may have been lost here: the subscription was away (the store's link dropped and
    /// came back, and it is subscribed again) or fell behind. What the store holds is the truth
    /// to go back to.
    Gap,
}

pub trait FleetStore: Send + Sync + 'static {
    /// Applies a batch of presence changes in order, in as few round trips as the store allows.
    fn write(&self, changes: Vec<PresenceWrite>) -> BoxFuture<'_, BackendResult<()>>;
    /// Records that `instance` (of pod `pod`) is alive; stale after the store's `ttl`. With
    /// `stopping`, the instance is gone at once (its sessions are offline).
    fn beat(&self, pod: &str, instance: &str, stopping: bool) -> BoxFuture<'_, BackendResult<()>>;
    /// The device's record, `None` if unknown or forgotten.
    fn device(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Option<DeviceRecord>>>;
    /// Up to `limit` devices after `cursor` (from the start when `None`), in device-id order.
    fn list(
        &self,
        filter: &DeviceFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> BoxFuture<'_, BackendResult<DevicePage>>;
    /// Stores `cursor` as the device's acknowledged position if it moves forward.
    fn ack(
        &self,
        device: &DeviceId,
        cursor: &Cursor,
        at_ms: u64,
    ) -> BoxFuture<'_, BackendResult<AckOutcome>>;
    /// Records the copies of a broadcast or a group event (one per shard it was stored in, in
    /// shard order) under
    /// the id the hub answered, `copies[0]`.
    fn record_broadcast(&self, copies: Vec<Cursor>) -> BoxFuture<'_, BackendResult<()>>;
    /// The copies of the broadcast answered as `id`; `None` if unknown or forgotten.
    fn broadcast_copies(&self, id: &Cursor) -> BoxFuture<'_, BackendResult<Option<Vec<Cursor>>>>;
    /// Where the members of `group` were seen (marked by `write`); `None` if the store holds
    /// nothing for it.
    fn group_index(
        &self,
        group: &GroupName,
    ) -> BoxFuture<'_, BackendResult<Option<groups::GroupIndex>>>;
    /// Sends `messages` to every pod's subscription, in order, in one message of the channel
    /// (a storm's connects travel in batches, not one publish each).
    fn announce(&self, messages: Vec<FleetMessage>) -> BoxFuture<'_, BackendResult<()>>;
    /// Every message announced from now on, by any pod, and a [`Heard::Gap`] wherever some may
    /// have been lost.
    fn subscribe(&self) -> BoxFuture<'_, BackendResult<BoxStream<'static, Heard>>>;
}

/// Two sessions of a device that opened within this long of each other are a race, decided by
/// `(connected_ms, instance, session)` everywhere (takeover, presence records, fleet events), so
/// that every pod agrees on which one survives. Beyond it, the later one wins.
pub const RACE_WINDOW: Duration = Duration::from_secs(2);

impl Session {
    /// The stand-in of a device acknowledged before any session of it was recorded.
    pub fn unknown(device: &DeviceId) -> Self {
        Session {
            device: device.clone(),
            pod: String::new(),
            instance: String::new(),
            session: 0,
            connected_ms: 0,
            remote: String::new(),
            user_agent: String::new(),
            groups: Groups::default(),
        }
    }

    /// The order of a race: greater survives.
    pub fn rank(&self) -> (u64, &str, u64) {
        (self.connected_ms, &self.instance, self.session)
    }

    /// Names this session without its details.
    pub fn reference(&self) -> SessionRef {
        SessionRef {
            device: self.device.clone(),
            instance: self.instance.clone(),
            session: self.session,
        }
    }

    /// Whether `other` is the same session.
    pub fn is(&self, other: &Session) -> bool {
        self.instance == other.instance && self.session == other.session
    }
}

/// Whether `new` takes the place of `stored` (ended or not) in a device's record. The same
/// session again (a pod refreshing the record of a long open stream) keeps the record as it
/// is, but for the time it was written.
pub fn replaces(new: &Session, stored: &Session, stored_open: bool) -> bool {
    let race = new.connected_ms.abs_diff(stored.connected_ms) < RACE_WINDOW.as_millis() as u64;
    new.is(stored) || !stored_open || !race || new.rank() > stored.rank()
}

/// Whether a refresh of `new` writes a device's record that names `stored` (a record that is
/// gone is always written again): the same session only while it is open (an ended one stays
/// ended); another session only if `new` ranks higher, so a pod with a stale view (a takeover
/// on its way, a connect it has not heard of) cannot take the record from a newer session.
pub fn refreshes(new: &Session, stored: &Session, stored_open: bool) -> bool {
    if new.is(stored) {
        stored_open
    } else {
        new.rank() > stored.rank()
    }
}

/// A record's `last_seen_ms`: when its session ended; now while it is online; else the last beat
/// of its instance (a pod that died), or when it connected if no beat is known.
pub fn last_seen_ms(
    ended_ms: Option<u64>,
    online: bool,
    now_ms: u64,
    last_beat_ms: Option<u64>,
    connected_ms: u64,
) -> u64 {
    match (ended_ms, online) {
        (Some(ended), _) => ended,
        (None, true) => now_ms,
        (None, false) => last_beat_ms.unwrap_or(connected_ms),
    }
}

/// Whether an ack of `new` moves the device's acknowledged position forward from `stored`.
pub fn ack_moves(stored: Option<&Cursor>, new: &Cursor) -> bool {
    match stored {
        None => true,
        Some(stored) => {
            stored.epoch != new.epoch || stored.shard != new.shard || new.position > stored.position
        }
    }
}

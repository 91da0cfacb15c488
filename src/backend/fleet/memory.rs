//! The fleet store of the memory backend: this pod's devices, in a map behind one mutex, and an
//! in-process channel. Only this pod's streams exist, so takeover and fleet events stay within
//! it; the contract is the same as for the shared stores (module doc of `fleet`).

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    sync::Mutex,
    time::Duration,
};

use futures_util::{future::BoxFuture, stream::BoxStream, FutureExt, StreamExt};
use tokio::sync::broadcast;

use super::{
    ack_moves,
    groups::{seen_window, GroupIndex, GroupMarks},
    last_seen_ms, refreshes, replaces, AckOutcome, DeviceFilter, DevicePage, DeviceRecord,
    FleetMessage, FleetSettings, FleetStore, Heard, PresenceWrite, Session,
};
use crate::{
    backend::BackendResult,
    model::{unix_ms, Cursor, DeviceId, GroupName},
};

/// Messages a slow subscriber may fall behind by before it misses some (it then hears a gap,
/// as after an outage of a shared store).
const CHANNEL_CAPACITY: usize = 65_536;

pub struct MemoryFleet {
    settings: FleetSettings,
    /// Broadcasts whose copies are kept at most: the memory log's `max_len`, since an older
    /// broadcast has been trimmed from every shard and cannot be asked about.
    max_broadcasts: usize,
    state: Mutex<State>,
    channel: broadcast::Sender<FleetMessage>,
    marks: GroupMarks,
}

#[derive(Default)]
struct State {
    /// Looked up by hash: every progress sample of every stream is a lookup (a search of a
    /// tree of 10,000 heap-allocated names cost about 14 cache misses each; docs/BENCHMARKS.md).
    devices: HashMap<DeviceId, Stored>,
    /// The same devices in order, for the pages of a listing.
    order: BTreeSet<DeviceId>,
    /// When records were last swept for retention (Unix ms).
    swept_ms: u64,
    /// Last beat per instance, Unix ms; `None` once it said it stops.
    instances: HashMap<String, Option<u64>>,
    /// The copies of each recorded broadcast by the id it was answered with, and when it was
    /// recorded (Unix ms).
    broadcasts: HashMap<String, (u64, Vec<Cursor>)>,
    /// The same ids in the order they were recorded, so the oldest go first.
    broadcast_order: VecDeque<(u64, String)>,
    /// Per group: since when it is indexed, and per shard the last mark of a member there.
    groups: HashMap<GroupName, (u64, HashMap<u32, u64>)>,
}

#[derive(Clone)]
struct Stored {
    session: Session,
    ended_ms: Option<u64>,
    last_sent: Option<Cursor>,
    acked: Option<Cursor>,
    acked_ms: Option<u64>,
    written_ms: u64,
}

impl MemoryFleet {
    pub fn new(settings: FleetSettings, max_broadcasts: usize) -> Self {
        Self {
            settings,
            max_broadcasts,
            state: Mutex::new(State::default()),
            channel: broadcast::channel(CHANNEL_CAPACITY).0,
            marks: GroupMarks::new(settings.shards, settings.retention),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl State {
    /// Records the copies of broadcast `id` (a broadcast recorded again counts from its last
    /// record).
    fn record_broadcast(&mut self, id: String, copies: Vec<Cursor>, now: u64) {
        self.broadcast_order.push_back((now, id.clone()));
        self.broadcasts.insert(id, (now, copies));
    }

    /// Forgets the broadcasts recorded before `retention` and the oldest beyond `max`.
    fn forget_broadcasts(&mut self, now: u64, retention: Duration, max: usize) {
        let oldest = now.saturating_sub(retention.as_millis() as u64);
        while let Some((recorded, id)) = self.broadcast_order.front() {
            if *recorded >= oldest && self.broadcasts.len() <= max {
                break;
            }
            // The entry of a broadcast recorded again since is stale: its record stays.
            if self
                .broadcasts
                .get(id)
                .is_some_and(|(written, _)| written == recorded)
            {
                self.broadcasts.remove(id);
            }
            self.broadcast_order.pop_front();
        }
    }

    /// Forgets records not written for `retention`, but never an open session of a live
    /// instance (a terminal connected all week with nothing sent). At most once a second: the
    /// sweep visits every record.
    fn forget_old(&mut self, now: u64, settings: &FleetSettings) {
        if now.saturating_sub(self.swept_ms) < 1000 {
            return;
        }
        self.swept_ms = now;
        let oldest = now.saturating_sub(settings.retention.as_millis() as u64);
        let (instances, order) = (&self.instances, &mut self.order);
        self.devices.retain(|device, stored| {
            let kept = stored.written_ms >= oldest
                || (stored.ended_ms.is_none()
                    && alive(instances, &stored.session.instance, now, settings.ttl));
            if !kept {
                order.remove(device);
            }
            kept
        });
        self.instances
            .retain(|_, beat| beat.is_some_and(|beat| beat >= oldest));
        let window = seen_window(settings.retention, settings.broadcast_retention);
        let unseen = now.saturating_sub(window.as_millis() as u64);
        self.groups.retain(|_, (_, marks)| {
            marks.retain(|_, marked| *marked >= unseen);
            !marks.is_empty()
        });
    }

    fn record(&self, stored: &Stored, now: u64, ttl: Duration) -> DeviceRecord {
        let beat = self
            .instances
            .get(&stored.session.instance)
            .copied()
            .flatten();
        let online =
            stored.ended_ms.is_none() && alive(&self.instances, &stored.session.instance, now, ttl);
        let last_seen_ms = last_seen_ms(
            stored.ended_ms,
            online,
            now,
            beat,
            stored.session.connected_ms,
        );
        DeviceRecord {
            device: stored.session.device.clone(),
            online,
            pod: stored.session.pod.clone(),
            instance: stored.session.instance.clone(),
            session: stored.session.session,
            connected_ms: stored.session.connected_ms,
            last_seen_ms,
            remote: stored.session.remote.clone(),
            user_agent: stored.session.user_agent.clone(),
            groups: stored.session.groups.clone(),
            last_sent: stored.last_sent.clone(),
            acked: stored.acked.clone(),
            acked_ms: stored.acked_ms,
        }
    }
}

fn alive(
    instances: &HashMap<String, Option<u64>>,
    instance: &str,
    now: u64,
    ttl: Duration,
) -> bool {
    instances
        .get(instance)
        .copied()
        .flatten()
        .is_some_and(|beat| now.saturating_sub(beat) < ttl.as_millis() as u64)
}

fn same_session(stored: &Stored, instance: &str, session: u64) -> bool {
    stored.session.instance == instance && stored.session.session == session
}

impl FleetStore for MemoryFleet {
    fn write(&self, changes: Vec<PresenceWrite>) -> BoxFuture<'_, BackendResult<()>> {
        let now = unix_ms();
        let due = self.marks.due(&changes, now);
        let mut state = self.state();
        let window = seen_window(self.settings.retention, self.settings.broadcast_retention);
        let unseen = now.saturating_sub(window.as_millis() as u64);
        for (group, shards) in &due {
            let (since, marks) = state
                .groups
                .entry(group.clone())
                .or_insert_with(|| (now, HashMap::new()));
            // An index no member marked within the window is forgotten (not yet swept): it
            // begins again.
            if marks.values().all(|&marked| marked < unseen) {
                *since = now;
                marks.clear();
            }
            for &shard in shards {
                marks.insert(shard, now);
            }
        }
        self.marks.written(&due, now);
        for change in changes {
            let refresh = matches!(change, PresenceWrite::Refresh(_));
            match change {
                PresenceWrite::Online(session) | PresenceWrite::Refresh(session) => {
                    if let Some(stored) = state.devices.get_mut(&session.device) {
                        let open = stored.ended_ms.is_none();
                        let writes = if refresh {
                            refreshes(&session, &stored.session, open)
                        } else {
                            replaces(&session, &stored.session, open)
                        };
                        if !writes {
                            continue;
                        }
                        if stored.session.is(&session) {
                            stored.written_ms = now;
                            continue;
                        }
                    }
                    let stored = state.devices.get(&session.device);
                    // The ack and the last position outlive the session they were written in.
                    let (acked, acked_ms, last_sent) = stored
                        .map(|stored| {
                            (
                                stored.acked.clone(),
                                stored.acked_ms,
                                stored.last_sent.clone(),
                            )
                        })
                        .unwrap_or_default();
                    if stored.is_none() {
                        state.order.insert(session.device.clone());
                    }
                    state.devices.insert(
                        session.device.clone(),
                        Stored {
                            session,
                            ended_ms: None,
                            last_sent,
                            acked,
                            acked_ms,
                            written_ms: now,
                        },
                    );
                }
                PresenceWrite::Offline {
                    session,
                    at_ms,
                    last_sent,
                } => {
                    if let Some(stored) = state.devices.get_mut(&session.device) {
                        if same_session(stored, &session.instance, session.session) {
                            stored.ended_ms = Some(at_ms);
                            stored.last_sent = last_sent.or(stored.last_sent.take());
                            stored.written_ms = now;
                        }
                    }
                }
                PresenceWrite::Sent { session, last_sent } => {
                    if let Some(stored) = state.devices.get_mut(&session.device) {
                        // A sample taken before the session ended must not undo its exact end.
                        if same_session(stored, &session.instance, session.session)
                            && stored.ended_ms.is_none()
                        {
                            stored.last_sent = Some(last_sent);
                            stored.written_ms = now;
                        }
                    }
                }
            }
        }
        state.forget_old(now, &self.settings);
        async { Ok(()) }.boxed()
    }

    fn beat(&self, _pod: &str, instance: &str, stopping: bool) -> BoxFuture<'_, BackendResult<()>> {
        let beat = (!stopping).then(unix_ms);
        self.state().instances.insert(instance.to_owned(), beat);
        async { Ok(()) }.boxed()
    }

    fn device(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Option<DeviceRecord>>> {
        let now = unix_ms();
        let mut state = self.state();
        state.forget_old(now, &self.settings);
        let record = state
            .devices
            .get(device)
            .map(|stored| state.record(stored, now, self.settings.ttl));
        async { Ok(record) }.boxed()
    }

    fn list(
        &self,
        filter: &DeviceFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> BoxFuture<'_, BackendResult<DevicePage>> {
        let now = unix_ms();
        let mut state = self.state();
        state.forget_old(now, &self.settings);
        // The cursor is the last device of the previous page: any text is a place in the order.
        let start = match cursor {
            Some(after) => std::ops::Bound::Excluded(after),
            None => std::ops::Bound::Unbounded,
        };
        let mut devices = Vec::new();
        let mut last = None;
        for (device, stored) in state
            .order
            .range::<str, _>((start, std::ops::Bound::Unbounded))
            .take(limit.max(1))
            .filter_map(|device| Some((device, state.devices.get(device)?)))
        {
            last = Some(device.clone());
            let record = state.record(stored, now, self.settings.ttl);
            if filter.admits(&record) {
                devices.push(record);
            }
        }
        let more = last.as_ref().is_some_and(|last| {
            state
                .order
                .range::<str, _>((
                    std::ops::Bound::Excluded(last.as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .next()
                .is_some()
        });
        let next = last.filter(|_| more).map(|last| last.to_string());
        async { Ok(DevicePage { devices, next }) }.boxed()
    }

    fn ack(
        &self,
        device: &DeviceId,
        cursor: &Cursor,
        at_ms: u64,
    ) -> BoxFuture<'_, BackendResult<AckOutcome>> {
        let now = unix_ms();
        let mut state = self.state();
        if !state.devices.contains_key(device) {
            state.order.insert(device.clone());
        }
        let stored = state
            .devices
            .entry(device.clone())
            .or_insert_with(|| Stored {
                session: Session::unknown(device),
                ended_ms: Some(at_ms),
                last_sent: None,
                acked: None,
                acked_ms: None,
                written_ms: now,
            });
        let outcome = if ack_moves(stored.acked.as_ref(), cursor) {
            stored.acked = Some(cursor.clone());
            stored.acked_ms = Some(at_ms);
            stored.written_ms = now;
            AckOutcome::Moved
        } else {
            AckOutcome::Stale
        };
        async move { Ok(outcome) }.boxed()
    }

    fn record_broadcast(&self, copies: Vec<Cursor>) -> BoxFuture<'_, BackendResult<()>> {
        if let Some(id) = copies.first() {
            let (id, now) = (id.to_string(), unix_ms());
            let mut state = self.state();
            state.record_broadcast(id, copies, now);
            state.forget_broadcasts(now, self.settings.broadcast_retention, self.max_broadcasts);
        }
        async { Ok(()) }.boxed()
    }

    fn broadcast_copies(&self, id: &Cursor) -> BoxFuture<'_, BackendResult<Option<Vec<Cursor>>>> {
        let now = unix_ms();
        let mut state = self.state();
        state.forget_broadcasts(now, self.settings.broadcast_retention, self.max_broadcasts);
        let copies = state
            .broadcasts
            .get(&id.to_string())
            .map(|(_, copies)| copies.clone());
        async { Ok(copies) }.boxed()
    }

    fn group_index(&self, group: &GroupName) -> BoxFuture<'_, BackendResult<Option<GroupIndex>>> {
        // Forgotten after the seen window, as the shared stores' entries expire.
        let now_ms = unix_ms();
        let window = seen_window(self.settings.retention, self.settings.broadcast_retention);
        let unseen = now_ms.saturating_sub(window.as_millis() as u64);
        let index = self
            .state()
            .groups
            .get(group)
            .map(|(since_ms, marks)| GroupIndex {
                since_ms: *since_ms,
                marks: marks
                    .iter()
                    .filter(|(_, &ms)| ms >= unseen)
                    .map(|(&shard, &ms)| (shard, ms))
                    .collect(),
                now_ms,
            })
            .filter(|index| !index.marks.is_empty());
        async { Ok(index) }.boxed()
    }

    fn announce(&self, messages: Vec<FleetMessage>) -> BoxFuture<'_, BackendResult<()>> {
        for message in messages {
            // No subscriber yet is not an error: nobody was listening.
            let _ = self.channel.send(message);
        }
        async { Ok(()) }.boxed()
    }

    fn subscribe(&self) -> BoxFuture<'_, BackendResult<BoxStream<'static, Heard>>> {
        let receiver = self.channel.subscribe();
        let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
            match receiver.recv().await {
                Ok(message) => Some((Heard::Message(message), receiver)),
                Err(broadcast::error::RecvError::Lagged(_)) => Some((Heard::Gap, receiver)),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        })
        .boxed();
        async { Ok(stream) }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Epoch, Position};

    fn store(broadcast_retention: Duration, max_broadcasts: usize) -> MemoryFleet {
        MemoryFleet::new(
            FleetSettings {
                shards: 8,
                ttl: Duration::from_secs(30),
                retention: Duration::from_secs(7 * 24 * 3600),
                broadcast_retention,
            },
            max_broadcasts,
        )
    }

    /// The copies of a broadcast on 64 shards, the first at `ms`.
    fn copies(ms: u64) -> Vec<Cursor> {
        let epoch = Epoch::new("e1").unwrap();
        (0..64)
            .map(|shard| Cursor::new(epoch.clone(), shard, Position::new(ms, 0)))
            .collect()
    }

    /// Broadcast copies go with the event retention, not with presence's 7 days. Regression:
    /// each broadcast's ~3.3 KB stayed for `presence.retention` (50,000 broadcasts held 166 MB
    /// more than with presence off), long after the broadcast itself was trimmed.
    #[tokio::test]
    async fn broadcast_copies_go_with_the_event_retention() {
        let fleet = store(Duration::from_millis(200), 1_000);
        let first = copies(1);
        fleet.record_broadcast(first.clone()).await.unwrap();
        assert_eq!(
            fleet.broadcast_copies(&first[0]).await.unwrap(),
            Some(first.clone())
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(fleet.broadcast_copies(&first[0]).await.unwrap(), None);
        assert!(fleet.state().broadcast_order.is_empty());
    }

    /// At most `max_broadcasts` are kept, the newest: an older broadcast has been trimmed from
    /// the memory log's every shard by its length cap.
    #[tokio::test]
    async fn at_most_the_logs_length_of_broadcasts_is_kept() {
        let fleet = store(Duration::from_secs(900), 3);
        let all: Vec<Vec<Cursor>> = (1..=5).map(copies).collect();
        for broadcast in &all {
            fleet.record_broadcast(broadcast.clone()).await.unwrap();
        }
        let mut kept = Vec::new();
        for broadcast in &all {
            kept.push(
                fleet
                    .broadcast_copies(&broadcast[0])
                    .await
                    .unwrap()
                    .is_some(),
            );
        }
        assert_eq!(kept, [false, false, true, true, true]);
        assert_eq!(fleet.state().broadcast_order.len(), 3);
    }
}

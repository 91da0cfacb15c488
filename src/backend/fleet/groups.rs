//! Where a group's members are: per group, the shards in which a member's session was written,
//! and when. The publisher reads it to store a group event only in those shards (a store of
//! eight terminals costs at most eight entries, not one per shard); every fleet store keeps it
//! beside its records and marks it as it writes sessions. Decisions are made here, once, from
//! what a store returns ([`shards_to_write`]); stores only keep the marks.
//!
//! A shard is named for as long as a member there may still need a copy: seen within the
//! longer of `presence.retention` and the event retention (an away member resumes as long as its
//! cursor is kept), plus the longest an open session goes without being marked again
//! ([`seen_window`]). Marks name only what was written since the group's index began (its
//! `since`, kept in the same key as its marks, so that whatever loses one loses the other): a
//! member seen before that (by a pod of a version that did not mark, or in an index the store
//! lost) would be missed, so until a group's index has been kept for a whole window, and for a
//! group without one, a group event goes to every shard.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Mutex,
    time::Duration,
};

use super::PresenceWrite;
use crate::model::{shard_of, GroupName};

/// Longest time between two refreshes of an open session's record.
const REFRESH_AT_MOST: Duration = Duration::from_secs(3600);

/// How often a pod writes an open session's record again (`presence.retention / 4`, at most an
/// hour), so that retention never forgets a device that stays connected without being sent
/// anything, and a store that lost its records learns them again.
pub fn refresh_every(retention: Duration) -> Duration {
    (retention / 4).min(REFRESH_AT_MOST)
}

/// How often a pod marks one (group, shard) at most: a storm of connects writes each pair once.
fn mark_every(retention: Duration) -> Duration {
    refresh_every(retention) / 4
}

/// How long a mark names its shard: the longer of `presence_retention` (a member seen within it
/// counts) and `event_retention` (an away member resumes while its cursor is kept), plus three
/// refresh periods, the longest an open session goes unmarked: a refresh is written at the pod's
/// first visit after its period (visits come at most a period apart), and a pair marked within
/// [`mark_every`] is not marked again.
pub fn seen_window(presence_retention: Duration, event_retention: Duration) -> Duration {
    presence_retention.max(event_retention) + 3 * refresh_every(presence_retention)
}

/// What a store holds for one group, with the time of the read: all Unix ms by the store's clock
/// where it has one (Redis `TIME` of the group key's node, the NATS server's), so that pods'
/// clocks do not matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupIndex {
    /// When the store began to keep this group's index.
    pub since_ms: u64,
    /// Per shard, the newest mark of a member there.
    pub marks: Vec<(u32, u64)>,
    pub now_ms: u64,
}

/// The shards a group event is stored on: `None` for every shard (no index for the group, or
/// one kept for less than `window`), else the shards marked within `window`, ascending (empty:
/// no member is known).
pub fn shards_to_write(
    index: Option<&GroupIndex>,
    window: Duration,
    shards: u32,
) -> Option<Vec<u32>> {
    let index = index?;
    let window = window.as_millis() as u64;
    let now_ms = index.now_ms;
    if now_ms.saturating_sub(index.since_ms) < window {
        return None;
    }
    let oldest = now_ms.saturating_sub(window);
    let seen: BTreeSet<u32> = index
        .marks
        .iter()
        .filter(|&&(shard, marked)| marked >= oldest && shard < shards)
        .map(|&(shard, _)| shard)
        .collect();
    Some(seen.into_iter().collect())
}

/// The marks a pod owes its store for a batch of presence writes: for every session written
/// (online or refreshed), each of its groups in its device's shard, unless this pod wrote that
/// pair within [`mark_every`]. A store confirms what it wrote ([`GroupMarks::written`]): marks
/// of a write that failed, timed out or was dropped are owed again.
pub struct GroupMarks {
    shards: u32,
    every_ms: u64,
    state: Mutex<Written>,
}

#[derive(Default)]
struct Written {
    /// When each pair was last written (the pod's clock, ms).
    at: HashMap<(GroupName, u32), u64>,
    swept_ms: u64,
}

impl GroupMarks {
    pub fn new(shards: u32, retention: Duration) -> Self {
        Self {
            shards,
            every_ms: mark_every(retention).as_millis() as u64,
            state: Mutex::new(Written::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Written> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The (group → shards) owed for `changes` at `now_ms`.
    pub fn due(&self, changes: &[PresenceWrite], now_ms: u64) -> BTreeMap<GroupName, Vec<u32>> {
        let mut due: BTreeMap<GroupName, Vec<u32>> = BTreeMap::new();
        let state = self.state();
        for change in changes {
            let (PresenceWrite::Online(session) | PresenceWrite::Refresh(session)) = change else {
                continue;
            };
            let shard = shard_of(session.device.as_str(), self.shards);
            for group in session.groups.iter() {
                let fresh = state
                    .at
                    .get(&(group.clone(), shard))
                    .is_some_and(|&at| now_ms.saturating_sub(at) < self.every_ms);
                if fresh {
                    continue;
                }
                let shards = due.entry(group.clone()).or_default();
                if !shards.contains(&shard) {
                    shards.push(shard);
                }
            }
        }
        due
    }

    /// Records that `marks` were written to the store at `now_ms`.
    pub fn written(&self, marks: &BTreeMap<GroupName, Vec<u32>>, now_ms: u64) {
        let mut state = self.state();
        for (group, shards) in marks {
            for &shard in shards {
                state.at.insert((group.clone(), shard), now_ms);
            }
        }
        // Older pairs are owed anyway: the map stays the size of the pairs written lately,
        // swept at most once a period.
        if state.at.len() > 4096 && now_ms.saturating_sub(state.swept_ms) >= self.every_ms {
            let every = self.every_ms;
            state.at.retain(|_, at| now_ms.saturating_sub(*at) < every);
            state.swept_ms = now_ms;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fleet::Session;
    use crate::model::{DeviceId, Groups};

    const RETENTION: Duration = Duration::from_secs(400);

    fn session(device: &str, groups: &[&str]) -> Session {
        let mut session = Session::unknown(&DeviceId::parse(device).unwrap());
        session.groups = Groups::new(
            groups
                .iter()
                .map(|name| GroupName::parse(name).unwrap())
                .collect(),
        );
        session
    }

    /// No index, or one kept for less than the window: every shard. Then the shards marked within
    /// the window, ascending and once each; none seen is an empty set, not every shard.
    #[test]
    fn an_index_is_trusted_once_it_covers_the_window() {
        // presence.retention 400 s, events kept 600 s: the longer, plus 3 × 100 s.
        let window = seen_window(RETENTION, Duration::from_secs(600));
        assert_eq!(window, Duration::from_secs(900));
        assert_eq!(
            seen_window(RETENTION, Duration::from_secs(60)),
            Duration::from_secs(700)
        );
        let seen = window.as_millis() as u64;
        let now = 10_000_000;
        assert_eq!(shards_to_write(None, window, 8), None);
        let young = GroupIndex {
            since_ms: now - seen + 1,
            marks: vec![(3, now)],
            now_ms: now,
        };
        assert_eq!(shards_to_write(Some(&young), window, 8), None);
        let settled = GroupIndex {
            since_ms: now - seen,
            marks: vec![
                (5, now - seen),
                (3, now),
                (3, now - 1),
                (1, now - seen - 1),
                (9, now),
            ],
            now_ms: now,
        };
        assert_eq!(
            shards_to_write(Some(&settled), window, 8),
            Some(vec![3, 5]),
            "shard 1 was last seen too long ago; shard 9 does not exist"
        );
        let nobody = GroupIndex {
            marks: vec![(1, 0)],
            ..settled
        };
        assert_eq!(shards_to_write(Some(&nobody), window, 8), Some(vec![]));
    }

    /// Sessions written or refreshed owe a mark of each of their groups in their shard, once
    /// per period once written; ends and progress owe nothing; what was not confirmed written is
    /// owed again.
    #[test]
    fn marks_are_owed_once_per_period_once_written() {
        let marks = GroupMarks::new(8, RETENTION);
        let every = mark_every(RETENTION).as_millis() as u64;
        let a = session("pos-1", &["store-1", "eu"]);
        let b = session("pos-2", &["store-1"]);
        let (shard_a, shard_b) = (shard_of("pos-1", 8), shard_of("pos-2", 8));
        let changes = vec![
            PresenceWrite::Online(a.clone()),
            PresenceWrite::Refresh(b.clone()),
            PresenceWrite::Offline {
                session: a.reference(),
                at_ms: 1,
                last_sent: None,
            },
        ];
        let due = marks.due(&changes, 1_000);
        let mut store = vec![shard_a, shard_b];
        store.sort();
        store.dedup();
        let mut got = due[&GroupName::parse("store-1").unwrap()].clone();
        got.sort();
        assert_eq!(got, store);
        assert_eq!(due[&GroupName::parse("eu").unwrap()], vec![shard_a]);
        assert_eq!(marks.due(&changes, 1_001), due, "not written: owed again");
        marks.written(&due, 1_000);
        assert!(marks.due(&changes, 1_000 + every - 1).is_empty());
        assert_eq!(marks.due(&changes, 1_000 + every), due);
    }
}

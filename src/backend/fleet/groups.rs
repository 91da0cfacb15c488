//! Where a group's members are: per group, the shards in which a member's session was written,
//! and when. The publisher reads it to store a group event only in those shards (a store of
//! eight terminals costs at most eight entries, not one per shard); every fleet store keeps it
//! beside its records and marks it as it writes sessions. Decisions are made here, once, from
//! what a store returns ([`shards_to_write`]); stores only keep the marks.
//!
//! A shard is named for as long as a member there counts as seen: written within `retention`,
//! plus the longest an open session goes without being written again ([`refresh_every`]) and
//! without being marked again ([`GroupMarks`]). Marks name only what was written since the
//! store began to index (its `indexing since`); a member seen before that (by a pod of a version
//! that did not mark, or in an index the store lost) would be missed, so until the store has
//! indexed for a whole [`seen_window`], a group event goes to every shard. A store that loses its
//! index loses that time with it and begins again.

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

/// How long a mark names its shard. A member there counts as seen for `retention` after its
/// record's last write; that write may come up to three refresh periods after the mark that
/// stands for it: a refresh is written at the pod's first visit after its period (visits come
/// at most a period apart), and a pair marked within [`mark_every`] is not marked again.
pub fn seen_window(retention: Duration) -> Duration {
    retention + 3 * refresh_every(retention)
}

/// What a store holds for one group, with the time of the read: all Unix ms by the store's clock
/// where it has one (Redis `TIME`, the NATS server's), so that pods' clocks do not matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupIndex {
    /// When the store began to index groups (its first mark, of any group).
    pub indexing_since_ms: u64,
    /// Per shard, the newest mark of a member there (none: no member seen lately).
    pub marks: Vec<(u32, u64)>,
    pub now_ms: u64,
}

/// The shards a group event is stored on: `None` for every shard (the store does not index
/// groups, or has not for a whole seen window), else the shards of members seen, ascending
/// (empty: no member is known).
pub fn shards_to_write(
    index: Option<&GroupIndex>,
    retention: Duration,
    shards: u32,
) -> Option<Vec<u32>> {
    let index = index?;
    let window = seen_window(retention).as_millis() as u64;
    let now_ms = index.now_ms;
    if now_ms.saturating_sub(index.indexing_since_ms) < window {
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
/// (online or refreshed), each of its groups in its device's shard, unless this pod marked that
/// pair within [`mark_every`].
pub struct GroupMarks {
    shards: u32,
    every_ms: u64,
    marked: Mutex<HashMap<(GroupName, u32), u64>>,
}

impl GroupMarks {
    pub fn new(shards: u32, retention: Duration) -> Self {
        Self {
            shards,
            every_ms: mark_every(retention).as_millis() as u64,
            marked: Mutex::new(HashMap::new()),
        }
    }

    /// The (group → shards) to mark now, taken as marked at `now_ms`.
    pub fn due(&self, changes: &[PresenceWrite], now_ms: u64) -> BTreeMap<GroupName, Vec<u32>> {
        let mut due: BTreeMap<GroupName, Vec<u32>> = BTreeMap::new();
        let mut marked = self
            .marked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for change in changes {
            let (PresenceWrite::Online(session) | PresenceWrite::Refresh(session)) = change else {
                continue;
            };
            if session.groups.is_empty() {
                continue;
            }
            let shard = shard_of(session.device.as_str(), self.shards);
            for group in session.groups.iter() {
                let last = marked.entry((group.clone(), shard)).or_insert(0);
                if *last != 0 && now_ms.saturating_sub(*last) < self.every_ms {
                    continue;
                }
                *last = now_ms;
                let shards = due.entry(group.clone()).or_default();
                if !shards.contains(&shard) {
                    shards.push(shard);
                }
            }
        }
        // What is older than a period will be marked again anyway: the map stays the size of
        // the pairs marked lately.
        if marked.len() > 4096 {
            let every = self.every_ms;
            marked.retain(|_, last| now_ms.saturating_sub(*last) < every);
        }
        due
    }

    /// Forgets every mark: the store lost what it held, so the next writes mark again.
    pub fn forget(&self) {
        self.marked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
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

    /// A store that does not index, or has not for a whole seen window: every shard. Then the
    /// shards marked within the window, ascending and once each; none seen is an empty set, not
    /// every shard.
    #[test]
    fn an_index_is_trusted_once_it_covers_the_window() {
        let seen = seen_window(RETENTION).as_millis() as u64;
        assert_eq!(seen, 700_000);
        let now = 10_000_000;
        assert_eq!(shards_to_write(None, RETENTION, 8), None);
        let young = GroupIndex {
            indexing_since_ms: now - seen + 1,
            marks: vec![(3, now)],
            now_ms: now,
        };
        assert_eq!(shards_to_write(Some(&young), RETENTION, 8), None);
        let settled = GroupIndex {
            indexing_since_ms: now - seen,
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
            shards_to_write(Some(&settled), RETENTION, 8),
            Some(vec![3, 5]),
            "shard 1 was last seen too long ago; shard 9 does not exist"
        );
        let nobody = GroupIndex {
            marks: Vec::new(),
            ..settled
        };
        assert_eq!(shards_to_write(Some(&nobody), RETENTION, 8), Some(vec![]));
    }

    /// Sessions written or refreshed mark each of their groups in their shard, once per period;
    /// ends and progress mark nothing.
    #[test]
    fn marks_are_owed_once_per_period() {
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
        assert!(marks.due(&changes, 1_000 + every - 1).is_empty());
        assert_eq!(marks.due(&changes, 1_000 + every).len(), 2);
        marks.forget();
        assert_eq!(marks.due(&changes, 1_000 + every).len(), 2);
    }
}

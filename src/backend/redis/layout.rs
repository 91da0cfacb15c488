//! Where shards live in Redis: stream keys, node groups, and the per-group keys that must share a
//! slot with the group's streams (idempotency keys, the trim lease).
//!
//! Groups are contiguous, even shard ranges: `group = shard * groups / shards`. In cluster mode
//! every key of a group carries the hash tag `{g<group>}`, so one XREAD (and one append script)
//! per group stays in one slot. With `redis.urls` the same formula maps shards to instances, one
//! group per instance, and keys carry no tag.

use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub prefix: String,
    pub shards: u32,
    pub groups: u32,
    /// Keys carry `{g<group>}` hash tags.
    pub cluster: bool,
}

impl Layout {
    pub fn group_of(&self, shard: u32) -> usize {
        (u64::from(shard) * u64::from(self.groups) / u64::from(self.shards)) as usize
    }

    /// The shards `s` with `group_of(s) == group`: `[ceil(g·S/G), ceil((g+1)·S/G))`.
    pub fn shards_of(&self, group: usize) -> Range<u32> {
        let (shards, groups) = (u64::from(self.shards), u64::from(self.groups));
        let bound = |g: u64| (g * shards).div_ceil(groups) as u32;
        bound(group as u64)..bound(group as u64 + 1)
    }

    fn group_prefix(&self, group: usize) -> String {
        if self.cluster {
            format!("{}:{{g{group}}}", self.prefix)
        } else {
            self.prefix.clone()
        }
    }

    pub fn stream_key(&self, shard: u32) -> String {
        format!("{}:{shard}", self.group_prefix(self.group_of(shard)))
    }

    /// A key of `group`'s slot, to route the group's scripts in a cluster.
    pub fn group_key(&self, group: usize) -> String {
        self.stream_key(self.shards_of(group).start)
    }

    /// Remembers an accepted idempotency key of one target (a device id, or `*` for a
    /// broadcast) and the cursor it was answered with, for the dedupe window. Device ids cannot
    /// contain `/`, so no two (target, key) pairs share a name.
    pub fn dedupe_key(&self, group: usize, target: &str, key: &str) -> String {
        format!("{}:dedupe:{target}/{key}", self.group_prefix(group))
    }

    /// The supersede index of `shard`: a hash from `<dev>/<name>` to `<epoch> <id>` of the newest
    /// entry the hub appended with that supersede name. Not `<prefix>:<digits>`, so a direct
    /// producer's ACL (streams only) does not reach it.
    pub fn supersede_key(&self, shard: u32) -> String {
        format!("{}:sup:{shard}", self.group_prefix(self.group_of(shard)))
    }

    /// Held by the one pod that applies retention to the group's streams.
    pub fn trim_lease_key(&self, group: usize) -> String {
        format!("{}:trim-lease", self.group_prefix(group))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(shards: u32, groups: u32, cluster: bool) -> Layout {
        Layout {
            prefix: "pos-ev".into(),
            shards,
            groups,
            cluster,
        }
    }

    /// Keys follow docs/stream-format.md for standalone and cluster mode.
    #[test]
    fn keys_follow_the_spec() {
        assert_eq!(layout(64, 1, false).stream_key(17), "pos-ev:17");
        let cluster = layout(64, 4, true);
        assert_eq!(cluster.stream_key(0), "pos-ev:{g0}:0");
        assert_eq!(cluster.stream_key(15), "pos-ev:{g0}:15");
        assert_eq!(cluster.stream_key(16), "pos-ev:{g1}:16");
        assert_eq!(cluster.stream_key(63), "pos-ev:{g3}:63");
        assert_eq!(cluster.trim_lease_key(2), "pos-ev:{g2}:trim-lease");
        assert_eq!(
            cluster.dedupe_key(1, "pos-17", "k"),
            "pos-ev:{g1}:dedupe:pos-17/k"
        );
        assert_eq!(
            cluster.dedupe_key(1, "*", "k:3"),
            "pos-ev:{g1}:dedupe:*/k:3"
        );
        assert_eq!(cluster.group_key(1), "pos-ev:{g1}:16");
        assert_eq!(cluster.supersede_key(17), "pos-ev:{g1}:sup:17");
        assert_eq!(layout(64, 1, false).supersede_key(3), "pos-ev:sup:3");
    }

    /// Group ranges are contiguous, cover every shard once, and agree with `group_of`.
    #[test]
    fn group_ranges_partition_the_shards() {
        for (shards, groups) in [(64, 1), (64, 3), (64, 4), (7, 3), (5, 5), (100, 7)] {
            let layout = layout(shards, groups, true);
            let mut next = 0;
            for group in 0..groups as usize {
                let range = layout.shards_of(group);
                assert_eq!(range.start, next, "{shards}/{groups}");
                assert!(
                    !range.is_empty(),
                    "{shards}/{groups} group {group} is empty"
                );
                for shard in range.clone() {
                    assert_eq!(layout.group_of(shard), group);
                }
                next = range.end;
            }
            assert_eq!(next, shards);
        }
    }
}

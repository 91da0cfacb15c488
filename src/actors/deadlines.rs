//! When streams' tokens end: the Router's index of the streams that came with a token, ordered
//! by the moment each must close (`exp` plus `auth.leeway`). The Router's 25 ms tick takes what
//! is due, so a stream ends within a tick of its token, with no timer of its own and no check
//! per event. A stream that closes for another reason leaves the index with its route.

use std::collections::BTreeMap;

use crate::model::DeviceId;

/// A stream whose token ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    pub shard: u32,
    pub device: DeviceId,
    pub connection_id: u64,
    /// The token's `exp` (Unix seconds), for the client's `token_expired` event.
    pub exp: u64,
}

#[derive(Debug, Default)]
pub struct Deadlines {
    /// By (closing time in Unix ms, connection id): shard, device and `exp`.
    due: BTreeMap<(u64, u64), (u32, DeviceId, u64)>,
    /// Added to `exp` before a stream closes (ms).
    leeway_ms: u64,
}

impl Deadlines {
    pub fn new(leeway_ms: u64) -> Self {
        Self {
            due: BTreeMap::new(),
            leeway_ms,
        }
    }

    fn key(&self, exp: u64, connection_id: u64) -> (u64, u64) {
        (
            exp.saturating_mul(1000).saturating_add(self.leeway_ms),
            connection_id,
        )
    }

    pub fn insert(&mut self, shard: u32, device: DeviceId, connection_id: u64, exp: u64) {
        let key = self.key(exp, connection_id);
        self.due.insert(key, (shard, device, exp));
    }

    pub fn remove(&mut self, connection_id: u64, exp: u64) {
        let key = self.key(exp, connection_id);
        self.due.remove(&key);
    }

    /// Takes the streams due at `now_ms`, earliest first.
    pub fn take_due(&mut self, now_ms: u64) -> Vec<Due> {
        let mut due = Vec::new();
        while let Some(entry) = self.due.first_entry() {
            if entry.key().0 > now_ms {
                break;
            }
            let ((_, connection_id), (shard, device, exp)) = entry.remove_entry();
            due.push(Due {
                shard,
                device,
                connection_id,
                exp,
            });
        }
        due
    }

    pub fn len(&self) -> usize {
        self.due.len()
    }

    pub fn is_empty(&self) -> bool {
        self.due.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(id: &str) -> DeviceId {
        DeviceId::parse(id).unwrap()
    }

    /// Streams come due at `exp` plus the leeway, earliest first; a removed one never does.
    #[test]
    fn streams_come_due_at_exp_plus_leeway() {
        let mut deadlines = Deadlines::new(30_000);
        deadlines.insert(1, device("b"), 2, 100);
        deadlines.insert(1, device("a"), 1, 100);
        deadlines.insert(2, device("c"), 3, 90);
        deadlines.insert(3, device("d"), 4, 95);
        deadlines.remove(4, 95);
        assert!(deadlines.take_due(119_999).is_empty());
        let due = deadlines.take_due(130_000);
        assert_eq!(
            due.iter()
                .map(|due| (due.connection_id, due.exp))
                .collect::<Vec<_>>(),
            [(3, 90), (1, 100), (2, 100)]
        );
        assert!(deadlines.is_empty());
    }
}

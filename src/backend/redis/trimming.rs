//! What a stream says about the entries removed from it (`trimming(key)` in [`super::scripts`]),
//! and the two questions the backend asks of it: what may a cursor have missed
//! ([`Trimming::removed_through`]), and did the tail miss anything between two reads
//! ([`Trimming::continuity`]).
//!
//! Trimming (`MINID`, `MAXLEN`) removes entries from the front, so the stored entries are the
//! newest `length` of the `entries-added` ever appended; XDEL may remove any entry and is
//! tracked by `max-deleted-entry-id` (Redis 7.0 does not update that field when it trims).

use fred::types::Value;

use super::{bad_reply, reply};
use crate::{
    backend::{BackendError, BackendResult},
    model::Position,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trimming {
    /// `last-generated-id`: the newest position ever appended.
    pub head: Position,
    /// `entries-added`: entries ever appended to the stream.
    pub added: u64,
    /// `length`: entries stored now.
    pub length: u64,
    /// `max-deleted-entry-id`.
    pub deleted: Position,
    /// The oldest stored entry.
    pub first: Option<Position>,
}

/// Whether a tail's reads join up.
#[derive(Debug, PartialEq, Eq)]
pub enum Continuity {
    /// Nothing after the tail's last position was removed unread. `count` is the number of
    /// entries ever appended up to and including the last one now read, when known.
    Whole { count: Option<u64> },
    /// Entries after the tail's last position were removed before it read them: it continues
    /// after `resume_after` (what it read meanwhile is dropped: it will be read again).
    Gap {
        resume_after: Position,
        count: Option<u64>,
    },
}

impl Trimming {
    /// Reads the `{last-generated-id, entries-added, length, max-deleted-entry-id, first}` reply.
    pub fn parse(reply: &Value) -> BackendResult<Self> {
        let [head, added, length, deleted, first] = reply::items(reply) else {
            return Err(BackendError::rejected(
                "XINFO STREAM lacks entries-added or max-deleted-entry-id: Redis 7 or newer is \
                 required",
            ));
        };
        let position = |value: &Value, what| reply::position(value).ok_or_else(|| bad_reply(what));
        let count = |value: &Value| match value {
            Value::Integer(n) => Ok((*n).max(0) as u64),
            _ => Err(bad_reply("XINFO STREAM counts")),
        };
        Ok(Self {
            head: position(head, "last-generated-id")?,
            added: count(added)?,
            length: count(length)?,
            deleted: position(deleted, "max-deleted-entry-id")?,
            first: reply::text(first)
                .filter(|text| !text.is_empty())
                .and_then(|text| text.parse().ok()),
        })
    }

    /// Entries ever appended up to and including `position`, when the stream tells: at `0-0`, at
    /// its head, and just before its first stored entry (or the head of an emptied stream) as long as no
    /// XDEL left a hole among the stored entries.
    pub fn count_through(&self, position: Position) -> Option<u64> {
        if position == Position::ZERO {
            // Redis never gives an entry the id 0-0.
            return Some(0);
        }
        if position == self.head {
            return Some(self.added);
        }
        (!self.has_holes() && position == self.removed_through()).then(|| self.removed())
    }

    /// Entries removed from the front or by XDEL.
    fn removed(&self) -> u64 {
        self.added.saturating_sub(self.length)
    }

    /// An entry was deleted after the oldest stored one: the stored entries are not simply the
    /// newest `length`.
    fn has_holes(&self) -> bool {
        self.first.is_some_and(|first| self.deleted > first)
    }

    /// The highest position that may have been removed. When fewer entries remain than were
    /// ever added, everything before the first remaining entry may be gone, so its predecessor
    /// counts as removed (the whole stream, up to the head, when none remains). A cursor that is
    /// exactly the last trimmed entry is thereby reported `expired` although it missed nothing:
    /// a needless resync, never a silent gap.
    pub fn removed_through(&self) -> Position {
        if self.added <= self.length {
            return self.deleted;
        }
        let trimmed = match self.first {
            Some(first) if first.seq > 0 => Position::new(first.ms, first.seq - 1),
            Some(first) if first.ms > 0 => Position::new(first.ms - 1, u64::MAX),
            Some(_) => Position::ZERO,
            None => self.head,
        };
        self.deleted.max(trimmed)
    }

    /// Whether a tail that had read through `last` (`count` entries ever appended up to it, when
    /// known) and then read `read` (the positions of every entry its last read returned after
    /// `last`, in order; none for a check between reads) missed entries that were removed before
    /// it read them. `self` is checked after the read.
    ///
    /// Nothing can be missed when no position above `last` may have been removed. Otherwise the
    /// counts tell an entry the tail read that was trimmed since (an idle stream whose entries
    /// aged out before a new one came) from one it never saw: with `removed` entries gone from
    /// the front, the stored entries begin with the `removed + 1`-th ever appended, which must be
    /// the `removed - count`-th of the read if the read took up right after `last`. Where the
    /// counts cannot tell (unknown, holes, a read itself trimmed away since), it is a gap: a
    /// needless resync at the edge of retention, never a silent one. A count above what the
    /// stream says it ever received, or above what it removed although the tail's position is
    /// gone, means its history was rewritten under the same life (a failover to a lagging
    /// replica, a restore, XSETID): the count is dropped, and a gap is told.
    pub fn continuity(&self, last: Position, count: Option<u64>, read: &[Position]) -> Continuity {
        let count = count.filter(|count| *count <= self.added);
        let then = |count: u64| count + read.len() as u64;
        let newest = read.last().copied().unwrap_or(last);
        let whole = |count: Option<u64>| Continuity::Whole {
            count: self.count_through(newest).or(count),
        };
        if self.removed_through() <= last {
            return whole(count.map(then));
        }
        match count {
            Some(count) if !self.has_holes() => {
                // Everything up to `last` is gone (it is below what was removed), so at least
                // `count` entries were removed; exactly `count`: nothing unread was.
                let removed = self.removed();
                if removed == count {
                    return whole(Some(then(count)));
                }
                let first_kept = usize::try_from(removed.saturating_sub(count)).unwrap_or(0);
                if removed > count
                    && first_kept < read.len()
                    && self.first == Some(read[first_kept])
                {
                    return whole(Some(then(count)));
                }
            }
            _ => {}
        }
        let resume_after = self.removed_through();
        Continuity::Gap {
            resume_after,
            count: self.count_through(resume_after),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(ms: u64) -> Position {
        Position::new(ms, 0)
    }

    fn trimming(head: u64, added: u64, length: u64, first: Option<u64>) -> Trimming {
        Trimming {
            head: p(head),
            added,
            length,
            deleted: Position::ZERO,
            first: first.map(p),
        }
    }

    /// What trimming removed: exactly the deleted entries while nothing was trimmed, else
    /// everything before the first remaining entry, or the whole stream when none remains.
    #[test]
    fn removed_positions_from_stream_info() {
        let deleted = Position::new(3, 0);
        let mut state = Trimming {
            deleted,
            ..trimming(9, 5, 5, Some(1))
        };
        assert_eq!(state.removed_through(), deleted);
        state = Trimming {
            first: Some(Position::new(7, 2)),
            ..trimming(9, 9, 5, None)
        };
        assert_eq!(state.removed_through(), Position::new(7, 1));
        state.first = Some(Position::new(7, 0));
        assert_eq!(state.removed_through(), Position::new(6, u64::MAX));
        assert_eq!(trimming(9, 9, 0, None).removed_through(), p(9));
    }

    /// Entries 1..=10 at positions 1..=10; the tail had read through 3 (count 3).
    #[test]
    fn a_read_that_takes_up_where_the_last_ended_is_whole() {
        // Nothing removed.
        let state = trimming(10, 10, 10, Some(1));
        assert_eq!(
            state.continuity(p(3), Some(3), &[p(4), p(5)]),
            Continuity::Whole { count: Some(5) }
        );
        // Trimmed up to what the tail had read.
        let state = trimming(10, 10, 7, Some(4));
        assert_eq!(
            state.continuity(p(3), Some(3), &[p(4), p(5), p(6), p(7), p(8), p(9), p(10)]),
            Continuity::Whole { count: Some(10) },
            "read up to the head: the count is the stream's own"
        );
        // Trimmed after the read into what it returned.
        let state = trimming(10, 10, 5, Some(6));
        assert_eq!(
            state.continuity(p(3), Some(3), &[p(4), p(5), p(6), p(7)]),
            Continuity::Whole { count: Some(7) }
        );
    }

    /// The tail read entry 3, the stream then stayed idle until it aged out, and entry 4 came:
    /// nothing was missed although the tail's last position is gone.
    #[test]
    fn an_aged_out_stream_with_a_new_entry_is_whole() {
        let state = trimming(4, 4, 1, Some(4));
        assert_eq!(
            state.continuity(p(3), Some(3), &[p(4)]),
            Continuity::Whole { count: Some(4) }
        );
        assert_eq!(
            trimming(3, 3, 0, None).continuity(p(3), Some(3), &[]),
            Continuity::Whole { count: Some(3) },
            "everything aged out, nothing new"
        );
    }

    /// Entries 4..=7 were appended and trimmed before the read, which returned 8..=10.
    #[test]
    fn entries_trimmed_before_the_read_are_a_gap() {
        let state = trimming(10, 10, 3, Some(8));
        assert_eq!(
            state.continuity(p(3), Some(3), &[p(8), p(9), p(10)]),
            Continuity::Gap {
                resume_after: Position::new(7, u64::MAX),
                count: Some(7)
            }
        );
        assert_eq!(
            state.continuity(p(3), None, &[p(8), p(9), p(10)]),
            Continuity::Gap {
                resume_after: Position::new(7, u64::MAX),
                count: Some(7)
            },
            "without a count, conservatively"
        );
        assert_eq!(
            trimming(10, 10, 0, None).continuity(p(3), Some(3), &[]),
            Continuity::Gap {
                resume_after: p(10),
                count: Some(10)
            },
            "a check between reads finds everything after the tail gone"
        );
    }

    /// The read returned 4..=5, then 6..=10 were appended and everything up to 9 trimmed before
    /// the check: whether 4 followed 3 directly cannot be told, so it is a gap.
    #[test]
    fn a_read_trimmed_away_since_is_a_gap() {
        let state = trimming(10, 10, 1, Some(10));
        assert_eq!(
            state.continuity(p(3), Some(3), &[p(4), p(5)]),
            Continuity::Gap {
                resume_after: Position::new(9, u64::MAX),
                count: Some(9)
            }
        );
    }

    /// The tail read 101..=105 (count 105); a failover to a replica that had only 1..=100, then
    /// 110..=120 appended and everything through 113 trimmed: the count is now too high, and
    /// trusting it would hide 110..=113.
    #[test]
    fn a_count_the_stream_contradicts_is_a_gap() {
        let state = Trimming {
            head: p(120),
            added: 111,
            length: 7,
            deleted: Position::ZERO,
            first: Some(p(114)),
        };
        assert!(matches!(
            state.continuity(p(105), Some(105), &[p(114), p(115)]),
            Continuity::Gap { .. }
        ));
        assert!(
            matches!(
                state.continuity(p(105), Some(200), &[]),
                Continuity::Gap {
                    count: Some(104),
                    ..
                }
            ),
            "a count above entries-added is forgotten"
        );
    }

    /// An XDEL among the stored entries makes the counts useless: only positions are trusted.
    #[test]
    fn holes_fall_back_to_positions() {
        let state = Trimming {
            deleted: p(6),
            ..trimming(10, 10, 6, Some(5))
        };
        assert!(matches!(
            state.continuity(p(3), Some(3), &[p(5), p(7)]),
            Continuity::Gap { count: None, .. }
        ));
        assert_eq!(
            state.continuity(p(7), None, &[p(8)]),
            Continuity::Whole { count: None },
            "holes below the tail's position do not matter"
        );
    }
}

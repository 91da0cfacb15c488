//! [`Window`]: the entries of one shard that its replays have read, shared by them.
//!
//! It covers a contiguous range `(lo, hi]` of one life of the shard: every deliverable entry in
//! it is kept (entries no device can receive are skipped, as everywhere). A replay whose position
//! lies inside is served from memory; one at `hi` extends the window forward, one below `lo`
//! extends it backward once its reads reach `lo`. Reads of the backend happen under the window's
//! lock, so replays of one shard that need the same entries wait for one read instead of making
//! their own. What does not fit the pod's budget (`replay.cache_entries`) or is not contiguous
//! with the window is read for one replay only, as before.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Instant,
};

use tokio::sync::Mutex;

use super::REPLAY_PAGE;
use crate::{
    backend::{Backend, BackendResult, StoredEvent},
    metrics::Metrics,
    model::{Epoch, Position},
};

/// How many entries all windows of the pod may hold together.
pub struct CacheBudget {
    used: AtomicUsize,
    limit: usize,
}

impl CacheBudget {
    pub fn new(limit: usize) -> Self {
        Self {
            used: AtomicUsize::new(0),
            limit,
        }
    }

    fn take(&self, entries: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + entries <= self.limit).then_some(used + entries)
            })
            .is_ok()
    }

    fn give_back(&self, entries: usize) {
        self.used.fetch_sub(entries, Ordering::AcqRel);
    }
}

/// What one request for a page got.
pub struct Page {
    pub epoch: Epoch,
    /// Entries after the position asked about, for every device of the shard.
    pub events: Vec<StoredEvent>,
    /// Position read through (delivered or not): the next page starts after it.
    pub last: Option<Position>,
    /// Nothing more was stored before the replay's stream registered: the replay is complete.
    pub done: bool,
    /// Trimming removed entries after the position asked about before they were read, through
    /// this position: the page holds nothing, and the replay resyncs and continues after it.
    pub overtaken: Option<Position>,
}

pub struct Window {
    shard: u32,
    budget: Arc<CacheBudget>,
    cached: Mutex<Cached>,
}

#[derive(Default)]
struct Cached {
    /// The life the entries belong to; `None` while nothing is cached.
    epoch: Option<Epoch>,
    /// Every deliverable entry in `(lo, hi]` is in `entries`.
    lo: Position,
    hi: Position,
    entries: VecDeque<StoredEvent>,
    /// When a read began that found nothing stored after `hi`.
    end_seen: Option<Instant>,
}

impl Window {
    pub fn new(shard: u32, budget: Arc<CacheBudget>) -> Self {
        Self {
            shard,
            budget,
            cached: Mutex::new(Cached::default()),
        }
    }

    /// Up to [`REPLAY_PAGE`] entries of the shard after `after`, for a replay in life `epoch`
    /// whose stream registered at `registered`.
    pub async fn page_after(
        &self,
        backend: &dyn Backend,
        metrics: &Metrics,
        epoch: &Epoch,
        after: Position,
        registered: Instant,
    ) -> BackendResult<Page> {
        let budget = &*self.budget;
        let mut cached = self.cached.lock().await;
        let current = cached.epoch.as_ref() == Some(epoch);
        if current && cached.lo <= after && after < cached.hi {
            return Ok(cached.page_from_memory(after));
        }
        if current && after == cached.hi && cached.end_seen.is_some_and(|seen| seen >= registered) {
            return Ok(Page {
                epoch: epoch.clone(),
                events: Vec::new(),
                last: None,
                done: true,
                overtaken: None,
            });
        }
        let started = Instant::now();
        let page = backend.read_after(self.shard, after, REPLAY_PAGE).await?;
        metrics.replay_entries_read.inc_by(page.read as u64);
        if page.trimmed_through > after && page.epoch == *epoch {
            // Not contiguous with what the reader (and the window) had: nothing of it is kept.
            return Ok(Page {
                epoch: page.epoch,
                events: Vec::new(),
                last: None,
                done: false,
                overtaken: Some(page.trimmed_through),
            });
        }
        let done = page.read < REPLAY_PAGE;
        let reached = page.last.unwrap_or(after);
        let end_seen = done.then_some(started);
        if &page.epoch != epoch {
            // Not the reader's life (a loss while it replayed, or a page labelled after a
            // re-creation): the reader starts over; nothing of it is kept.
        } else if cached.epoch.as_ref() != Some(&page.epoch) {
            // Nothing cached yet, or of a life that is gone: start over with this page.
            cached.clear(budget);
            if budget.take(page.events.len()) {
                *cached = Cached {
                    epoch: Some(page.epoch.clone()),
                    lo: after,
                    hi: reached,
                    entries: page.events.iter().cloned().collect(),
                    end_seen,
                };
            }
        } else if after == cached.hi {
            if budget.take(page.events.len()) {
                cached.entries.extend(page.events.iter().cloned());
                cached.hi = reached;
                cached.end_seen = end_seen;
            }
        } else if after < cached.lo && reached >= cached.lo {
            // Reaches the window from below: the part before it joins the front.
            let lo = cached.lo;
            let front: Vec<&StoredEvent> = page
                .events
                .iter()
                .filter(|event| event.position <= lo)
                .collect();
            if budget.take(front.len()) {
                for event in front.into_iter().rev() {
                    cached.entries.push_front(event.clone());
                }
                cached.lo = after;
            }
        }
        Ok(Page {
            epoch: page.epoch,
            events: page.events,
            last: page.last,
            done,
            overtaken: None,
        })
    }
}

impl Cached {
    /// Entries after `after` (inside the window), up to a page; through `hi` when they end.
    fn page_from_memory(&self, after: Position) -> Page {
        let start = self
            .entries
            .partition_point(|entry| entry.position <= after);
        let events: Vec<StoredEvent> = self
            .entries
            .range(start..)
            .take(REPLAY_PAGE)
            .cloned()
            .collect();
        let last = if start + events.len() < self.entries.len() {
            events.last().map(|event| event.position)
        } else {
            // The rest of the window holds nothing deliverable: continue after its end.
            Some(self.hi)
        };
        Page {
            epoch: self
                .epoch
                .clone()
                .expect("a window with entries has a life"),
            events,
            last,
            done: false,
            overtaken: None,
        }
    }

    fn clear(&mut self, budget: &CacheBudget) {
        budget.give_back(self.entries.len());
        *self = Cached::default();
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        let cached = self.cached.get_mut();
        self.budget.give_back(cached.entries.len());
    }
}

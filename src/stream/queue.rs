//! The bounded queue between the Router (and the Connection) and one SSE response body.
//!
//! A `VecDeque` under a mutex with a waker, instead of tokio's mpsc: a connection that is idle
//! holds no queue storage at all (tokio allocates a 32-slot block per channel up front, 1.8 KB
//! per connection that mostly sits idle), a send is one uncontended lock, and the body is woken
//! only when the queue goes from empty to non-empty, not once per event.
//!
//! The queue also knows how long its oldest item has waited without the body taking anything:
//! a client that stopped reading stops the body (actix-http polls it only when the socket
//! accepts data), so that age is how the Router finds stalled clients before the queue is full.
//! Not while the body replays a backlog (or waits for its turn to): live events then wait on
//! purpose, and the replay watches the client's progress itself.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures_util::task::AtomicWaker;

use crate::sse::QueueItem;

/// Storage kept after the queue drained; more is released so a burst does not pin memory.
const RETAINED_CAPACITY: usize = 16;

#[derive(Debug, PartialEq, Eq)]
pub enum TrySendError {
    /// `limit` items are waiting: the client is too slow.
    Full,
    /// The body is gone.
    Closed,
}

pub fn channel(limit: usize) -> (QueueSender, QueueReceiver) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::new(),
            senders: 1,
            receiver_alive: true,
            waiting_since: None,
            replaying: false,
        }),
        waker: AtomicWaker::new(),
        limit,
    });
    (
        QueueSender {
            shared: shared.clone(),
        },
        QueueReceiver {
            shared,
            emptied: false,
        },
    )
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    waker: AtomicWaker,
    limit: usize,
}

#[derive(Debug)]
struct State {
    items: VecDeque<QueueItem>,
    senders: usize,
    receiver_alive: bool,
    /// Since when the oldest waiting item has waited without progress (`None` when empty).
    waiting_since: Option<Instant>,
    /// The body replays first: waiting items are not a stall.
    replaying: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn waiting(&self, now: Instant) -> Waiting {
        let state = self.lock();
        if !state.receiver_alive {
            return Waiting::BodyGone;
        }
        match state.waiting_since {
            Some(since) if !state.replaying => Waiting::For(now.saturating_duration_since(since)),
            _ => Waiting::Nothing,
        }
    }
}

#[derive(Debug)]
pub struct QueueSender {
    shared: Arc<Shared>,
}

impl QueueSender {
    pub fn try_send(&self, item: QueueItem) -> Result<(), TrySendError> {
        let mut state = self.shared.lock();
        if !state.receiver_alive {
            return Err(TrySendError::Closed);
        }
        if state.items.len() >= self.shared.limit {
            return Err(TrySendError::Full);
        }
        let was_empty = state.items.is_empty();
        if was_empty {
            state.waiting_since = Some(Instant::now());
        }
        state.items.push_back(item);
        drop(state);
        // A body that found the queue empty registered its waker under the lock; one that left
        // items behind will poll again on its own.
        if was_empty {
            self.shared.waker.wake();
        }
        Ok(())
    }

    /// A view of this queue for the stall check, which neither sends nor keeps the body going.
    pub fn watch(&self) -> QueueWatch {
        QueueWatch {
            shared: self.shared.clone(),
        }
    }
}

/// What the stall check sees of a queue.
#[derive(Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Its body has been dropped: nothing to check any more.
    BodyGone,
    /// Nothing waits, or what waits is held back by a replay on purpose.
    Nothing,
    /// The oldest item has waited this long without the body taking anything.
    For(Duration),
}

/// The stall check's handle on a queue: not a sender, so it neither delays the end of the body
/// nor counts for it. The Router's rotation keeps one per connection, so a check reaches the
/// queue directly instead of through the route map (a hash of the device and three more pieces
/// of memory per connection per second: docs/BENCHMARKS.md).
#[derive(Debug, Clone)]
pub struct QueueWatch {
    shared: Arc<Shared>,
}

impl QueueWatch {
    pub fn waiting(&self, now: Instant) -> Waiting {
        self.shared.waiting(now)
    }
}

impl Clone for QueueSender {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for QueueSender {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.senders -= 1;
        let last = state.senders == 0;
        drop(state);
        if last {
            self.shared.waker.wake();
        }
    }
}

#[derive(Debug)]
pub struct QueueReceiver {
    shared: Arc<Shared>,
    /// The last `poll_recv` took the last waiting item.
    emptied: bool,
}

impl QueueReceiver {
    /// The next item; `Ready(None)` once every sender is gone and the queue is empty.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<QueueItem>> {
        let mut state = self.shared.lock();
        match state.items.pop_front() {
            Some(item) => {
                self.emptied = state.items.is_empty();
                state.waiting_since = if self.emptied {
                    if state.items.capacity() > RETAINED_CAPACITY {
                        state.items.shrink_to(RETAINED_CAPACITY);
                    }
                    None
                } else {
                    Some(Instant::now())
                };
                Poll::Ready(Some(item))
            }
            None if state.senders == 0 => Poll::Ready(None),
            None => {
                self.shared.waker.register(cx.waker());
                Poll::Pending
            }
        }
    }

    /// The item last received was the last one waiting (at that moment: a sender may have added
    /// more since). Lets the body write what it has without asking the queue once more, which
    /// would take the lock only to find it empty.
    pub fn emptied(&self) -> bool {
        self.emptied
    }
}

impl QueueReceiver {
    /// While the body replays, waiting items are not a stall; afterwards their clock restarts.
    pub fn set_replaying(&self, replaying: bool) {
        let mut state = self.shared.lock();
        state.replaying = replaying;
        if !replaying && state.waiting_since.is_some() {
            state.waiting_since = Some(Instant::now());
        }
    }
}

impl Drop for QueueReceiver {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.receiver_alive = false;
        // Frames of a client that is gone are released now, not when the last sender goes.
        let items = std::mem::take(&mut state.items);
        state.waiting_since = None;
        drop(state);
        drop(items);
        // The body's waker holds its task's memory; the Router's watch on this queue may
        // outlive the body by a heartbeat, and must not hold that memory too.
        drop(self.shared.waker.take());
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use super::*;

    fn poll(receiver: &mut QueueReceiver) -> Poll<Option<QueueItem>> {
        receiver.poll_recv(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn bounded_fifo_that_ends_with_its_last_sender() {
        let (sender, mut receiver) = channel(2);
        let second = sender.clone();
        sender.try_send(QueueItem::Retry(1)).unwrap();
        second.try_send(QueueItem::Retry(2)).unwrap();
        assert_eq!(sender.try_send(QueueItem::Ping), Err(TrySendError::Full));
        assert!(matches!(
            poll(&mut receiver),
            Poll::Ready(Some(QueueItem::Retry(1)))
        ));
        assert!(!receiver.emptied(), "one item still waits");
        drop(sender);
        assert!(matches!(
            poll(&mut receiver),
            Poll::Ready(Some(QueueItem::Retry(2)))
        ));
        assert!(receiver.emptied(), "the last waiting item was taken");
        assert!(poll(&mut receiver).is_pending(), "a sender is left");
        drop(second);
        assert!(matches!(poll(&mut receiver), Poll::Ready(None)));
    }

    #[test]
    fn sending_to_a_dropped_body_fails() {
        let (sender, receiver) = channel(4);
        drop(receiver);
        assert_eq!(sender.try_send(QueueItem::Ping), Err(TrySendError::Closed));
    }

    #[test]
    fn stall_age_counts_from_the_last_progress() {
        let (sender, mut receiver) = channel(8);
        let watch = sender.watch();
        let now = Instant::now();
        assert_eq!(watch.waiting(now), Waiting::Nothing, "empty: nothing waits");
        sender.try_send(QueueItem::Ping).unwrap();
        sender.try_send(QueueItem::Ping).unwrap();
        let later = Instant::now() + Duration::from_secs(5);
        assert!(
            matches!(watch.waiting(later), Waiting::For(waited) if waited >= Duration::from_secs(4))
        );
        let _ = poll(&mut receiver);
        assert!(
            matches!(watch.waiting(Instant::now()), Waiting::For(waited) if waited < Duration::from_secs(1)),
            "taking an item is progress"
        );
        let _ = poll(&mut receiver);
        assert_eq!(watch.waiting(later), Waiting::Nothing);
        sender.try_send(QueueItem::Ping).unwrap();
        receiver.set_replaying(true);
        assert_eq!(
            watch.waiting(later),
            Waiting::Nothing,
            "held back by a replay"
        );
        drop(receiver);
        assert_eq!(watch.waiting(later), Waiting::BodyGone);
    }

    /// The stall check's watch is not a sender: the body ends when the last sender goes.
    #[test]
    fn a_watch_does_not_keep_the_body_going() {
        let (sender, mut receiver) = channel(2);
        let watch = sender.watch();
        drop(sender);
        assert!(matches!(poll(&mut receiver), Poll::Ready(None)));
        assert_eq!(watch.waiting(Instant::now()), Waiting::Nothing);
    }

    /// The Router's watch may outlive the body: the body's waker (and with it its task's
    /// memory) must not.
    #[test]
    fn a_dropped_body_leaves_no_waker_behind() {
        struct Task;
        impl std::task::Wake for Task {
            fn wake(self: Arc<Self>) {}
        }
        let task = Arc::new(Task);
        let waker = Waker::from(task.clone());
        let (sender, mut receiver) = channel(2);
        let watch = sender.watch();
        assert!(receiver
            .poll_recv(&mut Context::from_waker(&waker))
            .is_pending());
        drop(waker);
        assert_eq!(
            Arc::strong_count(&task),
            2,
            "the queue holds the body's waker"
        );
        drop(receiver);
        assert_eq!(Arc::strong_count(&task), 1, "released with the body");
        assert_eq!(watch.waiting(Instant::now()), Waiting::BodyGone);
        drop(sender);
    }

    #[tokio::test]
    async fn an_empty_queue_wakes_its_body_on_send() {
        let (sender, mut receiver) = channel(4);
        let waiter =
            tokio::spawn(async move { std::future::poll_fn(|cx| receiver.poll_recv(cx)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        sender.try_send(QueueItem::Retry(7)).unwrap();
        let item = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .unwrap();
        assert!(matches!(item, Some(QueueItem::Retry(7))));
    }
}

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
//!
//! Wakes from the Router travel in batches ([`WakeBatch`], [`WorkerWakes`]): a body's task lives
//! on its HTTP worker's thread, and woken from the Router's thread tokio queues it through that
//! worker's shared run queue, a lock taken by the Router to push and by the worker to pop, once
//! per stream. A broadcast did that for every connection. Handed over per worker, the worker
//! wakes its own bodies: each wake a push on its local run queue (docs/BENCHMARKS.md, "Broadcast
//! fan-out and CPU per delivery").

use std::{
    collections::VecDeque,
    future::Future,
    mem,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures_util::task::AtomicWaker;

use crate::sse::QueueItem;

/// Storage kept after the queue drained; more is released so a burst does not pin memory.
const RETAINED_CAPACITY: usize = 16;
/// Wakes a [`WakeBatch`] collects for one worker before it hands them over without waiting
/// for the rest: the worker starts writing while the Router still fills other queues.
const HAND_OVER_AT: usize = 256;

#[derive(Debug, PartialEq, Eq)]
pub enum TrySendError {
    /// `limit` items are waiting: the client is too slow.
    Full,
    /// The body is gone.
    Closed,
}

/// A queue whose body is woken directly by whoever sends.
pub fn channel(limit: usize) -> (QueueSender, QueueReceiver) {
    channel_on(limit, None)
}

/// A queue whose body runs on the worker of `wakes`: senders holding a [`WakeBatch`] leave its
/// wakes to that worker.
pub fn channel_on(limit: usize, wakes: Option<Arc<WorkerWakes>>) -> (QueueSender, QueueReceiver) {
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
        worker: wakes,
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
    /// The worker the body runs on, when it takes wakes in batches.
    worker: Option<Arc<WorkerWakes>>,
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
        if self.push(item)? {
            self.shared.waker.wake();
        }
        Ok(())
    }

    /// Like [`Self::try_send`], but a wake the body needs goes into `wakes`, for its worker to
    /// do, when the body runs on a worker that takes wakes in batches.
    pub fn offer(&self, item: QueueItem, wakes: &mut WakeBatch) -> Result<(), TrySendError> {
        if self.push(item)? {
            match &self.shared.worker {
                Some(worker) => wakes.owe(worker, self.shared.clone()),
                None => self.shared.waker.wake(),
            }
        }
        Ok(())
    }

    /// Queues `item`; true when the body must be woken (the queue was empty).
    fn push(&self, item: QueueItem) -> Result<bool, TrySendError> {
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
        // A body that found the queue empty registered its waker under the lock; one that left
        // items behind will poll again on its own.
        Ok(was_empty)
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

/// The wakes owed to the bodies of one HTTP worker, and the task on that worker that does them.
#[derive(Debug)]
pub struct WorkerWakes {
    inbox: Mutex<Inbox>,
    /// The task's waker.
    task: AtomicWaker,
}

#[derive(Debug)]
struct Inbox {
    owed: Vec<Arc<Shared>>,
    /// False once the worker's task is gone (the worker stopped): wakes are then done by the
    /// sender, as without batches.
    open: bool,
}

impl WorkerWakes {
    /// Starts the task that does the wakes handed over, on the calling worker's event loop.
    pub fn start() -> Arc<Self> {
        let wakes = Arc::new(WorkerWakes {
            inbox: Mutex::new(Inbox {
                owed: Vec::new(),
                open: true,
            }),
            task: AtomicWaker::new(),
        });
        actix_rt::spawn(WakeTask(wakes.clone()));
        wakes
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn hand_over(&self, mut owed: Vec<Arc<Shared>>) {
        let mut inbox = self.inbox();
        if !inbox.open {
            drop(inbox);
            wake_all(owed);
            return;
        }
        if inbox.owed.is_empty() {
            mem::swap(&mut inbox.owed, &mut owed);
        } else {
            inbox.owed.append(&mut owed);
        }
        drop(inbox);
        self.task.wake();
    }
}

fn wake_all(owed: Vec<Arc<Shared>>) {
    for shared in owed {
        shared.waker.wake();
    }
}

/// Runs on the worker for its lifetime; never completes.
struct WakeTask(Arc<WorkerWakes>);

impl Future for WakeTask {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // Registered before taking, so a hand-over after the take wakes this task again.
        self.0.task.register(cx.waker());
        let owed = mem::take(&mut self.0.inbox().owed);
        wake_all(owed);
        Poll::Pending
    }
}

impl Drop for WakeTask {
    fn drop(&mut self) {
        let owed = {
            let mut inbox = self.0.inbox();
            inbox.open = false;
            mem::take(&mut inbox.owed)
        };
        wake_all(owed);
    }
}

/// Wakes one sender owes, per worker. Hands a worker's share over when it reaches
/// [`HAND_OVER_AT`], and the rest when dropped: a sender makes one per turn and drops it when
/// done sending, so no wake is left owed.
#[derive(Default)]
pub struct WakeBatch {
    workers: Vec<(Arc<WorkerWakes>, Vec<Arc<Shared>>)>,
}

impl WakeBatch {
    fn owe(&mut self, worker: &Arc<WorkerWakes>, shared: Arc<Shared>) {
        let index = match self
            .workers
            .iter()
            .position(|(known, _)| Arc::ptr_eq(known, worker))
        {
            Some(index) => index,
            None => {
                self.workers.push((worker.clone(), Vec::new()));
                self.workers.len() - 1
            }
        };
        let (worker, owed) = &mut self.workers[index];
        owed.push(shared);
        if owed.len() >= HAND_OVER_AT {
            worker.hand_over(mem::take(owed));
        }
    }
}

impl Drop for WakeBatch {
    fn drop(&mut self) {
        for (worker, owed) in self.workers.drain(..) {
            if !owed.is_empty() {
                worker.hand_over(owed);
            }
        }
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

    /// A waker that records the thread each wake happened on.
    #[derive(Default)]
    struct Witness(Mutex<Vec<std::thread::ThreadId>>);

    impl std::task::Wake for Witness {
        fn wake(self: Arc<Self>) {
            self.0.lock().unwrap().push(std::thread::current().id());
        }
    }

    impl Witness {
        fn woken_on(&self) -> Vec<std::thread::ThreadId> {
            self.0.lock().unwrap().clone()
        }
    }

    /// Waits on the worker's event loop (letting its wake task run) until `witness` was woken.
    async fn until_woken(witness: &Witness) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while witness.woken_on().is_empty() {
            assert!(Instant::now() < deadline, "never woken");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The Router sends from its own thread; the body's wake is done by the body's worker, once
    /// the Router's batch is done, and only then.
    #[actix_rt::test]
    async fn wakes_owed_to_a_worker_are_done_on_that_worker_after_the_batch() {
        let (sender, mut receiver) = channel_on(4, Some(WorkerWakes::start()));
        let witness = Arc::new(Witness::default());
        let waker = Waker::from(witness.clone());
        assert!(receiver
            .poll_recv(&mut Context::from_waker(&waker))
            .is_pending());
        let router = std::thread::spawn({
            let witness = witness.clone();
            move || {
                let mut wakes = WakeBatch::default();
                sender.offer(QueueItem::Ping, &mut wakes).unwrap();
                std::thread::sleep(Duration::from_millis(50));
                assert!(
                    witness.woken_on().is_empty(),
                    "woken before the batch ended"
                );
                drop(wakes);
                sender
            }
        });
        until_woken(&witness).await;
        assert_eq!(witness.woken_on(), vec![std::thread::current().id()]);
        let _sender = router.join().unwrap();
        assert!(matches!(
            receiver.poll_recv(&mut Context::from_waker(&waker)),
            Poll::Ready(Some(QueueItem::Ping))
        ));
    }

    /// A large batch goes to its worker in parts: the first bodies write while the Router still
    /// fills the other queues.
    #[actix_rt::test]
    async fn a_long_batch_is_handed_over_in_parts() {
        let wakes = WorkerWakes::start();
        let witness = Arc::new(Witness::default());
        let waker = Waker::from(witness.clone());
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for _ in 0..HAND_OVER_AT + 10 {
            let (sender, mut receiver) = channel_on(4, Some(wakes.clone()));
            assert!(receiver
                .poll_recv(&mut Context::from_waker(&waker))
                .is_pending());
            senders.push(sender);
            receivers.push(receiver);
        }
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let router = std::thread::spawn({
            let witness = witness.clone();
            move || {
                let mut wakes = WakeBatch::default();
                for sender in &senders {
                    sender.offer(QueueItem::Ping, &mut wakes).unwrap();
                }
                // The batch is still open: only a part handed over early can be woken.
                let deadline = Instant::now() + Duration::from_secs(5);
                while witness.woken_on().len() < HAND_OVER_AT {
                    assert!(
                        Instant::now() < deadline,
                        "the first part was not handed over"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert_eq!(witness.woken_on().len(), HAND_OVER_AT);
                drop(wakes);
                done_tx.send(senders).unwrap();
            }
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while witness.woken_on().len() < HAND_OVER_AT + 10 {
            assert!(Instant::now() < deadline, "the rest was not handed over");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        router.join().unwrap();
        let _senders = done_rx.recv().unwrap();
    }

    /// Once the worker's task is gone (the worker stopped), the sender wakes the body itself.
    #[test]
    fn wakes_for_a_stopped_worker_are_done_by_the_sender() {
        let system = actix_rt::System::new();
        let wakes = system.block_on(async { WorkerWakes::start() });
        drop(system);
        let (sender, mut receiver) = channel_on(4, Some(wakes));
        let witness = Arc::new(Witness::default());
        assert!(receiver
            .poll_recv(&mut Context::from_waker(&Waker::from(witness.clone())))
            .is_pending());
        let mut batch = WakeBatch::default();
        sender.offer(QueueItem::Ping, &mut batch).unwrap();
        drop(batch);
        assert_eq!(witness.woken_on(), vec![std::thread::current().id()]);
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

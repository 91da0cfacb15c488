//! The way joins and leaves of streams travel from an HTTP worker to the Router: one outbox per
//! worker thread, sent as one [`Membership`] message per turn of the worker's event loop.
//!
//! Why: a message to the Router wakes its thread when it sleeps, and while streams are opened
//! one by one, it nearly always sleeps. One message per stream cost about 6 of the 43 µs of CPU
//! per accepted connection (docs/BENCHMARKS.md, "Connection acceptance: accept loops in the
//! workers, registrations in batches").
//! Streams accepted in the same turn now share one message and one wake-up.
//!
//! Order: a join is in the Router's mailbox before [`Joined::wait`] returns, and the HTTP handler
//! answers only after that, so the Connection's guarantee holds unchanged (its module doc). The
//! replay of a resuming stream also starts only then. Joins and leaves of one worker leave in the
//! order they were made, so a stream that is gone before its batch was sent is removed right
//! after it was added. Not an actor: the outbox belongs to the worker thread, like the
//! Connections it serves; each HTTP worker builds its own [`super::StreamOpener`] and with it
//! its outbox.

use std::{
    cell::{Cell, RefCell},
    mem,
    rc::Rc,
};

use actix::prelude::*;
use tokio::sync::Notify;

use super::{Peer, Route};
use crate::model::{Cursor, DeviceId};

/// Joins and leaves for the Router, in the order they were made on one worker.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Membership(pub Vec<Change>);

pub enum Change {
    Join(Register),
    Leave(Unregister),
}

/// A stream joins: from now on its device's events go into its route's queue.
pub struct Register {
    pub device: DeviceId,
    pub shard: u32,
    pub route: Route,
    /// Who opened it, for presence (the Router passes it on and keeps none of it).
    pub peer: Peer,
}

/// A stream has ended; its route goes unless a newer stream of the device took it over.
pub struct Unregister {
    pub device: DeviceId,
    pub shard: u32,
    pub connection_id: u64,
    /// Unix ms (the pod's clock) and the last id written, for presence.
    pub at_ms: u64,
    pub last_sent: Option<Cursor>,
}

/// The Router's mailbox is closed: the hub is shutting down.
#[derive(Debug, thiserror::Error)]
#[error("the router is gone")]
pub struct RouterGone;

/// The outbox of one worker thread for one Router.
pub struct Outbox {
    router: Recipient<Membership>,
    pending: RefCell<Vec<Change>>,
    /// Resolved when the batch now being collected has been sent.
    batch: RefCell<Joined>,
}

/// Resolves once a join is in the Router's mailbox.
#[derive(Clone, Default)]
pub struct Joined(Rc<Sent>);

#[derive(Default)]
struct Sent {
    done: Cell<bool>,
    notify: Notify,
}

impl Joined {
    pub async fn wait(&self) {
        // One thread: nothing can send the batch between the check and the registration of the
        // waiter, which happens when `notified()` is first polled, right here.
        while !self.0.done.get() {
            self.0.notify.notified().await;
        }
    }

    fn resolve(&self) {
        self.0.done.set(true);
        self.0.notify.notify_waiters();
    }
}

impl Outbox {
    /// The outbox of the calling worker thread; it must stay on that thread.
    pub fn new(router: Recipient<Membership>) -> Rc<Outbox> {
        Rc::new(Outbox {
            router,
            pending: RefCell::default(),
            batch: RefCell::default(),
        })
    }

    /// Queues a join for the batch of this turn; it is sent when the worker's other ready tasks
    /// have run. Must be called inside the worker's event loop (an HTTP handler).
    pub fn join(self: &Rc<Self>, register: Register) -> Result<Joined, RouterGone> {
        if !self.router.connected() {
            return Err(RouterGone);
        }
        let mut pending = self.pending.borrow_mut();
        if pending.is_empty() {
            let outbox = self.clone();
            actix_rt::spawn(async move { outbox.send() });
        }
        pending.push(Change::Join(register));
        Ok(self.batch.borrow().clone())
    }

    /// Sends a leave at once, behind whatever this thread still had to send. At once because an
    /// actor may stop while its arbiter shuts down, where no task can be spawned any more.
    pub fn leave(&self, unregister: Unregister) {
        self.pending.borrow_mut().push(Change::Leave(unregister));
        self.send();
    }

    fn send(&self) {
        let changes = mem::take(&mut *self.pending.borrow_mut());
        if changes.is_empty() {
            return;
        }
        let sent = mem::take(&mut *self.batch.borrow_mut());
        // `do_send` queues even beyond the mailbox capacity; if the Router is gone, so is the hub.
        self.router.do_send(Membership(changes));
        sent.resolve();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::{queue, AnnounceRetry, Close, DrainTarget};

    /// Stands in for the Router: records each `Membership` as (join?, connection id) pairs.
    #[derive(Default)]
    struct Probe {
        seen: Vec<Vec<(bool, u64)>>,
    }

    impl Actor for Probe {
        type Context = Context<Self>;
    }

    impl Handler<Membership> for Probe {
        type Result = ();

        fn handle(&mut self, Membership(changes): Membership, _: &mut Context<Self>) {
            let batch = changes
                .iter()
                .map(|change| match change {
                    Change::Join(register) => (true, register.route.connection_id),
                    Change::Leave(unregister) => (false, unregister.connection_id),
                })
                .collect();
            self.seen.push(batch);
        }
    }

    /// Everything received so far (the mailbox is FIFO, so this answer comes after them).
    #[derive(Message)]
    #[rtype(result = "Vec<Vec<(bool, u64)>>")]
    struct Seen;

    impl Handler<Seen> for Probe {
        type Result = MessageResult<Seen>;

        fn handle(&mut self, _: Seen, _: &mut Context<Self>) -> Self::Result {
            MessageResult(self.seen.clone())
        }
    }

    impl Handler<Close> for Probe {
        type Result = ();

        fn handle(&mut self, _: Close, _: &mut Context<Self>) {}
    }

    impl Handler<AnnounceRetry> for Probe {
        type Result = ();

        fn handle(&mut self, _: AnnounceRetry, _: &mut Context<Self>) {}
    }

    fn register(connection_id: u64, probe: &Addr<Probe>) -> Register {
        Register {
            device: DeviceId::parse(&format!("pos-{connection_id}")).unwrap(),
            shard: 0,
            route: Route {
                connection_id,
                queue: queue::channel(4).0,
                control: DrainTarget {
                    announce: probe.clone().recipient(),
                    close: probe.clone().recipient(),
                },
                opened_ms: 0,
                progress: Default::default(),
                credential: Default::default(),
            },
            peer: Default::default(),
        }
    }

    fn unregister(connection_id: u64) -> Unregister {
        Unregister {
            device: DeviceId::parse(&format!("pos-{connection_id}")).unwrap(),
            shard: 0,
            connection_id,
            at_ms: 0,
            last_sent: None,
        }
    }

    #[actix_rt::test]
    async fn joins_of_one_turn_reach_the_router_as_one_message_before_they_resolve() {
        let probe = Probe::default().start();
        let outbox = Outbox::new(probe.clone().recipient());
        let joined: Vec<Joined> = (1..=3)
            .map(|id| outbox.join(register(id, &probe)).unwrap())
            .collect();
        assert!(
            joined.iter().all(|joined| !joined.0.done.get()),
            "nothing is sent before the worker's turn ends"
        );
        for joined in &joined {
            joined.wait().await;
        }
        assert_eq!(
            probe.send(Seen).await.unwrap(),
            vec![vec![(true, 1), (true, 2), (true, 3)]]
        );
        // The next turn starts a new batch.
        outbox.join(register(4, &probe)).unwrap().wait().await;
        assert_eq!(probe.send(Seen).await.unwrap().len(), 2);
    }

    #[actix_rt::test]
    async fn a_leave_goes_at_once_behind_the_joins_still_waiting() {
        let probe = Probe::default().start();
        let outbox = Outbox::new(probe.clone().recipient());
        let joined = outbox.join(register(1, &probe)).unwrap();
        outbox.leave(unregister(1));
        assert!(joined.0.done.get(), "the join left with the leave");
        assert_eq!(
            probe.send(Seen).await.unwrap(),
            vec![vec![(true, 1), (false, 1)]]
        );
        // The batch task that the join scheduled finds nothing left and sends nothing.
        actix_rt::task::yield_now().await;
        assert_eq!(probe.send(Seen).await.unwrap().len(), 1);
    }
}

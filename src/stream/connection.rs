//! `Connection`: one actor per open SSE stream (one device on this pod).
//!
//! Owns: the bounded event queue (`sse.queue_limit`, an mpsc whose receiver is the SSE body), the
//! replay channel while a backlog is sent, and the [`StreamControl`] it shares with the body.
//! Receives (control only): [`Close`] (Router: `SlowConsumer`, `Takeover`; Shutdown: `Drain`),
//! [`AnnounceRetry`] (Shutdown, when a drain begins), [`BodyDropped`] (the body, when actix drops
//! it: the client went away).
//! Sends: [`Register`] when opened and [`Unregister`] on stop to the Router, through its worker's
//! membership outbox (`membership.rs`: one Router message per turn of the worker, not per stream).
//! Opened by the HTTP edge through [`StreamOpener`]; the Router sees only its [`Route`].
//! Registration: `open` returns only when its `Register` is in the Router's mailbox; the HTTP
//! handler answers after that, without waiting for the Router to handle it. Any event appended to
//! the backend after that moment reaches the Router behind it (a tail reads it later, and the
//! mailbox is FIFO), so a client that has seen the first bytes misses nothing, and the stream
//! costs no round trip to the Router's thread.
//! Resume: once registered, the pod's [`Replayer`] replays the backlog after the cursor (when a
//! replay slot is free: bounded and shared, see `replay/`), then ends the replay with
//! `ReplayEnd` and the body switches to the live queue, skipping what was replayed.
//! Backpressure: the Router `try_send`s into the queue; full → `CloseReason::SlowConsumer`, and
//! the socket is shut at once (see `control.rs`). Replay pages wait on the replay channel, i.e.
//! on the client's reading speed, while live events accumulate in the bounded queue.
//! Drain: `AnnounceRetry(ms)` queues `retry: ms` at once and keeps it for the close; later
//! `Close { Drain }` leaves the Router, drops this actor's queue sender and stops a replay in
//! progress (the body then ends after what was replayed: nothing live may follow a cut replay).
//! The body writes everything already queued, then `retry: ms` again, then ends the response.
//! A client that does not take it within the close's flush time, or takes nothing for
//! [`DRAIN_STALL`], is cut off: a stopped reader must not hold the drain.

use std::{
    rc::Rc,
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;
use tokio::sync::mpsc;

use super::{
    body::SseBody,
    control::StreamControl,
    membership::{Joined, Outbox, Register, RouterGone, Unregister},
    queue::{self, QueueSender},
    CloseHandle, Peer, Progress, Route, StreamOpener,
};
use crate::{
    metrics::Metrics,
    model::{unix_ms, Addressee, CloseReason, Credential, DeviceId, Groups},
    pod::PodState,
    replay::{ReplayError, Replayer},
    report::Report,
    sse::{frame, Farewell, QueueItem},
};

/// Replayed frames buffered ahead of the client; replay waits when the client reads slowly.
const REPLAY_BUFFER: usize = 64;
/// How often a connection closed for a drain looks at its client's progress.
const FLUSH_CHECK: Duration = Duration::from_millis(250);
/// A client closed for a drain that takes nothing for this long (or for `sse.stall_timeout`, if
/// shorter) is cut off: it resumes elsewhere from its last id, so waiting only delays the drain.
const DRAIN_STALL: Duration = Duration::from_secs(2);

#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "()")]
pub struct Close {
    pub reason: CloseReason,
    /// For a clean end: how long the client may take to receive what is queued before it is cut
    /// off. Zero: at once, discarding what is queued.
    pub flush_within: Duration,
    /// For a clean end: what the stream says last, after what is queued.
    pub farewell: Option<Farewell>,
}

/// How long a client whose token ended (or was revoked) may take to receive what is queued.
const TOKEN_END_FLUSH: Duration = Duration::from_secs(10);

impl Close {
    /// Ends the stream without waiting for the client.
    pub fn now(reason: CloseReason) -> Self {
        Self {
            reason,
            flush_within: Duration::ZERO,
            farewell: None,
        }
    }

    /// A drain's close: what is queued is written first, within `flush_within`, then the
    /// `retry:` announced before.
    pub fn drain(flush_within: Duration) -> Self {
        Self {
            reason: CloseReason::Drain,
            flush_within,
            farewell: None,
        }
    }

    /// The stream's token ended at `exp` (Unix seconds; the leeway is past too): what is queued
    /// is written, then `event: token_expired`.
    pub fn token_expired(exp: u64) -> Self {
        Self {
            reason: CloseReason::TokenExpired,
            flush_within: TOKEN_END_FLUSH,
            farewell: Some(Farewell::TokenExpired { exp }),
        }
    }

    /// The device's tokens until `at` (Unix seconds) were revoked: what is queued is written,
    /// then `event: revoked`.
    pub fn revoked(at: u64) -> Self {
        Self {
            reason: CloseReason::Revoked,
            flush_within: TOKEN_END_FLUSH,
            farewell: Some(Farewell::Revoked { at }),
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct BodyDropped;

/// From Shutdown when a drain begins: the `retry:` this connection is sent now (so a client whose
/// connection breaks before its turn still comes back at its own time) and again when it closes.
#[derive(Message, Debug, Clone, Copy)]
#[rtype(result = "()")]
pub struct AnnounceRetry(pub u32);

/// What the Router keeps of each connection for Shutdown: its two control inputs.
#[derive(Clone)]
pub struct DrainTarget {
    pub announce: Recipient<AnnounceRetry>,
    pub close: Recipient<Close>,
}

/// Everything needed to open a stream; the HTTP edge fills it after validating the request.
pub struct OpenStream {
    pub device: DeviceId,
    pub shard: u32,
    /// `Last-Event-ID` (or `?last_event_id=`) as the client sent it.
    pub cursor: Option<String>,
    pub queue_limit: usize,
    pub retry_ms: u32,
    /// A client whose queued frames wait this long without progress is stalled (zero: never).
    pub stall_timeout: Duration,
    /// The TCP socket's fd, when the server recorded it.
    pub socket_fd: Option<std::os::fd::RawFd>,
    pub peer: Peer,
    /// The token's `iat` and `exp`.
    pub credential: Credential,
}

pub struct Connection {
    /// Unique per process; tells a takeover's successor apart from its predecessor.
    id: u64,
    device: DeviceId,
    /// Its groups, for the replay to pick the group events of the device's shard.
    groups: Groups,
    shard: u32,
    /// Our own sending half: keeps the stream open until this actor decides how it ends (before
    /// registration the Router holds none). `None` once closing.
    queue: Option<QueueSender>,
    /// Cursor and replay sender, taken when the actor starts.
    resume: Option<(String, mpsc::Sender<QueueItem>)>,
    /// The replay while it runs, so a drain can stop it.
    replaying: Option<SpawnHandle>,
    /// `sse.stall_timeout`: a drain's flush gives up on a client that long without progress.
    stall_timeout: Duration,
    /// Resolves when the Router has our registration queued: the replay must not start earlier.
    joined: Joined,
    control: Arc<StreamControl>,
    outbox: Rc<Outbox>,
    replayer: Arc<Replayer>,
    metrics: Arc<Metrics>,
    pod: Arc<PodState>,
    /// Why the stream ends, once decided; the first reason wins.
    closing: Option<CloseReason>,
}

impl Connection {
    /// Starts the actor on the current arbiter, registers it with the Router, and returns the
    /// response body it feeds plus the actor's close handle once the registration is in the
    /// Router's mailbox. The caller has taken a connection slot with
    /// [`PodState::try_acquire_connection`]; the actor returns it when it stops. Runs on the HTTP
    /// worker whose `opener` it is (the registration goes through the worker's outbox).
    pub(super) async fn open(
        stream: OpenStream,
        opener: &StreamOpener,
    ) -> Result<(SseBody, CloseHandle), RouterGone> {
        let (outbox, replayer, metrics, pod) = (
            opener.outbox.clone(),
            opener.replayer.clone(),
            opener.metrics.clone(),
            opener.pod.clone(),
        );
        let (queue, live) = queue::channel_on(stream.queue_limit, Some(opener.worker_wakes()));
        let (resume, replay) = match stream.cursor {
            Some(cursor) => {
                let (tx, rx) = mpsc::channel(REPLAY_BUFFER);
                (Some((cursor, tx)), Some(rx))
            }
            None => (None, None),
        };
        let control = Arc::new(StreamControl::new(stream.socket_fd));
        let id = pod.next_connection_id();
        // The registration names the actor's address, and the actor needs the registration's
        // ticket: take the address from a context that runs the actor afterwards.
        let context = Context::new();
        let address = context.address();
        let joined = outbox
            .join(Register {
                device: stream.device.clone(),
                shard: stream.shard,
                route: Route {
                    connection_id: id,
                    queue: queue.clone(),
                    control: DrainTarget {
                        announce: address.clone().recipient(),
                        close: address.clone().recipient(),
                    },
                    opened_ms: unix_ms(),
                    progress: Progress(control.clone()),
                    credential: stream.credential.clone(),
                },
                peer: stream.peer,
            })
            .inspect_err(|_| {
                // No actor will run to give the caller's slot back.
                pod.release_connection();
            })?;
        let body = SseBody::new(
            frame::prelude(stream.retry_ms),
            replay,
            live,
            control.clone(),
            address.clone().recipient(),
            metrics.clone(),
            pod.clone(),
        );
        context.run(Connection {
            id,
            device: stream.device,
            groups: stream.credential.groups,
            shard: stream.shard,
            stall_timeout: stream.stall_timeout,
            queue: Some(queue),
            resume,
            replaying: None,
            joined: joined.clone(),
            control,
            outbox,
            replayer,
            metrics,
            pod,
            closing: None,
        });
        joined.wait().await;
        Ok((body, CloseHandle(address.recipient())))
    }

    /// Ends the stream at once: nothing queued is written.
    fn abort(&mut self, reason: CloseReason) {
        self.closing.get_or_insert(reason);
        self.queue = None;
        self.control.abort();
    }

    fn leave_router(&self) {
        self.outbox.leave(Unregister {
            device: self.device.clone(),
            shard: self.shard,
            connection_id: self.id,
            at_ms: unix_ms(),
            last_sent: self.control.last_sent().0,
        });
    }

    /// A clean close (a drain, a token's end): the body writes what is queued and ends; this
    /// actor stays until the body is gone, and cuts the client off if it does not take what is
    /// left in time.
    fn close_cleanly(
        &mut self,
        reason: CloseReason,
        flush_within: Duration,
        ctx: &mut Context<Self>,
    ) {
        self.closing = Some(reason);
        self.leave_router();
        if let Some(replay) = self.replaying.take() {
            ctx.cancel_future(replay);
        }
        self.queue = None;
        // A client that was idle before the drain has not stopped reading: count from now.
        self.control.wrote();
        let deadline = Instant::now() + flush_within;
        let patience = match self.stall_timeout {
            Duration::ZERO => DRAIN_STALL,
            stall_timeout => stall_timeout.min(DRAIN_STALL),
        };
        ctx.run_interval(FLUSH_CHECK, move |connection, ctx| {
            // No bytes handed to the socket for that long: the client stopped reading (what is
            // left waits in the replay channel, the queue, or the socket's buffers).
            let stalled = connection.control.idle_for() >= patience;
            if stalled || Instant::now() >= deadline {
                log::debug!(
                    "stream of {} cut off: its client did not take what was left",
                    connection.device
                );
                connection.control.abort();
                ctx.stop();
            }
        });
    }
}

impl Actor for Connection {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.metrics.sse_connections.inc();
        self.metrics.sse_connections_opened.inc();
        let Some((cursor, replay)) = self.resume.take() else {
            return;
        };
        let (replayer, device, groups, shard, joined) = (
            self.replayer.clone(),
            self.device.clone(),
            self.groups.clone(),
            self.shard,
            self.joined.clone(),
        );
        // Once the registration is queued ahead of anything appended from then on, what this
        // replay does not find, the Router delivers live (and the body drops doubles).
        let replay = async move {
            joined.wait().await;
            let registered = Instant::now();
            replayer
                .replay(
                    Addressee::new(&device, &groups),
                    shard,
                    &cursor,
                    registered,
                    &replay,
                )
                .await
        };
        let handle = ctx.spawn(replay.into_actor(self).map(
            |result, connection, ctx| match result {
                Ok(()) => connection.replaying = None,
                Err(ReplayError::ClientGone) => {
                    connection.closing.get_or_insert(CloseReason::Client);
                    ctx.stop();
                }
                Err(error @ ReplayError::Stalled(_)) => {
                    log::debug!("stream of {} evicted: {error}", connection.device);
                    connection.abort(CloseReason::SlowConsumer);
                    ctx.stop();
                }
                Err(error) => {
                    log::warn!("stream of {} failed: {}", connection.device, Report(&error));
                    connection.abort(CloseReason::Error);
                    ctx.stop();
                }
            },
        ));
        self.replaying = Some(handle);
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        // A second leave after a drain's is harmless: the Router checks the connection id.
        self.leave_router();
        let reason = self.closing.unwrap_or(CloseReason::Client);
        log::debug!("stream of {} closed: {reason}", self.device);
        self.metrics.sse_connections.dec();
        self.metrics.connection_closed(reason);
        self.pod.release_connection();
    }
}

impl Handler<Close> for Connection {
    type Result = ();

    fn handle(&mut self, close: Close, ctx: &mut Context<Self>) {
        if self.closing.is_some() {
            return;
        }
        if let Some(farewell) = close.farewell {
            self.control.set_farewell(farewell);
        }
        if !close.flush_within.is_zero() {
            self.close_cleanly(close.reason, close.flush_within, ctx);
        } else {
            self.abort(close.reason);
            ctx.stop();
        }
    }
}

impl Handler<AnnounceRetry> for Connection {
    type Result = ();

    fn handle(&mut self, AnnounceRetry(retry_ms): AnnounceRetry, _: &mut Context<Self>) {
        self.control.set_farewell(Farewell::Retry(retry_ms));
        // A full queue cannot take it now; the close writes it after the queue anyway.
        if let Some(queue) = &self.queue {
            let _ = queue.try_send(QueueItem::Retry(retry_ms));
        }
    }
}

impl Handler<BodyDropped> for Connection {
    type Result = ();

    fn handle(&mut self, _: BodyDropped, ctx: &mut Context<Self>) {
        self.closing.get_or_insert(CloseReason::Client);
        ctx.stop();
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::{
        model::{shard_of, Position},
        stream::tests::{read, until, Ending, Harness, PRELUDE, SHARDS},
    };

    fn event(seq: u64, text: &str) -> QueueItem {
        QueueItem::Event {
            epoch: crate::model::Epoch::new("alpha").unwrap().id(),
            position: Position::new(1, seq),
            appended_ms: 0,
            frame: Bytes::from(format!("E {text}\n")),
        }
    }

    /// The Router gets the stream's route, whose queue (bounded by `queue_limit`) feeds the body.
    #[actix_rt::test]
    async fn open_registers_the_route_with_the_router() {
        let harness = Harness::new();
        let (mut body, _close) = harness.open("pos-1", None, Duration::ZERO).await.unwrap();
        // `open` returned once the join was in the Router's mailbox: it is handled before this.
        assert_eq!(
            harness.changes().await,
            vec![(true, "pos-1".into(), shard_of("pos-1", SHARDS), 0)]
        );
        assert_eq!(harness.metrics.sse_connections.get(), 1);
        assert_eq!(harness.metrics.sse_connections_opened.get(), 1);
        assert_eq!(harness.pod.open_streams(), 1);

        let (queue, _) = harness.route(0).await;
        queue.try_send(event(1, "routed")).unwrap();
        assert_eq!(
            read(&mut body),
            (format!("{PRELUDE}E routed\n"), Ending::Pending)
        );
        for seq in 2..=5 {
            queue.try_send(event(seq, "more")).unwrap();
        }
        assert_eq!(
            queue.try_send(event(6, "one too many")),
            Err(queue::TrySendError::Full),
            "the queue holds queue_limit items"
        );

        // A second stream has its own id.
        let _second = harness.open("pos-2", None, Duration::ZERO).await.unwrap();
        assert_eq!(harness.changes().await.last().unwrap().3, 1);
    }

    /// `Close` from the Router (slow consumer, takeover): the stream is cut at once (nothing
    /// queued is written), the actor stops, leaves the Router and records the reason.
    #[actix_rt::test]
    async fn an_eviction_aborts_and_the_actor_stops_with_its_reason() {
        for reason in [CloseReason::SlowConsumer, CloseReason::Takeover] {
            let harness = Harness::new();
            let (mut body, _close) = harness.open("pos-1", None, Duration::ZERO).await.unwrap();
            let (queue, target) = harness.route(0).await;
            assert_eq!(read(&mut body), (PRELUDE.into(), Ending::Pending));
            queue.try_send(event(1, "discarded")).unwrap();
            target.close.send(Close::now(reason)).await.unwrap();
            assert_eq!(
                read(&mut body),
                (String::new(), Ending::Evicted),
                "{reason}"
            );
            harness.stopped(0).await;
            assert_eq!(harness.closed(reason), 1, "{reason}");
            assert_eq!(harness.closed(CloseReason::Client), 0, "{reason}");
            assert_eq!(
                harness.metrics.sse_slow_consumer_disconnects.get(),
                u64::from(reason == CloseReason::SlowConsumer)
            );
            assert_eq!(harness.pod.connections(), 0, "the slot is given back");
            drop(body);
            assert_eq!(harness.pod.open_streams(), 0);
        }
    }

    #[actix_rt::test]
    async fn the_first_close_reason_wins() {
        let harness = Harness::new();
        let (_body, _close) = harness.open("pos-1", None, Duration::ZERO).await.unwrap();
        let (_, target) = harness.route(0).await;
        target.close.do_send(Close::now(CloseReason::Takeover));
        target.close.do_send(Close::now(CloseReason::SlowConsumer));
        target.close.do_send(Close::drain(Duration::from_secs(5)));
        harness.stopped(0).await;
        assert_eq!(harness.closed(CloseReason::Takeover), 1);
        assert_eq!(harness.closed(CloseReason::SlowConsumer), 0);
        assert_eq!(harness.closed(CloseReason::Drain), 0);
    }

    /// The client went away: actix drops the body, and the stream closes as `client`.
    #[actix_rt::test]
    async fn a_dropped_body_closes_the_stream_as_client() {
        let harness = Harness::new();
        let (body, _close) = harness.open("pos-1", None, Duration::ZERO).await.unwrap();
        drop(body);
        harness.stopped(0).await;
        assert_eq!(harness.closed(CloseReason::Client), 1);
        assert_eq!(harness.pod.connections(), 0);
        assert_eq!(harness.pod.open_streams(), 0);
    }

    /// `AnnounceRetry` queues `retry:` at once and keeps it; the drain's close leaves the Router,
    /// and the body writes what is queued, the `retry:` again, and ends. The actor stays until
    /// its body is gone.
    #[actix_rt::test]
    async fn a_drain_writes_what_is_queued_then_the_retry_and_ends() {
        let harness = Harness::new();
        let (mut body, _close) = harness.open("pos-1", None, Duration::ZERO).await.unwrap();
        let (queue, target) = harness.route(0).await;
        target.announce.send(AnnounceRetry(4321)).await.unwrap();
        assert_eq!(
            read(&mut body),
            (format!("{PRELUDE}retry: 4321\n\n"), Ending::Pending)
        );
        queue.try_send(event(1, "queued")).unwrap();
        drop(queue);
        target
            .close
            .send(Close::drain(Duration::from_secs(10)))
            .await
            .unwrap();
        assert!(
            harness.changes().await.contains(&(
                false,
                "pos-1".into(),
                shard_of("pos-1", SHARDS),
                0
            )),
            "the drain left the Router at once"
        );
        assert_eq!(
            read(&mut body),
            ("E queued\nretry: 4321\n\n".into(), Ending::Ended)
        );
        assert_eq!(
            harness.metrics.sse_connections.get(),
            1,
            "the actor waits for its body"
        );
        drop(body);
        harness.stopped(0).await;
        assert_eq!(harness.closed(CloseReason::Drain), 1);
        assert_eq!(harness.closed(CloseReason::Client), 0);
    }

    /// A client that takes nothing of what is left is cut off (at the first check, 250 ms after
    /// the close) instead of holding the drain; the reason stays `drain`.
    #[actix_rt::test]
    async fn a_drain_cuts_off_a_client_that_does_not_read() {
        let harness = Harness::new();
        let (mut body, _close) = harness
            .open("pos-1", None, Duration::from_millis(20))
            .await
            .unwrap();
        let (queue, target) = harness.route(0).await;
        for seq in 1..=4 {
            queue.try_send(event(seq, "unread")).unwrap();
        }
        drop(queue);
        let closed_at = Instant::now();
        target
            .close
            .send(Close::drain(Duration::from_secs(10)))
            .await
            .unwrap();
        assert_eq!(harness.metrics.sse_connections.get(), 1, "not at once");
        harness.stopped(0).await;
        assert!(closed_at.elapsed() < Duration::from_secs(1));
        assert_eq!(read(&mut body), (String::new(), Ending::Evicted));
        assert_eq!(harness.closed(CloseReason::Drain), 1);
        assert_eq!(harness.metrics.sse_slow_consumer_disconnects.get(), 0);
    }

    /// A drain that reaches a stream mid-replay: the replay stops, and the body ends after what
    /// was replayed, with no live event (the client's last id must not jump past events it was
    /// not sent).
    #[actix_rt::test]
    async fn a_drain_mid_replay_ends_after_what_was_replayed() {
        let harness = Harness::new();
        let payloads: Vec<String> = (0..=200).map(|n| format!("replayed {n}")).collect();
        let cursors = harness.append("pos-1", &payloads).await;
        let (mut body, _close) = harness
            .open("pos-1", Some(cursors[0].to_string()), Duration::ZERO)
            .await
            .unwrap();
        // The client reads nothing yet: the replay fills its channel (the floor and 63 events)
        // and waits.
        until(|| async { harness.metrics.sse_replayed_events.get() == 63 }).await;
        // Meanwhile the Router routes a newer event live.
        let (queue, target) = harness.route(0).await;
        let newest = cursors.last().unwrap();
        queue
            .try_send(QueueItem::Event {
                epoch: newest.epoch.id(),
                position: Position::new(newest.position.ms + 1, 0),
                appended_ms: 0,
                frame: Bytes::from_static(b"E live\n"),
            })
            .unwrap();
        target.announce.send(AnnounceRetry(900)).await.unwrap();
        target
            .close
            .send(Close::drain(Duration::from_secs(10)))
            .await
            .unwrap();

        let (text, ending) = read(&mut body);
        assert_eq!(ending, Ending::Ended);
        let ids: Vec<&str> = text
            .lines()
            .filter_map(|line| line.strip_prefix("id: "))
            .collect();
        let expected: Vec<String> = cursors[1..=63].iter().map(ToString::to_string).collect();
        assert_eq!(
            ids, expected,
            "the replay's events, in order, and nothing else"
        );
        assert!(!text.contains("live"), "no live event after a cut replay");
        assert!(text.starts_with(PRELUDE));
        assert!(
            text.ends_with("data: replayed 63\n\nretry: 900\n\n"),
            "then the closing retry"
        );
        assert_eq!(harness.metrics.sse_replayed_events.get(), 63);
        drop(body);
        harness.stopped(0).await;
        assert_eq!(harness.closed(CloseReason::Drain), 1);
    }
}

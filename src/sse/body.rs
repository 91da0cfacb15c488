//! The SSE response body of one connection: it drains the connection's queues into the socket.
//!
//! Order of what it writes: the prelude (`retry:` and a comment, at once); then, while the
//! Connection replays a backlog, only the replay channel (live events wait in the bounded queue);
//! then the live queue, skipping events at or before the last replayed position, so the switch
//! from replay to live has no gap and no duplicate. Frames that are ready together are written in
//! one chunk (one syscall instead of one per event). When every sender is gone the stream ends
//! cleanly, after the closing `retry:` of a drain; an abort ends it with an error at once.

use std::{
    error::Error as StdError,
    fmt,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use actix::Recipient;
use actix_web::body::{BodySize, MessageBody};
use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;

use super::{control::StreamControl, frame, queue::QueueReceiver, QueueItem};
use crate::{
    actors::connection::{BodyDropped, HubState},
    metrics::Metrics,
    model::Position,
};

/// Largest chunk assembled from queued frames before handing it to actix.
const MAX_CHUNK: usize = 64 * 1024;

#[derive(Debug)]
pub struct Evicted;

impl fmt::Display for Evicted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("connection evicted")
    }
}

impl StdError for Evicted {}

pub struct SseBody {
    prelude: Option<Bytes>,
    /// Present while the Connection replays; its end switches the body to `live`.
    replay: Option<mpsc::Receiver<QueueItem>>,
    /// The bounded queue the Router (and the Connection) feed.
    live: QueueReceiver,
    /// Newest position already written: live events at or before it are duplicates.
    floor: Option<Position>,
    ended: bool,
    control: Arc<StreamControl>,
    /// Tells the Connection actor that the client is gone when actix drops the body.
    on_drop: Option<Recipient<BodyDropped>>,
    metrics: Arc<Metrics>,
    /// Counts this body among the pod's open streams until it is dropped.
    hub: Arc<HubState>,
}

impl SseBody {
    pub fn new(
        prelude: Bytes,
        replay: Option<mpsc::Receiver<QueueItem>>,
        live: QueueReceiver,
        control: Arc<StreamControl>,
        on_drop: Recipient<BodyDropped>,
        metrics: Arc<Metrics>,
        hub: Arc<HubState>,
    ) -> Self {
        hub.stream_opened();
        Self {
            prelude: Some(prelude),
            replay,
            live,
            floor: None,
            ended: false,
            control,
            on_drop: Some(on_drop),
            metrics,
            hub,
        }
    }

    /// Next queued item, replay first; `None` when nothing is ready (or the stream ended).
    fn poll_item(&mut self, cx: &mut Context<'_>) -> Option<(QueueItem, bool)> {
        loop {
            if let Some(replay) = &mut self.replay {
                match replay.poll_recv(cx) {
                    Poll::Ready(Some(item)) => return Some((item, true)),
                    Poll::Ready(None) => self.replay = None,
                    Poll::Pending => return None,
                }
            } else {
                return match self.live.poll_recv(cx) {
                    Poll::Ready(Some(item)) => Some((item, false)),
                    Poll::Ready(None) => {
                        self.ended = true;
                        None
                    }
                    Poll::Pending => None,
                };
            }
        }
    }
}

/// Frames gathered for one write: the first is passed through without copying.
#[derive(Default)]
struct Chunk {
    first: Option<Bytes>,
    rest: Option<BytesMut>,
}

impl Chunk {
    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.rest.as_ref().map_or(0, BytesMut::len)
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn push(&mut self, bytes: Bytes) {
        match (&self.first, &mut self.rest) {
            (None, _) => self.first = Some(bytes),
            (Some(_), Some(rest)) => rest.extend_from_slice(&bytes),
            (Some(first), None) => {
                let mut rest = BytesMut::with_capacity((first.len() + bytes.len()) * 4);
                rest.extend_from_slice(first);
                rest.extend_from_slice(&bytes);
                self.rest = Some(rest);
            }
        }
    }

    fn into_bytes(self) -> Option<Bytes> {
        match self.rest {
            Some(rest) => Some(rest.freeze()),
            None => self.first,
        }
    }
}

impl MessageBody for SseBody {
    type Error = Evicted;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Evicted>>> {
        let this = self.get_mut();
        if this.control.is_aborted() {
            return Poll::Ready(Some(Err(Evicted)));
        }
        if let Some(prelude) = this.prelude.take() {
            return Poll::Ready(Some(Ok(prelude)));
        }
        let mut chunk = Chunk::default();
        // Counted per chunk: one shared atomic update per write, not one per event.
        let (mut events, mut pings) = (0, 0);
        while !this.ended && chunk.len() < MAX_CHUNK {
            let Some((item, replaying)) = this.poll_item(cx) else {
                break;
            };
            match item {
                QueueItem::Event { position, frame } => {
                    if !replaying && this.floor.is_some_and(|floor| position <= floor) {
                        continue;
                    }
                    if replaying {
                        this.floor = Some(this.floor.map_or(position, |floor| floor.max(position)));
                    }
                    events += 1;
                    chunk.push(frame);
                }
                QueueItem::Floor(position) => {
                    this.floor = Some(this.floor.map_or(position, |floor| floor.max(position)));
                }
                QueueItem::Ping => {
                    pings += 1;
                    chunk.push(frame::PING);
                }
                QueueItem::Retry(retry_ms) => chunk.push(frame::retry(retry_ms)),
            }
            // Returning data means actix polls again, and that poll will find the queue empty
            // (registering the waker) or take what arrived meanwhile; polling the queue now would
            // only lock it to find it empty, once more per event. With nothing to write yet
            // the loop must go on: only a `Pending` from the queue leaves a waker behind.
            if !replaying && this.live.emptied() && !chunk.is_empty() {
                break;
            }
        }
        if events > 0 {
            this.metrics.sse_events_sent.inc_by(events);
        }
        if pings > 0 {
            this.metrics.sse_heartbeats_sent.inc_by(pings);
        }
        // Every sender is gone: a clean end (drain) tells the client when to come back.
        if this.ended && !this.control.is_aborted() {
            if let Some(retry_ms) = this.control.take_closing_retry() {
                chunk.push(frame::retry(retry_ms));
            }
        }
        match chunk.into_bytes() {
            Some(bytes) => {
                if this.replay.is_some() {
                    // Replaying is progress too: live events wait behind it, not for the client.
                    this.live.mark_progress();
                }
                Poll::Ready(Some(Ok(bytes)))
            }
            None if this.ended && this.control.is_aborted() => Poll::Ready(Some(Err(Evicted))),
            None if this.ended => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

impl Drop for SseBody {
    fn drop(&mut self) {
        self.control.release();
        self.hub.stream_closed();
        if let Some(connection) = self.on_drop.take() {
            connection.do_send(BodyDropped);
        }
    }
}

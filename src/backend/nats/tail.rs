//! The tail: one ordered consumer over every shard subject (`{prefix}.*`, the stream's one
//! filter; nats-server 2.9 takes one filter per consumer), from "now".
//!
//! "Now" is resolved once, at open, to the stream's last sequence; the tail then keeps the last
//! sequence it read, across errors, and every consumer it creates starts right after it, so an
//! outage leaves no gap. The consumer is ordered as NATS defines it (ephemeral, no acks, and the
//! consumer sequence of each delivery must be exactly one more than the last), but implemented
//! here rather than with async-nats' `OrderedConfig`, which recreates its consumer silently:
//! ours is only recreated after the checks below, so it never reads a *new* stream as if it
//! were the old one.
//!
//! Every [`CHECK_EVERY`], after any error and before every new consumer, it reads the stream's
//! info: a new epoch (the stream was deleted and recreated) gives every shard `resync`
//! `data_lost` at the new life's start (sequence 0), and reading continues from there, so every
//! message of the new stream is delivered after the resync; a last sequence below what the tail
//! read (the stream went back in time) gives `data_lost` at the new last sequence; a first
//! sequence past what the tail read (retention removed messages it never saw, e.g. during a long
//! disconnect) gives every shard `resync` `expired`. Every shard, because the stream state does not say which
//! subjects the removed messages were on. A message whose sequence is not the next one (removed
//! before the consumer delivered it) is such a loss too. The stream holds only our subjects (a
//! conflicting stream is refused at start-up), so every sequence reaches this consumer.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use futures_util::{future::BoxFuture, FutureExt, StreamExt};

use super::{layout, message, unavailable, Inner};
use crate::{
    backend::{BackendError, BackendResult, Gap, Tail, TailBatch},
    model::{Cursor, Epoch, Position, ResyncReason},
    report::Report,
};

const CHECK_EVERY: Duration = Duration::from_secs(2);
/// Messages per Router batch (and per pull request).
const BATCH: usize = 500;
/// The server sends a heartbeat after this much silence; two missed ones end the consumer.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// Lifetime of one pull request; the client sends the next one before it runs out.
const PULL_EXPIRES: Duration = Duration::from_secs(10);
/// A consumer this tail abandoned (after an error, or a crash) is removed by the server after this.
const CONSUMER_IDLE: Duration = Duration::from_secs(30);

pub struct NatsTail {
    inner: Arc<Inner>,
    epoch: Epoch,
    /// Last stream sequence read: every shard has been read up to it.
    last: u64,
    /// The ordered consumer's deliveries; `None` after an error, until the next check.
    messages: Option<pull::Stream>,
    /// Consumer sequence of the last delivery of the current consumer.
    delivered: u64,
    /// A delivery after a loss, kept for the next batch so the batch with the `resync` holds
    /// nothing from before it.
    held: Option<async_nats::jetstream::Message>,
    last_check: Instant,
}

impl NatsTail {
    pub async fn open(inner: Arc<Inner>) -> BackendResult<Self> {
        let info = inner.stream_info().await?;
        let mut tail = Self {
            epoch: layout::epoch_of(info.created.unix_timestamp_nanos()),
            last: info.state.last_sequence,
            inner,
            messages: None,
            delivered: 0,
            held: None,
            last_check: Instant::now(),
        };
        // Created now, so that what is appended after `open` returns is certainly delivered.
        tail.subscribe().await?;
        Ok(tail)
    }

    async fn subscribe(&mut self) -> BackendResult<()> {
        let layout = &self.inner.layout;
        let consumer = self
            .inner
            .jetstream
            .create_consumer_on_stream(
                pull::Config {
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: self.last + 1,
                    },
                    ack_policy: AckPolicy::None,
                    filter_subject: layout.filter(),
                    memory_storage: true,
                    inactive_threshold: CONSUMER_IDLE,
                    ..Default::default()
                },
                &layout.stream,
            )
            .await
            .map_err(|error| unavailable("create the tail consumer", error))?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(BATCH)
            .expires(PULL_EXPIRES)
            .heartbeat(HEARTBEAT)
            .messages()
            .await
            .map_err(|error| unavailable("pull from the tail consumer", error))?;
        self.messages = Some(messages);
        self.delivered = 0;
        self.held = None;
        Ok(())
    }

    fn gaps(&self, reason: ResyncReason, gaps: &mut Vec<Gap>) {
        let position = layout::position(self.last);
        gaps.extend((0..self.inner.layout.shards).map(|shard| Gap {
            cursor: Cursor::new(self.epoch.clone(), shard, position),
            reason,
        }));
    }

    /// Epoch and retention checks; the gaps found are reported and reading moves past them.
    async fn check(&mut self, gaps: &mut Vec<Gap>) -> BackendResult<()> {
        let info = self.inner.stream_info().await?;
        let epoch = layout::epoch_of(info.created.unix_timestamp_nanos());
        let first = info.state.first_sequence;
        if epoch != self.epoch {
            log::warn!(
                "nats stream {} was recreated: its events were lost",
                self.inner.layout.stream
            );
            self.epoch = epoch;
            self.last = 0;
            self.messages = None;
            self.gaps(ResyncReason::DataLost, gaps);
        } else if info.state.last_sequence < self.last {
            log::warn!(
                "nats stream {} went back from sequence {} to {}: events were lost",
                self.inner.layout.stream,
                self.last,
                info.state.last_sequence
            );
            self.last = info.state.last_sequence;
            self.messages = None;
            self.gaps(ResyncReason::DataLost, gaps);
        } else if first.saturating_sub(1) > self.last {
            self.last = first - 1;
            self.messages = None;
            self.gaps(ResyncReason::Expired, gaps);
        }
        self.last_check = Instant::now();
        Ok(())
    }

    /// Takes one delivery into the batch; true when the batch must end here. An error means the
    /// consumer must be recreated.
    fn take(
        &mut self,
        delivery: async_nats::jetstream::Message,
        batch: &mut TailBatch,
    ) -> BackendResult<bool> {
        let info = delivery
            .info()
            .map_err(|error| unavailable("tail delivery", error))?;
        let (delivered, sequence) = (info.consumer_sequence, info.stream_sequence);
        let published_ms = (info.published.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
        if delivered != self.delivered + 1 {
            return Err(BackendError::unavailable(format!(
                "nats: the tail consumer delivered #{delivered} after #{}",
                self.delivered
            )));
        }
        let lost = sequence > self.last + 1;
        if lost && !batch.events.is_empty() {
            self.held = Some(delivery);
            return Ok(true);
        }
        self.delivered = delivered;
        if sequence <= self.last {
            // Already read (cannot happen with a consumer that starts after `last`).
            return Ok(false);
        }
        if lost {
            log::warn!(
                "nats: messages {}..{sequence} were removed before the tail read them",
                self.last + 1
            );
            self.last = sequence - 1;
            self.gaps(ResyncReason::Expired, &mut batch.gaps);
        }
        self.last = sequence;
        let event = self
            .inner
            .layout
            .shard_of_subject(&delivery.subject)
            .and_then(|shard| {
                message::event(
                    shard,
                    &self.epoch,
                    sequence,
                    published_ms,
                    delivery.headers.as_ref(),
                    &delivery.payload,
                )
            });
        match event {
            Some(event) => batch.events.push(event),
            None => batch.skipped += 1,
        }
        Ok(false)
    }

    async fn read(&mut self) -> BackendResult<TailBatch> {
        let mut batch = TailBatch::default();
        if self.messages.is_none() || self.last_check.elapsed() >= CHECK_EVERY {
            self.check(&mut batch.gaps).await?;
        }
        // Gaps go out before anything can fail: `last` has already moved past them.
        if batch.gaps.is_empty() {
            if self.messages.is_none() {
                self.subscribe().await?;
            }
            self.read_messages(&mut batch).await?;
        }
        Ok(batch)
    }

    /// Waits for the first message until the next check is due, then takes what is ready.
    async fn read_messages(&mut self, batch: &mut TailBatch) -> BackendResult<()> {
        let mut next = match self.held.take() {
            Some(held) => Some(Ok(held)),
            None => {
                let Some(messages) = self.messages.as_mut() else {
                    return Ok(());
                };
                let wait = CHECK_EVERY.saturating_sub(self.last_check.elapsed());
                // `next()` is cancel-safe: a message not yet returned stays in the subscription.
                match tokio::time::timeout(wait, messages.next()).await {
                    Err(_) => return Ok(()),
                    Ok(first) => first,
                }
            }
        };
        loop {
            match next {
                Some(Ok(delivery)) => match self.take(delivery, batch) {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    Err(error) => return self.broken(error, batch),
                },
                Some(Err(error)) => {
                    return self.broken(unavailable("tail consumer", error), batch);
                }
                None => {
                    let error = BackendError::unavailable("nats: the tail consumer ended");
                    return self.broken(error, batch);
                }
            }
            if batch.events.len() as u64 + batch.skipped >= BATCH as u64 {
                return Ok(());
            }
            let Some(messages) = self.messages.as_mut() else {
                return Ok(());
            };
            match messages.next().now_or_never() {
                Some(ready) => next = ready,
                None => return Ok(()),
            }
        }
    }

    /// Drops the consumer; the next read checks the stream and creates a new one after `last`.
    /// What was read before the error is delivered first.
    fn broken(&mut self, error: BackendError, batch: &TailBatch) -> BackendResult<()> {
        self.messages = None;
        if batch.events.is_empty() && batch.skipped == 0 && batch.gaps.is_empty() {
            Err(error)
        } else {
            log::warn!("{}", Report(&error));
            Ok(())
        }
    }
}

impl Tail for NatsTail {
    fn next_batch(&mut self) -> BoxFuture<'_, BackendResult<TailBatch>> {
        async move {
            let result = self.read().await;
            if result.is_err() {
                // Whatever happened meanwhile (a restart that lost the consumer, a recreated
                // stream, retention) is checked before a new consumer continues after `last`.
                self.messages = None;
            }
            result
        }
        .boxed()
    }

    fn last_positions(&self) -> Vec<(u32, Position)> {
        let position = layout::position(self.last);
        (0..self.inner.layout.shards)
            .map(|shard| (shard, position))
            .collect()
    }
}

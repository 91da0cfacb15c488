//! The tail of one node group: a dedicated connection running one blocking multi-key
//! `XREAD BLOCK <redis.block> COUNT <redis.count> STREAMS k1..kn id1..idn`, used for nothing else.
//!
//! It starts at "now" by resolving `$` once to concrete ids (sending `$` again after a reconnect
//! would skip what arrived during the outage). It keeps the last id per shard across errors, so
//! after an outage it continues where it was.
//!
//! Loss detection ([`Inner::check`]: the life of each stream, whether the newest position this
//! pod knows of is still stored, and what trimming removed):
//! - after every read that returned entries, for the shards it returned, *before* they are
//!   delivered: entries read from a stream whose life changed are dropped, the shard's
//!   connections get `resync` `data_lost` at the new life's start, and the next read continues
//!   from there, so nothing of the new life is skipped and nothing after the loss comes first.
//!   Entries removed before the tail read them (one append script that adds more than the length
//!   cap keeps, a tail that fell behind, an operator's XTRIM) are found the same way
//!   ([`super::trimming::Trimming::continuity`]: XREAD simply answers with the next entry still stored): the
//!   read is dropped, the connections get `resync` `expired`, and reading continues after what
//!   was removed;
//! - every [`CHECK_EVERY`] for all shards, while a read may still be blocked (it is kept and
//!   awaited on the next call), so an idle shard hears of a loss within seconds too, and after
//!   any error, before the next read.
//!
//! To tell an entry it read that was trimmed since from one it never saw, the tail keeps per
//! shard how many entries the stream had ever received up to its last position (XINFO's
//! `entries-added`, which XREAD does not return: taken at the head and counted forward).

use std::{
    ops::Range,
    sync::Arc,
    time::{Duration, Instant},
};

use fred::{
    interfaces::EventInterface,
    prelude::{Client, ClientLike},
    types::{
        config::{Options, Server},
        CustomCommand, Value,
    },
};
use futures_util::{future::BoxFuture, FutureExt};
use tokio::sync::broadcast;

use super::{init, reply, trimming::Continuity, unavailable, Inner, StreamCheck};
use crate::{
    backend::{BackendError, BackendResult, Gap, Tail, TailBatch},
    model::{Cursor, Epoch, Position, ResyncReason},
};

const CHECK_EVERY: Duration = Duration::from_secs(2);
/// Beyond the block time, how long a read may take before the connection counts as dead.
const READ_GRACE: Duration = Duration::from_secs(10);
/// How long an abandoned read may take to return after `CLIENT UNBLOCK`.
const UNBLOCK_WAIT: Duration = Duration::from_secs(2);

type PendingRead = BoxFuture<'static, BackendResult<Value>>;

pub struct RedisTail {
    inner: Arc<Inner>,
    /// Dedicated to this tail's XREAD; other commands go through the shared clients.
    client: Client,
    /// The dedicated connection's `CLIENT ID`, to unblock a read that must be abandoned.
    client_id: Option<i64>,
    /// fred's word of each reconnection of `client` (after it first connected): it retries a
    /// blocked read on the new connection by itself, so no read fails.
    reconnects: broadcast::Receiver<Server>,
    /// A reconnection was seen and not yet reported by [`Tail::reconnected`].
    reconnected: bool,
    group: usize,
    shards: Range<u32>,
    keys: Vec<String>,
    /// Per shard of the group (index = shard - shards.start): the life being read...
    lives: Vec<Epoch>,
    /// ...the last position read in it...
    last: Vec<Position>,
    /// ...and how many entries the stream had received up to it, when known.
    counts: Vec<Option<u64>>,
    /// A blocking read in flight, kept across calls so that checks can run while it waits.
    pending: Option<PendingRead>,
    /// An error happened since the last full check.
    after_error: bool,
    next_check: Instant,
}

impl RedisTail {
    pub async fn open(inner: Arc<Inner>, group: usize) -> BackendResult<Self> {
        let client = inner.client(group).clone_new();
        init(&client, "redis").await?;
        // Subscribed after the first connection, whose own notice came before `init` returned.
        let reconnects = client.reconnect_rx();
        let client_id = client_id(&inner, group, &client).await;
        let shards = inner.layout.shards_of(group);
        let all: Vec<u32> = shards.clone().collect();
        let checks = inner.check(group, &all, &[]).await?;
        Ok(Self {
            keys: shards
                .clone()
                .map(|shard| inner.layout.stream_key(shard))
                .collect(),
            lives: checks.iter().map(|check| check.epoch.clone()).collect(),
            last: checks.iter().map(|check| check.trimming.head).collect(),
            counts: checks
                .iter()
                .map(|check| Some(check.trimming.added))
                .collect(),
            inner,
            client,
            client_id,
            reconnects,
            reconnected: false,
            group,
            shards,
            pending: None,
            after_error: false,
            next_check: Instant::now() + CHECK_EVERY,
        })
    }

    fn index(&self, shard: u32) -> usize {
        (shard - self.shards.start) as usize
    }

    /// Compares a checked stream with what the tail read: a new life is a `data_lost` gap and
    /// reading moves to its start; entries removed before the tail read them are an `expired`
    /// gap and reading moves past them. `read`: the positions the read being checked returned
    /// after the tail's last one (none for a check between reads); they are taken unless the
    /// position moved, in which case it returns true and they are read again from there.
    fn judge(&mut self, check: &StreamCheck, read: &[Position], gaps: &mut Vec<Gap>) -> bool {
        let index = self.index(check.shard);
        let (reason, resume_after, count) = if check.epoch != self.lives[index] {
            log::warn!(
                "redis stream {} has a new life: its data was lost",
                self.keys[index]
            );
            (
                ResyncReason::DataLost,
                check.start,
                check.trimming.count_through(check.start),
            )
        } else {
            match check
                .trimming
                .continuity(self.last[index], self.counts[index], read)
            {
                Continuity::Whole { count } => {
                    if let Some(&newest) = read.last() {
                        self.last[index] = newest;
                    }
                    self.counts[index] = count;
                    return false;
                }
                Continuity::Gap {
                    resume_after,
                    count,
                } => {
                    log::warn!(
                        "redis stream {}: entries after {} were removed before this pod read \
                         them (trimmed through {resume_after}): its streams get resync expired",
                        self.keys[index],
                        self.last[index]
                    );
                    (ResyncReason::Expired, resume_after, count)
                }
            }
        };
        self.lives[index] = check.epoch.clone();
        self.last[index] = resume_after;
        self.counts[index] = count;
        gaps.push(Gap {
            cursor: Cursor::new(check.epoch.clone(), check.shard, resume_after),
            reason,
        });
        true
    }

    /// The periodic (or after-error) check of every shard of the group.
    async fn check_all(&mut self) -> BackendResult<Vec<Gap>> {
        let shards: Vec<u32> = self.shards.clone().collect();
        let checks = self.inner.check(self.group, &shards, &[]).await?;
        let mut gaps = Vec::new();
        let mut moved = false;
        for check in &checks {
            moved |= self.judge(check, &[], &mut gaps);
        }
        if moved {
            // A read in flight still asks for entries after the old positions.
            self.abandon_read().await;
        }
        self.after_error = false;
        self.next_check = Instant::now() + CHECK_EVERY;
        Ok(gaps)
    }

    /// Ends a blocked read without waiting for its block time: `CLIENT UNBLOCK` from another
    /// connection, then its (discarded) answer.
    async fn abandon_read(&mut self) {
        let Some(pending) = self.pending.take() else {
            return;
        };
        if let Some(id) = self.client_id {
            let command = CustomCommand::new_static("CLIENT", self.inner.hash(self.group), false);
            let unblocked = self
                .inner
                .client(self.group)
                .custom::<Value, Value>(command, vec![Value::from("UNBLOCK"), Value::from(id)])
                .await;
            if unblocked.is_ok() && tokio::time::timeout(UNBLOCK_WAIT, pending).await.is_ok() {
                return;
            }
        }
        // The connection may still be blocked: a new one for the next read.
        log::debug!("tail of group {} renews its connection", self.group);
        let client = self.inner.client(self.group).clone_new();
        if init(&client, "redis").await.is_ok() {
            self.reconnects = client.reconnect_rx();
            let old = std::mem::replace(&mut self.client, client);
            tokio::spawn(async move {
                let _ = old.quit().await;
            });
            self.client_id = client_id(&self.inner, self.group, &self.client).await;
        }
    }

    fn start_read(&self) -> PendingRead {
        let block = self.inner.settings.redis.block;
        let mut args = vec![
            Value::from("BLOCK"),
            Value::from(block.as_millis() as i64),
            Value::from("COUNT"),
            Value::from(self.inner.settings.redis.count as i64),
            Value::from("STREAMS"),
        ];
        args.extend(self.keys.iter().map(|key| Value::from(key.as_str())));
        args.extend(
            self.last
                .iter()
                .map(|position| Value::from(position.to_string())),
        );
        let command = CustomCommand::new_static("XREAD", self.inner.hash(self.group), true);
        // The client's default command timeout is shorter than a blocking read.
        let options = Options {
            timeout: Some(block + READ_GRACE),
            ..Options::default()
        };
        let client = self.client.with_options(&options);
        async move {
            match tokio::time::timeout(block + READ_GRACE, client.custom(command, args)).await {
                Ok(Ok(reply)) => Ok(reply),
                Ok(Err(error)) => Err(unavailable(error)),
                Err(_) => Err(BackendError::unavailable(
                    "redis: XREAD did not return in time",
                )),
            }
        }
        .boxed()
    }

    /// Turns a read's reply into a batch, after checking the lives and trimming of the shards
    /// it read.
    async fn take(&mut self, reply: Value) -> BackendResult<TailBatch> {
        let mut batch = TailBatch::default();
        // Per shard read: its new entries (a BLOCK timeout is a nil reply: nothing new).
        let mut read: Vec<(u32, reply::Entries)> = Vec::new();
        for stream in reply::items(&reply) {
            let parts = reply::items(stream);
            let Some(index) = parts
                .first()
                .and_then(reply::text)
                .and_then(|key| self.keys.iter().position(|k| k == key))
            else {
                continue;
            };
            let shard = self.shards.start + index as u32;
            let mut entries = reply::entries(
                shard,
                &self.lives[index],
                parts.get(1).unwrap_or(&Value::Null),
            );
            // A read sent before the tail moved (to a new life's start, or past trimmed
            // entries) may return entries it has already passed: never twice.
            let last = self.last[index];
            entries.events.retain(|event| event.position > last);
            entries.positions.retain(|position| *position > last);
            if !entries.positions.is_empty() {
                read.push((shard, entries));
            }
        }
        if read.is_empty() {
            return Ok(batch);
        }
        let shards: Vec<u32> = read.iter().map(|(shard, _)| *shard).collect();
        let checks = self.inner.check(self.group, &shards, &[]).await?;
        for (check, (shard, entries)) in checks.iter().zip(read) {
            if self.judge(check, &entries.positions, &mut batch.gaps) {
                // Read before the tail knew of the loss: read again from where it moved.
                continue;
            }
            let index = self.index(shard);
            self.inner
                .watermarks
                .saw(shard, &self.lives[index], self.last[index]);
            batch.skipped += (entries.positions.len() - entries.events.len()) as u64;
            batch.events.extend(entries.events);
        }
        Ok(batch)
    }

    /// Notes reconnections fred made on its own: like an error, they call for a new client id
    /// and a check of every shard before the next read.
    fn note_reconnects(&mut self) {
        loop {
            match self.reconnects.try_recv() {
                Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {
                    self.reconnected = true;
                    self.after_error = true;
                    // The server knows the new connection by a new id (and may have given the
                    // old one to another client after a restart): never unblock by it again.
                    self.client_id = None;
                }
                Err(_) => return,
            }
        }
    }

    async fn read(&mut self) -> BackendResult<TailBatch> {
        self.note_reconnects();
        if self.after_error && self.pending.is_none() {
            // fred reconnects on its own after an outage; the server then knows the connection
            // by a new id (and may give the old one to another client).
            self.client_id = client_id(&self.inner, self.group, &self.client).await;
        }
        loop {
            if self.after_error || Instant::now() >= self.next_check {
                let gaps = self.check_all().await?;
                if !gaps.is_empty() {
                    return Ok(TailBatch {
                        gaps,
                        ..TailBatch::default()
                    });
                }
            }
            if self.pending.is_none() {
                self.pending = Some(self.start_read());
            }
            let pending = self.pending.as_mut().expect("a read is in flight");
            let due = tokio::time::Instant::from_std(self.next_check);
            let reply = tokio::select! {
                reply = pending => reply,
                _ = tokio::time::sleep_until(due) => continue,
            };
            self.pending = None;
            let batch = self.take(reply?).await?;
            if !(batch.events.is_empty() && batch.gaps.is_empty() && batch.skipped == 0) {
                return Ok(batch);
            }
        }
    }
}

/// The server's id of `client`'s connection (`CLIENT ID`), to unblock its reads.
async fn client_id(inner: &Inner, group: usize, client: &Client) -> Option<i64> {
    let command = CustomCommand::new_static("CLIENT", inner.hash(group), false);
    match client
        .custom::<Value, Value>(command, vec![Value::from("ID")])
        .await
    {
        Ok(Value::Integer(id)) => Some(id),
        _ => None,
    }
}

impl Tail for RedisTail {
    fn next_batch(&mut self) -> BoxFuture<'_, BackendResult<TailBatch>> {
        async move {
            let result = self.read().await;
            if result.is_err() {
                // Whatever happened during the outage (data loss, trimming) is found before the
                // next read.
                self.after_error = true;
            }
            result
        }
        .boxed()
    }

    fn last_positions(&self) -> Vec<(u32, Position)> {
        self.shards.clone().zip(self.last.iter().copied()).collect()
    }

    fn reconnected(&mut self) -> bool {
        self.note_reconnects();
        std::mem::take(&mut self.reconnected)
    }
}

impl Drop for RedisTail {
    fn drop(&mut self) {
        // Closing the dedicated connection abandons a blocked XREAD at once.
        let client = self.client.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = client.quit().await;
            });
        }
    }
}

//! The tail of one node group: a dedicated connection running one blocking multi-key
//! `XREAD BLOCK <redis.block> COUNT <redis.count> STREAMS k1..kn id1..idn`, used for nothing else.
//!
//! It starts at "now" by resolving `$` once to concrete ids (sending `$` again after a reconnect
//! would skip what arrived during the outage). It keeps the last id per shard across errors, so
//! after an outage it continues where it was. Every [`CHECK_EVERY`], and after any error, it
//! checks the group's epoch (a new epoch: Redis lost its data, every shard gets `resync`
//! `data_lost` and reading restarts at the current heads). After an error it also checks whether
//! trimming removed entries it had not read (`resync` `expired`). That check is not periodic: a
//! stream whose entries all aged out and then got a new one looks trimmed past the tail's last id
//! although nothing was missed, and a live tail that keeps reading cannot fall behind retention.

use std::{
    ops::Range,
    sync::Arc,
    time::{Duration, Instant},
};

use fred::{
    prelude::{Client, ClientLike},
    types::{config::Options, CustomCommand, Value},
};
use futures_util::{future::BoxFuture, FutureExt};

use super::{init, reply, unavailable, Inner};
use crate::{
    backend::{BackendError, BackendResult, Gap, GapReason, Tail, TailBatch},
    model::{Cursor, Epoch, Position},
};

const CHECK_EVERY: Duration = Duration::from_secs(2);
/// Beyond the block time, how long a read may take before the connection counts as dead.
const READ_GRACE: Duration = Duration::from_secs(10);

pub struct RedisTail {
    inner: Arc<Inner>,
    /// Dedicated to this tail's XREAD; other commands go through the shared clients.
    client: Client,
    group: usize,
    shards: Range<u32>,
    keys: Vec<String>,
    /// Last id read per shard of the group (index = shard - shards.start).
    last: Vec<Position>,
    epoch: Epoch,
    check_due: bool,
    last_check: Instant,
}

impl RedisTail {
    pub async fn open(inner: Arc<Inner>, group: usize) -> BackendResult<Self> {
        let client = inner.client(group).clone_new();
        init(&client).await?;
        let shards = inner.layout.shards_of(group);
        let epoch = inner.ensure_epoch(group).await?;
        let mut last = Vec::with_capacity(shards.len());
        for shard in shards.clone() {
            last.push(inner.stream_info(shard).await?.0);
        }
        Ok(Self {
            keys: shards
                .clone()
                .map(|shard| inner.layout.stream_key(shard))
                .collect(),
            inner,
            client,
            group,
            shards,
            last,
            epoch,
            check_due: false,
            last_check: Instant::now(),
        })
    }

    /// Epoch and trimming checks; gaps found are reported and reading moves past them.
    async fn check(&mut self, gaps: &mut Vec<Gap>) -> BackendResult<()> {
        let epoch = self.inner.ensure_epoch(self.group).await?;
        let data_lost = epoch != self.epoch;
        if data_lost {
            log::warn!(
                "redis group {} has a new epoch: its data was lost",
                self.group
            );
        }
        for (index, shard) in self.shards.clone().enumerate() {
            let (head, trimmed) = self.inner.stream_info(shard).await?;
            let last = &mut self.last[index];
            let (reason, resume_after) = if data_lost {
                (GapReason::DataLost, head)
            } else if trimmed > *last {
                (GapReason::Expired, trimmed)
            } else {
                continue;
            };
            *last = resume_after;
            gaps.push(Gap {
                cursor: Cursor::new(epoch.clone(), shard, resume_after),
                reason,
            });
        }
        self.epoch = epoch;
        self.check_due = false;
        self.last_check = Instant::now();
        Ok(())
    }

    async fn read(&mut self) -> BackendResult<TailBatch> {
        let mut batch = TailBatch::default();
        if self.check_due || self.last_check.elapsed() >= CHECK_EVERY {
            self.check(&mut batch.gaps).await?;
        }
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
        let read = client.custom::<Value, Value>(command, args);
        let reply = match tokio::time::timeout(block + READ_GRACE, read).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(error)) => return Err(unavailable(error)),
            Err(_) => {
                return Err(BackendError::Unavailable(
                    "redis: XREAD did not return in time".into(),
                ))
            }
        };
        // A BLOCK timeout is a nil reply: nothing new.
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
            let entries = reply::entries(shard, parts.get(1).unwrap_or(&Value::Null));
            if let Some(last) = entries.last {
                self.last[index] = last;
            }
            batch.events.extend(entries.events);
            batch.skipped += entries.skipped;
        }
        batch.epoch = Some(self.epoch.clone());
        Ok(batch)
    }
}

impl Tail for RedisTail {
    fn next_batch(&mut self) -> BoxFuture<'_, BackendResult<TailBatch>> {
        async move {
            let result = self.read().await;
            if result.is_err() {
                // Whatever happened during the outage (data loss, trimming) is found before the
                // next read.
                self.check_due = true;
            }
            result
        }
        .boxed()
    }

    fn last_positions(&self) -> Vec<(u32, Position)> {
        self.shards.clone().zip(self.last.iter().copied()).collect()
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

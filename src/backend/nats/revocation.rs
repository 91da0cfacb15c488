//! The revocation store on NATS (docs/security.md, "Revocation"): KV bucket
//! `{stream}_revocations`, one key per device, max age `auth.revocation_retention`. A
//! revocation's time is the server's timestamp of its entry; a reader's mark is the bucket
//! stream's sequence, and a stream whose last sequence is below a mark was created again (it
//! lost its store): the reader starts over. The contract is the module doc of
//! `backend::revocation`.

use std::time::Duration;

use async_nats::jetstream::{
    self,
    consumer::{pull, AckPolicy, DeliverPolicy},
    kv,
};
use futures_util::{future::BoxFuture, FutureExt, StreamExt};

use super::{fleet::bucket_stream, unavailable, Inner};
use crate::{
    backend::{
        revocation::{Changes, Mark, Revocation, RevocationStore},
        BackendError, BackendResult,
    },
    model::DeviceId,
};

/// Messages per fetch while catching up.
const FETCH_MAX: usize = 1000;
/// A reading consumer whose deletion failed is removed by the server after this.
const CONSUMER_IDLE: Duration = Duration::from_secs(10);
/// Longest read of changes.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

pub struct NatsRevocations {
    jetstream: jetstream::Context,
    config: jetstream::stream::Config,
    bucket: kv::Store,
}

impl NatsRevocations {
    pub(super) async fn new(inner: &Inner, retention: Duration) -> BackendResult<Self> {
        let config = bucket_stream(inner, "revocations", "posthorn: revoked devices", retention);
        let jetstream = inner.jetstream.clone();
        let bucket = open(&jetstream, &config).await?;
        Ok(Self {
            jetstream,
            config,
            bucket,
        })
    }

    /// Creates the bucket's stream again after a failure: a server that lost its store (or a
    /// bucket deleted by hand) would otherwise fail every later revocation.
    async fn restore(&self) {
        if let Err(error) = open(&self.jetstream, &self.config).await {
            log::debug!("nats: the revocations bucket is not back yet: {error}");
        }
    }

    async fn revoke(&self, device: &DeviceId) -> BackendResult<Revocation> {
        let sequence = match self.bucket.put(device.as_str(), Default::default()).await {
            Ok(sequence) => sequence,
            Err(error) => {
                self.restore().await;
                return Err(unavailable("revoke", error));
            }
        };
        let message = self
            .bucket
            .stream
            .get_raw_message(sequence)
            .await
            .map_err(|error| unavailable("revoke: read back", error))?;
        Ok(Revocation {
            device: device.clone(),
            at_ms: ms(message.time.unix_timestamp_nanos()),
        })
    }

    async fn changes(&self, after: &Mark) -> BackendResult<Changes> {
        let after: u64 = after.0.parse().unwrap_or(0);
        let read = async {
            let mut stream = self
                .jetstream
                .get_stream(&self.config.name)
                .await
                .map_err(|error| unavailable("revocations", error))?;
            let last = stream
                .info()
                .await
                .map_err(|error| unavailable("revocations", error))?
                .state
                .last_sequence;
            // Below the mark: the stream was created again and its sequence started over.
            let after = if last < after { 0 } else { after };
            if last == after {
                return Ok(Changes {
                    revocations: Vec::new(),
                    mark: Mark(after.to_string()),
                });
            }
            self.read_after(after).await
        };
        match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(Ok(changes)) => Ok(changes),
            Ok(Err(error)) => {
                self.restore().await;
                Err(error)
            }
            Err(_) => Err(BackendError::unavailable(
                "nats: reading the revocations did not complete in time",
            )),
        }
    }

    /// Every entry after sequence `after`, through one ephemeral pull consumer.
    async fn read_after(&self, after: u64) -> BackendResult<Changes> {
        let consumer = self
            .jetstream
            .create_consumer_on_stream(
                pull::Config {
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: after + 1,
                    },
                    ack_policy: AckPolicy::None,
                    memory_storage: true,
                    inactive_threshold: CONSUMER_IDLE,
                    ..Default::default()
                },
                self.config.name.as_str(),
            )
            .await
            .map_err(|error| unavailable("create a revocations consumer", error))?;
        let info = consumer.cached_info();
        let name = info.name.clone();
        let mut pending = info.num_pending;
        let mut changes = Changes {
            revocations: Vec::new(),
            mark: Mark(after.to_string()),
        };
        let fetched = async {
            while pending > 0 {
                let want = pending.min(FETCH_MAX as u64) as usize;
                let mut batch = consumer
                    .fetch()
                    .max_messages(want)
                    .messages()
                    .await
                    .map_err(|error| unavailable("fetch", error))?;
                let mut got = 0;
                while let Some(message) = batch.next().await {
                    let message = message.map_err(|error| unavailable("fetch", error))?;
                    got += 1;
                    let info = message
                        .info()
                        .map_err(|error| unavailable("message info", error))?;
                    changes.mark = Mark(info.stream_sequence.to_string());
                    // `$KV.{bucket}.{key}`: the key is everything after the second dot.
                    let device = message
                        .subject
                        .splitn(3, '.')
                        .nth(2)
                        .and_then(|key| DeviceId::parse(key).ok());
                    if let Some(device) = device {
                        changes.revocations.push(Revocation {
                            device,
                            at_ms: ms(info.published.unix_timestamp_nanos()),
                        });
                    }
                }
                if got == 0 {
                    // Max age removed what was pending when the consumer was created.
                    break;
                }
                pending = pending.saturating_sub(got as u64);
            }
            Ok::<_, BackendError>(())
        };
        let outcome = fetched.await;
        if let Err(error) = self
            .jetstream
            .delete_consumer_from_stream(&name, self.config.name.as_str())
            .await
        {
            log::debug!("nats: revocations consumer {name} is left to expire: {error}");
        }
        outcome.map(|()| changes)
    }
}

/// Creates (or updates) the bucket's stream and opens the bucket.
async fn open(
    jetstream: &jetstream::Context,
    config: &jetstream::stream::Config,
) -> BackendResult<kv::Store> {
    jetstream
        .create_or_update_stream(config.clone())
        .await
        .map_err(|error| unavailable("the revocations bucket", error))?;
    let bucket = config.name.trim_start_matches("KV_");
    jetstream
        .get_key_value(bucket)
        .await
        .map_err(|error| unavailable("the revocations bucket", error))
}

fn ms(nanos: i128) -> u64 {
    u64::try_from(nanos / 1_000_000).unwrap_or(0)
}

impl RevocationStore for NatsRevocations {
    fn revoke(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Revocation>> {
        let device = device.clone();
        async move { self.revoke(&device).await }.boxed()
    }

    fn changes(&self, after: &Mark) -> BoxFuture<'_, BackendResult<Changes>> {
        let after = after.clone();
        async move { self.changes(&after).await }.boxed()
    }
}

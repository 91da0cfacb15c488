//! The revocation store on Redis (docs/security.md, "Revocation"): one stream,
//! `{prefix}:revocations`, on the backend's first client (the first instance of `redis.urls`,
//! or the cluster). Each revocation is an entry `dev <device>`; its id is Redis' clock at the
//! append, which is the revocation's time and the readers' mark. Appends trim by age
//! (`MINID`, `auth.revocation_retention` before the new entry). The contract is the module doc
//! of `backend::revocation`.

use std::time::Duration;

use fred::{
    prelude::{Client, ClientLike},
    types::{ClusterHash, CustomCommand, Value},
    util::redis_keyslot,
};
use futures_util::{future::BoxFuture, FutureExt};

use super::{bad_reply, reply, unavailable};
use crate::{
    backend::{
        revocation::{Changes, Mark, Revocation, RevocationStore},
        BackendResult,
    },
    model::DeviceId,
};

/// Appends a revocation and trims what retention forgets. KEYS: the stream. ARGV: the device,
/// the retention (ms). Returns the entry's id.
const REVOKE: &str = r#"
local id = redis.call('XADD', KEYS[1], '*', 'dev', ARGV[1])
local ms = tonumber(string.match(id, '^(%d+)-'))
redis.call('XTRIM', KEYS[1], 'MINID', '~', string.format('%.0f', ms - tonumber(ARGV[2])))
return id
"#;

/// Entries read per round trip: a pod catching up after a long outage reads in pages.
const PAGE: usize = 1000;

pub struct RedisRevocations {
    client: Client,
    key: String,
    retention: Duration,
}

impl RedisRevocations {
    pub(super) fn new(client: Client, prefix: &str, retention: Duration) -> Self {
        Self {
            client,
            key: format!("{prefix}:revocations"),
            retention,
        }
    }

    async fn command(&self, name: &'static str, args: Vec<Value>) -> BackendResult<Value> {
        let hash = ClusterHash::Custom(redis_keyslot(self.key.as_bytes()));
        self.client
            .custom::<Value, Value>(CustomCommand::new_static(name, hash, false), args)
            .await
            .map_err(unavailable)
    }

    async fn revoke(&self, device: &DeviceId) -> BackendResult<Revocation> {
        let reply = self
            .command(
                "EVAL",
                vec![
                    Value::from(REVOKE),
                    Value::from(1),
                    Value::from(self.key.as_str()),
                    Value::from(device.as_str()),
                    Value::from(self.retention.as_millis().min(i64::MAX as u128) as i64),
                ],
            )
            .await?;
        let position = reply::position(&reply).ok_or_else(|| bad_reply("revoke"))?;
        Ok(Revocation {
            device: device.clone(),
            at_ms: position.ms,
        })
    }

    async fn changes(&self, after: &Mark) -> BackendResult<Changes> {
        let mut mark = after.clone();
        let mut revocations = Vec::new();
        loop {
            let start = if mark.0.is_empty() {
                "-".to_string()
            } else {
                format!("({}", mark.0)
            };
            let reply = self
                .command(
                    "XRANGE",
                    vec![
                        Value::from(self.key.as_str()),
                        Value::from(start),
                        Value::from("+"),
                        Value::from("COUNT"),
                        Value::from(PAGE as i64),
                    ],
                )
                .await?;
            let entries = reply::items(&reply);
            for entry in entries {
                let [id, fields] = reply::items(entry) else {
                    return Err(bad_reply("revocations entry"));
                };
                let position = reply::position(id).ok_or_else(|| bad_reply("revocation id"))?;
                mark = Mark(position.to_string());
                // An entry that is no revocation of ours (written by hand) is passed over.
                let device = reply::items(fields)
                    .chunks(2)
                    .find(|pair| reply::text(&pair[0]) == Some("dev"))
                    .and_then(|pair| pair.get(1))
                    .and_then(reply::text)
                    .and_then(|text| DeviceId::parse(text).ok());
                if let Some(device) = device {
                    revocations.push(Revocation {
                        device,
                        at_ms: position.ms,
                    });
                }
            }
            if entries.len() < PAGE {
                return Ok(Changes { revocations, mark });
            }
        }
    }
}

impl RevocationStore for RedisRevocations {
    fn revoke(&self, device: &DeviceId) -> BoxFuture<'_, BackendResult<Revocation>> {
        let device = device.clone();
        async move { self.revoke(&device).await }.boxed()
    }

    fn changes(&self, after: &Mark) -> BoxFuture<'_, BackendResult<Changes>> {
        let after = after.clone();
        async move { self.changes(&after).await }.boxed()
    }
}

//! `Revocations`: applies the revocations of every pod on this one (docs/security.md,
//! "Revocation").
//!
//! Owns: the revocation store (`backend/revocation/`), the mark of what it has read, and the
//! pod's view of the revocations ([`Revoked`], shared with the HTTP edge, which refuses the
//! tokens it covers, and the Router, which checks streams as they register).
//! Receives: [`Revoke`] from `POST /admin/revoke` (→ the revocation as stored, or the error
//! with the revocation applied on this pod only).
//! Sends: [`CloseRevoked`] to the Router for every revocation it learns of, its own or another
//! pod's, so the device's streams close with `event: revoked`.
//! Reads the store's changes every second (a pod learns another pod's revocation within about a
//! second) and forgets what retention forgets. While the store is away the view keeps everything
//! already seen, a revocation made here is applied here at once, and the first read after the
//! outage catches up from the mark (nothing stored is missed). Mailbox: the default; `Revoke`
//! comes by `send`, the poll is its own timer. Nothing to do on drain.

use std::{sync::Arc, time::Duration};

use actix::prelude::*;

use super::router::CloseRevoked;
use crate::{
    backend::{
        revocation::{Mark, Revocation, RevocationStore, Revoked},
        BackendError,
    },
    metrics::Metrics,
    model::{unix_ms, DeviceId},
    report::Report,
};

/// How often the store is read for other pods' revocations.
pub const POLL_EVERY: Duration = Duration::from_secs(1);
/// Longest wait for the store to take a revocation: the operator's request is answered then,
/// and the revocation holds on this pod meanwhile.
const STORE_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest read of the store's changes; the next read starts from the same mark.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Revoke the tokens of `device` issued until now, on every pod.
#[derive(Message)]
#[rtype(result = "Result<Revocation, RevokeFailed>")]
pub struct Revoke {
    pub device: DeviceId,
}

/// The store did not take the revocation: it holds on this pod (the pod's clock), and nowhere
/// else until it is made again.
#[derive(Debug)]
pub struct RevokeFailed {
    pub applied_here: Revocation,
    pub error: BackendError,
}

pub struct Revocations {
    store: Arc<dyn RevocationStore>,
    revoked: Arc<Revoked>,
    router: Recipient<CloseRevoked>,
    retention: Duration,
    /// What has been read of the store's changes.
    mark: Mark,
    /// A read is in flight: the next tick waits for it.
    polling: bool,
    /// The last read failed (its error is logged once, not every second).
    failing: bool,
    metrics: Arc<Metrics>,
}

impl Revocations {
    /// `loaded` is what the store answered at start-up (applied to `revoked` already).
    pub fn new(
        store: Arc<dyn RevocationStore>,
        revoked: Arc<Revoked>,
        router: Recipient<CloseRevoked>,
        retention: Duration,
        loaded: Mark,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            store,
            revoked,
            router,
            retention,
            mark: loaded,
            polling: false,
            failing: false,
            metrics,
        }
    }

    /// Reads every revocation kept into `revoked` and answers the mark to continue from: what a
    /// pod does before it serves, so that a pod restarted after a revocation refuses the old
    /// tokens from its first request.
    pub async fn load(
        store: &dyn RevocationStore,
        revoked: &Revoked,
    ) -> Result<Mark, BackendError> {
        let changes = store.changes(&Mark::default()).await?;
        for revocation in &changes.revocations {
            revoked.note(revocation);
        }
        Ok(changes.mark)
    }

    fn apply(revoked: &Revoked, router: &Recipient<CloseRevoked>, revocation: &Revocation) {
        if revoked.note(revocation) {
            router.do_send(CloseRevoked {
                device: revocation.device.clone(),
                at_ms: revocation.at_ms,
            });
        }
    }

    fn poll(&mut self, ctx: &mut Context<Self>) {
        if self.polling {
            return;
        }
        self.polling = true;
        self.revoked.forget_before(unix_ms(), self.retention);
        self.metrics
            .revocations_known
            .set(self.revoked.len() as i64);
        let (store, mark) = (self.store.clone(), self.mark.clone());
        let read = async move {
            tokio::time::timeout(READ_TIMEOUT, store.changes(&mark))
                .await
                .unwrap_or_else(|_| {
                    Err(BackendError::unavailable(
                        "the revocations were not read in time",
                    ))
                })
        };
        ctx.spawn(read.into_actor(self).map(|result, this, _| {
            this.polling = false;
            match result {
                Ok(changes) => {
                    if this.failing {
                        log::info!("revocations: the store answers again");
                    }
                    this.failing = false;
                    for revocation in &changes.revocations {
                        Self::apply(&this.revoked, &this.router, revocation);
                    }
                    this.mark = changes.mark;
                }
                Err(error) => {
                    if !this.failing {
                        log::warn!(
                            "revocations: cannot read the store ({}); the revocations known \
                             here still hold",
                            Report(&error)
                        );
                    }
                    this.failing = true;
                }
            }
        }));
    }
}

impl Actor for Revocations {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(POLL_EVERY, |this, ctx| this.poll(ctx));
    }
}

impl Handler<Revoke> for Revocations {
    type Result = ResponseFuture<Result<Revocation, RevokeFailed>>;

    fn handle(&mut self, Revoke { device }: Revoke, _: &mut Context<Self>) -> Self::Result {
        let (store, revoked, router) = (
            self.store.clone(),
            self.revoked.clone(),
            self.router.clone(),
        );
        Box::pin(async move {
            let stored = tokio::time::timeout(STORE_TIMEOUT, store.revoke(&device))
                .await
                .unwrap_or_else(|_| {
                    Err(BackendError::unavailable(format!(
                        "the revocation was not stored within {}s",
                        STORE_TIMEOUT.as_secs()
                    )))
                });
            match stored {
                Ok(revocation) => {
                    Self::apply(&revoked, &router, &revocation);
                    Ok(revocation)
                }
                Err(error) => {
                    let applied_here = Revocation {
                        device,
                        at_ms: unix_ms(),
                    };
                    Self::apply(&revoked, &router, &applied_here);
                    Err(RevokeFailed {
                        applied_here,
                        error,
                    })
                }
            }
        })
    }
}

//! `Shutdown`: drains the pod (docs/operations.md, "Drain timeline") on SIGTERM/SIGINT or `POST /admin/drain`.
//!
//! Owns: the drain plan and its status, the HTTP server handle, the signal listener.
//! Receives: [`StartDrain`] (signal listener, admin endpoint), [`AttachServer`] (start-up).
//! Sends: [`Snapshot`] to the Router, [`AnnounceRetry`] then [`Close`] to Connections, [`StopTail`]
//! to the tails, and finally stops the HTTP server (the process then exits 0).
//! Sequence: readiness off and new streams refused at once (`PodState::start_draining`); after
//! `drain.readiness_delay`, every connection is sent its own `retry:` drawn uniformly from
//! `[drain.retry_min, drain.retry_max]`, then connections are closed in slices every 100 ms at
//! `max(drain.close_rate, connections / budget)` per second (each writes what it has queued, then
//! its retry again, and is cut off if its client does not take it before the grace's margin);
//! live events keep flowing until each connection's own close; the tails stop once no stream is
//! routed or still writing, or at `drain.grace` (then the process exits 1, which a stopped
//! reader can no longer cause).
//! One timer drives the whole drain, whatever the number of connections.
//! A second signal exits at once.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use actix::prelude::*;
use rand::Rng;
use serde::Serialize;

use super::{router::Snapshot, stream_tail::StopTail};
use crate::{
    config::DrainConfig,
    metrics::Metrics,
    pod::PodState,
    stop::StopHandle,
    stream::{AnnounceRetry, Close},
};

const SLICE: Duration = Duration::from_millis(100);

#[derive(Message)]
#[rtype(result = "bool")]
pub struct StartDrain {
    /// Stop the process once drained (false: stay up, unready, e.g. for inspection).
    pub exit: bool,
    pub trigger: &'static str,
}

#[derive(Message)]
#[rtype(result = "()")]
pub struct AttachServer(pub StopHandle);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainPhase {
    Idle,
    Draining,
    Drained,
}

/// What `/admin/status` shows of a drain.
#[derive(Debug, Clone, Serialize)]
pub struct DrainStatus {
    pub phase: DrainPhase,
    pub trigger: Option<&'static str>,
    pub connections_at_start: usize,
    pub close_rate_per_second: f64,
    pub closed: usize,
    pub elapsed_seconds: f64,
    /// False when the grace period ran out before every connection had closed.
    pub completed_in_grace: Option<bool>,
}

pub type SharedDrainStatus = Arc<Mutex<DrainStatus>>;

/// The close schedule: how many connections per second, so that all fit into the budget.
pub fn close_rate(connections: usize, min_rate: u32, budget: Duration) -> f64 {
    let needed = connections as f64 / budget.as_secs_f64().max(0.1);
    needed.max(f64::from(min_rate))
}

pub struct Shutdown {
    pod: Arc<PodState>,
    snapshot: Recipient<Snapshot>,
    tails: Vec<Recipient<StopTail>>,
    server: Option<StopHandle>,
    config: DrainConfig,
    metrics: Arc<Metrics>,
    status: SharedDrainStatus,
    /// Some trigger asked for the process to end once drained (a signal after an `exit=false`
    /// drain still ends the process).
    exit_when_drained: bool,
    drained: bool,
}

impl Shutdown {
    pub fn new(
        pod: Arc<PodState>,
        snapshot: Recipient<Snapshot>,
        tails: Vec<Recipient<StopTail>>,
        config: DrainConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            pod,
            snapshot,
            tails,
            server: None,
            config,
            metrics,
            exit_when_drained: false,
            drained: false,
            status: Arc::new(Mutex::new(DrainStatus {
                phase: DrainPhase::Idle,
                trigger: None,
                connections_at_start: 0,
                close_rate_per_second: 0.0,
                closed: 0,
                elapsed_seconds: 0.0,
                completed_in_grace: None,
            })),
        }
    }

    pub fn status(&self) -> SharedDrainStatus {
        self.status.clone()
    }

    fn stop_server_if_asked(&mut self) {
        if !(self.drained && self.exit_when_drained) {
            return;
        }
        if let Some(server) = self.server.take() {
            // SSE responses are closed by now; the server only waits for in-flight requests.
            server.stop();
        }
    }
}

impl Actor for Shutdown {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let me = ctx.address();
        actix::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                log::error!("cannot listen for SIGTERM/SIGINT: drain only via POST /admin/drain");
                return;
            };
            let trigger = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            me.do_send(StartDrain {
                exit: true,
                trigger,
            });
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
            log::warn!("second signal during drain: exiting now");
            std::process::exit(1);
        });
    }
}

impl Handler<AttachServer> for Shutdown {
    type Result = ();

    fn handle(&mut self, AttachServer(server): AttachServer, _: &mut Context<Self>) {
        self.server = Some(server);
    }
}

impl Handler<StartDrain> for Shutdown {
    type Result = bool;

    fn handle(&mut self, start: StartDrain, ctx: &mut Context<Self>) -> bool {
        self.exit_when_drained |= start.exit;
        if !self.pod.start_draining() {
            // Already draining or drained: only the exit request may be new.
            self.stop_server_if_asked();
            return false;
        }
        self.metrics.drain_in_progress.set(1);
        {
            let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
            status.phase = DrainPhase::Draining;
            status.trigger = Some(start.trigger);
        }
        let drain = Drain {
            started: Instant::now(),
            config: self.config.clone(),
            snapshot: self.snapshot.clone(),
            tails: self.tails.clone(),
            status: self.status.clone(),
            metrics: self.metrics.clone(),
            trigger: start.trigger,
            pod: self.pod.clone(),
        };
        log::info!(
            "drain requested by {}: readiness is off, new streams get 503; closes begin in {:.1}s",
            start.trigger,
            self.config.readiness_delay.as_secs_f64()
        );
        ctx.spawn(drain.run().into_actor(self).map(|(), shutdown, _| {
            shutdown.drained = true;
            shutdown.stop_server_if_asked();
        }));
        true
    }
}

struct Drain {
    started: Instant,
    config: DrainConfig,
    snapshot: Recipient<Snapshot>,
    tails: Vec<Recipient<StopTail>>,
    status: SharedDrainStatus,
    metrics: Arc<Metrics>,
    trigger: &'static str,
    pod: Arc<PodState>,
}

impl Drain {
    fn update(&self, change: impl FnOnce(&mut DrainStatus)) {
        change(&mut self.status.lock().unwrap_or_else(|p| p.into_inner()));
    }

    async fn run(self) {
        let config = &self.config;
        let deadline = self.started + config.grace;
        tokio::time::sleep(config.readiness_delay).await;
        let targets = self.snapshot.send(Snapshot).await.unwrap_or_default();
        // Keep a margin before the grace deadline for the last writes and the tails to stop.
        let margin = (config.grace / 10).min(Duration::from_secs(2));
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .saturating_sub(margin);
        let rate = close_rate(targets.len(), config.close_rate, budget);
        let expected = Duration::from_secs_f64(targets.len() as f64 / rate);
        log::info!(
            "drain started by {}: {} connections, closing {:.0}/s with retry {}..{} ms, expected to finish in {:.1}s (grace {:.1}s)",
            self.trigger,
            targets.len(),
            rate,
            config.retry_min.as_millis(),
            config.retry_max.as_millis(),
            expected.as_secs_f64(),
            config.grace.as_secs_f64()
        );
        self.update(|s| {
            s.connections_at_start = targets.len();
            s.close_rate_per_second = rate;
        });

        // Every connection learns its own reconnect delay now, before any close.
        let (retry_min, retry_max) = (
            config.retry_min.as_millis() as u32,
            config.retry_max.as_millis() as u32,
        );
        {
            let mut rng = rand::rng();
            for target in &targets {
                target
                    .announce
                    .do_send(AnnounceRetry(rng.random_range(retry_min..=retry_max)));
            }
        }
        // A client that has not taken what was queued for it by then is cut off.
        let flush_by = deadline - margin / 2;
        let per_slice = rate * SLICE.as_secs_f64();
        let mut ticker = tokio::time::interval(SLICE);
        let mut allowance = 0.0;
        let mut closed = 0;
        while closed < targets.len() {
            ticker.tick().await;
            allowance += per_slice;
            let upto = (closed + allowance as usize).min(targets.len());
            allowance -= (upto - closed) as f64;
            let flush_within = flush_by.saturating_duration_since(Instant::now());
            for target in &targets[closed..upto] {
                target.close.do_send(Close::drain(flush_within));
            }
            closed = upto;
            let elapsed = self.started.elapsed().as_secs_f64();
            self.update(|s| {
                s.closed = closed;
                s.elapsed_seconds = elapsed;
            });
        }

        // Done when no connection is routed any more and every response has been written out.
        let completed = loop {
            // Every routed connection has a live response body, so no open stream also means
            // no connection left in the Router.
            if self.pod.open_streams() == 0 {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        for tail in &self.tails {
            tail.do_send(StopTail);
        }
        let elapsed = self.started.elapsed();
        self.metrics.drain_in_progress.set(0);
        self.metrics
            .drain_duration_seconds
            .set(elapsed.as_secs_f64());
        self.update(|s| {
            s.phase = DrainPhase::Drained;
            s.elapsed_seconds = elapsed.as_secs_f64();
            s.completed_in_grace = Some(completed);
        });
        if completed {
            log::info!(
                "drain finished: {closed} connections closed in {:.1}s",
                elapsed.as_secs_f64()
            );
        } else {
            self.pod.mark_drain_forced();
            log::warn!(
                "drain forced at the grace deadline: {closed} connections asked to close in {:.1}s, some still open",
                elapsed.as_secs_f64()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The close rate respects the configured minimum and rises to fit the budget.
    #[test]
    fn close_rate_fits_the_grace_budget() {
        assert_eq!(close_rate(1000, 100, Duration::from_secs(28)), 100.0);
        let rate = close_rate(10_000, 100, Duration::from_secs(28));
        assert!(rate > 357.0 && rate < 358.0, "{rate}");
        assert_eq!(close_rate(0, 100, Duration::ZERO), 100.0);
    }
}

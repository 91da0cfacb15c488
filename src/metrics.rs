//! Every metric (docs/operations.md, "Metrics to watch"), in one struct registered into a registry that is passed in (tests build
//! their own). Label values come from enums ([`CloseReason`], [`ResyncReason`], ...), never from
//! device ids, so cardinality is fixed. Hot-path counters are resolved to their label once.

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, Opts, Registry, TextEncoder,
};

use crate::model::{CloseReason, ResyncReason};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteResult {
    /// Queued for a local connection.
    Delivered,
    /// No connection for the device on this pod (it is connected elsewhere, or not at all).
    NotConnected,
    /// The connection's queue was full: the client is evicted.
    QueueFull,
    /// The connection had just ended.
    Closed,
}

impl RouteResult {
    pub const ALL: [RouteResult; 4] = [
        RouteResult::Delivered,
        RouteResult::NotConnected,
        RouteResult::QueueFull,
        RouteResult::Closed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            RouteResult::Delivered => "delivered",
            RouteResult::NotConnected => "not_connected",
            RouteResult::QueueFull => "queue_full",
            RouteResult::Closed => "closed",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishResult {
    Accepted,
    Duplicate,
    Rejected,
    Failed,
}

impl PublishResult {
    pub fn label(self) -> &'static str {
        match self {
            PublishResult::Accepted => "accepted",
            PublishResult::Duplicate => "duplicate",
            PublishResult::Rejected => "rejected",
            PublishResult::Failed => "failed",
        }
    }
}

/// Why a request's token was refused (`auth_rejections_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthRejection {
    /// No token at all.
    Missing,
    /// Not a JWT, or claims of the wrong shape (`exp` missing, say).
    Malformed,
    /// Its `exp` (plus `auth.leeway`) has passed.
    Expired,
    /// A revocation of its device covers it.
    Revoked,
    /// Not signed by a key the hub trusts, or with another algorithm than the key's.
    BadSignature,
    /// It names a `kid` the key set does not hold (after a refresh, when one was allowed).
    UnknownKid,
    WrongIssuer,
    WrongAudience,
    /// Valid, but for another device or without the scope asked for (403).
    Forbidden,
}

impl AuthRejection {
    pub const ALL: [AuthRejection; 9] = [
        AuthRejection::Missing,
        AuthRejection::Malformed,
        AuthRejection::Expired,
        AuthRejection::Revoked,
        AuthRejection::BadSignature,
        AuthRejection::UnknownKid,
        AuthRejection::WrongIssuer,
        AuthRejection::WrongAudience,
        AuthRejection::Forbidden,
    ];

    pub fn label(self) -> &'static str {
        match self {
            AuthRejection::Missing => "missing",
            AuthRejection::Malformed => "malformed",
            AuthRejection::Expired => "expired",
            AuthRejection::Revoked => "revoked",
            AuthRejection::BadSignature => "bad_signature",
            AuthRejection::UnknownKid => "unknown_kid",
            AuthRejection::WrongIssuer => "wrong_issuer",
            AuthRejection::WrongAudience => "wrong_audience",
            AuthRejection::Forbidden => "forbidden",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    auth_rejections: IntCounterVec,
    /// `jwks_fetches_total{result="ok"}`: key sets fetched from `auth.jwks_url`.
    pub jwks_fetched: IntCounter,
    /// `jwks_fetches_total{result="error"}`.
    pub jwks_fetch_failed: IntCounter,
    /// Keys of the last key set fetched.
    pub jwks_keys: IntGauge,
    /// Revocations this pod knows of (its own and other pods').
    pub revocations_known: IntGauge,
    pub sse_connections: IntGauge,
    pub sse_connections_opened: IntCounter,
    sse_connections_closed: IntCounterVec,
    pub sse_slow_consumer_disconnects: IntCounter,
    pub sse_events_sent: IntCounter,
    pub sse_heartbeats_sent: IntCounter,
    pub sse_replayed_events: IntCounter,
    sse_resyncs: IntCounterVec,
    pub replay_entries_read: IntCounter,
    pub replays_in_flight: IntGauge,
    pub replays_waiting: IntGauge,
    pub replay_duration_seconds: Histogram,
    /// Live events only: replayed ones are old on purpose.
    pub sse_delivery_lag_seconds: Histogram,
    pub publish_duration_seconds: Histogram,
    tail_lag_seconds: GaugeVec,
    tail_reconnects: IntCounterVec,
    tail_batch_events: HistogramVec,
    pub tail_entries_skipped: IntCounter,
    /// `events_expired_total{path="live"}`: dropped by a tail before routing.
    pub events_expired_live: IntCounter,
    /// `events_expired_total{path="replay"}`: skipped by a replay.
    pub events_expired_replay: IntCounter,
    pub events_superseded: IntCounter,
    router_events: [IntCounter; 4],
    publish_events: IntCounterVec,
    pub drain_in_progress: IntGauge,
    pub ready: IntGauge,
    pub drain_duration_seconds: Gauge,
    pub fleet_devices_online: IntGauge,
    fleet_acks: IntCounterVec,
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let metric = IntCounter::new(name, help).expect("metric names are static and valid");
    registry
        .register(Box::new(metric.clone()))
        .expect("each metric is registered once");
    metric
}

fn counter_vec(registry: &Registry, name: &str, help: &str, label: &str) -> IntCounterVec {
    let metric = IntCounterVec::new(Opts::new(name, help), &[label])
        .expect("metric names are static and valid");
    registry
        .register(Box::new(metric.clone()))
        .expect("each metric is registered once");
    metric
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let metric = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("metric names are static and valid");
    registry
        .register(Box::new(metric.clone()))
        .expect("each metric is registered once");
    metric
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let metric = IntGauge::new(name, help).expect("metric names are static and valid");
    registry
        .register(Box::new(metric.clone()))
        .expect("each metric is registered once");
    metric
}

impl Metrics {
    /// `backend_kind` prefixes the tail metrics (`redis_tail_lag_seconds`, `memory_tail_...`), so
    /// the same dashboards read every backend.
    pub fn new(registry: Registry, backend_kind: &str) -> Self {
        let r = &registry;
        let sse_connections_closed = counter_vec(
            r,
            "sse_connections_closed_total",
            "SSE connections closed, by reason (client, slow_consumer, drain, takeover, error, \
             token_expired, revoked)",
            "reason",
        );
        for reason in CloseReason::ALL {
            sse_connections_closed.with_label_values(&[reason.label()]);
        }
        let auth_rejections = counter_vec(
            r,
            "auth_rejections_total",
            "requests whose token was refused, by reason (missing, malformed, expired, revoked, \
             bad_signature, unknown_kid, wrong_issuer, wrong_audience: 401; forbidden: 403)",
            "reason",
        );
        for reason in AuthRejection::ALL {
            auth_rejections.with_label_values(&[reason.label()]);
        }
        let jwks_fetches = counter_vec(
            r,
            "jwks_fetches_total",
            "fetches of the key set at auth.jwks_url, by result (ok, error)",
            "result",
        );
        let sse_resyncs = counter_vec(
            r,
            "sse_resyncs_total",
            "resync events written to clients, by reason (expired, invalid, data_lost): on resume, \
             and when a tail finds a loss",
            "reason",
        );
        for reason in ResyncReason::ALL {
            sse_resyncs.with_label_values(&[reason.label()]);
        }
        let router_events_vec = counter_vec(
            r,
            "router_events_total",
            "event deliveries handled by the router, by result",
            "result",
        );
        let router_events =
            RouteResult::ALL.map(|result| router_events_vec.with_label_values(&[result.label()]));
        let fleet_acks = counter_vec(
            r,
            "fleet_acks_total",
            "acknowledgements received (POST /v1/devices/{device}/ack), by result: moved (stored), \
             stale (at or behind the stored ack)",
            "result",
        );
        for result in ["moved", "stale"] {
            fleet_acks.with_label_values(&[result]);
        }
        let publish_events = counter_vec(
            r,
            "publish_events_total",
            "events submitted to POST /v1/events, by result (accepted, duplicate, failed); a rejected request counts once",
            "result",
        );
        for result in [
            PublishResult::Accepted,
            PublishResult::Duplicate,
            PublishResult::Rejected,
            PublishResult::Failed,
        ] {
            publish_events.with_label_values(&[result.label()]);
        }
        let tail_lag_seconds = GaugeVec::new(
            Opts::new(
                format!("{backend_kind}_tail_lag_seconds"),
                "now minus the time of the last entry a stream tail read, per node group",
            ),
            &["group"],
        )
        .expect("metric names are static and valid");
        r.register(Box::new(tail_lag_seconds.clone()))
            .expect("each metric is registered once");
        let events_expired = counter_vec(
            r,
            "events_expired_total",
            "events not delivered because their exp (ttl) had passed, by where they were dropped",
            "path",
        );
        let tail_reconnects = counter_vec(
            r,
            &format!("{backend_kind}_tail_reconnects_total"),
            "times a stream tail re-established its backend connection, per node group",
            "group",
        );
        let tail_batch_events = HistogramVec::new(
            HistogramOpts::new(
                format!("{backend_kind}_tail_batch_events"),
                "entries per non-empty read of a stream tail, per node group",
            )
            .buckets(vec![1.0, 5.0, 20.0, 100.0, 500.0, 2000.0]),
            &["group"],
        )
        .expect("metric names are static and valid");
        r.register(Box::new(tail_batch_events.clone()))
            .expect("each metric is registered once");
        let replay_duration_seconds = histogram(
            r,
            "replay_duration_seconds",
            "time from a resumed stream's open to the end of its replay, waiting included",
            &[0.005, 0.02, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
        );
        // Buckets from docs/BENCHMARKS.md: live deliveries take 1–10 ms on a healthy pod (p50
        // about 1 ms, p99 under 10 ms at 5,000 events/s), a broadcast to 10,000 streams tens of
        // ms; positions have millisecond resolution, so nothing finer than 1 ms.
        let sse_delivery_lag_seconds = histogram(
            r,
            "sse_delivery_lag_seconds",
            "time from an event's append (the backend's clock) to its write to a live stream",
            &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ],
        );
        // A publish answers in about 1 ms on the memory backend and a few ms on Redis or NATS.
        let publish_duration_seconds = histogram(
            r,
            "publish_duration_seconds",
            "time to answer POST /v1/events, reading its body included",
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ],
        );
        let drain_duration_seconds = Gauge::new(
            "drain_duration_seconds",
            "duration of the last completed drain (0 before any drain)",
        )
        .expect("metric names are static and valid");
        r.register(Box::new(drain_duration_seconds.clone()))
            .expect("each metric is registered once");

        #[cfg(target_os = "linux")]
        {
            // Registering twice (several hubs in one test process) is harmless to skip.
            let _ = r.register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ));
        }

        Self {
            auth_rejections,
            jwks_fetched: jwks_fetches.with_label_values(&["ok"]),
            jwks_fetch_failed: jwks_fetches.with_label_values(&["error"]),
            jwks_keys: gauge(
                r,
                "jwks_keys",
                "keys in the key set last fetched from auth.jwks_url",
            ),
            revocations_known: gauge(
                r,
                "revocations_known",
                "device revocations this pod applies (its own and other pods', within \
                 auth.revocation_retention)",
            ),
            fleet_acks,
            fleet_devices_online: gauge(
                r,
                "fleet_devices_online",
                "devices online in the whole fleet as this pod's fleet event stream reports them \
                 (debounced by presence.debounce; 0 with presence disabled)",
            ),
            sse_connections: gauge(r, "sse_connections", "open SSE connections"),
            sse_connections_opened: counter(
                r,
                "sse_connections_opened_total",
                "SSE connections opened",
            ),
            sse_connections_closed,
            sse_slow_consumer_disconnects: counter(
                r,
                "sse_slow_consumer_disconnects_total",
                "connections evicted as too slow: their bounded queue overflowed, or their queue or replay \
                 made no progress for sse.stall_timeout",
            ),
            sse_events_sent: counter(
                r,
                "sse_events_sent_total",
                "events written to SSE connections",
            ),
            sse_heartbeats_sent: counter(
                r,
                "sse_heartbeats_sent_total",
                "heartbeat comments written",
            ),
            sse_replayed_events: counter(
                r,
                "sse_replayed_events_total",
                "events replayed after a Last-Event-ID",
            ),
            sse_resyncs,
            replay_entries_read: counter(
                r,
                "replay_entries_read_total",
                "stream entries replays read from the backend, for any device of the shard",
            ),
            replays_in_flight: gauge(r, "replays_in_flight", "replays running now"),
            replays_waiting: gauge(
                r,
                "replays_waiting",
                "resumed streams waiting for a replay slot (replay.max_concurrent)",
            ),
            replay_duration_seconds,
            sse_delivery_lag_seconds,
            publish_duration_seconds,
            tail_lag_seconds,
            tail_reconnects,
            tail_batch_events,
            tail_entries_skipped: counter(
                r,
                "tail_entries_skipped_total",
                "stream entries skipped because a field was missing or invalid",
            ),
            events_expired_live: events_expired.with_label_values(&["live"]),
            events_expired_replay: events_expired.with_label_values(&["replay"]),
            events_superseded: counter(
                r,
                "events_superseded_total",
                "events a replay skipped because a newer event of the same target and supersede \
                 name is stored",
            ),
            router_events,
            publish_events,
            drain_in_progress: gauge(r, "drain_in_progress", "1 while this pod is draining"),
            ready: gauge(
                r,
                "ready",
                "1 while GET /readyz answers 200 (not draining, backend answering), checked every 5 s \
                 and at each probe",
            ),
            drain_duration_seconds,
            registry,
        }
    }

    pub fn auth_rejected(&self, reason: AuthRejection) {
        self.auth_rejections
            .with_label_values(&[reason.label()])
            .inc();
    }

    pub fn connection_closed(&self, reason: CloseReason) {
        self.sse_connections_closed
            .with_label_values(&[reason.label()])
            .inc();
        if reason == CloseReason::SlowConsumer {
            self.sse_slow_consumer_disconnects.inc();
        }
    }

    pub fn resync(&self, reason: ResyncReason) {
        self.sse_resyncs.with_label_values(&[reason.label()]).inc();
    }

    pub fn routed(&self, result: RouteResult, count: u64) {
        let index = RouteResult::ALL
            .iter()
            .position(|r| *r == result)
            .unwrap_or(0);
        self.router_events[index].inc_by(count);
    }

    /// An ack that moved the device's acknowledged position (`true`) or was stale.
    pub fn acked(&self, moved: bool) {
        self.fleet_acks
            .with_label_values(&[if moved { "moved" } else { "stale" }])
            .inc();
    }

    pub fn published(&self, result: PublishResult, count: u64) {
        self.publish_events
            .with_label_values(&[result.label()])
            .inc_by(count);
    }

    pub fn tail_lag(&self, group: usize, seconds: f64) {
        self.tail_lag_seconds
            .with_label_values(&[&group.to_string()])
            .set(seconds);
    }

    pub fn tail_batch(&self, group: usize, events: usize) {
        self.tail_batch_events
            .with_label_values(&[&group.to_string()])
            .observe(events as f64);
    }

    pub fn tail_reconnected(&self, group: usize) {
        self.tail_reconnects
            .with_label_values(&[&group.to_string()])
            .inc();
    }

    /// Registers the per-group series up front so dashboards see them before the first event.
    pub fn init_groups(&self, groups: usize) {
        for group in 0..groups {
            self.tail_lag_seconds
                .with_label_values(&[&group.to_string()]);
            self.tail_reconnects
                .with_label_values(&[&group.to_string()]);
        }
    }

    /// Prometheus text exposition of everything registered.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        let encoder = TextEncoder::new();
        // Encoding into a Vec cannot fail for well-formed metric families.
        let _ = encoder.encode(&self.registry.gather(), &mut buffer);
        String::from_utf8(buffer).unwrap_or_default()
    }
}

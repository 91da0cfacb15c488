//! Fault-injection checker ("our own Jepsen"): real hubs behind nginx on a real Redis or NATS,
//! devices that follow the client contract, sequential producers, and faults from a seeded
//! schedule; then a pure checker ([`checker::check`]) compares what every device processed with
//! what the producers were told. The promise it checks: every event of a device (its unicasts,
//! the broadcasts and the events of its groups) once and in order, or an explicit `resync`
//! before anything after the gap; and no event of a group to a device outside it.
//!
//! Groups: every device names its store (`store-0` to `store-3`) and, for about half of them, a
//! region (`region-0`, `region-1`) in `?groups=` on every connect, fixed per device by the seed;
//! the HTTP producers mix group events into their batches beside the unicasts (one producer owns
//! each group, so that its series stays sequential). The external producers write unicasts only.
//!
//! Topologies and their fault kinds ([`faults`]; hub SIGKILL and hub drain on every topology):
//! - `redis`: one Redis with AOF: restart from the AOF, restart without files, rollback to an
//!   older snapshot (taken halfway through every pause), FLUSHALL, DEL of a stream;
//! - `redis-rdb`: one Redis without persistence: the same but the AOF restart (the snapshots
//!   are SAVEd RDB files);
//! - `redis-cluster`: 3 masters with a replica each, hubs with `redis.cluster` and 3 groups:
//!   failover (the master of a group's slot SIGKILLed, its replica promoted, the old master
//!   restarted as a replica), FLUSHALL on every master, DEL of a stream;
//! - `nats`: one `nats-server -js`: stream deletion, restart with and without its store;
//! - `nats-cluster`: 3 nodes, hubs with every node's URL and an R3 stream: one node SIGKILLed
//!   (now and then stopped), the stream leader and a follower in turn, and restarted (no stream
//!   deletion: nats-server 2.9.10 does not bring a node killed after a re-creation back).
//!
//! - Short runs, one per topology but `redis-rdb`, fixed seeds, each kind of the topology once
//!   (the cluster runs: two failovers or node kills, and no hub faults), 2 to 3.5 s apart; they
//!   assert that there is no violation, and that the run did its work: every scheduled fault
//!   injected, a `resync` after each fault that loses data, a stream opened by every device, and
//!   floors of publishes acknowledged, events checked, group events checked and streams opened
//!   ([`Floors`]), so that a system that refuses everything, or a run whose groups deliver
//!   nothing, fails. `cargo test --test chaos -- --nocapture` runs them one after the other (plus
//!   the unit tests) in about 95 s on the 2-core machine: `redis` 29 s, `redis-cluster` 22 s (2 s
//!   to start the cluster), `nats` 23 s, `nats-cluster` 20 s (4 s to start); up to 10 s more each
//!   if devices miss events (the quiet period).
//! - `long_run` (ignored): every topology in turn, in rounds, each segment a fresh system:
//!   `POSTHORN_CHAOS_MINUTES` (default 10; the minutes of faults, split by a weight per
//!   topology and over `round(minutes / 12)` rounds), `POSTHORN_CHAOS_SEED` (default: drawn
//!   from the clock), `POSTHORN_CHAOS_BACKEND` (`all`, the default; `both` for `redis,nats`; or
//!   a comma-separated list of topologies). Kinds only one topology has come twice per deck,
//!   pauses are 1.5 to 3 s, so that 30 minutes give each kind about 20 faults or more (a
//!   3-minute trial: 57 faults, 19 a minute, 2 to 10 per kind). It ends with a table per fault
//!   kind over all segments (faults injected, events checked after them, violations, resyncs,
//!   topologies) and lists the kinds below 20 faults; each segment prints its own replay line:
//!   `POSTHORN_CHAOS_MINUTES=30 cargo test --test chaos long_run -- --ignored --nocapture`
//!   (3 minutes of faults took 3.2 minutes: start-up, quiet periods, the last faults).
//!
//! Each run (segment) prints a human summary (per fault kind: faults injected, resyncs seen
//! after it, events checked, violations by kind; then each violation with the device's history
//! around it) and one JSON line starting with `{"chaos":`. A seed replays the same schedule,
//! device behaviours and publishing pattern; process timing differs from run to run. A run with
//! violations (or any run with `POSTHORN_CHAOS_HISTORY_DIR` set) writes its whole history as
//! JSON; `recheck` (ignored) checks such a file again.

#[path = "../support/mod.rs"]
mod support;

mod checker;
mod device;
mod faults;
mod history;
mod producer;
mod scenario;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use checker::Report;
use faults::{BackendKind, FaultKind};
use history::{Observation, Outcome, Via};
use scenario::{Plan, RunResult};

const SHORT_REDIS_SEED: u64 = 0x00c4_a05e_0001;
const SHORT_NATS_SEED: u64 = 0x00c4_a05e_0002;
const SHORT_REDIS_CLUSTER_SEED: u64 = 0x00c4_a05e_0003;
const SHORT_NATS_CLUSTER_SEED: u64 = 0x00c4_a05e_0004;

// The floors of the short runs: about a quarter of the least that three runs on the shared
// 2-core machine did (publishes acknowledged by the hubs / events checked / streams opened, as
// each run prints them): `redis` 2045 / 3269 / 85, `nats` 1722 / 2660 / 83, `redis-cluster`
// 923 / 1526 / 50, `nats-cluster` 689 / 1138 / 46; streams at about half, as 16 devices each
// open one at the start and only some reconnect. Publishing is paced, so a loaded machine
// lowers these little; hubs that refuse every publish leave about none acknowledged (a test
// run with every event over `limits.max_event_bytes`: 0, and 284 events checked, all from the
// external producers). Group events checked, at about a quarter of one run with groups: `redis`
// 288, `nats` 252, `redis-cluster` 154, `nats-cluster` 150; a run that publishes no group event,
// or whose members receive none, falls below them.
const SHORT_REDIS_FLOORS: Floors = Floors {
    acked: 500,
    checked: 800,
    streams: 24,
    groups: 70,
};
const SHORT_NATS_FLOORS: Floors = Floors {
    acked: 400,
    checked: 600,
    streams: 24,
    groups: 60,
};
const SHORT_REDIS_CLUSTER_FLOORS: Floors = Floors {
    acked: 250,
    checked: 400,
    streams: 24,
    groups: 35,
};
const SHORT_NATS_CLUSTER_FLOORS: Floors = Floors {
    acked: 150,
    checked: 250,
    streams: 24,
    groups: 35,
};

/// The scenarios share two cores with everything they start: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Runs a plan on its own runtime, bounded in time, and prints its summary and JSON line.
fn execute(plan: &Plan) -> RunResult {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let limit = plan.chaos + Duration::from_secs(120);
    let result = runtime.block_on(async {
        tokio::time::timeout(limit, scenario::run(plan))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "chaos run ({}, seed {}) did not finish within {limit:?}",
                    plan.backend.label(),
                    plan.seed
                )
            })
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    println!("{}", result.report.summary(&result.history, 6).trim_end());
    if !result.lagging.is_empty() {
        println!(
            "still awaited when the quiet period ended: {}",
            result.lagging.join("; ")
        );
    }
    if !result.hub_warnings.is_empty() {
        println!(
            "hub warnings (last lines):\n{}",
            result.hub_warnings.trim_end()
        );
    }
    println!(
        "run took {:.1} s (faults {}, publishing stopped {}, end {})",
        result.elapsed.as_secs_f64(),
        history::show_time(result.history.faults_stopped),
        history::show_time(result.history.publishing_stopped),
        history::show_time(result.history.ended),
    );
    if let Some(path) = keep_history(&result) {
        println!("history written to {}", path.display());
    }
    println!("{}", result.report.json_line());
    result
}

/// Writes the whole history as JSON when the run found violations, or always when
/// `POSTHORN_CHAOS_HISTORY_DIR` names a directory.
fn keep_history(result: &RunResult) -> Option<std::path::PathBuf> {
    let dir = match std::env::var_os("POSTHORN_CHAOS_HISTORY_DIR") {
        Some(dir) => std::path::PathBuf::from(dir),
        None if !result.report.is_clean() => std::env::temp_dir(),
        None => return None,
    };
    let path = dir.join(format!(
        "posthorn-chaos-{}-{}-{}.json",
        result.report.backend,
        result.report.seed,
        std::process::id()
    ));
    let json = serde_json::to_vec(&result.history).expect("serialise the history");
    match std::fs::write(&path, json) {
        Ok(()) => Some(path),
        Err(error) => {
            println!("cannot write the history to {}: {error}", path.display());
            None
        }
    }
}

fn assert_clean(results: &[(&Report, String)]) {
    let failing: Vec<String> = results
        .iter()
        .filter(|(r, _)| !r.is_clean())
        .map(|(r, replay)| {
            format!(
                "{} seed {}: {} violations {:?}; replay: {replay}",
                r.backend,
                r.seed,
                r.violations.len(),
                r.violation_counts()
            )
        })
        .collect();
    assert!(
        failing.is_empty(),
        "the chaos run found violations of the delivery promise:\n{}",
        failing.join("\n")
    );
}

/// What a short run must at least have done besides finding no violation, so that a system that
/// refuses every request (nothing acknowledged, delivered or checked) cannot pass. Besides these
/// floors, every scheduled fault must have been injected, every device must have opened a stream,
/// and each fault that loses data must have been followed by a `resync`.
#[derive(Clone, Copy, Debug)]
struct Floors {
    /// Publishes through the hubs answered 201 with an id.
    acked: u64,
    /// Events devices processed that the checker verified.
    checked: u64,
    /// Of those, events of the devices' groups: without them groups go unchecked.
    groups: u64,
    /// Stream requests answered 200, over all devices and reconnects.
    streams: u64,
}

/// Everything a short run fell short of (see [`Floors`]), one line each.
fn shortfalls(plan: &Plan, result: &RunResult, floors: Floors) -> Vec<String> {
    let (history, report) = (&result.history, &result.report);
    let mut missing = Vec::new();
    let mut kinds: Vec<FaultKind> = Vec::new();
    for kind in &plan.kinds {
        if !kinds.contains(kind) {
            kinds.push(*kind);
        }
    }
    for kind in kinds {
        let scheduled = plan.kinds.iter().filter(|k| **k == kind).count();
        let injected = history
            .faults
            .iter()
            .filter(|f| f.kind == kind.label())
            .count();
        // One deck of `plan.kinds` is the whole schedule: each entry is struck once.
        if injected != scheduled {
            missing.push(format!(
                "{} injected {injected} times, scheduled {scheduled}",
                kind.label()
            ));
        }
    }
    // Any time after the fault: the hub may notice a loss only once the next fault has begun
    // (a NATS restarted empty, then a stream deletion that finds no stream to delete), and the
    // report counts a resync for the fault in force when it came.
    let losses = history.faults.iter().filter(|fault| {
        FaultKind::ALL
            .iter()
            .any(|k| k.label() == fault.kind && k.loses_data())
    });
    for fault in losses {
        let resyncs = history
            .devices
            .iter()
            .flat_map(|d| &d.observations)
            .filter(|o| o.at >= fault.started && matches!(o.what, Observation::Resync { .. }))
            .count();
        if resyncs == 0 {
            missing.push(format!(
                "no resync after {} at {}, which loses data",
                fault.kind,
                history::show_time(fault.started)
            ));
        }
    }
    let acked = history
        .attempts
        .iter()
        .filter(|a| a.via == Via::Http && matches!(a.outcome, Outcome::Acked { .. }))
        .count() as u64;
    if acked < floors.acked {
        missing.push(format!(
            "{acked} publishes acknowledged by the hubs, expected {} or more",
            floors.acked
        ));
    }
    if report.events_checked < floors.checked {
        missing.push(format!(
            "{} events checked, expected {} or more",
            report.events_checked, floors.checked
        ));
    }
    if report.group_events_checked < floors.groups {
        missing.push(format!(
            "{} group events checked, expected {} or more",
            report.group_events_checked, floors.groups
        ));
    }
    let opened = |device: &history::DeviceHistory| {
        device
            .observations
            .iter()
            .filter(|o| {
                matches!(
                    o.what,
                    Observation::Connected {
                        status: Some(200),
                        ..
                    }
                )
            })
            .count() as u64
    };
    let streams: u64 = history.devices.iter().map(opened).sum();
    println!(
        "short run floors: acked by the hubs {acked} (floor {}), checked {} (floor {}), group \
         events checked {} (floor {}), streams opened {streams} (floor {})",
        floors.acked,
        report.events_checked,
        floors.checked,
        report.group_events_checked,
        floors.groups,
        floors.streams
    );
    if streams < floors.streams {
        missing.push(format!(
            "{streams} streams opened (200), expected {} or more",
            floors.streams
        ));
    }
    let never: Vec<&str> = history
        .devices
        .iter()
        .filter(|d| opened(d) == 0)
        .map(|d| d.device.as_str())
        .collect();
    if !never.is_empty() {
        missing.push(format!("devices that never opened a stream: {never:?}"));
    }
    missing
}

/// A short run: one deck of `kinds` (every kind of the topology once, unless given), then
/// `settle` and the quiet period; bounded by `limit` if the faults take longer.
fn short_plan(backend: BackendKind, seed: u64, kinds: Option<Vec<FaultKind>>) -> Plan {
    let mut plan = Plan::new(backend, seed, Duration::from_secs(60));
    if let Some(kinds) = kinds {
        plan.kinds = kinds;
    }
    plan.max_faults = Some(plan.kinds.len());
    plan.pause = (Duration::from_millis(2000), Duration::from_millis(3500));
    plan.drain_wait = Duration::from_secs(5);
    plan
}

fn short_run(plan: Plan, test: &str, floors: Floors) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let result = execute(&plan);
    let replay = format!("cargo test --test chaos {test} -- --nocapture");
    assert_clean(&[(&result.report, replay.clone())]);
    let missing = shortfalls(&plan, &result, floors);
    assert!(
        missing.is_empty(),
        "the chaos run ({}, seed {}) did too little to count:\n{}\nreplay: {replay}",
        plan.backend.label(),
        plan.seed,
        missing.join("\n")
    );
}

#[test]
fn short_run_redis() {
    short_run(
        short_plan(BackendKind::Redis, SHORT_REDIS_SEED, None),
        "short_run_redis",
        SHORT_REDIS_FLOORS,
    );
}

#[test]
fn short_run_nats() {
    short_run(
        short_plan(BackendKind::Nats, SHORT_NATS_SEED, None),
        "short_run_nats",
        SHORT_NATS_FLOORS,
    );
}

#[test]
fn short_run_redis_cluster() {
    let kinds = vec![
        FaultKind::RedisFailover,
        FaultKind::RedisFailover,
        FaultKind::RedisFlushAll,
        FaultKind::RedisDelStream,
    ];
    short_run(
        short_plan(
            BackendKind::RedisCluster,
            SHORT_REDIS_CLUSTER_SEED,
            Some(kinds),
        ),
        "short_run_redis_cluster",
        SHORT_REDIS_CLUSTER_FLOORS,
    );
}

#[test]
fn short_run_nats_cluster() {
    let kinds = vec![FaultKind::NatsNodeKill, FaultKind::NatsNodeKill];
    short_run(
        short_plan(
            BackendKind::NatsCluster,
            SHORT_NATS_CLUSTER_SEED,
            Some(kinds),
        ),
        "short_run_nats_cluster",
        SHORT_NATS_CLUSTER_FLOORS,
    );
}

/// Checks a history written by an earlier run again (after a change to the checker, or to read
/// its report): `POSTHORN_CHAOS_RECHECK=/tmp/posthorn-chaos-....json cargo test --test chaos
/// recheck -- --ignored --nocapture`.
#[test]
#[ignore = "needs POSTHORN_CHAOS_RECHECK=<history.json>"]
fn recheck() {
    let path = std::env::var("POSTHORN_CHAOS_RECHECK")
        .expect("POSTHORN_CHAOS_RECHECK names a history file written by a chaos run");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let history: history::History =
        serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{path} is no history: {e}"));
    let report = checker::check(&history);
    println!("{}", report.summary(&history, 6).trim_end());
    println!("{}", report.json_line());
}

/// Share of a long run's minutes per topology: about what one deck of its kinds takes (the
/// cluster faults wait for failovers and rejoins), so that the kinds only one topology has get
/// about as many faults as the others.
fn weight(backend: BackendKind) -> f64 {
    match backend {
        BackendKind::Redis => 1.0,
        BackendKind::RedisRdb => 0.75,
        BackendKind::RedisCluster => 1.05,
        BackendKind::Nats => 1.2,
        BackendKind::NatsCluster => 0.9,
    }
}

/// Faults of each kind a long run of 30 minutes or more should inject at least.
const LONG_RUN_MIN_FAULTS: u64 = 20;

/// Per fault kind, over every segment of a long run.
#[derive(Default)]
struct KindTotals {
    topologies: BTreeSet<String>,
    injected: u64,
    events: u64,
    resyncs: BTreeMap<String, u64>,
    violations: BTreeMap<String, u64>,
}

fn fmt_counts(map: &BTreeMap<String, u64>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The long run's table: per fault kind, faults injected, events checked after them, resyncs
/// seen after them and violations attributed to them, over all segments.
fn long_summary(reports: &[Report]) -> (String, Vec<String>) {
    let mut totals: BTreeMap<String, KindTotals> = BTreeMap::new();
    let mut order: Vec<String> = vec![checker::NO_FAULT.to_string()];
    order.extend(
        FaultKind::ALL
            .iter()
            .map(|k| k.label().to_string())
            .collect::<Vec<_>>(),
    );
    for report in reports {
        for stats in &report.per_fault {
            let t = totals.entry(stats.fault.clone()).or_default();
            if stats.injected > 0 {
                t.topologies.insert(report.backend.clone());
            }
            t.injected += stats.injected;
            t.events += stats.events;
            for (k, v) in &stats.resyncs {
                *t.resyncs.entry(k.clone()).or_default() += v;
            }
            for (k, v) in &stats.violations {
                *t.violations.entry(format!("{k:?}")).or_default() += v;
            }
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:>8} {:>9} {:>10}  {:<26} topologies",
        "fault", "injected", "events", "violations", "resyncs seen after it"
    );
    let mut short = Vec::new();
    for label in &order {
        let Some(t) = totals.get(label) else {
            if label != checker::NO_FAULT {
                short.push(format!("{label} 0"));
            }
            continue;
        };
        let violations: u64 = t.violations.values().sum();
        let _ = writeln!(
            out,
            "{:<20} {:>8} {:>9} {:>10}  {:<26} {}",
            label,
            t.injected,
            t.events,
            if violations == 0 {
                "0".to_string()
            } else {
                format!("{violations} ({})", fmt_counts(&t.violations))
            },
            fmt_counts(&t.resyncs),
            t.topologies.iter().cloned().collect::<Vec<_>>().join(", "),
        );
        if label != checker::NO_FAULT && t.injected < LONG_RUN_MIN_FAULTS {
            short.push(format!("{label} {}", t.injected));
        }
    }
    let events: u64 = reports.iter().map(|r| r.events_checked).sum();
    let violations: usize = reports.iter().map(|r| r.violations.len()).sum();
    let _ = writeln!(
        out,
        "{:<20} {:>8} {:>9} {:>10}",
        "total",
        reports
            .iter()
            .flat_map(|r| &r.per_fault)
            .map(|s| s.injected)
            .sum::<u64>(),
        events,
        violations
    );
    (out, short)
}

/// Every topology in turn, in rounds, each segment a fresh system (clusters started anew):
/// `POSTHORN_CHAOS_MINUTES` (default 10) split over the topologies by [`weight`] and over
/// `round(minutes / 12)` rounds (at least one); `POSTHORN_CHAOS_SEED` (default: from the
/// clock; round `r` runs with seed + r); `POSTHORN_CHAOS_BACKEND`: `all` (the default), `both`
/// (`redis,nats`), or a comma-separated list of `redis`, `redis-rdb`, `redis-cluster`, `nats`,
/// `nats-cluster`.
#[test]
#[ignore = "long: POSTHORN_CHAOS_MINUTES, POSTHORN_CHAOS_SEED, POSTHORN_CHAOS_BACKEND"]
fn long_run() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let minutes: f64 = std::env::var("POSTHORN_CHAOS_MINUTES")
        .ok()
        .map(|m| m.parse().expect("POSTHORN_CHAOS_MINUTES is a number"))
        .unwrap_or(10.0);
    let seed: u64 = std::env::var("POSTHORN_CHAOS_SEED")
        .ok()
        .map(|s| {
            s.parse()
                .expect("POSTHORN_CHAOS_SEED is an unsigned integer")
        })
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64 % 1_000_000_000)
                .unwrap_or(1)
        });
    let which = std::env::var("POSTHORN_CHAOS_BACKEND").unwrap_or_else(|_| "all".into());
    let backends: Vec<BackendKind> = match which.as_str() {
        "all" => BackendKind::ALL.to_vec(),
        "both" => vec![BackendKind::Redis, BackendKind::Nats],
        list => list
            .split(',')
            .map(|label| {
                BackendKind::parse(label.trim()).unwrap_or_else(|| {
                    panic!(
                        "POSTHORN_CHAOS_BACKEND: {label:?} is none of all, both, redis, \
                         redis-rdb, redis-cluster, nats, nats-cluster"
                    )
                })
            })
            .collect(),
    };
    let rounds = ((minutes / 12.0).round() as u64).max(1);
    let total_weight: f64 = backends.iter().map(|&b| weight(b)).sum();
    println!(
        "long chaos run: seed {seed}, {minutes} minutes, {rounds} round(s) of {}",
        backends
            .iter()
            .map(|&b| format!(
                "{} {:.1} min",
                b.label(),
                minutes * weight(b) / total_weight / rounds as f64
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let began = std::time::Instant::now();
    let mut reports: Vec<(Report, String)> = Vec::new();
    for round in 0..rounds {
        for &backend in &backends {
            let segment = minutes * weight(backend) / total_weight / rounds as f64;
            let plan = Plan::long(
                backend,
                seed + round,
                Duration::from_secs_f64(segment * 60.0),
            );
            let replay = format!(
                "POSTHORN_CHAOS_SEED={} POSTHORN_CHAOS_MINUTES={segment:.3} \
                 POSTHORN_CHAOS_BACKEND={} cargo test --test chaos long_run -- --ignored \
                 --nocapture",
                seed + round,
                backend.label()
            );
            println!(
                "=== long run segment: round {} of {rounds}, {}, seed {}, {segment:.2} min",
                round + 1,
                backend.label(),
                seed + round
            );
            let result = execute(&plan);
            reports.push((result.report, replay));
        }
    }
    let plain: Vec<Report> = reports.iter().map(|(r, _)| r.clone()).collect();
    let (table, short) = long_summary(&plain);
    println!(
        "=== long chaos run: seed {seed}, {minutes} minutes of faults, {} segments, took {:.1} min",
        reports.len(),
        began.elapsed().as_secs_f64() / 60.0
    );
    println!("{}", table.trim_end());
    if !short.is_empty() {
        println!(
            "fewer than {LONG_RUN_MIN_FAULTS} faults of: {} (a run of 30 minutes or more should \
             reach it)",
            short.join(", ")
        );
    }
    let labelled: Vec<(&Report, String)> = reports.iter().map(|(r, s)| (r, s.clone())).collect();
    assert_clean(&labelled);
}

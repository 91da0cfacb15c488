//! Fault-injection checker ("our own Jepsen"): real hubs behind nginx on a real Redis or NATS,
//! devices that follow the client contract, sequential producers, and faults from a seeded
//! schedule; then a pure checker ([`checker::check`]) compares what every device processed with
//! what the producers were told. The promise it checks: every event of a device once and in
//! order, or an explicit `resync` before anything after the gap.
//!
//! - `short_run_redis`, `short_run_nats`: fixed seeds, about 40 s and 25 s (a quiet period of
//!   up to 10 s more when devices miss events); they assert that there is no violation. Run
//!   both with `cargo test --test chaos short_run -- --nocapture` (they take turns).
//! - `long_run` (ignored): `POSTHORN_CHAOS_MINUTES` (default 10), `POSTHORN_CHAOS_SEED`
//!   (default: drawn from the clock), `POSTHORN_CHAOS_BACKEND` (`redis`, `nats` or `both`,
//!   the default, which splits the minutes):
//!   `POSTHORN_CHAOS_MINUTES=30 cargo test --test chaos long_run -- --ignored --nocapture`.
//!
//! Each run prints a human summary (per fault kind: faults injected, resyncs seen after it,
//! events checked, violations by kind; then each violation with the device's history around
//! it) and one JSON line starting with `{"chaos":`. A seed replays the same schedule, device
//! behaviours and publishing pattern; process timing differs from run to run. A run with
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

use std::sync::Mutex;
use std::time::Duration;

use faults::BackendKind;
use scenario::{Plan, RunResult};

const SHORT_REDIS_SEED: u64 = 0x00c4_a05e_0001;
const SHORT_NATS_SEED: u64 = 0x00c4_a05e_0002;

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

fn assert_clean(results: &[(&RunResult, String)]) {
    let failing: Vec<String> = results
        .iter()
        .filter(|(r, _)| !r.report.is_clean())
        .map(|(r, replay)| {
            format!(
                "{} seed {}: {} violations {:?}; replay: {replay}",
                r.report.backend,
                r.report.seed,
                r.report.violations.len(),
                r.report.violation_counts()
            )
        })
        .collect();
    assert!(
        failing.is_empty(),
        "the chaos run found violations of the delivery promise:\n{}",
        failing.join("\n")
    );
}

#[test]
fn short_run_redis() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let plan = Plan::new(
        BackendKind::Redis,
        SHORT_REDIS_SEED,
        Duration::from_secs(40),
    );
    let result = execute(&plan);
    assert_clean(&[(
        &result,
        "cargo test --test chaos short_run_redis -- --nocapture".into(),
    )]);
}

#[test]
fn short_run_nats() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let plan = Plan::new(BackendKind::Nats, SHORT_NATS_SEED, Duration::from_secs(22));
    let result = execute(&plan);
    assert_clean(&[(
        &result,
        "cargo test --test chaos short_run_nats -- --nocapture".into(),
    )]);
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
    let which = std::env::var("POSTHORN_CHAOS_BACKEND").unwrap_or_else(|_| "both".into());
    let backends = match which.as_str() {
        "redis" => vec![BackendKind::Redis],
        "nats" => vec![BackendKind::Nats],
        "both" => vec![BackendKind::Redis, BackendKind::Nats],
        other => panic!("POSTHORN_CHAOS_BACKEND must be redis, nats or both, not {other:?}"),
    };
    let chaos = Duration::from_secs_f64(minutes * 60.0 / backends.len() as f64);
    println!("long chaos run: seed {seed}, {minutes} minutes, backends {which}");
    let replay = format!(
        "POSTHORN_CHAOS_SEED={seed} POSTHORN_CHAOS_MINUTES={minutes} POSTHORN_CHAOS_BACKEND={which} \
         cargo test --test chaos long_run -- --ignored --nocapture"
    );
    let results: Vec<RunResult> = backends
        .into_iter()
        .map(|backend| execute(&Plan::new(backend, seed, chaos)))
        .collect();
    let labelled: Vec<(&RunResult, String)> = results.iter().map(|r| (r, replay.clone())).collect();
    assert_clean(&labelled);
}

//! The Grafana dashboard (deploy/grafana/posthorn.json) and the alert rules
//! (deploy/prometheus/alerts.yml) against a real Prometheus scraping a real hub under a short
//! load: every query of every panel must return data, and every rule must evaluate cleanly.
//!
//! "Returns data" means a non-empty result with at least one sample that is a number: a series
//! at 0 counts (the rate of a counter nothing increased, e.g. `publish_events_total{result=
//! "failed"}`, is exactly what a quiet panel shows), NaN does not (a quantile of a histogram
//! without observations in the window draws nothing). The load is chosen so that the histograms
//! have observations: deliveries, a replay after a Last-Event-ID, evictions of clients that never
//! read (`posthorn loadtest slow`) and a `resync`.

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;
use tokio::time::Instant;

use support::prometheus::Prometheus;
use support::sse::resync_reason;
use support::{Hub, SseClient};

const BIN: &str = env!("CARGO_BIN_EXE_posthorn");
const LOADTEST_WAIT: Duration = Duration::from_secs(120);
/// How long every query together may take to return data: the first scrapes after the load need
/// a second or two, and the rules' first evaluation as long.
const DATA_WAIT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_secs(1);
/// Until Prometheus' first scrape of the hub: seconds after it is ready.
const SCRAPE_WAIT: Duration = Duration::from_secs(30);
const EVENT_WAIT: Duration = Duration::from_secs(10);
/// What `$__rate_interval` becomes. Grafana makes it at least four scrape intervals; a minute
/// covers the whole load of this test whenever the queries run within the wait above.
const RATE_INTERVAL: &str = "1m";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_and_every_alert_rule_evaluates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules_path = root.join("deploy/prometheus/alerts.yml");
    let exprs = dashboard_exprs(&root.join("deploy/grafana/posthorn.json"));

    // A small socket buffer and a short stall timeout evict clients that never read within
    // seconds (as in tests/loadtest.rs), so the eviction panels have something to show.
    let hub = Hub::builder()
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .env("POSTHORN_SSE__STALL_TIMEOUT", "1s")
        .start()
        .await;
    let prometheus = Prometheus::start(&[hub.addr()], &[&rules_path]).await;
    prometheus.wait_scraped(hub.addr(), SCRAPE_WAIT).await;

    // Kept open while the queries run, so the hub has a stream.
    let _resumed = resume_and_resync(&hub).await;
    loadtest_slow(&hub).await;

    let instance = hub.addr().to_string();
    let mut pending: Vec<(String, String)> = exprs
        .iter()
        .map(|(panel, expr)| (panel.clone(), substitute(expr, &instance)))
        .collect();
    let total = pending.len();
    let deadline = Instant::now() + DATA_WAIT;
    let mut last_results = Vec::new();
    loop {
        let mut still = Vec::new();
        last_results.clear();
        for (panel, expr) in pending {
            let result = prometheus.query(&expr).await;
            if !has_data(&result) {
                last_results.push(format!("  [{panel}] {expr}\n    -> {result}"));
                still.push((panel, expr));
            }
        }
        pending = still;
        if pending.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    assert!(
        pending.is_empty(),
        "{} of {total} dashboard queries returned no data within {DATA_WAIT:?}:\n{}",
        pending.len(),
        last_results.join("\n")
    );
    eprintln!("{total} dashboard queries returned data");

    let rule_count = std::fs::read_to_string(&rules_path)
        .expect("read alerts.yml")
        .lines()
        .filter(|line| line.trim_start().starts_with("- alert:"))
        .count();
    assert!(rule_count > 0, "no alerts in {}", rules_path.display());
    wait_rules_ok(&prometheus, rule_count).await;
    eprintln!("{rule_count} alert rules evaluated with health ok");
}

/// Every `targets[].expr` of every panel (rows' nested panels included), with its panel's title.
/// Panics if a panel that is not a row has no query: it would show nothing.
fn dashboard_exprs(path: &Path) -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let dashboard: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut exprs = Vec::new();
    collect_exprs(&dashboard["panels"], &mut exprs);
    assert!(!exprs.is_empty(), "no queries in {}", path.display());
    exprs
}

fn collect_exprs(panels: &Value, out: &mut Vec<(String, String)>) {
    for panel in panels.as_array().into_iter().flatten() {
        let title = panel["title"].as_str().unwrap_or("(untitled)").to_string();
        if panel["type"] == "row" {
            collect_exprs(&panel["panels"], out);
            continue;
        }
        let targets = panel["targets"].as_array().cloned().unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for target in targets {
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a target without expr: {target}"));
            out.push((title.clone(), expr.to_string()));
        }
    }
}

/// Replaces the Grafana variables the dashboard uses; panics on any other, which Prometheus
/// would reject or, worse, read as something else.
fn substitute(expr: &str, instance: &str) -> String {
    let out = expr
        .replace("${__rate_interval}", RATE_INTERVAL)
        .replace("$__rate_interval", RATE_INTERVAL)
        .replace("${instance}", instance)
        .replace("$instance", instance);
    let leftover = out.match_indices('$').find(|(i, _)| {
        out[i + 1..]
            .chars()
            .next()
            .is_some_and(|c| c == '{' || c == '_' || c.is_ascii_alphabetic())
    });
    assert!(
        leftover.is_none(),
        "unknown Grafana variable in {expr:?} (after substitution: {out:?})"
    );
    out
}

/// A non-empty vector with at least one sample that is a number (not NaN).
fn has_data(result: &Value) -> bool {
    result.as_array().is_some_and(|series| {
        series.iter().any(|s| {
            s["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| !v.is_nan())
        })
    })
}

/// A device gets five events, resumes after the first (a replay of four), and another stream
/// sends a cursor that is no cursor (a `resync` invalid). Returns the resumed stream.
async fn resume_and_resync(hub: &Hub) -> SseClient {
    let device = "prom-resume-1";
    let mut live = support::live_stream(hub, device).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(support::publish_to(hub, device, &format!("event {i}")).await);
    }
    let received = live.expect_events(5, EVENT_WAIT).await;
    let received: Vec<String> = received.into_iter().filter_map(|e| e.id).collect();
    assert_eq!(received, ids);
    drop(live);

    let path = support::stream_path(device);
    let mut resumed = SseClient::connect(hub.addr(), &path, &[("Last-Event-ID", &ids[0])]).await;
    assert_eq!(resumed.status(), 200);
    let replayed: Vec<String> = resumed
        .expect_events(4, EVENT_WAIT)
        .await
        .into_iter()
        .filter_map(|e| e.id)
        .collect();
    assert_eq!(replayed, ids[1..]);

    let mut invalid = SseClient::connect(
        hub.addr(),
        &support::stream_path("prom-resume-2"),
        &[("Last-Event-ID", "not-a-cursor")],
    )
    .await;
    assert_eq!(invalid.status(), 200);
    assert_eq!(
        resync_reason(&invalid.expect_event(EVENT_WAIT).await),
        "invalid"
    );
    resumed
}

/// `posthorn loadtest slow`: 20 streams, a quarter of which never read, 50 events/s of 2 KB for
/// 4 s (as tests/loadtest.rs proves, every never-reading client is evicted); asserts evictions.
async fn loadtest_slow(hub: &Hub) {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "loadtest",
        "slow",
        "--url",
        &hub.base_url(),
        "-n",
        "20",
        "--slow-fraction",
        "0.25",
        "--rate",
        "50",
        "--size",
        "2048",
        "--duration",
        "4s",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let output = tokio::time::timeout(LOADTEST_WAIT, cmd.output())
        .await
        .expect("loadtest within its bound")
        .expect("run loadtest");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let text = format!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "loadtest slow failed: {text}");
    let report: Value = stdout
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON line: {text}"));
    assert!(
        report["evicted"].as_u64().is_some_and(|n| n > 0),
        "no client evicted: {report}"
    );
}

/// Polls `/api/v1/rules` until all `expected` alerting rules were evaluated with health "ok";
/// panics at once on a rule with an error, or after the wait with what it saw.
async fn wait_rules_ok(prometheus: &Prometheus, expected: usize) {
    let deadline = Instant::now() + DATA_WAIT;
    loop {
        let data = prometheus.api("/api/v1/rules?type=alert").await;
        let rules: Vec<&Value> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|group| group["rules"].as_array().into_iter().flatten())
            .collect();
        for rule in &rules {
            assert_ne!(rule["health"], "err", "rule failed: {rule}");
        }
        let ok = rules.iter().filter(|rule| rule["health"] == "ok").count();
        if rules.len() == expected && ok == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{ok} of {} loaded rules healthy, {expected} expected, after {DATA_WAIT:?}: {data}",
            rules.len()
        );
        tokio::time::sleep(POLL).await;
    }
}

//! `posthorn loadtest` against a real hub (docs/BENCHMARKS.md, "The load tool"): each scenario runs small and bounded, and its
//! JSON line must add up exactly — every delivery counted, evictions seen, the drain measured.
//! The figures themselves are benchmarks (docs/BENCHMARKS.md), never asserted here.

mod support;

use std::{process::Stdio, time::Duration};

use serde_json::Value;
use tokio::process::Command;

use support::Hub;

const BIN: &str = env!("CARGO_BIN_EXE_posthorn");
const WAIT: Duration = Duration::from_secs(120);
const EX_USAGE: i32 = 64;

/// Runs `posthorn loadtest ARGS`; returns exit code, the last stdout line as JSON (if any), and
/// the whole output for messages.
async fn loadtest(args: &[&str]) -> (i32, Option<Value>, String) {
    let mut cmd = Command::new(BIN);
    cmd.arg("loadtest")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let output = tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("loadtest within its bound")
        .expect("run loadtest");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let text = format!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let json = stdout
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok());
    (output.status.code().unwrap_or(-1), json, text)
}

async fn run_ok(args: &[&str]) -> Value {
    let (code, json, text) = loadtest(args).await;
    assert_eq!(code, 0, "{text}");
    json.unwrap_or_else(|| panic!("no JSON line: {text}"))
}

fn u(value: &Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("not a count: {value}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unicast_and_broadcast_fanout_count_every_delivery() {
    let hub = Hub::builder().start().await;
    let url = hub.base_url();
    let pid = hub.pid().to_string();
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "40",
        "--mode",
        "unicast",
        "--rate",
        "400",
        "--duration",
        "2s",
        "--size",
        "120",
        "--pid",
        &pid,
    ])
    .await;
    assert_eq!(report["lossless"], true, "{report}");
    let deliveries = &report["deliveries"];
    assert_eq!(u(&deliveries["expected"]), 800, "{report}");
    assert_eq!(u(&deliveries["distinct"]), 800);
    assert_eq!(u(&deliveries["received"]), 800);
    assert_eq!(u(&report["latency"]["samples"]), 800);
    assert!(report["cpu"]["tool_percent"].as_f64().is_some());
    assert!(report["cpu"]["server_percent"].as_f64().is_some());

    let plot = support::unique_temp_dir("loadtest-plot").join("cdf.svg");
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "25",
        "--mode",
        "broadcast",
        "--rate",
        "20",
        "--duration",
        "1s",
        "--plot",
        plot.to_str().unwrap(),
    ])
    .await;
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(u(&report["deliveries"]["expected"]), 25 * 20);
    assert_eq!(u(&report["deliveries"]["distinct"]), 25 * 20);
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    assert!(svg.starts_with("<svg") && svg.contains("polyline"));
}

/// Group events reach the ten members of their group each (`--groups 1`, `--mode group`), and
/// a publisher that sits idle longer than the server's keep-alive (actix-web: 5 s) publishes
/// again on a fresh connection: broadcasts 6.7 s apart, as the group fan-out benchmark sends
/// them at its lowest rate, failed with "closed before the response head".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_events_and_a_publisher_idle_past_the_keep_alive() {
    let hub = Hub::builder().start().await;
    let url = hub.base_url();
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "40",
        "--groups",
        "1",
        "--mode",
        "group",
        "--rate",
        "20",
        "--duration",
        "1s",
    ])
    .await;
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(report["mode"], "group", "{report}");
    assert_eq!(u(&report["group_count"]), 4, "{report}");
    assert_eq!(u(&report["deliveries"]["expected"]), 20 * 10, "{report}");
    assert_eq!(u(&report["deliveries"]["distinct"]), 20 * 10, "{report}");
    assert_eq!(u(&report["deliveries"]["misrouted"]), 0, "{report}");

    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "5",
        "--mode",
        "broadcast",
        "--rate",
        "0.15",
        "--duration",
        "14s",
        "--settle",
        "1s",
    ])
    .await;
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(u(&report["published"]["events"]), 2, "{report}");
    assert_eq!(u(&report["deliveries"]["distinct"]), 2 * 5, "{report}");
}

/// Against a hub with jwt auth the tool signs a token per device and one for its publishes: a
/// storm and a fanout run through it with every stream and publish accepted; without tokens the
/// same hub refuses the streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_open_the_streams_of_a_jwt_hub() {
    const SECRET: &str = "loadtest-token-secret";
    let hub = Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .start()
        .await;
    let url = hub.base_url();
    let report = run_ok(&[
        "storm",
        "--url",
        &url,
        "-n",
        "30",
        "--pause",
        "200ms",
        "--token-secret",
        SECRET,
    ])
    .await;
    assert_eq!(u(&report["accepted"]), 30, "{report}");
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "10",
        "--mode",
        "unicast",
        "--rate",
        "100",
        "--duration",
        "1s",
        "--token-secret",
        SECRET,
    ])
    .await;
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(u(&report["deliveries"]["distinct"]), 100, "{report}");
    let (code, _, text) = loadtest(&["storm", "--url", &url, "-n", "5", "--pause", "200ms"]).await;
    assert_ne!(code, 0, "streams without tokens are refused: {text}");
    assert!(text.contains("status 401"), "{text}");
}

/// `--events-per-request 1` publishes every event in a request of its own (one object, the
/// requests pipelined): the hub answers one publish per event and every delivery still arrives
/// once. The option is refused where it means nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_can_be_published_one_per_request() {
    let hub = Hub::builder().start().await;
    let url = hub.base_url();
    let publishes = || async {
        support::metrics::scrape(hub.addr())
            .await
            .value_or_zero("publish_duration_seconds_count", &[])
    };
    let before = publishes().await;
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "20",
        "--mode",
        "unicast",
        "--rate",
        "200",
        "--duration",
        "1s",
        "--events-per-request",
        "1",
    ])
    .await;
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(u(&report["deliveries"]["distinct"]), 200, "{report}");
    assert_eq!(publishes().await - before, 200.0, "one request per event");

    let before = publishes().await;
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "20",
        "--mode",
        "unicast",
        "--rate",
        "200",
        "--duration",
        "1s",
    ])
    .await;
    assert_eq!(u(&report["deliveries"]["distinct"]), 200, "{report}");
    let batched = publishes().await - before;
    assert!(
        batched < 200.0,
        "by default the due events share a request: {batched}"
    );

    for refused in [
        &["--events-per-request", "0"][..],
        &["--events-per-request", "1001"],
        &["--events-per-request", "1", "--peer", "nchan"],
    ] {
        let mut args = vec!["fanout", "--url", &url, "-n", "1", "--duration", "1s"];
        args.extend_from_slice(refused);
        let (code, _, text) = loadtest(&args).await;
        assert_eq!(code, EX_USAGE, "{refused:?}: {text}");
        assert!(text.contains("--events-per-request"), "{text}");
    }
}

/// The accounting is exact: events appended to the hub's log while the tool publishes are not
/// mistaken for its own, and a device the hub routes wrongly would count as misrouted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_events_are_not_counted_as_deliveries() {
    let hub = Hub::builder().start().await;
    let url = hub.base_url();
    let publisher = {
        let addr = hub.addr();
        tokio::spawn(async move {
            for _ in 0..20 {
                support::http::post_json(
                    addr,
                    "/v1/events",
                    &serde_json::json!({ "broadcast": true, "data": "not a load-test payload" }),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "-n",
        "10",
        "--mode",
        "unicast",
        "--rate",
        "100",
        "--duration",
        "2s",
    ])
    .await;
    publisher.await.unwrap();
    assert_eq!(report["lossless"], true, "{report}");
    assert_eq!(u(&report["deliveries"]["distinct"]), 200);
    assert_eq!(u(&report["deliveries"]["misrouted"]), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_scenario_sees_every_never_reading_client_evicted() {
    let hub = Hub::builder()
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .env("POSTHORN_SSE__STALL_TIMEOUT", "1s")
        .start()
        .await;
    let report = run_ok(&[
        "slow",
        "--url",
        &hub.base_url(),
        "-n",
        "40",
        "--slow-fraction",
        "0.25",
        "--rate",
        "50",
        "--size",
        "2048",
        "--duration",
        "4s",
        "--pid",
        &hub.pid().to_string(),
    ])
    .await;
    assert_eq!(u(&report["slow_connections"]), 10, "{report}");
    assert_eq!(u(&report["evicted"]), 10, "{report}");
    assert_eq!(report["healthy_lossless"], true, "{report}");
    assert_eq!(u(&report["healthy"]["distinct"]), 30 * 200);
    assert!(u(&report["memory_peak"]["rss_kib"]) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_storm_and_drain_scenarios_report_what_happened() {
    let hub = Hub::builder().start().await;
    let url = hub.base_url();
    let pid = hub.pid().to_string();
    let report = run_ok(&[
        "idle", "--url", &url, "-n", "30", "--fill", "5", "--settle", "500ms", "--pid", &pid,
    ])
    .await;
    assert!(
        report["bytes_per_connection"].as_f64().is_some(),
        "{report}"
    );
    assert!(report["bytes_per_connection_full"].as_f64().is_some());
    assert_eq!(u(&report["open_after_fill"]), 30);

    let report = run_ok(&["storm", "--url", &url, "-n", "60", "--pause", "500ms"]).await;
    assert_eq!(u(&report["accepted"]), 60, "{report}");
    assert!(report["failures"].as_object().unwrap().is_empty());
    drop(hub);

    let mut hub = Hub::builder()
        .env("POSTHORN_DRAIN__GRACE", "6s")
        .env("POSTHORN_DRAIN__RETRY_MIN", "1s")
        .env("POSTHORN_DRAIN__RETRY_MAX", "5s")
        .start()
        .await;
    let report = run_ok(&[
        "drain",
        "--url",
        &hub.base_url(),
        "-n",
        "30",
        "--pid",
        &hub.pid().to_string(),
    ])
    .await;
    assert_eq!(u(&report["closed"]), 30, "{report}");
    assert_eq!(u(&report["retries"]), 30, "every client got a drain retry");
    let (low, high) = (
        report["retry_min_s"].as_f64().unwrap(),
        report["retry_max_s"].as_f64().unwrap(),
    );
    assert!(
        (1.0..=5.0).contains(&low) && (1.0..=5.0).contains(&high),
        "{report}"
    );
    assert!(report["exit_s"].as_f64().is_some(), "{report}");
    assert!(hub.wait_exit(Duration::from_secs(10)).await.is_some());
}

/// Over TLS (`docs/BENCHMARKS.md`, "TLS reconnect storm"): against an HTTPS hub the storm, a
/// broadcast fan-out and the idle scenario connect with TLS trusting `--ca-file`, the storm
/// reports what its handshakes negotiated, and a CA the hub's certificate does not come from
/// fails every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_run_over_tls() {
    let mut pki = support::tls::TestPki::new("loadtest CA");
    let hub = Hub::builder()
        .https(&pki.server_cert(), pki.ca_file())
        .start()
        .await;
    let url = hub.base_url();
    let ca = pki.ca_file().to_str().unwrap().to_string();
    let report = run_ok(&[
        "storm",
        "--url",
        &url,
        "--ca-file",
        &ca,
        "-n",
        "40",
        "--pause",
        "500ms",
    ])
    .await;
    assert_eq!(u(&report["accepted"]), 40, "{report}");
    assert!(
        report["tls"]
            .as_str()
            .is_some_and(|tls| tls.starts_with("TLSv1_3")),
        "{report}"
    );
    let report = run_ok(&[
        "fanout",
        "--url",
        &url,
        "--ca-file",
        &ca,
        "-n",
        "20",
        "--mode",
        "broadcast",
        "--rate",
        "5",
        "--duration",
        "2s",
    ])
    .await;
    assert_eq!(u(&report["deliveries"]["lost"]), 0, "{report}");
    assert!(u(&report["deliveries"]["distinct"]) > 0, "{report}");
    let report = run_ok(&[
        "idle",
        "--url",
        &url,
        "--ca-file",
        &ca,
        "-n",
        "20",
        "--settle",
        "500ms",
    ])
    .await;
    assert!(
        report["bytes_per_connection"].as_f64().is_some(),
        "{report}"
    );

    let stranger = support::tls::TestPki::new("another CA");
    let (code, _, text) = loadtest(&[
        "storm",
        "--url",
        &url,
        "--ca-file",
        stranger.ca_file().to_str().unwrap(),
        "-n",
        "5",
        "--pause",
        "100ms",
    ])
    .await;
    assert_ne!(code, 0, "{text}");
    assert!(text.contains("certificate"), "{text}");
}

/// `resume`: clients take a cursor, events are published while they are away, then all come
/// back at once; the report counts every replayed delivery, and the hub's replay counters are
/// read (here every entry of the memory log is read once per replay page it is in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_scenario_counts_every_replayed_delivery() {
    let hub = Hub::builder().start().await;
    let url = hub.base_url();
    let report = run_ok(&[
        "resume",
        "--url",
        &url,
        "-n",
        "40",
        "--rate",
        "400",
        "--away",
        "1s",
        "--time-limit",
        "60s",
    ])
    .await;
    assert_eq!(report["scenario"], "resume");
    assert_eq!(u(&report["caught_up"]), 40, "{report}");
    assert_eq!(u(&report["totals"]["expected"]), 400);
    assert_eq!(u(&report["totals"]["lost"]), 0, "{report}");
    assert_eq!(u(&report["totals"]["duplicates"]), 0, "{report}");
    assert_eq!(report["replayed_events"].as_f64(), Some(400.0), "{report}");
    let per_event = report["entries_read_per_delivered_event"]
        .as_f64()
        .unwrap_or_else(|| panic!("{report}"));
    assert!(per_event <= 2.0, "{report}");
}

#[tokio::test]
async fn remote_targets_and_unbounded_runs_are_refused() {
    let (code, _, text) = loadtest(&["idle", "--url", "http://10.0.0.1:8080", "-n", "1"]).await;
    assert_eq!(code, EX_USAGE, "{text}");
    assert!(text.contains("--allow-remote"), "{text}");
    let (code, _, text) = loadtest(&[
        "fanout",
        "--url",
        "http://127.0.0.1:9",
        "--rate",
        "1000000",
        "--duration",
        "1000s",
    ])
    .await;
    assert_eq!(code, EX_USAGE, "{text}");
    assert!(text.contains("bound"), "{text}");
}

/// `posthorn loadtest plan` prints the capacity plan of docs/capacity.md's worked example, and
/// its JSON has the figures the page quotes; bad input is a usage error (64).
#[tokio::test]
async fn the_capacity_plan_of_the_docs() {
    let output = Command::new(BIN)
        .args([
            "loadtest",
            "plan",
            "--devices",
            "50000",
            "--unicast-rate",
            "1000",
            "--broadcast-rate",
            "1",
            "--size",
            "256",
        ])
        .output()
        .await
        .expect("run posthorn loadtest plan");
    assert_eq!(output.status.code(), Some(0));
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/capacity.md"))
        .expect("docs/capacity.md");
    for line in printed
        .lines()
        .filter(|line| line.starts_with(|first: char| "pdmCeib".contains(first)))
    {
        assert!(doc.contains(line), "docs/capacity.md lacks {line:?}");
    }
    let output = Command::new(BIN)
        .args(["loadtest", "plan", "--devices", "0"])
        .output()
        .await
        .expect("run posthorn loadtest plan");
    assert_eq!(output.status.code(), Some(64));
}

//! A real Prometheus server scraping hubs, to run the dashboard's queries and the alert rules
//! (deploy/grafana/, deploy/prometheus/) against what a hub actually exports.
//!
//! Each server runs `prometheus` from a fresh temporary directory holding its `prometheus.yml`,
//! its TSDB and its log, listening on a free loopback port, so it never touches a system
//! Prometheus (Debian's package may run one on :9090) or its data. It scrapes and evaluates
//! rules every second. Dropping it sends SIGTERM, SIGKILLs it if that takes too long, reaps it,
//! prints its log if the test is panicking, and removes the directory (kept with
//! `POSTHORN_TEST_KEEP_LOGS` set).

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use super::{free_port, http};

const BIN: &str = "prometheus";
/// Start-up replays an empty WAL and loads the rules: a second or two, slower on a busy machine.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const READY_POLL: Duration = Duration::from_millis(100);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long Drop waits after SIGTERM (Prometheus closes its TSDB) before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
const EXIT_POLL: Duration = Duration::from_millis(10);
const LOG_TAIL_BYTES: usize = 32 * 1024;
/// Attempts when the port from [`free_port`] was taken in the meantime.
const PORT_ATTEMPTS: usize = 3;
const KEEP_LOGS_VAR: &str = "POSTHORN_TEST_KEEP_LOGS";
/// The scrape job of the hubs, as deploy/prometheus/alerts.yml expects it.
pub const JOB: &str = "posthorn";

/// A running Prometheus on `http://127.0.0.1:PORT/`, scraping its targets as job [`JOB`] every
/// second. Dropping it stops and reaps it.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
    /// Cached once reaped: after that the pid may belong to someone else.
    exit: Option<ExitStatus>,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (hubs' `GET /metrics`) with `rule_files` loaded, and
    /// waits until it is ready; panics (with its log) if it exits first or is not ready in time.
    pub async fn start(targets: &[SocketAddr], rule_files: &[&Path]) -> Prometheus {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut server = Self::spawn(targets, rule_files, free_port());
            match server.wait_ready().await {
                Ok(()) => return server,
                Err(status) => {
                    if server.log().contains("address already in use") && attempt < PORT_ATTEMPTS {
                        continue;
                    }
                    // Drop prints the log while this panic unwinds.
                    panic!(
                        "prometheus exited before becoming ready on {} ({status})",
                        server.addr
                    );
                }
            }
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Working directory: `prometheus.yml`, `data/`, `prometheus.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Everything Prometheus logged so far (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read(self.dir.join("prometheus.log"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// `GET path` on the HTTP API; panics unless it answers 200 with `"status": "success"`.
    /// Returns the `data` member.
    pub async fn api(&self, path: &str) -> Value {
        let response = http::get(self.addr, path).await;
        let body = response.text();
        assert_eq!(response.status, 200, "GET {path}: {body}");
        let json: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"));
        assert_eq!(json["status"], "success", "GET {path}: {body}");
        json["data"].clone()
    }

    /// An instant query at the current time (`/api/v1/query`); the result vector (or scalar).
    pub async fn query(&self, expr: &str) -> Value {
        let data = self
            .api(&format!("/api/v1/query?query={}", url_encode(expr)))
            .await;
        data["result"].clone()
    }

    /// Waits until a scrape of `target` succeeded (`up` is 1). Ready is not scraped: the first
    /// scrape comes up to a few seconds later, and a counter's first sample is its baseline, so
    /// what happens before it never shows in a `rate()`. Panics after `timeout`.
    pub async fn wait_scraped(&self, target: SocketAddr, timeout: Duration) {
        let expr = format!("up{{job=\"{JOB}\", instance=\"{target}\"}} == 1");
        let deadline = Instant::now() + timeout;
        loop {
            let result = self.query(&expr).await;
            if result.as_array().is_some_and(|series| !series.is_empty()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus on {} has not scraped {target} within {timeout:?}: {}",
                self.addr,
                self.query(&format!("up{{instance=\"{target}\"}}")).await
            );
            tokio::time::sleep(READY_POLL).await;
        }
    }

    fn spawn(targets: &[SocketAddr], rule_files: &[&Path], port: u16) -> Prometheus {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let dir = super::unique_temp_dir("prometheus");
        let conf = dir.join("prometheus.yml");
        std::fs::write(&conf, config(targets, rule_files))
            .unwrap_or_else(|e| panic!("write {}: {e}", conf.display()));
        let log_path = dir.join("prometheus.log");
        let log = File::create(&log_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", log_path.display()));
        let log_dup = log.try_clone().expect("clone log file handle");
        let child = Command::new(binary())
            .arg(format!("--config.file={}", conf.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log_dup)
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {BIN}: {e}"));
        Prometheus {
            child,
            addr,
            dir,
            exit: None,
        }
    }

    /// Polls `/-/ready` until it answers 200; `Err` with the exit status if the process exits
    /// first.
    async fn wait_ready(&mut self) -> Result<(), ExitStatus> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.try_exit_status() {
                return Err(status);
            }
            let probe =
                http::try_request(self.addr, "GET", "/-/ready", &[], None, PROBE_TIMEOUT).await;
            let last = match probe {
                Ok(response) if response.status == 200 => return Ok(()),
                Ok(response) => format!("{} {}", response.status, response.text()),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "prometheus not ready on {} after {READY_TIMEOUT:?} (last probe: {last})",
                    self.addr
                );
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    fn try_exit_status(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait on prometheus");
        }
        self.exit
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]; always reaps. No-op once it has exited.
    fn stop(&mut self) {
        if self.try_exit_status().is_some() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-s", "TERM", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        while std::time::Instant::now() < deadline {
            if self.try_exit_status().is_some() {
                return;
            }
            std::thread::sleep(EXIT_POLL);
        }
        self.kill();
    }

    fn kill(&mut self) {
        if self.try_exit_status().is_some() {
            return;
        }
        let _ = self.child.kill();
        self.exit = self.child.wait().ok();
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            let log = self.log();
            let tail =
                &log[super::floor_char_boundary(&log, log.len().saturating_sub(LOG_TAIL_BYTES))..];
            let exit = self
                .exit
                .map_or_else(|| "unknown".to_string(), |s| s.to_string());
            eprintln!(
                "--- prometheus {} log {} (pid {}, {exit}) ---\n{tail}\n--- end of prometheus log ---",
                self.addr,
                self.dir.display(),
                self.child.id(),
            );
        }
        if std::env::var_os(KEEP_LOGS_VAR).is_some() {
            eprintln!("prometheus directory kept at {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The whole configuration: one job scraping every target each second, rules evaluated each
/// second. Targets are labelled `instance="127.0.0.1:PORT"`, as Prometheus does by default.
fn config(targets: &[SocketAddr], rule_files: &[&Path]) -> String {
    let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
    let rules: String = rule_files
        .iter()
        .map(|path| format!("  - \"{}\"\n", path.display()))
        .collect();
    format!(
        "global:\n\
         \x20 scrape_interval: 1s\n\
         \x20 scrape_timeout: 1s\n\
         \x20 evaluation_interval: 1s\n\
         rule_files:\n\
         {rules}\
         scrape_configs:\n\
         \x20 - job_name: {JOB}\n\
         \x20   static_configs:\n\
         \x20     - targets: [{}]\n",
        targets.join(", ")
    )
}

/// Percent-encodes everything but RFC 3986's unreserved characters, for a query parameter.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for byte in s.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Resolves `prometheus` on PATH or in /usr/bin. A missing binary is a panic: a dashboard test
/// that passes without Prometheus proves nothing.
fn binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join(BIN))
        .find(|candidate| candidate.is_file());
    match found {
        Some(path) => path,
        None => panic!(
            "{BIN} not found on PATH or in /usr/bin; install the Debian package prometheus \
             (scripts/test does it)"
        ),
    }
}

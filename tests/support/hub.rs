//! Starts and controls the `posthorn` binary under test: builder for env
//! and arguments, readiness wait on `/healthz`, signals, exit status, RSS,
//! and a log file that is shown when a test panics.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{free_port, http};

const BIN: &str = env!("CARGO_BIN_EXE_posthorn");
const READY_TIMEOUT: Duration = Duration::from_secs(20);
const READY_POLL: Duration = Duration::from_millis(20);
const EXIT_POLL: Duration = Duration::from_millis(10);
/// How much of the log to echo when a test panics; the tail is where the
/// reason usually is.
const LOG_TAIL_BYTES: usize = 32 * 1024;
/// Attempts when the port from [`free_port`] was taken in the meantime.
const PORT_ATTEMPTS: usize = 3;
const KEEP_LOGS_VAR: &str = "POSTHORN_TEST_KEEP_LOGS";

/// The process exited before it became ready.
#[derive(Debug)]
pub struct EarlyExit {
    pub status: ExitStatus,
    /// Combined stdout and stderr.
    pub stderr: String,
}

impl EarlyExit {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

/// Configures a hub process. Arguments go after `serve --listen ADDR`.
#[derive(Debug, Clone)]
pub struct HubBuilder {
    envs: Vec<(String, String)>,
    args: Vec<OsString>,
    port: Option<u16>,
    ready_timeout: Duration,
    open_files_limit: Option<u64>,
    /// Serve HTTPS: readiness is probed over TLS trusting this CA file.
    https_ca: Option<PathBuf>,
}

impl HubBuilder {
    /// Serves HTTPS with `cert` (server.tls_cert_file / tls_key_file); the harness trusts
    /// `ca_file` to probe readiness.
    pub fn https(self, cert: &super::tls::CertFiles, ca_file: &Path) -> Self {
        let mut builder = self
            .env(
                "POSTHORN_SERVER__TLS_CERT_FILE",
                cert.cert.to_str().expect("utf-8 path"),
            )
            .env(
                "POSTHORN_SERVER__TLS_KEY_FILE",
                cert.key.to_str().expect("utf-8 path"),
            );
        builder.https_ca = Some(ca_file.to_path_buf());
        builder
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    /// Fixed port, e.g. to restart a hub on the address clients know.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// Hard and soft limit of open files for the hub process (it raises its soft limit to the
    /// hard one itself), to run it out of file descriptors on purpose.
    pub fn open_files_limit(mut self, limit: u64) -> Self {
        self.open_files_limit = Some(limit);
        self
    }

    /// Starts the hub and waits for `/healthz`; panics (with the log) if it
    /// exits or is not ready in time.
    pub async fn start(self) -> Hub {
        match self.try_start().await {
            Ok(hub) => hub,
            Err(exit) => panic!(
                "posthorn exited before becoming ready ({}):\n{}",
                exit.status, exit.stderr
            ),
        }
    }

    /// Like [`HubBuilder::start`] but returns the exit status and output if
    /// the process exits before it is ready (bad-configuration tests).
    pub async fn try_start(self) -> Result<Hub, EarlyExit> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let port = self.port.unwrap_or_else(free_port);
            let mut hub = self.spawn(port);
            match hub.wait_ready(self.ready_timeout).await {
                Ok(()) => return Ok(hub),
                Err(exit) => {
                    let port_race = exit.stderr.contains("Address already in use")
                        || exit.stderr.contains("os error 98");
                    if port_race && self.port.is_none() && attempt < PORT_ATTEMPTS {
                        continue;
                    }
                    return Err(exit);
                }
            }
        }
    }

    /// Runs the process without waiting for readiness until it exits;
    /// returns its exit code (`None` if killed by a signal, or if it was
    /// still running after `timeout` and had to be killed) and its output.
    pub async fn run_to_exit(self, timeout: Duration) -> (Option<i32>, String) {
        let mut hub = self.spawn(self.port.unwrap_or_else(free_port));
        let status = hub.wait_exit(timeout).await;
        if status.is_none() {
            hub.kill();
        }
        (status.and_then(|s| s.code()), hub.stderr_log())
    }

    fn spawn(&self, port: u16) -> Hub {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let log_path = unique_log_path(port);
        let log = File::create(&log_path)
            .unwrap_or_else(|e| panic!("create log file {}: {e}", log_path.display()));
        let log_dup = log.try_clone().expect("clone log file handle");

        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--listen")
            .arg(addr.to_string())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log_dup)
            .stderr(log);
        // The developer's shell may export POSTHORN_* settings (including
        // this harness's own POSTHORN_TEST_KEEP_LOGS, which the hub could
        // reject as an unknown section); tests must only see what they set.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("POSTHORN_") {
                cmd.env_remove(key);
            }
        }
        // Logs are the main clue when a test fails, so default to info.
        if !self.envs.iter().any(|(k, _)| k == "RUST_LOG") {
            cmd.env("RUST_LOG", "info");
        }
        cmd.envs(self.envs.iter().map(|(k, v)| (k, v)));
        if let Some(limit) = self.open_files_limit {
            let limit = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            // SAFETY: only `setrlimit`, which is async-signal-safe, runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }

        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {BIN}: {e}"));
        Hub {
            child,
            addr,
            log_path,
            exit: None,
            https_ca: self.https_ca.clone(),
        }
    }
}

fn unique_log_path(port: u16) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    std::env::temp_dir().join(format!(
        "posthorn-test-{}-{n}-{port}-{nanos}.log",
        std::process::id()
    ))
}

/// A running hub. Dropping it SIGKILLs and reaps the process.
#[derive(Debug)]
pub struct Hub {
    child: Child,
    addr: SocketAddr,
    log_path: PathBuf,
    /// Cached once reaped: after that the pid may belong to someone else,
    /// so it must never be signalled again.
    exit: Option<ExitStatus>,
    /// Set when the hub serves HTTPS: the CA its certificate comes from.
    https_ca: Option<PathBuf>,
}

impl Hub {
    pub fn builder() -> HubBuilder {
        HubBuilder {
            envs: Vec::new(),
            args: Vec::new(),
            port: None,
            ready_timeout: READY_TIMEOUT,
            open_files_limit: None,
            https_ca: None,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn base_url(&self) -> String {
        let scheme = if self.https_ca.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the process wrote so far (stderr and stdout interleaved).
    pub fn stderr_log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Polls the log for `needle`; true if it appears within `timeout`.
    pub async fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.stderr_log().contains(needle) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// Sends a signal by name ("TERM", "INT", "SIGHUP", ...) via kill(1),
    /// since libc is not available to tests.
    pub fn signal(&self, sig: &str) {
        assert!(
            self.exit.is_none(),
            "cannot send SIG{sig} to posthorn: it already exited ({:?})",
            self.exit
        );
        let sig = sig.strip_prefix("SIG").unwrap_or(sig);
        let status = Command::new("kill")
            .args(["-s", sig, &self.pid().to_string()])
            .status()
            .unwrap_or_else(|e| panic!("run kill(1): {e}"));
        assert!(
            status.success(),
            "kill -s {sig} {} failed: {status}",
            self.pid()
        );
    }

    /// Non-blocking: the exit status if the process has exited.
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait on posthorn");
        }
        self.exit
    }

    pub fn is_running(&mut self) -> bool {
        self.try_exit_status().is_none()
    }

    /// Waits up to `timeout` for the process to exit; `None` if it is
    /// still running.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit_status() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(EXIT_POLL).await;
        }
    }

    /// SIGKILL and reap (no-op if it already exited).
    pub fn kill(&mut self) {
        if self.try_exit_status().is_none() {
            let _ = self.child.kill();
            self.exit = self.child.wait().ok();
        }
    }

    /// Resident set size from /proc/PID/status.
    pub fn rss_bytes(&self) -> u64 {
        let path = format!("/proc/{}/status", self.pid());
        let status = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {path} (has posthorn exited?): {e}"));
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no VmRSS line in {path}"));
        kib * 1024
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), EarlyExit> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_exit_status() {
                return Err(EarlyExit {
                    status,
                    stderr: self.stderr_log(),
                });
            }
            let probe = match &self.https_ca {
                None => {
                    http::try_request(
                        self.addr,
                        "GET",
                        "/healthz",
                        &[],
                        None,
                        Duration::from_secs(1),
                    )
                    .await
                }
                Some(ca) => {
                    super::tls::try_https_request(
                        self.addr,
                        ca,
                        "GET",
                        "/healthz",
                        &[],
                        None,
                        Duration::from_secs(1),
                    )
                    .await
                }
            };
            if matches!(probe, Ok(ref r) if r.status == 200) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill();
                // Drop prints the log tail while this panic unwinds.
                panic!(
                    "posthorn not ready on {} after {timeout:?} (last probe: {probe:?})",
                    self.addr
                );
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = self.stderr_log();
            let tail =
                &log[super::floor_char_boundary(&log, log.len().saturating_sub(LOG_TAIL_BYTES))..];
            let exit = self
                .exit
                .map_or_else(|| "unknown".to_string(), |s| s.to_string());
            eprintln!(
                "--- posthorn log {} (pid {}, {exit}) ---\n{tail}\n--- end of posthorn log ---",
                self.log_path.display(),
                self.child.id(),
            );
        }
        if std::env::var_os(KEEP_LOGS_VAR).is_some() {
            eprintln!("posthorn log kept at {}", self.log_path.display());
        } else {
            let _ = std::fs::remove_file(&self.log_path);
        }
    }
}

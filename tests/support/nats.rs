//! A real `nats-server -js` for the JetStream backend tests: started on a free loopback port
//! with its own store directory, stopped (SIGTERM) or killed (SIGKILL), and started again on
//! the same port with the same store, so a test can take NATS away and bring it back with or
//! without its data.
//!
//! Each server runs from a fresh temporary directory holding its JetStream store (`store/`) and
//! `nats.log`; dropping it SIGKILLs and reaps the process, prints the log tail if the test is
//! panicking, and removes the directory (kept with `POSTHORN_TEST_KEEP_LOGS` set).
//!
//! The binary is `nats-server` on PATH, in /usr/sbin or in /usr/local/bin, or the file that
//! `POSTHORN_TEST_NATS_SERVER` names (which is then the only place looked at: setting it to a
//! path that does not exist shows what a machine without NATS does). A missing binary is always
//! a panic naming the Debian package: a NATS test that passes without NATS proves nothing.
//!
//! The nodes of a [`super::nats_cluster::NatsCluster`] are `NatsServer`s too, started from a
//! configuration file instead of flags; so is a server made by [`NatsServer::builder`] with TLS
//! (`tls {}`) or authentication (`authorization {}`, `accounts {}`, operator mode) configured.
//! Plain clients cannot probe those, so they count as ready once their log says "Server is
//! ready" (JetStream starts before the client port opens).

use std::fs::OpenOptions;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::free_port;
use super::tls::CertFiles;

const SERVER_BIN: &str = "nats-server";
/// Loading a store is fast on loopback; this only guards against a wedged process.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
const READY_POLL: Duration = Duration::from_millis(50);
/// How long a graceful stop may take before the server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const LOG_TAIL_BYTES: usize = 32 * 1024;
/// Attempts when a port from [`free_port`] was taken in the meantime.
const PORT_ATTEMPTS: usize = 3;
const KEEP_LOGS_VAR: &str = "POSTHORN_TEST_KEEP_LOGS";
/// Names the binary to run instead of looking for it.
const BINARY_VAR: &str = "POSTHORN_TEST_NATS_SERVER";
/// What nats-server logs once it accepts clients (after JetStream has started).
const READY_LINE: &str = "Server is ready";

/// A `nats-server -js` process. Dropping it SIGKILLs and reaps the process and removes its
/// directory.
#[derive(Debug)]
pub struct NatsServer {
    /// `None` while stopped.
    child: Option<Child>,
    binary: PathBuf,
    /// For the log banner in Drop, after the child is gone.
    last_exit: Option<ExitStatus>,
    last_pid: Option<u32>,
    port: u16,
    dir: PathBuf,
    /// `nats-server -c` this file instead of the standalone flags (cluster nodes, whose file
    /// sets the port and store directory).
    config: Option<PathBuf>,
    /// How readiness is seen: `None` probes with a plain client; `Some(n)` waits for more than
    /// `n` "Server is ready" lines in the log (servers that want TLS or credentials).
    ready_lines: Option<usize>,
}

/// A single `nats-server` with JetStream on loopback, configured from a file: TLS and
/// authentication blocks as a test writes them.
#[derive(Debug, Clone, Default)]
pub struct NatsServerBuilder {
    blocks: Vec<String>,
}

impl NatsServerBuilder {
    /// `tls {}`: the server presents `cert`, and with `verify` requires a client certificate
    /// signed by `ca_file` (mutual TLS). Every client must then speak TLS.
    pub fn tls(mut self, cert: &CertFiles, ca_file: &Path, verify: bool) -> Self {
        self.blocks.push(format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: {verify}\n  timeout: 5\n}}\n",
            cert.cert.display().to_string(),
            cert.key.display().to_string(),
            ca_file.display().to_string(),
        ));
        self
    }

    /// Configuration text added as written: `authorization {}`, `accounts {}`, `operator`,
    /// `resolver`, ...
    pub fn config(mut self, block: impl Into<String>) -> Self {
        self.blocks.push(block.into());
        self
    }

    /// Starts the server on a free port and waits until its log says it is ready; panics when
    /// `nats-server` is not installed.
    pub async fn start(self) -> NatsServer {
        let binary = binary();
        let dir = super::unique_temp_dir("nats");
        let mut server = NatsServer {
            child: None,
            binary,
            last_exit: None,
            last_pid: None,
            port: 0,
            config: Some(dir.join("nats.conf")),
            dir,
            ready_lines: Some(0),
        };
        for attempt in 1..=PORT_ATTEMPTS {
            server.port = free_port();
            let text = format!(
                "listen: \"127.0.0.1:{}\"\njetstream {{\n  store_dir: {:?}\n}}\n{}",
                server.port,
                server.dir.join("store").display().to_string(),
                self.blocks.join("\n")
            );
            let path = server.config.clone().expect("a configured server");
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            server.spawn(attempt == 1);
            match server.wait_ready().await {
                Ok(()) => return server,
                Err(status) => {
                    if server.log().contains("address already in use") && attempt < PORT_ATTEMPTS {
                        continue;
                    }
                    panic!(
                        "nats-server exited before it was ready on port {} ({status})",
                        server.port
                    );
                }
            }
        }
        unreachable!("the last attempt returns or panics")
    }
}

impl NatsServer {
    /// Starts a server on a free port and waits until JetStream answers; panics when
    /// `nats-server` is not installed.
    pub async fn start() -> NatsServer {
        let binary = binary();
        let mut server = NatsServer {
            child: None,
            binary,
            last_exit: None,
            last_pid: None,
            port: 0,
            dir: super::unique_temp_dir("nats"),
            config: None,
            ready_lines: None,
        };
        for attempt in 1..=PORT_ATTEMPTS {
            server.port = free_port();
            server.spawn(attempt == 1);
            match server.wait_ready().await {
                Ok(()) => return server,
                Err(status) => {
                    if server.log().contains("address already in use") && attempt < PORT_ATTEMPTS {
                        continue;
                    }
                    // Drop prints the log tail while this panic unwinds.
                    panic!(
                        "nats-server exited before it was ready on port {} ({status})",
                        server.port
                    );
                }
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// A server with TLS or authentication (or both), configured from a file.
    pub fn builder() -> NatsServerBuilder {
        NatsServerBuilder::default()
    }

    /// A stopped server that runs `nats-server -c DIR/nats.conf` from a fresh directory once
    /// spawned; the caller writes the file (with `port`) and waits for readiness its own way.
    pub(super) fn configured(binary: PathBuf, kind: &str, port: u16) -> NatsServer {
        let dir = super::unique_temp_dir(kind);
        NatsServer {
            child: None,
            binary,
            last_exit: None,
            last_pid: None,
            port,
            config: Some(dir.join("nats.conf")),
            dir,
            ready_lines: None,
        }
    }

    /// The configuration file of a cluster node.
    pub(super) fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    /// Moves a stopped configured server to another port (after losing a port race).
    pub(super) fn set_port(&mut self, port: u16) {
        assert!(self.child.is_none(), "set_port on a running nats-server");
        self.port = port;
    }

    /// The exit status if the process exited by itself since the last look (it is reaped);
    /// `None` while it runs or when it is stopped.
    pub(super) fn exited(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let status = child.try_wait().expect("try_wait on nats-server")?;
        self.child = None;
        self.last_exit = Some(status);
        Some(status)
    }

    /// The exit status of the last process (after a kill, a stop or a crash).
    pub fn last_exit(&self) -> Option<ExitStatus> {
        self.last_exit
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the process was started and not stopped or killed since (it may have crashed:
    /// see the log).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The process id while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// `nats://127.0.0.1:PORT`, the form the hub's configuration takes.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr())
    }

    /// Working directory: `store/` (JetStream) and `nats.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("nats.log")
    }

    /// Everything the server wrote so far, across restarts.
    pub fn log(&self) -> String {
        std::fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// A client of this server, for tests that act as producers or operators.
    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.url())
            .await
            .unwrap_or_else(|e| panic!("connect to nats at {}: {e}", self.addr()))
    }

    /// A JetStream context on a new client.
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client().await)
    }

    /// Stops the server gracefully (SIGTERM, it flushes its store) and starts it again on the
    /// same port and store; returns once JetStream answers.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.start_again().await;
    }

    /// SIGTERM, then waits for the exit (SIGKILL after [`STOP_TIMEOUT`]); the port is free
    /// until [`NatsServer::start_again`].
    pub async fn stop(&mut self) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        let status = Command::new("kill")
            .args(["-s", "TERM", &child.id().to_string()])
            .status()
            .unwrap_or_else(|e| panic!("run kill(1): {e}"));
        assert!(status.success(), "kill -s TERM {} failed", child.id());
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("still running");
            if let Some(status) = child.try_wait().expect("try_wait on nats-server") {
                self.child = None;
                self.last_exit = Some(status);
                return;
            }
            if Instant::now() >= deadline {
                return self.kill();
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// Starts a stopped server on its old port and store and waits for JetStream; panics if
    /// the port was taken in the meantime.
    pub async fn start_again(&mut self) {
        assert!(
            self.child.is_none(),
            "nats-server on port {} is still running; stop() it first",
            self.port
        );
        self.spawn(false);
        if let Err(status) = self.wait_ready().await {
            panic!(
                "nats-server did not come back on port {} ({status})",
                self.port
            );
        }
    }

    /// SIGKILL and reap (no-op while stopped).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            self.last_exit = child.wait().ok();
        }
    }

    /// `fresh_log` truncates the log, so a retried port race does not leave the previous
    /// attempt's "address already in use" behind.
    pub(super) fn spawn(&mut self, fresh_log: bool) {
        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .write(true)
            .append(!fresh_log)
            .truncate(fresh_log)
            .open(&log_path)
            .unwrap_or_else(|e| panic!("open {}: {e}", log_path.display()));
        let log_dup = log.try_clone().expect("clone log file handle");
        if self.ready_lines.is_some() {
            self.ready_lines = Some(if fresh_log {
                0
            } else {
                self.log().matches(READY_LINE).count()
            });
        }
        let mut command = Command::new(&self.binary);
        match &self.config {
            Some(config) => command.arg("-c").arg(config),
            None => command
                .args([
                    "-js",
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-sd",
                ])
                .arg(self.dir.join("store")),
        };
        let child = command
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log_dup)
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.binary.display()));
        self.last_pid = Some(child.id());
        self.last_exit = None;
        self.child = Some(child);
    }

    /// Polls until a JetStream account request answers; `Err` with the exit status if the
    /// process exits first.
    async fn wait_ready(&mut self) -> Result<(), ExitStatus> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("wait_ready on a started server");
            if let Some(status) = child.try_wait().expect("try_wait on nats-server") {
                self.child = None;
                self.last_exit = Some(status);
                return Err(status);
            }
            let last = match self.ready_lines {
                None => match probe(self.addr()).await {
                    Ok(()) => return Ok(()),
                    Err(e) => e,
                },
                Some(before) => {
                    if self.log().matches(READY_LINE).count() > before {
                        return Ok(());
                    }
                    format!("no new {READY_LINE:?} line in the log")
                }
            };
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "nats-server not ready on {} after {READY_TIMEOUT:?} (last probe: {last})",
                    self.addr()
                );
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }
}

/// Connects without retrying and asks JetStream for the account: ready means JetStream serves
/// (in a cluster: this node knows the meta leader).
pub(super) async fn probe(addr: SocketAddr) -> Result<(), String> {
    let attempt = async {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(1))
            .connect(format!("nats://{addr}"))
            .await
            .map_err(|e| e.to_string())?;
        // The raw API request: async-nats' typed account info does not parse 2.9's answer.
        let reply = client
            .request("$JS.API.INFO", "".into())
            .await
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&reply.payload);
        if text.contains("\"error\"") {
            return Err(text.into_owned());
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .unwrap_or_else(|_| Err("no answer within 2s".into()))
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = self.log();
            let tail =
                &log[super::floor_char_boundary(&log, log.len().saturating_sub(LOG_TAIL_BYTES))..];
            let exit = self
                .last_exit
                .map_or_else(|| "unknown".to_string(), |s| s.to_string());
            eprintln!(
                "--- nats-server {} log {} (pid {:?}, {exit}) ---\n{tail}\n--- end of nats-server log ---",
                self.addr(),
                self.log_path().display(),
                self.last_pid,
            );
        }
        if std::env::var_os(KEEP_LOGS_VAR).is_some() {
            eprintln!("nats-server directory kept at {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Resolves `nats-server`: the file [`BINARY_VAR`] names, or else the first on PATH, in
/// /usr/sbin (where Debian puts it and a non-root PATH may not look) or in /usr/local/bin.
/// Missing: a panic, under CI or not, so that no NATS test passes without NATS.
pub(super) fn binary() -> PathBuf {
    if let Some(named) = std::env::var_os(BINARY_VAR) {
        let path = PathBuf::from(named);
        assert!(
            path.is_file(),
            "{BINARY_VAR}={} names no file; unset it to look for {SERVER_BIN} on PATH, or install \
             the Debian package nats-server (scripts/test does it)",
            path.display()
        );
        return path;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join(SERVER_BIN))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{SERVER_BIN} not found on PATH, in /usr/sbin or in /usr/local/bin; install the \
                 Debian package nats-server (scripts/test does it)"
            )
        })
}

/// NATS headers from name/value pairs.
pub fn headers(pairs: &[(&str, &str)]) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in pairs {
        headers.insert(*name, *value);
    }
    headers
}

/// Publishes as an external producer would (the NATS format of docs/stream-format.md, not
/// through the hub) and waits for JetStream's ack; returns the stream sequence.
pub async fn produce(
    js: &async_nats::jetstream::Context,
    subject: &str,
    pairs: &[(&str, &str)],
    body: &[u8],
) -> u64 {
    js.publish_with_headers(subject.to_string(), headers(pairs), body.to_vec().into())
        .await
        .expect("publish")
        .await
        .expect("ack")
        .sequence
}

/// The state of stream `name` (message count, first and last sequence).
pub async fn stream_state(
    js: &async_nats::jetstream::Context,
    name: &str,
) -> async_nats::jetstream::stream::State {
    js.get_stream(name)
        .await
        .expect("the stream exists")
        .info()
        .await
        .expect("stream info")
        .state
        .clone()
}

/// `device`'s shard with the default 64 shards.
pub fn shard(device: &str) -> u32 {
    crc32fast::hash(device.as_bytes()) % 64
}

/// The subject of `device`'s shard with the default prefix and 64 shards.
pub fn subject(device: &str) -> String {
    format!("posthorn.ev.{}", shard(device))
}

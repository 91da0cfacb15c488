//! A real nginx reverse proxy in front of one or more upstreams (usually
//! hubs), configured the way production runs it for SSE: HTTP/1.1 to the
//! upstreams, no response buffering (events must not wait in a proxy
//! buffer), hour-long read timeouts, and a retry on the other upstream when
//! one refuses a request with 502/503 (a draining hub answers new streams
//! with 503, and clients must not see that).
//!
//! Each proxy runs `nginx` in the foreground from a fresh temporary
//! directory holding its `nginx.conf`, `error.log`, pid file and temp
//! directories, so nothing touches `/etc/nginx` or `/var/log/nginx` and it
//! works without root. Dropping it asks nginx to quit (SIGQUIT), SIGKILLs
//! it and its workers if that takes too long, reaps it, prints the logs if
//! the test is panicking, and removes the directory (kept with
//! `POSTHORN_TEST_KEEP_LOGS` set).

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{free_port, http};

const BIN: &str = "nginx";
const READY_TIMEOUT: Duration = Duration::from_secs(10);
const READY_POLL: Duration = Duration::from_millis(20);
/// Each readiness probe must be short so an exited process is noticed quickly.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long Drop waits for a graceful quit before SIGKILL. The config caps
/// the workers' graceful shutdown at 1 s (`worker_shutdown_timeout`), so
/// this is only a guard against a wedged process.
const QUIT_TIMEOUT: Duration = Duration::from_secs(5);
const EXIT_POLL: Duration = Duration::from_millis(10);
const LOG_TAIL_BYTES: usize = 32 * 1024;
/// Attempts when the port from [`free_port`] was taken in the meantime.
const PORT_ATTEMPTS: usize = 3;
const KEEP_LOGS_VAR: &str = "POSTHORN_TEST_KEEP_LOGS";
/// What nginx's own 400 answer carries; the readiness probe checks it so
/// that another process that grabbed the port is not mistaken for nginx
/// (nginx keeps retrying `bind()` for a few seconds before giving up).
const SERVER_HEADER_PREFIX: &str = "nginx";

/// A running nginx proxying `http://127.0.0.1:PORT/` to its upstreams
/// (round-robin). Dropping it stops and reaps it.
#[derive(Debug)]
pub struct Nginx {
    child: Child,
    addr: SocketAddr,
    upstreams: Vec<SocketAddr>,
    dir: PathBuf,
    /// Cached once reaped: after that the pid may belong to someone else,
    /// so it must never be signalled again.
    exit: Option<ExitStatus>,
}

impl Nginx {
    /// Starts nginx in front of `upstreams` on a free loopback port and
    /// waits until it answers; panics (with its logs) if it exits first or
    /// is not ready within 10 s.
    pub async fn start(upstreams: &[SocketAddr]) -> Nginx {
        assert!(!upstreams.is_empty(), "nginx needs at least one upstream");
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut nginx = Self::spawn(upstreams, free_port());
            match nginx.wait_ready().await {
                Ok(()) => return nginx,
                Err(status) => {
                    let logs = nginx.logs();
                    if logs.contains("Address already in use") && attempt < PORT_ATTEMPTS {
                        continue;
                    }
                    // Drop prints the logs while this panic unwinds.
                    panic!(
                        "nginx exited before becoming ready on {} ({status})",
                        nginx.addr
                    );
                }
            }
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn upstreams(&self) -> &[SocketAddr] {
        &self.upstreams
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Working directory: `nginx.conf`, `error.log`, `nginx.pid`, temp dirs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Everything nginx logged so far at `warn` or above, e.g. "upstream
    /// server temporarily disabled" when an upstream failed.
    pub fn error_log(&self) -> String {
        read_lossy(&self.dir.join("error.log"))
    }

    fn spawn(upstreams: &[SocketAddr], port: u16) -> Nginx {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let dir = super::unique_temp_dir("nginx");
        let conf = dir.join("nginx.conf");
        std::fs::write(&conf, config(&dir, addr, upstreams))
            .unwrap_or_else(|e| panic!("write {}: {e}", conf.display()));
        // Messages from before the config's error_log is open (a bad
        // directive) go to stderr, which Debian's build also uses as the
        // default error log.
        let stderr_path = dir.join("stderr.log");
        let stderr = File::create(&stderr_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", stderr_path.display()));
        let stdout = stderr.try_clone().expect("clone log file handle");
        let child = Command::new(binary())
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&conf)
            .args(["-g", "daemon off;"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {BIN}: {e}"));
        Nginx {
            child,
            addr,
            upstreams: upstreams.to_vec(),
            dir,
            exit: None,
        }
    }

    /// Polls until nginx itself answers on the port; `Err` with the exit
    /// status if the process exits first.
    async fn wait_ready(&mut self) -> Result<(), ExitStatus> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.try_exit_status() {
                return Err(status);
            }
            let last = match probe(self.addr).await {
                Ok(()) => return Ok(()),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "nginx not ready on {} after {READY_TIMEOUT:?} (last probe: {last})",
                    self.addr
                );
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    fn try_exit_status(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().expect("try_wait on nginx");
        }
        self.exit
    }

    /// SIGQUIT (graceful: finish in-flight requests, at most 1 s), then
    /// SIGKILL for the master and its workers if it is still running after
    /// [`QUIT_TIMEOUT`]; always reaps. No-op once it has exited.
    fn stop(&mut self) {
        if self.try_exit_status().is_some() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-s", "QUIT", &self.pid().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = std::time::Instant::now() + QUIT_TIMEOUT;
        while std::time::Instant::now() < deadline {
            if self.try_exit_status().is_some() {
                return;
            }
            std::thread::sleep(EXIT_POLL);
        }
        self.kill();
    }

    /// SIGKILLs the master and its workers and reaps the master. The
    /// workers are killed too because they do not notice a dead master and
    /// would keep the port open; they are found before the master dies,
    /// while they are still its children.
    fn kill(&mut self) {
        if self.try_exit_status().is_some() {
            return;
        }
        let workers = children_of(self.pid());
        let _ = self.child.kill();
        for pid in workers {
            let _ = Command::new("kill")
                .args(["-s", "KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        self.exit = self.child.wait().ok();
    }

    /// The error log followed by whatever went to stdout/stderr.
    fn logs(&self) -> String {
        format!(
            "{}{}",
            self.error_log(),
            read_lossy(&self.dir.join("stderr.log"))
        )
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            let log = self.logs();
            let tail =
                &log[super::floor_char_boundary(&log, log.len().saturating_sub(LOG_TAIL_BYTES))..];
            let exit = self
                .exit
                .map_or_else(|| "unknown".to_string(), |s| s.to_string());
            eprintln!(
                "--- nginx {} log {} (pid {}, {exit}) ---\n{tail}\n--- end of nginx log ---",
                self.addr,
                self.dir.display(),
                self.child.id(),
            );
        }
        if std::env::var_os(KEEP_LOGS_VAR).is_some() {
            eprintln!("nginx directory kept at {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The whole configuration; every path nginx writes is inside `dir`.
fn config(dir: &Path, addr: SocketAddr, upstreams: &[SocketAddr]) -> String {
    let d = dir.display();
    // max_fails=1 fail_timeout=1s: one refused request takes an upstream
    // out of rotation for a second, so a draining hub stops getting new
    // streams at once but is retried soon after it came back.
    let servers: String = upstreams
        .iter()
        .map(|u| format!("        server {u} max_fails=1 fail_timeout=1s;\n"))
        .collect();
    format!(
        "worker_processes 1;\n\
         error_log {d}/error.log warn;\n\
         pid {d}/nginx.pid;\n\
         # Graceful quit must not wait an hour for open SSE streams.\n\
         worker_shutdown_timeout 1s;\n\
         \n\
         events {{\n\
         \x20   worker_connections 4096;\n\
         }}\n\
         \n\
         http {{\n\
         \x20   access_log off;\n\
         \x20   client_body_temp_path {d}/client_body_temp;\n\
         \x20   proxy_temp_path {d}/proxy_temp;\n\
         \x20   fastcgi_temp_path {d}/fastcgi_temp;\n\
         \x20   uwsgi_temp_path {d}/uwsgi_temp;\n\
         \x20   scgi_temp_path {d}/scgi_temp;\n\
         \n\
         \x20   upstream hubs {{\n\
         {servers}\
         \x20   }}\n\
         \n\
         \x20   server {{\n\
         \x20       listen {addr};\n\
         \x20       location / {{\n\
         \x20           proxy_pass http://hubs;\n\
         \x20           # Keep-alive capable upstream requests; the empty Connection\n\
         \x20           # header stops nginx from sending `Connection: close`.\n\
         \x20           proxy_http_version 1.1;\n\
         \x20           proxy_set_header Connection \"\";\n\
         \x20           # The client's Host, as proxies in front of a hub should pass it: a hub\n\
         \x20           # with auth none refuses requests for names it does not know.\n\
         \x20           proxy_set_header Host $http_host;\n\
         \x20           # SSE: pass every event on as soon as the hub writes it.\n\
         \x20           proxy_buffering off;\n\
         \x20           proxy_cache off;\n\
         \x20           proxy_read_timeout 1h;\n\
         \x20           # A draining hub refuses new streams with 503; retry on the other.\n\
         \x20           proxy_next_upstream error timeout http_502 http_503 non_idempotent;\n\
         \x20           proxy_next_upstream_tries 2;\n\
         \x20       }}\n\
         \x20   }}\n\
         }}\n"
    )
}

/// Sends a request without `Host`, which nginx answers itself with 400
/// (never reaching an upstream); `Ok` if the answer says it came from nginx.
async fn probe(addr: SocketAddr) -> io::Result<()> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
            .await?;
        let head = http::read_head(&mut stream, &mut Vec::new()).await?;
        let server = http::find_header(&head.headers, "server").unwrap_or_default();
        if server.starts_with(SERVER_HEADER_PREFIX) {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "not nginx on {addr}: status {}, server {server:?}",
                head.status
            )))
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {PROBE_TIMEOUT:?}"),
            ))
        })
}

/// Pids whose parent is `ppid`, from /proc (no libc in tests).
fn children_of(ppid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            // `pid (comm) state ppid ...`; comm may contain spaces and
            // parentheses, so split after the last `)`.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(ppid)
        })
        .collect()
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Resolves `nginx` on PATH or in /usr/sbin (where Debian puts it and
/// which a non-root PATH often lacks). A missing binary is always a panic:
/// a proxy test that passes without the proxy proves nothing.
fn binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join(BIN))
        .find(|candidate| candidate.is_file());
    match found {
        Some(path) => path,
        None if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{BIN} not found; scripts/test installs it")
        }
        None => panic!(
            "{BIN} not found on PATH or in /usr/sbin; install the Debian package nginx-light \
             (scripts/test does it)"
        ),
    }
}

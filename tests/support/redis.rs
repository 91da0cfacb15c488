//! Real Redis servers for the Redis Streams backend tests: a standalone
//! server with optional AOF persistence that can be killed and restarted on
//! the same port (also from an older snapshot of its files, or without any,
//! to simulate rollbacks and lost disks), a cluster formed with
//! `redis-cli --cluster` (masters only, or with replicas that take over when
//! a master is killed), and a small RESP2 connection ([`RespClient`], on the
//! redis-protocol crate's codec) so tests can act as an external producer
//! (XADD), inspect state (XLEN, XINFO), reconfigure (CONFIG SET) and see error
//! replies (MOVED, WRONGTYPE) as values, exactly as Redis sent them.
//!
//! Each server runs `redis-server` from a fresh temporary directory holding
//! its `redis.conf`, its data files and `redis.log`; dropping it SIGKILLs and
//! reaps the process, prints the log tail if the test is panicking, and
//! removes the directory (kept with `POSTHORN_TEST_KEEP_LOGS` set).
//!
//! A server may listen with TLS only ([`RedisBuilder::tls`], also a TLS cluster:
//! [`RedisCluster::start_tls`]) and may turn its default user off
//! ([`RedisBuilder::harness_user`]). The harness's own connections to it, every
//! [`RespClient`] and readiness probe, then use TLS and authenticate by
//! themselves: what a port needs is registered while its server lives.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use redis_protocol::resp2::{
    self,
    types::{OwnedFrame, Resp2Frame},
};

use super::tls::{CertFiles, TestPki};
use super::{free_port, IO_TIMEOUT};

const SERVER_BIN: &str = "redis-server";
const CLI_BIN: &str = "redis-cli";
/// AOF replay and cluster handshakes are fast on loopback; this is only a
/// guard against a wedged process.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(30);
const READY_POLL: Duration = Duration::from_millis(20);
/// Each readiness probe must be short so an exited process is noticed quickly.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const LOG_TAIL_BYTES: usize = 32 * 1024;
/// Attempts when a port from [`free_port`] was taken in the meantime.
const PORT_ATTEMPTS: usize = 3;
const KEEP_LOGS_VAR: &str = "POSTHORN_TEST_KEEP_LOGS";
/// Redis Cluster listens for its node-to-node bus on the client port plus
/// this offset, so both must be free and the sum must be a valid port.
const CLUSTER_BUS_OFFSET: u16 = 10_000;
pub const CLUSTER_SLOTS: u16 = 16_384;

// ---------------------------------------------------------------------------
// RESP client
// ---------------------------------------------------------------------------

/// One RESP2 reply. Redis error replies are values (`Error`), not `Err`:
/// tests often assert on them (MOVED, WRONGTYPE, NOGROUP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    Simple(String),
    Error(String),
    Int(i64),
    /// `None` is the null bulk string (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `None` is the null array (`*-1`), e.g. an XREAD that timed out.
    Array(Option<Vec<RespValue>>),
}

impl RespValue {
    /// Text of a simple string or a UTF-8 bulk string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            RespValue::Simple(s) => Some(s),
            RespValue::Bulk(Some(b)) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            RespValue::Int(n) => Some(*n),
            _ => None,
        }
    }

    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            RespValue::Bulk(Some(b)) => Some(b),
            RespValue::Simple(s) => Some(s.as_bytes()),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[RespValue]> {
        match self {
            RespValue::Array(Some(items)) => Some(items),
            _ => None,
        }
    }

    /// The message of an error reply (without the leading `-`).
    pub fn as_error(&self) -> Option<&str> {
        match self {
            RespValue::Error(e) => Some(e),
            _ => None,
        }
    }

    /// `+OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, RespValue::Simple(s) if s == "OK")
    }

    pub fn is_null(&self) -> bool {
        matches!(self, RespValue::Bulk(None) | RespValue::Array(None))
    }
}

impl From<OwnedFrame> for RespValue {
    fn from(frame: OwnedFrame) -> Self {
        match frame {
            OwnedFrame::SimpleString(text) => {
                RespValue::Simple(String::from_utf8_lossy(&text).into_owned())
            }
            OwnedFrame::Error(message) => RespValue::Error(message),
            OwnedFrame::Integer(n) => RespValue::Int(n),
            OwnedFrame::BulkString(bytes) => RespValue::Bulk(Some(bytes)),
            OwnedFrame::Array(items) => {
                RespValue::Array(Some(items.into_iter().map(RespValue::from).collect()))
            }
            // RESP2 has a null bulk string and a null array; the codec reads both as one null.
            OwnedFrame::Null => RespValue::Bulk(None),
        }
    }
}

/// Encodes a command as a RESP array of bulk strings, the only form Redis accepts from clients
/// besides inline commands (redis-protocol's encoder, the codec fred is built on).
fn encode_command<A: AsRef<[u8]>>(args: &[A]) -> Vec<u8> {
    let frame = OwnedFrame::Array(
        args.iter()
            .map(|arg| OwnedFrame::BulkString(arg.as_ref().to_vec()))
            .collect(),
    );
    let mut out = vec![0; frame.encode_len(false)];
    resp2::encode::encode(&mut out, &frame, false).expect("the buffer has the frame's length");
    out
}

/// A RESP2 connection, over TLS and with an ACL user where the server asks for them: one
/// command, one reply, in order. The protocol (encoding and decoding) is the redis-protocol
/// crate's; what is left here is a socket and a timeout.
#[derive(Debug)]
pub struct RespClient {
    stream: Box<dyn Connection>,
    addr: SocketAddr,
    /// Bytes read past the previous reply (a reply may span reads).
    buf: Vec<u8>,
}

impl RespClient {
    /// Connects or panics; see [`RespClient::try_connect`].
    pub async fn connect(addr: SocketAddr) -> RespClient {
        Self::try_connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect to redis at {addr}: {e}"))
    }

    pub async fn try_connect(addr: SocketAddr) -> io::Result<RespClient> {
        Self::try_connect_within(addr, IO_TIMEOUT).await
    }

    async fn try_connect_within(addr: SocketAddr, timeout: Duration) -> io::Result<RespClient> {
        let access = access_of(addr.port());
        let connect = async {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let stream: Box<dyn Connection> = match &access.tls {
                Some((config, name)) => {
                    let connector = tokio_rustls::TlsConnector::from(config.clone());
                    Box::new(connector.connect(name.clone(), tcp).await?)
                }
                None => Box::new(tcp),
            };
            io::Result::Ok(stream)
        };
        let stream = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| timed_out(format!("connect to {addr}")))??;
        let mut client = RespClient {
            stream,
            addr,
            buf: Vec::new(),
        };
        if let Some((user, password)) = &access.user {
            let reply = client
                .try_cmd_within(&["AUTH", user, password], timeout)
                .await?;
            if !reply.is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("AUTH {user} on {addr}: {reply:?}"),
                ));
            }
        }
        Ok(client)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends `args` as one command and returns the reply; panics on I/O
    /// errors and timeouts (Redis error replies are returned).
    pub async fn cmd(&mut self, args: &[&str]) -> RespValue {
        self.try_cmd(args)
            .await
            .unwrap_or_else(|e| panic!("redis {} {args:?}: {e}", self.addr))
    }

    pub async fn try_cmd(&mut self, args: &[&str]) -> io::Result<RespValue> {
        self.try_cmd_within(args, IO_TIMEOUT).await
    }

    /// Like [`RespClient::cmd`] for binary arguments (payloads that are not
    /// UTF-8).
    pub async fn cmd_bytes(&mut self, args: &[&[u8]]) -> RespValue {
        let request = encode_command(args);
        self.round_trip(&request, IO_TIMEOUT)
            .await
            .unwrap_or_else(|e| {
                let shown: Vec<_> = args.iter().map(|a| String::from_utf8_lossy(a)).collect();
                panic!("redis {} {shown:?}: {e}", self.addr)
            })
    }

    async fn try_cmd_within(&mut self, args: &[&str], timeout: Duration) -> io::Result<RespValue> {
        let request = encode_command(args);
        self.round_trip(&request, timeout).await
    }

    async fn round_trip(&mut self, request: &[u8], timeout: Duration) -> io::Result<RespValue> {
        let exchange = async {
            self.stream.write_all(request).await?;
            self.read_reply().await
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| timed_out(format!("no reply within {timeout:?}")))?
    }

    async fn read_reply(&mut self) -> io::Result<RespValue> {
        loop {
            let decoded = resp2::decode::decode(&self.buf)
                .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error.to_string()))?;
            if let Some((frame, used)) = decoded {
                self.buf.drain(..used);
                return Ok(frame.into());
            }
            self.buf.reserve(16 * 1024);
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "redis closed the connection",
                ));
            }
        }
    }

    /// `XADD key * field value ...`; returns the new entry id.
    pub async fn xadd(&mut self, key: &str, fields: &[(&str, &str)]) -> String {
        let reply = self.cmd(&xadd_args(key, fields)).await;
        expect_id(&reply, self.addr)
    }

    pub async fn flushall(&mut self) {
        let reply = self.cmd(&["FLUSHALL"]).await;
        assert!(reply.is_ok(), "FLUSHALL on {}: {reply:?}", self.addr);
    }

    /// `XLEN key` (0 for a missing key).
    pub async fn xlen(&mut self, key: &str) -> i64 {
        let reply = self.cmd(&["XLEN", key]).await;
        reply
            .as_int()
            .unwrap_or_else(|| panic!("XLEN {key} on {}: {reply:?}", self.addr))
    }

    /// `CLUSTER INFO` (or `INFO section`) parsed into `key:value` pairs.
    pub async fn info_map(&mut self, args: &[&str]) -> Vec<(String, String)> {
        let reply = self.cmd(args).await;
        let text = reply
            .as_str()
            .unwrap_or_else(|| panic!("{args:?} on {}: {reply:?}", self.addr));
        text.lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect()
    }
}

fn timed_out(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what)
}

/// A plain or TLS socket of a [`RespClient`].
trait Connection: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug> Connection for T {}

/// How the harness reaches the server on one port: with TLS, and as which user.
#[derive(Clone, Default)]
struct Access {
    /// With the name the server's certificate is verified against.
    tls: Option<(
        Arc<rustls::ClientConfig>,
        rustls_pki_types::ServerName<'static>,
    )>,
    user: Option<(String, String)>,
}

/// What each running TLS or ACL server's port needs, so that every connection of the harness
/// (probes, cluster checks, test clients) reaches it without being told.
static ACCESS: Mutex<Option<HashMap<u16, Access>>> = Mutex::new(None);

fn access_of(port: u16) -> Access {
    let registry = ACCESS.lock().unwrap_or_else(|p| p.into_inner());
    registry
        .as_ref()
        .and_then(|ports| ports.get(&port).cloned())
        .unwrap_or_default()
}

fn set_access(port: u16, access: Option<Access>) {
    let mut registry = ACCESS.lock().unwrap_or_else(|p| p.into_inner());
    let ports = registry.get_or_insert_with(HashMap::new);
    match access {
        Some(access) => ports.insert(port, access),
        None => ports.remove(&port),
    };
}

/// TLS of a server: its certificate (also its client certificate on a cluster's bus) and CA,
/// whether it asks clients for certificates, and the certificate the harness presents.
#[derive(Debug, Clone)]
pub struct RedisTls {
    pub ca_file: PathBuf,
    pub server: CertFiles,
    /// What the harness's own connections present.
    pub client: CertFiles,
    /// `tls-auth-clients`: "yes", "no" or "optional".
    pub auth_clients: &'static str,
    /// The name the harness verifies the server's certificate against.
    pub server_name: String,
}

impl RedisTls {
    /// Certificates from `pki` (keep it alive while the server runs: it holds the files).
    pub fn new(pki: &mut TestPki, auth_clients: &'static str) -> RedisTls {
        RedisTls {
            ca_file: pki.ca_file().to_path_buf(),
            server: pki.peer_cert(),
            client: pki.client_cert("harness"),
            auth_clients,
            server_name: "127.0.0.1".into(),
        }
    }

    /// The harness's client side: trusts the CA, presents its client certificate.
    fn client_config(&self) -> Arc<rustls::ClientConfig> {
        use rustls_pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca_file).expect("read CA") {
            roots.add(cert.expect("CA cert")).expect("add CA");
        }
        let certs = CertificateDer::pem_file_iter(&self.client.cert)
            .expect("read client cert")
            .collect::<Result<Vec<_>, _>>()
            .expect("client cert");
        let key = PrivateKeyDer::from_pem_file(&self.client.key).expect("client key");
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .expect("client certificate");
        Arc::new(config)
    }

    /// The `redis.conf` lines; `cluster` adds TLS on the bus and for replication.
    fn directives(&self, port: u16, cluster: bool) -> String {
        let mut conf = format!(
            "port 0\n\
             tls-port {port}\n\
             tls-cert-file {cert:?}\n\
             tls-key-file {key:?}\n\
             tls-ca-cert-file {ca:?}\n\
             tls-auth-clients {auth}\n",
            cert = self.server.cert.display().to_string(),
            key = self.server.key.display().to_string(),
            ca = self.ca_file.display().to_string(),
            auth = self.auth_clients,
        );
        if cluster {
            conf.push_str("tls-cluster yes\ntls-replication yes\n");
        }
        conf
    }
}

fn xadd_args<'a>(key: &'a str, fields: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    let mut args = vec!["XADD", key, "*"];
    for (field, value) in fields {
        args.push(field);
        args.push(value);
    }
    args
}

fn expect_id(reply: &RespValue, context: impl std::fmt::Display) -> String {
    match reply {
        RespValue::Bulk(Some(_)) => reply.as_str().expect("XADD id is ASCII").to_string(),
        other => panic!("XADD on {context}: {other:?}"),
    }
}

/// The target of a `-MOVED slot host:port` or `-ASK slot host:port` reply.
/// An empty host (node without a known endpoint) means 127.0.0.1, the only
/// address the harness binds.
pub fn redirect_target(reply: &RespValue) -> Option<(u16, SocketAddr)> {
    let err = reply.as_error()?;
    let mut parts = err.split_whitespace();
    if !matches!(parts.next(), Some("MOVED" | "ASK")) {
        return None;
    }
    let slot = parts.next()?.parse().ok()?;
    let (host, port) = parts.next()?.rsplit_once(':')?;
    let ip = if host.is_empty() {
        Ipv4Addr::LOCALHOST.into()
    } else {
        host.parse().ok()?
    };
    Some((slot, SocketAddr::new(ip, port.parse().ok()?)))
}

/// The cluster hash slot of `key` (CRC16/XMODEM of the hash tag if it has a
/// non-empty `{...}`, else of the whole key, modulo 16384), so tests can
/// choose keys per node without asking a server.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &bytes[open + 1..open + 1 + close])
        })
        .unwrap_or(bytes);
    crc16_xmodem(hashed) % CLUSTER_SLOTS
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

// ---------------------------------------------------------------------------
// Standalone server
// ---------------------------------------------------------------------------

/// Configures a [`RedisServer`].
#[derive(Debug, Clone, Default)]
pub struct RedisBuilder {
    appendonly: bool,
    cluster: bool,
    config: Vec<(String, String)>,
    // Boxed: a server is held by value in enums of other test code, which should stay small.
    tls: Option<Box<RedisTls>>,
    harness_user: Option<Box<(String, String)>>,
}

impl RedisBuilder {
    /// AOF persistence with `appendfsync always`, so every acknowledged
    /// write survives a SIGKILL.
    pub fn appendonly(mut self, on: bool) -> Self {
        self.appendonly = on;
        self
    }

    /// An extra `redis.conf` directive, e.g. `.config("maxmemory", "10mb")`.
    /// The value is written verbatim (quote it yourself if it needs quotes).
    pub fn config(mut self, directive: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((directive.into(), value.into()));
        self
    }

    /// Listen with TLS only (`port 0`, `tls-port`): clients must use `rediss://`.
    pub fn tls(mut self, tls: RedisTls) -> Self {
        self.tls = Some(Box::new(tls));
        self
    }

    /// The user the harness's own connections authenticate as, for a server whose `default`
    /// user is off (give that user its `user` directive with [`RedisBuilder::config`]).
    pub fn harness_user(mut self, user: &str, password: &str) -> Self {
        self.harness_user = Some(Box::new((user.into(), password.into())));
        self
    }

    /// Starts the server on a free port and waits until it answers PING;
    /// panics (with the log) if it exits or is not ready in time.
    pub async fn start(self) -> RedisServer {
        let mut server = RedisServer {
            child: None,
            last_exit: None,
            last_pid: None,
            port: 0,
            dir: super::unique_temp_dir("redis"),
            builder: self,
            snapshots: 0,
        };
        for attempt in 1..=PORT_ATTEMPTS {
            server.port = if server.builder.cluster {
                free_cluster_port()
            } else {
                free_port()
            };
            server.write_config();
            server.register_access();
            server.spawn(attempt == 1);
            match server.wait_ready().await {
                Ok(()) => return server,
                Err(status) => {
                    set_access(server.port, None);
                    let log = server.log();
                    if log.contains("Address already in use") && attempt < PORT_ATTEMPTS {
                        continue;
                    }
                    // Drop prints the log tail while this panic unwinds.
                    panic!(
                        "redis-server exited before answering PING on port {} ({status})",
                        server.port
                    );
                }
            }
        }
        unreachable!("the last attempt returns or panics")
    }
}

/// The persisted state of one [`RedisServer`] at some moment, copied aside
/// by [`RedisServer::snapshot`] into the server's directory (and removed
/// with it); [`RedisServer::restart_from`] restarts the server from it.
#[derive(Debug, Clone)]
pub struct RedisSnapshot {
    dir: PathBuf,
    /// Directory of the server that took it, the only one it may restore.
    origin: PathBuf,
    aof: bool,
    /// Relative to `dir`, and to the server's directory once restored.
    files: Vec<PathBuf>,
}

impl RedisSnapshot {
    /// Where the copied files are (`snapshots/N` in the server's directory).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether it holds an AOF directory (the server had AOF on) rather than
    /// an RDB file.
    pub fn is_aof(&self) -> bool {
        self.aof
    }

    /// The copied files, relative to [`RedisSnapshot::dir`] and to the
    /// server's directory, e.g. `dump.rdb` or
    /// `appendonlydir/appendonly.aof.2.base.rdb`.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
}

/// A `redis-server` process. Dropping it SIGKILLs and reaps the process and
/// removes its directory.
#[derive(Debug)]
pub struct RedisServer {
    /// `None` while stopped (see [`RedisServer::stop`]).
    child: Option<Child>,
    /// For the log banner in Drop, after the child is gone.
    last_exit: Option<ExitStatus>,
    last_pid: Option<u32>,
    port: u16,
    dir: PathBuf,
    builder: RedisBuilder,
    /// Snapshots taken so far, to name the next one's directory.
    snapshots: usize,
}

impl RedisServer {
    pub fn builder() -> RedisBuilder {
        RedisBuilder::default()
    }

    /// A standalone server without persistence.
    pub async fn start() -> RedisServer {
        Self::builder().start().await
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// `redis://127.0.0.1:PORT` (`rediss://` with TLS), the form the hub's configuration takes.
    pub fn url(&self) -> String {
        let scheme = if self.builder.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://{}", self.addr())
    }

    /// What the harness needs to reach this server, registered for its port.
    fn register_access(&self) {
        let access = Access {
            tls: self.builder.tls.as_ref().map(|tls| {
                let name = rustls_pki_types::ServerName::try_from(tls.server_name.clone())
                    .expect("a server name");
                (tls.client_config(), name)
            }),
            user: self.builder.harness_user.as_deref().cloned(),
        };
        let needed = access.tls.is_some() || access.user.is_some();
        set_access(self.port, needed.then_some(access));
    }

    /// Working directory: `redis.conf`, `redis.log`, AOF and cluster files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("redis.log")
    }

    /// Everything the server wrote so far, across restarts.
    pub fn log(&self) -> String {
        std::fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => child
                .try_wait()
                .expect("try_wait on redis-server")
                .is_none(),
            None => false,
        }
    }

    pub async fn client(&self) -> RespClient {
        RespClient::connect(self.addr()).await
    }

    /// SIGKILLs the server and starts it again on the same port and
    /// directory: with AOF the data survives, without it the data is gone.
    /// Returns once it answers PING (after loading the AOF).
    pub async fn restart(&mut self) {
        self.stop().await;
        self.start_again().await;
    }

    /// SIGKILLs and reaps the server; the port is free until
    /// [`RedisServer::start_again`].
    pub async fn stop(&mut self) {
        self.kill();
    }

    /// Starts a stopped server on its old port and directory and waits for
    /// PING; panics if the port was taken in the meantime.
    pub async fn start_again(&mut self) {
        assert!(
            self.child.is_none(),
            "redis-server on port {} is still running; stop() it first",
            self.port
        );
        self.spawn(false);
        if let Err(status) = self.wait_ready().await {
            panic!(
                "redis-server did not come back on port {} ({status})",
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

    /// Copies the server's persisted state aside, into `snapshots/N/` of its
    /// directory, so that [`RedisServer::restart_from`] can later restart the
    /// server from this older state. Panics if the server is stopped or
    /// Redis reports a failure.
    ///
    /// Without AOF it runs `SAVE` and copies the RDB file. With AOF it runs
    /// `BGREWRITEAOF`, waits until the rewrite is done and copies the files
    /// of the multi-part AOF of Redis 7 (`appendonlydir/`: an RDB-format
    /// base, an incremental AOF and the manifest naming them). Writes racing
    /// with the snapshot may or may not be in it.
    pub async fn snapshot(&mut self) -> RedisSnapshot {
        assert!(
            self.child.is_some(),
            "snapshot of the stopped redis-server on port {}",
            self.port
        );
        let mut client = self.client().await;
        let reply = client.cmd(&["CONFIG", "GET", "appendonly"]).await;
        let aof = match reply.as_array() {
            Some([_, value]) => value.as_str() == Some("yes"),
            _ => panic!("CONFIG GET appendonly on {}: {reply:?}", self.addr()),
        };
        // restart_from starts the server from redis.conf, which decides what
        // it loads: a snapshot in the other mode would silently load nothing.
        assert_eq!(
            aof,
            self.aof_configured(),
            "appendonly on {} was changed at run time; its snapshot would not be loaded on restart",
            self.addr()
        );
        let dir = self.dir.join("snapshots").join(self.snapshots.to_string());
        self.snapshots += 1;
        create_dir(&dir);
        let (rdb_name, aof_dir_name) = self.persistence_names();
        let mut files = Vec::new();
        if aof {
            rewrite_aof(&mut client).await;
            let aof_dir = self.dir.join(&aof_dir_name);
            let manifest_name = format!("{}.manifest", self.aof_file_name());
            let manifest_path = aof_dir.join(&manifest_name);
            // Read first: the manifest names the files this state is made
            // of; history files it may still list are being deleted.
            let manifest = std::fs::read_to_string(&manifest_path)
                .unwrap_or_else(|e| panic!("read {}: {e}", manifest_path.display()));
            create_dir(&dir.join(&aof_dir_name));
            for name in aof_manifest_files(&manifest) {
                let file = Path::new(&aof_dir_name).join(name);
                copy_file(&self.dir.join(&file), &dir.join(&file));
                files.push(file);
            }
            let file = Path::new(&aof_dir_name).join(manifest_name);
            let target = dir.join(&file);
            std::fs::write(&target, &manifest)
                .unwrap_or_else(|e| panic!("write {}: {e}", target.display()));
            files.push(file);
        } else {
            let live = self.dir.join(&rdb_name);
            let existed = live.exists();
            let reply = client.cmd(&["SAVE"]).await;
            assert!(reply.is_ok(), "SAVE on {}: {reply:?}", self.addr());
            copy_file(&live, &dir.join(&rdb_name));
            // With `save ""` the server had no RDB file, and a plain restart
            // must keep losing the data: Redis loads an RDB file at start-up
            // whenever AOF is off, so leaving this one would turn every later
            // restart into a silent rollback to the snapshot.
            if !existed {
                std::fs::remove_file(&live)
                    .unwrap_or_else(|e| panic!("remove {}: {e}", live.display()));
            }
            files.push(PathBuf::from(rdb_name));
        }
        RedisSnapshot {
            dir,
            origin: self.dir.clone(),
            aof,
            files,
        }
    }

    /// SIGKILLs the server, replaces its persistence files with the
    /// snapshot's and starts it again on the same port: it comes back with
    /// the data it had when the snapshot was taken, as after a restart from
    /// an older RDB file or AOF. Returns once it answers PING (not LOADING).
    /// The snapshot stays usable for further restarts.
    pub async fn restart_from(&mut self, snapshot: &RedisSnapshot) {
        assert_eq!(
            snapshot.origin, self.dir,
            "a snapshot can only restore the server that took it"
        );
        self.kill();
        self.remove_persistence();
        for file in &snapshot.files {
            let target = self.dir.join(file);
            if let Some(parent) = target.parent() {
                create_dir(parent);
            }
            copy_file(&snapshot.dir.join(file), &target);
        }
        self.start_again().await;
    }

    /// SIGKILLs the server, deletes its RDB file and AOF directory and starts
    /// it again on the same port: a restart that lost every key even with
    /// AOF on (a lost disk). A cluster node keeps its `nodes.conf`, hence its
    /// identity and view of the cluster. Returns once it answers PING.
    pub async fn restart_without_data(&mut self) {
        self.kill();
        self.remove_persistence();
        self.start_again().await;
    }

    /// Deletes the files a (stopped) server loads its data from.
    fn remove_persistence(&self) {
        let (rdb_name, aof_dir_name) = self.persistence_names();
        let rdb = self.dir.join(rdb_name);
        match std::fs::remove_file(&rdb) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => panic!("remove {}: {e}", rdb.display()),
        }
        let aof_dir = self.dir.join(aof_dir_name);
        match std::fs::remove_dir_all(&aof_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => panic!("remove {}: {e}", aof_dir.display()),
        }
    }

    /// The last value of `directive` among the builder's extra directives
    /// (the one Redis applies), without quotes.
    fn configured(&self, directive: &str) -> Option<String> {
        self.builder
            .config
            .iter()
            .rev()
            .find(|(d, _)| d.eq_ignore_ascii_case(directive))
            .map(|(_, v)| v.trim_matches('"').to_string())
    }

    /// Whether redis.conf turns AOF on (an extra directive wins over
    /// [`RedisBuilder::appendonly`], as it comes later in the file).
    fn aof_configured(&self) -> bool {
        self.configured("appendonly")
            .map_or(self.builder.appendonly, |v| v.eq_ignore_ascii_case("yes"))
    }

    /// `dbfilename` and `appenddirname` as redis.conf sets them.
    fn persistence_names(&self) -> (String, String) {
        (
            self.configured("dbfilename")
                .unwrap_or_else(|| "dump.rdb".into()),
            self.configured("appenddirname")
                .unwrap_or_else(|| "appendonlydir".into()),
        )
    }

    /// `appendfilename`, the prefix of every AOF file and of the manifest.
    fn aof_file_name(&self) -> String {
        self.configured("appendfilename")
            .unwrap_or_else(|| "appendonly.aof".into())
    }

    fn write_config(&self) {
        let b = &self.builder;
        let listen = match &b.tls {
            Some(tls) => tls.directives(self.port, b.cluster),
            None => format!("port {}\n", self.port),
        };
        let mut conf = format!(
            "{listen}\
             bind 127.0.0.1\n\
             dir {dir:?}\n\
             daemonize no\n\
             # stdout, which goes to redis.log\n\
             logfile \"\"\n\
             save \"\"\n\
             appendonly {aof}\n\
             appendfsync always\n\
             # DEBUG SLEEP and friends let tests simulate a stalled server\n\
             enable-debug-command local\n",
            dir = self.dir.display().to_string(),
            aof = if b.appendonly { "yes" } else { "no" },
        );
        if b.cluster {
            conf.push_str(
                "cluster-enabled yes\n\
                 cluster-config-file nodes.conf\n",
            );
            // Written only when the builder has none: redis.conf takes the
            // last of repeated directives, but one line per directive keeps
            // the file readable in a failure report.
            if self.configured("cluster-node-timeout").is_none() {
                conf.push_str("cluster-node-timeout 5000\n");
            }
        }
        for (directive, value) in &b.config {
            conf.push_str(&format!("{directive} {value}\n"));
        }
        let path = self.dir.join("redis.conf");
        std::fs::write(&path, conf).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }

    /// `fresh_log` truncates the log, so a retried port race does not leave
    /// the previous attempt's "Address already in use" behind.
    fn spawn(&mut self, fresh_log: bool) {
        let log_path = self.log_path();
        let log = OpenOptions::new()
            .create(true)
            .write(true)
            .append(!fresh_log)
            .truncate(fresh_log)
            .open(&log_path)
            .unwrap_or_else(|e| panic!("open {}: {e}", log_path.display()));
        let log_dup = log.try_clone().expect("clone log file handle");
        let child = Command::new(binary(SERVER_BIN))
            .arg(self.dir.join("redis.conf"))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log_dup)
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {SERVER_BIN}: {e}"));
        self.last_pid = Some(child.id());
        self.last_exit = None;
        self.child = Some(child);
    }

    /// Polls PING until `+PONG` (not `-LOADING` while the AOF replays);
    /// `Err` with the exit status if the process exits first.
    async fn wait_ready(&mut self) -> Result<(), ExitStatus> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("wait_ready on a started server");
            if let Some(status) = child.try_wait().expect("try_wait on redis-server") {
                self.child = None;
                self.last_exit = Some(status);
                return Err(status);
            }
            let last = match ping(self.addr()).await {
                Ok(RespValue::Simple(s)) if s == "PONG" => return Ok(()),
                Ok(other) => format!("{other:?}"),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "redis-server not ready on {} after {READY_TIMEOUT:?} (last probe: {last})",
                    self.addr()
                );
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }
}

async fn ping(addr: SocketAddr) -> io::Result<RespValue> {
    let mut client = RespClient::try_connect_within(addr, PROBE_TIMEOUT).await?;
    client.try_cmd_within(&["PING"], PROBE_TIMEOUT).await
}

/// Runs `BGREWRITEAOF` and waits until that rewrite is done, so the AOF
/// directory holds a fresh base and its manifest is not about to change.
async fn rewrite_aof(client: &mut RespClient) {
    let addr = client.addr();
    let deadline = Instant::now() + READY_TIMEOUT;
    let info = client.info_map(&["INFO", "persistence"]).await;
    let rewrites_before = info_u64(&info, "aof_rewrites", addr);
    loop {
        let reply = client.cmd(&["BGREWRITEAOF"]).await;
        match reply.as_error() {
            // "started", or "scheduled" behind a running RDB save.
            None => break,
            // A rewrite we did not ask for: it may have forked before the
            // latest writes; wait for it and start ours.
            Some(e) if e.contains("in progress") && Instant::now() < deadline => {
                tokio::time::sleep(READY_POLL).await;
            }
            Some(_) => panic!("BGREWRITEAOF on {addr}: {reply:?}"),
        }
    }
    loop {
        let info = client.info_map(&["INFO", "persistence"]).await;
        let get = |k: &str| {
            info.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        // aof_rewrites counts forks, so it moves as soon as ours started;
        // in_progress drops only after the manifest names the new files.
        let done = info_u64(&info, "aof_rewrites", addr) > rewrites_before
            && get("aof_rewrite_in_progress") == Some("0")
            && get("aof_rewrite_scheduled") == Some("0");
        if done {
            assert_eq!(
                get("aof_last_bgrewrite_status"),
                Some("ok"),
                "AOF rewrite on {addr} failed: {info:?}"
            );
            return;
        }
        if Instant::now() >= deadline {
            panic!("AOF rewrite on {addr} not done after {READY_TIMEOUT:?}: {info:?}");
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

fn info_u64(info: &[(String, String)], key: &str, addr: SocketAddr) -> u64 {
    info.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric {key} in INFO of {addr}: {info:?}"))
}

/// The base and incremental files an AOF manifest of Redis 7 lists, one
/// `file NAME seq N type T` line each (`b` base, `i` incremental, `h`
/// history: left over from an older rewrite and never loaded).
fn aof_manifest_files(manifest: &str) -> Vec<String> {
    let mut files = Vec::new();
    for line in manifest.lines().filter(|l| !l.trim().is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let field = |key: &str| {
            words
                .chunks(2)
                .find(|pair| pair[0] == key)
                .and_then(|pair| pair.get(1).copied())
        };
        let (Some(name), Some(kind)) = (field("file"), field("type")) else {
            panic!("unexpected AOF manifest line {line:?} in:\n{manifest}");
        };
        // Redis quotes names with special characters; ours have none.
        assert!(
            !name.starts_with('"'),
            "quoted AOF file name in:\n{manifest}"
        );
        if kind != "h" {
            files.push(name.to_string());
        }
    }
    assert!(!files.is_empty(), "AOF manifest lists no file:\n{manifest}");
    files
}

fn create_dir(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
}

fn copy_file(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), to.display()));
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        set_access(self.port, None);
        if std::thread::panicking() {
            let log = self.log();
            let tail =
                &log[super::floor_char_boundary(&log, log.len().saturating_sub(LOG_TAIL_BYTES))..];
            let exit = self
                .last_exit
                .map_or_else(|| "unknown".to_string(), |s| s.to_string());
            eprintln!(
                "--- redis-server {} log {} (pid {:?}, {exit}) ---\n{tail}\n--- end of redis-server log ---",
                self.addr(),
                self.log_path().display(),
                self.last_pid,
            );
        }
        if std::env::var_os(KEEP_LOGS_VAR).is_some() {
            eprintln!("redis-server directory kept at {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Resolves a Redis binary on PATH (or /usr/sbin, which a non-root PATH
/// may lack). A missing binary is always a panic: a Redis test that passes
/// without Redis proves nothing.
fn binary(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file());
    match found {
        Some(path) => path,
        None if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{name} not found; scripts/test installs it")
        }
        None => panic!(
            "{name} not found on PATH; install Debian packages redis-server and redis-tools \
             (scripts/test does it)"
        ),
    }
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// A free port whose cluster bus port (port + 10000) is free and valid too.
fn free_cluster_port() -> u16 {
    for _ in 0..200 {
        let port = free_port();
        if port < u16::MAX - CLUSTER_BUS_OFFSET && port_is_free(port + CLUSTER_BUS_OFFSET) {
            return port;
        }
    }
    panic!("no free port P below 55535 with P+10000 free after 200 tries")
}

// ---------------------------------------------------------------------------
// Cluster
// ---------------------------------------------------------------------------

/// `cluster-node-timeout` of [`RedisCluster::start_with_replicas`]: a killed
/// master is flagged failing after about this long, and its replica is
/// promoted within a few seconds.
const REPLICA_CLUSTER_NODE_TIMEOUT_MS: u32 = 1_000;
/// How long a failover or a rejoin may take: a few node timeouts plus the
/// replica's election delay, with room for a loaded machine.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(30);
const CLUSTER_POLL: Duration = Duration::from_millis(50);

/// A Redis Cluster with every slot assigned: masters only
/// ([`RedisCluster::start`]), or masters with replicas that take over when a
/// master is killed ([`RedisCluster::start_with_replicas`]). Nodes are
/// numbered in start order; a node keeps its index, port, directory and
/// cluster id across restarts, whatever its role. Dropping the cluster kills
/// every node.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    /// `CLUSTER MYID` of each node (kept in its `nodes.conf`).
    ids: Vec<String>,
}

impl RedisCluster {
    /// Starts `masters` cluster-enabled servers, splits the 16384 slots
    /// between them (with `redis-cli --cluster create` from 3 masters on,
    /// which refuses fewer; by hand below that) and waits until every node
    /// reports `cluster_state:ok`.
    pub async fn start(masters: usize) -> RedisCluster {
        Self::start_masters(masters, false).await
    }

    /// Like [`RedisCluster::start`], with AOF on every node
    /// ([`RedisBuilder::appendonly`]): a node that is stopped and started
    /// again ([`RedisServer::stop`], [`RedisServer::start_again`]) keeps every
    /// acknowledged write, and [`RedisServer::restart_without_data`] loses
    /// them all.
    pub async fn start_persistent(masters: usize) -> RedisCluster {
        Self::start_masters(masters, true).await
    }

    /// Like [`RedisCluster::start`] with TLS only: clients, the cluster bus and replication
    /// (`tls-cluster`, `tls-replication`); `tls.server` must also be a client certificate
    /// ([`TestPki::peer_cert`], as [`RedisTls::new`] makes it), for the bus. `configure` adds
    /// directives to every node (ACL users, say).
    pub async fn start_tls(
        masters: usize,
        tls: RedisTls,
        configure: impl Fn(RedisBuilder) -> RedisBuilder,
    ) -> RedisCluster {
        let builder = RedisBuilder {
            cluster: true,
            ..RedisBuilder::default()
        }
        .tls(tls);
        Self::start_masters_with(masters, configure(builder)).await
    }

    async fn start_masters(masters: usize, appendonly: bool) -> RedisCluster {
        let builder = RedisBuilder {
            cluster: true,
            ..RedisBuilder::default()
        }
        .appendonly(appendonly);
        Self::start_masters_with(masters, builder).await
    }

    async fn start_masters_with(masters: usize, builder: RedisBuilder) -> RedisCluster {
        assert!(masters >= 1, "a cluster needs at least one master");
        let cluster = Self::start_nodes(masters, builder).await;
        if masters >= 3 {
            cluster.create_with_redis_cli(0).await;
        } else {
            cluster.create_by_hand().await;
        }
        cluster.wait_ok().await;
        cluster
    }

    /// Starts `masters * (1 + replicas)` cluster-enabled servers without
    /// persistence and forms a cluster of `masters` masters with `replicas`
    /// replicas each (`redis-cli --cluster create --cluster-replicas`, which
    /// picks the roles: ask [`RedisCluster::masters`]). Returns once every
    /// node reports `cluster_state:ok` and every master streams its writes
    /// to its replicas, so a failover can promote them right away.
    ///
    /// Replication stays asynchronous: a write is on a replica only once
    /// `WAIT` on the connection that wrote it says so.
    ///
    /// The node timeout is 1 s, so a killed master's replica takes over in a
    /// few seconds; a node stalled that long (DEBUG SLEEP) is failed over too.
    pub async fn start_with_replicas(masters: usize, replicas: usize) -> RedisCluster {
        assert!(
            masters >= 3,
            "redis-cli --cluster create needs at least 3 masters, got {masters}"
        );
        assert!(
            replicas >= 1,
            "no replicas: use RedisCluster::start({masters})"
        );
        let builder = RedisBuilder {
            cluster: true,
            ..RedisBuilder::default()
        }
        .config(
            "cluster-node-timeout",
            REPLICA_CLUSTER_NODE_TIMEOUT_MS.to_string(),
        )
        // Redis 7.0 streams the initial sync to replicas without a file
        // (repl-diskless-sync yes) but first waits 5 s for more replicas to
        // share it; nothing would share it here.
        .config("repl-diskless-sync-delay", "0");
        let cluster = Self::start_nodes(masters * (1 + replicas), builder).await;
        cluster.create_with_redis_cli(replicas).await;
        cluster.wait_ok().await;
        cluster.wait_replicas_synced().await;
        cluster.wait_replication_streams().await;
        cluster
    }

    async fn start_nodes(count: usize, builder: RedisBuilder) -> RedisCluster {
        let mut nodes = Vec::with_capacity(count);
        let mut ids = Vec::with_capacity(count);
        for _ in 0..count {
            let node = builder.clone().start().await;
            let reply = node.client().await.cmd(&["CLUSTER", "MYID"]).await;
            let id = reply
                .as_str()
                .unwrap_or_else(|| panic!("CLUSTER MYID on {}: {reply:?}", node.addr()))
                .to_string();
            nodes.push(node);
            ids.push(id);
        }
        RedisCluster { nodes, ids }
    }

    async fn create_with_redis_cli(&self, replicas: usize) {
        let mut cmd = tokio::process::Command::new(binary(CLI_BIN));
        let first = &self.nodes[0].builder;
        if let Some(tls) = &first.tls {
            cmd.arg("--tls")
                .arg("--cacert")
                .arg(&tls.ca_file)
                .arg("--cert")
                .arg(&tls.client.cert)
                .arg("--key")
                .arg(&tls.client.key);
        }
        if let Some((user, password)) = first.harness_user.as_deref() {
            cmd.args([
                "--user",
                user.as_str(),
                "--pass",
                password.as_str(),
                "--no-auth-warning",
            ]);
        }
        cmd.args(["--cluster", "create"])
            .args(self.nodes().iter().map(ToString::to_string))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let output = tokio::time::timeout(CLUSTER_READY_TIMEOUT, cmd.output())
            .await
            .unwrap_or_else(|_| {
                panic!("redis-cli --cluster create hung for {CLUSTER_READY_TIMEOUT:?}")
            })
            .unwrap_or_else(|e| panic!("run {CLI_BIN}: {e}"));
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
    }

    /// What `redis-cli --cluster create` does, for 1 or 2 masters: contiguous
    /// slot ranges, distinct config epochs (so no epoch collision has to be
    /// resolved), then every node meets the first.
    async fn create_by_hand(&self) {
        let n = self.nodes.len();
        let first = self.nodes[0].addr();
        for (i, node) in self.nodes.iter().enumerate() {
            let mut client = node.client().await;
            let lo = usize::from(CLUSTER_SLOTS) * i / n;
            let hi = usize::from(CLUSTER_SLOTS) * (i + 1) / n - 1;
            let reply = client
                .cmd(&["CLUSTER", "ADDSLOTSRANGE", &lo.to_string(), &hi.to_string()])
                .await;
            assert!(
                reply.is_ok(),
                "CLUSTER ADDSLOTSRANGE on {}: {reply:?}",
                node.addr()
            );
            let epoch = (i + 1).to_string();
            let reply = client.cmd(&["CLUSTER", "SET-CONFIG-EPOCH", &epoch]).await;
            assert!(
                reply.is_ok(),
                "CLUSTER SET-CONFIG-EPOCH on {}: {reply:?}",
                node.addr()
            );
            if i > 0 {
                let reply = client
                    .cmd(&[
                        "CLUSTER",
                        "MEET",
                        &first.ip().to_string(),
                        &first.port().to_string(),
                    ])
                    .await;
                assert!(reply.is_ok(), "CLUSTER MEET on {}: {reply:?}", node.addr());
            }
        }
    }

    /// Waits until every running node says `cluster_state:ok`, knows every
    /// node (a killed node stays known: the cluster only flags it failing),
    /// sees all slots assigned and all served by nodes it does not consider
    /// failing; panics with the last CLUSTER INFO otherwise. Stopped nodes are
    /// not asked.
    pub async fn wait_ok(&self) {
        let deadline = Instant::now() + CLUSTER_READY_TIMEOUT;
        loop {
            let Err(why) = self.all_ok().await else {
                return;
            };
            if Instant::now() >= deadline {
                panic!("cluster not ok after {CLUSTER_READY_TIMEOUT:?}: {why}");
            }
            tokio::time::sleep(CLUSTER_POLL).await;
        }
    }

    /// `Err` says which running node is not ok, and why.
    async fn all_ok(&self) -> Result<(), String> {
        let want_nodes = self.nodes.len().to_string();
        let want_slots = CLUSTER_SLOTS.to_string();
        for (_, node) in self.running() {
            let addr = node.addr();
            let info = query(addr, &["CLUSTER", "INFO"])
                .await
                .map_err(|e| format!("CLUSTER INFO on {addr}: {e}"))?;
            let get = |k: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
                    .map(str::trim)
            };
            let ok = get("cluster_state") == Some("ok")
                && get("cluster_known_nodes") == Some(want_nodes.as_str())
                && get("cluster_slots_assigned") == Some(want_slots.as_str())
                && get("cluster_slots_ok") == Some(want_slots.as_str());
            if !ok {
                return Err(format!("node {addr}: {info}"));
            }
        }
        Ok(())
    }

    /// Waits until every running replica reports `master_link_status:up`.
    async fn wait_replicas_synced(&self) {
        let deadline = Instant::now() + CLUSTER_READY_TIMEOUT;
        'poll: loop {
            for (_, node) in self.running() {
                let addr = node.addr();
                let info = query(addr, &["INFO", "replication"]).await;
                let synced = info.as_ref().is_ok_and(|text| {
                    !text.contains("role:slave") || text.contains("master_link_status:up")
                });
                if !synced {
                    if Instant::now() >= deadline {
                        panic!(
                            "replica {addr} not synced after {CLUSTER_READY_TIMEOUT:?}: {info:?}"
                        );
                    }
                    tokio::time::sleep(CLUSTER_POLL).await;
                    continue 'poll;
                }
            }
            return;
        }
    }

    /// Waits until every master with running replicas gets a write of its
    /// own acknowledged by all of them (`SET` and `DEL` of a scratch key in
    /// one of its slots, then `WAIT`). A replica reports its link up as soon
    /// as the initial (diskless) sync is loaded, but Redis 7.0 holds the
    /// writes that follow in the master's buffer until the replica's next
    /// `REPLCONF ACK`, up to a second later: a master killed meanwhile takes
    /// them along although `INFO` looked ready.
    async fn wait_replication_streams(&self) {
        let deadline = Instant::now() + CLUSTER_READY_TIMEOUT;
        let (_, text) = self.any_cluster_nodes().await;
        let entries = parse_cluster_nodes(&text);
        let masters = entries
            .iter()
            .filter(|n| n.has_flag("master") && !n.has_flag("fail") && !n.slots.is_empty());
        for master in masters {
            let replicas = entries
                .iter()
                .filter(|n| {
                    n.master_id.as_deref() == Some(master.id.as_str())
                        && !n.has_flag("fail")
                        && !n.has_flag("fail?")
                })
                .count();
            if replicas == 0 {
                continue;
            }
            let key = (0..)
                .map(|n| format!("posthorn:harness:replication:{{{n}}}"))
                .find(|key| master.owns(key_slot(key)))
                .expect("some tag hashes into the master's slots");
            let addr = master
                .addr
                .unwrap_or_else(|| panic!("master {} without address", master.id));
            // WAIT counts acknowledgements of this connection's writes only.
            let mut client = RespClient::connect(addr).await;
            let want = i64::try_from(replicas).expect("replica count fits i64");
            loop {
                let set = client.cmd(&["SET", &key, "1"]).await;
                assert!(set.is_ok(), "SET {key} on {addr}: {set:?}");
                client.cmd(&["DEL", &key]).await;
                let acked = client.cmd(&["WAIT", &replicas.to_string(), "1000"]).await;
                if acked.as_int().is_some_and(|n| n >= want) {
                    break;
                }
                if Instant::now() >= deadline {
                    panic!(
                        "{addr} does not stream writes to its {replicas} replicas after                          {CLUSTER_READY_TIMEOUT:?} (WAIT: {acked:?})\n{}",
                        self.report().await
                    );
                }
            }
        }
    }

    /// `redis://` URL of the first node; cluster clients discover the rest.
    pub fn seed_url(&self) -> String {
        self.nodes[0].url()
    }

    /// Every node's address, by index, whatever its role and state.
    pub fn nodes(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(RedisServer::addr).collect()
    }

    /// One node, e.g. to [`RedisServer::stop`] it.
    pub fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    pub fn node_mut(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// The cluster id (`CLUSTER MYID`) of node `i`, as `CLUSTER NODES` shows
    /// it.
    pub fn node_id(&self, i: usize) -> &str {
        &self.ids[i]
    }

    /// The index of the node listening on `addr`.
    pub fn index_of(&self, addr: SocketAddr) -> Option<usize> {
        self.nodes.iter().position(|n| n.addr() == addr)
    }

    fn running(&self) -> impl Iterator<Item = (usize, &RedisServer)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.pid().is_some())
    }

    /// The masters that serve slots, per `CLUSTER NODES` on the first running
    /// node that answers, in slot order; a master the cluster has flagged
    /// failed (`fail`) is left out, one only suspected (`fail?`) is not.
    pub async fn masters(&self) -> Vec<SocketAddr> {
        let (seed, text) = self.any_cluster_nodes().await;
        let mut masters: Vec<(u16, SocketAddr)> = parse_cluster_nodes(&text)
            .into_iter()
            .filter(|n| n.has_flag("master") && !n.has_flag("fail") && !n.slots.is_empty())
            .map(|n| {
                let addr = n
                    .addr
                    .unwrap_or_else(|| panic!("master {} without address on {seed}", n.id));
                (n.slots[0].0, addr)
            })
            .collect();
        masters.sort_unstable();
        masters.into_iter().map(|(_, addr)| addr).collect()
    }

    async fn any_cluster_nodes(&self) -> (SocketAddr, String) {
        let mut errors = Vec::new();
        for (_, node) in self.running() {
            match query(node.addr(), &["CLUSTER", "NODES"]).await {
                Ok(text) => return (node.addr(), text),
                Err(e) => errors.push(format!("{}: {e}", node.addr())),
            }
        }
        panic!("no running cluster node answers CLUSTER NODES: {errors:?}")
    }

    /// The node that masters `key`'s slot, per `CLUSTER SLOTS` on the first
    /// running node that answers (what a cluster client would be told).
    pub async fn master_of_slot_of(&self, key: &str) -> SocketAddr {
        let slot = i64::from(key_slot(key));
        let mut last_error = None;
        for (_, node) in self.running() {
            let seed = node.addr();
            let slots = match RespClient::try_connect(seed).await {
                Ok(mut client) => client.try_cmd(&["CLUSTER", "SLOTS"]).await,
                Err(e) => Err(e),
            };
            let slots = match slots {
                Ok(slots) => slots,
                Err(e) => {
                    last_error = Some(format!("{seed}: {e}"));
                    continue;
                }
            };
            let ranges = slots
                .as_array()
                .unwrap_or_else(|| panic!("CLUSTER SLOTS on {seed}: {slots:?}"));
            for range in ranges {
                let r = range.as_array().expect("CLUSTER SLOTS entry is an array");
                let (Some(lo), Some(hi)) = (r[0].as_int(), r[1].as_int()) else {
                    panic!("CLUSTER SLOTS entry without a range: {range:?}");
                };
                if (lo..=hi).contains(&slot) {
                    let master = r[2].as_array().expect("CLUSTER SLOTS master is an array");
                    let host = master[0].as_str().unwrap_or_default();
                    let ip = if host.is_empty() {
                        Ipv4Addr::LOCALHOST.into()
                    } else {
                        host.parse()
                            .unwrap_or_else(|e| panic!("CLUSTER SLOTS host {host:?}: {e}"))
                    };
                    let port = master[1].as_int().expect("CLUSTER SLOTS port");
                    return SocketAddr::new(ip, u16::try_from(port).expect("port fits u16"));
                }
            }
            panic!("slot {slot} of {key} is not assigned on {seed}: {slots:?}")
        }
        panic!("no running cluster node answers CLUSTER SLOTS (last error: {last_error:?})")
    }

    /// The node that owns `key`'s slot; same as
    /// [`RedisCluster::master_of_slot_of`].
    pub async fn owner_of(&self, key: &str) -> SocketAddr {
        self.master_of_slot_of(key).await
    }

    /// SIGKILLs the master of `key`'s slot; returns its index, for
    /// [`RedisCluster::wait_failover`] and [`RedisCluster::restart_node`].
    pub async fn kill_master_of(&mut self, key: &str) -> usize {
        let master = self.master_of_slot_of(key).await;
        let i = self
            .index_of(master)
            .unwrap_or_else(|| panic!("master {master} of {key} is not a node of this cluster"));
        self.nodes[i].kill();
        i
    }

    /// Waits until a replica of the killed (or stopped) master `killed` took
    /// over its slots and every running node agrees: the old master flagged
    /// `fail` and without slots, the new one serving them, `cluster_state:ok`
    /// with every slot assigned and served. Returns the new master's index.
    /// Panics after [`FAILOVER_TIMEOUT`] with every node's CLUSTER NODES.
    pub async fn wait_failover(&self, killed: usize) -> usize {
        assert!(
            self.nodes[killed].pid().is_none(),
            "node {killed} ({}) is running; kill it first",
            self.nodes[killed].addr()
        );
        // The dead node cannot be asked and the others forget its slots as
        // soon as a replica claims them: its nodes.conf, saved (and fsynced)
        // on every configuration change, has its last word.
        let slots = self.slots_in_nodes_conf(killed);
        let Some(&(slot, _)) = slots.first() else {
            panic!("node {killed} owned no slots when it died: nothing to fail over");
        };
        let deadline = Instant::now() + FAILOVER_TIMEOUT;
        loop {
            let why = match self.failover_state(killed, slot).await {
                Ok(new_master) => match self.all_ok().await {
                    Ok(()) => return new_master,
                    Err(why) => why,
                },
                Err(why) => why,
            };
            if Instant::now() >= deadline {
                panic!(
                    "no failover of node {killed} ({}) after {FAILOVER_TIMEOUT:?}: {why}\n{}",
                    self.nodes[killed].addr(),
                    self.report().await
                );
            }
            tokio::time::sleep(CLUSTER_POLL).await;
        }
    }

    /// `Ok(index)` of the new master of `slot` once every running node sees
    /// node `killed` as failed, slotless, and the same other master owning
    /// `slot`.
    async fn failover_state(&self, killed: usize, slot: u16) -> Result<usize, String> {
        let killed_id = &self.ids[killed];
        let mut owner: Option<&str> = None;
        for (_, node) in self.running() {
            let addr = node.addr();
            let text = query(addr, &["CLUSTER", "NODES"])
                .await
                .map_err(|e| format!("CLUSTER NODES on {addr}: {e}"))?;
            let entries = parse_cluster_nodes(&text);
            let old = entries
                .iter()
                .find(|n| &n.id == killed_id)
                .ok_or_else(|| format!("{addr} does not know node {killed}"))?;
            if !old.has_flag("fail") || !old.slots.is_empty() {
                return Err(format!("{addr} still sees node {killed} as {old:?}"));
            }
            let new = entries
                .iter()
                .find(|n| n.owns(slot))
                .ok_or_else(|| format!("{addr} sees slot {slot} unassigned"))?;
            if !new.has_flag("master") || new.has_flag("fail") || new.has_flag("fail?") {
                return Err(format!("{addr} sees slot {slot} on {new:?}"));
            }
            let new_id = self
                .ids
                .iter()
                .find(|id| **id == new.id)
                .ok_or_else(|| format!("{addr} sees slot {slot} on a stranger: {new:?}"))?;
            if owner.is_some_and(|o| o != new_id) {
                return Err(format!(
                    "nodes disagree on the master of slot {slot}: {owner:?} and {new_id}"
                ));
            }
            owner = Some(new_id);
        }
        let owner = owner.ok_or("no running node")?;
        Ok(self
            .ids
            .iter()
            .position(|id| id == owner)
            .expect("owner is one of ids"))
    }

    /// Starts the killed (or stopped) node `i` again on its port and
    /// directory and waits until it is back as a replica: it reports
    /// `role:slave` with `master_link_status:up`, every running node sees it
    /// as a healthy replica, the cluster is ok and its master streams writes
    /// to it (see [`RedisCluster::start_with_replicas`]). A failed-over master
    /// rejoins as a replica of the master that replaced it; without AOF it
    /// comes back empty and resyncs in full. Panics if it comes back as the
    /// master of slots (it was a master restarted before
    /// [`RedisCluster::wait_failover`] saw its replica take over: use
    /// [`RedisServer::start_again`] and [`RedisCluster::wait_ok`] for that).
    pub async fn restart_node(&mut self, i: usize) {
        self.nodes[i].start_again().await;
        let deadline = Instant::now() + FAILOVER_TIMEOUT;
        loop {
            let why = match self.rejoined_as_replica(i).await {
                Ok(()) => match self.all_ok().await {
                    Ok(()) => break,
                    Err(why) => why,
                },
                Err(why) => why,
            };
            if Instant::now() >= deadline {
                panic!(
                    "node {i} ({}) not back as a replica after {FAILOVER_TIMEOUT:?}: {why}\n{}",
                    self.nodes[i].addr(),
                    self.report().await
                );
            }
            tokio::time::sleep(CLUSTER_POLL).await;
        }
        self.wait_replication_streams().await;
    }

    async fn rejoined_as_replica(&self, i: usize) -> Result<(), String> {
        let addr = self.nodes[i].addr();
        let id = &self.ids[i];
        for (j, node) in self.running() {
            let seen_from = node.addr();
            let text = query(seen_from, &["CLUSTER", "NODES"])
                .await
                .map_err(|e| format!("CLUSTER NODES on {seen_from}: {e}"))?;
            let entry = parse_cluster_nodes(&text)
                .into_iter()
                .find(|n| &n.id == id)
                .ok_or_else(|| format!("{seen_from} does not know node {i}"))?;
            // The others keep the slots of a master that was never replaced:
            // waiting would not change that.
            if j != i && !entry.slots.is_empty() {
                panic!(
                    "node {i} ({addr}) is back as the master of {:?}: no replica took over \
                     before it restarted\n{}",
                    entry.slots,
                    self.report().await
                );
            }
            if !entry.has_flag("slave") || entry.has_flag("fail") || entry.has_flag("fail?") {
                return Err(format!("{seen_from} sees node {i} as {entry:?}"));
            }
        }
        let info = query(addr, &["INFO", "replication"])
            .await
            .map_err(|e| format!("INFO replication on {addr}: {e}"))?;
        if !info.contains("role:slave") || !info.contains("master_link_status:up") {
            return Err(format!("node {i} ({addr}): {info}"));
        }
        Ok(())
    }

    /// The slot ranges node `i` last claimed for itself in its `nodes.conf`
    /// (same line format as CLUSTER NODES, plus a `vars` line).
    fn slots_in_nodes_conf(&self, i: usize) -> Vec<(u16, u16)> {
        let path = self.nodes[i].dir().join("nodes.conf");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        parse_cluster_nodes(&text)
            .into_iter()
            .find(|n| n.has_flag("myself"))
            .unwrap_or_else(|| panic!("no `myself` line in {}:\n{text}", path.display()))
            .slots
    }

    /// CLUSTER NODES as seen by every running node, for failure messages.
    async fn report(&self) -> String {
        let mut out = String::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let addr = node.addr();
            let state = if node.pid().is_none() {
                "stopped".to_string()
            } else {
                match query(addr, &["CLUSTER", "NODES"]).await {
                    Ok(text) => format!("CLUSTER NODES:\n{text}"),
                    Err(e) => format!("CLUSTER NODES failed: {e}"),
                }
            };
            out.push_str(&format!(
                "--- node {i} {addr} id {}: {state}\n",
                self.ids[i]
            ));
        }
        out
    }

    /// A connection to the node owning `key`.
    pub async fn client_for_key(&self, key: &str) -> RespClient {
        RespClient::connect(self.owner_of(key).await).await
    }

    /// Runs `args` on the owner of `key`; if the slot moved meanwhile, follows
    /// one `-MOVED` redirect.
    pub async fn cmd_for_key(&self, key: &str, args: &[&str]) -> RespValue {
        let mut client = self.client_for_key(key).await;
        let reply = client.cmd(args).await;
        let moved = reply.as_error().is_some_and(|e| e.starts_with("MOVED "));
        match redirect_target(&reply) {
            Some((_, target)) if moved => RespClient::connect(target).await.cmd(args).await,
            _ => reply,
        }
    }

    /// `XADD key * fields...` on the node owning `key`; returns the id.
    pub async fn xadd(&self, key: &str, fields: &[(&str, &str)]) -> String {
        let reply = self.cmd_for_key(key, &xadd_args(key, fields)).await;
        expect_id(&reply, format_args!("the cluster, key {key}"))
    }

    /// `FLUSHALL` on every master (each only holds its own slots' keys;
    /// replicas follow, and refuse writes themselves).
    pub async fn flushall(&self) {
        for master in self.masters().await {
            RespClient::connect(master).await.flushall().await;
        }
    }
}

/// One short command whose reply is text (CLUSTER INFO, CLUSTER NODES,
/// INFO): `Err` on I/O errors, timeouts and error replies, so polling loops
/// can retry.
async fn query(addr: SocketAddr, args: &[&str]) -> Result<String, String> {
    let mut client = RespClient::try_connect_within(addr, PROBE_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    let reply = client
        .try_cmd_within(args, PROBE_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    match reply.as_str() {
        Some(text) => Ok(text.to_string()),
        None => Err(format!("{reply:?}")),
    }
}

/// One node as a line of CLUSTER NODES or `nodes.conf` describes it:
/// `id ip:port@bus[,hostname] flags master-id ping pong epoch link slot...`.
#[derive(Debug, Clone)]
struct ClusterNodeEntry {
    id: String,
    /// `None` for a node whose address is not known yet (`:0@0`).
    addr: Option<SocketAddr>,
    flags: Vec<String>,
    /// The master of a replica (`-` for a master).
    master_id: Option<String>,
    slots: Vec<(u16, u16)>,
}

impl ClusterNodeEntry {
    /// `flag` exactly: `fail` (agreed) is not `fail?` (suspected).
    fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(lo, hi)| (lo..=hi).contains(&slot))
    }
}

fn parse_cluster_nodes(text: &str) -> Vec<ClusterNodeEntry> {
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("vars "))
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            assert!(words.len() >= 8, "short CLUSTER NODES line {line:?}");
            let endpoint = words[1].split(['@', ',']).next().unwrap_or_default();
            let addr = endpoint.rsplit_once(':').and_then(|(host, port)| {
                let port: u16 = port.parse().ok().filter(|&p| p != 0)?;
                let ip = if host.is_empty() {
                    Ipv4Addr::LOCALHOST.into()
                } else {
                    host.parse().ok()?
                };
                Some(SocketAddr::new(ip, port))
            });
            // Slots being imported or migrated show as `[slot->-id]` and
            // `[slot-<-id]`; only owned ranges matter here.
            let slots = words[8..]
                .iter()
                .filter(|w| !w.starts_with('['))
                .map(|w| {
                    let (lo, hi) = w.split_once('-').unwrap_or((w, w));
                    let parse = |s: &str| -> u16 {
                        s.parse()
                            .unwrap_or_else(|_| panic!("bad slot {w:?} in {line:?}"))
                    };
                    (parse(lo), parse(hi))
                })
                .collect();
            ClusterNodeEntry {
                id: words[0].to_string(),
                addr,
                flags: words[2].split(',').map(str::to_string).collect(),
                master_id: (words[3] != "-").then(|| words[3].to_string()),
                slots,
            }
        })
        .collect()
}

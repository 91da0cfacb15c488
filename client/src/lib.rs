//! The reference POS client (docs/client-contract.md), used by `posthorn tail` and embeddable in a Rust POS app.
//!
//! - Sends `Last-Event-ID` from its stored cursor (at-least-once: the cursor is persisted
//!   atomically after each event was handed to the application) or none (at-most-once: no
//!   cursor file). The server does not take part in this choice.
//! - Honours `retry:` with a floor of 1 s, backs off exponentially with full jitter (cap 60 s)
//!   after consecutive failures, resets after a healthy connection, honours a 503's
//!   `Retry-After`, and stops with an error on 401/403 (or 400) instead of hammering the hub.
//! - On `event: resync` it drops its cursor, tells the application (which reloads its state from
//!   its source of truth) and continues from the id the resync carries.
//! - Silence longer than three heartbeat intervals counts as a dead connection.
//!
//! - Speaks `http://` and `https://` (rustls; the system's certificate authorities, or those of
//!   a CA file). A certificate it cannot verify is a failed connection like any other: reported
//!   and retried with backoff, since a fleet must come back by itself once the hub's certificate
//!   is fixed.

pub mod ack;
pub mod cursor;
pub mod dechunk;
pub mod parser;
pub mod policy;

use std::{
    io,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName};
use thiserror::Error;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
};
use tokio_rustls::TlsConnector;

use self::{
    cursor::CursorFile,
    dechunk::Dechunk,
    parser::{Dispatched, Parsed, Parser},
    policy::{ReconnectPolicy, HEALTHY_AFTER},
};

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The hub's base URL, `http://host[:port]` or `https://host[:port]` (a path prefix is kept).
    pub base_url: String,
    /// For `https://`: the certificate authorities to trust, in PEM; the system's when `None`.
    pub ca_file: Option<PathBuf>,
    pub device: String,
    /// Sent as `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// At-least-once when set: the cursor survives restarts of the application.
    pub cursor_file: Option<PathBuf>,
    /// The hub's `sse.heartbeat`; three of them without a byte mean the connection is dead.
    pub heartbeat: Duration,
    /// With a cursor file: acknowledge each persisted cursor to the hub (at most once per
    /// second, see [`ack`]), so that its fleet API knows what the device has processed.
    pub ack: bool,
}

/// What the client tells the application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    Connected {
        resumed_from: Option<String>,
    },
    Event(Dispatched),
    /// The cursor could not be resumed: reload state from the source of truth.
    Resync {
        reason: String,
        id: Option<String>,
    },
    Disconnected {
        reason: String,
        reconnect_in: Duration,
    },
}

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("invalid hub URL {0:?}: expected http://host[:port] or https://host[:port]")]
    Url(String),
    #[error("cannot set up TLS: {0}")]
    Tls(String),
    #[error("the hub refused the stream with {status}: {body}")]
    Refused { status: u16, body: String },
    #[error("cursor file {path}: {source}")]
    Cursor { path: PathBuf, source: io::Error },
}

#[derive(Clone)]
struct Target {
    /// What the TCP connection goes to, and the request's `Host`.
    host_port: String,
    path: String,
    ack_path: String,
    /// For `https://`: the connector and the name the certificate must carry.
    tls: Option<(TlsConnector, ServerName<'static>)>,
}

fn target(options: &ClientOptions) -> Result<Target, ClientError> {
    let bad_url = || ClientError::Url(options.base_url.clone());
    let (https, rest) = match options.base_url.split_once("://") {
        Some(("http", rest)) => (false, rest),
        Some(("https", rest)) => (true, rest),
        _ => return Err(bad_url()),
    };
    let (authority, prefix) = match rest.split_once('/') {
        Some((authority, prefix)) => (authority, format!("/{}", prefix.trim_end_matches('/'))),
        None => (rest, String::new()),
    };
    if authority.is_empty()
        || prefix.contains(['\r', '\n'])
        || authority.contains(['\r', '\n', '@'])
    {
        return Err(bad_url());
    }
    // `[v6]:port`, `host:port`, or either without a port.
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => {
            (host, port.parse::<u16>().map_err(|_| bad_url())?)
        }
        _ => (authority, if https { 443 } else { 80 }),
    };
    let prefix = if prefix == "/" { String::new() } else { prefix };
    let tls = if https {
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(name.to_string()).map_err(|_| bad_url())?;
        Some((connector(options.ca_file.as_deref())?, name))
    } else {
        None
    };
    Ok(Target {
        host_port: format!("{host}:{port}"),
        path: format!("{prefix}/v1/devices/{}/events", options.device),
        ack_path: format!("{prefix}/v1/devices/{}/ack", options.device),
        tls,
    })
}

/// A TLS connector trusting `ca_file`'s authorities, or the system's.
fn connector(ca_file: Option<&Path>) -> Result<TlsConnector, ClientError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certificates = CertificateDer::pem_file_iter(path)
                .and_then(|found| found.collect::<Result<Vec<_>, _>>())
                .map_err(|error| {
                    ClientError::Tls(format!("CA file {}: {error}", path.display()))
                })?;
            roots.add_parsable_certificates(certificates);
            if roots.is_empty() {
                return Err(ClientError::Tls(format!(
                    "CA file {} holds no usable certificate",
                    path.display()
                )));
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if roots.is_empty() {
                return Err(ClientError::Tls(
                    "this system has no certificate authorities to trust; give a CA file".into(),
                ));
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|error| ClientError::Tls(error.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// A connection to the hub, with or without TLS.
trait Connection: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Connection for T {}

async fn connect(target: &Target) -> Result<Box<dyn Connection>, String> {
    let stream = TcpStream::connect(&target.host_port)
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", target.host_port))?;
    let _ = stream.set_nodelay(true);
    let Some((connector, name)) = &target.tls else {
        return Ok(Box::new(stream));
    };
    let stream = connector
        .connect(name.clone(), stream)
        .await
        .map_err(|error| format!("TLS handshake with {} failed: {error}", target.host_port))?;
    Ok(Box::new(stream))
}

/// How one connection ended.
enum Ended {
    /// Reconnect after the policy's delay; `retry_after` from a 503.
    Retry {
        reason: String,
        retry_after: Option<Duration>,
    },
    /// The server ended the stream itself (a drain): come back after its `retry:`.
    Closed,
    Fatal(ClientError),
}

/// Where a cursor goes once the application has its event: the cursor file, then an ack.
struct Kept<'a> {
    store: Option<&'a CursorFile>,
    acker: Option<&'a ack::Acker>,
}

/// Follows the device's stream until a fatal error (a refusal, an unusable cursor file).
pub async fn follow(
    options: ClientOptions,
    mut notify: impl FnMut(Notice),
) -> Result<(), ClientError> {
    let target = target(&options)?;
    let store = options.cursor_file.clone().map(CursorFile::new);
    let acker = (options.ack && store.is_some())
        .then(|| ack::Acker::start(target.clone(), options.token.clone()));
    let kept = Kept {
        store: store.as_ref(),
        acker: acker.as_ref(),
    };
    let mut cursor = match &store {
        Some(store) => store.load().map_err(|source| ClientError::Cursor {
            path: store.path().to_path_buf(),
            source,
        })?,
        None => None,
    };
    let mut policy = ReconnectPolicy::default();
    loop {
        let started = Instant::now();
        let mut delivered = 0u64;
        let ended = connect_once(
            &options,
            &target,
            &kept,
            &mut cursor,
            &mut policy,
            &mut delivered,
            &mut notify,
        )
        .await;
        let (reason, retry_after, closed_by_server) = match ended {
            Ended::Fatal(error) => return Err(error),
            Ended::Retry {
                reason,
                retry_after,
            } => (reason, retry_after, false),
            Ended::Closed => ("the hub ended the stream".to_string(), None, true),
        };
        let healthy = closed_by_server || delivered > 0 || started.elapsed() >= HEALTHY_AFTER;
        let reconnect_in = policy.next_delay(healthy, retry_after, &mut rand::rng());
        notify(Notice::Disconnected {
            reason,
            reconnect_in,
        });
        tokio::time::sleep(reconnect_in).await;
    }
}

async fn connect_once(
    options: &ClientOptions,
    target: &Target,
    kept: &Kept<'_>,
    cursor: &mut Option<String>,
    policy: &mut ReconnectPolicy,
    delivered: &mut u64,
    notify: &mut impl FnMut(Notice),
) -> Ended {
    let retry = |reason: String| Ended::Retry {
        reason,
        retry_after: None,
    };
    let silence = options
        .heartbeat
        .saturating_mul(3)
        .max(Duration::from_secs(1));
    let mut stream = match tokio::time::timeout(Duration::from_secs(10), connect(target)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(reason)) => return retry(reason),
        Err(_) => return retry(format!("connecting to {} timed out", target.host_port)),
    };
    let mut request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nAccept: text/event-stream\r\nCache-Control: no-cache\r\n",
        target.path, target.host_port
    );
    if let Some(cursor) = cursor.as_deref().filter(|c| !c.contains(['\r', '\n'])) {
        request.push_str(&format!("Last-Event-ID: {cursor}\r\n"));
    }
    if let Some(token) = options
        .token
        .as_deref()
        .filter(|t| !t.contains(['\r', '\n']))
    {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    request.push_str("\r\n");
    if let Err(error) = stream.write_all(request.as_bytes()).await {
        return retry(format!("cannot send the request: {error}"));
    }

    let mut buf = vec![0u8; 16 * 1024];
    let mut head = Vec::new();
    let body_start = loop {
        let n = match tokio::time::timeout(silence, stream.read(&mut buf)).await {
            Ok(Ok(0)) => return retry("closed before answering".into()),
            Ok(Ok(n)) => n,
            Ok(Err(error)) => return retry(format!("read failed: {error}")),
            Err(_) => return retry("no answer".into()),
        };
        head.extend_from_slice(&buf[..n]);
        if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if head.len() > 64 * 1024 {
            return retry("response head too large".into());
        }
    };
    let head_text = String::from_utf8_lossy(&head[..body_start]).into_owned();
    let status: u16 = head_text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let header = |name: &str| {
        head_text.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_string())
        })
    };
    let mut body = head[body_start..].to_vec();
    if status != 200 {
        let text = String::from_utf8_lossy(&body).into_owned();
        return match status {
            400 | 401 | 403 | 404 => Ended::Fatal(ClientError::Refused { status, body: text }),
            _ => Ended::Retry {
                reason: format!("the hub answered {status}"),
                retry_after: header("retry-after")
                    .and_then(|s| s.parse().ok())
                    .map(Duration::from_secs),
            },
        };
    }
    let chunked = header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    notify(Notice::Connected {
        resumed_from: cursor.clone(),
    });
    let mut dechunk = chunked.then(Dechunk::default);
    let mut parser = Parser::new();
    loop {
        let decoded = match &mut dechunk {
            Some(dechunk) => {
                let mut decoded = Vec::new();
                if let Err(error) = dechunk.feed(&body, |bytes| decoded.extend_from_slice(bytes)) {
                    return retry(error.to_string());
                }
                decoded
            }
            None => std::mem::take(&mut body),
        };
        body.clear();
        for parsed in parser.feed(&decoded) {
            match parsed {
                Parsed::Retry(ms) => policy.set_retry(Duration::from_millis(ms)),
                Parsed::Comment(_) => {}
                Parsed::Event(event) => {
                    let resync = event.event_type == "resync";
                    if resync {
                        let reason = serde_json::from_str::<serde_json::Value>(&event.data)
                            .ok()
                            .and_then(|v| v["reason"].as_str().map(String::from))
                            .unwrap_or_else(|| "unknown".into());
                        notify(Notice::Resync {
                            reason,
                            id: event.id.clone(),
                        });
                    } else {
                        *delivered += 1;
                        notify(Notice::Event(event.clone()));
                    }
                    // Persist only after the application has the event: at-least-once.
                    *cursor = event.id.clone();
                    if let (Some(store), Some(id)) = (kept.store, &event.id) {
                        if let Err(source) = store.store(id) {
                            return Ended::Fatal(ClientError::Cursor {
                                path: store.path().to_path_buf(),
                                source,
                            });
                        }
                        if let Some(acker) = kept.acker {
                            acker.persisted(id);
                        }
                    }
                }
            }
        }
        if dechunk.as_ref().is_some_and(Dechunk::finished) {
            return Ended::Closed;
        }
        match tokio::time::timeout(silence, stream.read(&mut buf)).await {
            // Without chunked framing a clean end is the peer closing the connection.
            Ok(Ok(0)) if dechunk.is_none() => return Ended::Closed,
            Ok(Ok(0)) => return retry("the connection closed mid-stream".into()),
            Ok(Ok(n)) => body.extend_from_slice(&buf[..n]),
            Ok(Err(error)) => return retry(format!("read failed: {error}")),
            Err(_) => {
                return retry(format!(
                    "no data for {}s: connection presumed dead",
                    silence.as_secs()
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(url: &str) -> ClientOptions {
        ClientOptions {
            base_url: url.into(),
            ca_file: None,
            device: "pos-1".into(),
            token: None,
            cursor_file: None,
            heartbeat: Duration::from_secs(20),
            ack: false,
        }
    }

    /// Base URLs keep a path prefix, get the scheme's port when they name none, and refuse
    /// other schemes.
    #[test]
    fn targets_from_base_urls() {
        let t = target(&options("http://127.0.0.1:8080")).unwrap();
        assert_eq!(
            (t.host_port.as_str(), t.path.as_str()),
            ("127.0.0.1:8080", "/v1/devices/pos-1/events")
        );
        assert!(t.tls.is_none());
        let t = target(&options("http://hub:80/posthorn/")).unwrap();
        assert_eq!(t.path, "/posthorn/v1/devices/pos-1/events");
        assert_eq!(target(&options("http://hub")).unwrap().host_port, "hub:80");
        assert_eq!(
            target(&options("http://[::1]:9")).unwrap().host_port,
            "[::1]:9"
        );
        assert!(target(&options("ftp://hub")).is_err());
        assert!(target(&options("http://hub:port")).is_err());
        assert!(target(&options("http://user@hub")).is_err());
    }

    /// https:// names the certificate's expected name (without brackets or port) and defaults
    /// to port 443; a CA file that holds nothing usable is an error before any connection.
    #[test]
    fn https_targets() {
        let t = target(&options("https://hub.example/prefix")).unwrap();
        assert_eq!(t.host_port, "hub.example:443");
        assert_eq!(t.path, "/prefix/v1/devices/pos-1/events");
        let (_, name) = t.tls.as_ref().expect("TLS");
        assert_eq!(name.to_str(), "hub.example");
        let t = target(&options("https://[::1]:8443")).unwrap();
        assert_eq!(t.tls.as_ref().unwrap().1.to_str(), "::1");
        let empty = std::env::temp_dir().join(format!("posthorn-client-ca-{}", std::process::id()));
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let error = target(&ClientOptions {
            ca_file: Some(empty.clone()),
            ..options("https://hub.example")
        })
        .err()
        .expect("no CA");
        std::fs::remove_file(&empty).unwrap();
        assert!(
            matches!(&error, ClientError::Tls(text) if text.contains("no usable certificate")),
            "{error}"
        );
    }
}

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
//! - Its token ([`Token`]) is asked for before every connection: a token source (a file, a
//!   callback) is asked again after `event: token_expired` (the client reconnects within a
//!   second or two, resuming with its cursor: nothing is lost) or a 401. `event: revoked`, or a
//!   401 `token_revoked`, ends it with [`ClientError::Revoked`].
//!
//! - Speaks `http://` and `https://` (rustls; the system's certificate authorities, or those of
//!   a CA file). A certificate it cannot verify is a failed connection like any other: reported
//!   and retried with backoff, since a fleet must come back by itself once the hub's certificate
//!   is fixed.

pub mod ack;
pub mod cursor;
pub mod dechunk;
pub mod http;
pub mod parser;
pub mod policy;

use std::{
    future::Future,
    io,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use rustls::pki_types::ServerName;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

use self::{
    cursor::CursorFile,
    dechunk::Dechunk,
    parser::{Dispatched, Parsed, Parser},
    policy::{ReconnectPolicy, FLOOR, HEALTHY_AFTER},
};

/// A token, as a future that answers it or why there is none.
pub type TokenFuture = Pin<Box<dyn Future<Output = Result<String, String>> + Send>>;

/// Where the client's bearer token comes from.
#[derive(Clone, Default)]
pub enum Token {
    /// No token (the hub's `auth.mode = "none"`).
    #[default]
    None,
    /// The same token for every connection: it cannot be refreshed, so a 401 is final.
    Fixed(String),
    /// Asked before every connection (a `token_expired` or a 401 makes the next one): a file
    /// that another process keeps fresh, or the application's identity provider.
    Source(Arc<dyn Fn() -> TokenFuture + Send + Sync>),
}

impl Token {
    /// A token read from `path` before every connection (surrounding white space ignored).
    pub fn file(path: PathBuf) -> Token {
        Token::Source(Arc::new(move || {
            let path = path.clone();
            Box::pin(async move {
                let text = tokio::fs::read_to_string(&path).await.map_err(|error| {
                    format!("cannot read the token file {}: {error}", path.display())
                })?;
                let token = text.trim();
                if token.is_empty() {
                    return Err(format!("the token file {} is empty", path.display()));
                }
                Ok(token.to_string())
            })
        }))
    }

    fn refreshable(&self) -> bool {
        matches!(self, Token::Source(_))
    }

    async fn get(&self) -> Result<Option<String>, String> {
        match self {
            Token::None => Ok(None),
            Token::Fixed(token) => Ok(Some(token.clone())),
            Token::Source(source) => source().await.map(Some),
        }
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Token::None => "Token::None",
            Token::Fixed(_) => "Token::Fixed(..)",
            Token::Source(_) => "Token::Source(..)",
        })
    }
}

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The hub's base URL, `http://host[:port]` or `https://host[:port]` (a path prefix is kept).
    pub base_url: String,
    /// For `https://`: the certificate authorities to trust, in PEM; the system's when `None`.
    pub ca_file: Option<PathBuf>,
    pub device: String,
    /// Sent as `Authorization: Bearer <token>`.
    pub token: Token,
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
    /// The device's tokens were revoked: a new one must be issued before it may connect again.
    #[error("the hub revoked this device's token: {0}")]
    Revoked(String),
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
    http::tls_connector(ca_file).map_err(ClientError::Tls)
}

async fn connect(target: &Target) -> Result<Box<dyn http::Connection>, String> {
    let tls = target
        .tls
        .as_ref()
        .map(|(connector, name)| (connector, name.clone()));
    http::connect(&target.host_port, tls).await
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
    /// The stream's token ended: come back soon with a fresh one.
    TokenExpired,
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
    // The token of the current connection, which the acks use too.
    let (current_token, tokens) = tokio::sync::watch::channel(None::<String>);
    let acker = (options.ack && store.is_some()).then(|| ack::Acker::start(target.clone(), tokens));
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
        let ended = match options.token.get().await {
            Ok(token) => {
                current_token.send_replace(token.clone());
                connect_once(
                    &options,
                    token.as_deref(),
                    &target,
                    &kept,
                    &mut cursor,
                    &mut policy,
                    &mut delivered,
                    &mut notify,
                )
                .await
            }
            Err(reason) => Ended::Retry {
                reason: format!("no token: {reason}"),
                retry_after: None,
            },
        };
        let (reason, retry_after, closed_by_server) = match ended {
            Ended::Fatal(error) => return Err(error),
            Ended::Retry {
                reason,
                retry_after,
            } => (reason, retry_after, false),
            Ended::Closed => ("the hub ended the stream".to_string(), None, true),
            Ended::TokenExpired => {
                // Nothing failed: come back with a fresh token within a second or two, spread
                // so that tokens minted together do not bring their devices back together.
                let reconnect_in = FLOOR + FLOOR.mul_f64(rand::random::<f64>());
                notify(Notice::Disconnected {
                    reason: "the token expired".into(),
                    reconnect_in,
                });
                tokio::time::sleep(reconnect_in).await;
                continue;
            }
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

#[allow(clippy::too_many_arguments)]
async fn connect_once(
    options: &ClientOptions,
    token: Option<&str>,
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
    if let Some(token) = token.filter(|t| !t.contains(['\r', '\n'])) {
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
            401 if text.contains("\"token_revoked\"") => Ended::Fatal(ClientError::Revoked(text)),
            // The source may have a new token by the next attempt; the back-off paces it.
            401 if options.token.refreshable() => Ended::Retry {
                reason: format!("the hub refused the token: {text}"),
                retry_after: None,
            },
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
                // The hub's own last words carry no id (an event published with such a type
                // always has one).
                Parsed::Event(event) if !event.own_id && event.event_type == "token_expired" => {
                    return Ended::TokenExpired;
                }
                Parsed::Event(event) if !event.own_id && event.event_type == "revoked" => {
                    return Ended::Fatal(ClientError::Revoked(event.data));
                }
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
            token: Token::None,
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

//! `[server]`: where the hub listens, how many HTTP workers it runs, and who may connect.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawServer;
use super::value::{int_in, optional_path, serialize_optional_path};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// As configured; 0 means one per core, see `effective_workers`.
    pub workers: usize,
    /// `workers`, or the core count when it is 0: resolved once at load, so the status shows
    /// what the server runs.
    pub effective_workers: usize,
    pub insecure: bool,
    pub cors_origins: Vec<String>,
    /// Host names, besides loopback ones, that requests may name in `Host` when auth is `none`
    /// (docs/security.md, "Requests a browser sends for someone else"); `*` turns the check off.
    pub allowed_hosts: Vec<String>,
    /// With both set the listener serves HTTPS only (docs/operations.md, "TLS").
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_cert_file: Option<PathBuf>,
    #[serde(serialize_with = "serialize_optional_path")]
    pub tls_key_file: Option<PathBuf>,
}

impl ServerConfig {
    /// The certificate chain and key files when the hub serves HTTPS.
    pub fn tls_files(&self) -> Option<(&PathBuf, &PathBuf)> {
        self.tls_cert_file.as_ref().zip(self.tls_key_file.as_ref())
    }
}

impl TryFrom<RawServer> for ServerConfig {
    type Error = ConfigError;

    fn try_from(raw: RawServer) -> Result<Self, ConfigError> {
        let listen = raw.listen.trim().parse().map_err(|_| {
            invalid(
                "server.listen",
                format!("must be an ip:port socket address (got {:?})", raw.listen),
            )
        })?;
        let workers = int_in("server.workers", raw.workers, 0, i64::MAX)?;
        for origin in &raw.cors_origins {
            if origin != "*" && !origin.starts_with("http://") && !origin.starts_with("https://") {
                return Err(invalid(
                    "server.cors_origins",
                    format!("each origin must be \"*\" or start with http:// or https:// (got {origin:?})"),
                ));
            }
        }
        let mut allowed_hosts = Vec::with_capacity(raw.allowed_hosts.len());
        for entry in raw.allowed_hosts {
            let entry = entry.trim().to_ascii_lowercase();
            // Kept as a request's Host names it once its port is cut: IPv6 without brackets.
            let host = entry
                .strip_prefix('[')
                .and_then(|rest| rest.strip_suffix(']'))
                .unwrap_or(&entry);
            let is_host = host.parse::<std::net::IpAddr>().is_ok()
                || (!host.is_empty()
                    && host
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-')));
            if host != "*" && !is_host {
                return Err(invalid(
                    "server.allowed_hosts",
                    format!("each entry must be \"*\" or a host name or address without scheme or port (got {entry:?})"),
                ));
            }
            allowed_hosts.push(host.to_string());
        }
        let tls_cert_file = optional_path(raw.tls_cert_file);
        let tls_key_file = optional_path(raw.tls_key_file);
        if tls_cert_file.is_some() != tls_key_file.is_some() {
            let (set, unset) = if tls_cert_file.is_some() {
                ("server.tls_cert_file", "server.tls_key_file")
            } else {
                ("server.tls_key_file", "server.tls_cert_file")
            };
            return Err(invalid(
                unset,
                format!("must be set together with {set} (HTTPS needs both the certificate chain and its key)"),
            ));
        }
        Ok(ServerConfig {
            listen,
            workers,
            effective_workers: effective_workers(workers),
            insecure: raw.insecure,
            cors_origins: raw.cors_origins,
            allowed_hosts,
            tls_cert_file,
            tls_key_file,
        })
    }
}

/// HTTP worker threads for `server.workers`: as configured, or the core count when it is 0.
fn effective_workers(workers: usize) -> usize {
    if workers > 0 {
        return workers;
    }
    // The core count can be unknowable (restricted /proc, odd platforms); one worker still serves.
    std::thread::available_parallelism()
        .map(std::num::NonZeroUsize::get)
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(raw: RawServer) -> Result<ServerConfig, String> {
        ServerConfig::try_from(raw).map_err(|error| error.to_string())
    }

    /// The listen address must be ip:port; surrounding blanks are forgiven.
    #[test]
    fn listen_is_a_socket_address() {
        let ok = server(RawServer {
            listen: " 0.0.0.0:9090 ".into(),
            ..RawServer::default()
        })
        .expect("valid");
        assert_eq!(ok.listen, "0.0.0.0:9090".parse().expect("addr"));
        let error = server(RawServer {
            listen: "localhost".into(),
            ..RawServer::default()
        })
        .expect_err("no port");
        assert_eq!(
            error,
            "server.listen: must be an ip:port socket address (got \"localhost\")"
        );
    }

    /// Each CORS origin is "*" or an http(s) origin.
    #[test]
    fn cors_origins_are_origins() {
        let origins = |list: &[&str]| RawServer {
            cors_origins: list.iter().map(|o| o.to_string()).collect(),
            ..RawServer::default()
        };
        assert!(server(origins(&["*", "https://a.example", "http://b:8080"])).is_ok());
        let error = server(origins(&["https://a.example", "example.com"])).expect_err("bare host");
        assert!(
            error.starts_with("server.cors_origins: ") && error.contains("\"example.com\""),
            "{error}"
        );
    }

    /// HTTPS needs both files; either alone is refused naming the missing one.
    #[test]
    fn tls_files_come_in_pairs() {
        let both = server(RawServer {
            tls_cert_file: "/etc/posthorn/cert.pem".into(),
            tls_key_file: "/etc/posthorn/key.pem".into(),
            ..RawServer::default()
        })
        .expect("valid");
        assert_eq!(
            both.tls_files(),
            Some((
                &PathBuf::from("/etc/posthorn/cert.pem"),
                &PathBuf::from("/etc/posthorn/key.pem")
            ))
        );
        assert_eq!(
            server(RawServer::default()).expect("valid").tls_files(),
            None
        );
        let error = server(RawServer {
            tls_cert_file: "/c.pem".into(),
            ..RawServer::default()
        })
        .expect_err("no key");
        assert!(
            error
                .starts_with("server.tls_key_file: must be set together with server.tls_cert_file"),
            "{error}"
        );
        let error = server(RawServer {
            tls_key_file: "/k.pem".into(),
            ..RawServer::default()
        })
        .expect_err("no cert");
        assert!(error.starts_with("server.tls_cert_file: "), "{error}");
    }

    /// Allowed hosts are names or addresses, lower-cased; a URL or a port is refused.
    #[test]
    fn allowed_hosts_are_host_names() {
        let hosts = |list: &[&str]| RawServer {
            allowed_hosts: list.iter().map(|h| h.to_string()).collect(),
            ..RawServer::default()
        };
        let ok = server(hosts(&["Hub.Internal", "10.0.0.7", "[fd00::1]", "*"])).expect("valid");
        assert_eq!(
            ok.allowed_hosts,
            ["hub.internal", "10.0.0.7", "fd00::1", "*"]
        );
        for bad in ["https://hub.internal", "hub internal", "", "hub:8080"] {
            let error = server(hosts(&[bad])).expect_err(bad);
            assert!(error.starts_with("server.allowed_hosts: "), "{error}");
        }
    }

    /// Workers: 0 means one per core (at least one), a negative count is refused.
    #[test]
    fn workers() {
        let per_core = server(RawServer::default()).expect("valid");
        assert_eq!(per_core.workers, 0);
        assert!(per_core.effective_workers >= 1);
        let three = server(RawServer {
            workers: 3,
            ..RawServer::default()
        })
        .expect("valid");
        assert_eq!((three.workers, three.effective_workers), (3, 3));
        let error = server(RawServer {
            workers: -1,
            ..RawServer::default()
        })
        .expect_err("negative");
        assert_eq!(error, "server.workers: must be at least 0 (got -1)");
    }
}

//! `[server]`: where the hub listens, how many HTTP workers it runs, and who may connect.

use std::net::SocketAddr;

use serde::Serialize;

use super::error::{invalid, ConfigError};
use super::raw::RawServer;
use super::value::int_in;

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
        Ok(ServerConfig {
            listen,
            workers,
            effective_workers: effective_workers(workers),
            insecure: raw.insecure,
            cors_origins: raw.cors_origins,
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

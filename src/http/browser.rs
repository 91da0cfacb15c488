//! Requests a browser sends on someone else's behalf, refused when `auth.mode = "none"`
//! (docs/security.md, "Requests a browser sends for someone else").
//!
//! Without tokens, being on loopback is the only credential, and a web page open in a browser on
//! the hub's machine is on loopback too. Two ways in are closed here:
//! - **Cross-site requests.** A page may POST to any address without asking (a form, or `fetch`
//!   with a "simple" content type), so publish and `/admin/*` refuse a request whose `Origin` is
//!   neither in `server.cors_origins` nor the hub's own origin. Clients that are not browsers send
//!   no `Origin` and are not affected. (Publish also takes `application/json` only, which no
//!   simple request can carry: see `publish.rs`.)
//! - **DNS rebinding.** A page of `evil.example` whose name then resolves to 127.0.0.1 is
//!   same-origin with the hub as far as the browser knows, and could read streams too; its
//!   requests still say `Host: evil.example`. Every request to `/v1/*` and `/admin/*` must name a
//!   loopback host (`localhost`, `*.localhost`, 127.0.0.0/8, `::1`) or one of
//!   `server.allowed_hosts`.
//!
//! With jwt auth none of this applies: a browser attaches no bearer token by itself.

use std::net::IpAddr;

use actix_web::{
    http::header::{self, HeaderValue},
    HttpRequest,
};

use super::{auth::Access, cors::Cors, error::ApiError};
use crate::config::ServerConfig;

pub struct BrowserGuard {
    cors: Cors,
    allowed_hosts: Vec<String>,
    any_host: bool,
}

impl BrowserGuard {
    pub fn new(server: &ServerConfig) -> Self {
        Self {
            cors: Cors::new(&server.cors_origins),
            any_host: server.allowed_hosts.iter().any(|host| host == "*"),
            allowed_hosts: server.allowed_hosts.clone(),
        }
    }

    pub fn check(&self, request: &HttpRequest, access: Access<'_>) -> Result<(), ApiError> {
        // HTTP/1.1 requires Host and browsers always send it; a client without one is no browser.
        let host = request.headers().get(header::HOST);
        if let Some(host) = host {
            if !self.host_allowed(host) {
                return Err(ApiError::Forbidden(format!(
                    "Host {:?} is not a loopback name or address: with auth.mode = none the hub \
                     answers only requests for loopback names (a defence against DNS rebinding); \
                     add the name to server.allowed_hosts if it is this hub's",
                    String::from_utf8_lossy(host.as_bytes())
                )));
            }
        }
        if matches!(access, Access::Stream(_)) {
            return Ok(());
        }
        let Some(origin) = request.headers().get(header::ORIGIN) else {
            return Ok(());
        };
        // `*` lets any page publish, but never drain or read the pod's status: /admin takes
        // the hub's own origin and origins listed by name.
        let allowed = match access {
            Access::Admin | Access::Fleet => self.cors.lists(origin),
            _ => self.cors.allow(Some(origin)).is_some(),
        };
        if allowed || is_same_origin(origin, host) {
            return Ok(());
        }
        Err(ApiError::Forbidden(format!(
            "requests from a web page of origin {:?} are refused: with auth.mode = none only \
             origins in server.cors_origins may publish, and only those listed by name (not \
             `*`) may use /admin",
            String::from_utf8_lossy(origin.as_bytes())
        )))
    }

    fn host_allowed(&self, host: &HeaderValue) -> bool {
        if self.any_host {
            return true;
        }
        let Some(name) = host.to_str().ok().and_then(host_name) else {
            return false;
        };
        is_loopback_name(&name) || self.allowed_hosts.contains(&name)
    }
}

/// The name in a `Host` value, lower-cased, without port, brackets or a final dot.
fn host_name(host: &str) -> Option<String> {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        &rest[..rest.find(']')?]
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            Some(_) => return None,
            None => host,
        }
    };
    if name.contains(':') && !host.starts_with('[') {
        return None;
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    (!name.is_empty()).then(|| name.to_ascii_lowercase())
}

fn is_loopback_name(name: &str) -> bool {
    // Browsers resolve `localhost` and `*.localhost` to loopback themselves (RFC 6761), so no DNS
    // answer can point them elsewhere.
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    name.parse::<IpAddr>()
        .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// An `Origin` of the hub itself (a page the hub serves, on the host the request names).
fn is_same_origin(origin: &HeaderValue, host: Option<&HeaderValue>) -> bool {
    let (Ok(origin), Some(Ok(host))) = (origin.to_str(), host.map(HeaderValue::to_str)) else {
        return false;
    };
    ["http://", "https://"]
        .iter()
        .any(|scheme| origin.strip_prefix(scheme) == Some(host))
}

#[cfg(test)]
mod tests {
    use actix_web::test::TestRequest;

    use super::*;
    use crate::{config::Config, model::DeviceId};

    fn guard(cors_origins: &[&str], allowed_hosts: &[&str]) -> BrowserGuard {
        let mut server = Config::default().server;
        server.cors_origins = cors_origins.iter().map(ToString::to_string).collect();
        server.allowed_hosts = allowed_hosts.iter().map(ToString::to_string).collect();
        BrowserGuard::new(&server)
    }

    fn request(headers: &[(&str, &str)]) -> HttpRequest {
        let mut request = TestRequest::default();
        for &(name, value) in headers {
            request = request.insert_header((name, value));
        }
        request.to_http_request()
    }

    #[test]
    fn host_names() {
        for (host, name) in [
            ("127.0.0.1:8080", Some("127.0.0.1")),
            ("[::1]:8080", Some("::1")),
            ("[::1]", Some("::1")),
            ("LocalHost.", Some("localhost")),
            ("pos.localhost:80", Some("pos.localhost")),
            ("evil.example", Some("evil.example")),
            // IPv6 in Host must be bracketed.
            ("::1", None),
            ("", None),
        ] {
            assert_eq!(host_name(host).as_deref(), name, "{host}");
        }
    }

    /// Loopback names and addresses pass; any other name, 0.0.0.0 and a LAN address do not,
    /// unless allowed.
    #[test]
    fn host_must_be_loopback_or_allowed() {
        let strict = guard(&[], &[]);
        let lan = guard(&[], &["hub.internal", "10.0.0.7"]);
        let pos = DeviceId::parse("pos-1").unwrap();
        for host in [
            "127.0.0.1:8080",
            "127.1.2.3",
            "[::1]:8080",
            "localhost:8080",
            "a.localhost",
            "[::ffff:127.0.0.1]:80",
        ] {
            let request = request(&[("Host", host)]);
            assert!(
                strict.check(&request, Access::Stream(&pos)).is_ok(),
                "{host}"
            );
            assert!(strict.check(&request, Access::Admin).is_ok(), "{host}");
        }
        for host in [
            "evil.example:8080",
            "0.0.0.0:8080",
            "10.0.0.7:8080",
            "localhost.evil.example",
        ] {
            let request = request(&[("Host", host)]);
            for access in [Access::Stream(&pos), Access::Publish, Access::Admin] {
                let error = strict.check(&request, access).expect_err(host);
                assert!(matches!(error, ApiError::Forbidden(_)), "{host}");
            }
        }
        assert!(lan
            .check(&request(&[("Host", "10.0.0.7:8080")]), Access::Publish)
            .is_ok());
        assert!(lan
            .check(&request(&[("Host", "HUB.internal")]), Access::Publish)
            .is_ok());
        assert!(lan
            .check(&request(&[("Host", "evil.example")]), Access::Publish)
            .is_err());
        let any = guard(&[], &["*"]);
        assert!(any
            .check(&request(&[("Host", "evil.example")]), Access::Publish)
            .is_ok());
        // No Host at all: not a browser.
        assert!(strict.check(&request(&[]), Access::Admin).is_ok());
    }

    /// Publish and admin refuse a foreign Origin; streams do not look at it (a browser does not
    /// let a foreign page read them without CORS anyway).
    #[test]
    fn origin_must_be_allowed_or_the_hub_itself() {
        let strict = guard(&[], &[]);
        let cors = guard(&["https://pos.example"], &[]);
        let pos = DeviceId::parse("pos-1").unwrap();
        let foreign = request(&[
            ("Host", "127.0.0.1:8080"),
            ("Origin", "https://evil.example"),
        ]);
        for access in [Access::Publish, Access::Admin] {
            assert!(strict.check(&foreign, access).is_err());
            assert!(cors.check(&foreign, access).is_err());
        }
        assert!(strict.check(&foreign, Access::Stream(&pos)).is_ok());
        let null = request(&[("Host", "127.0.0.1:8080"), ("Origin", "null")]);
        assert!(strict.check(&null, Access::Publish).is_err());
        let listed = request(&[
            ("Host", "127.0.0.1:8080"),
            ("Origin", "https://pos.example"),
        ]);
        assert!(cors.check(&listed, Access::Publish).is_ok());
        assert!(strict.check(&listed, Access::Publish).is_err());
        let own = request(&[
            ("Host", "127.0.0.1:8080"),
            ("Origin", "http://127.0.0.1:8080"),
        ]);
        assert!(strict.check(&own, Access::Admin).is_ok());
        let other_port = request(&[
            ("Host", "127.0.0.1:8080"),
            ("Origin", "http://127.0.0.1:9999"),
        ]);
        assert!(strict.check(&other_port, Access::Admin).is_err());
        assert!(guard(&["*"], &[]).check(&foreign, Access::Publish).is_ok());
        // A producer or curl sends no Origin.
        assert!(strict
            .check(&request(&[("Host", "localhost")]), Access::Publish)
            .is_ok());
    }
}

//! TLS to Redis (`rediss://`): the one rustls `ClientConfig` of the backend, built once at
//! start-up and shared by every connection (each `redis.urls` instance, every cluster node, the
//! tails' dedicated connections).
//!
//! Why not fred's own `rediss://` handling: it trusts the system's roots only, has no client
//! certificate, and takes rustls' process-wide crypto provider. Here the servers are verified
//! against `redis.tls_ca_file` (else the system's roots), mutual TLS presents
//! `redis.tls_cert_file`/`redis.tls_key_file`, the provider is ring (as for the rest of the
//! binary), and a file that cannot be read or parsed stops start-up with an error naming its key.
//!
//! Host names: a server's certificate is verified against the host of its URL, a name or an IP
//! address. A cluster's other nodes come from `CLUSTER SLOTS`, which names them by IP address
//! unless the cluster announces host names (`cluster-announce-hostname` with
//! `cluster-preferred-endpoint-type hostname`). Such an IP is verified against the seed URL's host
//! when that is a name (one certificate for the cluster's name, as managed services issue), and
//! against the IP itself when the seed is an IP address.

use std::{net::IpAddr, sync::Arc};

use fred::types::config::{HostMapping, TlsConfig, TlsConnector, TlsHostMapping};
use rustls::{
    client::{
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
        WebPkiServerVerifier,
    },
    ClientConfig, DigitallySignedStruct, SignatureScheme,
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use super::setup::SetupError;
use crate::{config::RedisConfig, tls};

/// The TLS settings for fred, or `None` when no URL in use is `rediss://`.
pub fn client_tls(redis: &RedisConfig) -> Result<Option<TlsConfig>, SetupError> {
    if !redis.wants_tls() {
        return Ok(None);
    }
    let provider = tls::provider();
    let roots = tls::root_store(redis.tls_ca_file.as_deref())
        .map_err(SetupError::file("redis.tls_ca_file"))?;
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(SetupError::Verifier)?;
    let trusted = match &redis.tls_ca_file {
        Some(path) => format!("redis.tls_ca_file {}", path.display()),
        None => "the system's CA store".into(),
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(SetupError::Tls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Explained { verifier, trusted }));
    let config = match (&redis.tls_cert_file, &redis.tls_key_file) {
        (Some(cert_file), Some(key_file)) => {
            let certs =
                tls::certificates(cert_file).map_err(SetupError::file("redis.tls_cert_file"))?;
            let key = tls::private_key(key_file).map_err(SetupError::file("redis.tls_key_file"))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|source| SetupError::ClientCert {
                    cert: cert_file.clone(),
                    key: key_file.clone(),
                    source,
                })?
        }
        // The configuration allows both or neither.
        _ => builder.with_no_client_auth(),
    };
    Ok(Some(TlsConfig {
        connector: TlsConnector::from(config),
        hostnames: hostnames(redis),
    }))
}

/// The standard verification (chain to the trusted roots, validity, host name), which also logs
/// why a server's certificate was refused: the client library reports a failed handshake only as
/// a debug dump of the I/O error.
#[derive(Debug)]
struct Explained {
    verifier: Arc<WebPkiServerVerifier>,
    /// Where the trusted CAs come from, for the message.
    trusted: String,
}

impl ServerCertVerifier for Explained {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.verifier
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
            .inspect_err(|error| {
                log::error!(
                    "redis TLS: the certificate of {} was refused ({error}); trusted CAs: {}",
                    server_name.to_str(),
                    self.trusted
                )
            })
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.verifier.supported_verify_schemes()
    }
}

/// Names for the IP addresses a cluster announces (see the module's card).
fn hostnames(redis: &RedisConfig) -> TlsHostMapping {
    match seed_host(redis.url.as_str()) {
        Some(host) if redis.cluster && host.parse::<IpAddr>().is_err() => {
            TlsHostMapping::Custom(Arc::new(SeedName(host.to_string())))
        }
        _ => TlsHostMapping::None,
    }
}

/// The host of a URL: after the scheme and user-info, before the port (IPv6 without brackets).
fn seed_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let host_port = &authority[authority.rfind('@').map_or(0, |at| at + 1)..];
    let host = match host_port.strip_prefix('[') {
        Some(bracketed) => &bracketed[..bracketed.find(']')?],
        None => &host_port[..host_port.rfind(':').unwrap_or(host_port.len())],
    };
    (!host.is_empty()).then_some(host)
}

/// Every announced IP address is the seed's host name.
#[derive(Debug)]
struct SeedName(String);

impl HostMapping for SeedName {
    fn map(&self, _ip: &IpAddr, _default_host: &str) -> Option<String> {
        Some(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host is found with and without user-info, port, path and IPv6 brackets.
    #[test]
    fn seed_hosts() {
        assert_eq!(
            seed_host("rediss://redis.example:6380"),
            Some("redis.example")
        );
        assert_eq!(seed_host("rediss://u:p@w@h.example/0"), Some("h.example"));
        assert_eq!(seed_host("rediss://127.0.0.1:7000"), Some("127.0.0.1"));
        assert_eq!(seed_host("rediss://[::1]:7000"), Some("::1"));
        assert_eq!(seed_host("rediss://:7000"), None);
    }

    fn redis(url: &str, cluster: bool) -> RedisConfig {
        let mut redis = crate::config::Config::default().redis;
        redis.url = crate::config::RedactedUrl::new(url);
        redis.cluster = cluster;
        redis
    }

    /// Only a cluster seeded by a host name maps announced IPs to that name.
    #[test]
    fn cluster_ips_are_verified_as_the_seed_name() {
        assert!(matches!(
            hostnames(&redis("rediss://redis.example:6380", true)),
            TlsHostMapping::Custom(mapping)
                if mapping.map(&"10.0.0.7".parse().unwrap(), "10.0.0.7").as_deref()
                    == Some("redis.example")
        ));
        assert_eq!(
            hostnames(&redis("rediss://10.0.0.1:6380", true)),
            TlsHostMapping::None
        );
        assert_eq!(
            hostnames(&redis("rediss://redis.example:6380", false)),
            TlsHostMapping::None
        );
    }

    /// Plain URLs get no TLS; a CA file that is missing or holds no certificate names its key
    /// and path.
    #[test]
    fn files_are_checked() {
        assert!(client_tls(&redis("redis://a:6379", false))
            .expect("plain")
            .is_none());
        let mut config = redis("rediss://a:6380", false);
        config.tls_ca_file = Some("/nonexistent/ca.pem".into());
        let error = crate::report::Report(&client_tls(&config).expect_err("missing")).to_string();
        assert!(
            error.starts_with("redis.tls_ca_file: cannot read /nonexistent/ca.pem"),
            "{error}"
        );
        let empty = std::env::temp_dir().join(format!("posthorn-empty-{}.pem", std::process::id()));
        std::fs::write(&empty, "not a certificate\n").expect("write");
        config.tls_ca_file = Some(empty.clone());
        let error = crate::report::Report(&client_tls(&config).expect_err("empty")).to_string();
        let _ = std::fs::remove_file(&empty);
        assert!(error.starts_with("redis.tls_ca_file: "), "{error}");
        assert!(error.contains("holds no certificate in PEM"), "{error}");
    }
}

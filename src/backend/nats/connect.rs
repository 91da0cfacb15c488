//! How the hub connects to NATS: the one place that builds async-nats' `ConnectOptions`, so that
//! TLS and credentials are decided once, from the validated `[nats]` section
//! (docs/operations.md, "NATS JetStream"; the permissions the hub's user needs are in
//! docs/security.md, "Least privilege: NATS").
//!
//! - **Files are read at start-up, before anything goes on the wire** ([`NatsAccess::load`]): a
//!   missing, unreadable or malformed file stops start-up as a configuration error (exit 64)
//!   naming its key and path, instead of becoming an authentication or TLS failure the server
//!   reports without saying which file was wrong.
//!   What the secret files hold goes into the options and nowhere else: never into a message
//!   or a log line (an error names the key and the path, not the content). async-nats keeps it
//!   for reconnects. The TLS files are only checked here; async-nats reads them again at each
//!   (re)connection, so a renewed certificate is picked up by the next reconnect.
//! - **TLS is required** (`require_tls`) whenever a `tls://` URL or a TLS file is configured, so
//!   a server that stops offering TLS is refused instead of being spoken to in plain text.
//!   Without any of them, TLS is still used when the server requires it, verified against the
//!   system's roots.
//! - **A user and password in `nats.url`**: async-nats 0.46 parses them but does not send them,
//!   so they are taken from the URL here (percent-decoded) and given as credentials, and the
//!   client gets the URLs without them (its debug log prints the server addresses). A URL user
//!   without a password is a token, as in the NATS tools. Config validation made sure no
//!   credentials key is set beside them.

use std::path::{Path, PathBuf};

use async_nats::{ConnectErrorKind, ConnectOptions, ServerAddr};
use tokio::sync::watch;

use super::{unavailable, CONNECT_TIMEOUT, REQUEST_TIMEOUT};
use crate::{
    backend::{BackendError, BackendResult},
    config::{nats::NatsCredentials, NatsConfig, RedactedUrl, Secret, SecretFileError},
};

/// A TLS or credentials file of `[nats]` that cannot be used: the key and the path, never what
/// the file holds.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {} {problem}", path.display())]
pub struct NatsFileError {
    key: &'static str,
    path: PathBuf,
    problem: String,
    #[source]
    cause: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The TLS and credentials of `[nats]`, read from their files and checked: how the hub will
/// prove who it is, before it connects.
pub struct NatsAccess {
    options: ConnectOptions,
    interruptions: watch::Receiver<u64>,
}

/// A connected client, and how many times so far it has connected (the first connection
/// included) or dropped messages of a slow subscription: a subscriber that sees the count
/// change knows that what was published meanwhile may not have reached it (after a reconnect
/// async-nats subscribes again by itself, silently).
pub(super) struct Connected {
    pub client: async_nats::Client,
    pub interruptions: watch::Receiver<u64>,
}

impl std::fmt::Debug for NatsAccess {
    // ConnectOptions' own Debug is not ours to audit: show nothing of it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NatsAccess")
    }
}

impl NatsAccess {
    /// Reads and checks the files of `nats` (and the credentials inside its URLs).
    pub fn load(nats: &NatsConfig) -> Result<NatsAccess, NatsFileError> {
        let (counter, interruptions) = watch::channel(0u64);
        let counter = std::sync::Arc::new(counter);
        let options = ConnectOptions::new()
            .name("posthorn")
            .connection_timeout(CONNECT_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            // The client reconnects forever (the default); say so in the log, once per change.
            .event_callback(move |event| {
                let counter = counter.clone();
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            log::info!("nats: connected");
                            counter.send_modify(|count| *count += 1);
                        }
                        // The client dropped messages of a subscription that fell behind.
                        async_nats::Event::SlowConsumer(_) => {
                            log::warn!("nats: {event}");
                            counter.send_modify(|count| *count += 1);
                        }
                        other => log::warn!("nats: {other}"),
                    }
                }
            });
        let options = tls(options, nats)?;
        let options = credentials(options, nats)?;
        Ok(NatsAccess {
            options,
            interruptions,
        })
    }
}

/// Connects to the servers of `nats` with `access`; fails when a URL is not one, or the servers
/// cannot be reached, refuse the credentials or fail TLS within [`CONNECT_TIMEOUT`].
pub(super) async fn connect(nats: &NatsConfig, access: NatsAccess) -> BackendResult<Connected> {
    let servers = server_addrs(&nats.url)?;
    let NatsAccess {
        options,
        interruptions,
    } = access;
    let shown: Vec<String> = nats
        .url
        .iter()
        .map(|url| url.redacted().trim().to_string())
        .collect();
    let client = options.connect(servers).await.map_err(|error| {
        let hint = match error.kind() {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                " (the server refused the credentials: check nats.creds_file, \
                 nats.nkey_seed_file, nats.user and nats.password_file, nats.token_file, or \
                 the user in nats.url)"
            }
            _ if is_tls_failure(&error) => {
                " (TLS failed: check nats.tls_ca_file against the server's certificate, and \
                 nats.tls_cert_file and nats.tls_key_file if the server verifies clients)"
            }
            _ => "",
        };
        unavailable(
            &format!("cannot connect to {}{hint}", shown.join(",")),
            error,
        )
    })?;
    Ok(Connected {
        client,
        interruptions,
    })
}

/// Whether TLS failed somewhere in `error`'s chain: async-nats reports a failed handshake (an
/// unknown issuer, a missing client certificate) as an I/O error around rustls' own.
fn is_tls_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(ConnectErrorKind::Tls) = error
            .downcast_ref::<async_nats::ConnectError>()
            .map(async_nats::ConnectError::kind)
        {
            return true;
        }
        // io::Error's `source` skips the error it wraps: look at that one directly.
        let wrapped = error
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .map(|inner| inner as &(dyn std::error::Error + 'static));
        if error.is::<rustls::Error>() || wrapped.is_some_and(|inner| inner.is::<rustls::Error>()) {
            return true;
        }
        next = error.source();
    }
    false
}

/// The servers of `nats.url`: one URL, or several (the nodes of one cluster; the client also
/// learns the others from the first server it reaches); without their user-info, which
/// [`credentials`] has taken.
fn server_addrs(urls: &[RedactedUrl]) -> BackendResult<Vec<ServerAddr>> {
    urls.iter()
        .map(|url| {
            without_user_info(url.as_str().trim())
                .parse()
                .map_err(|error| {
                    BackendError::rejected(format!(
                        "nats.url: {:?} is not a server URL: {error}",
                        url.redacted().trim()
                    ))
                })
        })
        .collect()
}

/// `url` without the `user:password@` of its authority.
fn without_user_info(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rfind('@') {
        Some(at) => format!("{scheme}://{}{path}", &authority[at + 1..]),
        None => url.to_string(),
    }
}

/// The user and password (or the token) of the first URL of `nats.url` that carries them.
fn url_credentials(urls: &[RedactedUrl]) -> Option<(String, Option<String>)> {
    urls.iter()
        .filter_map(|url| url.as_str().trim().parse::<ServerAddr>().ok())
        .find(ServerAddr::has_user_pass)
        .map(|server| {
            (
                percent_decode(server.username().unwrap_or_default()),
                server.password().map(percent_decode),
            )
        })
}

fn file_error(
    key: &'static str,
    path: &Path,
    problem: &str,
    cause: Option<Box<dyn std::error::Error + Send + Sync>>,
) -> NatsFileError {
    NatsFileError {
        key,
        path: path.to_path_buf(),
        problem: problem.to_string(),
        cause,
    }
}

fn read(key: &'static str, path: &Path) -> Result<Vec<u8>, NatsFileError> {
    std::fs::read(path).map_err(|error| file_error(key, path, "cannot be read", Some(error.into())))
}

/// A secret file's text ([`Secret::read`]: one trailing line break dropped, empty refused).
fn read_secret(key: &'static str, path: &Path) -> Result<Secret, NatsFileError> {
    Secret::read(path).map_err(|error| match error {
        SecretFileError::Read(source) => {
            file_error(key, path, "cannot be read", Some(source.into()))
        }
        other => file_error(key, path, &other.to_string(), None),
    })
}

/// What `crate::tls` found wrong with a TLS file, as the file error of its key.
fn tls_file(key: &'static str, path: &Path, error: crate::tls::TlsError) -> NatsFileError {
    use crate::tls::TlsError;
    let (problem, cause): (String, Option<Box<dyn std::error::Error + Send + Sync>>) = match error {
        TlsError::Read { source, .. } => ("cannot be read".into(), Some(source.into())),
        TlsError::Missing { what, .. } => (format!("holds no PEM {what}"), None),
        TlsError::Pem { source, .. } => ("is not PEM".into(), Some(Box::new(source))),
        other => ("cannot be used".into(), Some(Box::new(other))),
    };
    file_error(key, path, &problem, cause)
}

/// TLS files are checked (parsed as the TLS stack will) so that a wrong file fails start-up with
/// its key; async-nats reads them itself when it connects.
fn tls(options: ConnectOptions, nats: &NatsConfig) -> Result<ConnectOptions, NatsFileError> {
    use crate::tls;

    let mut options = options.require_tls(nats.wants_tls());
    if let Some(path) = &nats.tls_ca_file {
        tls::root_store(Some(path)).map_err(|error| tls_file("nats.tls_ca_file", path, error))?;
        options = options.add_root_certificates(path.clone());
    }
    if let Some((cert, key)) = nats.client_cert() {
        let chain =
            tls::certificates(cert).map_err(|error| tls_file("nats.tls_cert_file", cert, error))?;
        let private =
            tls::private_key(key).map_err(|error| tls_file("nats.tls_key_file", key, error))?;
        rustls::ClientConfig::builder_with_provider(tls::provider())
            .with_safe_default_protocol_versions()
            .and_then(|builder| {
                builder
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_client_auth_cert(chain, private)
            })
            .map_err(|error| {
                file_error(
                    "nats.tls_key_file",
                    key,
                    &format!("does not fit the certificate in {}", cert.display()),
                    Some(error.into()),
                )
            })?;
        options = options.add_client_certificate(cert.to_path_buf(), key.to_path_buf());
    }
    Ok(options)
}

/// The one kind of credentials configured, read from its file; or the user and password (or
/// token) of the first URL that carries them.
fn credentials(
    options: ConnectOptions,
    nats: &NatsConfig,
) -> Result<ConnectOptions, NatsFileError> {
    Ok(match &nats.credentials {
        NatsCredentials::None => match url_credentials(&nats.url) {
            None => options,
            Some((user, Some(password))) => options.user_and_password(user, password),
            Some((token, None)) => options.token(token),
        },
        NatsCredentials::CredsFile(path) => {
            let key = "nats.creds_file";
            // As written: the format ends its last marker line with a newline.
            let text = String::from_utf8(read(key, path)?)
                .map(Secret::new)
                .map_err(|_| file_error(key, path, "is not UTF-8 text", None))?;
            options.credentials(text.expose()).map_err(|error| {
                file_error(
                    key,
                    path,
                    "is not a NATS credentials file (a user JWT and an nkey seed)",
                    Some(error.into()),
                )
            })?
        }
        NatsCredentials::NkeySeedFile(path) => {
            let key = "nats.nkey_seed_file";
            let seed = read_secret(key, path)?;
            match nkeys::KeyPair::from_seed(seed.expose()) {
                Ok(pair) if pair.public_key().starts_with('U') => {}
                // The error of `from_seed` is about the seed's encoding; it never holds the seed.
                Ok(_) => {
                    return Err(file_error(
                        key,
                        path,
                        "holds an nkey seed that is not a user's (SU...)",
                        None,
                    ))
                }
                Err(error) => {
                    return Err(file_error(
                        key,
                        path,
                        "holds no nkey seed",
                        Some(error.into()),
                    ))
                }
            }
            options.nkey(seed.expose().to_string())
        }
        NatsCredentials::UserPassword {
            user,
            password_file,
        } => {
            let password = read_secret("nats.password_file", password_file)?;
            options.user_and_password(user.clone(), password.expose().to_string())
        }
        NatsCredentials::TokenFile(path) => {
            let token = read_secret("nats.token_file", path)?;
            options.token(token.expose().to_string())
        }
    })
}

/// `%XX` escapes of URL user-info decoded (a password may hold `@`, `:` or `/`); anything that is
/// not a valid escape is kept as written.
fn percent_decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::raw::RawNats;

    fn config(raw: RawNats) -> NatsConfig {
        NatsConfig::try_from(raw).expect("valid")
    }

    /// A file in a directory of its own, removed with it. The directory is numbered so that
    /// tests running at once never share one: two files of the same name in one process used
    /// to, and the first to be dropped took the other's file with it.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(name: &str, content: &[u8]) -> TempFile {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let number = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!(
                "posthorn-nats-connect-{}-{number}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).expect("temp dir");
            std::fs::write(dir.join(name), content).expect("write");
            TempFile(dir.join(name))
        }

        fn path(&self) -> String {
            self.0.display().to_string()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            if let Some(dir) = self.0.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }

    fn options_error(raw: RawNats) -> String {
        let error = NatsAccess::load(&config(raw)).expect_err("refused");
        crate::report::Report(&error).to_string()
    }

    /// A secret file that is missing, empty or malformed stops start-up naming key and path,
    /// and the message never holds what the file holds.
    #[test]
    fn unusable_files_name_key_and_path() {
        let missing = "/nonexistent/posthorn/secret";
        let error = options_error(RawNats {
            token_file: missing.into(),
            ..RawNats::default()
        });
        assert!(
            error.starts_with("nats.token_file: /nonexistent/posthorn/secret cannot be read: "),
            "{error}"
        );
        let empty = TempFile::new("empty", b"\n");
        let error = options_error(RawNats {
            user: "hub".into(),
            password_file: empty.path(),
            ..RawNats::default()
        });
        assert!(error.contains("nats.password_file: "), "{error}");
        assert!(error.contains("is empty"), "{error}");
        let bad_seed = TempFile::new("seed", b"SUNOTASEED-hunter2\n");
        let error = options_error(RawNats {
            nkey_seed_file: bad_seed.path(),
            ..RawNats::default()
        });
        assert!(error.contains("nats.nkey_seed_file: "), "{error}");
        assert!(error.contains("holds no nkey seed"), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
        let bad_creds = TempFile::new("creds", b"hunter2\n");
        let error = options_error(RawNats {
            creds_file: bad_creds.path(),
            ..RawNats::default()
        });
        assert!(error.contains("nats.creds_file: "), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
        let not_pem = TempFile::new("ca", b"not a certificate");
        let error = options_error(RawNats {
            tls_ca_file: not_pem.path(),
            ..RawNats::default()
        });
        assert!(error.contains("nats.tls_ca_file: "), "{error}");
        assert!(error.contains("holds no PEM certificate"), "{error}");
    }

    /// A password and a token are read without their trailing line break (one, as for every
    /// secret file); an empty file names its key.
    #[test]
    fn secrets_lose_their_trailing_newline() {
        let token = TempFile::new("token", b"t0ken\r\n");
        assert_eq!(read_secret("k", &token.0).expect("read").expose(), "t0ken");
        let password = TempFile::new("password", b"pass word\n");
        assert_eq!(
            read_secret("k", &password.0).expect("read").expose(),
            "pass word"
        );
        let empty = TempFile::new("empty", b"\n");
        let error = read_secret("nats.token_file", &empty.0).expect_err("empty");
        assert!(error.to_string().contains("nats.token_file"), "{error}");
        assert!(error.to_string().contains("is empty"), "{error}");
    }

    /// The client gets the URLs without user-info; the credentials come from the first URL that
    /// has them, decoded.
    #[test]
    fn url_user_info_becomes_credentials() {
        assert_eq!(
            without_user_info("nats://u:p%40@h:4222/x@y"),
            "nats://h:4222/x@y"
        );
        assert_eq!(without_user_info("h:4222"), "h:4222");
        let urls = [
            RedactedUrl::new("nats://a:4222"),
            RedactedUrl::new(" tls://hub:p%40ss@b:4222"),
            RedactedUrl::new("nats://other:pw@c:4222"),
        ];
        assert_eq!(
            url_credentials(&urls),
            Some(("hub".to_string(), Some("p@ss".to_string())))
        );
        assert_eq!(
            url_credentials(&[RedactedUrl::new("nats://t0ken@a:4222")]),
            Some(("t0ken".to_string(), None))
        );
        let servers = server_addrs(&urls).expect("urls");
        assert!(servers.iter().all(|server| !server.has_user_pass()));
    }

    #[test]
    fn user_info_is_percent_decoded() {
        assert_eq!(percent_decode("p%40ss%2Fw%3Ad"), "p@ss/w:d");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }
}

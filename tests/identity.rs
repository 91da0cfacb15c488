//! Keys from an identity provider and the reference client across a token's life
//! (docs/security.md): a JSON Web Key Set served over HTTPS by a test provider rotates from one
//! key to another without a restart; a storm of unknown `kid`s costs the provider at most one
//! fetch per 10 s; the provider going away leaves the cached keys working; RS256, ES256 and
//! EdDSA keys verify; `auth.issuer` and `auth.audience` are checked; `posthorn tail
//! --token-file` crosses a token expiry without losing an event, and a revoked tail exits 3.
//! What every backend must do with tokens (expiry, revocation across pods) is the conformance
//! suite's (tests/conformance/identity.rs).

mod support;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use jsonwebtoken::{jwk::Jwk, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use support::{http, metrics, stream_path, tls::TestPki, Hub, SseClient};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

const BIN: &str = env!("CARGO_BIN_EXE_posthorn");
const WAIT: Duration = Duration::from_secs(20);

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A private key made by `openssl genpkey` (RSA 2048, EC P-256 or Ed25519), as a signing key, and
/// its public half as a JWK named `kid`.
struct SigningKey {
    kid: String,
    algorithm: Algorithm,
    key: EncodingKey,
    jwk: Value,
}

impl SigningKey {
    fn new(kid: &str, algorithm: Algorithm, dir: &Path) -> SigningKey {
        let args: &[&str] = match algorithm {
            Algorithm::RS256 => &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
            Algorithm::ES256 => &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
            Algorithm::EdDSA => &["-algorithm", "ED25519"],
            other => panic!("no test key for {other:?}"),
        };
        let path = dir.join(format!("{kid}.pem"));
        let status = Command::new("openssl")
            .arg("genpkey")
            .args(args)
            .arg("-out")
            .arg(&path)
            .stderr(Stdio::null())
            .status()
            .expect("openssl is installed (scripts/test installs it)");
        assert!(status.success(), "openssl genpkey {args:?}");
        let pem = std::fs::read(&path).unwrap();
        let key = match algorithm {
            Algorithm::RS256 => EncodingKey::from_rsa_pem(&pem),
            Algorithm::ES256 => EncodingKey::from_ec_pem(&pem),
            _ => EncodingKey::from_ed_pem(&pem),
        }
        .unwrap();
        let mut jwk = Jwk::from_encoding_key(&key, algorithm).unwrap();
        jwk.common.key_id = Some(kid.into());
        SigningKey {
            kid: kid.into(),
            algorithm,
            key,
            jwk: serde_json::to_value(&jwk).unwrap(),
        }
    }

    /// A token for `claims` (an hour's `exp` added) naming this key's `kid`.
    fn token(&self, claims: Value) -> String {
        let mut all = json!({ "iat": now(), "exp": now() + 3600 });
        all.as_object_mut()
            .unwrap()
            .extend(claims.as_object().unwrap().clone());
        let mut header = Header::new(self.algorithm);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, &all, &self.key).unwrap()
    }
}

/// A test identity provider: serves the current key set over HTTPS (a certificate of the test
/// PKI) and counts the requests; stops when dropped.
struct Provider {
    addr: SocketAddr,
    keys: Arc<Mutex<Vec<Value>>>,
    fetches: Arc<AtomicUsize>,
    server: tokio::task::JoinHandle<()>,
}

impl Provider {
    async fn start(pki: &mut TestPki, keys: Vec<Value>) -> Provider {
        let cert = pki.server_cert();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            rustls_pemfile_certs(&cert.cert),
            <rustls::pki_types::PrivateKeyDer as rustls::pki_types::pem::PemObject>::from_pem_file(
                &cert.key,
            )
            .unwrap(),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let keys = Arc::new(Mutex::new(keys));
        let fetches = Arc::new(AtomicUsize::new(0));
        let (served, counted) = (keys.clone(), fetches.clone());
        let server = tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, served, counted) =
                    (acceptor.clone(), served.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
                    let body = json!({ "keys": *served.lock().unwrap() }).to_string();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        Provider {
            addr,
            keys,
            fetches,
            server,
        }
    }

    fn url(&self) -> String {
        format!(
            "https://127.0.0.1:{}/.well-known/jwks.json",
            self.addr.port()
        )
    }

    fn serve(&self, keys: Vec<Value>) {
        *self.keys.lock().unwrap() = keys;
    }

    fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn rustls_pemfile_certs(path: &Path) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_file_iter(path)
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

fn key_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("posthorn-identity-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The status of a stream request with `token` (the stream is dropped at once).
async fn stream_status(hub: &Hub, device: &str, token: &str) -> u16 {
    let authorization = format!("Bearer {token}");
    SseClient::connect(
        hub.addr(),
        &stream_path(device),
        &[("Authorization", authorization.as_str())],
    )
    .await
    .status()
}

async fn rejected(hub: &Hub, reason: &str) -> f64 {
    metrics::scrape(hub.addr())
        .await
        .value_or_zero("auth_rejections_total", &[("reason", reason)])
}

/// A hub that takes its keys from `provider` (refreshed every 10 s, the shortest).
async fn jwks_hub(provider: &Provider, pki: &TestPki) -> Hub {
    Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWKS_URL", provider.url())
        .env(
            "POSTHORN_AUTH__JWKS_CA_FILE",
            pki.ca_file().display().to_string(),
        )
        .env("POSTHORN_AUTH__JWKS_REFRESH", "10s")
        .start()
        .await
}

/// The provider rotates from one key to another: a token of the new key works at once (its
/// unknown `kid` fetches the set again), the old key is refused once the set no longer holds it,
/// and no restart is needed. RS256, ES256 and EdDSA keys all verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_rotates_its_keys_without_a_restart() {
    let dir = key_dir("rotate");
    let mut pki = TestPki::new("identity provider CA");
    let old = SigningKey::new("2026-11", Algorithm::RS256, &dir);
    let ec = SigningKey::new("ec-1", Algorithm::ES256, &dir);
    let ed = SigningKey::new("ed-1", Algorithm::EdDSA, &dir);
    let provider = Provider::start(
        &mut pki,
        vec![old.jwk.clone(), ec.jwk.clone(), ed.jwk.clone()],
    )
    .await;
    let hub = jwks_hub(&provider, &pki).await;
    assert_eq!(provider.fetches(), 1, "fetched once at start-up");
    for key in [&old, &ec, &ed] {
        assert_eq!(
            stream_status(&hub, "pos-1", &key.token(json!({ "sub": "pos-1" }))).await,
            200,
            "{:?}",
            key.algorithm
        );
    }

    let new = SigningKey::new("2026-12", Algorithm::RS256, &dir);
    provider.serve(vec![new.jwk.clone()]);
    assert_eq!(
        stream_status(&hub, "pos-1", &new.token(json!({ "sub": "pos-1" }))).await,
        200,
        "the new key is fetched for its first token"
    );
    assert_eq!(provider.fetches(), 2);
    let before = rejected(&hub, "unknown_kid").await;
    assert_eq!(
        stream_status(&hub, "pos-1", &old.token(json!({ "sub": "pos-1" }))).await,
        401,
        "the removed key is refused"
    );
    assert_eq!(rejected(&hub, "unknown_kid").await, before + 1.0);
    // A token of a key the hub holds, signed by another key: a bad signature.
    let forged = {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(new.kid.clone());
        jsonwebtoken::encode(
            &header,
            &json!({ "sub": "pos-1", "exp": now() + 60 }),
            &old.key,
        )
        .unwrap()
    };
    assert_eq!(stream_status(&hub, "pos-1", &forged).await, 401);
    assert_eq!(rejected(&hub, "bad_signature").await, 1.0);
    let _ = std::fs::remove_dir_all(dir);
}

/// Tokens naming `kid`s nobody issued, a hundred at once and again later, cost the provider at
/// most one fetch per 10 s; while it is unreachable the keys already fetched keep working, and
/// the failed fetches are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_kids_and_a_missing_provider_cost_little() {
    let dir = key_dir("storm");
    let mut pki = TestPki::new("identity provider CA");
    let key = SigningKey::new("k1", Algorithm::ES256, &dir);
    let provider = Provider::start(&mut pki, vec![key.jwk.clone()]).await;
    let hub = jwks_hub(&provider, &pki).await;
    let storm = || async {
        let requests = (0..100).map(|n| {
            let mut made_up = SigningKey {
                kid: format!("made-up-{n}"),
                algorithm: key.algorithm,
                key: key.key.clone(),
                jwk: Value::Null,
            };
            made_up.kid = format!("made-up-{n}-{}", now());
            let token = made_up.token(json!({ "sub": "pos-1" }));
            let hub = &hub;
            async move { stream_status(hub, "pos-1", &token).await }
        });
        let statuses = futures_util::future::join_all(requests).await;
        assert!(statuses.iter().all(|status| *status == 401), "{statuses:?}");
    };
    let started = tokio::time::Instant::now();
    storm().await;
    assert!(
        provider.fetches() <= 2,
        "start-up plus at most one for the storm: {}",
        provider.fetches()
    );
    let after_first = provider.fetches();
    storm().await;
    if started.elapsed() < Duration::from_secs(10) {
        assert_eq!(
            provider.fetches(),
            after_first,
            "no second fetch within 10 s"
        );
    }
    assert!(rejected(&hub, "unknown_kid").await >= 200.0);

    let fetched = provider.fetches();
    drop(provider);
    // The next scheduled refresh (10 s) finds the provider gone.
    metrics::wait_for(
        hub.addr(),
        "jwks_fetches_total",
        &[("result", "error")],
        1.0,
        Duration::from_secs(25),
    )
    .await;
    assert!(fetched >= 1);
    assert_eq!(
        stream_status(&hub, "pos-1", &key.token(json!({ "sub": "pos-1" }))).await,
        200,
        "the cached key still works"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// With `auth.issuer` and `auth.audience` set, a token of another issuer or audience, or
/// without the claim, is refused with 401 naming the claim, and counted.
#[tokio::test]
async fn issuer_and_audience_are_checked() {
    const SECRET: &str = "issuer-audience-secret";
    let hub = Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .env("POSTHORN_AUTH__ISSUER", "https://idp.example/")
        .env("POSTHORN_AUTH__AUDIENCE", "posthorn")
        .start()
        .await;
    let token = |claims: Value| {
        let mut all = json!({ "sub": "pos-1", "exp": now() + 600 });
        all.as_object_mut()
            .unwrap()
            .extend(claims.as_object().unwrap().clone());
        jsonwebtoken::encode(
            &Header::default(),
            &all,
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let good = token(json!({ "iss": "https://idp.example/", "aud": "posthorn" }));
    assert_eq!(stream_status(&hub, "pos-1", &good).await, 200);
    for (claims, named, reason) in [
        (
            json!({ "iss": "https://evil.example/", "aud": "posthorn" }),
            "iss",
            "wrong_issuer",
        ),
        (json!({ "aud": "posthorn" }), "iss", "wrong_issuer"),
        (
            json!({ "iss": "https://idp.example/", "aud": "billing" }),
            "aud",
            "wrong_audience",
        ),
        (
            json!({ "iss": "https://idp.example/" }),
            "aud",
            "wrong_audience",
        ),
    ] {
        let authorization = format!("Bearer {}", token(claims.clone()));
        let response = http::request(
            hub.addr(),
            "GET",
            &stream_path("pos-1"),
            &[("Authorization", &authorization)],
            None,
        )
        .await;
        assert_eq!(response.status, 401, "{claims}");
        let body = response.json();
        assert_eq!(body["error"], "unauthorized");
        assert!(body["message"].as_str().unwrap().contains(named), "{body}");
        assert!(rejected(&hub, reason).await >= 1.0, "{reason}");
    }
    assert_eq!(rejected(&hub, "wrong_issuer").await, 2.0);
    assert_eq!(rejected(&hub, "wrong_audience").await, 2.0);
}

const TAIL_SECRET: &str = "tail-identity-secret";

fn hs256(claims: Value) -> String {
    jsonwebtoken::encode(
        &Header::default(),
        &claims,
        &EncodingKey::from_secret(TAIL_SECRET.as_bytes()).unwrap(),
    )
    .unwrap()
}

async fn tail_hub() -> Hub {
    Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", TAIL_SECRET)
        .env("POSTHORN_AUTH__LEEWAY", "0s")
        .start()
        .await
}

async fn publish(hub: &Hub, device: &str, data: &str) -> String {
    let authorization = format!(
        "Bearer {}",
        hs256(json!({ "scope": "publish admin", "exp": now() + 600 }))
    );
    let response = http::request(
        hub.addr(),
        "POST",
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &authorization),
        ],
        Some(
            json!({ "device": device, "type": "t", "data": data })
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
    response.json()["results"][0]["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// `posthorn tail` as a child process, its stdout lines collected.
struct Tail {
    child: tokio::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
}

impl Tail {
    fn start(hub: &Hub, device: &str, token_file: &Path, cursor_file: &Path) -> Tail {
        let mut child = tokio::process::Command::new(BIN)
            .args(["tail", "--url", &hub.base_url(), "--device", device])
            .arg("--token-file")
            .arg(token_file)
            .arg("--cursor-file")
            .arg(cursor_file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let collected = lines.clone();
        tokio::spawn(async move {
            let mut text = String::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = out.read(&mut buf).await {
                if n == 0 {
                    return;
                }
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
                while let Some(at) = text.find('\n') {
                    let line: String = text.drain(..=at).collect();
                    collected.lock().unwrap().push(line.trim_end().to_string());
                }
            }
        });
        let errors = stderr.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf).await {
                if n == 0 {
                    return;
                }
                errors
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Tail {
            child,
            lines,
            stderr,
        }
    }

    /// The data of the events printed so far (`id<TAB>type<TAB>data`).
    fn data(&self) -> Vec<String> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|line| line.split('\t').nth(2).map(String::from))
            .collect()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

/// `posthorn tail --token-file` crosses its token's expiry: the hub ends the stream with
/// `token_expired`, the client reads the file again and resumes with its cursor, and every event
/// published meanwhile arrives once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_crosses_a_token_expiry_without_losing_an_event() {
    let hub = tail_hub().await;
    let dir = key_dir("tail-expiry");
    let (token_file, cursor_file) = (dir.join("token"), dir.join("cursor"));
    let short = hs256(json!({ "sub": "pos-t", "iat": now(), "exp": now() + 2 }));
    std::fs::write(&token_file, &short).unwrap();
    let tail = Tail::start(&hub, "pos-t", &token_file, &cursor_file);
    support::wait_until(WAIT, "the tail connects", async || {
        metrics::scrape(hub.addr())
            .await
            .value_or_zero("sse_connections", &[])
            == 1.0
    })
    .await;
    // The next token waits in the file; the tail reads it when the hub ends the stream.
    std::fs::write(
        &token_file,
        hs256(json!({ "sub": "pos-t", "iat": now(), "exp": now() + 600 })),
    )
    .unwrap();
    let mut sent = Vec::new();
    for n in 0..12 {
        sent.push(format!("e{n}"));
        publish(&hub, "pos-t", &format!("e{n}")).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    support::wait_until(WAIT, "every event printed", async || {
        tail.data().len() >= sent.len()
    })
    .await;
    assert_eq!(tail.data(), sent, "stderr: {}", tail.stderr());
    metrics::wait_for(
        hub.addr(),
        "sse_connections_closed_total",
        &[("reason", "token_expired")],
        1.0,
        WAIT,
    )
    .await;
    assert!(
        tail.stderr().contains("the token expired"),
        "the client saw the expiry: {}",
        tail.stderr()
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A revoked device's tail stops at once with exit status 3 and says why; it does not retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_tail_exits_3() {
    let hub = tail_hub().await;
    let dir = key_dir("tail-revoked");
    let (token_file, cursor_file) = (dir.join("token"), dir.join("cursor"));
    std::fs::write(
        &token_file,
        hs256(json!({ "sub": "pos-v", "iat": now() - 5, "exp": now() + 600 })),
    )
    .unwrap();
    let mut tail = Tail::start(&hub, "pos-v", &token_file, &cursor_file);
    support::wait_until(WAIT, "the tail connects", async || {
        metrics::scrape(hub.addr())
            .await
            .value_or_zero("sse_connections", &[])
            == 1.0
    })
    .await;
    publish(&hub, "pos-v", "first").await;
    support::wait_until(WAIT, "the tail prints the first event", async || {
        tail.data() == ["first"]
    })
    .await;
    let authorization = format!(
        "Bearer {}",
        hs256(json!({ "scope": "admin", "exp": now() + 600 }))
    );
    let response = http::request(
        hub.addr(),
        "POST",
        "/admin/revoke",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", &authorization),
        ],
        Some(br#"{"device":"pos-v"}"#),
    )
    .await;
    assert_eq!(response.status, 202, "{}", response.text());
    let status = tokio::time::timeout(WAIT, tail.child.wait())
        .await
        .expect("the tail stops by itself")
        .unwrap();
    assert_eq!(status.code(), Some(3), "stderr: {}", tail.stderr());
    // The reader of its stderr may still be reading its last words when the exit is seen.
    support::wait_until(WAIT, "the tail says it was revoked", async || {
        tail.stderr().contains("revoked")
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

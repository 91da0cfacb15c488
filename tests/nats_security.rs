//! The hub against a `nats-server -js` that wants TLS or credentials: TLS with a
//! private CA, mutual TLS, a server certificate the hub must refuse, each kind of credentials
//! (user and password file, token file, nkey seed file, creds file in operator mode), and the
//! least-privilege permissions of docs/security.md ("Least privilege: NATS") for the hub and for
//! a producer. Each test starts its own server from a configuration file
//! ([`NatsServer::builder`]) and the certificates of [`TestPki`], made when it runs.
//!
//! Secrets are random per test and must never show in the hub's log (at `RUST_LOG=debug`) nor
//! in `/admin/status`.

mod support;

use support::nats::{shard, subject};
use support::sse::resync_reason;

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use support::{
    http,
    hub::HubBuilder,
    live_stream,
    nats::{headers, NatsServer},
    publish_to, stream_path,
    tls::TestPki,
    Hub, SseClient, SseNext,
};

const WAIT: Duration = Duration::from_secs(20);
const STREAM: &str = "POSTHORN";
/// A hub that cannot start exits within its connect timeout (10 s); this bounds the wait.
const EXIT_WAIT: Duration = Duration::from_secs(30);

fn nats_hub(url: &str) -> HubBuilder {
    Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "nats")
        .env("POSTHORN_NATS__URL", url)
}

/// A random string no test writes anywhere else, to look for in logs.
fn random_secret(what: &str) -> String {
    format!("{what}-{:016x}{:016x}", rand_u64(), rand_u64())
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    hasher.finish()
}

/// Files of one test (secrets, creds), removed with it.
struct Files(PathBuf);

impl Files {
    fn new() -> Files {
        Files(support::unique_temp_dir("nats-secrets"))
    }

    /// Writes `content` plus a trailing newline, as `echo` and editors leave it.
    fn secret(&self, name: &str, content: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, format!("{content}\n")).expect("write secret file");
        path
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn path_str(path: &Path) -> String {
    path.display().to_string()
}

/// Live delivery, then a resume from a cursor (a replay through a consumer of its own): what a
/// hub does with NATS, end to end.
async fn publish_live_and_resume(hub: &Hub, device: &str) {
    let mut live = live_stream(hub, device).await;
    let first = publish_to(hub, device, "first").await;
    let event = live.expect_event(WAIT).await;
    assert_eq!(
        (event.data.as_str(), event.id.as_deref()),
        ("first", Some(first.as_str()))
    );
    drop(live);
    // Two versions of one supersede name, with a ttl: the index is written after each ack and
    // read by the replay, which sends the newest only.
    for data in ["second", "third"] {
        let response = http::post_json(
            hub.addr(),
            "/v1/events",
            &serde_json::json!({
                "device": device, "data": data, "supersede": "state", "ttl": "10m"
            }),
        )
        .await;
        assert_eq!(response.status, 201, "{}", response.text());
    }
    let mut resumed = SseClient::connect(
        hub.addr(),
        &stream_path(device),
        &[("Last-Event-ID", &first)],
    )
    .await;
    assert_eq!(resumed.expect_event(WAIT).await.data, "third");
}

/// The hub's log and `/admin/status` hold none of `secrets`, though both tell of what the secrets
/// were for: the status shows `nats.{key}` (the key that holds or names them), the log is a
/// debug log that says the hub connected.
async fn assert_not_shown(hub: &Hub, key: &str, secrets: &[&str]) {
    let status = http::get(hub.addr(), "/admin/status").await;
    assert_eq!(status.status, 200);
    let shown = status.json()["config"]["nats"][key].clone();
    let status = status.text();
    assert!(
        shown.as_str().is_some_and(|value| !value.is_empty()),
        "no nats.{key} in /admin/status: {status}"
    );
    let log = hub.stderr_log();
    assert!(
        log.contains(" DEBUG ") && log.contains("nats: connected"),
        "not the debug log of a hub that connected:\n{log}"
    );
    for secret in secrets {
        assert!(
            !status.contains(secret),
            "{secret} in /admin/status: {status}"
        );
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
}

/// Runs a hub that must fail to start: exit code 1 ("cannot start the backend"); returns its
/// output.
async fn start_up_fails(hub: HubBuilder) -> String {
    let (code, log) = hub.run_to_exit(EXIT_WAIT).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains("cannot start the backend"), "{log}");
    log
}

/// (a) TLS with the test CA, given to the hub as `nats.tls_ca_file`, over a `tls://` URL: a
/// plain client is turned away, the hub publishes, streams live and resumes.
#[tokio::test]
async fn tls_with_a_private_ca() {
    let mut pki = TestPki::new("posthorn test CA");
    let cert = pki.server_cert();
    let nats = NatsServer::builder()
        .tls(&cert, pki.ca_file(), false)
        .start()
        .await;
    let plain = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .connect(nats.url())
        .await;
    assert!(
        plain.is_err(),
        "a client without the CA connected, so the server is not on TLS"
    );
    let hub = nats_hub(&format!("tls://{}", nats.addr()))
        .env("POSTHORN_NATS__TLS_CA_FILE", path_str(pki.ca_file()))
        .start()
        .await;
    publish_live_and_resume(&hub, "pos-tls").await;
    let status = http::get(hub.addr(), "/admin/status").await.json();
    assert_eq!(
        status["config"]["nats"]["tls_ca_file"],
        path_str(pki.ca_file())
    );
}

/// With a TLS file configured the hub requires TLS: a server that does not offer it is refused
/// instead of being spoken to in plain text.
#[tokio::test]
async fn a_plain_server_is_refused_when_tls_is_configured() {
    let pki = TestPki::new("posthorn test CA");
    let nats = NatsServer::start().await;
    let log = start_up_fails(
        nats_hub(&nats.url()).env("POSTHORN_NATS__TLS_CA_FILE", path_str(pki.ca_file())),
    )
    .await;
    assert!(log.contains("nats: cannot connect to"), "{log}");
    // Refused for want of TLS, not for anything said in plain text.
    assert!(log.contains("TLS failed"), "{log}");
}

/// (b) A server that verifies clients (`verify: true`): without a client certificate the hub
/// stops at start-up saying it could not connect; with one signed by the CA it works.
#[tokio::test]
async fn mutual_tls_needs_the_client_certificate() {
    let mut pki = TestPki::new("posthorn test CA");
    let cert = pki.server_cert();
    let client = pki.client_cert("posthorn-hub");
    let nats = NatsServer::builder()
        .tls(&cert, pki.ca_file(), true)
        .start()
        .await;
    let log = start_up_fails(
        nats_hub(&nats.url()).env("POSTHORN_NATS__TLS_CA_FILE", path_str(pki.ca_file())),
    )
    .await;
    assert!(log.contains("nats: cannot connect to"), "{log}");
    assert!(log.contains("TLS failed"), "{log}");
    let hub = nats_hub(&nats.url())
        .env("POSTHORN_NATS__TLS_CA_FILE", path_str(pki.ca_file()))
        .env("POSTHORN_NATS__TLS_CERT_FILE", path_str(&client.cert))
        .env("POSTHORN_NATS__TLS_KEY_FILE", path_str(&client.key))
        .start()
        .await;
    publish_live_and_resume(&hub, "pos-mtls").await;
}

/// (c) A server whose certificate another CA signed is refused: start-up fails naming TLS and
/// the verification error.
#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused() {
    let pki = TestPki::new("posthorn test CA");
    let mut other = TestPki::new("someone else's CA");
    let cert = other.server_cert();
    let nats = NatsServer::builder()
        .tls(&cert, other.ca_file(), false)
        .start()
        .await;
    let log = start_up_fails(
        nats_hub(&format!("tls://{}", nats.addr()))
            .env("POSTHORN_NATS__TLS_CA_FILE", path_str(pki.ca_file())),
    )
    .await;
    assert!(log.contains("TLS failed"), "{log}");
    assert!(
        log.contains("UnknownIssuer") || log.contains("invalid peer certificate"),
        "{log}"
    );
}

/// (d) `nats.user` + `nats.password_file`: a wrong password stops start-up as refused
/// credentials; the right one works, and neither password shows in the debug log or in
/// `/admin/status`. A user and password inside `nats.url` work too.
#[tokio::test]
async fn user_and_password_file() {
    let password = random_secret("pw");
    let nats = NatsServer::builder()
        .config(format!(
            "authorization {{\n  users = [ {{ user: hub, password: \"{password}\" }} ]\n}}\n"
        ))
        .start()
        .await;
    let files = Files::new();
    let wrong = random_secret("wrong");
    let log = start_up_fails(
        nats_hub(&nats.url())
            .env("RUST_LOG", "debug")
            .env("POSTHORN_NATS__USER", "hub")
            .env(
                "POSTHORN_NATS__PASSWORD_FILE",
                path_str(&files.secret("wrong", &wrong)),
            ),
    )
    .await;
    assert!(log.contains("refused the credentials"), "{log}");
    // The debug log, which names the key of the refused password but not the password.
    assert!(log.contains(" DEBUG "), "{log}");
    assert!(log.contains("nats.password_file"), "{log}");
    assert!(!log.contains(&wrong), "{log}");
    let hub = nats_hub(&nats.url())
        .env("RUST_LOG", "debug")
        .env("POSTHORN_NATS__USER", "hub")
        .env(
            "POSTHORN_NATS__PASSWORD_FILE",
            path_str(&files.secret("password", &password)),
        )
        .start()
        .await;
    publish_live_and_resume(&hub, "pos-user").await;
    assert_not_shown(&hub, "password_file", &[&password]).await;
    let status = http::get(hub.addr(), "/admin/status").await.json();
    assert_eq!(status["config"]["nats"]["user"], "hub");
    drop(hub);
    let hub = nats_hub(&format!("nats://hub:{password}@{}", nats.addr()))
        .env("RUST_LOG", "debug")
        .start()
        .await;
    publish_to(&hub, "pos-user", "with the URL's password").await;
    assert_not_shown(&hub, "url", &[&password]).await;
    let status = http::get(hub.addr(), "/admin/status").await.json();
    assert_eq!(
        status["config"]["nats"]["url"],
        format!("nats://(redacted)@{}", nats.addr())
    );
}

/// (e) `nats.token_file`: works, and the token never shows in the debug log or
/// `/admin/status`.
#[tokio::test]
async fn token_file() {
    let token = random_secret("token");
    let nats = NatsServer::builder()
        .config(format!("authorization {{\n  token: \"{token}\"\n}}\n"))
        .start()
        .await;
    let files = Files::new();
    let hub = nats_hub(&nats.url())
        .env("RUST_LOG", "debug")
        .env(
            "POSTHORN_NATS__TOKEN_FILE",
            path_str(&files.secret("token", &token)),
        )
        .start()
        .await;
    publish_live_and_resume(&hub, "pos-token").await;
    assert_not_shown(&hub, "token_file", &[&token]).await;
}

/// (f) `nats.nkey_seed_file` with a user nkey made by the test; the seed never shows. A server
/// that does not know the key refuses it.
#[tokio::test]
async fn nkey_seed_file() {
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().expect("seed");
    let stranger = nkeys::KeyPair::new_user();
    let nats = NatsServer::builder()
        .config(format!(
            "authorization {{\n  users = [ {{ nkey: {} }} ]\n}}\n",
            user.public_key()
        ))
        .start()
        .await;
    let files = Files::new();
    let log = start_up_fails(nats_hub(&nats.url()).env(
        "POSTHORN_NATS__NKEY_SEED_FILE",
        path_str(&files.secret("stranger", &stranger.seed().expect("seed"))),
    ))
    .await;
    assert!(log.contains("refused the credentials"), "{log}");
    let hub = nats_hub(&nats.url())
        .env("RUST_LOG", "debug")
        .env(
            "POSTHORN_NATS__NKEY_SEED_FILE",
            path_str(&files.secret("seed", &seed)),
        )
        .start()
        .await;
    publish_live_and_resume(&hub, "pos-nkey").await;
    assert_not_shown(&hub, "nkey_seed_file", &[&seed]).await;
}

/// JWTs of nats-server's operator mode, made and signed here (what `nsc` does): header and
/// claims as base64url without padding, signed with ed25519 by the issuer's nkey.
mod jwt {
    use serde_json::{json, Value};

    fn base64url(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
            for i in 0..=chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            }
        }
        out
    }

    /// A JWT for `subject` with claims `nats`, issued (signed) by `issuer`.
    pub fn sign(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: Value) -> String {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let iat = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let claims = json!({
            // nats-server 2.9 checks the signature and the issuer, not how `jti` was made.
            "jti": format!("POSTHORNTEST{iat}X{n}X{}", std::process::id()),
            "iat": iat,
            "iss": issuer.public_key(),
            "name": name,
            "sub": subject,
            "nats": nats,
        });
        let header = base64url(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
        let body = base64url(claims.to_string().as_bytes());
        let signed = format!("{header}.{body}");
        let signature = issuer.sign(signed.as_bytes()).expect("sign");
        format!("{signed}.{}", base64url(&signature))
    }

    /// Unlimited connections, subscriptions and data; JetStream with unlimited storage when
    /// `jetstream`.
    pub fn account(jetstream: bool) -> Value {
        let storage = if jetstream { -1 } else { 0 };
        json!({
            "type": "account",
            "version": 2,
            "limits": {
                "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                "wildcards": true, "conn": -1, "leaf": -1,
                "mem_storage": storage, "disk_storage": storage, "streams": -1, "consumer": -1,
            },
            "default_permissions": { "pub": {}, "sub": {} },
        })
    }

    pub fn user() -> Value {
        json!({
            "type": "user",
            "version": 2,
            "pub": {}, "sub": {},
            "subs": -1, "data": -1, "payload": -1,
        })
    }

    pub fn operator(system_account: &str) -> Value {
        json!({ "type": "operator", "version": 2, "system_account": system_account })
    }

    /// The `.creds` file of a user: its JWT and its seed.
    pub fn creds(user_jwt: &str, seed: &str) -> String {
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        )
    }

    #[test]
    fn base64url_without_padding() {
        assert_eq!(base64url(b""), "");
        assert_eq!(base64url(b"f"), "Zg");
        assert_eq!(base64url(b"fo"), "Zm8");
        assert_eq!(base64url(b"foo"), "Zm9v");
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }
}

/// (g) `nats.creds_file` against a server in operator (JWT) mode: an operator, a system account
/// and an account with JetStream, made by the test and preloaded into the server's memory
/// resolver; the hub's user JWT is signed by the account. A user the account never signed is
/// refused.
#[tokio::test]
async fn creds_file_in_operator_mode() {
    let operator = nkeys::KeyPair::new_operator();
    let system = nkeys::KeyPair::new_account();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let operator_jwt = jwt::sign(
        &operator,
        &operator.public_key(),
        "posthorn-test",
        jwt::operator(&system.public_key()),
    );
    let system_jwt = jwt::sign(&operator, &system.public_key(), "SYS", jwt::account(false));
    let account_jwt = jwt::sign(&operator, &account.public_key(), "APP", jwt::account(true));
    let user_jwt = jwt::sign(&account, &user.public_key(), "hub", jwt::user());
    let nats = NatsServer::builder()
        .config(format!(
            "operator: {operator_jwt}\nsystem_account: {}\nresolver: MEMORY\n\
             resolver_preload: {{\n  {}: {system_jwt}\n  {}: {account_jwt}\n}}\n",
            system.public_key(),
            system.public_key(),
            account.public_key(),
        ))
        .start()
        .await;
    let files = Files::new();
    let seed = user.seed().expect("seed");
    // Signed by an account the operator never signed.
    let rogue = nkeys::KeyPair::new_account();
    let rogue_jwt = jwt::sign(&rogue, &user.public_key(), "rogue", jwt::user());
    let log = start_up_fails(nats_hub(&nats.url()).env(
        "POSTHORN_NATS__CREDS_FILE",
        path_str(&files.secret("rogue.creds", &jwt::creds(&rogue_jwt, &seed))),
    ))
    .await;
    assert!(log.contains("nats: cannot connect to"), "{log}");
    let hub = nats_hub(&nats.url())
        .env("RUST_LOG", "debug")
        .env(
            "POSTHORN_NATS__CREDS_FILE",
            path_str(&files.secret("hub.creds", &jwt::creds(&user_jwt, &seed))),
        )
        .start()
        .await;
    publish_live_and_resume(&hub, "pos-creds").await;
    assert_not_shown(&hub, "creds_file", &[&seed]).await;
}

/// The permissions of docs/security.md ("Least privilege: NATS"), for the default stream and
/// subject prefix, as nats-server configuration.
const HUB_PERMISSIONS: &str = r#"{
        publish: { allow: [
          "$JS.API.STREAM.INFO.POSTHORN",
          "$JS.API.STREAM.CREATE.POSTHORN",
          "$JS.API.STREAM.UPDATE.POSTHORN",
          "$JS.API.STREAM.MSG.GET.POSTHORN",
          "$JS.API.CONSUMER.CREATE.POSTHORN",
          "$JS.API.CONSUMER.INFO.POSTHORN.*",
          "$JS.API.CONSUMER.MSG.NEXT.POSTHORN.*",
          "$JS.API.CONSUMER.DELETE.POSTHORN.*",
          "$JS.API.STREAM.INFO.POSTHORN_SUP",
          "$JS.API.STREAM.CREATE.POSTHORN_SUP",
          "$JS.API.STREAM.MSG.GET.POSTHORN_SUP",
          "posthorn.ev.*",
          "posthorn.ev.sup.>",
          "$JS.API.STREAM.INFO.KV_POSTHORN_devices",
          "$JS.API.STREAM.INFO.KV_POSTHORN_pods",
          "$JS.API.STREAM.INFO.KV_POSTHORN_broadcasts",
          "$JS.API.STREAM.INFO.KV_POSTHORN_groups",
          "$JS.API.STREAM.CREATE.KV_POSTHORN_devices",
          "$JS.API.STREAM.CREATE.KV_POSTHORN_pods",
          "$JS.API.STREAM.CREATE.KV_POSTHORN_broadcasts",
          "$JS.API.STREAM.CREATE.KV_POSTHORN_groups",
          "$JS.API.STREAM.UPDATE.KV_POSTHORN_devices",
          "$JS.API.STREAM.UPDATE.KV_POSTHORN_pods",
          "$JS.API.STREAM.UPDATE.KV_POSTHORN_broadcasts",
          "$JS.API.STREAM.UPDATE.KV_POSTHORN_groups",
          "$JS.API.STREAM.MSG.GET.KV_POSTHORN_devices",
          "$JS.API.STREAM.MSG.GET.KV_POSTHORN_pods",
          "$JS.API.STREAM.MSG.GET.KV_POSTHORN_broadcasts",
          "$JS.API.STREAM.MSG.GET.KV_POSTHORN_groups",
          "$JS.API.CONSUMER.CREATE.KV_POSTHORN_devices",
          "$JS.API.CONSUMER.CREATE.KV_POSTHORN_pods",
          "$JS.API.CONSUMER.MSG.NEXT.KV_POSTHORN_devices.*",
          "$JS.API.CONSUMER.MSG.NEXT.KV_POSTHORN_pods.*",
          "$JS.API.CONSUMER.DELETE.KV_POSTHORN_devices.*",
          "$JS.API.CONSUMER.DELETE.KV_POSTHORN_pods.*",
          "$KV.POSTHORN_devices.>",
          "$KV.POSTHORN_pods.>",
          "$KV.POSTHORN_broadcasts.>",
          "$KV.POSTHORN_groups.>",
          "posthorn.ev.fleet.pods",
          "$JS.API.STREAM.INFO.KV_POSTHORN_revocations",
          "$JS.API.STREAM.CREATE.KV_POSTHORN_revocations",
          "$JS.API.STREAM.UPDATE.KV_POSTHORN_revocations",
          "$JS.API.STREAM.MSG.GET.KV_POSTHORN_revocations",
          "$JS.API.CONSUMER.CREATE.KV_POSTHORN_revocations",
          "$JS.API.CONSUMER.MSG.NEXT.KV_POSTHORN_revocations.*",
          "$JS.API.CONSUMER.DELETE.KV_POSTHORN_revocations.*",
          "$KV.POSTHORN_revocations.>"
        ] }
        subscribe: { allow: [ "_INBOX.>", "posthorn.ev.fleet.pods" ] }
      }"#;
const PRODUCER_PERMISSIONS: &str = r#"{
        publish: { allow: [ "posthorn.ev.*" ] }
        subscribe: { allow: [ "_INBOX_producer.>" ] }
      }"#;
/// The producer's inbox prefix: its subscribe permission covers its own inboxes only, never the
/// hub's (`_INBOX.>`), where the hub's consumers deliver events.
const PRODUCER_INBOX: &str = "_INBOX_producer";

/// One account with JetStream and three users: the hub and the producer with exactly the
/// permissions of docs/security.md, and an operator (`admin`) with all of them, for what tests
/// do behind the hub's back.
struct LeastPrivilege {
    nats: NatsServer,
    hub_password: String,
    producer_password: String,
    admin_password: String,
}

impl LeastPrivilege {
    async fn start() -> LeastPrivilege {
        let hub_password = random_secret("hub");
        let producer_password = random_secret("producer");
        let admin_password = random_secret("admin");
        let nats = NatsServer::builder()
            .config(format!(
                "accounts {{\n  APP {{\n    jetstream: enabled\n    users = [\n      \
                 {{ user: hub, password: \"{hub_password}\", permissions: {HUB_PERMISSIONS} }}\n      \
                 {{ user: producer, password: \"{producer_password}\", permissions: {PRODUCER_PERMISSIONS} }}\n      \
                 {{ user: admin, password: \"{admin_password}\" }}\n    ]\n  }}\n}}\n"
            ))
            .start()
            .await;
        LeastPrivilege {
            nats,
            hub_password,
            producer_password,
            admin_password,
        }
    }

    fn hub(&self, files: &Files) -> HubBuilder {
        nats_hub(&self.nats.url())
            .env("POSTHORN_NATS__USER", "hub")
            .env(
                "POSTHORN_NATS__PASSWORD_FILE",
                path_str(&files.secret("hub-password", &self.hub_password)),
            )
    }

    async fn admin(&self) -> jetstream::Context {
        let client = async_nats::ConnectOptions::with_user_and_password(
            "admin".into(),
            self.admin_password.clone(),
        )
        .connect(self.nats.url())
        .await
        .expect("admin connects");
        jetstream::new(client)
    }

    /// The server's log lines about permissions refused to `user`.
    fn violations_of(&self, user: &str) -> Vec<String> {
        let needle = format!("User \"{user}\"");
        self.nats
            .log()
            .lines()
            .filter(|line| line.contains("Violation") && line.contains(&needle))
            .map(str::to_string)
            .collect()
    }
}

/// The hub as the least-privilege hub user does everything it does: adopts an existing stream
/// and updates its limits, publishes, tails live, resumes, answers a cursor before a purged hole
/// `expired` (a message get), follows a deleted stream with `resync` `data_lost` and creates it
/// again, and keeps reading across a NATS restart (its consumer asks for its info after a
/// reconnect); the server refuses it nothing.
#[tokio::test]
async fn the_hub_needs_no_more_than_its_permissions() {
    let mut setup = LeastPrivilege::start().await;
    let admin = setup.admin().await;
    // An existing stream with another max age: the hub adopts it and sets its own (UPDATE).
    admin
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec!["posthorn.ev.*".into()],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("admin creates the stream");
    let files = Files::new();
    let hub = setup.hub(&files).start().await;
    assert!(
        hub.stderr_log().contains("setting max age"),
        "{}",
        hub.stderr_log()
    );
    publish_live_and_resume(&hub, "pos-2").await;

    // A hole inside the stream: a cursor before it is answered `expired` (STREAM.MSG.GET).
    let other = (0..)
        .map(|i| format!("h-{i}"))
        .find(|d| shard(d) != shard("pos-2"))
        .expect("a device on another shard");
    publish_to(&hub, &other, "old").await;
    let h1 = publish_to(&hub, "pos-2", "h1").await;
    publish_to(&hub, "pos-2", "h2").await;
    let h3 = publish_to(&hub, "pos-2", "h3").await;
    admin
        .get_stream(STREAM)
        .await
        .expect("stream")
        .purge()
        .filter(subject("pos-2"))
        .keep(1)
        .await
        .expect("purge");
    let mut expired =
        SseClient::connect(hub.addr(), &stream_path("pos-2"), &[("Last-Event-ID", &h1)]).await;
    let event = expired.expect_event(WAIT).await;
    assert_eq!(resync_reason(&event), "expired");
    assert_eq!(event.id.as_deref(), Some(h3.as_str()));
    drop(expired);

    // NATS restarts: the live stream goes on (the consumer's info after the reconnect).
    let mut live = live_stream(&hub, "pos-9").await;
    setup.nats.restart().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let after_restart = loop {
        let response = http::post_json(
            hub.addr(),
            "/v1/events",
            &serde_json::json!({ "device": "pos-9", "data": "after the restart" }),
        )
        .await;
        if response.status == 201 {
            break response;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no publish after the restart: {}",
            response.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(after_restart.status, 201);
    assert_eq!(live.expect_event(WAIT).await.data, "after the restart");

    // The stream is deleted: `resync` `data_lost`, then the hub creates it again (CREATE).
    let admin = setup.admin().await;
    admin
        .delete_stream(STREAM)
        .await
        .expect("delete the stream");
    let event = live.expect_event(WAIT).await;
    assert_eq!(resync_reason(&event), "data_lost");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let response = http::post_json(
            hub.addr(),
            "/v1/events",
            &serde_json::json!({ "device": "pos-9", "data": "new life" }),
        )
        .await;
        if response.status == 201 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no publish to the new stream: {}",
            response.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(live.expect_event(WAIT).await.data, "new life");
    // The fleet store under the same rights: the streaming device is online (beats, presence
    // writes), a listing and an ack work.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let device = http::get(hub.addr(), "/v1/devices/pos-9").await;
        assert_eq!(device.status, 200, "{}", device.text());
        if device.json()["online"] == true {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pos-9 never online: {}",
            device.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let listing = http::get(hub.addr(), "/v1/devices?limit=10").await;
    assert_eq!(listing.status, 200, "{}", listing.text());
    // Absences, but of wordings that a_producer_can_publish_but_not_read finds present for the
    // producer (the server's log line, and the client event the hub logs as a warning).
    let violations = setup.violations_of("hub");
    assert!(violations.is_empty(), "{violations:#?}");
    assert!(
        !hub.stderr_log().contains("Permissions Violation"),
        "{}",
        hub.stderr_log()
    );
}

/// A producer with the producer permissions publishes an event in the external producer format
/// (docs/stream-format.md) with a JetStream ack, and the hub delivers it; but it cannot create a
/// consumer, get a message, read the stream's info, or subscribe to the events' subjects: the
/// server refuses each as a permissions violation, and the subscription receives nothing.
#[tokio::test]
async fn a_producer_can_publish_but_not_read() {
    let setup = LeastPrivilege::start().await;
    let files = Files::new();
    let hub = setup.hub(&files).start().await;
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let producer = async_nats::ConnectOptions::with_user_and_password(
        "producer".into(),
        setup.producer_password.clone(),
    )
    .custom_inbox_prefix(PRODUCER_INBOX)
    .event_callback(move |event| {
        let events_tx = events_tx.clone();
        async move {
            let _ = events_tx.send(event.to_string());
        }
    })
    .connect(setup.nats.url())
    .await
    .expect("the producer connects");
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(2))
        .build(producer.clone());

    let mut live = live_stream(&hub, "pos-17").await;
    let ack = js
        .publish_with_headers(
            subject("pos-17"),
            headers(&[("Posthorn-Dev", "pos-17"), ("Posthorn-Type", "order")]),
            "from the producer".into(),
        )
        .await
        .expect("publish")
        .await
        .expect("JetStream acknowledges the producer's publish");
    assert_eq!(ack.stream, STREAM);
    let event = live.expect_event(WAIT).await;
    assert_eq!(
        (event.event.as_str(), event.data.as_str()),
        ("order", "from the producer")
    );

    let mut peek = producer
        .subscribe("posthorn.ev.*")
        .await
        .expect("the client sends the subscription");
    let consumer = js
        .create_consumer_on_stream(
            pull::Config {
                filter_subject: subject("pos-17"),
                ..Default::default()
            },
            STREAM,
        )
        .await;
    assert!(consumer.is_err(), "the producer created a consumer");
    let message = js
        .get_stream_no_info(STREAM)
        .await
        .expect("a handle, no request")
        .get_raw_message(ack.sequence)
        .await;
    assert!(message.is_err(), "the producer read a message");
    assert!(
        js.get_stream(STREAM).await.is_err(),
        "the producer read the stream's info"
    );
    publish_to(&hub, "pos-17", "not for the producer").await;
    assert_eq!(live.expect_event(WAIT).await.data, "not for the producer");
    let leaked = tokio::time::timeout(
        Duration::from_secs(1),
        futures_util::StreamExt::next(&mut peek),
    )
    .await;
    assert!(
        !matches!(leaked, Ok(Some(_))),
        "the producer's subscription received an event: {leaked:?}"
    );

    let mut refused = Vec::new();
    while let Ok(event) = events.try_recv() {
        refused.push(event);
    }
    let refused = refused.join("\n");
    for what in [
        "Subscription to \"posthorn.ev.*\"",
        "Publish to \"$JS.API.CONSUMER.CREATE.POSTHORN\"",
        "Publish to \"$JS.API.STREAM.MSG.GET.POSTHORN\"",
        "Publish to \"$JS.API.STREAM.INFO.POSTHORN\"",
    ] {
        assert!(
            refused.contains(&format!("Permissions Violation for {what}")),
            "no violation for {what} in:\n{refused}"
        );
    }
    let violations = setup.violations_of("producer").join("\n");
    assert!(
        violations.contains("$JS.API.CONSUMER.CREATE.POSTHORN"),
        "{violations}"
    );
    assert!(setup.violations_of("hub").is_empty());
    assert!(matches!(
        live.next_event(Duration::from_millis(200)).await,
        SseNext::Timeout
    ));
}

/// Two kinds of credentials stop start-up before anything connects (exit 64, a configuration
/// error naming both keys); so does a secret file that cannot be read, naming key and path.
#[tokio::test]
async fn credentials_are_checked_at_start_up() {
    let (code, log) = nats_hub("nats://127.0.0.1:1")
        .env("POSTHORN_NATS__TOKEN_FILE", "/run/secrets/token")
        .env("POSTHORN_NATS__CREDS_FILE", "/run/secrets/hub.creds")
        .run_to_exit(EXIT_WAIT)
        .await;
    assert_eq!(code, Some(64), "{log}");
    assert!(
        log.contains("nats.creds_file: cannot be used together with nats.token_file"),
        "{log}"
    );
    let missing = "/nonexistent/posthorn-test/password";
    let (code, log) = nats_hub("nats://127.0.0.1:1")
        .env("POSTHORN_NATS__USER", "hub")
        .env("POSTHORN_NATS__PASSWORD_FILE", missing)
        .run_to_exit(EXIT_WAIT)
        .await;
    assert_eq!(code, Some(64), "{log}");
    assert!(
        log.contains(&format!("nats.password_file: {missing} cannot be read")),
        "{log}"
    );
}

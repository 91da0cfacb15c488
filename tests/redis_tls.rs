//! TLS to Redis (`rediss://`) and the least-privilege ACL users of docs/security.md, against real
//! redis-server processes that listen with TLS only (certificates made when the test runs,
//! `support::tls`): one instance, several (`redis.urls`) and a 3-master TLS cluster; mutual TLS;
//! servers the hub must refuse; the start-up checks of the `tls_*` files; and the hub and a
//! producer running as exactly the ACL users the documentation gives, with the `default` user off.

mod support;

use support::sse::resync_reason;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::{
    http, live_stream, publish_to,
    redis::{RedisBuilder, RedisCluster, RedisServer, RedisTls},
    stream_path,
    tls::TestPki,
    Hub, RespClient, RespValue, SseClient,
};

const WAIT: Duration = Duration::from_secs(20);
/// How long a hub that cannot connect may take to give up (fred fails fast; this is a guard).
const EXIT_WAIT: Duration = Duration::from_secs(30);
const SECURITY_DOC: &str = include_str!("../docs/security.md");

fn redis_hub() -> support::hub::HubBuilder {
    Hub::builder()
        .env("POSTHORN_BACKEND__KIND", "redis")
        // Short blocks keep shutdown and checks quick in tests; behaviour is the same.
        .env("POSTHORN_REDIS__BLOCK", "1s")
}

fn tls_hub(url: &str, pki: &TestPki) -> support::hub::HubBuilder {
    redis_hub()
        .env("POSTHORN_REDIS__URL", url)
        .env("POSTHORN_REDIS__TLS_CA_FILE", path_text(pki.ca_file()))
}

fn path_text(path: &Path) -> String {
    path.to_str().expect("UTF-8 path").to_string()
}

fn crc_shard(device: &str, shards: u32) -> u32 {
    crc32fast::hash(device.as_bytes()) % shards
}

/// A device whose shard (of 64) satisfies `wanted`.
fn device_where(wanted: impl Fn(u32) -> bool) -> String {
    (0..)
        .map(|i| format!("dev-{i}"))
        .find(|device| wanted(crc_shard(device, 64)))
        .expect("some device")
}

/// The output of a hub that must not start.
async fn start_refused(hub: support::hub::HubBuilder, why: &str) -> support::hub::EarlyExit {
    match hub.ready_timeout(EXIT_WAIT).try_start().await {
        Ok(_) => panic!("the hub started: {why}"),
        Err(exit) => exit,
    }
}

/// Live delivery of a publish, then a resume after the first event's id that delivers exactly
/// the later ones, of which one is superseded: [`APPENDED`] entries on the device's stream.
/// Entries [`publish_live_and_resume`] appends.
const APPENDED: i64 = 4;

async fn publish_live_and_resume(hub: &Hub, device: &str) {
    let mut live = live_stream(hub, device).await;
    let first = publish_to(hub, device, "one").await;
    publish_to(hub, device, "two").await;
    let got: Vec<String> = live
        .expect_events(2, WAIT)
        .await
        .into_iter()
        .map(|event| event.data)
        .collect();
    assert_eq!(got, ["one", "two"], "live on {device}");
    // A later version of a supersede name, with a ttl: the append script writes the index, the
    // replay reads it and sends the newest only (and the trim pass prunes the index).
    let mut live = live_stream(hub, device).await;
    for data in ["two, v1", "two, v2"] {
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
    live.expect_events(2, WAIT).await;
    drop(live);
    let mut resumed = SseClient::connect(
        hub.addr(),
        &stream_path(device),
        &[("Last-Event-ID", &first)],
    )
    .await;
    assert_eq!(resumed.status(), 200);
    let got: Vec<String> = resumed
        .expect_events(2, WAIT)
        .await
        .into_iter()
        .map(|event| event.data)
        .collect();
    assert_eq!(got, ["two", "two, v2"], "resume on {device}");
}

/// (a) One instance over TLS, verified with the test CA: live delivery and resume work, and the
/// server really only speaks TLS (the harness's plain probe is refused).
#[tokio::test]
async fn tls_instance_streams_and_resumes() {
    let mut pki = TestPki::new("posthorn test CA");
    let redis = RedisServer::builder()
        .tls(RedisTls::new(&mut pki, "no"))
        .start()
        .await;
    assert!(redis.url().starts_with("rediss://127.0.0.1:"));
    let hub = tls_hub(&redis.url(), &pki).start().await;
    publish_live_and_resume(&hub, "pos-17").await;
    assert_eq!(redis.client().await.xlen("pos-ev:2").await, APPENDED);
    // Without TLS the port answers nothing usable: the hub's traffic was encrypted.
    let mut plain = tokio::net::TcpStream::connect(redis.addr())
        .await
        .expect("connect");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    plain.write_all(b"PING\r\n").await.expect("write");
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut reply)).await;
    assert!(!reply.starts_with(b"+PONG"), "{reply:?}");
}

/// (b) A server that requires client certificates: a hub without one stops at start-up with the
/// TLS reason; with `redis.tls_cert_file`/`tls_key_file` it works.
#[tokio::test]
async fn mutual_tls_needs_the_client_certificate() {
    let mut pki = TestPki::new("posthorn test CA");
    let redis = RedisServer::builder()
        .tls(RedisTls::new(&mut pki, "yes"))
        .start()
        .await;
    let refused = start_refused(
        tls_hub(&redis.url(), &pki),
        "a hub without a client certificate must not start",
    )
    .await;
    assert_eq!(refused.code(), Some(1), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("cannot start the backend")
            && refused.stderr.to_lowercase().contains("certificate"),
        "{}",
        refused.stderr
    );

    let client = pki.client_cert("posthorn");
    let hub = tls_hub(&redis.url(), &pki)
        .env("POSTHORN_REDIS__TLS_CERT_FILE", path_text(&client.cert))
        .env("POSTHORN_REDIS__TLS_KEY_FILE", path_text(&client.key))
        .start()
        .await;
    publish_live_and_resume(&hub, "pos-17").await;
}

/// (c) TLS is verified: a server certificate from another CA, and one of the right CA for another
/// name, both stop the hub at start-up with the verification error.
#[tokio::test]
async fn the_server_certificate_is_verified() {
    let mut server_pki = TestPki::new("the server's CA");
    let other_pki = TestPki::new("another CA");
    let redis = RedisServer::builder()
        .tls(RedisTls::new(&mut server_pki, "no"))
        .start()
        .await;
    let refused = start_refused(
        tls_hub(&redis.url(), &other_pki),
        "a server of another CA must be refused",
    )
    .await;
    assert_eq!(refused.code(), Some(1), "{}", refused.stderr);
    assert!(
        refused.stderr.contains(&format!(
            "redis TLS: the certificate of 127.0.0.1 was refused (invalid peer certificate: \
             UnknownIssuer); trusted CAs: redis.tls_ca_file {}",
            other_pki.ca_file().display()
        )),
        "{}",
        refused.stderr
    );

    let mut tls = RedisTls::new(&mut server_pki, "no");
    tls.server = server_pki.server_cert_for(&["redis.example"]);
    tls.server_name = "redis.example".into();
    let misnamed = RedisServer::builder().tls(tls).start().await;
    let refused = start_refused(
        tls_hub(&misnamed.url(), &server_pki),
        "a certificate for another name must be refused",
    )
    .await;
    assert!(
        refused.stderr.contains(
            "the certificate of 127.0.0.1 was refused (invalid peer certificate: \
                       certificate not valid for name \"127.0.0.1\""
        ),
        "{}",
        refused.stderr
    );
}

/// Start-up checks of the TLS keys, before any connection: files that cannot be read or hold no
/// certificate or key, a certificate without its key, and TLS keys without a rediss:// URL, each
/// stop the hub with exit 64 and an error naming the key (and the path).
#[tokio::test]
async fn tls_files_are_checked_at_start() {
    let pki = TestPki::new("posthorn test CA");
    let garbage = pki.dir().join("garbage.pem");
    std::fs::write(&garbage, "no PEM here\n").expect("write");
    let missing = pki.dir().join("missing.pem");
    let url = "rediss://127.0.0.1:1";
    let cases: Vec<(Vec<(&str, String)>, String)> = vec![
        (
            vec![
                ("POSTHORN_REDIS__URL", url.into()),
                ("POSTHORN_REDIS__TLS_CA_FILE", path_text(&missing)),
            ],
            format!("redis.tls_ca_file: cannot read {}", missing.display()),
        ),
        (
            vec![
                ("POSTHORN_REDIS__URL", url.into()),
                ("POSTHORN_REDIS__TLS_CA_FILE", path_text(&garbage)),
            ],
            format!(
                "redis.tls_ca_file: {} holds no certificate in PEM",
                garbage.display()
            ),
        ),
        (
            vec![
                ("POSTHORN_REDIS__URL", url.into()),
                ("POSTHORN_REDIS__TLS_CA_FILE", path_text(pki.ca_file())),
                ("POSTHORN_REDIS__TLS_CERT_FILE", path_text(pki.ca_file())),
                ("POSTHORN_REDIS__TLS_KEY_FILE", path_text(&garbage)),
            ],
            format!(
                "redis.tls_key_file: {} holds no private key in PEM",
                garbage.display()
            ),
        ),
        (
            vec![
                ("POSTHORN_REDIS__URL", url.into()),
                ("POSTHORN_REDIS__TLS_CERT_FILE", path_text(pki.ca_file())),
            ],
            "redis.tls_key_file: must be set when redis.tls_cert_file is".into(),
        ),
        (
            vec![("POSTHORN_REDIS__TLS_CA_FILE", path_text(pki.ca_file()))],
            "redis.tls_ca_file: is set, but no Redis URL in use is rediss://".into(),
        ),
        (
            vec![
                ("POSTHORN_REDIS__USERNAME", "posthorn".into()),
                ("POSTHORN_REDIS__PASSWORD_FILE", path_text(&missing)),
            ],
            format!("redis.password_file: cannot read {}", missing.display()),
        ),
    ];
    for (envs, expected) in cases {
        let mut hub = redis_hub();
        for (key, value) in &envs {
            hub = hub.env(*key, value.clone());
        }
        let (code, log) = hub.run_to_exit(EXIT_WAIT).await;
        assert_eq!(code, Some(64), "{envs:?}: {log}");
        assert!(
            log.contains(&expected),
            "{envs:?}: expected {expected:?} in {log}"
        );
    }
}

/// (d) `redis.urls` with two TLS instances: each half of the shards is served from its instance.
#[tokio::test]
async fn several_tls_instances() {
    let mut pki = TestPki::new("posthorn test CA");
    let first = RedisServer::builder()
        .tls(RedisTls::new(&mut pki, "no"))
        .start()
        .await;
    let second = RedisServer::builder()
        .tls(RedisTls::new(&mut pki, "no"))
        .start()
        .await;
    let hub = redis_hub()
        .env(
            "POSTHORN_REDIS__URLS",
            format!("{},{}", first.url(), second.url()),
        )
        .env("POSTHORN_REDIS__TLS_CA_FILE", path_text(pki.ca_file()))
        .start()
        .await;
    let low = device_where(|shard| shard < 32);
    let high = device_where(|shard| shard >= 32);
    publish_live_and_resume(&hub, &low).await;
    publish_live_and_resume(&hub, &high).await;
    let key = |device: &str| format!("pos-ev:{}", crc_shard(device, 64));
    assert_eq!(first.client().await.xlen(&key(&low)).await, APPENDED);
    assert_eq!(second.client().await.xlen(&key(&high)).await, APPENDED);
    assert_eq!(first.client().await.xlen(&key(&high)).await, 0);
}

// ---------------------------------------------------------------------------
// Least privilege: the ACL users of docs/security.md
// ---------------------------------------------------------------------------

/// Passwords of one test's users.
struct Users {
    admin: String,
    hub: String,
    producer: String,
}

impl Users {
    fn new() -> Users {
        let random = || format!("pw-{:016x}", rand::random::<u64>());
        Users {
            admin: random(),
            hub: random(),
            producer: random(),
        }
    }
}

/// The `user` lines of docs/security.md's block `kind` ("standalone" or "cluster"), passwords
/// filled in.
fn documented_rules(kind: &str, users: &Users) -> Vec<String> {
    let marker = format!("<!-- acl-rules: {kind} -->");
    let after = SECURITY_DOC
        .split_once(&marker)
        .unwrap_or_else(|| panic!("docs/security.md has no {marker}"))
        .1;
    let block = after
        .trim_start()
        .strip_prefix("```\n")
        .and_then(|rest| rest.split_once("```"))
        .expect("a fenced block after the marker")
        .0;
    let rules: Vec<String> = block
        .lines()
        .filter(|line| line.starts_with("user "))
        .map(|line| {
            line.replace(">HUB-PASSWORD", &format!(">{}", users.hub))
                .replace(">PRODUCER-PASSWORD", &format!(">{}", users.producer))
        })
        .collect();
    assert_eq!(rules.len(), 2, "{block}");
    assert!(rules[0].starts_with("user posthorn ") && rules[1].starts_with("user producer "));
    rules
}

/// A server with the documented users, `default` off, and an administrator for the harness.
fn with_users(mut builder: RedisBuilder, kind: &str, users: &Users) -> RedisBuilder {
    builder = builder
        .config("user", "default off")
        .config("user", format!("admin on >{} ~* &* +@all", users.admin))
        .harness_user("admin", &users.admin);
    for rule in documented_rules(kind, users) {
        let rule = rule.strip_prefix("user ").expect("a user line").to_string();
        builder = builder.config("user", rule);
    }
    builder
}

fn password_file(dir: &Path, password: &str) -> PathBuf {
    let path = dir.join("redis-password");
    // With the newline an editor or `echo` leaves: it is not part of the password.
    std::fs::write(&path, format!("{password}\n")).expect("write password file");
    path
}

/// Entries of `ACL LOG` (each a map of its fields) made by `user`.
async fn denied(client: &mut RespClient, user: &str) -> Vec<String> {
    let reply = client.cmd(&["ACL", "LOG"]).await;
    reply
        .as_array()
        .unwrap_or_else(|| panic!("ACL LOG: {reply:?}"))
        .iter()
        .filter_map(|entry| {
            let fields = entry.as_array()?;
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|pair| pair[0].as_str() == Some(name))
                    .and_then(|pair| pair[1].as_str().map(str::to_string))
            };
            (field("username").as_deref() == Some(user)).then(|| {
                format!(
                    "{} {} ({})",
                    field("reason").unwrap_or_default(),
                    field("object").unwrap_or_default(),
                    field("context").unwrap_or_default()
                )
            })
        })
        .collect()
}

fn is_noperm(reply: &RespValue) -> bool {
    reply.as_error().is_some_and(|e| e.starts_with("NOPERM"))
}

/// As the producer user on `client`: a documented append (MINID trimming on Redis' clock)
/// succeeds; reading the streams, touching the hub's other keys or any other key, and the life
/// markers are all refused with NOPERM.
async fn producer_checks(client: &mut RespClient, users: &Users, stream: &str, other: &[&str]) {
    let auth = client.cmd(&["AUTH", "producer", &users.producer]).await;
    assert!(auth.is_ok(), "{auth:?}");
    let time = client.cmd(&["TIME"]).await;
    let seconds: u64 = time.as_array().expect("TIME")[0]
        .as_str()
        .expect("seconds")
        .parse()
        .expect("number");
    let minid = (seconds * 1000 - 15 * 60 * 1000).to_string();
    let added = client
        .cmd(&[
            "XADD",
            stream,
            "MINID",
            "~",
            &minid,
            "*",
            "dev",
            "pos-17",
            "type",
            "order.paid",
            "data",
            "from the producer",
        ])
        .await;
    assert!(added.as_str().is_some(), "XADD as producer: {added:?}");
    let trimmed = client
        .cmd(&["XTRIM", stream, "MAXLEN", "~", "100000"])
        .await;
    assert!(trimmed.as_int().is_some(), "XTRIM as producer: {trimmed:?}");
    let refused: Vec<Vec<&str>> = vec![
        vec!["XREAD", "COUNT", "1", "STREAMS", stream, "0"],
        vec!["XRANGE", stream, "-", "+"],
        vec!["XLEN", stream],
        vec!["XINFO", "GROUPS", stream],
        vec!["XGROUP", "DESTROY", stream, "posthorn:epoch:x"],
        vec!["SET", "unrelated", "x"],
        vec!["GET", "unrelated"],
    ];
    for args in refused {
        let reply = client.cmd(&args).await;
        assert!(is_noperm(&reply), "{args:?} as producer: {reply:?}");
    }
    for key in other {
        let reply = client
            .cmd(&["XADD", key, "*", "dev", "pos-17", "data", "x"])
            .await;
        assert!(is_noperm(&reply), "XADD {key} as producer: {reply:?}");
    }
}

/// The least-privilege Redis user and `redis.password_file`, on one instance: the hub runs as
/// the documented `posthorn` user (password from a file, with its newline) with `default` off, at
/// debug level.
/// Publishing, the live tail, resume, trimming by length and by age (the trim lease), and a new
/// life after the stream is deleted all work, and Redis logged no denied command of that user.
/// The password is in no log line and not in `/admin/status`.
#[tokio::test]
async fn hub_runs_as_the_documented_acl_user() {
    let users = Users::new();
    let redis = with_users(RedisServer::builder(), "standalone", &users)
        // Small stream nodes, so that approximate (`~`) trimming removes entries in a small test.
        .config("stream-node-max-entries", "2")
        .start()
        .await;
    let file = password_file(redis.dir(), &users.hub);
    let hub = redis_hub()
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__USERNAME", "posthorn")
        .env("POSTHORN_REDIS__PASSWORD_FILE", path_text(&file))
        .env("POSTHORN_REDIS__RETENTION", "3s")
        .env("POSTHORN_REDIS__MAX_LEN", "6")
        .env("RUST_LOG", "debug")
        .start()
        .await;
    let mut admin = redis.client().await;
    publish_live_and_resume(&hub, "pos-17").await;

    // Trimming by length on append (XTRIM MAXLEN ~ inside the append script).
    let mut live = live_stream(&hub, "pos-17").await;
    let first = publish_to(&hub, "pos-17", "e0").await;
    for n in 1..20 {
        publish_to(&hub, "pos-17", &format!("e{n}")).await;
    }
    // A tail that fell more than the cap behind (a busy machine) hears of it as `resync`
    // `expired` instead of reading every entry: either way nothing is skipped silently.
    let mut next = 0;
    let mut resynced = false;
    while next < 20 {
        let event = live.expect_event(WAIT).await;
        if event.event == "resync" {
            assert_eq!(resync_reason(&event), "expired");
            resynced = true;
            continue;
        }
        let n: usize = event.data[1..].parse().expect("e<n>");
        assert!(
            n == next || (resynced && n > next),
            "e{n} came after e{} without a resync",
            next as i64 - 1
        );
        (next, resynced) = (n + 1, false);
    }
    let length = admin.xlen("pos-ev:2").await;
    assert!(length < 20, "XLEN pos-ev:2 = {length} after max_len 6");
    // Trimming by age under the lease: the periodic pass removes the aged nodes of the stream
    // (all but, perhaps, the last: `~` trims whole nodes).
    let deadline = tokio::time::Instant::now() + WAIT;
    while admin.xlen("pos-ev:2").await > 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never trimmed by age"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let lease = admin.cmd(&["GET", "pos-ev:trim-lease"]).await;
    assert!(lease.as_str().is_some(), "trim lease: {lease:?}");
    let mut expired = SseClient::connect(
        hub.addr(),
        &stream_path("pos-17"),
        &[("Last-Event-ID", &first)],
    )
    .await;
    assert_eq!(resync_reason(&expired.expect_event(WAIT).await), "expired");
    // That stream took the device over from `live`.
    drop(expired);
    let mut live = live_stream(&hub, "pos-17").await;

    // Data loss: the stream and its life marker deleted, a new life named by the hub's check.
    let reply = admin.cmd(&["DEL", "pos-ev:2"]).await;
    assert_eq!(reply.as_int(), Some(1), "{reply:?}");
    assert_eq!(resync_reason(&live.expect_event(WAIT).await), "data_lost");
    publish_to(&hub, "pos-17", "after the loss").await;
    assert_eq!(live.expect_event(WAIT).await.data, "after the loss");

    // What the hub sends when a tail's connection closes, checked against the rules.
    let reply = admin.cmd(&["ACL", "DRYRUN", "posthorn", "QUIT"]).await;
    assert!(reply.is_ok(), "QUIT for posthorn: {reply:?}");
    let status = http::get(hub.addr(), "/admin/status").await;
    assert_eq!(status.status, 200);
    let text = status.text();
    assert_eq!(status.json()["config"]["redis"]["username"], "posthorn");
    assert_eq!(
        status.json()["config"]["redis"]["password_file"],
        path_text(&file)
    );
    assert!(
        !text.contains(&users.hub),
        "password in /admin/status: {text}"
    );
    // The fleet store under the same rights: the streaming device is online (beats, presence
    // writes), a listing and an ack work.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let device = http::get(hub.addr(), "/v1/devices/pos-17").await;
        assert_eq!(device.status, 200, "{}", device.text());
        if device.json()["online"] == true {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pos-17 never online: {}",
            device.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let listing = http::get(hub.addr(), "/v1/devices?limit=10").await;
    assert_eq!(listing.status, 200, "{}", listing.text());
    let denials = denied(&mut admin, "posthorn").await;
    assert!(denials.is_empty(), "denied to the hub: {denials:?}");

    // The debug log covers the client library's authentication, and never shows the password.
    let log = hub.stderr_log();
    assert!(
        log.contains("Authenticating client"),
        "no debug log of AUTH:\n{log}"
    );
    assert!(!log.contains(&users.hub), "password in the log:\n{log}");
}

/// As the documented hub user, a restart from an older snapshot (the stream went back in time)
/// gives a new life (`START_NEW_LIFE`: the old life marker destroyed, a new one created) and
/// `data_lost`, without a denied command.
#[tokio::test]
async fn a_rollback_starts_a_new_life_as_the_acl_user() {
    let users = Users::new();
    let mut redis = with_users(RedisServer::builder(), "standalone", &users)
        .start()
        .await;
    let file = password_file(redis.dir(), &users.hub);
    let hub = redis_hub()
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__USERNAME", "posthorn")
        .env("POSTHORN_REDIS__PASSWORD_FILE", path_text(&file))
        .start()
        .await;
    publish_to(&hub, "pos-17", "before the snapshot").await;
    let snapshot = redis.snapshot().await;
    let mut live = live_stream(&hub, "pos-17").await;
    publish_to(&hub, "pos-17", "lost").await;
    assert_eq!(live.expect_event(WAIT).await.data, "lost");
    redis.restart_from(&snapshot).await;
    assert_eq!(resync_reason(&live.expect_event(WAIT).await), "data_lost");
    publish_to(&hub, "pos-17", "new life").await;
    assert_eq!(live.expect_event(WAIT).await.data, "new life");
    let mut admin = redis.client().await;
    let denials = denied(&mut admin, "posthorn").await;
    assert!(denials.is_empty(), "denied to the hub: {denials:?}");
    let groups = admin.cmd(&["XINFO", "GROUPS", "pos-ev:2"]).await;
    assert_eq!(groups.as_array().map(<[_]>::len), Some(1), "{groups:?}");
}

/// The producer user of docs/security.md appends an entry the hub delivers (the hub here with the
/// password in its URL, which still works) and is refused everything else with NOPERM. A hub
/// given a wrong password file stops, without the password in its debug log.
#[tokio::test]
async fn producer_may_only_append() {
    let users = Users::new();
    let redis = with_users(RedisServer::builder(), "standalone", &users)
        .start()
        .await;
    let hub = redis_hub()
        .env(
            "POSTHORN_REDIS__URL",
            format!("redis://posthorn:{}@{}", users.hub, redis.addr()),
        )
        .start()
        .await;
    let mut live = live_stream(&hub, "pos-17").await;
    let mut producer = redis.client().await;
    producer_checks(
        &mut producer,
        &users,
        "pos-ev:2",
        &["pos-ev:dedupe:pos-17/k", "pos-ev:trim-lease", "other:2"],
    )
    .await;
    let event = live.expect_event(WAIT).await;
    assert_eq!(
        (event.event.as_str(), event.data.as_str()),
        ("order.paid", "from the producer")
    );
    let mut admin = redis.client().await;
    assert!(denied(&mut admin, "posthorn").await.is_empty());
    assert!(!denied(&mut admin, "producer").await.is_empty());

    // A wrong password from a file stops the hub, and not even its debug log shows it.
    let wrong = format!("{}-wrong", users.hub);
    let file = redis.dir().join("wrong-password");
    std::fs::write(&file, format!("{wrong}\n")).expect("write");
    let (code, log) = redis_hub()
        .env("POSTHORN_REDIS__URL", redis.url())
        .env("POSTHORN_REDIS__USERNAME", "posthorn")
        .env("POSTHORN_REDIS__PASSWORD_FILE", path_text(&file))
        .env("RUST_LOG", "debug")
        .run_to_exit(EXIT_WAIT)
        .await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains("WRONGPASS"), "{log}");
    assert!(!log.contains(&wrong), "password in the log:\n{log}");
}

/// (e) A 3-master cluster with TLS on every link and the documented cluster users: the hub (TLS,
/// ACL user, password file, three hash-tag groups) publishes, tails and resumes on every group and
/// trims under the lease; the producer appends to a group's stream and is refused the rest; no
/// node logged a denied command of the hub.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_cluster_with_the_documented_acl_users() {
    let mut pki = TestPki::new("posthorn test CA");
    let users = Users::new();
    let cluster = RedisCluster::start_tls(3, RedisTls::new(&mut pki, "yes"), |builder| {
        with_users(builder, "cluster", &users)
    })
    .await;
    let client = pki.client_cert("posthorn");
    let file = password_file(pki.dir(), &users.hub);
    let hub = tls_hub(&cluster.seed_url(), &pki)
        .env("POSTHORN_REDIS__CLUSTER", "true")
        .env("POSTHORN_REDIS__GROUPS", "3")
        .env("POSTHORN_REDIS__RETENTION", "4s")
        .env("POSTHORN_REDIS__TLS_CERT_FILE", path_text(&client.cert))
        .env("POSTHORN_REDIS__TLS_KEY_FILE", path_text(&client.key))
        .env("POSTHORN_REDIS__USERNAME", "posthorn")
        .env("POSTHORN_REDIS__PASSWORD_FILE", path_text(&file))
        .start()
        .await;
    // Groups of 64 shards in 3: 0-21, 22-42, 43-63.
    for (low, high) in [(0, 22), (22, 43), (43, 64)] {
        let device = device_where(|shard| (low..high).contains(&shard));
        publish_live_and_resume(&hub, &device).await;
    }
    // pos-17 is on shard 2, group 0.
    let mut live = live_stream(&hub, "pos-17").await;
    let stream = "pos-ev:{g0}:2";
    let mut producer = cluster.client_for_key(stream).await;
    producer_checks(
        &mut producer,
        &users,
        stream,
        &["pos-ev:{g0}:dedupe:pos-17/k", "pos-ev:{g0}:trim-lease"],
    )
    .await;
    let event = live.expect_event(WAIT).await;
    assert_eq!(event.data, "from the producer");

    // A trim pass (every 2 s with a 4 s retention) has taken the lease of group 0.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let lease = cluster
            .cmd_for_key("pos-ev:{g0}:trim-lease", &["GET", "pos-ev:{g0}:trim-lease"])
            .await;
        if lease.as_str().is_some() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no trim lease: {lease:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for node in cluster.nodes() {
        let mut admin = RespClient::connect(node).await;
        let denials = denied(&mut admin, "posthorn").await;
        assert!(
            denials.is_empty(),
            "denied to the hub on {node}: {denials:?}"
        );
    }
    let status = http::get(hub.addr(), "/admin/status").await.text();
    assert!(!status.contains(&users.hub), "password in /admin/status");
}

/// A TLS cluster whose certificates name `localhost` only, reached through the seed
/// `rediss://localhost:PORT`: the nodes announce themselves as 127.0.0.1, and the hub verifies
/// them against the seed's name (an IP the certificate does not list would be refused), so
/// every group, on every node, is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_cluster_nodes_are_verified_as_the_seed_name() {
    let mut pki = TestPki::new("posthorn test CA");
    let mut tls = RedisTls::new(&mut pki, "no");
    tls.server = pki.peer_cert_for(&["localhost"]);
    tls.server_name = "localhost".into();
    let cluster = RedisCluster::start_tls(3, tls, |builder| builder).await;
    let seed = cluster.nodes()[0];
    let hub = tls_hub(&format!("rediss://localhost:{}", seed.port()), &pki)
        .env("POSTHORN_REDIS__CLUSTER", "true")
        .env("POSTHORN_REDIS__GROUPS", "3")
        .start()
        .await;
    for (low, high) in [(0, 22), (22, 43), (43, 64)] {
        let device = device_where(|shard| (low..high).contains(&shard));
        publish_live_and_resume(&hub, &device).await;
    }
    // The groups' hash tags live on different nodes, all of which the hub reached.
    let mut owners = Vec::new();
    for group in 0..3 {
        owners.push(cluster.owner_of(&format!("pos-ev:{{g{group}}}:0")).await);
    }
    owners.sort();
    owners.dedup();
    assert!(owners.len() > 1, "all groups on one node: {owners:?}");
}

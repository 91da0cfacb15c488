//! Black-box tests of the `posthorn` command line (config/posthorn.toml, README.md): configuration errors and their
//! exit code, the secure-by-default listen check, `shard-key`, `publish`, and the shipped
//! configuration files.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;
use tokio::time::Instant;

use support::{free_port, http, Hub, SseClient, SseNext};

const BIN: &str = env!("CARGO_BIN_EXE_posthorn");
/// Failure guard for one-shot commands and start-up.
const WAIT: Duration = Duration::from_secs(20);
/// EX_USAGE: bad configuration or arguments.
const EX_USAGE: i32 = 64;

/// A `posthorn` command that sees no POSTHORN_* variable of the developer's shell.
fn posthorn() -> Command {
    let mut cmd = Command::new(BIN);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("POSTHORN_") {
            cmd.env_remove(key);
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

async fn run(mut cmd: Command) -> Output {
    let child = cmd.spawn().expect("spawn posthorn");
    tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("posthorn did not exit in time")
        .expect("wait for posthorn")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A file in the temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, contents: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("posthorn-cli-test-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).expect("write temp config");
        Self(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs `serve` with the given env and args and asserts it exits 64 naming `key`.
async fn assert_config_error(envs: &[(&str, &str)], args: &[&str], key: &str) -> String {
    let mut builder = Hub::builder().args(args);
    for (k, v) in envs {
        builder = builder.env(*k, *v);
    }
    let (code, log) = builder.run_to_exit(WAIT).await;
    assert_eq!(
        code,
        Some(EX_USAGE),
        "exit code for {envs:?} {args:?}: {log}"
    );
    assert!(log.contains(key), "error does not name {key:?}: {log}");
    // It must not start: exit 64 comes before the listener is bound, and the whole output is the
    // one line of the error (no start-up line before it).
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines.len() == 1 && lines[0].starts_with("posthorn: "),
        "more than the error: {log}"
    );
    log
}

async fn stream(hub: &Hub, device: &str) -> SseClient {
    // An invalid cursor makes the hub answer `resync` after registering the connection, so
    // events published afterwards are known to be delivered (see tests/publish.rs).
    let mut client = SseClient::connect(
        hub.addr(),
        &format!("/v1/devices/{device}/events"),
        &[("Last-Event-ID", "sync")],
    )
    .await;
    assert_eq!(client.status(), 200);
    assert_eq!(client.expect_event(WAIT).await.event, "resync");
    client
}

/// An invalid value from the environment stops start-up with exit 64 naming the key.
#[tokio::test]
async fn invalid_env_value_exits_64() {
    assert_config_error(
        &[("POSTHORN_SSE__QUEUE_LIMIT", "0")],
        &[],
        "sse.queue_limit",
    )
    .await;
    assert_config_error(
        &[("POSTHORN_SSE__QUEUE_LIMIT", "many")],
        &[],
        "sse.queue_limit",
    )
    .await;
}

/// An unknown `POSTHORN_*__*` variable is an unknown key: exit 64 naming it.
#[tokio::test]
async fn unknown_env_key_exits_64() {
    let log = assert_config_error(&[("POSTHORN_SSE__BOGUS", "1")], &[], "sse.bogus").await;
    assert!(log.contains("POSTHORN_SSE__BOGUS"), "{log}");
    assert_config_error(&[("POSTHORN_NOSECTION__KEY", "1")], &[], "nosection.key").await;
}

/// An unknown key in a `--config` file stops start-up with exit 64 naming it.
#[tokio::test]
async fn unknown_file_key_exits_64() {
    let file = TempFile::new(
        "unknown-key.toml",
        "[sse]\nqueue_limit = 10\nqueue_limt = 20\n",
    );
    let path = file.0.to_str().expect("utf-8 temp path");
    assert_config_error(&[], &["--config", path], "sse.queue_limt").await;

    let file = TempFile::new(
        "unknown-section.toml",
        "[sever]\nlisten = \"127.0.0.1:1\"\n",
    );
    let path = file.0.to_str().expect("utf-8 temp path");
    assert_config_error(&[], &["--config", path], "sever").await;
}

/// An invalid duration, from the environment or a file, exits 64 naming the key.
#[tokio::test]
async fn invalid_duration_exits_64() {
    assert_config_error(&[("POSTHORN_SSE__HEARTBEAT", "soon")], &[], "sse.heartbeat").await;
    assert_config_error(&[("POSTHORN_DRAIN__GRACE", "30")], &[], "drain.grace").await;
    let file = TempFile::new("bad-duration.toml", "[drain]\nretry_max = \"1 minute\"\n");
    let path = file.0.to_str().expect("utf-8 temp path");
    assert_config_error(&[], &["--config", path], "drain.retry_max").await;
}

/// Bug pinned: a huge `drain.retry_max` was accepted and cast to a `u32` of
/// milliseconds (a value past 49 days wrapped, and a wrapped range below `retry_min` panicked in
/// the drain); `redis.block = 0s` was accepted although Redis reads it as "block forever", past
/// every client timeout. Both now stop start-up naming the key.
#[tokio::test]
async fn values_the_hub_cannot_honour_exit_64() {
    assert_config_error(
        &[("POSTHORN_DRAIN__RETRY_MAX", "2000h")],
        &[],
        "drain.retry_max",
    )
    .await;
    assert_config_error(
        &[
            ("POSTHORN_DRAIN__RETRY_MIN", "2000h"),
            ("POSTHORN_DRAIN__RETRY_MAX", "2000h"),
        ],
        &[],
        "drain.retry_min",
    )
    .await;
    assert_config_error(&[("POSTHORN_REDIS__BLOCK", "0s")], &[], "redis.block").await;
}

/// Bug pinned: `serve --backend nats` switched the backend after validation, so a
/// `publish.dedupe_window` longer than `nats.retention` got past the rule `backend.kind = "nats"`
/// is held to, and JetStream refused the stream at start-up. The flag is now checked like the
/// key; an unknown `--backend` exits 64 naming the flag.
#[tokio::test]
async fn backend_flag_is_validated_like_the_key() {
    assert_config_error(
        &[("POSTHORN_NATS__RETENTION", "5m")],
        &["--backend", "nats"],
        "publish.dedupe_window",
    )
    .await;
    assert_config_error(&[], &["--backend", "kafka"], "--backend").await;
}

/// A missing `--config` file exits 64 naming the file.
#[tokio::test]
async fn missing_config_file_exits_64() {
    let path = std::env::temp_dir().join("posthorn-cli-test-does-not-exist.toml");
    let path = path.to_str().expect("utf-8 temp path");
    let (code, log) = Hub::builder()
        .args(["--config", path])
        .run_to_exit(WAIT)
        .await;
    assert_eq!(code, Some(EX_USAGE), "{log}");
    assert!(log.contains(path), "{log}");
}

/// With auth `none`, `serve --listen 0.0.0.0:PORT` refuses to start (exit 64) and says that
/// `server.insecure` would allow it.
#[tokio::test]
async fn non_loopback_listen_requires_insecure() {
    let port = free_port();
    let mut cmd = posthorn();
    cmd.args(["serve", "--listen", &format!("0.0.0.0:{port}")]);
    let output = run(cmd).await;
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(EX_USAGE), "{stderr}");
    assert!(stderr.contains("server.insecure"), "{stderr}");

    // The same through the environment.
    let mut cmd = posthorn();
    cmd.args(["serve"])
        .env("POSTHORN_SERVER__LISTEN", format!("0.0.0.0:{port}"));
    let output = run(cmd).await;
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(EX_USAGE), "{stderr}");
    assert!(stderr.contains("server.insecure"), "{stderr}");
}

/// With `--insecure`, `serve --listen 0.0.0.0:PORT` starts and answers on 127.0.0.1:PORT.
#[tokio::test]
async fn insecure_flag_allows_non_loopback_listen() {
    let mut last_error = String::new();
    for _attempt in 0..3 {
        let port = free_port();
        let mut cmd = posthorn();
        cmd.args([
            "serve",
            "--insecure",
            "--listen",
            &format!("0.0.0.0:{port}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn posthorn");
        let addr = ([127, 0, 0, 1], port).into();
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                let output = child.wait_with_output().await.expect("output");
                last_error = format!("exited {status}: {}", text(&output.stderr));
                break;
            }
            let probe =
                http::try_request(addr, "GET", "/healthz", &[], None, Duration::from_secs(1)).await;
            if matches!(probe, Ok(ref r) if r.status == 200) {
                child.kill().await.expect("kill posthorn");
                return;
            }
            assert!(Instant::now() < deadline, "not ready on {addr}: {probe:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !last_error.contains("in use") && !last_error.contains("os error 98") {
            break;
        }
    }
    panic!("posthorn --insecure did not start: {last_error}");
}

/// `shard-key` prints the CRC-32 shard and the standalone stream key.
#[tokio::test]
async fn shard_key_standalone() {
    // zlib.crc32(b"pos-17") == 2524787842, and 2524787842 % 64 == 2.
    assert_eq!(crc32fast::hash(b"pos-17"), 2_524_787_842);
    let mut cmd = posthorn();
    cmd.args(["shard-key", "pos-17"]);
    let output = run(cmd).await;
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(text(&output.stdout).trim_end(), "shard=2 key=pos-ev:2");

    for device in ["pos-1", "A", "kiosk:7.b_c-d"] {
        let shard = crc32fast::hash(device.as_bytes()) % 64;
        let mut cmd = posthorn();
        cmd.args(["shard-key", device]);
        let output = run(cmd).await;
        assert!(output.status.success(), "{}", text(&output.stderr));
        assert_eq!(
            text(&output.stdout).trim_end(),
            format!("shard={shard} key=pos-ev:{shard}")
        );
    }
}

/// `shard-key` follows the active configuration: the prefix, and hash-tagged cluster keys with
/// `group = shard * groups / shards`.
#[tokio::test]
async fn shard_key_cluster_and_prefix() {
    let mut cmd = posthorn();
    cmd.args(["shard-key", "pos-17"])
        .env("POSTHORN_REDIS__CLUSTER", "true")
        .env("POSTHORN_REDIS__GROUPS", "4");
    let output = run(cmd).await;
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(text(&output.stdout).trim_end(), "shard=2 key=pos-ev:{g0}:2");

    // A device on a high shard lands in the last group.
    let device = (0..)
        .map(|i| format!("pos-{i}"))
        .find(|d| crc32fast::hash(d.as_bytes()) % 64 >= 48)
        .expect("some device on shards 48..64");
    let shard = crc32fast::hash(device.as_bytes()) % 64;
    let mut cmd = posthorn();
    cmd.args(["shard-key", &device])
        .env("POSTHORN_REDIS__CLUSTER", "true")
        .env("POSTHORN_REDIS__GROUPS", "4")
        .env("POSTHORN_REDIS__PREFIX", "ev");
    let output = run(cmd).await;
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(
        text(&output.stdout).trim_end(),
        format!("shard={shard} key=ev:{{g3}}:{shard}")
    );
}

/// `shard-key` with an invalid device id exits 64 and prints nothing on stdout.
#[tokio::test]
async fn shard_key_invalid_device_exits_64() {
    for device in ["pos 17", "ké", "*"] {
        let mut cmd = posthorn();
        cmd.args(["shard-key", device]);
        let output = run(cmd).await;
        assert_eq!(
            output.status.code(),
            Some(EX_USAGE),
            "{device:?}: {}",
            text(&output.stderr)
        );
        assert!(output.stdout.is_empty(), "{}", text(&output.stdout));
        assert!(
            text(&output.stderr).contains("device"),
            "{}",
            text(&output.stderr)
        );
    }
}

fn publish_results(output: &Output) -> Vec<(String, bool)> {
    assert!(
        output.status.success(),
        "publish failed ({}): {}",
        output.status,
        text(&output.stderr)
    );
    let body: Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text(&output.stdout)));
    body["results"]
        .as_array()
        .unwrap_or_else(|| panic!("no results in {body}"))
        .iter()
        .map(|r| {
            (
                r["id"].as_str().expect("id").to_string(),
                r["duplicate"].as_bool().expect("duplicate"),
            )
        })
        .collect()
}

/// `posthorn publish --url` publishes to a device (JSON data sent compact) and prints the
/// results; the device's stream receives the event with that id.
#[tokio::test]
async fn publish_to_device() {
    let hub = Hub::builder().start().await;
    let mut client = stream(&hub, "pos-1").await;
    let mut cmd = posthorn();
    cmd.args([
        "publish",
        "--url",
        &hub.base_url(),
        "--device",
        "pos-1",
        "--type",
        "t",
        "--data",
        r#"{"a": 1}"#,
    ]);
    let output = run(cmd).await;
    let results = publish_results(&output);
    assert_eq!(results.len(), 1);
    assert!(!results[0].1);

    let event = client.expect_event(WAIT).await;
    assert_eq!(event.id.as_deref(), Some(results[0].0.as_str()));
    assert_eq!(event.event, "t");
    assert_eq!(event.data, r#"{"a":1}"#);
}

/// `posthorn publish --broadcast` reaches a connected device; `--key` makes a repeat a
/// duplicate with the same id.
#[tokio::test]
async fn publish_broadcast_and_key() {
    let hub = Hub::builder().start().await;
    let mut client = stream(&hub, "pos-9").await;
    let broadcast = |key: &'static str| {
        let mut cmd = posthorn();
        cmd.args([
            "publish",
            "--url",
            &hub.base_url(),
            "--broadcast",
            "--type",
            "price.update",
            "--data",
            "new prices",
            "--key",
            key,
        ]);
        cmd
    };
    let first = publish_results(&run(broadcast("b-1")).await);
    assert!(!first[0].1);
    let event = client.expect_event(WAIT).await;
    assert_eq!(event.event, "price.update");
    assert_eq!(event.data, "new prices");

    let again = publish_results(&run(broadcast("b-1")).await);
    assert_eq!(again, vec![(first[0].0.clone(), true)]);
}

/// `posthorn publish --group` reaches a member of the group and not a device outside it;
/// `--group` with `--device` or `--broadcast` is a usage error.
#[tokio::test]
async fn publish_to_group() {
    let hub = Hub::builder().start().await;
    let member_path = "/v1/devices/pos-m/events?groups=store-17";
    let mut member = SseClient::connect(hub.addr(), member_path, &[]).await;
    assert_eq!(member.status(), 200);
    let mut outsider = stream(&hub, "pos-o").await;
    let mut cmd = posthorn();
    cmd.args([
        "publish",
        "--url",
        &hub.base_url(),
        "--group",
        "store-17",
        "--type",
        "price.update",
        "--data",
        "new prices",
    ]);
    let results = publish_results(&run(cmd).await);
    assert_eq!(results.len(), 1);
    assert!(!results[0].1, "a first publish is no duplicate");
    let event = member.expect_event(WAIT).await;
    // The answer names one copy's id (as for a broadcast); the member's shard has its own.
    assert_eq!(
        (event.event.as_str(), event.data.as_str()),
        ("price.update", "new prices")
    );
    assert!(
        matches!(
            outsider.next_event(Duration::from_millis(500)).await,
            SseNext::Timeout
        ),
        "a device in no group received the group event"
    );
    for other in [["--device", "pos-1"], ["--broadcast", "--type"]] {
        let mut cmd = posthorn();
        cmd.args([
            "publish",
            "--url",
            &hub.base_url(),
            "--group",
            "g",
            "--data",
            "x",
        ]);
        cmd.args(other);
        if other[0] == "--broadcast" {
            cmd.arg("t");
        }
        let output = run(cmd).await;
        assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
        assert!(
            text(&output.stderr).contains("cannot be used with"),
            "{}",
            text(&output.stderr)
        );
    }
}

/// A publish the hub rejects exits non-zero, prints nothing on stdout and shows the hub's
/// error on stderr.
#[tokio::test]
async fn publish_rejected_exits_nonzero() {
    let hub = Hub::builder().start().await;
    let mut cmd = posthorn();
    cmd.args([
        "publish",
        "--url",
        &hub.base_url(),
        "--device",
        "bad device",
        "--data",
        "x",
    ]);
    let output = run(cmd).await;
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(output.stdout.is_empty(), "{}", text(&output.stdout));
    assert!(stderr.contains("400"), "{stderr}");
    assert!(stderr.contains("invalid_request"), "{stderr}");
    assert!(stderr.contains("device"), "{stderr}");

    // An unreachable hub fails too.
    let mut cmd = posthorn();
    cmd.args([
        "publish",
        "--url",
        &format!("http://127.0.0.1:{}", free_port()),
        "--device",
        "pos-1",
        "--data",
        "x",
    ]);
    let output = run(cmd).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
    assert!(
        text(&output.stderr).contains("cannot reach"),
        "{}",
        text(&output.stderr)
    );
}

/// Every file in `config/` parses and serves: `serve --config FILE` starts.
#[tokio::test]
async fn shipped_config_files_start() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read config/")
        .map(|entry| entry.expect("dir entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    files.sort();
    assert!(
        files.iter().any(|f| f.ends_with("posthorn.toml")),
        "{files:?}"
    );
    for file in files {
        let hub = Hub::builder().arg("--config").arg(&file).start().await;
        let resp = http::get(hub.addr(), "/readyz").await;
        assert_eq!(resp.status, 200, "{}: {}", file.display(), resp.text());
    }
}

// ---------------------------------------------------------------------------------------------
// posthorn config check | show | default
// ---------------------------------------------------------------------------------------------

/// `config check` accepts a good configuration (exit 0) and refuses, with exit 64 naming the
/// key, what `serve` would refuse: an invalid value from the file or the environment, an unknown
/// key, auth none on a public address, and a file it names that cannot be read — without
/// starting anything.
#[tokio::test]
async fn config_check_names_the_key_at_fault() {
    let good = TempFile::new("check-good.toml", "[memory]\nshards = 16\n");
    let mut cmd = posthorn();
    cmd.args(["config", "check", "--config"]).arg(&good.0);
    let output = run(cmd).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("configuration ok"));

    let unknown = TempFile::new("check-unknown.toml", "[sse]\nheartbeats = \"20s\"\n");
    let missing_cert = TempFile::new(
        "check-cert.toml",
        "[server]\ntls_cert_file = \"/nonexistent/cert.pem\"\ntls_key_file = \"/nonexistent/key.pem\"\n",
    );
    let public = TempFile::new("check-public.toml", "[server]\nlisten = \"0.0.0.0:8080\"\n");
    // (file, environment, the key the error must name)
    type Case<'a> = (&'a TempFile, &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 6] = [
        (&unknown, &[], "sse.heartbeats"),
        (
            &good,
            &[("POSTHORN_SSE__HEARTBEAT", "soon")],
            "sse.heartbeat",
        ),
        (&missing_cert, &[], "server.tls_cert_file"),
        (&public, &[], "auth.mode"),
        (
            &good,
            &[
                ("POSTHORN_BACKEND__KIND", "redis"),
                ("POSTHORN_REDIS__PASSWORD_FILE", "/nonexistent/password"),
            ],
            "redis.password_file",
        ),
        (
            &good,
            &[
                ("POSTHORN_AUTH__MODE", "jwt"),
                ("POSTHORN_AUTH__JWT_PUBLIC_KEY_FILE", "/nonexistent/key.pem"),
            ],
            "auth.jwt_public_key_file",
        ),
    ];
    for (file, envs, key) in cases {
        let mut cmd = posthorn();
        cmd.args(["config", "check", "--config"]).arg(&file.0);
        cmd.envs(envs.iter().copied());
        let output = run(cmd).await;
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(EX_USAGE), "{key}: {stderr}");
        assert!(
            stderr.contains(key),
            "the error does not name {key}: {stderr}"
        );
    }
}

/// `config check` takes `serve`'s flags and judges what `serve` would run with them: a public
/// `--listen` is refused unless `--insecure`, and `--backend redis` checks Redis' files.
#[tokio::test]
async fn config_check_takes_the_flags_of_serve() {
    // (serve's flags, environment, the key a refusal must name)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], Option<&'a str>);
    let cases: [Case; 3] = [
        (&["--listen", "0.0.0.0:8080"], &[], Some("auth.mode")),
        (&["--listen", "0.0.0.0:8080", "--insecure"], &[], None),
        (
            &["--backend", "redis"],
            &[("POSTHORN_REDIS__PASSWORD_FILE", "/nonexistent/password")],
            Some("redis.password_file"),
        ),
    ];
    for (args, envs, refused_for) in cases {
        let mut cmd = posthorn();
        cmd.args(["config", "check"]).args(args);
        cmd.envs(envs.iter().copied());
        let output = run(cmd).await;
        let stderr = text(&output.stderr);
        match refused_for {
            Some(key) => {
                assert_eq!(output.status.code(), Some(EX_USAGE), "{args:?}: {stderr}");
                assert!(
                    stderr.contains(key),
                    "{args:?} does not name {key}: {stderr}"
                );
            }
            None => assert_eq!(output.status.code(), Some(0), "{args:?}: {stderr}"),
        }
    }
}

/// `config show` prints the effective configuration — defaults, the file and the environment
/// together — as a configuration file, with no secret in it; `config check` accepts it once
/// the redacted credentials are put back.
#[tokio::test]
async fn config_show_is_the_effective_configuration_without_secrets() {
    let file = TempFile::new(
        "show.toml",
        "[memory]\nshards = 16\n[redis]\nurl = \"redis://hub:hunter2@redis.internal:6379\"\n",
    );
    let mut cmd = posthorn();
    cmd.args(["config", "show", "--config"])
        .arg(&file.0)
        .env("POSTHORN_SSE__HEARTBEAT", "7s")
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", "correct-horse-battery-staple");
    let output = run(cmd).await;
    let shown = text(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let table: toml::Table = toml::from_str(&shown).expect("config show prints TOML");
    assert_eq!(
        table["memory"]["shards"].as_integer(),
        Some(16),
        "from the file"
    );
    assert_eq!(
        table["sse"]["heartbeat"].as_str(),
        Some("7s"),
        "from the environment"
    );
    assert_eq!(
        table["sse"]["queue_limit"].as_integer(),
        Some(256),
        "a default"
    );
    assert_eq!(table["auth"]["mode"].as_str(), Some("jwt"));
    // Both secrets' keys are there, without their values.
    assert_eq!(
        table["redis"]["url"].as_str(),
        Some("redis://(redacted)@redis.internal:6379")
    );
    assert!(shown.contains("jwt_secret is set, not shown"), "{shown}");
    for secret in ["correct-horse-battery-staple", "hunter2"] {
        assert!(!shown.contains(secret), "{secret} in:\n{shown}");
    }

    // Fed back, the placeholder of the URL's password is refused rather than taken for a user;
    // with the password back in place the file is the same configuration.
    let saved = TempFile::new("shown.toml", &shown);
    let check = |path: &Path| {
        let mut cmd = posthorn();
        cmd.args(["config", "check", "--config"])
            .arg(path)
            .env("POSTHORN_AUTH__JWT_SECRET", "correct-horse-battery-staple");
        run(cmd)
    };
    let output = check(&saved.0).await;
    assert_eq!(output.status.code(), Some(EX_USAGE));
    assert!(
        text(&output.stderr).contains("redis.url"),
        "{}",
        text(&output.stderr)
    );
    let restored = TempFile::new(
        "restored.toml",
        &shown.replace("(redacted)@", "hub:hunter2@"),
    );
    let output = check(&restored.0).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
}

/// `config default` prints the reference file, byte for byte.
#[tokio::test]
async fn config_default_is_the_reference_file() {
    let mut cmd = posthorn();
    cmd.args(["config", "default"]);
    let output = run(cmd).await;
    assert_eq!(output.status.code(), Some(0));
    let reference =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/posthorn.toml"))
            .expect("config/posthorn.toml");
    assert_eq!(text(&output.stdout), reference);
}

//! JWT authentication (docs/http-api.md): 401 versus 403 exactly as documented, scopes as a
//! string or an array, the token in the header or the query, HS256 and ES256 keys, and the
//! `posthorn token` command.

mod support;

use std::{
    process::Command,
    time::{SystemTime, UNIX_EPOCH},
};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use support::{http, stream_path, Hub, SseClient};

const SECRET: &str = "test-secret-for-posthorn";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn hs256(claims: Value) -> String {
    let key = EncodingKey::from_secret(SECRET.as_bytes()).unwrap();
    jsonwebtoken::encode(&Header::default(), &claims, &key).unwrap()
}

async fn jwt_hub() -> Hub {
    Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .start()
        .await
}

async fn stream_status(hub: &Hub, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let client = SseClient::connect(hub.addr(), path, headers).await;
    let status = client.status();
    if status == 200 {
        return (status, Value::Null);
    }
    let response = http::request(hub.addr(), "GET", path, headers, None).await;
    (status, response.json())
}

/// Streams: a token for the device (header or `?token=`) opens it; none, garbage, a wrong
/// signature or an expired token is 401 with `WWW-Authenticate`; a token for another device is 403.
#[tokio::test]
async fn stream_tokens_are_checked() {
    let hub = jwt_hub().await;
    let valid = hs256(json!({ "sub": "pos-1", "exp": now() + 600 }));
    let bearer = format!("Bearer {valid}");
    assert_eq!(
        stream_status(&hub, &stream_path("pos-1"), &[("Authorization", &bearer)])
            .await
            .0,
        200
    );
    assert_eq!(
        stream_status(
            &hub,
            &format!("{}?token={valid}", stream_path("pos-1")),
            &[]
        )
        .await
        .0,
        200
    );

    let (status, body) =
        stream_status(&hub, &stream_path("pos-2"), &[("Authorization", &bearer)]).await;
    assert_eq!((status, body["error"].as_str()), (403, Some("forbidden")));

    let expired = hs256(json!({ "sub": "pos-1", "exp": now() - 300 }));
    let forged = {
        let key = EncodingKey::from_secret(b"another secret").unwrap();
        jsonwebtoken::encode(
            &Header::default(),
            &json!({ "sub": "pos-1", "exp": now() + 600 }),
            &key,
        )
        .unwrap()
    };
    let no_exp = hs256(json!({ "sub": "pos-1" }));
    for token in [
        None,
        Some("garbage".to_string()),
        Some(expired),
        Some(forged),
        Some(no_exp),
    ] {
        let header = token.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = header
            .iter()
            .map(|h| ("Authorization", h.as_str()))
            .collect();
        let response =
            http::request(hub.addr(), "GET", &stream_path("pos-1"), &headers, None).await;
        assert_eq!(response.status, 401, "{header:?}: {}", response.text());
        assert_eq!(response.json()["error"], "unauthorized");
        assert_eq!(response.header("www-authenticate"), Some("Bearer"));
    }
}

/// Publishing needs the `publish` scope (space-separated string or array); a device token is 403,
/// no token 401.
#[tokio::test]
async fn publish_needs_the_publish_scope() {
    let hub = jwt_hub().await;
    let event = json!({ "device": "pos-1", "data": "x" });
    let post = |token: Option<String>| {
        let hub_addr = hub.addr();
        let event = event.clone();
        async move {
            let header = token.map(|t| format!("Bearer {t}"));
            let mut headers: Vec<(&str, &str)> = header
                .iter()
                .map(|h| ("Authorization", h.as_str()))
                .collect();
            headers.push(("Content-Type", "application/json"));
            let body = serde_json::to_vec(&event).unwrap();
            http::request(hub_addr, "POST", "/v1/events", &headers, Some(&body))
                .await
                .status
        }
    };
    assert_eq!(post(None).await, 401);
    assert_eq!(
        post(Some(hs256(json!({ "sub": "pos-1", "exp": now() + 600 })))).await,
        403
    );
    assert_eq!(
        post(Some(hs256(json!({ "scope": "admin", "exp": now() + 600 })))).await,
        403
    );
    assert_eq!(
        post(Some(hs256(
            json!({ "scope": "read publish", "exp": now() + 600 })
        )))
        .await,
        201
    );
    assert_eq!(
        post(Some(hs256(
            json!({ "scope": ["publish"], "exp": now() + 600 })
        )))
        .await,
        201
    );
}

/// Admin endpoints need the `admin` scope with jwt auth.
#[tokio::test]
async fn admin_needs_the_admin_scope() {
    let hub = jwt_hub().await;
    let publish = format!(
        "Bearer {}",
        hs256(json!({ "scope": "publish", "exp": now() + 600 }))
    );
    let admin = format!(
        "Bearer {}",
        hs256(json!({ "scope": ["admin"], "exp": now() + 600 }))
    );
    assert_eq!(
        http::request(hub.addr(), "GET", "/admin/status", &[], None)
            .await
            .status,
        401
    );
    assert_eq!(
        http::request(
            hub.addr(),
            "GET",
            "/admin/status",
            &[("Authorization", &publish)],
            None
        )
        .await
        .status,
        403
    );
    let status = http::request(
        hub.addr(),
        "GET",
        "/admin/status",
        &[("Authorization", &admin)],
        None,
    )
    .await;
    assert_eq!(status.status, 200);
    assert!(
        !status.text().contains(SECRET),
        "the status page must not show the secret"
    );
    let drain = http::request(
        hub.addr(),
        "POST",
        "/admin/drain?exit=false",
        &[("Authorization", &admin)],
        None,
    )
    .await;
    assert_eq!(drain.status, 202);
}

/// With an ES256 (and, below, an RS256) public key, tokens signed by the matching private key
/// are accepted and HS256 tokens are not.
#[tokio::test]
async fn es256_public_keys_verify_tokens() {
    let dir = std::env::temp_dir().join(format!("posthorn-keys-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let private = dir.join("private.pem");
    let public = dir.join("public.pem");
    let run = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .status()
            .expect("openssl");
        assert!(status.success(), "openssl {args:?}");
    };
    run(&[
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-noout",
        "-out",
        private.to_str().unwrap(),
    ]);
    run(&[
        "pkcs8",
        "-topk8",
        "-nocrypt",
        "-in",
        private.to_str().unwrap(),
        "-out",
        dir.join("pk8.pem").to_str().unwrap(),
    ]);
    run(&[
        "ec",
        "-in",
        private.to_str().unwrap(),
        "-pubout",
        "-out",
        public.to_str().unwrap(),
    ]);
    let hub = Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env(
            "POSTHORN_AUTH__JWT_PUBLIC_KEY_FILE",
            public.to_str().unwrap(),
        )
        .start()
        .await;
    let key = EncodingKey::from_ec_pem(&std::fs::read(dir.join("pk8.pem")).unwrap()).unwrap();
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::ES256),
        &json!({ "sub": "pos-1", "exp": now() + 600 }),
        &key,
    )
    .unwrap();
    let path = format!("{}?token={token}", stream_path("pos-1"));
    assert_eq!(stream_status(&hub, &path, &[]).await.0, 200);
    let hs = hs256(json!({ "sub": "pos-1", "exp": now() + 600 }));
    assert_eq!(
        stream_status(&hub, &format!("{}?token={hs}", stream_path("pos-1")), &[])
            .await
            .0,
        401
    );
    drop(hub);

    run(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        dir.join("rsa.pem").to_str().unwrap(),
    ]);
    run(&[
        "pkey",
        "-in",
        dir.join("rsa.pem").to_str().unwrap(),
        "-pubout",
        "-out",
        dir.join("rsa.pub").to_str().unwrap(),
    ]);
    let hub = Hub::builder()
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env(
            "POSTHORN_AUTH__JWT_PUBLIC_KEY_FILE",
            dir.join("rsa.pub").to_str().unwrap(),
        )
        .start()
        .await;
    let key = EncodingKey::from_rsa_pem(&std::fs::read(dir.join("rsa.pem")).unwrap()).unwrap();
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::RS256),
        &json!({ "sub": "pos-1", "exp": now() + 600 }),
        &key,
    )
    .unwrap();
    assert_eq!(
        stream_status(
            &hub,
            &format!("{}?token={token}", stream_path("pos-1")),
            &[]
        )
        .await
        .0,
        200
    );
    assert_eq!(
        stream_status(&hub, &format!("{}?token={hs}", stream_path("pos-1")), &[])
            .await
            .0,
        401
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `posthorn token` mints tokens the hub accepts; without a secret it refuses with exit 64. With
/// jwt auth the hub may listen beyond loopback without `--insecure`.
#[tokio::test]
async fn token_command_and_secure_defaults() {
    let port = support::free_port();
    let hub = Hub::builder()
        .port(port)
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .start()
        .await;
    let mint = |args: &[&str], secret: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_posthorn"));
        command.arg("token").args(args);
        command.env_remove("POSTHORN_AUTH__JWT_SECRET");
        if let Some(secret) = secret {
            command.env("POSTHORN_AUTH__JWT_SECRET", secret);
        }
        command.output().expect("posthorn token")
    };
    let device = mint(&["--device", "pos-9"], Some(SECRET));
    assert!(device.status.success());
    let token = String::from_utf8(device.stdout).unwrap().trim().to_string();
    assert_eq!(
        stream_status(
            &hub,
            &format!("{}?token={token}", stream_path("pos-9")),
            &[]
        )
        .await
        .0,
        200
    );
    let publisher = String::from_utf8(mint(&["--scope", "publish"], Some(SECRET)).stdout).unwrap();
    let bearer = format!("Bearer {}", publisher.trim());
    let body = serde_json::to_vec(&json!({ "device": "pos-9", "data": "x" })).unwrap();
    assert_eq!(
        http::request(
            hub.addr(),
            "POST",
            "/v1/events",
            &[
                ("Authorization", &bearer),
                ("Content-Type", "application/json")
            ],
            Some(&body)
        )
        .await
        .status,
        201
    );
    let refused = mint(&["--device", "pos-9"], None);
    assert_eq!(refused.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("auth.jwt_secret"));

    // With jwt auth the hub may listen beyond loopback without --insecure.
    let open_port = support::free_port();
    let mut open = Command::new(env!("CARGO_BIN_EXE_posthorn"))
        .args(["serve", "--listen", &format!("0.0.0.0:{open_port}")])
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn serve");
    let local: std::net::SocketAddr = format!("127.0.0.1:{open_port}").parse().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        assert!(
            open.try_wait().unwrap().is_none(),
            "a jwt hub must not refuse 0.0.0.0"
        );
        if let Ok(response) = http::try_request(
            local,
            "GET",
            "/healthz",
            &[],
            None,
            std::time::Duration::from_secs(1),
        )
        .await
        {
            assert_eq!(response.status, 200);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the hub never answered"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let _ = open.kill();
    let _ = open.wait();
}

/// Tokens never reach the log, even at debug level, whether sent in the header or the query.
#[tokio::test]
async fn tokens_are_not_logged() {
    let hub = Hub::builder()
        .env("RUST_LOG", "debug")
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET", SECRET)
        .start()
        .await;
    let good = hs256(json!({ "sub": "pos-1", "exp": now() + 600 }));
    let wrong_device = hs256(json!({ "sub": "pos-2", "exp": now() + 600 }));
    let client = SseClient::connect(
        hub.addr(),
        &format!("{}?token={good}", stream_path("pos-1")),
        &[],
    )
    .await;
    assert_eq!(client.status(), 200);
    drop(client);
    let bearer = format!("Bearer {wrong_device}");
    http::request(
        hub.addr(),
        "GET",
        &stream_path("pos-1"),
        &[("Authorization", &bearer)],
        None,
    )
    .await;
    http::request(
        hub.addr(),
        "GET",
        &format!("{}?token=garbage-token-text", stream_path("pos-1")),
        &[],
        None,
    )
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let log = hub.stderr_log();
    assert!(log.contains("DEBUG"), "debug logging is on");
    for secret in [
        good.as_str(),
        wrong_device.as_str(),
        "garbage-token-text",
        SECRET,
    ] {
        assert!(
            !log.contains(secret),
            "a token or the secret appeared in the log"
        );
    }
}

/// With jwt auth a browser cannot attach the token by itself, so origins and hosts are not
/// checked (tests/browser.rs checks them with auth `none`): a token-bearing publish from any
/// origin, naming any host, is served.
#[tokio::test]
async fn browser_checks_are_for_auth_none_only() {
    let hub = jwt_hub().await;
    let bearer = format!(
        "Bearer {}",
        hs256(json!({ "scope": "publish", "exp": now() + 600 }))
    );
    let body = serde_json::to_vec(&json!({ "device": "pos-1", "data": "with a token" })).unwrap();
    let response = http::request(
        hub.addr(),
        "POST",
        "/v1/events",
        &[
            ("Content-Type", "application/json"),
            ("Origin", "https://other.example"),
            ("Host", "hub.example.com"),
            ("Authorization", &bearer),
        ],
        Some(&body),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
}

/// `auth.jwt_secret_file`: the secret comes from a file (its final line break dropped); tokens
/// signed with it are accepted, `posthorn token` signs with it, and neither the log at debug
/// level nor `/admin/status` shows it.
#[tokio::test]
async fn secret_from_a_file() {
    let dir = support::unique_temp_dir("jwt-secret");
    let file = dir.join("secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let hub = Hub::builder()
        .env("RUST_LOG", "debug")
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET_FILE", file.to_str().unwrap())
        .start()
        .await;
    let (status, _) = stream_status(
        &hub,
        &stream_path("pos-1"),
        &[(
            "Authorization",
            &format!(
                "Bearer {}",
                hs256(json!({ "sub": "pos-1", "exp": now() + 600 }))
            ),
        )],
    )
    .await;
    assert_eq!(status, 200, "a token signed with the file's secret");

    let minted = std::process::Command::new(env!("CARGO_BIN_EXE_posthorn"))
        .args(["token", "--scope", "admin"])
        .env("POSTHORN_AUTH__MODE", "jwt")
        .env("POSTHORN_AUTH__JWT_SECRET_FILE", file.to_str().unwrap())
        .output()
        .unwrap();
    assert!(minted.status.success(), "{minted:?}");
    let admin = String::from_utf8(minted.stdout).unwrap().trim().to_string();
    let status = http::request(
        hub.addr(),
        "GET",
        "/admin/status",
        &[("Authorization", &format!("Bearer {admin}"))],
        None,
    )
    .await;
    assert_eq!(status.status, 200, "{}", status.text());
    let auth = &status.json()["config"]["auth"];
    assert_eq!(auth["jwt_secret"], "(set)", "{auth}");
    assert_eq!(auth["jwt_secret_file"], file.to_str().unwrap(), "{auth}");
    assert!(!status.text().contains(SECRET));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let log = hub.stderr_log();
    assert!(log.contains("DEBUG"), "debug logging is on");
    assert!(!log.contains(SECRET), "the secret appeared in the log");
    std::fs::remove_dir_all(&dir).unwrap();
}

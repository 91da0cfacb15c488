//! The hub over HTTPS (`server.tls_cert_file`, `server.tls_key_file`; docs/operations.md, "TLS")
//! with certificates made by the test: streams, publish, readiness, metrics, CORS and drain work
//! as over plain HTTP; the certificate is replaced on a file change and on SIGHUP without
//! touching open streams, and a pair that does not load keeps the old one. The reference client
//! (library and `posthorn tail`) speaks https:// and refuses a certificate it cannot verify.

mod support;

use std::{path::Path, time::Duration};

use posthorn_client::{follow, ClientOptions, Notice};
use serde_json::json;
use support::{
    tls::{https_request, try_https_request, CertFiles, TestPki},
    Hub,
};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(15);

/// Follows `device` on `hub` with the reference client, trusting `ca_file`; notices arrive on
/// the channel. The task ends with the test.
fn follow_device(
    hub: &Hub,
    device: &str,
    ca_file: &Path,
) -> (mpsc::UnboundedReceiver<Notice>, tokio::task::JoinHandle<()>) {
    let (sender, receiver) = mpsc::unbounded_channel();
    let options = ClientOptions {
        base_url: hub.base_url(),
        ca_file: Some(ca_file.to_path_buf()),
        device: device.into(),
        token: posthorn_client::Token::None,
        cursor_file: None,
        heartbeat: Duration::from_secs(20),
        ack: false,
    };
    let task = tokio::spawn(async move {
        let _ = follow(options, move |notice| {
            let _ = sender.send(notice);
        })
        .await;
    });
    (receiver, task)
}

/// The next notice that is not a `Connected`.
async fn next_notice(notices: &mut mpsc::UnboundedReceiver<Notice>) -> Notice {
    loop {
        match tokio::time::timeout(WAIT, notices.recv()).await {
            Ok(Some(Notice::Connected { .. })) => continue,
            Ok(Some(notice)) => return notice,
            Ok(None) => panic!("the client stopped"),
            Err(_) => panic!("no notice within {WAIT:?}"),
        }
    }
}

async fn connected(notices: &mut mpsc::UnboundedReceiver<Notice>) {
    match tokio::time::timeout(WAIT, notices.recv()).await {
        Ok(Some(Notice::Connected { .. })) => {}
        other => panic!("expected Connected, got {other:?}"),
    }
}

async fn publish(hub: &Hub, ca_file: &Path, device: &str, data: &str) {
    let body =
        serde_json::to_vec(&json!({ "device": device, "type": "test", "data": data })).unwrap();
    let response = https_request(
        hub.addr(),
        ca_file,
        "POST",
        "/v1/events",
        &[("Content-Type", "application/json")],
        Some(&body),
    )
    .await;
    assert_eq!(response.status, 201, "{}", response.text());
}

fn data_of(notice: Notice) -> String {
    match notice {
        Notice::Event(event) => event.data,
        other => panic!("expected an event, got {other:?}"),
    }
}

/// Everything a client and an operator use, over HTTPS: a stream with the reference client,
/// publish, /healthz, /readyz, /metrics, /admin/status, a CORS preflight and grant, and a drain
/// that closes the stream with `retry:` and turns readiness off. Plain HTTP on the port gets no
/// answer.
#[tokio::test]
async fn everything_works_over_https() {
    let mut pki = TestPki::new("posthorn test CA");
    let cert = pki.server_cert();
    let hub = Hub::builder()
        .https(&cert, pki.ca_file())
        .env("POSTHORN_SERVER__CORS_ORIGINS", "https://pos.example")
        .start()
        .await;
    assert!(hub.base_url().starts_with("https://"));
    assert!(hub
        .stderr_log()
        .contains(&format!("listening on https://{}", hub.addr())));

    let (mut notices, _task) = follow_device(&hub, "pos-1", pki.ca_file());
    connected(&mut notices).await;
    publish(&hub, pki.ca_file(), "pos-1", "over tls").await;
    assert_eq!(data_of(next_notice(&mut notices).await), "over tls");

    let ca = pki.ca_file();
    for path in ["/healthz", "/readyz", "/metrics", "/admin/status"] {
        let response = https_request(hub.addr(), ca, "GET", path, &[], None).await;
        assert_eq!(response.status, 200, "{path}: {}", response.text());
    }
    let preflight = https_request(
        hub.addr(),
        ca,
        "OPTIONS",
        "/v1/events",
        &[
            ("Origin", "https://pos.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        None,
    )
    .await;
    assert_eq!(preflight.status, 204);
    assert!(preflight.header("access-control-allow-methods").is_some());
    // The one stream opened above, the `notices` over TLS.
    assert_eq!(https_metric(&hub, ca, "sse_connections").await, 1.0);

    // A client that does not speak TLS gets no HTTP answer.
    let plain = support::http::try_request(
        hub.addr(),
        "GET",
        "/healthz",
        &[],
        None,
        Duration::from_secs(3),
    )
    .await;
    assert!(!matches!(plain, Ok(ref r) if r.status == 200), "{plain:?}");

    let drain = https_request(hub.addr(), ca, "POST", "/admin/drain?exit=false", &[], None).await;
    assert_eq!(drain.status, 202, "{}", drain.text());
    match next_notice(&mut notices).await {
        Notice::Disconnected { reason, .. } => {
            assert!(reason.contains("ended the stream"), "{reason}")
        }
        other => panic!("expected the drain to close the stream, got {other:?}"),
    }
    let ready = https_request(hub.addr(), ca, "GET", "/readyz", &[], None).await;
    assert_eq!(ready.status, 503, "{}", ready.text());
}

/// Replaces the pair the way a certificate manager does: new files written beside, then renamed
/// over the old ones.
fn install(from: &CertFiles, to: &CertFiles) {
    for (source, target) in [(&from.cert, &to.cert), (&from.key, &to.key)] {
        let staged = target.with_extension("new");
        std::fs::copy(source, &staged).unwrap();
        std::fs::rename(&staged, target).unwrap();
    }
}

/// The issuer of the certificate a new TLS connection is shown, as a CA file that verifies it.
async fn verifies_with(hub: &Hub, ca_file: &Path) -> bool {
    try_https_request(hub.addr(), ca_file, "GET", "/healthz", &[], None, WAIT)
        .await
        .is_ok_and(|response| response.status == 200)
}

/// A renewal lands without a restart: after a change of the files new connections get the new
/// certificate (within the 5 s poll) while an open stream keeps flowing; a pair that does not
/// belong together, announced by SIGHUP, is refused with a log line and the current one stays.
#[tokio::test]
async fn certificate_reloads_without_touching_streams() {
    let mut old_pki = TestPki::new("old CA");
    let mut new_pki = TestPki::new("new CA");
    let served = old_pki.server_cert();
    let mut hub = Hub::builder()
        .https(&served, old_pki.ca_file())
        .start()
        .await;
    let (mut notices, _task) = follow_device(&hub, "pos-1", old_pki.ca_file());
    connected(&mut notices).await;

    install(&new_pki.server_cert(), &served);
    assert!(
        hub.wait_for_log("TLS certificate reloaded", WAIT).await,
        "{}",
        hub.stderr_log()
    );
    assert!(
        verifies_with(&hub, new_pki.ca_file()).await,
        "new certificate served"
    );
    assert!(
        !verifies_with(&hub, old_pki.ca_file()).await,
        "old certificate gone"
    );
    publish(&hub, new_pki.ca_file(), "pos-1", "after the renewal").await;
    assert_eq!(
        data_of(next_notice(&mut notices).await),
        "after the renewal",
        "the stream opened before the renewal still flows"
    );

    // A key of another certificate: refused, logged, the current pair kept.
    let mismatched = CertFiles {
        cert: old_pki.server_cert().cert,
        key: new_pki.server_cert().key,
    };
    install(&mismatched, &served);
    hub.signal("HUP");
    assert!(
        hub.wait_for_log("TLS certificate not reloaded after SIGHUP", WAIT)
            .await,
        "{}",
        hub.stderr_log()
    );
    assert!(hub
        .stderr_log()
        .contains("does not belong to the certificate"));
    assert!(
        verifies_with(&hub, new_pki.ca_file()).await,
        "still the last good certificate"
    );
    // SIGHUP with a good pair reloads at once.
    install(&old_pki.server_cert(), &served);
    hub.signal("HUP");
    tokio::time::timeout(WAIT, async {
        while !verifies_with(&hub, old_pki.ca_file()).await {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the pair announced by SIGHUP is served");
    assert!(hub.is_running());
}

/// A certificate from an authority the client does not trust: the reference client never
/// delivers anything and says why; `posthorn tail` with `--ca-file` of the right authority
/// prints the stream.
#[tokio::test]
async fn clients_verify_the_certificate() {
    let mut pki = TestPki::new("hub CA");
    let stranger = TestPki::new("another CA");
    let hub = Hub::builder()
        .https(&pki.server_cert(), pki.ca_file())
        .start()
        .await;

    let (mut notices, _task) = follow_device(&hub, "pos-1", stranger.ca_file());
    match next_notice(&mut notices).await {
        Notice::Disconnected { reason, .. } => {
            assert!(reason.contains("TLS handshake"), "{reason}");
            assert!(reason.contains("certificate"), "{reason}");
        }
        other => panic!("expected a refused connection, got {other:?}"),
    }

    let dir = support::unique_temp_dir("tail-https");
    let (out, err) = (dir.join("out"), dir.join("err"));
    let mut tail = std::process::Command::new(env!("CARGO_BIN_EXE_posthorn"))
        .args([
            "tail",
            "--url",
            &hub.base_url(),
            "--device",
            "pos-2",
            "--ca-file",
        ])
        .arg(pki.ca_file())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !std::fs::read_to_string(&err).unwrap().contains("connected") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            std::fs::read_to_string(&err).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publish(&hub, pki.ca_file(), "pos-2", "to the tail").await;
    while !std::fs::read_to_string(&out)
        .unwrap()
        .contains("to the tail")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            std::fs::read_to_string(&err).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = tail.kill();
    let _ = tail.wait();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The value of a metric without labels, read over HTTPS.
async fn https_metric(hub: &Hub, ca_file: &Path, name: &str) -> f64 {
    let scrape = https_request(hub.addr(), ca_file, "GET", "/metrics", &[], None).await;
    support::metrics::Scrape::parse(&scrape.text()).value_or_zero(name, &[])
}

/// A client that opens a TCP connection and never starts its TLS handshake is dropped when the
/// handshake time is up, as a plain client that never finishes its request head is.
#[tokio::test]
async fn a_silent_tls_client_is_dropped() {
    let mut pki = TestPki::new("CA");
    let hub = Hub::builder()
        .https(&pki.server_cert(), pki.ca_file())
        .start()
        .await;
    let mut silent = tokio::net::TcpStream::connect(hub.addr()).await.unwrap();
    assert!(
        support::sse::is_closed_within(&mut silent, WAIT).await,
        "a connection without a handshake must be dropped"
    );
}

/// A TLS client that stops reading fills its queue and is evicted like a plain one, and no stream
/// is left open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_that_stops_reading_is_evicted() {
    use tokio::io::AsyncWriteExt;

    let mut pki = TestPki::new("CA");
    let hub = Hub::builder()
        .https(&pki.server_cert(), pki.ca_file())
        .env("POSTHORN_SSE__QUEUE_LIMIT", "64")
        .env("POSTHORN_SSE__SEND_BUFFER", "4096")
        .env("POSTHORN_SSE__STALL_TIMEOUT", "0s")
        .start()
        .await;
    let ca = pki.ca_file();
    let mut stalled = support::tls::connect(hub.addr(), ca).await.unwrap();
    stalled
        .write_all(
            b"GET /v1/devices/stalled-1/events HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n",
        )
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while https_metric(&hub, ca, "sse_connections").await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream did not open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // About 400 KB: far beyond the queue (64 events), the socket and the capped TLS buffer.
    let payload = "x".repeat(1024);
    for i in 0..400 {
        let body =
            serde_json::to_vec(&json!({ "broadcast": true, "data": format!("{i}:{payload}") }))
                .unwrap();
        let response = https_request(
            hub.addr(),
            ca,
            "POST",
            "/v1/events",
            &[("Content-Type", "application/json")],
            Some(&body),
        )
        .await;
        assert_eq!(response.status, 201, "{}", response.text());
        if https_metric(&hub, ca, "sse_slow_consumer_disconnects_total").await >= 1.0 {
            break;
        }
    }
    while https_metric(&hub, ca, "sse_slow_consumer_disconnects_total").await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stalled TLS client was not evicted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(https_metric(&hub, ca, "sse_connections").await, 0.0);
}

/// A pair that does not load stops start-up with exit 64, naming the keys and the reason.
#[tokio::test]
async fn a_bad_certificate_stops_start_up() {
    let mut pki = TestPki::new("CA");
    let good = pki.server_cert();
    let other = pki.server_cert();
    let missing = pki.dir().join("missing.pem");
    for (cert, key, why) in [
        (
            good.cert.clone(),
            other.key.clone(),
            "does not belong to the certificate",
        ),
        (missing.clone(), good.key.clone(), "cannot read"),
        (good.key.clone(), good.key.clone(), "holds no certificate"),
    ] {
        let (code, log) = Hub::builder()
            .env("POSTHORN_SERVER__TLS_CERT_FILE", cert.to_str().unwrap())
            .env("POSTHORN_SERVER__TLS_KEY_FILE", key.to_str().unwrap())
            .run_to_exit(WAIT)
            .await;
        assert_eq!(code, Some(64), "{log}");
        assert!(log.contains("server.tls_cert_file"), "{log}");
        assert!(log.contains(why), "{why}: {log}");
    }
}

//! Acknowledgements: after the client persisted a cursor, it tells the hub
//! (`POST /v1/devices/{device}/ack`, docs/http-api.md) that the device has processed everything up
//! to it, so that a back office can see which terminals applied an event. At most once per second,
//! and only the newest cursor: an ack covers everything before it. A failed ack is not retried on
//! its own (the next cursor's ack covers it); a hub whose fleet API is off (404 `fleet_disabled`)
//! is not asked again. Any other answer (a pod of an older version during a rolling deploy
//! answers 404 `not_found`) just waits for the next cursor.

use std::time::Duration;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    sync::watch,
};

use crate::{connect, Target};

/// At most one ack per this interval.
pub const ACK_INTERVAL: Duration = Duration::from_secs(1);

/// Hands persisted cursors to a task that acknowledges them.
pub struct Acker {
    newest: watch::Sender<Option<String>>,
}

impl Acker {
    /// Starts the acknowledging task on the current tokio runtime; it ends with the `Acker`.
    /// Each ack goes with the token of the stream's current connection.
    pub(crate) fn start(target: Target, tokens: watch::Receiver<Option<String>>) -> Self {
        let (newest, mut persisted) = watch::channel(None::<String>);
        tokio::spawn(async move {
            while persisted.changed().await.is_ok() {
                let Some(cursor) = persisted.borrow_and_update().clone() else {
                    continue;
                };
                let token = tokens.borrow().clone();
                if let Ok(Answer::FleetDisabled) = send(&target, token.as_deref(), &cursor).await {
                    return;
                }
                tokio::time::sleep(ACK_INTERVAL).await;
            }
        });
        Self { newest }
    }

    /// `cursor` is persisted: acknowledge it (or a newer one) soon.
    pub fn persisted(&self, cursor: &str) {
        self.newest.send_replace(Some(cursor.to_owned()));
    }
}

/// What the hub said to an ack.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// Any status but the one below.
    Status(u16),
    /// 404 `fleet_disabled`: this hub keeps no acks.
    FleetDisabled,
}

/// One ack.
async fn send(target: &Target, token: Option<&str>, cursor: &str) -> Result<Answer, String> {
    let body = serde_json::json!({ "id": cursor }).to_string();
    let mut request = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        target.ack_path,
        target.host_port,
        body.len()
    );
    if let Some(token) = token.filter(|token| !token.contains(['\r', '\n'])) {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    let exchange = async {
        let mut stream = connect(target).await?;
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|error| error.to_string())?;
        // The whole answer is small (`Connection: close` ends it): read at most 4 KiB of it.
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while answer.len() < 4096 {
            match stream.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                Err(error) => return Err(error.to_string()),
            }
        }
        let text = String::from_utf8_lossy(&answer);
        // "HTTP/1.1 204 ...": the status is the second word.
        let status: u16 = text
            .split(' ')
            .nth(1)
            .and_then(|status| status.parse().ok())
            .ok_or_else(|| "no status line".to_string())?;
        Ok(if status == 404 && text.contains("\"fleet_disabled\"") {
            Answer::FleetDisabled
        } else {
            Answer::Status(status)
        })
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| "the ack timed out".to_string())?
}

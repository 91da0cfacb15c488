//! Acknowledgements: after the client persisted a cursor, it tells the hub
//! (`POST /v1/devices/{device}/ack`, docs/http-api.md) that the device has processed everything up
//! to it, so that a back office can see which terminals applied an event. At most once per second,
//! and only the newest cursor: an ack covers everything before it. A failed ack is not retried on
//! its own (the next cursor's ack covers it); a hub whose fleet API is off (404) is not asked again.

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
    pub(crate) fn start(target: Target, token: Option<String>) -> Self {
        let (newest, mut persisted) = watch::channel(None::<String>);
        tokio::spawn(async move {
            while persisted.changed().await.is_ok() {
                let Some(cursor) = persisted.borrow_and_update().clone() else {
                    continue;
                };
                // 404: the hub does not keep acks (its fleet API is off); stop asking.
                if let Ok(404) = send(&target, token.as_deref(), &cursor).await {
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

/// One ack; the status the hub answered.
async fn send(target: &Target, token: Option<&str>, cursor: &str) -> Result<u16, String> {
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
        let mut head = [0u8; 16];
        let mut read = 0;
        while read < head.len() {
            match stream.read(&mut head[read..]).await {
                Ok(0) => break,
                Ok(n) => read += n,
                Err(error) => return Err(error.to_string()),
            }
        }
        // "HTTP/1.1 204 ...": the status is the second word.
        std::str::from_utf8(&head[..read])
            .ok()
            .and_then(|text| text.split(' ').nth(1))
            .and_then(|status| status.parse().ok())
            .ok_or_else(|| "no status line".to_string())
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| "the ack timed out".to_string())?
}

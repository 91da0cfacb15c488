//! Headless Chromium (Debian's `chromium`) driven over the Chrome DevTools Protocol, for tests of
//! the pages the hub serves (`/admin/console`).
//!
//! [`Chromium`] owns the browser process (in its own process group, killed with everything it
//! started on `Drop`) and a fresh profile directory (removed on `Drop`). [`Cdp`] is one DevTools
//! connection to a page: a minimal WebSocket client (RFC 6455: text frames out, masked; text and
//! continuation frames in), enough for DevTools, which sends neither pings nor binary frames. It
//! keeps the events Chromium sends between answers, so a test can look for console errors.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{http, unique_temp_dir, IO_TIMEOUT};

/// A cold Chromium on two busy cores takes several seconds to open its DevTools port.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running headless Chromium with an empty page (`about:blank`).
pub struct Chromium {
    child: Child,
    /// The profile (`--user-data-dir`) and the browser's log; removed on drop.
    dir: PathBuf,
    /// The DevTools HTTP and WebSocket endpoint on loopback.
    devtools: SocketAddr,
}

impl Chromium {
    /// Starts `chromium` (install it with `apt-get install chromium`; `scripts/test` does) with a
    /// window of `width` × `height` CSS pixels, for screenshots.
    pub async fn start(width: u32, height: u32) -> Chromium {
        let dir = unique_temp_dir("chromium");
        let profile = dir.join("profile");
        let log = std::fs::File::create(dir.join("chromium.log")).expect("create chromium.log");
        let mut command = Command::new("chromium");
        command
            .args([
                "--headless=new",
                // Tests run as root in containers, where Chromium's sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                // Containers often have a tiny /dev/shm.
                "--disable-dev-shm-usage",
                // Port 0: Chromium picks one and writes it to DevToolsActivePort in the profile.
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                // No calls home, no first-run UI: nothing but the page under test.
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-extensions",
                "--disable-sync",
                "--hide-scrollbars",
                "--mute-audio",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("--window-size={width},{height}"))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone chromium.log"))
            .stderr(log);
        // Its own process group, so that Drop can end the renderers and helpers with it.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command.spawn().unwrap_or_else(|e| {
            panic!("start chromium: {e} (install it: apt-get install -y --no-install-recommends chromium)")
        });
        let mut chromium = Chromium {
            child,
            dir,
            devtools: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        };
        let port_file = profile.join("DevToolsActivePort");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            // The file's first line is the port; it is written whole once the port listens.
            let port = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|text| text.lines().next()?.trim().parse::<u16>().ok());
            if let Some(port) = port {
                chromium.devtools.set_port(port);
                return chromium;
            }
            if let Ok(Some(status)) = chromium.child.try_wait() {
                panic!(
                    "chromium exited ({status}) before it opened DevTools:\n{}",
                    chromium.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "chromium opened no DevTools port within {START_TIMEOUT:?}:\n{}",
                chromium.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What the browser wrote to stdout and stderr, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("chromium.log")).unwrap_or_default()
    }

    /// A DevTools connection to the browser's (only) page.
    pub async fn page(&self) -> Cdp {
        let targets = http::get(self.devtools, "/json/list").await;
        assert_eq!(targets.status, 200, "/json/list: {}", targets.text());
        let targets = targets.json();
        let url = targets
            .as_array()
            .and_then(|all| all.iter().find(|t| t["type"] == "page"))
            .and_then(|page| page["webSocketDebuggerUrl"].as_str())
            .unwrap_or_else(|| panic!("no page among the DevTools targets: {targets}"));
        // ws://127.0.0.1:<port>/devtools/page/<id>: only the path is needed.
        let path = url
            .splitn(4, '/')
            .nth(3)
            .map(|path| format!("/{path}"))
            .unwrap_or_else(|| panic!("unexpected DevTools URL {url}"));
        Cdp::connect(self.devtools, &path).await
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        // The whole group: the browser leaves its zygote and renderers behind otherwise.
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One DevTools connection (to a page target).
pub struct Cdp {
    stream: BufStream<TcpStream>,
    next_id: u64,
    /// Events received so far (`{"method": ..., "params": ...}`), oldest first.
    events: Vec<Value>,
}

impl Cdp {
    async fn connect(addr: SocketAddr, path: &str) -> Cdp {
        let connect = async {
            let mut stream = BufStream::new(TcpStream::connect(addr).await?);
            // The key only proves to a proxy that the client speaks WebSocket; any value works.
            let request = format!(
                "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                 Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await?;
            stream.flush().await?;
            let mut status = String::new();
            stream.read_line(&mut status).await?;
            loop {
                let mut line = String::new();
                if stream.read_line(&mut line).await? == 0 || line == "\r\n" {
                    break;
                }
            }
            std::io::Result::Ok((stream, status))
        };
        let (stream, status) = tokio::time::timeout(IO_TIMEOUT, connect)
            .await
            .unwrap_or_else(|_| panic!("DevTools handshake on {addr} took over {IO_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("DevTools handshake on {addr}: {e}"));
        assert!(
            status.contains(" 101 "),
            "DevTools refused the WebSocket: {status}"
        );
        Cdp {
            stream,
            next_id: 1,
            events: Vec::new(),
        }
    }

    /// Sends a command and returns its `result`; panics on a protocol error or after
    /// [`IO_TIMEOUT`]. Events that arrive meanwhile are kept (see [`Cdp::events`]).
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let message = json!({ "id": id, "method": method, "params": params }).to_string();
        let exchange = async {
            self.send(message.as_bytes()).await?;
            loop {
                let answer: Value = serde_json::from_slice(&self.receive().await?)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
                if answer["id"] == id {
                    return std::io::Result::Ok(answer);
                }
                self.events.push(answer);
            }
        };
        let answer = tokio::time::timeout(IO_TIMEOUT, exchange)
            .await
            .unwrap_or_else(|_| panic!("{method}: no answer within {IO_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("{method}: {e}"));
        if let Some(error) = answer.get("error") {
            panic!("{method} failed: {error}");
        }
        answer["result"].clone()
    }

    /// Loads `url` in the page and waits for its `load` event (needs `Page.enable`).
    pub async fn navigate(&mut self, url: &str) {
        let seen = self.events.len();
        let answer = self.call("Page.navigate", json!({ "url": url })).await;
        if let Some(error) = answer.get("errorText") {
            panic!("loading {url} failed: {error}");
        }
        let loaded = |event: &Value| event["method"] == "Page.loadEventFired";
        if self.events[seen..].iter().any(loaded) {
            return;
        }
        let wait = async {
            loop {
                let event: Value = serde_json::from_slice(&self.receive().await?)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
                let done = loaded(&event);
                self.events.push(event);
                if done {
                    return std::io::Result::Ok(());
                }
            }
        };
        tokio::time::timeout(IO_TIMEOUT, wait)
            .await
            .unwrap_or_else(|_| panic!("{url} did not load within {IO_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("loading {url}: {e}"));
    }

    /// Evaluates `expression` in the page (awaiting it if it is a promise) and returns its value
    /// as JSON; panics if it throws.
    pub async fn evaluate(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await;
        if let Some(exception) = result.get("exceptionDetails") {
            panic!("{expression} threw: {exception}");
        }
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` until it is truthy in JavaScript; panics with `what` after
    /// `timeout`.
    pub async fn wait_for(&mut self, expression: &str, timeout: Duration, what: &str) {
        let deadline = Instant::now() + timeout;
        let truthy = format!("Boolean({expression})");
        while self.evaluate(&truthy).await != true {
            assert!(
                Instant::now() < deadline,
                "the page never showed {what} within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Errors the page reported: uncaught exceptions, `console.error`, and the browser's own log
    /// entries at level error (failed loads, refused by the Content-Security-Policy). Needs
    /// `Runtime.enable` and `Log.enable` first.
    pub fn console_errors(&self) -> Vec<&Value> {
        self.events
            .iter()
            .filter(|event| match event["method"].as_str() {
                Some("Runtime.exceptionThrown") => true,
                Some("Runtime.consoleAPICalled") => event["params"]["type"] == "error",
                Some("Log.entryAdded") => event["params"]["entry"]["level"] == "error",
                _ => false,
            })
            .collect()
    }

    /// One text message in one masked frame (a client must mask, RFC 6455 5.3; a fixed mask
    /// key is enough against a browser's DevTools).
    async fn send(&mut self, payload: &[u8]) -> std::io::Result<()> {
        const MASK: [u8; 4] = [0x37, 0xfa, 0x21, 0x3d];
        let mut frame = vec![0x81]; // FIN, text
        match payload.len() {
            len @ 0..=125 => frame.push(0x80 | len as u8),
            len @ 126..=0xffff => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(len as u16).to_be_bytes());
            }
            len => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        frame.extend_from_slice(&MASK);
        frame.extend(payload.iter().zip(MASK.iter().cycle()).map(|(b, m)| b ^ m));
        self.stream.write_all(&frame).await?;
        self.stream.flush().await
    }

    /// The next whole message (text and continuation frames up to FIN).
    async fn receive(&mut self) -> std::io::Result<Vec<u8>> {
        let mut message = Vec::new();
        loop {
            let mut head = [0u8; 2];
            self.stream.read_exact(&mut head).await?;
            let (fin, opcode) = (head[0] & 0x80 != 0, head[0] & 0x0f);
            let len = match head[1] & 0x7f {
                126 => u64::from(self.stream.read_u16().await?),
                127 => self.stream.read_u64().await?,
                len => u64::from(len),
            };
            // A server never masks (RFC 6455 5.1), so no mask key follows.
            let mut payload = vec![0u8; len as usize];
            self.stream.read_exact(&mut payload).await?;
            match opcode {
                0x0 | 0x1 => message.extend_from_slice(&payload),
                0x8 => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "chromium closed the DevTools connection",
                    ))
                }
                // Pings and pongs: DevTools sends none, and none needs an answer here.
                _ => continue,
            }
            if fin {
                return Ok(message);
            }
        }
    }
}

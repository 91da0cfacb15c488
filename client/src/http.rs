//! A one-shot HTTP/1.1 `GET` over plain TCP or TLS: what the hub needs to fetch a small document
//! (an identity provider's key set) without a second HTTP client library in its tree. One
//! request per connection (`Connection: close`), the body by `Content-Length`, chunked framing
//! or the end of the connection, bounded in size and time.

use std::{path::Path, sync::Arc, time::Duration};

use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tokio_rustls::TlsConnector;

use crate::dechunk::Dechunk;

/// Largest response head accepted.
const MAX_HEAD: usize = 64 * 1024;

/// An `http://` or `https://` URL taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    pub https: bool,
    /// As written, without brackets around an IPv6 address.
    pub host: String,
    pub port: u16,
    /// The path and query, at least `/`.
    pub path: String,
}

impl Url {
    pub fn parse(text: &str) -> Result<Url, String> {
        let bad = |why: &str| format!("invalid URL {text:?}: {why}");
        let (https, rest) = match text.split_once("://") {
            Some(("http", rest)) => (false, rest),
            Some(("https", rest)) => (true, rest),
            _ => return Err(bad("expected http:// or https://")),
        };
        let (authority, path) = match rest.find(['/', '?']) {
            Some(at) => (&rest[..at], rest[at..].to_string()),
            None => (rest, "/".to_string()),
        };
        let path = if path.starts_with('?') {
            format!("/{path}")
        } else {
            path
        };
        let path = path.split('#').next().unwrap_or("/").to_string();
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("expected a host (and no user name)"));
        }
        if text.contains(['\r', '\n', ' ']) {
            return Err(bad("it holds a space or a line break"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !port.contains(']') => (
                host,
                port.parse::<u16>()
                    .map_err(|_| bad("the port is not a number"))?,
            ),
            _ => (authority, if https { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("expected a host"));
        }
        Ok(Url {
            https,
            host: host.to_string(),
            port,
            path,
        })
    }

    /// What `Host:` carries, and what a TCP connection goes to.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// A TLS connector trusting `ca_file`'s authorities, or the system's.
pub fn tls_connector(ca_file: Option<&Path>) -> Result<TlsConnector, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certificates = CertificateDer::pem_file_iter(path)
                .and_then(|found| found.collect::<Result<Vec<_>, _>>())
                .map_err(|error| format!("CA file {}: {error}", path.display()))?;
            roots.add_parsable_certificates(certificates);
            if roots.is_empty() {
                return Err(format!(
                    "CA file {} holds no usable certificate",
                    path.display()
                ));
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if roots.is_empty() {
                return Err(
                    "this system has no certificate authorities to trust; give a CA file".into(),
                );
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|error| error.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// A connection to a server, with or without TLS.
pub trait Connection: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Connection for T {}

/// Connects to `host_port`, through TLS for the server `tls` names.
pub async fn connect(
    host_port: &str,
    tls: Option<(&TlsConnector, ServerName<'static>)>,
) -> Result<Box<dyn Connection>, String> {
    let stream = TcpStream::connect(host_port)
        .await
        .map_err(|error| format!("cannot connect to {host_port}: {error}"))?;
    let _ = stream.set_nodelay(true);
    let Some((connector, name)) = tls else {
        return Ok(Box::new(stream));
    };
    let stream = connector
        .connect(name, stream)
        .await
        .map_err(|error| format!("TLS handshake with {host_port} failed: {error}"))?;
    Ok(Box::new(stream))
}

/// A whole response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// `GET url` with `headers`; `tls` is needed for `https://`. Fails after `timeout` in all, or
/// when the body exceeds `max_body` bytes.
pub async fn get(
    url: &Url,
    tls: Option<&TlsConnector>,
    headers: &[(&str, &str)],
    timeout: Duration,
    max_body: usize,
) -> Result<Response, String> {
    tokio::time::timeout(timeout, get_unbounded(url, tls, headers, max_body))
        .await
        .map_err(|_| {
            format!(
                "no whole answer from {} within {timeout:?}",
                url.authority()
            )
        })?
}

async fn get_unbounded(
    url: &Url,
    tls: Option<&TlsConnector>,
    headers: &[(&str, &str)],
    max_body: usize,
) -> Result<Response, String> {
    let tls = match (url.https, tls) {
        (false, _) => None,
        (true, Some(connector)) => {
            let name = ServerName::try_from(url.host.clone())
                .map_err(|_| format!("{:?} is no server name", url.host))?;
            Some((connector, name))
        }
        (true, None) => return Err(format!("{} needs TLS", url.authority())),
    };
    let mut connection = connect(&url.authority(), tls).await?;
    let mut request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
        url.path,
        url.authority()
    );
    for (name, value) in headers {
        if name.contains(['\r', '\n', ':']) || value.contains(['\r', '\n']) {
            return Err(format!("header {name:?} cannot be sent"));
        }
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    connection
        .write_all(request.as_bytes())
        .await
        .map_err(|error| format!("cannot send the request: {error}"))?;
    let mut received = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let body_start = loop {
        let n = connection
            .read(&mut buf)
            .await
            .map_err(|error| format!("read failed: {error}"))?;
        if n == 0 {
            return Err("the connection closed before the answer's head".into());
        }
        received.extend_from_slice(&buf[..n]);
        if let Some(at) = memchr::memmem::find(&received, b"\r\n\r\n") {
            break at + 4;
        }
        if received.len() > MAX_HEAD {
            return Err("the answer's head is too large".into());
        }
    };
    let head = String::from_utf8_lossy(&received[..body_start]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| "the answer has no status line".to_string())?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    let mut response = Response {
        status,
        headers,
        body: Vec::new(),
    };
    let chunked = response
        .header("transfer-encoding")
        .is_some_and(|value| value.to_ascii_lowercase().contains("chunked"));
    let length = match response.header("content-length") {
        Some(value) => Some(
            value
                .parse::<usize>()
                .map_err(|_| format!("bad Content-Length {value:?}"))?,
        ),
        None => None,
    };
    if length.is_some_and(|length| length > max_body) {
        return Err(format!("the body is larger than {max_body} bytes"));
    }
    let mut dechunk = chunked.then(Dechunk::default);
    let mut body = Vec::new();
    take(&mut dechunk, &received[body_start..], &mut body, max_body)?;
    loop {
        let done = match &dechunk {
            Some(dechunk) => dechunk.finished(),
            None => length.is_some_and(|length| body.len() >= length),
        };
        if done {
            break;
        }
        let n = connection
            .read(&mut buf)
            .await
            .map_err(|error| format!("read failed: {error}"))?;
        if n == 0 {
            if chunked || length.is_some() {
                return Err("the connection closed before the whole body".into());
            }
            break;
        }
        take(&mut dechunk, &buf[..n], &mut body, max_body)?;
    }
    if let Some(length) = length {
        body.truncate(length);
    }
    response.body = body;
    Ok(response)
}

/// Adds the body bytes `bytes` carry (through `dechunk` for a chunked body) to `body`.
fn take(
    dechunk: &mut Option<Dechunk>,
    bytes: &[u8],
    body: &mut Vec<u8>,
    max_body: usize,
) -> Result<(), String> {
    let mut over = dechunk.is_none() && body.len() + bytes.len() > max_body;
    match dechunk {
        Some(dechunk) => {
            dechunk
                .feed(bytes, |data| {
                    over |= body.len() + data.len() > max_body;
                    if !over {
                        body.extend_from_slice(data);
                    }
                })
                .map_err(|error| format!("bad chunked body: {error}"))?;
        }
        None if !over => body.extend_from_slice(bytes),
        None => {}
    }
    if over {
        return Err(format!("the body is larger than {max_body} bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// URLs are taken apart as the request needs them; what cannot be one is refused.
    #[test]
    fn urls() {
        let url = Url::parse("https://idp.example/.well-known/jwks.json").unwrap();
        assert_eq!(
            url,
            Url {
                https: true,
                host: "idp.example".into(),
                port: 443,
                path: "/.well-known/jwks.json".into(),
            }
        );
        let url = Url::parse("http://127.0.0.1:8081?x=1#frag").unwrap();
        assert_eq!((url.port, url.path.as_str()), (8081, "/?x=1"));
        let url = Url::parse("http://[::1]:9/k").unwrap();
        assert_eq!(
            (url.host.as_str(), url.authority()),
            ("::1", "[::1]:9".into())
        );
        for bad in [
            "ftp://a/",
            "a/b",
            "http://",
            "http://u@h/",
            "http://h:x/",
            "http://h/a b",
            "http://h/\r\n",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    /// A body by `Content-Length`, by chunks, and to the end of the connection; one over the
    /// limit is refused.
    #[tokio::test]
    async fn bodies_in_every_framing() {
        async fn serve(answer: &'static [u8]) -> Url {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            tokio::spawn(async move {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut request = [0u8; 1024];
                let _ = socket.read(&mut request).await.unwrap();
                socket.write_all(answer).await.unwrap();
            });
            Url::parse(&format!("http://127.0.0.1:{port}/keys")).unwrap()
        }
        let fetch =
            |url: Url, max| async move { get(&url, None, &[], Duration::from_secs(5), max).await };
        let url = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").await;
        let response = fetch(url, 100).await.unwrap();
        assert_eq!(
            (response.status, response.body.as_slice()),
            (200, &b"hello"[..])
        );
        let url = serve(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(fetch(url, 100).await.unwrap().body, b"hello");
        let url = serve(b"HTTP/1.0 404 Not Found\r\n\r\ngone").await;
        let response = fetch(url, 100).await.unwrap();
        assert_eq!(
            (response.status, response.body.as_slice()),
            (404, &b"gone"[..])
        );
        let url = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").await;
        assert!(fetch(url, 4).await.unwrap_err().contains("larger than 4"));
    }
}

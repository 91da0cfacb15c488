//! `posthorn loadtest` (README.md, docs/BENCHMARKS.md): drives a server under test — posthorn, or nchan as the peer it
//! is compared with — over real sockets and reports what it measured: a human summary, one JSON
//! line, optionally an SVG plot.
//!
//! Every scenario is bounded in connections, events and time (`--time-limit`), targets loopback
//! addresses unless `--allow-remote`, and spreads its client sockets over several 127.0.0.x
//! source addresses so that more than one address's ephemeral ports are available. Events carry
//! a send timestamp and a sequence number (see `payload`), so latency, loss, duplicates, order
//! violations and misrouting are counted exactly, and every report shows the tool's own CPU
//! share next to the server's: a saturated load tool would otherwise pass for a slow server.

mod drain;
mod fanout;
mod idle;
mod payload;
mod plan;
mod plot;
mod probe;
mod publisher;
mod resume;
mod slow;
mod storm;
mod tally;
mod tokens;
mod wire;

use std::{
    io,
    net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs},
    path::PathBuf,
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use thiserror::Error;

/// Upper bounds that keep a mistyped argument from becoming a machine-wide outage.
const MAX_CONNECTIONS: usize = 100_000;
const MAX_EVENTS: u64 = 100_000_000;
/// Clients per source address: below the ~28k ephemeral ports of one address.
const CLIENTS_PER_SOURCE: usize = 20_000;
/// Members of a group of level 1 (`--groups`); each level's groups are ten times the size of the
/// level's below.
const GROUP_SIZE: usize = 10;

/// The index of the group of `level` (1, 2, ...) that device `device` joins.
fn group_of(device: usize, level: u32) -> usize {
    device / GROUP_SIZE.pow(level)
}

fn group_name(level: u32, index: usize) -> String {
    format!("g{level}-{index}")
}

#[derive(Debug, clap::Args)]
pub struct LoadtestArgs {
    #[command(subcommand)]
    pub scenario: Scenario,
}

#[derive(Debug, clap::Subcommand)]
pub enum Scenario {
    /// N connections that do not read: memory per connection with empty, then with full queues.
    Idle(idle::IdleArgs),
    /// N clients reconnect at once with their cursors: accepted connections per second.
    Storm(storm::StormArgs),
    /// Events at a fixed rate (unicast, to groups of ten, or broadcast, size S): delivered/s,
    /// latency, loss.
    Fanout(fanout::FanoutArgs),
    /// A fraction of the clients never read: evictions, their timing, server memory, and what
    /// the healthy clients received.
    Slow(slow::SlowArgs),
    /// Drain a posthorn hub with N connections: close times, retry values, reconnect times.
    Drain(drain::DrainArgs),
    /// N clients resume at once after being away while events were published: time until all
    /// caught up, loss, peak server memory, backend reads per replayed event.
    Resume(resume::ResumeArgs),
    /// Capacity calculator (docs/capacity.md): pods, memory, CPU and network for a fleet, from
    /// the figures measured by the other scenarios. Connects to nothing.
    Plan(plan::PlanArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Peer {
    /// `GET /v1/devices/{d}/events`, `POST /v1/events`.
    Posthorn,
    /// nchan with scripts/bench/nchan.conf: `GET /sub/{d}` (device and broadcast channels),
    /// `POST /pub/{channel}`.
    Nchan,
}

/// Options every scenario takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// Base URL of the server under test (its SSE endpoint).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long, value_enum, default_value = "posthorn")]
    pub peer: Peer,
    /// Client connections.
    #[arg(long, short = 'n', default_value_t = 1000)]
    pub connections: usize,
    /// Server process ids (comma-separated; all nginx processes for nchan) whose memory and CPU
    /// are reported. Without them posthorn's /metrics is read.
    #[arg(long = "pid", value_delimiter = ',')]
    pub pids: Vec<u32>,
    /// Loopback source addresses to spread client sockets over (127.0.0.2 and up).
    #[arg(long, default_value_t = 4)]
    pub sources: u8,
    /// Connection attempts in flight while opening the connections.
    #[arg(long, default_value_t = 500)]
    pub connect_concurrency: usize,
    /// Device names are PREFIX-0 .. PREFIX-(N-1).
    #[arg(long, default_value = "lt")]
    pub device_prefix: String,
    /// posthorn with `auth.mode = "none"`: every stream joins this many groups (`?groups=`),
    /// device i the groups `g1-(i/10)`, `g2-(i/100)`, ... (groups of 10, of 100, ...).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8))]
    pub groups: u32,
    /// Hard bound on the whole run.
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    pub time_limit: Duration,
    /// Allow a target outside 127.0.0.0/8 (load tests against shared hosts are opt-in).
    #[arg(long)]
    pub allow_remote: bool,
    /// Write an SVG plot here.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Load tool threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub tokens: tokens::TokenArgs,
}

/// TLS to the server under test: an `https://` URL, or `--tls` with an `http://` one.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// Connect with TLS (as an https:// URL does). Every connection makes a full handshake: a
    /// storm lands on pods that never saw its clients, so there is no session to resume.
    #[arg(long)]
    pub tls: bool,
    /// Trust the certificate authorities in this PEM file instead of the system's.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
}

/// What a TLS connection to the server needs: the connector and the name its certificate bears.
#[derive(Clone)]
pub struct TlsClient {
    pub connector: tokio_rustls::TlsConnector,
    pub name: rustls::pki_types::ServerName<'static>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("name", &self.name)
            .finish()
    }
}

impl TlsClient {
    fn new(host: &str, args: &TlsArgs) -> Result<Self, String> {
        let name = host
            .rsplit_once(':')
            .filter(|(_, port)| port.parse::<u16>().is_ok())
            .map_or(host, |(name, _)| name)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = rustls::pki_types::ServerName::try_from(name.to_string())
            .map_err(|error| format!("{name:?} cannot be a TLS server name: {error}"))?;
        let mut config = crate::tls::client_config(args.ca_file.as_deref())
            .map_err(|error| crate::report::Report(&error).to_string())?;
        config.resumption = rustls::client::Resumption::disabled();
        Ok(Self {
            connector: tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)),
            name,
        })
    }
}

/// Where events are published (fanout, slow, idle's fill).
#[derive(Debug, Clone, clap::Args)]
pub struct PublishOptions {
    /// `http`: the server's publish API; `redis`: XADD straight into Redis Streams.
    #[arg(long, value_enum, default_value = "http")]
    pub publish_via: PublishVia,
    /// Publish API base URL when it differs from --url (nchan's slow-consumer listener).
    #[arg(long)]
    pub publish_url: Option<String>,
    /// posthorn's HTTP publish only: at most this many events per `POST /v1/events` (1: each
    /// event alone, as one object), the requests pipelined over 8 connections as nchan's are.
    /// Without it, every event that is due goes in one request (up to 1,000) on one connection.
    #[arg(long)]
    pub events_per_request: Option<usize>,
    /// Redis for --publish-via redis (standalone layout).
    #[arg(long, default_value = "127.0.0.1:6379")]
    pub redis: String,
    #[arg(long, default_value = "pos-ev")]
    pub redis_prefix: String,
    #[arg(long, default_value_t = 64)]
    pub redis_shards: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PublishVia {
    Http,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Unicast,
    Broadcast,
    /// To one group of ten (`g1-j`, with `--groups`), round robin over the groups.
    Group,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Unicast => "unicast",
            Mode::Broadcast => "broadcast",
            Mode::Group => "group",
        }
    }
}

#[derive(Debug, Error)]
pub enum LoadtestError {
    #[error("loadtest: {0}")]
    Usage(String),
    #[error("loadtest: {0}")]
    Failed(String),
}

fn failed(context: &str) -> impl Fn(io::Error) -> LoadtestError + '_ {
    move |error| LoadtestError::Failed(format!("{context}: {error}"))
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    crate::config::parse_duration(text)
        .ok_or_else(|| format!("invalid duration {text:?} (e.g. 500ms, 20s, 1m)"))
}

/// A resolved `http://host:port` or `https://host:port` target.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub addr: SocketAddr,
    /// The `Host` header.
    pub host: String,
    pub tls: Option<TlsClient>,
    /// The `Authorization` header of publishes (a hub with jwt auth).
    pub authorization: Option<std::sync::Arc<str>>,
}

impl Endpoint {
    fn parse(url: &str, allow_remote: bool, tls: &TlsArgs) -> Result<Self, LoadtestError> {
        let usage = |why: &str| LoadtestError::Usage(format!("{url:?}: {why}"));
        let (https, rest) = match url.split_once("://") {
            Some(("http", rest)) => (tls.tls, rest),
            Some(("https", rest)) => (true, rest),
            _ => return Err(usage("only http:// and https:// URLs")),
        };
        let host = rest.split('/').next().unwrap_or(rest);
        if rest.len() > host.len() + 1 {
            return Err(usage("give the base URL without a path"));
        }
        let default_port = if https { 443 } else { 80 };
        let mut endpoint =
            Self::resolve(host, default_port, allow_remote).map_err(|why| usage(&why))?;
        if https {
            endpoint.tls = Some(TlsClient::new(host, tls).map_err(|why| usage(&why))?);
        }
        Ok(endpoint)
    }

    fn resolve(host: &str, default_port: u16, allow_remote: bool) -> Result<Self, String> {
        let with_port = if host
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            host.to_string()
        } else {
            format!("{host}:{default_port}")
        };
        let addr = with_port
            .to_socket_addrs()
            .map_err(|error| format!("cannot resolve: {error}"))?
            .next()
            .ok_or("resolves to no address")?;
        if !allow_remote && !addr.ip().is_loopback() {
            return Err(format!(
                "{} is not a loopback address; pass --allow-remote to load a remote host",
                addr.ip()
            ));
        }
        Ok(Self {
            addr,
            host: host.to_string(),
            tls: None,
            authorization: None,
        })
    }
}

/// The shared setting of one run: target, devices, source addresses, server probe.
pub struct Run {
    pub peer: Peer,
    pub endpoint: Endpoint,
    /// For the other URLs of a run (publish, drain).
    pub tls: TlsArgs,
    pub devices: Vec<String>,
    sources: Vec<IpAddr>,
    pub server: probe::Server,
    pub connect_concurrency: usize,
    pub plot: Option<PathBuf>,
    /// For a hub with jwt auth: each device's token and the publisher's.
    tokens: tokens::Tokens,
    /// The groups each stream asks for (`Common::groups`).
    groups: u32,
}

impl Run {
    fn new(common: &Common) -> Result<Self, LoadtestError> {
        if common.connections == 0 || common.connections > MAX_CONNECTIONS {
            return Err(LoadtestError::Usage(format!(
                "--connections must be 1..={MAX_CONNECTIONS}"
            )));
        }
        if common.groups > 0 && common.peer != Peer::Posthorn {
            return Err(LoadtestError::Usage("--groups is posthorn's".into()));
        }
        if common.groups > 0
            && (common.tokens.token_secret.is_some() || common.tokens.token_key.is_some())
        {
            // A jwt hub takes groups from the token only and ignores `?groups=`.
            return Err(LoadtestError::Usage(
                "--groups joins with ?groups=, which a hub with tokens ignores".into(),
            ));
        }
        let endpoint = Endpoint::parse(&common.url, common.allow_remote, &common.tls)?;
        // Source addresses other than 127.0.0.1 only reach a loopback target.
        let sources = match endpoint.addr.ip() {
            IpAddr::V4(ip) if ip.is_loopback() => {
                let needed = common.connections.div_ceil(CLIENTS_PER_SOURCE);
                let count = usize::from(common.sources.max(1)).max(needed);
                if count > 250 {
                    return Err(LoadtestError::Usage("too many source addresses".into()));
                }
                (0..count)
                    .map(|i| IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + i as u8)))
                    .collect()
            }
            _ => Vec::new(),
        };
        let server = if !common.pids.is_empty() {
            probe::Server::Pids(common.pids.clone())
        } else if common.peer == Peer::Posthorn {
            probe::Server::Metrics(endpoint.clone())
        } else {
            probe::Server::Unknown
        };
        let devices: Vec<String> = (0..common.connections)
            .map(|i| format!("{}-{i}", common.device_prefix))
            .collect();
        Ok(Self {
            peer: common.peer,
            tokens: tokens::Tokens::make(&common.tokens, &devices)?,
            devices,
            endpoint,
            tls: common.tls.clone(),
            sources,
            server,
            connect_concurrency: common.connect_concurrency.max(1),
            plot: common.plot.clone(),
            groups: common.groups,
        })
    }

    fn source(&self, index: usize) -> Option<IpAddr> {
        (!self.sources.is_empty()).then(|| self.sources[index % self.sources.len()])
    }

    fn stream_path(&self, device: usize) -> String {
        match self.peer {
            Peer::Posthorn if self.groups > 0 => {
                let groups: Vec<String> = (1..=self.groups)
                    .map(|level| group_name(level, group_of(device, level)))
                    .collect();
                format!(
                    "/v1/devices/{}/events?groups={}",
                    self.devices[device],
                    groups.join(",")
                )
            }
            Peer::Posthorn => format!("/v1/devices/{}/events", self.devices[device]),
            Peer::Nchan => format!("/sub/{}", self.devices[device]),
        }
    }

    /// Opens one event stream per device index, `connect_concurrency` attempts in flight,
    /// each with its cursor when `cursors` is given. Results are in index order. Each attempt is
    /// its own task, so the tool's threads share the connecting and the response parsing.
    async fn open_streams(
        &self,
        indices: impl Iterator<Item = usize>,
        cursors: Option<&[String]>,
        receive_buffer: Option<u32>,
        concurrency: usize,
    ) -> Vec<Opened> {
        let started = Instant::now();
        let mut opened: Vec<_> = futures_util::stream::iter(indices)
            .map(|index| {
                let cursor = cursors.map(|c| c[index].clone()).filter(|c| !c.is_empty());
                let endpoint = self.endpoint.clone();
                let source = self.source(index);
                let path = self.stream_path(index);
                let authorization = self.tokens.device(index).map(str::to_owned);
                tokio::spawn(async move {
                    let result = wire::open_sse(
                        &endpoint,
                        source,
                        &path,
                        cursor.as_deref(),
                        authorization.as_deref(),
                        receive_buffer,
                    )
                    .await;
                    Opened {
                        index,
                        result,
                        after: started.elapsed(),
                    }
                })
            })
            .buffer_unordered(concurrency)
            .map(|joined| joined.expect("a connection attempt panicked"))
            .collect()
            .await;
        opened.sort_by_key(|opened| opened.index);
        opened
    }

    /// Opens all streams or fails with the first error (setup phases).
    async fn open_all(
        &self,
        receive_buffer: Option<u32>,
    ) -> Result<Vec<wire::SseStream>, LoadtestError> {
        let mut streams = Vec::with_capacity(self.devices.len());
        for opened in self
            .open_streams(
                0..self.devices.len(),
                None,
                receive_buffer,
                self.connect_concurrency,
            )
            .await
        {
            streams.push(opened.stream()?);
        }
        Ok(streams)
    }

    fn publish_route(&self, options: &PublishOptions) -> Result<publisher::Route, LoadtestError> {
        let allow_remote = !self.endpoint.addr.ip().is_loopback();
        if let Some(count) = options.events_per_request {
            if options.publish_via != PublishVia::Http || self.peer != Peer::Posthorn {
                return Err(LoadtestError::Usage(
                    "--events-per-request applies to posthorn's HTTP publish only".into(),
                ));
            }
            if !(1..=publisher::POSTHORN_MAX_BATCH).contains(&count) {
                return Err(LoadtestError::Usage(format!(
                    "--events-per-request must be 1 to {} (got {count})",
                    publisher::POSTHORN_MAX_BATCH
                )));
            }
        }
        Ok(match options.publish_via {
            PublishVia::Http => publisher::Route::Http {
                endpoint: Endpoint {
                    authorization: self.tokens.publish(),
                    ..match &options.publish_url {
                        Some(url) => Endpoint::parse(url, allow_remote, &self.tls)?,
                        None => self.endpoint.clone(),
                    }
                },
                events_per_request: options.events_per_request,
            },
            PublishVia::Redis => publisher::Route::Redis {
                endpoint: Endpoint::resolve(&options.redis, 6379, allow_remote)
                    .map_err(|why| LoadtestError::Usage(format!("--redis: {why}")))?,
                prefix: options.redis_prefix.clone(),
                shards: options.redis_shards.max(1),
            },
        })
    }

    /// Opens every stream, hands each a cursor with one broadcast, and closes them again:
    /// the clients of a storm or a resume are devices that were connected before.
    async fn take_cursors(&self, options: &PublishOptions) -> Result<Vec<String>, LoadtestError> {
        /// Longest wait for the broadcast that hands every client its cursor.
        const CURSOR_WAIT: Duration = Duration::from_secs(30);
        let mut streams = self.open_all(None).await?;
        let mut publisher = self.publisher(options).await?;
        let data = payload::Stamp {
            seq: 0,
            sent_us: payload::now_us(),
            target: payload::Target::Broadcast,
        }
        .encode(payload::MIN_SIZE);
        let broadcast = publisher::Outgoing {
            target: payload::Target::Broadcast,
            data,
        };
        publisher
            .publish(&self.devices, &[broadcast])
            .await
            .map_err(failed("publishing the cursor broadcast failed"))?;
        tokio::time::timeout(
            CURSOR_WAIT,
            futures_util::future::try_join_all(streams.iter_mut().map(|stream| async move {
                let mut buf = vec![0u8; 4096];
                let mut got = false;
                while !got {
                    if !stream.read_events(&mut buf, |_| got = true).await? {
                        return Err(io::Error::other("closed before the broadcast"));
                    }
                }
                Ok::<_, io::Error>(stream.counters.last_id.clone())
            })),
        )
        .await
        .map_err(|_| {
            LoadtestError::Failed("the cursor broadcast did not reach every client".into())
        })?
        .map_err(failed("waiting for the cursor broadcast"))
    }

    async fn publisher(
        &self,
        options: &PublishOptions,
    ) -> Result<publisher::Publisher, LoadtestError> {
        let route = self.publish_route(options)?;
        publisher::Publisher::open(self.peer, &route)
            .await
            .map_err(failed("cannot connect the publisher"))
    }
}

/// One connection attempt: its outcome and when it finished, from the start of the batch.
pub struct Opened {
    pub index: usize,
    pub result: io::Result<wire::SseStream>,
    pub after: Duration,
}

impl Opened {
    /// The stream, or an error naming the connection (setup phases fail on the first one).
    fn stream(self) -> Result<wire::SseStream, LoadtestError> {
        self.result.map_err(|error| {
            LoadtestError::Failed(format!("connection {} failed to open: {error}", self.index))
        })
    }
}

/// Prints the machine-readable result: one JSON line.
fn emit(report: serde_json::Value) {
    println!("{report}");
}

/// Bytes per connection from two memory samples.
fn per_connection(
    before: Option<probe::Memory>,
    after: Option<probe::Memory>,
    n: usize,
) -> Option<f64> {
    let (before, after) = (before?, after?);
    // With several processes sharing pages (nginx), PSS splits them fairly; for one process
    // the two agree.
    Some(after.pss_kib.saturating_sub(before.pss_kib) as f64 * 1024.0 / n as f64)
}

pub fn run(args: LoadtestArgs) -> Result<(), LoadtestError> {
    let common = match &args.scenario {
        Scenario::Plan(a) => return plan::run(a),
        Scenario::Idle(a) => &a.common,
        Scenario::Storm(a) => &a.common,
        Scenario::Fanout(a) => &a.common,
        Scenario::Slow(a) => &a.common,
        Scenario::Drain(a) => &a.common,
        Scenario::Resume(a) => &a.common,
    };
    let (time_limit, threads) = (common.time_limit, common.threads);
    let run = Run::new(common)?;
    let publish = match &args.scenario {
        Scenario::Idle(a) => Some(&a.publish),
        Scenario::Storm(a) => Some(&a.publish),
        Scenario::Fanout(a) => Some(&a.publish),
        Scenario::Slow(a) => Some(&a.publish),
        Scenario::Resume(a) => Some(&a.publish),
        Scenario::Drain(_) | Scenario::Plan(_) => None,
    };
    // Checked before any connection opens: a bad option is a usage error, not a failed run.
    if let Some(options) = publish {
        run.publish_route(options)?;
    }
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if (limit as usize) < run.devices.len() + 64 => {
            return Err(LoadtestError::Usage(format!(
                "open files limit {limit} is below --connections; raise `ulimit -n`"
            )))
        }
        Ok(_) => {}
        Err(error) => log::warn!("cannot raise the open files limit: {error}"),
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .map_err(|error| LoadtestError::Failed(format!("cannot start the runtime: {error}")))?;
    runtime.block_on(async move {
        let work = async {
            match &args.scenario {
                Scenario::Idle(a) => idle::run(&run, a).await,
                Scenario::Storm(a) => storm::run(&run, a).await,
                Scenario::Fanout(a) => fanout::run(&run, a).await,
                Scenario::Slow(a) => slow::run(&run, a).await,
                Scenario::Drain(a) => drain::run(&run, a).await,
                Scenario::Resume(a) => resume::run(&run, a).await,
                Scenario::Plan(_) => unreachable!("a plan connects to nothing and returned above"),
            }
        };
        match tokio::time::timeout(time_limit, work).await {
            Ok(result) => result,
            Err(_) => Err(LoadtestError::Failed(format!(
                "loadtest: stopped at --time-limit {time_limit:?}"
            ))),
        }
    })?;
    // Thousands of sockets are closed by the runtime's drop; do not wait for it.
    runtime.shutdown_background();
    Ok(())
}

fn check_events(total: u64) -> Result<(), LoadtestError> {
    if total > MAX_EVENTS {
        return Err(LoadtestError::Usage(format!(
            "the run would publish {total} events; the bound is {MAX_EVENTS}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str, allow_remote: bool) -> Result<Endpoint, LoadtestError> {
        Endpoint::parse(url, allow_remote, &TlsArgs::default())
    }

    #[test]
    fn remote_targets_need_the_flag() {
        assert!(parse("http://127.0.0.1:8080", false).is_ok());
        assert!(parse("http://127.0.0.9:80", false).is_ok());
        let error = parse("http://10.1.2.3:8080", false).unwrap_err();
        assert!(error.to_string().contains("--allow-remote"), "{error}");
        assert!(parse("http://10.1.2.3:8080", true).is_ok());
        assert!(parse("ftp://127.0.0.1", false).is_err());
        assert!(parse("http://127.0.0.1:8080/x", false).is_err());
        assert_eq!(parse("http://127.0.0.1", false).unwrap().addr.port(), 80);
    }

    /// https:// (or --tls) targets connect with TLS to the name of the URL, port 443 by default.
    #[test]
    fn tls_targets() {
        let plain = parse("http://127.0.0.1:8080", false).unwrap();
        assert!(plain.tls.is_none());
        let https = parse("https://127.0.0.1", false).unwrap();
        assert_eq!(https.addr.port(), 443);
        assert_eq!(https.tls.unwrap().name.to_str(), "127.0.0.1");
        let forced = Endpoint::parse(
            "http://localhost:8443",
            false,
            &TlsArgs {
                tls: true,
                ca_file: None,
            },
        )
        .unwrap();
        assert_eq!(forced.tls.unwrap().name.to_str(), "localhost");
    }

    fn run(args: &[&str]) -> Result<Run, LoadtestError> {
        #[derive(clap::Parser)]
        struct Options {
            #[command(flatten)]
            common: Common,
        }
        let options = <Options as clap::Parser>::try_parse_from(
            std::iter::once("loadtest").chain(args.iter().copied()),
        )
        .unwrap();
        Run::new(&options.common)
    }

    /// `--groups K` puts device i in groups of 10, of 100, ...; posthorn's only.
    #[test]
    fn streams_join_their_groups() {
        let path = |args: &[&str], device| run(args).unwrap().stream_path(device);
        assert_eq!(path(&["-n", "300"], 251), "/v1/devices/lt-251/events");
        assert_eq!(
            path(&["-n", "300", "--groups", "2"], 251),
            "/v1/devices/lt-251/events?groups=g1-25,g2-2"
        );
        assert_eq!(
            path(&["-n", "300", "--groups", "1"], 9),
            "/v1/devices/lt-9/events?groups=g1-0"
        );
        let refused = run(&["--peer", "nchan", "--groups", "1"]).err().unwrap();
        assert!(refused.to_string().contains("--groups"), "{refused}");
        let refused = run(&["--groups", "1", "--token-secret", "s"])
            .err()
            .unwrap();
        assert!(refused.to_string().contains("ignores"), "{refused}");
    }

    fn fanout(args: &str) -> Result<(Run, fanout::Plan), LoadtestError> {
        #[derive(clap::Parser)]
        struct Options {
            #[command(flatten)]
            fanout: fanout::FanoutArgs,
        }
        let options = <Options as clap::Parser>::try_parse_from(
            std::iter::once("fanout").chain(args.split_whitespace()),
        )
        .unwrap();
        let run = Run::new(&options.fanout.common)?;
        let plan = options.fanout.plan(&run)?;
        Ok((run, plan))
    }

    /// Group events go round robin over the groups of ten; each reaches exactly the devices
    /// whose streams joined that group, the last group being short when N is not a multiple
    /// of ten.
    #[test]
    fn group_events_go_to_the_members_of_one_group() {
        let (run, plan) = fanout("-n 25 --groups 2 --mode group --rate 10 --duration 1s").unwrap();
        assert_eq!((plan.total, plan.groups), (10, 3));
        for index in 0..plan.total {
            let event = plan.event(index, 7);
            let stamp = payload::Stamp::parse(event.data.as_bytes()).unwrap();
            assert_eq!(
                event.target,
                payload::Target::Group(index % 3),
                "event {index}"
            );
            assert_eq!(stamp.target, event.target);
            assert_eq!(
                stamp.seq,
                index / 3,
                "per group, so each member sees 0, 1, 2, ..."
            );
            let name = format!("g1-{}", index % 3);
            let joined: Vec<u64> = (0..25)
                .filter(|&device| {
                    let path = run.stream_path(device);
                    let groups = path.split_once("?groups=").unwrap().1;
                    groups.split(',').any(|group| group == name)
                })
                .map(|device| device as u64)
                .collect();
            let members: Vec<u64> = plan.members(index % 3).collect();
            assert_eq!(joined, members, "{name}");
            for &device in &members {
                assert_eq!(plan.group(device), Some(index % 3));
            }
        }
        // Group 0 has events 0, 3, 6, 9; groups 1 and 2 three each; group 2 has 5 members.
        assert_eq!(plan.expected(0), 4);
        assert_eq!(plan.expected(19), 3);
        assert_eq!(plan.expected(24), 3);
        assert_eq!(plan.members(2), 20..25);
        assert_eq!(plan.deliveries(), 4 * 10 + 3 * 10 + 3 * 5);
        let expected: u64 = (0..25).map(|device| plan.expected(device)).sum();
        assert_eq!(expected, plan.deliveries());
    }

    /// `--mode group` publishes to the groups `--groups` joins: without it, or to nchan, it is a
    /// usage error before anything connects.
    #[test]
    fn group_mode_needs_groups() {
        let refused = fanout("--mode group").err().unwrap();
        assert!(matches!(refused, LoadtestError::Usage(_)), "{refused}");
        assert!(refused.to_string().contains("--groups"), "{refused}");
        let refused = fanout("--mode group --peer nchan").err().unwrap();
        assert!(matches!(refused, LoadtestError::Usage(_)), "{refused}");
        assert!(refused.to_string().contains("nchan"), "{refused}");
        assert!(fanout("--mode group --groups 1").is_ok());
        let (_, plan) = fanout("--mode unicast --groups 1").unwrap();
        assert_eq!(plan.deliveries(), plan.total);
        assert!(fanout("--mode broadcast").is_ok());
    }
}

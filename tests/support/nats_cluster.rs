//! A JetStream cluster of real `nats-server` processes for the fault-injection tests: every
//! node has its own store directory and client, route and monitoring ports on loopback, and
//! routes to every other node, so a test can kill a node (SIGKILL) or stop it (SIGTERM) while
//! replicated streams keep serving, and bring it back on the same port with the same store.
//!
//! Each node is a [`NatsServer`] started with `nats-server -c DIR/nats.conf` (flags cannot name
//! the server or list routes on 2.9); the cluster is ready once JetStream answers on every node
//! and a throwaway stream replicated to every node can be created, i.e. the meta leader knows
//! them all. Dropping the cluster SIGKILLs and reaps every node, prints their log tails if the
//! test is panicking, and removes their directories (kept with `POSTHORN_TEST_KEEP_LOGS` set).
//!
//! Clients: async-nats 0.46 parses a string as exactly one server URL, so the comma-separated
//! [`NatsCluster::urls`] (the form of the `nats` CLI and of most configs) fails to parse there;
//! give it [`NatsCluster::server_urls`] (a `Vec<String>`) instead. A client given one URL still
//! learns the other nodes from the server's `connect_urls` when it connects and fails over to
//! them.
//!
//! Like [`NatsServer::start`], [`NatsCluster::start`] panics when `nats-server` is not
//! installed.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use tokio::time::Instant;

use super::nats::{self, NatsServer};
use super::{free_port, http};

const CLUSTER_NAME: &str = "posthorn";
/// Routes are retried every second and the meta group then elects a leader, within a few
/// seconds on loopback; this only guards against a wedged cluster.
const FORM_TIMEOUT: Duration = Duration::from_secs(30);
/// A restarted node catches up with the meta group and its streams; as for forming.
const REJOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// A replicated stream elects a leader and its replicas catch up; an election after its
/// leader died takes a few seconds.
const STREAM_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(100);
/// Each readiness request must be short so the polling loops notice progress.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Attempts per node when a port from [`free_port`] was taken before the node bound it.
const PORT_ATTEMPTS: usize = 3;
/// Created and deleted while forming: only succeeds once every node is a JetStream peer.
const PROBE_STREAM: &str = "POSTHORN_HARNESS_PROBE";
/// NATS replicates a stream to at most five servers.
const MAX_REPLICAS: usize = 5;

#[derive(Debug, Clone, Copy)]
struct NodePorts {
    client: u16,
    route: u16,
    monitor: u16,
}

/// A running JetStream cluster of `nats-server` nodes `n0`, `n1`, ... (their `server_name`,
/// which stream and meta cluster info report). Nodes keep their index, ports and store across
/// kills and restarts.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
    ports: Vec<NodePorts>,
}

impl NatsCluster {
    /// Starts `nodes` clustered `nats-server -js` processes routed to each other and waits
    /// until JetStream is usable cluster-wide. Panics when `nats-server` is not installed, and
    /// (with every node's log) if a node exits or the cluster does not form within 30 s.
    pub async fn start(nodes: usize) -> NatsCluster {
        assert!(
            nodes >= 2,
            "a cluster needs at least two nodes; use NatsServer for one"
        );
        let binary = nats::binary();
        let mut used = HashSet::new();
        let ports: Vec<NodePorts> = (0..nodes).map(|_| fresh_ports(&mut used)).collect();
        let nodes: Vec<NatsServer> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| NatsServer::configured(binary.clone(), &format!("nats-n{i}"), p.client))
            .collect();
        let mut cluster = NatsCluster { nodes, ports };
        cluster.write_configs();
        for node in &mut cluster.nodes {
            node.spawn(true);
        }
        let mut attempts = vec![1; cluster.node_count()];
        let deadline = Instant::now() + FORM_TIMEOUT;
        loop {
            for (i, attempts) in attempts.iter_mut().enumerate() {
                let Some(status) = cluster.nodes[i].exited() else {
                    continue;
                };
                if cluster.nodes[i].log().contains("address already in use")
                    && *attempts < PORT_ATTEMPTS
                {
                    // The others keep retrying the old route port in vain, which is harmless:
                    // this node's routes reach them, and the cluster gossips the rest.
                    *attempts += 1;
                    cluster.ports[i] = fresh_ports(&mut used);
                    cluster.nodes[i].set_port(cluster.ports[i].client);
                    cluster.write_configs();
                    cluster.nodes[i].spawn(true);
                    continue;
                }
                // Drop prints every node's log tail while this panic unwinds.
                panic!(
                    "nats-server {} exited while the cluster formed ({status})",
                    server_name(i)
                );
            }
            let why = match cluster.formed().await {
                Ok(()) => return cluster,
                Err(why) => why,
            };
            if Instant::now() >= deadline {
                panic!("NATS cluster not formed after {FORM_TIMEOUT:?}: {why}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Number of nodes, running or not.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// One node, for its log, directory and process state.
    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    /// The `server_name` of node `i` (`n0`, `n1`, ...), as stream and meta cluster info show
    /// it.
    pub fn server_name(&self, i: usize) -> String {
        assert!(i < self.node_count(), "no node {i}");
        server_name(i)
    }

    /// The index of the node named `name` (see [`NatsCluster::server_name`]).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        (0..self.node_count()).find(|&i| server_name(i) == name)
    }

    /// Client address of node `i`.
    pub fn addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.ports[i].client))
    }

    /// HTTP monitoring address of node `i` (`/varz`, `/routez`, `/jsz`, `/healthz`).
    pub fn monitor_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.ports[i].monitor))
    }

    /// `nats://127.0.0.1:PORT` of node `i`, the form the hub's `nats.url` takes.
    pub fn url(&self, i: usize) -> String {
        format!("nats://{}", self.addr(i))
    }

    /// Every node's URL joined by commas (`nats://127.0.0.1:P1,nats://127.0.0.1:P2,...`), the
    /// form the `nats` CLI and many client configs take. async-nats 0.46 does not split it (it
    /// fails with "invalid port number"): pass [`NatsCluster::server_urls`] to it.
    pub fn urls(&self) -> String {
        self.server_urls().join(",")
    }

    /// Every node's URL, the form `async_nats::connect` and `ConnectOptions::connect` take for
    /// several servers.
    pub fn server_urls(&self) -> Vec<String> {
        (0..self.node_count()).map(|i| self.url(i)).collect()
    }

    /// A client given every node, connected to one that runs; it reconnects to another when
    /// that one dies.
    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.server_urls())
            .await
            .unwrap_or_else(|e| panic!("connect to the nats cluster {}: {e}", self.urls()))
    }

    /// A JetStream context (default 5 s request timeout) on a new [`NatsCluster::client`].
    pub async fn jetstream(&self) -> jetstream::Context {
        jetstream::new(self.client().await)
    }

    /// SIGKILL and reap node `i` (no-op while stopped): its store keeps what it had synced.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// SIGTERM node `i` and wait for its exit (SIGKILL after 10 s).
    pub async fn stop(&mut self, i: usize) {
        self.nodes[i].stop().await;
    }

    /// Starts node `i` again on its ports with its store (stopping it gracefully first if it
    /// runs) and returns once it is back in the cluster: routed to every running node,
    /// JetStream answering through it and its `/healthz` ok, which on 2.9.10 also means every
    /// stream replica it holds caught up (after a 60 MB backlog too). The stream leaders may
    /// take a moment longer to see it current: see [`NatsCluster::wait_stream_current`].
    /// Panics if it exits (e.g. its port was taken meanwhile) or is not back within 30 s.
    pub async fn restart(&mut self, i: usize) {
        if self.nodes[i].is_running() {
            self.nodes[i].stop().await;
        }
        self.nodes[i].spawn(false);
        let deadline = Instant::now() + REJOIN_TIMEOUT;
        loop {
            if let Some(status) = self.nodes[i].exited() {
                panic!(
                    "nats-server {} exited after its restart on port {} ({status})",
                    server_name(i),
                    self.ports[i].client
                );
            }
            let running = self.nodes.iter().filter(|n| n.is_running()).count();
            let mut why = self.node_ready(i, running - 1).await;
            if why.is_ok() {
                why = self.healthz(i).await;
            }
            let Err(why) = why else {
                return;
            };
            if Instant::now() >= deadline {
                panic!(
                    "nats-server {} not back in the cluster after {REJOIN_TIMEOUT:?}: {why}",
                    server_name(i)
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Creates a stream with `config` replicated to every node (R3 on three nodes; NATS
    /// allows at most five) through [`NatsCluster::jetstream`], and returns it once its leader
    /// is elected and every replica is current. The hub adopts such a stream when it exists
    /// (it creates R1 streams itself).
    pub async fn create_replicated_stream(&self, config: stream::Config) -> stream::Stream {
        let replicas = self.node_count().min(MAX_REPLICAS);
        let name = config.name.clone();
        let config = stream::Config {
            num_replicas: replicas,
            ..config
        };
        let stream = self
            .jetstream()
            .await
            .create_stream(config)
            .await
            .unwrap_or_else(|e| panic!("create stream {name} with {replicas} replicas: {e}"));
        self.wait_stream_current(&name).await;
        stream
    }

    /// Waits until stream `name` has a leader and as many current, online replicas as it is
    /// configured for (per its leader); returns that info. Panics with the last info after
    /// 30 s.
    pub async fn wait_stream_current(&self, name: &str) -> stream::Info {
        let js = jetstream::ContextBuilder::new()
            .timeout(PROBE_TIMEOUT)
            .build(self.client().await);
        let deadline = Instant::now() + STREAM_TIMEOUT;
        loop {
            let last = match js.get_stream(name).await {
                Ok(stream) => match stream.get_info().await {
                    Ok(info) if stream_is_current(&info) => return info,
                    Ok(info) => format!("{:?}", info.cluster),
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                panic!("stream {name} not current after {STREAM_TIMEOUT:?}: {last}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The index of the node that leads stream `name`, once it has a leader (within 30 s).
    pub async fn stream_leader(&self, name: &str) -> usize {
        let js = jetstream::ContextBuilder::new()
            .timeout(PROBE_TIMEOUT)
            .build(self.client().await);
        let deadline = Instant::now() + STREAM_TIMEOUT;
        loop {
            let last = match js.get_stream(name).await {
                Ok(stream) => match stream.get_info().await {
                    Ok(info) => {
                        let leader = info.cluster.as_ref().and_then(|c| c.leader.as_deref());
                        if let Some(i) = leader.and_then(|l| self.index_of(l)) {
                            return i;
                        }
                        format!("{:?}", info.cluster)
                    }
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                panic!("stream {name} has no leader after {STREAM_TIMEOUT:?}: {last}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn write_configs(&self) {
        for (i, node) in self.nodes.iter().enumerate() {
            let ports = self.ports[i];
            let routes: String = (0..self.node_count())
                .filter(|&j| j != i)
                .map(|j| format!("    \"nats-route://127.0.0.1:{}\"\n", self.ports[j].route))
                .collect();
            let store = node.dir().join("store").display().to_string();
            let conf = format!(
                "server_name: \"{name}\"\n\
                 listen: \"127.0.0.1:{client}\"\n\
                 http: \"127.0.0.1:{monitor}\"\n\
                 jetstream {{\n  store_dir: {store:?}\n}}\n\
                 cluster {{\n  name: \"{CLUSTER_NAME}\"\n  listen: \"127.0.0.1:{route}\"\n  \
                 routes: [\n{routes}  ]\n}}\n",
                name = server_name(i),
                client = ports.client,
                monitor = ports.monitor,
                route = ports.route,
            );
            let path = node
                .config_path()
                .expect("cluster nodes run from a config file");
            std::fs::write(path, conf).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        }
    }

    /// `Err` says what is missing: a node without JetStream or routes, or no replicated stream
    /// yet.
    async fn formed(&self) -> Result<(), String> {
        for i in 0..self.node_count() {
            self.node_ready(i, self.node_count() - 1).await?;
        }
        let replicas = self.node_count().min(MAX_REPLICAS);
        let attempt = async {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(PROBE_TIMEOUT)
                .connect(self.server_urls())
                .await
                .map_err(|e| e.to_string())?;
            let js = jetstream::ContextBuilder::new()
                .timeout(PROBE_TIMEOUT)
                .build(client);
            js.create_stream(stream::Config {
                name: PROBE_STREAM.into(),
                subjects: vec!["posthorn.harness.probe".into()],
                num_replicas: replicas,
                storage: stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("create an R{replicas} stream: {e}"))?;
            js.delete_stream(PROBE_STREAM)
                .await
                .map_err(|e| format!("delete the R{replicas} stream: {e}"))?;
            Ok(())
        };
        tokio::time::timeout(PROBE_TIMEOUT * 3, attempt)
            .await
            .unwrap_or_else(|_| Err("replicated stream probe timed out".into()))
    }

    /// `Ok` once node `i` answers a JetStream request and has at least `routes` routes.
    async fn node_ready(&self, i: usize, routes: usize) -> Result<(), String> {
        let name = server_name(i);
        nats::probe(self.addr(i))
            .await
            .map_err(|e| format!("{name}: {e}"))?;
        let response = http::try_request(
            self.monitor_addr(i),
            "GET",
            "/routez",
            &[],
            None,
            PROBE_TIMEOUT,
        )
        .await
        .map_err(|e| format!("{name} /routez: {e}"))?;
        let have = response.json()["num_routes"].as_u64().unwrap_or_default();
        if have < routes as u64 {
            return Err(format!("{name} has {have} of {routes} routes"));
        }
        Ok(())
    }

    /// `Ok` once node `i`'s `/healthz` says ok: on 2.9.10, in contact with the meta leader,
    /// current with it, and every stream (and consumer) replica it holds current.
    async fn healthz(&self, i: usize) -> Result<(), String> {
        let response = http::try_request(
            self.monitor_addr(i),
            "GET",
            "/healthz",
            &[],
            None,
            PROBE_TIMEOUT,
        )
        .await
        .map_err(|e| format!("{} /healthz: {e}", server_name(i)))?;
        if response.status != 200 {
            return Err(format!(
                "{} /healthz: {} {}",
                server_name(i),
                response.status,
                response.text()
            ));
        }
        Ok(())
    }
}

fn server_name(i: usize) -> String {
    format!("n{i}")
}

/// Three free ports none of this cluster's nodes uses (a port just released by one
/// [`free_port`] may come back from the next).
fn fresh_ports(used: &mut HashSet<u16>) -> NodePorts {
    let mut next = || loop {
        let port = free_port();
        if used.insert(port) {
            return port;
        }
    };
    NodePorts {
        client: next(),
        route: next(),
        monitor: next(),
    }
}

/// A leader, and every other configured replica current and online.
fn stream_is_current(info: &stream::Info) -> bool {
    let Some(cluster) = &info.cluster else {
        return false;
    };
    cluster.leader.is_some()
        && cluster.replicas.len() + 1 == info.config.num_replicas.max(1)
        && cluster.replicas.iter().all(|p| p.current && !p.offline)
}

//! One chaos run: start the system, connect the devices, publish, inject faults from the
//! seeded schedule (on a standalone Redis that can be rolled back, with a snapshot in the
//! middle of every pause), stop the faults, stop publishing, let every device catch up (it reads
//! steadily from then on; the quiet period ends early once nothing is awaited), stop everything
//! and check the history.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::seq::SliceRandom;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::checker::{self, Report};
use super::device::{self, Behaviour, Board, DeviceSpec, Endpoints, Presence};
use super::faults::{self, BackendKind, External, FaultKind, System};
use super::history::{Clock, DeviceHistory, FaultRecord, History, Observation};
use super::producer::{self, Ctx};

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    pub backend: BackendKind,
    pub seed: u64,
    /// How long faults are injected.
    pub chaos: Duration,
    /// Stop injecting after this many faults (and `settle` later), even before `chaos` ends.
    pub max_faults: Option<usize>,
    /// Time between the last fault of `max_faults` and the end of publishing.
    pub settle: Duration,
    pub hubs: usize,
    pub devices: usize,
    /// Devices whose unicasts come from an external producer (XADD / JetStream publish).
    pub external: usize,
    /// Pause before each fault.
    pub pause: (Duration, Duration),
    /// How long a drain waits for a hub where a slow reader has just resumed.
    pub drain_wait: Duration,
    pub kinds: Vec<FaultKind>,
    /// Longest quiet period after publishing stopped.
    pub quiet_max: Duration,
    /// Unicasts per second per device (slow readers: `slow_rate`), broadcasts per second.
    pub rate: f64,
    pub slow_rate: f64,
    pub broadcast_rate: f64,
    /// Events per second per group ([`memberships`]).
    pub group_rate: f64,
}

impl Plan {
    pub fn new(backend: BackendKind, seed: u64, chaos: Duration) -> Plan {
        Plan {
            backend,
            seed,
            chaos,
            max_faults: None,
            settle: Duration::from_secs(2),
            hubs: 3,
            devices: 16,
            external: 2,
            pause: (Duration::from_millis(2500), Duration::from_millis(4500)),
            drain_wait: Duration::from_secs(10),
            kinds: FaultKind::applicable(backend),
            quiet_max: Duration::from_secs(10),
            rate: 3.0,
            slow_rate: 12.0,
            broadcast_rate: 3.0,
            group_rate: 0.5,
        }
    }
}

impl Plan {
    /// A segment of a long run: [`FaultKind::long_deck`], shorter pauses and drain waits (more
    /// faults per minute).
    pub fn long(backend: BackendKind, seed: u64, chaos: Duration) -> Plan {
        Plan {
            kinds: FaultKind::long_deck(backend),
            pause: (Duration::from_millis(1500), Duration::from_millis(3000)),
            drain_wait: Duration::from_secs(5),
            ..Plan::new(backend, seed, chaos)
        }
    }
}

/// A finished run.
pub struct RunResult {
    pub history: History,
    pub report: Report,
    /// What devices were still waiting for when the quiet period ended.
    pub lagging: Vec<String>,
    /// Warnings and errors from the hubs' logs.
    pub hub_warnings: String,
    pub elapsed: Duration,
}

/// The arguments of one [`producer::http_unicasts`] but its groups.
struct HttpProducer {
    devices: Vec<String>,
    seed: u64,
    rate: f64,
    pad: (usize, usize),
}

/// Padding sizes of events (slow readers get bigger ones, to fill their buffers).
const PAD: (usize, usize) = (0, 300);
const SLOW_PAD: (usize, usize) = (600, 1500);

fn snapshot(
    seed: u64,
    backend: BackendKind,
    attempts: &Mutex<Vec<super::history::Attempt>>,
    devices: &[Arc<Mutex<DeviceHistory>>],
) -> History {
    History {
        seed,
        backend: backend.label().into(),
        attempts: attempts.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        devices: devices
            .iter()
            .map(|d| d.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .collect(),
        ..History::default()
    }
}

async fn join_all(handles: Vec<JoinHandle<()>>, within: Duration) {
    let deadline = Instant::now() + within;
    for handle in handles {
        let abort = handle.abort_handle();
        if tokio::time::timeout_at(deadline, handle).await.is_err() {
            abort.abort();
        }
    }
}

/// Stores and regions: every device is in the store of its index modulo [`STORES`] and about
/// half of them in one of [`REGIONS`] regions as well, so that every group has members on
/// several shards and non-members beside them on the same shards.
const STORES: usize = 4;
const REGIONS: usize = 2;

/// Each device's groups, fixed for the run, and every group (stores first).
fn memberships(rng: &mut StdRng, n: usize) -> (Vec<Vec<String>>, Vec<String>) {
    let per_device = (0..n)
        .map(|i| {
            let mut groups = vec![format!("store-{}", i % STORES)];
            if rng.random_bool(0.5) {
                groups.push(format!("region-{}", rng.random_range(0..REGIONS)));
            }
            groups
        })
        .collect();
    let all = (0..STORES)
        .map(|s| format!("store-{s}"))
        .chain((0..REGIONS).map(|r| format!("region-{r}")))
        .collect();
    (per_device, all)
}

/// `n` device names from `pos-0`, `pos-1`, ..., taken round by round: in each round of
/// `SHARDS` names every shard gets one.
fn balanced_names(n: usize) -> Vec<String> {
    let shards = faults::SHARDS as usize;
    let mut per_shard = vec![0usize; shards];
    let mut names = Vec::with_capacity(n);
    let mut candidate = 0;
    while names.len() < n {
        let name = format!("pos-{candidate}");
        candidate += 1;
        let shard = faults::shard_of(&name) as usize;
        if per_shard[shard] == names.len() / shards {
            per_shard[shard] += 1;
            names.push(name);
        }
    }
    names
}

pub async fn run(plan: &Plan) -> RunResult {
    let began = Instant::now();
    let clock = Clock::start();
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let mut system = System::start(plan.backend, plan.hubs).await;
    let endpoints: Arc<Endpoints> = Arc::new(system.endpoints());
    eprintln!(
        "chaos: {} system up in {:?} (hubs {:?}, nginx {})",
        plan.backend.label(),
        began.elapsed(),
        endpoints.hubs,
        endpoints.nginx
    );

    // Devices and their behaviours: spread evenly over the shards, and each shard with a device
    // that is often away (flappy, slow) and one that mostly stays (steady, takeover).
    let n = plan.devices;
    let names = balanced_names(n);
    let behaviours: Vec<Behaviour> = (0..n)
        .map(|i| {
            let coin = rng.random_bool(0.5);
            match ((i / faults::SHARDS as usize).is_multiple_of(2), coin) {
                (true, true) => Behaviour::Flappy,
                (true, false) => Behaviour::Slow,
                (false, true) => Behaviour::Steady,
                (false, false) => Behaviour::Takeover,
            }
        })
        .collect();
    let (groups, all_groups) = memberships(&mut rng, n);
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rng);
    let external: Vec<usize> = order[..plan.external.min(n)].to_vec();
    let producer_of = |i: usize| -> &'static str {
        if external.contains(&i) {
            if plan.backend.is_redis() {
                "xadd"
            } else {
                "js-publish"
            }
        } else {
            "http"
        }
    };
    let histories: Vec<Arc<Mutex<DeviceHistory>>> = (0..n)
        .map(|i| {
            Arc::new(Mutex::new(DeviceHistory {
                device: names[i].clone(),
                shard: faults::shard_of(&names[i]),
                groups: groups[i].clone(),
                behaviour: format!("{}, {}", behaviours[i].label(), producer_of(i)),
                observations: Vec::new(),
            }))
        })
        .collect();
    let board: Board = Arc::new(Mutex::new(
        names
            .iter()
            .map(|d| Presence {
                shard: faults::shard_of(d),
                hub: None,
                opened: None,
                resumed: false,
                connected: false,
                reading: false,
                sluggish_until: None,
            })
            .collect(),
    ));
    let (device_stop, device_stop_rx) = watch::channel(false);
    let (device_calm, device_calm_rx) = watch::channel(false);
    let mut device_tasks = Vec::new();
    for i in 0..n {
        let spec = DeviceSpec {
            index: i,
            device: names[i].clone(),
            behaviour: behaviours[i],
            groups: groups[i].clone(),
            seed: rng.random(),
        };
        device_tasks.push(tokio::spawn(device::run(
            spec,
            board.clone(),
            endpoints.clone(),
            clock,
            histories[i].clone(),
            device_calm_rx.clone(),
            device_stop_rx.clone(),
        )));
    }
    // Publishing starts once every device holds a stream: a first connection has no cursor.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let connected = histories
            .iter()
            .filter(|h| {
                h.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .observations
                    .iter()
                    .any(|o| {
                        matches!(
                            o.what,
                            Observation::Connected {
                                status: Some(200),
                                ..
                            }
                        )
                    })
            })
            .count();
        if connected == n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {connected} of {n} devices connected within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Producers.
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let (publish_stop, publish_stop_rx) = watch::channel(false);
    let ctx = Ctx {
        clock,
        attempts: attempts.clone(),
        stop: publish_stop_rx,
        endpoints: endpoints.clone(),
    };
    let mut producer_tasks = Vec::new();
    // Started once each knows the groups it owns.
    let mut http: Vec<HttpProducer> = Vec::new();
    let mut http_pairs: Vec<String> = Vec::new();
    for &i in &order {
        let name = names[i].clone();
        let slow = behaviours[i] == Behaviour::Slow;
        let (rate, pad) = if slow {
            (plan.slow_rate, SLOW_PAD)
        } else {
            (plan.rate, PAD)
        };
        let seed = rng.random();
        if external.contains(&i) {
            let shard = faults::shard_of(&name);
            let task = match system.external() {
                External::Redis(nodes) => tokio::spawn(producer::redis_external(
                    ctx.clone(),
                    nodes,
                    faults::stream_key(plan.backend, shard),
                    name,
                    shard,
                    seed,
                    rate,
                    pad,
                )),
                External::Nats(urls) => {
                    let client = async_nats::connect(urls)
                        .await
                        .expect("connect the external NATS producer");
                    tokio::spawn(producer::nats_external(
                        ctx.clone(),
                        client,
                        name,
                        shard,
                        seed,
                        rate,
                        pad,
                    ))
                }
            };
            producer_tasks.push(task);
        } else if slow {
            http.push(HttpProducer {
                devices: vec![name],
                seed,
                rate,
                pad,
            });
        } else {
            http_pairs.push(name);
            if http_pairs.len() == 2 {
                http.push(HttpProducer {
                    devices: std::mem::take(&mut http_pairs),
                    seed,
                    rate,
                    pad,
                });
            }
        }
    }
    if !http_pairs.is_empty() {
        http.push(HttpProducer {
            devices: http_pairs,
            seed: rng.random(),
            rate: plan.rate,
            pad: PAD,
        });
    }
    // One owner per group keeps its series sequential; spread, so that group events ride in
    // batches of several producers.
    let mut owned: Vec<Vec<String>> = vec![Vec::new(); http.len()];
    for (g, group) in all_groups.into_iter().enumerate() {
        if !http.is_empty() {
            owned[g % http.len()].push(group);
        }
    }
    for (p, groups) in http.into_iter().zip(owned) {
        producer_tasks.push(tokio::spawn(producer::http_unicasts(
            ctx.clone(),
            p.devices,
            p.seed,
            p.rate,
            p.pad,
            groups,
            plan.group_rate,
        )));
    }
    producer_tasks.push(tokio::spawn(producer::broadcasts(
        ctx.clone(),
        rng.random(),
        plan.broadcast_rate,
        (0, 200),
    )));

    // Faults.
    let mut device_shards: Vec<u32> = names.iter().map(|d| faults::shard_of(d)).collect();
    device_shards.sort_unstable();
    device_shards.dedup();
    let mut chaos_end = Instant::now() + plan.chaos;
    let schedule = faults::schedule(&mut rng, &plan.kinds, 10_000, plan.pause);
    let snapshots = plan.kinds.contains(&FaultKind::RedisRollback);
    let mut records = Vec::new();
    for fault in &schedule {
        if Instant::now() + fault.pause >= chaos_end {
            break;
        }
        if snapshots {
            // Halfway through the pause: every rollback then loses the writes of at least half
            // a pause.
            tokio::time::sleep(fault.pause / 2).await;
            if let Some(what) = system.take_snapshot(&clock).await {
                eprintln!("chaos: {} {what}", plan.backend.label());
            }
            tokio::time::sleep(fault.pause - fault.pause / 2).await;
        } else {
            tokio::time::sleep(fault.pause).await;
        }
        let aim = system
            .aim(fault, &device_shards, &board, plan.drain_wait)
            .await;
        let started = clock.now();
        let detail = system.inject(fault, &aim, &clock).await;
        let finished = clock.now();
        eprintln!(
            "chaos: {} {} at {}: {detail}",
            plan.backend.label(),
            fault.kind.label(),
            super::history::show_time(started)
        );
        records.push(FaultRecord {
            kind: fault.kind.label().into(),
            started,
            finished,
            detail,
        });
        if plan.max_faults.is_some_and(|max| records.len() >= max) {
            chaos_end = chaos_end.min(Instant::now() + plan.settle);
            break;
        }
    }
    let faults_stopped = clock.now();
    tokio::time::sleep_until(chaos_end.max(Instant::now() + Duration::from_secs(1))).await;

    // Stop publishing (every attempt in flight ends at its next try); devices stop misbehaving.
    publish_stop.send_replace(true);
    device_calm.send_replace(true);
    join_all(producer_tasks, Duration::from_secs(15)).await;
    let publishing_stopped = clock.now();

    // Quiet period: until every device has what it must have, or the limit.
    let quiet_end = Instant::now() + plan.quiet_max;
    let mut lagging;
    loop {
        let now = snapshot(plan.seed, plan.backend, &attempts, &histories);
        lagging = checker::lagging(&now);
        if lagging.is_empty() || Instant::now() >= quiet_end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    device_stop.send_replace(true);
    join_all(device_tasks, Duration::from_secs(5)).await;
    let mut history = snapshot(plan.seed, plan.backend, &attempts, &histories);
    history.faults = records;
    history.faults_stopped = faults_stopped;
    history.publishing_stopped = publishing_stopped;
    history.ended = clock.now();
    let report = checker::check(&history);
    let hub_warnings = system.hub_warnings(12);
    drop(system);
    RunResult {
        history,
        report,
        lagging,
        hub_warnings,
        elapsed: began.elapsed(),
    }
}

//! `fanout`: N reading connections, events published at a fixed rate (unicast round robin over
//! the devices, group events round robin over the groups of ten that `--groups` makes the
//! streams join, or broadcasts that every connection receives), then a settle time for
//! stragglers. Reports deliveries per second, end-to-end latency, and exact loss, duplicates,
//! order violations and misrouting. Also home of the paced publisher and the reader that the
//! `slow` and `resume` scenarios share.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::json;
use tokio::sync::watch;

use super::{
    emit, failed, group_of,
    payload::{self, Target},
    probe::{CpuMeter, CpuShare},
    publisher::{Outgoing, Publisher},
    tally::{Latencies, LatencySummary, Tally, Totals},
    wire::{self, SseStream},
    Common, LoadtestError, Mode, Peer, PublishOptions, Run, GROUP_SIZE,
};

#[derive(Debug, clap::Args)]
pub struct FanoutArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub publish: PublishOptions,
    #[arg(long, value_enum, default_value = "unicast")]
    pub mode: Mode,
    /// Events per second: unicast events in total, group events in total (each one delivery
    /// per member), or broadcasts (each one delivery per connection).
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// Payload bytes per event.
    #[arg(long, default_value_t = 100)]
    pub size: usize,
    #[arg(long, default_value = "10s", value_parser = super::parse_duration)]
    pub duration: Duration,
    /// Wait this long after the last publish for deliveries still on their way.
    #[arg(long, default_value = "5s", value_parser = super::parse_duration)]
    pub settle: Duration,
}

impl FanoutArgs {
    pub fn plan(&self, run: &Run) -> Result<Plan, LoadtestError> {
        Plan::new(self.mode, self.rate, self.duration, self.size, run)
    }
}

/// A publishing plan: `total` events at `rate` per second.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub mode: Mode,
    pub rate: f64,
    pub total: u64,
    pub size: usize,
    pub devices: u64,
    /// The groups of ten the streams joined (`g1-0` ..), 0 without `--groups`.
    pub groups: u64,
}

impl Plan {
    pub fn new(
        mode: Mode,
        rate: f64,
        duration: Duration,
        size: usize,
        run: &Run,
    ) -> Result<Self, LoadtestError> {
        let devices = run.devices.len();
        let groups = if run.groups > 0 {
            devices.div_ceil(GROUP_SIZE)
        } else {
            0
        };
        if mode == Mode::Group && run.peer != Peer::Posthorn {
            return Err(LoadtestError::Usage(
                "--mode group is posthorn's (nchan has no groups)".into(),
            ));
        }
        if mode == Mode::Group && groups == 0 {
            // Without them no stream is a member, and every group event would reach nobody.
            return Err(LoadtestError::Usage(
                "--mode group publishes to the groups the streams join: give --groups 1 or more"
                    .into(),
            ));
        }
        if !(rate > 0.0 && rate.is_finite()) {
            return Err(LoadtestError::Usage("--rate must be above 0".into()));
        }
        if size < payload::MIN_SIZE {
            return Err(LoadtestError::Usage(format!(
                "--size must be at least {} bytes (the payload carries sequence and timestamp)",
                payload::MIN_SIZE
            )));
        }
        let total = (rate * duration.as_secs_f64()).round().max(1.0) as u64;
        let plan = Self {
            mode,
            rate,
            total,
            size,
            devices: devices as u64,
            groups: groups as u64,
        };
        super::check_events(plan.deliveries())?;
        Ok(plan)
    }

    /// Events a device should receive.
    pub fn expected(&self, device: u64) -> u64 {
        match self.mode {
            Mode::Broadcast => self.total,
            Mode::Unicast => round_robin_share(self.total, self.devices, device),
            Mode::Group => match self.group(device) {
                Some(group) => round_robin_share(self.total, self.groups, group),
                None => 0,
            },
        }
    }

    pub fn deliveries(&self) -> u64 {
        match self.mode {
            Mode::Broadcast => self.total * self.devices,
            Mode::Unicast => self.total,
            Mode::Group => (0..self.groups)
                .map(|group| {
                    let members = self.members(group);
                    round_robin_share(self.total, self.groups, group)
                        * (members.end - members.start)
                })
                .sum(),
        }
    }

    /// The group of ten device `device` joined, if the streams joined groups.
    pub fn group(&self, device: u64) -> Option<u64> {
        (self.groups > 0).then(|| group_of(device as usize, 1) as u64)
    }

    /// The devices of group `group`: ten, or fewer in the last group.
    pub fn members(&self, group: u64) -> std::ops::Range<u64> {
        let size = GROUP_SIZE as u64;
        (group * size).min(self.devices)..((group + 1) * size).min(self.devices)
    }

    pub(super) fn event(&self, index: u64, sent_us: u64) -> Outgoing {
        let (target, seq) = match self.mode {
            Mode::Broadcast => (Target::Broadcast, index),
            Mode::Unicast => (Target::Device(index % self.devices), index / self.devices),
            Mode::Group => (Target::Group(index % self.groups), index / self.groups),
        };
        let stamp = payload::Stamp {
            seq,
            sent_us,
            target,
        };
        Outgoing {
            target,
            data: stamp.encode(self.size),
        }
    }
}

/// How many of `total` events dealt round robin over `targets` go to target `target`.
fn round_robin_share(total: u64, targets: u64, target: u64) -> u64 {
    total / targets + u64::from(target < total % targets)
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Published {
    pub events: u64,
    pub seconds: f64,
    /// How far publishing fell behind its schedule at worst (the publisher or the server could
    /// not keep the rate).
    pub max_behind_ms: f64,
}

/// Publishes the plan on a 5 ms schedule; a batch carries every event that is due.
pub(super) async fn publish_paced(
    run: &Run,
    publisher: &mut Publisher,
    plan: &Plan,
) -> Result<Published, LoadtestError> {
    let tick = Duration::from_millis(5);
    let started = Instant::now();
    let mut next = tokio::time::Instant::now();
    let mut sent = 0u64;
    let mut max_behind = Duration::ZERO;
    let mut batch = Vec::new();
    while sent < plan.total {
        next += tick;
        tokio::time::sleep_until(next).await;
        let elapsed = started.elapsed();
        // Event i is due at i / rate: event 0 goes out at once.
        let due = ((elapsed.as_secs_f64() * plan.rate) as u64 + 1).min(plan.total);
        if due <= sent {
            continue;
        }
        // The oldest event of this batch was due at sent / rate; one tick late is on time.
        let scheduled = Duration::from_secs_f64(sent as f64 / plan.rate);
        max_behind = max_behind.max(elapsed.saturating_sub(scheduled + tick));
        let sent_us = payload::now_us();
        batch.clear();
        batch.extend((sent..due).map(|i| plan.event(i, sent_us)));
        publisher
            .publish(&run.devices, &batch)
            .await
            .map_err(failed("publishing failed"))?;
        sent = due;
    }
    Ok(Published {
        events: sent,
        seconds: started.elapsed().as_secs_f64(),
        max_behind_ms: max_behind.as_secs_f64() * 1000.0,
    })
}

/// Shared by all readers of a run.
#[derive(Default)]
pub struct Readers {
    pub latencies: Latencies,
    /// Microsecond wall clock of the latest delivery, for the delivery rate.
    pub last_delivery_us: AtomicU64,
    /// Connections that received everything they expect.
    pub complete: AtomicU64,
}

pub struct Followed {
    pub tally: Tally,
    pub expected: u64,
    /// The server closed the stream (evicted, drained, crashed) before the end.
    pub closed_by_server: bool,
    pub resyncs: u64,
}

/// Reads a stream until it has everything it expects, the server closes it, or `stop`.
pub async fn follow(
    mut stream: SseStream,
    device: usize,
    group: Option<u64>,
    expected: u64,
    shared: Arc<Readers>,
    mut stop: watch::Receiver<bool>,
) -> Followed {
    let mut tally = Tally::new(device as u64, group, expected);
    // The stop signal is awaited once around the whole loop, not once per read: re-registering
    // with the shared watch channel on every read was a tenth of the tool's CPU.
    let reading = async {
        let mut buf = vec![0u8; wire::READ_BUFFER];
        let mut stamps = Vec::with_capacity(64);
        let mut complete = false;
        loop {
            if !complete && tally.distinct >= expected {
                complete = true;
                shared.complete.fetch_add(1, Ordering::Relaxed);
            }
            let read = stream
                .read_events(&mut buf, |stamp| {
                    stamps.push(stamp.sent_us);
                    tally.record(stamp);
                })
                .await;
            if !stamps.is_empty() {
                shared.latencies.record(device, &stamps);
                shared
                    .last_delivery_us
                    .fetch_max(payload::now_us(), Ordering::Relaxed);
                stamps.clear();
            }
            if !matches!(read, Ok(true)) {
                return;
            }
        }
    };
    let closed_by_server = tokio::select! {
        () = reading => true,
        _ = stop.changed() => false,
    };
    Followed {
        tally,
        expected,
        closed_by_server,
        resyncs: stream.counters.resyncs,
    }
}

/// One reading task per stream, stopped together.
pub struct ReaderSet {
    tasks: Vec<tokio::task::JoinHandle<Followed>>,
    stop: watch::Sender<bool>,
    pub shared: Arc<Readers>,
}

/// What [`ReaderSet::publish_and_read`] measured.
pub struct Measured {
    pub published: Published,
    /// When publishing began (µs since the epoch, as the payloads' send stamps).
    pub first_publish_us: u64,
    pub cpu: CpuShare,
    pub read: ReadOutcome,
}

/// What the readers of a run received, summed.
pub struct ReadOutcome {
    pub totals: Totals,
    pub closed_by_server: u64,
    pub resyncs: u64,
}

impl ReaderSet {
    /// Starts a reader per `(device, stream)`, each expecting what `plan` sends its device.
    pub fn spawn(streams: impl IntoIterator<Item = (usize, SseStream)>, plan: &Plan) -> Self {
        let shared = Arc::new(Readers::default());
        let (stop, stop_rx) = watch::channel(false);
        let tasks = streams
            .into_iter()
            .map(|(device, stream)| {
                tokio::spawn(follow(
                    stream,
                    device,
                    plan.group(device as u64),
                    plan.expected(device as u64),
                    shared.clone(),
                    stop_rx.clone(),
                ))
            })
            .collect();
        Self {
            tasks,
            stop,
            shared,
        }
    }

    /// Fires when the readers are stopped; for companion tasks of the scenario.
    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Waits until every reader is complete, or `settle` after publishing ended.
    pub(super) async fn settle(&self, settle: Duration) {
        let deadline = Instant::now() + settle;
        while self.shared.complete.load(Ordering::Relaxed) < self.tasks.len() as u64
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The measured part of a run: publishes `plan` paced, lets the readers settle, and sums
    /// what they received, with the CPU used meanwhile.
    pub async fn publish_and_read(
        self,
        run: &Run,
        publisher: &mut Publisher,
        plan: &Plan,
        settle: Duration,
    ) -> Result<Measured, LoadtestError> {
        let cpu = CpuMeter::start(&run.server).await;
        let first_publish_us = payload::now_us();
        let published = publish_paced(run, publisher, plan).await?;
        self.settle(settle).await;
        let cpu = cpu.stop(&run.server).await;
        Ok(Measured {
            published,
            first_publish_us,
            cpu,
            read: self.finish().await?,
        })
    }

    /// Stops every reader (and companion task) and sums what they received.
    pub(super) async fn finish(self) -> Result<ReadOutcome, LoadtestError> {
        let _ = self.stop.send(true);
        let mut outcome = ReadOutcome {
            totals: Totals::default(),
            closed_by_server: 0,
            resyncs: 0,
        };
        for task in self.tasks {
            let followed = task
                .await
                .map_err(|e| LoadtestError::Failed(format!("reader: {e}")))?;
            outcome.totals.add(&followed.tally, followed.expected);
            outcome.closed_by_server += u64::from(followed.closed_by_server);
            outcome.resyncs += followed.resyncs;
        }
        Ok(outcome)
    }
}

pub async fn run(run: &Run, args: &FanoutArgs) -> Result<(), LoadtestError> {
    let n = run.devices.len();
    let plan = args.plan(run)?;
    let opening = Instant::now();
    let streams = run.open_all(None).await?;
    // Opened after the streams: a server closes a connection that sends no request for a few
    // seconds.
    let mut publisher = run.publisher(&args.publish).await?;
    println!(
        "fanout: {n} connections open in {:.2} s",
        opening.elapsed().as_secs_f64()
    );
    let readers = ReaderSet::spawn(streams.into_iter().enumerate(), &plan);
    let shared = readers.shared.clone();
    let Measured {
        published,
        first_publish_us,
        cpu,
        read:
            ReadOutcome {
                totals,
                closed_by_server: closed,
                resyncs,
            },
    } = readers
        .publish_and_read(run, &mut publisher, &plan, args.settle)
        .await?;
    let histogram = shared.latencies.merged();
    let latency = LatencySummary::of(&histogram);
    let last = shared.last_delivery_us.load(Ordering::Relaxed);
    let delivery_seconds = (last.saturating_sub(first_publish_us) as f64 / 1e6).max(1e-3);
    let delivered_per_second = totals.distinct as f64 / delivery_seconds;
    let mode = plan.mode.name();
    let recipients = match plan.mode {
        Mode::Group => format!(" (round robin over {} groups of {GROUP_SIZE})", plan.groups),
        Mode::Unicast | Mode::Broadcast => String::new(),
    };
    // Per delivery, so that modes with the same deliveries per second compare directly.
    let server_cpu_us_per_delivery = cpu
        .server_percent
        .filter(|_| totals.distinct > 0)
        .map(|percent| percent / 100.0 * cpu.wall_seconds * 1e6 / totals.distinct as f64);
    println!(
        "fanout: {} {mode} events{recipients} of {} B at {}/s over {n} connections ({:?}): {}/{} delivered \
         ({} lost, {} duplicates, {} out of order, {} misrouted, {closed} connections closed by \
         the server, {resyncs} resyncs): {delivered_per_second:.0} deliveries/s; latency p50 \
         {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms; publishing took {:.2} s (at \
         worst {:.0} ms behind schedule) -- {}",
        published.events,
        plan.size,
        plan.rate,
        run.peer,
        totals.distinct,
        totals.expected,
        totals.lost,
        totals.duplicates,
        totals.out_of_order,
        totals.misrouted,
        latency.p50_ms,
        latency.p99_ms,
        latency.p999_ms,
        latency.max_ms,
        published.seconds,
        published.max_behind_ms,
        if totals.lossless() && closed == 0 {
            "LOSSLESS"
        } else {
            "NOT LOSSLESS"
        }
    );
    match server_cpu_us_per_delivery {
        Some(us) => println!("fanout: {cpu}; server {us:.2} µs of CPU per delivery"),
        None => println!("fanout: {cpu}"),
    }
    if let Some(path) = &run.plot {
        let title = format!(
            "{:?} fanout: {mode} {}/s x {} B, {n} connections",
            run.peer, plan.rate, plan.size
        );
        super::plot::latency_cdf(path, &title, &histogram)
            .map_err(failed("cannot write the plot"))?;
    }
    emit(json!({
        "scenario": "fanout",
        "peer": run.peer,
        "connections": n,
        "mode": plan.mode,
        "group_count": plan.groups,
        "rate": plan.rate,
        "size": plan.size,
        "published": published,
        "deliveries": totals,
        "lossless": totals.lossless() && closed == 0,
        "closed_by_server": closed,
        "resyncs": resyncs,
        "delivered_per_second": delivered_per_second,
        "latency": latency,
        "cpu": cpu,
        "server_cpu_us_per_delivery": server_cpu_us_per_delivery,
    }));
    Ok(())
}

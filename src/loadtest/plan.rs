//! `posthorn loadtest plan`: the capacity calculator of docs/capacity.md. It measures nothing:
//! it turns the figures measured by the other scenarios (docs/BENCHMARKS.md, each constant below
//! names its table) into pods, memory, CPU and network for a fleet, and prints the arithmetic
//! with the assumptions, so that an operator can redo it with their own figures.

use serde::Serialize;

use super::LoadtestError;
use crate::{
    model::{Cursor, Epoch, Position},
    sse::frame,
};

/// Streams one pod was measured with (BENCHMARKS "Machine": 10,000 connections per 2-core pod).
const MEASURED_STREAMS_PER_POD: u64 = 10_000;
/// Resident memory of a hub with no stream (BENCHMARKS "Resume storm through Redis": 25.2–25.5
/// MiB before the storm).
const BASE_BYTES: f64 = 26.0 * 1024.0 * 1024.0;
/// PSS per idle stream (BENCHMARKS "Idle memory per connection": 6,365 B; "TLS reconnect
/// storm": 18,624 B over TLS).
const IDLE_BYTES: f64 = 6_400.0;
const IDLE_TLS_BYTES: f64 = 18_600.0;
/// Memory per queued event beyond its frame (BENCHMARKS "Slow consumers": about 608 B per
/// queued event of 512 B).
const QUEUED_OVERHEAD_BYTES: f64 = 96.0;
/// Hub CPU per event written to a stream (BENCHMARKS "Broadcast fan-out": 17.7 µs in the compare
/// run, 14–15.6 µs in the series; the larger is taken).
const DELIVERY_CPU_S: f64 = 17.7e-6;
/// Hub CPU per unicast event a pod tails, routes and writes (BENCHMARKS "Unicast latency by
/// publish path": 18.4–21.8 % of a core at 5,000 XADDs/s, 44 µs per event), and for one it also
/// answered through `POST /v1/events` (24.8–29.0 % at 5,000/s: 58 µs).
const UNICAST_TAILED_AND_WRITTEN_CPU_S: f64 = 44e-6;
const UNICAST_PUBLISHED_CPU_S: f64 = 58e-6;
/// Hub CPU per accepted stream in a reconnect storm (BENCHMARKS "Reconnect storm": 57 µs with
/// presence on, the default; 41 µs before it; "TLS reconnect storm": 300 µs with a full handshake).
const ACCEPT_CPU_S: f64 = 57e-6;
const ACCEPT_TLS_CPU_S: f64 = 300e-6;
/// Bytes of the heartbeat comment `: ping` and its interval (`sse.heartbeat` default).
const HEARTBEAT_BYTES: f64 = 8.0;
const HEARTBEAT_INTERVAL_S: f64 = 20.0;
/// Fields of a stored entry besides the payload (`dev`, `type`, ids), for the backend's egress.
const ENTRY_OVERHEAD_BYTES: f64 = 64.0;

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Devices (terminals) in the fleet, each holding one stream.
    #[arg(long)]
    pub devices: u64,
    /// Unicast events per second over the whole fleet.
    #[arg(long, default_value_t = 0.0)]
    pub unicast_rate: f64,
    /// Broadcasts per second (each reaches every device).
    #[arg(long, default_value_t = 0.0)]
    pub broadcast_rate: f64,
    /// Payload bytes per event (`data`).
    #[arg(long, default_value_t = 256)]
    pub size: u64,
    /// Event type name, for the size of a frame.
    #[arg(long, default_value = "price.update")]
    pub event_type: String,
    /// Pods; default: enough that the fleet still fits after one pod is lost.
    #[arg(long)]
    pub pods: Option<u64>,
    /// Most streams to plan per pod (the measured figure by default).
    #[arg(long, default_value_t = MEASURED_STREAMS_PER_POD)]
    pub streams_per_pod: u64,
    /// Terminals connect over TLS to the hub.
    #[arg(long)]
    pub tls: bool,
    /// `sse.queue_limit`: events a slow stream may have queued.
    #[arg(long, default_value_t = 256)]
    pub queue_limit: u64,
    /// Shards (`redis.shards`, `nats.shards`): a broadcast is stored once per shard.
    #[arg(long, default_value_t = 64)]
    pub shards: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// What the fleet needs, per pod and in total.
#[derive(Debug, Serialize, PartialEq)]
pub struct Plan {
    pub pods: u64,
    pub streams_per_pod: u64,
    /// Streams per surviving pod once one pod is lost.
    pub streams_per_pod_after_loss: u64,
    pub frame_bytes: u64,
    pub deliveries_per_pod_per_s: f64,
    pub memory_idle_bytes: f64,
    pub memory_full_queues_bytes: f64,
    pub cpu_steady_cores: f64,
    /// CPU seconds a surviving pod spends accepting its share of a lost pod's streams.
    pub cpu_storm_seconds: f64,
    pub egress_to_devices_bytes_per_s: f64,
    /// What every pod reads from the backend (each pod tails every shard): the seed's R × S × P
    /// in total.
    pub ingress_from_backend_bytes_per_s: f64,
    pub backend_egress_total_bytes_per_s: f64,
}

pub fn run(args: &PlanArgs) -> Result<(), LoadtestError> {
    let plan = plan(args)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&plan).expect("a plan serializes")
        );
    } else {
        print!("{}", report(args, &plan));
    }
    Ok(())
}

fn usage(message: &str) -> LoadtestError {
    LoadtestError::Usage(format!("plan: {message}"))
}

pub fn plan(args: &PlanArgs) -> Result<Plan, LoadtestError> {
    if args.devices == 0 || args.streams_per_pod == 0 || args.shards == 0 {
        return Err(usage(
            "--devices, --streams-per-pod and --shards must be positive",
        ));
    }
    let usable = |rate: f64| rate.is_finite() && rate >= 0.0;
    if !usable(args.unicast_rate) || !usable(args.broadcast_rate) {
        return Err(usage("rates must be finite and not negative"));
    }
    let pods = match args.pods {
        Some(0) => return Err(usage("--pods must be positive")),
        Some(pods) => pods,
        None => args.devices.div_ceil(args.streams_per_pod) + 1,
    };
    let streams = args.devices.div_ceil(pods);
    let after_loss = if pods > 1 {
        args.devices.div_ceil(pods - 1)
    } else {
        streams
    };
    let frame_bytes = frame_bytes(&args.event_type, args.size);
    let frame = frame_bytes as f64;
    let streams_f = streams as f64;
    let unicast_per_pod = args.unicast_rate / pods as f64;
    let broadcast_deliveries = args.broadcast_rate * streams_f;
    let deliveries = unicast_per_pod + broadcast_deliveries;
    let idle = if args.tls { IDLE_TLS_BYTES } else { IDLE_BYTES };
    let memory_idle = BASE_BYTES + streams_f * idle;
    let memory_full =
        memory_idle + streams_f * args.queue_limit as f64 * (frame + QUEUED_OVERHEAD_BYTES);
    // Every pod tails every unicast event; the one holding the device writes it, and the one
    // that took the publish answered it (taken as the same pod: the larger cost).
    let unicast_tail_only = UNICAST_TAILED_AND_WRITTEN_CPU_S - DELIVERY_CPU_S;
    let cpu_steady = unicast_per_pod * UNICAST_PUBLISHED_CPU_S
        + (args.unicast_rate - unicast_per_pod) * unicast_tail_only
        + broadcast_deliveries * DELIVERY_CPU_S;
    let accept = if args.tls {
        ACCEPT_TLS_CPU_S
    } else {
        ACCEPT_CPU_S
    };
    let storm_share = if pods > 1 {
        streams_f / (pods - 1) as f64
    } else {
        streams_f
    };
    let entry = args.size as f64 + ENTRY_OVERHEAD_BYTES;
    let entries_read_per_s = args.unicast_rate + args.broadcast_rate * args.shards as f64;
    Ok(Plan {
        pods,
        streams_per_pod: streams,
        streams_per_pod_after_loss: after_loss,
        frame_bytes,
        deliveries_per_pod_per_s: deliveries,
        memory_idle_bytes: memory_idle,
        memory_full_queues_bytes: memory_full,
        cpu_steady_cores: cpu_steady,
        cpu_storm_seconds: storm_share * accept,
        egress_to_devices_bytes_per_s: deliveries * frame
            + streams_f * HEARTBEAT_BYTES / HEARTBEAT_INTERVAL_S,
        ingress_from_backend_bytes_per_s: entries_read_per_s * entry,
        backend_egress_total_bytes_per_s: entries_read_per_s * entry * pods as f64,
    })
}

/// Bytes of one `event` frame with a payload of `size` bytes, framed as the hub frames it.
fn frame_bytes(event_type: &str, size: u64) -> u64 {
    let id = Cursor::new(Epoch::random(), 63, Position::new(1_764_700_000_000, 0)).to_string();
    let data = "x".repeat(size as usize);
    frame::event(&id, event_type, &data).len() as u64
}

fn mib(bytes: f64) -> String {
    format!("{:.0} MiB", bytes / (1024.0 * 1024.0))
}

fn rate(bytes_per_s: f64) -> String {
    let megabits = bytes_per_s * 8.0 / 1e6;
    format!("{:.2} MB/s ({megabits:.1} Mbit/s)", bytes_per_s / 1e6)
}

fn report(args: &PlanArgs, plan: &Plan) -> String {
    let tls = if args.tls { "TLS" } else { "plain HTTP" };
    let idle = if args.tls { IDLE_TLS_BYTES } else { IDLE_BYTES };
    let accept_us = if args.tls {
        ACCEPT_TLS_CPU_S
    } else {
        ACCEPT_CPU_S
    } * 1e6;
    format!(
        "posthorn capacity plan: {devices} devices, {unicast} unicast events/s, {broadcast} \
         broadcasts/s, {size} B payloads ({frame} B framed), {tls}\n\
         \n\
         pods                      {pods} ({streams} streams each; {after} each after one pod is lost)\n\
         deliveries per pod        {deliveries:.0}/s\n\
         \n\
         per pod\n\
         memory, idle              {idle_mem} = 26 MiB + {streams} × {idle:.0} B\n\
         memory, every queue full  {full_mem} = idle + {streams} × {queue} × ({frame} + {overhead:.0}) B  \
         (the limit to set: a burst no client reads)\n\
         CPU, steady               {cpu:.3} cores\n\
         CPU, absorbing a lost pod {storm:.2} CPU-seconds ({share:.0} streams × {accept_us:.0} µs)\n\
         egress to terminals       {egress}\n\
         ingress from the backend  {ingress}\n\
         \n\
         backend egress, all pods  {backend} (every pod reads every entry: R × S × P)\n\
         \n\
         Figures from docs/BENCHMARKS.md (2 vCPU pods, loopback); see docs/capacity.md for what \
         each assumes.\n",
        devices = args.devices,
        unicast = args.unicast_rate,
        broadcast = args.broadcast_rate,
        size = args.size,
        frame = plan.frame_bytes,
        pods = plan.pods,
        streams = plan.streams_per_pod,
        after = plan.streams_per_pod_after_loss,
        deliveries = plan.deliveries_per_pod_per_s,
        idle_mem = mib(plan.memory_idle_bytes),
        full_mem = mib(plan.memory_full_queues_bytes),
        queue = args.queue_limit,
        overhead = QUEUED_OVERHEAD_BYTES,
        cpu = plan.cpu_steady_cores,
        storm = plan.cpu_storm_seconds,
        share = plan.cpu_storm_seconds / (accept_us / 1e6),
        egress = rate(plan.egress_to_devices_bytes_per_s),
        ingress = rate(plan.ingress_from_backend_bytes_per_s),
        backend = rate(plan.backend_egress_total_bytes_per_s),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(devices: u64, unicast: f64, broadcast: f64) -> PlanArgs {
        PlanArgs {
            devices,
            unicast_rate: unicast,
            broadcast_rate: broadcast,
            size: 256,
            event_type: "price.update".into(),
            pods: None,
            streams_per_pod: 10_000,
            tls: false,
            queue_limit: 256,
            shards: 64,
            json: false,
        }
    }

    /// Enough pods that the fleet fits after one is lost; the arithmetic of each line.
    #[test]
    fn fifty_thousand_terminals() {
        let plan = plan(&args(50_000, 1_000.0, 1.0)).unwrap();
        assert_eq!(plan.pods, 6);
        assert_eq!(plan.streams_per_pod, 8_334);
        assert_eq!(plan.streams_per_pod_after_loss, 10_000);
        let per_pod_unicast = 1_000.0 / 6.0;
        assert!((plan.deliveries_per_pod_per_s - (per_pod_unicast + 8_334.0)).abs() < 1e-9);
        assert!((plan.memory_idle_bytes - (BASE_BYTES + 8_334.0 * IDLE_BYTES)).abs() < 1e-6);
        let cpu = per_pod_unicast * 58e-6
            + (1_000.0 - per_pod_unicast) * (44e-6 - 17.7e-6)
            + 8_334.0 * 17.7e-6;
        assert!((plan.cpu_steady_cores - cpu).abs() < 1e-9);
        assert!((plan.cpu_storm_seconds - 8_334.0 / 5.0 * 57e-6).abs() < 1e-9);
        let entries = 1_000.0 + 64.0;
        assert!(
            (plan.backend_egress_total_bytes_per_s - entries * (256.0 + 64.0) * 6.0).abs() < 1e-6
        );
    }

    /// A frame is the hub's own framing of the payload: `id:`, `event:`, `data:` lines.
    #[test]
    fn frames_are_the_payload_plus_the_fields() {
        let framed = frame_bytes("price.update", 256);
        assert!(framed > 256 + 40 && framed < 256 + 80, "{framed}");
    }

    #[test]
    fn the_heartbeat_is_what_the_hub_writes() {
        assert_eq!(frame::PING.len() as f64, HEARTBEAT_BYTES);
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(plan(&args(0, 1.0, 0.0)).is_err());
        assert!(plan(&args(10, -1.0, 0.0)).is_err());
        assert!(plan(&args(10, f64::NAN, 0.0)).is_err());
        let mut zero_pods = args(10, 1.0, 0.0);
        zero_pods.pods = Some(0);
        assert!(plan(&zero_pods).is_err());
    }
}

//! `slow`: a fraction of the connections never read (small receive buffers, so the server's
//! queue fills quickly) while the rest read normally and events flow at a fixed rate. Reports
//! which slow connections the server closed and how soon after publishing started, the server's
//! peak memory against the bound the queues allow, and what the healthy clients received
//! (which must be everything, once, in order).

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::watch;

use super::{
    emit,
    fanout::{Measured, Plan, ReadOutcome, ReaderSet},
    probe::Memory,
    tally::LatencySummary,
    wire, Common, LoadtestError, Mode, PublishOptions, Run,
};

/// How often the never-reading sockets are checked for a close by the server.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, clap::Args)]
pub struct SlowArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub publish: PublishOptions,
    /// Share of the connections that never read.
    #[arg(long, default_value_t = 0.1)]
    pub slow_fraction: f64,
    /// Receive buffer of a never-reading client (the kernel doubles it).
    #[arg(long, default_value_t = 4096)]
    pub slow_receive_buffer: u32,
    #[arg(long, value_enum, default_value = "broadcast")]
    pub mode: Mode,
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 512)]
    pub size: usize,
    #[arg(long, default_value = "20s", value_parser = super::parse_duration)]
    pub duration: Duration,
    #[arg(long, default_value = "5s", value_parser = super::parse_duration)]
    pub settle: Duration,
    /// The server's per-connection queue limit, for the memory bound in the report
    /// (posthorn's `sse.queue_limit`).
    #[arg(long, default_value_t = 256)]
    pub queue_limit: u64,
}

pub async fn run(run: &Run, args: &SlowArgs) -> Result<(), LoadtestError> {
    if !(args.slow_fraction > 0.0 && args.slow_fraction < 1.0) {
        return Err(LoadtestError::Usage(
            "--slow-fraction must be between 0 and 1".into(),
        ));
    }
    let n = run.devices.len();
    let every = (1.0 / args.slow_fraction).round().max(2.0) as usize;
    let is_slow = |device: usize| device.is_multiple_of(every);
    let plan = Plan::new(args.mode, args.rate, args.duration, args.size, run)?;
    let memory_before = run.server.memory().await;
    let healthy_indices: Vec<usize> = (0..n).filter(|d| !is_slow(*d)).collect();
    let slow_indices: Vec<usize> = (0..n).filter(|d| is_slow(*d)).collect();
    let mut healthy = Vec::with_capacity(healthy_indices.len());
    for opened in run
        .open_streams(
            healthy_indices.iter().copied(),
            None,
            None,
            run.connect_concurrency,
        )
        .await
    {
        healthy.push((opened.index, opened.stream()?));
    }
    let mut slow = Vec::with_capacity(slow_indices.len());
    for opened in run
        .open_streams(
            slow_indices.iter().copied(),
            None,
            Some(args.slow_receive_buffer),
            run.connect_concurrency,
        )
        .await
    {
        slow.push(opened.stream()?);
    }
    println!(
        "slow: {} healthy and {} never-reading connections open ({:?})",
        healthy.len(),
        slow.len(),
        run.peer
    );
    // Opened after the streams: a server closes a connection that sends no request for a few
    // seconds.
    let mut publisher = run.publisher(&args.publish).await?;
    let readers = ReaderSet::spawn(healthy, &plan);
    let shared = readers.shared.clone();
    let started = Instant::now();
    let watcher = tokio::spawn(watch_slow(slow, started, readers.stop_signal()));
    let sampler = tokio::spawn(sample_memory(run.server.clone(), readers.stop_signal()));
    let Measured {
        published,
        cpu,
        read:
            ReadOutcome {
                totals,
                closed_by_server: healthy_closed,
                ..
            },
        ..
    } = readers
        .publish_and_read(run, &mut publisher, &plan, args.settle)
        .await?;
    let evictions = watcher
        .await
        .map_err(|e| LoadtestError::Failed(format!("watcher: {e}")))?;
    let peak = sampler
        .await
        .map_err(|e| LoadtestError::Failed(format!("sampler: {e}")))?;
    let evicted: Vec<f64> = evictions.iter().flatten().copied().collect();
    let latest = evicted.iter().copied().fold(0.0, f64::max);
    let mut sorted = evicted.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied();
    // What the queues may hold at most: every connection's queue full of distinct frames. A
    // broadcast frame is shared by every queue, so broadcasts stay far below this.
    let frame_bytes = plan.size as u64 + 96;
    let bound_kib = n as u64 * args.queue_limit * frame_bytes / 1024;
    let latency = LatencySummary::of(&shared.latencies.merged());
    let healthy_lossless = totals.lossless() && healthy_closed == 0;
    println!(
        "slow: {}/{} never-reading connections closed by the server, median {}, last {latest:.2} \
         s after publishing started; healthy: {}/{} delivered, {} lost, {} duplicates, {} out of \
         order, {healthy_closed} closed by the server -- {}; healthy latency p50 {:.2} ms p99 \
         {:.2} ms",
        evicted.len(),
        slow_indices.len(),
        median.map_or("-".to_string(), |m| format!("{m:.2} s")),
        totals.distinct,
        totals.expected,
        totals.lost,
        totals.duplicates,
        totals.out_of_order,
        if healthy_lossless {
            "LOSSLESS"
        } else {
            "NOT LOSSLESS"
        },
        latency.p50_ms,
        latency.p99_ms,
    );
    if let (Some(before), Some(peak)) = (memory_before, peak) {
        println!(
            "slow: server memory {} KiB before, peak {} KiB (+{} KiB); the queues allow at most \
             {bound_kib} KiB ({n} connections x {} events x ~{frame_bytes} B)",
            before.rss_kib,
            peak.rss_kib,
            peak.rss_kib.saturating_sub(before.rss_kib),
            args.queue_limit
        );
    }
    println!("slow: {cpu}");
    emit(json!({
        "scenario": "slow",
        "peer": run.peer,
        "connections": n,
        "slow_connections": slow_indices.len(),
        "mode": plan.mode,
        "rate": plan.rate,
        "size": plan.size,
        "published": published,
        "evicted": evicted.len(),
        "eviction_median_s": median,
        "eviction_last_s": latest,
        "healthy": totals,
        "healthy_closed_by_server": healthy_closed,
        "healthy_lossless": healthy_lossless,
        "healthy_latency": latency,
        "memory_before": memory_before,
        "memory_peak": peak,
        "queue_bound_kib": bound_kib,
        "cpu": cpu,
    }));
    Ok(())
}

/// Polls the never-reading sockets; per socket, when the server closed it (seconds after
/// `started`), or `None` if it was still open at the end.
async fn watch_slow(
    slow: Vec<wire::SseStream>,
    started: Instant,
    mut stop: watch::Receiver<bool>,
) -> Vec<Option<f64>> {
    let mut closed_at: Vec<Option<f64>> = vec![None; slow.len()];
    loop {
        for (stream, closed) in slow.iter().zip(closed_at.iter_mut()) {
            if closed.is_none() && !wire::established(&stream.stream) {
                *closed = Some(started.elapsed().as_secs_f64());
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(WATCH_INTERVAL) => {}
            _ = stop.changed() => return closed_at,
        }
    }
}

/// The server's peak memory while the scenario runs, sampled every 500 ms.
async fn sample_memory(
    server: super::probe::Server,
    mut stop: watch::Receiver<bool>,
) -> Option<Memory> {
    let mut peak: Option<Memory> = None;
    loop {
        if let Some(now) = server.memory().await {
            if peak.is_none_or(|p| now.rss_kib > p.rss_kib) {
                peak = Some(now);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.changed() => return peak,
        }
    }
}

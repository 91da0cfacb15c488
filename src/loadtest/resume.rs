//! `resume`: the resume storm after a pod died. N clients take a cursor (one broadcast), go away;
//! while they are away, unicast events are published at `--rate` for `--away` (round robin over
//! the devices); then all reconnect at the same moment with their cursors and read their
//! backlog. Reports how long until every device had its whole backlog, exact loss, duplicates
//! and order, the server's peak memory during the storm, and, for posthorn, the backend entries
//! its replays read per event they delivered (`replay_entries_read_total` over
//! `sse_replayed_events_total`).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::json;

use super::{
    emit,
    fanout::{publish_paced, Plan, ReaderSet},
    probe::{self, CpuMeter},
    Common, LoadtestError, Mode, PublishOptions, Run,
};

/// How often the server's memory is sampled during the storm.
const MEMORY_SAMPLE: Duration = Duration::from_millis(100);

#[derive(Debug, clap::Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub publish: PublishOptions,
    /// Unicast events per second published while the clients are away.
    #[arg(long, default_value_t = 5000.0)]
    pub rate: f64,
    /// How long the clients are away: their cursors are this far behind.
    #[arg(long, default_value = "60s", value_parser = super::parse_duration)]
    pub away: Duration,
    /// Payload bytes per event.
    #[arg(long, default_value_t = 100)]
    pub size: usize,
    /// Connection attempts in flight during the storm (default: all at once).
    #[arg(long)]
    pub storm_concurrency: Option<usize>,
    /// Longest wait for every device to have its backlog.
    #[arg(long, default_value = "120s", value_parser = super::parse_duration)]
    pub catch_up_limit: Duration,
}

pub async fn run(run: &Run, args: &ResumeArgs) -> Result<(), LoadtestError> {
    let n = run.devices.len();
    let plan = Plan::new(Mode::Unicast, args.rate, args.away, args.size, run)?;
    let cursors = run.take_cursors(&args.publish).await?;

    let mut publisher = run.publisher(&args.publish).await?;
    println!(
        "resume: {n} clients away; publishing {} events at {}/s for {:?}",
        plan.total, args.rate, args.away
    );
    let published = publish_paced(run, &mut publisher, &plan).await?;
    drop(publisher);

    let metric = |name: &'static str| async move {
        match &run.server {
            probe::Server::Metrics(endpoint) => probe::metric(endpoint, name).await,
            _ => probe::metric(&run.endpoint, name).await,
        }
    };
    let (read_before, replayed_before) = (
        metric("replay_entries_read_total").await,
        metric("sse_replayed_events_total").await,
    );
    let base_memory = run.server.memory().await;
    let peak_kib = Arc::new(AtomicU64::new(base_memory.map_or(0, |m| m.rss_kib)));
    let sampler = {
        let (server, peak_kib) = (run.server.clone(), peak_kib.clone());
        tokio::spawn(async move {
            loop {
                if let Some(memory) = server.memory().await {
                    peak_kib.fetch_max(memory.rss_kib, Ordering::Relaxed);
                }
                tokio::time::sleep(MEMORY_SAMPLE).await;
            }
        })
    };

    let concurrency = args.storm_concurrency.unwrap_or(n).max(1);
    let cpu = CpuMeter::start(&run.server).await;
    let started = Instant::now();
    let opened = run
        .open_streams(0..n, Some(&cursors), None, concurrency)
        .await;
    let accepted_after = started.elapsed();
    let mut failures: std::collections::BTreeMap<String, u64> = Default::default();
    let mut streams = Vec::with_capacity(n);
    for attempt in opened {
        match attempt.result {
            Ok(stream) => streams.push((attempt.index, stream)),
            Err(error) => *failures.entry(error.to_string()).or_default() += 1,
        }
    }
    let accepted = streams.len();
    let readers = ReaderSet::spawn(streams, &plan);
    let complete = readers.shared.clone();
    readers.settle(args.catch_up_limit).await;
    let caught_up = complete.complete.load(Ordering::Relaxed);
    let caught_up_after = started.elapsed();
    let cpu = cpu.stop(&run.server).await;
    sampler.abort();
    let outcome = readers.finish().await?;

    let (read_after, replayed_after) = (
        metric("replay_entries_read_total").await,
        metric("sse_replayed_events_total").await,
    );
    let entries_read = read_after.zip(read_before).map(|(a, b)| a - b);
    let replayed = replayed_after.zip(replayed_before).map(|(a, b)| a - b);
    let per_delivered = entries_read
        .zip(replayed)
        .map(|(read, replayed)| read / replayed.max(1.0));
    let peak_kib = peak_kib.load(Ordering::Relaxed);
    let totals = outcome.totals;
    println!(
        "resume: {accepted}/{n} streams accepted in {:.2} s ({} failures); {caught_up}/{accepted} \
         had their whole backlog after {:.2} s",
        accepted_after.as_secs_f64(),
        failures.values().sum::<u64>(),
        caught_up_after.as_secs_f64(),
    );
    println!(
        "resume: expected {}, received {}, lost {}, duplicates {}, out of order {}, streams \
         closed by the server {}, resyncs {}",
        totals.expected,
        totals.received,
        totals.lost,
        totals.duplicates,
        totals.out_of_order,
        outcome.closed_by_server,
        outcome.resyncs
    );
    println!(
        "resume: server memory {} KiB before the storm, peak {peak_kib} KiB; backend entries read \
         by replays {}, events replayed {}: {} per delivered event",
        base_memory.map_or(0, |m| m.rss_kib),
        entries_read.map_or("unknown".into(), |v| format!("{v:.0}")),
        replayed.map_or("unknown".into(), |v| format!("{v:.0}")),
        per_delivered.map_or("unknown".into(), |v| format!("{v:.2}")),
    );
    println!("resume: {cpu}");
    emit(json!({
        "scenario": "resume",
        "peer": run.peer,
        "connections": n,
        "published": published,
        "accepted": accepted,
        "failures": failures,
        "accept_seconds": accepted_after.as_secs_f64(),
        "caught_up": caught_up,
        "caught_up_seconds": caught_up_after.as_secs_f64(),
        "totals": totals,
        "closed_by_server": outcome.closed_by_server,
        "resyncs": outcome.resyncs,
        "memory_before_kib": base_memory.map(|m| m.rss_kib),
        "memory_peak_kib": peak_kib,
        "replay_entries_read": entries_read,
        "replayed_events": replayed,
        "entries_read_per_delivered_event": per_delivered,
        "cpu": cpu,
    }));
    Ok(())
}

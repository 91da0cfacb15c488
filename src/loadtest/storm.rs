//! `storm`: the reconnect storm after a pod went away. N clients connect, receive one broadcast
//! (so each holds a real cursor), disconnect, and then all reconnect at the same moment with
//! `Last-Event-ID`. Reports accepted connections per second, connect times and failures. With
//! TLS (`--tls` or an `https://` URL) every reconnect is a full handshake, and the negotiated
//! protocol, suite and key exchange are reported.

use std::time::Duration;

use serde_json::json;

use super::{
    emit, probe::CpuMeter, tally::LatencySummary, Common, LoadtestError, PublishOptions, Run,
};

#[derive(Debug, clap::Args)]
pub struct StormArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub publish: PublishOptions,
    /// Connection attempts in flight during the storm (default: all at once).
    #[arg(long)]
    pub storm_concurrency: Option<usize>,
    /// Pause between the disconnect and the storm, so the server has let go of the old streams.
    #[arg(long, default_value = "3s", value_parser = super::parse_duration)]
    pub pause: Duration,
}

pub async fn run(run: &Run, args: &StormArgs) -> Result<(), LoadtestError> {
    let n = run.devices.len();
    let cursors = run.take_cursors(&args.publish).await?;
    println!(
        "storm: {n} clients hold a cursor (e.g. {:?}); reconnecting all at once in {:?}",
        cursors.first().map(String::as_str).unwrap_or(""),
        args.pause
    );
    tokio::time::sleep(args.pause).await;

    let concurrency = args.storm_concurrency.unwrap_or(n).max(1);
    let cpu = CpuMeter::start(&run.server).await;
    let opened = run
        .open_streams(0..n, Some(&cursors), None, concurrency)
        .await;
    let cpu = cpu.stop(&run.server).await;
    let mut times = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)
        .expect("static histogram bounds");
    let mut failures: std::collections::BTreeMap<String, u64> = Default::default();
    let mut last_accept = Duration::ZERO;
    let mut accepted = Vec::with_capacity(n);
    for attempt in opened {
        match attempt.result {
            Ok(stream) => {
                times.saturating_record(attempt.after.as_micros().max(1) as u64);
                last_accept = last_accept.max(attempt.after);
                accepted.push(stream);
            }
            Err(error) => *failures.entry(error.to_string()).or_default() += 1,
        }
    }
    let rate = accepted.len() as f64 / last_accept.as_secs_f64().max(1e-3);
    let connect = LatencySummary::of(&times);
    println!(
        "storm: {}/{n} reconnects accepted in {:.2} s: {rate:.0} connections/s ({concurrency} \
         in flight); time to accept p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; failures: {}",
        accepted.len(),
        last_accept.as_secs_f64(),
        connect.p50_ms,
        connect.p99_ms,
        connect.max_ms,
        if failures.is_empty() {
            "none".to_string()
        } else {
            format!("{failures:?}")
        }
    );
    println!("storm: {cpu}");
    let tls = accepted
        .first()
        .and_then(|stream: &super::wire::SseStream| stream.stream.tls_parameters());
    if let Some(tls) = &tls {
        println!("storm: every connection made a full TLS handshake ({tls})");
    }
    emit(json!({
        "scenario": "storm",
        "peer": run.peer,
        "connections": n,
        "concurrency": concurrency,
        "accepted": accepted.len(),
        "failures": failures,
        "seconds": last_accept.as_secs_f64(),
        "accepted_per_second": rate,
        "time_to_accept": connect,
        "cpu": cpu,
        // Server CPU per accepted stream: with TLS, mostly the handshake.
        "server_cpu_ms_per_accept": cpu.server_percent.map(|percent| {
            percent / 100.0 * cpu.wall_seconds * 1000.0 / accepted.len().max(1) as f64
        }),
        "tls": tls,
    }));
    Ok(())
}

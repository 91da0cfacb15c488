//! `idle`: N connections that read nothing after the response head. Measures how fast they are
//! accepted, the server's memory per connection with empty queues, then (with `--fill K`) with
//! K undelivered events per connection waiting in the server, and the memory left after all
//! connections closed. Clients use a small receive buffer so that undelivered events stay in
//! the server rather than in the kernel.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{
    emit, failed,
    payload::{self, Target},
    probe::{CpuMeter, Memory},
    publisher::Outgoing,
    wire, Common, LoadtestError, Mode, PublishOptions, Run,
};

#[derive(Debug, clap::Args)]
pub struct IdleArgs {
    #[command(flatten)]
    pub common: Common,
    #[command(flatten)]
    pub publish: PublishOptions,
    /// After the empty-queue measurement, publish this many events per connection and measure
    /// again (0: skip).
    #[arg(long, default_value_t = 0)]
    pub fill: u64,
    #[arg(long, value_enum, default_value = "unicast")]
    pub fill_mode: Mode,
    #[arg(long, default_value_t = 256)]
    pub size: usize,
    /// Client receive buffer (the kernel doubles it).
    #[arg(long, default_value_t = 4096)]
    pub receive_buffer: u32,
    /// Pause before each memory sample, so the server settles.
    #[arg(long, default_value = "5s", value_parser = super::parse_duration)]
    pub settle: Duration,
}

pub async fn run(run: &Run, args: &IdleArgs) -> Result<(), LoadtestError> {
    let n = run.devices.len();
    let fill_events = match args.fill_mode {
        Mode::Unicast => args.fill * n as u64,
        Mode::Broadcast => args.fill,
        Mode::Group => {
            return Err(LoadtestError::Usage(
                "--fill-mode group is not supported: fill with unicast or broadcast".into(),
            ))
        }
    };
    super::check_events(fill_events)?;
    let before = run.server.memory().await;
    let cpu = CpuMeter::start(&run.server).await;
    let started = Instant::now();
    let streams = run.open_all(Some(args.receive_buffer)).await?;
    let connect_seconds = started.elapsed().as_secs_f64();
    let cpu = cpu.stop(&run.server).await;
    let connects_per_second = n as f64 / connect_seconds;
    println!(
        "idle: {n} connections to {:?} opened in {connect_seconds:.2} s ({connects_per_second:.0}/s, {} at a time)",
        run.peer, run.connect_concurrency
    );
    println!("idle: while connecting: {cpu}");
    tokio::time::sleep(args.settle).await;
    let open = run.server.memory().await;
    let empty = super::per_connection(before, open, n);
    print_memory("empty queues", before, open, empty);

    let mut full = None;
    let mut filled = None;
    let mut still_open = n;
    if args.fill > 0 {
        // Opened now: a server closes a connection that sends no request for a few seconds.
        let mut publisher = run.publisher(&args.publish).await?;
        let fill_started = Instant::now();
        let mut sent = 0u64;
        let batch_events = 1000u64;
        while sent < fill_events {
            let upto = (sent + batch_events).min(fill_events);
            let sent_us = payload::now_us();
            let batch: Vec<Outgoing> = (sent..upto)
                .map(|i| {
                    let (target, seq) = match args.fill_mode {
                        Mode::Unicast => (Target::Device(i % n as u64), i / n as u64),
                        Mode::Broadcast => (Target::Broadcast, i),
                        Mode::Group => unreachable!("refused above"),
                    };
                    Outgoing {
                        target,
                        data: payload::Stamp {
                            seq,
                            sent_us,
                            target,
                        }
                        .encode(args.size),
                    }
                })
                .collect();
            publisher
                .publish(&run.devices, &batch)
                .await
                .map_err(failed("filling the queues failed"))?;
            sent = upto;
        }
        println!(
            "idle: published {sent} {:?} events of {} B ({} per connection) in {:.2} s",
            args.fill_mode,
            args.size,
            args.fill,
            fill_started.elapsed().as_secs_f64()
        );
        tokio::time::sleep(args.settle).await;
        filled = run.server.memory().await;
        full = super::per_connection(before, filled, n);
        still_open = streams
            .iter()
            .filter(|s| wire::established(&s.stream))
            .count();
        print_memory(
            &format!("{} events waiting per connection", args.fill),
            before,
            filled,
            full,
        );
        if still_open < n {
            println!(
                "idle: {} connections were closed by the server while full",
                n - still_open
            );
        }
    }
    drop(streams);
    tokio::time::sleep(args.settle).await;
    let after = run.server.memory().await;
    if let Some(after) = after {
        println!(
            "idle: after closing all: server RSS {} KiB, PSS {} KiB",
            after.rss_kib, after.pss_kib
        );
    }
    emit(json!({
        "scenario": "idle",
        "peer": run.peer,
        "connections": n,
        "connect_seconds": connect_seconds,
        "connects_per_second": connects_per_second,
        "memory_before": before,
        "memory_open": open,
        "bytes_per_connection": empty,
        "fill": args.fill,
        "fill_mode": args.fill_mode,
        "size": args.size,
        "memory_full": filled,
        "bytes_per_connection_full": full,
        "open_after_fill": still_open,
        "memory_after_close": after,
        "cpu_connecting": cpu,
    }));
    Ok(())
}

fn print_memory(label: &str, before: Option<Memory>, now: Option<Memory>, per: Option<f64>) {
    match (before, now, per) {
        (Some(before), Some(now), Some(per)) => println!(
            "idle: {label}: server RSS {} -> {} KiB, PSS {} -> {} KiB: {per:.0} bytes per connection",
            before.rss_kib, now.rss_kib, before.pss_kib, now.pss_kib
        ),
        _ => println!("idle: {label}: server memory unknown (give --pid)"),
    }
}

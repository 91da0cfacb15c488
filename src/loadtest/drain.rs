//! `drain`: N connections to a posthorn hub, then a drain (`POST /admin/drain` or SIGTERM to
//! `--pid`). Each client reads until the server closes its stream and keeps the last `retry:`
//! it was sent after the drain began. Reports close times and rate, the spread of retry values,
//! when each client reconnects — really, to `--reconnect-url` (another pod) after its retry, or
//! computed as close + retry — and when the process exited.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::json;

use super::{emit, failed, probe::Server, wire, Common, Endpoint, LoadtestError, Peer, Run};

/// The reference client never reconnects sooner than this (docs/client-contract.md).
const RETRY_FLOOR_MS: u64 = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Trigger {
    /// `POST /admin/drain` (loopback admin without auth).
    Admin,
    /// SIGTERM to the --pid process.
    Signal,
}

#[derive(Debug, clap::Args)]
pub struct DrainArgs {
    #[command(flatten)]
    pub common: Common,
    #[arg(long, value_enum, default_value = "admin")]
    pub trigger: Trigger,
    /// Reconnect every closed client here after its retry (a second hub); without it,
    /// reconnect times are computed as close time + retry.
    #[arg(long)]
    pub reconnect_url: Option<String>,
    /// Longest wait for the drain to finish.
    #[arg(long, default_value = "120s", value_parser = super::parse_duration)]
    pub wait: Duration,
}

struct Closed {
    closed_after: Option<f64>,
    retry_ms: Option<u64>,
    reconnected_after: Option<f64>,
}

pub async fn run(run: &Run, args: &DrainArgs) -> Result<(), LoadtestError> {
    if run.peer != Peer::Posthorn {
        return Err(LoadtestError::Usage(
            "drain measures posthorn's drain; nchan has none".into(),
        ));
    }
    if args.trigger == Trigger::Signal && !matches!(run.server, Server::Pids(_)) {
        return Err(LoadtestError::Usage("--trigger signal needs --pid".into()));
    }
    let reconnect = match &args.reconnect_url {
        Some(url) => Some(Endpoint::parse(
            url,
            !run.endpoint.addr.ip().is_loopback(),
            &run.tls,
        )?),
        None => None,
    };
    let n = run.devices.len();
    let streams = run.open_all(None).await?;
    let draining = Arc::new(AtomicBool::new(false));
    let started = Arc::new(std::sync::OnceLock::<Instant>::new());
    let readers: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(device, stream)| {
            let (draining, started) = (draining.clone(), started.clone());
            let reconnect = reconnect.clone().map(|endpoint| {
                let path = run.stream_path(device);
                (endpoint, path, run.source(device))
            });
            tokio::spawn(until_closed(stream, draining, started, reconnect))
        })
        .collect();
    // Let every reader take its prelude before the drain begins.
    tokio::time::sleep(Duration::from_secs(1)).await;
    draining.store(true, Ordering::SeqCst);
    let begun = *started.get_or_init(Instant::now);
    match args.trigger {
        Trigger::Admin => {
            let mut stream = wire::open(&run.endpoint, None, None)
                .await
                .map_err(failed("cannot reach the admin endpoint"))?;
            let request = format!(
                "POST /admin/drain HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                run.endpoint.host
            );
            let (status, body) = wire::request(&mut stream, &mut Vec::new(), request.as_bytes())
                .await
                .map_err(failed("drain request"))?;
            if status != 202 {
                return Err(LoadtestError::Failed(format!(
                    "POST /admin/drain answered {status}: {}",
                    String::from_utf8_lossy(&body)
                )));
            }
        }
        Trigger::Signal => {
            if let Server::Pids(pids) = &run.server {
                for pid in pids {
                    // SAFETY: kill has no memory preconditions.
                    unsafe { libc::kill(*pid as libc::pid_t, libc::SIGTERM) };
                }
            }
        }
    }
    let results = tokio::time::timeout(args.wait, futures_util::future::join_all(readers))
        .await
        .map_err(|_| {
            LoadtestError::Failed(format!("not every stream closed within {:?}", args.wait))
        })?;
    let mut exited = None;
    while exited.is_none() && begun.elapsed() < args.wait {
        if !run.server.alive() {
            exited = Some(begun.elapsed().as_secs_f64());
        } else if !matches!(run.server, Server::Pids(_)) {
            break;
        } else {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let results: Vec<Closed> = results.into_iter().filter_map(Result::ok).collect();
    let mut closes: Vec<f64> = results.iter().filter_map(|r| r.closed_after).collect();
    closes.sort_by(f64::total_cmp);
    let retries: Vec<u64> = results.iter().filter_map(|r| r.retry_ms).collect();
    let reconnects: Vec<f64> = results
        .iter()
        .filter_map(|r| match reconnect {
            Some(_) => r.reconnected_after,
            None => {
                Some(r.closed_after? + r.retry_ms.unwrap_or(0).max(RETRY_FLOOR_MS) as f64 / 1000.0)
            }
        })
        .collect();
    let (first, last) = (
        closes.first().copied().unwrap_or(0.0),
        closes.last().copied().unwrap_or(0.0),
    );
    let close_rate = closes.len() as f64 / (last - first).max(1e-3);
    let quantile = |values: &[f64], q: f64| -> f64 {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        sorted
            .get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    let retry_seconds: Vec<f64> = retries.iter().map(|ms| *ms as f64 / 1000.0).collect();
    let peak_reconnects_per_second = per_second_peak(&reconnects);
    println!(
        "drain: {}/{n} streams closed: first {first:.2} s, last {last:.2} s after the drain \
         began ({close_rate:.0} closes/s); process gone after {}",
        closes.len(),
        exited.map_or("(unknown: give --pid)".to_string(), |s| format!("{s:.2} s")),
    );
    println!(
        "drain: {} clients got a drain retry: min {:.1} s, p50 {:.1} s, max {:.1} s; \
         reconnects ({}) from {:.1} s to {:.1} s, at most {peak_reconnects_per_second} in one second",
        retries.len(),
        quantile(&retry_seconds, 0.0),
        quantile(&retry_seconds, 0.5),
        quantile(&retry_seconds, 1.0),
        if reconnect.is_some() { "measured" } else { "close + retry" },
        quantile(&reconnects, 0.0),
        quantile(&reconnects, 1.0),
    );
    if let Some(path) = &run.plot {
        super::plot::histogram(
            path,
            &format!("posthorn drain: {n} connections, reconnects per second"),
            "seconds after the drain began",
            &reconnects,
        )
        .map_err(failed("cannot write the plot"))?;
    }
    emit(json!({
        "scenario": "drain",
        "peer": run.peer,
        "connections": n,
        "closed": closes.len(),
        "first_close_s": first,
        "last_close_s": last,
        "closes_per_second": close_rate,
        "exit_s": exited,
        "retries": retries.len(),
        "retry_min_s": quantile(&retry_seconds, 0.0),
        "retry_p50_s": quantile(&retry_seconds, 0.5),
        "retry_max_s": quantile(&retry_seconds, 1.0),
        "reconnects_measured": reconnect.is_some(),
        "reconnects": reconnects.len(),
        "reconnect_first_s": quantile(&reconnects, 0.0),
        "reconnect_last_s": quantile(&reconnects, 1.0),
        "reconnect_peak_per_second": peak_reconnects_per_second,
    }));
    Ok(())
}

/// Most values falling into one one-second bucket.
fn per_second_peak(seconds: &[f64]) -> usize {
    let mut buckets = std::collections::HashMap::<u64, usize>::new();
    for s in seconds {
        *buckets.entry(*s as u64).or_default() += 1;
    }
    buckets.values().copied().max().unwrap_or(0)
}

async fn until_closed(
    mut stream: wire::SseStream,
    draining: Arc<AtomicBool>,
    started: Arc<std::sync::OnceLock<Instant>>,
    reconnect: Option<(Endpoint, String, Option<std::net::IpAddr>)>,
) -> Closed {
    let mut buf = vec![0u8; 4096];
    let mut retries_before = 0;
    let mut retry_ms = None;
    loop {
        let open = stream.read_events(&mut buf, |_| {}).await.unwrap_or(false);
        if !draining.load(Ordering::SeqCst) {
            retries_before = stream.counters.retries_seen;
        } else if stream.counters.retries_seen > retries_before {
            retry_ms = stream.counters.last_retry;
        }
        if !open {
            break;
        }
    }
    let Some(begun) = started.get().copied() else {
        // Closed before the drain: not part of the measurement.
        return Closed {
            closed_after: None,
            retry_ms: None,
            reconnected_after: None,
        };
    };
    let closed_after = begun.elapsed().as_secs_f64();
    let mut reconnected_after = None;
    if let Some((endpoint, path, source)) = reconnect {
        let wait = retry_ms.unwrap_or(0).max(RETRY_FLOOR_MS);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        if wire::open_sse(&endpoint, source, &path, None, None, None)
            .await
            .is_ok()
        {
            reconnected_after = Some(begun.elapsed().as_secs_f64());
        }
    }
    Closed {
        closed_after: Some(closed_after),
        retry_ms,
        reconnected_after,
    }
}

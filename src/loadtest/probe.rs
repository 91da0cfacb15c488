//! Server memory and CPU, and the load tool's own CPU, from /proc. A server made of several
//! processes (nginx's master and workers) is summed; its workers share memory (nchan's message
//! store), so PSS — each shared page split between the processes using it — is reported beside
//! RSS. Without pids, posthorn's own `process_*` metrics are read over HTTP.

use std::time::Instant;

use serde::Serialize;

use super::{wire, Endpoint};

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Memory {
    pub rss_kib: u64,
    /// Equal to RSS when only `/metrics` was available.
    pub pss_kib: u64,
}

/// Where server figures come from.
#[derive(Debug, Clone)]
pub enum Server {
    Pids(Vec<u32>),
    Metrics(Endpoint),
    Unknown,
}

impl Server {
    pub async fn memory(&self) -> Option<Memory> {
        match self {
            Server::Pids(pids) => {
                let mut total = Memory::default();
                for pid in pids {
                    let rollup =
                        std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
                    total.rss_kib += kib_field(&rollup, "Rss:")?;
                    total.pss_kib += kib_field(&rollup, "Pss:")?;
                }
                Some(total)
            }
            Server::Metrics(endpoint) => {
                let bytes = metric(endpoint, "process_resident_memory_bytes").await? as u64;
                Some(Memory {
                    rss_kib: bytes / 1024,
                    pss_kib: bytes / 1024,
                })
            }
            Server::Unknown => None,
        }
    }

    /// CPU seconds used so far (user + system), summed over the processes.
    pub async fn cpu_seconds(&self) -> Option<f64> {
        match self {
            Server::Pids(pids) => pids.iter().map(|pid| process_cpu_seconds(*pid)).sum(),
            Server::Metrics(endpoint) => metric(endpoint, "process_cpu_seconds_total").await,
            Server::Unknown => None,
        }
    }

    pub fn alive(&self) -> bool {
        match self {
            Server::Pids(pids) => pids.iter().any(|pid| process_running(*pid)),
            _ => true,
        }
    }
}

/// A process that exited but was not yet reaped by its parent (a zombie) has stopped running.
fn process_running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat[stat.rfind(')')? + 1..].trim_start().chars().next()?;
            Some(!matches!(state, 'Z' | 'X'))
        })
        .unwrap_or(false)
}

fn kib_field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// utime + stime of a process, from /proc/PID/stat (fields 14 and 15, after the command name).
fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 2..];
    let mut fields = after_name.split(' ').skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some((user + system) as f64 / clock_ticks_per_second())
}

/// The value of a metric without labels from posthorn's `/metrics`.
pub async fn metric(endpoint: &Endpoint, name: &str) -> Option<f64> {
    let mut stream = wire::open(endpoint, None, None).await.ok()?;
    let request = format!(
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        endpoint.host
    );
    let mut buf = Vec::new();
    let (status, body) = wire::request(&mut stream, &mut buf, request.as_bytes())
        .await
        .ok()?;
    if status != 200 {
        return None;
    }
    String::from_utf8_lossy(&body).lines().find_map(|line| {
        line.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
    })
}

/// CPU used by the load tool and the server over one measured phase.
pub struct CpuMeter {
    started: Instant,
    tool_start: f64,
    server_start: Option<f64>,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CpuShare {
    pub wall_seconds: f64,
    /// Percent of one core.
    pub tool_percent: f64,
    pub server_percent: Option<f64>,
    /// The machine's cores, for reading the percentages.
    pub cores: usize,
}

impl CpuMeter {
    pub async fn start(server: &Server) -> Self {
        Self {
            started: Instant::now(),
            tool_start: process_cpu_seconds(std::process::id()).unwrap_or(0.0),
            server_start: server.cpu_seconds().await,
        }
    }

    pub async fn stop(&self, server: &Server) -> CpuShare {
        let wall_seconds = self.started.elapsed().as_secs_f64().max(1e-3);
        let tool = process_cpu_seconds(std::process::id()).unwrap_or(0.0) - self.tool_start;
        let server_used = match (self.server_start, server.cpu_seconds().await) {
            (Some(start), Some(end)) => Some(100.0 * (end - start) / wall_seconds),
            _ => None,
        };
        CpuShare {
            wall_seconds,
            tool_percent: 100.0 * tool / wall_seconds,
            server_percent: server_used,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl std::fmt::Display for CpuShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CPU over {:.1} s: load tool {:.0}% of a core",
            self.wall_seconds, self.tool_percent
        )?;
        if let Some(server) = self.server_percent {
            write!(f, ", server {server:.0}%")?;
        }
        write!(
            f,
            " (machine: {} cores = {}%)",
            self.cores,
            100 * self.cores
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_process() {
        let server = Server::Pids(vec![std::process::id()]);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let memory = runtime.block_on(server.memory()).expect("own smaps_rollup");
        assert!(memory.rss_kib > 100 && memory.pss_kib > 0, "{memory:?}");
        assert!(process_cpu_seconds(std::process::id()).is_some());
        assert!(server.alive());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let zombie = Server::Pids(vec![child.id()]);
        // `true` exits at once, but a busy machine may not run it for a while: wait for the
        // exit (bounded) instead of sleeping a fixed time.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while zombie.alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(!zombie.alive(), "exited but not reaped counts as gone");
        child.wait().unwrap();
    }
}

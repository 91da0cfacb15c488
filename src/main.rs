//! The `posthorn` binary: parse the command line, run, map errors to exit codes.

use clap::Parser;
use posthorn::cli::{self, Cli};

// jemalloc instead of glibc's malloc: glibc grows the heap of a worker thread's arena one
// `mprotect` per page (5 % of the hub's CPU while ten thousand streams open), and its allocator
// functions took three times jemalloc's share of a storm; jemalloc also keeps 9 % less per idle
// connection (docs/BENCHMARKS.md, "The allocator, again").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    if let Err(error) = cli::run(Cli::parse()) {
        eprintln!("posthorn: {error}");
        std::process::exit(error.exit_code());
    }
}

//! The `posthorn` binary: parse the command line, run, map errors to exit codes.

use clap::Parser;
use posthorn::cli::{self, Cli};

// glibc keeps freed memory of departed connections; mimalloc returns it and packs small
// per-connection allocations tighter (see docs/BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    if let Err(error) = cli::run(Cli::parse()) {
        eprintln!("posthorn: {error}");
        std::process::exit(error.exit_code());
    }
}

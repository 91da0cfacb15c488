//! The `posthorn` binary: parse the command line, run, map errors to exit codes.

use clap::Parser;
use posthorn::cli::{self, Cli};

// The system allocator (glibc) is deliberate: measured side by side it needed 17.1 KB per idle
// connection against mimalloc's 24.5 KB, and jemalloc and tcmalloc saved nothing
// (docs/BENCHMARKS.md).

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    if let Err(error) = cli::run(Cli::parse()) {
        eprintln!("posthorn: {error}");
        std::process::exit(error.exit_code());
    }
}

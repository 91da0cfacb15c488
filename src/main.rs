//! The `posthorn` binary: parse the command line, run, map errors to exit codes.

use clap::Parser;
use posthorn::{
    cli::{self, Cli},
    report::Report,
};

// jemalloc instead of glibc's malloc: glibc grows the heap of a worker thread's arena one
// `mprotect` per page (5 % of the hub's CPU while ten thousand streams open), and its allocator
// functions took three times jemalloc's share of a storm; jemalloc also keeps 9 % less per idle
// connection (docs/BENCHMARKS.md, "The allocator, again").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

// jemalloc returns freed pages to the kernel only while it is being asked for memory, so a hub
// that went quiet after a burst, or after many streams closed, kept every page it had freed
// (about 5 KB per stream after a batch of 100 broadcasts that 4,000 clients read). Its
// background thread purges them once they have been unused for the decay time (10 s).
// Read before `main` (jemalloc's compile-time `malloc_conf`, overriding its weak default).
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: Option<&'static std::ffi::c_char> =
    // SAFETY: a pointer to the first byte of a NUL-terminated static string, as jemalloc expects.
    Some(unsafe { &*c"background_thread:true,max_background_threads:1".as_ptr() });

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    if let Err(error) = cli::run(Cli::parse()) {
        eprintln!("posthorn: {}", Report(&error));
        std::process::exit(error.exit_code());
    }
}

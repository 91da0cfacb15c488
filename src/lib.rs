//! posthorn: a realtime event hub for fleets of point-of-sale terminals.
//!
//! Crate map (see `docs/ARCHITECTURE.md` for the message flow):
//! - [`model`]: device ids, event types, shards, positions and cursors (pure).
//! - [`sse`]: SSE framing and the response body that drains a connection's queue.
//! - [`backend`]: the backend trait and its implementations (embedded memory log).
//! - [`actors`]: StreamTail → Router → Connection, and Shutdown.
//! - [`http`]: the HTTP edge: stream, publish, operations, errors.
//! - [`config`]: the typed, validated configuration.
//! - [`metrics`]: every Prometheus metric.
//! - [`hub`]: wiring and the `serve` entry point.
//! - [`cli`]: the subcommands of the `posthorn` binary.
//! - [`loadtest`]: the load tester (`posthorn loadtest`).
//! - [`stop`]: the stop signal shared by long-running loops.

pub mod actors;
pub mod backend;
pub mod cli;
pub mod client;
pub mod config;
pub mod http;
pub mod hub;
pub mod loadtest;
pub mod metrics;
pub mod model;
pub mod replay;
pub mod sse;
pub mod stop;

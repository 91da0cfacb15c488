//! posthorn: a realtime event hub for fleets of point-of-sale terminals.
//!
//! Crate map, in layers: a module imports only from the layers above it in this list (checked
//! by `tests/layers.rs`; `docs/ARCHITECTURE.md` draws them with the message flow).
//! - [`model`]: device ids, event types, shards, positions, cursors, close and resync reasons
//!   (pure); [`stop`]: the stop signal of long-running loops; [`report`]: errors with their
//!   causes, for people; [`tls`]: certificates, keys and trusted CAs from PEM files. The reference client is its own crate, `posthorn-client` (`client/`).
//! - [`config`]: the typed, validated configuration.
//! - [`metrics`]: every Prometheus metric. [`pod`]: pod-wide state (draining, stream counts).
//! - [`sse`]: SSE framing and the items a stream's queue carries (pure).
//! - [`backend`]: the backend trait and its implementations (memory, Redis, NATS).
//! - [`replay`]: resumes, bounded and shared per shard.
//! - [`stream`]: one open SSE stream: its Connection actor, queue, body and control.
//! - [`actors`]: StreamTail → Router, and Shutdown.
//! - [`http`]: the HTTP edge: stream, publish, operations, errors, the server.
//! - [`hub`]: wiring and the `serve` entry point.
//! - [`loadtest`]: the load tester (`posthorn loadtest`).
//! - [`cli`]: the subcommands of the `posthorn` binary.

pub mod actors;
pub mod backend;
pub mod cli;
pub mod config;
pub mod http;
pub mod hub;
pub mod loadtest;
pub mod metrics;
pub mod model;
pub mod pod;
pub mod replay;
pub mod report;
pub mod sse;
pub mod stop;
pub mod stream;
pub mod tls;

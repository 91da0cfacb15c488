//! `posthorn tail`: the reference POS client (docs/client-contract.md) on the command line. One line per event on
//! stdout; connections, reconnects and resyncs are reported on stderr. A revoked token ends it
//! with exit status 3.

use std::{io::Write, path::PathBuf, time::Duration};

use serde_json::json;

use super::CliError;
use posthorn_client::{follow, ClientError, ClientOptions, Notice, Token};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// `id<TAB>type<TAB>data`, line breaks in data written as `\n`.
    Text,
    /// `{"id": ..., "type": ..., "data": ...}`.
    Json,
}

#[derive(Debug, clap::Args)]
pub struct TailArgs {
    /// The hub's base URL, e.g. http://127.0.0.1:8080 or https://hub.example.
    #[arg(long)]
    pub url: String,
    /// For https://: trust the certificate authorities in this PEM file instead of the system's.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// Device to follow.
    #[arg(long)]
    pub device: String,
    /// Bearer token (jwt auth); it cannot be refreshed, so its expiry ends the client.
    #[arg(long, conflicts_with = "token_file")]
    pub token: Option<String>,
    /// Read the bearer token from this file before every connection, and again after the hub
    /// ends a stream with `token_expired` or answers 401: keep it fresh and the client crosses
    /// token lifetimes without losing an event.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Keep the cursor here (at-least-once); without it, events missed while away are not
    /// replayed (at-most-once).
    #[arg(long, value_name = "FILE")]
    pub cursor_file: Option<PathBuf>,
    /// Do not acknowledge persisted cursors to the hub (by default, with --cursor-file, the
    /// newest is acknowledged at most once per second: POST /v1/devices/{device}/ack).
    #[arg(long)]
    pub no_ack: bool,
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
    /// The hub's heartbeat interval; silence for three of them means a dead connection.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub heartbeat: Duration,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    crate::config::parse_duration(text)
        .ok_or_else(|| format!("invalid duration {text:?} (e.g. 500ms, 20s, 1m)"))
}

pub fn run(args: TailArgs) -> Result<(), CliError> {
    let options = ClientOptions {
        base_url: args.url.trim_end_matches('/').to_string(),
        ca_file: args.ca_file,
        device: args.device,
        token: match (args.token, args.token_file) {
            (Some(token), _) => Token::Fixed(token),
            (None, Some(path)) => Token::file(path),
            (None, None) => Token::None,
        },
        cursor_file: args.cursor_file,
        heartbeat: args.heartbeat,
        ack: !args.no_ack,
    };
    let format = args.format;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| CliError::Failed(format!("cannot start the runtime: {error}")))?;
    match runtime.block_on(follow(options, move |notice| report(format, notice))) {
        Ok(()) => Ok(()),
        Err(ClientError::Revoked(reason)) => Err(CliError::Revoked(format!(
            "the hub revoked this device's token ({reason}): a new token must be issued"
        ))),
        Err(error) => Err(CliError::Failed(error.to_string())),
    }
}

fn report(format: Format, notice: Notice) {
    match notice {
        Notice::Event(event) => {
            let line = match format {
                Format::Text => format!(
                    "{}\t{}\t{}",
                    event.id.as_deref().unwrap_or(""),
                    event.event_type,
                    event.data.replace('\\', "\\\\").replace('\n', "\\n")
                ),
                Format::Json => {
                    json!({ "id": event.id, "type": event.event_type, "data": event.data })
                        .to_string()
                }
            };
            let mut stdout = std::io::stdout().lock();
            // A closed stdout (e.g. `| head`) ends the program like any other Unix filter.
            if writeln!(stdout, "{line}")
                .and_then(|()| stdout.flush())
                .is_err()
            {
                std::process::exit(0);
            }
        }
        Notice::Connected { resumed_from } => match resumed_from {
            Some(cursor) => eprintln!("connected, resuming after {cursor}"),
            None => eprintln!("connected"),
        },
        Notice::Resync { reason, id } => eprintln!(
            "resync ({reason}): reload state from the source of truth; continuing from {}",
            id.as_deref().unwrap_or("the head")
        ),
        Notice::Disconnected {
            reason,
            reconnect_in,
        } => {
            eprintln!(
                "disconnected: {reason}; reconnecting in {} ms",
                reconnect_in.as_millis()
            )
        }
    }
}

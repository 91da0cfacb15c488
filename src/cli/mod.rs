//! The `posthorn` command line (README.md): one file per subcommand.

pub mod config;
pub mod publish;
pub mod serve;
pub mod shard_key;
pub mod tail;
pub mod token;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use thiserror::Error;

use crate::{
    config::{env::ProcessEnv, Config, ConfigError},
    hub::ServeError,
    loadtest::LoadtestError,
};

#[derive(Debug, Parser)]
#[command(
    name = "posthorn",
    version,
    about = "Realtime event hub for fleets of POS terminals"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the hub (memory backend on 127.0.0.1:8080 by default).
    Serve(serve::ServeArgs),
    /// Publish one event through a hub's HTTP API.
    Publish(publish::PublishArgs),
    /// Print the shard and stream key of a device under the active configuration.
    ShardKey(shard_key::ShardKeyArgs),
    /// Follow a device's stream like a POS terminal (reference client).
    Tail(tail::TailArgs),
    /// Mint a JWT with the configured HS256 secret (device or scopes).
    Token(token::TokenArgs),
    /// Check, show or print the default configuration.
    Config(config::ConfigArgs),
    /// Load tester: idle, storm, fanout, slow, drain and resume scenarios against posthorn or
    /// nchan.
    // Boxed: the load tester's arguments are many times the size of the other commands'.
    Loadtest(Box<crate::loadtest::LoadtestArgs>),
}

#[derive(Debug, Error)]
pub enum CliError {
    #[error("configuration error")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Failed(String),
    /// `posthorn tail`: the device's token was revoked (exit status 3).
    #[error("{0}")]
    Revoked(String),
    #[error(transparent)]
    Loadtest(#[from] LoadtestError),
}

impl CliError {
    /// 64 (EX_USAGE) for anything the operator must fix in configuration or arguments.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Config(error) => error.exit_code(),
            CliError::Serve(ServeError::Unservable(_) | ServeError::Certificate(_))
            | CliError::Usage(_)
            | CliError::Loadtest(LoadtestError::Usage(_)) => 64,
            CliError::Serve(_)
            | CliError::Failed(_)
            | CliError::Loadtest(LoadtestError::Failed(_)) => 1,
            CliError::Revoked(_) => 3,
        }
    }
}

/// `--config PATH`, shared by every subcommand that reads the configuration.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArg {
    /// Configuration file (default: built-in defaults; see config/posthorn.toml).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
}

impl ConfigArg {
    pub fn load(&self) -> Result<Config, ConfigError> {
        Config::load(self.config.as_deref(), &ProcessEnv)
    }
}

pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Publish(args) => publish::run(args),
        Command::ShardKey(args) => shard_key::run(args),
        Command::Tail(args) => tail::run(args),
        Command::Token(args) => token::run(args),
        Command::Config(args) => config::run(args),
        Command::Loadtest(args) => Ok(crate::loadtest::run(*args)?),
    }
}

//! `posthorn config check | show | default`: the configuration as the hub would run with it,
//! without running it (docs/operations.md, "Configuration commands").

use clap::Subcommand;

use super::{serve::Overrides, CliError, ConfigArg};
use crate::{config::REFERENCE_FILE, hub};

#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    #[command(subcommand)]
    pub command: ConfigCommand,
}

/// The configuration `serve` would run with the same arguments.
#[derive(Debug, clap::Args)]
pub struct Source {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(flatten)]
    pub overrides: Overrides,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration (file, POSTHORN_* environment and serve's flags) and read
    /// every file it names, as `serve` does before connecting; exit 0, or 64 naming the key at
    /// fault.
    Check(Source),
    /// Print the effective configuration (defaults, file, environment and serve's flags) as
    /// TOML, secrets redacted.
    Show(Source),
    /// Print the reference file: every key with its default and what it means.
    Default,
}

pub fn run(args: ConfigArgs) -> Result<(), CliError> {
    match args.command {
        ConfigCommand::Check(source) => {
            let config = source.overrides.load(&source.config)?;
            hub::check_servable(&config)?;
            hub::check_files(&config)?;
            let from = source
                .config
                .config
                .as_deref()
                .map_or("built-in defaults".to_string(), |path| {
                    path.display().to_string()
                });
            println!(
                "configuration ok: {from} with the environment, backend {}, listening on {}{}",
                config.backend.kind.as_str(),
                config.server.listen,
                if config.server.tls_files().is_some() {
                    " (https)"
                } else {
                    ""
                }
            );
            Ok(())
        }
        ConfigCommand::Show(source) => {
            let config = source.overrides.load(&source.config)?;
            let text = toml::to_string_pretty(&config.as_file()).map_err(|error| {
                CliError::Failed(format!("cannot write the configuration: {error}"))
            })?;
            let secret = if config.auth.jwt_secret.is_empty() {
                "empty"
            } else {
                "set, not shown"
            };
            println!(
                "# posthorn config show: the effective configuration (defaults, file, POSTHORN_* \
                 environment).\n# Secrets are not shown: auth.jwt_secret is {secret}; the \
                 user-info of URLs reads (redacted)."
            );
            print!("{text}");
            Ok(())
        }
        ConfigCommand::Default => {
            print!("{REFERENCE_FILE}");
            Ok(())
        }
    }
}

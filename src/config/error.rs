//! What can go wrong while loading the configuration, and the exit code for it.

use std::fmt;
use std::path::PathBuf;

/// Where a key came from, for the unknown-key message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyOrigin {
    /// A configuration file (path or other label).
    File(String),
    /// An environment variable (its full name).
    Env(String),
}

impl fmt::Display for KeyOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyOrigin::File(path) => write!(f, "in {path}"),
            KeyOrigin::Env(name) => write!(f, "(from environment variable {name})"),
        }
    }
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid toml in {origin}: {message}")]
    Syntax { origin: String, message: String },
    #[error("unknown configuration key {key} {origin}")]
    UnknownKey { key: String, origin: KeyOrigin },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

impl ConfigError {
    /// Process exit code for a bad configuration (EX_USAGE from sysexits.h).
    pub const EXIT_CODE: i32 = 64;

    /// Same as [`ConfigError::EXIT_CODE`], for callers holding an error value.
    pub fn exit_code(&self) -> i32 {
        Self::EXIT_CODE
    }

    /// The dotted key the error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. } | ConfigError::Invalid { key, .. } => Some(key),
            ConfigError::Io { .. } | ConfigError::Syntax { .. } => None,
        }
    }
}

/// The error of a value that parsed but breaks a rule of its key: "<section>.<key>: <message>".
pub(crate) fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

//! The environment overlay: `POSTHORN_<SECTION>__<KEY>` variables layered on
//! top of the file, read through [`EnvSource`] so tests can pass a map instead
//! of mutating the process environment.
//!
//! Each variable's string is converted by the type of the key's default value
//! in the schema (see `raw::schema`), so adding a key to `raw.rs` makes it
//! overridable without touching this file.

use std::collections::{BTreeMap, HashMap};

use toml::{Table, Value};

use super::{ConfigError, KeyOrigin};

/// Prefix of every variable the overlay looks at.
pub const PREFIX: &str = "POSTHORN_";
/// Separator between section and key, doubled so that keys may contain `_`.
pub const SEPARATOR: &str = "__";

/// Where environment variables come from.
pub trait EnvSource {
    /// All variables as (name, value) pairs, in any order.
    fn vars(&self) -> Vec<(String, String)>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn vars(&self) -> Vec<(String, String)> {
        // `std::env::vars()` panics on a non-unicode variable anywhere in the
        // environment, including ones that are none of our business.
        std::env::vars_os()
            .filter_map(|(name, value)| {
                let name = name.into_string().ok()?;
                Some((name, value.to_string_lossy().into_owned()))
            })
            .collect()
    }
}

impl EnvSource for HashMap<String, String> {
    fn vars(&self) -> Vec<(String, String)> {
        self.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

impl EnvSource for BTreeMap<String, String> {
    fn vars(&self) -> Vec<(String, String)> {
        self.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

impl EnvSource for Vec<(String, String)> {
    fn vars(&self) -> Vec<(String, String)> {
        self.clone()
    }
}

impl EnvSource for [(&str, &str)] {
    fn vars(&self) -> Vec<(String, String)> {
        self.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

/// Overlay every `POSTHORN_<SECTION>__<KEY>` variable of `env` onto `table`
/// (the parsed file), converting values by the type found in `schema`.
///
/// Variables are applied in name order so that, with several bad variables,
/// the reported one does not depend on the environment's iteration order.
pub fn apply(table: &mut Table, schema: &Table, env: &dyn EnvSource) -> Result<(), ConfigError> {
    let mut vars = env.vars();
    vars.sort();
    for (name, value) in vars {
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        // Without the separator it is a variable like POSTHORN_LOG that other
        // parts of the program own.
        let Some((section, key)) = rest.split_once(SEPARATOR) else {
            continue;
        };
        let section = section.to_ascii_lowercase();
        let key = key.to_ascii_lowercase();
        let dotted = format!("{section}.{key}");
        let Some(default) = schema
            .get(&section)
            .and_then(Value::as_table)
            .and_then(|keys| keys.get(&key))
        else {
            return Err(ConfigError::UnknownKey {
                key: dotted,
                origin: KeyOrigin::Env(name),
            });
        };
        let converted = convert(&dotted, &name, &value, default)?;
        let slot = table
            .entry(section)
            .or_insert_with(|| Value::Table(Table::new()));
        match slot {
            Value::Table(keys) => {
                keys.insert(key, converted);
            }
            // The file check runs before the overlay and rejects a section
            // that is not a table, so this only guards against misuse.
            other => {
                return Err(ConfigError::Invalid {
                    key: dotted.split('.').next().unwrap_or_default().to_string(),
                    message: format!("expected a table (got {other})"),
                })
            }
        }
    }
    Ok(())
}

/// Convert one variable's text to the TOML type of `default`.
fn convert(dotted: &str, name: &str, text: &str, default: &Value) -> Result<Value, ConfigError> {
    let invalid = |what: &str| ConfigError::Invalid {
        key: dotted.to_string(),
        message: format!("{what} in environment variable {name} (got {text:?})"),
    };
    match default {
        Value::Integer(_) => text
            .trim()
            .parse::<i64>()
            .map(Value::Integer)
            .map_err(|_| invalid("expected an integer")),
        Value::Boolean(_) => match text.trim() {
            "true" => Ok(Value::Boolean(true)),
            "false" => Ok(Value::Boolean(false)),
            _ => Err(invalid("expected true or false")),
        },
        Value::Array(_) => Ok(Value::Array(split_list(text))),
        Value::String(_) => Ok(Value::String(text.to_string())),
        // The schema only holds the four types above (a test in raw.rs checks).
        _ => Err(invalid("unsupported key type")),
    }
}

/// Comma-separated list; the empty string is the empty list, and blank items
/// (from a trailing comma) are dropped rather than becoming "" entries.
fn split_list(text: &str) -> Vec<Value> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| Value::String(item.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::raw;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Variables without the double underscore, or without the prefix, are
    /// left alone.
    #[test]
    fn ignores_foreign_variables() {
        let mut table = Table::new();
        let vars = env(&[
            ("POSTHORN_LOG", "debug"),
            ("PATH", "/bin"),
            ("RUST_LOG", "x"),
        ]);
        apply(&mut table, &raw::schema(), &vars).expect("ignored");
        assert!(table.is_empty());
    }

    /// Values are converted by the type of the default and lists are split.
    #[test]
    fn converts_by_schema_type() {
        let mut table = Table::new();
        let vars = env(&[
            ("POSTHORN_SSE__QUEUE_LIMIT", " 100 "),
            ("POSTHORN_SERVER__INSECURE", "true"),
            (
                "POSTHORN_SERVER__CORS_ORIGINS",
                "https://a.example, http://b.example,",
            ),
            ("POSTHORN_REDIS__URLS", ""),
        ]);
        apply(&mut table, &raw::schema(), &vars).expect("valid");
        assert_eq!(table["sse"]["queue_limit"], Value::Integer(100));
        assert_eq!(table["server"]["insecure"], Value::Boolean(true));
        assert_eq!(
            table["server"]["cors_origins"],
            Value::Array(vec![
                Value::String("https://a.example".into()),
                Value::String("http://b.example".into())
            ])
        );
        assert_eq!(table["redis"]["urls"], Value::Array(vec![]));
    }

    /// A non-numeric integer names the key, the variable and the value.
    #[test]
    fn bad_integer_names_key() {
        let mut table = Table::new();
        let vars = env(&[("POSTHORN_SSE__QUEUE_LIMIT", "lots")]);
        let err = apply(&mut table, &raw::schema(), &vars).expect_err("invalid");
        let text = err.to_string();
        assert!(text.starts_with("sse.queue_limit: "), "{text}");
        assert!(text.contains("POSTHORN_SSE__QUEUE_LIMIT"), "{text}");
        assert!(text.contains("\"lots\""), "{text}");
    }

    /// A bool accepts only true or false.
    #[test]
    fn bad_bool_names_key() {
        let mut table = Table::new();
        let vars = env(&[("POSTHORN_REDIS__CLUSTER", "yes")]);
        let err = apply(&mut table, &raw::schema(), &vars).expect_err("invalid");
        assert!(err.to_string().starts_with("redis.cluster: "), "{err}");
    }

    /// An unknown section is an unknown key too.
    #[test]
    fn unknown_section_is_unknown_key() {
        let mut table = Table::new();
        let vars = env(&[("POSTHORN_NOPE__X", "1")]);
        let err = apply(&mut table, &raw::schema(), &vars).expect_err("unknown");
        assert_eq!(
            err.to_string(),
            "unknown configuration key nope.x (from environment variable POSTHORN_NOPE__X)"
        );
    }
}

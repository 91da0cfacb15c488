//! How an error is shown to a person (logs, `/admin/status`, HTTP error messages): its own
//! message, then the message of each source, joined by `: `.
//!
//! Error types keep what caused them as a `#[source]` instead of formatting it into their own
//! message, so code can still look at the cause; [`Report`] puts the chain back together where a
//! person reads it.

use std::{error::Error, fmt};

/// Displays an error with every source behind it.
pub struct Report<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading the stream failed")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_report_names_every_cause() {
        let error = Outer(std::io::Error::other("connection reset"));
        assert_eq!(error.to_string(), "reading the stream failed");
        assert_eq!(
            Report(&error).to_string(),
            "reading the stream failed: connection reset"
        );
    }
}

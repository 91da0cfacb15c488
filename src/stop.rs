//! The stop signal of long-running loops (stream tails, HTTP accept loops): a `watch` that turns
//! true once.

use std::time::Duration;

use tokio::sync::watch;

/// Sleeps unless stopped first; true when stopped.
pub async fn sleep_or_stop(delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = stop.wait_for(|stopped| *stopped) => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

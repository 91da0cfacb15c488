//! The stop signal of long-running loops (stream tails, HTTP accept loops): a `watch` that turns
//! true once, and the handle that turns it.

use std::time::Duration;

use tokio::sync::watch;

/// Sleeps unless stopped first; true when stopped.
pub async fn sleep_or_stop(delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = stop.wait_for(|stopped| *stopped) => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

/// Turns a stop signal true; cheap to clone. The HTTP server hands one to the Shutdown actor, so
/// the actors need not know the server.
#[derive(Clone)]
pub struct StopHandle(watch::Sender<bool>);

impl StopHandle {
    /// A handle and the signal it turns.
    pub fn new() -> (Self, watch::Receiver<bool>) {
        let (sender, receiver) = watch::channel(false);
        (Self(sender), receiver)
    }

    pub fn stop(&self) {
        self.0.send_replace(true);
    }
}

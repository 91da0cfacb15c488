//! When to reconnect (docs/client-contract.md): honour the server's `retry:` but never sooner
//! than 1 s; after a healthy connection wait `retry` plus a random 0-100 % of it, so the
//! terminals of a pod that crashed do not all come back in the same instant; after consecutive
//! failures back off exponentially with full jitter up to 60 s; start over after a healthy
//! connection. A 503's `Retry-After` is a floor too.

use std::time::Duration;

use rand::Rng;

pub const FLOOR: Duration = Duration::from_secs(1);
pub const CAP: Duration = Duration::from_secs(60);
/// A connection that lasted this long, delivered an event, or was ended by the server itself
/// (a drain), was healthy.
pub const HEALTHY_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct ReconnectPolicy {
    /// The last `retry:` the server sent (its own default until then).
    retry: Duration,
    /// Consecutive failed or unhealthy connections.
    failures: u32,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        Self {
            retry: Duration::from_secs(3),
            failures: 0,
        }
    }
}

impl ReconnectPolicy {
    pub fn set_retry(&mut self, retry: Duration) {
        self.retry = retry;
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The wait before the next attempt after a connection ended (`healthy` or not), given the
    /// server's `Retry-After` if it sent one.
    pub fn next_delay(
        &mut self,
        healthy: bool,
        retry_after: Option<Duration>,
        rng: &mut impl Rng,
    ) -> Duration {
        let delay = if healthy {
            self.failures = 0;
            let retry = self.retry.max(FLOOR);
            retry + retry.mul_f64(rng.random::<f64>())
        } else {
            self.failures = self.failures.saturating_add(1);
            // Full jitter: uniform in [0, min(cap, retry · 2^failures)], then the floor.
            let ceiling = self
                .retry
                .max(FLOOR)
                .saturating_mul(1u32 << self.failures.min(16))
                .min(CAP);
            ceiling.mul_f64(rng.random::<f64>())
        };
        delay
            .max(retry_after.unwrap_or_default())
            .clamp(FLOOR, CAP.max(retry_after.unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a healthy connection: `retry` plus 0-100 % of it, `retry` raised to 1 s first.
    fn assert_healthy_delay(delay: Duration, retry: Duration) {
        assert!(
            delay >= retry && delay <= retry * 2,
            "{delay:?} for {retry:?}"
        );
    }

    /// Delays never go below 1 s nor above 60 s, grow with failures, and reset when healthy.
    #[test]
    fn delays_are_bounded_and_back_off() {
        let mut rng = rand::rng();
        let mut policy = ReconnectPolicy::default();
        policy.set_retry(Duration::from_millis(10));
        assert_healthy_delay(policy.next_delay(true, None, &mut rng), FLOOR);
        policy.set_retry(Duration::from_secs(2));
        assert_healthy_delay(
            policy.next_delay(true, None, &mut rng),
            Duration::from_secs(2),
        );
        for round in 1..=12u32 {
            let delay = policy.next_delay(false, None, &mut rng);
            let ceiling = Duration::from_secs(2).saturating_mul(1 << round).min(CAP);
            assert!(
                delay >= FLOOR && delay <= ceiling.max(FLOOR),
                "round {round}: {delay:?}"
            );
        }
        assert_eq!(policy.failures(), 12);
        let mut many = Vec::new();
        for _ in 0..200 {
            many.push(policy.next_delay(false, None, &mut rng));
        }
        assert!(
            many.iter().any(|d| *d > Duration::from_secs(30)),
            "the cap is reached"
        );
        assert!(many.iter().all(|d| *d <= CAP));
        assert_healthy_delay(
            policy.next_delay(true, None, &mut rng),
            Duration::from_secs(2),
        );
        assert_eq!(policy.failures(), 0);
    }

    /// The first reconnect after a healthy connection is spread: a fleet told the same `retry`
    /// does not come back in one instant.
    #[test]
    fn healthy_reconnects_are_jittered() {
        let mut rng = rand::rng();
        let mut policy = ReconnectPolicy::default();
        policy.set_retry(Duration::from_secs(3));
        let delays: Vec<Duration> = (0..100)
            .map(|_| policy.next_delay(true, None, &mut rng))
            .collect();
        for delay in &delays {
            assert_healthy_delay(*delay, Duration::from_secs(3));
        }
        let spread = delays
            .iter()
            .max()
            .unwrap()
            .saturating_sub(*delays.iter().min().unwrap());
        assert!(spread > Duration::from_secs(1), "{spread:?}");
    }

    /// `Retry-After` from a 503 is honoured even beyond the cap.
    #[test]
    fn retry_after_is_a_floor() {
        let mut rng = rand::rng();
        let mut policy = ReconnectPolicy::default();
        let delay = policy.next_delay(false, Some(Duration::from_secs(90)), &mut rng);
        assert_eq!(delay, Duration::from_secs(90));
    }
}

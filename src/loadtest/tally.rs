//! Exact delivery accounting: per connection, which sequence numbers arrived (a bitset, so loss,
//! duplicates and order violations are counted exactly), and end-to-end latency in shared HDR
//! histograms (striped, so ten thousand readers do not queue on one lock).

use std::sync::Mutex;

use hdrhistogram::Histogram;

use super::payload::{now_us, Stamp, Target};

const STRIPES: usize = 16;
/// Latencies are recorded in microseconds up to ten minutes.
const MAX_LATENCY_US: u64 = 600_000_000;

/// What one connection expects and received.
#[derive(Debug, Clone)]
pub struct Tally {
    /// Device index of this connection.
    device: u64,
    /// The group of ten it joined (`g1-<index>`), if any.
    group: Option<u64>,
    seen: Vec<u64>,
    highest: Option<u64>,
    pub received: u64,
    pub distinct: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
    /// Payloads meant for another device or for a group it is not in, or with a sequence beyond
    /// the plan.
    pub misrouted: u64,
}

impl Tally {
    pub fn new(device: u64, group: Option<u64>, expected: u64) -> Self {
        Self {
            device,
            group,
            seen: vec![0; expected.div_ceil(64) as usize],
            highest: None,
            received: 0,
            distinct: 0,
            duplicates: 0,
            out_of_order: 0,
            misrouted: 0,
        }
    }

    pub fn record(&mut self, stamp: Stamp) {
        self.received += 1;
        let foreign = match stamp.target {
            Target::Device(device) => device != self.device,
            Target::Group(group) => self.group != Some(group),
            Target::Broadcast => false,
        };
        if foreign {
            self.misrouted += 1;
            return;
        }
        let (word, bit) = ((stamp.seq / 64) as usize, stamp.seq % 64);
        let Some(slot) = self.seen.get_mut(word) else {
            self.misrouted += 1;
            return;
        };
        if *slot & (1 << bit) != 0 {
            self.duplicates += 1;
            return;
        }
        *slot |= 1 << bit;
        self.distinct += 1;
        if self.highest.is_some_and(|highest| stamp.seq < highest) {
            self.out_of_order += 1;
        }
        self.highest = Some(self.highest.map_or(stamp.seq, |h| h.max(stamp.seq)));
    }
}

/// Sums over connections.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct Totals {
    pub expected: u64,
    pub received: u64,
    pub distinct: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
    pub misrouted: u64,
}

impl Totals {
    pub fn add(&mut self, tally: &Tally, expected: u64) {
        self.expected += expected;
        self.received += tally.received;
        self.distinct += tally.distinct;
        self.lost += expected.saturating_sub(tally.distinct);
        self.duplicates += tally.duplicates;
        self.out_of_order += tally.out_of_order;
        self.misrouted += tally.misrouted;
    }

    pub fn lossless(&self) -> bool {
        self.lost == 0 && self.duplicates == 0 && self.out_of_order == 0 && self.misrouted == 0
    }
}

/// End-to-end latency (publisher's batch built → reader's read returned), microseconds.
pub struct Latencies {
    stripes: Vec<Mutex<Histogram<u64>>>,
}

impl Default for Latencies {
    fn default() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| Mutex::new(new_histogram())).collect(),
        }
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("static histogram bounds")
}

impl Latencies {
    /// Records the stamps of one read (all received at the same instant).
    pub fn record(&self, reader: usize, sent_us: &[u64]) {
        if sent_us.is_empty() {
            return;
        }
        let now = now_us();
        let mut histogram = self.stripes[reader % STRIPES]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for sent in sent_us {
            histogram.saturating_record(now.saturating_sub(*sent).clamp(1, MAX_LATENCY_US));
        }
    }

    pub fn merged(&self) -> Histogram<u64> {
        let mut all = new_histogram();
        for stripe in &self.stripes {
            let stripe = stripe.lock().unwrap_or_else(|p| p.into_inner());
            all.add(&*stripe).expect("same bounds");
        }
        all
    }
}

/// p50/p99/p99.9/max in milliseconds.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct LatencySummary {
    pub samples: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl LatencySummary {
    pub fn of(histogram: &Histogram<u64>) -> Self {
        let ms = |us: u64| us as f64 / 1000.0;
        Self {
            samples: histogram.len(),
            p50_ms: ms(histogram.value_at_quantile(0.5)),
            p99_ms: ms(histogram.value_at_quantile(0.99)),
            p999_ms: ms(histogram.value_at_quantile(0.999)),
            max_ms: ms(histogram.max()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(seq: u64, target: Target) -> Stamp {
        Stamp {
            seq,
            sent_us: 0,
            target,
        }
    }

    #[test]
    fn counts_loss_duplicates_order_and_misrouting() {
        let mut tally = Tally::new(3, None, 10);
        for seq in [0, 1, 3, 2, 3, 5] {
            tally.record(stamp(seq, Target::Device(3)));
        }
        tally.record(stamp(6, Target::Device(4)));
        tally.record(stamp(7, Target::Broadcast));
        tally.record(stamp(99, Target::Broadcast));
        let mut totals = Totals::default();
        totals.add(&tally, 10);
        assert_eq!(totals.received, 9);
        assert_eq!(totals.distinct, 6); // 0 1 2 3 5 7
        assert_eq!(totals.lost, 4); // 4 6 8 9
        assert_eq!(totals.duplicates, 1);
        assert_eq!(totals.out_of_order, 1); // 2 after 3
        assert_eq!(totals.misrouted, 2); // device 4, seq 99
        assert!(!totals.lossless());
    }

    /// A member counts its group's events; another group's, or any group's for a stream in
    /// none, are misrouted.
    #[test]
    fn group_events_of_other_groups_are_misrouted() {
        let mut member = Tally::new(25, Some(2), 4);
        for seq in [0, 1, 1, 3] {
            member.record(stamp(seq, Target::Group(2)));
        }
        member.record(stamp(2, Target::Group(3)));
        let mut outsider = Tally::new(25, None, 0);
        outsider.record(stamp(0, Target::Group(2)));
        let mut totals = Totals::default();
        totals.add(&member, 4);
        totals.add(&outsider, 0);
        assert_eq!(totals.distinct, 3);
        assert_eq!(totals.lost, 1);
        assert_eq!(totals.duplicates, 1);
        assert_eq!(totals.misrouted, 2);
    }

    #[test]
    fn latency_quantiles() {
        let latencies = Latencies::default();
        let now = now_us();
        latencies.record(0, &[now - 1_000; 99]);
        latencies.record(5, &[now - 100_000]);
        let summary = LatencySummary::of(&latencies.merged());
        assert_eq!(summary.samples, 100);
        assert!(summary.p50_ms >= 1.0 && summary.p50_ms < 2.0, "{summary:?}");
        assert!(summary.max_ms >= 100.0, "{summary:?}");
    }
}

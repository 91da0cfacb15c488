//! A rotation of connections for periodic work: the Router's heartbeats and stall check, the
//! Fleet's progress samples and session refreshes.
//!
//! Every connection joins one of many small slices when it registers. The owner's timer visits
//! one slice per tick, so a pod pings a few dozen connections every 25 ms instead of a large
//! share of them at once. A burst of pings is a burst of writes on the workers, and every event
//! queued behind it waits: with one tenth of 10,000 connections pinged every 2 s, the bursts were
//! visible in the unicast p99 (docs/BENCHMARKS.md).
//!
//! Members are not removed when their connection goes: a visit drops the ones that are gone (the
//! heartbeat's visit finds their route gone or taken over, the stall check their body dropped,
//! the Fleet's its stream gone), so a member outlives its connection by one period at most and
//! unregistering costs nothing.

use std::time::Duration;

/// Target time between two ticks.
pub const TICK: Duration = Duration::from_millis(25);
/// More slices than this would only make ticks emptier (a 20 s heartbeat needs 800).
const MAX_SLICES: u32 = 4096;

/// The members' slices, visited in turn: `M` is what the owner keeps of a connection.
#[derive(Debug)]
pub struct Rotation<M> {
    slices: Vec<Vec<M>>,
    /// One tick per slice: every member is visited once per `period`.
    period: Duration,
    joined: usize,
}

impl<M> Rotation<M> {
    /// A rotation that visits every member once per `period`, one slice per tick.
    pub fn new(period: Duration) -> Self {
        let slices = (period.as_nanos() / TICK.as_nanos()).clamp(1, MAX_SLICES as u128) as usize;
        Self {
            slices: (0..slices).map(|_| Vec::new()).collect(),
            period,
            joined: 0,
        }
    }

    /// Time between two visits of a member.
    pub fn period(&self) -> Duration {
        self.period
    }

    pub fn slices(&self) -> usize {
        self.slices.len()
    }

    /// Time between ticks so that all slices are visited once per period.
    pub fn tick_interval(&self) -> Duration {
        self.period / self.slices.len() as u32
    }

    /// Slices to visit per tick so that all of them are visited once per `every` (at least one).
    pub fn slices_per_tick(&self, every: Duration) -> usize {
        let ticks = every.as_secs_f64() / self.tick_interval().as_secs_f64();
        ((self.slices() as f64 / ticks).ceil() as usize).clamp(1, self.slices())
    }

    /// Adds a member, round robin, so slices differ in size by one at most.
    pub fn join(&mut self, member: M) {
        let slice = self.joined % self.slices.len();
        self.joined = self.joined.wrapping_add(1);
        self.slices[slice].push(member);
    }

    /// Visits every member of slice `index`; those for which `keep` answers false leave.
    pub fn visit(&mut self, index: usize, keep: impl FnMut(&M) -> bool) {
        let count = self.slices.len();
        let slice = &mut self.slices[index % count];
        slice.retain(keep);
        // A slice that emptied after a burst of connections must not pin its storage.
        if slice.capacity() > 2 * slice.len() + 8 {
            slice.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_follow_the_period() {
        assert_eq!(Rotation::<u64>::new(Duration::from_secs(20)).slices(), 800);
        assert_eq!(Rotation::<u64>::new(Duration::from_millis(100)).slices(), 4);
        assert_eq!(Rotation::<u64>::new(Duration::from_millis(10)).slices(), 1);
        assert_eq!(
            Rotation::<u64>::new(Duration::from_secs(3600)).slices(),
            4096
        );
        let rotation = Rotation::<u64>::new(Duration::from_secs(20));
        assert_eq!(rotation.tick_interval(), Duration::from_millis(25));
        assert_eq!(rotation.slices_per_tick(Duration::from_secs(1)), 20);
        // Ticks of 879 ms: 3,600 of the 4,096 slices per tick cover all of them within 1 s.
        let slow = Rotation::<u64>::new(Duration::from_secs(3600));
        let per_tick = slow.slices_per_tick(Duration::from_secs(1));
        assert!(per_tick as f64 * (1.0 / slow.tick_interval().as_secs_f64()) >= 4096.0);
        assert!(per_tick <= 4096);
    }

    #[test]
    fn every_member_is_visited_once_per_round_in_small_slices() {
        let mut rotation = Rotation::<u64>::new(Duration::from_secs(1));
        assert_eq!(rotation.slices(), 40);
        for n in 0..1000 {
            rotation.join(n);
        }
        let mut seen = vec![0u32; 1000];
        for index in 0..rotation.slices() {
            let mut in_slice = 0;
            rotation.visit(index, |m| {
                seen[*m as usize] += 1;
                in_slice += 1;
                true
            });
            assert_eq!(in_slice, 25, "slice {index}");
        }
        assert!(seen.iter().all(|&visits| visits == 1), "{seen:?}");
    }

    #[test]
    fn members_that_are_not_kept_leave() {
        let mut rotation = Rotation::<u64>::new(Duration::from_millis(50));
        for n in 0..10 {
            rotation.join(n);
        }
        for index in 0..rotation.slices() {
            rotation.visit(index, |m| *m % 2 == 0);
        }
        assert_eq!(rotation.slices.iter().map(Vec::len).sum::<usize>(), 5);
        let mut left = Vec::new();
        for index in 0..rotation.slices() {
            rotation.visit(index, |m| {
                left.push(*m);
                true
            });
        }
        left.sort();
        assert_eq!(left, vec![0, 2, 4, 6, 8]);
    }
}

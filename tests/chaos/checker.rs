//! The checker: a pure function from a [`History`] to a [`Report`].
//!
//! The promise to a terminal: every event of its device once and in order, or an explicit
//! `resync` before anything after the gap. Per device, a *segment* is the span between resyncs;
//! a connection opened without a cursor (the device's first) also starts one, at the moment
//! its answer was seen. Tokens are published in *series* (the unicasts of one device; the
//! broadcasts; the events of one group), each strictly sequentially: token `n + 1` is not sent
//! before token `n` has its final answer. A device must receive its own unicasts, the broadcasts
//! and the events of the groups it names on every connect (fixed for the run); a group event,
//! like a broadcast, is a copy per shard with another id on each. Violations:
//!
//! - `Phantom`: an event whose token was never attempted (or was attempted for another device,
//!   or whose publish was answered as definitely not appended).
//! - `Misrouted`: an event of a group the device is not a member of.
//! - `Duplicate`: a token received twice within one segment. Across a resync it is only counted
//!   (`duplicate_across_resync`): the application reloaded its state in between.
//! - `OutOfOrder`: within a segment, a series' tokens must increase, and within one epoch the
//!   ids' positions must strictly increase.
//! - `WrongId`: a unicast acknowledged with id X arrives with another id of the same epoch (or
//!   with an id that does not parse or names another shard).
//! - `Gap`: within a segment, an acknowledged token lies between two received tokens of its
//!   series but was not received there; and at the end of the run, in the device's last
//!   segment, every acknowledged token whose publish started after the segment began, and every
//!   acknowledged token after the first token of its series received in that segment, must have
//!   been received.
//! - `UnexpectedResync`: a resync with reason `invalid` (the clients only send real cursors).
//!
//! Each violation is attributed to a fault: one visible on an event to the last fault injected
//! before the device processed it; a gap to the first fault injected after the publish of the
//! last token of that series the device received before the gap (the series stopped
//! progressing there; publish time, because a lagging reader processes it much later), or, if
//! none came before the gap was seen, to the last fault before it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use serde::Serialize;

use super::history::{
    show_time, Attempt, DeviceHistory, EventId, History, Micros, Observation, Outcome, Pos, Series,
    Token,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum ViolationKind {
    Phantom,
    Misrouted,
    Duplicate,
    OutOfOrder,
    WrongId,
    Gap,
    UnexpectedResync,
}

#[derive(Clone, Debug, Serialize)]
pub struct Violation {
    pub kind: ViolationKind,
    pub device: String,
    /// When it became visible (a gap at the end: when the first missing token was acknowledged).
    pub at: Micros,
    /// The span in which it arose: an event's violation at once; a gap from the publish of the
    /// last token of its series the device received before it to the processing of the next one
    /// (or the end of the run). It is attributed to the first fault injected in that span, or
    /// else to the last fault before it.
    pub window: (Micros, Micros),
    /// The fault it is attributed to (a fault kind's label, or [`NO_FAULT`]).
    pub fault: String,
    /// The device's segment (0-based) it happened in.
    pub segment: usize,
    /// The observation that started that segment, if any.
    pub segment_start: Option<usize>,
    /// The device observation concerned: the offending event, or the one after a gap.
    pub observation: Option<usize>,
    /// Tokens concerned (for a gap: the missing ones, in order).
    pub tokens: Vec<Token>,
    pub detail: String,
}

/// Counts attributed to one fault kind (or to the time before the first fault).
#[derive(Clone, Debug, Default, Serialize)]
pub struct FaultStats {
    pub fault: String,
    pub injected: u64,
    /// Resyncs devices processed after such a fault (before the next one), by reason.
    pub resyncs: BTreeMap<String, u64>,
    /// Events devices processed after such a fault.
    pub events: u64,
    pub violations: BTreeMap<ViolationKind, u64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub seed: u64,
    pub backend: String,
    pub devices: usize,
    /// Publish attempts by final outcome (`acked`, `failed`, `unknown`).
    pub attempts: BTreeMap<String, u64>,
    pub events_checked: u64,
    /// Of those, events of a group the device is a member of (each member's copy counts).
    pub group_events_checked: u64,
    pub resyncs: BTreeMap<String, u64>,
    /// A token received again after a resync (tolerated: the application reloaded its state).
    pub duplicate_across_resync: u64,
    /// Consecutive events of one segment whose ids name different epochs: the data changed
    /// lives and no resync said so. Not a violation by itself (a gap, if any, is one).
    pub epoch_changes_without_resync: u64,
    /// The first few of those, for the summary: device, time, observation, old and new epoch.
    pub epoch_change_examples: Vec<String>,
    pub per_fault: Vec<FaultStats>,
    pub violations: Vec<Violation>,
}

/// The label of the time before the first fault.
pub const NO_FAULT: &str = "(before any fault)";

impl Report {
    pub fn violation_counts(&self) -> BTreeMap<ViolationKind, u64> {
        let mut counts = BTreeMap::new();
        for v in &self.violations {
            *counts.entry(v.kind).or_default() += 1;
        }
        counts
    }

    pub fn is_clean(&self) -> bool {
        self.violations.is_empty()
    }

    /// The human summary: totals, a table per fault kind, and every violation's kind with up to
    /// `examples` explained with the device's history around it.
    pub fn summary(&self, history: &History, examples: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "chaos run: backend {}, seed {}, {} devices, {} faults, publishing {}, end {}",
            self.backend,
            self.seed,
            self.devices,
            history.faults.len(),
            fmt_map(&self.attempts),
            show_time(history.ended),
        );
        let _ = writeln!(
            out,
            "events checked {} (group events {}), resyncs {}, duplicates across a resync {}, epoch changes without resync {}",
            self.events_checked,
            self.group_events_checked,
            fmt_map(&self.resyncs),
            self.duplicate_across_resync,
            self.epoch_changes_without_resync,
        );
        for example in &self.epoch_change_examples {
            let _ = writeln!(out, "  epoch changed without resync: {example}");
        }
        let _ = writeln!(
            out,
            "{:<22} {:>8} {:>8}  {:<34} violations",
            "fault", "injected", "events", "resyncs seen after it"
        );
        for stats in &self.per_fault {
            let violations: BTreeMap<String, u64> = stats
                .violations
                .iter()
                .map(|(k, v)| (format!("{k:?}"), *v))
                .collect();
            let _ = writeln!(
                out,
                "{:<22} {:>8} {:>8}  {:<34} {}",
                stats.fault,
                stats.injected,
                stats.events,
                fmt_map(&stats.resyncs),
                fmt_map(&violations),
            );
        }
        let counts: BTreeMap<String, u64> = self
            .violation_counts()
            .iter()
            .map(|(k, v)| (format!("{k:?}"), *v))
            .collect();
        let _ = writeln!(
            out,
            "VIOLATIONS: {} ({})",
            self.violations.len(),
            fmt_map(&counts)
        );
        for v in &self.violations {
            let _ = writeln!(
                out,
                "  {:?} {} at {} (seg {}, after {}): {}",
                v.kind,
                v.device,
                show_time(v.at),
                v.segment,
                v.fault,
                v.detail
            );
        }
        // One example per kind first, then more of any kind.
        let mut chosen: Vec<&Violation> = Vec::new();
        let mut kinds_shown = HashSet::new();
        for v in &self.violations {
            if kinds_shown.insert(v.kind) {
                chosen.push(v);
            }
        }
        for v in &self.violations {
            if chosen.len() >= examples.max(kinds_shown.len()) {
                break;
            }
            if !chosen.iter().any(|c| std::ptr::eq(*c, v)) {
                chosen.push(v);
            }
        }
        for v in chosen.into_iter().take(examples.max(kinds_shown.len())) {
            out.push_str(&explain(history, v));
        }
        out
    }

    /// One line of JSON: the counts, the per-fault table and the first violations.
    pub fn json_line(&self) -> String {
        let sample: Vec<serde_json::Value> = self
            .violations
            .iter()
            .take(20)
            .map(|v| {
                serde_json::json!({
                    "kind": v.kind, "device": v.device, "at_ms": v.at / 1000,
                    "fault": v.fault, "tokens": v.tokens.len(), "detail": v.detail,
                })
            })
            .collect();
        serde_json::json!({
            "chaos": {
                "seed": self.seed,
                "backend": self.backend,
                "devices": self.devices,
                "attempts": self.attempts,
                "events_checked": self.events_checked,
                "group_events_checked": self.group_events_checked,
                "resyncs": self.resyncs,
                "duplicate_across_resync": self.duplicate_across_resync,
                "epoch_changes_without_resync": self.epoch_changes_without_resync,
                "per_fault": self.per_fault,
                "violations": self.violation_counts(),
                "violations_total": self.violations.len(),
                "violations_sample": sample,
            }
        })
        .to_string()
    }
}

fn fmt_map<K: std::fmt::Display, V: std::fmt::Display>(map: &BTreeMap<K, V>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Tokens, attempts and acknowledged tokens per series.
struct Index<'h> {
    attempts: HashMap<&'h Token, &'h Attempt>,
    /// Acknowledged tokens of each series, by number.
    acked: HashMap<&'h Series, Vec<(u64, &'h Attempt)>>,
}

impl<'h> Index<'h> {
    fn new(history: &'h History) -> Self {
        let mut attempts = HashMap::new();
        let mut acked: HashMap<&Series, Vec<(u64, &Attempt)>> = HashMap::new();
        for attempt in &history.attempts {
            attempts.insert(&attempt.token, attempt);
            if matches!(attempt.outcome, Outcome::Acked { .. }) {
                acked
                    .entry(&attempt.token.series)
                    .or_default()
                    .push((attempt.token.n, attempt));
            }
        }
        for list in acked.values_mut() {
            list.sort_by_key(|(n, _)| *n);
        }
        Self { attempts, acked }
    }

    fn acked(&self, series: &Series) -> &[(u64, &'h Attempt)] {
        self.acked.get(series).map_or(&[], Vec::as_slice)
    }
}

/// Attribution of times to the fault injected last before them.
struct Buckets {
    starts: Vec<(Micros, String)>,
}

impl Buckets {
    fn new(history: &History) -> Self {
        let mut starts: Vec<(Micros, String)> = history
            .faults
            .iter()
            .map(|f| (f.started, f.kind.clone()))
            .collect();
        starts.sort();
        Self { starts }
    }

    fn label(&self, at: Micros) -> &str {
        match self.starts.partition_point(|(start, _)| *start <= at) {
            0 => NO_FAULT,
            i => &self.starts[i - 1].1,
        }
    }

    /// The first fault started within `window`, or else the last one before it.
    fn cause(&self, window: (Micros, Micros)) -> &str {
        let first = self.starts.partition_point(|(start, _)| *start < window.0);
        match self.starts.get(first) {
            Some((start, label)) if *start <= window.1 => label,
            _ => self.label(window.1),
        }
    }
}

/// One segment of one device while it is being checked.
#[derive(Default)]
struct Segment {
    start: Micros,
    start_obs: Option<usize>,
    seen: HashMap<Token, usize>,
    /// Per series: (token number, observation index, time) in processing order.
    received: BTreeMap<Series, Vec<(u64, usize, Micros)>>,
    max_n: HashMap<Series, u64>,
    /// Epoch, position and observation of the last event with a parseable id.
    last_pos: Option<(Option<String>, Pos, usize)>,
}

struct Acc<'r> {
    report: &'r mut Report,
    per_fault: BTreeMap<String, FaultStats>,
}

impl Acc<'_> {
    fn stats(&mut self, label: &str) -> &mut FaultStats {
        self.per_fault
            .entry(label.to_string())
            .or_insert_with(|| FaultStats {
                fault: label.to_string(),
                ..FaultStats::default()
            })
    }
}

/// Checks a whole run.
pub fn check(history: &History) -> Report {
    let index = Index::new(history);
    let buckets = Buckets::new(history);
    let mut report = Report {
        seed: history.seed,
        backend: history.backend.clone(),
        devices: history.devices.len(),
        ..Report::default()
    };
    for attempt in &history.attempts {
        let outcome = match attempt.outcome {
            Outcome::Acked { .. } => "acked",
            Outcome::Failed => "failed",
            Outcome::Unknown => "unknown",
        };
        *report.attempts.entry(outcome.into()).or_default() += 1;
    }
    let mut acc = Acc {
        report: &mut report,
        per_fault: BTreeMap::new(),
    };
    acc.stats(NO_FAULT);
    for fault in &history.faults {
        acc.stats(&fault.kind).injected += 1;
    }
    let mut violations = Vec::new();
    for device in &history.devices {
        let segments = walk(device, &index, &buckets, &mut acc, &mut violations);
        gaps_within(device, &segments, &index, &mut violations);
        if let Some(last) = segments.last() {
            let s = segments.len() - 1;
            gaps_at_end(device, s, last, &index, history.ended, &mut violations);
        }
    }
    violations.sort_by(|a, b| (a.at, &a.device).cmp(&(b.at, &b.device)));
    for v in &mut violations {
        v.fault = buckets.cause(v.window).to_string();
        *acc.stats(&v.fault).violations.entry(v.kind).or_default() += 1;
    }
    // The time before the first fault, then the kinds in the order they were first injected.
    let mut order: Vec<String> = vec![NO_FAULT.to_string()];
    for fault in &history.faults {
        if !order.contains(&fault.kind) {
            order.push(fault.kind.clone());
        }
    }
    let mut per_fault = std::mem::take(&mut acc.per_fault);
    report.per_fault = order
        .iter()
        .filter_map(|label| per_fault.remove(label))
        .collect();
    report.violations = violations;
    report
}

/// Walks one device's observations: segments, and every violation visible on a single event.
fn walk(
    device: &DeviceHistory,
    index: &Index,
    buckets: &Buckets,
    acc: &mut Acc,
    violations: &mut Vec<Violation>,
) -> Vec<Segment> {
    let own = Series::Unicast(device.device.clone());
    let mut segments: Vec<Segment> = Vec::new();
    // Tokens received in earlier segments.
    let mut before: HashSet<Token> = HashSet::new();
    for (i, observed) in device.observations.iter().enumerate() {
        let at = observed.at;
        let starts_segment = match &observed.what {
            Observation::Connected {
                cursor: None,
                status: Some(200),
                ..
            } => true,
            Observation::Resync { .. } => true,
            Observation::Event { .. } => segments.is_empty(),
            Observation::Connected { .. } | Observation::Closed { .. } => false,
        };
        if starts_segment {
            if let Some(last) = segments.last() {
                before.extend(last.seen.keys().cloned());
            }
            let start_obs = (!matches!(observed.what, Observation::Event { .. })).then_some(i);
            segments.push(Segment {
                start: at,
                start_obs,
                ..Segment::default()
            });
        }
        let mut found: Vec<(ViolationKind, Vec<Token>, String)> = Vec::new();
        match &observed.what {
            Observation::Connected { .. } | Observation::Closed { .. } => {}
            Observation::Resync { reason, id, .. } => {
                *acc.report.resyncs.entry(reason.clone()).or_default() += 1;
                *acc.stats(buckets.label(at))
                    .resyncs
                    .entry(reason.clone())
                    .or_default() += 1;
                if reason == "invalid" {
                    found.push((
                        ViolationKind::UnexpectedResync,
                        Vec::new(),
                        format!(
                            "resync invalid (id {}): the device only sends cursors the hub gave it",
                            id.as_deref().unwrap_or("none")
                        ),
                    ));
                }
            }
            Observation::Event { id, data, .. } => {
                acc.report.events_checked += 1;
                acc.stats(buckets.label(at)).events += 1;
                let seg = segments.last_mut().expect("a segment exists");
                event(
                    device, &own, index, seg, &before, acc, i, at, id, data, &mut found,
                );
            }
        }
        let segment = segments.len().saturating_sub(1);
        let segment_start = segments.last().and_then(|s| s.start_obs);
        for (kind, tokens, detail) in found {
            violations.push(Violation {
                kind,
                device: device.device.clone(),
                at,
                window: (at, at),
                fault: String::new(),
                segment,
                segment_start,
                observation: Some(i),
                tokens,
                detail,
            });
        }
    }
    segments
}

/// Checks one event against its segment and records it there.
#[allow(clippy::too_many_arguments)]
fn event(
    device: &DeviceHistory,
    own: &Series,
    index: &Index,
    seg: &mut Segment,
    before: &HashSet<Token>,
    acc: &mut Acc,
    i: usize,
    at: Micros,
    id: &Option<String>,
    data: &str,
    found: &mut Vec<(ViolationKind, Vec<Token>, String)>,
) {
    let token = Token::parse(data);
    let attempt = token.as_ref().and_then(|t| index.attempts.get(t).copied());
    let (Some(token), Some(attempt)) = (token, attempt) else {
        let shown: String = data.chars().take(40).collect();
        found.push((
            ViolationKind::Phantom,
            Vec::new(),
            format!("event data {shown:?} (id {id:?}): no publish attempt carried it"),
        ));
        return;
    };
    let one = vec![token.clone()];
    match &token.series {
        Series::Broadcast => {}
        Series::Unicast(_) if token.series == *own => {}
        Series::Unicast(_) => {
            found.push((
                ViolationKind::Phantom,
                one,
                format!("{token} was published for another device"),
            ));
            return;
        }
        Series::Group(group) if device.groups.contains(group) => {
            acc.report.group_events_checked += 1;
        }
        Series::Group(group) => {
            found.push((
                ViolationKind::Misrouted,
                one,
                format!(
                    "{token} is an event of group {group}; the device is a member of {:?} only",
                    device.groups
                ),
            ));
            return;
        }
    }
    if attempt.outcome == Outcome::Failed {
        found.push((
            ViolationKind::Phantom,
            one.clone(),
            format!(
                "{token} was answered as not appended ({}) yet delivered",
                attempt.answers.join(", ")
            ),
        ));
    }
    if let Some(&first) = seg.seen.get(&token) {
        found.push((
            ViolationKind::Duplicate,
            one,
            format!("{token} again (first as observation {first} in this segment)"),
        ));
        return;
    }
    if before.contains(&token) {
        acc.report.duplicate_across_resync += 1;
    }
    seg.seen.insert(token.clone(), i);
    if let Some(&max) = seg.max_n.get(&token.series) {
        if token.n < max {
            found.push((
                ViolationKind::OutOfOrder,
                one.clone(),
                format!(
                    "{token} after token {max} of the {} in one segment",
                    token.series
                ),
            ));
        }
    }
    let max = seg.max_n.entry(token.series.clone()).or_insert(token.n);
    *max = (*max).max(token.n);
    match id.as_deref().and_then(EventId::parse) {
        None => found.push((
            ViolationKind::WrongId,
            one.clone(),
            format!("{token} arrived with id {id:?}, which is no event id"),
        )),
        Some(eid) => {
            let wrong_shard = eid.shard != device.shard;
            if wrong_shard {
                found.push((
                    ViolationKind::WrongId,
                    one.clone(),
                    format!(
                        "{token} arrived with id {eid} of shard {}, the device is on shard {}",
                        eid.shard, device.shard
                    ),
                ));
            }
            match &seg.last_pos {
                Some((epoch, pos, j)) if *epoch == eid.epoch && eid.pos <= *pos => {
                    found.push((
                        ViolationKind::OutOfOrder,
                        one.clone(),
                        format!(
                            "{token} id {eid} is not after position {pos} (observation {j}) of the same epoch"
                        ),
                    ));
                }
                Some((epoch, _, _)) if *epoch == eid.epoch => {}
                Some((epoch, _, j)) => {
                    acc.report.epoch_changes_without_resync += 1;
                    if acc.report.epoch_change_examples.len() < 8 {
                        acc.report.epoch_change_examples.push(format!(
                            "{} at {} (observation {i}, after {j}): {} -> {}",
                            device.device,
                            show_time(at),
                            epoch.as_deref().unwrap_or("?"),
                            eid.epoch.as_deref().unwrap_or("?")
                        ));
                    }
                }
                None => {}
            }
            seg.last_pos = Some((eid.epoch.clone(), eid.pos, i));
            if let (Series::Unicast(_), Some(ack)) = (&token.series, attempt.acked_id()) {
                let comparable = match &ack.epoch {
                    Some(epoch) => eid.epoch.as_ref() == Some(epoch),
                    // An external ack names no epoch: comparable only when a single try can
                    // have stored the token once.
                    None => attempt.tries == 1,
                };
                if comparable && !wrong_shard && !ack.same_place(&eid) {
                    found.push((
                        ViolationKind::WrongId,
                        one.clone(),
                        format!("{token} was acknowledged as {ack}, arrived as {eid}"),
                    ));
                }
            }
        }
    }
    seg.received
        .entry(token.series.clone())
        .or_default()
        .push((token.n, i, at));
}

/// Acknowledged tokens strictly between the smallest and largest received token of their
/// series in one segment, not received in it.
fn gaps_within(
    device: &DeviceHistory,
    segments: &[Segment],
    index: &Index,
    violations: &mut Vec<Violation>,
) {
    for (s, seg) in segments.iter().enumerate() {
        for (series, received) in &seg.received {
            let mut got: Vec<(u64, usize, Micros)> = received.clone();
            got.sort_by_key(|r| r.0);
            let (lo, hi) = (got[0].0, got[got.len() - 1].0);
            let numbers: HashSet<u64> = got.iter().map(|r| r.0).collect();
            // Missing tokens grouped by the received token that follows them.
            let mut by_next: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
            for &(n, _) in index.acked(series) {
                if n > lo && n < hi && !numbers.contains(&n) {
                    let next = got.partition_point(|r| r.0 < n);
                    by_next.entry(next).or_default().push(n);
                }
            }
            for (next, missing) in by_next {
                let (next_n, next_obs, next_at) = got[next];
                let prev_n = got[next - 1].0;
                let since = published(index, series, prev_n).unwrap_or(seg.start);
                let tokens: Vec<Token> = missing.iter().map(|&n| token_of(series, n)).collect();
                violations.push(Violation {
                    kind: ViolationKind::Gap,
                    device: device.device.clone(),
                    at: next_at,
                    window: (since.min(next_at), next_at),
                    fault: String::new(),
                    segment: s,
                    segment_start: seg.start_obs,
                    observation: Some(next_obs),
                    detail: format!(
                        "{} acknowledged token(s) {} of the {series} missing between received {} and {} in one segment",
                        tokens.len(),
                        span(&tokens),
                        prev_n,
                        next_n
                    ),
                    tokens,
                });
            }
        }
    }
}

/// The series whose every acknowledged token the device must receive: its unicasts, the
/// broadcasts and the events of its groups.
fn expected_series(device: &DeviceHistory) -> Vec<Series> {
    let mut series = vec![Series::Unicast(device.device.clone()), Series::Broadcast];
    series.extend(device.groups.iter().cloned().map(Series::Group));
    series
}

/// The acknowledged tokens the device's last segment must hold once everything is quiet.
fn expected_at_end<'h>(
    seg: &Segment,
    series: &Series,
    index: &Index<'h>,
) -> Vec<(u64, &'h Attempt)> {
    let first = seg
        .received
        .get(series)
        .and_then(|r| r.first())
        .map(|r| r.0);
    index
        .acked(series)
        .iter()
        .filter(|(n, attempt)| attempt.started > seg.start || first.is_some_and(|f| *n > f))
        .copied()
        .collect()
}

fn gaps_at_end(
    device: &DeviceHistory,
    s: usize,
    seg: &Segment,
    index: &Index,
    ended: Micros,
    violations: &mut Vec<Violation>,
) {
    for series in expected_series(device) {
        let received = seg.received.get(&series).map_or(&[][..], Vec::as_slice);
        let numbers: HashSet<u64> = received.iter().map(|r| r.0).collect();
        let lo = numbers.iter().min().copied().unwrap_or(0);
        let hi = numbers.iter().max().copied().unwrap_or(0);
        let first = received.first().map(|r| r.0);
        let acked = index.acked(&series);
        // Runs of missing tokens that are consecutive among the acknowledged ones.
        let mut runs: Vec<Vec<&Attempt>> = Vec::new();
        let mut previous_missing = false;
        for (n, attempt) in expected_at_end(seg, &series, index) {
            // Already reported as a gap inside the segment.
            let inside = n > lo && n < hi;
            let missing = !numbers.contains(&n) && !inside;
            if missing {
                let position = acked.partition_point(|(m, _)| *m < n);
                let adjacent = previous_missing
                    && position > 0
                    && runs
                        .last()
                        .and_then(|r| r.last())
                        .is_some_and(|last| last.token.n == acked[position - 1].0);
                if adjacent {
                    runs.last_mut().expect("a run").push(attempt);
                } else {
                    runs.push(vec![attempt]);
                }
            }
            previous_missing = missing;
        }
        for run in runs {
            let tokens: Vec<Token> = run.iter().map(|a| a.token.clone()).collect();
            // Since the last token of the series received before the run was published, or the
            // segment start.
            let since = received
                .iter()
                .map(|r| r.0)
                .filter(|&n| n < run[0].token.n)
                .max()
                .and_then(|n| published(index, &series, n))
                .unwrap_or(seg.start);
            let why = match first {
                Some(f) => format!(
                    "published after the segment began at {} or after token {f}, the first received in it",
                    show_time(seg.start)
                ),
                None => format!(
                    "published after the segment began at {}; nothing of the series received in it",
                    show_time(seg.start)
                ),
            };
            violations.push(Violation {
                kind: ViolationKind::Gap,
                device: device.device.clone(),
                at: run[0].finished,
                window: (since, ended.max(since)),
                fault: String::new(),
                segment: s,
                segment_start: seg.start_obs,
                observation: None,
                detail: format!(
                    "{} acknowledged token(s) {} of the {series} never received by the end: {why}",
                    tokens.len(),
                    span(&tokens),
                ),
                tokens,
            });
        }
    }
}

/// When the publish of token `n` of `series` started.
fn published(index: &Index, series: &Series, n: u64) -> Option<Micros> {
    index
        .attempts
        .get(&token_of(series, n))
        .map(|attempt| attempt.started)
}

fn token_of(series: &Series, n: u64) -> Token {
    Token {
        series: series.clone(),
        n,
    }
}

fn span(tokens: &[Token]) -> String {
    match tokens {
        [] => String::new(),
        [one] => one.to_string(),
        [first, .., last] => format!("{first}..{}", last.n),
    }
}

/// Devices (and series) whose last segment has not yet received the last token it must hold:
/// empty once everything acknowledged has arrived. For the quiet period at the end of a run.
pub fn lagging(history: &History) -> Vec<String> {
    let index = Index::new(history);
    let buckets = Buckets::new(history);
    let mut scratch = Report::default();
    let mut acc = Acc {
        report: &mut scratch,
        per_fault: BTreeMap::new(),
    };
    let mut lagging = Vec::new();
    for device in &history.devices {
        let segments = walk(device, &index, &buckets, &mut acc, &mut Vec::new());
        let Some(seg) = segments.last() else {
            lagging.push(format!("{}: never connected", device.device));
            continue;
        };
        for series in expected_series(device) {
            let expected = expected_at_end(seg, &series, &index);
            let Some((last, _)) = expected.last() else {
                continue;
            };
            let received = seg.received.get(&series).map_or(&[][..], Vec::as_slice);
            if !received.iter().any(|r| r.0 == *last) {
                lagging.push(format!(
                    "{}: waits for {}",
                    device.device,
                    token_of(&series, *last)
                ));
            }
        }
    }
    lagging
}

/// A violation with the device's history around it, the faults near it and the publish
/// attempts of its tokens.
pub fn explain(history: &History, v: &Violation) -> String {
    let mut out = String::new();
    let device = history.devices.iter().find(|d| d.device == v.device);
    let (behaviour, shard) = device.map_or(("?", 0), |d| (d.behaviour.as_str(), d.shard));
    let groups = device.map_or(String::new(), |d| d.groups.join(","));
    let _ = writeln!(
        out,
        "--- {:?} on {} ({behaviour}, shard {shard}, groups [{groups}]) at {}, segment {}, after {}: {}",
        v.kind,
        v.device,
        show_time(v.at),
        v.segment,
        v.fault,
        v.detail
    );
    let window_start = v.at.saturating_sub(15_000_000);
    for fault in &history.faults {
        if fault.started >= window_start && fault.started <= v.at + 2_000_000 {
            let _ = writeln!(
                out,
                "    fault {} at {} (healed {}): {}",
                fault.kind,
                show_time(fault.started),
                show_time(fault.finished),
                fault.detail
            );
        }
    }
    if let Some(device) = device {
        let obs = &device.observations;
        let show = |out: &mut String, range: std::ops::Range<usize>, mark: Option<usize>| {
            for j in range {
                let marker = if Some(j) == mark { ">>" } else { "  " };
                let _ = writeln!(out, "  {marker} [{j}] {}", obs[j]);
            }
        };
        if let Some(start) = v.segment_start {
            let _ = writeln!(out, "  segment began with:");
            show(
                &mut out,
                start.saturating_sub(3)..(start + 2).min(obs.len()),
                Some(start),
            );
        }
        match v.observation {
            Some(i) => {
                let _ = writeln!(out, "  around it:");
                show(
                    &mut out,
                    i.saturating_sub(10)..(i + 4).min(obs.len()),
                    Some(i),
                );
            }
            None => {
                let _ = writeln!(out, "  last observations:");
                show(&mut out, obs.len().saturating_sub(8)..obs.len(), None);
            }
        }
    }
    for token in v.tokens.iter().take(4) {
        if let Some(a) = history.attempts.iter().find(|a| &a.token == token) {
            let _ = writeln!(
                out,
                "    publish {} via {:?}: {}..{} tries {} -> {:?} [{}]",
                a.token,
                a.via,
                show_time(a.started),
                show_time(a.finished),
                a.tries,
                a.outcome,
                a.answers.join(", ")
            );
        }
    }
    if v.tokens.len() > 4 {
        let _ = writeln!(out, "    ... and {} more tokens", v.tokens.len() - 4);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::history::{FaultRecord, Observed, Via};
    use super::*;

    const SEC: Micros = 1_000_000;
    const DEV: &str = "d1";

    const STORE: &str = "store-1";

    /// Builds histories by hand: one device `d1` on shard 1, a member of [`STORE`], ids
    /// `e1.1.<pos>-0` by default.
    struct Build {
        history: History,
        conn: u32,
    }

    fn id(epoch: &str, pos: u64) -> String {
        format!("{epoch}.1.{pos}-0")
    }

    impl Build {
        fn new() -> Self {
            let mut history = History::default();
            history.devices.push(DeviceHistory {
                device: DEV.into(),
                shard: 1,
                groups: vec![STORE.into()],
                behaviour: "steady".into(),
                observations: Vec::new(),
            });
            Self { history, conn: 0 }
        }

        fn attempt(&mut self, token: Token, started: Micros, outcome: Outcome) -> &mut Self {
            self.history.attempts.push(Attempt {
                token,
                via: Via::Http,
                started,
                finished: started + 1000,
                tries: 1,
                outcome,
                answers: vec!["201".into()],
            });
            self
        }

        /// Unicast `n` of `d1` published at `started`, acknowledged at position `pos` of `e1`.
        fn acked(&mut self, n: u64, started: Micros, pos: u64) -> &mut Self {
            let outcome = Outcome::Acked {
                id: EventId::parse(&id("e1", pos)).unwrap(),
                duplicate: false,
            };
            self.attempt(Token::unicast(DEV, n), started, outcome)
        }

        fn acked_b(&mut self, n: u64, started: Micros) -> &mut Self {
            let outcome = Outcome::Acked {
                id: EventId::parse(&format!("e1.0.{}-0", 1000 + n)).unwrap(),
                duplicate: false,
            };
            self.attempt(Token::broadcast(n), started, outcome)
        }

        /// Event `n` of `group` published at `started`; the answer names the copy on shard 0.
        fn acked_g(&mut self, group: &str, n: u64, started: Micros) -> &mut Self {
            let outcome = Outcome::Acked {
                id: EventId::parse(&format!("e1.0.{}-0", 2000 + n)).unwrap(),
                duplicate: false,
            };
            self.attempt(Token::group(group, n), started, outcome)
        }

        fn observe(&mut self, at: Micros, what: Observation) -> &mut Self {
            self.history.devices[0]
                .observations
                .push(Observed { at, what });
            self
        }

        fn connect(&mut self, at: Micros, cursor: Option<&str>) -> &mut Self {
            self.conn += 1;
            let what = Observation::Connected {
                conn: self.conn,
                endpoint: "nginx".into(),
                cursor: cursor.map(String::from),
                status: Some(200),
            };
            self.observe(at, what)
        }

        fn event(&mut self, at: Micros, data: &str, id: &str) -> &mut Self {
            let what = Observation::Event {
                conn: self.conn,
                id: Some(id.into()),
                kind: "t".into(),
                data: data.into(),
            };
            self.observe(at, what)
        }

        /// Unicast `n` of `d1` received at position `pos` of `e1`.
        fn got(&mut self, at: Micros, n: u64, pos: u64) -> &mut Self {
            self.event(at, &format!("u:{DEV}:{n}|pad"), &id("e1", pos))
        }

        fn got_b(&mut self, at: Micros, n: u64, pos: u64) -> &mut Self {
            self.event(at, &format!("b:{n}"), &id("e1", pos))
        }

        /// The copy of event `n` of `group` on the device's shard, at position `pos` of `e1`.
        fn got_g(&mut self, at: Micros, group: &str, n: u64, pos: u64) -> &mut Self {
            self.event(at, &format!("g:{group}:{n}|pad"), &id("e1", pos))
        }

        fn resync(&mut self, at: Micros, reason: &str, id: &str) -> &mut Self {
            let what = Observation::Resync {
                conn: self.conn,
                id: Some(id.into()),
                reason: reason.into(),
            };
            self.observe(at, what)
        }

        fn closed(&mut self, at: Micros) -> &mut Self {
            let what = Observation::Closed {
                conn: self.conn,
                why: "test".into(),
            };
            self.observe(at, what)
        }

        fn fault(&mut self, kind: &str, at: Micros) -> &mut Self {
            self.history.faults.push(FaultRecord {
                kind: kind.into(),
                started: at,
                finished: at + 1000,
                detail: String::new(),
            });
            self
        }

        fn check(&self) -> Report {
            check(&self.history)
        }
    }

    fn kinds(report: &Report) -> Vec<ViolationKind> {
        report.violations.iter().map(|v| v.kind).collect()
    }

    /// Three unicasts and a broadcast, all received once in order, across a reconnect with the
    /// cursor: clean.
    fn clean() -> Build {
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked(2, 2 * SEC, 20)
            .acked_b(1, 2 * SEC)
            .acked(3, 3 * SEC, 30)
            .got(SEC + 10, 1, 10)
            .got(2 * SEC + 10, 2, 20)
            .closed(2 * SEC + 20)
            .connect(2 * SEC + 30, Some(&id("e1", 20)))
            .got_b(2 * SEC + 40, 1, 25)
            .got(3 * SEC + 10, 3, 30);
        b
    }

    #[test]
    fn a_clean_history_has_no_violations() {
        let report = clean().check();
        assert!(report.is_clean(), "{:?}", report.violations);
        assert_eq!(report.events_checked, 4);
        assert_eq!(report.attempts.get("acked"), Some(&4));
    }

    #[test]
    fn phantom_events_are_found() {
        let mut b = clean();
        b.got(4 * SEC, 9, 40);
        assert_eq!(kinds(&b.check()), [ViolationKind::Phantom]);

        let mut b = clean();
        b.event(4 * SEC, "no token here", &id("e1", 40));
        assert_eq!(kinds(&b.check()), [ViolationKind::Phantom]);

        // A token of another device is a phantom for this one.
        let mut b = clean();
        b.attempt(
            Token::unicast("d2", 1),
            3 * SEC,
            Outcome::Acked {
                id: EventId::parse("e1.2.35-0").unwrap(),
                duplicate: false,
            },
        )
        .event(4 * SEC, "u:d2:1", &id("e1", 35));
        assert_eq!(kinds(&b.check()), [ViolationKind::Phantom]);
    }

    #[test]
    fn a_token_answered_as_not_appended_must_not_arrive() {
        let mut b = clean();
        b.attempt(Token::unicast(DEV, 4), 4 * SEC, Outcome::Failed)
            .got(4 * SEC + 10, 4, 40);
        assert_eq!(kinds(&b.check()), [ViolationKind::Phantom]);
        // Unknown outcomes may or may not arrive.
        let mut b = clean();
        b.attempt(Token::unicast(DEV, 4), 4 * SEC, Outcome::Unknown)
            .got(4 * SEC + 10, 4, 40);
        assert!(b.check().is_clean());
    }

    #[test]
    fn duplicates_within_a_segment_are_violations_across_a_resync_they_are_counted() {
        let mut b = clean();
        b.got(3 * SEC + 20, 3, 30);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Duplicate]);

        let mut b = clean();
        b.resync(3 * SEC + 20, "data_lost", &id("e2", 0))
            .got(3 * SEC + 30, 3, 30);
        let report = b.check();
        assert!(report.is_clean(), "{:?}", report.violations);
        assert_eq!(report.duplicate_across_resync, 1);
        assert_eq!(report.resyncs.get("data_lost"), Some(&1));
    }

    #[test]
    fn tokens_of_a_series_must_increase_within_a_segment() {
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked(2, 2 * SEC, 20)
            .got(3 * SEC, 2, 20)
            .got(3 * SEC + 10, 1, 30);
        let report = b.check();
        assert!(
            kinds(&report).contains(&ViolationKind::OutOfOrder),
            "{:?}",
            report.violations
        );
        // After a resync the series may start again lower.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked(2, 2 * SEC, 20)
            .got(3 * SEC, 2, 20)
            .resync(3 * SEC + 5, "expired", &id("e1", 5))
            .got(3 * SEC + 10, 1, 10)
            .got(3 * SEC + 20, 2, 20);
        let report = b.check();
        assert!(report.is_clean(), "{:?}", report.violations);
    }

    #[test]
    fn positions_must_increase_within_an_epoch() {
        // Tokens in order but the second id is not after the first: out of order (and not the
        // acknowledged id either).
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked_b(1, 2 * SEC)
            .got(SEC + 10, 1, 10)
            .got_b(2 * SEC + 10, 1, 10);
        assert_eq!(kinds(&b.check()), [ViolationKind::OutOfOrder]);
        // Another epoch may start lower; that is counted, not a violation by itself.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked_b(1, 2 * SEC)
            .got(SEC + 10, 1, 10)
            .event(2 * SEC + 10, "b:1", &id("e2", 3));
        let report = b.check();
        assert!(report.is_clean(), "{:?}", report.violations);
        assert_eq!(report.epoch_changes_without_resync, 1);
    }

    #[test]
    fn a_unicast_must_arrive_with_its_acknowledged_id() {
        let mut b = Build::new();
        b.connect(0, None).acked(1, SEC, 10).got(SEC + 10, 1, 11);
        assert_eq!(kinds(&b.check()), [ViolationKind::WrongId]);
        // Another epoch: a copy from another life of the data (a retry after a loss).
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .event(SEC + 10, "u:d1:1", &id("e0", 11));
        assert!(b.check().is_clean());
        // An id that is no id, or names another shard.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .event(SEC + 10, "u:d1:1", "garbage");
        assert_eq!(kinds(&b.check()), [ViolationKind::WrongId]);
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .event(SEC + 10, "u:d1:1", "e1.2.10-0");
        assert_eq!(kinds(&b.check()), [ViolationKind::WrongId]);
    }

    #[test]
    fn external_acks_without_an_epoch_are_compared_only_after_a_single_try() {
        for via in [Via::RedisXadd, Via::NatsPublish] {
            external_ack(via);
        }
    }

    fn external_ack(via: Via) {
        let ack = |tries: u32| Attempt {
            token: Token::unicast(DEV, 1),
            via,
            started: SEC,
            finished: SEC + 1,
            tries,
            outcome: Outcome::Acked {
                id: EventId {
                    epoch: None,
                    shard: 1,
                    pos: Pos { ms: 0, seq: 7 },
                },
                duplicate: false,
            },
            answers: Vec::new(),
        };
        let mut b = Build::new();
        b.connect(0, None)
            .event(SEC + 10, "u:d1:1", "n1.1.0-8")
            .history
            .attempts
            .push(ack(1));
        assert_eq!(kinds(&b.check()), [ViolationKind::WrongId]);
        b.history.attempts[0] = ack(2);
        assert!(b.check().is_clean());
        b.history.attempts[0] = ack(1);
        b.history.devices[0].observations[1].what = Observation::Event {
            conn: 1,
            id: Some("n1.1.0-7".into()),
            kind: "t".into(),
            data: "u:d1:1".into(),
        };
        assert!(b.check().is_clean());
    }

    #[test]
    fn an_acknowledged_token_between_two_received_ones_must_be_received() {
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked(2, 2 * SEC, 20)
            .acked(3, 3 * SEC, 30)
            .got(SEC + 10, 1, 10)
            .got(3 * SEC + 10, 3, 30);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        assert_eq!(report.violations[0].tokens, [Token::unicast(DEV, 2)]);
        assert_eq!(report.violations[0].observation, Some(2));
        // An unacknowledged token in between may be missing.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .attempt(Token::unicast(DEV, 2), 2 * SEC, Outcome::Unknown)
            .acked(3, 3 * SEC, 30)
            .got(SEC + 10, 1, 10)
            .got(3 * SEC + 10, 3, 30);
        assert!(b.check().is_clean());
        // A resync in between announces the loss.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked(2, 2 * SEC, 20)
            .acked(3, 3 * SEC, 30)
            .got(SEC + 10, 1, 10)
            .resync(2 * SEC + 500, "data_lost", &id("e1", 25))
            .got(3 * SEC + 10, 3, 30);
        let report = b.check();
        assert!(report.is_clean(), "{:?}", report.violations);
    }

    #[test]
    fn at_the_end_everything_published_after_the_last_resync_must_have_arrived() {
        // Token 3 started after the resync and never arrived.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .got(SEC + 10, 1, 10)
            .resync(2 * SEC, "data_lost", &id("e2", 0))
            .acked(2, SEC + 500, 20)
            .acked(3, 3 * SEC, 30);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        assert_eq!(report.violations[0].tokens, [Token::unicast(DEV, 3)]);
        assert_eq!(report.violations[0].observation, None);
        // Token 2 started before the resync: it may be lost with the data.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .got(SEC + 10, 1, 10)
            .acked(2, SEC + 500, 20)
            .resync(2 * SEC, "data_lost", &id("e2", 0));
        assert!(b.check().is_clean());
    }

    #[test]
    fn at_the_end_everything_after_the_first_received_token_must_have_arrived() {
        // Token 2 started before the segment, but token 1 (before it) arrived in it.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked(2, 2 * SEC, 20)
            .acked(3, 3 * SEC, 30)
            .got(3 * SEC + 10, 1, 10);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        assert_eq!(
            report.violations[0].tokens,
            [Token::unicast(DEV, 2), Token::unicast(DEV, 3)],
            "one run of two missing tokens"
        );
        // Broadcasts too: every device must get every acknowledged broadcast.
        let mut b = clean();
        b.acked_b(2, 4 * SEC);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        assert_eq!(report.violations[0].tokens, [Token::broadcast(2)]);
        assert!(!lagging(&b.history).is_empty());
        assert!(lagging(&clean().history).is_empty());
    }

    #[test]
    fn a_cursorless_connection_starts_a_segment() {
        // Token 2 was published while the device had no cursor and no stream: at most once.
        let mut b = Build::new();
        b.connect(0, None)
            .closed(SEC)
            .acked(1, SEC + 10, 10)
            .acked(2, 2 * SEC, 20)
            .connect(3 * SEC, None)
            .acked(3, 4 * SEC, 30)
            .got(4 * SEC + 10, 3, 30);
        let report = b.check();
        assert!(report.is_clean(), "{:?}", report.violations);
        // But what is published after it must arrive.
        b.acked(4, 5 * SEC, 40);
        assert_eq!(kinds(&b.check()), [ViolationKind::Gap]);
    }

    #[test]
    fn only_invalid_resyncs_are_unexpected() {
        let mut b = clean();
        b.resync(4 * SEC, "invalid", &id("e1", 30));
        assert_eq!(kinds(&b.check()), [ViolationKind::UnexpectedResync]);
        for reason in ["expired", "data_lost"] {
            let mut b = clean();
            b.resync(4 * SEC, reason, &id("e1", 30));
            assert!(b.check().is_clean(), "{reason}");
        }
    }

    #[test]
    fn a_gap_is_attributed_to_the_first_fault_after_the_series_last_progressed() {
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked(2, 2 * SEC, 20)
            .acked(3, 5 * SEC, 30)
            .got(SEC + 10, 1, 10)
            .fault("nats-restart", 2 * SEC + 500)
            .fault("hub-kill", 4 * SEC)
            .got(5 * SEC + 10, 3, 30);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        let restart = report
            .per_fault
            .iter()
            .find(|s| s.fault == "nats-restart")
            .unwrap();
        assert_eq!(restart.violations.get(&ViolationKind::Gap), Some(&1));
        // At the end: the window runs from the last token received to the end of the run.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .got(SEC + 10, 1, 10)
            .fault("nats-stream-delete", 2 * SEC)
            .acked(2, 3 * SEC, 20)
            .fault("hub-kill", 4 * SEC);
        b.history.ended = 6 * SEC;
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        let delete = report
            .per_fault
            .iter()
            .find(|s| s.fault == "nats-stream-delete")
            .unwrap();
        assert_eq!(delete.violations.get(&ViolationKind::Gap), Some(&1));
    }

    #[test]
    fn violations_and_resyncs_are_attributed_to_the_fault_before_them() {
        let mut b = clean();
        b.fault("redis-flushall", 3 * SEC + 15)
            .resync(3 * SEC + 20, "data_lost", &id("e2", 0))
            .got(3 * SEC + 30, 9, 40)
            .fault("hub-kill", 5 * SEC)
            .fault("redis-flushall", 6 * SEC);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Phantom]);
        let flush = report
            .per_fault
            .iter()
            .find(|s| s.fault == "redis-flushall")
            .unwrap();
        assert_eq!(flush.injected, 2);
        assert_eq!(flush.resyncs.get("data_lost"), Some(&1));
        assert_eq!(flush.events, 1);
        assert_eq!(flush.violations.get(&ViolationKind::Phantom), Some(&1));
        let before = &report.per_fault[0];
        assert_eq!(before.fault, NO_FAULT);
        assert_eq!(before.events, 4);
        assert!(report.summary(&b.history, 3).contains("Phantom d1"));
        let json: serde_json::Value = serde_json::from_str(&report.json_line()).unwrap();
        assert_eq!(json["chaos"]["violations"]["Phantom"], 1);
    }
    /// [`clean`] with two events of the device's group between its unicasts, across the
    /// reconnect, and an event of a group it is not in that it does not receive.
    fn clean_with_groups() -> Build {
        let mut b = clean();
        b.acked_g(STORE, 1, SEC + 500)
            .acked_g("store-2", 1, SEC + 600)
            .acked_g(STORE, 2, 2 * SEC + 15);
        // Received in the order of the shard: g1 between u1 and u2, g2 replayed after b1.
        let obs = &mut b.history.devices[0].observations;
        let g1 = Observed {
            at: SEC + 510,
            what: Observation::Event {
                conn: 1,
                id: Some(id("e1", 15)),
                kind: "t".into(),
                data: format!("g:{STORE}:1|pad"),
            },
        };
        obs.insert(2, g1);
        let after_b1 = obs
            .iter()
            .position(|o| o.to_string().contains("event b:1"))
            .unwrap();
        let g2 = Observed {
            at: 2 * SEC + 45,
            what: Observation::Event {
                conn: 2,
                id: Some(id("e1", 27)),
                kind: "t".into(),
                data: format!("g:{STORE}:2|pad"),
            },
        };
        obs.insert(after_b1 + 1, g2);
        b
    }

    #[test]
    fn group_events_of_the_device_s_groups_are_checked_like_broadcasts() {
        let report = clean_with_groups().check();
        assert!(report.is_clean(), "{:?}", report.violations);
        assert_eq!(report.events_checked, 6);
        assert_eq!(report.group_events_checked, 2);
        assert!(lagging(&clean_with_groups().history).is_empty());
    }

    #[test]
    fn a_member_must_receive_every_acknowledged_event_of_its_groups() {
        // Between two received events of the group.
        let mut b = clean_with_groups();
        b.acked_g(STORE, 3, 3 * SEC + 200)
            .acked_g(STORE, 4, 3 * SEC + 300)
            .got_g(3 * SEC + 310, STORE, 4, 34);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        assert_eq!(report.violations[0].tokens, [Token::group(STORE, 3)]);
        // At the end, with nothing of the group after it.
        let mut b = clean_with_groups();
        b.acked_g(STORE, 3, 4 * SEC);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Gap]);
        assert_eq!(report.violations[0].tokens, [Token::group(STORE, 3)]);
        assert_eq!(
            lagging(&b.history),
            [format!("{DEV}: waits for g:{STORE}:3")]
        );
        // Events of a group the device is not in are not awaited.
        let mut b = clean_with_groups();
        b.acked_g("store-2", 2, 4 * SEC);
        assert!(b.check().is_clean());
        // A resync announces the loss.
        let mut b = clean_with_groups();
        b.acked_g(STORE, 3, 3 * SEC + 200)
            .acked_g(STORE, 4, 3 * SEC + 300)
            .resync(3 * SEC + 305, "data_lost", &id("e1", 33))
            .got_g(3 * SEC + 310, STORE, 4, 34);
        assert!(b.check().is_clean());
    }

    #[test]
    fn a_non_member_must_not_receive_a_group_event() {
        let mut b = clean_with_groups();
        b.got_g(3 * SEC + 20, "store-2", 1, 35);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Misrouted]);
        assert_eq!(report.violations[0].tokens, [Token::group("store-2", 1)]);
        assert_eq!(report.group_events_checked, 2, "not one of its groups");
        // An event of a group nobody published to is a phantom, as any unknown token.
        let mut b = clean_with_groups();
        b.got_g(3 * SEC + 20, STORE, 9, 35);
        assert_eq!(kinds(&b.check()), [ViolationKind::Phantom]);
    }

    #[test]
    fn a_group_event_twice_in_a_segment_is_a_duplicate() {
        let mut b = clean_with_groups();
        b.got_g(3 * SEC + 20, STORE, 2, 35);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::Duplicate]);
        assert_eq!(report.violations[0].tokens, [Token::group(STORE, 2)]);
        // Across a resync it is only counted.
        let mut b = clean_with_groups();
        b.resync(3 * SEC + 20, "data_lost", &id("e2", 0)).event(
            3 * SEC + 30,
            &format!("g:{STORE}:2"),
            &id("e2", 5),
        );
        let report = b.check();
        assert!(report.is_clean(), "{:?}", report.violations);
        assert_eq!(report.duplicate_across_resync, 1);
    }

    #[test]
    fn group_events_are_in_order_with_the_device_s_unicasts() {
        // The copy on the device's shard comes before a unicast stored after it.
        let mut b = Build::new();
        b.connect(0, None)
            .acked(1, SEC, 10)
            .acked_g(STORE, 1, 2 * SEC)
            .acked(2, 3 * SEC, 30)
            .got(SEC + 10, 1, 10)
            .got(3 * SEC + 10, 2, 30)
            .got_g(3 * SEC + 20, STORE, 1, 20);
        let report = b.check();
        assert_eq!(kinds(&report), [ViolationKind::OutOfOrder]);
        assert_eq!(report.violations[0].tokens, [Token::group(STORE, 1)]);
        // Tokens of a group must increase, whatever the ids say.
        let mut b = Build::new();
        b.connect(0, None)
            .acked_g(STORE, 1, SEC)
            .acked_g(STORE, 2, 2 * SEC)
            .got_g(2 * SEC + 10, STORE, 2, 20)
            .got_g(2 * SEC + 20, STORE, 1, 30);
        assert!(kinds(&b.check()).contains(&ViolationKind::OutOfOrder));
        // The copy's id is not compared with the acknowledged one (shard 0's copy).
        let mut b = Build::new();
        b.connect(0, None)
            .acked_g(STORE, 1, SEC)
            .got_g(SEC + 10, STORE, 1, 7);
        assert!(b.check().is_clean());
    }
}

//! Fault-injection checker ("our own Jepsen"). This commit: the recorded history and the pure
//! checker, with unit tests on hand-made histories; the run against real processes follows.

#[path = "../support/mod.rs"]
mod support;

mod checker;
mod history;

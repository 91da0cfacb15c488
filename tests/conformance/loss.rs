//! Data loss: a stream's life ends, and every client that could have missed something is told
//! `data_lost`, once.

use std::time::Duration;

use crate::env::{device_on_shard, shard, Env, Fault};
use crate::support::{live_stream, metrics, Hub};
use crate::{
    assert_quiet, epoch_of, expect_resync, publish_to, publish_until_accepted, resume,
    resync_reason, LOSS_NOTICE, WAIT,
};

/// A way to lose stored data, in the order a scenario prefers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// The stream of the device's shard is deleted; the other shards keep their data.
    OneStream,
    /// Every stored entry is lost while the hub runs.
    AllData,
}

/// What [`lose`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    OneStream,
    AllData,
    /// The store restarted without its data; `hub_survived` is false for memory, whose store
    /// is the hub's process: its open streams were cut.
    Restart {
        hub_survived: bool,
    },
}

impl Lost {
    /// Whether the hub kept running, so that its open streams must hear of the loss.
    pub fn hub_survived(self) -> bool {
        !matches!(
            self,
            Lost::Restart {
                hub_survived: false
            }
        )
    }

    /// How long an open stream may wait for its `data_lost`: within 10 s of the loss, and a
    /// restarted store first has to answer again.
    pub fn notice(self) -> Duration {
        match self {
            Lost::Restart { .. } => LOSS_NOTICE + Duration::from_secs(5),
            _ => LOSS_NOTICE,
        }
    }
}

/// Loses the data of `device`'s shard in the first way of `preferred` this backend can do,
/// otherwise by restarting the store without its data, which every backend can (memory by
/// restarting `hub`). Records which of them ran.
pub async fn lose(env: &mut Env, hub: &mut Hub, device: &str, preferred: &[Loss]) -> Lost {
    for loss in preferred {
        match loss {
            Loss::OneStream => {
                if env.part("the shard's stream deleted", &[Fault::LoseOneStream]) {
                    env.lose_stream(device).await;
                    return Lost::OneStream;
                }
            }
            Loss::AllData => {
                if env.part("all data lost under the running hub", &[Fault::LoseAllData]) {
                    env.lose_all_data().await;
                    return Lost::AllData;
                }
            }
        }
    }
    let hub_survived = env.part(
        "the store restarted empty under the running hub",
        &[Fault::RestartLosingDataUnderTheHub],
    );
    if !hub_survived {
        env.ran("instead: the hub's process restarted, losing its store");
    }
    env.restart_losing_data(hub).await;
    Lost::Restart { hub_survived }
}

/// Losing every stored entry while the hub runs (FLUSHALL; a deleted JetStream stream, which
/// the hub creates again) ends the stream's life: a connected client is told `data_lost` with an
/// id of the new life, a client coming back with a cursor from before gets `data_lost`, and
/// delivery goes on in the new epoch. Memory loses its data only with the hub's process, so
/// there the hub restarts: its open stream is cut, and the rest holds.
pub async fn a_loss_of_all_data_gives_data_lost(env: &mut Env) {
    let mut hub = env.start_hub().await;
    let device = "pos-9";
    let mut connected = live_stream(&hub, device).await;
    let old = publish_to(&hub, device, "before").await;
    assert_eq!(connected.expect_event(WAIT).await.data, "before");

    let lost = lose(env, &mut hub, device, &[Loss::AllData]).await;
    if lost.hub_survived() {
        let event = expect_resync(&mut connected, lost.notice()).await;
        assert_eq!(resync_reason(&event), "data_lost");
        assert_ne!(
            event.id.as_deref().map(epoch_of),
            Some(epoch_of(&old)),
            "the resync carries the new epoch"
        );
    }
    // The same device coming back (on the same pod this replaces the connection above).
    drop(connected);
    let mut back = resume(&hub, device, &old).await;
    assert_eq!(resync_reason(&back.expect_event(WAIT).await), "data_lost");
    let fresh = publish_until_accepted(&hub, device, "after").await;
    assert_ne!(
        epoch_of(&fresh),
        epoch_of(&old),
        "a new epoch after the loss"
    );
    assert_eq!(back.expect_event(WAIT).await.data, "after");
}

/// Bug pinned: a stream opened *with* a cursor dropped the tail's `resync` (its id
/// is the new head, below the cursor) and every later event below the old cursor, so a
/// FLUSHALL went unnoticed by resumed streams; on NATS, where a new stream starts again at
/// sequence 1, such a stream received nothing for the rest of its life while heartbeats kept it
/// looking healthy (`a_resumed_stream_hears_of_a_recreated_stream`). Now the resumed stream gets
/// `data_lost` within 10 s, then the new life's events, and that resync is counted like any
/// other. Memory loses its data only with the hub's process: the resumed stream is
/// cut, and the client that comes back with its cursor gets `data_lost`.
pub async fn a_resumed_stream_hears_of_a_flushall(env: &mut Env) {
    let mut hub = env.start_hub().await;
    let device = "pos-1";
    // A cursor well above the first positions of a new life.
    for i in 0..20 {
        publish_to(&hub, device, &format!("before {i}")).await;
    }
    let cursor = publish_to(&hub, device, "before last").await;
    let mut resumed = resume(&hub, device, &cursor).await;
    // Past its (empty) replay: a loss during a replay fails the replay instead, and the client
    // comes back.
    assert_quiet(&mut resumed, "nothing to replay").await;

    let lost = lose(env, &mut hub, device, &[Loss::AllData]).await;
    if !lost.hub_survived() {
        resumed = resume(&hub, device, &cursor).await;
    }
    let event = expect_resync(&mut resumed, lost.notice()).await;
    assert_eq!(resync_reason(&event), "data_lost");
    publish_until_accepted(&hub, device, "after").await;
    assert_eq!(resumed.expect_event(WAIT).await.data, "after");
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("sse_resyncs_total", &[("reason", "data_lost")]),
        Some(1.0),
        "a resync found by a tail is counted like any other"
    );
}

/// Bug pinned: a stream deleted and re-created by the next append (an external
/// producer's XADD) kept the group's epoch key, so a cursor from before replayed what was left
/// and skipped the lost events, and connected clients were never told. Now both get
/// `data_lost`, the new life's events follow from its first one, and the other shards' streams
/// are untouched. NATS keeps every shard in one stream, so there all of them are lost instead;
/// memory restarts its hub.
pub async fn a_deleted_stream_gives_data_lost(env: &mut Env) {
    let mut hub = env.start_hub().await;
    let device = "pos-2";
    let other = device_on_shard("pos", (shard(device) + 32) % 64);
    let other_cursor = publish_to(&hub, &other, "other shard").await;
    let mut connected = live_stream(&hub, device).await;
    let cursor = publish_to(&hub, device, "before 1").await;
    publish_to(&hub, device, "before 2").await;
    connected.expect_events(2, WAIT).await;

    let lost = lose(env, &mut hub, device, &[Loss::OneStream, Loss::AllData]).await;
    if lost == Lost::OneStream
        && env.part(
            "an external producer's append creates the stream again",
            &[Fault::ExternalProducer],
        )
    {
        env.produce(device, None, "new life 1").await;
    } else {
        publish_until_accepted(&hub, device, "new life 1").await;
    }
    if lost.hub_survived() {
        let resync = expect_resync(&mut connected, lost.notice()).await;
        assert_eq!(resync_reason(&resync), "data_lost");
        assert_eq!(connected.expect_event(WAIT).await.data, "new life 1");
        publish_to(&hub, device, "new life 2").await;
        assert_eq!(connected.expect_event(WAIT).await.data, "new life 2");
    }
    // The device comes back with its cursor from before the loss (this replaces `connected`).
    let mut back = resume(&hub, device, &cursor).await;
    assert_eq!(resync_reason(&back.expect_event(WAIT).await), "data_lost");
    publish_to(&hub, device, "new life 3").await;
    assert_eq!(back.expect_event(WAIT).await.data, "new life 3");
    if lost == Lost::OneStream {
        let mut untouched = resume(&hub, &other, &other_cursor).await;
        assert_quiet(&mut untouched, "another shard's stream kept its life").await;
        env.ran("another shard keeps its life");
    }
}

/// A store that restarts without its data (Redis without its AOF, nats-server without its
/// store, the memory backend's hub process) has lost it: connected and resumed streams get
/// `data_lost`, a cursor from before gets `data_lost` on resume, and delivery goes on. On
/// memory the restart cuts the hub's streams, so only the cursor part runs there.
pub async fn a_restart_without_the_store_gives_data_lost(env: &mut Env) {
    let mut hub = env.start_hub().await;
    let mut connected = live_stream(&hub, "pos-6").await;
    let cursor = publish_to(&hub, "pos-6", "before").await;
    assert_eq!(connected.expect_event(WAIT).await.data, "before");
    let other = publish_to(&hub, "pos-7", "before").await;
    let mut resumed = resume(&hub, "pos-7", &other).await;
    // Past its (empty) replay: a loss during a replay fails the replay instead, and the client
    // comes back.
    assert_quiet(&mut resumed, "nothing to replay").await;

    let lost = lose(env, &mut hub, "pos-6", &[]).await;
    if lost.hub_survived() {
        for client in [&mut connected, &mut resumed] {
            let event = expect_resync(client, lost.notice()).await;
            assert_eq!(resync_reason(&event), "data_lost");
        }
    }
    let mut back = resume(&hub, "pos-6", &cursor).await;
    assert_eq!(resync_reason(&back.expect_event(WAIT).await), "data_lost");
    publish_until_accepted(&hub, "pos-6", "after").await;
    assert_eq!(back.expect_event(WAIT).await.data, "after");
}

//! External producers: entries appended without the hub, in the documented format.

use crate::env::{neighbour, shard, Env, Fault};
use crate::support::{live_stream, metrics};
use crate::{assert_quiet, data_of, publish_to, WAIT};

/// Entries an external producer appends in the documented format (docs/stream-format.md: Redis
/// fields, NATS headers) reach the device in order with the hub's own: with a type, without one
/// (`message`), multi-line data, a broadcast copy on the device's shard, and nothing of another
/// device on that shard. Entries the hub cannot deliver (no device, no data, an invalid type, a
/// body that is not UTF-8) are skipped and counted in `tail_entries_skipped_total`, and the
/// tail keeps running. Memory, where only the hub appends, checks instead that the counter is
/// exported and stays 0 while the hub's events flow.
pub async fn external_entries_are_delivered_and_bad_ones_skipped(env: &mut Env) {
    let hub = env.start_hub().await;
    let device = "pos-17";
    let mut client = live_stream(&hub, device).await;
    let first = publish_to(&hub, device, "from the hub").await;
    let mut expected = vec!["from the hub".to_string()];
    let mut skipped = 0;
    if env.part("external entries", &[Fault::ExternalProducer]) {
        skipped = env.produce_undeliverable(device).await;
        env.produce(device, Some("ext"), "line 1\nline 2").await;
        env.produce(&neighbour(device), None, "not for this device")
            .await;
        env.produce(device, None, "no type").await;
        env.produce_on(
            shard(device),
            "*",
            Some("notice"),
            "external broadcast copy",
        )
        .await;
        expected.extend(["line 1\nline 2", "no type", "external broadcast copy"].map(String::from));
    }
    publish_to(&hub, device, "from the hub again").await;
    expected.push("from the hub again".to_string());

    let events = client.expect_events(expected.len(), WAIT).await;
    assert_eq!(data_of(&events), expected);
    assert_eq!(events[0].id.as_deref(), Some(first.as_str()));
    if skipped > 0 {
        let types: Vec<&str> = events.iter().map(|event| event.event.as_str()).collect();
        assert_eq!(types, ["test", "ext", "message", "notice", "test"]);
    }
    assert_quiet(&mut client, "nothing else").await;
    let scrape = metrics::scrape(hub.addr()).await;
    assert_eq!(
        scrape.value("tail_entries_skipped_total", &[]),
        Some(skipped as f64),
        "every undeliverable entry counted once"
    );
    env.ran("the tail runs on past skipped entries, and counts them");
}

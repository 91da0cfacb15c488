//! Producers. Every series is published strictly sequentially: a token is sent only once the
//! previous token of its series has its final answer.
//!
//! - [`http_unicasts`]: the unicasts of a few devices through nginx or straight to a hub, as
//!   single objects or batches (consecutive tokens of a device stay in order inside a batch),
//!   and the events of the groups it owns (each group has one owner, so its series stays
//!   sequential) mixed into the batches, at most one per group and batch: its copies are
//!   appended per shard, so two of one group in a batch could be stored in either order where
//!   one copy is retried. Every item has an idempotency key (its token). 503s, 5xx from nginx,
//!   transport errors, timeouts and `incomplete` items make the outcome unknown; it retries
//!   with the same keys until every item has a definite answer or the deadline passes.
//! - [`broadcasts`]: one sequential broadcaster, the same way.
//! - [`redis_external`]: `XADD <shard's key> * dev D type T data X` on a fresh connection per
//!   try (following `MOVED` on a cluster). Redis has no idempotency for it, so it retries only
//!   while nothing can have been appended (connection refused, an error reply); once a command
//!   may have been executed without an answer, the outcome stays unknown and it moves on.
//! - [`nats_external`]: a JetStream publish with `Posthorn-Dev`, `Posthorn-Type` and
//!   `Nats-Msg-Id` (the token), awaiting the ack, retried with the same message id.
//!
//! Every attempt is recorded (as `Unknown`) before its first try, so an attempt the run cuts
//! short is never mistaken for a phantom.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use super::device::Endpoints;
use super::history::{Attempt, Clock, EventId, Outcome, Pos, Token, Via};
use crate::support::http;
use crate::support::redis::{redirect_target, RespClient, RespValue};

/// Padding of group events: they reach several devices, so they stay small like broadcasts,
/// whoever publishes them.
const GROUP_PAD: (usize, usize) = (0, 200);
/// How long one token (or batch) is retried before its outcome is left as it is.
const ATTEMPT_DEADLINE: Duration = Duration::from_secs(10);
/// One HTTP try; longer than the hub's own backend timeouts, so the hub answers first.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(8);
const ACK_TIMEOUT: Duration = Duration::from_secs(3);

/// What every producer shares: the clock, the attempt log and the stop signal.
#[derive(Clone)]
pub struct Ctx {
    pub clock: Clock,
    pub attempts: Arc<Mutex<Vec<Attempt>>>,
    pub stop: watch::Receiver<bool>,
    pub endpoints: Arc<Endpoints>,
}

impl Ctx {
    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Vec<Attempt>> {
        self.attempts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the start of a token's publish; returns its index in the log.
    fn begin(&self, token: Token, via: Via) -> usize {
        let now = self.clock.now();
        let mut log = self.log();
        log.push(Attempt {
            token,
            via,
            started: now,
            finished: now,
            tries: 0,
            outcome: Outcome::Unknown,
            answers: Vec::new(),
        });
        log.len() - 1
    }

    fn finish(&self, index: usize, tries: u32, outcome: Outcome, answers: Vec<String>) {
        let now = self.clock.now();
        let mut log = self.log();
        let attempt = &mut log[index];
        attempt.finished = now;
        attempt.tries = tries;
        attempt.outcome = outcome;
        attempt.answers = answers;
    }

    /// Sleeps about `mean` (0.5x to 1.5x), returning early when the run stops.
    async fn pace(&self, rng: &mut StdRng, mean: Duration) {
        let wait = mean.mul_f64(rng.random_range(0.5..1.5));
        let mut stop = self.stop.clone();
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => {}
        }
    }
}

/// `data` of an event: the token, then padding so that slow readers fill their buffers.
fn payload(token: &Token, rng: &mut StdRng, pad: (usize, usize)) -> String {
    let n = rng.random_range(pad.0..=pad.1);
    format!("{token}|{}", "x".repeat(n))
}

/// One item of an HTTP publish until it has its final answer.
struct Item {
    index: usize,
    body: Value,
    done: Option<Outcome>,
    /// Some try may have appended it (a 503, a transport error, a timeout).
    maybe: bool,
    tries: u32,
    answers: Vec<String>,
}

/// Publishes `items` over HTTP (one request per try, the still unresolved items in their
/// order) until each has a definite answer or the deadline passes; records the outcomes.
async fn publish_http(ctx: &Ctx, rng: &mut StdRng, items: &mut [Item]) {
    let deadline = Instant::now() + ATTEMPT_DEADLINE;
    loop {
        let open: Vec<usize> = (0..items.len())
            .filter(|&i| items[i].done.is_none())
            .collect();
        if open.is_empty() {
            break;
        }
        let (name, addr) = ctx.endpoints.pick(rng, 0.25);
        let body = if open.len() == 1 && rng.random_bool(0.5) {
            items[open[0]].body.clone()
        } else {
            Value::Array(open.iter().map(|&i| items[i].body.clone()).collect())
        };
        let bytes = serde_json::to_vec(&body).expect("serialise a publish");
        for &i in &open {
            items[i].tries += 1;
        }
        let answer = http::try_request(
            addr,
            "POST",
            "/v1/events",
            &[("Content-Type", "application/json")],
            Some(&bytes),
            REQUEST_TIMEOUT,
        )
        .await;
        match answer {
            Err(error) => {
                for &i in &open {
                    items[i].maybe = true;
                    items[i].answers.push(format!("{name}: {}", error.kind()));
                }
            }
            Ok(response) => match response.status {
                201 | 207 => take_results(&name, &response, &open, items),
                400 | 413 => {
                    // The checker's own requests are valid: this is worth seeing in the log.
                    eprintln!(
                        "chaos producer: {} refused a valid publish: {} {}",
                        name,
                        response.status,
                        response.text()
                    );
                    for &i in &open {
                        items[i]
                            .answers
                            .push(format!("{name}: {}", response.status));
                        let outcome = if items[i].maybe {
                            Outcome::Unknown
                        } else {
                            Outcome::Failed
                        };
                        items[i].done = Some(outcome);
                    }
                }
                status => {
                    for &i in &open {
                        items[i].maybe = true;
                        items[i].answers.push(format!("{name}: {status}"));
                    }
                }
            },
        }
        if items.iter().all(|item| item.done.is_some()) {
            break;
        }
        if Instant::now() >= deadline || ctx.stopping() {
            for item in items.iter_mut().filter(|item| item.done.is_none()) {
                item.done = Some(if item.maybe {
                    Outcome::Unknown
                } else {
                    Outcome::Failed
                });
            }
            break;
        }
        let wait = rng.random_range(100..400);
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }
    for item in items.iter_mut() {
        let outcome = item.done.take().unwrap_or(Outcome::Unknown);
        ctx.finish(
            item.index,
            item.tries,
            outcome,
            std::mem::take(&mut item.answers),
        );
    }
}

/// Reads a 201/207 answer: per item an id (appended) or an error (not appended, retried).
fn take_results(name: &str, response: &http::HttpResponse, open: &[usize], items: &mut [Item]) {
    let parsed: Option<Value> = serde_json::from_slice(&response.body).ok();
    let results = parsed
        .as_ref()
        .and_then(|v| v["results"].as_array())
        .filter(|r| r.len() == open.len());
    let Some(results) = results else {
        eprintln!(
            "chaos producer: {name} answered {} with an unexpected body: {}",
            response.status,
            response.text()
        );
        for &i in open {
            items[i].maybe = true;
            items[i]
                .answers
                .push(format!("{name}: {} (bad body)", response.status));
        }
        return;
    };
    for (&i, result) in open.iter().zip(results) {
        let item = &mut items[i];
        match result["id"].as_str().and_then(EventId::parse) {
            Some(id) => {
                item.answers.push(format!("{name}: {} id", response.status));
                item.done = Some(Outcome::Acked {
                    id,
                    duplicate: result["duplicate"].as_bool().unwrap_or(false),
                });
            }
            None if result.get("error").is_some() => {
                // Some copies of a broadcast or group event were stored: devices on those
                // shards may receive it even if no retry completes it.
                if result["error"] == "incomplete" {
                    item.maybe = true;
                }
                item.answers.push(format!(
                    "{name}: {} error {}",
                    response.status, result["error"]
                ));
            }
            None => {
                item.maybe = true;
                item.answers
                    .push(format!("{name}: {} unreadable {result}", response.status));
            }
        }
    }
}

/// Publishes the unicasts of `devices` over HTTP at about `rate` events per second per device,
/// as single items and batches of up to four, and the events of `groups` (which no other
/// producer publishes to) at about `group_rate` per second per group, each at a random place in
/// a batch, until the run stops.
pub async fn http_unicasts(
    ctx: Ctx,
    devices: Vec<String>,
    seed: u64,
    rate: f64,
    pad: (usize, usize),
    groups: Vec<String>,
    group_rate: f64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut next = vec![1u64; devices.len()];
    let mut next_of_group = vec![1u64; groups.len()];
    while !ctx.stopping() {
        let size = if rng.random_bool(0.5) {
            1
        } else {
            rng.random_range(2..=4)
        };
        let mean = Duration::from_secs_f64(size as f64 / (rate * devices.len() as f64));
        let mut items = Vec::with_capacity(size + groups.len());
        for _ in 0..size {
            let d = rng.random_range(0..devices.len());
            let token = Token::unicast(&devices[d], next[d]);
            next[d] += 1;
            let data = payload(&token, &mut rng, pad);
            let body = json!({
                "device": devices[d], "type": "chaos", "data": data, "key": token.to_string(),
            });
            let index = ctx.begin(token, Via::Http);
            items.push(Item {
                index,
                body,
                done: None,
                maybe: false,
                tries: 0,
                answers: Vec::new(),
            });
        }
        for (g, group) in groups.iter().enumerate() {
            if !rng.random_bool((group_rate * mean.as_secs_f64()).min(1.0)) {
                continue;
            }
            let token = Token::group(group, next_of_group[g]);
            next_of_group[g] += 1;
            let data = payload(&token, &mut rng, GROUP_PAD);
            let body = json!({
                "group": group, "type": "chaos.group", "data": data, "key": token.to_string(),
            });
            let index = ctx.begin(token, Via::Http);
            // Anywhere among the unicasts, whose order stays as it is.
            let at = rng.random_range(0..=items.len());
            items.insert(
                at,
                Item {
                    index,
                    body,
                    done: None,
                    maybe: false,
                    tries: 0,
                    answers: Vec::new(),
                },
            );
        }
        publish_http(&ctx, &mut rng, &mut items).await;
        ctx.pace(&mut rng, mean).await;
    }
}

/// One sequential broadcaster at about `rate` per second.
pub async fn broadcasts(ctx: Ctx, seed: u64, rate: f64, pad: (usize, usize)) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0;
    while !ctx.stopping() {
        n += 1;
        let token = Token::broadcast(n);
        let data = payload(&token, &mut rng, pad);
        let body = json!({
            "broadcast": true, "type": "chaos.all", "data": data, "key": token.to_string(),
        });
        let index = ctx.begin(token, Via::Http);
        let mut items = [Item {
            index,
            body,
            done: None,
            maybe: false,
            tries: 0,
            answers: Vec::new(),
        }];
        publish_http(&ctx, &mut rng, &mut items).await;
        ctx.pace(&mut rng, Duration::from_secs_f64(1.0 / rate))
            .await;
    }
}

/// An external producer appending `device`'s unicasts to its shard's Redis stream `key`, on the
/// first of `nodes` that takes it: a refused connection moves on to the next node, a `MOVED`
/// redirect (a cluster whose slot moved, or a replica) to the node it names; both mean the
/// command was not executed.
#[allow(clippy::too_many_arguments)]
pub async fn redis_external(
    ctx: Ctx,
    nodes: Vec<SocketAddr>,
    key: String,
    device: String,
    shard: u32,
    seed: u64,
    rate: f64,
    pad: (usize, usize),
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut node = nodes[0];
    let mut n = 0;
    while !ctx.stopping() {
        n += 1;
        let token = Token::unicast(&device, n);
        let data = payload(&token, &mut rng, pad);
        let index = ctx.begin(token, Via::RedisXadd);
        let deadline = Instant::now() + ATTEMPT_DEADLINE;
        let mut answers = Vec::new();
        let mut tries = 0;
        let outcome = loop {
            tries += 1;
            let args = [
                "XADD", &key, "*", "dev", &device, "type", "chaos.x", "data", &data,
            ];
            let mut redirected = false;
            match RespClient::try_connect(node).await {
                Err(error) => {
                    answers.push(format!("connect {node}: {}", error.kind()));
                    let i = nodes.iter().position(|&a| a == node).unwrap_or(0);
                    node = nodes[(i + 1) % nodes.len()];
                }
                Ok(mut client) => match client.try_cmd(&args).await {
                    Ok(RespValue::Bulk(Some(id))) => {
                        let text = String::from_utf8_lossy(&id).into_owned();
                        answers.push("id".into());
                        match Pos::parse(&text) {
                            Some(pos) => {
                                break Outcome::Acked {
                                    id: EventId {
                                        epoch: None,
                                        shard,
                                        pos,
                                    },
                                    duplicate: false,
                                }
                            }
                            None => break Outcome::Unknown,
                        }
                    }
                    // MOVED, CLUSTERDOWN, LOADING and the like: the command was refused.
                    Ok(reply @ RespValue::Error(_)) => {
                        answers.push(format!("error {}", reply.as_error().unwrap_or_default()));
                        if let Some((_, target)) = redirect_target(&reply) {
                            node = target;
                            redirected = true;
                        }
                    }
                    Ok(other) => {
                        answers.push(format!("odd reply {other:?}"));
                        break Outcome::Unknown;
                    }
                    Err(error) => {
                        answers.push(format!("no reply: {}", error.kind()));
                        break Outcome::Unknown;
                    }
                },
            }
            if Instant::now() >= deadline || ctx.stopping() {
                break Outcome::Failed;
            }
            if !redirected {
                tokio::time::sleep(Duration::from_millis(rng.random_range(100..300))).await;
            }
        };
        ctx.finish(index, tries, outcome, answers);
        ctx.pace(&mut rng, Duration::from_secs_f64(1.0 / rate))
            .await;
    }
}

/// An external producer publishing `device`'s unicasts to JetStream with message ids.
#[allow(clippy::too_many_arguments)]
pub async fn nats_external(
    ctx: Ctx,
    client: async_nats::Client,
    device: String,
    shard: u32,
    seed: u64,
    rate: f64,
    pad: (usize, usize),
) {
    let js = async_nats::jetstream::new(client);
    let mut rng = StdRng::seed_from_u64(seed);
    let subject = format!("posthorn.ev.{shard}");
    let mut n = 0;
    while !ctx.stopping() {
        n += 1;
        let token = Token::unicast(&device, n);
        let data = payload(&token, &mut rng, pad);
        let msg_id = token.to_string();
        let index = ctx.begin(token, Via::NatsPublish);
        let deadline = Instant::now() + ATTEMPT_DEADLINE;
        let mut answers = Vec::new();
        let mut tries = 0;
        let outcome = loop {
            tries += 1;
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Posthorn-Dev", device.as_str());
            headers.insert("Posthorn-Type", "chaos.x");
            headers.insert("Nats-Msg-Id", msg_id.as_str());
            let sent = js
                .publish_with_headers(subject.clone(), headers, data.clone().into())
                .await;
            match sent {
                Err(error) => answers.push(format!("publish: {error}")),
                Ok(ack) => match tokio::time::timeout(ACK_TIMEOUT, ack).await {
                    Ok(Ok(ack)) => {
                        answers.push(format!("ack seq {}", ack.sequence));
                        break Outcome::Acked {
                            id: EventId {
                                epoch: None,
                                shard,
                                pos: Pos {
                                    ms: 0,
                                    seq: ack.sequence,
                                },
                            },
                            duplicate: ack.duplicate,
                        };
                    }
                    Ok(Err(error)) => answers.push(format!("ack: {error}")),
                    Err(_) => answers.push("no ack".into()),
                },
            }
            if Instant::now() >= deadline || ctx.stopping() {
                // A publish may have been stored without its ack reaching us.
                break Outcome::Unknown;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..300))).await;
        };
        ctx.finish(index, tries, outcome, answers);
        ctx.pace(&mut rng, Duration::from_secs_f64(1.0 / rate))
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(index: usize) -> Item {
        Item {
            index,
            body: json!({}),
            done: None,
            maybe: false,
            tries: 1,
            answers: Vec::new(),
        }
    }

    fn response(status: u16, body: Value) -> http::HttpResponse {
        http::HttpResponse {
            status,
            headers: Vec::new(),
            body: serde_json::to_vec(&body).unwrap(),
        }
    }

    /// A 207 acknowledges the items with an id and leaves those with an error open (not
    /// appended: they are retried); results are matched to the items sent, in order.
    #[test]
    fn partial_answers_acknowledge_item_by_item() {
        let mut items = vec![item(0), item(1), item(2)];
        items[0].done = Some(Outcome::Failed);
        let answer = response(
            207,
            json!({"results": [
                {"id": "e1.3.17-0", "duplicate": false},
                {"error": "backend_unavailable", "message": "group 1 failed"},
            ]}),
        );
        take_results("nginx", &answer, &[1, 2], &mut items);
        assert_eq!(
            items[1].done,
            Some(Outcome::Acked {
                id: EventId::parse("e1.3.17-0").unwrap(),
                duplicate: false
            })
        );
        assert_eq!(items[2].done, None);
        assert!(!items[2].maybe, "an item error means not appended");
        assert_eq!(
            items[0].done,
            Some(Outcome::Failed),
            "not sent, not touched"
        );
    }

    /// An `incomplete` broadcast or group event had some copies stored: unless a retry
    /// completes it, its outcome stays unknown, not failed.
    #[test]
    fn an_incomplete_item_may_have_been_appended() {
        let mut items = vec![item(0)];
        let answer = response(
            207,
            json!({"results": [{"error": "incomplete", "message": "2 of 8 shards"}]}),
        );
        take_results("nginx", &answer, &[0], &mut items);
        assert!(items[0].done.is_none() && items[0].maybe);
    }

    /// An answer that does not match the items sent leaves all of them possibly appended.
    #[test]
    fn an_unreadable_answer_makes_every_outcome_unknown() {
        let mut items = vec![item(0), item(1)];
        let answer = response(201, json!({"results": [{"id": "e1.3.17-0"}]}));
        take_results("hub0", &answer, &[0, 1], &mut items);
        assert!(items.iter().all(|i| i.done.is_none() && i.maybe));
        let mut items = vec![item(0)];
        let answer = response(201, json!({"results": [{"id": 5}]}));
        take_results("hub0", &answer, &[0], &mut items);
        assert!(items[0].done.is_none() && items[0].maybe);
    }
}

//! A WebSocket upgrade (Codex's Responses socket, `GET …/responses` with
//! `Upgrade: websocket`): the upstream is upgraded first, so its refusal reaches the
//! client as its own status; on its 101 the client is upgraded too and the bytes are
//! copied both ways unchanged (permessage-deflate, when the two ends agree on it, is
//! theirs). Or refused with a 426, which makes Codex fall back to HTTP at once.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http::header::{CONNECTION, UPGRADE};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::id::ExchangeId;
use crate::provider::Provider;
use crate::record::{ExchangeRecord, Outcome};

/// What a WebSocket upgrade on an OpenAI route gets (`websocket` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WebSocket {
    /// Relayed byte for byte once the upstream accepts it.
    Relay,
    /// Answered 426 in OpenAI's error shape, so every turn goes over HTTP.
    Refuse,
}

/// Whether the request asks to become a WebSocket.
pub(super) fn asks(headers: &HeaderMap) -> bool {
    headers
        .get_all(UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("websocket"))
}

/// Puts back what hop-by-hop removal took from an upgrade: `Connection: Upgrade` and
/// the client's `Upgrade` value. The `Sec-WebSocket-*` headers are end to end and
/// were never removed.
pub(super) fn keep_upgrade(received: &HeaderMap, outgoing: &mut HeaderMap) {
    outgoing.insert(CONNECTION, http::HeaderValue::from_static("Upgrade"));
    for v in received.get_all(UPGRADE) {
        outgoing.append(UPGRADE, v.clone());
    }
}

/// How a relayed socket ended.
#[derive(Debug, Default)]
pub(super) struct Relayed {
    /// Bytes from the client to the upstream.
    pub(super) from_client: u64,
    /// Bytes from the upstream to the client.
    pub(super) to_client: u64,
    /// Why it ended, when not by a close from one side.
    pub(super) error: Option<String>,
    /// Whether that was the client's side (it vanished), not the upstream's.
    pub(super) client_broke: bool,
}

/// How much of one direction is read at a time.
const CHUNK: usize = 64 << 10;

/// Waits for both upgrades, then copies both ways until one side closes, breaks
/// off, or both are silent for `idle`.
pub(super) async fn relay(
    client: OnUpgrade,
    upstream: OnUpgrade,
    idle: Duration,
    mut watch: impl FnMut(Way, &[u8]),
) -> Relayed {
    let (client, upstream) = match tokio::join!(client, upstream) {
        (Ok(c), Ok(u)) => (TokioIo::new(c), TokioIo::new(u)),
        (Err(e), _) => {
            return Relayed {
                error: Some(format!("the client's upgrade failed: {e}")),
                ..Relayed::default()
            };
        }
        (_, Err(e)) => {
            return Relayed {
                error: Some(format!("the upstream's upgrade failed: {e}")),
                ..Relayed::default()
            };
        }
    };
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut upstream_read, mut upstream_write) = tokio::io::split(upstream);
    let mut out = Relayed::default();
    let mut up = vec![0u8; CHUNK];
    let mut down = vec![0u8; CHUNK];
    let (mut client_open, mut upstream_open) = (true, true);
    // Either side's close is passed on as a half-close; the socket ends when both are.
    while client_open || upstream_open {
        let step = tokio::time::timeout(idle, async {
            tokio::select! {
                r = client_read.read(&mut up), if client_open => Step::Up(r),
                r = upstream_read.read(&mut down), if upstream_open => Step::Down(r),
            }
        })
        .await;
        let moved = match step {
            Err(_) => {
                out.error = Some(format!("silent for {} s (--idle-timeout)", idle.as_secs()));
                break;
            }
            // A failed read is its side's; a failed write the other's.
            // Read after it is passed on: the copy costs the relay no latency.
            Ok(Step::Up(r)) => {
                let client = r.is_err();
                pass(r, &up, &mut upstream_write, &mut client_open)
                    .await
                    .map(|n| {
                        watch(Way::Up, &up[..n as usize]);
                        out.from_client += n;
                    })
                    .map_err(|e| (client, e))
            }
            Ok(Step::Down(r)) => {
                let client = r.is_ok();
                pass(r, &down, &mut client_write, &mut upstream_open)
                    .await
                    .map(|n| {
                        watch(Way::Down, &down[..n as usize]);
                        out.to_client += n;
                    })
                    .map_err(|e| (client, e))
            }
        };
        if let Err((client, e)) = moved {
            let side = if client { "the client" } else { "the upstream" };
            out.error = Some(format!("{side} broke off the socket: {e}"));
            out.client_broke = client;
            break;
        }
    }
    out
}

/// One read's outcome, by direction.
enum Step {
    Up(std::io::Result<usize>),
    Down(std::io::Result<usize>),
}

/// Writes what one read got to the other side (or half-closes it at the end).
async fn pass(
    read: std::io::Result<usize>,
    buf: &[u8],
    to: &mut (impl AsyncWrite + Unpin),
    open: &mut bool,
) -> std::io::Result<u64> {
    let n = read?;
    if n == 0 {
        *open = false;
        let _ = to.shutdown().await;
        return Ok(0);
    }
    to.write_all(&buf[..n]).await?;
    Ok(n as u64)
}

/// Which way a relayed chunk went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    /// From the client to the upstream.
    Up,
    /// From the upstream to the client.
    Down,
}

/// The events that end a turn of the Responses socket.
const TERMINAL: &[&str] = &[
    "response.completed",
    "response.failed",
    "response.incomplete",
    "error",
];

/// A message's `type`, read without building the rest.
#[derive(serde::Deserialize)]
struct Kind<'a> {
    #[serde(borrow, rename = "type")]
    kind: std::borrow::Cow<'a, str>,
}

fn kind_of(message: &[u8]) -> Option<String> {
    serde_json::from_slice::<Kind<'_>>(message)
        .ok()
        .map(|k| k.kind.into_owned())
}

/// One turn of the socket: a `response.create` and the events that answer it.
#[derive(Debug)]
pub(super) struct Turn {
    /// The message as the client sent it (unmasked, inflated).
    pub(super) request: Bytes,
    pub(super) started: tokio::time::Instant,
    pub(super) first_event: Option<tokio::time::Instant>,
    /// The events as SSE (`event:` and `data:` lines), as the HTTP API streams them.
    pub(super) events: Vec<u8>,
    /// The event that ended it; `None` when the socket ended first.
    pub(super) ended_by: Option<String>,
}

/// Splits a relayed Responses socket into turns, from copies of what crossed it.
pub(super) struct Turns {
    up: crate::observer::frames::Frames,
    down: crate::observer::frames::Frames,
    open: std::collections::VecDeque<Turn>,
    messages: Vec<crate::observer::frames::Message>,
    /// Messages read each way that were not turns or their events.
    pub(super) other: u64,
    /// A message too large to read, or framing that could not be followed.
    pub(super) unread: Option<String>,
}

impl Turns {
    /// For a socket whose 101 answer agreed on `extensions`; `limit` bounds one message.
    pub(super) fn new(extensions: &str, limit: usize) -> Turns {
        use crate::observer::frames::{Deflate, Frames};
        let (up, down) = Deflate::agreed(extensions);
        Turns {
            up: Frames::new(up, limit),
            down: Frames::new(down, limit),
            open: std::collections::VecDeque::new(),
            messages: Vec::new(),
            other: 0,
            unread: None,
        }
    }

    /// Reads a chunk that crossed `way`; every turn that ended goes to `ended`.
    pub(super) fn read(&mut self, way: Way, chunk: &[u8], ended: &mut impl FnMut(Turn)) {
        use crate::observer::frames::Message;
        let frames = match way {
            Way::Up => &mut self.up,
            Way::Down => &mut self.down,
        };
        frames.push(chunk, &mut self.messages);
        if let (None, Some(e)) = (&self.unread, frames.broken()) {
            let side = if way == Way::Up { "client" } else { "server" };
            self.unread = Some(format!("the {side}'s frames could not be read on: {e}"));
        }
        for message in std::mem::take(&mut self.messages) {
            let text = match message {
                Message::Text(t) => t,
                Message::TooLarge(n) => {
                    self.unread.get_or_insert_with(|| {
                        format!("a message of {n} bytes was over the limit")
                    });
                    continue;
                }
                Message::Binary(_) | Message::Close => {
                    self.other += 1;
                    continue;
                }
            };
            let kind = kind_of(&text);
            match (way, kind.as_deref()) {
                (Way::Up, Some("response.create")) => self.open.push_back(Turn {
                    request: text,
                    started: tokio::time::Instant::now(),
                    first_event: None,
                    events: Vec::new(),
                    ended_by: None,
                }),
                (Way::Down, Some(kind)) if !self.open.is_empty() => {
                    let terminal = TERMINAL.contains(&kind);
                    if let Some(turn) = self.open.front_mut() {
                        turn.first_event
                            .get_or_insert_with(tokio::time::Instant::now);
                        turn.events.extend_from_slice(b"event: ");
                        turn.events.extend_from_slice(kind.as_bytes());
                        turn.events.extend_from_slice(b"\ndata: ");
                        turn.events.extend_from_slice(&text);
                        turn.events.extend_from_slice(b"\n\n");
                        if terminal {
                            turn.ended_by = Some(kind.to_owned());
                        }
                    }
                    if terminal && let Some(turn) = self.open.pop_front() {
                        ended(turn);
                    }
                }
                _ => self.other += 1,
            }
        }
    }

    /// The turns still open when the socket ended.
    pub(super) fn unfinished(&mut self) -> impl Iterator<Item = Turn> + '_ {
        self.open.drain(..)
    }
}

impl super::Proxy {
    /// Emits the record of one turn: the socket's facts, the client's message as the
    /// request, and its events as the SSE answer the HTTP API would have streamed,
    /// read by the same observer (usage, the message, the cache analysis).
    pub(super) fn record_turn(&self, socket: &ExchangeRecord, turn: Turn) {
        let mut r = socket.clone();
        r.id = ExchangeId::new();
        r.started_at = std::time::SystemTime::now() - turn.started.elapsed();
        // A turn is what a POST of its message to the path would be.
        r.method = http::Method::POST;
        for list in [&mut r.rules_fired, &mut r.body_diff] {
            list.clear();
        }
        r.edits.clear();
        r.policy_runs.clear();
        r.findings.clear();
        r.tags = vec!["websocket".into(), format!("socket:{}", socket.id)];
        r.model = crate::provider::sniff(&turn.request).model;
        r.set_request_body(turn.request.clone(), turn.request.clone());
        r.conversation = crate::conversation::ConversationCell::new(
            &r.request_headers,
            &self.settings.conversation,
        );
        r.conversation.set_body(r.prompt.clone());
        r.bytes_in = turn.request.len() as u64;
        r.timing = crate::record::Timing {
            first_byte: turn.first_event.map(|t| t - turn.started),
            total: turn.started.elapsed(),
            ..Default::default()
        };
        let (outcome, error) = match turn.ended_by.as_deref() {
            Some("response.completed") => (Outcome::Ok, None),
            Some(kind) => (
                Outcome::ProviderError,
                Some(format!("the turn ended with {kind}")),
            ),
            None => (
                self.recorder.cut_outcome(),
                Some("the socket closed before the turn ended".to_owned()),
            ),
        };
        let events = Bytes::from(turn.events);
        let mut sse = HeaderMap::new();
        sse.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/event-stream"),
        );
        let (provider, api) = (
            r.provider.unwrap_or(Provider::OpenAi),
            r.api.unwrap_or(crate::provider::Api::Responses),
        );
        let limit = self.settings.max_response;
        let recorder = self.recorder.clone();
        let message = recorder.reads_message();
        let bytes = r.held_bytes() + events.len() as u64;
        self.recorder.begin();
        self.recorder.submit(
            Box::new(move || {
                let observation = crate::observer::observe(
                    provider,
                    api,
                    &sse,
                    std::slice::from_ref(&events),
                    false,
                    limit,
                    message,
                );
                r.bytes_out = events.len() as u64;
                // A provider error inside a completed turn still counts as one.
                let (outcome, error) = match (&observation.summary.provider_error, outcome) {
                    (Some(e), Outcome::Ok) => (Outcome::ProviderError, Some(e.clone())),
                    _ => (outcome, error),
                };
                r.observation = Some(observation);
                r.outcome = outcome;
                r.error = error;
                recorder.emit(&mut r);
            }),
            bytes,
        );
    }
}

//! A WebSocket upgrade (Codex's Responses socket, `GET …/responses` with
//! `Upgrade: websocket`): the upstream is upgraded first, so its refusal reaches the
//! client as its own status; on its 101 the client is upgraded too and the bytes are
//! copied both ways unchanged (permessage-deflate, when the two ends agree on it, is
//! theirs). Or refused with a 426, which makes Codex fall back to HTTP at once.
//!
//! While policies are on, a [`Gate`] reads the frames on the relay's path: each
//! `response.create` runs the request phases, and each turn's events its per-event
//! policies, as an HTTP request and its SSE answer would.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http::header::{CONNECTION, UPGRADE};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::id::ExchangeId;
use crate::observer::frames::{self, Head, read_head};
use crate::policy::{EventPolicy, SharedReport};
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
    /// Whether it ended because both sides were silent for the idle timeout.
    pub(super) idle: bool,
}

/// How much of one direction is read at a time.
const CHUNK: usize = 64 << 10;

/// Waits for both upgrades, then copies both ways until one side closes, breaks
/// off, or both are silent for `idle`.
pub(super) async fn relay(
    client: OnUpgrade,
    upstream: OnUpgrade,
    idle: Duration,
    mut gate: Option<Gate<impl Police>>,
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
        // Per-event policies may hold an event until a time.
        let due = gate.as_ref().and_then(Gate::next_release);
        let step = tokio::time::timeout(idle, async {
            tokio::select! {
                r = client_read.read(&mut up), if client_open => Step::Up(r),
                r = upstream_read.read(&mut down), if upstream_open => Step::Down(r),
                () = sleep_until(due), if due.is_some() => Step::Due,
            }
        })
        .await;
        // The upstream's end: what per-event policies hold goes out before it.
        let upstream_closed = match &step {
            Ok(Step::Down(Ok(0))) => true,
            Ok(Step::Down(Err(e))) => e.kind() == std::io::ErrorKind::UnexpectedEof,
            _ => false,
        };
        if upstream_closed && let Some(g) = gate.as_mut() {
            // A failed write here is the client's, and shows at the close below too.
            if g.upstream_ended().is_ok() {
                let _ = g.flush(&mut client_write).await;
            }
        }
        let moved = match (step, gate.as_mut()) {
            (Err(_), _) => {
                out.error = Some(format!("silent for {} s (--idle-timeout)", idle.as_secs()));
                out.idle = true;
                break;
            }
            (Ok(Step::Due), Some(g)) => g.release_due().map_err(|e| (true, e)),
            (Ok(Step::Due), None) => Ok(()),
            // A failed read is its side's; a failed write the other's.
            // With policies on, each message the client sends waits for them.
            (Ok(Step::Up(Ok(n))), Some(g)) if n > 0 => {
                out.from_client += n as u64;
                g.pass(&up[..n], &mut upstream_write, &mut watch)
                    .await
                    .map_err(|(side, e)| (side == Way::Down, e))
            }
            // Read after it is passed on: the copy costs the relay no latency.
            (Ok(Step::Up(r)), _) => {
                let client = r.is_err();
                pass(r, &up, &mut upstream_write, &mut client_open)
                    .await
                    .map(|n| {
                        watch(Way::Up, &up[..n as usize]);
                        out.from_client += n;
                    })
                    .map_err(|e| (client, e))
            }
            (Ok(Step::Down(Ok(n))), Some(g)) if n > 0 => {
                out.to_client += n as u64;
                // Framing the upstream broke is its fault; a failed write the client's.
                g.pass_down(&down[..n], &mut watch)
                    .map_err(|e| (e.kind() != std::io::ErrorKind::InvalidData, e))
            }
            (Ok(Step::Down(r)), _) => {
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
        // What the gate has for the client goes in one write.
        let moved = match (moved, gate.as_mut()) {
            (Ok(()), Some(g)) => g.flush(&mut client_write).await.map_err(|e| (true, e)),
            (moved, _) => moved,
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

/// What a socket's policies decided on one `response.create` message.
pub(super) enum Verdict {
    /// Pass the message's frames on as they came.
    Pass,
    /// Send this message upstream instead.
    Replace(Bytes),
    /// Send nothing upstream; answer the client with this event instead.
    Refuse(Bytes),
}

/// Decides on each `response.create` message a policed socket's client sends.
pub(super) trait Police: Send {
    fn check(&mut self, message: Bytes) -> impl std::future::Future<Output = Verdict> + Send;

    /// A message was answered with an error and not sent (over the limit, or not
    /// readable): its record says so.
    fn unsent(&mut self, size: u64, outcome: Outcome, why: String);

    /// The per-event policies of the turn just let through, which read its events
    /// as they come back (`None` when none acts on them).
    fn events(&mut self) -> Option<Box<dyn EventPolicy>> {
        None
    }
}

/// The per-event policies of the turn whose events are streaming back.
struct TurnEvents {
    engine: Box<dyn EventPolicy>,
    /// Events pushed and not yet seen released, with their frames as they came: an
    /// event the policies leave alone goes out as its own bytes.
    pushed: std::collections::VecDeque<(Vec<u8>, Vec<u8>)>,
    /// Reads the events the policies release back into messages.
    released: crate::provider::sse::SseDecoder,
    /// A policy ended the turn for the client: its later events are dropped.
    blocked: bool,
}

/// A data message being read whole, one direction's: its frames as they came, its
/// payload unmasked, and whether any of its frames said compressed.
#[derive(Default)]
struct Held {
    raw: Vec<u8>,
    payload: Vec<u8>,
    compressed: bool,
}

impl Held {
    /// Adds a whole frame whose head is `head`.
    fn push(&mut self, frame: Vec<u8>, head: &Head) {
        let at = self.payload.len();
        self.payload.extend_from_slice(&frame[head.len..]);
        if let Some(m) = head.mask {
            frames::unmask(&mut self.payload[at..], m);
        }
        self.compressed |= head.rsv;
        self.raw.extend(frame);
    }
}

/// Reads the client's frames on the relay's path when policies are on (the upgrade
/// then offered no compression): control frames pass at once, each data message is
/// held until it is whole and the policies have decided on it. It fails closed: a
/// message it cannot read (compressed, no JSON `type`, over the limit) is answered
/// with an error event and not sent.
pub(super) struct Gate<P> {
    police: P,
    /// The client's bytes of a frame head not yet whole, or of a held frame.
    pending: Vec<u8>,
    /// The client's message being held.
    up: Held,
    /// The largest message held; a larger one is refused, not passed unread.
    limit: usize,
    /// While an over-limit message is dropped: its payload bytes still to drop in
    /// this frame, whether this frame is its last, and its size so far.
    dropping: Option<(u64, bool, u64)>,
    /// The upstream's side: bytes of a frame head not yet whole, and the payload
    /// bytes of the current frame still to pass. Events of promptgate's own wait in
    /// `queued` until the upstream's frame in flight has passed whole.
    down_head: Vec<u8>,
    down_left: u64,
    queued: Vec<u8>,
    /// Per-event policies are on: the upstream's messages up to this size are read
    /// whole (below), and each turn's events go through its [`TurnEvents`].
    down_limit: Option<usize>,
    /// One slot per turn let through and not yet ended, oldest first: the upstream
    /// answers them in order, so the front one owns the events that come.
    /// `None`: no per-event policy reads that turn.
    events: std::collections::VecDeque<Option<TurnEvents>>,
    /// The upstream's message being read; `passing` while an over-limit message
    /// passes unread.
    down: Held,
    passing: bool,
    /// What goes to the client at the end of this step (see [`Gate::flush`]).
    out: Vec<u8>,
}

/// A control frame's payload is at most 125 bytes (RFC 6455 §5.5).
const MAX_CONTROL: u64 = 125;

impl<P: Police> Gate<P> {
    /// A gate that reads the client's messages (up to `limit` bytes each) and, with
    /// `down_limit`, the upstream's too (up to that many bytes each).
    pub(super) fn new(police: P, limit: usize, down_limit: Option<usize>) -> Gate<P> {
        Gate {
            police,
            pending: Vec::new(),
            up: Held::default(),
            limit,
            dropping: None,
            down_head: Vec::new(),
            down_left: 0,
            queued: Vec::new(),
            down_limit,
            events: std::collections::VecDeque::new(),
            down: Held::default(),
            out: Vec::new(),
            passing: false,
        }
    }

    /// Whether no frame of the upstream's, nor a fragmented message of its, is
    /// part-way out to the client.
    fn between_frames(&self) -> bool {
        self.down_left == 0
            && !self.passing
            && (self.down_limit.is_some() || self.down_head.is_empty())
    }

    /// Writes what the gate has for the client, in one write: the relay calls it
    /// after each of the gate's steps.
    // Written frame by frame, a turn's 22 events were 44 writes: ~150-350 µs p50 a turn.
    pub(super) async fn flush(
        &mut self,
        client: &mut (impl AsyncWrite + Unpin),
    ) -> std::io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let result = client.write_all(&self.out).await;
        self.out.clear();
        result
    }

    /// Sends frames of promptgate's own: now, or once the upstream's frame or
    /// fragmented message in flight has passed.
    fn own(&mut self, frames: &[u8]) -> std::io::Result<()> {
        if self.between_frames() {
            self.out.extend_from_slice(frames);
            Ok(())
        } else {
            self.queued.extend_from_slice(frames);
            Ok(())
        }
    }

    /// Passes what the upstream sent to the client as it comes, keeping count of
    /// where its frames end, so that an event of promptgate's own goes out only
    /// between two of them. Nothing is held but a frame head's few bytes.
    fn pass_down(
        &mut self,
        mut chunk: &[u8],
        watch: &mut impl FnMut(Way, &[u8]),
    ) -> std::io::Result<()> {
        if let Some(limit) = self.down_limit {
            return self.read_down(chunk, limit, watch);
        }
        while !chunk.is_empty() {
            if self.down_left > 0 {
                let n = self.down_left.min(chunk.len() as u64) as usize;
                self.out.extend_from_slice(&chunk[..n]);
                watch(Way::Down, &chunk[..n]);
                self.down_left -= n as u64;
                chunk = &chunk[n..];
            } else {
                // A head is at most 14 bytes: take one byte at a time until it is whole.
                self.down_head.push(chunk[0]);
                chunk = &chunk[1..];
                if let Some(head) = read_head(&self.down_head) {
                    let bytes = std::mem::take(&mut self.down_head);
                    self.out.extend_from_slice(&bytes);
                    watch(Way::Down, &bytes);
                    self.down_left = head.payload;
                    // Nothing of promptgate's own may come between a message's fragments.
                    if head.opcode & 0x08 == 0 {
                        self.passing = !head.fin;
                    }
                }
            }
            if self.between_frames() {
                self.flush_queued()?;
            }
        }
        Ok(())
    }

    /// With per-event policies on: reads what the upstream sent into whole messages
    /// (control frames pass at once) and hands each to [`Gate::event`]. A message
    /// over `limit` passes unread, as an over-limit JSON answer does over HTTP (or is
    /// dropped, when its turn was blocked).
    fn read_down(
        &mut self,
        chunk: &[u8],
        limit: usize,
        watch: &mut impl FnMut(Way, &[u8]),
    ) -> std::io::Result<()> {
        self.down_head.extend_from_slice(chunk);
        loop {
            if self.down_left > 0 {
                let n = self.down_left.min(self.down_head.len() as u64) as usize;
                if n == 0 {
                    return Ok(());
                }
                let bytes: Vec<u8> = self.down_head.drain(..n).collect();
                if !self.front_blocked() {
                    self.out.extend_from_slice(&bytes);
                }
                watch(Way::Down, &bytes);
                self.down_left -= n as u64;
                if self.between_frames() {
                    self.flush_queued()?;
                }
                continue;
            }
            let Some(head) = read_head(&self.down_head) else {
                return Ok(());
            };
            let control = head.opcode & 0x08 != 0;
            if control && head.payload > MAX_CONTROL {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the upstream sent a control frame over 125 bytes",
                ));
            }
            let held = self.down.payload.len() as u64;
            if !control && (self.passing || held.saturating_add(head.payload) > limit as u64) {
                if !self.passing {
                    self.pass_unread(&head)?;
                }
                let raw = std::mem::take(&mut self.down).raw;
                let head_bytes: Vec<u8> = self.down_head.drain(..head.len).collect();
                for bytes in [raw, head_bytes] {
                    if !self.front_blocked() {
                        self.out.extend_from_slice(&bytes);
                    }
                    watch(Way::Down, &bytes);
                }
                self.passing = !head.fin;
                self.down_left = head.payload;
                continue;
            }
            let end = head.len.saturating_add(head.payload as usize);
            if self.down_head.len() < end {
                return Ok(());
            }
            let frame: Vec<u8> = self.down_head.drain(..end).collect();
            if control {
                self.out.extend_from_slice(&frame);
                watch(Way::Down, &frame);
                continue;
            }
            self.down.push(frame, &head);
            if head.fin {
                self.event(watch)?;
            }
        }
    }

    /// Whether the turn whose events come now was ended by a policy.
    fn front_blocked(&self) -> bool {
        matches!(self.events.front(), Some(Some(e)) if e.blocked)
    }

    /// An upstream message too large to read whole starts passing unread: when its
    /// first bytes say it ends its turn, the turn's policies let out what they hold
    /// first, and the turn is over.
    fn pass_unread(&mut self, head: &Head) -> std::io::Result<()> {
        let mut start = self.down.payload.clone();
        let body = &self.down_head[head.len..];
        let mut first = body[..body.len().min(256)].to_vec();
        if let Some(m) = head.mask {
            frames::unmask(&mut first, m);
        }
        start.extend_from_slice(&first);
        if leading_kind(&start).is_some_and(|k| TERMINAL.contains(&k)) {
            self.end_turn()?;
        }
        Ok(())
    }

    /// The front turn ended: what its policies hold goes out, and the next turn's
    /// events are the next to come.
    fn end_turn(&mut self) -> std::io::Result<()> {
        if let Some(Some(events)) = self.events.front_mut()
            && !events.blocked
        {
            let mut out = Vec::new();
            events.engine.finish(&mut out);
            self.send_released(out)?;
        }
        self.events.pop_front();
        Ok(())
    }

    /// One whole message from the upstream: through the front turn's per-event
    /// policies when they read it, else on as it came. The copy the turn's record
    /// reads is the upstream's, taken after the policies saw it (so their report is
    /// whole when the turn's end is read).
    fn event(&mut self, watch: &mut impl FnMut(Way, &[u8])) -> std::io::Result<()> {
        let Held {
            raw,
            mut payload,
            compressed,
        } = std::mem::take(&mut self.down);
        // A raw CR can only be JSON whitespace, but it would end an SSE line.
        for b in payload.iter_mut().filter(|b| **b == b'\r') {
            *b = b' ';
        }
        let kind = if compressed { None } else { kind_of(&payload) };
        let terminal = kind.as_deref().is_some_and(|k| TERMINAL.contains(&k));
        match (self.events.front_mut(), kind) {
            (Some(Some(events)), Some(kind)) if !events.blocked => {
                let sse = Bytes::from(sse_event(&kind, &payload));
                // Policies that only observe see the event after it went, as over HTTP.
                let observing = !events.engine.may_change();
                if !observing {
                    events.pushed.push_back((payload, raw.clone()));
                }
                let mut out = Vec::new();
                let block = events
                    .engine
                    .push(sse, tokio::time::Instant::now(), &mut out);
                if observing {
                    self.out.extend_from_slice(&raw);
                } else {
                    self.send_released(out)?;
                }
                if let Some(block) = block {
                    let event = error_event(
                        block.status.as_u16(),
                        "blocked_by_rule",
                        &format!("promptgate: {} (rule {:?})", block.message, block.rule),
                    );
                    self.own(&server_text_frame(&event))?;
                    if let Some(Some(events)) = self.events.front_mut() {
                        events.blocked = true;
                    }
                }
            }
            // The rest of a turn a policy ended: dropped.
            (Some(Some(events)), _) if events.blocked => {}
            _ => self.out.extend_from_slice(&raw),
        }
        if terminal {
            self.end_turn()?;
        }
        watch(Way::Down, &raw);
        Ok(())
    }

    /// Sends what the front turn's policies released: each event as the frames it
    /// came in when they left it alone, else as a new frame.
    fn send_released(&mut self, out: Vec<Bytes>) -> std::io::Result<()> {
        let Some(Some(events)) = self.events.front_mut() else {
            return Ok(());
        };
        let mut messages = Vec::new();
        for bytes in &out {
            events.released.feed(bytes, &mut |_, data| {
                messages.push(data.as_bytes().to_vec())
            });
        }
        let mut frames = Vec::new();
        for message in messages {
            match events.pushed.iter().position(|(p, _)| *p == message) {
                Some(i) => {
                    let (_, raw) = events.pushed.drain(..=i).next_back().unwrap_or_default();
                    frames.extend_from_slice(&raw);
                }
                None => frames.extend_from_slice(&server_text_frame(&message)),
            }
        }
        if frames.is_empty() {
            return Ok(());
        }
        self.own(&frames)
    }

    /// When the front turn's policies must release an event they hold.
    pub(super) fn next_release(&self) -> Option<tokio::time::Instant> {
        self.events.front()?.as_ref()?.engine.next_release()
    }

    /// Sends the held events whose time has come.
    pub(super) fn release_due(&mut self) -> std::io::Result<()> {
        let Some(Some(events)) = self.events.front_mut() else {
            return Ok(());
        };
        let mut out = Vec::new();
        events
            .engine
            .release_due(tokio::time::Instant::now(), &mut out);
        self.send_released(out)
    }

    /// The upstream closed: every open turn's policies let out what they hold,
    /// before the close reaches the client.
    pub(super) fn upstream_ended(&mut self) -> std::io::Result<()> {
        while !self.events.is_empty() {
            self.end_turn()?;
        }
        self.passing = false;
        self.down_left = 0;
        self.flush_queued()
    }

    /// Sends promptgate's own events that waited for a frame boundary.
    fn flush_queued(&mut self) -> std::io::Result<()> {
        if self.queued.is_empty() {
            return Ok(());
        }
        let own = std::mem::take(&mut self.queued);
        self.out.extend_from_slice(&own);
        Ok(())
    }

    /// Sends an event of promptgate's own to the client: now, between the
    /// upstream's frames, or as soon as the one in flight has passed.
    fn answer(&mut self, event: &[u8]) -> std::io::Result<()> {
        self.own(&server_text_frame(event))
    }

    /// Takes what the client sent, passing on whatever the policies let through;
    /// a failed write is named by the side it went to.
    async fn pass(
        &mut self,
        mut chunk: &[u8],
        upstream: &mut (impl AsyncWrite + Unpin),
        watch: &mut impl FnMut(Way, &[u8]),
    ) -> Result<(), (Way, std::io::Error)> {
        loop {
            // An over-limit message's bytes are dropped as they come, never held.
            if let Some((left, last, size)) = self.dropping.as_mut() {
                let held = (*left).min(self.pending.len() as u64) as usize;
                self.pending.drain(..held);
                *left -= held as u64;
                let n = (*left).min(chunk.len() as u64) as usize;
                *left -= n as u64;
                chunk = &chunk[n..];
                if *left > 0 {
                    return Ok(());
                }
                let (last, size) = (*last, *size);
                if last {
                    self.dropping = None;
                    self.police.unsent(
                        size,
                        Outcome::TooLarge,
                        format!(
                            "a message of {size} bytes, over the {} bytes policies read \
                             (--max-body): answered with an error event, not sent",
                            self.limit
                        ),
                    );
                    let event = error_event(
                        413,
                        "request_too_large",
                        &format!(
                            "promptgate: a message over the {} bytes policies read \
                             (--max-body) is not sent",
                            self.limit
                        ),
                    );
                    self.answer(&event).map_err(|e| (Way::Down, e))?;
                }
            }
            self.pending.extend_from_slice(chunk);
            chunk = &[];
            let Some(head) = read_head(&self.pending) else {
                return Ok(());
            };
            let control = head.opcode & 0x08 != 0;
            if control && head.payload > MAX_CONTROL {
                // The client's own framing: it is the side that broke the socket.
                return Err((
                    Way::Down,
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "the client sent a control frame over 125 bytes",
                    ),
                ));
            }
            if !control {
                let held = self.up.payload.len() as u64;
                if let Some((left, last, size)) = self.dropping.as_mut() {
                    // A later fragment of the message being dropped.
                    *left = head.payload;
                    *last = head.fin;
                    *size = size.saturating_add(head.payload);
                } else if held.saturating_add(head.payload) > self.limit as u64 {
                    self.dropping = Some((head.payload, head.fin, held + head.payload));
                    self.up = Held::default();
                }
                if self.dropping.is_some() {
                    // Its payload is dropped at the loop's top, from what is pending on.
                    self.pending.drain(..head.len);
                    continue;
                }
            }
            // Whole frames only from here: the payload is within the limit.
            let end = head.len + head.payload as usize;
            if self.pending.len() < end {
                return Ok(());
            }
            let frame: Vec<u8> = self.pending.drain(..end).collect();
            if control {
                // Control frames may come between a message's fragments: at once.
                upstream.write_all(&frame).await.map_err(|e| (Way::Up, e))?;
                watch(Way::Up, &frame);
                continue;
            }
            self.up.push(frame, &head);
            if !head.fin {
                continue;
            }
            self.release(upstream, watch).await?;
        }
    }

    /// The held message is whole: sends it, its replacement, or promptgate's answer.
    async fn release(
        &mut self,
        upstream: &mut (impl AsyncWrite + Unpin),
        watch: &mut impl FnMut(Way, &[u8]),
    ) -> Result<(), (Way, std::io::Error)> {
        let Held {
            raw,
            payload,
            compressed,
        } = std::mem::take(&mut self.up);
        // Text or binary alike: a message is read by its JSON `type`.
        let kind = if compressed { None } else { kind_of(&payload) };
        let verdict = match kind.as_deref() {
            Some("response.create") => self.police.check(Bytes::from(payload)).await,
            Some(_) => Verdict::Pass,
            None => {
                self.police.unsent(
                    raw.len() as u64,
                    Outcome::BadRequest,
                    "a message that is not JSON with a \"type\" (or came compressed), on a \
                     socket whose messages policies read: answered with an error event, \
                     not sent"
                        .into(),
                );
                Verdict::Refuse(error_event(
                    400,
                    "unreadable_message",
                    "promptgate: policies read every message here, and this one is not \
                 JSON with a \"type\" (or came compressed): not sent",
                ))
            }
        };
        // Every turn let through is answered in order: its slot says whose policies
        // read the events that come.
        if matches!(verdict, Verdict::Pass | Verdict::Replace(_)) && self.down_limit.is_some() {
            let engine = self.police.events();
            self.events.push_back(engine.map(|engine| TurnEvents {
                engine,
                pushed: std::collections::VecDeque::new(),
                released: crate::provider::sse::SseDecoder::default(),
                blocked: false,
            }));
        }
        match verdict {
            Verdict::Pass => {
                upstream.write_all(&raw).await.map_err(|e| (Way::Up, e))?;
                watch(Way::Up, &raw);
            }
            Verdict::Replace(message) => {
                let framed = client_text_frame(&message);
                upstream
                    .write_all(&framed)
                    .await
                    .map_err(|e| (Way::Up, e))?;
                watch(Way::Up, &framed);
            }
            // promptgate's own event: its turn is recorded apart, not read as the
            // upstream's (it would end whichever turn is open).
            Verdict::Refuse(event) => {
                self.answer(&event).map_err(|e| (Way::Down, e))?;
            }
        }
        Ok(())
    }
}

/// A turn's record as it starts: the socket's facts, none of what policies did to
/// the upgrade, tagged with its socket.
fn turn_of(socket: &ExchangeRecord, id: ExchangeId) -> ExchangeRecord {
    let mut r = socket.clone();
    r.id = id;
    r.started_at = std::time::SystemTime::now();
    // A turn is what a POST of its message to the path would be.
    r.method = http::Method::POST;
    for list in [&mut r.rules_fired, &mut r.body_diff] {
        list.clear();
    }
    r.edits.clear();
    r.policy_runs.clear();
    r.findings.clear();
    r.tags = vec!["websocket".into(), format!("socket:{}", socket.id)];
    r
}

/// The socket's request-phase policies, run on each `response.create` as on an
/// HTTP request's body: what they let through carries their record to the turn's;
/// what they refuse is answered with an `error` event and recorded as blocked.
pub(super) struct TurnPolicies {
    pub(super) proxy: Arc<super::Proxy>,
    /// The socket's record, each turn's starting point.
    pub(super) socket: ExchangeRecord,
    pub(super) host: Option<String>,
    pub(super) target: Option<super::Target>,
    pub(super) route: Option<crate::provider::Route>,
    pub(super) policies: Vec<Arc<dyn crate::policy::Policy>>,
    /// The upgrade's headers as received: each turn's request headers.
    pub(super) received: HeaderMap,
    pub(super) notes: std::sync::mpsc::Sender<Policed>,
    /// The per-event policies of the turn last let through, until the gate takes them.
    pub(super) engine: Option<Box<dyn EventPolicy>>,
}

/// A turn the policies let through, as the socket's reader gets it: their record
/// (begun), and the reports its per-event policies fill as its events stream.
pub(super) struct Policed {
    record: ExchangeRecord,
    reports: Vec<SharedReport>,
}

/// The per-event policies of a turn let through: those of an SSE answer to its
/// message sent over HTTP (status 200, `text/event-stream`), which its events are.
fn turn_events(ex: &super::Exchange) -> Option<(Box<dyn EventPolicy>, Vec<SharedReport>)> {
    let route = ex.route.as_ref()?;
    let (mut head, ()) = http::Response::new(()).into_parts();
    head.headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    super::stream_policies(ex, route, &mut head, true)
}

impl Police for TurnPolicies {
    fn events(&mut self) -> Option<Box<dyn EventPolicy>> {
        self.engine.take()
    }

    fn unsent(&mut self, size: u64, outcome: Outcome, why: String) {
        let mut r = turn_of(&self.socket, ExchangeId::new());
        r.bytes_in = size;
        self.proxy.recorder.begin();
        let pending = super::PendingRecord {
            record: Some(r),
            recorder: self.proxy.recorder.clone(),
            started: tokio::time::Instant::now(),
        };
        pending.emit(outcome, Some(why));
    }

    async fn check(&mut self, message: Bytes) -> Verdict {
        let mut r = turn_of(&self.socket, ExchangeId::new());
        r.model = crate::provider::sniff(&message).model;
        r.set_request_body(message.clone(), message.clone());
        r.conversation = crate::conversation::ConversationCell::new(
            &self.received,
            &self.proxy.settings.conversation,
        );
        r.conversation.set_body(r.prompt.clone());
        self.proxy.recorder.begin();
        let mut ex = super::Exchange {
            pending: super::PendingRecord {
                record: Some(r),
                recorder: self.proxy.recorder.clone(),
                started: tokio::time::Instant::now(),
            },
            host: self.host.clone(),
            target: self.target.clone(),
            route: self.route.clone(),
            encoded: false,
            policies: self.policies.clone(),
            effects: crate::policy::Effects::default(),
            runs: Vec::new(),
            predicted_read: None,
        };
        let decided = super::request_policies(
            &mut ex,
            self.received.clone(),
            message.clone(),
            self.proxy.cache.as_deref(),
        )
        .await;
        match decided {
            Ok(outgoing) => {
                let (engine, reports) = match turn_events(&ex) {
                    Some((engine, reports)) => (Some(engine), reports),
                    None => (None, Vec::new()),
                };
                self.engine = engine;
                if let Some(record) = ex.pending.record.take()
                    && let Err(std::sync::mpsc::SendError(Policed { record, .. })) =
                        self.notes.send(Policed { record, reports })
                {
                    // The socket's reader is gone: its turn is recorded from here.
                    super::PendingRecord {
                        record: Some(record),
                        recorder: self.proxy.recorder.clone(),
                        started: tokio::time::Instant::now(),
                    }
                    .emit(
                        self.proxy.recorder.cut_outcome(),
                        Some("the socket's reader was gone; the turn went upstream unread".into()),
                    );
                }
                if outgoing.body == message {
                    Verdict::Pass
                } else {
                    Verdict::Replace(outgoing.body)
                }
            }
            Err(stop) => {
                let (status, code, text) = match &stop {
                    super::Stop::Blocked(b) => (
                        b.status,
                        "blocked_by_rule",
                        format!("{} (rule {:?})", b.message, b.rule),
                    ),
                    super::Stop::Error(e) => (e.kind.status(), e.kind.code(), e.message.clone()),
                    super::Stop::Stalled(_) => (
                        http::StatusCode::GATEWAY_TIMEOUT,
                        "stalled",
                        "stalled".to_owned(),
                    ),
                };
                // Recorded (and budgets' holds released) as an HTTP block is.
                drop(ex.answer(stop));
                Verdict::Refuse(error_event(
                    status.as_u16(),
                    code,
                    &format!("promptgate: {text}"),
                ))
            }
        }
    }
}

/// A message as a client sends it: one masked text frame (a fresh mask each time).
fn client_text_frame(payload: &[u8]) -> Vec<u8> {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS and varied per instance (as ids are).
    let k = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
        .to_le_bytes();
    frames::text_frame(payload, Some([k[0], k[1], k[2], k[3]]))
}

/// An event as a server sends it: one unmasked text frame.
fn server_text_frame(payload: &[u8]) -> Vec<u8> {
    frames::text_frame(payload, None)
}

/// An `error` event in the Responses socket's shape.
pub(super) fn error_event(status: u16, code: &str, message: &str) -> Bytes {
    let error_type = match status {
        401 => "authentication_error",
        403 => "permission_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        _ => "invalid_request_error",
    };
    let event = serde_json::json!({
        "type": "error",
        "status": status,
        "error": { "type": error_type, "code": code, "message": message },
    });
    Bytes::from(serde_json::to_vec(&event).unwrap_or_default())
}

/// One read's outcome, by direction, or a held event's time come.
enum Step {
    Up(std::io::Result<usize>),
    Down(std::io::Result<usize>),
    Due,
}

/// Sleeps until `at` (forever when `None`; the branch is off then).
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Writes what one read got to the other side (or half-closes it at the end).
async fn pass(
    read: std::io::Result<usize>,
    buf: &[u8],
    to: &mut (impl AsyncWrite + Unpin),
    open: &mut bool,
) -> std::io::Result<u64> {
    // A TLS peer that just closes (Codex never sends a close frame, nor TLS's
    // close_notify) has ended its side, as a TCP end would.
    let n = match read {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
        other => other?,
    };
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

/// The most bytes of copies a socket's reader may be behind the relay; past it the
/// copies stop (the relay never waits for its reader) and the record says so.
const MAX_BEHIND: usize = 64 << 20;

/// What the relay hands its reader.
enum Copy {
    Chunk(Way, Bytes),
    /// The reader fell behind by [`MAX_BEHIND`]: what follows was not copied.
    Lost,
    Ended(Relayed),
}

/// The relay's side of the copies: sends never wait.
pub(super) struct Copies {
    tx: std::sync::mpsc::Sender<Copy>,
    behind: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    lost: bool,
}

/// The reader's side of the copies.
pub(super) struct CopyReader {
    rx: std::sync::mpsc::Receiver<Copy>,
    behind: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Copies {
    pub(super) fn new() -> (Copies, CopyReader) {
        let (tx, rx) = std::sync::mpsc::channel();
        let behind = std::sync::Arc::default();
        (
            Copies {
                tx,
                behind: std::sync::Arc::clone(&behind),
                lost: false,
            },
            CopyReader { rx, behind },
        )
    }

    /// Copies a chunk that crossed `way` for the reader, unless it is too far behind.
    pub(super) fn send(&mut self, way: Way, chunk: &[u8]) {
        use std::sync::atomic::Ordering;
        if self.lost {
            return;
        }
        if self.behind.fetch_add(chunk.len(), Ordering::Relaxed) + chunk.len() > MAX_BEHIND {
            self.lost = true;
            let _ = self.tx.send(Copy::Lost);
            return;
        }
        let _ = self
            .tx
            .send(Copy::Chunk(way, Bytes::copy_from_slice(chunk)));
    }

    /// The socket ended as `relayed` says.
    pub(super) fn ended(self, relayed: Relayed) {
        let _ = self.tx.send(Copy::Ended(relayed));
    }
}

impl CopyReader {
    /// Reads the copies into `turns` until the socket ends; how it ended.
    pub(super) fn read(self, turns: &mut Turns, ended: &mut impl FnMut(Turn)) -> Relayed {
        use std::sync::atomic::Ordering;
        for copy in self.rx {
            match copy {
                Copy::Chunk(way, chunk) => {
                    turns.read(way, &chunk, ended);
                    self.behind.fetch_sub(chunk.len(), Ordering::Relaxed);
                }
                Copy::Lost => {
                    turns.lost();
                }
                Copy::Ended(relayed) => return relayed,
            }
        }
        Relayed {
            error: Some("the relay ended without saying how".into()),
            ..Relayed::default()
        }
    }
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

/// The `type` a message's first bytes give, when it is its first key (as the
/// Responses API writes its events): for a message too large to read whole.
fn leading_kind(start: &[u8]) -> Option<&str> {
    let rest = start.strip_prefix(b"{\"type\":\"")?;
    let end = memchr::memchr(b'"', rest)?;
    std::str::from_utf8(&rest[..end]).ok()
}

fn kind_of(message: &[u8]) -> Option<String> {
    serde_json::from_slice::<Kind<'_>>(message)
        .ok()
        .map(|k| k.kind.into_owned())
}

/// An event of the socket as the HTTP API streams it: its `type` as the SSE event's
/// name, the message as its data (one `data:` line per line).
fn sse_event(kind: &str, message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len() + kind.len() + 16);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.push(b'\n');
    for line in message.split(|b| *b == b'\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line);
        out.push(b'\n');
    }
    out.push(b'\n');
    out
}

/// One turn of the socket: a `response.create` and the events that answer it.
#[derive(Debug)]
pub(super) struct Turn {
    /// Its record's id, known when it starts: later turns name it.
    pub(super) id: ExchangeId,
    /// What the socket's policies made of its message (their record, begun), when
    /// they ran.
    pub(super) policed: Option<ExchangeRecord>,
    /// What its per-event policies did to its events, filled as they stream.
    reports: Vec<SharedReport>,
    /// The message as the client sent it (unmasked, inflated).
    pub(super) request: Bytes,
    /// Its whole prompt: the earlier turns it continues, their output, its input.
    pub(super) whole: Bytes,
    /// The turns `whole` was put together from, oldest first.
    pub(super) recovered_from: Vec<ExchangeId>,
    /// Why `whole` is not the whole prompt, when it is not.
    pub(super) missing: Option<String>,
    /// `whole` in parts, kept until the turn completes (its continuation needs it).
    prompt: Option<PromptParts>,
    pub(super) started: tokio::time::Instant,
    pub(super) first_event: Option<tokio::time::Instant>,
    /// The events as SSE (`event:` and `data:` lines), as the HTTP API streams them.
    pub(super) events: Vec<u8>,
    /// The event that ended it; `None` when the socket ended first.
    pub(super) ended_by: Option<String>,
}

impl Turn {
    /// A turn that starts with `request` (its whole prompt is put together when it
    /// ends).
    fn new(
        id: ExchangeId,
        request: Bytes,
        policed: Option<Policed>,
        missing: Option<String>,
    ) -> Turn {
        let (policed, reports) = match policed {
            Some(p) => (Some(p.record), p.reports),
            None => (None, Vec::new()),
        };
        Turn {
            id,
            policed,
            reports,
            whole: request.clone(),
            request,
            recovered_from: Vec::new(),
            missing,
            prompt: None,
            started: tokio::time::Instant::now(),
            first_event: None,
            events: Vec::new(),
            ended_by: None,
        }
    }
}

/// Splits a relayed Responses socket into turns, from copies of what crossed it.
pub(super) struct Turns {
    up: crate::observer::frames::Frames,
    down: crate::observer::frames::Frames,
    open: std::collections::VecDeque<Turn>,
    messages: Vec<crate::observer::frames::Message>,
    /// A message too large to read, or framing that could not be followed.
    pub(super) unread: Option<String>,
    /// Whose socket this is: a turn continues only responses made with the same
    /// credential (see [`Continuable`]).
    credential: u64,
    /// Where a response no socket of this process carried is looked for.
    lookup: Option<Lookup>,
    /// The copies stopped: open turns are dropped, nothing more is read.
    broken: bool,
    /// The policies' records of the messages they let through, in order.
    policed: std::sync::mpsc::Receiver<Policed>,
}

/// A whole prompt kept for the turn that continues it, in the two parts splicing
/// needs: every field but `input`, and the input items' JSON, comma-joined.
#[derive(Debug)]
pub(super) struct PromptParts {
    head: serde_json::Map<String, serde_json::Value>,
    items: Vec<u8>,
}

impl PromptParts {
    /// `{head…,"input":[items]}`: the fields in their order, `input` last.
    fn whole(&self) -> Option<Bytes> {
        let head = serde_json::to_vec(&self.head).ok()?;
        let mut out = Vec::with_capacity(head.len() + self.items.len() + 12);
        out.extend_from_slice(&head[..head.len() - 1]);
        if !self.head.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(b"\"input\":[");
        out.extend_from_slice(&self.items);
        out.extend_from_slice(b"]}");
        Some(Bytes::from(out))
    }

    /// Appends items' JSON.
    fn push(&mut self, items: impl IntoIterator<Item = Vec<u8>>) {
        for item in items {
            if !self.items.is_empty() {
                self.items.push(b',');
            }
            self.items.extend_from_slice(&item);
        }
    }
}

/// A completed turn, as a later one that continues it needs it.
struct Done {
    id: ExchangeId,
    prompt: PromptParts,
    /// The response's output items' JSON, which the next turn's prompt holds next.
    output: Vec<Vec<u8>>,
    from: Vec<ExchangeId>,
    /// About what it holds in memory, measured when it was made.
    bytes: usize,
}

impl Done {
    fn new(
        id: ExchangeId,
        prompt: PromptParts,
        output: Vec<Vec<u8>>,
        from: Vec<ExchangeId>,
    ) -> Done {
        // The fields besides the input (instructions, tools) are often tens of KB.
        let head = serde_json::to_vec(&prompt.head).map_or(0, |h| h.len());
        let bytes = head + prompt.items.len() + output.iter().map(Vec::len).sum::<usize>();
        Done {
            id,
            prompt,
            output,
            from,
            bytes,
        }
    }

    fn size(&self) -> usize {
        self.bytes
    }
}

/// A completed turn as a capture store keeps it: what a turn that continues it
/// after a restart needs.
pub(crate) struct StoredTurn {
    pub(crate) id: ExchangeId,
    /// Its whole prompt (the request body stored, redacted as stored).
    pub(crate) prompt: Bytes,
    /// Its answer as SSE events (`response.completed` holds the output items).
    pub(crate) events: Bytes,
}

/// Which credential made a request: the header that carried it and the id
/// [`crate::redact::credential_id`] gives it (a stored fingerprint gives the same).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Credential {
    pub(crate) header: &'static str,
    pub(crate) id: String,
}

impl Credential {
    /// The credential `headers` carry, if any.
    pub(crate) fn of(headers: &HeaderMap) -> Option<Credential> {
        ["authorization", "x-api-key"]
            .into_iter()
            .find_map(|header| {
                let v = headers.get(header)?;
                Some(Credential {
                    header,
                    id: crate::redact::credential_id(header, v.as_bytes()),
                })
            })
    }
}

/// The turns a capture store keeps, as a socket's reader asks for them when a turn
/// continues a response no socket of this process carried (capture implements it).
pub(crate) trait StoredTurns: Send + Sync {
    /// The newest stored turn of `conversation` whose answer's id is `response_id`,
    /// made with the credential `credential` names (`credential_id` of its header).
    fn answered(
        &self,
        conversation: &str,
        credential: &Credential,
        response_id: &str,
    ) -> Option<StoredTurn>;
}

/// Where a socket's reader looks for a turn its process never saw: the store, by the
/// conversation the socket's headers (or the message) name.
pub(super) struct Lookup {
    pub(super) store: Arc<dyn StoredTurns>,
    pub(super) headers: HeaderMap,
    pub(super) source: crate::conversation::KeySource,
}

impl Lookup {
    /// The stored turn `message` continues (`link`), as a turn kept in memory.
    fn done(&self, message: &Bytes, link: &str) -> Option<Done> {
        let mut cell = crate::conversation::ConversationCell::new(&self.headers, &self.source);
        cell.set_body(crate::prompt::PromptCell::of(crate::prompt::Prompt::read(
            message.clone(),
            Some(crate::prompt::Format::OpenAiResponses),
        )));
        // Only a turn made with the same credential: one client never takes in
        // another's prompt.
        let credential = Credential::of(&self.headers)?;
        let stored = self.store.answered(cell.get()?, &credential, link)?;
        let serde_json::Value::Object(mut head) =
            serde_json::from_slice::<serde_json::Value>(&stored.prompt).ok()?
        else {
            return None;
        };
        let mut prompt = PromptParts {
            items: Vec::new(),
            head: serde_json::Map::new(),
        };
        prompt.push(items(head.remove("input")));
        prompt.head = head;
        let mut output = Vec::new();
        crate::provider::sse::SseDecoder::default().feed(&stored.events, &mut |event, data| {
            if event == "response.completed"
                && let Ok(v) = serde_json::from_str::<serde_json::Value>(data)
                && let Some(items) = v["response"]["output"].as_array()
            {
                output = items
                    .iter()
                    .filter_map(|i| serde_json::to_vec(i).ok())
                    .collect();
            }
        });
        Some(Done::new(stored.id, prompt, output, Vec::new()))
    }
}

/// The most bytes of completed turns kept for the turns that continue them.
const CONTINUABLE_BYTES: usize = 64 << 20;

/// Completed turns a later turn may continue, across the sockets of this process:
/// a client that opens a new socket may go on from a response an earlier socket
/// carried. Keyed by the credential that made a response and its id, so one
/// client's turn never takes in another's prompt. A response is continued once
/// (taken, not copied); past [`CONTINUABLE_BYTES`] the oldest go.
#[derive(Default)]
struct Continuable {
    done: std::collections::HashMap<(u64, String), Done>,
    order: std::collections::VecDeque<(u64, String)>,
    bytes: usize,
}

impl Continuable {
    fn keep(&mut self, credential: u64, id: String, done: Done) {
        let key = (credential, id);
        self.bytes += done.size();
        if let Some(old) = self.done.insert(key.clone(), done) {
            self.bytes -= old.size();
        }
        self.order.push_back(key);
        while self.bytes > CONTINUABLE_BYTES {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(gone) = self.done.remove(&oldest) {
                self.bytes -= gone.size();
            }
        }
    }

    fn take(&mut self, credential: u64, id: &str) -> Option<Done> {
        let key = (credential, id.to_owned());
        let done = self.done.remove(&key)?;
        self.bytes -= done.size();
        self.order.retain(|k| *k != key);
        Some(done)
    }
}

/// The process's completed turns (see [`Continuable`]).
fn continuable() -> std::sync::MutexGuard<'static, Continuable> {
    static KEPT: std::sync::OnceLock<std::sync::Mutex<Continuable>> = std::sync::OnceLock::new();
    KEPT.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Who opened a socket, as [`Continuable`] keys it: a hash of its credential
/// headers (never kept as text).
pub(super) fn credential_of(headers: &HeaderMap) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // Seeded once per process: the same credential hashes the same in every socket.
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let mut h = SEED.get_or_init(Default::default).build_hasher();
    for name in ["authorization", "x-api-key", "chatgpt-account-id"] {
        for v in headers.get_all(name) {
            h.write(name.as_bytes());
            h.write(v.as_bytes());
        }
    }
    h.finish()
}

/// What a `response.create` message's whole prompt is, and where it came from.
struct Recovered {
    whole: Bytes,
    prompt: Option<PromptParts>,
    from: Vec<ExchangeId>,
    missing: Option<String>,
}

/// The items of an `input`, each as JSON (a string is one user message).
fn items(input: Option<serde_json::Value>) -> Vec<Vec<u8>> {
    let items = match input {
        Some(serde_json::Value::Array(items)) => items,
        Some(serde_json::Value::String(text)) => {
            vec![serde_json::json!({"role": "user", "content": text})]
        }
        _ => Vec::new(),
    };
    items
        .iter()
        .filter_map(|i| serde_json::to_vec(i).ok())
        .collect()
}

impl Turns {
    /// For a socket whose 101 answer agreed on `extensions`; `limit` bounds one message.
    pub(super) fn new(
        extensions: &str,
        limit: usize,
        policed: std::sync::mpsc::Receiver<Policed>,
        credential: u64,
        lookup: Option<Lookup>,
    ) -> Turns {
        use crate::observer::frames::{Deflate, Frames};
        let (up, down) = Deflate::agreed(extensions);
        Turns {
            up: Frames::new(up, limit),
            down: Frames::new(down, limit),
            open: std::collections::VecDeque::new(),
            messages: Vec::new(),
            unread: None,
            credential,
            lookup,
            broken: false,
            policed,
        }
    }

    /// The whole prompt of a `response.create` message: over the socket a turn sends
    /// only its new input items and names the response it continues; the prompt the
    /// provider works from is that response's prompt, its output, then these items.
    /// The message's own fields win; `type` and the link are not part of a prompt.
    /// Put together by splicing the earlier prompt's bytes: only the message and the
    /// earlier turn's fields other than its input are parsed or written again.
    // Cloning and re-serialising the whole JSON tree each turn cost ~1.5 ms a turn at ~600 KB.
    fn recover(&mut self, message: &Bytes) -> Recovered {
        let as_sent = |missing| Recovered {
            whole: message.clone(),
            prompt: None,
            from: Vec::new(),
            missing,
        };
        let Ok(serde_json::Value::Object(mut body)) = serde_json::from_slice(message) else {
            return as_sent(None);
        };
        body.remove("type");
        let mut from = Vec::new();
        let mut missing = None;
        let link = body
            .get("previous_response_id")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned);
        // Taken, not copied: a response is continued once, and what a socket keeps
        // stays one prompt deep.
        let done = link.as_ref().and_then(|l| {
            // Taken in its own statement: the lock is not held while the store is asked.
            let kept = continuable().take(self.credential, l);
            kept.or_else(|| self.lookup.as_ref()?.done(message, l))
        });
        let new_items = match (&link, &done) {
            (Some(_), Some(_)) => {
                body.remove("previous_response_id");
                items(body.remove("input"))
            }
            _ => items(body.remove("input")),
        };
        let mut prompt = match (&link, done) {
            (Some(_), Some(done)) => {
                let mut prompt = done.prompt;
                // A prewarm's `generate: false` is its own, not its successors'.
                prompt.head.remove("generate");
                for (k, v) in body {
                    prompt.head.insert(k, v);
                }
                prompt.push(done.output);
                from.extend(done.from);
                from.push(done.id);
                prompt
            }
            (Some(link), None) => {
                missing = Some(format!(
                    "it continues {link}, which no socket of this promptgate carried \
                     with this credential and the store does not hold for this \
                     conversation (promptgate started mid-session without its store, \
                     the response was made over HTTP, or it was continued before): \
                     this is the message's prompt only"
                ));
                PromptParts {
                    head: body,
                    items: Vec::new(),
                }
            }
            (None, _) => PromptParts {
                head: body,
                items: Vec::new(),
            },
        };
        prompt.push(new_items);
        match prompt.whole() {
            Some(whole) => Recovered {
                whole,
                prompt: Some(prompt),
                from,
                missing,
            },
            None => as_sent(missing),
        }
    }

    /// Keeps a completed turn for the turns that continue it.
    fn completed(&mut self, turn: &mut Turn, event: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(event) else {
            return;
        };
        let response = &v["response"];
        let (Some(id), Some(prompt)) = (response["id"].as_str(), turn.prompt.take()) else {
            return;
        };
        let output = response["output"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|i| serde_json::to_vec(i).ok())
                    .collect()
            })
            .unwrap_or_default();
        continuable().keep(
            self.credential,
            id.to_owned(),
            Done::new(turn.id, prompt, output, turn.recovered_from.clone()),
        );
    }

    /// Reads a chunk that crossed `way`; every turn that ended goes to `ended`.
    pub(super) fn read(&mut self, way: Way, chunk: &[u8], ended: &mut impl FnMut(Turn)) {
        use crate::observer::frames::Message;
        if self.broken {
            return;
        }
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
                    // A policed message that went out too large to read here: its
                    // policies' record still pairs with it, not with the next turn.
                    if way == Way::Up
                        && let Ok(policed) = self.policed.try_recv()
                    {
                        self.open.push_back(Turn::new(
                            policed.record.id,
                            policed.record.request_body.clone(),
                            Some(policed),
                            Some(format!(
                                "the message as sent ({n} bytes) was over what the socket's \
                                 reader keeps; this is the message before policies"
                            )),
                        ));
                    }
                    continue;
                }
                Message::Binary(_) | Message::Close => continue,
            };
            let kind = kind_of(&text);
            match (way, kind.as_deref()) {
                (Way::Up, Some("response.create")) => {
                    // A policed socket's messages come in the order they were let through.
                    let policed = self.policed.try_recv().ok();
                    let id = policed
                        .as_ref()
                        .map_or_else(ExchangeId::new, |p| p.record.id);
                    self.open.push_back(Turn::new(id, text, policed, None));
                }
                (Way::Down, Some(kind)) if !self.open.is_empty() => {
                    let terminal = TERMINAL.contains(&kind);
                    if let Some(turn) = self.open.front_mut() {
                        turn.first_event
                            .get_or_insert_with(tokio::time::Instant::now);
                        turn.events.extend_from_slice(&sse_event(kind, &text));
                        if terminal {
                            turn.ended_by = Some(kind.to_owned());
                        }
                    }
                    if terminal && let Some(mut turn) = self.open.pop_front() {
                        self.recover_into(&mut turn);
                        if kind == "response.completed" {
                            self.completed(&mut turn, &text);
                        }
                        ended(turn);
                    }
                }
                _ => {}
            }
        }
    }

    /// The copies stopped: nothing after this point can be read.
    fn lost(&mut self) {
        self.unread.get_or_insert_with(|| {
            format!(
                "the copies fell {} MiB behind the relay and stopped; later turns are not recorded",
                MAX_BEHIND >> 20
            )
        });
        self.broken = true;
    }

    /// The turns still open when the socket ended.
    pub(super) fn unfinished(&mut self) -> Vec<Turn> {
        let mut open: Vec<Turn> = self.open.drain(..).collect();
        // Let through, but their copies never read (the copies stopped): recorded too.
        while let Ok(policed) = self.policed.try_recv() {
            open.push(Turn::new(
                policed.record.id,
                policed.record.request_body.clone(),
                Some(policed),
                None,
            ));
        }
        for turn in &mut open {
            self.recover_into(turn);
        }
        open
    }

    /// Puts `turn`'s whole prompt together when it ends: by then every turn before
    /// it on the socket has ended too, whatever order the two directions' copies
    /// were read in.
    fn recover_into(&mut self, turn: &mut Turn) {
        let recovered = self.recover(&turn.request);
        turn.whole = recovered.whole;
        turn.prompt = recovered.prompt;
        turn.recovered_from = recovered.from;
        turn.missing = recovered.missing;
    }
}

/// Writes what a turn's per-event policies did into its record and logs their
/// lines; the block that ended the turn, if one did.
fn take_reports(
    r: &mut ExchangeRecord,
    reports: Vec<SharedReport>,
) -> Option<crate::policy::Block> {
    let mut blocked = None;
    for report in reports {
        let mut report = std::mem::take(&mut *report.lock().unwrap_or_else(|p| p.into_inner()));
        for (rule, line) in &report.logs {
            tracing::info!(target: "promptgate::rules", id = %r.id, rule = %rule, "{line}");
        }
        blocked = blocked.or(report.blocked.take());
        r.take_stream_report(report);
    }
    blocked
}

/// How a turn ended, for its record: blocked by a per-event policy, by its last
/// event, or cut (`cut` is the outcome of a cut, which a shutdown changes).
fn turn_outcome(
    blocked: Option<&crate::policy::Block>,
    ended_by: Option<&str>,
    cut: Outcome,
) -> (Outcome, Option<String>) {
    match (blocked, ended_by) {
        (Some(b), _) => (
            Outcome::Blocked,
            Some(format!(
                "rule {:?} ended the turn: {}; the client got an error event and none \
                 of the turn's later events",
                b.rule, b.message
            )),
        ),
        (None, Some("response.completed")) => (Outcome::Ok, None),
        (None, Some(kind)) => (
            Outcome::ProviderError,
            Some(format!("the turn ended with {kind}")),
        ),
        (None, None) => (
            cut,
            Some("the socket closed before the turn ended".to_owned()),
        ),
    }
}

impl super::Proxy {
    /// Emits the record of one turn: the socket's facts, the client's message as the
    /// request, and its events as the SSE answer the HTTP API would have streamed,
    /// read by the same observer (usage, the message, the cache analysis).
    pub(super) fn record_turn(
        &self,
        socket: &ExchangeRecord,
        mut turn: Turn,
        enders: &[Arc<dyn crate::policy::Policy>],
    ) {
        let mut r = turn_of(socket, turn.id);
        r.started_at = std::time::SystemTime::now() - turn.started.elapsed();
        // What the policies did to its message is this turn's record's too.
        let begun = turn.policed.is_some();
        if let Some(p) = turn.policed.take() {
            r.rules_fired = p.rules_fired;
            r.policy_runs = p.policy_runs;
            r.findings = p.findings;
            r.edits = p.edits;
            r.body_diff = p.body_diff;
            for tag in p.tags {
                if !r.tags.contains(&tag) {
                    r.tags.push(tag);
                }
            }
        }
        r.model = crate::provider::sniff(&turn.whole).model;
        // Every reader (the prompt view, the diff, the cache analysis, replay) works
        // on the whole prompt; the message as it crossed the socket is kept beside it.
        r.set_request_body(turn.whole.clone(), turn.whole.clone());
        r.websocket = Some(crate::record::SocketTurn {
            socket: socket.id,
            frame: turn.request.clone(),
            recovered_from: turn.recovered_from.clone(),
            missing: turn.missing.clone(),
        });
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
        // What its per-event policies did: the relay let them finish before the
        // copy of the turn's last event reached this reader.
        let blocked = take_reports(&mut r, std::mem::take(&mut turn.reports));
        let (outcome, error) = turn_outcome(
            blocked.as_ref(),
            turn.ended_by.as_deref(),
            self.recorder.cut_outcome(),
        );
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
        let enders = enders.to_vec();
        if !begun {
            self.recorder.begin();
        }
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
                // Budgets charge what the turn used, as an HTTP exchange's end does.
                if !enders.is_empty() {
                    let summary = r.observation.as_ref().map(|o| &o.summary);
                    let end = crate::policy::Ending {
                        id: r.id,
                        model: r.model.as_deref(),
                        conversation: r.conversation.get(),
                        response_id: summary.and_then(|s| s.response_id.as_deref()),
                        usage: summary.and_then(|s| s.usage.as_ref()),
                        answered: r.outcome == Outcome::Ok,
                    };
                    for p in &enders {
                        p.exchange_ended(&end);
                    }
                }
                recorder.emit(&mut r);
            }),
            bytes,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unmasked text frame (the reader takes masked and unmasked alike).
    fn frame(text: &str) -> Vec<u8> {
        let mut out = vec![0x81];
        match text.len() {
            n if n < 126 => out.push(n as u8),
            n => {
                out.push(126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
        }
        out.extend_from_slice(text.as_bytes());
        out
    }

    fn json(b: &[u8]) -> serde_json::Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn a_turn_on_a_new_socket_continues_a_response_of_an_earlier_one_with_its_credential() {
        let mut ended = Vec::new();
        let mut read = |turns: &mut Turns, way, text: &str| {
            turns.read(way, &frame(text), &mut |t| ended.push(t));
        };
        let mut first = Turns::new("", 1 << 20, std::sync::mpsc::channel().1, 7, None);
        read(
            &mut first,
            Way::Up,
            r#"{"type":"response.create","model":"gpt-5.5","instructions":"sys","input":[{"role":"user","content":"one"}]}"#,
        );
        read(
            &mut first,
            Way::Down,
            r#"{"type":"response.completed","response":{"id":"r-across-1","output":[{"type":"message","role":"assistant","content":[]}]}}"#,
        );
        drop(first);
        // Another credential does not see it; the same one, on a new socket, does.
        let next = r#"{"type":"response.create","model":"gpt-5.5","previous_response_id":"r-across-1","input":[{"role":"user","content":"two"}]}"#;
        let mut other = Turns::new("", 1 << 20, std::sync::mpsc::channel().1, 8, None);
        read(&mut other, Way::Up, next);
        read(
            &mut other,
            Way::Down,
            r#"{"type":"response.completed","response":{"id":"r-other","output":[]}}"#,
        );
        let mut second = Turns::new("", 1 << 20, std::sync::mpsc::channel().1, 7, None);
        read(&mut second, Way::Up, next);
        read(
            &mut second,
            Way::Down,
            r#"{"type":"response.completed","response":{"id":"r-across-2","output":[]}}"#,
        );
        assert_eq!(ended.len(), 3);
        assert!(ended[1].missing.is_some(), "another credential's response");
        let (from, turn) = (&ended[0], &ended[2]);
        assert_eq!(turn.recovered_from, vec![from.id]);
        assert_eq!(turn.missing, None);
        let whole = json(&turn.whole);
        assert_eq!(whole["instructions"], "sys");
        let input = whole["input"].as_array().unwrap();
        assert_eq!(input.len(), 3, "{whole}");
        assert_eq!(input[0]["content"], "one");
        assert_eq!(input[1]["role"], "assistant");
        assert_eq!(input[2]["content"], "two");
    }

    #[test]
    fn each_turns_whole_prompt_is_put_back_together_from_the_socket() {
        let mut turns = Turns::new("", 1 << 20, std::sync::mpsc::channel().1, 1, None);
        let mut ended = Vec::new();
        let mut read = |turns: &mut Turns, way, text: &str| {
            turns.read(way, &frame(text), &mut |t| ended.push(t));
        };
        read(
            &mut turns,
            Way::Up,
            r#"{"type":"response.create","model":"gpt-5.5","instructions":"sys","tools":[{"type":"web_search"}],"input":[],"generate":false}"#,
        );
        read(
            &mut turns,
            Way::Down,
            r#"{"type":"response.completed","response":{"id":"r0","output":[]}}"#,
        );
        read(
            &mut turns,
            Way::Up,
            r#"{"type":"response.create","model":"gpt-5.5","previous_response_id":"r0","input":[{"type":"message","role":"user","content":"one"}]}"#,
        );
        read(
            &mut turns,
            Way::Down,
            r#"{"type":"response.completed","response":{"id":"r1","output":[{"type":"function_call","call_id":"c1","name":"exec_command","arguments":"{}"}]}}"#,
        );
        read(
            &mut turns,
            Way::Up,
            r#"{"type":"response.create","model":"gpt-5.5","previous_response_id":"r1","input":[{"type":"function_call_output","call_id":"c1","output":"hi"}]}"#,
        );
        read(
            &mut turns,
            Way::Down,
            r#"{"type":"response.completed","response":{"id":"r2","output":[]}}"#,
        );
        read(
            &mut turns,
            Way::Up,
            r#"{"type":"response.create","previous_response_id":"r-elsewhere","input":[]}"#,
        );
        read(
            &mut turns,
            Way::Down,
            r#"{"type":"response.completed","response":{"id":"r3","output":[]}}"#,
        );
        assert_eq!(ended.len(), 4);
        let (prewarm, first, second, orphan) = (&ended[0], &ended[1], &ended[2], &ended[3]);
        assert_eq!(json(&prewarm.whole)["generate"], false);
        assert!(prewarm.recovered_from.is_empty());

        let whole = json(&first.whole);
        assert_eq!(whole["instructions"], "sys", "inherited from the prewarm");
        assert_eq!(whole["tools"][0]["type"], "web_search");
        assert_eq!(whole.get("generate"), None, "the prewarm's own");
        assert_eq!(whole.get("previous_response_id"), None);
        assert_eq!(whole.get("type"), None);
        assert_eq!(whole["input"].as_array().unwrap().len(), 1);
        assert_eq!(first.recovered_from, vec![prewarm.id]);

        let whole = json(&second.whole);
        let input: Vec<&str> = whole["input"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["type"].as_str().unwrap_or("message"))
            .collect();
        assert_eq!(input, ["message", "function_call", "function_call_output"]);
        assert_eq!(second.recovered_from, vec![prewarm.id, first.id]);
        assert_eq!(
            second.request.as_ref(),
            br#"{"type":"response.create","model":"gpt-5.5","previous_response_id":"r1","input":[{"type":"function_call_output","call_id":"c1","output":"hi"}]}"#,
            "the message stays as it was sent"
        );

        assert!(orphan.missing.as_deref().unwrap().contains("r-elsewhere"));
        assert_eq!(json(&orphan.whole)["previous_response_id"], "r-elsewhere");
    }
}

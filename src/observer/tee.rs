//! The response body the client reads: upstream frames pass straight through while
//! a copy of them is kept for the observer (see [`Kept`]).
//!
//! It also owns the two things only the body can see: the idle timeout (no byte
//! from upstream for too long; a live stream is never cut) and how the body ended.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use super::StreamError;
use super::stall::{OnStall, Stall, StallSettings};
use crate::error::error_chain;
use crate::provider::{self, Api, Provider};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Who watches a response body pass, chunk by chunk (the live feed): told of each
/// chunk the client got, a stall, and the end. It must not block.
pub(crate) trait Progress: Send {
    /// A body chunk passed to the client.
    fn chunk(&mut self, data: &[u8]);
    /// The stream has been silent past `stream.stall_after` for `silence`.
    fn stalled(&mut self, silence: std::time::Duration);
    /// The body ended.
    fn end(&mut self);
}

/// How a response body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BodyEnd {
    /// The upstream finished the body and the client took all of it.
    Complete,
    /// The upstream broke off (reset, protocol error) before the end.
    UpstreamError(String),
    /// No byte from upstream within the idle timeout.
    IdleTimeout(Duration),
    /// The client went away before the end; the upstream request was dropped with it.
    ClientGone,
    /// promptgate's shutdown grace period ended first; the client was told.
    Shutdown,
    /// The stream stalled and `stream.on_stall` ended it after `silence`; `event`:
    /// the client got an SSE error event before the incomplete ending.
    StallAborted { silence: Duration, event: bool },
    /// A per-event rule ended the stream: an SSE error event, then an incomplete ending.
    Blocked(crate::rules::Block),
}

/// What the tap saw, handed over once when the body ends.
#[derive(Debug)]
pub(crate) struct TapResult {
    /// The body as the client received it, in one buffer (up to the retention limit),
    /// less the events skipped unread (see [`ObservedBody::skipping`]).
    pub chunks: Vec<Bytes>,
    /// More bytes passed than were retained.
    pub truncated: bool,
    /// Events passed but not kept because their reader skips them unread.
    pub skipped_events: u32,
    /// Bytes forwarded to the client.
    pub bytes: u64,
    /// When the first body byte arrived from upstream.
    pub first_byte: Option<Instant>,
    /// When the body ended.
    pub ended: Instant,
    pub end: BodyEnd,
    /// The longest silence past the stall threshold, for a watched stream.
    pub stall: Option<Stall>,
}

type OnEnd = Box<dyn FnOnce(TapResult) + Send>;

/// The bytes of a body kept for the observer, copied into one buffer: memory then
/// follows the bytes kept, not how many reads brought them (a chunk sliced from
/// hyper's read buffer pins that whole buffer while it is held). A prefix: past
/// `limit` nothing more is kept. The buffer at most doubles, so its capacity stays
/// under twice the bytes kept (and never past `limit`).
#[derive(Debug)]
pub(crate) struct Kept {
    buf: Vec<u8>,
    limit: usize,
    /// Some bytes did not fit: the rest of the body is not kept.
    truncated: bool,
}

impl Kept {
    pub(crate) fn new(limit: usize) -> Self {
        Kept {
            buf: Vec::new(),
            limit,
            truncated: false,
        }
    }

    /// Keeps `data` whole if it fits under the limit; else keeps nothing more from
    /// here on (so what is kept stays a prefix of the body, with no gap).
    pub(crate) fn push(&mut self, data: &[u8]) {
        if data.is_empty() || self.truncated {
            self.truncated |= !data.is_empty();
            return;
        }
        let need = self.buf.len() + data.len();
        if need > self.limit {
            self.truncated = true;
            return;
        }
        if need > self.buf.capacity() {
            let want = (self.buf.capacity() * 2).max(need).min(self.limit);
            self.buf.reserve_exact(want - self.buf.len());
        }
        self.buf.extend_from_slice(data);
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The bytes kept, as one shared buffer (no copy), and whether some were not.
    pub(crate) fn finish(self) -> (Bytes, bool) {
        (Bytes::from(self.buf), self.truncated)
    }
}

/// Where a [`Skipper`] stands in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// Between events: no line of the next one yet.
    Between,
    /// Inside an event's first line, read into `head` to know its name.
    Head,
    /// Inside an event that is kept.
    Keep,
    /// Inside an event that is skipped.
    Skip,
}

/// The longest first line a skipped event can have (`event: content_block_delta`).
const HEAD_MAX: usize = 40;

/// For a stream whose message nobody reads: counts, instead of keeping, the events
/// whose reader skips them unread by name (an Anthropic stream's text deltas and
/// pings, most of its bytes). An event is known by its first line, `event: <name>`,
/// as the providers send them; anything else is kept as it came.
#[derive(Debug)]
struct Skipper {
    names: &'static [&'static str],
    at: At,
    /// The event's first line so far, while `at` is `Head` (at most `HEAD_MAX`).
    head: Vec<u8>,
    /// No byte of the current line yet.
    line_start: bool,
    /// The last byte was a `\r`: a `\n` right after it ends the same line.
    after_cr: bool,
    skipped: u32,
    /// The name of the event skipped last, when no event was kept after it.
    last_skipped: Option<&'static str>,
}

impl Skipper {
    fn new(names: &'static [&'static str]) -> Self {
        Skipper {
            names,
            at: At::Between,
            head: Vec::new(),
            line_start: true,
            after_cr: false,
            skipped: 0,
            last_skipped: None,
        }
    }

    /// The skipped event a first line names, if it names one.
    fn skipped_name(&self, line: &[u8]) -> Option<&'static str> {
        let value = line.strip_prefix(b"event:")?;
        let value = value.strip_prefix(b" ").unwrap_or(value);
        self.names.iter().copied().find(|n| n.as_bytes() == value)
    }

    /// Passes `data` on: what is kept goes to `kept`.
    fn feed(&mut self, data: &[u8], kept: &mut Kept) {
        // Bytes from `run` up to the current position go to `kept` when kept.
        let mut run = 0;
        let mut i = 0;
        while i < data.len() {
            let b = data[i];
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                i += 1;
                continue;
            }
            let line_end = b == b'\n' || b == b'\r';
            match (self.at, line_end) {
                (At::Between, false) => {
                    kept.push(&data[run..i]);
                    self.at = At::Head;
                    self.head.clear();
                    self.head.push(b);
                    run = i + 1;
                }
                (At::Head, false) => {
                    self.head.push(b);
                    run = i + 1;
                    if self.head.len() > HEAD_MAX {
                        kept.push(&self.head);
                        self.at = At::Keep;
                    }
                }
                (At::Head, true) => {
                    let name = self.skipped_name(&self.head);
                    self.at = if name.is_some() { At::Skip } else { At::Keep };
                    if let Some(name) = name {
                        self.last_skipped = Some(name);
                    } else {
                        kept.push(&self.head);
                        self.last_skipped = None;
                    }
                    run = i;
                }
                (At::Keep | At::Skip, true) if self.line_start => {
                    // A blank line: the event ends with it.
                    if self.at == At::Skip {
                        self.skipped += 1;
                        run = i + 1;
                    }
                    self.at = At::Between;
                }
                (At::Skip, _) => run = i + 1,
                _ => {}
            }
            self.line_start = line_end;
            self.after_cr = b == b'\r';
            // Within a kept or skipped event only line ends matter: jump to the next.
            i += 1;
            if matches!(self.at, At::Keep | At::Skip) && !line_end {
                let to = memchr::memchr2(b'\n', b'\r', &data[i..]).map_or(data.len(), |n| i + n);
                if self.at == At::Skip {
                    run = to;
                }
                if to > i {
                    self.line_start = false;
                    self.after_cr = false;
                }
                i = to;
            }
        }
        if self.at != At::Skip && self.at != At::Head {
            kept.push(&data[run..]);
        }
    }

    /// The stream ended: an unfinished first line is kept as it came.
    fn finish(&mut self, kept: &mut Kept) {
        if self.at == At::Head {
            kept.push(&self.head);
        }
    }
}

struct Tap {
    kept: Kept,
    /// Set for a stream whose skipped events are counted, not kept.
    skipper: Option<Box<Skipper>>,
    bytes: u64,
    first_byte: Option<Instant>,
    /// The last bytes forwarded, to know whether the stream stands at an event boundary.
    tail: [u8; 4],
    on_end: OnEnd,
}

impl Tap {
    fn record(&mut self, data: &Bytes, now: Instant) {
        self.first_byte.get_or_insert(now);
        self.bytes += data.len() as u64;
        match self.skipper.as_mut() {
            Some(skipper) => skipper.feed(data, &mut self.kept),
            None => self.kept.push(data),
        }
        let n = data.len().min(4);
        self.tail.rotate_left(n);
        self.tail[4 - n..].copy_from_slice(&data[data.len() - n..]);
    }

    /// The type of the last SSE event forwarded (from the bytes kept), for the stall warning.
    fn last_event(&self) -> Option<String> {
        if let Some(name) = self.skipper.as_ref().and_then(|s| s.last_skipped) {
            return Some(name.to_owned());
        }
        let c = self.kept.bytes();
        let at = memchr::memmem::rfind(c, b"event: ")?;
        let rest = &c[at + 7..];
        let end = memchr::memchr2(b'\n', b'\r', rest).unwrap_or(rest.len());
        Some(String::from_utf8_lossy(&rest[..end]).into_owned())
    }

    fn at_event_boundary(&self) -> bool {
        self.bytes == 0
            || self.tail.ends_with(b"\n\n")
            || self.tail.ends_with(b"\r\r")
            || self.tail == *b"\r\n\r\n"
    }

    /// What it saw, once the body ended with `end`.
    fn result(mut self, end: BodyEnd, stall: Option<Stall>) -> (OnEnd, TapResult) {
        let skipped_events = match self.skipper.as_mut() {
            Some(s) => {
                s.finish(&mut self.kept);
                s.skipped
            }
            None => 0,
        };
        let (body, truncated) = self.kept.finish();
        let result = TapResult {
            chunks: if body.is_empty() {
                Vec::new()
            } else {
                vec![body]
            },
            truncated,
            skipped_events,
            bytes: self.bytes,
            first_byte: self.first_byte,
            ended: Instant::now(),
            end,
            stall,
        };
        (self.on_end, result)
    }
}

/// What the stall watchdog needs to watch one streamed answer.
#[derive(Debug, Clone)]
pub(crate) struct StallWatch {
    pub settings: StallSettings,
    /// When the exchange started (stall times are told from it).
    pub started: Instant,
    /// For the warning: the exchange id and model.
    pub id: crate::id::ExchangeId,
    pub model: Option<String>,
}

/// The watchdog's state while the body streams.
struct Watch {
    spec: StallWatch,
    found: Option<Stall>,
    warned: bool,
}

/// The error type a per-event `block` sends when its rule names none.
const BLOCK_TYPE: &str = "permission_error";

/// How long a last frame (an error event) gets to be written before the
/// connection is cut: an error right after it could drop it from the write buffer.
const FLUSH_BEFORE_CUT: Duration = Duration::from_millis(50);

/// A response body that tees into the observer. See the module docs.
pub(crate) struct ObservedBody<B: Body> {
    inner: B,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    last_activity: Instant,
    tap: Option<Tap>,
    /// Set for SSE responses without a fixed length: on an upstream failure at an
    /// event boundary the client gets the provider's error event instead of a cut.
    error_event: Option<(Provider, Api)>,
    /// Resolves when promptgate's shutdown grace period is over.
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// The stall watchdog, for a streamed answer (boxed: most bodies have none).
    watch: Option<Box<Watch>>,
    /// Ending incomplete: after this pause, the error that cuts the connection.
    cutting: Option<Box<(Pin<Box<Sleep>>, String)>>,
    /// The live viewer's tap, while somebody watches.
    live: Option<Box<dyn Progress>>,
    done: bool,
}

impl<B> ObservedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    /// Wraps `inner`. `on_end` runs exactly once, when the body ends or is dropped.
    /// `watch` turns the stall watchdog on (streamed answers only).
    pub(crate) fn new(
        inner: B,
        idle_timeout: Duration,
        retain_limit: usize,
        error_event: Option<(Provider, Api)>,
        shutdown: impl Future<Output = ()> + Send + 'static,
        watch: Option<StallWatch>,
        on_end: impl FnOnce(TapResult) + Send + 'static,
    ) -> Self {
        let now = Instant::now();
        let empty = inner.is_end_stream();
        let first_wake = match &watch {
            Some(w) => idle_timeout.min(w.settings.stall_after),
            None => idle_timeout,
        };
        let mut body = ObservedBody {
            inner,
            idle_timeout,
            idle: Box::pin(tokio::time::sleep_until(now + first_wake)),
            last_activity: now,
            tap: Some(Tap {
                kept: Kept::new(retain_limit),
                skipper: None,
                bytes: 0,
                first_byte: None,
                tail: [0; 4],
                on_end: Box::new(on_end),
            }),
            error_event,
            shutdown: Box::pin(shutdown),
            watch: watch.map(|spec| {
                Box::new(Watch {
                    spec,
                    found: None,
                    warned: false,
                })
            }),
            cutting: None,
            live: None,
            done: false,
        };
        if empty {
            // HEAD, 204, 304 or a zero length: hyper may never poll it.
            body.done = true;
            body.finish(BodyEnd::Complete);
        }
        body
    }

    /// Shows the body to the live viewer as it passes.
    pub(crate) fn with_live(mut self, live: Option<Box<dyn Progress>>) -> Self {
        self.live = live;
        self
    }

    /// Counts, instead of keeping, the SSE events named `names` (events whose reader
    /// skips them unread: see `provider::unread_events`); none: everything is kept.
    pub(crate) fn skipping(mut self, names: &'static [&'static str]) -> Self {
        if let Some(tap) = self.tap.as_mut()
            && !names.is_empty()
            && tap.bytes == 0
        {
            tap.skipper = Some(Box::new(Skipper::new(names)));
        }
        self
    }

    fn finish(&mut self, end: BodyEnd) {
        if let Some(mut live) = self.live.take() {
            live.end();
        }
        let stall = self.watch.as_ref().and_then(|w| w.found);
        if let Some(tap) = self.tap.take() {
            let (on_end, result) = tap.result(end, stall);
            on_end(result);
        }
    }

    /// Ends the body after a failure as an incomplete response (never a clean end:
    /// no terminating chunk, a reset HTTP/2 stream): first, with `event`, the
    /// provider's error event when the stream stands at an event boundary.
    fn fail(
        &mut self,
        kind: &str,
        end: BodyEnd,
        event: bool,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let message = match &end {
            BodyEnd::UpstreamError(m) => m.clone(),
            BodyEnd::IdleTimeout(d) => format!("no data from upstream for {}s", d.as_secs()),
            BodyEnd::Shutdown => "shutting down: the answer was cut off (--shutdown-grace)".into(),
            BodyEnd::StallAborted { silence: d, .. } => format!(
                "the upstream stream stalled: no data for {}s, so promptgate ended it \
                 (stream.on_stall); retry the request",
                d.as_secs()
            ),
            BodyEnd::Blocked(block) => block.message.clone(),
            _ => String::new(),
        };
        let error_type = match &end {
            BodyEnd::Blocked(block) => Some(
                block
                    .error_type
                    .clone()
                    .unwrap_or_else(|| BLOCK_TYPE.into()),
            ),
            _ => None,
        };
        let at_boundary = self.tap.as_ref().is_some_and(Tap::at_event_boundary);
        let end = match end {
            BodyEnd::StallAborted { silence, .. } => BodyEnd::StallAborted {
                silence,
                event: event && at_boundary && self.error_event.is_some(),
            },
            other => other,
        };
        self.finish(end);
        let cut = format!("promptgate: {message}");
        match self.error_event {
            Some((provider, api)) if event && at_boundary => {
                let frame = provider::stream_error_event(
                    provider,
                    api,
                    error_type.as_deref().unwrap_or(kind),
                    error_type.as_deref(),
                    &message,
                );
                let pause = Box::pin(tokio::time::sleep(FLUSH_BEFORE_CUT));
                self.cutting = Some(Box::new((pause, cut)));
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(frame)))))
            }
            _ => {
                self.done = true;
                Poll::Ready(Some(Err(cut.into())))
            }
        }
    }

    /// A silence of `silence` that began at `began` is at least the stall threshold:
    /// keeps the longest, and warns once per exchange.
    fn note_stall(&mut self, began: Instant, silence: Duration) {
        let bytes = self.tap.as_ref().map_or(0, |t| t.bytes);
        let last_event = self.tap.as_ref().and_then(Tap::last_event);
        let Some(w) = self.watch.as_mut() else {
            return;
        };
        let stall = Stall {
            longest_ms: silence.as_millis() as u64,
            began_ms: began.saturating_duration_since(w.spec.started).as_millis() as u64,
            before_head: false,
            aborted: false,
        };
        w.found = Stall::max(w.found, Some(stall));
        if let Some(live) = self.live.as_mut() {
            live.stalled(silence);
        }
        if !w.warned {
            w.warned = true;
            tracing::warn!(
                id = %w.spec.id,
                model = %crate::redact::cut(
                    w.spec.model.as_deref().unwrap_or("-"),
                    crate::redact::NAME_MAX
                ),
                bytes,
                last_event = last_event.as_deref().unwrap_or("-"),
                on_stall = w.spec.settings.on_stall.name(),
                "stream stalled: no data from upstream for {}s",
                silence.as_secs()
            );
        }
    }
}

impl<B> Body for ObservedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(cutting) = this.cutting.as_mut() {
            if cutting.0.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let cut = this.cutting.take().map(|c| c.1).unwrap_or_default();
            this.done = true;
            return Poll::Ready(Some(Err(cut.into())));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && !data.is_empty()
                {
                    let now = Instant::now();
                    let silence = now - this.last_activity;
                    if this
                        .watch
                        .as_ref()
                        .is_some_and(|w| silence >= w.spec.settings.stall_after)
                    {
                        this.note_stall(this.last_activity, silence);
                    }
                    this.last_activity = now;
                    if let Some(tap) = this.tap.as_mut() {
                        tap.record(data, now);
                    }
                    if let Some(live) = this.live.as_mut() {
                        live.chunk(data);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                let any: &(dyn std::error::Error + 'static) = &e;
                if let Some(StreamError::Blocked(block)) = any.downcast_ref::<StreamError>() {
                    return this.fail("blocked", BodyEnd::Blocked(block.clone()), true);
                }
                let message = format!("upstream broke off mid-response: {}", error_chain(&e));
                this.fail("upstream_error", BodyEnd::UpstreamError(message), true)
            }
            // A close-delimited stream that ends inside an event did not finish: the
            // upstream's FIN only looks like an end.
            Poll::Ready(None)
                if this.error_event.is_some()
                    && !this.tap.as_ref().is_none_or(Tap::at_event_boundary) =>
            {
                let message = "stream ended mid-event: the upstream closed the connection \
                               inside an event"
                    .to_owned();
                this.fail("upstream_error", BodyEnd::UpstreamError(message), true)
            }
            Poll::Ready(None) => {
                this.done = true;
                this.finish(BodyEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Pending if this.shutdown.as_mut().poll(cx).is_ready() => {
                this.fail("shutting_down", BodyEnd::Shutdown, true)
            }
            Poll::Pending => loop {
                // The timer is re-armed lazily: chunks only move `last_activity`.
                match this.idle.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) => {
                        let now = Instant::now();
                        let silence = now - this.last_activity;
                        if silence >= this.idle_timeout {
                            let end = BodyEnd::IdleTimeout(this.idle_timeout);
                            return this.fail("upstream_timeout", end, true);
                        }
                        let mut next = this.last_activity + this.idle_timeout;
                        if let Some(settings) = this.watch.as_ref().map(|w| w.spec.settings) {
                            if silence >= settings.stall_after {
                                this.note_stall(this.last_activity, silence);
                                match settings.abort_at(this.last_activity) {
                                    Some(at) if now >= at => {
                                        if let Some(w) = this.watch.as_mut()
                                            && let Some(f) = w.found.as_mut()
                                        {
                                            f.aborted = true;
                                        }
                                        let event = settings.on_stall == OnStall::Error;
                                        let end = BodyEnd::StallAborted { silence, event };
                                        return this.fail("stream_stalled", end, event);
                                    }
                                    Some(at) => next = next.min(at),
                                    // Waiting: wake again to keep the longest silence.
                                    None => next = next.min(now + settings.stall_after),
                                }
                            } else {
                                next = next.min(this.last_activity + settings.stall_after);
                            }
                        }
                        this.idle.as_mut().reset(next);
                    }
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        // While cutting, the cut is still to come: the end must not look clean.
        self.done || (self.cutting.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match self.error_event {
            Some(_) => SizeHint::default(),
            None => self.inner.size_hint(),
        }
    }
}

impl<B: Body> Drop for ObservedBody<B> {
    fn drop(&mut self) {
        if let Some(tap) = self.tap.take() {
            // hyper stops polling once the inner body says it is at its end, or once
            // the declared length was sent (an HTTP/2 upstream's END_STREAM may still be
            // on its way then); anything else dropped early means the client went away.
            let end = if self.inner.is_end_stream() || self.inner.size_hint().exact() == Some(0) {
                BodyEnd::Complete
            } else {
                BodyEnd::ClientGone
            };
            let (on_end, result) = tap.result(end, self.watch.as_ref().and_then(|w| w.found));
            on_end(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::{Arc, Mutex};

    /// A scripted body: frames, errors and pauses.
    enum Step {
        Data(&'static str),
        Fail,
        Pause(Duration),
    }

    struct Script {
        steps: std::collections::VecDeque<Step>,
        sleep: Option<Pin<Box<Sleep>>>,
    }

    #[derive(Debug)]
    struct Broken;
    impl std::fmt::Display for Broken {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection reset")
        }
    }
    impl std::error::Error for Broken {}

    impl Body for Script {
        type Data = Bytes;
        type Error = Broken;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Broken>>> {
            if let Some(s) = self.sleep.as_mut() {
                if s.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
            }
            match self.steps.pop_front() {
                None => Poll::Ready(None),
                Some(Step::Data(d)) => {
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(d.as_bytes())))))
                }
                Some(Step::Fail) => Poll::Ready(Some(Err(Broken))),
                Some(Step::Pause(d)) => {
                    self.sleep = Some(Box::pin(tokio::time::sleep(d)));
                    self.poll_frame(cx)
                }
            }
        }
    }

    fn body(
        steps: Vec<Step>,
        idle: Duration,
        sse: bool,
    ) -> (ObservedBody<Script>, Arc<Mutex<Option<TapResult>>>) {
        watched(steps, idle, sse, None)
    }

    fn watched(
        steps: Vec<Step>,
        idle: Duration,
        sse: bool,
        stall: Option<StallSettings>,
    ) -> (ObservedBody<Script>, Arc<Mutex<Option<TapResult>>>) {
        let seen = Arc::new(Mutex::new(None));
        let slot = seen.clone();
        let b = ObservedBody::new(
            Script {
                steps: steps.into(),
                sleep: None,
            },
            idle,
            1 << 20,
            sse.then_some((Provider::Anthropic, Api::Messages)),
            std::future::pending(),
            stall.map(|settings| StallWatch {
                settings,
                started: Instant::now(),
                id: crate::id::ExchangeId::new(),
                model: None,
            }),
            move |r| *slot.lock().unwrap() = Some(r),
        );
        (b, seen)
    }

    async fn read_all<B: Body<Data = Bytes> + Unpin>(mut b: B) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        while let Some(f) = b.frame().await {
            match f {
                Ok(f) => out.extend_from_slice(f.data_ref().map(|d| &d[..]).unwrap_or(b"")),
                Err(_) => return (out, true),
            }
        }
        (out, false)
    }

    #[tokio::test]
    async fn passes_frames_and_reports_completion() {
        let (b, seen) = body(
            vec![Step::Data("a"), Step::Data("bc")],
            Duration::from_secs(5),
            false,
        );
        assert_eq!(read_all(b).await, (b"abc".to_vec(), false));
        let r = seen.lock().unwrap().take().unwrap();
        assert_eq!(r.end, BodyEnd::Complete);
        assert_eq!(r.bytes, 3);
        assert_eq!(
            r.chunks,
            vec![Bytes::from_static(b"abc")],
            "kept in one buffer"
        );
    }

    #[test]
    fn the_kept_copy_is_one_buffer_under_twice_its_bytes_and_a_prefix_under_the_cap() {
        // 20,000 small reads, as an SSE stream of small deltas comes: memory follows
        // the bytes kept, never the number of reads.
        let limit = 256 << 10;
        let mut kept = Kept::new(limit);
        let mut sent = Vec::new();
        for i in 0..20_000u32 {
            let chunk = format!("data: {{\"i\":{i}}}\n\n").repeat(1 + (i % 3) as usize);
            sent.extend_from_slice(chunk.as_bytes());
            kept.push(chunk.as_bytes());
            let (len, cap) = (kept.buf.len(), kept.buf.capacity());
            assert!(cap <= 2 * len, "capacity {cap} for {len} bytes kept");
            assert!(cap <= limit, "capacity {cap} past the cap");
        }
        let (body, truncated) = kept.finish();
        assert!(truncated && sent.len() > limit);
        assert!(
            body.len() <= limit && body.len() > limit - 100,
            "{}",
            body.len()
        );
        assert_eq!(body, sent[..body.len()], "a prefix, with no gap");
    }

    /// An Anthropic stream with text deltas and pings, its lines ended by `eol`.
    fn anthropic_stream(eol: &str) -> String {
        let mut events = vec![
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"claude-x\",\"content\":[],\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n".to_owned(),
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n".to_owned(),
            ": a comment\n\nevent: ping\ndata: {\"type\": \"ping\"}\n\n".to_owned(),
        ];
        for i in 0..50 {
            events.push(format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"w{i} \"}}}}\n\n"));
        }
        events.push(
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
                .to_owned(),
        );
        events.push("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":50}}\n\n".to_owned());
        events.push("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_owned());
        events.concat().replace('\n', eol)
    }

    #[test]
    fn skipped_events_are_counted_and_the_summary_is_the_same() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/event-stream"),
        );
        let names = crate::provider::unread_events(Provider::Anthropic, false);
        for eol in ["\n", "\r\n", "\r"] {
            let text = anthropic_stream(eol);
            let whole = crate::observer::observe(
                Provider::Anthropic,
                Api::Messages,
                &headers,
                &[Bytes::from(text.clone())],
                false,
                1 << 20,
                false,
            );
            assert_eq!(whole.summary.events, 56, "{eol:?}");
            for size in [1, 2, 3, 7, 26, 27, 64, 1000, text.len()] {
                let mut kept = Kept::new(1 << 20);
                let mut skipper = Skipper::new(names);
                for piece in text.as_bytes().chunks(size) {
                    skipper.feed(piece, &mut kept);
                }
                skipper.finish(&mut kept);
                let (body, _) = kept.finish();
                let mut seen = crate::observer::observe(
                    Provider::Anthropic,
                    Api::Messages,
                    &headers,
                    std::slice::from_ref(&body),
                    false,
                    1 << 20,
                    false,
                );
                seen.summary.events += skipper.skipped;
                assert_eq!(skipper.skipped, 51, "{eol:?} in pieces of {size}");
                assert_eq!(seen.summary, whole.summary, "{eol:?} in pieces of {size}");
                let body = String::from_utf8(body.to_vec()).unwrap();
                assert!(
                    !body.contains("content_block_delta") && !body.contains("ping"),
                    "{body}"
                );
                assert!(
                    body.len() < text.len() / 3,
                    "{} of {}",
                    body.len(),
                    text.len()
                );
            }
        }
    }

    #[tokio::test]
    async fn upstream_failure_at_boundary_becomes_an_error_event() {
        let (b, seen) = body(
            vec![Step::Data("event: ping\ndata: {}\n\n"), Step::Fail],
            Duration::from_secs(5),
            true,
        );
        let (out, errored) = read_all(b).await;
        let text = String::from_utf8(out).unwrap();
        assert!(
            errored,
            "after the event the stream ends incomplete, never cleanly"
        );
        assert!(
            text.ends_with("\n\n") && text.contains("event: error\ndata: {\"type\":\"error\""),
            "{text}"
        );
        let r = seen.lock().unwrap().take().unwrap();
        assert!(
            matches!(r.end, BodyEnd::UpstreamError(ref m) if m.contains("connection reset")),
            "{:?}",
            r.end
        );
    }

    #[tokio::test]
    async fn upstream_failure_mid_event_cuts_the_stream() {
        let (b, _) = body(
            vec![Step::Data("event: ping\ndata: {"), Step::Fail],
            Duration::from_secs(5),
            true,
        );
        let (out, errored) = read_all(b).await;
        assert!(errored);
        assert_eq!(out, b"event: ping\ndata: {");
    }

    #[tokio::test]
    async fn a_stream_that_ends_mid_event_is_cut_not_complete() {
        let (b, seen) = body(
            vec![Step::Data(
                "event: ping\ndata: {}\n\nevent: content_block_delta\ndata: {\"a\"",
            )],
            Duration::from_secs(5),
            true,
        );
        let (_, errored) = read_all(b).await;
        assert!(errored, "the client sees an abort, not a clean end");
        let r = seen.lock().unwrap().take().unwrap();
        assert!(
            matches!(r.end, BodyEnd::UpstreamError(ref m) if m.starts_with("stream ended mid-event")),
            "{:?}",
            r.end
        );
        // The same end at an event boundary is a clean one.
        let (b, seen) = body(
            vec![Step::Data("data: x\n\n")],
            Duration::from_secs(5),
            true,
        );
        assert!(!read_all(b).await.1);
        assert_eq!(seen.lock().unwrap().take().unwrap().end, BodyEnd::Complete);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timeout_fires_only_after_silence() {
        // Five pauses of 3 s under a 5 s idle timeout: a live stream is never cut.
        let mut steps = Vec::new();
        for _ in 0..5 {
            steps.push(Step::Pause(Duration::from_secs(3)));
            steps.push(Step::Data("data: x\n\n"));
        }
        steps.push(Step::Pause(Duration::from_secs(60)));
        steps.push(Step::Data("never"));
        let (b, seen) = body(steps, Duration::from_secs(5), true);
        let (out, _) = read_all(b).await;
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.matches("data: x").count(), 5);
        assert!(text.contains("no data from upstream for 5s"), "{text}");
        assert_eq!(
            seen.lock().unwrap().take().unwrap().end,
            BodyEnd::IdleTimeout(Duration::from_secs(5))
        );
    }

    fn stall(on_stall: OnStall) -> Option<StallSettings> {
        Some(StallSettings {
            stall_after: Duration::from_secs(2),
            on_stall,
            abort_after: Duration::from_secs(4),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_stream_is_ended_with_an_error_event_and_an_incomplete_ending() {
        let steps = vec![
            Step::Data("event: ping\ndata: {}\n\n"),
            Step::Pause(Duration::from_secs(30)),
            Step::Data("never"),
        ];
        let (b, seen) = watched(steps, Duration::from_secs(600), true, stall(OnStall::Error));
        let (out, errored) = read_all(b).await;
        let text = String::from_utf8(out).unwrap();
        assert!(errored, "incomplete: no clean end");
        assert!(text.contains("\"type\":\"overloaded_error\""), "{text}");
        assert!(text.contains("stalled: no data for 4s"), "{text}");
        let r = seen.lock().unwrap().take().unwrap();
        assert_eq!(
            r.end,
            BodyEnd::StallAborted {
                silence: Duration::from_secs(4),
                event: true
            }
        );
        let s = r.stall.unwrap();
        assert!(s.aborted && !s.before_head);
        assert_eq!(s.longest_ms, 4000);
    }

    #[tokio::test(start_paused = true)]
    async fn reset_cuts_a_stalled_stream_without_an_event() {
        let steps = vec![
            Step::Data("event: ping\ndata: {}\n\n"),
            Step::Pause(Duration::from_secs(30)),
        ];
        let (b, _) = watched(steps, Duration::from_secs(600), true, stall(OnStall::Reset));
        let (out, errored) = read_all(b).await;
        assert!(errored);
        assert_eq!(out, b"event: ping\ndata: {}\n\n");
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_keeps_a_stalled_stream_and_records_its_longest_silence() {
        let steps = vec![
            Step::Data("data: a\n\n"),
            Step::Pause(Duration::from_secs(3)),
            Step::Data("data: b\n\n"),
            Step::Pause(Duration::from_secs(7)),
            Step::Data("data: c\n\n"),
        ];
        let (b, seen) = watched(steps, Duration::from_secs(600), true, stall(OnStall::Wait));
        let (out, errored) = read_all(b).await;
        assert!(!errored);
        assert_eq!(out, b"data: a\n\ndata: b\n\ndata: c\n\n");
        let r = seen.lock().unwrap().take().unwrap();
        assert_eq!(r.end, BodyEnd::Complete);
        let s = r.stall.unwrap();
        assert_eq!((s.longest_ms, s.aborted), (7000, false));
    }

    #[tokio::test(start_paused = true)]
    async fn pings_are_bytes_and_never_a_stall() {
        let mut steps = Vec::new();
        for _ in 0..20 {
            steps.push(Step::Pause(Duration::from_secs(1)));
            steps.push(Step::Data("event: ping\ndata: {\"type\": \"ping\"}\n\n"));
        }
        let (b, seen) = watched(steps, Duration::from_secs(600), true, stall(OnStall::Error));
        assert!(!read_all(b).await.1);
        let r = seen.lock().unwrap().take().unwrap();
        assert_eq!((r.end, r.stall), (BodyEnd::Complete, None));
    }

    #[tokio::test]
    async fn dropping_early_means_the_client_left() {
        let (mut b, seen) = body(
            vec![Step::Data("a"), Step::Data("b")],
            Duration::from_secs(5),
            false,
        );
        let _ = b.frame().await;
        drop(b);
        let r = seen.lock().unwrap().take().unwrap();
        assert_eq!((r.end, r.bytes), (BodyEnd::ClientGone, 1));
    }
}

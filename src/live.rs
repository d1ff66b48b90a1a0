//! What is happening now, for the viewer: each exchange as it starts, a streamed
//! answer's text as it arrives, and each record once it is stored.
//!
//! The exchange, the observer and the capture writer publish here; the admin API's
//! `/api/live` serves it as server-sent events. Nothing is built unless somebody
//! watches (a feed without receivers costs one load per exchange), and every value
//! goes through the process's one redactor first, as a stored record does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;
use tokio::sync::broadcast;

use crate::id::ExchangeId;
use crate::observer::EventSplitter;
use crate::provider::{Api, Provider};
use crate::record::{ExchangeRecord, StoredNotice};
use crate::redact::{Redactor, Summary};

/// Events a slow viewer may fall behind by before it is told to fill the gap.
const BACKLOG: usize = 1024;

/// How often an in-flight stream's progress is published at most: the page shows
/// text as it arrives without an event per delta.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// Streamed text kept per exchange for the page; past it the page shows the last
/// half of it (see [`LiveTap::trim`]).
const TEXT_LIMIT: usize = 64 * 1024;

/// One server-sent event, framed once for every viewer.
#[derive(Debug, Clone)]
pub(crate) struct LiveEvent {
    /// A recorded row's `seq`: the SSE `id`, which a reconnecting browser sends back.
    pub seq: Option<i64>,
    /// The event as it goes on the wire (see [`sse_frame`]).
    pub frame: Bytes,
}

/// One event on the wire: `event: NAME`, `id: SEQ` when given, and `data` (each of
/// its lines a `data:` field of its own, so a line break cannot end the event).
pub(crate) fn sse_frame(name: &str, seq: Option<i64>, data: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 48);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    if let Some(seq) = seq {
        out.extend_from_slice(format!("\nid: {seq}").as_bytes());
    }
    for line in data.split(|b| *b == b'\n') {
        out.extend_from_slice(b"\ndata: ");
        out.extend_from_slice(line);
    }
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The feed. See the module docs.
#[derive(Debug)]
pub(crate) struct LiveFeed {
    tx: broadcast::Sender<LiveEvent>,
    redactor: Arc<Redactor>,
}

impl LiveFeed {
    /// `text` through the process's one redactor: what the admin API shows that a
    /// client chose (a budget's scope values are conversation keys as sent).
    pub(crate) fn redact(&self, text: &str) -> String {
        let mut uncounted = crate::redact::Summary::new();
        self.redactor.redact_text(text, &[], &mut uncounted)
    }

    pub(crate) fn new(redactor: Arc<Redactor>) -> Arc<LiveFeed> {
        Arc::new(LiveFeed {
            tx: broadcast::Sender::new(BACKLOG),
            redactor,
        })
    }

    /// Whether anybody watches now.
    pub(crate) fn watched(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<LiveEvent> {
        self.tx.subscribe()
    }

    fn publish(&self, name: &'static str, seq: Option<i64>, data: &impl serde::Serialize) {
        let data = serde_json::to_vec(data).unwrap_or_default();
        self.publish_json(name, seq, &data);
    }

    /// [`publish`](Self::publish) of data already written as JSON.
    fn publish_json(&self, name: &'static str, seq: Option<i64>, data: &[u8]) {
        let frame = sse_frame(name, seq, data);
        // An error only says nobody watches.
        let _ = self.tx.send(LiveEvent { seq, frame });
    }

    /// An exchange went upstream.
    pub(crate) fn started(&self, record: &ExchangeRecord) {
        if !self.watched() {
            return;
        }
        let mut uncounted = Summary::new();
        let model = record
            .model
            .as_deref()
            .map(|m| self.redactor.redact_text(m, &[], &mut uncounted));
        self.publish(
            "started",
            None,
            &json!({
                "id": record.id.to_string(),
                "started_ms": record
                    .started_at
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                "method": record.method.as_str(),
                "path": self.redactor.path(&record.path, &mut uncounted),
                "provider": record.provider.map(Provider::name),
                "model": model,
                "side": record.is_side_request(),
            }),
        );
    }

    /// A tap on a response body, when somebody watches and the record keeps bodies.
    pub(crate) fn tap(self: &Arc<Self>, record: &ExchangeRecord, stream: bool) -> Option<LiveTap> {
        if !self.watched() || !record.capture {
            return None;
        }
        Some(LiveTap {
            feed: self.clone(),
            id: record.id,
            status: record.status.map(|s| s.as_u16()),
            grammar: stream.then_some((record.provider, record.api)),
            extra: record.extra_redactions.clone(),
            splitter: EventSplitter::default(),
            text: String::new(),
            skipping: false,
            bytes: 0,
            sent: None,
            stalled: None,
        })
    }
}

impl StoredNotice for LiveFeed {
    fn watched(&self) -> bool {
        LiveFeed::watched(self)
    }

    /// Records were stored: each announced as `recorded`, in storing order.
    fn stored(&self, seq: i64, row: &[u8]) {
        self.publish_json("recorded", Some(seq), row);
    }
}

/// Reads a response body as it passes, for [`LiveFeed`]: its size and, for a
/// stream, the text of its deltas so far.
pub(crate) struct LiveTap {
    feed: Arc<LiveFeed>,
    id: ExchangeId,
    status: Option<u16>,
    /// A stream's provider and API, whose deltas carry its text.
    grammar: Option<(Option<Provider>, Option<Api>)>,
    extra: Vec<regex::Regex>,
    splitter: EventSplitter,
    text: String,
    /// The word arriving was too long to keep whole: its rest is dropped too.
    skipping: bool,
    bytes: u64,
    sent: Option<Instant>,
    /// Silent past the stall threshold this long, until data comes again.
    stalled: Option<Duration>,
}

impl crate::observer::Progress for LiveTap {
    fn chunk(&mut self, data: &[u8]) {
        let now = Instant::now();
        self.stalled = None;
        self.bytes += data.len() as u64;
        if let Some((Some(provider), Some(api))) = self.grammar {
            self.splitter.push(data);
            while let Some(event) = self.splitter.next_event() {
                let Some(piece) = crate::rules::stream::delta_text(provider, api, &event) else {
                    continue;
                };
                let mut piece = &piece[..];
                if self.skipping {
                    let Some(at) = piece.find(char::is_whitespace) else {
                        continue;
                    };
                    piece = &piece[at..];
                    self.skipping = false;
                }
                self.text.push_str(piece);
            }
            if self.text.len() > TEXT_LIMIT {
                self.trim();
            }
        }
        if self.sent.is_none_or(|at| now - at >= PROGRESS_EVERY) {
            self.send(false, now);
        }
    }

    fn end(&mut self) {
        self.send(true, Instant::now());
    }

    // The page shows it as stalled until data comes again.
    fn stalled(&mut self, silence: Duration) {
        self.stalled = Some(silence);
        self.send(false, Instant::now());
    }
}

impl LiveTap {
    /// Cuts the text to about half of [`TEXT_LIMIT`] without halving a secret: what
    /// is kept is redacted first, with all its context (a key across the cut is
    /// replaced whole), then cut at whitespace, which neither a key nor a redaction
    /// marker holds.
    fn trim(&mut self) {
        let keep = TEXT_LIMIT / 2;
        // The last word may be the first half of a key, and a secret reaching it (a
        // PEM block) may go on: both stay as they came, to be redacted once whole.
        let mut settled = self.text.rfind(char::is_whitespace).map_or(0, |at| {
            at + self.text[at..].chars().next().map_or(1, char::len_utf8)
        });
        let spans = self.feed.redactor.spans(&self.text[..settled], &self.extra);
        if let Some(&(start, end)) = spans.last()
            && self
                .text
                .get(end..settled)
                .is_some_and(|s| s.trim().is_empty())
        {
            settled = start;
            while !self.text.is_char_boundary(settled) {
                settled -= 1;
            }
        }
        let mut uncounted = Summary::new();
        let redacted =
            self.feed
                .redactor
                .redact_text(&self.text[..settled], &self.extra, &mut uncounted);
        let rest = &self.text[settled..];
        // From the first whitespace in the last `keep` bytes of `text`.
        let tail = |text: &str, keep: usize| -> usize {
            let mut from = text.len().saturating_sub(keep);
            while !text.is_char_boundary(from) {
                from += 1;
            }
            text[from..]
                .find(char::is_whitespace)
                .map_or(text.len(), |at| from + at)
        };
        self.text = if rest.len() > keep {
            // One word longer than what is kept: none of it is shown, not even its end.
            self.skipping = true;
            redacted[tail(&redacted, keep)..].to_owned()
        } else {
            let from = tail(&redacted, keep - rest.len());
            format!("{}{rest}", &redacted[from..])
        };
    }

    fn send(&mut self, done: bool, now: Instant) {
        self.sent = Some(now);
        if !self.feed.watched() {
            return;
        }
        // A word still arriving may be the first half of a key that only its second
        // half makes recognisable: it is shown once it is whole.
        let shown = if done {
            &self.text[..]
        } else {
            let cut = self.text.rfind(char::is_whitespace).map_or(0, |at| {
                at + self.text[at..].chars().next().map_or(1, char::len_utf8)
            });
            &self.text[..cut]
        };
        let mut uncounted = Summary::new();
        let text = self
            .feed
            .redactor
            .redact_text(shown, &self.extra, &mut uncounted);
        self.feed.publish(
            "progress",
            None,
            &json!({
                "id": self.id.to_string(),
                "status": self.status,
                "bytes": self.bytes,
                "text": text,
                "done": done,
                "stalled_ms": self.stalled.map(|s| s.as_millis() as u64),
            }),
        );
    }
}

impl crate::record::InFlight for Arc<LiveFeed> {
    fn started(&self, record: &ExchangeRecord) {
        LiveFeed::started(self, record);
    }

    fn tap(
        &self,
        record: &ExchangeRecord,
        stream: bool,
    ) -> Option<Box<dyn crate::observer::Progress>> {
        LiveFeed::tap(self, record, stream)
            .map(|t| Box::new(t) as Box<dyn crate::observer::Progress>)
    }
}

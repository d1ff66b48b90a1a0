//! The record every exchange ends as, and the sinks that receive it.
//!
//! Exactly one [`ExchangeRecord`] per exchange, whatever happened: answered,
//! refused, failed upstream, or abandoned by the client. The exchange builds it;
//! [`Recorder::emit`] hands it to each [`RecordSink`] (the log line today, the
//! capture store later). Sinks must be quick: they run on a runtime thread.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use serde::Serialize;
use tokio::sync::Notify;

use crate::error::ErrorKind;
use crate::id::ExchangeId;
use crate::observer::Observation;
use crate::prompt::{Format, Prompt, PromptCell};
use crate::provider::{Api, Provider};

/// How an exchange ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The upstream answered with a success status and its whole response reached
    /// the client.
    Ok,
    /// The provider answered with an error: a 4xx or 5xx status (a 429, a 529, …),
    /// or an error event inside a stream. Its whole answer reached the client.
    ProviderError,
    /// A rule blocked the request (the upstream was not contacted), or a per-event
    /// rule ended the stream.
    Blocked,
    /// The path is not one promptgate routes; the upstream was not contacted.
    NoRoute,
    /// The request body was over `--max-body`; the upstream was not contacted.
    TooLarge,
    /// The request body could not be read from the client.
    BadRequest,
    /// The upstream could not be reached, failed TLS, timed out, or broke off mid-response.
    UpstreamError,
    /// The client went away before the response was complete; the upstream request was cancelled.
    ClientCancelled,
    /// promptgate shut down and the grace period ended before the response did.
    Shutdown,
    /// `capture.required` is set and the capture could not take the record; the
    /// upstream was not contacted.
    CaptureUnavailable,
    /// The streamed answer stalled and `stream.on_stall` ended it (the client got a
    /// retryable error, or an incomplete stream).
    StallAborted,
}

impl Outcome {
    /// Every outcome, in the order the viewer offers them.
    pub const ALL: [Outcome; 11] = [
        Outcome::Ok,
        Outcome::ProviderError,
        Outcome::Blocked,
        Outcome::UpstreamError,
        Outcome::ClientCancelled,
        Outcome::StallAborted,
        Outcome::TooLarge,
        Outcome::BadRequest,
        Outcome::NoRoute,
        Outcome::CaptureUnavailable,
        Outcome::Shutdown,
    ];

    /// The snake_case name the record, the log and the API use.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ProviderError => "provider_error",
            Outcome::Blocked => "blocked",
            Outcome::NoRoute => "no_route",
            Outcome::TooLarge => "too_large",
            Outcome::BadRequest => "bad_request",
            Outcome::UpstreamError => "upstream_error",
            Outcome::ClientCancelled => "client_cancelled",
            Outcome::Shutdown => "shutdown",
            Outcome::CaptureUnavailable => "capture_unavailable",
            Outcome::StallAborted => "stall_aborted",
        }
    }
}

impl From<ErrorKind> for Outcome {
    /// The outcome recorded for an exchange that ended with an error of `kind`.
    fn from(kind: ErrorKind) -> Outcome {
        match kind {
            ErrorKind::NoRoute => Outcome::NoRoute,
            ErrorKind::WebSocketUpgrade => Outcome::BadRequest,
            ErrorKind::BodyTooLarge => Outcome::TooLarge,
            ErrorKind::BadRequestBody => Outcome::BadRequest,
            ErrorKind::UnsupportedEncoding => Outcome::BadRequest,
            ErrorKind::BodyTimeout => Outcome::BadRequest,
            ErrorKind::UpstreamConnect => Outcome::UpstreamError,
            ErrorKind::UpstreamTls => Outcome::UpstreamError,
            ErrorKind::UpstreamTimeout => Outcome::UpstreamError,
            ErrorKind::UpstreamProtocol => Outcome::UpstreamError,
            ErrorKind::CaptureUnavailable => Outcome::CaptureUnavailable,
            ErrorKind::WrongBaseUrl => Outcome::NoRoute,
        }
    }
}

/// How the client reached promptgate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The client was pointed at promptgate as its base URL.
    Reverse,
    /// The client used promptgate as its HTTP(S) proxy: a request inside an
    /// intercepted CONNECT tunnel, or an absolute-form `http://` request.
    Forward,
}

impl Mode {
    /// Lowercase name used in logs and records.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Reverse => "reverse",
            Mode::Forward => "forward",
        }
    }
}

/// Times within an exchange, from its start (the request head arriving).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    /// Until the upstream's response head arrived.
    pub upstream_headers: Option<Duration>,
    /// Until the first response body byte arrived from upstream.
    pub first_byte: Option<Duration>,
    /// Until the exchange ended.
    pub total: Duration,
    /// Until the last request body byte arrived from the client.
    pub body_read: Option<Duration>,
    /// Until the upstream connection took the request (its head written, the body asked for).
    pub sent_upstream: Option<Duration>,
    /// Until the response head was handed to the client's connection.
    pub head_to_client: Option<Duration>,
}

impl Timing {
    /// The time promptgate itself added: from the last request byte received to the
    /// request going upstream, plus from the response head received to it going to
    /// the client. `None` for an exchange that did not reach the upstream.
    pub fn overhead(&self) -> Option<Duration> {
        let out = self.sent_upstream?.checked_sub(self.body_read?)?;
        let back = self.head_to_client?.checked_sub(self.upstream_headers?)?;
        Some(out + back)
    }
}

/// Everything known about one exchange when it ended.
#[derive(Debug, Clone)]
pub struct ExchangeRecord {
    pub id: ExchangeId,
    /// `doctor`'s own probe (it carried the running proxy's probe token): a side
    /// request, tagged `promptgate-doctor`.
    pub probe: bool,
    pub started_at: SystemTime,
    pub mode: Mode,
    pub client_addr: Option<SocketAddr>,
    pub method: Method,
    /// Path and query as the client sent them.
    pub path: String,
    /// The host the client addressed (its `Host` header or HTTP/2 authority).
    pub host: Option<String>,
    pub provider: Option<Provider>,
    pub api: Option<Api>,
    /// The upstream URL the request went to (no credentials are ever in it).
    pub upstream_url: Option<String>,
    /// The model the request asked for.
    pub model: Option<String>,
    /// Request headers as the client sent them. Secrets included: sinks must redact.
    pub request_headers: HeaderMap,
    /// The request body exactly as received.
    pub request_body: Bytes,
    /// The request body as every reader reads it (sniff, rules, capture, cache
    /// analysis): `request_body` decoded once when it arrived compressed, else the
    /// same bytes.
    pub request_plain: Bytes,
    /// The model of `request_plain`.
    pub prompt: PromptCell,
    /// The model of the body as the provider reads it (`sent_body`, decoded): the
    /// same cell as `prompt` when rules left the body as it was.
    pub sent_prompt: PromptCell,
    /// Request headers as sent upstream (hop-by-hop removed, rules applied).
    pub sent_headers: HeaderMap,
    /// The request body exactly as sent upstream (the received bytes when unchanged;
    /// empty while dried, see [`ExchangeRecord::dry_sent`]).
    pub sent_body: Bytes,
    /// The body sent, without its bytes, while the answer streams.
    pub(crate) sent_dried: Option<Arc<crate::prompt::DriedPrompt>>,
    /// Names of the rules that fired, in order.
    pub rules_fired: Vec<String>,
    /// Labels that rules put on the exchange.
    pub tags: Vec<String>,
    /// JSON pointers of the body nodes rules changed, in order.
    pub body_diff: Vec<String>,
    /// Who changed what: (policy, JSON pointer of a body node or `header NAME`).
    pub edits: Vec<(String, String)>,
    /// Events per-event rules changed, dropped or stopped at, in stream order.
    pub stream_edits: Vec<crate::policy::EventEdit>,
    /// Each policy's turn at each phase, in order: its decision and its time.
    pub policy_runs: Vec<crate::policy::PolicyRun>,
    /// The conversation key, decided once by its first reader (a policy, the cache
    /// stage or the capture) from what the client sent.
    pub conversation: crate::conversation::ConversationCell,
    /// What the outgoing-secrets scanner found (never a value).
    pub findings: Vec<crate::policy::Finding>,
    /// When the rule set whose rules ran on the request was loaded (ms since the
    /// epoch): a cache miss a rule caused names the time its set changed.
    pub rules_loaded_ms: Option<u64>,
    /// Whether the capture store should keep this exchange (a rule may turn it off).
    pub capture: bool,
    /// Extra secret patterns (from rules) the capture redacts in this exchange's bodies.
    pub extra_redactions: Vec<regex::Regex>,
    /// Header names whose values are secrets beyond the usual credential headers
    /// (e.g. set by a rule from `${env:…}`): stored only as fingerprints.
    pub secret_headers: Vec<http::HeaderName>,
    pub status: Option<StatusCode>,
    pub response_headers: HeaderMap,
    pub outcome: Outcome,
    /// What went wrong, when something did (also a provider error on a 2xx stream).
    pub error: Option<String>,
    pub timing: Timing,
    /// Request body bytes received from the client.
    pub bytes_in: u64,
    /// Response body bytes sent to the client.
    pub bytes_out: u64,
    /// What the observer read from the response body.
    pub observation: Option<Observation>,
    /// What prompt-cache analysis made of the exchange (set by its stage before the sinks).
    pub cache: Option<crate::cache::CacheReport>,
    /// The longest silence of a streamed answer past `stream.stall_after`.
    pub stall: Option<crate::observer::stall::Stall>,
    /// A turn of a relayed WebSocket: its request body is the whole prompt put back
    /// together, and this keeps the message as it crossed the socket.
    pub websocket: Option<SocketTurn>,
}

/// One turn of a relayed WebSocket (Codex's Responses socket).
#[derive(Debug, Clone)]
pub struct SocketTurn {
    /// The socket's own record (its upgrade).
    pub socket: ExchangeId,
    /// The client's `response.create` message exactly as it came off the socket.
    pub frame: Bytes,
    /// The earlier turns of the socket whose prompt and output this turn continues
    /// (by `previous_response_id`), oldest first.
    pub recovered_from: Vec<ExchangeId>,
    /// Why the whole prompt could not be put back together, when it could not.
    pub missing: Option<String>,
}

impl ExchangeRecord {
    /// Writes what the policies of the request and response phases did, as the
    /// exchange gathered it: the one place their effects reach the record.
    pub fn take_effects(&mut self, effects: &crate::policy::Effects) {
        self.rules_fired.extend(effects.fired.iter().cloned());
        for t in &effects.tags {
            if !self.tags.contains(t) {
                self.tags.push(t.clone());
            }
        }
        for p in &effects.body_diff {
            if !self.body_diff.contains(p) {
                self.body_diff.push(p.clone());
            }
        }
        self.edits.extend(effects.edits.iter().cloned());
        self.findings.extend(effects.findings.iter().cloned());
        self.rules_loaded_ms = self.rules_loaded_ms.or(effects.rules_loaded_ms);
        if effects.capture == Some(false) {
            self.capture = false;
        }
        self.extra_redactions
            .extend(effects.redactions.iter().cloned());
        for h in &effects.secret_headers {
            if !self.secret_headers.contains(h) {
                self.secret_headers.push(h.clone());
            }
        }
    }

    /// Writes what per-event policies did to the stream, once it ended.
    pub fn take_stream_report(&mut self, report: crate::policy::StreamReport) {
        for f in report.fired {
            if !self.rules_fired.contains(&f) {
                self.rules_fired.push(f);
            }
        }
        for t in report.tags {
            if !self.tags.contains(&t) {
                self.tags.push(t);
            }
        }
        self.stream_edits.extend(report.edits);
    }

    /// The body bytes it holds (received, sent when rules changed it, response): what
    /// a queue of records is bounded by. A sent body sharing the received one's memory
    /// counts once; comparing their bytes would read them all. A body sent dried
    /// counts whole: the record pipeline restores it before the record waits anywhere
    /// else (counted as the bytes rules wrote, the pipeline's 16 MiB let twice as many
    /// 1 MB records wait as it meant to).
    pub fn held_bytes(&self) -> u64 {
        let sent = if self.sent_unchanged() {
            0
        } else {
            self.sent_body.len() + self.sent_dried.as_ref().map_or(0, |d| d.len())
        };
        let response = self.observation.as_ref().map_or(0, |o| o.body.len());
        (self.request_body.len() + sent + response) as u64
    }

    /// The model the provider reads. The sniff took the first `"model"` key without
    /// reading the body; once the body is read and repeats a key, the provider's
    /// reading (the last) is the one (the one home of that rule).
    pub(crate) fn model_as_read(&self) -> Option<String> {
        match self.prompt.if_read() {
            Some(prompt) if prompt.keys().repeated().is_some() => prompt.model(),
            _ => self.model.clone(),
        }
    }

    /// Sets the request body as received (`body`) and decoded (`plain`, the same
    /// bytes when it came uncompressed), a request of `provider` and `api` as set:
    /// it is also the body sent until [`ExchangeRecord::set_sent`].
    pub fn set_request_body(&mut self, body: Bytes, plain: Bytes) {
        let model = PromptCell::new(plain, self.request_format());
        self.set_request_model(body, model);
    }

    /// Sets the request body as received (`body`) and the model of it decoded
    /// (shared with an earlier exchange that received the same bytes, see
    /// `exchange::resent`).
    pub(crate) fn set_request_model(&mut self, body: Bytes, model: PromptCell) {
        self.request_plain = model.body().clone();
        self.prompt = model;
        self.sent_prompt = self.prompt.clone();
        self.sent_body = body.clone();
        self.request_body = body;
    }

    /// The grammar of this exchange's request bodies, when promptgate reads it.
    pub(crate) fn request_format(&self) -> Option<Format> {
        match (self.provider, self.api) {
            (Some(p), Some(a)) => Format::of_request(p, a),
            _ => None,
        }
    }

    /// Sets the body rules wrote to send upstream instead, with its model.
    pub fn set_sent(&mut self, changed: Prompt) {
        self.sent_body = changed.body().clone();
        self.sent_prompt = PromptCell::of(changed);
    }

    /// Sets the body policies replaced the received one with, as its shared model.
    pub fn set_sent_cell(&mut self, changed: PromptCell) {
        self.sent_body = changed.body().clone();
        self.sent_prompt = changed;
    }

    /// Lets go of the body sent, once it went, when rules wrote it from the body
    /// received: only what they wrote is kept until [`ExchangeRecord::restore_sent`]
    /// (on the record pipeline, before anything reads it). Nothing reads it between.
    pub(crate) fn dry_sent(&mut self) {
        if self.sent_unchanged() || self.sent_dried.is_some() {
            return;
        }
        let cell = std::mem::take(&mut self.sent_prompt);
        let prompt = match cell.into_prompt() {
            Ok(prompt) => prompt,
            Err(cell) => {
                self.sent_prompt = cell;
                return;
            }
        };
        // Only the prompt's own handle may be left, or drying frees nothing.
        self.sent_body = Bytes::new();
        match prompt.dry(self.prompt.body()) {
            Ok(dried) => self.sent_dried = Some(Arc::new(dried)),
            Err(prompt) => self.set_sent(*prompt),
        }
    }

    /// The body sent again, when [`ExchangeRecord::dry_sent`] let it go.
    pub(crate) fn restore_sent(&mut self) {
        let Some(dried) = self.sent_dried.take() else {
            return;
        };
        let received = self.prompt.body().clone();
        match Arc::try_unwrap(dried) {
            Ok(dried) => self.set_sent(dried.restore(&received)),
            // Shared (a copy of the record): the same bytes, read afresh.
            Err(dried) => {
                self.set_sent_cell(PromptCell::new(dried.body(&received), dried.format()));
            }
        }
    }

    /// Whether the body went upstream as it was received (no bytes compared).
    pub fn sent_unchanged(&self) -> bool {
        self.sent_body.as_ptr() == self.request_body.as_ptr()
            && self.sent_body.len() == self.request_body.len()
    }

    /// A record for an exchange that has just begun.
    /// A side request: not a model call (count_tokens, `/api/…` and other
    /// passed-through paths, `HEAD` checks); see [`crate::provider::is_side_request`],
    /// the one definition the CLI and the viewer share.
    pub fn is_side_request(&self) -> bool {
        self.probe || crate::provider::is_side_request(&self.method, self.api)
    }

    pub fn begin(
        id: ExchangeId,
        client_addr: Option<SocketAddr>,
        method: Method,
        path: String,
    ) -> Self {
        ExchangeRecord {
            probe: false,
            id,
            started_at: SystemTime::now(),
            mode: Mode::Reverse,
            client_addr,
            method,
            path,
            host: None,
            provider: None,
            api: None,
            upstream_url: None,
            model: None,
            request_headers: HeaderMap::new(),
            request_body: Bytes::new(),
            request_plain: Bytes::new(),
            prompt: PromptCell::default(),
            sent_prompt: PromptCell::default(),
            sent_headers: HeaderMap::new(),
            sent_body: Bytes::new(),
            sent_dried: None,
            rules_fired: Vec::new(),
            tags: Vec::new(),
            body_diff: Vec::new(),
            edits: Vec::new(),
            stream_edits: Vec::new(),
            policy_runs: Vec::new(),
            conversation: Default::default(),
            findings: Vec::new(),
            rules_loaded_ms: None,
            capture: true,
            extra_redactions: Vec::new(),
            secret_headers: Vec::new(),
            status: None,
            response_headers: HeaderMap::new(),
            outcome: Outcome::ClientCancelled,
            error: None,
            timing: Timing::default(),
            bytes_in: 0,
            bytes_out: 0,
            observation: None,
            cache: None,
            stall: None,
            websocket: None,
        }
    }
}

/// Told of each record once the capture stored it (the live feed, wired by the
/// server): a sink that stores tells whoever shows stored records, through this.
pub(crate) trait StoredNotice: Send + Sync {
    /// Whether anybody listens now: stored rows are read back only then.
    fn watched(&self) -> bool;

    /// A record was stored: its place in storing order and its listing row as JSON.
    fn stored(&self, seq: i64, row: &[u8]);
}

/// Receives every finished record.
pub trait RecordSink: Send + Sync {
    /// Takes a finished record. Must not block: a sink that is full drops the record,
    /// counts and logs the drop (admission already waited for room).
    fn record(&self, record: &ExchangeRecord);

    /// Whether it reads the message reassembled from a streamed answer
    /// (`ResponseSummary::message`): the observer rebuilds it only when a sink does.
    fn reads_message(&self) -> bool {
        false
    }

    /// Whether it compares a body with earlier exchanges' bodies (to know a resend):
    /// the exchange then holds a body received again as the bytes of its first
    /// arrival, so that compare is of pointers.
    fn compares_bodies(&self) -> bool {
        false
    }

    /// Whether the sink could take `record` (as it stands before it goes upstream) now.
    /// A sink that keeps places keeps one for it when it answers yes: the look and
    /// the promise are one step, so no record lands between them.
    fn has_room(&self, _record: &ExchangeRecord) -> bool {
        true
    }

    /// Resolves when the sink may have room again (none: admission polls it).
    fn room_freed(&self) -> Option<tokio::sync::futures::Notified<'_>> {
        None
    }

    /// Asked before the request goes upstream, after admission waited for room: a
    /// sink with a bounded queue keeps the room it has for this record. `Err(why)`
    /// refuses the exchange (a sink that must not miss a record — capture with
    /// `required` — and cannot take one now). Must not block.
    fn admit(&self, _record: &ExchangeRecord) -> Result<(), Refusal> {
        Ok(())
    }

    /// Blocks until every record received so far is handled (called on shutdown).
    fn flush(&self) {}
}

/// Why a sink that must not miss a record (capture with `required`) refuses an
/// exchange before it goes upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("capture is required and the capture store is failing")]
    StoreFailing,
    #[error("capture is required and the capture queue is full")]
    QueueFull,
}

/// Works on a record before the sinks see it (cache analysis), in emit order.
pub trait RecordStage: Send + Sync {
    /// The upstream's response head arrived (status and timing set). Runs on the
    /// request path: it must only take note, never compute.
    fn response_began(&self, _record: &ExchangeRecord) {}
    /// Annotates a finished record; runs once per record, before the sinks.
    fn apply(&self, record: &mut ExchangeRecord);

    /// Whether it compares a body with earlier exchanges' bodies (to know a resend):
    /// the exchange then holds a body received again as the bytes of its first
    /// arrival, so that compare is of pointers.
    fn compares_bodies(&self) -> bool {
        false
    }
}

/// Cache analysis as a stage: told of each answer as it begins, it sets the record's
/// `cache` once the exchange ends.
impl RecordStage for crate::cache::CacheStage {
    fn compares_bodies(&self) -> bool {
        self.enabled()
    }

    fn response_began(&self, record: &ExchangeRecord) {
        self.note_response(crate::cache::ResponseBegan {
            id: record.id,
            provider: record.provider,
            api: record.api,
            success: record.status.is_some_and(|s| s.is_success()),
            started_at: record.started_at,
            upstream_headers: record.timing.upstream_headers,
            sent_prompt: &record.sent_prompt,
            sent_dried: record.sent_dried.as_ref(),
            received: record.prompt.body(),
            sent_headers: &record.sent_headers,
            conversation: &record.conversation,
        });
    }

    fn apply(&self, record: &mut ExchangeRecord) {
        let usage = record.observation.as_ref().and_then(|o| o.summary.usage);
        record.cache = self.judge_exchange(record.id, usage.as_ref());
        let diagnosis = record
            .observation
            .as_ref()
            .and_then(|o| o.summary.diagnosis.as_ref());
        if let Some(report) = &mut record.cache {
            report.name_writer(&record.edits, record.rules_loaded_ms);
            report.read_diagnosis(diagnosis);
        }
    }
}

/// Records waiting for the pipeline beyond which admission waits. Each holds its
/// bodies: at 256, full at 200 KB c16 peaked at 236–315 MB, at 32 at 159 MB.
const PIPELINE_BACKLOG: usize = 32;

/// Body bytes held by waiting records beyond which admission waits too: at 1 MB,
/// 32 records hold ~64 MB (received and sent).
const PIPELINE_BYTES: usize = 16 << 20;

/// How long the pipeline thread, its queue empty, waits before it sleeps until woken
/// (20 KB pass-through at c16: 99 → 90 µs of CPU per request, fewer wake-ups).
const PIPELINE_LINGER: Duration = Duration::from_micros(200);

/// What watches exchanges while they are in flight (the live feed): told when one
/// is sent upstream, and given a look at its response body as it passes. The
/// exchange calls it; the feed implements it; neither imports the other.
pub(crate) trait InFlight: Send + Sync {
    /// The exchange was admitted and goes upstream.
    fn started(&self, record: &ExchangeRecord);
    /// A watcher of this exchange's response body, while anybody watches.
    fn tap(
        &self,
        record: &ExchangeRecord,
        stream: bool,
    ) -> Option<Box<dyn crate::observer::Progress>>;
}

/// A unit of record work for the pipeline thread.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The records waiting for the pipeline thread, and the body bytes they hold.
#[derive(Debug, Default)]
struct Backlog {
    records: AtomicUsize,
    bytes: AtomicUsize,
}

impl Backlog {
    fn put(&self, bytes: usize) {
        self.records.fetch_add(1, Ordering::SeqCst);
        self.bytes.fetch_add(bytes, Ordering::SeqCst);
    }

    fn take(&self, bytes: usize) {
        self.records.fetch_sub(1, Ordering::SeqCst);
        self.bytes.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// Past either bound; a single record larger than the byte bound still goes.
    fn full(&self) -> bool {
        let records = self.records.load(Ordering::SeqCst);
        records >= PIPELINE_BACKLOG
            || (records > 0 && self.bytes.load(Ordering::SeqCst) >= PIPELINE_BYTES)
    }
}

/// Hands records to the stages, then the sinks, on its own thread (off the runtime,
/// so reading bodies, analysis and capture never delay a stream), and counts
/// exchanges still in flight (for shutdown).
///
/// Memory stays bounded: [`Recorder::admit`] holds a new exchange back (for a bounded
/// time) while the pipeline or a sink is behind.
pub(crate) struct Recorder {
    stages: Vec<Arc<dyn RecordStage>>,
    sinks: Vec<Arc<dyn RecordSink>>,
    in_flight: AtomicUsize,
    idle: Notify,
    /// Set when the grace period is over; open response bodies watch it.
    abandoning: tokio::sync::watch::Sender<bool>,
    pipeline: Mutex<Option<mpsc::Sender<(Job, usize)>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    backlog: Arc<Backlog>,
    admit_wait: Duration,
    /// The line of exchanges waiting for room (tokio's mutex is handed over in order).
    line: tokio::sync::Mutex<()>,
}

impl Recorder {
    #[cfg(test)]
    pub(crate) fn new(sinks: Vec<Arc<dyn RecordSink>>) -> Self {
        Self::with_stages(Vec::new(), sinks)
    }

    /// A recorder that runs `stages` on each record, in order, before the sinks.
    pub(crate) fn with_stages(
        stages: Vec<Arc<dyn RecordStage>>,
        sinks: Vec<Arc<dyn RecordSink>>,
    ) -> Self {
        let (tx, rx) = mpsc::channel::<(Job, usize)>();
        let backlog = Arc::new(Backlog::default());
        let left = backlog.clone();
        let worker = std::thread::Builder::new()
            .name("promptgate-records".into())
            .spawn(move || {
                let mut next = rx.recv().ok();
                while let Some((job, bytes)) = next {
                    // A job that panics loses its record, never the pipeline.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("a record job panicked; its record is lost");
                    }
                    left.take(bytes);
                    next = match rx.try_recv() {
                        Ok(more) => Some(more),
                        Err(mpsc::TryRecvError::Disconnected) => None,
                        Err(mpsc::TryRecvError::Empty) => {
                            // A busy proxy's next record is moments away: one wake-up
                            // then serves several.
                            std::thread::sleep(PIPELINE_LINGER);
                            rx.recv().ok()
                        }
                    };
                }
            })
            .ok();
        Recorder {
            stages,
            sinks,
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            abandoning: tokio::sync::watch::Sender::new(false),
            pipeline: Mutex::new(worker.as_ref().map(|_| tx)),
            worker: Mutex::new(worker),
            backlog,
            admit_wait: Duration::from_secs(2),
            line: tokio::sync::Mutex::new(()),
        }
    }

    /// How long [`Recorder::admit`] waits for room before letting an exchange through
    /// (its record may then be dropped by a full sink, counted and logged).
    pub(crate) fn with_admit_wait(mut self, wait: Duration) -> Self {
        self.admit_wait = wait;
        self
    }

    /// Counts an exchange that will end with exactly one [`Recorder::emit`].
    pub(crate) fn begin(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    /// Runs `job`, which holds `bytes` of bodies, on the pipeline thread (inline
    /// once the pipeline is closed).
    pub(crate) fn submit(&self, job: Job, bytes: u64) {
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        let pipeline = self.pipeline.lock().unwrap_or_else(|p| p.into_inner());
        match pipeline.as_ref() {
            Some(tx) => {
                self.backlog.put(bytes);
                if let Err(mpsc::SendError((job, _))) = tx.send((job, bytes)) {
                    self.backlog.take(bytes);
                    drop(pipeline);
                    job();
                }
            }
            None => {
                drop(pipeline);
                job();
            }
        }
    }

    /// Waits (at most the admit wait) while the pipeline or a sink is behind, then
    /// asks every sink whether the exchange may go upstream. Exchanges wait in line,
    /// first come first served: only the first looks for room, and one that arrives
    /// while others wait joins the line even if it sees room, so none starves.
    pub(crate) async fn admit(&self, record: &ExchangeRecord) -> Result<(), Refusal> {
        let deadline = tokio::time::Instant::now() + self.admit_wait;
        let full = || self.backlog.full() || self.sinks.iter().any(|s| !s.has_room(record));
        let turn = match self.line.try_lock() {
            // The usual case: nobody waiting and room at once; allocates nothing.
            Ok(_) if !full() => return self.sinks.iter().try_for_each(|sink| sink.admit(record)),
            Ok(turn) => Some(turn),
            // Still in line at the deadline: it goes through unpromised, as below.
            Err(_) => tokio::time::timeout_at(deadline, self.line.lock())
                .await
                .ok(),
        };
        while turn.is_some() && full() && tokio::time::Instant::now() < deadline {
            // Listening, then looking again, so that room freed in between is not missed.
            let mut freed: Vec<_> = self
                .sinks
                .iter()
                .filter_map(|s| s.room_freed())
                .map(Box::pin)
                .collect();
            for f in &mut freed {
                f.as_mut().enable();
            }
            if !full() {
                break;
            }
            // A sink's wake-up ends the wait at once; the pipeline's backlog (and a
            // sink without one) is looked at again after a short poll.
            let any_freed = std::future::poll_fn(|cx| {
                match freed.iter_mut().any(|f| f.as_mut().poll(cx).is_ready()) {
                    true => std::task::Poll::Ready(()),
                    false => std::task::Poll::Pending,
                }
            });
            tokio::select! {
                _ = any_freed => {}
                _ = tokio::time::sleep(Duration::from_millis(2)) => {}
            }
        }
        self.sinks.iter().try_for_each(|sink| sink.admit(record))
    }

    /// Stops the pipeline after the jobs already queued (called once the runtime
    /// is down, so that exchanges cut at shutdown have queued their records).
    pub(crate) fn close(&self) {
        self.pipeline
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(worker) = worker {
            let _ = worker.join();
        }
    }

    /// Tells the stages that an exchange's response head arrived.
    pub(crate) fn response_began(&self, record: &ExchangeRecord) {
        for stage in &self.stages {
            stage.response_began(record);
        }
    }

    /// Runs the stages on a finished record, then hands it to every sink.
    pub(crate) fn emit(&self, record: &mut ExchangeRecord) {
        // The stages first: the cache stage's hold on a dried body ends when it is
        // prepared, so the body is restored with the units it cut.
        for stage in &self.stages {
            stage.apply(record);
        }
        record.restore_sent();
        for sink in &self.sinks {
            sink.record(record);
        }
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Blocks until every sink has handled the records emitted so far.
    pub(crate) fn flush(&self) {
        for sink in &self.sinks {
            sink.flush();
        }
    }

    /// Marks that the grace period is over: exchanges still open are being cut by
    /// promptgate itself, not abandoned by their clients.
    pub(crate) fn abandon_in_flight(&self) {
        self.abandoning.send_replace(true);
    }

    /// Resolves when the grace period is over (never, if it never is): a stream still
    /// open then tells its client why before it is cut.
    pub(crate) fn grace_over(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut over = self.abandoning.subscribe();
        async move {
            if over.wait_for(|v| *v).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether a stage or a sink compares bodies with earlier exchanges'.
    pub(crate) fn compares_bodies(&self) -> bool {
        self.stages.iter().any(|s| s.compares_bodies())
            || self.sinks.iter().any(|s| s.compares_bodies())
    }

    /// Whether a sink reads the message reassembled from a streamed answer.
    pub(crate) fn reads_message(&self) -> bool {
        self.sinks.iter().any(|s| s.reads_message())
    }

    /// How an exchange that ends without its response should be recorded.
    pub(crate) fn cut_outcome(&self) -> Outcome {
        if *self.abandoning.borrow() {
            Outcome::Shutdown
        } else {
            Outcome::ClientCancelled
        }
    }

    /// Exchanges begun and not yet emitted.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits until no exchange is in flight.
    pub(crate) async fn drained(&self) {
        loop {
            let notified = self.idle.notified();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_all_names_every_outcome_once() {
        use Outcome::*;
        let every = [
            Ok,
            ProviderError,
            Blocked,
            NoRoute,
            TooLarge,
            BadRequest,
            UpstreamError,
            ClientCancelled,
            Shutdown,
            CaptureUnavailable,
            StallAborted,
        ];
        for o in every {
            // A new variant fails to compile here: add it to `every` and to ALL.
            match o {
                Ok | ProviderError | Blocked | NoRoute | TooLarge | BadRequest | UpstreamError
                | ClientCancelled | Shutdown | CaptureUnavailable | StallAborted => {
                    assert!(Outcome::ALL.contains(&o), "{o:?} is not in ALL")
                }
            }
        }
        let names: std::collections::HashSet<_> = Outcome::ALL.iter().map(|o| o.name()).collect();
        assert_eq!(names.len(), every.len());
    }

    /// A sink with room for `slots` records; each admission keeps one.
    #[derive(Default)]
    struct Slots {
        slots: AtomicUsize,
        room: Notify,
        admitted: Mutex<Vec<ExchangeId>>,
    }

    impl Slots {
        fn free(&self, n: usize) {
            self.slots.fetch_add(n, Ordering::SeqCst);
            self.room.notify_waiters();
        }
    }

    impl RecordSink for Slots {
        fn record(&self, _record: &ExchangeRecord) {}

        fn has_room(&self, _record: &ExchangeRecord) -> bool {
            self.slots.load(Ordering::SeqCst) > 0
        }

        fn room_freed(&self) -> Option<tokio::sync::futures::Notified<'_>> {
            Some(self.room.notified())
        }

        fn admit(&self, record: &ExchangeRecord) -> Result<(), Refusal> {
            let _ = self
                .slots
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            self.admitted.lock().unwrap().push(record.id);
            Ok(())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn admission_goes_on_when_a_sink_frees_room_not_at_its_next_poll() {
        let sink = Arc::new(Slots::default());
        let recorder = Arc::new(Recorder::new(vec![sink.clone()]));
        let record =
            ExchangeRecord::begin(ExchangeId::new(), None, Method::POST, "/v1/messages".into());
        let started = tokio::time::Instant::now();
        let admitting = tokio::spawn({
            let recorder = recorder.clone();
            async move { recorder.admit(&record).await }
        });
        // The admission looks, finds no room and waits.
        tokio::task::yield_now().await;
        assert!(!admitting.is_finished());
        sink.free(1);
        admitting.await.unwrap().unwrap();
        // The clock is paused: a wait ended by the 2 ms poll would have moved it.
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn exchanges_waiting_for_room_go_in_the_order_they_came() {
        let sink = Arc::new(Slots::default());
        let recorder = Arc::new(Recorder::new(vec![sink.clone()]));
        let admit = |recorder: &Arc<Recorder>| {
            let record =
                ExchangeRecord::begin(ExchangeId::new(), None, Method::POST, "/v1/messages".into());
            let id = record.id;
            let recorder = recorder.clone();
            (
                id,
                tokio::spawn(async move { recorder.admit(&record).await }),
            )
        };
        let mut waiting = Vec::new();
        for _ in 0..3 {
            waiting.push(admit(&recorder));
            tokio::task::yield_now().await;
        }
        sink.free(1);
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        assert_eq!(*sink.admitted.lock().unwrap(), vec![waiting[0].0]);
        // Room for one, without a wake-up: a newcomer sees it but queues behind the
        // two still waiting, and the first of them takes it.
        sink.slots.fetch_add(1, Ordering::SeqCst);
        waiting.push(admit(&recorder));
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        sink.room.notify_waiters();
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            *sink.admitted.lock().unwrap(),
            vec![waiting[0].0, waiting[1].0]
        );
        let ids: Vec<ExchangeId> = waiting.iter().map(|(id, _)| *id).collect();
        sink.free(2);
        for (_, admitting) in waiting {
            admitting.await.unwrap().unwrap();
        }
        assert_eq!(*sink.admitted.lock().unwrap(), ids);
    }
}

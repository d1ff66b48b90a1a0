//! The stored record: one exchange after redaction, as the store keeps it and the
//! command line, the admin API and the exports show it.
//!
//! Built from an [`ExchangeRecord`] by [`CaptureRecord::redacted`]; nothing in it
//! holds a secret. Bodies travel beside the metadata as bytes and are stored as
//! units (see `layout`); [`BodyInfo`] describes each.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::layout::{self, Parts};
use super::timestamp;
use crate::digest::{self, Algorithm};
use crate::observer::{BodyFormat, SseDecoder};
use crate::prompt::KeyCheck;
use crate::prompt::Prompt;
use crate::provider::json::Span;
use crate::provider::{Api, Usage};
use crate::record::ExchangeRecord;
use crate::redact::{Redactor, Summary};

/// One body as stored: what it is, and (when loaded) its bytes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BodyInfo {
    /// Stored bytes (after redaction; decoded when it arrived compressed).
    pub size: u64,
    /// The digest of the stored bytes (the record's [`Algorithm`]): a rebuilt body
    /// is checked against it.
    #[serde(alias = "sha256")]
    pub digest: String,
    /// The stored bytes are one JSON document.
    pub json: bool,
    /// What to know about it: not JSON, decoded from gzip, not stored and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// How `content` is written: `json` (the body itself), `text` or `base64` (a string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
    /// The body, only in exports and `show --raw`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Box<RawValue>>,
    /// The stored bytes, when loaded or about to be stored.
    #[serde(skip)]
    pub bytes: Bytes,
    /// The stored bytes already cut into units, when the writer did it.
    #[serde(skip)]
    pub parts: Option<std::sync::Arc<Parts>>,
}

impl BodyInfo {
    /// Describes `bytes`, which are about to be stored.
    pub fn of(bytes: Bytes, note: Option<String>) -> BodyInfo {
        BodyInfo {
            digest: digest::content_hex(&bytes),
            ..BodyInfo::of_unhashed(bytes, note)
        }
    }

    /// [`BodyInfo::of`] without its hash.
    fn of_unhashed(bytes: Bytes, note: Option<String>) -> BodyInfo {
        let json =
            !bytes.is_empty() && serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok();
        BodyInfo {
            size: bytes.len() as u64,
            digest: String::new(),
            json,
            note,
            encoding: None,
            content: None,
            bytes,
            parts: None,
        }
    }

    /// [`BodyInfo::of`] for a response body: the store keeps it as one unit, its
    /// bytes, and the hash is taken once.
    pub fn of_response(bytes: Bytes) -> BodyInfo {
        let hash = digest::content(&bytes);
        BodyInfo {
            digest: digest::hex(&hash),
            parts: Some(std::sync::Arc::new(Parts {
                skeleton: (bytes.clone(), hash),
                units: Vec::new(),
            })),
            ..BodyInfo::of_unhashed(bytes, None)
        }
    }

    /// Fills `encoding` and `content` from `bytes`, for an export. JSON without line
    /// breaks is embedded as is (byte-exact); anything else becomes a string.
    pub fn with_content(&mut self) {
        if self.bytes.is_empty() && self.size == 0 {
            return;
        }
        let text = std::str::from_utf8(&self.bytes).ok();
        let (encoding, raw) = match text {
            Some(t) if self.json && !t.contains(['\n', '\r']) => {
                ("json", RawValue::from_string(t.to_owned()).ok())
            }
            Some(t) => (
                "text",
                serde_json::to_string(t)
                    .ok()
                    .and_then(|s| RawValue::from_string(s).ok()),
            ),
            None => (
                "base64",
                RawValue::from_string(format!("\"{}\"", base64(&self.bytes))).ok(),
            ),
        };
        self.encoding = Some(encoding.into());
        self.content = raw;
    }
}

/// The request side of a record.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RequestPart {
    /// Headers as received, credentials fingerprinted.
    pub headers: Vec<(String, String)>,
    pub body: BodyInfo,
    /// Headers as sent upstream.
    pub sent_headers: Vec<(String, String)>,
    /// The body as sent upstream; absent when it is the body as received.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_body: Option<BodyInfo>,
}

/// The response side of a record.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ResponsePart {
    /// The status the client got; absent when the exchange ended before one.
    pub status: Option<u16>,
    pub headers: Vec<(String, String)>,
    /// The body as the provider sent it, decoded; for a stream, the raw events.
    pub body: BodyInfo,
    /// `json`, `sse`, `other` or `empty`.
    pub format: Option<String>,
    /// The reassembled message of a stream (a JSON body is its own message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<BodyInfo>,
    /// The events of a stream, in exports: `[{event, data}]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<SseEvent>>,
    pub event_count: u32,
    /// A stream's terminal event arrived.
    pub complete: bool,
    pub stop_reason: Option<String>,
    pub response_id: Option<String>,
    /// Why the body could not be read, when it could not.
    pub parse_error: Option<String>,
    /// More came than the observer keeps; the body is a prefix.
    pub truncated: bool,
    /// Events per-event rules masked, dropped or stopped at: `body` is what the
    /// provider sent, and these say how what the client received differs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub edits: Vec<crate::rules::stream::EventEdit>,
}

/// One server-sent event as it came.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

/// Times of an exchange.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Times {
    /// Start, milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// Milliseconds from the start to the upstream's response head.
    pub upstream_headers_ms: Option<f64>,
    /// Milliseconds from the start to the first response body byte from upstream.
    pub first_byte_ms: Option<f64>,
    /// Milliseconds from the start to the end.
    pub total_ms: f64,
}

/// One exchange as stored. See the module docs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CaptureRecord {
    /// The exchange's id (a ULID: time-ordered).
    pub id: String,
    /// RFC 3339, UTC.
    pub started_at: String,
    /// Timings of the exchange, in milliseconds from its start.
    pub times: Times,
    /// `reverse` (a base URL) or `forward` (an HTTPS proxy).
    pub mode: String,
    /// The client's address.
    pub client: Option<String>,
    /// `anthropic` or `openai`, when the route named one.
    pub provider: Option<String>,
    /// The provider API: `messages`, `count_tokens`, `chat_completions`, `responses`, `other`.
    pub api: Option<String>,
    /// The HTTP method.
    pub method: String,
    /// The host the client addressed, redacted and cut.
    pub host: Option<String>,
    /// Path and query as the client sent them (credential-like query values fingerprinted).
    pub path: String,
    /// The URL the request went to (never with credentials).
    pub upstream_url: Option<String>,
    /// The model the provider read (the last of a repeated key), redacted and cut.
    pub model: Option<String>,
    /// The conversation key (`cc:<session id>`, `codex:<thread>`, `session:…`, `header:…`, `pointer:…`, `cache-key:…`, `hash:…`), redacted.
    pub conversation: Option<String>,
    /// The JSON pointer of a key the request body repeats in one object: every
    /// reader took its last value, as the providers' parsers do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duplicate_key: Option<String>,
    /// Names of the rules, scans and budgets that acted, in order.
    pub rules_fired: Vec<String>,
    /// Each policy's turn at each phase: its decision and its time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<crate::policy::PolicyRun>,
    /// What the outgoing-secrets scanner found: detector, kind, where, and what was
    /// done (never the value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<crate::policy::Finding>,
    /// Labels policies put on the exchange.
    pub tags: Vec<String>,
    /// JSON pointers of the body nodes rules changed.
    pub body_diff: Vec<String>,
    /// The request: headers as received and as sent, its bodies.
    pub request: RequestPart,
    /// The response: status, headers, body, stream events, what policies did to it.
    pub response: ResponsePart,
    /// Token usage as the provider reported it.
    pub usage: Option<Usage>,
    /// How it ended: `ok`, `provider_error`, `blocked`, `no_route`, `too_large`,
    /// `bad_request`, `upstream_error`, `client_cancelled`, `shutdown`,
    /// `capture_unavailable`, `stall_aborted`.
    pub outcome: String,
    /// What went wrong, when something did.
    pub error: Option<String>,
    /// Request body bytes received from the client.
    pub bytes_in: u64,
    /// Response body bytes sent to the client.
    pub bytes_out: u64,
    /// What every digest in this record was taken with (an old store's: SHA-256).
    #[serde(default = "Algorithm::unnamed")]
    pub digest: Algorithm,
    /// The digest of the exact request bytes received, before anything (redaction included).
    #[serde(alias = "received_sha256")]
    pub received_digest: String,
    /// The digest of the exact request bytes sent upstream.
    #[serde(alias = "sent_sha256")]
    pub sent_digest: String,
    /// Redactions per kind.
    pub redactions: BTreeMap<String, u32>,
    /// False when a rule turned capture off: headers and bodies were not kept.
    pub captured: bool,
    /// A blocked request the same client sent again within a minute: the id of the
    /// first attempt (each attempt stays a record of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_of: Option<String>,
    /// Not a model call (count_tokens, other paths, anything but a POST): lists and
    /// the viewer hide these unless asked. See [`crate::record::ExchangeRecord::is_side_request`].
    #[serde(default)]
    pub side: bool,
    /// Cache analysis, without prompt text (see `analysis`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<crate::cache::CacheReport>,
    /// A streamed answer's longest silence past `stream.stall_after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<crate::observer::stall::Stall>,
    /// A turn of a relayed WebSocket: the request body is its whole prompt put back
    /// together; this keeps the message as it crossed the socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub websocket: Option<StoredSocketTurn>,
}

/// A WebSocket turn as stored (see [`crate::record::SocketTurn`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StoredSocketTurn {
    /// The id of the socket's own record.
    pub socket: String,
    /// The client's `response.create` message as it crossed the socket, redacted.
    pub frame: BodyInfo,
    /// The earlier turns this turn's prompt continues, oldest first.
    pub recovered_from: Vec<String>,
    /// Why the whole prompt could not be put back together, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing: Option<String>,
}

/// A stored header list as a map, for reading the body stored beside it: values
/// that are not header values are left out, and `Content-Encoding` with them (the
/// store keeps bodies decoded).
fn readable_headers(pairs: &[(String, String)]) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    for (k, v) in pairs {
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(k.as_bytes()),
            http::HeaderValue::from_str(v),
        ) {
            map.append(k, v);
        }
    }
    map.remove(http::header::CONTENT_ENCODING);
    map
}

impl CaptureRecord {
    /// The request headers as received (credentials fingerprinted), beside the stored body.
    pub fn received_headers(&self) -> http::HeaderMap {
        readable_headers(&self.request.headers)
    }

    /// The exchange's whole cost at the provider's prices (input, cache writes and
    /// reads, output), when the cache analysis priced it.
    pub fn cost_usd(&self) -> Option<f64> {
        self.cache
            .as_ref()
            .and_then(|c| c.cost.as_ref())
            .map(|c| c.usd.total_usd)
    }

    /// The request headers as sent upstream, beside the stored sent body.
    pub fn sent_headers(&self) -> http::HeaderMap {
        readable_headers(&self.request.sent_headers)
    }

    /// The record of `r`, every header, body, path and message redacted in memory.
    pub fn redacted(r: &ExchangeRecord, redactor: &Redactor) -> CaptureRecord {
        Self::redacted_with(r, redactor, &mut UnitCache::default())
    }

    /// [`CaptureRecord::redacted`], redacting only the request units `cache` has not
    /// seen (the writer keeps one cache for all records).
    pub fn redacted_with(
        r: &ExchangeRecord,
        redactor: &Redactor,
        cache: &mut UnitCache,
    ) -> CaptureRecord {
        let mut summary = Summary::new();
        let extra = &r.extra_redactions;
        let started_ms = crate::capture::timestamp::ms_of(r.started_at);
        let ms = |d: Duration| (d.as_micros() as f64 / 1000.0 * 1000.0).round() / 1000.0;
        let known = cache.request_seen(r);
        let (received_digest, sent_digest, same_body) = match &known {
            Some(k) => (k.received_digest.clone(), k.sent_digest.clone(), k.same),
            None => cache.body_digests(r),
        };
        // The key the exchange's cell decides (once), redacted like any text.
        let conversation = r
            .conversation
            .get()
            .map(|k| redactor.redact_text(k, extra, &mut summary));
        // The one check of the model, which rules made if they looked, else made here.
        let not_checked = KeyCheck::NotChecked;
        let duplicate_key = match r.prompt.if_read() {
            Some(prompt) => prompt.keys(),
            None if r.capture => r.prompt.get().keys(),
            None => &not_checked,
        };
        let model = r.model_as_read();
        let observation = r.observation.as_ref();
        let summary_of = observation.map(|o| &o.summary);
        // Every field read out of a message is text a client or provider chose: a key
        // sent as `"model"` is redacted here as it is in the body.
        let mut field =
            |text: Option<&str>| text.map(|t| redactor.redact_text(t, extra, &mut summary));
        let model = field(model.as_deref());
        let host = field(r.host.as_deref());
        let stop_reason = field(summary_of.and_then(|s| s.stop_reason.as_deref()));
        let response_id = field(summary_of.and_then(|s| s.response_id.as_deref()));
        let parse_error = field(observation.and_then(|o| o.parse_error.as_deref()));
        let error = field(r.error.as_deref());
        let duplicate_key = field(duplicate_key.repeated());
        let mut record = CaptureRecord {
            id: r.id.to_string(),
            started_at: timestamp::rfc3339(started_ms),
            times: Times {
                started_ms,
                upstream_headers_ms: r.timing.upstream_headers.map(ms),
                first_byte_ms: r.timing.first_byte.map(ms),
                total_ms: ms(r.timing.total),
            },
            mode: r.mode.name().into(),
            client: r.client_addr.map(|a| a.to_string()),
            provider: r.provider.map(|p| p.name().to_owned()),
            api: r.api.map(|a| Api::name(a).to_owned()),
            method: r.method.to_string(),
            host,
            path: redactor.path(&r.path, &mut summary),
            upstream_url: r
                .upstream_url
                .as_ref()
                .map(|u| redactor.path(u, &mut summary)),
            model,
            conversation,
            duplicate_key,
            rules_fired: r.rules_fired.clone(),
            policies: redacted_policies(r, redactor),
            findings: redacted_findings(r, redactor),
            tags: r.tags.clone(),
            body_diff: r.body_diff.clone(),
            request: RequestPart::default(),
            response: ResponsePart {
                status: r.status.map(|s| s.as_u16()),
                format: observation.map(|o| format_name(o.format).to_owned()),
                event_count: summary_of.map_or(0, |s| s.events),
                complete: summary_of.is_some_and(|s| s.complete),
                stop_reason,
                response_id,
                parse_error,
                truncated: observation.is_some_and(|o| o.truncated),
                ..ResponsePart::default()
            },
            usage: summary_of.and_then(|s| s.usage),
            outcome: r.outcome.name().to_owned(),
            error,
            bytes_in: r.bytes_in,
            bytes_out: r.bytes_out,
            digest: Algorithm::CURRENT,
            received_digest,
            sent_digest,
            redactions: BTreeMap::new(),
            captured: r.capture,
            side: r.is_side_request(),
            repeat_of: None,
            cache: r
                .cache
                .as_ref()
                .map(|c| super::analysis::stored(c, redactor, extra)),
            stall: r.stall,
            websocket: r.websocket.as_ref().map(|t| StoredSocketTurn {
                socket: t.socket.to_string(),
                frame: BodyInfo::default(),
                recovered_from: t.recovered_from.iter().map(ToString::to_string).collect(),
                missing: t.missing.clone(),
            }),
        };
        if r.capture {
            record.capture_contents(r, redactor, cache, known, same_body, &mut summary);
        }
        record.redactions = summary;
        record
    }

    /// Adds the headers and bodies, redacted (a record with capture on).
    fn capture_contents(
        &mut self,
        r: &ExchangeRecord,
        redactor: &Redactor,
        cache: &mut UnitCache,
        known: Option<StoredRequest>,
        same_body: bool,
        summary: &mut Summary,
    ) {
        let extra = &r.extra_redactions;
        let secret = &r.secret_headers;
        // What was sent mostly repeats what was received: its redactions count once.
        let mut sent_summary = Summary::new();
        self.request.headers = redactor.headers(&r.request_headers, secret, summary);
        self.request.sent_headers = redactor.headers(&r.sent_headers, secret, &mut sent_summary);
        self.response.headers = redactor.headers(&r.response_headers, secret, summary);
        let ctx = &mut BodyContext {
            redactor,
            extra,
            cache,
            copied: Vec::new(),
            received: r.prompt.body(),
            placing: Placing::default(),
        };
        let stored = match known {
            Some(known) => known,
            None => {
                let conversation = r.conversation.get();
                ctx.placing = Placing {
                    open: true,
                    previous: conversation.and_then(|c| ctx.cache.take_placed(c)),
                    placed: None,
                };
                let stored = self.request_bodies(r, ctx, same_body);
                ctx.cache.keep_request(r, &stored);
                if let (Some(c), Some(placed)) = (conversation, ctx.placing.placed.take()) {
                    ctx.cache.keep_placed(c, placed);
                }
                stored
            }
        };
        self.request.body = stored.body;
        self.request.sent_body = stored.sent_body;
        for (kind, n) in stored.counts {
            *summary.entry(kind).or_default() += n;
        }
        for (kind, n) in stored.sent_counts {
            *sent_summary.entry(kind).or_default() += n;
        }
        for (kind, n) in sent_summary {
            let seen = summary.entry(kind).or_default();
            *seen = (*seen).max(n);
        }
        if let (Some(turn), Some(stored)) = (&r.websocket, self.websocket.as_mut()) {
            // The message as it crossed the socket, stored and redacted like a body.
            let format = r.prompt.get().format();
            let frame = crate::prompt::Prompt::read(turn.frame.clone(), format);
            let frame_digest = digest::content_hex(&turn.frame);
            // Its text mostly repeats the body's: its redactions count once.
            let mut frame_summary = Summary::new();
            stored.frame = request_body(
                &turn.frame,
                &frame_digest,
                None,
                &frame,
                None,
                ctx,
                &mut frame_summary,
            );
            for (kind, n) in frame_summary {
                let seen = summary.entry(kind).or_default();
                *seen = (*seen).max(n);
            }
        }
        if let Some(o) = r.observation.as_ref() {
            self.response_contents(o, redactor, extra, summary);
        }
        self.response.edits = r
            .stream_edits
            .iter()
            .map(|e| crate::rules::stream::EventEdit {
                sent: e.sent.as_ref().map(|t| {
                    String::from_utf8_lossy(&redactor.redact(t.as_bytes(), extra, summary))
                        .into_owned()
                }),
                ..e.clone()
            })
            .collect();
    }

    /// The request bodies (received, and sent when it differs), redacted and cut.
    fn request_bodies(
        &self,
        r: &ExchangeRecord,
        ctx: &mut BodyContext<'_>,
        same_body: bool,
    ) -> StoredRequest {
        let mut counts = Summary::new();
        let mut sent_counts = Summary::new();
        // The body sent first: the cache stage took its units' digests, which
        // find them in the cache unread; the body received takes what was copied.
        let sent_body = (!same_body).then(|| {
            request_body(
                &r.sent_body,
                &self.sent_digest,
                // A changed body goes upstream identity-encoded.
                None,
                r.sent_prompt.get(),
                None,
                ctx,
                &mut sent_counts,
            )
        });
        // Cut where the body sent copied it: those units are the sent body's, already
        // redacted; what rules changed is a unit of its own. Cutting it afresh was
        // ~60 µs of the writer's ~340 a request at 200 KB (full, resend, perf).
        let received = r.prompt.get();
        // (Rules that copied one value twice overlap: that body is cut afresh.)
        let split = (!ctx.copied.is_empty())
            .then(|| {
                let spans = ctx.copied.iter().map(|(at, unit)| Span {
                    start: *at,
                    end: at + unit.sent.len(),
                });
                layout::split_around(received.body(), spans)
            })
            .filter(|split| !split.units.is_empty());
        let body = request_body(
            &r.request_body,
            &self.received_digest,
            crate::provider::content_coding(&r.request_headers),
            received,
            split,
            ctx,
            &mut counts,
        );
        StoredRequest {
            received_digest: self.received_digest.clone(),
            sent_digest: self.sent_digest.clone(),
            same: same_body,
            body,
            sent_body,
            counts,
            sent_counts,
        }
    }

    /// Adds the response body and, for a stream, its reassembled message, redacted.
    fn response_contents(
        &mut self,
        o: &crate::observer::Observation,
        redactor: &Redactor,
        extra: &[regex::Regex],
        summary: &mut Summary,
    ) {
        // Shared, not copied, when there was nothing to redact: a response
        // copy may be `capture.max_response` bytes, several at once.
        let mut body = owned_or(redactor.redact(&o.body, extra, summary), &o.body);
        if o.format == BodyFormat::Sse
            && let Some(message) = &o.summary.message
        {
            let text = Bytes::from(message.to_string());
            // Secrets the stream split across events show whole only here.
            let secrets = redactor.secrets(&text, extra);
            if !secrets.is_empty() {
                body = owned_or(redactor.scrub_fragments(&body, &secrets), &body);
            }
            let text = owned_or(redactor.redact(&text, extra, summary), &text);
            self.response.message = Some(BodyInfo::of_response(text));
        }
        self.response.body = BodyInfo::of_response(body);
    }

    /// The stored bodies, in a fixed order: received, sent, response, message.
    pub fn bodies(&self) -> [Option<&BodyInfo>; 4] {
        [
            Some(&self.request.body),
            self.request.sent_body.as_ref(),
            Some(&self.response.body),
            self.response.message.as_ref(),
        ]
    }

    /// [`CaptureRecord::bodies`], to change them.
    pub fn bodies_mut(&mut self) -> [Option<&mut BodyInfo>; 4] {
        [
            Some(&mut self.request.body),
            self.request.sent_body.as_mut(),
            Some(&mut self.response.body),
            self.response.message.as_mut(),
        ]
    }

    /// The grammar of its request bodies, from its provider and API.
    pub fn request_format(&self) -> Option<crate::prompt::Format> {
        use crate::provider::{Api, Provider};
        let provider = match self.provider.as_deref()? {
            "anthropic" => Provider::Anthropic,
            "openai" => Provider::OpenAi,
            _ => return None,
        };
        let api = Api::from_name(self.api.as_deref()?)?;
        crate::prompt::Format::of_request(provider, api)
    }

    /// The request body as sent upstream (the received one when they are the same).
    pub fn sent(&self) -> &BodyInfo {
        self.request
            .sent_body
            .as_ref()
            .unwrap_or(&self.request.body)
    }

    /// Fills every body's content and a stream's event list, for an export.
    pub fn with_contents(&mut self) {
        for body in self.bodies_mut().into_iter().flatten() {
            body.with_content();
        }
        if self.response.format.as_deref() == Some("sse") {
            self.response.events = Some(sse_events(&self.response.body.bytes));
        }
    }
}

/// A redactor's answer as bytes: its own when it changed something, else `input`
/// shared (no copy).
fn owned_or(redacted: std::borrow::Cow<'_, [u8]>, input: &Bytes) -> Bytes {
    match redacted {
        std::borrow::Cow::Borrowed(_) => input.clone(),
        std::borrow::Cow::Owned(v) => Bytes::from(v),
    }
}

/// What redacting a request body needs.
struct BodyContext<'a> {
    redactor: &'a Redactor,
    extra: &'a [regex::Regex],
    cache: &'a mut UnitCache,
    /// The units the body sent copied unchanged from the body received, as stored,
    /// by where they start in that one: it takes them without reading them again.
    copied: Vec<(usize, CachedUnit)>,
    /// The body received (decoded), where copies are found.
    received: &'a [u8],
    placing: Placing,
}

/// Each policy's turn, its decision redacted: a hook's error text may quote what
/// its program printed.
fn redacted_policies(r: &ExchangeRecord, redactor: &Redactor) -> Vec<crate::policy::PolicyRun> {
    r.policy_runs
        .iter()
        .map(|p| crate::policy::PolicyRun {
            decision: redactor.bounded(&p.decision, &r.extra_redactions, crate::redact::TEXT_MAX),
            ..p.clone()
        })
        .collect()
}

/// The scanners' findings; locations name a tool, which a client chose: redacted
/// like any text.
fn redacted_findings(r: &ExchangeRecord, redactor: &Redactor) -> Vec<crate::policy::Finding> {
    r.findings
        .iter()
        .map(|f| crate::policy::Finding {
            location: redactor.bounded(&f.location, &r.extra_redactions, crate::redact::NAME_MAX),
            ..f.clone()
        })
        .collect()
}

/// Whether two bodies hold the same bytes; the sent body usually shares the received
/// one's memory, which settles it without reading them.
fn same_bytes(a: &Bytes, b: &Bytes) -> bool {
    same_memory(a, b) || a == b
}

/// Whether both are the one range of memory (no byte read).
fn same_memory(a: &Bytes, b: &Bytes) -> bool {
    a.len() == b.len() && a.as_ptr() == b.as_ptr()
}

/// A request body, redacted: stored as `prompt` holds it (decoded once by the
/// exchange when it came compressed with `coding`), cut as `split` says, else at
/// the prompt's units. `raw_digest` is the digest of `raw`, reused when the stored
/// bytes are the same.
fn request_body(
    raw: &Bytes,
    raw_digest: &str,
    coding: Option<&str>,
    prompt: &Prompt,
    split: Option<layout::Split<'_>>,
    ctx: &mut BodyContext<'_>,
    summary: &mut Summary,
) -> BodyInfo {
    let plain = prompt.body().clone();
    let mut note = match coding {
        // Refused before it went anywhere: bytes that cannot be scanned are not kept.
        Some(c) if plain.is_empty() && !raw.is_empty() => {
            return BodyInfo {
                size: 0,
                digest: digest::content_hex(b""),
                note: Some(format!("not stored: it could not be decoded from {c}")),
                ..BodyInfo::default()
            };
        }
        Some(c) => Some(format!("decoded from {c}")),
        None => None,
    };
    let split = split.unwrap_or_else(|| layout::split(prompt));
    let mut info = match ctx.cache.redact(
        &plain,
        split,
        prompt,
        &mut ctx.copied,
        &mut ctx.placing,
        ctx.received,
        ctx.redactor,
        ctx.extra,
        summary,
    ) {
        // Untouched: the bytes parsed as a JSON object when they were cut.
        Redacted::Same(parts) if note.is_none() => BodyInfo {
            size: plain.len() as u64,
            digest: raw_digest.to_owned(),
            json: true,
            parts: Some(parts),
            ..BodyInfo::default()
        },
        Redacted::Same(parts) => BodyInfo {
            parts: Some(parts),
            ..BodyInfo::of(plain.clone(), None)
        },
        Redacted::Cut(bytes, parts) => BodyInfo {
            parts: Some(parts),
            ..BodyInfo::of(bytes, None)
        },
        Redacted::Whole(bytes) => BodyInfo::of(bytes, None),
    };
    if info.bytes.is_empty() {
        info.bytes = plain.clone();
    }
    if !info.json && !info.bytes.is_empty() {
        let why = match serde_json::from_slice::<serde::de::IgnoredAny>(&plain) {
            Err(e) => format!("not valid JSON: {e}"),
            Ok(_) => "not valid JSON after redaction".to_owned(),
        };
        note = Some(match note {
            Some(n) => format!("{n}; {why}"),
            None => why,
        });
    }
    info.note = note;
    info
}

/// The most bytes [`UnitCache`] keeps (units as stored, plus the bytes as sent of the
/// few that had something redacted): units shared across conversations, and those a
/// conversation whose last turn is no longer kept sends again. Copies, so kept small;
/// a conversation's last turn finds its units by place for the bytes it shares.
// At 32 MiB, 200 KB conversations at c16 peaked at 112–116 MB RSS; at 4 MiB with the
// last turns' bound below, 92–98 MB at the same CPU (bench/README, issue 45).
const UNIT_CACHE_BYTES: usize = 4 << 20;

/// Request units already redacted. An agent resends its whole conversation every
/// turn, and the body sent upstream mostly repeats the one received: a unit seen
/// before is found by the digest the cache stage took of it, or else by a fast hash
/// of its bytes confirmed byte for byte, so it is redacted and hashed once. Memory
/// only; two generations, the older dropped when the newer fills half the limit
/// (what is still in use moves up).
#[derive(Debug)]
pub struct UnitCache {
    seeds: foldhash::quality::RandomState,
    current: HashMap<UnitKey, CachedUnit, foldhash::fast::RandomState>,
    previous: HashMap<UnitKey, CachedUnit, foldhash::fast::RandomState>,
    /// Bytes held by `current`.
    bytes: usize,
    limit: usize,
    /// The last requests stored, newest last: one sent again byte for byte takes its
    /// digests and stored bodies from here, without reading its bytes but to compare.
    // 200 KB resend, full, c16: the writer thread 269–293 µs a request → 72–74.
    recent: std::collections::VecDeque<RecentRequest>,
    /// The bodies each conversation sent last, with their blocks' digests: the next
    /// turn repeats most of those blocks where they stood, and is hashed by the rest.
    // Conversations at 200–250 KB, full, c16: the two whole-body digests were ~44 % of
    // the writer thread (perf), for bytes mostly digested a turn before.
    last_turns: std::collections::VecDeque<LastTurn>,
    /// Units found by place (tests).
    #[cfg(test)]
    placed_hits: usize,
}

/// The most conversations [`UnitCache`] keeps the last bodies of, and the most bytes
/// those bodies keep alive (bodies the cache analysis holds too cost nothing more).
// 16 MiB held ~36 of 64 conversations at the 200 KB band; the others' units came from
// the unit cache by lookup (c64: the writer 264–280 µs a turn, 228–229 with all kept).
const LAST_TURNS: usize = 64;
const LAST_TURN_BYTES: usize = 64 << 20;

/// A conversation's last bodies, received and (when rules changed it) sent, with
/// their blocks' digests.
#[derive(Debug)]
struct LastTurn {
    conversation: String,
    received: digest::Blocks,
    /// When rules changed it before the place the turn parted from its last turn.
    sent: Option<digest::Blocks>,
    /// The units of the body sent, as stored, by place.
    placed: Option<PlacedUnits>,
}

/// A body's units as stored, in order, each with the span digest it was found by
/// when nothing in it was redacted: the next turn of the conversation sends most of
/// them again in the same order, and takes them here without a lookup.
// Conversations, full, c16: the unit map's lookups (cold buckets) were ~24 % of the
// writer at the 200 KB band and ~31 % at 400 KB, growing with the body (perf).
#[derive(Debug)]
struct PlacedUnits {
    parts: std::sync::Arc<Parts>,
    /// Each unit's span digest, in order.
    spans: crate::prompt::DigestPlaces,
}

impl PlacedUnits {
    /// The unit at `cursor` or a few places on, when its span digest is `digest` (a
    /// turn changes the unit its breakpoint left, and units found by their bytes or
    /// with a secret hold no digest here); the cursor moves past it.
    fn find(&self, cursor: &mut usize, digest: crate::digest::Digest) -> Option<CachedUnit> {
        let k = self.spans.find(cursor, &digest)?;
        let (_, stored, hash) = &self.parts.units[k];
        Some(CachedUnit {
            sent: stored.clone(),
            stored: stored.clone(),
            hash: *hash,
            counts: Vec::new(),
        })
    }
}

/// The units of a conversation's last turn, offered to the first body cut now (the
/// body sent), and that body's units, kept for the next turn.
#[derive(Debug, Default)]
struct Placing {
    open: bool,
    previous: Option<PlacedUnits>,
    placed: Option<PlacedUnits>,
}

impl LastTurn {
    fn size(&self) -> usize {
        self.received.body().len() + self.sent.as_ref().map_or(0, |s| s.body().len())
    }
}

impl Default for UnitCache {
    fn default() -> Self {
        Self::with_limit(UNIT_CACHE_BYTES)
    }
}

/// A request's bodies as the writer stored them, with their digests: what a
/// byte-identical resend (a retry, a replay, a benchmark) stores again.
#[derive(Debug, Clone)]
struct StoredRequest {
    received_digest: String,
    sent_digest: String,
    /// The body sent is the body received.
    same: bool,
    body: BodyInfo,
    sent_body: Option<BodyInfo>,
    /// Redactions in the body received, and in the body sent, per kind.
    counts: Summary,
    sent_counts: Summary,
}

/// A request stored lately, with the bytes that identify it.
#[derive(Debug)]
struct RecentRequest {
    received: Bytes,
    sent: Bytes,
    making: Making,
    coding: Option<String>,
    stored: StoredRequest,
}

/// How a request's body sent was made from its body received: what proves two
/// bodies sent the same once their bodies received are, without comparing the
/// bytes they share. On the 200 KB resend that second compare of a cold body was
/// 18 of the capture writer's 65 µs a record (perf).
#[derive(Debug)]
enum Making {
    /// Sent as received.
    Received,
    /// Written by rules from the body received.
    Written(crate::prompt::WrittenBody),
    /// Anything else: only its bytes tell.
    Other,
}

impl Making {
    fn of(r: &ExchangeRecord) -> Making {
        if r.sent_unchanged() {
            return Making::Received;
        }
        match r
            .sent_prompt
            .if_read()
            .and_then(|p| p.written_body(&r.request_plain))
        {
            Some(written) => Making::Written(written),
            None => Making::Other,
        }
    }

    /// Whether `sent`, made as `self`, is `other_sent`, made as `other`, from
    /// bodies received that are the same bytes.
    fn same_sent(&self, sent: &Bytes, other: &Making, other_sent: &Bytes) -> bool {
        match (self, other) {
            (Making::Received, Making::Received) => true,
            (Making::Written(a), Making::Written(b)) => a.same(b),
            _ => same_bytes(sent, other_sent),
        }
    }
}

impl RecentRequest {
    /// Memory it keeps alive: each body once (they often share it).
    fn size(&self) -> usize {
        let stored = &self.stored;
        let bodies = [
            Some(&self.received),
            Some(&self.sent),
            Some(&stored.body.bytes),
            stored.sent_body.as_ref().map(|b| &b.bytes),
        ];
        let mut seen: Vec<*const u8> = Vec::with_capacity(4);
        let mut size = 0;
        for b in bodies.into_iter().flatten() {
            if !seen.contains(&b.as_ptr()) {
                seen.push(b.as_ptr());
                size += b.len();
            }
        }
        size
    }
}

/// The most requests [`UnitCache`] remembers whole, and the most bytes they keep alive:
/// enough for the retries of a few agents; a growing conversation never repeats.
const RECENT_REQUESTS: usize = 4;
const RECENT_REQUEST_BYTES: usize = 4 << 20;

/// What [`UnitCache`] finds a unit by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum UnitKey {
    /// The content digest of the unit's span ([`crate::prompt::Unit::span_digest`]),
    /// which fixes its stored bytes: no byte of it is read.
    // A record 128→118, 157→145, 153→137 µs (`cargo bench --bench capture`, 100 turns).
    Span(crate::digest::Digest),
    /// A fast hash (`seeds`) of the stored bytes, confirmed byte for byte.
    Bytes(u64),
}

#[derive(Debug, Clone)]
struct CachedUnit {
    /// The unit as sent (the same memory as `stored` when nothing was redacted).
    sent: Bytes,
    /// The unit as stored, and its SHA-256.
    stored: Bytes,
    hash: [u8; 32],
    /// Redactions in it, per kind; empty when `stored` is `sent`.
    counts: Vec<(String, u32)>,
}

impl CachedUnit {
    /// `bytes` redacted and hashed.
    fn of(bytes: &[u8], redactor: &Redactor) -> CachedUnit {
        let mut counts = Summary::new();
        match redactor.redact(bytes, &[], &mut counts) {
            std::borrow::Cow::Borrowed(_) => {
                let sent = Bytes::copy_from_slice(bytes);
                CachedUnit {
                    stored: sent.clone(),
                    sent,
                    hash: digest::content(bytes),
                    counts: Vec::new(),
                }
            }
            std::borrow::Cow::Owned(v) => CachedUnit {
                sent: Bytes::copy_from_slice(bytes),
                hash: digest::content(&v),
                stored: Bytes::from(v),
                counts: counts.into_iter().collect(),
            },
        }
    }

    fn redacted(&self) -> bool {
        !self.counts.is_empty()
    }

    /// Memory it holds.
    fn size(&self) -> usize {
        self.stored.len() + if self.redacted() { self.sent.len() } else { 0 }
    }
}

/// A request body after redaction.
enum Redacted {
    /// Cut into units, nothing redacted: the stored bytes are the bytes sent.
    Same(std::sync::Arc<Parts>),
    /// Cut into units, some redacted: the stored bytes.
    Cut(Bytes, std::sync::Arc<Parts>),
    /// Redacted whole (not a JSON object with units, or a rule added patterns).
    Whole(Bytes),
}

impl UnitCache {
    /// A cache holding at most about `limit` bytes.
    pub fn with_limit(limit: usize) -> Self {
        UnitCache {
            seeds: Default::default(),
            current: HashMap::default(),
            previous: HashMap::default(),
            bytes: 0,
            limit,
            recent: Default::default(),
            last_turns: Default::default(),
            #[cfg(test)]
            placed_hits: 0,
        }
    }

    /// The digests of the body received and of the body sent (taken once when they
    /// are the same bytes), and whether they are: each by the blocks that its
    /// conversation's last turn did not have where they stand now (all of them for a
    /// request that names no conversation).
    fn body_digests(&mut self, r: &ExchangeRecord) -> (String, String, bool) {
        let same = same_bytes(&r.sent_body, &r.request_body);
        let conversation = r.conversation.get();
        let last = conversation
            .and_then(|c| self.last_turns.iter().position(|t| t.conversation == c))
            .and_then(|i| self.last_turns.remove(i));
        let (received, received_blocks) =
            digest::content_after(&r.request_body, last.as_ref().map(|t| &t.received));
        let (sent, sent_blocks) = if same {
            (received, None)
        } else {
            let earlier = last
                .as_ref()
                .map(|t| t.sent.as_ref().unwrap_or(&t.received));
            // The bytes rules copied ahead of their first edit are the received
            // body's, block for block: their values are taken, not compared again.
            // 400 KB band, full: proving those blocks equal to the last turn's was
            // half of the writer's memcmp, ~7 % of the thread (perf).
            let shared = match r.sent_prompt.if_read() {
                Some(p)
                    if same_memory(&r.request_body, &r.request_plain)
                        && same_memory(p.body(), &r.sent_body) =>
                {
                    Some((&received_blocks, p.copied_prefix(&r.request_plain)))
                }
                _ => None,
            };
            let (d, blocks) = digest::content_sharing(&r.sent_body, earlier, shared);
            // Kept for the next turn only when rules first changed it before the
            // place this turn parted from its last: past that place the next turn's
            // bytes move, and no block of this one would stand where it stood.
            // Conversations, 200 KB band, c64, 5 pairs: peak RSS 187–197 → 176–189 MB.
            let parted = last
                .as_ref()
                .map(|t| received_blocks.shared_start(&t.received));
            let copied = shared.map_or(0, |(_, len)| len);
            let keep = parted.is_none_or(|p| copied.next_multiple_of(digest::BLOCK) < p);
            (d, keep.then_some(blocks))
        };
        let placed = last.and_then(|t| t.placed);
        if let Some(conversation) = conversation {
            self.keep_turn(LastTurn {
                conversation: conversation.to_owned(),
                received: received_blocks,
                sent: sent_blocks,
                placed,
            });
        }
        (digest::hex(&received), digest::hex(&sent), same)
    }

    /// The units a conversation's last turn stored by place, taken to find this
    /// turn's (its turn was just kept, newest).
    fn take_placed(&mut self, conversation: &str) -> Option<PlacedUnits> {
        let turn = self.last_turns.back_mut()?;
        (turn.conversation == conversation).then(|| turn.placed.take())?
    }

    /// Keeps this turn's units by place for the conversation's next turn.
    fn keep_placed(&mut self, conversation: &str, placed: PlacedUnits) {
        if let Some(turn) = self
            .last_turns
            .back_mut()
            .filter(|t| t.conversation == conversation)
        {
            turn.placed = Some(placed);
        }
    }

    /// Keeps a conversation's last turn, letting the oldest go past the bounds.
    fn keep_turn(&mut self, turn: LastTurn) {
        self.last_turns.push_back(turn);
        while self.last_turns.len() > LAST_TURNS
            || self.last_turns.iter().map(LastTurn::size).sum::<usize>() > LAST_TURN_BYTES
        {
            if self.last_turns.pop_front().is_none() {
                break;
            }
        }
    }

    /// What was stored for a request with these exact bodies, if it was lately: only
    /// a request that stores its bodies as they are (no socket frame, no patterns a
    /// rule added).
    fn request_seen(&self, r: &ExchangeRecord) -> Option<StoredRequest> {
        if !Self::rememberable(r) {
            return None;
        }
        let coding = crate::provider::content_coding(&r.request_headers);
        let making = Making::of(r);
        self.recent
            .iter()
            .rev()
            .find(|k| {
                k.received.len() == r.request_body.len()
                    && k.sent.len() == r.sent_body.len()
                    && k.coding.as_deref() == coding
                    && same_bytes(&k.received, &r.request_body)
                    && k.making.same_sent(&k.sent, &making, &r.sent_body)
            })
            .map(|k| k.stored.clone())
    }

    /// Remembers what was stored for `r`, dropping the oldest past the bounds.
    fn keep_request(&mut self, r: &ExchangeRecord, stored: &StoredRequest) {
        if !Self::rememberable(r) {
            return;
        }
        let recent = RecentRequest {
            received: r.request_body.clone(),
            sent: r.sent_body.clone(),
            making: Making::of(r),
            coding: crate::provider::content_coding(&r.request_headers).map(str::to_owned),
            stored: stored.clone(),
        };
        if recent.size() > RECENT_REQUEST_BYTES / 2 {
            return;
        }
        self.recent.push_back(recent);
        while self.recent.len() > RECENT_REQUESTS
            || self.recent.iter().map(RecentRequest::size).sum::<usize>() > RECENT_REQUEST_BYTES
        {
            self.recent.pop_front();
        }
    }

    fn rememberable(r: &ExchangeRecord) -> bool {
        r.capture && r.websocket.is_none() && r.extra_redactions.is_empty()
    }

    /// `body` (cut as `split`, the body of `prompt`) with its units redacted, each
    /// unit once per cache life. A body rules derived from the one received notes in
    /// `copied` the units it copied from it; that body, redacted next, takes them.
    #[allow(clippy::too_many_arguments)]
    fn redact(
        &mut self,
        body: &Bytes,
        split: layout::Split<'_>,
        prompt: &Prompt,
        copied: &mut Vec<(usize, CachedUnit)>,
        placing: &mut Placing,
        received: &[u8],
        redactor: &Redactor,
        extra: &[regex::Regex],
        summary: &mut Summary,
    ) -> Redacted {
        // Only the first body cut (the body sent) is found and kept by place.
        let placed_now = std::mem::take(&mut placing.open);
        let previous = placing.previous.take().filter(|_| placed_now);
        let whole = |summary: &mut Summary| {
            Redacted::Whole(owned_or(redactor.redact(body, extra, summary), body))
        };
        if !extra.is_empty() || split.units.is_empty() {
            return whole(summary);
        }
        // A secret in the skeleton would shift the units' offsets: redact it whole.
        let skeleton = self.unit(&split.skeleton, None, redactor);
        if skeleton.redacted() {
            return whole(summary);
        }
        // The digests already taken, by where each unit's stored bytes start, when the
        // prompt was cut (a body cut where another copied it was not: its units not
        // lent are found by their bytes).
        let mut digests: Vec<(usize, crate::digest::Digest)> = prompt
            .units_if_cut()
            .iter()
            .filter_map(|u| Some((u.stored.start, u.span_digest()?)))
            .collect();
        digests.sort_unstable_by_key(|(start, _)| *start);
        let mut changed = false;
        let mut units = Vec::with_capacity(split.units.len());
        let mut spans = Vec::with_capacity(if placed_now { split.units.len() } else { 0 });
        let mut cursor = 0;
        let lent = std::mem::take(copied);
        for (offset, bytes) in &split.units {
            let start = bytes.as_ptr() as usize - body.as_ptr() as usize;
            let from_sent = lent
                .binary_search_by_key(&start, |(s, _)| *s)
                .ok()
                .map(|i| &lent[i].1)
                .filter(|unit| unit.sent.len() == bytes.len());
            let digest = digests
                .binary_search_by_key(&start, |(s, _)| *s)
                .ok()
                .map(|i| digests[i].1);
            let unit = match from_sent {
                Some(unit) => unit.clone(),
                None => match previous.as_ref().zip(digest) {
                    Some((p, d)) if let Some(unit) = p.find(&mut cursor, d) => {
                        debug_assert_eq!(unit.sent, bytes, "one span digest, two stored units");
                        #[cfg(test)]
                        {
                            self.placed_hits += 1;
                        }
                        unit
                    }
                    _ => self.unit(bytes, digest, redactor),
                },
            };
            if placed_now {
                spans.push(digest.filter(|_| !unit.redacted()));
            }
            let span = Span {
                start,
                end: start + bytes.len(),
            };
            if let Some(at) = prompt.received_at(span, received) {
                copied.push((at, unit.clone()));
            }
            for (kind, n) in &unit.counts {
                *summary.entry(kind.clone()).or_default() += n;
            }
            // A redaction whose marker spells the secret itself changes nothing.
            changed |= unit.redacted() && unit.stored != unit.sent;
            units.push((*offset, unit.stored, unit.hash));
        }
        copied.sort_by_key(|(at, _)| *at);
        let parts = std::sync::Arc::new(Parts {
            skeleton: (skeleton.stored, skeleton.hash),
            units,
        });
        if placed_now {
            placing.placed = Some(PlacedUnits {
                parts: parts.clone(),
                spans: crate::prompt::DigestPlaces::new(spans),
            });
        }
        if !changed {
            return Redacted::Same(parts);
        }
        let bytes = layout::join(
            &parts.skeleton.0,
            parts.units.iter().map(|(o, u, _)| (*o, &u[..])),
        );
        Redacted::Cut(Bytes::from(bytes), parts)
    }

    /// The unit `bytes` as stored: from the cache when these exact bytes were seen,
    /// else redacted and hashed now. `span_digest`: its span's digest, when known.
    fn unit(
        &mut self,
        bytes: &[u8],
        span_digest: Option<crate::digest::Digest>,
        redactor: &Redactor,
    ) -> CachedUnit {
        if let Some(d) = span_digest
            && let Some(hit) = self.find(UnitKey::Span(d), |_| true)
        {
            debug_assert_eq!(hit.sent, bytes, "one span digest, two stored units");
            return hit;
        }
        // Seen by its bytes only: with a breakpoint (no span digest then) a turn ago.
        let fast = UnitKey::Bytes(self.seeds.hash_one(bytes));
        let unit = match self.find(fast, |c| c.sent == bytes) {
            Some(hit) => hit,
            None => {
                let unit = CachedUnit::of(bytes, redactor);
                self.keep(fast, unit.clone());
                unit
            }
        };
        if let Some(d) = span_digest {
            self.keep(UnitKey::Span(d), unit.clone());
        }
        unit
    }

    /// The unit kept under `key`, if `same` says it is the one; a hit in the older
    /// generation moves up.
    fn find(&mut self, key: UnitKey, same: impl Fn(&CachedUnit) -> bool) -> Option<CachedUnit> {
        if let Some(hit) = self.current.get(&key).filter(|c| same(c)) {
            return Some(hit.clone());
        }
        let hit = self.previous.remove(&key).filter(|c| same(c))?;
        self.keep(key, hit.clone());
        Some(hit)
    }

    /// Keeps `unit`; a full generation becomes the previous one, dropping the older.
    fn keep(&mut self, key: UnitKey, unit: CachedUnit) {
        let size = unit.size();
        if size > self.limit / 2 {
            return;
        }
        if self.bytes + size > self.limit / 2 {
            self.previous = std::mem::take(&mut self.current);
            self.bytes = 0;
        }
        self.bytes += size;
        if let Some(old) = self.current.insert(key, unit) {
            self.bytes -= old.size();
        }
    }
}

/// The events of an SSE body, in order.
pub(crate) fn sse_events(body: &[u8]) -> Vec<SseEvent> {
    let mut out = Vec::new();
    let mut decoder = SseDecoder::default();
    decoder.feed(body, &mut |event, data| {
        out.push(SseEvent {
            event: event.to_owned(),
            data: data.to_owned(),
        })
    });
    // A body cut inside its last event still shows that event.
    decoder.feed(b"\n\n", &mut |event, data| {
        out.push(SseEvent {
            event: event.to_owned(),
            data: data.to_owned(),
        })
    });
    out
}

fn format_name(format: BodyFormat) -> &'static str {
    match format {
        BodyFormat::Empty => "empty",
        BodyFormat::Json => "json",
        BodyFormat::Sse => "sse",
        BodyFormat::Other => "other",
    }
}

fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn content_is_exact_json_or_a_string() {
        let mut b = BodyInfo::of(Bytes::from_static(br#"{"a":0.70,"b":"\u00e9"}"#), None);
        b.with_content();
        assert_eq!(b.encoding.as_deref(), Some("json"));
        assert_eq!(
            b.content.as_ref().unwrap().get(),
            r#"{"a":0.70,"b":"\u00e9"}"#
        );
        let mut b = BodyInfo::of(Bytes::from_static(b"{\n\"a\":1}"), None);
        b.with_content();
        assert_eq!(b.encoding.as_deref(), Some("text"));
        let mut b = BodyInfo::of(Bytes::from_static(&[0xff, 0x00]), None);
        b.with_content();
        assert_eq!(b.content.as_ref().unwrap().get(), "\"/wA=\"");
    }

    #[test]
    fn sse_events_include_a_cut_last_event() {
        let e = sse_events(b"event: a\ndata: 1\n\nevent: b\ndata: {\"x\"");
        assert_eq!(e.len(), 2);
        assert_eq!(e[1].data, "{\"x\"");
    }
}

#[cfg(test)]
mod redacted_tests {
    use super::*;
    use crate::id::ExchangeId;

    fn exchange() -> ExchangeRecord {
        let mut r = ExchangeRecord::begin(
            ExchangeId::new(),
            None,
            http::Method::POST,
            "/v1/messages?key=abc123".into(),
        );
        r.provider = Some(crate::provider::Provider::Anthropic);
        r.api = Some(Api::Messages);
        let body = Bytes::from_static(br#"{"messages":[{"role":"user","content":"ticket internal-4242 and sk-ant-api03-RECORDSECRET0123456789"}]}"#);
        r.set_request_body(body.clone(), body);
        r.request_headers
            .insert("x-team-secret", "team-value".parse().unwrap());
        r.request_headers.insert(
            "x-api-key",
            "sk-ant-api03-RECORDSECRET0123456789".parse().unwrap(),
        );
        r.sent_headers = r.request_headers.clone();
        r
    }

    /// A body rules derived from the one received lends the units it copied: the
    /// record is the one a body read afresh gives, unit for unit.
    #[test]
    fn a_derived_body_stores_what_a_body_read_afresh_stores() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let body = Bytes::from_static(br#"{"model":"claude-x","system":[{"type":"text","text":"be brief sk-ant-api03-SYSTEMSECRET0123456789"}],"messages":[{"role":"user","content":[{"type":"text","text":"one DB_PASSWORD=hunter2hunter2"},{"type":"text","text":"two","cache_control":{"type":"ephemeral"}}]}],"max_tokens":5}"#);
        let mut r = exchange();
        r.set_request_body(body.clone(), body.clone());
        let derived = derive(&r, &body);
        let mut afresh = r.clone();
        afresh.set_sent(Prompt::read(derived.body().clone(), derived.get().format()));
        r.set_sent_cell(derived);
        let mut cache = UnitCache::default();
        let lent = CaptureRecord::redacted_with(&r, &redactor, &mut cache);
        let read = CaptureRecord::redacted(&afresh, &redactor);
        let parts = |c: &CaptureRecord| c.request.sent_body.as_ref().unwrap().parts.clone();
        assert_eq!(parts(&lent), parts(&read));
        assert_eq!(lent.redactions, read.redactions);
        let stored = &lent.request.sent_body.as_ref().unwrap().bytes;
        assert_eq!(stored, &read.request.sent_body.as_ref().unwrap().bytes);
        let text = String::from_utf8_lossy(stored);
        assert!(
            text.contains("policy") && text.contains(r#""ttl":"1h""#),
            "{text}"
        );
        assert!(
            !text.contains("hunter2") && !text.contains("SYSTEMSECRET"),
            "{text}"
        );
    }

    /// A system preamble and a 1 h ttl, applied to `body` as received by `r`.
    fn derive(r: &ExchangeRecord, body: &Bytes) -> crate::prompt::PromptCell {
        derive_with(
            r,
            body,
            r#"
[[rule]]
name = "preamble"
on = "before_provider_request"
actions = [ { system.prepend = { text = "policy" } }, { cache_control.ttl = "1h" } ]
"#,
        )
    }

    /// The rules `toml`, applied to `body` as received by `r`.
    fn derive_with(r: &ExchangeRecord, body: &Bytes, toml: &str) -> crate::prompt::PromptCell {
        crate::rules::derive_for_test(&r.prompt, body, toml)
    }

    /// A body the rules of [`derive`] change in a few places: most of it is copied.
    fn sent_body() -> Bytes {
        let text = "lorem ipsum ".repeat(300);
        Bytes::from(format!(
            r#"{{"model":"claude-x","system":[{{"type":"text","text":"be brief"}}],"messages":[{{"role":"user","content":[{{"type":"text","text":"one DB_PASSWORD=hunter2hunter2 {text}"}},{{"type":"text","text":"two","cache_control":{{"type":"ephemeral"}}}}]}}],"max_tokens":5}}"#
        ))
    }

    /// While the answer streams the body sent is held as what the rules wrote; the
    /// record pipeline builds it again, and the record is the one it was.
    #[test]
    fn a_body_sent_dried_and_restored_stores_what_it_did_before() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let body = sent_body();
        let record = || {
            let mut r = exchange();
            r.set_request_body(body.clone(), body.clone());
            let sent = derive(&r, &body);
            r.set_sent_cell(sent);
            r
        };
        let kept = record();
        let mut dried = record();
        dried.sent_prompt.get().units();
        dried.dry_sent();
        assert!(dried.sent_body.is_empty(), "dried");
        // Queues count it whole: the pipeline restores it before it waits anywhere.
        assert_eq!(dried.held_bytes(), kept.held_bytes());
        dried.restore_sent();
        assert_eq!(dried.sent_body, kept.sent_body);
        let a = CaptureRecord::redacted(&kept, &redactor);
        let b = CaptureRecord::redacted(&dried, &redactor);
        let sent = |c: &CaptureRecord| {
            let s = c.request.sent_body.as_ref().unwrap();
            (s.bytes.clone(), s.digest.clone(), s.parts.clone())
        };
        assert_eq!(sent(&a), sent(&b));
        assert_eq!(a.request.body.bytes, b.request.body.bytes);
        assert_eq!(a.sent_digest, b.sent_digest);
    }

    /// A body rules changed: the body received is cut where the body sent copied it
    /// (its units are the sent body's, redacted once), not cut afresh, and is stored
    /// as a body read on its own is.
    #[test]
    fn the_body_received_is_cut_where_the_body_sent_copied_it() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let body = sent_body();
        let mut r = exchange();
        r.set_request_body(body.clone(), body.clone());
        let mut own = exchange();
        own.set_request_body(body.clone(), body.clone());
        let alone = CaptureRecord::redacted(&own, &redactor);
        let sent = derive(&r, &body);
        r.set_sent_cell(sent);
        let c = CaptureRecord::redacted(&r, &redactor);
        assert!(
            r.prompt.get().units_if_cut().is_empty(),
            "the body received was cut afresh"
        );
        let parts = c.request.body.parts.as_ref().unwrap();
        let sent_units: std::collections::HashSet<[u8; 32]> = c
            .request
            .sent_body
            .as_ref()
            .unwrap()
            .parts
            .as_ref()
            .unwrap()
            .units
            .iter()
            .map(|u| u.2)
            .collect();
        // Every unit a fresh cut finds, the block whose `cache_control` the ttl rule
        // rewrote included (its keys written anew, found by the copy inside it).
        let fresh = alone.request.body.parts.as_ref().unwrap();
        assert_eq!(parts.units, fresh.units);
        assert!(parts.units.iter().all(|u| sent_units.contains(&u.2)));
        let rebuilt = layout::join(
            &parts.skeleton.0,
            parts.units.iter().map(|(o, u, _)| (*o, &u[..])),
        );
        assert_eq!(rebuilt, c.request.body.bytes);
        assert_eq!(c.request.body.bytes, alone.request.body.bytes);
        assert_eq!(c.request.body.digest, alone.request.body.digest);
        assert_eq!(c.redactions, alone.redactions);
        assert!(!String::from_utf8_lossy(&c.request.body.bytes).contains("hunter2"));
    }

    /// A long value rules rewrote is not copied: in the body received it is a unit of
    /// its own (stored once by its digest), not part of every turn's skeleton.
    #[test]
    fn a_long_value_rules_rewrote_is_a_unit_of_the_body_received() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let long = "work in /home/alice/src and keep it tidy. ".repeat(40);
        let body = Bytes::from(format!(
            r#"{{"model":"claude-x","system":[{{"type":"text","text":"{long}"}}],"messages":[{{"role":"user","content":[{{"type":"text","text":"hello there"}}]}}],"max_tokens":5}}"#
        ));
        let mut r = exchange();
        r.set_request_body(body.clone(), body.clone());
        let sent = derive_with(
            &r,
            &body,
            r#"
[[rule]]
name = "scrub"
on = "before_provider_request"
actions = [ { system.replace = { regex = "/home/[a-z]+/", with = "~/" } } ]
"#,
        );
        assert!(!String::from_utf8_lossy(sent.body()).contains("/home/alice/"));
        r.set_sent_cell(sent);
        let c = CaptureRecord::redacted(&r, &redactor);
        let parts = c.request.body.parts.as_ref().unwrap();
        assert!(!String::from_utf8_lossy(&parts.skeleton.0).contains("/home/alice/"));
        assert!(
            parts
                .units
                .iter()
                .any(|(_, u, _)| String::from_utf8_lossy(u).contains("/home/alice/"))
        );
        assert_eq!(c.request.body.bytes, body);
        assert_eq!(c.received_digest, digest::content_hex(&body));
    }

    /// Copies taken from a payload a hook replaced are not copies of the body
    /// received: a received body of the same length, one word changed, is stored as
    /// it came, and the body sent is not dried against it.
    #[test]
    fn copies_from_another_payload_lend_nothing_to_the_body_received() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let replaced = sent_body();
        let received =
            Bytes::from(String::from_utf8_lossy(&replaced).replace("one DB_", "uno DB_"));
        let mut r = exchange();
        r.set_request_body(replaced.clone(), replaced.clone());
        let derived = derive(&r, &replaced);
        r.set_request_body(received.clone(), received.clone());
        r.set_sent_cell(derived);
        let stored = CaptureRecord::redacted(&r, &redactor);
        let text = String::from_utf8_lossy(&stored.request.body.bytes);
        assert!(text.contains("uno DB_"), "{text}");
        r.dry_sent();
        assert!(!r.sent_body.is_empty(), "not dried against another body");
    }

    #[test]
    fn cached_units_store_what_a_fresh_cache_stores() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let mut r = exchange();
        // What a rule sends: the received message, one top-level key added.
        r.set_sent(Prompt::read(Bytes::from_static(br#"{"messages":[{"role":"user","content":"ticket internal-4242 and sk-ant-api03-RECORDSECRET0123456789"}],"max_tokens":5}"#), r.prompt.get().format()));
        let fresh = CaptureRecord::redacted(&r, &redactor);
        let sent = fresh.request.sent_body.as_ref().unwrap();
        let parts = sent.parts.as_ref().unwrap();
        assert_eq!(parts.skeleton.1, digest::content(&parts.skeleton.0));
        for (_, unit, hash) in &parts.units {
            assert_eq!(*hash, digest::content(unit));
        }
        assert_eq!(fresh.sent_digest, digest::content_hex(&r.sent_body));
        assert_eq!(fresh.received_digest, digest::content_hex(&r.request_body));
        // A warm cache, and one too small to keep anything.
        for limit in [1 << 20, 64] {
            let mut cache = UnitCache::with_limit(limit);
            for _ in 0..3 {
                let c = CaptureRecord::redacted_with(&r, &redactor, &mut cache);
                assert_eq!(c.request.body.parts, fresh.request.body.parts);
                assert_eq!(c.request.body.digest, fresh.request.body.digest);
                assert_eq!(c.request.body.bytes, fresh.request.body.bytes);
                let got = c.request.sent_body.as_ref().unwrap();
                assert_eq!((&got.parts, &got.bytes), (&sent.parts, &sent.bytes));
                assert_eq!(c.redactions, fresh.redactions);
            }
        }
    }

    /// A request sent again byte for byte (in other memory) takes what was stored for
    /// it, digests and redaction counts included; one byte changed, it does not.
    #[test]
    fn a_request_sent_again_byte_for_byte_stores_what_it_stored() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let record = |body: Bytes| {
            let mut r = exchange();
            r.set_request_body(body.clone(), body.clone());
            let sent = derive(&r, &body);
            r.set_sent_cell(sent);
            r
        };
        let body = sent_body();
        let mut cache = UnitCache::default();
        let first = CaptureRecord::redacted_with(&record(body.clone()), &redactor, &mut cache);
        let parts = |c: &CaptureRecord| {
            let sent = c.request.sent_body.as_ref().unwrap();
            (
                c.request.body.parts.clone().unwrap(),
                sent.parts.clone().unwrap(),
            )
        };
        let again = record(Bytes::copy_from_slice(&body));
        let second = CaptureRecord::redacted_with(&again, &redactor, &mut cache);
        let (a, b) = (parts(&first), parts(&second));
        assert!(std::sync::Arc::ptr_eq(&a.0, &b.0) && std::sync::Arc::ptr_eq(&a.1, &b.1));
        let fresh = CaptureRecord::redacted(&again, &redactor);
        assert_eq!(
            second.received_digest,
            digest::content_hex(&again.request_body)
        );
        assert_eq!(second.sent_digest, digest::content_hex(&again.sent_body));
        assert_eq!(second.redactions, fresh.redactions);
        assert!(!second.redactions.is_empty(), "{:?}", second.redactions);
        assert_eq!(second.request.body.bytes, fresh.request.body.bytes);
        let sent = |c: &CaptureRecord| c.request.sent_body.as_ref().unwrap().bytes.clone();
        assert_eq!(sent(&second), sent(&fresh));
        // The same length, one byte apart.
        let mut other = body.to_vec();
        let at = body.iter().rposition(|&b| b == b'l').expect("lorem");
        other[at] = b'x';
        let changed = record(Bytes::from(other));
        let third = CaptureRecord::redacted_with(&changed, &redactor, &mut cache);
        assert!(!std::sync::Arc::ptr_eq(&a.0, &parts(&third).0));
        assert_eq!(
            third.received_digest,
            digest::content_hex(&changed.request_body)
        );
        assert_ne!(third.received_digest, first.received_digest);
        assert_eq!(
            third.request.body.bytes,
            CaptureRecord::redacted(&changed, &redactor)
                .request
                .body
                .bytes
        );
    }

    /// A body received again byte for byte but sent otherwise (rules that wrote other
    /// bytes of the same length, or none) takes nothing stored for the first: what
    /// proves a body sent the same is the bytes the rules wrote, compared.
    #[test]
    fn a_body_received_again_but_written_otherwise_is_not_taken_as_stored() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let rules = |text: &str| {
            format!(
                "[[rule]]\nname = \"preamble\"\non = \"before_provider_request\"\n\
                 actions = [ {{ system.prepend = {{ text = \"{text}\" }} }} ]\n"
            )
        };
        let record = |text: Option<&str>| {
            let body = Bytes::copy_from_slice(&sent_body());
            let mut r = exchange();
            r.set_request_body(body.clone(), body.clone());
            if let Some(text) = text {
                let sent = derive_with(&r, &body, &rules(text));
                r.set_sent_cell(sent);
            }
            r
        };
        let mut cache = UnitCache::default();
        let sent_of = |c: &CaptureRecord| c.request.sent_body.as_ref().map(|s| s.bytes.clone());
        let mut seen = Vec::new();
        for text in [Some("policy"), Some("POLICY"), Some("policy"), None] {
            let r = record(text);
            let c = CaptureRecord::redacted_with(&r, &redactor, &mut cache);
            let fresh = CaptureRecord::redacted(&r, &redactor);
            assert_eq!(c.sent_digest, digest::content_hex(&r.sent_body), "{text:?}");
            assert_eq!(sent_of(&c), sent_of(&fresh), "{text:?}");
            if let Some(text) = text {
                let sent = String::from_utf8_lossy(&r.sent_body).into_owned();
                assert!(sent.contains(text), "{sent}");
            }
            seen.push(c.sent_digest);
        }
        assert_ne!(seen[0], seen[1], "other bytes written, another digest");
        assert_eq!(seen[0], seen[2], "the same bytes written, the same digest");
        assert_ne!(seen[0], seen[3], "nothing written: the body received");
    }

    /// Each turn of a conversation is hashed by the blocks its last turn did not have
    /// where they stand, and its digests are still those of its own bytes, received
    /// and sent; the writer keeps one last turn per conversation, with its body sent
    /// when rules changed that before the place the turn parted from its last.
    #[test]
    fn each_turn_of_a_conversation_has_the_digests_of_its_own_bytes() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        // The rules prepend to the system prompt and change every breakpoint's ttl:
        // with the system prompt after the messages (as Claude Code sends it), their
        // first change is at the newest message's breakpoint, past where the turn
        // parted from its last; before the messages, at the body's start.
        let turn = |rounds: usize, conversation: &str, system_first: bool| {
            let messages: Vec<String> = (0..rounds)
                .map(|i| {
                    let text = format!("{conversation} round {i} ").repeat(4_000);
                    let marker = if i + 1 == rounds {
                        r#","cache_control":{"type":"ephemeral"}"#
                    } else {
                        ""
                    };
                    format!(
                        r#"{{"role":"user","content":[{{"type":"text","text":"{text}"{marker}}}]}},{{"role":"assistant","content":"ok {i}"}}"#
                    )
                })
                .collect();
            let system = r#""system":[{"type":"text","text":"be brief"}]"#;
            let messages = format!(r#""messages":[{}]"#, messages.join(","));
            let (first, second) = if system_first {
                (system, messages.as_str())
            } else {
                (messages.as_str(), system)
            };
            Bytes::from(format!(
                r#"{{"model":"claude-x",{first},{second},"max_tokens":5}}"#
            ))
        };
        let record = |body: Bytes, conversation: &str| {
            let mut r = exchange();
            r.conversation = crate::conversation::ConversationCell::known(conversation.into());
            r.set_request_body(body.clone(), body.clone());
            let sent = derive(&r, &body);
            r.set_sent_cell(sent);
            r
        };
        let mut cache = UnitCache::default();
        let turns = [
            (2, "a", false, true),
            (3, "a", false, false),
            (3, "b", false, true),
            (5, "a", false, false),
            (2, "c", true, true),
            (3, "c", true, true),
            (4, "c", true, true),
        ];
        for (rounds, conversation, system_first, sent_kept) in turns {
            let r = record(turn(rounds, conversation, system_first), conversation);
            assert!(
                r.request_body.len() > 4 * 16_384,
                "{}",
                r.request_body.len()
            );
            assert_ne!(r.sent_body, r.request_body);
            let c = CaptureRecord::redacted_with(&r, &redactor, &mut cache);
            assert_eq!(c.received_digest, digest::content_hex(&r.request_body));
            assert_eq!(c.sent_digest, digest::content_hex(&r.sent_body));
            let last = cache.last_turns.back().unwrap();
            assert_eq!(last.conversation, conversation);
            assert_eq!(last.received.body(), &r.request_body);
            assert_eq!(
                last.sent.as_ref().map(digest::Blocks::body),
                sent_kept.then_some(&r.sent_body),
                "{rounds} rounds of {conversation}"
            );
        }
        let kept: Vec<&str> = cache
            .last_turns
            .iter()
            .map(|t| t.conversation.as_str())
            .collect();
        assert_eq!(kept, ["b", "a", "c"]);
    }

    /// `warm`, a record made with a cache, stores what a record of `body` made with
    /// a fresh one stores, and no `secret`.
    fn assert_stored_as_fresh(
        warm: &CaptureRecord,
        body: Bytes,
        redactor: &Redactor,
        secret: &str,
        what: &str,
    ) {
        let mut unhashed = exchange();
        unhashed.set_request_body(body.clone(), body);
        assert_stored_as_alone(warm, &unhashed, redactor, secret, what);
    }

    /// `warm` stores what `alone` (the same exchange, unhashed) stores with a fresh
    /// cache, both bodies, and no `secret`.
    fn assert_stored_as_alone(
        warm: &CaptureRecord,
        alone: &ExchangeRecord,
        redactor: &Redactor,
        secret: &str,
        what: &str,
    ) {
        let fresh = CaptureRecord::redacted(alone, redactor);
        let sent = |c: &CaptureRecord| {
            c.request
                .sent_body
                .as_ref()
                .map(|b| (b.parts.clone(), b.bytes.clone()))
        };
        assert_eq!(warm.request.body.parts, fresh.request.body.parts, "{what}");
        assert_eq!(warm.request.body.bytes, fresh.request.body.bytes, "{what}");
        assert_eq!(sent(warm), sent(&fresh), "{what}");
        assert_eq!(warm.redactions, fresh.redactions, "{what}");
        assert!(
            !String::from_utf8_lossy(&warm.request.body.bytes).contains(secret),
            "{what}"
        );
    }

    /// Captures `body` as conversation "c"'s next turn, its units hashed as the cache
    /// stage hashes the body sent, and checks it stores what a fresh cache stores:
    /// how many units it took from its last turn by place.
    fn next_turn_by_place(
        cache: &mut UnitCache,
        body: Bytes,
        redactor: &Redactor,
        secret: &str,
        what: &str,
    ) -> usize {
        let mut r = exchange();
        r.conversation = crate::conversation::ConversationCell::known("c".into());
        r.set_request_body(body.clone(), body.clone());
        let prompt = r.prompt.get();
        for unit in prompt.units() {
            unit.hash(prompt.body());
        }
        let before = cache.placed_hits;
        let warm = CaptureRecord::redacted_with(&r, redactor, cache);
        let hits = cache.placed_hits - before;
        assert_stored_as_fresh(&warm, body, redactor, secret, what);
        hits
    }

    /// A conversation's next turn takes the units its last turn stored by place (the
    /// new round, the unit its breakpoint left and a unit with a secret are found
    /// the other ways): each turn stores what a fresh cache stores.
    #[test]
    fn a_turn_takes_its_last_turn_s_units_by_place_and_stores_what_a_fresh_cache_stores() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let turn = |rounds: usize| {
            let messages: Vec<String> = (0..rounds)
                .map(|i| {
                    let secret = if i == 1 { " sk-ant-api03-PLACESECRET0123456789" } else { "" };
                    let marker = if i + 1 == rounds {
                        r#","cache_control":{"type":"ephemeral"}"#
                    } else {
                        ""
                    };
                    format!(
                        r#"{{"role":"user","content":[{{"type":"text","text":"round {i}{secret}"{marker}}}]}},{{"role":"assistant","content":"ok {i}"}}"#
                    )
                })
                .collect();
            Bytes::from(format!(
                r#"{{"model":"m","messages":[{}],"system":[{{"type":"text","text":"be brief"}},{{"type":"text","text":"and kind"}}],"max_tokens":5}}"#,
                messages.join(",")
            ))
        };
        let mut cache = UnitCache::default();
        let hits: Vec<usize> = (2..=5)
            .map(|rounds| {
                let what = format!("{rounds} rounds");
                next_turn_by_place(&mut cache, turn(rounds), &redactor, "PLACESECRET", &what)
            })
            .collect();
        // The first turn has no last turn; each later one finds by place the units the
        // turn before kept by their span digest: the first round's block, the rounds
        // after the secret's but the last (it had the marker), and the two system
        // blocks past the new round. The secret's block, the marked one and the
        // assistants' strings (found by their bytes) are found the other ways.
        assert_eq!(hits, [0, 3, 3, 4]);
    }

    /// A turn that dropped more of its oldest rounds than the by-place look reaches
    /// takes the units that stayed by place too, and stores what a fresh cache stores.
    #[test]
    fn a_turn_that_dropped_its_oldest_rounds_takes_the_rest_by_place() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let turn = |rounds: std::ops::Range<usize>| {
            let last = rounds.end - 1;
            let messages: Vec<String> = rounds
                .map(|i| {
                    let marker = if i == last {
                        r#","cache_control":{"type":"ephemeral"}"#
                    } else {
                        ""
                    };
                    format!(
                        r#"{{"role":"user","content":[{{"type":"text","text":"round {i}"{marker}}}]}},{{"role":"assistant","content":[{{"type":"text","text":"ok {i}"}}]}}"#
                    )
                })
                .collect();
            Bytes::from(format!(
                r#"{{"model":"m","system":[{{"type":"text","text":"be brief"}}],"messages":[{}],"max_tokens":5}}"#,
                messages.join(",")
            ))
        };
        let mut cache = UnitCache::default();
        let hits: Vec<usize> = [0..14, 10..15]
            .into_iter()
            .map(|rounds| {
                let what = format!("{rounds:?}");
                next_turn_by_place(&mut cache, turn(rounds), &redactor, "NOSECRET", &what)
            })
            .collect();
        // The system block, then rounds 10 to 13 but the one that carried the
        // breakpoint (its user block): 1 + 4 + 3.
        assert_eq!(hits, [0, 8]);
    }

    /// Units the cache stage hashed are found by that digest, unread; a block that
    /// carried the breakpoint a turn ago (no span digest then) is found by its bytes.
    /// Either way each turn stores what a fresh cache and an unhashed model store.
    #[test]
    fn units_found_by_their_span_digest_store_what_a_fresh_cache_stores() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let result = |id: u32, marked: bool| {
            let marker = if marked {
                r#","cache_control":{"type":"ephemeral"}"#
            } else {
                ""
            };
            format!(
                r#"{{"type":"tool_result","tool_use_id":"t{id}","content":"out {id} sk-ant-api03-UNITSECRET0123456789"{marker}}}"#
            )
        };
        let turn = |n: u32| {
            let blocks: Vec<String> = (1..=n).map(|i| result(i, i == n)).collect();
            Bytes::from(format!(
                r#"{{"model":"m","system":[{{"type":"text","text":"be brief"}}],"messages":[{{"role":"user","content":[{}]}}],"max_tokens":5}}"#,
                blocks.join(",")
            ))
        };
        let mut cache = UnitCache::default();
        for n in 1..=3 {
            let body = turn(n);
            let mut hashed = exchange();
            hashed.set_request_body(body.clone(), body.clone());
            let prompt = hashed.prompt.get();
            // What the cache stage does to the body sent.
            for unit in prompt.units() {
                unit.hash(prompt.body());
            }
            let warm = CaptureRecord::redacted_with(&hashed, &redactor, &mut cache);
            assert_stored_as_fresh(&warm, body, &redactor, "UNITSECRET", &format!("turn {n}"));
        }
        // The system block and the two blocks that lost their breakpoint are kept by
        // digest, each sharing the memory of the unit first kept by its bytes.
        let by_digest: Vec<&CachedUnit> = cache
            .current
            .iter()
            .filter(|(k, _)| matches!(k, UnitKey::Span(_)))
            .map(|(_, u)| u)
            .collect();
        assert_eq!(by_digest.len(), 3, "{by_digest:?}");
        for unit in by_digest {
            let twin = cache
                .current
                .iter()
                .find(|(k, u)| matches!(k, UnitKey::Bytes(_)) && u.sent == unit.sent)
                .map(|(_, u)| u)
                .expect("kept by its bytes too");
            assert_eq!(twin.stored.as_ptr(), unit.stored.as_ptr());
        }
    }

    #[test]
    fn rule_patterns_and_secret_headers_apply_per_exchange() {
        let mut r = exchange();
        r.extra_redactions = vec![regex::Regex::new(r"internal-\d+").unwrap()];
        r.secret_headers = vec![http::HeaderName::from_static("x-team-secret")];
        let redactor = Redactor::new(&[], &[]).unwrap();
        let c = CaptureRecord::redacted(&r, &redactor);
        let body = std::str::from_utf8(&c.request.body.bytes).unwrap();
        assert!(
            body.contains("ticket [REDACTED:rule:") && !body.contains("4242"),
            "{body}"
        );
        assert!(!body.contains("RECORDSECRET"));
        let header = |name: &str| {
            c.request
                .headers
                .iter()
                .find(|(k, _)| k == name)
                .unwrap()
                .1
                .clone()
        };
        assert!(header("x-team-secret").starts_with("[REDACTED:x-team-secret:"));
        assert!(
            c.path
                .starts_with("/v1/messages?key=[REDACTED:query-secret:")
        );
        assert_eq!(
            c.redactions["anthropic"], 2,
            "header and body, sent copies not counted twice"
        );
        assert_eq!(c.received_digest, digest::content_hex(&r.request_body));
        assert!(c.request.sent_body.is_none(), "sent = received");
    }

    #[test]
    fn unit_by_unit_redaction_equals_whole_body_redaction() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let bodies = [
            r#"{"model":"m","messages":[{"role":"user","content":"DB_PASSWORD=hunter2hunter2"},{"role":"assistant","content":"ok"}],"system":[{"type":"text","text":"key sk-ant-api03-UNITSECRET0123456789"}],"tools":[{"name":"t"}]}"#,
            r#"{"api_key":"sk-ant-api03-SKELETONSECRET0123","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"messages":[{"role":"user","content":"nothing here"}],"max_tokens":5}"#,
            r#"not json sk-ant-api03-PLAINSECRET0123456"#,
        ];
        let mut cache = UnitCache::default();
        for round in 0..2 {
            for body in bodies {
                let body = Bytes::from(body);
                let mut whole = Summary::new();
                let expected = redactor.redact(&body, &[], &mut whole).into_owned();
                let mut units = Summary::new();
                let prompt =
                    Prompt::read(body.clone(), Some(crate::prompt::Format::AnthropicMessages));
                let split = layout::split(&prompt);
                let got = match cache.redact(
                    &body,
                    split,
                    &prompt,
                    &mut Vec::new(),
                    &mut Placing::default(),
                    &[],
                    &redactor,
                    &[],
                    &mut units,
                ) {
                    Redacted::Same(parts) => {
                        let joined = layout::join(
                            &parts.skeleton.0,
                            parts.units.iter().map(|(o, u, _)| (*o, &u[..])),
                        );
                        assert_eq!(joined, body, "parts rebuild the body");
                        body.to_vec()
                    }
                    Redacted::Cut(bytes, parts) => {
                        for (_, unit, hash) in &parts.units {
                            assert_eq!(
                                *hash,
                                digest::content(unit),
                                "each part carries its own hash"
                            );
                        }
                        bytes.to_vec()
                    }
                    Redacted::Whole(bytes) => bytes.to_vec(),
                };
                assert_eq!(
                    got,
                    expected,
                    "round {round}: {}",
                    String::from_utf8_lossy(&body)
                );
                assert_eq!(units, whole, "the same counts, cached or not");
            }
        }
    }

    #[test]
    fn capture_off_keeps_no_headers_or_bodies() {
        let mut r = exchange();
        r.capture = false;
        let redactor = Redactor::new(&[], &[]).unwrap();
        let c = CaptureRecord::redacted(&r, &redactor);
        assert!(!c.captured);
        assert!(c.request.headers.is_empty() && c.request.body.bytes.is_empty());
        assert_eq!(
            c.received_digest,
            digest::content_hex(&r.request_body),
            "the hash still proves what came"
        );
    }

    /// How a generated turn's message block is written: the same value in three
    /// spellings (key order, spacing), a breakpoint, a secret.
    #[derive(Debug, Clone)]
    struct Block {
        text: String,
        spelling: u8,
        marked: bool,
        secret: bool,
    }

    impl Block {
        fn json(&self) -> String {
            let secret = if self.secret {
                " sk-ant-api03-GENSECRET0123456789"
            } else {
                ""
            };
            let text = format!("{}{secret}", self.text);
            let marker = if self.marked {
                r#","cache_control":{"type":"ephemeral"}"#
            } else {
                ""
            };
            match self.spelling % 3 {
                0 => format!(r#"{{"type":"text","text":"{text}"{marker}}}"#),
                1 => format!(r#"{{"text":"{text}","type":"text"{marker}}}"#),
                _ => format!(r#"{{ "type": "text", "text": "{text}"{marker} }}"#),
            }
        }
    }

    fn body_of(blocks: &[Block]) -> Bytes {
        let messages: Vec<String> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                format!(r#"{{"role":"{role}","content":[{}]}}"#, b.json())
            })
            .collect();
        Bytes::from(format!(
            r#"{{"model":"m","system":[{{"type":"text","text":"be brief"}}],"messages":[{}],"max_tokens":5}}"#,
            messages.join(",")
        ))
    }

    use crate::cache::segment;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(
            std::env::var("PROMPTGATE_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(128)
        ))]

        /// A conversation's turns, each analysed for the cache as the record pipeline
        /// does (which lends digests to the prompt's units) and then captured with the
        /// writer's warm cache, with or without rules writing the body sent, each turn
        /// read on its own or continuing the last (its tape and units lent): whatever
        /// the turns do (grow, respell a block, move or add a breakpoint, resend, drop
        /// the oldest round, carry a secret), each stores what the same exchange
        /// stores captured alone, unanalysed.
        #[test]
        fn analysed_turns_store_what_a_fresh_capture_stores(
            steps in proptest::collection::vec((0u8..6, 0usize..64, 0u8..3), 2..12),
            rules in proptest::bool::ANY,
            continued in proptest::bool::ANY,
        ) {
            let redactor = Redactor::new(&[], &[]).unwrap();
            let mut cache = UnitCache::default();
            let mut previous = None;
            let block = |i: usize| Block {
                text: format!("round {i} ").repeat(4),
                spelling: 0,
                marked: false,
                secret: false,
            };
            let mut blocks = vec![block(0), block(1)];
            let mut last = None;
            for (n, &(step, at, spelling)) in steps.iter().enumerate() {
                let k = at % blocks.len();
                match step {
                    0 => {
                        let i = blocks.len();
                        blocks.extend([block(i), block(i + 1)]);
                    }
                    1 => blocks[k].spelling = spelling,
                    2 => {} // the same body again
                    3 => blocks[k].marked = !blocks[k].marked,
                    // A context edit: the oldest round dropped, every later unit moved.
                    4 if blocks.len() > 2 => drop(blocks.drain(..2)),
                    _ => {
                        let mut b = block(blocks.len());
                        b.secret = true;
                        blocks.push(b);
                    }
                }
                let body = body_of(&blocks);
                let mut r = exchange();
                r.conversation = crate::conversation::ConversationCell::known("c".into());
                match last.take() {
                    // As a body received lately continues its last turn: its tape
                    // and units are taken from that turn's where the bytes are the same.
                    Some(last) if continued => {
                        let format = Some(crate::prompt::Format::AnthropicMessages);
                        let model = crate::prompt::PromptCell::continuing(body.clone(), format, last);
                        r.set_request_model(body.clone(), model);
                    }
                    _ => r.set_request_body(body.clone(), body.clone()),
                }
                last = Some(r.prompt.clone());
                if rules {
                    r.set_sent_cell(derive(&r, &body));
                }
                // What the cache stage analyses: the body sent, held as rules wrote it.
                let sent = r.sent_prompt.get();
                let cut_from = segment::CutFrom::of(sent, &r.request_body);
                let segments = segment::segment_from(sent, &[], previous.as_ref(), cut_from)
                    .expect("the body is a request");
                previous = Some(segments);
                let warm = CaptureRecord::redacted_with(&r, &redactor, &mut cache);
                let what = format!("turn {n} after {:?}", &steps[..=n]);
                // The same exchange, neither analysed nor captured after other turns.
                let mut fresh = exchange();
                fresh.set_request_body(body.clone(), body.clone());
                if rules {
                    fresh.set_sent_cell(derive(&fresh, &body));
                }
                assert_stored_as_alone(&warm, &fresh, &redactor, "GENSECRET", &what);
            }
        }
    }
}

//! OpenTelemetry traces: one span per exchange, sent to an OTLP/HTTP collector.
//!
//! Spans are made after the fact from the finished [`ExchangeRecord`] (its times,
//! usage, cache verdict and rules are all known then), on the record pipeline's
//! thread, and handed to [`export`], which batches them and posts them off the
//! request path. Attribute names are in [`semconv`]. Content (the prompt and the
//! answer) goes out only with `--otlp-content`, and only redacted.

pub(crate) mod export;
pub(crate) mod semconv;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::Uri;
use opentelemetry_proto::tonic::common::v1::{AnyValue, ArrayValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{Span, Status, span, status};
use serde::Deserialize;
use serde_json::{Value as Json, json};

use crate::prompt::{Prompt, Region};
use crate::provider::json::decode_str;
use crate::provider::{Api, Provider};
use crate::record::{ExchangeRecord, Outcome};
use crate::redact::{NAME_MAX, Redactor, Summary, TEXT_MAX, cut, url_without_password};
use crate::setting::{Scalar, parse_size};
use semconv::*;

/// `[traces]` in the config file, as written; the flags and `OTEL_*` fill it too.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracesLayer {
    /// The collector's OTLP/HTTP base URL: `/v1/traces` is added to it.
    pub endpoint: Option<String>,
    /// The whole URL spans are posted to, used as it is.
    pub url: Option<String>,
    /// Put the redacted prompt and answer on the spans.
    pub content: Option<bool>,
    /// `service.name` of the spans [default: promptgate].
    pub service_name: Option<String>,
    /// Spans waiting to be sent at most; past it new ones are dropped and counted.
    pub queue: Option<usize>,
    /// Bytes of spans the exporter may hold (queued or being posted); past it new
    /// ones are dropped and counted [default: 64MiB].
    pub queue_bytes: Option<Scalar>,
}

impl TracesLayer {
    /// The flags' layer: `--otlp-endpoint` (else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
    /// else `OTEL_EXPORTER_OTLP_ENDPOINT`), `--otlp-content`, `OTEL_SERVICE_NAME`.
    pub fn from_flags(
        endpoint: Option<String>,
        content: bool,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> TracesLayer {
        let env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let (endpoint, url) = match endpoint {
            Some(e) => (Some(e), None),
            None => match env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
                Some(url) => (None, Some(url)),
                None => (env("OTEL_EXPORTER_OTLP_ENDPOINT"), None),
            },
        };
        TracesLayer {
            endpoint,
            url,
            content: content.then_some(true),
            service_name: env("OTEL_SERVICE_NAME"),
            queue: None,
            queue_bytes: None,
        }
    }
}

/// The validated trace-export settings.
#[derive(Debug, Clone)]
pub struct TracesSettings {
    /// Where spans are posted; `None`: export is off.
    pub url: Option<Uri>,
    pub content: bool,
    pub service_name: String,
    pub queue: usize,
    /// The most bytes of spans held at once (queued, batched or being posted), by
    /// their encoded size: with `content` a span carries the whole prompt, so a
    /// count alone lets a hung collector cost gigabytes.
    pub queue_bytes: usize,
}

/// The default of [`TracesSettings::queue_bytes`].
pub(crate) const QUEUE_BYTES: usize = 64 << 20;

impl Default for TracesSettings {
    fn default() -> Self {
        TracesSettings {
            url: None,
            content: false,
            service_name: "promptgate".into(),
            queue: 2048,
            queue_bytes: QUEUE_BYTES,
        }
    }
}

/// Why a traces setting is refused (URLs shown without their password).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TracesError {
    #[error("{0:?} is not a URL: {1} (expected e.g. \"http://127.0.0.1:4318\")")]
    NotAUrl(String, String),
    #[error("{0:?} is not an http:// or https:// URL (expected e.g. \"http://127.0.0.1:4318\")")]
    NotHttp(String),
    #[error(
        "{0:?} has credentials in it; a collector that needs them belongs behind a local agent"
    )]
    Credentials(String),
    #[error("queue: expected at least 1 (e.g. 2048)")]
    EmptyQueue,
    #[error("queue_bytes: {0}")]
    QueueBytes(crate::setting::SettingError),
    #[error("queue_bytes: expected at least 1 byte (e.g. \"64MiB\")")]
    NoQueueBytes,
}

impl TracesSettings {
    /// Applies a layer; the error says which value is wrong and what was expected.
    pub fn apply(&mut self, layer: TracesLayer) -> Result<(), TracesError> {
        if let Some(url) = layer.url {
            self.url = Some(parse_url(&url, false)?);
        } else if let Some(base) = layer.endpoint {
            self.url = Some(parse_url(&base, true)?);
        }
        if let Some(c) = layer.content {
            self.content = c;
        }
        if let Some(name) = layer.service_name {
            self.service_name = name;
        }
        if let Some(q) = layer.queue {
            if q == 0 {
                return Err(TracesError::EmptyQueue);
            }
            self.queue = q;
        }
        if let Some(v) = layer.queue_bytes {
            let bytes = parse_size(&v).map_err(TracesError::QueueBytes)?;
            if bytes == 0 {
                return Err(TracesError::NoQueueBytes);
            }
            self.queue_bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        }
        Ok(())
    }
}

/// An http(s) URL; a base gets `/v1/traces` unless it already ends so.
fn parse_url(text: &str, base: bool) -> Result<Uri, TracesError> {
    let text = text.trim();
    // Messages show the URL without its password: they reach the terminal and logs.
    let shown = url_without_password(text);
    let uri: Uri = text.parse().map_err(|e: http::uri::InvalidUri| {
        TracesError::NotAUrl(shown.to_string(), e.to_string())
    })?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(TracesError::NotHttp(shown.to_string()));
    }
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(TracesError::Credentials(shown.to_string()));
    }
    if !base || uri.path().ends_with("/v1/traces") {
        return Ok(uri);
    }
    let joined = format!("{}/v1/traces", text.trim_end_matches('/'));
    joined
        .parse()
        .map_err(|e: http::uri::InvalidUri| TracesError::NotAUrl(joined.clone(), e.to_string()))
}

/// The longest `tracestate` passed on (W3C Trace Context: 512 characters).
const TRACESTATE_MAX: usize = 512;

/// What a span needs beyond its record.
pub(crate) struct SpanContext<'a> {
    pub redactor: &'a Redactor,
    pub content: bool,
}

/// The operation a request is, by the GenAI conventions; `None` for side requests.
fn operation(api: Option<Api>) -> Option<&'static str> {
    match api? {
        Api::Messages | Api::ChatCompletions | Api::Responses => Some("chat"),
        Api::CountTokens | Api::Other => None,
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn attribute(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

fn text(key: &str, value: impl Into<String>) -> KeyValue {
    attribute(key, any_value::Value::StringValue(value.into()))
}

fn int(key: &str, value: u64) -> KeyValue {
    attribute(
        key,
        any_value::Value::IntValue(i64::try_from(value).unwrap_or(i64::MAX)),
    )
}

fn float(key: &str, value: f64) -> KeyValue {
    attribute(key, any_value::Value::DoubleValue(value))
}

fn texts(key: &str, values: impl IntoIterator<Item = String>) -> KeyValue {
    let values = values
        .into_iter()
        .map(|v| AnyValue {
            value: Some(any_value::Value::StringValue(v)),
        })
        .collect();
    attribute(key, any_value::Value::ArrayValue(ArrayValue { values }))
}

/// The parent named by a W3C `traceparent`: (trace id, parent span id, flags).
pub(crate) fn parent(headers: &http::HeaderMap) -> Option<([u8; 16], [u8; 8], u8)> {
    let value = headers.get("traceparent")?.to_str().ok()?.trim();
    let mut parts = value.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || version.eq_ignore_ascii_case("ff") || trace.len() != 32 {
        return None;
    }
    // Version 00 has exactly four fields; later versions may add more.
    if version == "00" && parts.next().is_some() {
        return None;
    }
    let trace = u128::from_str_radix(trace, 16).ok()?;
    let span = u64::from_str_radix(span, 16)
        .ok()
        .filter(|_| span.len() == 16)?;
    let flags = u8::from_str_radix(flags, 16)
        .ok()
        .filter(|_| flags.len() == 2)?;
    if trace == 0 || span == 0 {
        return None;
    }
    Some((trace.to_be_bytes(), span.to_be_bytes(), flags))
}

/// The span of one finished exchange.
pub(crate) fn span_of(record: &ExchangeRecord, cx: &SpanContext<'_>) -> Span {
    let mut summary = Summary::default();
    let mut redact = |s: &str| {
        cx.redactor
            .redact_text(s, &record.extra_redactions, &mut summary)
    };
    let id = record.id.to_bytes();
    let (trace_id, parent_span_id, flags) = match parent(&record.request_headers) {
        Some((trace, span, flags)) => (trace.to_vec(), span.to_vec(), u32::from(flags)),
        // The exchange id is unique and 80 of its bits are random: a valid trace id.
        None => (id.to_vec(), Vec::new(), 1),
    };
    // A client's text, and every attribute naming something: redacted, then cut.
    let bounded = |s: &str, max: usize| cx.redactor.bounded(s, &record.extra_redactions, max);
    let trace_state = trace_state_of(record, &bounded);
    let op = operation(record.api);
    let model = record.model.as_deref().map(|m| bounded(m, NAME_MAX));
    let name = match (op, &model) {
        (Some(op), Some(model)) => format!("{op} {model}"),
        (Some(op), None) => op.to_owned(),
        _ => {
            let path = record.path.split('?').next().unwrap_or("");
            format!("{} {}", record.method, cut(&redact(path), TEXT_MAX))
        }
    };
    let start = nanos(record.started_at);
    let at = |d: Duration| start.saturating_add(u64::try_from(d.as_nanos()).unwrap_or(0));
    let mut attributes = vec![
        text(PROMPTGATE_EXCHANGE_ID, record.id.to_string()),
        text(PROMPTGATE_OUTCOME, record.outcome.name()),
        text(HTTP_REQUEST_METHOD, record.method.as_str()),
    ];
    if let Some(op) = op {
        attributes.push(text(GEN_AI_OPERATION_NAME, op));
    }
    if let Some(p) = record.provider {
        attributes.push(text(GEN_AI_PROVIDER_NAME, p.name()));
    }
    if let Some(m) = model {
        attributes.push(text(GEN_AI_REQUEST_MODEL, m));
    }
    upstream_attributes(record, &mut attributes);
    if let Some(status) = record.status {
        attributes.push(int(HTTP_RESPONSE_STATUS_CODE, u64::from(status.as_u16())));
    }
    if let Some(s) = record.observation.as_ref().map(|o| &o.summary) {
        response_attributes(s, &bounded, &mut attributes);
    }
    if let Some(c) = record.conversation.get() {
        attributes.push(text(GEN_AI_CONVERSATION_ID, bounded(c, NAME_MAX)));
    }
    if let Some(cache) = &record.cache {
        cache_attributes(cache, &bounded, &mut attributes);
    }
    if !record.rules_fired.is_empty() {
        attributes.push(texts(
            PROMPTGATE_RULES_FIRED,
            record.rules_fired.iter().cloned(),
        ));
    }
    let failed = !matches!(record.outcome, Outcome::Ok);
    if failed {
        attributes.push(text(ERROR_TYPE, error_type(record)));
    }
    if cx.content {
        content_attributes(record, &mut redact, &mut attributes);
    }
    // Each policy's turn, in order, at the request's start (before the upstream call).
    let mut events = policy_events(record, start, &bounded);
    events.extend(record.timing.first_byte.map(|d| span::Event {
        time_unix_nano: at(d),
        name: EVENT_FIRST_BYTE.into(),
        ..Default::default()
    }));
    let status = Status {
        code: if failed {
            status::StatusCode::Error as i32
        } else {
            status::StatusCode::Unset as i32
        },
        message: record
            .error
            .as_deref()
            .filter(|_| failed)
            .map(|e| cut(&redact(e), TEXT_MAX).into_owned())
            .unwrap_or_default(),
    };
    Span {
        trace_id,
        span_id: id[8..].to_vec(),
        trace_state,
        parent_span_id,
        flags,
        name,
        kind: span::SpanKind::Client as i32,
        start_time_unix_nano: start,
        end_time_unix_nano: at(record.timing.total),
        attributes,
        events,
        status: Some(status),
        ..Default::default()
    }
}

/// The client's `tracestate`, passed on only as sent and within W3C's 512
/// characters: a cut or redacted one would be a wrong one.
fn trace_state_of(record: &ExchangeRecord, bounded: &dyn Fn(&str, usize) -> String) -> String {
    record
        .request_headers
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.len() <= TRACESTATE_MAX && bounded(v, TRACESTATE_MAX) == *v)
        .map(str::to_owned)
        .unwrap_or_default()
}

/// What failed, as `error.type`: the provider's status, else the outcome.
fn error_type(record: &ExchangeRecord) -> String {
    match (record.outcome, record.status) {
        (Outcome::ProviderError, Some(s)) if !s.is_success() => s.as_u16().to_string(),
        (outcome, _) => outcome.name().to_owned(),
    }
}

/// The prompt and the answer themselves (`--traces-content`), redacted.
fn content_attributes(
    record: &ExchangeRecord,
    redact: &mut dyn FnMut(&str) -> String,
    attributes: &mut Vec<KeyValue>,
) {
    let prompt = record.sent_prompt.get();
    if let Some(system) = system_instructions(prompt) {
        attributes.push(text(GEN_AI_SYSTEM_INSTRUCTIONS, redact(&system)));
    }
    if let Some(input) = input_messages(prompt) {
        attributes.push(text(GEN_AI_INPUT_MESSAGES, redact(&input)));
    }
    if let Some(output) = output_messages(record) {
        attributes.push(text(GEN_AI_OUTPUT_MESSAGES, redact(&output)));
    }
}

/// A span event per policy turn, at the exchange's start.
fn policy_events(
    record: &ExchangeRecord,
    start: u64,
    bounded: &dyn Fn(&str, usize) -> String,
) -> Vec<span::Event> {
    record
        .policy_runs
        .iter()
        .map(|run| span::Event {
            time_unix_nano: start,
            name: EVENT_POLICY.into(),
            attributes: vec![
                text(PROMPTGATE_POLICY, bounded(&run.policy, NAME_MAX)),
                text(PROMPTGATE_POLICY_PHASE, run.phase.name()),
                text(PROMPTGATE_POLICY_DECISION, bounded(&run.decision, TEXT_MAX)),
                int(PROMPTGATE_POLICY_MICROS, run.took_us),
            ],
            ..Default::default()
        })
        .collect()
}

/// The upstream's address and port, from the URL the exchange went to.
fn upstream_attributes(record: &ExchangeRecord, attributes: &mut Vec<KeyValue>) {
    if let Some(url) = record
        .upstream_url
        .as_deref()
        .and_then(|u| u.parse::<Uri>().ok())
    {
        if let Some(host) = url.host() {
            attributes.push(text(SERVER_ADDRESS, host));
        }
        let port = url
            .port_u16()
            .unwrap_or(if url.scheme_str() == Some("http") {
                80
            } else {
                443
            });
        attributes.push(int(SERVER_PORT, u64::from(port)));
    }
}

/// What the answer said: its model, id, finish reason and usage.
fn response_attributes(
    s: &crate::provider::ResponseSummary,
    bounded: &dyn Fn(&str, usize) -> String,
    attributes: &mut Vec<KeyValue>,
) {
    if let Some(m) = &s.model {
        attributes.push(text(GEN_AI_RESPONSE_MODEL, bounded(m, NAME_MAX)));
    }
    if let Some(id) = &s.response_id {
        attributes.push(text(GEN_AI_RESPONSE_ID, bounded(id, NAME_MAX)));
    }
    if let Some(reason) = &s.stop_reason {
        attributes.push(texts(
            GEN_AI_RESPONSE_FINISH_REASONS,
            [bounded(reason, NAME_MAX)],
        ));
    }
    if let Some(u) = &s.usage {
        attributes.push(int(GEN_AI_USAGE_INPUT_TOKENS, u.total_input()));
        attributes.push(int(GEN_AI_USAGE_OUTPUT_TOKENS, u.output_tokens));
        attributes.push(int(
            GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
            u.cache_read_tokens,
        ));
        attributes.push(int(
            GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS,
            u.cache_write_tokens,
        ));
    }
}

/// The cache analysis' verdict, reason, first changed unit and the dollars lost.
fn cache_attributes(
    cache: &crate::cache::CacheReport,
    bounded: &dyn Fn(&str, usize) -> String,
    attributes: &mut Vec<KeyValue>,
) {
    attributes.push(text(PROMPTGATE_CACHE_VERDICT, cache.verdict.name()));
    if let Some(reason) = &cache.reason {
        attributes.push(text(PROMPTGATE_CACHE_REASON, reason.name()));
    }
    let changed = match &cache.reason {
        Some(crate::cache::explain::Reason::PrefixChanged { unit, .. }) => Some(unit.clone()),
        _ => cache.stable.as_ref().and_then(|s| s.changed_at.clone()),
    };
    if let Some(unit) = changed {
        attributes.push(text(
            PROMPTGATE_CACHE_FIRST_CHANGED_UNIT,
            bounded(&unit, TEXT_MAX),
        ));
    }
    if let Some(cost) = &cache.cost {
        attributes.push(float(PROMPTGATE_CACHE_LOST_DOLLARS, cost.usd.lost_usd));
    }
}

/// A JSON string of the unit's text, when it has one.
fn unit_text(prompt: &Prompt, unit: &crate::prompt::Unit) -> Option<String> {
    let span = unit.text.or(unit.content)?;
    let raw = prompt.body().get(span.start..span.end)?;
    match decode_str(raw) {
        Some(text) => Some(text.into_owned()),
        // Tool results may hold an array of blocks: their JSON as written.
        None => Some(String::from_utf8_lossy(raw).into_owned()),
    }
}

/// One content unit as a GenAI message part.
fn part(prompt: &Prompt, unit: &crate::prompt::Unit) -> Json {
    let block = || {
        prompt
            .body()
            .get(unit.span.start..unit.span.end)
            .and_then(|b| serde_json::from_slice::<Json>(b).ok())
            .unwrap_or(Json::Null)
    };
    match &*unit.kind {
        "tool_use" | "function_call" => {
            let b = block();
            json!({
                "type": "tool_call",
                "id": b.get("id").or_else(|| b.get("call_id")),
                "name": b.get("name"),
                "arguments": b.get("input").or_else(|| b.get("arguments")),
            })
        }
        "tool_result" | "function_call_output" => {
            let b = block();
            json!({
                "type": "tool_call_response",
                "id": b.get("tool_use_id").or_else(|| b.get("call_id")),
                "response": unit_text(prompt, unit).map(Json::from).or_else(|| b.get("output").cloned()),
            })
        }
        kind => match unit_text(prompt, unit) {
            Some(content) if unit.text.is_some() => json!({"type": "text", "content": content}),
            _ => json!({"type": kind}),
        },
    }
}

/// The system prompt (Anthropic `system`, OpenAI `instructions`) as GenAI parts.
fn system_instructions(prompt: &Prompt) -> Option<String> {
    let parts: Vec<Json> = prompt
        .units()
        .iter()
        .filter(|u| matches!(u.path.region, Region::System | Region::Instructions))
        .map(|u| part(prompt, u))
        .collect();
    (!parts.is_empty()).then(|| Json::Array(parts).to_string())
}

/// The messages (or input items) as GenAI input messages.
fn input_messages(prompt: &Prompt) -> Option<String> {
    let messages: Vec<Json> = prompt
        .messages()
        .iter()
        .map(|m| {
            let role = prompt
                .value(m.tok)
                .and_then(|v| v.get("role"))
                .and_then(|r| r.str())
                .map_or_else(|| "user".to_owned(), |r| r.into_owned());
            let parts: Vec<Json> = prompt
                .units()
                .get(m.units.clone())
                .unwrap_or_default()
                .iter()
                .map(|u| part(prompt, u))
                .collect();
            json!({"role": role, "parts": parts})
        })
        .collect();
    (!messages.is_empty()).then(|| Json::Array(messages).to_string())
}

/// The answer as GenAI output messages: the reassembled stream, or the JSON body.
fn output_messages(record: &ExchangeRecord) -> Option<String> {
    let observation = record.observation.as_ref()?;
    let message = match &observation.summary.message {
        Some(m) => m.clone(),
        None => serde_json::from_slice::<Json>(&observation.body).ok()?,
    };
    let finish = observation.summary.stop_reason.clone();
    let parts_of = |content: &Json| -> Vec<Json> {
        match content {
            Json::String(s) => vec![json!({"type": "text", "content": s})],
            Json::Array(blocks) => blocks
                .iter()
                .map(|b| match b.get("type").and_then(Json::as_str) {
                    Some("text" | "output_text") => {
                        json!({"type": "text", "content": b.get("text")})
                    }
                    Some("thinking") => json!({"type": "reasoning", "content": b.get("thinking")}),
                    Some("tool_use") => json!({
                        "type": "tool_call", "id": b.get("id"), "name": b.get("name"),
                        "arguments": b.get("input"),
                    }),
                    Some(other) => json!({"type": other}),
                    None => json!({"type": "unknown"}),
                })
                .collect(),
            _ => Vec::new(),
        }
    };
    let messages: Vec<Json> = match record.provider {
        Some(Provider::Anthropic) => vec![json!({
            "role": "assistant",
            "parts": parts_of(message.get("content").unwrap_or(&Json::Null)),
            "finish_reason": finish,
        })],
        Some(Provider::OpenAi) => {
            if let Some(choices) = message.get("choices").and_then(Json::as_array) {
                choices
                    .iter()
                    .map(|c| {
                        let m = c.get("message").unwrap_or(&Json::Null);
                        json!({
                            "role": m.get("role").and_then(Json::as_str).unwrap_or("assistant"),
                            "parts": parts_of(m.get("content").unwrap_or(&Json::Null)),
                            "finish_reason": c.get("finish_reason"),
                        })
                    })
                    .collect()
            } else {
                message
                    .get("output")
                    .and_then(Json::as_array)
                    .into_iter()
                    .flatten()
                    .filter(|item| item.get("type").and_then(Json::as_str) == Some("message"))
                    .map(|item| {
                        json!({
                            "role": item.get("role").and_then(Json::as_str).unwrap_or("assistant"),
                            "parts": parts_of(item.get("content").unwrap_or(&Json::Null)),
                            "finish_reason": finish,
                        })
                    })
                    .collect()
            }
        }
        None => return None,
    };
    (!messages.is_empty()).then(|| Json::Array(messages).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_policy_turn_is_an_event_with_its_decision_redacted() {
        let mut record = ExchangeRecord::begin(
            crate::id::ExchangeId::new(),
            None,
            http::Method::POST,
            "/v1/messages".into(),
        );
        record.policy_runs.push(crate::policy::PolicyRun {
            policy: "entitlement".into(),
            phase: crate::policy::Phase::BeforeProviderRequest,
            decision: "error: the answer said sk-ant-api03-SPANSECRET0123456789 (allowed)".into(),
            took_us: 1234,
        });
        let redactor = Redactor::new(&[], &[]).unwrap();
        let cx = SpanContext {
            redactor: &redactor,
            content: false,
        };
        let span = span_of(&record, &cx);
        let event = span
            .events
            .iter()
            .find(|e| e.name == EVENT_POLICY)
            .expect("the policy's turn is an event");
        let value = |key: &str| {
            event
                .attributes
                .iter()
                .find(|a| a.key == key)
                .and_then(|a| a.value.clone())
                .and_then(|v| v.value)
        };
        assert_eq!(
            value(PROMPTGATE_POLICY),
            Some(any_value::Value::StringValue("entitlement".into()))
        );
        assert_eq!(
            value(PROMPTGATE_POLICY_MICROS),
            Some(any_value::Value::IntValue(1234))
        );
        let Some(any_value::Value::StringValue(decision)) = value(PROMPTGATE_POLICY_DECISION)
        else {
            panic!("a decision");
        };
        assert!(decision.starts_with("error: "), "{decision}");
        assert!(!decision.contains("SPANSECRET"), "{decision}");
    }

    #[test]
    fn a_traceparent_names_the_parent_and_a_bad_one_is_ignored() {
        let mut h = http::HeaderMap::new();
        h.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let (trace, span, flags) = parent(&h).unwrap();
        assert_eq!(trace[0], 0x4b);
        assert_eq!(span[7], 0xb7);
        assert_eq!(flags, 1);
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "garbage",
        ] {
            h.insert("traceparent", bad.parse().unwrap());
            assert!(parent(&h).is_none(), "{bad}");
        }
    }

    #[test]
    fn endpoints_resolve_as_the_otlp_variables_do() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let url = |layer: TracesLayer| {
            let mut s = TracesSettings::default();
            s.apply(layer).map(|()| s.url.map(|u| u.to_string()))
        };
        let base = env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")]);
        assert_eq!(
            url(TracesLayer::from_flags(None, false, &base)).unwrap(),
            Some("http://c:4318/v1/traces".into())
        );
        let both = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:9/custom"),
        ]);
        assert_eq!(
            url(TracesLayer::from_flags(None, false, &both)).unwrap(),
            Some("http://t:9/custom".into()),
            "the traces variable is used as it is"
        );
        assert_eq!(
            url(TracesLayer::from_flags(
                Some("http://f:1/v1/traces".into()),
                false,
                &both
            ))
            .unwrap(),
            Some("http://f:1/v1/traces".into()),
            "the flag wins"
        );
        assert_eq!(
            url(TracesLayer::from_flags(None, false, &env(&[]))).unwrap(),
            None
        );
        for bad in ["ftp://c", "c:4318", "http://user:pw@c:4318"] {
            let layer = TracesLayer {
                endpoint: Some(bad.into()),
                ..TracesLayer::default()
            };
            assert!(url(layer).is_err(), "{bad}");
        }
    }
}

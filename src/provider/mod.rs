//! What differs between providers: which paths go where, what an error looks
//! like, how a response stream is read and where usage hides in it.
//!
//! Nothing here does IO; the exchange and the observer call in with bytes.

pub(crate) mod anthropic;
pub mod json;
pub(crate) mod openai;
pub(crate) mod price;
pub(crate) mod sniff;
pub(crate) mod sse;
mod usage;

use http::uri::PathAndQuery;
use serde_json::json;
pub(crate) use sse::{EventSplitter, SseDecoder};

pub(crate) use sniff::{asks_to_stream, sniff};
// The structural scanners, for reading inside JSON already known to be valid.
pub(crate) use usage::AnthropicUsage;
pub use usage::Usage;

use serde_json::Value;

/// What a response body says, read by the provider's grammar.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ResponseSummary {
    /// The model that answered, as the provider reports it.
    pub model: Option<String>,
    /// The provider's id for the response (`msg_…`, `chatcmpl-…`, `resp_…`).
    pub response_id: Option<String>,
    /// Why generation stopped (`end_turn`, `tool_use`, `stop`, `completed`, …).
    pub stop_reason: Option<String>,
    /// Token usage, when the body carried it.
    pub usage: Option<Usage>,
    /// The message reassembled from a stream, when a record sink reads it
    /// ([`crate::record::RecordSink::reads_message`]). (A JSON body is itself the
    /// message: see `Observation::body`.)
    pub message: Option<Value>,
    /// Number of SSE events read (0 for a JSON body).
    pub events: u32,
    /// A stream's terminal event arrived (`message_stop`, `[DONE]`, `response.completed`).
    pub complete: bool,
    /// An error the provider reported: an error body, or an error event mid-stream.
    pub provider_error: Option<String>,
    /// The provider's own reason for a cache miss, when the answer carries one.
    pub diagnosis: Option<CacheDiagnosis>,
}

/// A provider's word, kept whole only when it is word-sized: it is upstream text.
fn short(word: &str) -> String {
    crate::redact::cut(word, crate::redact::NAME_MAX).into_owned()
}

/// A provider's own diagnosis of a cache miss: Anthropic's
/// `diagnostics.cache_miss_reason` (beta `cache-diagnosis-2026-04-07`), OpenAI's
/// Responses `prompt_cache_diagnostics`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheDiagnosis {
    /// The provider's reason as it spells it (`system_changed`, `model_changed`, …).
    pub reason: String,
    /// The input tokens it says the miss cost, when it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missed_tokens: Option<u64>,
}

impl CacheDiagnosis {
    /// Reads Anthropic's `diagnostics` object (`null` while the check is pending).
    pub fn from_anthropic(diagnostics: &Value) -> Option<CacheDiagnosis> {
        let reason = diagnostics.get("cache_miss_reason")?;
        Some(CacheDiagnosis {
            reason: short(reason.get("type")?.as_str()?),
            missed_tokens: reason
                .get("cache_missed_input_tokens")
                .and_then(Value::as_u64),
        })
    }

    /// Reads OpenAI's `prompt_cache_diagnostics`, a union on `type`: `cache_miss`
    /// (with `reason` and `cache_missed_tokens`), `cache_hit`,
    /// `comparison_response_not_found`, `unavailable`; the outcomes without a reason
    /// are kept under their type, as Anthropic names its own (`unavailable`).
    pub fn from_openai(diagnostics: &Value) -> Option<CacheDiagnosis> {
        let kind = diagnostics.get("type").and_then(Value::as_str);
        let reason = match kind {
            Some("cache_miss") | None => diagnostics.get("reason")?.as_str()?,
            Some(other) => other,
        };
        Some(CacheDiagnosis {
            reason: short(reason),
            missed_tokens: diagnostics
                .get("cache_missed_tokens")
                .and_then(Value::as_u64),
        })
    }
}

/// Reads a stream of SSE events of one provider API.
pub(crate) trait StreamReader: Send {
    /// One event: its `event:` name (empty when absent) and its joined `data:` lines.
    fn event(&mut self, name: &str, data: &str);
    /// What the stream said, as far as it went.
    fn finish(self: Box<Self>) -> ResponseSummary;
}

/// The stream reader for an API's SSE responses. `message`: whether anyone reads
/// the reassembled message; an Anthropic stream read without it skips its content
/// deltas (the OpenAI readers always reassemble: every chunk is read for its usage
/// and finish reason anyway).
pub(crate) fn stream_reader(provider: Provider, api: Api, message: bool) -> Box<dyn StreamReader> {
    match (provider, api) {
        (Provider::OpenAi, Api::ChatCompletions) => Box::<openai::ChatStream>::default(),
        (Provider::OpenAi, _) => Box::<openai::ResponsesStream>::default(),
        (Provider::Anthropic, _) => Box::new(anthropic::MessageStream::new(message)),
    }
}

/// The SSE events [`stream_reader`]'s reader skips unread by their `event:` name
/// when nobody reads the message (`message` false): a tap may count them instead of
/// keeping them. They are only counted (`ResponseSummary::events`).
pub(crate) fn unread_events(provider: Provider, message: bool) -> &'static [&'static str] {
    match (provider, message) {
        (Provider::Anthropic, false) => &["content_block_delta", "ping"],
        _ => &[],
    }
}

/// Reads a whole JSON response body of one provider API.
pub(crate) fn read_json(
    provider: Provider,
    body: &[u8],
) -> Result<ResponseSummary, serde_json::Error> {
    match provider {
        Provider::Anthropic => anthropic::read_json(body),
        Provider::OpenAi => openai::read_json(body),
    }
}

/// The text of a provider error object: `type: message`, or `message` alone.
pub(crate) fn error_text(error: &Value) -> String {
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| error.to_string());
    let kind = error
        .get("type")
        .or_else(|| error.get("code"))
        .and_then(Value::as_str);
    match kind {
        Some(kind) if !kind.is_empty() => format!("{kind}: {message}"),
        _ => message,
    }
}

/// A string field of a JSON object.
pub(crate) fn str_field(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// The model provider a request is bound for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provider {
    Anthropic,
    OpenAi,
}

impl Provider {
    /// Lowercase name used in logs, records and rules.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Anthropic => "anthropic",
            Provider::OpenAi => "openai",
        }
    }
}

/// The API behind a path, which decides how the response is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// Anthropic `POST /v1/messages`.
    Messages,
    /// Anthropic `POST /v1/messages/count_tokens`.
    CountTokens,
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/responses`.
    Responses,
    /// Anything else under a provider's prefix: passed through, read as plain JSON if it is.
    Other,
}

impl Api {
    pub const ALL: [Api; 5] = [
        Api::Messages,
        Api::CountTokens,
        Api::ChatCompletions,
        Api::Responses,
        Api::Other,
    ];

    /// The snake_case name records use.
    pub fn name(self) -> &'static str {
        match self {
            Api::Messages => "messages",
            Api::CountTokens => "count_tokens",
            Api::ChatCompletions => "chat_completions",
            Api::Responses => "responses",
            Api::Other => "other",
        }
    }

    /// Whether a `POST` to it asks a model for an answer (not count_tokens, not the
    /// other passed-through paths).
    pub fn is_model_call(self) -> bool {
        matches!(self, Api::Messages | Api::ChatCompletions | Api::Responses)
    }

    pub fn from_name(name: &str) -> Option<Api> {
        Api::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// Where a client path goes: the provider, the API, and the path (with query) to ask upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Route {
    pub provider: Provider,
    pub api: Api,
    /// Path and query for the upstream request, before the upstream's own base path.
    pub upstream_path: PathAndQuery,
}

/// What promptgate routes, for the 404 message.
pub(crate) const ROUTES_HELP: &str = "promptgate routes /v1/* and /api/* to Anthropic (also under /anthropic/), \
     and /openai/v1/* to OpenAI (set OPENAI_BASE_URL=http://<listen>/openai/v1)";

/// Maps a client path to its provider. The query string is kept exactly as sent.
pub(crate) fn route(path_and_query: &PathAndQuery) -> Option<Route> {
    let path = path_and_query.path();
    let (provider, rest) = if let Some(rest) = strip_segment(path, "/openai") {
        (Provider::OpenAi, rest)
    } else if let Some(rest) = strip_segment(path, "/anthropic") {
        (Provider::Anthropic, rest)
    } else {
        (Provider::Anthropic, path)
    };
    if !(rest.starts_with("/v1/") || (provider == Provider::Anthropic && rest.starts_with("/api/")))
    {
        return None;
    }
    let api = api(provider, rest);
    let upstream_path = if rest.len() == path.len() {
        path_and_query.clone()
    } else {
        let with_query = match path_and_query.query() {
            Some(q) => format!("{rest}?{q}"),
            None => rest.to_owned(),
        };
        PathAndQuery::try_from(with_query).ok()?
    };
    Some(Route {
        provider,
        api,
        upstream_path,
    })
}

/// A client path whose base URL repeats a prefix promptgate adds itself (`…/v1`
/// set where promptgate's root was meant: `/v1/v1/messages`): the provider, the
/// variable to set, and the path to add to `http://<listen>` for its base URL.
pub(crate) fn doubled_prefix(path: &str) -> Option<(Provider, &'static str, &'static str)> {
    const DOUBLED: &[(&str, Provider, &str, &str)] = &[
        ("/v1/v1/", Provider::Anthropic, "ANTHROPIC_BASE_URL", ""),
        (
            "/anthropic/v1/v1/",
            Provider::Anthropic,
            "ANTHROPIC_BASE_URL",
            "/anthropic",
        ),
        (
            "/anthropic/anthropic/",
            Provider::Anthropic,
            "ANTHROPIC_BASE_URL",
            "/anthropic",
        ),
        (
            "/openai/v1/v1/",
            Provider::OpenAi,
            "OPENAI_BASE_URL",
            "/openai/v1",
        ),
        (
            "/openai/openai/",
            Provider::OpenAi,
            "OPENAI_BASE_URL",
            "/openai/v1",
        ),
    ];
    DOUBLED
        .iter()
        .find(|(prefix, ..)| path.starts_with(prefix))
        .map(|(_, provider, var, base)| (*provider, *var, *base))
}

/// Whether `path` (a provider's own path, no query) is one only OpenAI serves: an
/// OpenAI SDK whose base URL lacks `/openai` sends these to the Anthropic route.
pub(crate) fn is_openai_only(path: &str) -> bool {
    let path = path.trim_end_matches('/');
    [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/moderations",
        "/v1/images",
        "/v1/audio",
    ]
    .iter()
    .any(|p| {
        path == *p
            || path
                .strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// The API behind a provider's own path (no promptgate prefix, no query).
pub(crate) fn api(provider: Provider, path: &str) -> Api {
    match (provider, path.trim_end_matches('/')) {
        (Provider::Anthropic, "/v1/messages") => Api::Messages,
        (Provider::Anthropic, "/v1/messages/count_tokens") => Api::CountTokens,
        (Provider::OpenAi, "/v1/chat/completions") => Api::ChatCompletions,
        // The ChatGPT backend's Codex endpoint speaks the Responses API.
        (Provider::OpenAi, "/v1/responses" | "/backend-api/codex/responses") => Api::Responses,
        _ => Api::Other,
    }
}

/// `path` without a leading `/segment`, if it starts with that whole segment.
fn strip_segment<'a>(path: &'a str, segment: &str) -> Option<&'a str> {
    let rest = path.strip_prefix(segment)?;
    rest.starts_with('/').then_some(rest)
}

/// The body of an error promptgate itself answers with, in the provider's shape.
///
/// `kind` is a short machine code (`upstream_unreachable`, `request_too_large`, …)
/// used as OpenAI's `error.code`; Anthropic's `error.type` follows the status.
#[cfg(test)]
pub(crate) fn error_body(
    provider: Provider,
    status: http::StatusCode,
    kind: &str,
    message: &str,
    request_id: &str,
) -> Vec<u8> {
    error_body_typed(provider, status, None, kind, message, request_id)
}

/// [`error_body`] with an explicit `error.type` (a rule's `block` may name one).
pub(crate) fn error_body_typed(
    provider: Provider,
    status: http::StatusCode,
    error_type: Option<&str>,
    kind: &str,
    message: &str,
    request_id: &str,
) -> Vec<u8> {
    let message = format!("promptgate: {message}");
    let body = match provider {
        Provider::Anthropic => json!({
            "type": "error",
            "error": {"type": error_type.unwrap_or(anthropic::error_type(status)), "message": message},
            "request_id": request_id,
        }),
        Provider::OpenAi => json!({
            "error": {
                "message": message,
                "type": error_type.unwrap_or(openai::error_type(status)),
                "param": null,
                "code": kind,
            }
        }),
    };
    body.to_string().into_bytes()
}

/// Whether a request is a side request: routed to an API, but not a `POST` to a
/// model-call one (count_tokens, other paths, `HEAD` checks). A request never
/// routed (malformed, no route) is not one: it is an error to see.
pub(crate) fn is_side_request(method: &http::Method, api: Option<Api>) -> bool {
    api.is_some_and(|a| method != http::Method::POST || !a.is_model_call())
}

/// An SSE event that tells a streaming client the stream failed, in the shape its SDK
/// raises on. Sent only at an event boundary, after the upstream broke mid-stream or
/// a rule ended it. `kind` is OpenAI's `code`; `error_type` Anthropic's `error.type`
/// (by default `overloaded_error` for a stall, else `api_error`).
pub(crate) fn stream_error_event(
    provider: Provider,
    api: Api,
    kind: &str,
    error_type: Option<&str>,
    message: &str,
) -> Vec<u8> {
    let message = format!("promptgate: {message}");
    let text = match (provider, api) {
        (Provider::OpenAi, Api::ChatCompletions) => format!(
            "data: {}\n\n",
            json!({"error": {"message": message, "type": "server_error", "param": null, "code": kind}})
        ),
        (Provider::OpenAi, _) => format!(
            "event: error\ndata: {}\n\n",
            json!({"type": "error", "code": kind, "message": message, "param": null})
        ),
        (Provider::Anthropic, _) => {
            // A stall is the provider being overloaded, which agents retry.
            let error_type = match error_type {
                Some(t) => t,
                None if kind == "stream_stalled" => "overloaded_error",
                None => "api_error",
            };
            format!(
                "event: error\ndata: {}\n\n",
                json!({"type": "error", "error": {"type": error_type, "message": message}})
            )
        }
    };
    text.into_bytes()
}

/// A body's `Content-Encoding` when it is not plain bytes (absent, empty and
/// `identity` are plain); a value that is not text is returned as `(not text)`.
pub(crate) fn content_coding(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get(http::header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("(not text)").trim())
        .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(p: &str) -> Option<(Provider, Api, String)> {
        route(&PathAndQuery::try_from(p).unwrap())
            .map(|r| (r.provider, r.api, r.upstream_path.to_string()))
    }

    #[test]
    fn anthropic_paths_pass_through_with_query() {
        assert_eq!(
            r("/v1/messages?beta=true"),
            Some((
                Provider::Anthropic,
                Api::Messages,
                "/v1/messages?beta=true".into()
            ))
        );
        assert_eq!(
            r("/v1/messages/count_tokens?beta=true").map(|x| x.1),
            Some(Api::CountTokens)
        );
        assert_eq!(
            r("/v1/models?limit=5"),
            Some((Provider::Anthropic, Api::Other, "/v1/models?limit=5".into()))
        );
        assert_eq!(
            r("/api/event_logging/batch").map(|x| x.0),
            Some(Provider::Anthropic)
        );
        assert_eq!(
            r("/anthropic/v1/messages"),
            Some((Provider::Anthropic, Api::Messages, "/v1/messages".into()))
        );
    }

    #[test]
    fn openai_prefix_is_stripped() {
        assert_eq!(
            r("/openai/v1/chat/completions"),
            Some((
                Provider::OpenAi,
                Api::ChatCompletions,
                "/v1/chat/completions".into()
            ))
        );
        assert_eq!(
            r("/openai/v1/responses?x=1"),
            Some((Provider::OpenAi, Api::Responses, "/v1/responses?x=1".into()))
        );
        assert_eq!(
            r("/openai/v1/models").map(|x| x.2),
            Some("/v1/models".into())
        );
        // OpenAI has no /api/ tree.
        assert_eq!(r("/openai/api/x"), None);
    }

    #[test]
    fn unknown_paths_do_not_route() {
        for p in [
            "/",
            "/v1",
            "/v2/messages",
            "/openai",
            "/openaiv1/x",
            "/favicon.ico",
        ] {
            assert_eq!(r(p), None, "{p}");
        }
    }

    #[test]
    fn error_bodies_have_the_provider_shape() {
        let a: serde_json::Value = serde_json::from_slice(&error_body(
            Provider::Anthropic,
            http::StatusCode::BAD_GATEWAY,
            "upstream_unreachable",
            "no route",
            "req_1",
        ))
        .unwrap();
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["type"], "api_error");
        assert_eq!(a["error"]["message"], "promptgate: no route");
        let o: serde_json::Value = serde_json::from_slice(&error_body(
            Provider::OpenAi,
            http::StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            "too big",
            "req_1",
        ))
        .unwrap();
        assert_eq!(o["error"]["type"], "invalid_request_error");
        assert_eq!(o["error"]["code"], "request_too_large");
    }
}

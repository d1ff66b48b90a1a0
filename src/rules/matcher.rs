//! `when`: the tests a rule makes before it fires, compiled at load.
//!
//! All tests of a `when` table must hold; `any`, `all` and `not` combine tables.
//! Tests that need no body (provider, path, model, headers, …) run first, so a rule
//! that does not apply never parses the body. A body test on a body that is not
//! JSON is *unknown*, not false: an `enforce` rule then blocks.

use globset::GlobSet;
use http::{HeaderMap, HeaderName, Method};
use regex::Regex;
use serde_json::Value;
use toml::de::DeValue;

use super::body::Pointer;
use super::load::{Cx, Val};
use super::shape::{self, Scope};
use super::stream::scan::Tail;
use super::{Phase, State};
use crate::provider::Provider;

/// One key a `when` table may hold: the reference for docs, `rules check` and the loader.
#[derive(Debug)]
pub(crate) struct MatcherSpec {
    pub key: &'static str,
    /// The phases it may be used in.
    pub phases: &'static [Phase],
    #[cfg_attr(not(test), allow(dead_code))]
    // read by the test that writes docs/reference/rule-keys.md
    pub doc: &'static str,
    /// A `when` entry using it.
    #[cfg_attr(not(test), allow(dead_code))] // checked by loading it in the reference test
    pub example: &'static str,
}

const REQ: &[Phase] = &[
    Phase::BeforeProviderHeaders,
    Phase::BeforeProviderRequest,
    Phase::AfterProviderResponse,
    Phase::ProviderStreamEvent,
];
const HEAD: &[Phase] = &[
    Phase::BeforeProviderHeaders,
    Phase::BeforeProviderRequest,
    Phase::AfterProviderResponse,
];
const BODY: &[Phase] = &[Phase::BeforeProviderHeaders, Phase::BeforeProviderRequest];
const RESP: &[Phase] = &[Phase::AfterProviderResponse, Phase::ProviderStreamEvent];
const EVENT: &[Phase] = &[Phase::ProviderStreamEvent];
const SCANNED: &[Phase] = &[Phase::BeforeProviderRequest];

/// Every matcher key.
pub(crate) static MATCHERS: &[MatcherSpec] = &[
    MatcherSpec {
        key: "provider",
        phases: REQ,
        doc: "The provider the request goes to: \"anthropic\" or \"openai\" (or a list).",
        example: "provider = \"anthropic\"",
    },
    MatcherSpec {
        key: "method",
        phases: REQ,
        doc: "The HTTP method (or a list).",
        example: "method = \"POST\"",
    },
    MatcherSpec {
        key: "host",
        phases: REQ,
        doc: "A glob (or list) on the host the client addressed.",
        example: "host = \"127.0.0.1:*\"",
    },
    MatcherSpec {
        key: "path",
        phases: REQ,
        doc: "A glob (or list) on the upstream path, without the query (`/v1/messages` also for `/anthropic/v1/messages?beta=true`).",
        example: "path = \"/v1/messages\"",
    },
    MatcherSpec {
        key: "model",
        phases: REQ,
        doc: "A glob (or list) on the model asked for (as rules before this one left it). Needs no body parse.",
        example: "model = [\"claude-opus-*\", \"claude-sonnet-*\"]",
    },
    MatcherSpec {
        key: "header",
        phases: REQ,
        doc: "Request headers by name: a string is `equals`; a table has one of `equals`, `contains`, `regex`, `exists`. In after_provider_response it reads the headers as sent upstream.",
        example: "header.\"x-team\" = \"batch\"",
    },
    MatcherSpec {
        key: "body",
        phases: BODY,
        doc: "Body values by RFC 6901 JSON pointer: a value is `equals`; a table has one of `equals`, `contains`, `regex` (on strings), `exists`.",
        example: "body.\"/metadata/user_id\" = { exists = true }",
    },
    MatcherSpec {
        key: "system",
        phases: BODY,
        doc: "System prompt text: `contains` or `regex`, with `scope` = \"system\" (the `system` field, default), \"messages\" (`role:\"system\"` messages) or \"both\".",
        example: "system = { contains = \"Claude Code\", scope = \"both\" }",
    },
    MatcherSpec {
        key: "tool",
        phases: BODY,
        doc: "A tool is present whose name matches a glob (or any of a list).",
        example: "tool = \"mcp__*\"",
    },
    MatcherSpec {
        key: "stream",
        phases: BODY,
        doc: "The request asks for a stream (`\"stream\": true`).",
        example: "stream = true",
    },
    MatcherSpec {
        key: "body_size",
        phases: HEAD,
        doc: "The body size as received: `min` and/or `max` (bytes, or \"100KB\", \"1MiB\"). Needs no parse.",
        example: "body_size = { min = \"100KB\" }",
    },
    MatcherSpec {
        key: "status",
        phases: RESP,
        doc: "The response status: a number, a class such as \"4xx\", or a list.",
        example: "status = [429, \"5xx\"]",
    },
    MatcherSpec {
        key: "response_header",
        phases: RESP,
        doc: "Response headers by name, tested like `header`.",
        example: "response_header.\"retry-after\" = { exists = true }",
    },
    MatcherSpec {
        key: "event",
        phases: EVENT,
        doc: "The SSE event type (or a list): `content_block_delta`, `response.output_text.delta`, …; OpenAI chat chunks, which have none, are `chunk` (and `done` for `[DONE]`).",
        example: "event = \"content_block_start\"",
    },
    MatcherSpec {
        key: "data",
        phases: EVENT,
        doc: "The event's JSON data by JSON pointer, tested like `body`.",
        example: "data.\"/delta/type\" = \"input_json_delta\"",
    },
    MatcherSpec {
        key: "block_type",
        phases: EVENT,
        doc: "The type of the content block the event belongs to (or a list): `text`, `tool_use`, `thinking`, …; OpenAI tool calls are `tool_use` too.",
        example: "block_type = \"tool_use\"",
    },
    MatcherSpec {
        key: "tool_name",
        phases: EVENT,
        doc: "A glob (or list) on the tool name of the tool_use block the event belongs to.",
        example: "tool_name = \"Bash\"",
    },
    MatcherSpec {
        key: "text",
        phases: EVENT,
        doc: "The text of the current content block so far (text deltas, and a tool call's input JSON as it streams), tested like a header: `contains`, `regex`, … Each event scans only its new text and a tail: a `regex` finds matches of at most 1 KiB (its longest match when shorter) that lie in one run of characters it can match.",
        example: "text = { regex = \"rm -rf /\" }",
    },
    MatcherSpec {
        key: "tag",
        phases: EVENT,
        doc: "A tag (or any of a list) set on the exchange so far, by request rules or earlier events.",
        example: "tag = \"batch\"",
    },
    MatcherSpec {
        key: "found",
        phases: SCANNED,
        doc: "The outgoing-secrets scanner found a kind (`secret`, `pii`) or a detector's value (`aws-access-key`, `email`, a `[[detector]]`'s name) in what the model will read: any of a list. The scanner runs before every rule of the phase.",
        example: "found = [\"secret\"]",
    },
    MatcherSpec {
        key: "any",
        phases: REQ,
        doc: "An array of `when` tables; at least one must hold.",
        example: "any = [ { model = \"claude-opus-*\" }, { header.\"x-team\" = \"research\" } ]",
    },
    MatcherSpec {
        key: "all",
        phases: REQ,
        doc: "An array of `when` tables; all must hold.",
        example: "all = [ { stream = true }, { tool = \"Bash\" } ]",
    },
    MatcherSpec {
        key: "not",
        phases: REQ,
        doc: "A `when` table that must not hold.",
        example: "not = { provider = \"openai\" }",
    },
];

/// A compiled test.
#[derive(Debug)]
pub(crate) enum Matcher {
    All(Vec<Matcher>),
    Any(Vec<Matcher>),
    Not(Box<Matcher>),
    Provider(Vec<Provider>),
    Method(Vec<Method>),
    Host(GlobSet),
    Path(GlobSet),
    Model(GlobSet),
    Header(HeaderName, TextTest),
    ResponseHeader(HeaderName, TextTest),
    Body(Pointer, ValueTest),
    System(Scope, TextTest),
    Tool(GlobSet),
    Stream(bool),
    BodySize(u64, u64),
    Status(Vec<StatusTest>),
    Event(Vec<String>),
    Data(Pointer, ValueTest),
    BlockType(Vec<String>),
    ToolName(GlobSet),
    /// With how a regex is rescanned as the block grows.
    Text(TextTest, Option<Tail>),
    Tag(Vec<String>),
    /// Kinds or detector names the scanner found.
    Found(Vec<String>),
}

/// A test on a text.
#[derive(Debug)]
pub(crate) enum TextTest {
    Exists(bool),
    Equals(String),
    Contains(String),
    Regex(Regex),
}

impl TextTest {
    fn test(&self, text: &str) -> bool {
        match self {
            TextTest::Exists(e) => *e,
            TextTest::Equals(s) => text == s,
            TextTest::Contains(s) => text.contains(s.as_str()),
            TextTest::Regex(r) => r.is_match(text),
        }
    }
}

/// A test on a body value.
#[derive(Debug)]
pub(crate) enum ValueTest {
    Exists(bool),
    Equals(Value),
    Contains(String),
    Regex(Regex),
}

/// A status test: exact, or a class (`4` for 4xx).
#[derive(Debug, Clone, Copy)]
pub(crate) enum StatusTest {
    Exact(u16),
    Class(u16),
}

/// The result of a test: it holds, it does not, or it cannot be told (and why).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tri {
    Yes,
    No,
    Unknown(String),
}

impl Tri {
    fn of(b: bool) -> Tri {
        if b { Tri::Yes } else { Tri::No }
    }
}

const TEST_KEYS: &[&str] = &["equals", "contains", "regex", "exists"];

impl Matcher {
    /// Compiles a rule's `when` table.
    pub(crate) fn compile_when(
        cx: &mut Cx<'_>,
        v: &Val<'_>,
        phase: Option<Phase>,
    ) -> Option<Matcher> {
        let keys: Vec<&str> = MATCHERS.iter().map(|m| m.key).collect();
        let table = cx.table(v, "when", &keys)?;
        let mut all = Vec::new();
        let mut ok = true;
        for (key, value) in table.iter() {
            let key_text = key.get_ref().as_ref();
            let Some(spec) = MATCHERS.iter().find(|m| m.key == key_text) else {
                continue; // reported by `table`
            };
            if let Some(phase) = phase
                && !spec.phases.contains(&phase)
            {
                let allowed: Vec<&str> = spec.phases.iter().map(|p| p.name()).collect();
                cx.error(
                    key.span(),
                    format!(
                        "matcher {key_text:?} cannot be used in {} (only in {})",
                        phase.name(),
                        allowed.join(", ")
                    ),
                );
                ok = false;
                continue;
            }
            match compile_one(cx, key_text, value, phase) {
                Some(mut m) => all.append(&mut m),
                None => ok = false,
            }
        }
        if !ok {
            return None;
        }
        // Cheap tests first: a rule that does not apply must not parse the body.
        all.sort_by_key(Matcher::needs_body);
        Some(Matcher::All(all))
    }

    /// The `when` keys this test uses, in order (for summaries).
    pub(crate) fn keys(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if let Matcher::All(list) = self {
            for m in list {
                let k = m.key();
                if !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        out
    }

    fn key(&self) -> &'static str {
        match self {
            Matcher::All(_) => "all",
            Matcher::Any(_) => "any",
            Matcher::Not(_) => "not",
            Matcher::Provider(_) => "provider",
            Matcher::Method(_) => "method",
            Matcher::Host(_) => "host",
            Matcher::Path(_) => "path",
            Matcher::Model(_) => "model",
            Matcher::Header(..) => "header",
            Matcher::ResponseHeader(..) => "response_header",
            Matcher::Body(..) => "body",
            Matcher::System(..) => "system",
            Matcher::Tool(_) => "tool",
            Matcher::Stream(_) => "stream",
            Matcher::BodySize(..) => "body_size",
            Matcher::Status(_) => "status",
            Matcher::Event(_) => "event",
            Matcher::Data(..) => "data",
            Matcher::BlockType(_) => "block_type",
            Matcher::ToolName(_) => "tool_name",
            Matcher::Text(..) => "text",
            Matcher::Tag(_) => "tag",
            Matcher::Found(_) => "found",
        }
    }

    /// Whether it tests what the outgoing-secrets scanner found.
    pub(crate) fn uses_found(&self) -> bool {
        match self {
            Matcher::All(v) | Matcher::Any(v) => v.iter().any(Matcher::uses_found),
            Matcher::Not(m) => m.uses_found(),
            Matcher::Found(_) => true,
            _ => false,
        }
    }

    /// Whether evaluating this test may parse the body.
    pub(crate) fn needs_body(&self) -> bool {
        match self {
            Matcher::All(v) | Matcher::Any(v) => v.iter().any(Matcher::needs_body),
            Matcher::Not(m) => m.needs_body(),
            Matcher::Body(..) | Matcher::System(..) | Matcher::Tool(_) | Matcher::Stream(_) => true,
            _ => false,
        }
    }

    /// Evaluates the test on the exchange as rules before left it.
    // One arm per matcher, each a few lines: splitting it would scatter the table.
    #[allow(clippy::too_many_lines)]
    pub(crate) fn eval(&self, st: &mut State<'_, '_>) -> Tri {
        match self {
            Matcher::All(list) => {
                let mut unknown = None;
                for m in list {
                    match m.eval(st) {
                        Tri::No => return Tri::No,
                        Tri::Unknown(why) => unknown = unknown.or(Some(why)),
                        Tri::Yes => {}
                    }
                }
                unknown.map_or(Tri::Yes, Tri::Unknown)
            }
            Matcher::Any(list) => {
                let mut unknown = None;
                for m in list {
                    match m.eval(st) {
                        Tri::Yes => return Tri::Yes,
                        Tri::Unknown(why) => unknown = unknown.or(Some(why)),
                        Tri::No => {}
                    }
                }
                unknown.map_or(Tri::No, Tri::Unknown)
            }
            Matcher::Not(m) => match m.eval(st) {
                Tri::Yes => Tri::No,
                Tri::No => Tri::Yes,
                u => u,
            },
            Matcher::Provider(list) => Tri::of(list.contains(&st.info.provider)),
            Matcher::Method(list) => Tri::of(list.contains(st.info.method)),
            Matcher::Host(g) => Tri::of(st.info.host.is_some_and(|h| g.is_match(h))),
            Matcher::Path(g) => Tri::of(g.is_match(st.info.path)),
            Matcher::Model(g) => Tri::of(st.model.as_deref().is_some_and(|m| g.is_match(m))),
            Matcher::Header(name, test) => {
                let headers = st.request_headers.unwrap_or(&*st.headers);
                Tri::of(header_test(headers, name, test))
            }
            Matcher::ResponseHeader(name, test) => Tri::of(header_test(st.headers, name, test)),
            Matcher::Status(tests) => Tri::of(st.status.is_some_and(|s| {
                let s = s.as_u16();
                tests.iter().any(|t| match t {
                    StatusTest::Exact(n) => s == *n,
                    StatusTest::Class(c) => s / 100 == *c,
                })
            })),
            Matcher::BodySize(min, max) => {
                let size = st.body.as_ref().map_or(0, |b| b.size());
                Tri::of(size >= *min && size <= *max)
            }
            Matcher::Event(names) => {
                Tri::of(st.event.is_some_and(|e| names.iter().any(|n| n == e.name)))
            }
            Matcher::Data(pointer, test) => match st.event.map(|e| e.data) {
                Some(Some(data)) => Tri::of(value_test(test, value_at(data, &pointer.0))),
                _ => Tri::Unknown("the event's data is not JSON".into()),
            },
            Matcher::BlockType(kinds) => Tri::of(
                st.event
                    .and_then(|e| e.block_type)
                    .is_some_and(|k| kinds.iter().any(|w| w == k)),
            ),
            Matcher::ToolName(g) => {
                Tri::of(st.event.and_then(|e| e.tool).is_some_and(|t| g.is_match(t)))
            }
            Matcher::Text(test, tail) => Tri::of(st.event.is_some_and(|e| {
                // Incremental: each event scans its new text and a bounded tail.
                let key = std::ptr::from_ref(self) as usize;
                match (test, tail) {
                    (TextTest::Contains(s), _) => e.scans.contains(key, s, e.text),
                    (TextTest::Regex(r), Some(tail)) => e.scans.regex(key, r, tail, e.text),
                    _ => test.test(e.text),
                }
            })),
            Matcher::Found(names) => Tri::of(
                st.effects
                    .findings
                    .iter()
                    .any(|f| names.iter().any(|n| *n == f.kind || *n == f.detector)),
            ),
            Matcher::Tag(tags) => Tri::of(st.event.is_some_and(|e| {
                tags.iter()
                    .any(|t| e.tags.contains(t) || st.effects.tags.contains(t))
            })),
            Matcher::Body(pointer, test) => match st.root() {
                Err(why) => Tri::Unknown(why.to_string()),
                Ok(root) => {
                    let node = root.peek().at(&pointer.0);
                    Tri::of(match (test, node) {
                        (ValueTest::Exists(e), n) => n.is_some() == *e,
                        (_, None) => false,
                        (ValueTest::Equals(want), Some(n)) => n.to_value() == *want,
                        (ValueTest::Contains(s), Some(n)) => {
                            n.as_str().is_some_and(|t| t.contains(s.as_str()))
                        }
                        (ValueTest::Regex(r), Some(n)) => {
                            n.as_str().is_some_and(|t| r.is_match(&t))
                        }
                    })
                }
            },
            Matcher::System(scope, test) => match st.root() {
                Err(why) => Tri::Unknown(why.to_string()),
                Ok(root) => Tri::of(shape::any_text(root, *scope, |t| test.test(t))),
            },
            Matcher::Tool(g) => match st.root() {
                Err(why) => Tri::Unknown(why.to_string()),
                Ok(root) => Tri::of(
                    shape::tools(root)
                        .any(|t| shape::tool_name(t).is_some_and(|n| g.is_match(n.as_ref()))),
                ),
            },
            Matcher::Stream(want) => match st.root() {
                Err(why) => Tri::Unknown(why.to_string()),
                Ok(root) => {
                    let stream = root
                        .peek()
                        .child("stream")
                        .and_then(|n| n.as_bool())
                        .unwrap_or(false);
                    Tri::of(stream == *want)
                }
            },
        }
    }
}

/// The value at a pointer's tokens (array indexes are decimal).
fn value_at<'v>(v: &'v Value, tokens: &[String]) -> Option<&'v Value> {
    tokens.iter().try_fold(v, |at, t| match at {
        Value::Array(items) => items.get(t.parse::<usize>().ok()?),
        _ => at.get(t.as_str()),
    })
}

fn value_test(test: &ValueTest, value: Option<&Value>) -> bool {
    match (test, value) {
        (ValueTest::Exists(e), v) => v.is_some() == *e,
        (_, None) => false,
        (ValueTest::Equals(want), Some(v)) => v == want,
        (ValueTest::Contains(s), Some(v)) => v.as_str().is_some_and(|t| t.contains(s.as_str())),
        (ValueTest::Regex(r), Some(v)) => v.as_str().is_some_and(|t| r.is_match(t)),
    }
}

fn header_test(headers: &HeaderMap, name: &HeaderName, test: &TextTest) -> bool {
    let mut values = headers.get_all(name).iter().peekable();
    match test {
        TextTest::Exists(e) => values.peek().is_some() == *e,
        _ => values.filter_map(|v| v.to_str().ok()).any(|v| test.test(v)),
    }
}

// One arm per matcher key, each checking its own value: splitting it would scatter the table.
#[allow(clippy::too_many_lines)]
fn compile_one(
    cx: &mut Cx<'_>,
    key: &str,
    v: &Val<'_>,
    phase: Option<Phase>,
) -> Option<Vec<Matcher>> {
    let one = |m| Some(vec![m]);
    match key {
        "provider" => {
            let mut out = Vec::new();
            for (text, span) in cx.strings(v, "provider")? {
                match text.as_str() {
                    "anthropic" => out.push(Provider::Anthropic),
                    "openai" => out.push(Provider::OpenAi),
                    _ => {
                        cx.error(
                            span,
                            format!("unknown provider {text:?} (known: anthropic, openai)"),
                        );
                        return None;
                    }
                }
            }
            one(Matcher::Provider(out))
        }
        "method" => {
            let mut out = Vec::new();
            for (text, span) in cx.strings(v, "method")? {
                match Method::from_bytes(text.to_ascii_uppercase().as_bytes()) {
                    Ok(m) => out.push(m),
                    Err(_) => {
                        cx.error(
                            span,
                            format!("invalid method {text:?} (expected e.g. \"POST\")"),
                        );
                        return None;
                    }
                }
            }
            one(Matcher::Method(out))
        }
        "host" => one(Matcher::Host(cx.globs(v, "host")?.0)),
        "path" => one(Matcher::Path(cx.globs(v, "path")?.0)),
        "model" => one(Matcher::Model(cx.globs(v, "model")?.0)),
        "tool" => {
            let globs = cx.globs(v, "tool")?.0;
            if let Some(warning) = super::deferred::tool_matcher_warning(&globs) {
                cx.warn(v.span(), warning);
            }
            one(Matcher::Tool(globs))
        }
        "tool_name" => one(Matcher::ToolName(cx.globs(v, "tool_name")?.0)),
        "found" => {
            let mut names = Vec::new();
            for (text, span) in cx.strings(v, "found")? {
                let known = crate::redact::DataKind::from_name(&text).is_some()
                    || crate::redact::detector(&text).is_some();
                if !known {
                    cx.warn(
                        span,
                        format!(
                            "found = {text:?} is neither a kind (secret, pii) nor a built-in detector: it matches only a [[detector]] of that name"
                        ),
                    );
                }
                names.push(text);
            }
            one(Matcher::Found(names))
        }
        "event" | "block_type" | "tag" => {
            let names: Vec<String> = cx.strings(v, key)?.into_iter().map(|(t, _)| t).collect();
            one(match key {
                "event" => Matcher::Event(names),
                "block_type" => Matcher::BlockType(names),
                _ => Matcher::Tag(names),
            })
        }
        "text" => {
            let test = text_test(cx, v, "text")?;
            let tail = match &test {
                TextTest::Regex(r) => Some(Tail::of(r)),
                _ => None,
            };
            one(Matcher::Text(test, tail))
        }
        "stream" => one(Matcher::Stream(cx.bool(v, "stream")?)),
        "header" | "response_header" => {
            let DeValue::Table(t) = v.get_ref() else {
                cx.error(
                    v.span(),
                    format!("{key} is a table of header names, e.g. {key}.\"x-team\" = \"batch\""),
                );
                return None;
            };
            let mut out = Vec::new();
            // `header = { name = "x", regex = "…" }` loads as two header names and
            // matches nothing: say so rather than fail silently.
            let test_like =
                |n: &str| TEST_KEYS.contains(&n) || ["name", "matches", "value"].contains(&n);
            if t.iter().any(|(n, _)| test_like(n.get_ref())) {
                cx.warn(
                    v.span(),
                    format!(
                        "{key} takes header names as keys, and these look like a test: write \
                         {key}.\"user-agent\" = {{ regex = \"…\" }}"
                    ),
                );
            }
            for (name, test) in t.iter() {
                let Ok(header) = HeaderName::from_bytes(name.get_ref().as_bytes()) else {
                    cx.error(
                        name.span(),
                        format!("invalid header name {:?}", name.get_ref()),
                    );
                    return None;
                };
                let test = text_test(cx, test, &format!("{key}.{}", name.get_ref()))?;
                out.push(if key == "header" {
                    Matcher::Header(header, test)
                } else {
                    Matcher::ResponseHeader(header, test)
                });
            }
            Some(out)
        }
        "body" | "data" => {
            let DeValue::Table(t) = v.get_ref() else {
                cx.error(v.span(), format!("{key} is a table of JSON pointers, e.g. {key}.\"/metadata/user_id\" = {{ exists = true }}"));
                return None;
            };
            let mut out = Vec::new();
            for (pointer, test) in t.iter() {
                let p = cx.pointer_text(pointer.get_ref(), pointer.span())?;
                let what = format!("{key}.{:?}", pointer.get_ref());
                // Pointers that load but can never match what was meant: say so.
                let text: &str = pointer.get_ref();
                if text.is_empty() {
                    cx.warn(
                        pointer.span(),
                        format!("{what}: the pointer \"\" is the whole body, not a value in it; name one (e.g. \"/metadata/user_id\")"),
                    );
                } else if text.split('/').any(|segment| segment == "*") {
                    cx.warn(
                        pointer.span(),
                        format!("{what}: a JSON pointer has no wildcards: \"*\" is a key named * (it matches no array element); name one (e.g. \"/messages/0/role\")"),
                    );
                }
                let test = match test.get_ref() {
                    DeValue::Table(_) => {
                        let t = cx.table(test, &what, TEST_KEYS)?;
                        one_test(cx, test, t.len(), &what)?;
                        let (k, arg) = t.iter().next()?;
                        match k.get_ref().as_ref() {
                            "exists" => ValueTest::Exists(cx.bool(arg, "exists")?),
                            "equals" => ValueTest::Equals(cx.json(arg)?),
                            "contains" => ValueTest::Contains(cx.str(arg, "contains")?.to_owned()),
                            _ => ValueTest::Regex(cx.regex(arg, "regex")?),
                        }
                    }
                    _ => ValueTest::Equals(cx.json(test)?),
                };
                out.push(if key == "body" {
                    Matcher::Body(p, test)
                } else {
                    Matcher::Data(p, test)
                });
            }
            Some(out)
        }
        "system" => {
            let t = cx.table(v, "system", &["contains", "regex", "scope"])?;
            let scope = match t.get("scope") {
                Some(s) => shape::compile_scope(cx, s)?,
                None => Scope::System,
            };
            let test = match (t.get("contains"), t.get("regex")) {
                (Some(c), None) => TextTest::Contains(cx.str(c, "contains")?.to_owned()),
                (None, Some(r)) => TextTest::Regex(cx.regex(r, "regex")?),
                _ => {
                    cx.error(v.span(), "system needs exactly one of contains or regex (e.g. system = { contains = \"Claude Code\" })");
                    return None;
                }
            };
            one(Matcher::System(scope, test))
        }
        "body_size" => {
            let t = cx.table(v, "body_size", &["min", "max"])?;
            let mut size = |k: &str| -> Option<Option<u64>> {
                let Some(arg) = t.get(k) else {
                    return Some(None);
                };
                let scalar = match arg.get_ref() {
                    DeValue::Integer(_) => {
                        crate::setting::Scalar::Number(cx.count(arg, k, 0..i64::MAX)?)
                    }
                    DeValue::String(s) => crate::setting::Scalar::Text(s.to_string()),
                    _ => {
                        cx.error(
                            arg.span(),
                            format!("body_size.{k} must be bytes or a size such as \"100KB\""),
                        );
                        return None;
                    }
                };
                match crate::setting::parse_size(&scalar) {
                    Ok(n) => Some(Some(n)),
                    Err(e) => {
                        cx.error(arg.span(), e.to_string());
                        None
                    }
                }
            };
            let min = size("min")?;
            let max = size("max")?;
            if min.is_none() && max.is_none() {
                cx.error(v.span(), "body_size needs min and/or max");
                return None;
            }
            one(Matcher::BodySize(min.unwrap_or(0), max.unwrap_or(u64::MAX)))
        }
        "status" => {
            let items: Vec<&Val<'_>> = match v.get_ref() {
                DeValue::Array(a) => a.iter().collect(),
                _ => vec![v],
            };
            let mut out = Vec::new();
            for item in items {
                match item.get_ref() {
                    DeValue::Integer(_) => {
                        out.push(StatusTest::Exact(cx.count(item, "status", 100..600)? as u16))
                    }
                    DeValue::String(s) => {
                        let b = s.as_bytes();
                        if b.len() == 3
                            && (b'1'..=b'5').contains(&b[0])
                            && s[1..].eq_ignore_ascii_case("xx")
                        {
                            out.push(StatusTest::Class(u16::from(b[0] - b'0')));
                        } else {
                            cx.error(
                                item.span(),
                                format!("invalid status class {s:?} (expected e.g. \"4xx\")"),
                            );
                            return None;
                        }
                    }
                    _ => {
                        cx.error(
                            item.span(),
                            "status must be a number such as 429 or a class such as \"5xx\"",
                        );
                        return None;
                    }
                }
            }
            one(Matcher::Status(out))
        }
        "any" | "all" => {
            let DeValue::Array(items) = v.get_ref() else {
                cx.error(v.span(), format!("{key} must be an array of when tables, e.g. {key} = [ {{ model = \"a\" }}, {{ model = \"b\" }} ]"));
                return None;
            };
            let mut out = Vec::new();
            for item in items.iter() {
                out.push(Matcher::compile_when(cx, item, phase)?);
            }
            one(if key == "any" {
                Matcher::Any(out)
            } else {
                Matcher::All(out)
            })
        }
        "not" => one(Matcher::Not(Box::new(Matcher::compile_when(cx, v, phase)?))),
        _ => None,
    }
}

fn one_test(cx: &mut Cx<'_>, v: &Val<'_>, len: usize, what: &str) -> Option<()> {
    if len != 1 {
        cx.error(
            v.span(),
            format!(
                "{what} needs exactly one of {} (e.g. {{ exists = true }})",
                TEST_KEYS.join(", ")
            ),
        );
        return None;
    }
    Some(())
}

fn text_test(cx: &mut Cx<'_>, v: &Val<'_>, what: &str) -> Option<TextTest> {
    match v.get_ref() {
        DeValue::String(s) => Some(TextTest::Equals(s.to_string())),
        DeValue::Table(_) => {
            let t = cx.table(v, what, TEST_KEYS)?;
            one_test(cx, v, t.len(), what)?;
            let (k, arg) = t.iter().next()?;
            Some(match k.get_ref().as_ref() {
                "exists" => TextTest::Exists(cx.bool(arg, "exists")?),
                "equals" => TextTest::Equals(cx.str(arg, "equals")?.to_owned()),
                "contains" => TextTest::Contains(cx.str(arg, "contains")?.to_owned()),
                _ => TextTest::Regex(cx.regex(arg, "regex")?),
            })
        }
        _ => {
            cx.error(
                v.span(),
                format!("{what} must be a string or a table such as {{ regex = \"^b\" }}"),
            );
            None
        }
    }
}

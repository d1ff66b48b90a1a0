//! Hook rules: TOML files that inspect, rewrite or block requests and note responses.
//!
//! A [`RuleSet`] is compiled from the rules directory (`load.rs`), kept live in a
//! [`reload::LiveRules`] and swapped whole on a valid change. Each exchange takes the
//! set once and runs it in four [`Phase`]s (the last, per event of a stream, in
//! [`stream`]). Rules do no IO: they work on a request
//! or response head held in memory, so `rules test` and unit tests need no sockets.

pub(crate) mod action;
mod body;
mod limits;
mod load;
mod matcher;
pub mod reload;
mod shape;
pub mod stream;

use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use serde::{Deserialize, Serialize};

pub use action::{ACTIONS, ActionSpec};
pub use load::LoadError;
pub(crate) use load::read_dir;
pub use matcher::{MATCHERS, MatcherSpec};

use action::CompiledAction;
use body::{BodyStore, LazyBody, Node};
use matcher::{Matcher, Tri};

use crate::prompt::PromptCell;
use crate::prompt::{KeyCheck, Prompt};
use crate::provider::{Api, Provider};
use crate::record::ExchangeRecord;

/// The four hooks, named as in the agent extension-event model. The names are the
/// `on` values of rules, used as written in TOML, logs and docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Runs first, once the request body is read and the model sniffed: sees the
    /// outgoing headers (hop-by-hop removed), may set or remove them, block, tag, log.
    BeforeProviderHeaders,
    /// Runs next, right before the upstream request is built: sees the payload as
    /// earlier rules left it, may rewrite it (JSON, system, cache_control, tools,
    /// model), block, tag, log. The final payload is what is sent.
    BeforeProviderRequest,
    /// Runs when the upstream's status and headers arrive, before the body streams:
    /// may set or remove response headers, tag, log. Never touches the body.
    AfterProviderResponse,
    /// Runs on each event of an SSE answer as it arrives: may mask text in what the
    /// client receives, drop the event, end the stream (`block`), tag, log.
    ProviderStreamEvent,
}

impl Phase {
    pub const ALL: [Phase; 4] = [
        Phase::BeforeProviderHeaders,
        Phase::BeforeProviderRequest,
        Phase::AfterProviderResponse,
        Phase::ProviderStreamEvent,
    ];

    /// The name used in rule files and logs.
    pub fn name(self) -> &'static str {
        match self {
            Phase::BeforeProviderHeaders => "before_provider_headers",
            Phase::BeforeProviderRequest => "before_provider_request",
            Phase::AfterProviderResponse => "after_provider_response",
            Phase::ProviderStreamEvent => "provider_stream_event",
        }
    }

    pub fn from_name(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// One compiled rule.
#[derive(Debug)]
pub struct Rule {
    pub name: String,
    pub description: Option<String>,
    pub phase: Phase,
    /// Fail closed: a rule that cannot be evaluated or applied blocks the request.
    pub enforce: bool,
    pub enabled: bool,
    /// The file it came from, and the line of its `[[rule]]`.
    pub file: String,
    pub line: usize,
    when: Matcher,
    actions: Vec<CompiledAction>,
    /// Whether matching or applying it may parse the body.
    pub needs_body: bool,
}

impl Rule {
    /// The `when` keys it tests, in order.
    pub fn matcher_keys(&self) -> Vec<&'static str> {
        self.when.keys()
    }

    /// The action keys, in order.
    pub fn action_keys(&self) -> Vec<&'static str> {
        self.actions.iter().map(|a| a.key).collect()
    }
}

/// A compiled rules directory: every rule in file-name then table order.
#[derive(Debug, Default)]
pub struct RuleSet {
    rules: Vec<Rule>,
    /// Each file read, with its number of rules.
    pub files: Vec<(String, usize)>,
    /// The directory it was loaded from.
    pub dir: Option<PathBuf>,
    /// Header names whose values rules read from the environment (secrets).
    pub secret_headers: Vec<HeaderName>,
    /// What compiled but is almost surely a mistake, as `file:line:col: message`.
    pub warnings: Vec<LoadError>,
}

/// The status of a `block` that names none, of `model.allow` and of the
/// repeated-key refusal: 451, measured with Claude Code (tests/claude_code.rs):
/// it prints the message and sends the request once. A 403 reads "Failed to
/// authenticate", and a 400 or 422 is sent 6 times in a second.
pub(crate) const BLOCK_STATUS: StatusCode = StatusCode::UNAVAILABLE_FOR_LEGAL_REASONS;

/// What a blocked request is answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub status: StatusCode,
    /// The provider error type (`permission_error`, …); by default it follows the status.
    pub error_type: Option<String>,
    pub message: String,
    /// The rule that blocked.
    pub rule: String,
}

/// What the request phases decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Send the request upstream.
    Continue,
    /// Answer the client with this error; the upstream is never contacted.
    Respond(Block),
}

/// What rules did to one exchange, for the record and the log.
#[derive(Debug, Default)]
pub struct Effects {
    /// Rule names that fired, in order.
    pub fired: Vec<String>,
    pub tags: Vec<String>,
    /// Log lines (`log` actions, fail-open errors, cache_control fix-ups), each with its rule.
    pub logs: Vec<(String, String)>,
    /// JSON pointers changed in the body, in the order changed.
    pub body_diff: Vec<String>,
    /// `Some(false)` when a rule turned capture off.
    pub capture: Option<bool>,
    pub redactions: Vec<regex::Regex>,
    /// Headers whose values came from the environment.
    pub secret_headers: Vec<HeaderName>,
    /// The breakpoint limit rules asked for (default 4).
    pub max_breakpoints: Option<usize>,
    /// Who changed what, in order: (rule, JSON pointer of a body node, or
    /// `header NAME`). The breakpoint-limit fix-ups are under [`LIMITS_FIXER`].
    pub edits: Vec<(String, String)>,
}

/// The name the cache_control policy's breakpoint-limit fix-ups go under in
/// [`Effects::edits`] and the log.
pub const LIMITS_FIXER: &str = "cache_control policy";

impl Effects {
    /// Adds what rules did to the exchange's record, and writes their log lines
    /// (target `promptgate::rules`, with the exchange id).
    pub fn record_into(&self, record: &mut ExchangeRecord) {
        record.rules_fired.extend(self.fired.iter().cloned());
        for t in &self.tags {
            if !record.tags.contains(t) {
                record.tags.push(t.clone());
            }
        }
        for p in &self.body_diff {
            if !record.body_diff.contains(p) {
                record.body_diff.push(p.clone());
            }
        }
        if self.capture == Some(false) {
            record.capture = false;
        }
        record
            .extra_redactions
            .extend(self.redactions.iter().cloned());
        for h in &self.secret_headers {
            if !record.secret_headers.contains(h) {
                record.secret_headers.push(h.clone());
            }
        }
        for (rule, line) in &self.logs {
            tracing::info!(target: "promptgate::rules", id = %record.id, rule = %rule, "{line}");
        }
    }

    fn note(&mut self, rule: &str, line: impl Into<String>) {
        self.logs.push((rule.to_owned(), line.into()));
    }

    fn changed(&mut self, pointer: String) {
        if !self.body_diff.contains(&pointer) {
            self.body_diff.push(pointer);
        }
    }
}

/// The request as rules see it: what was asked, the outgoing headers, the body.
#[derive(Debug)]
pub struct RequestCtx<'a> {
    pub provider: Provider,
    pub api: Api,
    pub method: &'a Method,
    pub host: Option<&'a str>,
    /// The upstream path, without the query.
    pub path: &'a str,
    /// The model as sniffed (no body parse).
    pub model: Option<&'a str>,
    /// The headers to send upstream (hop-by-hop already removed).
    pub headers: HeaderMap,
    /// The body as received (maybe compressed: see `Content-Encoding` in `headers`).
    pub body: &'a Bytes,
    /// The model of the body decoded once by the caller
    /// (`observer::decode::request_plain`: the same bytes as `body` when it came
    /// uncompressed). Rules read only this, and read it only when they must.
    pub prompt: &'a PromptCell,
}

/// What the request phases did.
#[derive(Debug)]
pub struct RequestResult {
    pub verdict: Verdict,
    /// The headers to send (content-length and content-encoding fixed when the body changed).
    pub headers: HeaderMap,
    /// The new body and its model when rules changed it (identity-encoded), else
    /// `None`: send the original.
    pub body: Option<Prompt>,
    pub effects: Effects,
    /// Whether the body was parsed (for the no-parse guarantee's tests).
    pub body_parsed: bool,
    /// Whether the body repeats a key in one object, when rules looked (they then
    /// read each repeated key's last value).
    pub keys: KeyCheck,
    /// The model as rules read it: the last `model` when the body repeats it.
    pub model: Option<String>,
}

/// The fixed facts of a request that every phase reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Info<'a> {
    pub(crate) provider: Provider,
    pub(crate) api: Api,
    pub(crate) method: &'a Method,
    pub(crate) host: Option<&'a str>,
    pub(crate) path: &'a str,
}

/// The working state of one phase run: what matchers read and actions change.
pub(crate) struct State<'r, 'a> {
    pub(crate) info: Info<'r>,
    /// The model as rules before left it.
    pub(crate) model: Option<String>,
    /// Request phases: the outgoing request headers. Response phase: the response headers.
    pub(crate) headers: &'r mut HeaderMap,
    /// Response phase: the request headers as sent.
    pub(crate) request_headers: Option<&'r HeaderMap>,
    pub(crate) status: Option<StatusCode>,
    pub(crate) body: Option<&'r mut LazyBody<'a>>,
    pub(crate) effects: &'r mut Effects,
    /// The rule being applied.
    pub(crate) rule: String,
    pub(crate) secrets: &'r [HeaderName],
    /// provider_stream_event: the event being matched, and what actions decide.
    pub(crate) event: Option<&'r stream::EventView<'r>>,
    pub(crate) decision: Option<&'r mut stream::EventDecision>,
}

impl<'a> State<'_, 'a> {
    /// The parsed body, or why it cannot be read.
    pub(crate) fn root(&mut self) -> Result<&mut Node<'a>, String> {
        match self.body.as_mut() {
            Some(b) => b.root(),
            None => Err("there is no request body in after_provider_response".into()),
        }
    }

    /// Records a changed body pointer.
    pub(crate) fn changed(&mut self, pointer: String) {
        self.effects
            .edits
            .push((self.rule.clone(), pointer.clone()));
        self.effects.changed(pointer);
    }

    /// Records a header set or removed.
    pub(crate) fn header_changed(&mut self, name: &HeaderName) {
        self.effects
            .edits
            .push((self.rule.clone(), format!("header {name}")));
    }

    /// Adds a log line for the current rule.
    pub(crate) fn log(&mut self, line: impl Into<String>) {
        let rule = self.rule.clone();
        self.effects.note(&rule, line);
    }
}

impl RuleSet {
    /// Loads and compiles every `*.toml` at the top of `dir`; all errors or none.
    pub fn load_dir(dir: &Path) -> Result<RuleSet, Vec<LoadError>> {
        load::load_dir(dir)
    }

    /// Compiles rule files given as (name, text), in order.
    pub fn compile(sources: &[(String, String)]) -> Result<RuleSet, Vec<LoadError>> {
        load::compile_sources(sources, &|name| std::env::var(name).ok())
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether any enabled rule runs in `phase`.
    pub fn has_rules(&self, phase: Phase) -> bool {
        self.active(phase).next().is_some()
    }

    fn active(&self, phase: Phase) -> impl Iterator<Item = &Rule> {
        self.rules
            .iter()
            .filter(move |r| r.enabled && r.phase == phase)
    }

    /// Runs before_provider_headers then before_provider_request on a request.
    pub fn apply_request(&self, req: RequestCtx<'_>) -> RequestResult {
        let mut headers = req.headers;
        let mut effects = Effects::default();
        if self.active(Phase::BeforeProviderHeaders).next().is_none()
            && self.active(Phase::BeforeProviderRequest).next().is_none()
        {
            return RequestResult {
                verdict: Verdict::Continue,
                headers,
                body: None,
                effects,
                body_parsed: false,
                keys: KeyCheck::NotChecked,
                model: req.model.map(str::to_owned),
            };
        }
        let encoded = crate::observer::decode::content_coding(&headers).is_some();
        let store = BodyStore::default();
        let mut body = LazyBody::new(req.body, req.prompt, encoded, &store);
        let info = Info {
            provider: req.provider,
            api: req.api,
            method: req.method,
            host: req.host,
            path: req.path,
        };
        let mut verdict = Verdict::Continue;
        let mut model = req.model.map(str::to_owned);
        // A repeated key reads one way here and another upstream (a last-wins parser
        // takes the later value): refused under enforce, else read as upstream reads it.
        let keys = body.key_check();
        if let Some(pointer) = keys.repeated() {
            if let Some(strict) = self.rules.iter().find(|r| r.enabled && r.enforce) {
                verdict = Verdict::Respond(ambiguous(strict, pointer));
            } else if let Ok(root) = body.root() {
                model = root.str_field("model");
            }
        }
        let received_model = model.clone();
        for phase in [Phase::BeforeProviderHeaders, Phase::BeforeProviderRequest] {
            let mut st = State {
                info,
                model: model.take(),
                headers: &mut headers,
                request_headers: None,
                status: None,
                body: Some(&mut body),
                effects: &mut effects,
                rule: String::new(),
                secrets: &self.secret_headers,
                event: None,
                decision: None,
            };
            if verdict != Verdict::Continue {
                break;
            }
            verdict = self.run(phase, &mut st);
            model = st.model.take();
        }
        if verdict == Verdict::Continue
            && (body.root_if_parsed().is_some_and(|r| r.is_dirty())
                || effects.max_breakpoints.is_some())
            && let Ok(root) = body.root()
        {
            let max = effects.max_breakpoints.unwrap_or(limits::MAX_BREAKPOINTS);
            for fix in limits::enforce(root, max) {
                effects.changed(fix.pointer.clone());
                effects
                    .edits
                    .push((LIMITS_FIXER.to_owned(), fix.pointer.clone()));
                effects.note(LIMITS_FIXER, fix.to_string());
            }
        }
        let body_parsed = body.was_parsed();
        let changed = match verdict {
            Verdict::Continue => body.changed(),
            Verdict::Respond(_) => None,
        };
        if let Some(new) = &changed {
            if body.was_encoded() {
                headers.remove(header::CONTENT_ENCODING);
            }
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(new.body().len()));
        }
        RequestResult {
            verdict,
            headers,
            body: changed,
            effects,
            body_parsed,
            keys,
            model: received_model,
        }
    }

    /// Runs after_provider_response on a response head: may change `response_headers`.
    #[allow(clippy::too_many_arguments)]
    pub fn apply_response(
        &self,
        provider: Provider,
        api: Api,
        method: &Method,
        host: Option<&str>,
        path: &str,
        model: Option<&str>,
        request_headers: &HeaderMap,
        status: StatusCode,
        response_headers: &mut HeaderMap,
    ) -> Effects {
        let mut effects = Effects::default();
        if self.active(Phase::AfterProviderResponse).next().is_none() {
            return effects;
        }
        let mut st = State {
            info: Info {
                provider,
                api,
                method,
                host,
                path,
            },
            model: model.map(str::to_owned),
            headers: response_headers,
            request_headers: Some(request_headers),
            status: Some(status),
            body: None,
            effects: &mut effects,
            rule: String::new(),
            secrets: &self.secret_headers,
            event: None,
            decision: None,
        };
        // Blocks are not allowed in this phase (the loader refuses them).
        let _ = self.run(Phase::AfterProviderResponse, &mut st);
        effects
    }

    /// Runs the rules of one phase in order; each sees what the previous ones left.
    fn run(&self, phase: Phase, st: &mut State<'_, '_>) -> Verdict {
        for rule in self.active(phase) {
            st.rule.clone_from(&rule.name);
            match rule.when.eval(st) {
                Tri::Yes => {}
                Tri::No => continue,
                Tri::Unknown(why) if rule.enforce => {
                    st.effects.fired.push(rule.name.clone());
                    return Verdict::Respond(unevaluable(rule, &why));
                }
                Tri::Unknown(why) => {
                    st.log(format!("not applied (fails open): {why}"));
                    continue;
                }
            }
            st.effects.fired.push(rule.name.clone());
            for a in &rule.actions {
                match a.action.apply(st) {
                    Ok(None) => {}
                    Ok(Some(block)) => return Verdict::Respond(block),
                    Err(why) if rule.enforce => {
                        return Verdict::Respond(unevaluable(rule, &format!("{}: {why}", a.key)));
                    }
                    Err(why) => st.log(format!("{} not applied (fails open): {why}", a.key)),
                }
            }
        }
        Verdict::Continue
    }
}

/// The refusal of a body with a repeated key while `strict`, an `enforce` rule, is
/// loaded: the status and type of a default `block`.
fn ambiguous(strict: &Rule, pointer: &str) -> Block {
    Block {
        status: BLOCK_STATUS,
        error_type: None,
        message: format!(
            "the request body repeats the key at {pointer} in one object, so it reads \
             differently to different JSON parsers; promptgate refuses such bodies \
             while enforce rules are loaded"
        ),
        rule: strict.name.clone(),
    }
}

/// The 400 an `enforce` rule answers with when it cannot be evaluated.
fn unevaluable(rule: &Rule, why: &str) -> Block {
    Block {
        status: StatusCode::BAD_REQUEST,
        error_type: Some("invalid_request_error".into()),
        message: format!(
            "rule {:?} is enforced and could not be evaluated: {why}",
            rule.name
        ),
        rule: rule.name.clone(),
    }
}

#[cfg(test)]
mod tests;

//! The phase contract every policy implements.
//!
//! A policy sees an exchange at the phases of the agent extension-event model and
//! decides: continue, continue with a changed value (what later policies and the
//! provider see), or answer the client now. The exchange's driver runs the policies
//! of a phase in load order, times each, and writes what they decided; a policy never
//! writes the record. The TOML rules ([`crate::rules`]) are the first
//! implementation; hooks, budgets and the outgoing-secrets scanner are more.

mod chain;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, StatusCode};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

pub(crate) use chain::EventChain;

use crate::id::ExchangeId;
use crate::prompt::{Prompt, PromptCell};
use crate::provider::{Api, Provider};

/// The four phases, named as in the agent extension-event model. The names are the
/// `on` values of rules, used as written in TOML, logs and docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Runs first, once the request body is read and the model known: sees the
    /// outgoing headers (hop-by-hop removed), may set or remove them, or answer.
    BeforeProviderHeaders,
    /// Runs next, right before the upstream request is built: sees the payload as
    /// earlier policies left it and may replace it, or answer. The final payload is
    /// what is sent.
    BeforeProviderRequest,
    /// Runs when the upstream's status and headers arrive, before the body streams:
    /// may set or remove response headers. Never touches the body.
    AfterProviderResponse,
    /// Runs on each event of an SSE answer as it arrives: may change or drop what
    /// the client receives, or end the stream.
    ProviderStreamEvent,
}

impl Phase {
    /// Every phase, in the order an exchange meets them.
    pub const ALL: [Phase; 4] = [
        Phase::BeforeProviderHeaders,
        Phase::BeforeProviderRequest,
        Phase::AfterProviderResponse,
        Phase::ProviderStreamEvent,
    ];

    /// The name used in rule files, hooks and logs.
    pub fn name(self) -> &'static str {
        match self {
            Phase::BeforeProviderHeaders => "before_provider_headers",
            Phase::BeforeProviderRequest => "before_provider_request",
            Phase::AfterProviderResponse => "after_provider_response",
            Phase::ProviderStreamEvent => "provider_stream_event",
        }
    }

    /// The phase of a name as [`Phase::name`] spells it.
    pub fn from_name(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// What the client is answered with instead of the provider's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub status: StatusCode,
    /// The provider error type (`permission_error`, …); by default it follows the status.
    pub error_type: Option<String>,
    pub message: String,
    /// The policy (a rule's name) that answered.
    pub rule: String,
    /// When asking again may succeed (a budget's window resets): sent as
    /// `retry-after`, in whole seconds.
    pub retry_after: Option<std::time::Duration>,
}

/// What happens to the request when a policy cannot do its part (a hook that fails
/// or times out, a budget store that cannot be written): `on_error` in rule files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Let the request go, and say so in the log and on the record.
    Allow,
    /// Refuse it.
    Block,
}

impl OnError {
    /// Its name in rule files.
    pub fn name(self) -> &'static str {
        match self {
            OnError::Allow => "allow",
            OnError::Block => "block",
        }
    }
}

/// What a policy decided at one phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Go on: to the next policy, then to the provider (a changed value is in the
    /// phase's object).
    Continue,
    /// Answer the client with this error; the upstream is never contacted.
    Respond(Block),
}

/// The facts of an exchange every phase reads, each decided once by the exchange.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// The exchange's id (`None` outside an exchange: `rules test`, unit tests).
    pub id: Option<ExchangeId>,
    pub provider: Provider,
    pub api: Api,
    pub method: &'a Method,
    pub host: Option<&'a str>,
    /// The upstream path, without the query.
    pub path: &'a str,
    /// The model the provider will read: the last `model` of the body, its key and
    /// value decoded.
    pub model: Option<&'a str>,
    /// Whether the body as received carries a `Content-Encoding`.
    pub encoded: bool,
    /// Tags set so far, by earlier phases and policies.
    pub tags: &'a [String],
    /// The conversation the exchange belongs to, decided once by the exchange when a
    /// policy [reads it](Policy::reads_conversation) (`None` otherwise, or unknown).
    pub conversation: Option<&'a str>,
    /// The prompt-cache tokens the provider is predicted to read for this request,
    /// when a policy [reads it](Policy::reads_prediction) and the analysis knows the
    /// conversation.
    pub predicted_read: Option<u64>,
}

/// How an exchange ended, for the policies that charge for it
/// ([`Policy::exchange_ended`]).
#[derive(Debug, Clone, Copy)]
pub struct Ending<'a> {
    pub id: ExchangeId,
    pub model: Option<&'a str>,
    /// The conversation, when the exchange decided it.
    pub conversation: Option<&'a str>,
    /// The answer's id (Anthropic's message id, OpenAI's response id).
    pub response_id: Option<&'a str>,
    /// What the provider said the exchange used; `None` when it said nothing (an
    /// answer cut before its usage, or no answer at all).
    pub usage: Option<&'a crate::provider::Usage>,
    /// Whether the provider answered with a 2xx (a stream cut later included).
    pub answered: bool,
}

/// The request as the request phases leave it: what goes upstream.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The headers to send (hop-by-hop already removed).
    pub headers: HeaderMap,
    /// The body to send: as received (maybe compressed) until a policy replaces it.
    pub body: Bytes,
    /// The model of `body`, decoded (read on first use, shared).
    pub prompt: PromptCell,
    /// Whether a policy replaced the received payload.
    pub replaced: bool,
}

impl Outgoing {
    /// Replaces the payload for later policies and for the actual request, fixing
    /// the framing headers (the new body is identity-encoded).
    pub fn replace(&mut self, payload: Prompt) {
        self.replace_cell(PromptCell::of(payload));
    }

    /// [`Outgoing::replace`] with a payload already in a cell.
    pub fn replace_cell(&mut self, payload: PromptCell) {
        self.headers.remove(http::header::CONTENT_ENCODING);
        self.headers.insert(
            http::header::CONTENT_LENGTH,
            http::HeaderValue::from(payload.body().len()),
        );
        self.body = payload.body().clone();
        self.prompt = payload;
        self.replaced = true;
    }
}

/// The response head as `after_provider_response` sees it.
#[derive(Debug)]
pub struct ResponseHead<'a> {
    pub status: StatusCode,
    /// The response headers the client will get; a policy may change them.
    pub headers: &'a mut HeaderMap,
    /// The request headers as sent upstream.
    pub request_headers: &'a HeaderMap,
}

/// What a policy did besides its decision, for the record and the log. The driver
/// gathers it; the record is written from it once, at the end.
#[derive(Debug, Default)]
pub struct Effects {
    /// Names that fired (rules), in order.
    pub fired: Vec<String>,
    pub tags: Vec<String>,
    /// Log lines (`log` actions, fail-open errors, fix-ups), each with who wrote it.
    pub logs: Vec<(String, String)>,
    /// JSON pointers changed in the body, in the order changed.
    pub body_diff: Vec<String>,
    /// `Some(false)` when a policy turned capture off.
    pub capture: Option<bool>,
    /// Extra patterns the capture redacts.
    pub redactions: Vec<regex::Regex>,
    /// Headers whose values are secrets (never stored or logged).
    pub secret_headers: Vec<HeaderName>,
    /// The breakpoint limit asked for (default 4).
    pub max_breakpoints: Option<usize>,
    /// Who changed what, in order: (policy, JSON pointer of a body node, or
    /// `header NAME`).
    pub edits: Vec<(String, String)>,
    /// Whether a policy parsed the body (the no-parse guarantee's tests read it).
    pub parsed_body: bool,
    /// What the current turn's [`PolicyRun::decision`] says instead of its default
    /// (a hook's `error: timeout after 1000 ms (allowed)`); the driver takes it.
    pub outcome: Option<String>,
    /// What the outgoing-secrets scanner found in the request (never a value).
    pub findings: Vec<Finding>,
    /// When the rule set that ran was loaded (ms since the epoch).
    pub rules_loaded_ms: Option<u64>,
}

impl Effects {
    /// Adds a log line written by `who`.
    pub fn note(&mut self, who: &str, line: impl Into<String>) {
        self.logs.push((who.to_owned(), line.into()));
    }

    /// Notes a changed body pointer (once).
    pub fn changed(&mut self, pointer: String) {
        if !self.body_diff.contains(&pointer) {
            self.body_diff.push(pointer);
        }
    }

    /// Adds `other`'s effects after this one's.
    pub fn extend(&mut self, other: Effects) {
        self.fired.extend(other.fired);
        for t in other.tags {
            if !self.tags.contains(&t) {
                self.tags.push(t);
            }
        }
        self.logs.extend(other.logs);
        for p in other.body_diff {
            self.changed(p);
        }
        if other.capture == Some(false) {
            self.capture = Some(false);
        }
        self.redactions.extend(other.redactions);
        for h in other.secret_headers {
            if !self.secret_headers.contains(&h) {
                self.secret_headers.push(h);
            }
        }
        if other.max_breakpoints.is_some() {
            self.max_breakpoints = other.max_breakpoints;
        }
        self.edits.extend(other.edits);
        self.parsed_body |= other.parsed_body;
        self.findings.extend(other.findings);
        self.rules_loaded_ms = self.rules_loaded_ms.or(other.rules_loaded_ms);
    }
}

/// One value the outgoing-secrets scanner found in a request: what and where,
/// never the value itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// The detector that found it (`aws-access-key`, `email`, or an admin's own).
    pub detector: String,
    /// `secret` or `pii`.
    pub kind: String,
    /// Where in the prompt: `messages[12].content[3]`, with the tool it belongs to
    /// when there is one (`messages[5].content[0] (tool_result of Read)`).
    pub location: String,
    /// What was done: `block`, `mask`, `mask_and_restore`, `tag`, `log`, or `found`
    /// (no scan acts on it; a rule's `found` test read it).
    pub action: String,
    /// The `[[scan]]` that acted, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scan: Option<String>,
}

/// One policy's turn at one phase, as the driver recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRun {
    pub policy: String,
    pub phase: Phase,
    /// `continue`, `changed` or `respond`.
    pub decision: String,
    /// How long it took, in microseconds.
    pub took_us: u64,
}

/// A change made to one event of a stream, for the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventEdit {
    /// The event's place in the stream, from 0.
    pub index: u32,
    pub event: String,
    pub rule: String,
    /// `mask`, `drop_event` or `block`.
    pub action: String,
    /// The event's data as the client received it, when it was rewritten.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent: Option<String>,
}

/// What per-event policies did to one stream, filled while it streams and read
/// once it ended.
#[derive(Debug, Default, Clone)]
pub struct StreamReport {
    pub fired: Vec<String>,
    pub tags: Vec<String>,
    pub logs: Vec<(String, String)>,
    pub edits: Vec<EventEdit>,
    pub blocked: Option<Block>,
}

/// The report a stream's policies share with the exchange.
pub(crate) type SharedReport = Arc<Mutex<StreamReport>>;

/// A policy's engine for one SSE answer: fed whole raw events in order, it releases
/// the bytes the client gets. It does no IO.
pub trait EventPolicy: Send {
    /// Whether it may change, drop or hold events (else bytes pass as they come).
    fn may_change(&self) -> bool;
    /// Takes one raw event; what may go out now is appended to `out`. `Some` ends
    /// the stream with that block.
    fn push(&mut self, raw: Bytes, now: Instant, out: &mut Vec<Bytes>) -> Option<Block>;
    /// Releases held events whose time is up.
    fn release_due(&mut self, now: Instant, out: &mut Vec<Bytes>);
    /// When the oldest held event must go out.
    fn next_release(&self) -> Option<Instant>;
    /// The stream ended: releases everything held.
    fn finish(&mut self, out: &mut Vec<Bytes>);
}

/// The phase contract. Every method has a default that does nothing and continues,
/// so a policy implements only the phases it acts in; [`Policy::runs`] tells the
/// driver which, so a phase no policy runs costs nothing.
pub trait Policy: Send + Sync {
    /// The name the record and the log give it.
    fn name(&self) -> &str;

    /// Whether it does anything in `phase`.
    fn runs(&self, phase: Phase) -> bool;

    /// `before_provider_headers`: the outgoing headers, before the payload phase.
    fn before_provider_headers(
        &self,
        _facts: &Facts<'_>,
        _request: &mut Outgoing,
        _effects: &mut Effects,
    ) -> Decision {
        Decision::Continue
    }

    /// `before_provider_request`: the payload as earlier policies left it; a policy
    /// that replaces it calls [`Outgoing::replace`].
    fn before_provider_request(
        &self,
        _facts: &Facts<'_>,
        _request: &mut Outgoing,
        _effects: &mut Effects,
    ) -> Decision {
        Decision::Continue
    }

    /// `after_provider_response`: the response head, before the body streams.
    fn after_provider_response(
        &self,
        _facts: &Facts<'_>,
        _head: &mut ResponseHead<'_>,
        _effects: &mut Effects,
    ) -> Decision {
        Decision::Continue
    }

    /// `provider_stream_event`: the engine that sees each event of this SSE answer,
    /// with the report it fills; `None` when nothing of it applies.
    fn provider_stream_event(
        &self,
        _facts: &Facts<'_>,
        _head: &ResponseHead<'_>,
    ) -> Option<(Box<dyn EventPolicy>, SharedReport)> {
        None
    }

    /// The engine that sees an answer that is not a stream (plain JSON) whole, as one
    /// event, once it has all come; what it releases is what the client gets. `None`
    /// when nothing of it applies.
    fn provider_json_answer(
        &self,
        _facts: &Facts<'_>,
        _head: &ResponseHead<'_>,
    ) -> Option<(Box<dyn EventPolicy>, SharedReport)> {
        None
    }

    /// Whether it wants [`Policy::exchange_ended`] called.
    fn reads_end(&self) -> bool {
        false
    }

    /// The exchange ended (answered, cut, failed or answered by a policy): called
    /// once, off the request path, with what the provider said it used.
    fn exchange_ended(&self, _end: &Ending<'_>) {}

    /// Whether it reads [`Facts::predicted_read`]: the exchange then asks the cache
    /// analysis before the request phases (a cut of the body on the request path).
    fn reads_prediction(&self) -> bool {
        false
    }

    /// Whether it reads [`Facts::conversation`]: the exchange then decides it before
    /// the request phases (else it is left undecided, at no cost).
    fn reads_conversation(&self) -> bool {
        false
    }

    /// Whether its turn at `phase` waits on IO (a hook): the driver then awaits
    /// [`Policy::request_waiting`] or [`Policy::response_waiting`] instead of the
    /// synchronous method, so a slow policy never blocks the worker's runtime.
    fn waits(&self, _phase: Phase) -> bool {
        false
    }

    /// The request phases of a policy that [`Policy::waits`]: as the synchronous
    /// methods, as a future.
    fn request_waiting<'a>(
        &'a self,
        _phase: Phase,
        _facts: Facts<'a>,
        _request: &'a mut Outgoing,
        _effects: &'a mut Effects,
    ) -> PolicyFuture<'a> {
        Box::pin(std::future::ready(Decision::Continue))
    }

    /// `after_provider_response` of a policy that [`Policy::waits`].
    fn response_waiting<'a, 'h: 'a>(
        &'a self,
        _facts: Facts<'a>,
        _head: &'a mut ResponseHead<'h>,
        _effects: &'a mut Effects,
    ) -> PolicyFuture<'a> {
        Box::pin(std::future::ready(Decision::Continue))
    }
}

/// The turn of a policy that waits on IO (see [`Policy::waits`]).
pub(crate) type PolicyFuture<'a> = Pin<Box<dyn Future<Output = Decision> + Send + 'a>>;

/// Where an exchange takes its policies from when it begins: their current version
/// (the rules and hooks as last reloaded, in load order), which the exchange keeps
/// until it ends.
pub(crate) trait PolicySource: Send + Sync {
    fn current(&self) -> Vec<Arc<dyn Policy>>;
}

/// Runs `phase` for every policy that acts in it, in order, stopping at the first
/// that answers. Each policy's effects join `effects`; each turn is timed into `runs`.
pub(crate) async fn run_request_phase(
    policies: &[Arc<dyn Policy>],
    phase: Phase,
    facts: &Facts<'_>,
    request: &mut Outgoing,
    effects: &mut Effects,
    runs: &mut Vec<PolicyRun>,
) -> Decision {
    for policy in policies.iter().filter(|p| p.runs(phase)) {
        let turn = Turn::begin(effects);
        let decision = match phase {
            _ if policy.waits(phase) => {
                policy
                    .request_waiting(phase, *facts, request, effects)
                    .await
            }
            Phase::BeforeProviderHeaders => policy.before_provider_headers(facts, request, effects),
            _ => policy.before_provider_request(facts, request, effects),
        };
        if turn.end(policy.as_ref(), phase, decision.clone(), effects, runs) {
            return decision;
        }
    }
    Decision::Continue
}

/// Runs `after_provider_response` for every policy that acts in it, in order.
pub(crate) async fn run_response_phase(
    policies: &[Arc<dyn Policy>],
    facts: &Facts<'_>,
    head: &mut ResponseHead<'_>,
    effects: &mut Effects,
    runs: &mut Vec<PolicyRun>,
) -> Decision {
    let phase = Phase::AfterProviderResponse;
    for policy in policies.iter().filter(|p| p.runs(phase)) {
        let turn = Turn::begin(effects);
        let decision = if policy.waits(phase) {
            policy.response_waiting(*facts, head, effects).await
        } else {
            policy.after_provider_response(facts, head, effects)
        };
        if turn.end(policy.as_ref(), phase, decision.clone(), effects, runs) {
            return decision;
        }
    }
    Decision::Continue
}

/// One policy's turn being timed: when it began and how many edits there were.
struct Turn {
    began: std::time::Instant,
    edits_before: usize,
}

impl Turn {
    fn begin(effects: &Effects) -> Turn {
        Turn {
            began: std::time::Instant::now(),
            edits_before: effects.edits.len(),
        }
    }

    /// Notes the turn in `runs`; true when the policy answered (the phase stops).
    fn end(
        self,
        policy: &dyn Policy,
        phase: Phase,
        decision: Decision,
        effects: &mut Effects,
        runs: &mut Vec<PolicyRun>,
    ) -> bool {
        let changed = effects.edits.len() > self.edits_before;
        runs.push(PolicyRun {
            policy: policy.name().to_owned(),
            phase,
            decision: effects
                .outcome
                .take()
                .unwrap_or_else(|| decision_name(&decision, changed).into()),
            took_us: micros(self.began.elapsed()),
        });
        decision != Decision::Continue
    }
}

/// The stream engines of every policy that acts on this answer's events (`sse`), or
/// on a JSON answer whole, chained in load order (each sees what the previous
/// released), with their reports.
pub(crate) fn stream_phase(
    policies: &[Arc<dyn Policy>],
    facts: &Facts<'_>,
    head: &ResponseHead<'_>,
    sse: bool,
) -> Option<(Box<dyn EventPolicy>, Vec<SharedReport>)> {
    let mut engines = Vec::new();
    let mut reports = Vec::new();
    for policy in policies
        .iter()
        .filter(|p| p.runs(Phase::ProviderStreamEvent))
    {
        let engine = if sse {
            policy.provider_stream_event(facts, head)
        } else {
            policy.provider_json_answer(facts, head)
        };
        if let Some((engine, report)) = engine {
            engines.push(engine);
            reports.push(report);
        }
    }
    match engines.len() {
        0 => None,
        1 => engines.pop().map(|e| (e, reports)),
        _ => Some((Box::new(EventChain::new(engines)), reports)),
    }
}

fn decision_name(decision: &Decision, changed: bool) -> &'static str {
    match decision {
        Decision::Respond(_) => "respond",
        Decision::Continue if changed => "changed",
        Decision::Continue => "continue",
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

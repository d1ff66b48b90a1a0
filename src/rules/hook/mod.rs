//! Programmable hooks: `[[hook]]` tables in the rules files, each a policy that
//! hands the exchange's event (JSON, `docs/hook-event.schema.json`) to a program —
//! a command per event, a co-process, or an HTTP service — and applies the
//! decision it answers. Hooks and rules of a phase run in one order, the load
//! order: the set is cut into slices of rules between hooks ([`RuleSet::policies`]).

mod patch;
mod transport;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde_json::Value;
use toml::de::DeValue;

use super::load::{Cx, Val};
use super::matcher::{Matcher, Tri};
use super::{BLOCK_STATUS, Info, RuleSet, State};
use crate::policy::{
    Block, Decision, Effects, Facts, Outgoing, Phase, Policy, PolicyFuture, ResponseHead,
    SharedReport,
};
use crate::prompt::{Prompt, PromptCell};

use transport::Answer;

/// The version of the event JSON (`version` in every event).
pub(crate) const EVENT_VERSION: u32 = 1;

/// A hook's default time limit: 1 s. The agent's request waits on the hook, and
/// an in-process policy service answers in milliseconds; a second is room for a
/// cold `command` start (an interpreter) without making a stuck hook a stuck agent.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest `timeout` a hook may declare: 60 s.
const MAX_TIMEOUT_MS: i64 = 60_001;

// Credential headers are redacted in events unless `secrets = true`: the redactor's list.
use crate::redact::CREDENTIAL_HEADERS;

/// What an event carries in place of a redacted header value.
const REDACTED: &str = "[REDACTED]";

/// Where a hook's event goes.
#[derive(Debug)]
enum Transport {
    Command(Arc<transport::Command>),
    Process(Arc<transport::Process>),
    Http(Arc<transport::Http>),
}

pub(crate) use crate::policy::OnError;

/// One compiled `[[hook]]`.
#[derive(Debug)]
pub struct Hook {
    pub name: String,
    pub phases: Vec<Phase>,
    pub timeout: Duration,
    pub on_error: OnError,
    pub enforce: bool,
    /// Whether the event carries credential headers as they are.
    pub secrets: bool,
    pub file: String,
    pub line: usize,
    /// How many rules were loaded before it: its place in the load order.
    pub(crate) after: usize,
    when: Matcher,
    transport: Transport,
}

const HOOK_KEYS: &[&str] = &[
    "name", "on", "when", "command", "process", "url", "timeout", "on_error", "enforce", "env",
    "secrets", "enabled",
];

/// The phases a hook may run in.
const HOOK_PHASES: [Phase; 3] = [
    Phase::BeforeProviderHeaders,
    Phase::BeforeProviderRequest,
    Phase::AfterProviderResponse,
];

/// The phases a hook's `on` names (an error for each it cannot run in).
fn phases_of(cx: &mut Cx<'_>, item: &Val<'_>, table: &toml::de::DeTable<'_>) -> Vec<Phase> {
    let mut phases = Vec::new();
    match table.get("on") {
        Some(v) => {
            for (text, span) in cx.strings(v, "on").unwrap_or_default() {
                match Phase::from_name(&text).filter(|p| HOOK_PHASES.contains(p)) {
                    Some(p) if !phases.contains(&p) => phases.push(p),
                    Some(_) => {}
                    None => cx.error(
                        span,
                        format!(
                            "a hook cannot run in {text:?} (known: before_provider_headers, before_provider_request, after_provider_response)"
                        ),
                    ),
                }
            }
        }
        None => cx.error(
            item.span(),
            "a hook needs `on` (before_provider_headers, before_provider_request or after_provider_response)",
        ),
    }
    phases
}

/// The one transport a hook names: `command`, `process` or `url`.
fn transport_of(
    cx: &mut Cx<'_>,
    item: &Val<'_>,
    table: &toml::de::DeTable<'_>,
    name: String,
    env: Vec<String>,
) -> Option<Transport> {
    let dir = Path::new(cx.file).parent().map(Path::to_path_buf);
    let transports: Vec<&str> = ["command", "process", "url"]
        .into_iter()
        .filter(|k| table.get(*k).is_some())
        .collect();
    match transports.as_slice() {
        [one] => {
            let v = table.get(*one)?;
            match *one {
                "url" => cx
                    .str(v, "url")
                    .and_then(|text| match text.parse::<http::Uri>() {
                        Ok(uri)
                            if matches!(uri.scheme_str(), Some("http" | "https"))
                                && uri.host().is_some() =>
                        {
                            Some(Transport::Http(Arc::new(transport::Http { url: uri })))
                        }
                        _ => {
                            cx.error(
                                v.span(),
                                format!("url must be an http:// or https:// URL, found {text:?}"),
                            );
                            None
                        }
                    }),
                key => argv(cx, v, key).map(|argv| {
                    if key == "command" {
                        Transport::Command(Arc::new(transport::Command { argv, env, dir }))
                    } else {
                        Transport::Process(Arc::new(transport::Process::new(name, argv, env, dir)))
                    }
                }),
            }
        }
        [] => {
            cx.error(
                item.span(),
                "a hook needs one transport: command = [..], process = [..] or url = \"http://..\"",
            );
            None
        }
        _ => {
            cx.error(
                item.span(),
                format!(
                    "a hook has one transport, found {}",
                    transports.join(" and ")
                ),
            );
            None
        }
    }
}

/// Compiles one `[[hook]]` table (`after`: the rules loaded before it); `None` when
/// it has errors (reported in `cx`) or is disabled.
pub(crate) fn compile(
    cx: &mut Cx<'_>,
    item: &Val<'_>,
    after: usize,
    seen: &mut std::collections::HashMap<String, String>,
) -> Option<Hook> {
    let errors_before = cx.errors.len();
    let table = cx.table(item, "a hook", HOOK_KEYS)?;
    let (line, _) = cx.position(item.span());
    let name = super::load::entry_name(cx, item, table, ("hook", "entitlement"), seen);
    let phases = phases_of(cx, item, table);
    // A hook in several phases is matched with the matchers all of them allow.
    let when = match table.get("when") {
        Some(v) => {
            let mut m = None;
            for p in &phases {
                m = Matcher::compile_when(cx, v, Some(*p));
                if m.is_none() {
                    break;
                }
            }
            if phases.is_empty() {
                Matcher::compile_when(cx, v, None)
            } else {
                m
            }
        }
        None => Some(Matcher::All(Vec::new())),
    };
    let enforce = table
        .get("enforce")
        .and_then(|v| cx.bool(v, "enforce"))
        .unwrap_or(false);
    let enabled = table
        .get("enabled")
        .and_then(|v| cx.bool(v, "enabled"))
        .unwrap_or(true);
    let secrets = table
        .get("secrets")
        .and_then(|v| cx.bool(v, "secrets"))
        .unwrap_or(false);
    let timeout = match table.get("timeout") {
        Some(v) => parse_timeout(cx, v),
        None => Some(DEFAULT_TIMEOUT),
    };
    let on_error = match table.get("on_error") {
        Some(v) => cx.on_error(v),
        None if enforce => {
            cx.error(
                item.span(),
                "a hook with enforce = true must say on_error = \"allow\" or \"block\" explicitly",
            );
            None
        }
        None => Some(OnError::Allow),
    };
    let env = match table.get("env") {
        Some(v) => cx
            .strings(v, "env")
            .map(|list| list.into_iter().map(|(s, _)| s).collect::<Vec<_>>()),
        None => Some(Vec::new()),
    };
    let hook_name = name.as_ref().map_or_else(String::new, |(n, _)| n.clone());
    let transport = transport_of(cx, item, table, hook_name, env.clone().unwrap_or_default());
    let (when, (name, _), timeout, on_error, _, transport) =
        (when?, name?, timeout?, on_error?, env?, transport?);
    if cx.errors.len() != errors_before || !enabled || phases.is_empty() {
        return None;
    }
    Some(Hook {
        name,
        phases,
        timeout,
        on_error,
        enforce,
        secrets,
        file: cx.file.to_owned(),
        line,
        after,
        when,
        transport,
    })
}

fn parse_timeout(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Duration> {
    let text = cx.str(v, "timeout")?;
    let ms = if let Some(n) = text.strip_suffix("ms") {
        n.trim().parse::<i64>().ok()
    } else if let Some(n) = text.strip_suffix('s') {
        n.trim().parse::<f64>().ok().map(|s| (s * 1000.0) as i64)
    } else {
        None
    };
    match ms {
        Some(ms) if (1..MAX_TIMEOUT_MS).contains(&ms) => Some(Duration::from_millis(ms as u64)),
        _ => {
            cx.error(
                v.span(),
                format!("timeout must be like \"500ms\" or \"2s\", between 1 ms and 60 s, found {text:?}"),
            );
            None
        }
    }
}

fn argv(cx: &mut Cx<'_>, v: &Val<'_>, key: &str) -> Option<Vec<String>> {
    if !matches!(v.get_ref(), DeValue::Array(_)) {
        cx.error(
            v.span(),
            format!("{key} is an argv array (e.g. {key} = [\"python3\", \"hook.py\"])"),
        );
        return None;
    }
    let list: Vec<String> = cx.strings(v, key)?.into_iter().map(|(s, _)| s).collect();
    if list.first().is_none_or(String::is_empty) {
        cx.error(v.span(), format!("{key} must name a program"));
        return None;
    }
    Some(list)
}

impl Hook {
    /// Starts what must run before the first event (a co-process).
    pub(crate) fn start(&self) {
        if let Transport::Process(p) = &self.transport {
            p.start();
        }
    }

    /// What `rules check` warns of (a hook that would fail each call): a program
    /// that is not there, a URL that takes no connection. Not an error: the program
    /// may be installed, the service started, before the rules are served.
    pub fn check(&self) -> Option<String> {
        let why = match &self.transport {
            Transport::Command(c) => transport::program_missing(&c.argv, c.dir.as_deref()),
            Transport::Process(p) => p.missing(),
            Transport::Http(h) => transport::url_unreachable(&h.url),
        }?;
        Some(format!(
            "{}:{}: hook {:?}: {why}: each call would fail ({})",
            self.file,
            self.line,
            self.name,
            match self.on_error {
                OnError::Allow => "allowed",
                OnError::Block => "blocked",
            }
        ))
    }

    /// The transport's name, as `rules check` shows it.
    pub fn transport_name(&self) -> &'static str {
        match self.transport {
            Transport::Command(_) => "command",
            Transport::Process(_) => "process",
            Transport::Http(_) => "http",
        }
    }

    /// Sends the event (`id` its event id) and waits up to `timeout` for the answer.
    async fn call(&self, id: String, event: EventBytes) -> Result<Answer, HookError> {
        let rt = transport::runtime();
        let mut handle = match &self.transport {
            Transport::Command(c) => {
                let (c, event) = (c.clone(), event.pieces());
                rt.spawn(async move { c.call(event).await })
            }
            Transport::Http(h) => {
                let (h, event) = (h.clone(), event.pieces());
                rt.spawn(async move { h.call(event).await })
            }
            Transport::Process(p) => {
                // Called from the exchange's own worker: see transport::Process.
                let line = event.line();
                return match tokio::time::timeout(self.timeout, p.call(id, line)).await {
                    Ok(Ok(answer)) => Ok(answer),
                    Ok(Err(e)) => Err(HookError::Call(e)),
                    Err(_) => Err(HookError::Timeout(self.timeout)),
                };
            }
        };
        match tokio::time::timeout(self.timeout, &mut handle).await {
            Ok(Ok(Ok(answer))) => Ok(answer),
            Ok(Ok(Err(e))) => Err(HookError::Call(e)),
            Ok(Err(e)) => Err(HookError::Lost(e.to_string())),
            Err(_) => {
                // Dropping the call kills a command that is still running.
                handle.abort();
                Err(HookError::Timeout(self.timeout))
            }
        }
    }
}

// === the set as policies in load order ===

/// The policies of a set with hooks: the rules before the first hook, the hook,
/// the rules up to the next, and so on. The first slice always comes first (maybe
/// empty): it makes the repeated-key check and runs the stream rules.
/// HTTP hooks trust the roots the upstream trusts (`--upstream-ca`): set at start.
pub(crate) fn trust(config: rustls::ClientConfig) {
    transport::trust(config);
}

/// Waits for `future` outside an exchange (`rules test`, `replay`), driven with the
/// hooks' own runtime, whose thread keeps its IO and timers turning.
pub(super) fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    transport::runtime().block_on(future)
}

pub(super) fn policies(set: &Arc<RuleSet>) -> Vec<Arc<dyn Policy>> {
    let mut out: Vec<Arc<dyn Policy>> = Vec::with_capacity(set.hooks.len() * 2 + 1);
    let mut start = 0;
    for (i, h) in set.hooks.iter().enumerate() {
        if start < h.after || out.is_empty() {
            out.push(Arc::new(RuleSlice {
                set: set.clone(),
                slice: start..h.after,
                first: out.is_empty(),
            }));
            start = h.after;
        }
        out.push(Arc::new(HookTurn {
            set: set.clone(),
            index: i,
        }));
    }
    if start < set.rules.len() {
        out.push(Arc::new(RuleSlice {
            set: set.clone(),
            slice: start..set.rules.len(),
            first: false,
        }));
    }
    out
}

/// The rules at `slice` of a set's load order, as one policy.
struct RuleSlice {
    set: Arc<RuleSet>,
    slice: Range<usize>,
    first: bool,
}

impl RuleSlice {
    fn has(&self, phase: Phase) -> bool {
        self.set
            .active_in(phase, self.slice.clone())
            .next()
            .is_some()
    }

    /// Whether the exchange's request phases run any rule or hook.
    fn request_has_policies(&self) -> bool {
        let set = &self.set;
        set.has_rules(Phase::BeforeProviderHeaders)
            || set.has_rules(Phase::BeforeProviderRequest)
            || set.hooks.iter().any(|h| {
                h.phases.contains(&Phase::BeforeProviderHeaders)
                    || h.phases.contains(&Phase::BeforeProviderRequest)
            })
    }
}

impl Policy for RuleSlice {
    fn name(&self) -> &str {
        "rules"
    }

    // The first slice speaks for the set's `cache.diagnose` (one note per answer).
    fn reads_conversation(&self) -> bool {
        self.first && self.set.diagnoses()
    }

    fn reads_end(&self) -> bool {
        self.first && self.set.diagnoses()
    }

    fn exchange_ended(&self, end: &crate::policy::Ending<'_>) {
        self.set.note_answer(end);
    }

    fn runs(&self, phase: Phase) -> bool {
        match phase {
            // The first slice makes the repeated-key check for every request that
            // has a rule or a hook.
            Phase::BeforeProviderHeaders if self.first => {
                self.has(phase) || self.request_has_policies()
            }
            Phase::ProviderStreamEvent => self.first && self.set.has_rules(phase),
            _ => self.has(phase),
        }
    }

    fn before_provider_headers(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        self.set
            .headers_phase(facts, request, effects, self.slice.clone(), self.first)
    }

    fn before_provider_request(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        self.set
            .request_phase(facts, request, effects, self.slice.clone())
    }

    fn after_provider_response(
        &self,
        facts: &Facts<'_>,
        head: &mut ResponseHead<'_>,
        effects: &mut Effects,
    ) -> Decision {
        self.set
            .response_phase(facts, head, effects, self.slice.clone())
    }

    fn provider_stream_event(
        &self,
        facts: &Facts<'_>,
        head: &ResponseHead<'_>,
    ) -> Option<(Box<dyn crate::policy::EventPolicy>, SharedReport)> {
        // Hooks have no stream phase: the first slice runs every stream rule.
        self.first
            .then(|| Policy::provider_stream_event(&self.set, facts, head))
            .flatten()
    }
}

/// One hook of a set, as a policy.
struct HookTurn {
    set: Arc<RuleSet>,
    index: usize,
}

/// What a hook's turn starts with, decided before any IO.
enum Prepared {
    /// Its `when` did not match: nothing to do.
    Skip,
    /// Decided without calling it (an enforced `when` that cannot be evaluated).
    Decided(Decision),
    /// The event to send, with its id.
    Call(String, EventBytes),
}

impl HookTurn {
    fn hook(&self) -> &Hook {
        &self.set.hooks[self.index]
    }

    /// Matches `when` on the request and builds the event (no IO, nothing held
    /// across the call).
    fn prepare_request(
        &self,
        phase: Phase,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Prepared {
        let hook = self.hook();
        let store = super::body::BodyStore::default();
        let mut body = super::body::LazyBody::new(&request.body, &request.prompt, &store);
        let model = RuleSet::model_of(facts, &mut body);
        let mut st = State {
            info: Info::of(facts),
            model: model.clone(),
            headers: &mut request.headers,
            request_headers: None,
            status: None,
            body: Some(&mut body),
            effects,
            rule: hook.name.clone(),
            secrets: &self.set.secret_headers,
            event: None,
            decision: None,
        };
        let matched = hook.when.eval(&mut st);
        effects.parsed_body |= body.was_parsed();
        if let Some(p) = self.unmatched(matched, effects) {
            return p;
        }
        let payload = (phase == Phase::BeforeProviderRequest).then(|| payload_of(&request.prompt));
        let id = event_id(facts, phase);
        let event = Event {
            phase,
            id: &id,
            facts,
            model: model.as_deref(),
            headers: &request.headers,
            status: None,
            request_headers: None,
            payload,
        }
        .write(&self.redacted());
        Prepared::Call(id, event)
    }

    /// The response-phase twin of [`HookTurn::prepare_request`].
    fn prepare_response(
        &self,
        facts: &Facts<'_>,
        head: &mut ResponseHead<'_>,
        effects: &mut Effects,
    ) -> Prepared {
        let hook = self.hook();
        let mut st = State {
            info: Info::of(facts),
            model: facts.model.map(str::to_owned),
            headers: head.headers,
            request_headers: Some(head.request_headers),
            status: Some(head.status),
            body: None,
            effects,
            rule: hook.name.clone(),
            secrets: &self.set.secret_headers,
            event: None,
            decision: None,
        };
        let matched = hook.when.eval(&mut st);
        if let Some(p) = self.unmatched(matched, effects) {
            return p;
        }
        let id = event_id(facts, Phase::AfterProviderResponse);
        let event = Event {
            phase: Phase::AfterProviderResponse,
            id: &id,
            facts,
            model: facts.model,
            headers: head.headers,
            status: Some(head.status),
            request_headers: Some(head.request_headers),
            payload: None,
        }
        .write(&self.redacted());
        Prepared::Call(id, event)
    }

    /// What `when` decided, unless it matched.
    fn unmatched(&self, matched: Tri, effects: &mut Effects) -> Option<Prepared> {
        let hook = self.hook();
        match matched {
            Tri::Yes => None,
            Tri::No => Some(Prepared::Skip),
            Tri::Unknown(why) if hook.enforce => {
                effects.outcome = Some(format!("error: when: {why} (blocked)"));
                Some(Prepared::Decided(Decision::Respond(Block {
                    status: StatusCode::BAD_REQUEST,
                    error_type: Some("invalid_request_error".into()),
                    message: format!(
                        "hook {:?} is enforced and its `when` could not be evaluated: {why}",
                        hook.name
                    ),
                    rule: hook.name.clone(),
                    retry_after: None,
                })))
            }
            Tri::Unknown(why) => {
                effects.note(&hook.name, format!("not run (fails open): {why}"));
                Some(Prepared::Skip)
            }
        }
    }

    /// The header names whose values an event hides.
    fn redacted(&self) -> Vec<HeaderName> {
        if self.hook().secrets {
            return Vec::new();
        }
        CREDENTIAL_HEADERS
            .iter()
            .map(|n| HeaderName::from_static(n))
            .chain(self.set.secret_headers.iter().cloned())
            .collect()
    }

    /// A failed call: logged once with the hook's name, written on the record's
    /// turn, and decided by `on_error`.
    fn failed(
        &self,
        phase: Phase,
        facts: &Facts<'_>,
        why: &str,
        effects: &mut Effects,
    ) -> Decision {
        let hook = self.hook();
        let blocks = hook.on_error == OnError::Block && phase != Phase::AfterProviderResponse;
        let verdict = if blocks { "blocked" } else { "allowed" };
        let id = facts.id.map(|i| i.to_string()).unwrap_or_default();
        tracing::warn!(target: "promptgate::hooks", hook = %hook.name, id = %id, phase = phase.name(), "hook failed: {why} ({verdict})");
        effects.outcome = Some(format!("error: {why} ({verdict})"));
        if !blocks {
            return Decision::Continue;
        }
        Decision::Respond(Block {
            status: BLOCK_STATUS,
            error_type: None,
            message: format!(
                "hook {:?} failed and its on_error is \"block\": {why}",
                hook.name
            ),
            rule: hook.name.clone(),
            retry_after: None,
        })
    }

    async fn request_turn(
        &self,
        phase: Phase,
        facts: Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        let prepared = self.prepare_request(phase, &facts, request, effects);
        let target = Target::Request {
            request,
            facts: &facts,
        };
        self.turn(phase, &facts, prepared, target, effects).await
    }

    async fn response_turn(
        &self,
        facts: Facts<'_>,
        head: &mut ResponseHead<'_>,
        effects: &mut Effects,
    ) -> Decision {
        let phase = Phase::AfterProviderResponse;
        let prepared = self.prepare_response(&facts, head, effects);
        let target = Target::Response(head.headers);
        self.turn(phase, &facts, prepared, target, effects).await
    }

    /// Calls the hook with a prepared event and applies its answer to `target`; a
    /// failure is decided by `on_error`.
    async fn turn(
        &self,
        phase: Phase,
        facts: &Facts<'_>,
        prepared: Prepared,
        mut target: Target<'_, '_>,
        effects: &mut Effects,
    ) -> Decision {
        let (id, event) = match prepared {
            Prepared::Skip => {
                effects.outcome = Some("skipped".into());
                return Decision::Continue;
            }
            Prepared::Decided(d) => return d,
            Prepared::Call(id, event) => (id, event),
        };
        // The provider's head has come: a hook cannot answer instead of it.
        let answers = !matches!(target, Target::Response(_));
        let answer = self.hook().call(id, event).await;
        let decided = answer.and_then(|a| Ok(self.decide(phase, a, &mut target, effects)?));
        match decided {
            Ok(d) if answers => d,
            Ok(_) => Decision::Continue,
            Err(why) => self.failed(phase, facts, &why.to_string(), effects),
        }
    }
}

impl Policy for HookTurn {
    fn name(&self) -> &str {
        &self.hook().name
    }

    fn runs(&self, phase: Phase) -> bool {
        self.hook().phases.contains(&phase)
    }

    fn waits(&self, phase: Phase) -> bool {
        self.runs(phase)
    }

    // The event names the conversation.
    fn reads_conversation(&self) -> bool {
        true
    }

    // The request's event carries the predicted cache read.
    fn reads_prediction(&self) -> bool {
        self.hook().phases.contains(&Phase::BeforeProviderRequest)
    }

    fn request_waiting<'a>(
        &'a self,
        phase: Phase,
        facts: Facts<'a>,
        request: &'a mut Outgoing,
        effects: &'a mut Effects,
    ) -> PolicyFuture<'a> {
        Box::pin(self.request_turn(phase, facts, request, effects))
    }

    fn response_waiting<'a, 'h: 'a>(
        &'a self,
        facts: Facts<'a>,
        head: &'a mut ResponseHead<'h>,
        effects: &'a mut Effects,
    ) -> PolicyFuture<'a> {
        Box::pin(self.response_turn(facts, head, effects))
    }
}

/// The event's id: unique among a co-process's events in flight (one hook runs
/// once per phase of an exchange).
fn event_id(facts: &Facts<'_>, phase: Phase) -> String {
    match facts.id {
        Some(id) => format!("{id}:{}", phase.name()),
        None => transport::Process::next_id(),
    }
}

/// The payload as an event carries it: the exact bytes, when they are a JSON object.
fn payload_of(prompt: &PromptCell) -> Option<Bytes> {
    matches!(prompt.get().shape(), crate::prompt::Shape::Object(_)).then(|| prompt.body().clone())
}

// === the event ===

/// One event, written as the JSON of `docs/hook-event.schema.json`.
struct Event<'e> {
    phase: Phase,
    id: &'e str,
    facts: &'e Facts<'e>,
    model: Option<&'e str>,
    /// Request phases: the outgoing request headers; response: the response headers.
    headers: &'e HeaderMap,
    status: Option<StatusCode>,
    request_headers: Option<&'e HeaderMap>,
    /// `Some(None)`: a request whose body is no JSON object (`payload` is null).
    payload: Option<Option<Bytes>>,
}

/// An event as written: every field but the payload, and the payload (the body's
/// own bytes) that closes it, kept apart so a co-process gets both in one vectored
/// write and the body is never copied on promptgate's side.
// A `process` hook at 200 KB: the event's copy and its fresh pages were a quarter of the hook's samples.
#[derive(Debug)]
struct EventBytes {
    /// The JSON up to `"payload":` when `payload` follows; the whole event otherwise.
    head: Bytes,
    payload: Option<Bytes>,
}

impl EventBytes {
    /// The event in pieces, as they are (a command's stdin, an HTTP body): the
    /// kernel's copy is the body's only one.
    // An `http` hook at 200 KB joined them first: a fresh 200 KB buffer per event.
    fn pieces(self) -> Vec<Bytes> {
        let Some(payload) = self.payload else {
            return vec![self.head];
        };
        vec![self.head, payload, Bytes::from_static(b"}")]
    }

    /// The event as a co-process's line, in pieces: JSON whitespace newlines become
    /// spaces (a newline inside a JSON string is always escaped), then its one
    /// newline. Only a body with raw newlines is copied.
    fn line(self) -> Vec<Bytes> {
        let Some(payload) = self.payload else {
            return vec![self.head, Bytes::from_static(b"\n")];
        };
        let payload = if memchr::memchr2(b'\n', b'\r', &payload).is_some() {
            let mut owned = payload.to_vec();
            for b in &mut owned {
                if *b == b'\n' || *b == b'\r' {
                    *b = b' ';
                }
            }
            Bytes::from(owned)
        } else {
            payload
        };
        vec![self.head, payload, Bytes::from_static(b"}\n")]
    }
}

impl Event<'_> {
    fn write(&self, redacted: &[HeaderName]) -> EventBytes {
        let f = self.facts;
        let mut out = Vec::with_capacity(1024);
        let mut head = serde_json::Map::new();
        head.insert("version".into(), EVENT_VERSION.into());
        head.insert("phase".into(), self.phase.name().into());
        head.insert("id".into(), self.id.into());
        head.insert(
            "exchange".into(),
            f.id.map_or(Value::Null, |i| i.to_string().into()),
        );
        head.insert("provider".into(), f.provider.name().into());
        head.insert("api".into(), f.api.name().into());
        head.insert("method".into(), f.method.as_str().into());
        head.insert("path".into(), f.path.into());
        head.insert("model".into(), self.model.map_or(Value::Null, Into::into));
        let class = self
            .request_headers
            .unwrap_or(self.headers)
            .get("x-claude-code-request-class")
            .and_then(|v| v.to_str().ok());
        head.insert(
            "request_class".into(),
            class.map_or(Value::Null, Into::into),
        );
        head.insert(
            "conversation".into(),
            f.conversation.map_or(Value::Null, Into::into),
        );
        head.insert("tags".into(), f.tags.into());
        if let Some(body) = self.payload.as_ref().and_then(Option::as_ref) {
            // What only promptgate knows before the answer: an estimate, not a count.
            let (tokens, usd) = super::budget::estimate_input(self.model, body.len());
            head.insert(
                "estimate".into(),
                serde_json::json!({
                    "input_tokens": tokens,
                    "input_usd": usd,
                    "cache_read_tokens": f.predicted_read,
                }),
            );
        }
        if let Some(status) = self.status {
            head.insert("status".into(), status.as_u16().into());
        }
        head.insert("headers".into(), headers_json(self.headers, redacted));
        if let Some(sent) = self.request_headers {
            head.insert("request_headers".into(), headers_json(sent, redacted));
        }
        // Writing a Map to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, &Value::Object(head));
        let mut payload = None;
        if let Some(body) = &self.payload {
            // The body goes in as it is: spliced, never re-serialised.
            out.pop();
            out.extend_from_slice(b",\"payload\":");
            match body {
                Some(bytes) => payload = Some(bytes.clone()),
                None => out.extend_from_slice(b"null}"),
            }
        }
        EventBytes {
            head: Bytes::from(out),
            payload,
        }
    }
}

/// Headers as a JSON object, repeated names joined with ", ", `redacted` hidden.
fn headers_json(headers: &HeaderMap, redacted: &[HeaderName]) -> Value {
    let mut map = serde_json::Map::new();
    for name in headers.keys() {
        let value = if redacted.contains(name) {
            REDACTED.to_owned()
        } else {
            headers
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect::<Vec<_>>()
                .join(", ")
        };
        map.insert(name.as_str().to_owned(), value.into());
    }
    Value::Object(map)
}

// === the decision ===

/// What a decision may change.
enum Target<'t, 'f> {
    Request {
        request: &'t mut Outgoing,
        facts: &'t Facts<'f>,
    },
    Response(&'t mut HeaderMap),
}

const DECISION_KEYS: &[&str] = &["payload", "patch", "headers", "tags", "log", "block", "id"];

/// Headers a hook may not set or remove: the framing is promptgate's.
const FRAMING: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "content-encoding",
    "host",
];

/// Why a hook gave no decision: `on_error` decides what the exchange does.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HookError {
    /// Its transport failed: the program, the co-process or the service.
    #[error(transparent)]
    Call(transport::CallError),
    /// The task that ran the call ended without an answer (it panicked or the
    /// hooks' runtime is gone).
    #[error("the call failed: {0}")]
    Lost(String),
    #[error("timeout after {} ms", .0.as_millis())]
    Timeout(Duration),
    #[error(transparent)]
    Answer(#[from] AnswerError),
}

/// What is wrong with a hook's answer: it is no decision promptgate can apply, so
/// `on_error` decides.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AnswerError {
    #[error("the answer is not JSON ({reason}): {preview:?}")]
    NotJson { reason: String, preview: String },
    #[error("the answer is not a JSON object: {0:?}")]
    NotObject(String),
    #[error("unknown key {key:?} in the decision (known: {known})")]
    UnknownKey { key: String, known: String },
    /// A field of the decision of the wrong kind.
    #[error("{field} must be {expected}")]
    Field {
        field: String,
        expected: &'static str,
    },
    #[error("{0} cannot answer after the response head came")]
    TooLate(&'static str),
    #[error("payload and patch are for before_provider_request, not {0}")]
    WrongPhase(&'static str),
    #[error("a decision has payload or patch, not both")]
    PayloadAndPatch,
    #[error("patch: the payload is not JSON ({0})")]
    PayloadNotJson(String),
    #[error(transparent)]
    Patch(#[from] patch::PatchError),
    #[error("{0:?} is not a header name")]
    HeaderName(String),
    #[error("the new payload cannot be written: {0}")]
    Write(String),
    #[error("a hook cannot change {0} (promptgate frames the request)")]
    Framing(String),
}

impl AnswerError {
    fn field(field: impl Into<String>, expected: &'static str) -> AnswerError {
        AnswerError::Field {
            field: field.into(),
            expected,
        }
    }
}

impl HookTurn {
    /// Applies an answer; `Err` is a failure (`on_error` decides). Nothing is
    /// changed unless the whole decision is valid.
    fn decide(
        &self,
        phase: Phase,
        answer: Answer,
        target: &mut Target<'_, '_>,
        effects: &mut Effects,
    ) -> Result<Decision, AnswerError> {
        let hook = self.hook();
        let bytes = match answer {
            Answer::Block(stderr) => {
                if phase == Phase::AfterProviderResponse {
                    return Err(AnswerError::TooLate("exit 2 (block)"));
                }
                effects.fired.push(hook.name.clone());
                let message = if stderr.is_empty() {
                    format!("blocked by hook {:?}", hook.name)
                } else {
                    stderr
                };
                effects.outcome = Some("respond".into());
                return Ok(Decision::Respond(Block {
                    status: BLOCK_STATUS,
                    error_type: None,
                    message,
                    rule: hook.name.clone(),
                    retry_after: None,
                }));
            }
            Answer::Decision(b) => b,
        };
        let text = bytes.trim_ascii();
        if text.is_empty() {
            return Ok(Decision::Continue);
        }
        let value: Value = serde_json::from_slice(text).map_err(|e| AnswerError::NotJson {
            reason: e.to_string(),
            preview: preview(text),
        })?;
        let Value::Object(d) = value else {
            return Err(AnswerError::NotObject(preview(text)));
        };
        if let Some(k) = d.keys().find(|k| !DECISION_KEYS.contains(&k.as_str())) {
            return Err(AnswerError::UnknownKey {
                key: k.clone(),
                known: DECISION_KEYS.join(", "),
            });
        }
        let parsed = parse_decision(phase, d, target)?;
        self.apply(parsed, target, effects)
    }

    /// Applies a valid decision: its tags, log line, block, headers and payload.
    fn apply(
        &self,
        decision: ParsedDecision,
        target: &mut Target<'_, '_>,
        effects: &mut Effects,
    ) -> Result<Decision, AnswerError> {
        let hook = self.hook();
        let ParsedDecision {
            tags,
            log,
            block,
            headers,
            new_body,
        } = decision;
        if !tags.is_empty()
            || log.is_some()
            || block.is_some()
            || headers.is_some()
            || new_body.is_some()
        {
            effects.fired.push(hook.name.clone());
        }
        for t in tags {
            if !effects.tags.contains(&t) {
                effects.tags.push(t);
            }
        }
        if let Some(line) = log {
            effects.note(&hook.name, line);
        }
        if let Some(b) = block {
            return Ok(Decision::Respond(Block {
                rule: hook.name.clone(),
                ..b
            }));
        }
        if let Some((set, remove)) = headers {
            let map: &mut HeaderMap = match target {
                Target::Request { request, .. } => &mut request.headers,
                Target::Response(h) => h,
            };
            for name in remove {
                if map.remove(&name).is_some() {
                    effects
                        .edits
                        .push((hook.name.clone(), format!("header {name}")));
                }
            }
            for (name, value) in set {
                effects
                    .edits
                    .push((hook.name.clone(), format!("header {name}")));
                map.insert(name, value);
            }
        }
        if let (Some((doc, pointers)), Target::Request { request, facts }) = (new_body, target) {
            let bytes = serde_json::to_vec(&doc).map_err(|e| AnswerError::Write(e.to_string()))?;
            for p in pointers {
                effects.edits.push((hook.name.clone(), p.clone()));
                effects.changed(p);
            }
            replace_payload(request, facts, bytes, effects);
        }
        Ok(Decision::Continue)
    }
}

/// Puts a hook's payload in place, through the cache_control limits rule edits go
/// through (a fix-up is recorded as the cache_control policy's).
fn replace_payload(
    request: &mut Outgoing,
    facts: &Facts<'_>,
    bytes: Vec<u8>,
    effects: &mut Effects,
) {
    let format = crate::prompt::Format::of_request(facts.provider, facts.api);
    let cell = PromptCell::of(Prompt::read(Bytes::from(bytes), format));
    let fixed = {
        let store = super::body::BodyStore::default();
        let mut body = super::body::LazyBody::new(cell.body(), &cell, &store);
        match body.root() {
            Ok(root) => {
                let max = effects
                    .max_breakpoints
                    .unwrap_or(super::limits::MAX_BREAKPOINTS);
                for fix in super::limits::enforce(root, max) {
                    effects.changed(fix.pointer.clone());
                    effects
                        .edits
                        .push((super::LIMITS_FIXER.to_owned(), fix.pointer.clone()));
                    effects.note(super::LIMITS_FIXER, fix.to_string());
                }
                body.changed()
            }
            Err(_) => None,
        }
    };
    match fixed {
        Some(prompt) => request.replace(prompt),
        None => request.replace_cell(cell),
    }
}

/// A hook's decision, read whole before anything is applied.
struct ParsedDecision {
    tags: Vec<String>,
    log: Option<String>,
    block: Option<Block>,
    headers: Option<HeaderEdits>,
    /// The new payload and the pointers it changed.
    new_body: Option<(Value, Vec<String>)>,
}

/// Reads the decision object `d` (its keys already checked) for `phase`.
fn parse_decision(
    phase: Phase,
    mut d: serde_json::Map<String, Value>,
    target: &mut Target<'_, '_>,
) -> Result<ParsedDecision, AnswerError> {
    let tags: Vec<String> = match d.remove("tags") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|t| match t {
                Value::String(s) => Ok(s),
                _ => Err(AnswerError::field("tags", "strings")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(AnswerError::field("tags", "an array of strings")),
    };
    let log = match d.remove("log") {
        None => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => return Err(AnswerError::field("log", "a string")),
    };
    let block = d.remove("block").map(parse_block).transpose()?;
    let headers = d.remove("headers").map(parse_headers).transpose()?;
    let payload = d.remove("payload");
    let patch = d.remove("patch");
    if block.is_some() && phase == Phase::AfterProviderResponse {
        return Err(AnswerError::TooLate("block"));
    }
    let new_body = match (payload, patch, &mut *target) {
        (None, None, _) => None,
        (_, _, Target::Request { .. }) if phase != Phase::BeforeProviderRequest => {
            return Err(AnswerError::WrongPhase(phase.name()));
        }
        (_, _, Target::Response(_)) => {
            return Err(AnswerError::WrongPhase(Phase::AfterProviderResponse.name()));
        }
        (Some(p @ Value::Object(_)), None, _) => Some((p, vec![String::new()])),
        (Some(_), None, _) => return Err(AnswerError::field("payload", "a JSON object")),
        (Some(_), Some(_), _) => return Err(AnswerError::PayloadAndPatch),
        (None, Some(ops), Target::Request { request, .. }) => {
            let mut doc: Value = serde_json::from_slice(request.prompt.body())
                .map_err(|e| AnswerError::PayloadNotJson(e.to_string()))?;
            let changed = patch::apply(&mut doc, &ops)?;
            Some((doc, changed))
        }
    };
    Ok(ParsedDecision {
        tags,
        log,
        block,
        headers,
        new_body,
    })
}

fn parse_block(v: Value) -> Result<Block, AnswerError> {
    let Value::Object(b) = v else {
        return Err(AnswerError::field(
            "block",
            "an object (message, status, type)",
        ));
    };
    let message = match b.get("message") {
        None => "blocked by a hook".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(AnswerError::field("block.message", "a string")),
    };
    let status = match b.get("status") {
        None => BLOCK_STATUS,
        Some(n) => n
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| (400..600).contains(n))
            .and_then(|n| StatusCode::from_u16(n).ok())
            .ok_or(AnswerError::field(
                "block.status",
                "an HTTP status from 400 to 599",
            ))?,
    };
    let error_type = match b.get("type") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(AnswerError::field("block.type", "a string")),
    };
    Ok(Block {
        status,
        error_type,
        message,
        rule: String::new(),
        retry_after: None,
    })
}

type HeaderEdits = (Vec<(HeaderName, HeaderValue)>, Vec<HeaderName>);

fn parse_headers(v: Value) -> Result<HeaderEdits, AnswerError> {
    let Value::Object(h) = v else {
        return Err(AnswerError::field(
            "headers",
            "an object ({\"set\": {..}, \"remove\": [..]})",
        ));
    };
    let name_of = |n: &str| -> Result<HeaderName, AnswerError> {
        let name = HeaderName::from_bytes(n.as_bytes())
            .map_err(|_| AnswerError::HeaderName(n.to_owned()))?;
        if FRAMING.contains(&name.as_str()) {
            return Err(AnswerError::Framing(name.to_string()));
        }
        Ok(name)
    };
    let mut set = Vec::new();
    let mut remove = Vec::new();
    for (k, v) in h {
        match (k.as_str(), v) {
            ("set", Value::Object(m)) => {
                for (n, val) in m {
                    let Value::String(val) = val else {
                        return Err(AnswerError::field(format!("headers.set.{n}"), "a string"));
                    };
                    let value = HeaderValue::from_str(&val).map_err(|_| {
                        AnswerError::field(format!("headers.set.{n}"), "a valid header value")
                    })?;
                    set.push((name_of(&n)?, value));
                }
            }
            ("remove", Value::Array(names)) => {
                for n in names {
                    let Value::String(n) = n else {
                        return Err(AnswerError::field("headers.remove", "header names"));
                    };
                    remove.push(name_of(&n)?);
                }
            }
            (other, _) => {
                return Err(AnswerError::field(
                    format!("headers.{other}"),
                    "set (an object) or remove (an array)",
                ));
            }
        }
    }
    Ok((set, remove))
}

/// The start of a bad answer, for the error line.
fn preview(text: &[u8]) -> String {
    let s = String::from_utf8_lossy(&text[..text.len().min(80)]);
    s.into_owned()
}

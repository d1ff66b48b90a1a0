//! Hook rules: TOML files that inspect, rewrite or block requests and note responses.
//!
//! A [`RuleSet`] is compiled from the rules directory (`load.rs`), kept live in a
//! [`reload::LiveRules`] and swapped whole on a valid change. Each exchange takes the
//! set once and runs it in four [`Phase`]s (the last, per event of a stream, in
//! [`stream`]). Rules do no IO: they work on a request
//! or response head held in memory, so `rules test` and unit tests need no sockets.

pub(crate) mod action;
mod body;
pub(crate) mod budget;
mod deferred;
pub(crate) mod hook;
mod limits;
mod load;
mod matcher;
pub(crate) mod reload;
pub(crate) mod secrets;
mod shape;
pub(crate) mod stream;

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, StatusCode};

pub(crate) use load::LoadError;
pub(crate) use load::read_dir;

use action::CompiledAction;
use body::{BodyStore, LazyBody, Node};
use matcher::{Matcher, Tri};

pub(crate) use crate::policy::{Block, Decision, Effects, Phase};
use crate::policy::{Facts, Outgoing, Policy, PolicyRun, ResponseHead, SharedReport};
use crate::prompt::KeyCheck;
use crate::prompt::PromptCell;
use crate::provider::{Api, Provider};

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
    /// The hooks, in load order (each knows how many rules precede it).
    hooks: Vec<hook::Hook>,
    /// The outgoing-secrets scanner, when a `[[scan]]` or a rule's `found` test asks
    /// for one: it runs first at before_provider_request.
    scanner: Option<Arc<secrets::Scanner>>,
    /// The budgets, as one policy: it runs last at before_provider_request, on the
    /// payload as it will go.
    budgets: Option<Arc<budget::Budgets>>,
    /// Each file read, with its number of rules.
    pub files: Vec<(String, usize)>,
    /// The directory it was loaded from.
    pub dir: Option<PathBuf>,
    /// Header names whose values rules read from the environment (secrets).
    pub secret_headers: Vec<HeaderName>,
    /// What compiled but is almost surely a mistake, as `file:line:col: message`.
    pub warnings: Vec<LoadError>,
    /// When it was compiled (ms since the epoch; 0 for a set made in code).
    pub loaded_at_ms: u64,
}

/// The status of a `block` that names none, of `model.allow` and of the
/// repeated-key refusal: 451, measured with Claude Code (tests/claude_code.rs):
/// it prints the message and sends the request once. A 403 reads "Failed to
/// authenticate", and a 400 or 422 is sent 6 times in a second.
pub(crate) const BLOCK_STATUS: StatusCode = StatusCode::UNAVAILABLE_FOR_LEGAL_REASONS;

/// The name the cache_control policy's breakpoint-limit fix-ups go under in
/// [`Effects::edits`] and the log.
pub(crate) const LIMITS_FIXER: &str = "cache_control policy";

/// The request as rules see it: what was asked, the outgoing headers, the body.
#[derive(Debug)]
pub struct RequestCtx<'a> {
    /// The exchange, when there is one (replay names the captured one; a budget
    /// holds and charges by it).
    pub id: Option<crate::id::ExchangeId>,
    pub provider: Provider,
    pub api: Api,
    pub method: &'a Method,
    pub host: Option<&'a str>,
    /// The upstream path, without the query.
    pub path: &'a str,
    /// The model as sniffed (no body parse).
    pub model: Option<&'a str>,
    /// The conversation the request belongs to, when known (placeholders of masked
    /// values are the same for the same value in one conversation).
    pub conversation: Option<&'a str>,
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
    pub verdict: Decision,
    /// The headers to send (content-length and content-encoding fixed when the body changed).
    pub headers: HeaderMap,
    /// The new body and its model when rules changed it (identity-encoded), else
    /// `None`: send the original.
    pub body: Option<PromptCell>,
    pub effects: Effects,
    /// Whether the body was parsed (for the no-parse guarantee's tests).
    pub body_parsed: bool,
    /// Whether the body repeats a key in one object, when rules looked (they then
    /// read each repeated key's last value).
    pub keys: KeyCheck,
    /// The model as rules read it: the last `model` when the body repeats it.
    pub model: Option<String>,
    /// Each policy's turn, when hooks ran too ([`RuleSet::apply_request_all`]).
    pub runs: Vec<PolicyRun>,
}

/// The fixed facts of a request that every phase reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Info<'a> {
    pub(crate) provider: Provider,
    pub(crate) api: Api,
    pub(crate) method: &'a Method,
    pub(crate) host: Option<&'a str>,
    pub(crate) path: &'a str,
    /// The conversation, when the exchange decided it.
    pub(crate) conversation: Option<&'a str>,
}

impl<'a> Info<'a> {
    fn of(facts: &Facts<'a>) -> Info<'a> {
        Info {
            provider: facts.provider,
            api: facts.api,
            method: facts.method,
            host: facts.host,
            path: facts.path,
            conversation: facts.conversation,
        }
    }
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
    pub(crate) fn root(&mut self) -> Result<&mut Node<'a>, body::BodyError> {
        match self.body.as_mut() {
            Some(b) => b.root(),
            None => Err(body::BodyError::NoRequest),
        }
    }

    /// Whether this is a request phase of a request that has no body at all.
    pub(crate) fn body_less(&self) -> bool {
        self.body.as_ref().is_some_and(|b| b.size() == 0)
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
        self.active_in(phase, 0..self.rules.len())
    }

    /// The enabled rules of `phase` among those at `slice` in load order.
    fn active_in(&self, phase: Phase, slice: Range<usize>) -> impl Iterator<Item = &Rule> {
        self.rules
            .get(slice)
            .unwrap_or_default()
            .iter()
            .filter(move |r| r.enabled && r.phase == phase)
    }

    /// The hooks, in load order.
    pub fn hooks(&self) -> &[hook::Hook] {
        &self.hooks
    }

    /// Starts what hooks need running before their first event (co-processes).
    pub fn start_hooks(&self) {
        for h in &self.hooks {
            h.start();
        }
    }

    /// The set as policies in load order: itself when it has no hooks, else the
    /// slices of rules between hooks, and the hooks (see [`hook`]).
    pub fn policies(self: &Arc<Self>) -> Vec<Arc<dyn Policy>> {
        let mut out: Vec<Arc<dyn Policy>> = Vec::new();
        if let Some(scanner) = &self.scanner {
            out.push(scanner.clone());
        }
        if self.hooks.is_empty() {
            out.push(Arc::new(self.clone()));
        } else {
            out.extend(hook::policies(self));
        }
        if let Some(budgets) = &self.budgets {
            out.push(budgets.clone());
        }
        out
    }

    /// The budgets, when the set has any.
    pub(crate) fn budgets(&self) -> Option<&budget::Budgets> {
        self.budgets.as_deref()
    }

    /// Whether a rule asks the provider for its cache diagnosis (`cache.diagnose`):
    /// then the exchange decides the conversation and each answer's id is noted.
    fn diagnoses(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.enabled && r.actions.iter().any(|a| a.key == "cache.diagnose"))
    }

    /// Notes an ended exchange's answer id as its conversation's last, for the next
    /// turn's `cache.diagnose`.
    fn note_answer(&self, end: &crate::policy::Ending<'_>) {
        if let (true, Some(c), Some(id)) = (end.answered, end.conversation, end.response_id) {
            action::diagnose::note_answer(c, id);
        }
    }

    /// Whether a rule tests what the outgoing-secrets scanner found.
    fn uses_found(&self) -> bool {
        self.rules.iter().any(|r| r.when.uses_found())
    }

    /// The outgoing-secrets scanner, when the set has one.
    pub(crate) fn scanner(&self) -> Option<&secrets::Scanner> {
        self.scanner.as_deref()
    }

    /// Runs before_provider_headers then before_provider_request on a request, as
    /// the exchange's driver runs them with the rules as the only policy (for
    /// tests of the rules alone).
    pub fn apply_request(&self, req: RequestCtx<'_>) -> RequestResult {
        self.request_with(req, |facts, out, effects, _| {
            let mut verdict = Decision::Continue;
            for phase in [Phase::BeforeProviderHeaders, Phase::BeforeProviderRequest] {
                if !self.runs(phase) {
                    continue;
                }
                verdict = match phase {
                    Phase::BeforeProviderHeaders => {
                        self.headers_phase(facts, out, effects, self.all(), true)
                    }
                    _ => self.request_phase(facts, out, effects, self.all()),
                };
                if verdict != Decision::Continue {
                    break;
                }
            }
            verdict
        })
    }

    /// [`RuleSet::apply_request`] with the hooks too, every policy in load order as
    /// the exchange runs them (for `rules test` and `replay`); each turn is in
    /// [`RequestResult::runs`].
    pub fn apply_request_all(self: &Arc<Self>, req: RequestCtx<'_>) -> RequestResult {
        if self.hooks.is_empty() && self.scanner.is_none() && self.budgets.is_none() {
            return self.apply_request(req);
        }
        self.start_hooks();
        let policies = self.policies();
        self.request_with(req, |facts, out, effects, runs| {
            hook::block_on(async {
                let mut verdict = Decision::Continue;
                for phase in [Phase::BeforeProviderHeaders, Phase::BeforeProviderRequest] {
                    verdict = crate::policy::run_request_phase(
                        &policies, phase, facts, out, effects, runs,
                    )
                    .await;
                    if verdict != Decision::Continue {
                        break;
                    }
                }
                verdict
            })
        })
    }

    /// The request phases run by `run` on `req`, and what they left.
    fn request_with(
        &self,
        req: RequestCtx<'_>,
        run: impl FnOnce(&Facts<'_>, &mut Outgoing, &mut Effects, &mut Vec<PolicyRun>) -> Decision,
    ) -> RequestResult {
        let encoded = crate::provider::content_coding(&req.headers).is_some();
        let model = req.model.map(str::to_owned);
        let facts = Facts {
            id: req.id,
            provider: req.provider,
            api: req.api,
            method: req.method,
            host: req.host,
            path: req.path,
            model: req.model,
            encoded,
            tags: &[],
            conversation: req.conversation,
            predicted_read: None,
        };
        let mut out = Outgoing {
            headers: req.headers,
            body: req.body.clone(),
            prompt: req.prompt.clone(),
            replaced: false,
        };
        let mut effects = Effects::default();
        let mut runs = Vec::new();
        let verdict = run(&facts, &mut out, &mut effects, &mut runs);
        let keys = if self.runs(Phase::BeforeProviderHeaders) {
            req.prompt
                .if_read()
                .map_or(KeyCheck::NotChecked, |p| p.keys().clone())
        } else {
            KeyCheck::NotChecked
        };
        let body_parsed = effects.parsed_body;
        let body = match verdict {
            Decision::Continue if out.replaced => Some(out.prompt),
            _ => None,
        };
        RequestResult {
            verdict,
            headers: out.headers,
            body,
            effects,
            body_parsed,
            keys,
            model,
            runs,
        }
    }

    /// Runs after_provider_response on a response head: may change `response_headers`.
    pub fn apply_response(
        &self,
        facts: &Facts<'_>,
        status: StatusCode,
        request_headers: &HeaderMap,
        response_headers: &mut HeaderMap,
    ) -> Effects {
        let mut effects = Effects::default();
        let mut head = ResponseHead {
            status,
            headers: response_headers,
            request_headers,
        };
        let _ = self.response_phase(facts, &mut head, &mut effects, self.all());
        effects
    }

    /// The model as rules read it: the last `model` when the body repeats a key
    /// (as the provider reads it), else the exchange's.
    fn model_of(facts: &Facts<'_>, body: &mut LazyBody<'_>) -> Option<String> {
        if body.key_check().repeated().is_some()
            && let Ok(root) = body.root()
        {
            return root.str_field("model");
        }
        facts.model.map(str::to_owned)
    }

    /// Runs the rules of one phase in order; each sees what the previous ones left.
    fn run(&self, phase: Phase, st: &mut State<'_, '_>) -> Decision {
        self.run_in(phase, self.all(), st)
    }

    /// Every rule's place in load order.
    fn all(&self) -> Range<usize> {
        0..self.rules.len()
    }

    /// Runs the rules of one phase at `slice` in load order.
    fn run_in(&self, phase: Phase, slice: Range<usize>, st: &mut State<'_, '_>) -> Decision {
        for rule in self.active_in(phase, slice) {
            st.rule.clone_from(&rule.name);
            match rule.when.eval(st) {
                Tri::Yes => {}
                Tri::No => continue,
                Tri::Unknown(why) if rule.enforce => {
                    st.effects.fired.push(rule.name.clone());
                    return Decision::Respond(unevaluable(rule, &why));
                }
                // A side request with no body (GET /v1/models) is no mistake to log
                // for every body rule on every such request.
                Tri::Unknown(_) if st.body_less() => continue,
                Tri::Unknown(why) => {
                    st.log(format!("not applied (fails open): {why}"));
                    continue;
                }
            }
            st.effects.fired.push(rule.name.clone());
            for a in &rule.actions {
                match a.action.apply(st) {
                    Ok(None) => {}
                    Ok(Some(block)) => return Decision::Respond(block),
                    Err(why) if rule.enforce => {
                        return Decision::Respond(unevaluable(rule, &format!("{}: {why}", a.key)));
                    }
                    Err(why) => st.log(format!("{} not applied (fails open): {why}", a.key)),
                }
            }
        }
        Decision::Continue
    }
}

/// The request and response phases, as the [`Policy`] impl runs them.
impl RuleSet {
    /// Whether it does anything in `phase`.
    pub fn runs(&self, phase: Phase) -> bool {
        match phase {
            // The repeated-key check runs here whenever the request has rules.
            Phase::BeforeProviderHeaders => {
                self.has_rules(phase) || self.has_rules(Phase::BeforeProviderRequest)
            }
            _ => self.has_rules(phase),
        }
    }

    /// `slice`: the rules that run (all, or those between two hooks); `first`:
    /// whether this run makes the repeated-key check (once per exchange).
    fn headers_phase(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
        slice: Range<usize>,
        first: bool,
    ) -> Decision {
        let store = BodyStore::default();
        let mut body = LazyBody::new(&request.body, &request.prompt, &store);
        // A repeated key reads one way here and another upstream (a last-wins parser
        // takes the later value): refused under enforce, else read as upstream reads it.
        if first
            && let Some(pointer) = body.key_check().repeated()
            && let Some(strict) = self.strict()
        {
            return Decision::Respond(ambiguous(strict, pointer));
        }
        if self
            .active_in(Phase::BeforeProviderHeaders, slice.clone())
            .next()
            .is_none()
        {
            return Decision::Continue;
        }
        let model = Self::model_of(facts, &mut body);
        let mut st = State {
            info: Info::of(facts),
            model,
            headers: &mut request.headers,
            request_headers: None,
            status: None,
            body: Some(&mut body),
            effects,
            rule: String::new(),
            secrets: &self.secret_headers,
            event: None,
            decision: None,
        };
        let decision = self.run_in(Phase::BeforeProviderHeaders, slice, &mut st);
        effects.parsed_body |= body.was_parsed();
        decision
    }

    fn request_phase(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
        slice: Range<usize>,
    ) -> Decision {
        let store = BodyStore::default();
        let mut body = LazyBody::new(&request.body, &request.prompt, &store);
        let model = Self::model_of(facts, &mut body);
        let mut headers = std::mem::take(&mut request.headers);
        let mut st = State {
            info: Info::of(facts),
            model,
            headers: &mut headers,
            request_headers: None,
            status: None,
            body: Some(&mut body),
            effects,
            rule: String::new(),
            secrets: &self.secret_headers,
            event: None,
            decision: None,
        };
        let decision = self.run_in(Phase::BeforeProviderRequest, slice, &mut st);
        if self.loaded_at_ms > 0 {
            effects.rules_loaded_ms = Some(self.loaded_at_ms);
        }
        if decision == Decision::Continue
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
        effects.parsed_body |= body.was_parsed();
        let changed = match decision {
            Decision::Continue => body.changed(),
            Decision::Respond(_) => None,
        };
        request.headers = headers;
        if let Some(new) = changed {
            request.replace(new);
        }
        decision
    }

    fn response_phase(
        &self,
        facts: &Facts<'_>,
        head: &mut ResponseHead<'_>,
        effects: &mut Effects,
        slice: Range<usize>,
    ) -> Decision {
        let mut st = State {
            info: Info::of(facts),
            model: facts.model.map(str::to_owned),
            headers: head.headers,
            request_headers: Some(head.request_headers),
            status: Some(head.status),
            body: None,
            effects,
            rule: String::new(),
            secrets: &self.secret_headers,
            event: None,
            decision: None,
        };
        // Blocks are not allowed in this phase (the loader refuses them).
        let _ = self.run_in(Phase::AfterProviderResponse, slice, &mut st);
        Decision::Continue
    }
}

/// The rules are a policy: the first implementation of the phase contract.
impl Policy for Arc<RuleSet> {
    fn name(&self) -> &str {
        "rules"
    }

    fn reads_conversation(&self) -> bool {
        self.diagnoses()
    }

    fn reads_end(&self) -> bool {
        self.diagnoses()
    }

    fn exchange_ended(&self, end: &crate::policy::Ending<'_>) {
        self.note_answer(end);
    }

    fn runs(&self, phase: Phase) -> bool {
        RuleSet::runs(self, phase)
    }

    fn before_provider_headers(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        self.headers_phase(facts, request, effects, self.all(), true)
    }

    fn before_provider_request(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        self.request_phase(facts, request, effects, self.all())
    }

    fn after_provider_response(
        &self,
        facts: &Facts<'_>,
        head: &mut ResponseHead<'_>,
        effects: &mut Effects,
    ) -> Decision {
        self.response_phase(facts, head, effects, self.all())
    }

    fn provider_stream_event(
        &self,
        facts: &Facts<'_>,
        head: &ResponseHead<'_>,
    ) -> Option<(Box<dyn crate::policy::EventPolicy>, SharedReport)> {
        let engine = stream::EventRules::new(self.clone(), stream::StreamContext::of(facts, head))?;
        let report = engine.report();
        Some((Box::new(engine), report))
    }
}

impl RuleSet {
    /// The first `enforce` rule or hook, by name: while one is loaded, a body with
    /// a repeated key is refused.
    fn strict(&self) -> Option<&str> {
        self.rules
            .iter()
            .find(|r| r.enabled && r.enforce)
            .map(|r| r.name.as_str())
            .or_else(|| {
                self.hooks
                    .iter()
                    .find(|h| h.enforce)
                    .map(|h| h.name.as_str())
            })
    }
}

/// The refusal of a body with a repeated key while `strict`, an `enforce` rule or
/// hook, is loaded: the status and type of a default `block`.
fn ambiguous(strict: &str, pointer: &str) -> Block {
    Block {
        status: BLOCK_STATUS,
        error_type: None,
        message: format!(
            "the request body repeats the key at {pointer} in one object, so it reads \
             differently to different JSON parsers; promptgate refuses such bodies \
             while enforce rules are loaded"
        ),
        rule: strict.to_owned(),
        retry_after: None,
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
        retry_after: None,
    }
}

#[cfg(test)]
mod tests;

/// The rules `toml` applied to the Anthropic Messages request `body`, received as
/// `prompt`: the body they send (for the tests of the readers of such a body).
#[cfg(test)]
pub(crate) fn derive_for_test(prompt: &PromptCell, body: &Bytes, toml: &str) -> PromptCell {
    let rules = RuleSet::compile(&[("r.toml".into(), toml.into())]).expect("rules that compile");
    let applied = rules.apply_request(RequestCtx {
        id: None,
        provider: Provider::Anthropic,
        api: Api::Messages,
        method: &Method::POST,
        host: None,
        path: "/v1/messages",
        model: None,
        conversation: None,
        headers: HeaderMap::new(),
        body,
        prompt,
    });
    applied.body.expect("the rules change the body")
}

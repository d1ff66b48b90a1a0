//! Replay: a candidate rule set run offline over captured requests, to see
//! before deploying it what it changes, what it blocks, and what it does to
//! prompt caching.
//!
//! Each captured request is taken *as received* (as stored: redacted), read
//! into the same [`Prompt`](crate::prompt::Prompt) the live path reads, and run
//! through [`RuleSet::apply_request`] in captured order. Cache impact compares,
//! per conversation, what the provider reported for the requests as they were
//! sent (the baseline) with what cache analysis predicts for the replayed ones
//! (the candidate), each request at its captured start so that ttls expire as
//! they did. Nothing is sent anywhere and the store is only read.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method};
use serde::Serialize;

use crate::cache::{CacheSettings, CacheStage, Clock, Predicted};
use crate::capture::Store;
use crate::capture::record::CaptureRecord;
use crate::capture::store::{Damaged, Filter, StoreError};
use crate::capture::units::{self, DiffEntry};
use crate::conversation::KeySource;
use crate::id::ExchangeId;
use crate::prompt::Format;
use crate::prompt::PromptCell;
use crate::provider::price::{self as cost, Price};
use crate::provider::{self, Api, Provider, Usage};
use crate::rules::{Decision, LIMITS_FIXER, RequestCtx, RuleSet};

/// How many blocked requests and changed requests the report lists by id.
const LISTED: usize = 20;

/// What one rule did over the replay.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RuleEffect {
    pub rule: String,
    pub phase: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Requests it matched (fired on).
    pub matched: usize,
    /// Requests whose body or headers it changed.
    pub changed: usize,
    /// Requests it blocked.
    pub blocked: usize,
    /// The JSON pointers (and `header NAME`s) it changed, most common first.
    pub pointers: Vec<(String, usize)>,
    /// Conversations it changed a request of.
    pub conversations: usize,
    /// Dollars of the requests only this rule changed, candidate − baseline.
    pub cost_delta: f64,
}

/// A request the candidate blocks: what its client would have seen.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Blocked {
    pub id: String,
    pub rule: String,
    pub status: u16,
    pub message: String,
}

/// Cache tokens and dollars of some requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct Tokens {
    pub read: u64,
    pub write: u64,
    /// Input neither read nor written.
    pub uncached: u64,
    /// The input's dollars, by the price table.
    pub dollars: f64,
}

impl Tokens {
    fn add(&mut self, o: &Tokens) {
        self.read += o.read;
        self.write += o.write;
        self.uncached += o.uncached;
        self.dollars += o.dollars;
    }

    fn total(&self) -> u64 {
        self.read + self.write + self.uncached
    }
}

/// One conversation's cache figures.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct ConversationImpact {
    pub conversation: String,
    pub requests: usize,
    /// What the provider reported for the requests as they were sent.
    pub baseline: Tokens,
    /// What the analysis predicts for those same requests (how far to trust it).
    pub baseline_predicted: Tokens,
    /// The candidate: the actual figures while the replayed requests are the ones
    /// sent, then what the analysis predicts for the replayed ones.
    pub candidate: Tokens,
}

impl ConversationImpact {
    /// Candidate dollars − baseline dollars.
    pub(crate) fn cost_delta(&self) -> f64 {
        self.candidate.dollars - self.baseline.dollars
    }
}

/// Per request, with `--each`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Each {
    pub id: String,
    pub conversation: Option<String>,
    pub rules: Vec<String>,
    pub blocked: bool,
    pub bytes_delta: i64,
    /// The received → replayed diff in cache order, when the rules changed the body.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub diff: Vec<DiffEntry>,
    /// Why the diff could not be made, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_error: Option<String>,
}

/// Everything a replay found.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Report {
    /// Exchanges selected from the store.
    pub selected: usize,
    /// Of them, model requests replayed.
    pub replayed: usize,
    /// Skipped, with why: side requests (not a model call), capture turned off by a rule.
    pub skipped: BTreeMap<String, usize>,
    /// Requests any rule matched, changed, blocked.
    pub matched: usize,
    pub changed: usize,
    pub blocked: usize,
    pub bytes_added: u64,
    pub bytes_removed: u64,
    /// Breakpoint-limit adjustments (cache_control policy fix-ups).
    pub breakpoint_adjustments: usize,
    pub rules: Vec<RuleEffect>,
    pub never_fired: Vec<String>,
    /// The first blocked requests.
    pub blocks: Vec<Blocked>,
    pub conversations: Vec<ConversationImpact>,
    /// Sums over the conversations.
    pub baseline: Tokens,
    pub baseline_predicted: Tokens,
    pub candidate: Tokens,
    pub cost_delta: f64,
    pub tokens_delta: i64,
    /// Requests left out of the cache figures: blocked by the candidate, or
    /// without usage (an error, a cancelled stream).
    pub cache_excluded: usize,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub each: Vec<Each>,
    /// Records left out because they could not be read (counted in `skipped` too).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub damaged: Vec<Damaged>,
}

/// What a replay needs beyond the rules.
pub(crate) struct ReplaySettings {
    pub cache: CacheSettings,
    pub conversation: KeySource,
    /// List each request in [`Report::each`].
    pub each: bool,
}

/// The input tokens of a usage, and what they cost at `price`.
fn priced(u: &Usage, price: Option<Price>) -> Tokens {
    Tokens {
        read: u.cache_read_tokens,
        write: u.cache_write_tokens,
        uncached: u.input_tokens,
        dollars: price.map_or(0.0, |p| cost::cost(&p, u, 0, false).input_usd),
    }
}

/// A prediction as a usage, its estimated tokens scaled by `scale` (the request's
/// actual input over its estimate, so the estimator's error cancels out).
fn predicted_usage(p: &Predicted, scale: f64) -> Usage {
    let at = |n: u64| (n as f64 * scale).round() as u64;
    let total = at(p.total_tokens);
    let read = at(p.prediction.read_tokens);
    let write = at(p.prediction.write_tokens);
    let write_1h = at(p.prediction.write_1h_tokens).min(write);
    Usage {
        input_tokens: total.saturating_sub(read + write),
        cache_read_tokens: read,
        cache_write_tokens: write,
        cache_write_5m_tokens: Some(write - write_1h),
        cache_write_1h_tokens: Some(write_1h),
        ..Usage::default()
    }
}

/// Replays the captured requests `filter` selects through `rules`.
pub(crate) fn replay(
    store: &Store,
    filter: &Filter,
    rules: &Arc<RuleSet>,
    settings: &ReplaySettings,
) -> Result<Report, StoreError> {
    let mut rows = store.list(filter)?;
    rows.sort_by(|a, b| (a.started_ms, &a.id).cmp(&(b.started_ms, &b.id)));
    let mut report = Report {
        selected: rows.len(),
        ..Report::default()
    };
    let mut tally = Tally::new(rules);
    let mut impact = CacheImpact::new(settings);
    // Budgets count on a clock at each captured request's start, so windows pass as
    // they did, and each request that goes is charged what it really used.
    let at = Arc::new(std::sync::atomic::AtomicU64::new(0));
    if rules.budgets().is_some() {
        crate::rules::budget::configure(
            None,
            None,
            crate::runtime::Clock::set_by(at.clone()),
            settings.cache.prices.clone(),
        );
    }
    for row in rows {
        let Some(record) = Damaged::sift(&row.id, store.load(&row.id), &mut report.damaged)? else {
            report.skip("damaged: the record could not be read");
            continue;
        };
        let Some(format) = record.request_format() else {
            report.skip("not a model request");
            continue;
        };
        if !record.captured {
            report.skip("capture was off for it");
            continue;
        }
        report.replayed += 1;
        at.store(
            record.times.started_ms,
            std::sync::atomic::Ordering::Relaxed,
        );
        let outcome = replay_one(&record, format, rules);
        if !outcome.fired.is_empty() {
            report.matched += 1;
        }
        let changed =
            outcome.body.is_some() || outcome.edits.iter().any(|(_, p)| p.starts_with("header "));
        if changed {
            report.changed += 1;
        }
        let received_len = record.request.body.bytes.len() as i64;
        let bytes_delta = outcome
            .body
            .as_ref()
            .map_or(0, |b| b.len() as i64 - received_len);
        if bytes_delta > 0 {
            report.bytes_added += bytes_delta as u64;
        } else {
            report.bytes_removed += bytes_delta.unsigned_abs();
        }
        let changed_by = tally.count(&outcome, record.conversation.as_ref(), &mut report);
        if settings.each {
            report.each.push(Each::of(&record, &outcome, bytes_delta));
        }
        match impact.add(&record, &outcome, format, settings) {
            Some(delta) => {
                // A request only one rule changed is that rule's to answer for.
                if let [only] = changed_by.as_slice() {
                    tally.effects[*only].cost_delta += delta;
                }
            }
            None => report.cache_excluded += 1,
        }
    }
    tally.finish(&mut report);
    for c in impact.conversations.values() {
        report.baseline.add(&c.baseline);
        report.baseline_predicted.add(&c.baseline_predicted);
        report.candidate.add(&c.candidate);
    }
    report.cost_delta = report.candidate.dollars - report.baseline.dollars;
    report.tokens_delta = report.candidate.total() as i64 - report.baseline.total() as i64;
    report.conversations = impact.conversations.into_values().collect();
    Ok(report)
}

impl Report {
    /// Counts a record left out, and why.
    fn skip(&mut self, why: &str) {
        *self.skipped.entry(why.into()).or_default() += 1;
    }
}

/// What each rule (and each outgoing-secrets scan) did over the replay.
struct Tally {
    effects: Vec<RuleEffect>,
    index: HashMap<String, usize>,
    pointers: Vec<HashMap<String, usize>>,
    conversations: Vec<std::collections::HashSet<String>>,
}

impl Tally {
    fn new(rules: &RuleSet) -> Tally {
        let effects: Vec<RuleEffect> = rules
            .rules()
            .iter()
            .map(|r| RuleEffect {
                rule: r.name.clone(),
                phase: r.phase.name().to_owned(),
                description: r.description.clone(),
                ..RuleEffect::default()
            })
            // The budgets too: each refuses what would cross it.
            .chain(
                rules
                    .budgets()
                    .into_iter()
                    .flat_map(|b| b.budgets.iter())
                    .map(|b| RuleEffect {
                        rule: b.name.clone(),
                        phase: crate::policy::Phase::BeforeProviderRequest
                            .name()
                            .to_owned(),
                        description: Some(b.describe()),
                        ..RuleEffect::default()
                    }),
            )
            // The outgoing-secrets scans too: each acts as one policy of its own.
            .chain(
                rules
                    .scanner()
                    .into_iter()
                    .flat_map(|s| s.scans())
                    .map(|s| RuleEffect {
                        rule: s.name.clone(),
                        phase: crate::policy::Phase::BeforeProviderRequest
                            .name()
                            .to_owned(),
                        description: Some(format!("scan: {} → {}", s.selection(), s.action.name())),
                        ..RuleEffect::default()
                    }),
            )
            .collect();
        let index = effects
            .iter()
            .enumerate()
            .map(|(i, e)| (e.rule.clone(), i))
            .collect();
        Tally {
            pointers: vec![HashMap::new(); effects.len()],
            conversations: vec![Default::default(); effects.len()],
            effects,
            index,
        }
    }

    /// Counts what the rules did to one request; returns the rules that changed it.
    fn count(
        &mut self,
        outcome: &Outcome,
        conversation: Option<&String>,
        report: &mut Report,
    ) -> Vec<usize> {
        let mut changed_by: Vec<usize> = Vec::new();
        for (rule, pointer) in &outcome.edits {
            if rule == LIMITS_FIXER {
                report.breakpoint_adjustments += 1;
                continue;
            }
            if let Some(&i) = self.index.get(rule) {
                *self.pointers[i].entry(pointer.clone()).or_default() += 1;
                if !changed_by.contains(&i) {
                    changed_by.push(i);
                }
            }
        }
        for rule in &outcome.fired {
            if let Some(&i) = self.index.get(rule) {
                self.effects[i].matched += 1;
            }
        }
        for &i in &changed_by {
            self.effects[i].changed += 1;
            if let Some(c) = conversation {
                self.conversations[i].insert(c.clone());
            }
        }
        if let Some(block) = &outcome.blocked {
            report.blocked += 1;
            if let Some(&i) = self.index.get(&block.rule) {
                self.effects[i].blocked += 1;
            }
            if report.blocks.len() < LISTED {
                report.blocks.push(block.clone());
            }
        }
        changed_by
    }

    /// Puts each rule's effect, its pointers most changed first, in the report.
    fn finish(mut self, report: &mut Report) {
        for (i, e) in self.effects.iter_mut().enumerate() {
            let mut list: Vec<(String, usize)> = self.pointers[i].drain().collect();
            list.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            e.pointers = list;
            e.conversations = self.conversations[i].len();
        }
        report.never_fired = self
            .effects
            .iter()
            .filter(|e| e.matched == 0)
            .map(|e| e.rule.clone())
            .collect();
        report.rules = self.effects;
    }
}

impl Each {
    /// One request's line: the diff, not the bodies (a long replay keeps only what
    /// it prints).
    fn of(record: &CaptureRecord, outcome: &Outcome, bytes_delta: i64) -> Each {
        let (diff, diff_error) = match &outcome.body {
            Some(replayed) => match units::diff_bodies(&record.request.body.bytes, replayed) {
                Ok(entries) => (entries, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            },
            None => (Vec::new(), None),
        };
        Each {
            id: record.id.clone(),
            conversation: record.conversation.clone(),
            rules: outcome.fired.clone(),
            blocked: outcome.blocked.is_some(),
            bytes_delta,
            diff,
            diff_error,
        }
    }
}

/// The cache's cost as sent and as replayed: two predictors, each with its own
/// history, and each conversation's figures.
struct CacheImpact {
    sent: CacheStage,
    replayed: CacheStage,
    conversations: BTreeMap<String, ConversationImpact>,
    /// Whether the candidate has sent something else in a conversation yet.
    diverged: HashMap<String, bool>,
}

impl CacheImpact {
    fn new(settings: &ReplaySettings) -> CacheImpact {
        let stage = || {
            CacheStage::new(
                settings.cache.clone(),
                settings.conversation.clone(),
                Clock::system(),
            )
        };
        CacheImpact {
            sent: stage(),
            replayed: stage(),
            conversations: BTreeMap::new(),
            diverged: HashMap::new(),
        }
    }

    /// Adds one request; the candidate's dollars minus the baseline's, or `None`
    /// when it has no baseline (unanswered, blocked, the analysis off).
    fn add(
        &mut self,
        record: &CaptureRecord,
        outcome: &Outcome,
        format: Format,
        settings: &ReplaySettings,
    ) -> Option<f64> {
        let usage = record.usage?;
        if outcome.blocked.is_some() || !settings.cache.enabled {
            return None;
        }
        let id = ExchangeId::parse(&record.id)?;
        let start = record.times.started_ms;
        let sent_body = record.sent().bytes.clone();
        let sent = self.sent.predict_only(
            id,
            start,
            format,
            &record.sent_headers(),
            PromptCell::new(sent_body.clone(), Some(format)),
        );
        let replayed_body = outcome
            .body
            .clone()
            .unwrap_or_else(|| record.request.body.bytes.clone());
        let same_body = replayed_body == sent_body;
        let replayed = self.replayed.predict_only(
            id,
            start,
            format,
            &outcome.headers,
            PromptCell::new(replayed_body, Some(format)),
        );
        let (sent, replayed) = (sent?, replayed?);
        let conversation = sent.conversation.clone();
        let scale = if sent.total_tokens > 0 {
            usage.total_input() as f64 / sent.total_tokens as f64
        } else {
            1.0
        };
        let model = record.model.clone().unwrap_or_else(|| sent.model.clone());
        let price = settings.cache.prices.find(&model).map(|(_, p)| p);
        let (sent, replayed) = (
            predicted_usage(&sent, scale),
            predicted_usage(&replayed, scale),
        );
        // Until the candidate sends something else in a conversation, its requests
        // are the ones the provider answered: their figures are the actual ones.
        let diverged = self.diverged.entry(conversation.clone()).or_default();
        *diverged |= !same_body;
        let baseline = priced(&usage, price);
        let baseline_predicted = priced(&sent, price);
        let candidate = if *diverged {
            priced(&replayed, price)
        } else {
            baseline
        };
        let key = record.conversation.clone().unwrap_or(conversation);
        let c = self
            .conversations
            .entry(key.clone())
            .or_insert_with(|| ConversationImpact {
                conversation: key,
                ..ConversationImpact::default()
            });
        c.requests += 1;
        c.baseline.add(&baseline);
        c.baseline_predicted.add(&baseline_predicted);
        c.candidate.add(&candidate);
        Some(candidate.dollars - baseline.dollars)
    }
}

/// What the candidate rules did to one request.
struct Outcome {
    fired: Vec<String>,
    edits: Vec<(String, String)>,
    body: Option<Bytes>,
    headers: HeaderMap,
    blocked: Option<Blocked>,
}

fn replay_one(record: &CaptureRecord, format: Format, rules: &Arc<RuleSet>) -> Outcome {
    let provider = format.provider();
    let api = record
        .api
        .as_deref()
        .and_then(Api::from_name)
        .unwrap_or(Api::Other);
    let method = record.method.parse().unwrap_or(Method::POST);
    // The upstream path, as the rules saw it live: without promptgate's /openai prefix.
    let path = record.path.split('?').next().unwrap_or("").to_owned();
    let path = match provider {
        Provider::OpenAi => path
            .strip_prefix("/openai")
            .map(str::to_owned)
            .unwrap_or(path),
        Provider::Anthropic => path,
    };
    let body = record.request.body.bytes.clone();
    let model = provider::sniff(&body).model;
    let prompt = PromptCell::new(body.clone(), Some(format));
    // The hooks too, in load order: a hook can be tried over captured traffic.
    let id = ExchangeId::parse(&record.id).unwrap_or_default();
    let result = rules.apply_request_all(RequestCtx {
        id: Some(id),
        provider,
        api,
        method: &method,
        host: record.host.as_deref(),
        path: &path,
        model: model.as_deref(),
        conversation: record.conversation.as_deref(),
        headers: record.received_headers(),
        body: &body,
        prompt: &prompt,
    });
    if result.verdict == Decision::Continue {
        // What the budgets hold for it becomes what it used, as when it ended live.
        let end = crate::policy::Ending {
            id,
            model: record.model.as_deref(),
            conversation: record.conversation.as_deref(),
            response_id: None,
            usage: record.usage.as_ref(),
            answered: record
                .response
                .status
                .is_some_and(|s| (200..300).contains(&s)),
        };
        for p in rules.policies().iter().filter(|p| p.reads_end()) {
            p.exchange_ended(&end);
        }
    }
    let blocked = match result.verdict {
        Decision::Respond(b) => Some(Blocked {
            id: record.id.clone(),
            rule: b.rule,
            status: b.status.as_u16(),
            message: b.message,
        }),
        Decision::Continue => None,
    };
    Outcome {
        fired: result.effects.fired,
        edits: result.effects.edits,
        body: result.body.map(|b| b.body().clone()),
        headers: result.headers,
        blocked,
    }
}

/// One `--fail-on` condition: `NAME OP NUMBER`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Condition {
    pub name: String,
    pub op: String,
    pub value: f64,
}

/// The grammar, for usage errors.
pub(crate) const CONDITION_GRAMMAR: &str = "NAME OP NUMBER, NAME one of blocked, changed, cost_delta \
     (dollars), tokens_delta; OP one of >, >=, <, <=, ==; e.g. 'blocked>0' or 'cost_delta>=1.5'";

/// Why a `--fail-on` condition does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BadCondition {
    #[error("--fail-on {0:?}: {1:?} is not a condition name (expected {CONDITION_GRAMMAR})")]
    Name(String, String),
    #[error("--fail-on {0:?}: no comparison after {1:?} (expected {CONDITION_GRAMMAR})")]
    NoComparison(String, String),
    #[error("--fail-on {0:?}: {1:?} is not a number (expected {CONDITION_GRAMMAR})")]
    NotANumber(String, String),
    #[error("--fail-on {0:?}: {1:?} is not a finite number")]
    NotFinite(String, String),
}

impl Condition {
    /// Parses `blocked>0`, `cost_delta >= 1.5`, …
    pub(crate) fn parse(text: &str) -> Result<Condition, BadCondition> {
        let t = text.trim();
        let name_end = t
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(t.len());
        let (name, rest) = t.split_at(name_end);
        if !matches!(name, "blocked" | "changed" | "cost_delta" | "tokens_delta") {
            return Err(BadCondition::Name(text.to_owned(), name.to_owned()));
        }
        let rest = rest.trim_start();
        let op = [">=", "<=", "==", ">", "<"]
            .into_iter()
            .find(|op| rest.starts_with(op))
            .ok_or_else(|| BadCondition::NoComparison(text.to_owned(), name.to_owned()))?;
        let number = rest[op.len()..].trim();
        let value: f64 = number
            .parse()
            .map_err(|_| BadCondition::NotANumber(text.to_owned(), number.to_owned()))?;
        if !value.is_finite() {
            return Err(BadCondition::NotFinite(text.to_owned(), number.to_owned()));
        }
        Ok(Condition {
            name: name.to_owned(),
            op: op.to_owned(),
            value,
        })
    }

    /// Whether it holds for `report`.
    pub(crate) fn holds(&self, report: &Report) -> bool {
        let v = match self.name.as_str() {
            "blocked" => report.blocked as f64,
            "changed" => report.changed as f64,
            "cost_delta" => report.cost_delta,
            _ => report.tokens_delta as f64,
        };
        match self.op.as_str() {
            ">" => v > self.value,
            ">=" => v >= self.value,
            "<" => v < self.value,
            "<=" => v <= self.value,
            _ => v == self.value,
        }
    }
}

impl std::fmt::Display for Condition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}{}", self.name, self.op, self.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_parse_and_hold() {
        let c = Condition::parse("blocked>0").unwrap();
        let mut r = Report::default();
        assert!(!c.holds(&r));
        r.blocked = 1;
        assert!(c.holds(&r));
        let d = Condition::parse(" cost_delta >= -1.5 ").unwrap();
        assert_eq!(
            (d.name.as_str(), d.op.as_str(), d.value),
            ("cost_delta", ">=", -1.5)
        );
        r.cost_delta = -1.5;
        assert!(d.holds(&r));
        assert!(Condition::parse("tokens_delta==0").unwrap().holds(&r));
        for bad in [
            "blocked",
            "blokked>0",
            "blocked=>1",
            "blocked>x",
            "changed>",
            ">1",
            "cost_delta>inf",
        ] {
            let e = Condition::parse(bad).unwrap_err().to_string();
            assert!(e.contains("--fail-on"), "{e}");
        }
        assert!(
            Condition::parse("blocked!1")
                .unwrap_err()
                .to_string()
                .contains(CONDITION_GRAMMAR)
        );
    }
}

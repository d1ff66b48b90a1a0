//! Prompt-cache analysis: for every Anthropic (and OpenAI) exchange, what the
//! provider could reuse, what it did reuse, why not, and what that cost.
//!
//! [`segment`] cuts a request into cache units with a running prefix hash;
//! [`history`] remembers per conversation what was cached when; [`explain`] predicts
//! and then judges against the provider's `usage`; [`cost`] prices it. [`CacheStage`]
//! runs all of it when a record is emitted (before the sinks, off the client's path)
//! and puts a [`CacheReport`] on the record. It never changes a request.

pub(crate) mod anatomy;
pub(crate) mod estimate;
pub(crate) mod explain;
pub(crate) mod history;
pub(crate) mod segment;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::HeaderMap;
use serde::{Deserialize, Serialize};

use crate::conversation::{ConversationCell, KeySource};
use crate::id::ExchangeId;
use crate::prompt::{DriedPrompt, Format, PromptCell, Region, Ttl};
use crate::provider::Usage;
use crate::provider::price::{self as cost, Cost, Price, Table};
use crate::redact::{NAME_MAX, Redactor};
use explain::{Explanation, Prediction, Reason, Request, Verdict, kilo};
pub(crate) use history::Clock;
use history::{History, Millis, Snapshot};
use segment::{CutFrom, IgnoreRule, Segments};

// === settings ===

/// `[cache]` in the config file, as written.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfigLayer {
    /// Turn the analysis off (`false`); on by default.
    pub enabled: Option<bool>,
    /// Units left out of the prefix hash; replaces the default list (the billing header).
    pub ignore: Option<Vec<IgnoreConfig>>,
    /// Minimum cacheable tokens by model pattern, over the defaults.
    pub min_tokens: Option<BTreeMap<String, u64>>,
    /// Prices by model pattern, over the defaults.
    pub prices: Option<BTreeMap<String, Price>>,
    /// How many conversations to remember (least recently active forgotten first).
    pub conversations: Option<usize>,
}

/// One `[[cache.ignore]]` entry: text blocks of `region` whose text matches `text`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IgnoreConfig {
    pub region: String,
    pub text: String,
}

/// The validated cache-analysis settings.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    pub enabled: bool,
    pub ignore: Vec<IgnoreRule>,
    pub min_tokens: Table<u64>,
    pub prices: Table<Price>,
    pub conversations: usize,
}

impl Default for CacheSettings {
    fn default() -> Self {
        CacheSettings {
            enabled: true,
            ignore: vec![IgnoreRule::billing_header()],
            min_tokens: cost::min_tokens(Vec::new()),
            prices: cost::prices(Vec::new()),
            conversations: 64,
        }
    }
}

/// Why a `[cache]` setting is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheSettingError {
    #[error(
        "ignore[{0}].region: {1:?} is not a region (expected \"system\", \"messages\" or \"tools\")"
    )]
    Region(usize, String),
    #[error(
        "ignore[{0}].text: invalid regex {1:?}: {2} (expected e.g. \"^x-anthropic-billing-header:\")"
    )]
    Regex(usize, String, String),
    #[error("prices.{0:?}: prices and multipliers must be numbers >= 0")]
    Price(String),
    #[error("conversations: must be at least 1")]
    NoConversations,
}

impl CacheSettings {
    /// Applies a layer; the error names the key, e.g. `ignore[0].text: …`.
    pub fn apply(&mut self, layer: CacheConfigLayer) -> Result<(), CacheSettingError> {
        if let Some(v) = layer.enabled {
            self.enabled = v;
        }
        if let Some(list) = layer.ignore {
            self.ignore = list
                .into_iter()
                .enumerate()
                .map(|(i, c)| {
                    let region = match c.region.as_str() {
                        "tools" => Region::Tools,
                        "system" => Region::System,
                        "messages" => Region::Messages,
                        other => {
                            return Err(CacheSettingError::Region(i, other.to_owned()));
                        }
                    };
                    let text = regex::Regex::new(&c.text)
                        .map_err(|e| CacheSettingError::Regex(i, c.text.clone(), e.to_string()))?;
                    Ok(IgnoreRule { region, text })
                })
                .collect::<Result<_, CacheSettingError>>()?;
        }
        if let Some(m) = layer.min_tokens {
            self.min_tokens = cost::min_tokens(m.into_iter().collect());
        }
        if let Some(p) = layer.prices {
            for (model, price) in &p {
                let values = [
                    price.input,
                    price.output,
                    price.cache_read,
                    price.cache_write_5m,
                    price.cache_write_1h,
                ];
                if values.iter().any(|v| !v.is_finite() || *v < 0.0) {
                    return Err(CacheSettingError::Price(model.clone()));
                }
            }
            self.prices = cost::prices(p.into_iter().collect());
        }
        if let Some(n) = layer.conversations {
            if n == 0 {
                return Err(CacheSettingError::NoConversations);
            }
            self.conversations = n;
        }
        Ok(())
    }

    fn min_tokens_for(&self, model: &str) -> u64 {
        self.min_tokens
            .find(model)
            .map_or(cost::FALLBACK_MIN_TOKENS, |(_, n)| n)
    }
}

// === the report ===

/// A breakpoint as the report shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BreakpointView {
    pub unit: String,
    pub position: u32,
    pub ttl: Ttl,
    pub automatic: bool,
    /// Estimated tokens through this unit.
    pub tokens: u64,
    /// The digest of the prefix through this unit (its first 8 bytes, hex): what the
    /// fleet store indexes, so that another replica finds who cached the prefix.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
}

/// The provider's cache numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actual {
    pub read: u64,
    pub write: u64,
    pub input: u64,
}

/// The token estimate set beside the provider's count of the same prompt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EstimateCheck {
    /// The estimator's count of the whole prompt (uncalibrated).
    pub tokens: u64,
    /// The provider's: input + cache read + cache write.
    pub actual: u64,
    /// (estimate − actual) / actual, in percent.
    pub error_pct: f64,
}

/// Dollars, with the price entry used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostView {
    /// The price-table pattern that matched the model.
    pub price: String,
    #[serde(flatten)]
    pub usd: Cost,
}

/// For automatic caching (OpenAI): how much of the previous request's prefix stayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StablePrefix {
    /// Units identical, in order, to the previous request's.
    pub units: usize,
    /// Their estimated tokens.
    pub tokens: u64,
    /// The first unit that differs, if one does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changed_at: Option<String>,
}

/// Everything cache analysis says about one exchange; serialisable, so the capture
/// store can keep it and `cache report` can build timelines and summaries from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheReport {
    pub provider: String,
    pub conversation: String,
    pub model: String,
    /// Start on the analysis clock (ms since the Unix epoch).
    pub started_ms: Millis,
    pub units: usize,
    pub positions: u32,
    pub breakpoints: Vec<BreakpointView>,
    /// The provider workspace the request was sent to, as the hash of its
    /// credential's fingerprint stands in for it (the cache is the workspace's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    pub min_tokens: u64,
    pub prediction: Prediction,
    pub actual: Actual,
    pub verdict: Verdict,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// Tokens the rules say could have been read and were not.
    pub lost_tokens: u64,
    /// The earlier request of the conversation this one was compared with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    pub estimate: EstimateCheck,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<CostView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stable: Option<StablePrefix>,
    /// What would have let this request read the cache (see [`Reason::fix`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// Units sent in other bytes than the earlier turn's, with the same JSON value
    /// (the first [`RESPELLED_SHOWN`]): compared as values, as the provider does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub respelled: Vec<String>,
    /// The provider's own reason for the miss, when its answer carried one, and
    /// whether it agrees with promptgate's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_says: Option<ProviderSays>,
}

/// What the provider said of a miss, beside promptgate's reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderSays {
    /// Its reason as it spells it (`system_changed`, `model_changed`, …).
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missed_tokens: Option<u64>,
    /// Whether it names what promptgate named; `None` when it names no change
    /// (`previous_message_not_found`, `unavailable`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agrees: Option<bool>,
    /// What a disagreement means, in a line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl ProviderSays {
    /// The provider's diagnosis set against promptgate's `reason` (`None`: it saw
    /// no change).
    pub fn judge(
        diagnosis: &crate::provider::CacheDiagnosis,
        reason: Option<&Reason>,
    ) -> ProviderSays {
        let said = diagnosis.reason.as_str();
        let seen = reason.and_then(changed_part);
        let (agrees, note) = match (provider_parts(said), seen) {
            (None, _) => (None, None),
            // OpenAI's `cache_hit`: it saw nothing that stops reuse.
            (Some([]), None) => (Some(true), None),
            (Some([]), Some(s)) => (
                Some(false),
                Some(format!(
                    "the provider saw no change; promptgate saw the first change in the {s}"
                )),
            ),
            (Some(parts), Some(s)) if parts.contains(&s) => (Some(true), None),
            (Some(_), Some(s)) => (
                Some(false),
                Some(format!(
                    "the provider says {said}; promptgate saw the first change in the {s}"
                )),
            ),
            (Some(parts), None) => (
                Some(false),
                Some(format!(
                    "the provider says {said}; promptgate saw the {} unchanged: a change on the \
                     provider's side, or one promptgate does not see",
                    parts[0]
                )),
            ),
        };
        ProviderSays {
            reason: diagnosis.reason.clone(),
            missed_tokens: diagnosis.missed_tokens,
            agrees,
            note,
        }
    }
}

/// The parts of the prompt a provider's reason covers, in promptgate's words (the
/// first is the one it names). Anthropic's `model_changed`, `system_changed`,
/// `tools_changed`, and `messages_changed`, which also covers a changed setting
/// (`tool_choice`, `thinking`: Anthropic has no settings reason); OpenAI's
/// `input_changed`, which covers the instructions (its reasons have none of their
/// own), `context_compacted`, and its settings (`prompt_cache_key`, `text_format`,
/// `reasoning_effort`, `verbosity`, `service_tier`). None for OpenAI's `cache_hit`;
/// `None` when it names no change (`previous_message_not_found`,
/// `comparison_response_not_found`, `unavailable`).
fn provider_parts(said: &str) -> Option<&'static [&'static str]> {
    Some(match said {
        "cache_hit" => &[],
        "model_changed" => &["model"],
        "tools_changed" => &["tools"],
        "system_changed" => &["system"],
        "instructions_changed" => &["instructions"],
        "messages_changed" => &["messages", "settings"],
        "input_changed" => &["messages", "instructions"],
        "context_compacted" => &["messages"],
        "prompt_cache_key_changed"
        | "text_format_changed"
        | "reasoning_effort_changed"
        | "verbosity_changed"
        | "service_tier_changed" => &["settings"],
        _ => return None,
    })
}

/// The part of the prompt a reason says changed, in the providers' words: `model`,
/// `tools`, `system`, `instructions`, `messages` or `settings`.
fn changed_part(reason: &Reason) -> Option<&'static str> {
    match reason {
        Reason::ModelChanged { .. } => Some("model"),
        Reason::ToolsChanged { .. } => Some("tools"),
        Reason::SettingChanged { .. } => Some("settings"),
        Reason::PrefixChanged { unit, .. } => {
            Some(match unit.split(['[', '.']).next().unwrap_or_default() {
                "tools" => "tools",
                "system" => "system",
                "instructions" => "instructions",
                _ => "messages",
            })
        }
        Reason::Unexplained { rules, .. } => rules.as_deref().and_then(changed_part),
        _ => None,
    }
}

/// How many re-spelled units a report names.
pub(crate) const RESPELLED_SHOWN: usize = 8;

impl CacheReport {
    /// The `cache=` value of the exchange log line: `hit 48.2k/50.1k`,
    /// `MISS system[2] changed @812`, `write 48.1k`, …
    pub fn log_field(&self) -> String {
        let total = self.actual.read + self.actual.write + self.actual.input;
        let reason = self
            .reason
            .as_ref()
            .map(|r| format!(" {r}"))
            .unwrap_or_default();
        match self.verdict {
            Verdict::Hit => format!("hit {}/{}", kilo(self.actual.read), kilo(total)),
            Verdict::Partial => {
                format!("partial {}/{}{reason}", kilo(self.actual.read), kilo(total))
            }
            Verdict::Miss => format!("MISS{reason}"),
            Verdict::Write => format!("write {}", kilo(self.actual.write)),
            Verdict::None => format!("none{reason}"),
            Verdict::Unexplained => format!("unexplained:{reason}"),
        }
    }

    /// A narrow cell for tables: `hit`, `partial system[2]`, `MISS ttl`, `write`, …
    pub fn short(&self) -> String {
        let verdict = match self.verdict {
            Verdict::Miss => "MISS",
            v => v.name(),
        };
        match self.reason.as_ref().map(Reason::label) {
            Some(label) if !label.is_empty() => format!("{verdict} {label}"),
            _ => verdict.to_owned(),
        }
    }

    /// Sets the provider's own diagnosis beside promptgate's reason.
    pub fn read_diagnosis(&mut self, diagnosis: Option<&crate::provider::CacheDiagnosis>) {
        self.provider_says = diagnosis.map(|d| ProviderSays::judge(d, self.reason.as_ref()));
    }

    /// Names the policy that wrote the changed unit, from the exchange's edits
    /// (policy, JSON pointer): a miss promptgate itself caused says so.
    pub fn name_writer(&mut self, edits: &[(String, String)], loaded_ms: Option<u64>) {
        if edits.is_empty() {
            return;
        }
        let within = |p: &str, of: &str| {
            p == of || p.strip_prefix(of).is_some_and(|rest| rest.starts_with('/'))
        };
        let mut named = false;
        self.reason = self.reason.take().map(|reason| {
            reason.map(&mut |r| match r {
                Reason::PrefixChanged {
                    unit,
                    offset,
                    before,
                    after,
                    spelling_only,
                    by: _,
                } => {
                    let at = pointer_of(&unit);
                    let by = edits
                        .iter()
                        .find(|(_, p)| within(p, &at) || within(&at, p))
                        .map(|(policy, _)| policy.clone());
                    named |= by.is_some();
                    Reason::PrefixChanged {
                        unit,
                        offset,
                        before,
                        after,
                        spelling_only,
                        by,
                    }
                }
                other => other,
            })
        });
        if named && self.verdict != Verdict::Hit {
            self.fix = self
                .reason
                .as_ref()
                .and_then(|r| r.fix(self.lost_tokens, None))
                .map(|fix| match loaded_ms {
                    // When the rule set changed: a miss right after it is the edit's.
                    Some(ms) => format!(
                        "{fix} (the rules and hooks in use were loaded at {})",
                        utc(ms)
                    ),
                    None => fix,
                });
        }
    }

    /// The report without prompt text (excerpts), for logs.
    pub fn without_excerpts(&self) -> CacheReport {
        let mut r = self.clone();
        r.reason = r.reason.map(|x| x.without_excerpts());
        r
    }
}

/// Milliseconds since the epoch as `2026-12-05 05:59:03 UTC`.
fn utc(ms: u64) -> String {
    crate::tls::ca::date(
        time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH),
    )
}

/// A unit path (`messages[3].content[0]`) as the JSON pointer of its node
/// (`/messages/3/content/0`).
fn pointer_of(unit: &str) -> String {
    let mut out = String::with_capacity(unit.len() + 2);
    for part in unit.split(['.', '[']) {
        out.push('/');
        out.push_str(part.trim_end_matches(']'));
    }
    out
}

// === the stage ===

/// A request whose response head arrived, not yet cut into units.
struct Began {
    id: ExchangeId,
    start: Millis,
    began: Millis,
    format: Format,
    /// The exchange's conversation key: decided here, off the request path, unless
    /// a reader before did.
    key: ConversationCell,
    /// The credential it was sent with (its header's name, and the value shared, not
    /// a copy); hashed into the workspace when prepared, off the request path.
    credential: Option<(&'static str, http::HeaderValue)>,
    /// The body as sent; joined and read here, off the request path, unless a
    /// reader before did.
    prompt: Sent,
}

/// The body sent, as the exchange holds it while its answer streams.
enum Sent {
    /// Its model, shared with the exchange, and the body received (decoded) when
    /// rules may have written it from that.
    Cell {
        cell: PromptCell,
        received: Option<Bytes>,
    },
    /// Let go by the exchange (a large body rules wrote, see
    /// [`crate::record::ExchangeRecord::dry_sent`]): put back together from the body
    /// received when prepared, and let go again after, its units given back.
    Dried {
        received: Bytes,
        dried: Arc<DriedPrompt>,
    },
}

impl Sent {
    /// The body as the segments keep it: compared with the earlier turn's as held,
    /// and a dried one put back together only when it is cut. A body rules wrote is
    /// held as they wrote it: a resend is known by what they wrote, not by every
    /// byte they copied.
    fn cut_from(&self) -> CutFrom {
        match self {
            Sent::Cell { cell, received } => match (cell.if_read(), received) {
                (Some(prompt), Some(received)) => CutFrom::of(prompt, received),
                _ => CutFrom::Body(cell.body().clone()),
            },
            Sent::Dried { received, dried } => {
                CutFrom::Written(dried.written_body(received.clone()))
            }
        }
    }
}

/// A request's units cut before it went, for a policy's prediction
/// ([`CacheStage::predict_read`]), and the turn they were cut after.
struct CutAhead {
    segments: Arc<Segments>,
    after: Option<Arc<Segments>>,
}

/// The most requests cut ahead kept waiting for their analysis. Each is taken or let
/// go when its record is judged (every exchange's is); this bounds a path not taken.
const CUT_AHEAD_MAX: usize = 256;

impl CutAhead {
    /// Whether these are the units the analysis would cut from `body` of `format`
    /// after `previous`: the same bytes, and the same turn before them (a unit's
    /// measure is taken against that turn's).
    fn fits(&self, previous: Option<&Arc<Segments>>, format: Format, body: &CutFrom) -> bool {
        let same_turn = match (&self.after, previous) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        same_turn && self.segments.are_of(format, body)
    }
}

/// A request cut and predicted, waiting for its record.
struct Pending {
    key: String,
    start: Millis,
    segments: Arc<Segments>,
    prediction: Prediction,
    /// The conversation (and its request) that wrote the prefix this one reads, when
    /// that is another conversation.
    shared: Option<(String, ExchangeId)>,
    workspace: Option<String>,
}

struct State {
    pending: HashMap<ExchangeId, Pending>,
    /// Requests cut on the request path for a prediction, until their analysis.
    cut_ahead: HashMap<ExchangeId, CutAhead>,
    history: History,
    /// Models already warned about for having no price.
    unpriced: Unpriced,
}

/// The most unpriced models warned about by name. A model name is whatever a client
/// sends: past this many, one more line says the rest go unnamed, so the set (and
/// the log) cannot grow with what clients invent. Real deployments use a handful.
const UNPRICED_WARNED_MAX: usize = 64;

/// The models warned about for having no price: at most [`UNPRICED_WARNED_MAX`],
/// each redacted and cut to [`NAME_MAX`] bytes.
#[derive(Default)]
struct Unpriced {
    names: std::collections::HashSet<String>,
    /// The line saying the rest go unnamed was written.
    full: bool,
}

/// What to log about a model with no price.
#[derive(Debug, PartialEq, Eq)]
enum UnpricedWarning {
    /// A model new to the set: its name, redacted and cut.
    Model(String),
    /// The set is full: said once.
    Full,
}

impl Unpriced {
    /// What to warn about `model`, which has no price: its name the first time it is
    /// seen, then nothing; past the cap once that the rest go unnamed.
    fn note(&mut self, model: &str, redactor: Option<&Redactor>) -> Option<UnpricedWarning> {
        let name = match redactor {
            Some(r) => r.bounded(model, &[], NAME_MAX),
            None => crate::redact::cut(model, NAME_MAX).into_owned(),
        };
        if self.names.contains(&name) {
            return None;
        }
        if self.names.len() >= UNPRICED_WARNED_MAX {
            return (!std::mem::replace(&mut self.full, true)).then_some(UnpricedWarning::Full);
        }
        self.names.insert(name.clone());
        Some(UnpricedWarning::Model(name))
    }
}

/// The record stage that analyses prompt caching.
///
/// When a response head arrives it only queues the request (cheap, on the request
/// path). When any record is emitted it first cuts and predicts the queued requests
/// in arrival order — so a request that began before another is in the history
/// before that one is judged, whichever finishes first — then judges the record.
pub struct CacheStage {
    settings: CacheSettings,
    key_source: KeySource,
    clock: Clock,
    /// Requests whose response began, in that order. Its own lock: the request path
    /// only ever waits for a push, never for an analysis.
    began: Mutex<Vec<Began>>,
    state: Mutex<State>,
    /// A store other replicas write too (PostgreSQL): turns they took are read from it.
    shared: Option<SharedStore>,
    /// Cleans the model names it warns about (else they are only cut).
    redactor: Option<Arc<Redactor>>,
}

/// How far back a conversation new to this replica is looked for in the shared
/// store: the longest cache ttl.
const CATCH_UP_WINDOW_MS: Millis = 3_600_000;
/// The most turns brought in from the shared store for one request.
const CATCH_UP_MOST: usize = 8;

/// How long the analysis goes without the shared store after it failed to answer:
/// a store that answers nothing must not hold the record pipeline per record.
const SHARED_STORE_PAUSE: std::time::Duration = std::time::Duration::from_secs(30);

/// How long one read of the shared store may take on the record pipeline.
pub(crate) const SHARED_STORE_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// The store the fleet's replicas share (capture's, in PostgreSQL), as the analysis
/// reads it: the turns other replicas took. Capture implements it.
pub trait SharedHistory: Send + Sync {
    /// The stored turns of `conversation` that started at or after `since` and
    /// before `before`, the newest `most`, oldest first; only those `known` does not
    /// name are read whole (the others are left out).
    fn turns(
        &self,
        conversation: &str,
        since: Millis,
        before: ExchangeId,
        most: usize,
        known: &dyn Fn(ExchangeId) -> bool,
    ) -> Result<Vec<SharedTurn>, SharedHistoryError>;

    /// Who cached which of `prefixes` (the first 8 bytes of a prefix hash, in hex)
    /// in `workspace`: `(prefix, conversation)` of the turns that started at or
    /// after `since` and before `before`, newest first.
    fn prefix_writers(
        &self,
        workspace: &str,
        prefixes: &[String],
        since: Millis,
        before: ExchangeId,
    ) -> Result<Vec<(String, String)>, SharedHistoryError>;
}

/// Why the shared store gave no answer (its own error, as text for the log).
pub(crate) type SharedHistoryError = Box<dyn std::error::Error + Send + Sync>;

/// A turn another replica took, as the shared store keeps it.
#[derive(Debug, Clone)]
pub struct SharedTurn {
    pub id: ExchangeId,
    /// The request's format, when it is one promptgate cuts.
    pub format: Option<Format>,
    /// The provider's answer status, when one came.
    pub status: Option<u16>,
    /// The provider's `usage`, when it told one.
    pub usage: Option<Usage>,
    /// When it started (ms since the epoch).
    pub start: Millis,
    /// When the provider's headers came, in ms after `start`.
    pub upstream_headers_ms: Option<f64>,
    /// The request headers as sent upstream (credentials as their stored fingerprints).
    pub headers: HeaderMap,
    /// The request body as sent upstream.
    pub body: bytes::Bytes,
}

/// The fleet's shared history, left alone for a while after it fails.
struct SharedStore {
    history: Arc<dyn SharedHistory>,
    /// Until when it is left alone after a failure.
    paused_until: Mutex<Option<std::time::Instant>>,
}

impl SharedStore {
    /// Whether a failure a moment ago still keeps it from being asked.
    fn paused(&self) -> bool {
        let until = self.paused_until.lock().unwrap_or_else(|p| p.into_inner());
        until.is_some_and(|until| std::time::Instant::now() < until)
    }

    /// Leaves it alone for [`SHARED_STORE_PAUSE`].
    fn pause(&self) {
        *self.paused_until.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::time::Instant::now() + SHARED_STORE_PAUSE);
    }

    /// The stored turns of `conversation` that started at or after `since` and
    /// before `before`, the newest [`CATCH_UP_MOST`], oldest first; only those
    /// `known` does not name are read whole.
    fn turns(
        &self,
        conversation: &str,
        since: Millis,
        before: ExchangeId,
        known: impl Fn(ExchangeId) -> bool,
    ) -> Result<Vec<SharedTurn>, SharedHistoryError> {
        if self.paused() {
            return Ok(Vec::new());
        }
        let result = self
            .history
            .turns(conversation, since, before, CATCH_UP_MOST, &known);
        if result.is_err() {
            self.pause();
        }
        result
    }

    /// The conversation of `workspace` that most recently cached the deepest of
    /// `prefixes` (deepest first) in a request that started at or after `since` and
    /// before `before`.
    fn writer(
        &self,
        workspace: &str,
        prefixes: &[segment::Hash],
        since: Millis,
        before: ExchangeId,
    ) -> Result<Option<String>, SharedHistoryError> {
        let wanted: Vec<String> = prefixes
            .iter()
            .map(|p| crate::digest::hex(&p[..8]))
            .collect();
        // Asked after `turns`, which the same request asked first.
        if self.paused() {
            return Ok(None);
        }
        let writers = match self
            .history
            .prefix_writers(workspace, &wanted, since, before)
        {
            Ok(w) => w,
            Err(e) => {
                self.pause();
                return Err(e);
            }
        };
        Ok(wanted.iter().find_map(|p| {
            writers
                .iter()
                .find(|(prefix, _)| prefix == p)
                .map(|(_, conversation)| conversation.clone())
        }))
    }
}

impl std::fmt::Debug for CacheStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheStage")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl CacheStage {
    /// A stage with `settings`, grouping requests by `key_source`'s conversation keys,
    /// on `clock`.
    pub fn new(settings: CacheSettings, key_source: KeySource, clock: Clock) -> CacheStage {
        let history = History::new(settings.conversations);
        CacheStage {
            settings,
            key_source,
            clock,
            began: Mutex::new(Vec::new()),
            state: Mutex::new(State {
                pending: HashMap::new(),
                cut_ahead: HashMap::new(),
                history,
                unpriced: Default::default(),
            }),
            shared: None,
            redactor: None,
        }
    }

    /// Redacts the client-chosen names it logs with `redactor`, as the logs do.
    pub fn redacting(mut self, redactor: Arc<Redactor>) -> CacheStage {
        self.redactor = Some(redactor);
        self
    }

    /// Reads the turns other replicas took from `store`, which they write too: a
    /// conversation's turns may reach any replica.
    pub fn sharing(mut self, history: Arc<dyn SharedHistory>) -> CacheStage {
        self.shared = Some(SharedStore {
            history,
            paused_until: Mutex::new(None),
        });
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic mid-analysis leaves at worst a stale history entry.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cuts and predicts a queued request, and notes what it will cache.
    fn prepare(&self, state: &mut State, b: Began) {
        // The session header names most agent conversations without reading the
        // body; only the others (pi, SDK apps) need the model.
        let key = b.key.get().unwrap_or("unkeyed").to_owned();
        if let Some(shared) = &self.shared {
            self.catch_up(state, shared, &key, &b);
        }
        self.prepare_keyed(state, b, key, self.shared.as_ref());
        Self::warn_forgotten(state);
    }

    /// Says when conversations were forgotten while active: past the remembered
    /// number their verdicts are a new conversation's, which reads as unexplained.
    fn warn_forgotten(state: &mut State) {
        if let Some((forgotten, limit)) = state.history.forgotten_warning() {
            tracing::warn!(
                "cache analysis: {forgotten} conversation(s) forgotten while active, more than \
                 the {limit} remembered at once (`[cache] conversations`): the next turn of each \
                 is analysed as a new conversation's"
            );
        }
    }

    /// Brings in, from the shared store, the conversation of `workspace` that cached
    /// the deepest of `prefixes` when another replica took it, so that the
    /// workspace's cache is found here as it would be on that replica.
    fn catch_up_writer(
        &self,
        state: &mut State,
        shared: &SharedStore,
        workspace: &str,
        prefixes: &[segment::Hash],
        b: &Began,
    ) {
        let since = b.start.saturating_sub(CATCH_UP_WINDOW_MS);
        match shared.writer(workspace, prefixes, since, b.id) {
            Ok(Some(conversation)) => self.catch_up(state, shared, &conversation, b),
            Ok(None) => {}
            Err(e) => tracing::debug!("cache analysis: no prefix index from the shared store: {e}"),
        }
    }

    /// Brings in the turns of `key` that another replica took since this one last
    /// saw it, from the shared store, as if this replica had taken them: each is
    /// prepared and judged against its stored usage (the reports are dropped).
    fn catch_up(&self, state: &mut State, shared: &SharedStore, key: &str, b: &Began) {
        let newest_here = state
            .history
            .get(key)
            .and_then(|c| c.snapshots.back().map(|s| s.start));
        let since = newest_here.unwrap_or(b.start.saturating_sub(CATCH_UP_WINDOW_MS));
        let known = |id: ExchangeId| {
            state.pending.contains_key(&id)
                || state
                    .history
                    .get(key)
                    .is_some_and(|c| c.snapshot(id).is_some())
        };
        let records = match shared.turns(key, since, b.id, known) {
            Ok(records) => records,
            Err(e) => {
                tracing::debug!("cache analysis: no turns from the shared store: {e}");
                return;
            }
        };
        for r in records {
            let (Some(format), Some(usage)) = (r.format, r.usage) else {
                continue;
            };
            if !r.status.is_some_and(|s| (200..300).contains(&s)) {
                continue;
            }
            let id = r.id;
            let start = r.start;
            let began = Began {
                id,
                start,
                began: start + r.upstream_headers_ms.map_or(0, |ms| ms as Millis),
                format,
                key: ConversationCell::known(key.to_owned()),
                // The stored fingerprint names the same workspace as the credential.
                credential: credential(&r.headers),
                prompt: Sent::Cell {
                    cell: PromptCell::new(r.body, Some(format)),
                    received: None,
                },
            };
            self.prepare_keyed(state, began, key.to_owned(), None);
            let _ = self.judge(state, id, &usage);
        }
    }

    /// Whether the analysis runs (`cache.enabled`); off, the stage reads nothing.
    pub(crate) fn enabled(&self) -> bool {
        self.settings.enabled
    }

    /// Now, on the analysis clock.
    pub fn now(&self) -> Millis {
        self.clock.now()
    }

    /// The tokens the provider is predicted to read from its cache for a request of
    /// `conversation` not sent yet, from what this stage saw of the conversation,
    /// changing nothing (a policy asks before the request goes: a hook's event).
    /// `None` when analysis is off, the body is not one promptgate cuts, or the
    /// conversation is new here. The units cut for it are kept for exchange `id`'s
    /// analysis, which takes them when it would cut the same body after the same turn.
    pub fn predict_read(
        &self,
        id: ExchangeId,
        conversation: &str,
        prompt: &PromptCell,
        now: Millis,
    ) -> Option<u64> {
        if !self.settings.enabled {
            return None;
        }
        let previous = {
            let state = self.lock();
            let conv = state.history.get(conversation)?;
            conv.snapshots.back().map(|s| s.segments.clone())
        };
        let format = prompt.format()?;
        let body = CutFrom::Body(prompt.body().clone());
        let segments = match &previous {
            // A byte-identical resend is the same units, as the analysis knows it.
            Some(p) if p.are_of(format, &body) => p.clone(),
            // Cut outside the lock: the analysis thread goes on meanwhile.
            _ => Arc::new(
                segment::segment_after(prompt.get(), &self.settings.ignore, previous.as_deref())
                    .ok()?,
            ),
        };
        let min = self.settings.min_tokens_for(&segments.settings.model);
        let mut state = self.lock();
        if state.cut_ahead.len() >= CUT_AHEAD_MAX {
            state.cut_ahead.clear();
        }
        state.cut_ahead.insert(
            id,
            CutAhead {
                segments: segments.clone(),
                after: previous,
            },
        );
        if segments.format != Format::AnthropicMessages {
            return None;
        }
        let conv = state.history.get(conversation)?;
        let request = Request {
            id,
            start: now,
            segments: &segments,
        };
        Some(explain::predict(request, Some(conv), min).read_tokens)
    }

    /// [`prepare`](Self::prepare) once the conversation is known. With `shared`, a
    /// prefix that no conversation here has cached is looked up in the shared store.
    fn prepare_keyed(
        &self,
        state: &mut State,
        b: Began,
        key: String,
        shared: Option<&SharedStore>,
    ) {
        let cut_from = b.prompt.cut_from();
        let previous = state
            .history
            .get(&key)
            .and_then(|c| c.snapshots.back().map(|s| s.segments.clone()));
        let ahead = state
            .cut_ahead
            .remove(&b.id)
            .filter(|p| p.fits(previous.as_ref(), b.format, &cut_from));
        let segments = match (previous, ahead) {
            // A byte-identical resend (a retry, a replay) is the same units.
            (Some(p), _) if p.are_of(b.format, &cut_from) => p,
            // Cut on the request path for a policy: this body, after this turn.
            (_, Some(p)) => p.segments,
            (previous, None) => {
                let mut wet = None;
                let prompt = match &b.prompt {
                    Sent::Cell { cell, .. } => cell.get(),
                    Sent::Dried { received, dried } => &*wet.insert(dried.wet(received)),
                };
                let cut = segment::segment_from(
                    prompt,
                    &self.settings.ignore,
                    previous.as_deref(),
                    cut_from,
                );
                if let (Some(wet), Sent::Dried { dried, .. }) = (wet, &b.prompt) {
                    // The body put back together goes; its units stay with the exchange.
                    dried.keep_cut(wet);
                }
                let Ok(s) = cut else {
                    return;
                };
                Arc::new(s)
            }
        };
        let min = self.settings.min_tokens_for(&segments.settings.model);
        let conv = state.history.conversation(&key, b.start);
        let workspace = b.credential.as_ref().map(workspace);
        if workspace.is_some() {
            conv.workspace.clone_from(&workspace);
        }
        let shared = match &workspace {
            Some(w) if b.format == Format::AnthropicMessages => {
                let deepest_first = explain::lookback_prefixes(&segments);
                let found = state.history.share(&key, w, &deepest_first, b.start, b.id);
                let unreached = state.history.unreached(&key, &deepest_first, b.start, b.id);
                match shared {
                    Some(store) if found.is_none() && unreached > 0 => {
                        self.catch_up_writer(state, store, w, &deepest_first[..unreached], &b);
                        state.history.share(&key, w, &deepest_first, b.start, b.id)
                    }
                    _ => found,
                }
            }
            _ => None,
        };
        let conv = state.history.conversation(&key, b.start);
        let req = Request {
            id: b.id,
            start: b.start,
            segments: &segments,
        };
        let prediction = if b.format == Format::AnthropicMessages {
            explain::predict(req, Some(conv), min)
        } else {
            Prediction::default()
        };
        let mut cached = prediction.written.clone();
        if let Some(h) = prediction.hit {
            cached.push(h);
            cached.sort_unstable();
            cached.dedup();
        }
        for &i in &cached {
            let ttl = segments.units[i]
                .breakpoint
                .map_or(Ttl::FiveMinutes, |m| m.ttl);
            conv.cache(segments.units[i].prefix, b.start, b.began, ttl, b.id);
        }
        if b.format != Format::AnthropicMessages {
            // Automatic caching: every request is a candidate prefix for the next.
            cached.clear();
        }
        conv.keep(Snapshot {
            id: b.id,
            start: b.start,
            segments: segments.clone(),
            usage: None,
            cached,
        });
        state.pending.insert(
            b.id,
            Pending {
                key,
                start: b.start,
                segments,
                prediction,
                shared,
                workspace,
            },
        );
    }

    /// Judges a prepared request against its usage and records what it did.
    fn judge(&self, state: &mut State, id: ExchangeId, usage: &Usage) -> Option<CacheReport> {
        let p = state.pending.remove(&id)?;
        let segs = &*p.segments;
        let model = segs.settings.model.clone();
        let min = self.settings.min_tokens_for(&model);
        let conv = state.history.conversation(&p.key, p.start);
        let req = Request {
            id,
            start: p.start,
            segments: segs,
        };
        let (mut explanation, stable) = if segs.format == Format::AnthropicMessages {
            (
                explain::explain(req, Some(conv), &p.prediction, usage, min),
                None,
            )
        } else {
            let (e, s) = explain::explain_automatic(req, conv, usage, min);
            (e, Some(s))
        };
        // A read of the prefix another conversation wrote is a hit on that one's cache.
        if let Some((conversation, by)) = &p.shared
            && explanation.reason.is_none()
            && matches!(explanation.verdict, Verdict::Hit | Verdict::Partial)
            && p.prediction.read_from.as_deref() == Some(by.to_string().as_str())
        {
            explanation.reason = Some(Reason::SharedPrefix {
                conversation: conversation.clone(),
                by: by.to_string(),
            });
        }
        // What the provider says it did becomes the history.
        let estimated = segs.total_tokens();
        let actual_total = usage.total_input();
        if actual_total > 0 && estimated > 0 {
            conv.calibration = Some(actual_total as f64 / estimated as f64);
        }
        if segs.format == Format::AnthropicMessages {
            record_usage(conv, id, p.start, segs, &p.prediction, &explanation, usage);
        }
        if let Some(snap) = conv.snapshot(id) {
            let mut s = (*snap).clone();
            s.usage = Some(*usage);
            if usage.cache_read_tokens + usage.cache_write_tokens == 0 {
                s.cached.clear();
            }
            conv.keep(s);
        }
        conv.prune(p.start);
        let one_hour = segs.breakpoints.iter().any(|&b| {
            segs.units[b]
                .breakpoint
                .is_some_and(|m| m.ttl == Ttl::OneHour)
        });
        let price = self.settings.prices.find(&model);
        if price.is_none() && !model.is_empty() {
            self.warn_unpriced(state, &model);
        }
        let cost = price.as_ref().map(|(pattern, price)| CostView {
            price: (*pattern).to_owned(),
            usd: cost::cost(price, usage, explanation.lost_tokens, one_hour),
        });
        let fix = explanation
            .reason
            .as_ref()
            .filter(|_| explanation.verdict != Verdict::Hit)
            .and_then(|r| r.fix(explanation.lost_tokens, price.as_ref().map(|(_, p)| p)));
        let breakpoints = breakpoint_views(segs);
        Some(CacheReport {
            provider: segs.format.provider().name().to_owned(),
            conversation: p.key,
            model,
            started_ms: p.start,
            units: segs.units.len(),
            positions: segs.units.last().map_or(0, |u| u.position + 1),
            breakpoints,
            workspace: p.workspace,
            min_tokens: min,
            prediction: p.prediction,
            actual: Actual {
                read: usage.cache_read_tokens,
                write: usage.cache_write_tokens,
                input: usage.input_tokens,
            },
            verdict: explanation.verdict,
            reason: explanation.reason,
            lost_tokens: explanation.lost_tokens,
            baseline: explanation.baseline.map(|b| b.to_string()),
            estimate: EstimateCheck::of(estimated, actual_total),
            cost,
            stable,
            fix,
            provider_says: None,
            respelled: segs
                .units
                .iter()
                .filter(|u| u.respelled)
                .take(RESPELLED_SHOWN)
                .map(|u| u.path.to_string())
                .collect(),
        })
    }

    /// Warns, once per model (and once when too many are unnamed), that `model` has
    /// no price: its cost is unknown, never $0.
    fn warn_unpriced(&self, state: &mut State, model: &str) {
        let warning = state.unpriced.note(model, self.redactor.as_deref());
        match warning {
            // Once per model: its cost is unknown, never $0.
            Some(UnpricedWarning::Model(model)) => tracing::warn!(
                "no price for model {model:?}: its cache cost shows as unknown; add one to the \
                 config file:\n[cache.prices.\"{model}\"]\ninput = 1.25        # $ per million input tokens\n\
                 output = 10.0\ncache_read = 0.1    # share of the input price (OpenAI's cached input)\n\
                 cache_write_5m = 1.0"
            ),
            Some(UnpricedWarning::Full) => tracing::warn!(
                "no price for more than {UNPRICED_WARNED_MAX} models: the next ones are not named \
                 (their cache cost shows as unknown)"
            ),
            None => {}
        }
    }
}

/// The breakpoints of a request, each with the tokens through it and its prefix's
/// digest (what the fleet store indexes).
fn breakpoint_views(segs: &Segments) -> Vec<BreakpointView> {
    let mut through = 0u64;
    segs.units
        .iter()
        .filter_map(|u| {
            through += u64::from(u.tokens);
            u.breakpoint.map(|m| BreakpointView {
                unit: u.path.to_string(),
                position: u.position,
                ttl: m.ttl,
                automatic: m.automatic,
                tokens: through,
                prefix: crate::digest::hex(&u.prefix[..8]),
            })
        })
        .collect()
}

impl EstimateCheck {
    /// The estimate beside the provider's count, and its error in percent.
    fn of(tokens: u64, actual: u64) -> EstimateCheck {
        EstimateCheck {
            tokens,
            actual,
            error_pct: if actual == 0 {
                0.0
            } else {
                (tokens as f64 - actual as f64) / actual as f64 * 100.0
            },
        }
    }
}

/// The credential whose hash stands in for the provider's workspace: `x-api-key`,
/// else `authorization`. Two keys of one workspace, or a rotated OAuth token, look
/// like two workspaces.
fn credential(headers: &HeaderMap) -> Option<(&'static str, http::HeaderValue)> {
    ["x-api-key", "authorization"]
        .into_iter()
        .find_map(|name| Some((name, headers.get(name)?.clone())))
}

/// The workspace of a credential: the id its stored fingerprint shows, never the
/// credential; the same for the live header and for the fingerprint in the store.
fn workspace((name, value): &(&'static str, http::HeaderValue)) -> String {
    format!(
        "ws:{}",
        crate::redact::credential_id(name, value.as_bytes())
    )
}

/// What the analysis predicts for a request nobody answered (a replay).
#[derive(Debug, Clone)]
pub struct Predicted {
    pub conversation: String,
    pub model: String,
    pub prediction: Prediction,
    /// The estimated tokens of the whole input.
    pub total_tokens: u64,
}

impl CacheStage {
    /// Predicts a request without an answer: cut, predicted against what the
    /// requests before it in its conversation were predicted to cache, and then
    /// taken to cache what it is predicted to. Replay runs captured requests
    /// through it in their order, at their captured start (`start`, ms since the
    /// epoch), so ttls expire as they did. `None` for a body that is not one
    /// promptgate cuts.
    pub fn predict_only(
        &self,
        id: ExchangeId,
        start: Millis,
        format: Format,
        headers: &HeaderMap,
        prompt: PromptCell,
    ) -> Option<Predicted> {
        let began = Began {
            id,
            start,
            began: start,
            format,
            key: {
                let mut key = ConversationCell::new(headers, &self.key_source);
                key.set_body(prompt.clone());
                key
            },
            // Stored credentials are fingerprints, one per key: the same workspaces.
            credential: credential(headers),
            prompt: Sent::Cell {
                cell: prompt,
                received: None,
            },
        };
        let mut state = self.lock();
        self.prepare(&mut state, began);
        let p = state.pending.remove(&id)?;
        Some(Predicted {
            conversation: p.key,
            model: p.segments.settings.model.clone(),
            total_tokens: p.segments.total_tokens(),
            prediction: p.prediction,
        })
    }
}

/// Puts the provider's numbers into the history: exact token counts for the
/// prefixes it read and wrote, and no entries at all when it cached nothing.
fn record_usage(
    conv: &mut history::Conversation,
    id: ExchangeId,
    start: Millis,
    segs: &Segments,
    prediction: &Prediction,
    explanation: &Explanation,
    usage: &Usage,
) {
    if usage.cache_read_tokens + usage.cache_write_tokens == 0 {
        conv.uncache(id);
        return;
    }
    // read + write = tokens through the last breakpoint.
    if let Some(&last) = segs.breakpoints.last() {
        let prefix = segs.units[last].prefix;
        let known = conv
            .entries
            .get(&prefix)
            .is_some_and(|e| e.uses.iter().any(|u| u.by == id));
        if !known && usage.cache_write_tokens > 0 {
            let ttl = segs.units[last]
                .breakpoint
                .map_or(Ttl::FiveMinutes, |m| m.ttl);
            conv.cache(prefix, start, start, ttl, id);
        }
        if let Some(e) = conv.entries.get_mut(&prefix) {
            e.tokens = Some(usage.cache_read_tokens + usage.cache_write_tokens);
        }
    }
    if explanation.verdict != Verdict::Unexplained
        && usage.cache_read_tokens > 0
        && let Some(h) = prediction.hit
        && let Some(e) = conv.entries.get_mut(&segs.units[h].prefix)
    {
        e.tokens = Some(usage.cache_read_tokens);
    }
}

/// What the cache stage is told of an exchange whose response head arrived.
pub struct ResponseBegan<'r> {
    pub id: ExchangeId,
    pub provider: Option<crate::provider::Provider>,
    pub api: Option<crate::provider::Api>,
    /// A 2xx status.
    pub success: bool,
    pub started_at: std::time::SystemTime,
    /// From the start until the response head arrived.
    pub upstream_headers: Option<std::time::Duration>,
    /// What the provider reads: the body sent, decoded when it went on compressed.
    pub sent_prompt: &'r PromptCell,
    /// That body, when the exchange let it go while the answer streams, and the body
    /// received it is put back together from.
    pub(crate) sent_dried: Option<&'r Arc<DriedPrompt>>,
    /// The body received (decoded): what rules wrote the body sent from, if they did.
    pub received: &'r Bytes,
    pub sent_headers: &'r HeaderMap,
    /// The exchange's conversation key (decided here when no reader before did).
    pub conversation: &'r ConversationCell,
}

impl CacheStage {
    /// Notes a request whose successful answer began: cut and predicted, in arrival
    /// order, when the next exchange is judged.
    pub fn note_response(&self, r: ResponseBegan<'_>) {
        if !self.settings.enabled || !r.success {
            return;
        }
        let (Some(provider), Some(api)) = (r.provider, r.api) else {
            return;
        };
        let Some(format) = Format::of(provider, api) else {
            return;
        };
        let prompt = match r.sent_dried {
            // Rules wrote it from a JSON object.
            Some(dried) => Sent::Dried {
                received: r.received.clone(),
                dried: dried.clone(),
            },
            None if r.sent_prompt.body().first() == Some(&b'{') => Sent::Cell {
                cell: r.sent_prompt.clone(),
                received: Some(r.received.clone()),
            },
            None => return,
        };
        let start = self.clock.at(r.started_at);
        let began = start + r.upstream_headers.map_or(0, |d| d.as_millis() as Millis);
        let began = Began {
            id: r.id,
            start,
            began,
            format,
            key: r.conversation.clone(),
            credential: credential(r.sent_headers),
            prompt,
        };
        // A panic elsewhere while holding it cannot leave the queue half-pushed.
        self.began
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(began);
    }

    /// The analysis of exchange `id`, which ended with the provider's `usage`
    /// (`None`: cut before it, or an error body; what it may have cached stays as
    /// predicted and nothing is judged).
    pub fn judge_exchange(&self, id: ExchangeId, usage: Option<&Usage>) -> Option<CacheReport> {
        if !self.settings.enabled {
            return None;
        }
        let mut state = self.lock();
        let state = &mut *state;
        // Taken under the state lock, so queued requests are prepared in arrival order.
        let queued = std::mem::take(&mut *self.began.lock().unwrap_or_else(|p| p.into_inner()));
        for b in queued {
            self.prepare(state, b);
        }
        // Cut for a prediction and not taken: its request got no answer to analyse.
        state.cut_ahead.remove(&id);
        let Some(usage) = usage else {
            state.pending.remove(&id);
            return None;
        };
        let report = self.judge(state, id, usage);
        if let Some(report) = &report
            && tracing::enabled!(target: "promptgate::cache", tracing::Level::DEBUG)
        {
            let json = serde_json::to_string(&report.without_excerpts()).unwrap_or_default();
            tracing::debug!(target: "promptgate::cache", id = %id, analysis = %json, "cache analysis");
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exchange whose body the rules `toml` changed, answered 200; its body sent
    /// dried with `dry`.
    fn derived_record(body: &Bytes, toml: &str, dry: bool) -> crate::record::ExchangeRecord {
        let mut r = received_record(body);
        r.set_sent_cell(crate::rules::derive_for_test(&r.prompt, body, toml));
        if dry {
            r.dry_sent();
            assert!(r.sent_body.is_empty(), "dried");
        }
        r
    }

    /// Analysis off (pass-through), the stage compares no body with an earlier
    /// one, so no body received is held or compared on its account.
    #[test]
    fn a_stage_that_is_off_compares_no_bodies() {
        use crate::record::RecordStage;
        let stage = |enabled: bool| {
            CacheStage::new(
                CacheSettings {
                    enabled,
                    ..CacheSettings::default()
                },
                KeySource::default(),
                crate::runtime::Clock::system(),
            )
        };
        assert!(stage(true).compares_bodies());
        assert!(!stage(false).compares_bodies());
    }

    /// A Messages request with `body`, answered 200, its body sent as received.
    fn received_record(body: &Bytes) -> crate::record::ExchangeRecord {
        use crate::provider::{Api, Provider};
        let mut r = crate::record::ExchangeRecord::begin(
            ExchangeId::new(),
            None,
            http::Method::POST,
            "/v1/messages".into(),
        );
        r.provider = Some(Provider::Anthropic);
        r.api = Some(Api::Messages);
        r.status = Some(http::StatusCode::OK);
        r.set_request_body(body.clone(), body.clone());
        r
    }

    /// [`received_record`] of conversation `conv`.
    fn plain_record(body: &Bytes, conv: &str) -> crate::record::ExchangeRecord {
        let mut r = received_record(body);
        r.conversation = ConversationCell::known(conv.into());
        r
    }

    /// The units cut on the request path for a policy's prediction are the ones the
    /// analysis takes (one cut per body), and it judges as if it had cut them; units
    /// cut after a turn that is no longer the last are cut again.
    #[test]
    fn a_body_cut_for_a_prediction_is_not_cut_again() {
        use crate::record::RecordStage;
        let body = |turns: usize| {
            let lorem = "lorem ipsum ".repeat(600);
            let mut messages = Vec::new();
            for t in 0..=turns {
                let last = if t == turns {
                    r#","cache_control":{"type":"ephemeral"}"#
                } else {
                    ""
                };
                messages.push(format!(
                    r#"{{"role":"user","content":[{{"type":"text","text":"{t} {lorem}"{last}}}]}}"#
                ));
                if t < turns {
                    messages.push(format!(
                        r#"{{"role":"assistant","content":[{{"type":"text","text":"answer {t}"}}]}}"#
                    ));
                }
            }
            Bytes::from(format!(
                r#"{{"model":"claude-x","system":[{{"type":"text","text":"be brief {lorem}","cache_control":{{"type":"ephemeral"}}}}],"messages":[{}],"max_tokens":5}}"#,
                messages.join(",")
            ))
        };
        let usage = Usage {
            input_tokens: 20,
            cache_write_tokens: 3000,
            cache_read_tokens: 2000,
            output_tokens: 5,
            ..Usage::default()
        };
        let records: Vec<_> = (0..3).map(|t| plain_record(&body(t), "conv")).collect();
        let stage = || {
            CacheStage::new(
                CacheSettings::default(),
                KeySource::default(),
                crate::runtime::Clock::system(),
            )
        };
        let last_cut = |stage: &CacheStage| {
            let state = stage.lock();
            let conv = state.history.get("conv").expect("kept");
            conv.snapshots.back().expect("a snapshot").segments.clone()
        };
        let judged = |stage: &CacheStage, r: &crate::record::ExchangeRecord| {
            stage.response_began(r);
            let report = stage.judge_exchange(r.id, Some(&usage)).expect("judged");
            serde_json::to_value(report).unwrap()
        };
        let (ahead, plain) = (stage(), stage());
        assert_eq!(judged(&ahead, &records[0]), judged(&plain, &records[0]));
        // Turns 1 and 2 predicted after turn 0, then analysed in order.
        let mut cut = Vec::new();
        for r in &records[1..] {
            let read = ahead.predict_read(r.id, "conv", &r.prompt, ahead.now());
            assert!(read.is_some(), "predicted");
            cut.push(ahead.lock().cut_ahead[&r.id].segments.clone());
        }
        assert_eq!(judged(&ahead, &records[1]), judged(&plain, &records[1]));
        assert!(Arc::ptr_eq(&last_cut(&ahead), &cut[0]), "taken");
        assert_eq!(judged(&ahead, &records[2]), judged(&plain, &records[2]));
        assert!(
            !Arc::ptr_eq(&last_cut(&ahead), &cut[1]),
            "cut after turn 0, not 1"
        );
        assert!(ahead.lock().cut_ahead.is_empty(), "each let go");
    }

    /// A large body sent, let go while its answer streams: the cache stage puts it
    /// back together to read it and lets it go again, its units copied unchanged
    /// sharing the body received; the units it cut come back with the body restored;
    /// the analysis is the one of a body kept; the same body again is known.
    #[test]
    fn a_body_sent_dried_while_the_answer_streams_is_judged_as_one_kept() {
        use crate::record::RecordStage;
        let lorem = "lorem ipsum ".repeat(2000);
        let body = Bytes::from(format!(
            r#"{{"model":"claude-x","system":[{{"type":"text","text":"be brief"}}],"messages":[{{"role":"user","content":[{{"type":"text","text":"{lorem}"}},{{"type":"text","text":"two","cache_control":{{"type":"ephemeral"}}}}]}}],"max_tokens":5}}"#
        ));
        let toml = r#"
[[rule]]
name = "preamble"
on = "before_provider_request"
actions = [ { system.prepend = { text = "policy" } } ]
"#;
        let record = |dry: bool| derived_record(&body, toml, dry);
        // The first turn writes the prefix, the second reads it.
        let usage = |turn: usize| Usage {
            input_tokens: 20,
            cache_write_tokens: if turn == 0 { 6000 } else { 0 },
            cache_read_tokens: if turn == 0 { 0 } else { 6000 },
            output_tokens: 5,
            ..Usage::default()
        };
        let run = |dry: bool| {
            let stage = CacheStage::new(
                CacheSettings::default(),
                KeySource::default(),
                crate::runtime::Clock::system(),
            );
            let mut reports = Vec::new();
            for turn in 0..2 {
                let mut r = record(dry);
                stage.response_began(&r);
                let mut report = stage
                    .judge_exchange(r.id, Some(&usage(turn)))
                    .expect("judged");
                if dry {
                    let dried = r.sent_dried.as_ref().expect("still dried");
                    assert_eq!(Arc::strong_count(dried), 1, "the stage let it go");
                }
                r.restore_sent();
                let sent = r.sent_prompt.get();
                assert_eq!(sent.body().len(), r.sent_body.len());
                if turn == 0 {
                    assert!(!sent.units_if_cut().is_empty(), "restored with its units");
                    let state = stage.lock();
                    let key = state
                        .pending
                        .is_empty()
                        .then(|| report.conversation.clone());
                    let conv = state.history.get(&key.unwrap()).expect("kept");
                    let segments = &conv.snapshots.back().expect("a snapshot").segments;
                    let lorem_unit = segments
                        .units
                        .iter()
                        .find(|u| u.bytes.len() > lorem.len())
                        .expect("the long block");
                    let inside = |b: &Bytes| {
                        let (at, end) = (b.as_ptr() as usize, body.as_ptr() as usize);
                        at >= end && at + b.len() <= end + body.len()
                    };
                    // Dried or kept, the body sent is held as what rules wrote.
                    assert!(
                        inside(&lorem_unit.bytes),
                        "a unit copied unchanged shares the body received"
                    );
                }
                report.started_ms = 0;
                report.baseline = None;
                report.prediction.read_from = None;
                reports.push(serde_json::to_value(&report).unwrap());
            }
            reports
        };
        let (kept, dried) = (run(false), run(true));
        assert_eq!(kept, dried);
        // The second is the first again: what it wrote is read.
        assert_eq!(dried[1]["verdict"], "hit");
        assert_eq!(
            dried[1]["prediction"]["read_through"],
            dried[0]["prediction"]["write_through"]
        );
    }

    /// Each provider reason, OpenAI's and Anthropic's, set against promptgate's.
    #[test]
    fn the_providers_reasons_are_judged_against_promptgates() {
        use crate::provider::CacheDiagnosis;
        let says = |said: &str, ours: Option<Reason>| {
            let d = CacheDiagnosis {
                reason: said.into(),
                missed_tokens: None,
            };
            ProviderSays::judge(&d, ours.as_ref()).agrees
        };
        let model = || {
            Some(Reason::ModelChanged {
                before: "a".into(),
                after: "b".into(),
            })
        };
        let tools = || {
            Some(Reason::ToolsChanged {
                added: vec!["x".into()],
                removed: vec![],
                changed: vec![],
            })
        };
        let setting = || {
            Some(Reason::SettingChanged {
                setting: "reasoning.effort".into(),
                before: Some("low".into()),
                after: Some("high".into()),
            })
        };
        assert_eq!(says("model_changed", model()), Some(true));
        assert_eq!(says("tools_changed", model()), Some(false));
        assert_eq!(says("tools_changed", tools()), Some(true));
        assert_eq!(says("reasoning_effort_changed", setting()), Some(true));
        assert_eq!(
            says("messages_changed", setting()),
            Some(true),
            "Anthropic has no settings reason"
        );
        assert_eq!(says("input_changed", setting()), Some(false));
        assert_eq!(
            says("system_changed", None),
            Some(false),
            "a change promptgate did not see"
        );
        assert_eq!(says("cache_hit", None), Some(true));
        assert_eq!(says("cache_hit", tools()), Some(false));
        for nothing in [
            "comparison_response_not_found",
            "previous_message_not_found",
            "unavailable",
        ] {
            assert_eq!(says(nothing, model()), None, "{nothing} names no change");
        }
    }

    fn layer(text: &str) -> CacheConfigLayer {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn the_unpriced_models_warned_about_are_capped_cut_and_redacted() {
        let redactor = Redactor::new(&[], &[]).unwrap();
        let mut set = Unpriced::default();
        let long = |i: usize| format!("model-{i}-{}", "x".repeat(1 << 20));
        let first = set.note(&long(0), Some(&redactor));
        let Some(UnpricedWarning::Model(name)) = &first else {
            panic!("{first:?}");
        };
        assert!(name.len() < NAME_MAX + 32, "{} bytes", name.len());
        assert!(name.ends_with(&format!("…(cut, {} bytes)", long(0).len())));
        assert_eq!(set.note(&long(0), Some(&redactor)), None, "once per model");
        for i in 1..UNPRICED_WARNED_MAX {
            assert!(matches!(
                set.note(&long(i), Some(&redactor)),
                Some(UnpricedWarning::Model(_))
            ));
        }
        // Past the cap: said once, then nothing, and the set stays as it was.
        for i in 0..1000 {
            let said = set.note(&long(UNPRICED_WARNED_MAX + i), Some(&redactor));
            assert_eq!(said, (i == 0).then_some(UnpricedWarning::Full));
        }
        assert_eq!(set.names.len(), UNPRICED_WARNED_MAX);
        assert!(set.names.iter().all(|n| n.len() < NAME_MAX + 32));
        // A key pasted as the model is never kept nor named.
        let mut set = Unpriced::default();
        let key = "sk-ant-api03-CANARYunpriced0123456789abcdefABCDEF";
        let said = set.note(key, Some(&redactor));
        assert!(
            matches!(&said, Some(UnpricedWarning::Model(n)) if n.starts_with("[REDACTED:anthropic:")),
            "{said:?}"
        );
    }

    #[test]
    fn settings_apply_over_the_defaults() {
        let mut s = CacheSettings::default();
        assert_eq!(s.min_tokens_for("claude-opus-4-6"), 4096);
        assert_eq!(
            s.min_tokens_for("someone-elses-model"),
            cost::FALLBACK_MIN_TOKENS
        );
        s.apply(layer(
            r#"
            enabled = false
            conversations = 3
            ignore = []
            [min_tokens]
            "claude-opus-4-6*" = 2048
            [prices."my-model"]
            input = 1.0
            output = 2.0
            "#,
        ))
        .unwrap();
        assert!(!s.enabled && s.ignore.is_empty() && s.conversations == 3);
        assert_eq!(s.min_tokens_for("claude-opus-4-6"), 2048);
        let (_, p) = s.prices.find("my-model").unwrap();
        assert_eq!(
            (p.cache_read, p.cache_write_5m, p.cache_write_1h),
            (0.1, 1.25, 2.0)
        );
        assert!(s.prices.find("claude-opus-5").is_some(), "defaults stay");
    }

    #[test]
    fn bad_settings_name_their_key() {
        let mut s = CacheSettings::default();
        let err = s
            .apply(layer(r#"ignore = [{ region = "system", text = "(" }]"#))
            .unwrap_err();
        assert!(
            err.to_string().starts_with("ignore[0].text: invalid regex"),
            "{err}"
        );
        let err = s.apply(layer("conversations = 0")).unwrap_err();
        assert_eq!(err.to_string(), "conversations: must be at least 1");
        let err = s
            .apply(layer("[prices.m]\ninput = -1.0\noutput = 1.0"))
            .unwrap_err();
        assert!(err.to_string().contains("must be numbers >= 0"), "{err}");
        assert!(
            toml::from_str::<CacheConfigLayer>("colour = 1").is_err(),
            "unknown keys refused"
        );
    }
}

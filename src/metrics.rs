//! Prometheus metrics, served at `GET /metrics` on the admin listener.
//!
//! Two kinds of series:
//! - **per exchange** (counts, tokens, dollars, verdicts, latencies, rule fires):
//!   [`Metrics`] is a [`RecordSink`], so they are counted on the record pipeline's
//!   thread after cache analysis, never on the request path;
//! - **state** (in flight, queues, connections, reloads, leaf mints): read from
//!   the parts that already count them, at scrape time ([`Sources`]).
//!
//! Label values are closed sets, except models (the first `metrics.max_models`
//! names, then `other`; each redacted and cut to [`NAME_MAX`] bytes) and rules
//! (names from the loaded set).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, text as openmetrics,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Deserialize;

use crate::provider::price::{Price, Table};
use crate::record::{ExchangeRecord, Outcome, RecordSink, Recorder};
use crate::redact::{NAME_MAX, Redactor};
use crate::rules::reload::LiveRules;

/// `[metrics]` in the config file, as written.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsLayer {
    /// Distinct model names with series of their own; later ones count as `other`.
    pub max_models: Option<usize>,
}

/// The validated `[metrics]` settings.
#[derive(Debug, Clone)]
pub struct MetricsSettings {
    pub max_models: usize,
}

impl Default for MetricsSettings {
    fn default() -> Self {
        MetricsSettings { max_models: 50 }
    }
}

impl MetricsSettings {
    pub fn apply(&mut self, layer: MetricsLayer) {
        if let Some(n) = layer.max_models {
            self.max_models = n;
        }
    }
}

/// The model label past `max_models`.
const OTHER: &str = "other";
/// The label of an absent value (no model, no provider, no status).
const NONE: &str = "none";

/// Buckets for model calls: 10 ms to 10 min.
const CALL_BUCKETS: [f64; 15] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Buckets for promptgate's own time: 10 µs to 1 s.
const OVERHEAD_BUCKETS: [f64; 15] = [
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExchangeLabels {
    provider: &'static str,
    model: Arc<str>,
    outcome: &'static str,
    status_class: &'static str,
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    provider: &'static str,
    model: Arc<str>,
    r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CostLabels {
    provider: &'static str,
    model: Arc<str>,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabels {
    verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgreementLabels {
    /// `yes`, `no`, or `none` (the provider named no change).
    agrees: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    rule: Arc<str>,
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    /// `rules`, or a hook's name from the loaded set.
    policy: Arc<str>,
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    policy: Arc<str>,
    phase: &'static str,
    /// `continue`, `changed`, `respond`, `skipped` or `error`.
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FindingLabels {
    /// A built-in detector's name, or a `[[detector]]`'s from the loaded set.
    detector: Arc<str>,
    /// `secret` or `pii`.
    kind: &'static str,
    /// `block`, `mask`, `mask_and_restore`, `tag`, `log` or `found`.
    action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BudgetLabels {
    /// A budget's name from the loaded set.
    budget: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BlockLabels {
    rule: Arc<str>,
}

type Dollars = Counter<f64, AtomicU64>;

/// The per-exchange series, and the sink that counts them.
pub(crate) struct Metrics {
    registry: Registry,
    exchanges: Family<ExchangeLabels, Counter>,
    tokens: Family<TokenLabels, Counter>,
    cost: Family<CostLabels, Dollars>,
    lost: Family<ReasonLabels, Dollars>,
    verdicts: Family<VerdictLabels, Counter>,
    provider_diagnoses: Family<AgreementLabels, Counter>,
    upstream_head: Histogram,
    first_byte: Histogram,
    duration: Histogram,
    overhead: Histogram,
    request_bytes: Histogram,
    rule_fires: Family<RuleLabels, Counter>,
    policy_seconds: Family<PolicyLabels, Histogram, fn() -> Histogram>,
    policy_decisions: Family<DecisionLabels, Counter>,
    findings: Family<FindingLabels, Counter>,
    blocks: Family<BlockLabels, Counter>,
    stalls: Counter,
    names: Mutex<Names>,
    prices: Table<Price>,
    rules: Arc<LiveRules>,
    /// A model name is a client's text: redacted and cut before it is a label.
    redactor: Arc<Redactor>,
}

/// Label values seen so far, shared so that a known one costs no allocation. Models
/// are keyed by their label (redacted, at most [`NAME_MAX`] bytes), so the map
/// holds at most `max_models` short names whatever clients send.
struct Names {
    models: HashMap<String, Arc<str>>,
    max_models: usize,
    other: Arc<str>,
    none: Arc<str>,
    rules: HashMap<String, Arc<str>>,
}

impl Names {
    fn model(&mut self, model: Option<&str>) -> Arc<str> {
        let Some(model) = model.filter(|m| !m.is_empty()) else {
            return self.none.clone();
        };
        if let Some(known) = self.models.get(model) {
            return known.clone();
        }
        if self.models.len() >= self.max_models {
            return self.other.clone();
        }
        let name: Arc<str> = Arc::from(model);
        self.models.insert(model.to_owned(), name.clone());
        name
    }

    fn rule(&mut self, rule: &str) -> Arc<str> {
        if let Some(known) = self.rules.get(rule) {
            return known.clone();
        }
        let name: Arc<str> = Arc::from(rule);
        self.rules.insert(rule.to_owned(), name.clone());
        name
    }
}

/// A policy's turn: 10 µs (a rule) to the hooks' 1 s default timeout and past it.
const POLICY_BUCKETS: [f64; 12] = [
    0.000_01, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
];

fn histogram(buckets: &[f64]) -> Histogram {
    Histogram::new(buckets.iter().copied())
}

impl Metrics {
    /// How often the rule `rule` of `phase` fired since the start.
    pub(crate) fn rule_fires(&self, rule: &str, phase: &'static str) -> u64 {
        let labels = RuleLabels {
            rule: Arc::from(rule),
            phase,
        };
        self.rule_fires.get(&labels).map_or(0, |c| c.get())
    }

    /// How often `policy` (a hook's or the scanner's name, or `rules`) decided
    /// each way since the start, over every phase: `continue`, `changed`, `respond`,
    /// `skipped`, `error`.
    pub(crate) fn policy_decisions(
        &self,
        policy: &str,
    ) -> std::collections::BTreeMap<&'static str, u64> {
        let mut out = std::collections::BTreeMap::new();
        for phase in crate::policy::Phase::ALL {
            for decision in ["continue", "changed", "respond", "skipped", "error"] {
                let labels = DecisionLabels {
                    policy: Arc::from(policy),
                    phase: phase.name(),
                    decision,
                };
                if let Some(c) = self.policy_decisions.get(&labels) {
                    *out.entry(decision).or_default() += c.get();
                }
            }
        }
        out
    }

    /// The series, empty; `prices` price the tokens, `rules` name the rules' phases,
    /// `redactor` cleans the model names before they are labels.
    // One registration per metric family: splitting it would scatter the table.
    #[allow(clippy::too_many_lines)]
    pub(crate) fn new(
        settings: &MetricsSettings,
        prices: Table<Price>,
        rules: Arc<LiveRules>,
        redactor: Arc<Redactor>,
    ) -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            exchanges: Family::default(),
            tokens: Family::default(),
            cost: Family::default(),
            lost: Family::default(),
            verdicts: Family::default(),
            provider_diagnoses: Family::default(),
            upstream_head: histogram(&CALL_BUCKETS),
            first_byte: histogram(&CALL_BUCKETS),
            duration: histogram(&CALL_BUCKETS),
            overhead: histogram(&OVERHEAD_BUCKETS),
            request_bytes: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(256.0, 4.0, 10),
            ),
            rule_fires: Family::default(),
            policy_seconds: Family::new_with_constructor(|| histogram(&POLICY_BUCKETS)),
            policy_decisions: Family::default(),
            findings: Family::default(),
            blocks: Family::default(),
            stalls: Counter::default(),
            names: Mutex::new(Names {
                models: HashMap::new(),
                max_models: settings.max_models,
                other: Arc::from(OTHER),
                none: Arc::from(NONE),
                rules: HashMap::new(),
            }),
            prices,
            rules,
            redactor,
        };
        let r = &mut m.registry;
        r.register(
            "promptgate_exchanges",
            "Exchanges ended, by provider, model, outcome, status class and mode",
            m.exchanges.clone(),
        );
        r.register(
            "promptgate_tokens",
            "Tokens the providers reported: input (uncached), output, cache_read, cache_write_5m, cache_write_1h",
            m.tokens.clone(),
        );
        r.register(
            "promptgate_cost_dollars",
            "Dollars by the price table: input (uncached), output, cache_read, cache_write",
            m.cost.clone(),
        );
        r.register(
            "promptgate_cache_lost_dollars",
            "Dollars lost to cache misses, by the reason cache analysis gave",
            m.lost.clone(),
        );
        r.register(
            "promptgate_cache_verdicts",
            "Cache analysis verdicts",
            m.verdicts.clone(),
        );
        r.register(
            "promptgate_policy_seconds",
            "Each policy's turn at a phase (the rules as one, each hook by name)",
            m.policy_seconds.clone(),
        );
        r.register(
            "promptgate_policy_decisions",
            "Each policy's decisions by phase: continue, changed, respond, skipped or error",
            m.policy_decisions.clone(),
        );
        r.register(
            "promptgate_secrets_findings",
            "Values the outgoing-secrets scanner found in requests, by detector, kind and action",
            m.findings.clone(),
        );
        r.register(
            "promptgate_cache_provider_diagnoses",
            "Cache misses the provider diagnosed, by whether it named what cache analysis named",
            m.provider_diagnoses.clone(),
        );
        r.register(
            "promptgate_upstream_head_seconds",
            "From the request's start to the upstream's response head",
            m.upstream_head.clone(),
        );
        r.register(
            "promptgate_time_to_first_byte_seconds",
            "From the request's start to the first response body byte from upstream",
            m.first_byte.clone(),
        );
        r.register(
            "promptgate_exchange_duration_seconds",
            "From the request's start to its end",
            m.duration.clone(),
        );
        r.register(
            "promptgate_overhead_seconds",
            "Time promptgate itself added: last request byte in to the request going upstream, \
             plus response head in to response head out",
            m.overhead.clone(),
        );
        r.register(
            "promptgate_request_bytes",
            "Request body bytes received",
            m.request_bytes.clone(),
        );
        r.register(
            "promptgate_rule_fires",
            "Rules that fired, by rule and phase",
            m.rule_fires.clone(),
        );
        r.register(
            "promptgate_blocks",
            "Requests a rule blocked, by rule",
            m.blocks.clone(),
        );
        r.register(
            "promptgate_stream_stalls",
            "Streams that went silent past the stall threshold",
            m.stalls.clone(),
        );
        m
    }

    /// Counts one finished exchange.
    // One update per metric family a record feeds: splitting it would scatter the table.
    #[allow(clippy::too_many_lines)]
    pub(crate) fn count(&self, record: &ExchangeRecord) {
        // Redacted and cut before the lock: the label, never the raw name, is kept.
        let label = record
            .model
            .as_deref()
            .filter(|m| !m.is_empty())
            .map(|m| self.redactor.bounded(m, &record.extra_redactions, NAME_MAX));
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        let provider = record.provider.map_or(NONE, |p| p.name());
        let model = names.model(label.as_deref());
        self.exchanges
            .get_or_create(&ExchangeLabels {
                provider,
                model: model.clone(),
                outcome: record.outcome.name(),
                status_class: status_class(record.status),
                mode: record.mode.name(),
            })
            .inc();
        self.request_bytes.observe(record.bytes_in as f64);
        let t = &record.timing;
        self.duration.observe(t.total.as_secs_f64());
        if let Some(d) = t.upstream_headers {
            self.upstream_head.observe(d.as_secs_f64());
        }
        if let Some(d) = t.first_byte {
            self.first_byte.observe(d.as_secs_f64());
        }
        if let Some(d) = t.overhead() {
            self.overhead.observe(d.as_secs_f64());
        }
        let usage = record
            .observation
            .as_ref()
            .and_then(|o| o.summary.usage.as_ref());
        if let Some(u) = usage {
            let (w5, w1) = match (u.cache_write_5m_tokens, u.cache_write_1h_tokens) {
                (Some(a), Some(b)) if a + b == u.cache_write_tokens => (a, b),
                // No split given: the default ttl.
                _ => (u.cache_write_tokens, 0),
            };
            for (kind, n) in [
                ("input", u.input_tokens),
                ("output", u.output_tokens),
                ("cache_read", u.cache_read_tokens),
                ("cache_write_5m", w5),
                ("cache_write_1h", w1),
            ] {
                self.tokens
                    .get_or_create(&TokenLabels {
                        provider,
                        model: model.clone(),
                        r#type: kind,
                    })
                    .inc_by(n);
            }
            // Priced by the model that answered, as the provider bills it.
            let billed = record
                .observation
                .as_ref()
                .and_then(|o| o.summary.model.as_deref())
                .or(record.model.as_deref());
            if let Some((_, price)) = billed.and_then(|m| self.prices.find(m)) {
                let per = price.input / 1e6;
                for (kind, usd) in [
                    ("input", per * u.input_tokens as f64),
                    ("output", price.output / 1e6 * u.output_tokens as f64),
                    (
                        "cache_read",
                        per * price.cache_read * u.cache_read_tokens as f64,
                    ),
                    (
                        "cache_write",
                        per * (price.cache_write_5m * w5 as f64 + price.cache_write_1h * w1 as f64),
                    ),
                ] {
                    self.cost
                        .get_or_create(&CostLabels {
                            provider,
                            model: model.clone(),
                            kind,
                        })
                        .inc_by(usd);
                }
            }
        }
        if let Some(cache) = &record.cache {
            self.verdicts
                .get_or_create(&VerdictLabels {
                    verdict: cache.verdict.name(),
                })
                .inc();
            if let Some(says) = &cache.provider_says {
                let agrees = match says.agrees {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "none",
                };
                self.provider_diagnoses
                    .get_or_create(&AgreementLabels { agrees })
                    .inc();
            }
            let lost = cache.cost.as_ref().map_or(0.0, |c| c.usd.lost_usd);
            if let Some(reason) = &cache.reason
                && lost > 0.0
            {
                self.lost
                    .get_or_create(&ReasonLabels {
                        reason: reason.name(),
                    })
                    .inc_by(lost);
            }
        }
        if !record.findings.is_empty() {
            let set = self.rules.snapshot();
            for f in &record.findings {
                // Label values come from the built-in list or the loaded set only.
                let detector = match crate::redact::detector(&f.detector) {
                    Some(d) => names.rule(d.name),
                    None if set.scanner().is_some_and(|s| {
                        s.own_detectors().iter().any(|d| d.name == f.detector)
                    }) =>
                    {
                        names.rule(&f.detector)
                    }
                    None => continue,
                };
                let kind =
                    crate::redact::DataKind::from_name(&f.kind).map_or("other", |k| k.name());
                let action = crate::rules::secrets::ACTIONS
                    .iter()
                    .find(|a| **a == f.action)
                    .copied()
                    .unwrap_or("other");
                self.findings
                    .get_or_create(&FindingLabels {
                        detector,
                        kind,
                        action,
                    })
                    .inc();
            }
        }
        if !record.rules_fired.is_empty() {
            let set = self.rules.snapshot();
            for fired in &record.rules_fired {
                // Rule names come from the loaded set; one reloaded away is not counted.
                let Some(rule) = set.rules().iter().find(|r| &r.name == fired) else {
                    continue;
                };
                let rule_name = names.rule(&rule.name);
                self.rule_fires
                    .get_or_create(&RuleLabels {
                        rule: rule_name,
                        phase: rule.phase.name(),
                    })
                    .inc();
            }
        }
        if !record.policy_runs.is_empty() {
            let set = self.rules.snapshot();
            for run in &record.policy_runs {
                // Hook names come from the loaded set: a client cannot add labels.
                let known = run.policy == "rules"
                    || run.policy == crate::rules::secrets::SCANNER
                    || set.hooks().iter().any(|h| h.name == run.policy);
                if !known {
                    continue;
                }
                let policy = names.rule(&run.policy);
                let phase = run.phase.name();
                self.policy_seconds
                    .get_or_create(&PolicyLabels {
                        policy: policy.clone(),
                        phase,
                    })
                    .observe(run.took_us as f64 / 1e6);
                self.policy_decisions
                    .get_or_create(&DecisionLabels {
                        policy,
                        phase,
                        decision: decision_kind(&run.decision),
                    })
                    .inc();
            }
        }
        if record.stall.is_some() {
            self.stalls.inc();
        }
        if record.outcome == Outcome::Blocked {
            // The rule that blocks is the last to fire.
            let rule = match record.rules_fired.last() {
                Some(r) => names.rule(r),
                None => names.none.clone(),
            };
            self.blocks.get_or_create(&BlockLabels { rule }).inc();
        }
    }

    /// The text of a scrape: the Prometheus text format, or OpenMetrics when
    /// `openmetrics`; with the state read from `sources` now.
    pub(crate) fn render(
        &self,
        sources: &Sources,
        openmetrics: bool,
    ) -> Result<String, std::fmt::Error> {
        let mut state = Registry::default();
        state.register_collector(Box::new(sources.clone()));
        // Budgets: read now, labelled by the budget's name only (never a scope value).
        let shares: Family<BudgetLabels, Gauge<f64, AtomicU64>> = Family::default();
        if let Some(budgets) = self.rules.snapshot().budgets() {
            for b in budgets.report() {
                let share = b.scopes.iter().map(|s| s.share).fold(0.0, f64::max);
                shares
                    .get_or_create(&BudgetLabels {
                        budget: Arc::from(b.name.as_str()),
                    })
                    .set(share);
            }
        }
        state.register(
            "promptgate_budget_spent_share",
            "Each budget's most spent scope, as a share of its nearest limit (1 is spent)",
            shares,
        );
        let mut out = String::with_capacity(16 << 10);
        if openmetrics {
            openmetrics::encode_registry(&mut out, &self.registry)?;
            openmetrics::encode_registry(&mut out, &state)?;
            openmetrics::encode_eof(&mut out)?;
        } else {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?;
            prometheus_client::encoding::prometheus_text::encode(&mut out, &state)?;
        }
        Ok(out)
    }
}

impl RecordSink for Metrics {
    fn record(&self, record: &ExchangeRecord) {
        self.count(record);
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn status_class(status: Option<http::StatusCode>) -> &'static str {
    match status.map(|s| s.as_u16() / 100) {
        Some(1) => "1xx",
        Some(2) => "2xx",
        Some(3) => "3xx",
        Some(4) => "4xx",
        Some(5) => "5xx",
        _ => NONE,
    }
}

/// Reads one part's state at scrape time; the server wires each to the part that
/// counts it (the listener, the capture, the exporter), which metrics does not import.
pub(crate) type Read<T> = Arc<dyn Fn() -> T + Send + Sync>;

/// Client connections counted since start, read at one moment (the listener fills it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Connections {
    /// TCP connections admitted.
    pub accepted: u64,
    /// TCP connections refused past a cap.
    pub refused: u64,
    /// CONNECT tunnels whose TLS promptgate terminated.
    pub intercepted: u64,
    /// CONNECT tunnels relayed blind.
    pub tunnelled: u64,
}

/// The capture pipeline now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CaptureState {
    /// Bytes of records waiting for the capture writer.
    pub queued_bytes: u64,
    /// Records waiting in the local spool, when the store has one (PostgreSQL).
    pub spooled: Option<u64>,
    pub written: u64,
    /// Records dropped because the queue stayed full.
    pub dropped: u64,
    /// Of those, dropped because the queue stayed full past `capture.queue_wait`.
    pub dropped_queue_full: u64,
    /// Of those, dropped because the capture had closed (shutdown).
    pub dropped_closed: u64,
    /// Records the store failed to write.
    pub failed: u64,
}

/// Spans handed to the OTLP exporter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SpanCounts {
    pub exported: u64,
    /// Dropped: the queue was full, or the collector failed or refused them.
    pub dropped: u64,
}

/// What the state series are read from, at scrape time.
#[derive(Clone)]
pub(crate) struct Sources {
    pub recorder: Arc<Recorder>,
    /// The capture pipeline, when capture is on.
    pub capture: Option<Read<CaptureState>>,
    /// The capture store's size on disk (database and write-ahead log), for a
    /// store in a directory.
    pub capture_store_bytes: Option<Read<u64>>,
    pub rules: Arc<LiveRules>,
    pub leaves: Option<Arc<crate::tls::Interception>>,
    pub connections: Read<Connections>,
    /// The OTLP exporter's counts, when export is on.
    pub export: Option<Read<SpanCounts>>,
    pub started: Instant,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sources")
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: &'static str,
}

/// Writes one series family of `values` by label set.
fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    values: &[(L, M)],
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in values {
        value.encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(value).encode(metric)
}

fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Collector for Sources {
    // One block per metric family, in the order /metrics lists them: splitting it would scatter the table.
    #[allow(clippy::too_many_lines)]
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let e = &mut encoder;
        gauge(
            e,
            "promptgate_inflight_exchanges",
            "Exchanges begun and not yet recorded",
            as_i64(self.recorder.in_flight() as u64),
        )?;
        let c = (self.connections)();
        family(
            e,
            "promptgate_connections",
            "Client connections: tcp (accepted), intercepted and tunnelled (CONNECT), refused (past a cap)",
            MetricType::Counter,
            &[
                (ModeLabels { mode: "tcp" }, ConstCounter::new(c.accepted)),
                (
                    ModeLabels {
                        mode: "intercepted",
                    },
                    ConstCounter::new(c.intercepted),
                ),
                (
                    ModeLabels { mode: "tunnelled" },
                    ConstCounter::new(c.tunnelled),
                ),
                (ModeLabels { mode: "refused" }, ConstCounter::new(c.refused)),
            ],
        )?;
        let mints = ConstCounter::new(self.leaves.as_ref().map_or(0, |l| l.minted()));
        let metric = e.encode_descriptor(
            "promptgate_tls_leaf_mints",
            "Leaf certificates minted for intercepted hosts",
            None,
            MetricType::Counter,
        )?;
        mints.encode(metric)?;
        let reloads = self.rules.reloads();
        family(
            e,
            "promptgate_rules_reload",
            "Rule directory reloads, by result",
            MetricType::Counter,
            &[
                (ResultLabels { result: "ok" }, ConstCounter::new(reloads.ok)),
                (
                    ResultLabels { result: "failed" },
                    ConstCounter::new(reloads.failed),
                ),
            ],
        )?;
        gauge(
            e,
            "promptgate_rules_loaded",
            "Rules live now",
            as_i64(self.rules.snapshot().rules().len() as u64),
        )?;
        if let Some(capture) = &self.capture {
            let counts = capture();
            gauge(
                e,
                "promptgate_capture_queue_bytes",
                "Bytes of records waiting for the capture writer",
                as_i64(counts.queued_bytes),
            )?;
            if let Some(spooled) = counts.spooled {
                gauge(
                    e,
                    "promptgate_capture_spool_records",
                    "Records waiting in the local spool for the PostgreSQL store to come back",
                    as_i64(spooled),
                )?;
            }
            family(
                e,
                "promptgate_capture_records",
                "Records handed to the capture: written, dropped (queue full), failed (store error)",
                MetricType::Counter,
                &[
                    (
                        ResultLabels { result: "written" },
                        ConstCounter::new(counts.written),
                    ),
                    (
                        ResultLabels { result: "dropped" },
                        ConstCounter::new(counts.dropped),
                    ),
                    (
                        ResultLabels { result: "failed" },
                        ConstCounter::new(counts.failed),
                    ),
                ],
            )?;
            family(
                e,
                "promptgate_capture_dropped_records",
                "Records the capture dropped, by why: queue_full (raise capture.queue_bytes), closed (ended after shutdown began)",
                MetricType::Counter,
                &[
                    (
                        ReasonLabels {
                            reason: "queue_full",
                        },
                        ConstCounter::new(counts.dropped_queue_full),
                    ),
                    (
                        ReasonLabels { reason: "closed" },
                        ConstCounter::new(counts.dropped_closed),
                    ),
                ],
            )?;
        }
        if let Some(store_bytes) = &self.capture_store_bytes {
            gauge(
                e,
                "promptgate_capture_store_bytes",
                "Size of the capture store on disk (database and write-ahead log)",
                as_i64(store_bytes()),
            )?;
        }
        if let Some(export) = &self.export {
            let export = export();
            family(
                e,
                "promptgate_otlp_spans",
                "Spans handed to the OTLP exporter: exported, or dropped (queue full, collector down)",
                MetricType::Counter,
                &[
                    (
                        ResultLabels { result: "exported" },
                        ConstCounter::new(export.exported),
                    ),
                    (
                        ResultLabels { result: "dropped" },
                        ConstCounter::new(export.dropped),
                    ),
                ],
            )?;
        }
        gauge(
            e,
            "promptgate_uptime_seconds",
            "Seconds since promptgate started",
            as_i64(self.started.elapsed().as_secs()),
        )?;
        family(
            e,
            "promptgate_build_info",
            "The running version (always 1)",
            MetricType::Gauge,
            &[(
                VersionLabels {
                    version: env!("CARGO_PKG_VERSION"),
                },
                ConstGauge::new(1i64),
            )],
        )?;
        Ok(())
    }
}

/// Which exposition format a scrape asked for: OpenMetrics when its `Accept`
/// prefers it (Prometheus servers do), else the Prometheus text format.
pub(crate) fn wants_openmetrics(accept: Option<&str>) -> bool {
    let Some(accept) = accept else {
        return false;
    };
    let mut best = (0.0f32, false);
    for item in accept.split(',') {
        let mut parts = item.split(';').map(str::trim);
        let kind = parts.next().unwrap_or("");
        let q = parts
            .find_map(|p| p.strip_prefix("q="))
            .and_then(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        let open = match kind {
            "application/openmetrics-text" => true,
            "text/plain" | "*/*" | "text/*" => false,
            _ => continue,
        };
        if q > best.0 {
            best = (q, open);
        }
    }
    best.1
}

/// The content type of a scrape answer.
pub(crate) fn content_type(openmetrics: bool) -> &'static str {
    if openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        prometheus_client::encoding::prometheus_text::CONTENT_TYPE
    }
}

/// The kind of a policy turn's decision; a hook's error text (`error: timeout after
/// 1000 ms (allowed)`) counts as `error`.
fn decision_kind(decision: &str) -> &'static str {
    match decision {
        "continue" => "continue",
        "changed" => "changed",
        "respond" => "respond",
        "skipped" => "skipped",
        _ => "error",
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn prometheus_servers_get_openmetrics_and_curl_gets_text() {
        // What Prometheus 2.x sends.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                    version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prom)));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some(
            "text/plain;q=0.9,application/openmetrics-text;q=0.5"
        )));
    }

    fn metrics(max_models: usize) -> Metrics {
        let rules = Arc::new(LiveRules::new(crate::rules::RuleSet::default()));
        Metrics::new(
            &MetricsSettings { max_models },
            crate::provider::price::prices(Vec::new()),
            rules,
            Arc::new(Redactor::new(&[], &[]).unwrap()),
        )
    }

    fn text(m: &Metrics) -> String {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &m.registry).unwrap();
        out
    }

    #[test]
    fn an_exchange_counts_its_tokens_dollars_and_times() {
        let m = metrics(1);
        let mut r = ExchangeRecord::begin(
            crate::id::ExchangeId::new(),
            None,
            http::Method::POST,
            "/v1/messages".into(),
        );
        r.provider = Some(crate::provider::Provider::Anthropic);
        r.model = Some("claude-opus-5-5".into());
        r.status = Some(http::StatusCode::OK);
        r.outcome = Outcome::Ok;
        r.bytes_in = 1000;
        r.timing = crate::record::Timing {
            upstream_headers: Some(Duration::from_millis(40)),
            first_byte: Some(Duration::from_millis(45)),
            total: Duration::from_millis(900),
            body_read: Some(Duration::from_micros(100)),
            sent_upstream: Some(Duration::from_micros(300)),
            head_to_client: Some(Duration::from_micros(40_050)),
        };
        let usage = crate::provider::Usage {
            input_tokens: 10,
            output_tokens: 20,
            cache_read_tokens: 1_000_000,
            cache_write_tokens: 300,
            cache_write_5m_tokens: Some(100),
            cache_write_1h_tokens: Some(200),
            ..Default::default()
        };
        r.observation = Some(crate::observer::Observation {
            format: crate::observer::BodyFormat::Empty,
            summary: crate::provider::ResponseSummary {
                usage: Some(usage),
                ..Default::default()
            },
            parse_error: None,
            truncated: false,
            body: bytes::Bytes::new(),
        });
        m.count(&r);
        // A second model is past max_models = 1.
        r.model = Some("claude-sonnet-5-5".into());
        r.observation = None;
        m.count(&r);
        let t = text(&m);
        let has = |line: &str| t.lines().any(|l| l == line);
        assert!(
            has(
                r#"promptgate_tokens_total{provider="anthropic",model="claude-opus-5-5",type="cache_read"} 1000000"#
            ),
            "{t}"
        );
        assert!(has(
            r#"promptgate_tokens_total{provider="anthropic",model="claude-opus-5-5",type="cache_write_1h"} 200"#
        ));
        assert!(has(
            r#"promptgate_exchanges_total{provider="anthropic",model="other",outcome="ok",status_class="2xx",mode="reverse"} 1"#
        ));
        let value = |series: &str| -> f64 {
            t.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("no {series} in {t}"))
        };
        let cost = |kind: &str| {
            value(&format!(
                r#"promptgate_cost_dollars_total{{provider="anthropic",model="claude-opus-5-5",kind="{kind}"}}"#
            ))
        };
        // By the default table, as its own lookup prices it.
        let (_, p) = crate::provider::price::prices(Vec::new())
            .find("claude-opus-5-5")
            .unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(cost("cache_read"), p.input * p.cache_read));
        assert!(close(cost("input"), p.input * 10e-6));
        assert!(close(cost("output"), p.output * 20e-6));
        let writes = p.input * 1e-6 * (100.0 * p.cache_write_5m + 200.0 * p.cache_write_1h);
        assert!(close(cost("cache_write"), writes));
        // 200 µs out and 50 µs back, twice.
        assert!(has("promptgate_overhead_seconds_sum 0.0005"), "{t}");
        assert!(
            has(r#"promptgate_overhead_seconds_bucket{le="0.00025"} 2"#),
            "{t}"
        );
        assert!(has("promptgate_exchange_duration_seconds_count 2"));
    }

    #[test]
    fn models_past_the_cap_count_as_other() {
        let mut names = Names {
            models: HashMap::new(),
            max_models: 2,
            other: Arc::from(OTHER),
            none: Arc::from(NONE),
            rules: HashMap::new(),
        };
        let a = names.model(Some("a"));
        assert_eq!(&*names.model(Some("b")), "b");
        assert_eq!(&*names.model(Some("c")), OTHER);
        assert!(
            Arc::ptr_eq(&a, &names.model(Some("a"))),
            "a known name is shared"
        );
        assert_eq!(&*names.model(None), NONE);
    }
}

//! Budgets and rate limits: `[[budget]]` tables in the rules files cap what a
//! conversation, a credential, a model, a request class or everything together may
//! spend in a window (dollars, tokens, requests), checked before each request goes
//! and charged with what the provider said it used once the exchange ends.
//!
//! One policy serves every budget of a set. At `before_provider_request` it adds
//! the request's estimate (input from the body's size, the answer from the
//! budget's `output_estimate`, priced as uncached input and output) to what the
//! scope spent in the window and to what requests still in flight hold, and
//! answers in the provider's error shape when a limit would be crossed. The
//! estimate is held for the exchange until it ends; then the provider's usage,
//! priced by the price table, replaces it (a cut answer with no usage is charged
//! its estimate). The counters live in memory and in a SQLite file beside the
//! captures, so a restart keeps them.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use globset::GlobMatcher;
use http::StatusCode;

use super::BLOCK_STATUS;
use super::load::{Cx, Val};
use crate::id::ExchangeId;
use crate::policy::{Block, Decision, Effects, Ending, Facts, OnError, Outgoing, Phase, Policy};
use crate::provider::price::{self, Price, Table};
use crate::runtime::{Clock, Millis};

/// The name the budgets' turns have in the record and in metrics.
pub(crate) const BUDGETS: &str = "budgets";

/// What a budget's spend is counted per.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dim {
    Conversation,
    Key,
    Model,
    RequestClass,
}

impl Dim {
    const ALL: [(Dim, &'static str); 4] = [
        (Dim::Conversation, "conversation"),
        (Dim::Key, "key"),
        (Dim::Model, "model"),
        (Dim::RequestClass, "request_class"),
    ];

    fn name(self) -> &'static str {
        Dim::ALL
            .iter()
            .find(|(d, _)| *d == self)
            .map_or("", |(_, n)| n)
    }
}

/// Over what time a budget's spend adds up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Window {
    /// The conversation's whole life: never resets.
    Lifetime,
    /// The last `Duration`, rolling.
    Rolling(Duration),
    /// The UTC calendar day.
    Day,
}

impl Window {
    fn text(self) -> String {
        match self {
            Window::Lifetime => "in this conversation".into(),
            Window::Rolling(d) => format!("in the last {}", span(d)),
            Window::Day => "today (UTC)".into(),
        }
    }

    /// The bucket a moment's spend goes into: 1/60 of a rolling window (so a sum
    /// is at most one bucket off), the day, or one bucket for all time.
    fn bucket(self, now: Millis) -> Millis {
        match self {
            Window::Lifetime => 0,
            Window::Day => now - now % DAY_MS,
            Window::Rolling(d) => {
                let size = (d.as_millis() as u64 / 60).max(1000);
                now - now % size
            }
        }
    }

    /// The first bucket start that counts now (a bucket counts when it began at or
    /// after it): what a query of the shared counters asks for.
    fn since(self, now: Millis) -> Millis {
        match self {
            Window::Lifetime => 0,
            Window::Day => now - now % DAY_MS,
            Window::Rolling(d) => (now + 1).saturating_sub(d.as_millis() as u64),
        }
    }

    /// Whether a bucket that began at `start` counts now.
    fn holds(self, start: Millis, now: Millis) -> bool {
        match self {
            Window::Lifetime => true,
            Window::Day => start >= now - now % DAY_MS,
            Window::Rolling(d) => start + d.as_millis() as u64 > now,
        }
    }
}

const DAY_MS: u64 = 86_400_000;

fn span(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        s if s % 86_400 == 0 => format!("{} day(s)", s / 86_400),
        s if s % 3600 == 0 => format!("{} hour(s)", s / 3600),
        s if s % 60 == 0 => format!("{} minute(s)", s / 60),
        s => format!("{s} s"),
    }
}

/// What a scope spent, or what a request is estimated to.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Spent {
    pub usd: f64,
    /// The whole input (uncached, cache writes and reads).
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub requests: u64,
}

impl Spent {
    fn add(&mut self, other: &Spent) {
        self.usd += other.usd;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.requests += other.requests;
    }
}

/// A budget's limits; each that is set is checked.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Limits {
    usd: Option<f64>,
    tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    requests: Option<u64>,
}

impl Limits {
    /// The first limit `total` is over: its name, the amount and the limit, as text.
    fn crossed(&self, total: &Spent) -> Option<(&'static str, String, String)> {
        let tokens = total.input_tokens + total.output_tokens;
        let n = |v: u64| v.to_string();
        if let Some(l) = self.usd
            && total.usd > l
        {
            return Some(("usd", format!("${:.2}", total.usd), format!("${l:.2}")));
        }
        for (name, value, limit) in [
            ("tokens", tokens, self.tokens),
            ("input_tokens", total.input_tokens, self.input_tokens),
            ("output_tokens", total.output_tokens, self.output_tokens),
            ("requests", total.requests, self.requests),
        ] {
            if let Some(l) = limit
                && value > l
            {
                return Some((name, n(value), n(l)));
            }
        }
        None
    }

    /// The largest share of a limit `total` uses (0 when none is set).
    fn share(&self, total: &Spent) -> f64 {
        let tokens = (total.input_tokens + total.output_tokens) as f64;
        [
            self.usd.map(|l| total.usd / l),
            self.tokens.map(|l| tokens / l as f64),
            self.input_tokens
                .map(|l| total.input_tokens as f64 / l as f64),
            self.output_tokens
                .map(|l| total.output_tokens as f64 / l as f64),
            self.requests.map(|l| total.requests as f64 / l as f64),
        ]
        .into_iter()
        .flatten()
        .fold(0.0, f64::max)
    }
}

/// One compiled `[[budget]]`.
#[derive(Debug)]
pub(crate) struct Budget {
    pub(crate) name: String,
    scope: Vec<Dim>,
    /// Only requests for these models count (and are checked).
    models: Option<(GlobMatcher, String)>,
    window: Window,
    limits: Limits,
    warn_at: Option<f64>,
    output_estimate: u64,
    on_error: OnError,
}

/// The keys of a `[[budget]]` table.
const BUDGET_KEYS: &[&str] = &[
    "name",
    "scope",
    "models",
    "window",
    "usd",
    "tokens",
    "input_tokens",
    "output_tokens",
    "requests",
    "warn_at",
    "output_estimate",
    "on_error",
];

impl Budget {
    /// Its scope's dimensions, `+`-joined (`key+model`; empty for a global one).
    fn dims(&self) -> String {
        self.scope
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join("+")
    }

    /// What it caps, in a few words (`conversation, in this conversation: $5.00`).
    pub(crate) fn describe(&self) -> String {
        let scope = match self.dims() {
            dims if dims.is_empty() => "global".to_owned(),
            dims => dims,
        };
        format!(
            "budget: {scope} {}: {}",
            self.window.text(),
            limits_text(&self.limits)
        )
    }
}

/// The answer's tokens a check assumes when a budget says nothing: a long answer
/// of an agent turn (Claude Code's `max_tokens` is 32k–128k, its answers mostly a
/// few hundred to a few thousand tokens).
pub(crate) const DEFAULT_OUTPUT_ESTIMATE: u64 = 2048;

/// Compiles a `[[budget]]` table.
pub(crate) fn compile(
    cx: &mut Cx<'_>,
    item: &Val<'_>,
    seen: &mut HashMap<String, String>,
) -> Option<Budget> {
    let errors_before = cx.errors.len();
    let table = cx.table(item, "a budget", BUDGET_KEYS)?;
    let name = super::load::entry_name(cx, item, table, ("budget", "session-cap"), seen)
        .map(|(n, _)| n)
        .unwrap_or_default();
    let mut scope = Vec::new();
    if let Some(v) = table.get("scope") {
        for (text, span) in cx.strings(v, "scope").unwrap_or_default() {
            match Dim::ALL.iter().find(|(_, n)| *n == text) {
                Some((d, _)) if !scope.contains(d) => scope.push(*d),
                Some(_) => {}
                None if text == "global" => {}
                None => cx.error(
                    span,
                    format!(
                        "unknown budget scope {text:?} (known: conversation, key, model, request_class, global)"
                    ),
                ),
            }
        }
    }
    let models = match table.get("models") {
        Some(v) => cx
            .str(v, "models")
            .and_then(|text| cx.glob_text(text, v.span()).map(|g| (g, text.to_owned()))),
        None => None,
    };
    let window = match table.get("window") {
        Some(v) => cx.str(v, "window").and_then(|text| match window_of(text) {
            Some(w) => Some(w),
            None => {
                cx.error(
                    v.span(),
                    format!(
                        "window must be \"conversation\", \"day\" (UTC) or a span such as \"1m\", \"1h\", \"30d\"; found {text:?}"
                    ),
                );
                None
            }
        }),
        None => Some(if scope.contains(&Dim::Conversation) {
            Window::Lifetime
        } else {
            Window::Day
        }),
    };
    if window == Some(Window::Lifetime) && !scope.contains(&Dim::Conversation) {
        cx.error(
            item.span(),
            "window = \"conversation\" needs \"conversation\" in scope",
        );
    }
    let limits = limits_of(cx, item, table);
    let warn_at = match table.get("warn_at") {
        Some(v) => number(cx, v, "warn_at").and_then(|w| {
            if w > 0.0 && w < 1.0 {
                Some(w)
            } else {
                cx.error(
                    v.span(),
                    "warn_at is a share of the limit, between 0 and 1 (e.g. 0.8)",
                );
                None
            }
        }),
        None => None,
    };
    let output_estimate = match table.get("output_estimate") {
        Some(v) => cx.count(v, "output_estimate", 0..10_000_000),
        None => Some(DEFAULT_OUTPUT_ESTIMATE),
    };
    let on_error = match table.get("on_error") {
        Some(v) => cx.on_error(v),
        None => Some(OnError::Allow),
    };
    if cx.errors.len() > errors_before {
        return None;
    }
    Some(Budget {
        name,
        scope,
        models,
        window: window?,
        limits,
        warn_at,
        output_estimate: output_estimate?,
        on_error: on_error?,
    })
}

/// A budget's limits, each checked; an error when it has none.
fn limits_of(cx: &mut Cx<'_>, item: &Val<'_>, table: &toml::de::DeTable<'_>) -> Limits {
    let mut limits = Limits::default();
    if let Some(v) = table.get("usd") {
        limits.usd = number(cx, v, "usd");
    }
    for (key, slot) in [
        ("tokens", &mut limits.tokens),
        ("input_tokens", &mut limits.input_tokens),
        ("output_tokens", &mut limits.output_tokens),
        ("requests", &mut limits.requests),
    ] {
        if let Some(v) = table.get(key) {
            *slot = cx.count(v, key, 1..i64::MAX);
        }
    }
    if ["usd", "tokens", "input_tokens", "output_tokens", "requests"]
        .iter()
        .all(|k| table.get(*k).is_none())
    {
        cx.error(
            item.span(),
            "a budget needs a limit: usd, tokens, input_tokens, output_tokens or requests",
        );
    }
    limits
}

fn number(cx: &mut Cx<'_>, v: &Val<'_>, what: &str) -> Option<f64> {
    match v.get_ref() {
        toml::de::DeValue::Float(f) => f.as_str().parse().ok(),
        toml::de::DeValue::Integer(i) => i.as_str().parse().ok(),
        _ => {
            cx.error(v.span(), format!("{what} must be a number"));
            None
        }
    }
    .filter(|n: &f64| n.is_finite() && *n >= 0.0)
}

/// `conversation`, `day`, or `<n>m|h|d`.
fn window_of(text: &str) -> Option<Window> {
    match text {
        "conversation" => return Some(Window::Lifetime),
        "day" => return Some(Window::Day),
        _ => {}
    }
    let (n, unit) = text.split_at(text.len().checked_sub(1)?);
    let n: u64 = n.parse().ok().filter(|n| *n > 0)?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return None,
    };
    Some(Window::Rolling(Duration::from_secs(secs)))
}

/// A request's estimate held against its scopes until the exchange ends.
#[derive(Debug, Clone)]
struct Held {
    budget: String,
    scope: String,
    estimate: Spent,
    model: Option<String>,
    at: Millis,
}

/// How long a hold outlives an exchange that never said it ended (the client left
/// before the answer): the longest an agent's turn takes, and some.
const HOLD_MAX_MS: u64 = 30 * 60 * 1000;

/// What one budget asks of the counters for one request: its scope's sums since
/// `since` (the window's first bucket), and to hold `estimate` if the request goes.
#[derive(Debug, Clone)]
pub(crate) struct ScopeAsk {
    pub budget: String,
    pub scope: String,
    pub since: Millis,
    pub estimate: Spent,
}

/// What a scope spent in its window, what requests in flight hold for it, and
/// when its oldest counted spend began.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Sums {
    pub spent: Spent,
    pub held: Spent,
    pub oldest: Millis,
}

/// A request's check against the counters: exchange `id`'s asks at `at`; holds
/// older than `held_since` belong to exchanges that never ended and count no more.
pub(crate) struct Reservation<'a> {
    pub id: &'a str,
    pub at: Millis,
    pub held_since: Millis,
    pub asks: &'a [ScopeAsk],
}

/// What an ended exchange adds to one scope's bucket.
#[derive(Debug, Clone)]
pub(crate) struct Charge {
    pub budget: String,
    pub scope: String,
    pub bucket: Millis,
    pub spent: Spent,
}

/// Why the shared counters gave no answer (their own error, as text for the log).
pub(crate) type SharedLedgerError = Box<dyn std::error::Error + Send + Sync>;

/// The counters a fleet of replicas shares (capture's PostgreSQL), so that every
/// replica enforces one budget. Capture implements it.
pub(crate) trait SharedLedger: Send + Sync {
    /// Under a lock on each asked scope that every replica takes, reads each one's
    /// [`Sums`] and asks `judge`; when it says the request goes, keeps the asks'
    /// estimates as holds of the exchange, in the same transaction. Two replicas
    /// checking one scope at once are served one after the other, the second seeing
    /// the first's hold.
    fn reserve(
        &self,
        reservation: &Reservation<'_>,
        judge: &mut dyn FnMut(&[Sums]) -> bool,
    ) -> Result<bool, SharedLedgerError>;

    /// Replaces exchange `id`'s holds with `charges` (none: only releases them), at
    /// once.
    fn charge(&self, id: &str, charges: &[Charge]) -> Result<(), SharedLedgerError>;

    /// Forgets the holds taken before `held_since` (their exchanges never ended: a
    /// replica stopped).
    fn forget_stale(&self, held_since: Millis) -> Result<(), SharedLedgerError>;

    /// Each scope of `budget` with what it spent since `since` and its oldest
    /// bucket, most spent first.
    fn scopes(
        &self,
        budget: &str,
        since: Millis,
    ) -> Result<Vec<(String, Spent, Millis)>, SharedLedgerError>;
}

/// What every scope of every budget spent, by bucket, and what exchanges in flight
/// hold: in memory, written through to a SQLite file when there is one.
pub(crate) struct Ledger {
    state: Mutex<LedgerState>,
    db: Option<Mutex<rusqlite::Connection>>,
    /// Charges not yet in the file, by (budget, scope, bucket), and when it was last
    /// written: one transaction a second at most.
    dirty: Mutex<Unwritten>,
    /// The last write to the file failed: `on_error` decides.
    failing: std::sync::atomic::AtomicBool,
    clock: Clock,
    prices: Table<Price>,
    /// The fleet's counters, when capture goes to PostgreSQL: checks and charges go
    /// there (charges through `charges`, off the request path), the memory keeping
    /// only this replica's holds.
    shared: Option<Arc<dyn SharedLedger>>,
    charges: Arc<ChargeQueue>,
}

/// Charges on their way to the shared counters: gathered by ended exchanges, written
/// by one thread (a failed write is tried again with the next).
#[derive(Default)]
struct ChargeQueue {
    pending: Mutex<Vec<(String, Vec<Charge>)>>,
    ready: std::sync::Condvar,
    /// When stale holds were last forgotten.
    forgot_ms: std::sync::atomic::AtomicU64,
}

/// The most charges kept for a shared store that keeps failing; past it the
/// oldest are dropped, and the log says so.
const CHARGES_KEPT_MAX: usize = 100_000;

/// Charges not yet in the file, by (budget, scope, bucket), and when the file was
/// last written.
type Unwritten = (HashMap<(String, String, Millis), Spent>, Millis);

#[derive(Default)]
struct LedgerState {
    spent: HashMap<(String, String), VecDeque<(Millis, Spent)>>,
    held: HashMap<ExchangeId, Vec<Held>>,
}

impl LedgerState {
    /// What `scope` of `budget` spent in the buckets from `since` on, and what the
    /// holds taken from `held_since` on hold for it.
    fn sums(&self, budget: &str, scope: &str, since: Millis, held_since: Millis) -> Sums {
        let mut sums = Sums {
            oldest: Millis::MAX,
            ..Sums::default()
        };
        if let Some(buckets) = self.spent.get(&(budget.to_owned(), scope.to_owned())) {
            for (start, s) in buckets.iter().filter(|(start, _)| *start >= since) {
                sums.spent.add(s);
                sums.oldest = sums.oldest.min(*start);
            }
        }
        for h in self.held.values().flatten() {
            if h.budget == budget && h.scope == scope && h.at >= held_since {
                sums.held.add(&h.estimate);
            }
        }
        sums
    }
}

/// The errors of the budget store.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LedgerError {
    #[error("budget store {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
}

impl Ledger {
    /// A ledger in memory only (nothing survives a restart).
    pub(crate) fn in_memory(clock: Clock, prices: Table<Price>) -> Ledger {
        Ledger {
            state: Mutex::default(),
            db: None,
            dirty: Mutex::default(),
            failing: Default::default(),
            clock,
            prices,
            shared: None,
            charges: Arc::default(),
        }
    }

    /// A ledger whose counters are `shared` by the fleet; a thread writes charges.
    pub(crate) fn shared(
        shared: Arc<dyn SharedLedger>,
        clock: Clock,
        prices: Table<Price>,
    ) -> Ledger {
        let ledger = Ledger {
            shared: Some(shared.clone()),
            ..Ledger::in_memory(clock.clone(), prices)
        };
        let queue = ledger.charges.clone();
        let spawned = std::thread::Builder::new()
            .name("promptgate-budgets".into())
            .spawn(move || {
                loop {
                    let batch = {
                        let mut pending = queue.pending.lock().unwrap_or_else(|p| p.into_inner());
                        while pending.is_empty() {
                            pending = queue.ready.wait(pending).unwrap_or_else(|p| p.into_inner());
                        }
                        std::mem::take(&mut *pending)
                    };
                    if !write_charges(shared.as_ref(), &clock, &queue, batch) {
                        // The store fails: try again in a second, not in a loop.
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(target: "promptgate::budgets", "cannot start the budgets' writer: {e}");
        }
        ledger
    }

    /// Checks exchange `id`'s `asks` at `now` and, when `judge` lets it go, holds
    /// their estimates, in one step (no other check of these scopes in between, in
    /// this process or, with shared counters, in the fleet).
    fn reserve(
        &self,
        id: ExchangeId,
        asks: &[ScopeAsk],
        model: Option<&str>,
        now: Millis,
        judge: &mut dyn FnMut(&[Sums]) -> bool,
    ) -> Result<bool, SharedLedgerError> {
        let held_since = now.saturating_sub(HOLD_MAX_MS);
        let holds = || {
            asks.iter().map(|a| Held {
                budget: a.budget.clone(),
                scope: a.scope.clone(),
                estimate: a.estimate,
                model: model.map(str::to_owned),
                at: now,
            })
        };
        if let Some(shared) = &self.shared {
            let text = id.to_string();
            let reservation = Reservation {
                id: &text,
                at: now,
                held_since,
                asks,
            };
            let goes = shared.reserve(&reservation, judge)?;
            if goes && !asks.is_empty() {
                // Kept here too: the charge is priced from them when the exchange ends.
                self.lock().held.entry(id).or_default().extend(holds());
            }
            return Ok(goes);
        }
        let mut state = self.lock();
        let sums: Vec<Sums> = asks
            .iter()
            .map(|a| state.sums(&a.budget, &a.scope, a.since, held_since))
            .collect();
        let goes = judge(&sums);
        if goes && !asks.is_empty() {
            state.held.entry(id).or_default().extend(holds());
        }
        Ok(goes)
    }

    /// A ledger kept in the SQLite file at `path` (made when missing), its counters
    /// of the last 31 days read back.
    pub(crate) fn open(
        path: &Path,
        clock: Clock,
        prices: Table<Price>,
    ) -> Result<Ledger, LedgerError> {
        let err = |source| LedgerError::Open {
            path: path.display().to_string(),
            source,
        };
        let db = rusqlite::Connection::open(path).map_err(err)?;
        db.execute_batch(
            "PRAGMA journal_mode=WAL;
             CREATE TABLE IF NOT EXISTS budget_spent (
               budget TEXT NOT NULL, scope TEXT NOT NULL, bucket INTEGER NOT NULL,
               usd REAL NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
               requests INTEGER NOT NULL, PRIMARY KEY (budget, scope, bucket));",
        )
        .map_err(err)?;
        let ledger = Ledger::in_memory(clock, prices);
        let since = ledger.clock.now().saturating_sub(31 * DAY_MS);
        {
            let mut state = ledger.lock();
            let mut rows = db
                .prepare(
                    "SELECT budget, scope, bucket, usd, input_tokens, output_tokens, requests
                     FROM budget_spent WHERE bucket = 0 OR bucket >= ?1 ORDER BY bucket",
                )
                .map_err(err)?;
            let read = rows
                .query_map([since as i64], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, i64>(2)? as u64,
                        Spent {
                            usd: r.get(3)?,
                            input_tokens: r.get::<_, i64>(4)? as u64,
                            output_tokens: r.get::<_, i64>(5)? as u64,
                            requests: r.get::<_, i64>(6)? as u64,
                        },
                    ))
                })
                .map_err(err)?;
            for row in read {
                let (budget, scope, bucket, spent) = row.map_err(err)?;
                state
                    .spent
                    .entry((budget, scope))
                    .or_default()
                    .push_back((bucket, spent));
            }
        }
        Ok(Ledger {
            db: Some(Mutex::new(db)),
            ..ledger
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LedgerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Charges what exchange `id` used (its holds released), returning what it
    /// charged, and whether it was the estimate for want of usage.
    fn charge(
        &self,
        end: &Ending<'_>,
        windows: &dyn Fn(&str) -> Option<Window>,
    ) -> Vec<(String, Spent, bool)> {
        let now = self.clock.now();
        let mut state = self.lock();
        let Some(held) = state.held.remove(&end.id) else {
            return Vec::new();
        };
        // Stale holds of exchanges that never ended go too.
        state
            .held
            .retain(|_, v| v.iter().all(|h| now.saturating_sub(h.at) < HOLD_MAX_MS));
        let mut charged = Vec::new();
        let mut shared_charges = Vec::new();
        for h in held.into_iter().filter(|_| end.answered) {
            let Some(window) = windows(&h.budget) else {
                continue;
            };
            let model = end.model.or(h.model.as_deref());
            let (spent, estimated) = match end.usage {
                Some(u) => (self.price(model, u), false),
                None => (h.estimate, true),
            };
            if self.shared.is_some() {
                shared_charges.push(Charge {
                    budget: h.budget.clone(),
                    scope: h.scope,
                    bucket: window.bucket(now),
                    spent,
                });
                charged.push((h.budget, spent, estimated));
                continue;
            }
            let key = (h.budget.clone(), h.scope.clone());
            let bucket = window.bucket(now);
            let buckets = state.spent.entry(key).or_default();
            buckets.retain(|(start, _)| window.holds(*start, now) || window == Window::Lifetime);
            match buckets.back_mut() {
                Some((start, s)) if *start == bucket => s.add(&spent),
                _ => buckets.push_back((bucket, spent)),
            }
            self.write(&h.budget, &h.scope, bucket, &spent);
            charged.push((h.budget, spent, estimated));
        }
        drop(state);
        if self.shared.is_some() {
            // Also when nothing is charged: the fleet's holds of the exchange go.
            let mut pending = self
                .charges
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if pending.len() >= CHARGES_KEPT_MAX {
                pending.remove(0);
                tracing::warn!(target: "promptgate::budgets", "the budget store keeps failing: the oldest unwritten charge is dropped");
            }
            pending.push((end.id.to_string(), shared_charges));
            self.charges.ready.notify_one();
        }
        charged
    }

    /// Adds `spent` to the bucket's row in the file: gathered, and written in one
    /// transaction when a second has passed since the last (a row per charge, each
    /// its own commit, was most of a request's CPU in the bench). A crash loses at
    /// most that second; a clean stop writes the rest ([`flush`]).
    fn write(&self, budget: &str, scope: &str, bucket: Millis, spent: &Spent) {
        if self.db.is_none() {
            return;
        }
        let now = self.clock.now();
        let due = {
            let mut dirty = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
            dirty
                .0
                .entry((budget.to_owned(), scope.to_owned(), bucket))
                .or_default()
                .add(spent);
            now.saturating_sub(dirty.1) >= 1000
        };
        if due {
            self.flush_now();
        }
    }

    /// Writes every gathered charge to the file, in one transaction (or to the
    /// shared counters, what their writer has not yet).
    fn flush_now(&self) {
        if let Some(shared) = &self.shared {
            let batch = std::mem::take(
                &mut *self
                    .charges
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()),
            );
            write_charges(shared.as_ref(), &self.clock, &self.charges, batch);
            return;
        }
        let Some(db) = &self.db else { return };
        let rows = {
            let mut dirty = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
            dirty.1 = self.clock.now();
            std::mem::take(&mut dirty.0)
        };
        if rows.is_empty() {
            return;
        }
        let mut db = db.lock().unwrap_or_else(|p| p.into_inner());
        let result = db.transaction().and_then(|tx| {
            {
                let mut statement = tx.prepare_cached(
                    "INSERT INTO budget_spent (budget, scope, bucket, usd, input_tokens, output_tokens, requests)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                     ON CONFLICT (budget, scope, bucket) DO UPDATE SET
                       usd = usd + excluded.usd, input_tokens = input_tokens + excluded.input_tokens,
                       output_tokens = output_tokens + excluded.output_tokens, requests = requests + excluded.requests",
                )?;
                for ((budget, scope, bucket), spent) in &rows {
                    statement.execute(rusqlite::params![
                        budget,
                        scope,
                        *bucket as i64,
                        spent.usd,
                        spent.input_tokens as i64,
                        spent.output_tokens as i64,
                        spent.requests as i64
                    ])?;
                }
            }
            tx.commit()
        });
        let failed = result.is_err();
        if let Err(e) = result {
            tracing::warn!(target: "promptgate::budgets", "budget store write failed: {e}");
        }
        self.failing
            .store(failed, std::sync::atomic::Ordering::Relaxed);
    }

    /// What a usage costs on `model` (nothing for a model with no price).
    fn price(&self, model: Option<&str>, usage: &crate::provider::Usage) -> Spent {
        let usd = model
            .and_then(|m| self.prices.find(m))
            .map_or(0.0, |(_, p)| price::cost(&p, usage, 0, false).total_usd);
        Spent {
            usd,
            input_tokens: usage.total_input(),
            output_tokens: usage.output_tokens,
            requests: 1,
        }
    }

    /// Each scope of `budget` with what it spent in `window` now and its oldest
    /// counted bucket, most first (the fleet's, with shared counters).
    pub(crate) fn scopes(&self, budget: &str, window: Window) -> Vec<(String, Spent, Millis)> {
        let now = self.clock.now();
        let since = window.since(now);
        if let Some(shared) = &self.shared {
            return shared.scopes(budget, since).unwrap_or_else(|e| {
                tracing::warn!(target: "promptgate::budgets", "the budget store cannot be read: {e}");
                Vec::new()
            });
        }
        let state = self.lock();
        let mut out: Vec<(String, Spent, Millis)> = state
            .spent
            .keys()
            .filter(|(b, _)| b == budget)
            .map(|(_, scope)| {
                let sums = state.sums(budget, scope, since, now);
                (scope.clone(), sums.spent, sums.oldest.min(now))
            })
            .filter(|(_, s, _)| s.requests > 0)
            .collect();
        out.sort_by(|a, b| {
            b.1.usd
                .total_cmp(&a.1.usd)
                .then(b.1.requests.cmp(&a.1.requests))
        });
        out
    }
}

/// Writes `batch` (and what failed before) to the shared counters, each exchange
/// in its own transaction; what fails goes back to the front of the queue.
/// Whether everything was written.
fn write_charges(
    shared: &dyn SharedLedger,
    clock: &Clock,
    queue: &ChargeQueue,
    batch: Vec<(String, Vec<Charge>)>,
) -> bool {
    let mut rest = batch.into_iter();
    while let Some((id, charges)) = rest.next() {
        if let Err(e) = shared.charge(&id, &charges) {
            tracing::warn!(target: "promptgate::budgets", "budget store write failed: {e}");
            let mut pending = queue.pending.lock().unwrap_or_else(|p| p.into_inner());
            let mut again: Vec<_> = std::iter::once((id, charges)).chain(rest).collect();
            again.append(&mut pending);
            *pending = again;
            return false;
        }
    }
    // Now and then: a replica that stopped mid-exchange left its holds behind.
    let now = clock.now();
    let last = queue.forgot_ms.load(std::sync::atomic::Ordering::Relaxed);
    if now.saturating_sub(last) >= STALE_EVERY_MS {
        queue
            .forgot_ms
            .store(now, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = shared.forget_stale(now.saturating_sub(HOLD_MAX_MS)) {
            tracing::warn!(target: "promptgate::budgets", "budget store write failed: {e}");
        }
    }
    true
}

/// How often the writer forgets the fleet's stale holds.
const STALE_EVERY_MS: u64 = 60_000;

/// Where the process's ledger is kept and how it prices and tells time: set by the
/// server at start ([`configure`]); the file is opened when a budget first needs it.
struct LedgerConfig {
    path: Option<std::path::PathBuf>,
    shared: Option<Arc<dyn SharedLedger>>,
    clock: Clock,
    prices: Table<Price>,
}

static CONFIG: OnceLock<LedgerConfig> = OnceLock::new();
static LEDGER: OnceLock<Ledger> = OnceLock::new();

/// Sets where the process's ledger lives (`shared`: the fleet's counters; else
/// `path`, its SQLite file; `None`: memory only), its clock and its prices. Once;
/// later calls are ignored.
pub(crate) fn configure(
    path: Option<std::path::PathBuf>,
    shared: Option<Arc<dyn SharedLedger>>,
    clock: Clock,
    prices: Table<Price>,
) {
    let _ = CONFIG.set(LedgerConfig {
        path,
        shared,
        clock,
        prices,
    });
}

/// The process's ledger: the configured file (a file that cannot be opened leaves
/// the ledger in memory, failing, so that `on_error` decides), else memory with the
/// default prices (`rules test`, unit tests).
pub(crate) fn ledger() -> &'static Ledger {
    LEDGER.get_or_init(|| {
        let Some(c) = CONFIG.get() else {
            return Ledger::in_memory(Clock::system(), price::prices(Vec::new()));
        };
        if let Some(shared) = &c.shared {
            return Ledger::shared(shared.clone(), c.clock.clone(), c.prices.clone());
        }
        let Some(path) = &c.path else {
            return Ledger::in_memory(c.clock.clone(), c.prices.clone());
        };
        match Ledger::open(path, c.clock.clone(), c.prices.clone()) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(target: "promptgate::budgets", "{e}: budgets count in memory only");
                let l = Ledger::in_memory(c.clock.clone(), c.prices.clone());
                l.failing.store(true, std::sync::atomic::Ordering::Relaxed);
                l
            }
        }
    })
}

/// Writes the charges the process's ledger still holds to its file (at shutdown).
pub(crate) fn flush() {
    if let Some(l) = LEDGER.get() {
        l.flush_now();
    }
}

/// A request body's estimated input tokens (its bytes ÷ 4) and what they cost as
/// uncached input at `model`'s price (`None`: no price for it).
pub(crate) fn estimate_input(model: Option<&str>, body_bytes: usize) -> (u64, Option<f64>) {
    let tokens = body_bytes as u64 / BYTES_PER_TOKEN;
    let usd = model
        .and_then(|m| ledger().prices.find(m))
        .map(|(_, p)| p.input * tokens as f64 / 1e6);
    (tokens, usd)
}

/// The budgets of one rule set, as one policy.
#[derive(Debug)]
pub(crate) struct Budgets {
    pub(crate) budgets: Arc<[Budget]>,
}

impl Budgets {
    fn window_of(&self, name: &str) -> Option<Window> {
        self.budgets
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.window)
    }

    /// The budgets, with their scopes' spend now: for `promptgate budgets` and the
    /// admin API.
    pub(crate) fn report(&self) -> Vec<BudgetReport> {
        let ledger = ledger();
        self.budgets
            .iter()
            .map(|b| BudgetReport {
                name: b.name.clone(),
                scope: b.dims(),
                window: b.window.text(),
                limits: limits_text(&b.limits),
                scopes: ledger
                    .scopes(&b.name, b.window)
                    .into_iter()
                    .map(|(scope, spent, oldest)| ScopeReport {
                        share: b.limits.share(&spent),
                        resets: reset_text(b.window, oldest, ledger.clock.now()),
                        scope,
                        spent,
                    })
                    .collect(),
            })
            .collect()
    }
}

/// One budget as `promptgate budgets` shows it.
#[derive(Debug, Clone)]
pub(crate) struct BudgetReport {
    pub name: String,
    pub scope: String,
    pub window: String,
    pub limits: String,
    pub scopes: Vec<ScopeReport>,
}

/// One scope of a budget.
#[derive(Debug, Clone)]
pub(crate) struct ScopeReport {
    pub scope: String,
    pub spent: Spent,
    /// The largest share of a limit it uses.
    pub share: f64,
    pub resets: String,
}

fn limits_text(l: &Limits) -> String {
    let mut out = Vec::new();
    if let Some(u) = l.usd {
        out.push(format!("${u:.2}"));
    }
    for (name, v) in [
        ("tokens", l.tokens),
        ("input tokens", l.input_tokens),
        ("output tokens", l.output_tokens),
        ("requests", l.requests),
    ] {
        if let Some(v) = v {
            out.push(format!("{v} {name}"));
        }
    }
    out.join(", ")
}

/// When a window's oldest spend stops counting.
fn reset_in(window: Window, oldest: Millis, now: Millis) -> Option<Duration> {
    match window {
        Window::Lifetime => None,
        Window::Day => Some(Duration::from_millis(DAY_MS - now % DAY_MS)),
        Window::Rolling(d) => Some(Duration::from_millis(
            (oldest + d.as_millis() as u64)
                .saturating_sub(now)
                .max(1000),
        )),
    }
}

fn reset_text(window: Window, oldest: Millis, now: Millis) -> String {
    match reset_in(window, oldest, now) {
        None => "never (the conversation's life)".into(),
        Some(d) => format!("in {}", human(d)),
    }
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}s", s.max(1))
    }
}

/// Bytes of an agent's JSON body per token, for the check's input estimate (a
/// prompt of prose, code and JSON runs 3.5–4.5 bytes a token): an estimate that
/// reads nothing of the body but its length.
const BYTES_PER_TOKEN: u64 = 4;

/// The answer to a request that would cross `b`'s limit (`crossed`: what, the
/// amount it would reach, the limit) in `scope`, having spent `spent`.
fn spent_block(
    b: &Budget,
    scope: &str,
    (what, amount, limit): (&'static str, String, String),
    spent: &Spent,
    resets: Option<Duration>,
) -> Block {
    let when = match resets {
        Some(d) => format!("it resets in {}", human(d)),
        None => "it does not reset in this conversation; start a new one".into(),
    };
    // A window that resets is a rate limit; the client may come back.
    let (status, error_type) = match resets {
        Some(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
        None => (BLOCK_STATUS, "permission_error"),
    };
    let scope = if b.scope.is_empty() { "global" } else { scope };
    Block {
        status,
        error_type: Some(error_type.into()),
        message: format!(
            "budget {:?} ({scope}) is spent: {what} would reach {amount} of {limit} {} with this request (spent so far ${:.2}, {} requests); {when}",
            b.name,
            b.window.text(),
            spent.usd,
            spent.requests,
        ),
        rule: b.name.clone(),
        retry_after: resets,
    }
}

impl Budgets {
    /// The scope key of a request for `budget`: each dimension's value.
    fn scope_key(&self, budget: &Budget, facts: &Facts<'_>, request: &Outgoing) -> String {
        let mut parts = Vec::with_capacity(budget.scope.len());
        for d in &budget.scope {
            let value = match d {
                Dim::Conversation => facts.conversation.unwrap_or("-").to_owned(),
                Dim::Model => facts.model.unwrap_or("-").to_owned(),
                // The credential's fingerprint (its hash), never the credential.
                Dim::Key => ["x-api-key", "authorization", "api-key"]
                    .iter()
                    .find_map(|h| {
                        request
                            .headers
                            .get(*h)
                            .map(|v| crate::redact::credential_id(h, v.as_bytes()))
                    })
                    .unwrap_or_else(|| "-".into()),
                Dim::RequestClass => request
                    .headers
                    .get("x-claude-code-request-class")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("main")
                    .to_owned(),
            };
            parts.push(format!("{}={}", d.name(), crate::redact::cut(&value, 128)));
        }
        if parts.is_empty() {
            "global".into()
        } else {
            parts.join(" ")
        }
    }

    /// The budgets that apply to a request and what each asks of the counters, or
    /// the refusal when the store fails and a budget says `on_error = "block"`.
    fn asks(
        &self,
        facts: &Facts<'_>,
        request: &Outgoing,
        now: Millis,
    ) -> Result<(Vec<usize>, Vec<ScopeAsk>), Decision> {
        let ledger = ledger();
        let input = request.body.len() as u64 / BYTES_PER_TOKEN;
        let price = facts
            .model
            .and_then(|m| ledger.prices.find(m))
            .map(|(_, p)| p);
        let mut applies = Vec::new();
        let mut asks = Vec::new();
        for (i, b) in self.budgets.iter().enumerate() {
            if let Some((g, _)) = &b.models
                && !facts.model.is_some_and(|m| g.is_match(m))
            {
                continue;
            }
            // A local file's writes fail apart from the check; the shared store's
            // check is the call that fails, and tells again each time.
            if ledger.shared.is_none()
                && ledger.failing.load(std::sync::atomic::Ordering::Relaxed)
                && b.on_error == OnError::Block
            {
                return Err(Decision::Respond(store_fails(b)));
            }
            applies.push(i);
            asks.push(ScopeAsk {
                budget: b.name.clone(),
                scope: self.scope_key(b, facts, request),
                since: b.window.since(now),
                estimate: Spent {
                    usd: price.map_or(0.0, |p| {
                        (p.input * input as f64 + p.output * b.output_estimate as f64) / 1e6
                    }),
                    input_tokens: input,
                    output_tokens: b.output_estimate,
                    requests: 1,
                },
            });
        }
        Ok((applies, asks))
    }

    /// What a check asks now, for which exchange, or the decision already made (no
    /// budget applies, or the store fails and one refuses then).
    #[allow(clippy::type_complexity)] // one tuple, destructured at its two callers
    fn asked(
        &self,
        facts: &Facts<'_>,
        request: &Outgoing,
    ) -> Result<(Vec<usize>, Vec<ScopeAsk>, ExchangeId, Millis), Decision> {
        let now = ledger().clock.now();
        let (applies, asks) = self.asks(facts, request, now)?;
        if asks.is_empty() {
            return Err(Decision::Continue);
        }
        // `rules test` checks a request that is no exchange: its hold is its own.
        Ok((applies, asks, facts.id.unwrap_or_default(), now))
    }

    /// Checks a request against its budgets and holds its estimates (see
    /// [`Ledger::reserve`]); the verdict goes into `effects`.
    fn check(&self, facts: &Facts<'_>, request: &mut Outgoing, effects: &mut Effects) -> Decision {
        let (applies, asks, id, now) = match self.asked(facts, request) {
            Ok(asked) => asked,
            Err(decided) => return decided,
        };
        let budgets: Vec<&Budget> = applies.iter().map(|&i| &self.budgets[i]).collect();
        let verdict = reserve(&budgets, id, &asks, facts.model, now);
        verdict.into_decision(effects)
    }

    /// [`Budgets::check`] with shared counters: the store is asked off the runtime's
    /// workers.
    async fn check_shared(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        let (applies, asks, id, now) = match self.asked(facts, request) {
            Ok(asked) => asked,
            Err(decided) => return decided,
        };
        let budgets = self.budgets.clone();
        let model = facts.model.map(str::to_owned);
        let asked = tokio::task::spawn_blocking(move || {
            let budgets: Vec<&Budget> = applies.iter().map(|&i| &budgets[i]).collect();
            reserve(&budgets, id, &asks, model.as_deref(), now)
        })
        .await;
        match asked {
            Ok(verdict) => verdict.into_decision(effects),
            // The check panicked: nothing was held; the request goes, as on an error.
            Err(e) => {
                tracing::error!(target: "promptgate::budgets", "the budget check failed: {e}");
                Decision::Continue
            }
        }
    }
}

/// What the budgets decided about one request.
#[derive(Default)]
struct Verdict {
    /// The refusal, when a limit would be crossed or the store fails and a budget
    /// blocks then.
    block: Option<Block>,
    /// The budgets the request fired (refused it or warned).
    fired: Vec<String>,
    /// Warning lines, by budget.
    notes: Vec<(String, String)>,
}

impl Verdict {
    fn into_decision(self, effects: &mut Effects) -> Decision {
        for name in self.fired {
            if !effects.fired.contains(&name) {
                effects.fired.push(name);
            }
        }
        if !self.notes.is_empty() && !effects.tags.iter().any(|t| t == "budget-warning") {
            effects.tags.push("budget-warning".into());
        }
        for (name, line) in self.notes {
            effects.note(&name, line);
        }
        match self.block {
            Some(block) => Decision::Respond(block),
            None => Decision::Continue,
        }
    }
}

/// Checks `asks` (one per budget of `budgets`) against the counters and holds them
/// when the request goes: the ledger's one step.
fn reserve(
    budgets: &[&Budget],
    id: ExchangeId,
    asks: &[ScopeAsk],
    model: Option<&str>,
    now: Millis,
) -> Verdict {
    let ledger = ledger();
    let mut verdict = Verdict::default();
    let reserved = ledger.reserve(id, asks, model, now, &mut |sums| {
        verdict = judge(budgets, asks, sums, now);
        verdict.block.is_none()
    });
    // Only the shared store fails here; a local file's writes say so when they fail.
    if ledger.shared.is_some() {
        ledger
            .failing
            .store(reserved.is_err(), std::sync::atomic::Ordering::Relaxed);
    }
    if let Err(e) = reserved {
        tracing::warn!(target: "promptgate::budgets", "the budget store cannot be checked: {e}");
        verdict = Verdict {
            block: budgets
                .iter()
                .find(|b| b.on_error == OnError::Block)
                .map(|b| store_fails(b)),
            ..Verdict::default()
        };
    }
    verdict
}

/// The verdict on a request whose scopes have `sums` (one per ask).
fn judge(budgets: &[&Budget], asks: &[ScopeAsk], sums: &[Sums], now: Millis) -> Verdict {
    let mut verdict = Verdict::default();
    for ((b, ask), sums) in budgets.iter().zip(asks).zip(sums) {
        let mut spent = sums.spent;
        spent.add(&sums.held);
        let mut total = spent;
        total.add(&ask.estimate);
        if let Some(crossed) = b.limits.crossed(&total) {
            verdict.fired.push(b.name.clone());
            let resets = reset_in(b.window, sums.oldest.min(now), now);
            verdict.block = Some(spent_block(b, &ask.scope, crossed, &spent, resets));
            return verdict;
        }
        if let Some(w) = b.warn_at
            && b.limits.share(&total) >= w
        {
            verdict.fired.push(b.name.clone());
            verdict.notes.push((
                b.name.clone(),
                format!(
                    "budget at {:.0} % ({} {}; limit {})",
                    100.0 * b.limits.share(&total),
                    ask.scope,
                    b.window.text(),
                    limits_text(&b.limits)
                ),
            ));
        }
    }
    verdict
}

/// The refusal of a budget with `on_error = "block"` while its store fails.
fn store_fails(b: &Budget) -> Block {
    Block {
        status: StatusCode::SERVICE_UNAVAILABLE,
        error_type: Some("api_error".into()),
        message: format!(
            "budget {:?} cannot be checked: the budget store fails (on_error = \"block\")",
            b.name
        ),
        rule: b.name.clone(),
        retry_after: None,
    }
}

impl Policy for Budgets {
    fn name(&self) -> &str {
        BUDGETS
    }

    fn runs(&self, phase: Phase) -> bool {
        phase == Phase::BeforeProviderRequest
    }

    fn reads_conversation(&self) -> bool {
        self.budgets
            .iter()
            .any(|b| b.scope.contains(&Dim::Conversation))
    }

    fn reads_end(&self) -> bool {
        true
    }

    fn before_provider_request(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        self.check(facts, request, effects)
    }

    fn waits(&self, phase: Phase) -> bool {
        phase == Phase::BeforeProviderRequest && ledger().shared.is_some()
    }

    fn request_waiting<'a>(
        &'a self,
        _phase: Phase,
        facts: Facts<'a>,
        request: &'a mut Outgoing,
        effects: &'a mut Effects,
    ) -> crate::policy::PolicyFuture<'a> {
        Box::pin(async move { self.check_shared(&facts, request, effects).await })
    }

    fn exchange_ended(&self, end: &Ending<'_>) {
        for (budget, spent, estimated) in ledger().charge(end, &|name| self.window_of(name)) {
            if estimated {
                tracing::info!(
                    target: "promptgate::budgets",
                    id = %end.id,
                    budget = %budget,
                    "charged the estimate (${:.4}): the answer said no usage",
                    spent.usd
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_read_and_bucket() {
        assert_eq!(window_of("conversation"), Some(Window::Lifetime));
        assert_eq!(window_of("day"), Some(Window::Day));
        assert_eq!(
            window_of("90s"),
            Some(Window::Rolling(Duration::from_secs(90)))
        );
        assert_eq!(
            window_of("1h"),
            Some(Window::Rolling(Duration::from_secs(3600)))
        );
        assert_eq!(
            window_of("30d"),
            Some(Window::Rolling(Duration::from_secs(30 * 86_400)))
        );
        assert_eq!(window_of("0h"), None);
        assert_eq!(window_of("h"), None);
        let hour = Window::Rolling(Duration::from_secs(3600));
        assert_eq!(hour.bucket(3_599_999), 3_540_000, "one-minute buckets");
        assert!(hour.holds(0, 3_599_999) && !hour.holds(0, 3_600_000));
        assert!(
            Window::Day.holds(DAY_MS, DAY_MS + 5) && !Window::Day.holds(DAY_MS - 1, DAY_MS + 5)
        );
    }

    #[test]
    fn the_first_limit_crossed_is_named() {
        let limits = Limits {
            usd: Some(5.0),
            requests: Some(10),
            ..Limits::default()
        };
        let mut s = Spent {
            usd: 4.0,
            requests: 10,
            ..Spent::default()
        };
        assert_eq!(limits.crossed(&s), None);
        assert!((limits.share(&s) - 1.0).abs() < 1e-9);
        s.usd = 5.5;
        assert_eq!(limits.crossed(&s).map(|c| c.0), Some("usd"));
        s.usd = 1.0;
        s.requests = 11;
        assert_eq!(limits.crossed(&s).map(|c| c.0), Some("requests"));
    }
}

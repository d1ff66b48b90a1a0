//! The prediction before the response and the verdict after it.
//!
//! Prediction (Anthropic's documented prompt caching): from each breakpoint, walk back at most 20
//! lookback positions for the longest prefix an earlier request wrote or read that is
//! still alive for this request; the deepest breakpoint that reaches the model's
//! minimum length is written. Verdict: set the provider's `usage` beside it — a hit,
//! a partial read or a miss with the reason, or `unexplained` when the provider did
//! better or worse than the rules say (never a confident wrong reason).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::history::{Conversation, EntryState, Millis, Snapshot};
use super::segment::{Segments, Unit};
use crate::id::ExchangeId;
use crate::prompt::{Region, Ttl};
use crate::provider::Usage;

/// Lookback positions per breakpoint, the breakpoint itself counted first.
pub(crate) const LOOKBACK: u32 = 20;

/// The most prefixes [`lookback_prefixes`] gives: four breakpoints' windows, with
/// room for runs of tool blocks (a run is one position, many units).
pub(crate) const LOOKBACK_CANDIDATES: usize = 256;

/// Every prefix the provider's lookback could read for this request, deepest first:
/// each unit within [`LOOKBACK`] positions before a breakpoint, at most
/// [`LOOKBACK_CANDIDATES`]. Another conversation's entry at any of them is read (a
/// fork's deeper breakpoint finds the first session's last one).
pub(crate) fn lookback_prefixes(segs: &Segments) -> Vec<super::segment::Hash> {
    let mut at: Vec<usize> = Vec::new();
    for &b in &segs.breakpoints {
        let floor = segs.units[b].position.saturating_sub(LOOKBACK - 1);
        at.extend(
            (0..=b)
                .rev()
                .take_while(|&i| segs.units[i].position >= floor),
        );
    }
    at.sort_unstable_by(|x, y| y.cmp(x));
    at.dedup();
    at.truncate(LOOKBACK_CANDIDATES);
    at.into_iter().map(|i| segs.units[i].prefix).collect()
}

/// The request being explained.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    pub id: ExchangeId,
    /// Start on the analysis clock.
    pub start: Millis,
    pub segments: &'a Segments,
}

/// What the rules say the provider will do, before the response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub read_tokens: u64,
    pub write_tokens: u64,
    /// Of the writes, those at the 1h price.
    pub write_1h_tokens: u64,
    /// The unit whose prefix should be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_through: Option<String>,
    /// Who wrote (or last refreshed) that prefix.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_from: Option<String>,
    /// The unit through which the prefix should be written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_through: Option<String>,
    /// The read size comes from an earlier usage, not from the estimator.
    pub exact: bool,
    #[serde(skip)]
    pub hit: Option<usize>,
    #[serde(skip)]
    pub written: Vec<usize>,
}

/// How the provider's caching of one request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// It read everything earlier requests had cached for it, as predicted.
    Hit,
    /// It read part of what was cached; `reason` says why not the rest.
    Partial,
    /// It read nothing of what was cached; `reason` says why.
    Miss,
    /// Nothing was cached for it yet (a new conversation): it wrote, as predicted.
    Write,
    /// Nothing read or written, as predicted (no breakpoint, or below the minimum).
    None,
    /// The provider did better or worse than the rules predict.
    Unexplained,
}

impl Verdict {
    /// Every verdict, in the order the viewer offers them.
    pub const ALL: [Verdict; 6] = [
        Verdict::Hit,
        Verdict::Partial,
        Verdict::Miss,
        Verdict::Write,
        Verdict::None,
        Verdict::Unexplained,
    ];

    /// The snake_case name of the verdict.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Hit => "hit",
            Verdict::Partial => "partial",
            Verdict::Miss => "miss",
            Verdict::Write => "write",
            Verdict::None => "none",
            Verdict::Unexplained => "unexplained",
        }
    }
}

/// Why a request did not read what earlier requests had cached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// The first unit that differs from the earlier request, and where.
    PrefixChanged {
        unit: String,
        /// Byte offset of the first difference inside the normalised unit.
        offset: usize,
        /// The earlier and the current bytes around it (prompt text: keep out of logs).
        #[serde(skip_serializing_if = "Option::is_none")]
        before: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        after: Option<String>,
        /// The bytes differ, the JSON value does not (key order, escapes, spacing):
        /// the provider caches the rendered prompt, so this alone does not miss.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        spelling_only: bool,
        /// The policy (rule or hook) that wrote the unit in this request, when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    ToolsChanged {
        added: Vec<String>,
        removed: Vec<String>,
        changed: Vec<String>,
    },
    ModelChanged {
        before: String,
        after: String,
    },
    /// A request-level input rendered into the prompt changed: tool_choice,
    /// thinking, effort, speed or images.
    SettingChanged {
        setting: String,
        before: Option<String>,
        after: Option<String>,
    },
    /// The cached prefix outlived its ttl.
    TtlExpired {
        unit: String,
        idle_s: u64,
        ttl_s: u64,
    },
    /// No breakpoint at or after the end of the cached prefix.
    BreakpointMissing {
        unit: String,
    },
    /// The nearest breakpoint after the cached prefix is too many positions away.
    LookbackExceeded {
        unit: String,
        breakpoint: String,
        positions: u32,
    },
    /// The prefix up to the last breakpoint is shorter than the model's minimum.
    BelowMinimum {
        tokens: u64,
        minimum: u64,
    },
    /// The request that wrote the prefix had not begun its response when this one started.
    Concurrent {
        other: String,
        began_after_ms: u64,
    },
    /// Not a miss: the prefix read was written by another conversation of the same
    /// workspace (the provider's cache is the workspace's), by request `by`.
    SharedPrefix {
        conversation: String,
        by: String,
    },
    /// An earlier usage pinned the unchanged prefix's size, and the provider read
    /// less of it: the cache entry was evicted, or not yet written.
    PinnedReadLess {
        expected: u64,
        read: u64,
    },
    /// An earlier usage pinned the unchanged prefix's size, and the provider read
    /// more: it matched more than the bytes promptgate predicted.
    PinnedReadMore {
        expected: u64,
        read: u64,
    },
    /// The rules and the provider disagree; `rules` is what the rules would have said.
    Unexplained {
        predicted_read: u64,
        actual_read: u64,
        predicted_write: u64,
        actual_write: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        rules: Option<Box<Reason>>,
    },
}

impl Reason {
    /// The snake_case name of the reason.
    pub fn name(&self) -> &'static str {
        match self {
            Reason::PrefixChanged { .. } => "prefix_changed",
            Reason::ToolsChanged { .. } => "tools_changed",
            Reason::ModelChanged { .. } => "model_changed",
            Reason::SettingChanged { .. } => "setting_changed",
            Reason::TtlExpired { .. } => "ttl_expired",
            Reason::BreakpointMissing { .. } => "breakpoint_missing",
            Reason::LookbackExceeded { .. } => "lookback_exceeded",
            Reason::BelowMinimum { .. } => "below_minimum",
            Reason::Concurrent { .. } => "concurrent",
            Reason::SharedPrefix { .. } => "shared_prefix",
            Reason::PinnedReadLess { .. } => "pinned_read_less",
            Reason::PinnedReadMore { .. } => "pinned_read_more",
            Reason::Unexplained { .. } => "unexplained",
        }
    }

    /// A word or a unit path for narrow columns: `system[2]`, `ttl`, `model`, …;
    /// empty for `unexplained` (its verdict says it).
    pub fn label(&self) -> String {
        match self {
            Reason::PrefixChanged { unit, .. } => unit.clone(),
            Reason::ToolsChanged { .. } => "tools".into(),
            Reason::ModelChanged { .. } => "model".into(),
            Reason::SettingChanged { setting, .. } => setting.clone(),
            Reason::TtlExpired { .. } => "ttl".into(),
            Reason::BreakpointMissing { .. } => "breakpoint".into(),
            Reason::LookbackExceeded { .. } => "lookback".into(),
            Reason::BelowMinimum { .. } => "minimum".into(),
            Reason::Concurrent { .. } => "concurrent".into(),
            Reason::SharedPrefix { .. } => "shared".into(),
            Reason::PinnedReadLess { .. } => "evicted?".into(),
            Reason::PinnedReadMore { .. } => "read more".into(),
            Reason::Unexplained { .. } => String::new(),
        }
    }

    /// What to do about it, in a line: the change that would have let the request
    /// read the cache. `price` (per million input tokens, with the write and read
    /// multipliers) prices a ttl suggestion; `lost_tokens` are what the miss rewrote.
    pub fn fix(
        &self,
        lost_tokens: u64,
        price: Option<&crate::provider::price::Price>,
    ) -> Option<String> {
        // yyyy-mm-dd or yyyy/mm/dd: a date rendered into the prompt.
        static DATE: std::sync::LazyLock<Option<regex::Regex>> =
            std::sync::LazyLock::new(|| regex::Regex::new(r"\b\d{4}[-/]\d{2}[-/]\d{2}\b").ok());
        let date = |t: &Option<String>| {
            t.as_deref()
                .zip(DATE.as_ref())
                .is_some_and(|(t, re)| re.is_match(t))
        };
        Some(match self {
            Reason::PrefixChanged {
                unit,
                spelling_only: true,
                ..
            } => format!(
                "{unit} is the same JSON value in other bytes (key order, escapes or spacing), \
                 which the provider reads as the same prompt: the miss has another cause, such \
                 as an eviction on the provider's side"
            ),
            Reason::PrefixChanged {
                unit, by: Some(by), ..
            } => format!(
                "{unit} is written by {by:?}, which promptgate applies: what it writes changed \
                 (an edited rule or hook rewrites the cached prefix once); keep its output fixed \
                 within a session, or have it write after the last breakpoint"
            ),
            Reason::PrefixChanged { unit, before, after, .. } if date(before) || date(after) => {
                format!(
                    "a date changed inside the cached prefix ({unit}): move it after the last breakpoint, see rules/examples/50-move-dates.toml"
                )
            }
            Reason::PrefixChanged { unit, .. } => format!(
                "everything before a breakpoint must stay byte-identical: move what changes in {unit} after the last breakpoint, or put a breakpoint before it"
            ),
            Reason::ToolsChanged { .. } => "the tools come first in the prefix: keep the tool list fixed for a session (defer rarely used tools instead of adding them)"
                .to_owned(),
            Reason::ModelChanged { .. } => {
                "each model has a cache of its own: a switch writes the whole prefix again".to_owned()
            }
            Reason::SettingChanged { setting, .. } => format!(
                "{setting} is rendered into the prompt: changing it mid-conversation misses the cache"
            ),
            Reason::TtlExpired { idle_s, ttl_s, .. } if *ttl_s < 3600 && *idle_s < 3600 => {
                match price {
                    Some(p) => {
                        let per = p.input / 1e6;
                        let extra = per * (p.cache_write_1h - p.cache_write_5m) * lost_tokens as f64;
                        let saved = per * (p.cache_write_5m - p.cache_read) * lost_tokens as f64;
                        format!(
                            "a 1h ttl would have kept it (idle {idle_s}s): writing the prefix at 1h would have cost ${extra:.4} more and saved ${saved:.4} here; see rules/examples/40-ttl-1h.toml"
                        )
                    }
                    None => format!(
                        "a 1h ttl would have kept it (idle {idle_s}s): see rules/examples/40-ttl-1h.toml"
                    ),
                }
            }
            Reason::TtlExpired { .. } => {
                "idle longer than any ttl: only an earlier request could have kept it warm".to_owned()
            }
            Reason::BreakpointMissing { unit } => format!(
                "put a cache_control breakpoint at or after {unit} (or turn on automatic caching)"
            ),
            Reason::LookbackExceeded { unit, .. } => format!(
                "the prefix ends more than {LOOKBACK} blocks before the breakpoint: add a breakpoint nearer {unit}"
            ),
            Reason::BelowMinimum { minimum, .. } => {
                format!("the prefix must reach {minimum} tokens before it is cached at all")
            }
            Reason::Concurrent { .. } => "it started before the request that writes the prefix had begun its answer: send it after the first one's response starts"
                .to_owned(),
            Reason::PinnedReadLess { .. } => "nothing to change in the request: the provider no \
                 longer held, or had not yet stored, the prefix"
                .to_owned(),
            Reason::SharedPrefix { .. } | Reason::PinnedReadMore { .. } | Reason::Unexplained { .. } => {
                return None;
            }
        })
    }

    /// The same reason without prompt text (for logs).
    pub fn without_excerpts(&self) -> Reason {
        self.clone().map(&mut |r| match r {
            Reason::PrefixChanged {
                unit,
                offset,
                spelling_only,
                by,
                ..
            } => Reason::PrefixChanged {
                unit,
                offset,
                before: None,
                after: None,
                spelling_only,
                by,
            },
            other => other,
        })
    }

    /// `f` applied to this reason — or, for `unexplained`, to the reason the rules
    /// would have given.
    pub fn map(mut self, f: &mut dyn FnMut(Reason) -> Reason) -> Reason {
        if let Reason::Unexplained { rules, .. } = &mut self {
            *rules = rules.take().map(|r| Box::new(r.map(f)));
            return self;
        }
        f(self)
    }
}

/// Short, for the log line; never prompt text beyond unit paths and tool names.
impl fmt::Display for Reason {
    // One arm per reason, each its own sentence: splitting it would scatter the table.
    #[allow(clippy::too_many_lines)]
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::PrefixChanged {
                unit,
                offset,
                spelling_only: true,
                ..
            } => write!(
                f,
                "{unit} changed @{offset} in spelling only (the same JSON value in other bytes)"
            ),
            Reason::PrefixChanged {
                unit,
                offset,
                by: Some(by),
                ..
            } => write!(f, "{unit} changed @{offset} (written by {by})"),
            Reason::PrefixChanged { unit, offset, .. } => write!(f, "{unit} changed @{offset}"),
            Reason::ToolsChanged {
                added,
                removed,
                changed,
            } => {
                f.write_str("tools changed")?;
                let list: Vec<String> = added
                    .iter()
                    .map(|n| format!("+{n}"))
                    .chain(removed.iter().map(|n| format!("-{n}")))
                    .chain(changed.iter().map(|n| format!("~{n}")))
                    .collect();
                if !list.is_empty() {
                    write!(f, " ({})", list.join(" "))?;
                }
                Ok(())
            }
            Reason::ModelChanged { before, after } => {
                write!(f, "model changed ({before} -> {after})")
            }
            Reason::SettingChanged { setting, .. } => write!(f, "{setting} changed"),
            Reason::TtlExpired { idle_s, ttl_s, .. } => {
                write!(f, "ttl expired (idle {idle_s}s > {ttl_s}s)")
            }
            Reason::BreakpointMissing { unit } => write!(f, "no breakpoint at or after {unit}"),
            Reason::LookbackExceeded {
                breakpoint,
                positions,
                ..
            } => write!(
                f,
                "lookback exceeded ({positions} positions back from {breakpoint} > {LOOKBACK})"
            ),
            Reason::BelowMinimum { tokens, minimum } => {
                write!(f, "below minimum ({tokens} < {minimum} tokens)")
            }
            Reason::Concurrent {
                other,
                began_after_ms,
            } => write!(
                f,
                "concurrent with {other} (its response began {began_after_ms}ms after this request started)"
            ),
            Reason::SharedPrefix { conversation, by } => write!(
                f,
                "read the prefix conversation {conversation} wrote ({by}): the cache is the workspace's"
            ),
            Reason::PinnedReadLess { expected, read } => write!(
                f,
                "read {} fewer tokens than the unchanged prefix holds ({} of {}): evicted, or not yet written",
                kilo(expected - read),
                kilo(*read),
                kilo(*expected)
            ),
            Reason::PinnedReadMore { expected, read } => write!(
                f,
                "read {} more tokens than the unchanged prefix holds ({} of {}): the provider matched \
                 more than the bytes promptgate predicted",
                kilo(read - expected),
                kilo(*read),
                kilo(*expected)
            ),
            Reason::Unexplained {
                predicted_read,
                actual_read,
                predicted_write,
                actual_write,
                ..
            } => {
                write!(
                    f,
                    "rules predicted read {}/write {}, provider read {}/write {}",
                    kilo(*predicted_read),
                    kilo(*predicted_write),
                    kilo(*actual_read),
                    kilo(*actual_write)
                )?;
                // Say what is known of the difference.
                match (*predicted_read, *actual_read) {
                    (0, read) if read > 0 => write!(
                        f,
                        ": the provider read {} tokens of a prefix this proxy never saw written \
                         (another client or conversation, or a cache warmed before promptgate started)",
                        kilo(read)
                    ),
                    (p, read) if read < p => write!(
                        f,
                        ": it read {} fewer than the prefix the rules expected cached (evicted early, \
                         or not yet written)",
                        kilo(p - read)
                    ),
                    (p, read) if read > p => write!(
                        f,
                        ": it read {} more than the rules expected (the provider matched more than \
                         the bytes promptgate saw suggest)",
                        kilo(read - p)
                    ),
                    _ => Ok(()),
                }
            }
        }
    }
}

/// `48213` → `48.2k`.
pub(crate) fn kilo(n: u64) -> String {
    if n < 1000 {
        n.to_string()
    } else {
        format!("{:.1}k", n as f64 / 1000.0)
    }
}

// === prediction ===

/// Token counts per prefix: exact where an earlier usage pinned them, else the
/// calibrated estimate added on top of the nearest exact prefix before it.
struct Tokens {
    through: Vec<u64>,
    exact: Vec<bool>,
}

impl Tokens {
    fn new(segments: &Segments, conv: Option<&Conversation>) -> Tokens {
        let k = conv.and_then(|c| c.calibration).unwrap_or(1.0);
        let mut through = Vec::with_capacity(segments.units.len());
        let mut exact = Vec::with_capacity(segments.units.len());
        let (mut anchor, mut anchor_est, mut est) = (0u64, 0u64, 0u64);
        for u in &segments.units {
            est += u64::from(u.tokens);
            let known = conv
                .and_then(|c| c.entries.get(&u.prefix))
                .and_then(|e| e.tokens);
            match known {
                Some(n) => {
                    (anchor, anchor_est) = (n, est);
                    through.push(n);
                    exact.push(true);
                }
                None => {
                    through.push(anchor + ((est - anchor_est) as f64 * k).round() as u64);
                    exact.push(false);
                }
            }
        }
        Tokens { through, exact }
    }

    fn at(&self, i: usize) -> u64 {
        self.through.get(i).copied().unwrap_or(0)
    }
}

/// What the rules say the provider will read and write for `req`.
pub(crate) fn predict(
    req: Request<'_>,
    conv: Option<&Conversation>,
    min_tokens: u64,
) -> Prediction {
    let segs = req.segments;
    let tokens = Tokens::new(segs, conv);
    let mut hit: Option<(usize, ExchangeId)> = None;
    if let Some(conv) = conv {
        for &b in &segs.breakpoints {
            let floor = segs.units[b].position.saturating_sub(LOOKBACK - 1);
            for i in (0..=b).rev() {
                if segs.units[i].position < floor {
                    break;
                }
                let Some(entry) = conv.entries.get(&segs.units[i].prefix) else {
                    continue;
                };
                if let EntryState::Alive { last } = entry.state(req.start, req.id) {
                    let by = entry
                        .uses
                        .iter()
                        .filter(|u| u.at == last)
                        .map(|u| u.by)
                        .next()
                        .unwrap_or(req.id);
                    if hit.is_none_or(|(h, _)| i > h) {
                        hit = Some((i, by));
                    }
                    break;
                }
            }
        }
    }
    let read = hit.map_or(0, |(h, _)| tokens.at(h));
    let mut p = Prediction {
        read_tokens: read,
        exact: hit.is_some_and(|(h, _)| tokens.exact[h]),
        hit: hit.map(|(h, _)| h),
        read_through: hit.map(|(h, _)| segs.units[h].path.to_string()),
        read_from: hit.map(|(_, by)| by.to_string()),
        ..Prediction::default()
    };
    // Every breakpoint whose prefix reaches the minimum is written (or refreshed).
    p.written = segs
        .breakpoints
        .iter()
        .copied()
        .filter(|&b| tokens.at(b) >= min_tokens)
        .collect();
    if let Some(&last) = p.written.last()
        && hit.is_none_or(|(h, _)| last > h)
    {
        p.write_tokens = tokens.at(last).saturating_sub(read);
        p.write_through = Some(segs.units[last].path.to_string());
        // Billing with mixed ttls: 1h up to the last 1h marker after the hit.
        let one_hour = p
            .written
            .iter()
            .copied()
            .filter(|&b| hit.is_none_or(|(h, _)| b > h))
            .filter(|&b| {
                segs.units[b]
                    .breakpoint
                    .is_some_and(|m| m.ttl == Ttl::OneHour)
            })
            .max();
        if let Some(b) = one_hour {
            p.write_1h_tokens = tokens.at(b).saturating_sub(read);
        }
    }
    p
}

/// Automatic caching (OpenAI): how much of the previous request's prefix
/// stayed, set beside the provider's cached tokens. OpenAI's cache is best effort
/// (routing, eviction), so a stable prefix that was not reused is `unexplained`.
pub(crate) fn explain_automatic(
    req: Request<'_>,
    conv: &Conversation,
    usage: &Usage,
    min_tokens: u64,
) -> (Explanation, super::StablePrefix) {
    let now = req.segments;
    let tokens = Tokens::new(now, Some(conv));
    let baseline = conv.baseline(req.id, req.start, &req.segments.settings.model);
    let mut out = Explanation {
        verdict: Verdict::None,
        reason: None,
        lost_tokens: 0,
        baseline: baseline.as_ref().map(|b| b.id),
    };
    let Some(prev) = baseline else {
        out.verdict = if usage.cache_read_tokens > 0 {
            Verdict::Hit
        } else if usage.cache_write_tokens > 0 {
            Verdict::Write
        } else {
            Verdict::None
        };
        let stable = super::StablePrefix {
            units: 0,
            tokens: 0,
            changed_at: None,
        };
        return (out, stable);
    };
    let before = &*prev.segments;
    let n = now
        .units
        .iter()
        .zip(&before.units)
        .take_while(|(a, b)| a.prefix == b.prefix)
        .count();
    let stable_tokens = if n == 0 { 0 } else { tokens.at(n - 1) };
    let reason = (n < before.units.len()).then(|| changed(now, before, n));
    let stable = super::StablePrefix {
        units: n,
        tokens: stable_tokens,
        changed_at: (n < before.units.len())
            .then(|| {
                now.units
                    .get(n)
                    .or(before.units.get(n))
                    .map(|u| u.path.to_string())
            })
            .flatten(),
    };
    let prev_tokens = Tokens::new(before, Some(conv)).at(before.units.len().saturating_sub(1));
    out.verdict = match (usage.cache_read_tokens > 0, &reason) {
        (true, None) => Verdict::Hit,
        (true, Some(_)) => Verdict::Partial,
        (false, Some(_)) if stable_tokens >= min_tokens => Verdict::Unexplained,
        (false, Some(_)) => Verdict::Miss,
        (false, None) if prev_tokens < min_tokens => Verdict::None,
        (false, None) => Verdict::Unexplained,
    };
    out.reason = match out.verdict {
        Verdict::Unexplained => Some(Reason::Unexplained {
            predicted_read: stable_tokens,
            actual_read: usage.cache_read_tokens,
            predicted_write: 0,
            actual_write: usage.cache_write_tokens,
            rules: reason.map(Box::new),
        }),
        Verdict::None => Some(Reason::BelowMinimum {
            tokens: prev_tokens,
            minimum: min_tokens,
        }),
        _ => reason,
    };
    (out, stable)
}

// === verdict ===

/// The explanation of one request, given its usage.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Explanation {
    pub verdict: Verdict,
    pub reason: Option<Reason>,
    /// Tokens the rules say could have been read but were not.
    pub lost_tokens: u64,
    /// The request compared with.
    pub baseline: Option<ExchangeId>,
}

/// Sets the actual usage beside the prediction and explains the difference from
/// the conversation's previous request.
pub(crate) fn explain(
    req: Request<'_>,
    conv: Option<&Conversation>,
    prediction: &Prediction,
    usage: &Usage,
    min_tokens: u64,
) -> Explanation {
    let baseline = conv.and_then(|c| c.baseline(req.id, req.start, &req.segments.settings.model));
    let tokens = Tokens::new(req.segments, conv);
    let (rules, lost) = match (&baseline, conv) {
        (Some(p), Some(c)) => gap(req, c, p, prediction),
        _ => (None, 0),
    };
    let read_agrees = agrees(
        prediction.read_tokens,
        usage.cache_read_tokens,
        prediction.exact,
    );
    let write_agrees = (prediction.write_tokens == 0) == (usage.cache_write_tokens == 0);
    let mut out = Explanation {
        verdict: Verdict::Hit,
        reason: None,
        lost_tokens: lost,
        baseline: baseline.as_ref().map(|b| b.id),
    };
    // A pinned size is exact: any other read of that unchanged prefix is a finding of
    // its own, not a unit to blame.
    let pinned = prediction.exact && prediction.read_tokens > 0 && write_agrees;
    if pinned && usage.cache_read_tokens != prediction.read_tokens {
        let (expected, read) = (prediction.read_tokens, usage.cache_read_tokens);
        out.lost_tokens = expected.saturating_sub(read);
        (out.verdict, out.reason) = if read > expected {
            (
                Verdict::Hit,
                Some(Reason::PinnedReadMore { expected, read }),
            )
        } else if read > 0 {
            (
                Verdict::Partial,
                Some(Reason::PinnedReadLess { expected, read }),
            )
        } else {
            (
                Verdict::Miss,
                Some(Reason::PinnedReadLess { expected, read }),
            )
        };
        return out;
    }
    if !(read_agrees && write_agrees) {
        out.verdict = Verdict::Unexplained;
        out.reason = Some(Reason::Unexplained {
            predicted_read: prediction.read_tokens,
            actual_read: usage.cache_read_tokens,
            predicted_write: prediction.write_tokens,
            actual_write: usage.cache_write_tokens,
            rules: rules.map(Box::new),
        });
        out.lost_tokens = 0;
        return out;
    }
    match rules {
        Some(reason) => {
            out.verdict = if usage.cache_read_tokens > 0 {
                Verdict::Partial
            } else {
                Verdict::Miss
            };
            out.reason = Some(reason);
        }
        None if usage.cache_read_tokens > 0 => {
            out.verdict = Verdict::Hit;
            if let Some(conv) = conv
                && let Some((reason, lost)) = returned_to_model(req, conv, usage)
            {
                (out.verdict, out.reason, out.lost_tokens) = (Verdict::Partial, Some(reason), lost);
            }
        }
        None if usage.cache_write_tokens > 0 => out.verdict = Verdict::Write,
        None => {
            out.verdict = Verdict::None;
            out.reason = below_minimum(req.segments, &tokens, min_tokens);
        }
    }
    out
}

/// A turn back on a model after a turn on another reads this model's older entry
/// (each model has a cache of its own): short of what the conversation had cached
/// on the other model. The reason is that switch, and the tokens it cost.
fn returned_to_model(
    req: Request<'_>,
    conv: &Conversation,
    usage: &Usage,
) -> Option<(Reason, u64)> {
    let last = conv.previous(req.id, req.start)?;
    let model = &req.segments.settings.model;
    if last.segments.settings.model == *model {
        return None;
    }
    let &target = last.cached.last()?;
    // The same conversation went on there: its units through that entry are this
    // request's (a side request on a small model shares none of them).
    let now = &req.segments.units;
    let shared = last.segments.units.get(..=target)?.iter().zip(now.iter());
    if now.len() <= target || shared.into_iter().any(|(a, b)| a.hash != b.hash) {
        return None;
    }
    let reachable = Tokens::new(&last.segments, Some(conv)).at(target);
    (reachable > usage.cache_read_tokens).then(|| {
        (
            Reason::ModelChanged {
                before: last.segments.settings.model.clone(),
                after: model.clone(),
            },
            reachable - usage.cache_read_tokens,
        )
    })
}

/// Whether a predicted count matches the provider's: both zero or both not, and
/// equal when the prediction came from an earlier usage, else within 25 %
/// (estimates).
fn agrees(predicted: u64, actual: u64, exact: bool) -> bool {
    if (predicted == 0) != (actual == 0) {
        return false;
    }
    if exact {
        return predicted == actual;
    }
    predicted.abs_diff(actual) <= (predicted / 4).max(64)
}

fn below_minimum(segs: &Segments, tokens: &Tokens, min_tokens: u64) -> Option<Reason> {
    let last = *segs.breakpoints.last()?;
    let n = tokens.at(last);
    (n < min_tokens).then_some(Reason::BelowMinimum {
        tokens: n,
        minimum: min_tokens,
    })
}

/// Why `req` does not read what its baseline `prev` cached, if it does not; and the
/// tokens that costs.
fn gap(
    req: Request<'_>,
    conv: &Conversation,
    prev: &Snapshot,
    prediction: &Prediction,
) -> (Option<Reason>, u64) {
    let (now, before) = (req.segments, &*prev.segments);
    // A baseline that cached nothing (no breakpoint, below the minimum) leaves no gap.
    let Some(&target) = prev.cached.last() else {
        return (None, 0);
    };
    let target_tokens = conv
        .entries
        .get(&before.units[target].prefix)
        .and_then(|e| e.tokens)
        .unwrap_or_else(|| Tokens::new(before, Some(conv)).at(target));
    let lost = target_tokens.saturating_sub(prediction.read_tokens);
    if prediction.hit.is_some_and(|h| h >= target)
        && now.units.get(target).map(|u| u.prefix) == Some(before.units[target].prefix)
    {
        return (None, 0);
    }
    if now.settings.model != before.settings.model {
        return (
            Some(Reason::ModelChanged {
                before: before.settings.model.clone(),
                after: now.settings.model.clone(),
            }),
            lost,
        );
    }
    let diverged =
        (0..=target).find(|&i| now.units.get(i).map(|u| u.prefix) != Some(before.units[i].prefix));
    if let Some(d) = diverged {
        return (Some(changed(now, before, d)), lost);
    }
    let unit = before.units[target].path.to_string();
    let entry = conv.entries.get(&before.units[target].prefix);
    match entry.map(|e| e.state(req.start, req.id)) {
        Some(EntryState::Pending { by, available }) => {
            return (
                Some(Reason::Concurrent {
                    other: by.to_string(),
                    began_after_ms: available.saturating_sub(req.start),
                }),
                lost,
            );
        }
        Some(EntryState::Expired { last, ttl }) => {
            return (
                Some(Reason::TtlExpired {
                    unit,
                    idle_s: req.start.saturating_sub(last) / 1000,
                    ttl_s: ttl.secs(),
                }),
                lost,
            );
        }
        Some(EntryState::Alive { .. }) => {}
        // Nothing on record (forgotten, or the provider said it cached nothing).
        Some(EntryState::Absent) | None => return (None, 0),
    }
    let nearest = now.breakpoints.iter().copied().find(|&b| b >= target);
    match nearest {
        None => (Some(Reason::BreakpointMissing { unit }), lost),
        Some(b) => {
            let positions = now.units[b].position - now.units[target].position + 1;
            if positions > LOOKBACK {
                (
                    Some(Reason::LookbackExceeded {
                        unit,
                        breakpoint: now.units[b].path.to_string(),
                        positions,
                    }),
                    lost,
                )
            } else {
                (None, 0)
            }
        }
    }
}

/// What changed at unit `d`, the first whose prefix differs.
fn changed(now: &Segments, before: &Segments, d: usize) -> Reason {
    // The model keys every cache: every unit's prefix differs, the tools first.
    if now.settings.model != before.settings.model {
        return Reason::ModelChanged {
            before: before.settings.model.clone(),
            after: now.settings.model.clone(),
        };
    }
    let (a, b) = (before.units.get(d), now.units.get(d));
    let in_tools = |u: Option<&Unit>| u.is_some_and(|u| u.path.region == Region::Tools);
    if in_tools(a) || in_tools(b) {
        return tools_changed(before, now);
    }
    if let (Some(a), Some(b)) = (a, b)
        && (a.hash == b.hash || a.ignored || b.ignored)
    {
        let (s, t) = (&before.settings, &now.settings);
        let region = b.path.region;
        let first_of_region = now.region_start(region) == Some(d);
        let candidates: [(&str, Option<String>, Option<String>); 5] = [
            ("speed", s.speed.clone(), t.speed.clone()),
            ("tool_choice", s.tool_choice.clone(), t.tool_choice.clone()),
            ("thinking", s.thinking.clone(), t.thinking.clone()),
            ("effort", s.effort.clone(), t.effort.clone()),
            (
                "images",
                Some(present(s.images).into()),
                Some(present(t.images).into()),
            ),
        ];
        if first_of_region
            && let Some((name, x, y)) = candidates.into_iter().find(|(_, x, y)| x != y)
        {
            return Reason::SettingChanged {
                setting: name.to_owned(),
                before: x,
                after: y,
            };
        }
    }
    let path = b.or(a).map(|u| u.path.to_string()).unwrap_or_default();
    let empty = bytes::Bytes::new();
    let (x, y) = (
        a.map_or(&empty, |u| &u.bytes),
        b.map_or(&empty, |u| &u.bytes),
    );
    let offset = x.iter().zip(y.iter()).take_while(|(p, q)| p == q).count();
    let spelling_only = a.is_some()
        && b.is_some()
        && super::segment::same_value_sized(x, y, now.unique_keys && before.unique_keys);
    Reason::PrefixChanged {
        unit: path,
        offset,
        before: a.map(|_| excerpt(x, offset)),
        after: b.map(|_| excerpt(y, offset)),
        spelling_only,
        by: None,
    }
}

fn present(b: bool) -> &'static str {
    if b { "present" } else { "absent" }
}

/// Up to 24 bytes either side of `at`, as text.
pub(crate) fn excerpt(bytes: &[u8], at: usize) -> String {
    let from = at.saturating_sub(24);
    let to = (at + 24).min(bytes.len());
    let mut s = String::new();
    if from > 0 {
        s.push('…');
    }
    s.push_str(&String::from_utf8_lossy(&bytes[from.min(to)..to]));
    if to < bytes.len() {
        s.push('…');
    }
    s
}

fn tools_changed(before: &Segments, now: &Segments) -> Reason {
    let named = |s: &Segments| -> Vec<(String, [u8; 32])> {
        s.units
            .iter()
            .filter(|u| u.path.region == Region::Tools)
            .map(|u| (u.tool_name().unwrap_or_else(|| u.path.to_string()), u.hash))
            .collect()
    };
    let (a, b) = (named(before), named(now));
    let added = b
        .iter()
        .filter(|(n, _)| !a.iter().any(|(m, _)| m == n))
        .map(|(n, _)| n.clone())
        .collect();
    let removed = a
        .iter()
        .filter(|(n, _)| !b.iter().any(|(m, _)| m == n))
        .map(|(n, _)| n.clone())
        .collect();
    let changed = b
        .iter()
        .filter(|(n, h)| a.iter().any(|(m, g)| m == n && g != h))
        .map(|(n, _)| n.clone())
        .collect();
    Reason::ToolsChanged {
        added,
        removed,
        changed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::history::Snapshot;
    use crate::cache::segment::{IgnoreRule, segment_after};
    use crate::prompt::Format;
    use bytes::Bytes;
    use std::sync::Arc;

    const MIN: u64 = 100;

    fn segs(body: &str) -> Segments {
        segs_after(body, None)
    }

    /// Cut as the stage cuts a turn: after the conversation's last one.
    fn segs_after(body: &str, previous: Option<&Segments>) -> Segments {
        let prompt = crate::prompt::Prompt::read(
            Bytes::copy_from_slice(body.as_bytes()),
            Some(Format::AnthropicMessages),
        );
        segment_after(&prompt, &[IgnoreRule::billing_header()], previous).unwrap()
    }

    fn text(n: usize, seed: &str) -> String {
        format!("{seed} ").repeat(n)
    }

    /// A body: a system block with a breakpoint, then `turns` user/assistant texts
    /// with the breakpoint on the last block.
    fn body(system: &str, turns: usize) -> String {
        let mut messages = Vec::new();
        for t in 0..turns {
            let role = if t % 2 == 0 { "user" } else { "assistant" };
            let cc = if t + 1 == turns {
                r#","cache_control":{"type":"ephemeral"}"#
            } else {
                ""
            };
            messages.push(format!(
                r#"{{"role":"{role}","content":[{{"type":"text","text":"turn {t} {}"{cc}}}]}}"#,
                text(40, "word")
            ));
        }
        format!(
            r#"{{"model":"claude-test","system":[{{"type":"text","text":"{system}","cache_control":{{"type":"ephemeral"}}}}],"messages":[{}]}}"#,
            messages.join(",")
        )
    }

    /// Runs requests in order at the given times (ms) and returns each verdict,
    /// recording history as the stage does, with usage from the rules themselves.
    fn run(bodies: &[(String, Millis)]) -> Vec<(Verdict, Option<Reason>, Prediction)> {
        let mut conv = Conversation::default();
        let mut out = Vec::new();
        let mut previous: Option<Arc<Segments>> = None;
        for (body, at) in bodies {
            let s = Arc::new(segs_after(body, previous.as_deref()));
            previous = Some(s.clone());
            let id = ExchangeId::new();
            let req = Request {
                id,
                start: *at,
                segments: &s,
            };
            let p = predict(req, Some(&conv), MIN);
            let usage = Usage {
                cache_read_tokens: p.read_tokens,
                cache_write_tokens: p.write_tokens,
                input_tokens: 10,
                ..Usage::default()
            };
            let e = explain(req, Some(&conv), &p, &usage, MIN);
            for &b in &p.written {
                let ttl = s.units[b].breakpoint.unwrap().ttl;
                conv.cache(s.units[b].prefix, *at, *at + 500, ttl, id);
            }
            conv.keep(Snapshot {
                id,
                start: *at,
                segments: s.clone(),
                usage: Some(usage),
                cached: p.written.clone(),
            });
            out.push((e.verdict, e.reason, p));
        }
        out
    }

    #[test]
    fn growing_conversation_hits() {
        let sys = text(150, "rules");
        let r = run(&[
            (body(&sys, 1), 0),
            (body(&sys, 2), 10_000),
            (body(&sys, 3), 20_000),
        ]);
        assert_eq!(r[0].0, Verdict::Write);
        assert_eq!(r[1].0, Verdict::Hit);
        assert_eq!(
            r[1].2.read_through.as_deref(),
            Some("messages[0].content[0]")
        );
        assert_eq!(r[2].0, Verdict::Hit);
        assert!(r[2].2.read_tokens > r[1].2.read_tokens);
    }

    #[test]
    fn a_changed_system_block_is_named_with_offset_and_excerpt() {
        let a = format!("{} Today is 2026-11-29.", text(150, "rules"));
        let b = a.replace("2026-11-29", "2026-11-30");
        let r = run(&[(body(&a, 1), 0), (body(&b, 2), 10_000)]);
        assert_eq!(r[1].0, Verdict::Miss);
        let Some(Reason::PrefixChanged {
            unit,
            offset,
            before,
            after,
            spelling_only,
            ..
        }) = &r[1].1
        else {
            panic!("{:?}", r[1].1)
        };
        assert_eq!(unit, "system[0]");
        assert!(!spelling_only, "the value changed");
        let unit_bytes = format!(r#"{{"type":"text","text":"{a}"#);
        assert_eq!(*offset, unit_bytes.find("29.").unwrap());
        assert!(
            before.as_ref().unwrap().contains("2026-11-29"),
            "{before:?}"
        );
        assert!(after.as_ref().unwrap().contains("2026-11-30"), "{after:?}");
        assert_eq!(
            r[1].1.as_ref().unwrap().to_string(),
            format!("system[0] changed @{offset}")
        );
    }

    #[test]
    fn a_unit_respelled_but_equal_in_value_still_reads() {
        let sys = text(150, "rules");
        let a = body(&sys, 1);
        // The same system block with its keys in the other order and an escape.
        let b = body(&sys, 2).replacen(
            &format!(r#"{{"type":"text","text":"{sys}""#),
            &format!(r#"{{ "text": "{sys}", "type": "te\u0078t""#),
            1,
        );
        assert_ne!(b, body(&sys, 2), "the body was respelled");
        let r = run(&[(a.clone(), 0), (b.clone(), 10_000)]);
        // The provider caches the prompt the JSON renders: the prefix still reads.
        assert_eq!(r[1].0, Verdict::Hit, "{:?}", r[1]);
        assert!(r[1].2.read_tokens > 0, "{:?}", r[1].2);
        let first = segs(&a);
        let second = segs_after(&b, Some(&first));
        let unit = second
            .units
            .iter()
            .find(|u| u.path.to_string() == "system[0]")
            .unwrap();
        assert!(
            unit.respelled,
            "the byte-level difference is kept as a note"
        );
        assert!(
            !second
                .units
                .iter()
                .any(|u| u.respelled && u.path.to_string() != "system[0]")
        );
        // Against a cut that knew no earlier turn, the bytes decide: a real change.
        assert_ne!(
            segs(&b).units.last().unwrap().prefix,
            first.units.last().unwrap().prefix
        );
        let at = first
            .units
            .iter()
            .position(|u| u.path.to_string() == "system[0]")
            .unwrap();
        let reason = super::changed(&segs(&b), &first, at);
        assert!(
            matches!(&reason, Reason::PrefixChanged { unit, spelling_only: true, .. } if unit == "system[0]"),
            "{reason:?}"
        );
        assert!(reason.fix(0, None).unwrap().contains("another cause"));
    }

    #[test]
    fn ttl_expiry_and_refresh_by_reads() {
        let sys = text(150, "rules");
        let r = run(&[
            (body(&sys, 1), 0),
            (body(&sys, 1), 240_000), // read at 4 min: refreshed
            (body(&sys, 1), 480_000), // 4 min after the refresh: still alive
            (body(&sys, 1), 900_000), // 7 min idle: expired
        ]);
        assert_eq!(r[1].0, Verdict::Hit);
        assert_eq!(r[2].0, Verdict::Hit);
        assert_eq!(r[3].0, Verdict::Miss);
        assert_eq!(
            r[3].1,
            Some(Reason::TtlExpired {
                unit: "messages[0].content[0]".into(),
                idle_s: 420,
                ttl_s: 300
            })
        );
    }

    #[test]
    fn lookback_and_missing_breakpoints() {
        let sys = text(150, "rules");
        // Turn 2 appends 24 blocks after the cached prefix with the breakpoint on the last.
        let r = run(&[(body(&sys, 1), 0), (body(&sys, 25), 10_000)]);
        assert_eq!(
            r[1].0,
            Verdict::Partial,
            "the system breakpoint still reads"
        );
        assert!(
            matches!(
                &r[1].1,
                Some(Reason::LookbackExceeded { unit, positions: 25, .. }) if unit == "messages[0].content[0]"
            ),
            "{:?}",
            r[1].1
        );
        let bare = body(&sys, 2).replace(r#","cache_control":{"type":"ephemeral"}}]}]"#, "}]}]");
        let r = run(&[(body(&sys, 1), 0), (bare, 10_000)]);
        assert_eq!(r[1].0, Verdict::Partial);
        assert_eq!(
            r[1].1,
            Some(Reason::BreakpointMissing {
                unit: "messages[0].content[0]".into()
            })
        );
    }

    #[test]
    fn model_tools_and_settings() {
        let sys = text(150, "rules");
        let other = body(&sys, 2).replace("claude-test", "claude-other");
        let r = run(&[(body(&sys, 1), 0), (other.clone(), 10_000)]);
        assert_eq!(r[1].0, Verdict::Miss);
        assert!(matches!(&r[1].1, Some(Reason::ModelChanged { .. })));
        // Switching back reads the first model's older entry: short of what the
        // other model's turn cached, because of that switch.
        let back = run(&[(body(&sys, 1), 0), (other, 10_000), (body(&sys, 2), 20_000)]);
        assert_eq!(
            back[2].2.read_through.as_deref(),
            Some("messages[0].content[0]")
        );
        assert_eq!(
            (back[2].0, &back[2].1),
            (
                Verdict::Partial,
                &Some(Reason::ModelChanged {
                    before: "claude-other".into(),
                    after: "claude-test".into()
                })
            ),
            "{:?}",
            back[2]
        );
        let with_tool = |name: &str| {
            body(&sys, 2).replacen(
                "{",
                &format!(r#"{{"tools":[{{"name":"{name}","input_schema":{{}}}}],"#),
                1,
            )
        };
        let r = run(&[(with_tool("A"), 0), (with_tool("B"), 10_000)]);
        assert_eq!(
            r[1].1,
            Some(Reason::ToolsChanged {
                added: vec!["B".into()],
                removed: vec!["A".into()],
                changed: vec![]
            })
        );
        let choice = body(&sys, 2).replacen('{', r#"{"tool_choice":{"type":"auto"},"#, 1);
        let r = run(&[(body(&sys, 1), 0), (choice, 10_000)]);
        assert_eq!(r[1].0, Verdict::Partial, "system still read");
        assert!(
            matches!(&r[1].1, Some(Reason::SettingChanged { setting, .. }) if setting == "tool_choice")
        );
    }

    #[test]
    fn below_minimum_writes_nothing() {
        let r = run(&[(body("short", 1), 0)]);
        // 1 turn of ~45 words + a short system: under 100 estimated tokens? make sure.
        let tokens = segs(&body("short", 1)).total_tokens();
        if tokens < MIN {
            assert_eq!(r[0].0, Verdict::None);
            assert!(matches!(
                r[0].1,
                Some(Reason::BelowMinimum { minimum: MIN, .. })
            ));
        } else {
            panic!("fixture too large: {tokens}");
        }
    }

    #[test]
    fn concurrent_writer_is_named() {
        let sys = text(150, "rules");
        let s1 = Arc::new(segs(&body(&sys, 1)));
        let s2 = Arc::new(segs(&body(&sys, 1)));
        let (a, b) = (ExchangeId::new(), ExchangeId::new());
        let mut conv = Conversation::default();
        let pa = predict(
            Request {
                id: a,
                start: 0,
                segments: &s1,
            },
            Some(&conv),
            MIN,
        );
        for &bp in &pa.written {
            conv.cache(s1.units[bp].prefix, 0, 800, Ttl::FiveMinutes, a);
        }
        conv.keep(Snapshot {
            id: a,
            start: 0,
            segments: s1.clone(),
            usage: None,
            cached: pa.written.clone(),
        });
        let req = Request {
            id: b,
            start: 50,
            segments: &s2,
        };
        let pb = predict(req, Some(&conv), MIN);
        assert_eq!(pb.read_tokens, 0);
        let usage = Usage {
            cache_write_tokens: pb.write_tokens,
            ..Usage::default()
        };
        let e = explain(req, Some(&conv), &pb, &usage, MIN);
        assert_eq!(e.verdict, Verdict::Miss);
        assert_eq!(
            e.reason,
            Some(Reason::Concurrent {
                other: a.to_string(),
                began_after_ms: 750
            })
        );
        // The provider read anyway: the rules are wrong here, and say so.
        let usage = Usage {
            cache_read_tokens: 300,
            ..Usage::default()
        };
        let e = explain(req, Some(&conv), &pb, &usage, MIN);
        assert_eq!(e.verdict, Verdict::Unexplained);
        assert!(
            matches!(&e.reason, Some(Reason::Unexplained { rules: Some(r), .. }) if r.name() == "concurrent")
        );
    }

    #[test]
    fn agreement_slack() {
        assert!(agrees(0, 0, false));
        assert!(!agrees(0, 5, true));
        assert!(agrees(10_000, 10_000, true));
        assert!(!agrees(10_000, 10_050, true), "a pinned size is exact");
        assert!(!agrees(10_000, 10_500, true));
        assert!(agrees(10_000, 12_000, false));
        assert!(!agrees(10_000, 14_000, false));
    }

    #[test]
    fn unexplained_says_what_is_known_and_a_miss_says_what_would_fix_it() {
        let unexplained = |predicted_read, actual_read| Reason::Unexplained {
            predicted_read,
            actual_read,
            predicted_write: 0,
            actual_write: 0,
            rules: None,
        };
        let never_seen = unexplained(0, 45_000).to_string();
        assert!(
            never_seen.contains("read 45.0k tokens of a prefix this proxy never saw written"),
            "{never_seen}"
        );
        assert!(
            unexplained(12_000, 2_000)
                .to_string()
                .contains("10.0k fewer")
        );
        assert!(
            unexplained(2_000, 12_000)
                .to_string()
                .contains("10.0k more")
        );
        assert_eq!(unexplained(0, 45_000).fix(0, None), None);

        let date = Reason::PrefixChanged {
            unit: "system[2]".into(),
            offset: 40,
            before: Some("Today's date is 2026-11-29.".into()),
            after: Some("Today's date is 2026-11-30.".into()),
            spelling_only: false,
            by: None,
        };
        assert!(
            date.fix(0, None)
                .unwrap()
                .contains("rules/examples/50-move-dates.toml")
        );
        let other = Reason::PrefixChanged {
            unit: "system[2]".into(),
            offset: 40,
            before: Some("You are X".into()),
            after: Some("You are Y".into()),
            spelling_only: false,
            by: None,
        };
        assert!(!other.fix(0, None).unwrap().contains("50-move-dates"));
        let price = crate::provider::price::Price {
            input: 4.0,
            output: 20.0,
            cache_write_5m: 1.25,
            cache_write_1h: 2.0,
            cache_read: 0.05,
        };
        let ttl = Reason::TtlExpired {
            unit: "messages[3]".into(),
            idle_s: 401,
            ttl_s: 300,
        };
        // 1M tokens: 0.75 x $4 more to write at 1h; 1.2 x $4 saved by reading.
        let fix = ttl.fix(1_000_000, Some(&price)).unwrap();
        assert!(fix.contains("$3.0000 more and saved $4.8000"), "{fix}");
        let long = Reason::TtlExpired {
            unit: "messages[3]".into(),
            idle_s: 7200,
            ttl_s: 300,
        };
        assert!(!long.fix(1, Some(&price)).unwrap().contains("1h ttl would"));
    }
}

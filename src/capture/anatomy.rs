//! A stored exchange's prompt anatomy: its parts named (see
//! [`crate::cache::anatomy`]), each with its tokens by the provider's count, how the
//! provider billed them (read from the cache, written, or uncached) and, at the
//! rates the record was priced at, their dollars. One home for `captures anatomy`
//! and the viewer's panel.

use serde::Serialize;

use super::record::CaptureRecord;
use crate::cache::anatomy::{Billed, Family, Named, Part, anatomy, bill, by_family};
use crate::cache::segment::{IgnoreRule, segment};
use crate::prompt::Prompt;

/// Why a record has no anatomy.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AnatomyError {
    #[error("{0} is not a model request promptgate reads")]
    NotAModelRequest(String),
    #[error("{0} kept no request body (capture was off for it)")]
    NoBody(String),
    #[error("{0}'s request body cannot be read as a prompt")]
    Unreadable(String),
}

/// One part with how it was billed (when the record has the provider's usage).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BilledPart {
    #[serde(flatten)]
    pub part: Part,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub billed: Option<Billed>,
    /// Inside the cached prefix the provider read.
    pub cached: bool,
}

/// One family's tokens and dollars.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FamilyTotal {
    pub family: Family,
    pub tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usd: Option<f64>,
}

/// A record's anatomy.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Anatomy {
    pub id: String,
    /// The agent whose request shape it has (`Claude Code 2.1.332`, `pi`, `Codex`,
    /// `opencode`), or `unknown`.
    pub agent: String,
    pub estimated_tokens: u64,
    /// The provider's count of the whole input, when it gave one.
    pub provider_input_tokens: Option<u64>,
    /// The whole input's dollars, when the record was priced.
    pub input_usd: Option<f64>,
    pub families: Vec<FamilyTotal>,
    pub parts: Vec<BilledPart>,
    /// What the numbers call for (a large memory file, a heavy MCP server).
    pub advice: Vec<super::advice::Advice>,
}

impl Anatomy {
    /// Its families by the provider's count where it gave one (a chart's bars then
    /// sum to it), with their dollars.
    pub(crate) fn billed_families(&self) -> Vec<FamilyTotal> {
        Family::ALL
            .iter()
            .filter_map(|&family| {
                let tokens: u64 = self
                    .parts
                    .iter()
                    .filter(|p| p.part.family == family)
                    .map(|p| p.billed.map_or(p.part.tokens, |b| b.tokens))
                    .sum();
                let usd = self.families.iter().find(|f| f.family == family)?.usd;
                (tokens > 0).then_some(FamilyTotal {
                    family,
                    tokens,
                    usd,
                })
            })
            .collect()
    }
}

/// Families summed over several prompts: tokens added, dollars too while every one
/// was priced.
pub(crate) fn sum_families<'a>(lists: impl Iterator<Item = &'a [FamilyTotal]>) -> Vec<FamilyTotal> {
    let mut sums: Vec<FamilyTotal> = Family::ALL
        .iter()
        .map(|&family| FamilyTotal {
            family,
            tokens: 0,
            usd: Some(0.0),
        })
        .collect();
    for f in lists.flatten() {
        if let Some(sum) = sums.iter_mut().find(|s| s.family == f.family) {
            sum.tokens += f.tokens;
            sum.usd = sum.usd.zip(f.usd).map(|(a, b)| a + b);
        }
    }
    sums.retain(|s| s.tokens > 0);
    sums
}

/// The agent and parts of `record`'s prompt as sent upstream.
pub(crate) fn parts_of(record: &CaptureRecord) -> Result<Named, AnatomyError> {
    let format = record
        .request_format()
        .ok_or_else(|| AnatomyError::NotAModelRequest(record.id.clone()))?;
    let body = &record.sent().bytes;
    if body.is_empty() {
        return Err(AnatomyError::NoBody(record.id.clone()));
    }
    let prompt = Prompt::read(body.clone(), Some(format));
    let segs = segment(&prompt, &[IgnoreRule::billing_header()])
        .map_err(|_| AnatomyError::Unreadable(record.id.clone()))?;
    Ok(anatomy(&prompt, &segs))
}

/// `record`'s anatomy, billed by its usage at the rates it was priced at.
pub(crate) fn of(record: &CaptureRecord) -> Result<Anatomy, AnatomyError> {
    let Named { agent, parts } = parts_of(record)?;
    let cost = record
        .cache
        .as_ref()
        .and_then(|c| c.cost.as_ref())
        .map(|c| c.usd);
    let usage = record
        .usage
        .filter(|u| u.input_tokens + u.cache_read_tokens + u.cache_write_tokens > 0);
    let billed: Option<Vec<Billed>> = usage.map(|u| bill(&parts, &u, cost.as_ref()));
    let families = by_family(&parts)
        .into_iter()
        .map(|(family, tokens)| FamilyTotal {
            family,
            tokens,
            usd: billed.as_ref().and_then(|b| {
                parts
                    .iter()
                    .zip(b)
                    .filter(|(p, _)| p.family == family)
                    .map(|(_, b)| b.usd)
                    .sum::<Option<f64>>()
            }),
        })
        .collect();
    let input_usd = billed
        .as_ref()
        .and_then(|b| b.iter().map(|b| b.usd).sum::<Option<f64>>());
    let mut a = Anatomy {
        id: record.id.clone(),
        agent: agent.label(),
        estimated_tokens: parts.iter().map(|p| p.tokens).sum(),
        provider_input_tokens: usage
            .map(|u| u.input_tokens + u.cache_read_tokens + u.cache_write_tokens),
        input_usd,
        families,
        parts: parts
            .into_iter()
            .enumerate()
            .map(|(i, part)| {
                let billed = billed.as_ref().map(|b| b[i]);
                BilledPart {
                    part,
                    billed,
                    cached: billed.is_some_and(|b| b.cached()),
                }
            })
            .collect(),
        advice: Vec::new(),
    };
    a.advice = super::advice::request(&a);
    Ok(a)
}

/// One turn of a conversation: its families' tokens (by the provider's count when
/// it gave one, else estimated) and dollars.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TurnAnatomy {
    pub id: String,
    pub started_ms: u64,
    pub families: Vec<FamilyTotal>,
}

/// A conversation's anatomy, turn by turn, and each family over all of it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ConversationAnatomy {
    pub conversation: String,
    pub turns: Vec<TurnAnatomy>,
    /// Each family's dollars summed over the turns (`None`: a turn was unpriced).
    pub families: Vec<FamilyTotal>,
    /// The cache misses a family's change caused (the analysis' first changed
    /// unit, or a tools change), and what they lost.
    pub misses: Vec<FamilyMisses>,
    /// Turns that could not be read, and why.
    pub skipped: Vec<String>,
    /// What the numbers call for over the conversation.
    pub advice: Vec<super::advice::Advice>,
}

/// The cache misses one family's changes caused over a conversation.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FamilyMisses {
    pub family: Family,
    pub misses: u32,
    /// What reading the tokens those misses wrote again would have saved.
    pub lost_usd: f64,
    /// The turns, by id.
    pub turns: Vec<String>,
}

/// What made `record` miss the cache, when the analysis names it: the part its
/// first changed byte is in (a re-spelling alone misses nothing), or the tools.
enum Missed {
    /// The index of the part in the anatomy.
    Part(usize),
    Tools,
}

impl Missed {
    fn family(&self, parts: &[BilledPart]) -> Family {
        match self {
            Missed::Part(i) => parts[*i].part.family,
            Missed::Tools => Family::Tools,
        }
    }
}

fn missed_by(record: &CaptureRecord, parts: &[BilledPart]) -> Option<Missed> {
    use crate::cache::explain::Reason;
    match record.cache.as_ref()?.reason.as_ref()? {
        Reason::PrefixChanged {
            unit,
            offset,
            spelling_only: false,
            ..
        } => {
            // The unit's last part that starts at or before the changed byte.
            let mut found = None;
            for (i, p) in parts.iter().enumerate() {
                if p.part.unit == *unit && (found.is_none() || p.part.at <= *offset) {
                    found = Some(i);
                }
            }
            found.map(Missed::Part)
        }
        Reason::ToolsChanged { .. } => Some(Missed::Tools),
        _ => None,
    }
}

/// The model calls of conversation `key` (a key, or a bare session id: Claude
/// Code's `cc:` or a metadata `session:` one), oldest first.
pub(crate) fn conversation_records(
    store: &super::Store,
    key: &str,
) -> Result<(String, Vec<CaptureRecord>), super::StoreError> {
    let of = |key: String| super::store::Filter {
        conversation: Some(key),
        side: Some(false),
        ..super::store::Filter::default()
    };
    let mut key = key.to_owned();
    let mut rows = store.list(&of(key.clone()))?;
    for prefix in ["cc:", "session:"] {
        if rows.is_empty() && !key.contains(':') {
            let prefixed = format!("{prefix}{key}");
            rows = store.list(&of(prefixed.clone()))?;
            if !rows.is_empty() {
                key = prefixed;
            }
        }
    }
    rows.sort_by(|x, y| (x.started_ms, &x.id).cmp(&(y.started_ms, &y.id)));
    let records = rows
        .iter()
        .map(|r| store.load(&r.id))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((key, records))
}

/// The anatomy of each of `records` (a conversation's turns, oldest first).
pub(crate) fn conversation(key: &str, records: &[CaptureRecord]) -> ConversationAnatomy {
    let mut turns = Vec::with_capacity(records.len());
    let mut skipped = Vec::new();
    let mut misses: Vec<FamilyMisses> = Vec::new();
    let mut read: Vec<(Anatomy, Option<(usize, f64)>)> = Vec::with_capacity(records.len());
    for r in records {
        match of(r) {
            Ok(a) => {
                let missed = missed_by(r, &a.parts);
                let lost = r
                    .cache
                    .as_ref()
                    .and_then(|c| c.cost.as_ref())
                    .map_or(0.0, |c| c.usd.lost_usd);
                if let Some(missed) = &missed {
                    let family = missed.family(&a.parts);
                    let at = match misses.iter().position(|m| m.family == family) {
                        Some(at) => at,
                        None => {
                            misses.push(FamilyMisses {
                                family,
                                misses: 0,
                                lost_usd: 0.0,
                                turns: Vec::new(),
                            });
                            misses.len() - 1
                        }
                    };
                    misses[at].misses += 1;
                    misses[at].lost_usd += lost;
                    misses[at].turns.push(r.id.clone());
                }
                turns.push(TurnAnatomy {
                    families: a.billed_families(),
                    id: a.id.clone(),
                    started_ms: r.times.started_ms,
                });
                let part = match missed {
                    Some(Missed::Part(i)) => Some((i, lost)),
                    _ => None,
                };
                read.push((a, part));
            }
            Err(e) => skipped.push(e.to_string()),
        }
    }
    let families = sum_families(turns.iter().map(|t| t.families.as_slice()));
    misses.sort_by(|a, b| {
        b.lost_usd
            .total_cmp(&a.lost_usd)
            .then(b.misses.cmp(&a.misses))
    });
    ConversationAnatomy {
        conversation: key.to_owned(),
        turns,
        families,
        misses,
        skipped,
        advice: super::advice::conversation(&read),
    }
}

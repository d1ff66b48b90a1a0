//! `cache report`: per conversation, the timeline of cache verdicts and a summary —
//! hit rate by tokens, dollars written, saved and lost by reason, the units that
//! change most often — built from the capture store alone (no live state).
//!
//! The stored analyses carry no prompt text; the before/after excerpt of a changed
//! unit is cut here from the stored bodies, which were redacted before they were stored.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use super::CaptureRecord;
use super::store::{Damaged, Filter, Store, StoreError};
use crate::cache::explain::{Reason, Verdict, excerpt};
use crate::cache::segment::{self, IgnoreRule, Segments};
use crate::cache::{CostView, StablePrefix};
use crate::prompt::Ttl;

/// The report: one entry per conversation, in order of first request.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub conversations: Vec<ConversationReport>,
    /// Every conversation's exchanges together: hit rate, dollars, and the miss
    /// reasons by what they cost (no unit changes: those are per conversation).
    pub total: Summary,
    /// Every exchange's prompt by where its parts came from: tokens by the
    /// provider's count and input dollars per family, over the whole selection.
    pub by_family: Vec<super::anatomy::FamilyTotal>,
    /// Records left out because they could not be read.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub damaged: Vec<Damaged>,
}

/// One conversation's timeline and summary.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ConversationReport {
    /// The conversation key as stored (redacted like any text); `-` when none.
    pub conversation: String,
    /// The analysed exchanges, oldest first.
    pub timeline: Vec<Entry>,
    pub summary: Summary,
}

/// One analysed exchange.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Entry {
    pub id: String,
    /// RFC 3339, UTC.
    pub started_at: String,
    pub started_ms: u64,
    pub model: String,
    pub verdict: Verdict,
    /// Tokens the provider read from the cache, wrote to it, and took uncached.
    pub read: u64,
    pub write: u64,
    pub uncached: u64,
    pub predicted_read: u64,
    pub predicted_write: u64,
    /// Why it did not read what was cached; a changed unit with its before/after
    /// excerpt when both requests' bodies are in the store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// The reason as the log line says it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason_text: Option<String>,
    /// Tokens the rules say could have been read and were not.
    pub lost_tokens: u64,
    /// Dollars (absent when the price table has no entry for the model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<CostView>,
    /// The earlier request this one was compared with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// The ttl of the last breakpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl: Option<Ttl>,
    /// The token estimator's error against the provider's count, in percent.
    pub estimate_error_pct: f64,
    /// Automatic caching (OpenAI): the prefix that stayed the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stable: Option<StablePrefix>,
    /// What would have let it read the cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// The provider's own reason, beside promptgate's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider_says: Option<crate::cache::ProviderSays>,
}

/// What a conversation's caching came to.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Summary {
    /// Exchanges of the conversation in the store (within the filter).
    pub requests: usize,
    /// Of them, those with a cache analysis.
    pub analysed: usize,
    pub read_tokens: u64,
    pub write_tokens: u64,
    pub uncached_tokens: u64,
    /// Read tokens over all prompt tokens (read + written + uncached), 0 to 1.
    pub hit_rate: f64,
    /// Whether any exchange had a price (the dollar figures are 0 otherwise).
    pub priced: bool,
    /// Models with no price: their dollars are unknown and left out of the sums.
    pub unpriced: Vec<String>,
    pub write_usd: f64,
    pub read_usd: f64,
    pub saved_usd: f64,
    pub lost_usd: f64,
    /// Spent on the whole input (uncached, writes and reads) of the priced exchanges.
    pub input_usd: f64,
    /// Spent on their answers.
    pub output_usd: f64,
    /// Their whole cost: input and output.
    pub total_usd: f64,
    /// Lost to each reason, most dollars (then tokens) first.
    pub lost: Vec<Loss>,
    /// Requests whose unit view was compared with their baseline's.
    pub compared: usize,
    /// Units that changed against the baseline, most often first (at most 10).
    pub changed_units: Vec<UnitChanges>,
    /// Misses the provider diagnosed too: its reason named what promptgate named,
    /// or not.
    pub provider_agrees: usize,
    pub provider_disagrees: usize,
}

/// What one miss reason cost across a conversation.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Loss {
    pub reason: String,
    pub requests: usize,
    pub tokens: u64,
    pub usd: f64,
}

/// How often a unit differed from the same unit of the request before.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct UnitChanges {
    /// The unit path (`system[2]`; string content as `messages[1].content[0]`).
    pub unit: String,
    pub changed: usize,
    /// Requests compared.
    pub of: usize,
    /// Left out of the prefix hash by `[cache] ignore` (changes do not break the cache).
    pub ignored: bool,
}

/// A unit's path with string content read as its one text block, so the unit keeps
/// its key when Claude Code turns `messages[1].content` from blocks into a string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct UnitKey(String);

impl UnitKey {
    /// A tool by its name (a removed tool must not shift every one after it), any
    /// other unit by its path.
    fn of(unit: &segment::Unit) -> UnitKey {
        match unit.tool_name() {
            Some(name) => UnitKey(format!("tool {name}")),
            None => UnitKey::parse(&unit.path.to_string()),
        }
    }

    fn parse(path: &str) -> UnitKey {
        match path.strip_suffix(".content") {
            Some(message) => UnitKey(format!("{message}.content[0]")),
            None => UnitKey(path.to_owned()),
        }
    }
}

/// Units listed under "changed most often".
const CHANGED_SHOWN: usize = 10;

/// Builds the report over the records `filter` selects; `ignore` marks the units the
/// analysis leaves out of the prefix hash.
pub(crate) fn build(
    store: &Store,
    filter: &Filter,
    ignore: &[IgnoreRule],
) -> Result<Report, StoreError> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for row in store.list(filter)? {
        let key = row.conversation.unwrap_or_else(|| "-".into());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, ids)) => ids.push(row.id),
            None => groups.push((key, vec![row.id])),
        }
    }
    let mut conversations = Vec::with_capacity(groups.len());
    let mut damaged = Vec::new();
    let mut by_family = FamilySums::default();
    for (conversation, ids) in groups {
        let mut records = Vec::with_capacity(ids.len());
        for id in &ids {
            if let Some(record) = Damaged::sift(id, store.load(id), &mut damaged)? {
                by_family.add(&record);
                records.push(record);
            }
        }
        let mut units = UnitViews {
            store,
            ignore,
            by_id: HashMap::new(),
        };
        conversations.push(conversation_report(conversation, &records, &mut units));
    }
    let mut total = Summary::default();
    for c in &conversations {
        total.requests += c.summary.requests;
        for entry in &c.timeline {
            add(&mut total, entry);
        }
    }
    finish(&mut total);
    Ok(Report {
        conversations,
        total,
        by_family: by_family.totals(),
        damaged,
    })
}

/// Each record's prompt families (by the provider's count, with their dollars),
/// summed when the report is done.
#[derive(Default)]
struct FamilySums(Vec<Vec<super::anatomy::FamilyTotal>>);

impl FamilySums {
    /// Adds `record`'s anatomy (nothing for a record that is no model request).
    fn add(&mut self, record: &CaptureRecord) {
        if let Ok(a) = super::anatomy::of(record) {
            self.0.push(a.billed_families());
        }
    }

    fn totals(self) -> Vec<super::anatomy::FamilyTotal> {
        super::anatomy::sum_families(self.0.iter().map(Vec::as_slice))
    }
}

/// The hit rate, and the losses by what they cost.
fn finish(summary: &mut Summary) {
    let total = summary.read_tokens + summary.write_tokens + summary.uncached_tokens;
    if total > 0 {
        summary.hit_rate = summary.read_tokens as f64 / total as f64;
    }
    summary.lost.sort_by(|a, b| {
        b.usd
            .total_cmp(&a.usd)
            .then(b.tokens.cmp(&a.tokens))
            .then(a.reason.cmp(&b.reason))
    });
}

/// Requests cut into cache units from their stored bodies, by id; loaded from the
/// store when a baseline lies outside the selection.
struct UnitViews<'a> {
    store: &'a Store,
    ignore: &'a [IgnoreRule],
    by_id: HashMap<String, Option<Arc<Segments>>>,
}

impl UnitViews<'_> {
    fn of(&mut self, record: &CaptureRecord) -> Option<Arc<Segments>> {
        if let Some(s) = self.by_id.get(&record.id) {
            return s.clone();
        }
        let s = cut(record, self.ignore).map(Arc::new);
        self.by_id.insert(record.id.clone(), s.clone());
        s
    }

    fn of_id(&mut self, id: &str) -> Option<Arc<Segments>> {
        if let Some(s) = self.by_id.get(id) {
            return s.clone();
        }
        // Pruned, or never stored: no comparison, no excerpt.
        let record = self.store.load(id).ok()?;
        self.of(&record)
    }
}

/// The request as sent, cut into cache units, when its body was kept.
fn cut(record: &CaptureRecord, ignore: &[IgnoreRule]) -> Option<Segments> {
    // What cache analysis reads: not token counting.
    let format = record
        .request_format()
        .filter(|_| record.api.as_deref() != Some("count_tokens"))?;
    let body = &record.sent().bytes;
    if !record.captured || body.is_empty() {
        return None;
    }
    let prompt = crate::prompt::Prompt::read(body.clone(), Some(format));
    segment::segment(&prompt, ignore).ok()
}

fn conversation_report(
    conversation: String,
    records: &[CaptureRecord],
    units: &mut UnitViews<'_>,
) -> ConversationReport {
    let mut summary = Summary {
        requests: records.len(),
        ..Summary::default()
    };
    let mut timeline = Vec::new();
    // Per unit key, in the order first seen: (key, times changed, ignored).
    let mut changes: Vec<(UnitKey, usize, bool)> = Vec::new();
    for record in records {
        let Some((entry, compared)) = explained(record, units) else {
            continue;
        };
        if let Some((before, now)) = compared {
            summary.compared += 1;
            count_changes(&before, &now, &mut changes);
        }
        add(&mut summary, &entry);
        timeline.push(entry);
    }
    finish(&mut summary);
    changes.sort_by_key(|(_, n, _)| std::cmp::Reverse(*n));
    summary.changed_units = changes
        .into_iter()
        .take(CHANGED_SHOWN)
        .map(|(key, changed, ignored)| UnitChanges {
            unit: key.0,
            changed,
            of: summary.compared,
            ignored,
        })
        .collect();
    ConversationReport {
        conversation,
        timeline,
        summary,
    }
}

/// One stored record's analysis with its excerpts (the timeline entry `captures show`
/// prints), when it has one.
pub(crate) fn entry(store: &Store, record: &CaptureRecord) -> Option<Entry> {
    let mut units = UnitViews {
        store,
        ignore: &[],
        by_id: HashMap::new(),
    };
    explained(record, &mut units).map(|(e, _)| e)
}

/// A record's timeline entry, and its baseline's units and its own when both are known.
#[allow(clippy::type_complexity)]
fn explained(
    record: &CaptureRecord,
    units: &mut UnitViews<'_>,
) -> Option<(Entry, Option<(Arc<Segments>, Arc<Segments>)>)> {
    let report = record.cache.as_ref()?;
    let now = units.of(record);
    let before = report.baseline.as_deref().and_then(|b| units.of_id(b));
    let reason = report
        .reason
        .clone()
        .map(|r| with_excerpts(r, before.as_deref(), now.as_deref()));
    let entry = Entry {
        id: record.id.clone(),
        started_at: record.started_at.clone(),
        started_ms: record.times.started_ms,
        model: report.model.clone(),
        verdict: report.verdict,
        read: report.actual.read,
        write: report.actual.write,
        uncached: report.actual.input,
        predicted_read: report.prediction.read_tokens,
        predicted_write: report.prediction.write_tokens,
        reason_text: reason.as_ref().map(ToString::to_string),
        reason,
        lost_tokens: report.lost_tokens,
        cost: report.cost.clone(),
        baseline: report.baseline.clone(),
        ttl: report.breakpoints.last().map(|b| b.ttl),
        estimate_error_pct: report.estimate.error_pct,
        stable: report.stable.clone(),
        fix: report.fix.clone(),
        provider_says: report.provider_says.clone(),
    };
    Some((entry, before.zip(now)))
}

/// Adds an exchange's tokens and dollars to the summary.
fn add(summary: &mut Summary, e: &Entry) {
    summary.analysed += 1;
    match e.provider_says.as_ref().and_then(|p| p.agrees) {
        Some(true) => summary.provider_agrees += 1,
        Some(false) => summary.provider_disagrees += 1,
        None => {}
    }
    summary.read_tokens += e.read;
    summary.write_tokens += e.write;
    summary.uncached_tokens += e.uncached;
    let usd = e.cost.as_ref().map(|c| c.usd);
    if usd.is_none() && !summary.unpriced.contains(&e.model) {
        summary.unpriced.push(e.model.clone());
    }
    if let Some(c) = usd {
        summary.priced = true;
        summary.write_usd += c.write_usd;
        summary.read_usd += c.read_usd;
        summary.saved_usd += c.saved_usd;
        summary.lost_usd += c.lost_usd;
        summary.input_usd += c.input_usd;
        summary.output_usd += c.output_usd;
        summary.total_usd += c.total_usd;
    }
    let Some(reason) = &e.reason else {
        return;
    };
    if e.lost_tokens == 0 && !matches!(e.verdict, Verdict::Miss | Verdict::Partial) {
        return;
    }
    let name = reason.name().to_owned();
    let at = match summary.lost.iter().position(|l| l.reason == name) {
        Some(at) => at,
        None => {
            summary.lost.push(Loss {
                reason: name,
                requests: 0,
                tokens: 0,
                usd: 0.0,
            });
            summary.lost.len() - 1
        }
    };
    let loss = &mut summary.lost[at];
    loss.requests += 1;
    loss.tokens += e.lost_tokens;
    loss.usd += usd.map_or(0.0, |c| c.lost_usd);
}

/// Counts the units of `now` whose bytes differ from the same unit of `before`.
fn count_changes(before: &Segments, now: &Segments, changes: &mut Vec<(UnitKey, usize, bool)>) {
    let earlier: HashMap<UnitKey, [u8; 32]> = before
        .units
        .iter()
        .map(|u| (UnitKey::of(u), u.hash))
        .collect();
    for u in &now.units {
        let key = UnitKey::of(u);
        if earlier.get(&key).is_none_or(|h| *h == u.hash) {
            continue;
        }
        match changes.iter_mut().find(|(k, _, _)| *k == key) {
            Some((_, n, ignored)) => {
                *n += 1;
                *ignored |= u.ignored;
            }
            None => changes.push((key, 1, u.ignored)),
        }
    }
}

/// `reason` with the before/after excerpt of its changed unit, cut from the stored
/// bodies; unchanged when either body is missing.
fn with_excerpts(reason: Reason, before: Option<&Segments>, now: Option<&Segments>) -> Reason {
    let (Some(before), Some(now)) = (before, now) else {
        return reason;
    };
    reason.map(&mut |r| match r {
        Reason::PrefixChanged {
            unit,
            offset,
            spelling_only,
            by,
            ..
        } => {
            let key = UnitKey::parse(&unit);
            let find = |s: &Segments| {
                s.units
                    .iter()
                    .position(|u| UnitKey::parse(&u.path.to_string()) == key)
            };
            let a = find(before).map(|i| &before.units[i]);
            let b = find(now).map(|i| &now.units[i]);
            let (x, y) = (
                a.map_or(&[][..], |u| &u.bytes[..]),
                b.map_or(&[][..], |u| &u.bytes[..]),
            );
            let at = x.iter().zip(y).take_while(|(p, q)| p == q).count();
            Reason::PrefixChanged {
                unit,
                offset,
                before: a.map(|_| excerpt(x, at)),
                after: b.map(|_| excerpt(y, at)),
                spelling_only,
                by,
            }
        }
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn segs(system: &str, first: &str) -> Segments {
        let body = format!(
            r#"{{"model":"m","system":[{{"type":"text","text":"x-anthropic-billing-header: cch={system};"}},{{"type":"text","text":"{system}"}}],"messages":[{{"role":"user","content":{first}}},{{"role":"assistant","content":"ok"}}]}}"#
        );
        let prompt = crate::prompt::Prompt::read(
            Bytes::from(body),
            Some(crate::prompt::Format::AnthropicMessages),
        );
        segment::segment(&prompt, &[IgnoreRule::billing_header()]).unwrap()
    }

    #[test]
    fn changed_units_are_counted_by_path_and_a_string_equals_its_text_block() {
        let a = segs("date 2026-11-29", r#"[{"type":"text","text":"hi"}]"#);
        let b = segs("date 2026-11-30", r#""hi""#);
        let mut changes = Vec::new();
        count_changes(&a, &b, &mut changes);
        let got: Vec<(String, usize, bool)> =
            changes.into_iter().map(|(k, n, i)| (k.0, n, i)).collect();
        assert_eq!(
            got,
            [
                ("system[0]".to_owned(), 1, true),
                ("system[1]".to_owned(), 1, false)
            ],
            "messages[0] went from blocks to a string: not a change"
        );
        let reason = Reason::PrefixChanged {
            unit: "system[1]".into(),
            offset: 0,
            before: None,
            after: None,
            spelling_only: false,
            by: None,
        };
        let Reason::PrefixChanged { before, after, .. } =
            with_excerpts(reason.clone(), Some(&a), Some(&b))
        else {
            unreachable!()
        };
        assert_eq!(
            before.as_deref(),
            Some("…t\",\"text\":\"date 2026-11-29\"}")
        );
        assert_eq!(after.as_deref(), Some("…t\",\"text\":\"date 2026-11-30\"}"));
        assert_eq!(
            with_excerpts(reason.clone(), None, Some(&b)),
            reason,
            "no excerpt without both bodies"
        );
    }

    #[test]
    fn a_removed_tool_changes_no_other_tool() {
        let with_tools = |names: &[&str]| {
            let tools: Vec<String> = names
                .iter()
                .map(|n| match n.strip_suffix('*') {
                    // A star: the same tool with another schema.
                    Some(n) => format!(r#"{{"name":"{n}","input_schema":{{"type":"string"}}}}"#),
                    None => format!(r#"{{"name":"{n}","input_schema":{{"type":"object"}}}}"#),
                })
                .collect();
            let body = format!(
                r#"{{"model":"m","tools":[{}],"messages":[{{"role":"user","content":"hi"}}]}}"#,
                tools.join(",")
            );
            let prompt = crate::prompt::Prompt::read(
                Bytes::from(body),
                Some(crate::prompt::Format::AnthropicMessages),
            );
            segment::segment(&prompt, &[]).unwrap()
        };
        let before = with_tools(&["Agent", "Bash", "Edit", "Read", "Write"]);
        let mut changes = Vec::new();
        count_changes(
            &before,
            &with_tools(&["Agent", "Edit", "Read", "Write"]),
            &mut changes,
        );
        assert!(
            changes.is_empty(),
            "Bash went; the rest are the same tools: {:?}",
            changes.iter().map(|c| &c.0.0).collect::<Vec<_>>()
        );
        let mut changes = Vec::new();
        count_changes(
            &before,
            &with_tools(&["Agent", "Edit*", "Read", "Write"]),
            &mut changes,
        );
        let got: Vec<(String, usize)> = changes.into_iter().map(|(k, n, _)| (k.0, n)).collect();
        assert_eq!(
            got,
            [("tool Edit".to_owned(), 1)],
            "one tool edited, found by its name"
        );
    }
}

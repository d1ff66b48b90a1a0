//! `promptgate captures anatomy`: each part of a request's prompt named by where it
//! came from, with its estimated tokens, its share and, given the provider's usage,
//! its share of the input.

use std::fmt::Write as _;

use anyhow::Context as _;

use crate::cache::anatomy::{Family, Part, anatomy, by_family};
use crate::cache::explain::kilo;
use crate::cache::segment::{IgnoreRule, segment};
use crate::capture::CaptureRecord;
use crate::prompt::Prompt;

/// The parts of `record`'s prompt as sent upstream.
fn parts_of(record: &CaptureRecord) -> anyhow::Result<Vec<Part>> {
    let format = record
        .request_format()
        .with_context(|| format!("{} is not a model request promptgate reads", record.id))?;
    let body = &record.sent().bytes;
    if body.is_empty() {
        anyhow::bail!(
            "{} kept no request body (capture was off for it)",
            record.id
        );
    }
    let prompt = Prompt::read(body.clone(), Some(format));
    let segs = segment(&prompt, &[IgnoreRule::billing_header()])
        .with_context(|| format!("{}'s request body cannot be read as a prompt", record.id))?;
    Ok(anatomy(&prompt, &segs))
}

/// Tokens of `family` in a turn's families.
fn of(families: &[(Family, u64)], family: Family) -> u64 {
    families
        .iter()
        .find(|(f, _)| *f == family)
        .map_or(0, |(_, t)| *t)
}

/// Prints a conversation's turns, oldest first: estimated tokens per family per
/// turn and the change from the turn before (`text`), or the same as `json`.
pub(super) fn print_conversation(
    key: &str,
    records: &[CaptureRecord],
    json: bool,
    out: &mut String,
) -> anyhow::Result<()> {
    if records.is_empty() {
        anyhow::bail!("no model call of conversation {key:?} in the store");
    }
    let mut turns = Vec::new();
    for r in records {
        // A turn that cannot be read (no body kept) is skipped and named.
        match parts_of(r) {
            Ok(parts) => turns.push((r.id.clone(), by_family(&parts))),
            Err(e) => {
                let _ = writeln!(out, "skipped: {e:#}");
            }
        }
    }
    if json {
        let value: Vec<_> = turns
            .iter()
            .map(|(id, families)| {
                serde_json::json!({
                    "id": id,
                    "families": families
                        .iter()
                        .map(|(f, t)| serde_json::json!({"family": f, "tokens": t}))
                        .collect::<Vec<_>>(),
                })
            })
            .collect();
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    let _ = write!(out, "{:<28}", "TURN");
    for f in Family::ALL {
        let _ = write!(out, " {:>14}", f.name());
    }
    let _ = writeln!(out);
    let mut before: Option<&[(Family, u64)]> = None;
    for (id, now) in &turns {
        let _ = write!(out, "{id:<28}");
        for f in Family::ALL {
            let t = of(now, f);
            let cell = match before.map(|b| of(b, f)) {
                Some(b) if b != t => {
                    let sign = if t > b { "+" } else { "-" };
                    format!("{} {sign}{}", kilo(t), kilo(t.abs_diff(b)))
                }
                _ => kilo(t),
            };
            let _ = write!(out, " {cell:>14}");
        }
        let _ = writeln!(out);
        before = Some(now);
    }
    Ok(())
}

/// Prints the anatomy of `record`'s prompt as sent upstream: `text` (a table per
/// family, then each part) or `json`.
pub(super) fn print(record: &CaptureRecord, json: bool, out: &mut String) -> anyhow::Result<()> {
    let parts = parts_of(record)?;
    let total: u64 = parts.iter().map(|p| p.tokens).sum();
    // The provider's count of the whole input, when it gave one: each part's share of it.
    let input = record
        .usage
        .map(|u| u.input_tokens + u.cache_read_tokens + u.cache_write_tokens)
        .filter(|&n| n > 0);
    if json {
        let value = serde_json::json!({
            "id": record.id,
            "estimated_tokens": total,
            "provider_input_tokens": input,
            "families": by_family(&parts)
                .iter()
                .map(|(f, t)| serde_json::json!({"family": f, "tokens": t}))
                .collect::<Vec<_>>(),
            "parts": parts,
        });
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    let share = |t: u64| {
        if total == 0 {
            0.0
        } else {
            t as f64 * 100.0 / total as f64
        }
    };
    let scaled = |t: u64| input.map(|n| kilo(t * n / total.max(1)));
    let _ = writeln!(
        out,
        "{}  {} estimated tokens{}",
        record.id,
        kilo(total),
        input.map_or(String::new(), |n| format!(
            " ({} by the provider's count)",
            kilo(n)
        ))
    );
    for (family, tokens) in by_family(&parts) {
        let _ = writeln!(
            out,
            "  {:<13} {:>7}  {:>5.1} %{}",
            family.name(),
            kilo(tokens),
            share(tokens),
            scaled(tokens).map_or(String::new(), |k| format!("  ~{k} by the provider's count"))
        );
    }
    let _ = writeln!(out);
    for Part {
        family,
        name,
        unit,
        tokens,
        ..
    } in &parts
    {
        let _ = writeln!(
            out,
            "  {:<13} {:>7}  {:<28} {}",
            family.name(),
            kilo(*tokens),
            unit,
            crate::redact::cut(name, crate::redact::NAME_MAX)
        );
    }
    Ok(())
}

//! `promptgate captures anatomy`: each part of a request's prompt named by where it
//! came from, with its estimated tokens, its share and, given the provider's usage,
//! its share of the input.

use std::fmt::Write as _;

use crate::cache::anatomy::{Family, Part, by_family};
use crate::cache::explain::kilo;
use crate::capture::CaptureRecord;

/// The parts of `record`'s prompt as sent upstream.
fn parts_of(record: &CaptureRecord) -> anyhow::Result<Vec<Part>> {
    Ok(crate::capture::anatomy::parts_of(record)?)
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
/// family, then each part, with how the provider billed it and its dollars when
/// the record has its usage and price) or `json`.
pub(super) fn print(record: &CaptureRecord, json: bool, out: &mut String) -> anyhow::Result<()> {
    let a = crate::capture::anatomy::of(record)?;
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&a)?);
        return Ok(());
    }
    let total = a.estimated_tokens;
    let share = |t: u64| {
        if total == 0 {
            0.0
        } else {
            t as f64 * 100.0 / total as f64
        }
    };
    let scaled = |t: u64| a.provider_input_tokens.map(|n| kilo(t * n / total.max(1)));
    let _ = writeln!(
        out,
        "{}  {} estimated tokens{}{}",
        a.id,
        kilo(total),
        a.provider_input_tokens.map_or(String::new(), |n| format!(
            " ({} by the provider's count)",
            kilo(n)
        )),
        a.input_usd
            .map_or(String::new(), |d| format!(", input ${d:.4}"))
    );
    for f in &a.families {
        let _ = writeln!(
            out,
            "  {:<13} {:>7}  {:>5.1} %{}{}",
            f.family.name(),
            kilo(f.tokens),
            share(f.tokens),
            scaled(f.tokens).map_or(String::new(), |k| format!("  ~{k} by the provider's count")),
            f.usd.map_or(String::new(), |d| format!("  ${d:.4}"))
        );
    }
    let _ = writeln!(out);
    for p in &a.parts {
        // Where the provider billed it: read from the cache, written, or sent as is.
        let how = p.billed.map_or(String::new(), |b| {
            let kind = match (b.read, b.write, b.uncached) {
                _ if b.tokens == 0 => "-",
                (_, 0, 0) => "cached",
                (0, _, 0) => "written",
                (0, 0, _) => "uncached",
                _ => "split",
            };
            let usd = b.usd.map_or(String::new(), |u| format!(" ${u:.4}"));
            format!("{kind:<8}{usd:>9}  ")
        });
        let _ = writeln!(
            out,
            "  {:<13} {:>7}  {how}{:<28} {}",
            p.part.family.name(),
            kilo(p.part.tokens),
            p.part.unit,
            crate::redact::cut(&p.part.name, crate::redact::NAME_MAX)
        );
    }
    Ok(())
}

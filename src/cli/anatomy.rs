//! `promptgate captures anatomy`: each part of a request's prompt named by where it
//! came from, with its estimated tokens, its share and, given the provider's usage,
//! its share of the input.

use std::fmt::Write as _;

use crate::cache::anatomy::Family;
use crate::cache::explain::kilo;
use crate::capture::CaptureRecord;
use crate::capture::anatomy::FamilyTotal;

/// Tokens of `family` in a turn's families.
fn of(families: &[FamilyTotal], family: Family) -> u64 {
    families
        .iter()
        .find(|f| f.family == family)
        .map_or(0, |f| f.tokens)
}

/// Prints a conversation's turns, oldest first: tokens per family per turn (by
/// the provider's count where it gave one) and the change from the turn before,
/// then each family's dollars over the conversation (`text`), or the same as `json`.
pub(super) fn print_conversation(
    key: &str,
    records: &[CaptureRecord],
    json: bool,
    out: &mut String,
) -> anyhow::Result<()> {
    if records.is_empty() {
        anyhow::bail!("no model call of conversation {key:?} in the store");
    }
    let c = crate::capture::anatomy::conversation(key, records);
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&c)?);
        return Ok(());
    }
    // A turn that cannot be read (no body kept) is skipped and named.
    for why in &c.skipped {
        let _ = writeln!(out, "skipped: {why}");
    }
    let _ = write!(out, "{:<28}", "TURN");
    for f in Family::ALL {
        let _ = write!(out, " {:>14}", f.name());
    }
    let _ = writeln!(out);
    let mut before: Option<&[FamilyTotal]> = None;
    for t in &c.turns {
        let _ = write!(out, "{:<28}", t.id);
        for f in Family::ALL {
            let n = of(&t.families, f);
            let cell = match before.map(|b| of(b, f)) {
                Some(b) if b != n => {
                    let sign = if n > b { "+" } else { "-" };
                    format!("{} {sign}{}", kilo(n), kilo(n.abs_diff(b)))
                }
                _ => kilo(n),
            };
            let _ = write!(out, " {cell:>14}");
        }
        let _ = writeln!(out);
        before = Some(&t.families);
    }
    if c.families.iter().any(|f| f.usd.is_some()) {
        let _ = write!(out, "{:<28}", "INPUT $");
        for f in Family::ALL {
            let usd = c
                .families
                .iter()
                .find(|t| t.family == f)
                .and_then(|t| t.usd)
                .map_or("-".to_owned(), |u| format!("${u:.4}"));
            let _ = write!(out, " {usd:>14}");
        }
        let _ = writeln!(out);
    }
    for m in &c.misses {
        let _ = writeln!(
            out,
            "{} changed: {} cache miss(es), ${:.4} lost ({})",
            m.family.name(),
            m.misses,
            m.lost_usd,
            m.turns.join(", ")
        );
    }
    advice(&c.advice, out);
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
        "{}  {}  {} estimated tokens{}{}",
        a.id,
        a.agent,
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
    advice(&a.advice, out);
    Ok(())
}

/// The advice lines, after a blank line, when there is any.
fn advice(advice: &[crate::capture::advice::Advice], out: &mut String) {
    if advice.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nadvice:");
    for a in advice {
        let _ = writeln!(out, "  - {}", a.text);
    }
}

//! `promptgate cache report`: per conversation, the timeline of cache verdicts and a
//! summary, read from the capture store alone (see `capture::cache_report`).

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use super::output::{print, print_text, render_table, store_config, warn_damaged};
use crate::cache::explain::{Reason, Verdict, kilo};
use crate::capture::StoreLocation;
use crate::capture::cache_report::{self, ConversationReport, Entry, Report};
use crate::capture::store::Filter;
use crate::capture::{Store, timestamp};

/// `promptgate cache` and its verbs.
#[derive(Debug, Args)]
pub(super) struct CacheArgs {
    #[command(subcommand)]
    verb: Verb,
}

#[derive(Debug, Subcommand)]
enum Verb {
    /// Per conversation: each request's verdict, tokens and reason, then the hit rate,
    /// dollars written, saved and lost by reason, and the units that change most often.
    Report(ReportArgs),
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// The capture store: a directory or a postgres:// URL [default: capture.dir or
    /// capture.url of --config, else the running serve's, else `captures` in the
    /// data directory].
    #[arg(long, value_name = "DIR|URL", value_parser = super::output::StoreLocationParser)]
    captures: Option<StoreLocation>,
    /// Config file whose capture.dir or capture.url and [cache] ignore list to use.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Only this conversation (a key or its start).
    #[arg(long, value_name = "KEY")]
    conversation: Option<String>,
    /// Only since this time: 30m, 2h, 7d, 2026-11-29, 2026-11-29T14:00Z (UTC).
    #[arg(long, value_name = "WHEN")]
    since: Option<String>,
    /// text (a table per conversation) or json (what the admin API serves).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

/// Runs a `cache` verb.
pub(super) fn run(args: CacheArgs) -> anyhow::Result<()> {
    let Verb::Report(args) = args.verb;
    let (dir, config) = store_config(args.captures, args.config)?;
    let since_ms = match &args.since {
        Some(s) => {
            Some(timestamp::parse_since(s, timestamp::now_ms()).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };
    let filter = Filter {
        since_ms,
        conversation: args.conversation,
        ..Filter::default()
    };
    let store = Store::open_read_only(&dir)?;
    let report = cache_report::build(&store, &filter, &config.cache.ignore)?;
    warn_damaged(&report.damaged);
    match args.format {
        Format::Json => {
            let mut text = serde_json::to_string_pretty(&report)?;
            text.push('\n');
            print(text.as_bytes())
        }
        Format::Text => print_text(&text(&report)),
    }
}

/// The report as tables and summaries, one block per conversation.
fn text(report: &Report) -> String {
    let mut out = String::new();
    for c in &report.conversations {
        conversation(c, &mut out);
        out.push('\n');
    }
    let analysed = report
        .conversations
        .iter()
        .filter(|c| !c.timeline.is_empty())
        .count();
    let _ = writeln!(
        out,
        "{} conversation(s), {analysed} with cache analysis",
        report.conversations.len()
    );
    if analysed > 1 {
        out.push_str("all conversations:\n");
        totals(&report.total, &mut out);
    }
    by_family(&report.by_family, &mut out);
    out
}

/// Where the prompts' tokens and input dollars went, by part of the prompt.
fn by_family(families: &[crate::capture::anatomy::FamilyTotal], out: &mut String) {
    let tokens: u64 = families.iter().map(|f| f.tokens).sum();
    if tokens == 0 {
        return;
    }
    let dollars: Option<f64> = families.iter().map(|f| f.usd).sum();
    out.push_str("by part of the prompt (captures anatomy):\n");
    for f in families {
        let share = f.tokens as f64 * 100.0 / tokens as f64;
        let cost = match (f.usd, dollars) {
            (Some(u), Some(all)) if all > 0.0 => {
                format!("  {} ({:.0} % of input)", usd(u), u * 100.0 / all)
            }
            (Some(u), _) => format!("  {}", usd(u)),
            (None, _) => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:<13} {:>7} tokens  {share:>5.1} %{cost}",
            f.family.name(),
            kilo(f.tokens)
        );
    }
}

fn conversation(c: &ConversationReport, out: &mut String) {
    let s = &c.summary;
    let _ = writeln!(
        out,
        "conversation {} — {} request(s), {} analysed",
        c.conversation, s.requests, s.analysed
    );
    if c.timeline.is_empty() {
        out.push_str("  (no cache analysis: no usage came back, or not a messages request)\n");
        return;
    }
    let mut table = vec![
        [
            "TIME (UTC)",
            "ID",
            "MODEL",
            "VERDICT",
            "READ",
            "WRITE",
            "UNCACHED",
            "LOST",
            "REASON",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for e in &c.timeline {
        table.push(row(e));
    }
    let mut rendered = String::new();
    render_table(
        &table,
        &[false, false, false, false, true, true, true, true, false],
        &mut rendered,
    );
    // The excerpts of a changed unit go under its row.
    let indent = " ".repeat(4);
    for (i, line) in rendered.lines().enumerate() {
        let _ = writeln!(out, "  {line}");
        let Some(entry) = i.checked_sub(1).map(|i| &c.timeline[i]) else {
            continue;
        };
        if let Some(Reason::PrefixChanged { before, after, .. }) = &entry.reason {
            if let Some(b) = before {
                let _ = writeln!(out, "  {indent}before {}", one_line(b));
            }
            if let Some(a) = after {
                let _ = writeln!(out, "  {indent}after  {}", one_line(a));
            }
        }
        if let Some(fix) = &entry.fix {
            let _ = writeln!(out, "  {indent}fix    {fix}");
        }
    }
    summary(c, out);
}

fn row(e: &Entry) -> Vec<String> {
    let verdict = match e.verdict {
        Verdict::Miss => "MISS",
        v => v.name(),
    };
    let lost = match (&e.cost, e.lost_tokens) {
        (_, 0) => "-".to_owned(),
        (Some(c), n) => format!("{} {}", kilo(n), usd(c.usd.lost_usd)),
        (None, n) => kilo(n),
    };
    vec![
        timestamp::short(e.started_ms),
        e.id.clone(),
        e.model.clone(),
        verdict.to_owned(),
        e.read.to_string(),
        e.write.to_string(),
        e.uncached.to_string(),
        lost,
        e.reason_text.clone().unwrap_or_else(|| "-".into()),
    ]
}

/// The hit rate, the dollars and the losses by reason.
fn totals(s: &crate::capture::cache_report::Summary, out: &mut String) {
    let prompt = s.read_tokens + s.write_tokens + s.uncached_tokens;
    let _ = writeln!(
        out,
        "  hit rate        {:.1} % of prompt tokens read from the cache ({} of {}; {} written, {} uncached)",
        s.hit_rate * 100.0,
        kilo(s.read_tokens),
        kilo(prompt),
        kilo(s.write_tokens),
        kilo(s.uncached_tokens)
    );
    if s.priced {
        let _ = writeln!(
            out,
            "  total           {} (input {}, output {})",
            usd(s.total_usd),
            usd(s.input_usd),
            usd(s.output_usd)
        );
        let _ = writeln!(out, "  cache writes    {}", usd(s.write_usd));
        let _ = writeln!(out, "  cache reads     {}", usd(s.read_usd));
        let _ = writeln!(
            out,
            "  saved by reads  {} (against sending those tokens uncached)",
            usd(s.saved_usd)
        );
        let _ = writeln!(out, "  lost to misses  {}", usd(s.lost_usd));
    }
    if !s.unpriced.is_empty() {
        let first = &s.unpriced[0];
        let _ = writeln!(
            out,
            "  cost unknown    for {} (no price{}; add one: [cache.prices.\"{first}\"] input = …)",
            s.unpriced.join(", "),
            if s.priced {
                ", left out of the sums above"
            } else {
                ""
            }
        );
    }
    if s.provider_agrees + s.provider_disagrees > 0 {
        let _ = writeln!(
            out,
            "  provider says   agrees on {} miss(es), disagrees on {}",
            s.provider_agrees, s.provider_disagrees
        );
    }
    for l in &s.lost {
        let _ = writeln!(
            out,
            "    {:<18} {:>3} request(s)  {:>7} tokens  {}",
            l.reason,
            l.requests,
            kilo(l.tokens),
            if s.priced {
                usd(l.usd)
            } else {
                "unknown".into()
            }
        );
    }
}

fn summary(c: &ConversationReport, out: &mut String) {
    let s = &c.summary;
    totals(s, out);
    if s.compared == 0 {
        return;
    }
    if s.changed_units.is_empty() {
        let _ = writeln!(
            out,
            "  changed units   none in {} request(s) compared with the one before",
            s.compared
        );
        return;
    }
    let _ = writeln!(
        out,
        "  changed most often (in {} request(s) compared with the one before):",
        s.compared
    );
    for u in &s.changed_units {
        let _ = writeln!(
            out,
            "    {:<24} {:>3} of {}{}",
            u.unit,
            u.changed,
            u.of,
            if u.ignored {
                "  (left out of the prefix hash)"
            } else {
                ""
            }
        );
    }
}

fn usd(v: f64) -> String {
    format!("${v:.4}")
}

/// An excerpt on one line (it is JSON text, quotes and all; `…` marks a cut).
fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Lines for `captures show`: the verdict, prediction against usage, breakpoints,
/// the excerpt of a changed unit, cost and estimate.
pub(super) fn show_lines(store: &Store, record: &crate::capture::CaptureRecord, out: &mut String) {
    let Some(r) = &record.cache else {
        out.push_str("  cache         -\n");
        return;
    };
    let pad = " ".repeat(16);
    let _ = writeln!(out, "  cache         {}", r.log_field());
    let _ = writeln!(
        out,
        "{pad}predicted read {} write {}; provider read {} write {}, uncached {}",
        r.prediction.read_tokens,
        r.prediction.write_tokens,
        r.actual.read,
        r.actual.write,
        r.actual.input
    );
    if !r.breakpoints.is_empty() {
        let list: Vec<String> = r
            .breakpoints
            .iter()
            .map(|b| {
                let auto = if b.automatic { ", automatic" } else { "" };
                format!("{} ({}{auto})", b.unit, b.ttl)
            })
            .collect();
        let _ = writeln!(out, "{pad}breakpoints {}", list.join(", "));
    }
    if let Some(b) = &r.baseline {
        let _ = writeln!(out, "{pad}compared with {b}");
    }
    let entry = cache_report::entry(store, record);
    if let Some(Reason::PrefixChanged { before, after, .. }) =
        entry.as_ref().and_then(|e| e.reason.as_ref())
    {
        if let Some(b) = before {
            let _ = writeln!(out, "{pad}before {}", one_line(b));
        }
        if let Some(a) = after {
            let _ = writeln!(out, "{pad}after  {}", one_line(a));
        }
    }
    if let Some(fix) = &r.fix {
        let _ = writeln!(out, "{pad}fix: {fix}");
    }
    if let Some(p) = &r.provider_says {
        let tokens = p
            .missed_tokens
            .map(|n| format!(" ({n} tokens missed)"))
            .unwrap_or_default();
        let judged = match (p.agrees, &p.note) {
            (Some(true), _) => ": agrees".to_owned(),
            (Some(false), Some(note)) => format!(": disagrees, {note}"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "{pad}provider says {}{tokens}{judged}",
            one_line(&p.reason)
        );
    }
    if !r.respelled.is_empty() {
        let _ = writeln!(
            out,
            "{pad}re-spelled {} (other bytes, the same JSON value: compared as values, as the provider does)",
            r.respelled.join(", ")
        );
    }
    if let Some(c) = &r.cost {
        let _ = writeln!(
            out,
            "{pad}total {} (input {}, output {})",
            usd(c.usd.total_usd),
            usd(c.usd.input_usd),
            usd(c.usd.output_usd)
        );
        let _ = writeln!(
            out,
            "{pad}cost {} written, {} read, {} saved, {} lost ({} tokens; price {})",
            usd(c.usd.write_usd),
            usd(c.usd.read_usd),
            usd(c.usd.saved_usd),
            usd(c.usd.lost_usd),
            r.lost_tokens,
            c.price
        );
    }
    let _ = writeln!(
        out,
        "{pad}estimate {} tokens, provider {} ({:+.1} %)",
        r.estimate.tokens, r.estimate.actual, r.estimate.error_pct
    );
}

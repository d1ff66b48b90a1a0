//! `promptgate replay --rules DIR`: a candidate rule set over captured requests,
//! offline; the report as a table or JSON, and `--fail-on` to gate a CI job.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;

use super::captures::{FilterArgs, diff_lines};
use super::output::{print, print_text, render_table, store_config, warn_damaged};
use crate::capture::Store;
use crate::capture::StoreLocation;
use crate::replay::{self, Condition, ReplaySettings, Report};
use crate::rules::RuleSet;

/// `promptgate replay`
#[derive(Debug, Args)]
pub(super) struct ReplayArgs {
    /// The candidate rules directory.
    #[arg(long, value_name = "DIR")]
    rules: PathBuf,
    #[command(flatten)]
    filter: FilterArgs,
    /// The capture store: a directory or a postgres:// URL [default: capture.dir or
    /// capture.url of --config, else the running serve's, else `captures` in the
    /// data directory].
    #[arg(long, value_name = "DIR|URL", value_parser = super::output::StoreLocationParser)]
    captures: Option<StoreLocation>,
    /// Config file whose capture.dir or capture.url, [cache] prices and conversation settings to use.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Also print each request's received → replayed diff.
    #[arg(long)]
    each: bool,
    /// text (a readable report, the default) or json.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    format: String,
    /// Exit 1 when this holds: NAME OP NUMBER, NAME one of blocked, changed,
    /// cost_delta (dollars), tokens_delta; OP one of >, >=, <, <=, ==. Repeatable.
    /// Quote it in a shell: --fail-on 'blocked>0'.
    #[arg(long = "fail-on", value_name = "CONDITION")]
    fail_on: Vec<String>,
}

/// Runs the replay; exit 1 when a `--fail-on` condition holds.
pub(super) fn run(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let conditions = args
        .fail_on
        .iter()
        .map(|c| Condition::parse(c))
        .collect::<Result<Vec<_>, _>>()?;
    if !matches!(args.format.as_str(), "text" | "json") {
        bail!("--format {:?}: expected text or json", args.format);
    }
    let rules = RuleSet::load_dir(&args.rules)
        .map(std::sync::Arc::new)
        .map_err(|errors| {
            let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
            anyhow::anyhow!(
                "the candidate rules in {} do not load:\n{}",
                args.rules.display(),
                lines.join("\n")
            )
        })?;
    let (dir, config) = store_config(args.captures, args.config)?;
    let store =
        Store::open_read_only(&dir).with_context(|| format!("opening the capture store {dir}"))?;
    let settings = ReplaySettings {
        cache: config.cache.clone(),
        conversation: config.conversation.clone(),
        each: args.each,
    };
    let report = replay::replay(&store, &args.filter.filter()?, &rules, &settings)?;
    warn_damaged(&report.damaged);
    let mut out = String::new();
    if args.format == "json" {
        out = serde_json::to_string_pretty(&report)?;
        out.push('\n');
    } else {
        render(&report, &args.rules, &mut out);
    }
    let held: Vec<&Condition> = conditions.iter().filter(|c| c.holds(&report)).collect();
    if args.format == "text" && !conditions.is_empty() {
        let _ = writeln!(out);
        for c in &conditions {
            let verdict = if held.contains(&c) {
                "holds"
            } else {
                "does not hold"
            };
            let _ = writeln!(out, "--fail-on {c}: {verdict}");
        }
    }
    if args.format == "json" {
        print(out.as_bytes())?;
    } else {
        print_text(&out)?;
    }
    Ok(if held.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Dollars with cents, or to a hundredth of a cent below $10 (a replay of a few
/// requests moves fractions of a cent).
fn dollars(d: f64) -> String {
    let sign = if d < 0.0 { "-" } else { "" };
    match d.abs() {
        a if a >= 10.0 => format!("{sign}${a:.2}"),
        a => format!("{sign}${a:.4}"),
    }
}

fn signed_dollars(d: f64) -> String {
    if d >= 0.0 {
        format!("+{}", dollars(d))
    } else {
        dollars(d)
    }
}

fn render(r: &Report, dir: &std::path::Path, out: &mut String) {
    let _ = writeln!(
        out,
        "replay of {} through {}: {} model requests replayed, {} matched, {} changed, {} blocked \
         (bytes +{} / -{}; {} breakpoint-limit adjustments)",
        r.selected,
        dir.display(),
        r.replayed,
        r.matched,
        r.changed,
        r.blocked,
        r.bytes_added,
        r.bytes_removed,
        r.breakpoint_adjustments
    );
    for (why, n) in &r.skipped {
        let _ = writeln!(out, "  skipped {n}: {why}");
    }
    out.push_str(
        "  the rules saw the requests as captured: secrets were redacted before they saw them\n",
    );
    render_rules(r, out);
    render_cache(r, out);
    render_movers(r, out);
    render_trust(r, out);
    render_each(r, out);
}

/// Per rule: what it matched, changed and blocked, and what it cost; what never fired and what was blocked.
fn render_rules(r: &Report, out: &mut String) {
    out.push_str("\nper rule:\n");
    let mut rows = vec![
        [
            "rule",
            "phase",
            "matched",
            "changed",
            "blocked",
            "cost Δ",
            "most changed",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for e in &r.rules {
        let top: Vec<String> = e
            .pointers
            .iter()
            .take(3)
            .map(|(p, n)| format!("{p} ×{n}"))
            .collect();
        rows.push(vec![
            e.rule.clone(),
            e.phase.clone(),
            e.matched.to_string(),
            e.changed.to_string(),
            e.blocked.to_string(),
            if e.changed > 0 {
                signed_dollars(e.cost_delta)
            } else {
                "-".into()
            },
            top.join(", "),
        ]);
    }
    render_table(&rows, &[false, false, true, true, true, true, false], out);
    if !r.never_fired.is_empty() {
        let _ = writeln!(out, "never fired: {}", r.never_fired.join(", "));
    }
    if !r.blocks.is_empty() {
        out.push_str("\nblocked (what the client would have been told):\n");
        for b in &r.blocks {
            let _ = writeln!(
                out,
                "  {}  {} {}  (rule {})",
                b.id, b.status, b.message, b.rule
            );
        }
        if r.blocked > r.blocks.len() {
            let _ = writeln!(out, "  … and {} more", r.blocked - r.blocks.len());
        }
    }
}

/// The prompt-caching figures, baseline against candidate, per conversation.
fn render_cache(r: &Report, out: &mut String) {
    out.push_str("\nprompt caching (baseline: what the provider reported; candidate: predicted for the replayed requests):\n");
    let mut rows = vec![
        [
            "conversation",
            "requests",
            "read",
            "write",
            "uncached",
            "cost",
            "candidate read",
            "write",
            "uncached",
            "cost",
            "Δ",
        ]
        .map(String::from)
        .to_vec(),
    ];
    let line = |name: &str, requests: usize, b: &replay::Tokens, c: &replay::Tokens| {
        vec![
            name.to_owned(),
            requests.to_string(),
            b.read.to_string(),
            b.write.to_string(),
            b.uncached.to_string(),
            dollars(b.dollars),
            c.read.to_string(),
            c.write.to_string(),
            c.uncached.to_string(),
            dollars(c.dollars),
            signed_dollars(c.dollars - b.dollars),
        ]
    };
    let mut by_change: Vec<&replay::ConversationImpact> = r.conversations.iter().collect();
    by_change.sort_by(|a, b| b.cost_delta().abs().total_cmp(&a.cost_delta().abs()));
    for c in by_change.iter().take(20) {
        rows.push(line(&c.conversation, c.requests, &c.baseline, &c.candidate));
    }
    let requests = r.conversations.iter().map(|c| c.requests).sum();
    rows.push(line("total", requests, &r.baseline, &r.candidate));
    render_table(
        &rows,
        &[
            false, true, true, true, true, true, true, true, true, true, true,
        ],
        out,
    );
    if r.conversations.len() > 20 {
        let _ = writeln!(
            out,
            "({} conversations; the 20 that change most are shown)",
            r.conversations.len()
        );
    }
    if r.cache_excluded > 0 {
        let _ = writeln!(
            out,
            "left out of the cache figures: {} (blocked by the candidate, or no usage reported)",
            r.cache_excluded
        );
    }
    let _ = writeln!(
        out,
        "candidate − baseline: {} tokens of input, {}",
        r.tokens_delta,
        signed_dollars(r.cost_delta)
    );
}

/// The rules that changed most, by cost.
fn render_movers(r: &Report, out: &mut String) {
    out.push_str("\nlargest changes:\n");
    let mut movers: Vec<&replay::RuleEffect> = r.rules.iter().filter(|e| e.changed > 0).collect();
    movers.sort_by(|a, b| b.cost_delta.abs().total_cmp(&a.cost_delta.abs()));
    if movers.is_empty() {
        out.push_str("  none: no rule changed a request\n");
    }
    for e in movers.iter().take(5) {
        let top: Vec<&str> = e.pointers.iter().take(2).map(|(p, _)| p.as_str()).collect();
        let what = if top.is_empty() {
            String::new()
        } else {
            format!(" at {}", top.join(" and "))
        };
        let _ = writeln!(
            out,
            "  {}{}: changes {} request(s) in {} conversation(s){what}: {}",
            e.rule,
            e.description
                .as_deref()
                .map_or_else(String::new, |d| format!(" — {d}")),
            e.changed,
            e.conversations,
            signed_dollars(e.cost_delta)
        );
    }
}

/// How far the figures can be trusted: the analysis' prediction on the requests as sent, against what was reported.
fn render_trust(r: &Report, out: &mut String) {
    let b = &r.baseline;
    let p = &r.baseline_predicted;
    let pct = |pred: u64, actual: u64| {
        if actual == 0 {
            if pred == 0 { "0%".into() } else { "n/a".into() }
        } else {
            format!(
                "{:+.1}%",
                (pred as f64 - actual as f64) / actual as f64 * 100.0
            )
        }
    };
    let _ = writeln!(
        out,
        "\nhow far to trust it: on the requests as sent, the analysis predicts {} read \
         ({} of the {} reported) and {} written ({} of {}), {} against {}",
        p.read,
        pct(p.read, b.read),
        b.read,
        p.write,
        pct(p.write, b.write),
        b.write,
        dollars(p.dollars),
        dollars(b.dollars)
    );
}

/// Each request's rules and diff (`--each`).
fn render_each(r: &Report, out: &mut String) {
    if !r.each.is_empty() {
        out.push_str("\neach request:\n");
        for e in &r.each {
            let _ = writeln!(
                out,
                "{}  {}  rules: {}{}  bytes {:+}",
                e.id,
                e.conversation.as_deref().unwrap_or("-"),
                if e.rules.is_empty() {
                    "none".into()
                } else {
                    e.rules.join(", ")
                },
                if e.blocked { "  BLOCKED" } else { "" },
                e.bytes_delta
            );
            diff_lines(&e.diff, out);
            if let Some(err) = &e.diff_error {
                let _ = writeln!(out, "  {err}");
            }
        }
    }
}

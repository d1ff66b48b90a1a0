//! `promptgate captures …`: list, show, diff, export and conversations, read from the
//! store in `--captures DIR` (the same default as `serve`).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::Value;

use crate::capture::StoreLocation;
use crate::capture::record::{BodyInfo, CaptureRecord};
use crate::capture::store::{Filter, Row};
use crate::capture::units::{self, Change, DiffEntry};
use crate::capture::{Store, timestamp};
use crate::prompt::{Prompt, PromptView, UnitView};

use super::output::{page_text, print, print_text, render_table, store_config, warn_damaged};

/// `promptgate captures` and its verbs.
#[derive(Debug, Args)]
pub(super) struct CapturesArgs {
    #[command(subcommand)]
    verb: Verb,
    /// The capture store: a directory or a postgres:// URL [default: capture.dir or
    /// capture.url of --config, else the running serve's, else `captures` in the
    /// data directory].
    #[arg(long, value_name = "DIR|URL", value_parser = super::output::StoreLocationParser, global = true)]
    captures: Option<StoreLocation>,
    /// Config file whose capture.dir or capture.url to read.
    #[arg(long, value_name = "FILE", global = true)]
    config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Verb {
    /// One line per exchange: time, id, conversation, model, status, outcome, tokens,
    /// rules. Side requests are hidden unless --all.
    List(ListArgs),
    /// Follows the store like `tail -f`: the last few exchanges, then one line per
    /// exchange as its record lands, until Ctrl-C. The filters of `list`.
    Tail(ListArgs),
    /// One exchange, readable: system blocks, messages, tools, usage, rules.
    Show(ShowArgs),
    /// What changed between two requests, in the provider's cache order.
    Diff(DiffArgs),
    /// Each part of a request's prompt named by where it came from (system, tools by
    /// kind and MCP server, memory files, context, reminders, conversation), with its
    /// estimated tokens and share.
    Anatomy(AnatomyArgs),
    /// Every matching exchange as JSONL or HAR 1.2.
    Export(ExportArgs),
    /// One line per conversation: requests, tokens, first and last time.
    Conversations(FilterArgs),
}

/// Which exchanges.
#[derive(Debug, Args, Default)]
pub(super) struct FilterArgs {
    /// Only since this time: 30m, 2h, 7d, 2026-11-29, 2026-11-29T14:00Z (UTC).
    #[arg(long, value_name = "WHEN")]
    since: Option<String>,
    /// Only before this time (the same forms as --since).
    #[arg(long, value_name = "WHEN")]
    until: Option<String>,
    /// Only this model (`*` matches anything, e.g. claude-opus-*).
    #[arg(long, value_name = "MODEL")]
    model: Option<String>,
    /// Only this conversation (a key or its start).
    #[arg(long, value_name = "KEY")]
    conversation: Option<String>,
    /// Only this outcome: ok, provider_error, blocked, no_route, too_large, bad_request,
    /// upstream_error, client_cancelled, shutdown, capture_unavailable.
    #[arg(long, value_name = "OUTCOME")]
    outcome: Option<String>,
    /// Only exchanges whose record or bodies contain this text.
    #[arg(long, value_name = "TEXT")]
    grep: Option<String>,
    /// At most this many (the most recent).
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Skip this many of the most recent first (a next page, with --limit).
    #[arg(long, value_name = "N")]
    offset: Option<usize>,
    /// Only this provider: anthropic or openai.
    #[arg(long, value_name = "PROVIDER")]
    provider: Option<String>,
    /// Only exchanges this rule fired on.
    #[arg(long, value_name = "NAME")]
    rule: Option<String>,
    /// Only this cache verdict: hit, partial, miss, write, none, unexplained.
    #[arg(long, value_name = "VERDICT")]
    verdict: Option<String>,
    /// Only exchanges with this tag.
    #[arg(long, value_name = "TAG")]
    tag: Option<String>,
    /// Only this path (`*` matches anything; without `?` the query is ignored).
    #[arg(long, value_name = "PATH")]
    path: Option<String>,
    /// Only this mode: reverse or forward.
    #[arg(long, value_name = "MODE", value_parser = ["reverse", "forward"])]
    mode: Option<String>,
}

/// `captures list` and `captures tail`: the filters, and whether side requests show.
#[derive(Debug, Args)]
struct ListArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Show side requests too (count_tokens, other paths, HEAD checks: anything but
    /// a model call); they are hidden by default.
    #[arg(long)]
    all: bool,
}

impl ListArgs {
    fn filter(&self) -> anyhow::Result<Filter> {
        let mut f = self.filter.filter()?;
        f.side = (!self.all).then_some(false);
        Ok(f)
    }
}

impl FilterArgs {
    pub(super) fn filter(&self) -> anyhow::Result<Filter> {
        let when = |text: &Option<String>| -> anyhow::Result<Option<u64>> {
            text.as_deref()
                .map(|s| timestamp::parse_since(s, timestamp::now_ms()).map_err(anyhow::Error::msg))
                .transpose()
        };
        Ok(Filter {
            since_ms: when(&self.since)?,
            until_ms: when(&self.until)?,
            model: self.model.clone(),
            conversation: self.conversation.clone(),
            outcome: self.outcome.clone(),
            grep: self.grep.clone(),
            limit: self.limit,
            offset: self.offset,
            provider: self.provider.clone(),
            rule: self.rule.clone(),
            verdict: self.verdict.clone(),
            tag: self.tag.clone(),
            path: self.path.clone(),
            mode: self.mode.clone(),
            side: None,
            after_seq: None,
        })
    }
}

#[derive(Debug, Args)]
struct ShowArgs {
    /// The exchange id (or its start; unique), `last`, or `@-1`, `@-2`… for the ones before it.
    id: String,
    /// The redacted record as JSON, bodies included; with --sent/--received, that body's bytes.
    #[arg(long)]
    raw: bool,
    /// Show the request as sent upstream, after rules (the default, as in the viewer).
    #[arg(long, conflicts_with = "received")]
    sent: bool,
    /// Show the request as received from the client, before rules.
    #[arg(long)]
    received: bool,
    /// Summarise the prompt (blocks by type and size) instead of printing it whole.
    #[arg(long)]
    summary: bool,
}

#[derive(Debug, Args)]
struct AnatomyArgs {
    /// The exchange id (or its start; unique), `last`, or `@-1`, `@-2`…
    #[arg(required_unless_present = "conversation")]
    id: Option<String>,
    /// Every model call of this conversation (a key or its start), oldest first:
    /// tokens per family per turn, and what each family added or dropped.
    #[arg(long, value_name = "KEY", conflicts_with = "id")]
    conversation: Option<String>,
    /// text (a table) or json.
    #[arg(long, value_name = "FORMAT", default_value = "text", value_parser = ["text", "json"])]
    format: String,
}

#[derive(Debug, Args)]
struct DiffArgs {
    /// The earlier exchange (an id, its start, `last` or `@-N`); alone, the later
    /// one, compared with the request before it in its conversation.
    a: String,
    /// The later exchange (an id, its start, `last` or `@-N`).
    b: Option<String>,
    /// Compare the requests as received instead of as sent upstream.
    #[arg(long)]
    received: bool,
}

#[derive(Debug, Args)]
struct ExportArgs {
    /// jsonl (one whole record per line) or har (HAR 1.2).
    #[arg(long, value_name = "FORMAT", default_value = "jsonl")]
    format: String,
    /// Write here instead of standard output.
    #[arg(long, short, value_name = "FILE")]
    output: Option<PathBuf>,
    #[command(flatten)]
    filter: FilterArgs,
}

/// Runs a `captures` verb.
pub(super) fn run(args: CapturesArgs) -> anyhow::Result<()> {
    let (dir, _) = store_config(args.captures, args.config)?;
    let store = Store::open_read_only(&dir)?;
    let mut out = String::new();
    match args.verb {
        Verb::List(l) => list(&store, &l.filter()?, &mut out)?,
        Verb::Tail(l) => return tail(&store, l.filter()?),
        Verb::Show(s) => {
            let record = store.load(&s.id)?;
            if s.raw {
                return raw(record, &s);
            }
            show(&store, &record, &s, &mut out);
            return page_text(&out);
        }
        Verb::Diff(d) => {
            let (a, b) = match &d.b {
                Some(b) => (store.load(&d.a)?, store.load(b)?),
                None => {
                    let later = store.load(&d.a)?;
                    let Some(earlier) = store.previous_in_conversation(&later.id)? else {
                        anyhow::bail!(
                            "{} is the first request of its conversation (or has none): name the exchange to compare it with",
                            later.id
                        );
                    };
                    (store.load(&earlier)?, later)
                }
            };
            diff(&a, &b, d.received, &mut out)?;
        }
        Verb::Anatomy(a) => match (&a.id, &a.conversation) {
            (Some(id), _) => {
                let record = store.load(id)?;
                super::anatomy::print(&record, a.format == "json", &mut out)?;
            }
            (None, Some(key)) => {
                let (_, records) = crate::capture::anatomy::conversation_records(&store, key)?;
                super::anatomy::print_conversation(key, &records, a.format == "json", &mut out)?;
            }
            (None, None) => {
                anyhow::bail!("name an exchange, or a conversation with --conversation")
            }
        },
        Verb::Export(e) => return export(&store, &e),
        Verb::Conversations(f) => conversations(&store, &f.filter()?, &mut out)?,
    }
    print_text(&out)
}

// === list, conversations ===

/// The columns of `list` and `tail`.
const LIST_COLUMNS: [&str; 13] = [
    "TIME (UTC)",
    "ID",
    "CONVERSATION",
    "MODEL",
    "STATUS",
    "OUTCOME",
    "IN",
    "OUT",
    "CACHE_R",
    "CACHE_W",
    "COST",
    "CACHE",
    "RULES",
];

fn list(store: &Store, filter: &Filter, out: &mut String) -> anyhow::Result<()> {
    let rows = store.list(filter)?;
    let mut table = vec![LIST_COLUMNS.map(str::to_owned).to_vec()];
    for r in &rows {
        table.push(row_cells(r));
    }
    render_table(
        &table,
        &[
            false, false, false, false, true, false, true, true, true, true, true, false, false,
        ],
        out,
    );
    let _ = writeln!(out, "{} exchange(s)", rows.len());
    if filter.side == Some(false) && filter.grep.is_none() {
        let hidden = store.count(&Filter {
            side: Some(true),
            ..filter.clone()
        })?;
        if hidden > 0 {
            let _ = writeln!(
                out,
                "{hidden} side request(s) hidden (count_tokens, other paths, HEAD): --all shows them"
            );
        }
    }
    Ok(())
}

/// How often `tail` looks for new records.
const TAIL_POLL: std::time::Duration = std::time::Duration::from_millis(250);

fn tail(store: &Store, filter: Filter) -> anyhow::Result<()> {
    const WIDTHS: [usize; 13] = [19, 26, 28, 20, 6, 16, 7, 5, 7, 7, 8, 20, 0];
    let line = |cells: &[String]| {
        let mut text = String::new();
        for (cell, width) in cells.iter().zip(WIDTHS) {
            let _ = write!(text, "{cell:<width$}  ");
        }
        text.trim_end().to_owned() + "\n"
    };
    let head = LIST_COLUMNS.map(str::to_owned).to_vec();
    print_text(&line(&head))?;
    let first = Filter {
        limit: Some(filter.limit.unwrap_or(10)),
        ..filter.clone()
    };
    let mut rows = store.list(&first)?;
    let mut after = None;
    loop {
        rows.sort_by_key(|r| r.seq);
        for r in &rows {
            print_text(&line(&row_cells(r)))?;
            after = Some(r.seq);
        }
        std::thread::sleep(TAIL_POLL);
        rows = store.list(&Filter {
            after_seq: after.or(Some(0)),
            limit: None,
            offset: None,
            ..filter.clone()
        })?;
    }
}

/// A cost as the listings print it: `$0.0123`, `-` when nothing priced it.
fn dollars(usd: Option<f64>) -> String {
    usd.map_or_else(|| "-".into(), |u| format!("${u:.4}"))
}

fn row_cells(r: &Row) -> Vec<String> {
    let n = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
    vec![
        timestamp::short(r.started_ms),
        r.id.clone(),
        cut(r.conversation.as_deref().unwrap_or("-"), 28),
        r.model.clone().unwrap_or_else(|| "-".into()),
        r.status.map_or("-".into(), |s| s.to_string()),
        r.outcome.clone(),
        n(r.input_tokens),
        n(r.output_tokens),
        n(r.cache_read_tokens),
        n(r.cache_write_tokens),
        dollars(r.cost_usd),
        cut(r.cache.as_deref().unwrap_or("-"), 28),
        if r.rules.is_empty() {
            "-".into()
        } else {
            r.rules.join(",")
        },
    ]
}

fn conversations(store: &Store, filter: &Filter, out: &mut String) -> anyhow::Result<()> {
    let rows = store.conversations(filter)?;
    let mut table = vec![
        [
            "CONVERSATION",
            "REQUESTS",
            "MODELS",
            "IN",
            "OUT",
            "CACHE_R",
            "CACHE_W",
            "COST",
            "FIRST (UTC)",
            "LAST (UTC)",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for c in &rows {
        table.push(vec![
            c.conversation.clone().unwrap_or_else(|| "-".into()),
            c.requests.to_string(),
            c.models.join(","),
            c.input_tokens.to_string(),
            c.output_tokens.to_string(),
            c.cache_read_tokens.to_string(),
            c.cache_write_tokens.to_string(),
            dollars(c.cost_usd),
            timestamp::short(c.first_ms),
            timestamp::short(c.last_ms),
        ]);
    }
    render_table(
        &table,
        &[
            false, true, false, true, true, true, true, true, false, false,
        ],
        out,
    );
    let _ = writeln!(out, "{} conversation(s)", rows.len());
    Ok(())
}

// === show ===

fn raw(mut record: CaptureRecord, args: &ShowArgs) -> anyhow::Result<()> {
    if args.sent || args.received {
        let body = if args.sent {
            record.sent()
        } else {
            &record.request.body
        };
        return print(&body.bytes);
    }
    record.with_contents();
    let mut text = serde_json::to_string_pretty(&record)?;
    text.push('\n');
    print(text.as_bytes())
}

fn show(store: &Store, r: &CaptureRecord, args: &ShowArgs, out: &mut String) {
    // What the provider read is what the viewer shows: the default here too.
    let sent = !args.received;
    show_facts(store, r, out);
    if !r.captured {
        out.push_str(
            "\n(a rule turned capture off for this exchange: headers and bodies were not kept)\n",
        );
        return;
    }
    show_request(r, args, sent, out);
    show_response(r, out);
    show_headers(r, sent, out);
}

/// The exchange's facts: time, route, model, outcome, usage, cache, policies, digests.
fn show_facts(store: &Store, r: &CaptureRecord, out: &mut String) {
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1} ms"));
    let _ = writeln!(out, "capture {}", r.id);
    let _ = writeln!(
        out,
        "  time          {} (upstream head {}, first byte {}, total {})",
        r.started_at,
        ms(r.times.upstream_headers_ms),
        ms(r.times.first_byte_ms),
        ms(Some(r.times.total_ms))
    );
    let _ = writeln!(
        out,
        "  request       {} {} from {} ({} mode, host {})",
        r.method,
        r.path,
        r.client.as_deref().unwrap_or("?"),
        r.mode,
        r.host.as_deref().unwrap_or("-")
    );
    let _ = writeln!(
        out,
        "  upstream      {} {} {}",
        r.provider.as_deref().unwrap_or("-"),
        r.api.as_deref().unwrap_or("-"),
        r.upstream_url.as_deref().unwrap_or("(not contacted)")
    );
    let _ = writeln!(out, "  model         {}", r.model.as_deref().unwrap_or("-"));
    let _ = writeln!(
        out,
        "  conversation  {}",
        r.conversation.as_deref().unwrap_or("-")
    );
    let status = r
        .response
        .status
        .map_or("no status".into(), |s| format!("status {s}"));
    let _ = writeln!(out, "  outcome       {}, {status}", r.outcome);
    if let Some(e) = &r.error {
        let _ = writeln!(out, "  error         {e}");
    }
    if let Some(first) = &r.repeat_of {
        let _ = writeln!(
            out,
            "  repeat of     {first} (the client sent this blocked request again)"
        );
    }
    if let Some(ws) = &r.websocket {
        let whole = match (&ws.missing, ws.recovered_from.len()) {
            (Some(why), _) => format!("the prompt below is the message's only: {why}"),
            (None, 0) => "the prompt below is the message's own".to_owned(),
            (None, n) => format!(
                "the prompt below is put back together from {n} earlier turn(s): {}",
                ws.recovered_from.join(", ")
            ),
        };
        let _ = writeln!(
            out,
            "  websocket     a turn of socket {} ({} bytes as sent); {whole}",
            ws.socket, ws.frame.size
        );
    }
    match &r.usage {
        Some(u) => {
            let _ = writeln!(
                out,
                "  usage         input {}, output {}, cache read {}, cache write {}",
                u.input_tokens, u.output_tokens, u.cache_read_tokens, u.cache_write_tokens
            );
        }
        None => out.push_str("  usage         -\n"),
    }
    super::cache::show_lines(store, r, out);
    show_policy_lines(r, out);
}

/// What policy did (rules, each policy's turn, findings, tags, edits, redactions)
/// and the bodies' digests.
fn show_policy_lines(r: &CaptureRecord, out: &mut String) {
    let list = |v: &[String]| {
        if v.is_empty() {
            "(none)".to_owned()
        } else {
            v.join(", ")
        }
    };
    let _ = writeln!(out, "  rules         {}", list(&r.rules_fired));
    // Each policy's turn, as the exchange's driver ran them: who, where, what, how long.
    if !r.policies.is_empty() {
        let turns: Vec<String> = r
            .policies
            .iter()
            .map(|t| {
                format!(
                    "{} {} {} {}µs",
                    t.policy,
                    t.phase.name(),
                    t.decision,
                    t.took_us
                )
            })
            .collect();
        let _ = writeln!(out, "  policies      {}", turns.join(", "));
    }
    if !r.findings.is_empty() {
        let found: Vec<String> = r
            .findings
            .iter()
            .map(|f| {
                format!(
                    "{} ({}) at {}: {}",
                    f.detector, f.kind, f.location, f.action
                )
            })
            .collect();
        let _ = writeln!(out, "  found         {}", found.join("; "));
    }
    let _ = writeln!(out, "  tags          {}", list(&r.tags));
    let _ = writeln!(out, "  rule edits    {}", list(&r.body_diff));
    let redactions: Vec<String> = r
        .redactions
        .iter()
        .map(|(k, n)| format!("{k} ×{n}"))
        .collect();
    let _ = writeln!(out, "  redactions    {}", list(&redactions));
    let _ = writeln!(
        out,
        "  received      {} bytes, {} {}",
        r.bytes_in,
        r.digest.name(),
        r.received_digest
    );
    match &r.request.sent_body {
        None => {
            let _ = writeln!(
                out,
                "  sent          same body, {} {}",
                r.digest.name(),
                r.sent_digest
            );
        }
        Some(b) => {
            let _ = writeln!(
                out,
                "  sent          {} bytes, {} {}",
                b.size,
                r.digest.name(),
                r.sent_digest
            );
        }
    }
}

/// The request body (as sent, or `--received`) and what the rules changed in it.
fn show_request(r: &CaptureRecord, args: &ShowArgs, sent: bool, out: &mut String) {
    let (which, body) = if sent {
        (
            "as sent upstream, the default; --received for the client's",
            r.sent(),
        )
    } else {
        ("as received", &r.request.body)
    };
    let mut line = body_line(body, None);
    // Unchanged by rules, the sent body is the received one and its wire size holds.
    let wire = (!sent || r.request.sent_body.is_none()).then_some(r.bytes_in);
    if let Some(n) = wire.filter(|n| *n != body.size) {
        // Redaction (or a compressed body stored decoded) changes the size.
        let _ = write!(line, "; {n} bytes on the wire, stored decoded and redacted");
    }
    let _ = writeln!(out, "\nrequest ({which}): {line}");
    if args.summary {
        request_summary(body, out);
    } else {
        prompt_text(&Prompt::read(body.bytes.clone(), r.request_format()), out);
    }
    if r.request.sent_body.is_some() {
        out.push_str("\nwhat the rules changed (received → sent):\n");
        match units::diff_bodies(&r.request.body.bytes, &r.sent().bytes) {
            Ok(entries) => diff_lines(&entries, out),
            Err(e) => {
                let _ = writeln!(out, "  {e}");
            }
        }
    }
}

/// The response: status, stream, stop reason, stream-rule edits and the answer.
fn show_response(r: &CaptureRecord, out: &mut String) {
    let resp = &r.response;
    let _ = writeln!(
        out,
        "\nresponse: {} {}",
        resp.status.map_or("-".into(), |s| s.to_string()),
        body_line(&resp.body, resp.format.as_deref())
    );
    if resp.format.as_deref() == Some("sse") {
        let _ = writeln!(
            out,
            "  stream        {} event(s), {}",
            resp.event_count,
            if resp.complete {
                "complete"
            } else {
                "incomplete"
            }
        );
    }
    if resp.truncated {
        let _ = writeln!(
            out,
            "  truncated     {} bytes passed to the client; the record keeps the first {} (capture.max_response)",
            r.bytes_out, resp.body.size
        );
    }
    if let Some(stop) = &resp.stop_reason {
        let _ = writeln!(out, "  stop reason   {stop}");
    }
    if let Some(e) = &resp.parse_error {
        let _ = writeln!(out, "  unreadable    {e}");
    }
    if !resp.edits.is_empty() {
        let _ = writeln!(
            out,
            "  stream rules  {} event(s) reached the client changed (the body below is what the provider sent):",
            resp.edits.len()
        );
        for e in &resp.edits {
            let _ = writeln!(
                out,
                "    #{} {} {} by {:?}",
                e.index, e.event, e.action, e.rule
            );
            if let Some(sent) = &e.sent {
                let _ = writeln!(out, "      sent: {}", preview(sent));
            }
        }
    }
    let message = resp.message.as_ref().unwrap_or(&resp.body);
    if let Ok(v) = serde_json::from_slice::<Value>(&message.bytes) {
        if let Some(blocks) = v.get("content").and_then(Value::as_array) {
            for b in blocks {
                let _ = writeln!(out, "  {}", block_line(b));
            }
        } else if let Some(choices) = v.get("choices").and_then(Value::as_array) {
            for c in choices {
                let text = c
                    .pointer("/message/content")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let _ = writeln!(out, "  choice: {}", preview(text));
            }
        }
    }
}

/// The request headers (as sent, or as received) and the response's.
fn show_headers(r: &CaptureRecord, sent: bool, out: &mut String) {
    let (which, headers) = if sent {
        ("as sent upstream", &r.request.sent_headers)
    } else {
        ("as received", &r.request.headers)
    };
    let _ = writeln!(out, "\nrequest headers ({which}, secrets redacted):");
    for (k, v) in headers {
        let _ = writeln!(out, "  {k}: {v}");
    }
    out.push_str("\nresponse headers:\n");
    for (k, v) in &r.response.headers {
        let _ = writeln!(out, "  {k}: {v}");
    }
}

fn body_line(b: &BodyInfo, format: Option<&str>) -> String {
    let kind = if b.size == 0 {
        "empty"
    } else if format == Some("sse") {
        "server-sent events"
    } else if b.json {
        "JSON"
    } else {
        "not JSON"
    };
    let mut line = format!("{} bytes, {kind}", b.size);
    if let Some(n) = &b.note {
        let _ = write!(line, " ({n})");
    }
    line
}

/// System blocks with their cache_control, tools by name, messages by role and block
/// type, and the other top-level keys.
fn request_summary(body: &BodyInfo, out: &mut String) {
    let prompt = Prompt::read(body.bytes.clone(), None);
    let Some(root) = prompt.root() else {
        if !body.bytes.is_empty() {
            let _ = writeln!(out, "  {}", preview(&String::from_utf8_lossy(&body.bytes)));
        }
        return;
    };
    // Display only: each block is small, and serde's values are what the lines print.
    let value = |v: crate::prompt::Value<'_>| -> Value {
        serde_json::from_slice(v.bytes()).unwrap_or(Value::Null)
    };
    let chars = |v: crate::prompt::Value<'_>| v.str().map_or(0, |t| t.chars().count());
    let tools: Vec<Value> = root
        .get("tools")
        .into_iter()
        .flat_map(|t| t.items())
        .map(value)
        .collect();
    if !tools.is_empty() {
        let names: Vec<String> = tools
            .iter()
            .map(|v| {
                let name = v
                    .get("name")
                    .or_else(|| v.pointer("/function/name"))
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_owned();
                match v.get("cache_control") {
                    Some(cc) => format!("{name} (cache_control {cc})"),
                    None => name,
                }
            })
            .collect();
        let _ = writeln!(out, "  tools ({}): {}", tools.len(), names.join(", "));
    }
    match root.get("system") {
        Some(text) if text.is_string() => {
            let text = text.str().unwrap_or_default();
            let _ = writeln!(
                out,
                "  system: string, {} chars: {}",
                text.chars().count(),
                preview(&text)
            );
        }
        Some(blocks) if blocks.is_array() => {
            let _ = writeln!(out, "  system ({}):", blocks.items().count());
            for (i, b) in blocks.items().enumerate() {
                let _ = writeln!(out, "    [{i}] {}", block_line(&value(b)));
            }
        }
        _ => {}
    }
    let messages: Vec<_> = root
        .get("messages")
        .into_iter()
        .flat_map(|m| m.items())
        .collect();
    if !messages.is_empty() {
        let _ = writeln!(out, "  messages ({}):", messages.len());
        for (i, m) in messages.iter().enumerate() {
            let role = m.get("role").and_then(|r| r.str());
            let blocks: Vec<String> = match m.get("content") {
                Some(text) if text.is_string() => vec![format!("string, {} chars", chars(text))],
                Some(blocks) if blocks.is_array() => {
                    blocks.items().map(|b| block_kind(&value(b))).collect()
                }
                _ => vec!["no content".into()],
            };
            let _ = writeln!(
                out,
                "    [{i}] {}: {}",
                role.as_deref().unwrap_or("?"),
                blocks.join("; ")
            );
        }
    }
    let others = top_level(root, &["tools", "system", "messages"], 40);
    if !others.is_empty() {
        let _ = writeln!(out, "  other: {}", others.join(" "));
    }
}

/// The body's top-level keys but `skip`, as `key=value` (values over `width`
/// bytes by their size).
fn top_level(root: crate::prompt::Value<'_>, skip: &[&str], width: usize) -> Vec<String> {
    root.entries()
        .filter_map(|(k, v)| Some((k.str()?, v)))
        .filter(|(k, _)| !skip.contains(&k.as_ref()))
        .map(|(k, v)| {
            let raw = String::from_utf8_lossy(v.bytes());
            if raw.len() <= width {
                format!("{k}={raw}")
            } else {
                format!("{k}=…({} bytes)", raw.len())
            }
        })
        .collect()
}

/// The whole prompt in the provider's cache order, from the prompt model's view
/// (the one the viewer shows): each tool by name, every system block and message block in full with its type,
/// `<system-reminder>` blocks marked, and each breakpoint where it sits.
fn prompt_text(prompt: &Prompt, out: &mut String) {
    let body = prompt.body();
    if prompt.root().is_none() {
        if !body.is_empty() {
            let _ = writeln!(out, "  {}", preview(&String::from_utf8_lossy(body)));
        }
        return;
    }
    if prompt.units().is_empty() {
        // Not a prompt promptgate reads (another API): the body as it is.
        let _ = writeln!(out, "{}", String::from_utf8_lossy(body));
        return;
    }
    let view = PromptView::of(prompt, None);
    let others: Vec<String> = view
        .settings
        .iter()
        .map(|(k, raw)| match raw.len() {
            0..=60 => format!("{k}={raw}"),
            n => format!("{k}=…({n} bytes)"),
        })
        .collect();
    if !others.is_empty() {
        let _ = writeln!(out, "settings: {}", others.join(" "));
    }
    let mut tools: Vec<String> = Vec::new();
    let mut message = None;
    for unit in &view.units {
        if unit.region == "tools" {
            tools.push(unit.name.clone().unwrap_or_else(|| "?".into()));
        } else {
            flush_tools(&mut tools, out);
            // A message's heading before its first block.
            if unit.message.is_some() && unit.message != message {
                message = unit.message;
                let role = unit.role.as_deref().unwrap_or("?");
                let _ = writeln!(out, "messages[{}] {role}", unit.message.unwrap_or(0));
            }
            unit_text(unit, out);
        }
        if let Some((n, ttl)) = &unit.breakpoint {
            flush_tools(&mut tools, out);
            let _ = writeln!(out, "  ◆ breakpoint {n} after {} (ttl {ttl})", unit.path);
        }
    }
    flush_tools(&mut tools, out);
    if let Some(ttl) = &view.automatic {
        let _ = writeln!(
            out,
            "  ◆ automatic caching (top-level cache_control, ttl {ttl})"
        );
    }
}

/// One system or message block: its place and type, a call's name and input, and
/// its text in full (or its size).
fn unit_text(unit: &UnitView, out: &mut String) {
    // Inside a message the heading names it: `content[1]`, or `content` for a string.
    let label = match unit.path.find(".content") {
        Some(at) => format!("  {}", &unit.path[at + 1..]),
        None => unit.path.clone(),
    };
    let mut line = format!("{label} {}", unit.kind);
    // A Responses input item is its own message: its role goes on its line.
    if let (None, Some(role)) = (unit.message, &unit.role) {
        let _ = write!(line, " {role}");
    }
    if let Some(t) = &unit.text {
        let _ = write!(line, ", {} chars", t.chars().count());
        if unit.reminder {
            line.push_str("  <system-reminder>");
        }
    }
    let call = matches!(&*unit.kind, "tool_use" | "function_call");
    if call
        && let Some(v) = unit
            .json
            .as_deref()
            .and_then(|j| serde_json::from_str::<Value>(j).ok())
    {
        let name = v.get("name").and_then(Value::as_str).unwrap_or("?");
        let input = v
            .get("input")
            .or_else(|| v.get("arguments"))
            .map(|i| match i {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .unwrap_or_default();
        let _ = write!(line, " {name} {input}");
    }
    if unit.error {
        line.push_str(" (error)");
    }
    let _ = writeln!(out, "{line}");
    match &unit.text {
        Some(t) if !t.is_empty() => {
            for l in t.lines() {
                let _ = writeln!(out, "    │ {l}");
            }
        }
        None if !call => {
            let _ = writeln!(out, "    ({} bytes)", unit.bytes);
        }
        _ => {}
    }
}

/// The tool names gathered so far, as one line (before a breakpoint or what follows).
fn flush_tools(tools: &mut Vec<String>, out: &mut String) {
    if !tools.is_empty() {
        let _ = writeln!(out, "tools ({}): {}", tools.len(), tools.join(", "));
        tools.clear();
    }
}

/// A block's type and size, its cache_control, and a preview of its text.
fn block_line(v: &Value) -> String {
    let mut line = block_kind(v);
    if let Some(text) = v.get("text").and_then(Value::as_str) {
        let _ = write!(line, ": {}", preview(text));
    } else if let Some(input) = v.get("input") {
        let _ = write!(line, ": {}", preview(&input.to_string()));
    }
    line
}

fn block_kind(v: &Value) -> String {
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("?");
    let mut s = match kind {
        "text" => format!(
            "text, {} chars",
            v.get("text")
                .and_then(Value::as_str)
                .map_or(0, |t| t.chars().count())
        ),
        "tool_use" => format!(
            "tool_use {}",
            v.get("name").and_then(Value::as_str).unwrap_or("?")
        ),
        "tool_result" => format!(
            "tool_result, {} chars{}",
            crate::prompt::display_text(v.get("content").unwrap_or(&Value::Null))
                .chars()
                .count(),
            if v.get("is_error") == Some(&Value::Bool(true)) {
                ", error"
            } else {
                ""
            }
        ),
        other => other.to_owned(),
    };
    if let Some(cc) = v.get("cache_control") {
        let _ = write!(s, " [cache_control {cc}]");
    }
    s
}

/// The first 60 characters of a text, on one line.
fn preview(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| {
            if c == '\n' || c == '\r' || c == '\t' {
                ' '
            } else {
                c
            }
        })
        .collect();
    format!("\"{}\"", cut(flat.trim(), 60))
}

fn cut(text: &str, width: usize) -> String {
    if text.chars().count() > width {
        format!("{}…", text.chars().take(width - 1).collect::<String>())
    } else {
        text.to_owned()
    }
}

// === diff ===

fn diff(
    a: &CaptureRecord,
    b: &CaptureRecord,
    received: bool,
    out: &mut String,
) -> anyhow::Result<()> {
    let pick = |r: &'_ CaptureRecord| -> anyhow::Result<Vec<u8>> {
        let body = if received { &r.request.body } else { r.sent() };
        if !r.captured || body.bytes.is_empty() {
            bail!("capture {} kept no request body", r.id);
        }
        Ok(body.bytes.to_vec())
    };
    let (ba, bb) = (pick(a)?, pick(b)?);
    let entries = units::diff_bodies(&ba, &bb).map_err(anyhow::Error::msg)?;
    let _ = writeln!(
        out,
        "diff {} → {} (requests as {}; cache order tools → system → messages; a string equals one text block; cache_control ignored)",
        a.id,
        b.id,
        if received { "received" } else { "sent" }
    );
    diff_lines(&entries, out);
    let count = |c: Change| entries.iter().filter(|e| e.change == c).count();
    let _ = write!(
        out,
        "{} same, {} changed, {} added, {} removed",
        count(Change::Same),
        count(Change::Changed),
        count(Change::Added),
        count(Change::Removed)
    );
    match entries.iter().position(|e| e.change != Change::Same) {
        Some(at) => {
            let e = &entries[at];
            let index = e.b.or(e.a).unwrap_or(0);
            let _ = writeln!(
                out,
                "; first difference at {}[{index}] after {at} unchanged unit(s)",
                e.section.name()
            );
        }
        None => out.push_str("; the requests are the same unit for unit\n"),
    }
    Ok(())
}

/// Diff entries as lines; runs of unchanged units collapse into one.
pub(super) fn diff_lines(entries: &[DiffEntry], out: &mut String) {
    let mut i = 0;
    while i < entries.len() {
        let e = &entries[i];
        if e.change == Change::Same {
            let run = entries[i..]
                .iter()
                .take_while(|x| x.change == Change::Same && x.section == e.section)
                .count();
            let last = &entries[i + run - 1];
            let _ = writeln!(
                out,
                "  {:<9} = {} unchanged ({})",
                e.section.name(),
                run,
                range(e, last)
            );
            i += run;
            continue;
        }
        let (mark, at) = match e.change {
            Change::Added => ("+", e.b),
            Change::Removed => ("-", e.a),
            _ => ("~", e.b),
        };
        let index = at.map_or(String::new(), |n| format!("[{n}]"));
        let moved = match (e.change, e.a, e.b) {
            (Change::Changed, Some(a), Some(b)) if a != b => format!(" (was [{a}])"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:<9} {mark} {index}{moved} {}",
            e.section.name(),
            e.label
        );
        for line in &e.lines {
            let _ = writeln!(out, "      {line}");
        }
        if e.lines.is_empty() {
            unit_content(e, out);
        }
        i += 1;
    }
}

/// The readable text of an added or removed unit, not only its size: the first
/// lines, each cut at a readable width.
fn unit_content(e: &DiffEntry, out: &mut String) {
    const LINES: usize = 20;
    const WIDTH: usize = 160;
    let (mark, text) = match e.change {
        Change::Added => ('+', e.after.as_deref()),
        Change::Removed => ('-', e.before.as_deref()),
        _ => return,
    };
    let Some(text) = text.filter(|t| !t.is_empty()) else {
        return;
    };
    let total = text.lines().count();
    for line in text.lines().take(LINES) {
        let cut: String = line.chars().take(WIDTH).collect();
        let more = if cut.len() < line.len() { "…" } else { "" };
        let _ = writeln!(out, "      {mark} {cut}{more}");
    }
    if total > LINES {
        let _ = writeln!(out, "      {mark} … {} more line(s)", total - LINES);
    }
}

fn range(first: &DiffEntry, last: &DiffEntry) -> String {
    let a = first.b.or(first.a).unwrap_or(0);
    let b = last.b.or(last.a).unwrap_or(0);
    if a == b {
        format!("[{a}]")
    } else {
        format!("[{a}..{b}]")
    }
}

// === export ===

fn export(store: &Store, args: &ExportArgs) -> anyhow::Result<()> {
    let mut damaged = Vec::new();
    let records = store.records(&args.filter.filter()?, &mut damaged)?;
    warn_damaged(&damaged);
    let mut bytes = Vec::new();
    match args.format.as_str() {
        "jsonl" => crate::capture::export::jsonl(records, &mut bytes)?,
        "har" => {
            let har = crate::capture::export::har(&records);
            serde_json::to_writer_pretty(&mut bytes, &har)?;
            bytes.push(b'\n');
        }
        other => bail!("unknown export format {other:?} (expected \"jsonl\" or \"har\")"),
    }
    match &args.output {
        Some(path) => {
            std::fs::write(path, &bytes).with_context(|| format!("writing {}", path.display()))
        }
        None => print(&bytes),
    }
}

//! `promptgate rules check` and `promptgate rules test`, and loading the rules for `serve`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Args, Subcommand};
use http::{HeaderMap, HeaderName, HeaderValue, Method};

use super::{Colour, paint};
use crate::capture::StoreLocation;
use crate::observer::EventSplitter;
use crate::rules::stream::{EventRules, StreamContext};
use crate::rules::{Decision, RequestCtx, RuleSet};

/// `promptgate rules …`
#[derive(Debug, Args)]
pub(crate) struct RulesArgs {
    #[command(subcommand)]
    command: RulesCommand,
}

// Built once from argv: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum RulesCommand {
    /// Validate a rules directory and print a summary per file and rule; exit 1 on errors.
    Check {
        /// The rules directory [default: ./rules].
        dir: Option<PathBuf>,
    },
    /// Show which rules a request fires and how they change it, sending nothing.
    Test {
        /// The rules directory [default: ./rules].
        #[arg(long, value_name = "DIR")]
        rules: Option<PathBuf>,
        /// The request body (JSON) as a client would send it.
        #[arg(required_unless_present = "capture", conflicts_with = "capture")]
        request: Option<PathBuf>,
        /// Take the request (its body, headers and path) from the capture store
        /// instead: an id (or its start), `last`, or `@-1`, `@-2`…
        #[arg(long, value_name = "ID", conflicts_with_all = ["headers", "path"])]
        capture: Option<String>,
        /// The capture store for --capture, a directory or a postgres:// URL
        /// [default: the running serve's, else `captures` in the data directory].
        #[arg(long, value_name = "DIR|URL", value_parser = super::output::StoreLocationParser, requires = "capture")]
        captures: Option<StoreLocation>,
        /// Request headers: a JSON object of name → value.
        #[arg(long, value_name = "HEADERS.json")]
        headers: Option<PathBuf>,
        /// The path the client would ask for.
        #[arg(long, value_name = "PATH", default_value = "/v1/messages")]
        path: String,
        /// Write the body that would be sent to this file.
        #[arg(long, value_name = "FILE")]
        body_out: Option<PathBuf>,
        /// Also run after_provider_response as if the upstream answered this status.
        #[arg(long, value_name = "STATUS")]
        status: Option<u16>,
        /// Response headers for --status: a JSON object of name → value.
        #[arg(long, value_name = "HEADERS.json")]
        response_headers: Option<PathBuf>,
        /// A recorded SSE response body: also run provider_stream_event on its events
        /// and print them as they would reach the client (status 200 unless --status).
        #[arg(long, value_name = "FILE")]
        response: Option<PathBuf>,
    },
}

/// Runs `promptgate rules …`.
pub(crate) fn run(args: RulesArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        RulesCommand::Check { dir } => Ok(check(&dir.unwrap_or_else(|| PathBuf::from("rules")))),
        RulesCommand::Test {
            rules,
            request,
            capture,
            captures,
            headers,
            path,
            body_out,
            status,
            response_headers,
            response,
        } => test(&TestArgs {
            dir: &rules.unwrap_or_else(|| PathBuf::from("rules")),
            input: match (request, capture) {
                (Some(file), _) => Input::File(file),
                (None, Some(id)) => Input::Capture {
                    id,
                    dir: super::output::store_config(captures, None)?.0,
                },
                (None, None) => bail!("give a REQUEST.json or --capture ID"),
            },
            headers: headers.as_deref(),
            path: &path,
            body_out: body_out.as_deref(),
            status: status.or(response.as_ref().map(|_| 200)),
            response_headers: response_headers.as_deref(),
            response: response.as_deref(),
        }),
    }
}

fn check(dir: &Path) -> ExitCode {
    match RuleSet::load_dir(dir) {
        Ok(set) => {
            print!("{}", summary(&set));
            for w in &set.warnings {
                println!("{}: {w}", paint("warning", Colour::Yellow));
            }
            for w in set.hooks().iter().filter_map(|h| h.check()) {
                println!("{}: {w}", paint("warning", Colour::Yellow));
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in &errors {
                println!("{e}");
            }
            println!(
                "{}; nothing loaded from {}",
                paint(&format!("{} error(s)", errors.len()), Colour::Red),
                dir.display()
            );
            ExitCode::from(1)
        }
    }
}

/// The `rules check` summary: each file, each rule with its phase, tests and actions.
pub(crate) fn summary(set: &RuleSet) -> String {
    let mut out = String::new();
    let mut rules = set.rules().iter();
    for (file, count) in &set.files {
        out.push_str(&format!(
            "{file}: {count} rule{}\n",
            if *count == 1 { "" } else { "s" }
        ));
        for rule in rules.by_ref().take(*count) {
            let mut flags = Vec::new();
            if rule.enforce {
                flags.push("enforce");
            }
            if !rule.enabled {
                flags.push("disabled");
            }
            let flags = if flags.is_empty() {
                String::new()
            } else {
                format!(" [{}]", flags.join(", "))
            };
            let when = rule.matcher_keys();
            let when = if when.is_empty() {
                "always".to_owned()
            } else {
                when.join(", ")
            };
            out.push_str(&format!(
                "  {}:{} {} ({}){flags}\n    when: {when}\n    actions: {}\n",
                rule.file,
                rule.line,
                rule.name,
                rule.phase.name(),
                rule.action_keys().join(", ")
            ));
        }
    }
    if let Some(scanner) = set.scanner() {
        for d in scanner.own_detectors() {
            out.push_str(&format!("  detector {}\n", d.name));
        }
        for scan in scanner.scans() {
            out.push_str(&format!(
                "  scan {}: {} → {}\n",
                scan.name,
                scan.selection(),
                scan.action.name()
            ));
        }
    }
    if let Some(budgets) = set.budgets() {
        for b in budgets.report() {
            let per = if b.scope.is_empty() {
                "global"
            } else {
                &b.scope
            };
            out.push_str(&format!(
                "  budget {}: per {per} {}, limit {}\n",
                b.name, b.window, b.limits
            ));
        }
    }
    let files = set.files.len();
    out.push_str(&format!(
        "{}: {} rule{} in {files} file{}\n",
        paint("ok", Colour::Green),
        set.rules().len(),
        if set.rules().len() == 1 { "" } else { "s" },
        if files == 1 { "" } else { "s" }
    ));
    out
}

/// Where `rules test` takes its request from.
enum Input {
    File(PathBuf),
    /// A captured request, as received (redacted).
    Capture {
        id: String,
        dir: StoreLocation,
    },
}

/// What `rules test` was asked.
struct TestArgs<'a> {
    dir: &'a Path,
    input: Input,
    headers: Option<&'a Path>,
    path: &'a str,
    body_out: Option<&'a Path>,
    status: Option<u16>,
    response_headers: Option<&'a Path>,
    response: Option<&'a Path>,
}

/// Reads a JSON object of header name → value.
/// Headers from a JSON file: an object of name to value, or a recorded request,
/// `{"method": …, "path": …, "headers": [[name, value], …]}` (as `captures export`
/// and most tools save one; `headers` may also be an object).
fn read_headers(file: &Path) -> anyhow::Result<HeaderMap> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let shape = || {
        format!(
            "{}: expected a JSON object of header name to value, or a recorded request \
             {{\"headers\": [[name, value], …]}}",
            file.display()
        )
    };
    let value: serde_json::Value = serde_json::from_str(&text).with_context(shape)?;
    let pairs: Vec<(String, serde_json::Value)> = match value {
        serde_json::Value::Object(mut object) => match object.remove("headers") {
            Some(serde_json::Value::Array(items)) => items
                .into_iter()
                .map(|item| match item {
                    serde_json::Value::Array(pair) if pair.len() == 2 => {
                        let mut pair = pair.into_iter();
                        match (pair.next(), pair.next()) {
                            (Some(serde_json::Value::String(k)), Some(v)) => Ok((k, v)),
                            _ => Err(anyhow::anyhow!(shape())),
                        }
                    }
                    _ => Err(anyhow::anyhow!(shape())),
                })
                .collect::<anyhow::Result<_>>()?,
            Some(serde_json::Value::Object(headers)) => headers.into_iter().collect(),
            Some(_) => bail!(shape()),
            // A flat object: every key is a header (one named "headers" was removed above
            // only when it held a list or an object).
            None => object.into_iter().collect(),
        },
        _ => bail!(shape()),
    };
    let mut map = HeaderMap::new();
    for (k, v) in pairs {
        let name = HeaderName::from_bytes(k.as_bytes())
            .with_context(|| format!("invalid header name {k:?}"))?;
        let value = v
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string());
        map.append(
            name,
            HeaderValue::from_str(&value)
                .with_context(|| format!("invalid value for header {k:?}"))?,
        );
    }
    Ok(map)
}

fn test(args: &TestArgs<'_>) -> anyhow::Result<ExitCode> {
    let TestArgs { dir, body_out, .. } = *args;
    let set = match RuleSet::load_dir(dir) {
        Ok(set) => std::sync::Arc::new(set),
        Err(errors) => {
            for e in &errors {
                println!("{e}");
            }
            return Ok(ExitCode::from(1));
        }
    };
    let (body, header_map, path, what) = test_input(args)?;
    let path = path.as_str();
    let pq = http::uri::PathAndQuery::try_from(path)
        .with_context(|| format!("invalid path {path:?}"))?;
    let Some(route) = crate::provider::route(&pq) else {
        bail!(
            "promptgate does not route {path:?}: {}",
            crate::provider::ROUTES_HELP
        );
    };
    let plain = crate::observer::decode::request_plain(&header_map, &body, 32 << 20)
        .with_context(|| format!("reading {what}"))?;
    let model = crate::provider::sniff(&plain).model;
    let before = header_map.clone();
    let method = Method::POST;
    let prompt = crate::prompt::PromptCell::new(
        plain.clone(),
        crate::prompt::Format::of_request(route.provider, route.api),
    );
    // The hooks run too, for real: `rules test` shows what deploying the set does.
    let result = set.apply_request_all(RequestCtx {
        id: None,
        provider: route.provider,
        api: route.api,
        method: &method,
        host: None,
        path: route.upstream_path.path(),
        model: model.as_deref(),
        conversation: None,
        headers: header_map,
        body: &body,
        prompt: &prompt,
    });
    println!(
        "request: POST {path} ({}, model {}, {} bytes)",
        route.provider.name(),
        model.as_deref().unwrap_or("-"),
        body.len()
    );
    print_request_result(&set, &result, &before, body.len(), &plain);
    test_response(args, &set, &route, model.as_deref(), &result)?;
    if let Some(out) = body_out {
        let bytes = result.body.as_ref().map_or(&body, |b| b.body());
        std::fs::write(out, bytes).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// With `--status`, the response phases over the answer's head (and `--response`'s
/// stream), as the proxy would run them after `result` went upstream.
fn test_response(
    args: &TestArgs<'_>,
    set: &Arc<RuleSet>,
    route: &crate::provider::Route,
    model: Option<&str>,
    result: &crate::rules::RequestResult,
) -> anyhow::Result<()> {
    let method = Method::POST;
    if let (Some(status), Decision::Continue) = (args.status, &result.verdict) {
        let status = http::StatusCode::from_u16(status)
            .with_context(|| format!("invalid status {status}"))?;
        let mut response = match args.response_headers {
            Some(h) => read_headers(h)?,
            None => HeaderMap::new(),
        };
        let before = response.clone();
        let facts = crate::policy::Facts {
            id: None,
            provider: route.provider,
            api: route.api,
            method: &method,
            host: None,
            path: route.upstream_path.path(),
            model,
            encoded: false,
            tags: &result.effects.tags,
            conversation: None,
            predicted_read: None,
        };
        let effects = set.apply_response(&facts, status, &result.headers, &mut response);
        println!("response: {}", status.as_u16());
        print_fired(
            &effects.fired,
            &effects.logs,
            &effects.tags,
            "after_provider_response",
            true,
        );
        for line in header_changes(&before, &response, &effects.secret_headers) {
            println!("response header: {line}");
        }
        if let Some(file) = args.response {
            let sse = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            let mut tags = result.effects.tags.clone();
            tags.extend(effects.tags.iter().cloned());
            let cx = StreamContext {
                provider: route.provider,
                api: route.api,
                method: method.clone(),
                host: None,
                path: route.upstream_path.path().to_owned(),
                model: model.map(str::to_owned),
                request_headers: result.headers.clone(),
                status,
                response_headers: response,
                tags,
            };
            print_stream(set.clone(), cx, &sse);
        }
    } else if args.response.is_some() {
        println!("stream: not run (the request was blocked)");
    }
    Ok(())
}

/// The request `rules test` runs: its body, headers, path and a name for it (a
/// file, or a captured exchange as received).
fn test_input(args: &TestArgs<'_>) -> anyhow::Result<(Bytes, HeaderMap, String, String)> {
    Ok(match &args.input {
        Input::File(request) => {
            let body = Bytes::from(
                std::fs::read(request).with_context(|| format!("reading {}", request.display()))?,
            );
            let headers = match args.headers {
                Some(h) => read_headers(h)?,
                None => HeaderMap::new(),
            };
            (
                body,
                headers,
                args.path.to_owned(),
                request.display().to_string(),
            )
        }
        Input::Capture { id, dir } => {
            let store = crate::capture::Store::open_read_only(dir)
                .with_context(|| format!("opening the capture store {dir}"))?;
            let record = store.load(id)?;
            let headers = record.received_headers();
            println!(
                "captured request {} (as received; secrets were redacted before the rules saw it)",
                record.id
            );
            (
                record.request.body.bytes.clone(),
                headers,
                record.path.clone(),
                format!("capture {}", record.id),
            )
        }
    })
}

/// What the request phases did: what fired, each hook's turn, logs, tags, header
/// edits, the verdict and the body's changes.
fn print_request_result(
    set: &RuleSet,
    result: &crate::rules::RequestResult,
    before: &HeaderMap,
    received_len: usize,
    plain: &Bytes,
) {
    if result.effects.fired.is_empty() {
        println!("fired: none");
    }
    for name in &result.effects.fired {
        let phase = set
            .rules()
            .iter()
            .find(|r| &r.name == name)
            .map_or("", |r| r.phase.name());
        println!("fired: {name} ({phase})");
    }
    for run in result.runs.iter().filter(|r| r.policy != "rules") {
        println!(
            "hook: {} ({}): {} in {} µs",
            run.policy,
            run.phase.name(),
            run.decision,
            run.took_us
        );
    }
    for (rule, line) in &result.effects.logs {
        println!("log: [{rule}] {line}");
    }
    if !result.effects.tags.is_empty() {
        println!("tags: {}", result.effects.tags.join(", "));
    }
    for line in header_changes(before, &result.headers, &result.effects.secret_headers) {
        println!("header: {line}");
    }
    match &result.verdict {
        Decision::Continue => println!("verdict: continue (sent upstream)"),
        // The type the client gets: the rule's, else the one its status implies.
        Decision::Respond(b) => println!(
            "verdict: block {} {}: {} (rule {:?})",
            b.status.as_u16(),
            b.error_type
                .as_deref()
                .unwrap_or_else(|| crate::provider::anthropic::error_type(b.status)),
            b.message,
            b.rule
        ),
    }
    match &result.body {
        None => println!("body: unchanged (sent byte for byte)"),
        Some(new) => {
            println!(
                "body: changed, {} → {} bytes",
                received_len,
                new.body().len()
            );
            for p in &result.effects.body_diff {
                println!("  changed {p}");
            }
            // Each changed unit's text, before → after, as `captures show` prints it.
            match crate::capture::units::diff_bodies(plain, new.body()) {
                Ok(entries) => {
                    let mut text = String::new();
                    super::captures::diff_lines(&entries, &mut text);
                    println!("what the rules changed (received → sent):");
                    print!("{text}");
                }
                Err(e) => println!("  (no unit diff: {e})"),
            }
        }
    }
}

/// What the rules of `phase` did: each that fired, its log lines, the tags.
/// `none`: say so when none fired.
fn print_fired(
    fired: &[String],
    logs: &[(String, String)],
    tags: &[String],
    phase: &str,
    none: bool,
) {
    if none && fired.is_empty() {
        println!("fired: none");
    }
    for name in fired {
        println!("fired: {name} ({phase})");
    }
    for (rule, line) in logs {
        println!("log: [{rule}] {line}");
    }
    if !tags.is_empty() {
        println!("tags: {}", tags.join(", "));
    }
}

/// Runs provider_stream_event over a recorded stream and prints what the client
/// would receive. Held events are released by text and at block ends, as in the
/// proxy (no rule holds by time).
fn print_stream(set: Arc<RuleSet>, cx: StreamContext, sse: &[u8]) {
    let Some(mut rules) = EventRules::new(set, cx) else {
        println!("stream: no provider_stream_event rules; the events go out as they came");
        return;
    };
    let report = rules.report();
    let mut splitter = EventSplitter::default();
    splitter.push(sse);
    let mut out = Vec::new();
    let mut events = 0usize;
    let mut blocked = None;
    let now = tokio::time::Instant::now();
    while let Some(event) = splitter.next_event() {
        events += 1;
        if let Some(block) = rules.push(event, now, &mut out) {
            blocked = Some(block);
            break;
        }
    }
    if blocked.is_none() {
        rules.finish(&mut out);
        let rest = splitter.rest();
        if !rest.is_empty() {
            out.push(rest);
        }
    }
    let report = report.lock().unwrap_or_else(|p| p.into_inner()).clone();
    println!(
        "stream: {events} event(s) read, {} edit(s)",
        report.edits.len()
    );
    print_fired(
        &report.fired,
        &report.logs,
        &report.tags,
        "provider_stream_event",
        false,
    );
    for e in &report.edits {
        println!(
            "edit: event #{} {} {} by {:?}",
            e.index, e.event, e.action, e.rule
        );
    }
    println!("--- what the client receives ---");
    print!("{}", String::from_utf8_lossy(&out.concat()));
    if let Some(block) = blocked {
        println!(
            "--- then an SSE error event ({}: {}) and an incomplete ending (rule {:?}) ---",
            block.error_type.as_deref().unwrap_or("permission_error"),
            block.message,
            block.rule
        );
    }
}

/// `+ name: value`, `~ name: value`, `- name` lines; secret values hidden.
fn header_changes(before: &HeaderMap, after: &HeaderMap, secrets: &[HeaderName]) -> Vec<String> {
    let shown = |name: &HeaderName, v: &HeaderValue| {
        if secrets.contains(name) || v.is_sensitive() {
            "<secret>".to_owned()
        } else {
            String::from_utf8_lossy(v.as_bytes()).into_owned()
        }
    };
    let mut out = Vec::new();
    for (name, v) in after {
        match before.get(name) {
            None => out.push(format!("+ {name}: {}", shown(name, v))),
            Some(old) if old != v => out.push(format!("~ {name}: {}", shown(name, v))),
            _ => {}
        }
    }
    for name in before.keys() {
        if !after.contains_key(name) {
            out.push(format!("- {name}"));
        }
    }
    out
}

//! The JSON API over the captures: listings, records, diffs, conversations, the
//! cache report, and the views the viewer reads (a record's prompt, its HAR, a
//! `curl` that resends it, the live rule set).

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Value, json};

use super::{AdminResponse, AdminState, reply_bytes, typed};
use crate::capture::store::Filter;
use crate::capture::{CaptureRecord, Store, StoreError, StoreLocation, export, timestamp, units};
use crate::prompt::{Prompt, PromptView};

/// What a route answers: JSON, or bytes of another type (a HAR, a body).
pub(super) enum Answer {
    Json(Vec<u8>),
    Typed(&'static str, Bytes),
}

impl Answer {
    pub(super) fn into_response(self) -> AdminResponse {
        match self {
            Answer::Json(bytes) => reply_bytes(StatusCode::OK, bytes),
            Answer::Typed(content_type, bytes) => typed(StatusCode::OK, content_type, bytes),
        }
    }
}

/// An answer, or a status and why.
type Routed = Result<Answer, (StatusCode, String)>;

/// Serialises straight to bytes: a stored body is embedded as the raw JSON it was
/// stored as, never re-parsed (no nesting limit, `\u` escapes stay escaped).
fn json_bytes(value: &impl serde::Serialize) -> Routed {
    serde_json::to_vec(value)
        .map(Answer::Json)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// The names the viewer filters by, from the enums that define them: the viewer
/// never restates them.
pub(super) fn vocabulary() -> serde_json::Value {
    use crate::provider::Provider;
    let providers = [Provider::Anthropic, Provider::OpenAi].map(Provider::name);
    let outcomes = crate::record::Outcome::ALL.map(crate::record::Outcome::name);
    let verdicts = crate::cache::explain::Verdict::ALL.map(crate::cache::explain::Verdict::name);
    json!({"providers": providers, "outcomes": outcomes, "verdicts": verdicts})
}

pub(super) fn route(dir: &StoreLocation, path: &str, query: &str, state: &AdminState) -> Routed {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let store = Store::open_read_only(dir).map_err(store_error)?;
    match segments.as_slice() {
        ["api", "captures"] => {
            let mut f = filter(query)?;
            // Side requests only with `all=1`, as `captures list --all`.
            if !query.split('&').any(|p| p == "all=1" || p == "all=true") {
                f.side = Some(false);
            }
            let rows = store.list(&f).map_err(store_error)?;
            let last_seq = store.last_seq().map_err(store_error)?;
            json_bytes(&json!({"captures": rows, "last_seq": last_seq}))
        }
        ["api", "captures", id] => {
            let mut record = store.load(id).map_err(store_error)?;
            record.with_contents();
            json_bytes(&record)
        }
        ["api", "captures", id, "prompt"] => {
            let record = store.load(id).map_err(store_error)?;
            json_bytes(&prompt_view(&record, query))
        }
        ["api", "captures", id, "anatomy"] => {
            let record = store.load(id).map_err(store_error)?;
            let anatomy = crate::capture::anatomy::of(&record)
                .map_err(|e| (StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
            json_bytes(&anatomy)
        }
        ["api", "captures", id, "previous"] => {
            let id = store.resolve(id).map_err(store_error)?;
            let previous = store.previous_in_conversation(&id).map_err(store_error)?;
            json_bytes(&json!({"id": id, "previous": previous}))
        }
        ["api", "captures", id, "har"] => {
            let mut record = store.load(id).map_err(store_error)?;
            record.with_contents();
            let har = serde_json::to_vec_pretty(&export::har(&[record]))
                .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
            Ok(Answer::Typed("application/json", har.into()))
        }
        ["api", "captures", id, "body"] => {
            let record = store.load(id).map_err(store_error)?;
            let content_type = if record.sent().json {
                "application/json"
            } else {
                "application/octet-stream"
            };
            Ok(Answer::Typed(content_type, record.sent().bytes.clone()))
        }
        ["api", "captures", id, "curl"] => {
            let record = store.load(id).map_err(store_error)?;
            json_bytes(&json!({"command": curl(&record, state.proxy)}))
        }
        ["api", "captures", id, "edits"] => json_bytes(&edits(&store, id)?),
        ["api", "captures", a, "diff", b] => {
            let a = store.load(a).map_err(store_error)?;
            let b = store.load(b).map_err(store_error)?;
            let entries = units::diff_bodies(&a.sent().bytes, &b.sent().bytes)
                .map_err(|e| (StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
            let breaks = prefix_break(&entries, &state.cache_ignore);
            json_bytes(&json!({"a": a.id, "b": b.id, "entries": entries, "breaks_prefix": breaks}))
        }
        ["api", "anatomy"] => json_bytes(&conversation_anatomy(&store, query)?),
        ["api", "conversations"] => {
            let f = filter(query)?;
            let rows = store.conversations(&f).map_err(store_error)?;
            let rows = conversation_rows(&store, &f, rows, &state.cache_ignore)?;
            json_bytes(&json!({"conversations": rows}))
        }
        ["api", "cache", "report"] => {
            let f = filter(query)?;
            let only_conversation_and_since = Filter {
                since_ms: f.since_ms,
                conversation: f.conversation.clone(),
                ..Filter::default()
            };
            if f != only_conversation_and_since {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "the cache report takes only conversation and since".into(),
                ));
            }
            let report = crate::capture::cache_report::build(&store, &f, &state.cache_ignore)
                .map_err(store_error)?;
            json_bytes(&report)
        }
        _ => Err((
            StatusCode::NOT_FOUND,
            format!(
                "no such resource {path:?} (try /api/captures, /api/conversations, \
                 /api/cache/report, /api/rules, /api/live, /metrics, /healthz, /readyz)"
            ),
        )),
    }
}

/// A record's prompt as the model saw it (`side=received`: as the client sent it),
/// with the prefix the provider read from cache.
fn prompt_view(record: &CaptureRecord, query: &str) -> Value {
    let received = query.split('&').any(|p| p == "side=received");
    let body = if received {
        &record.request.body
    } else {
        record.sent()
    };
    let read_through = record
        .cache
        .as_ref()
        .filter(|c| c.actual.read > 0)
        .and_then(|c| c.prediction.read_through.clone());
    let prompt = Prompt::read(body.bytes.clone(), record.request_format());
    json!({
        "id": record.id,
        "side": if received { "received" } else { "sent" },
        "rules_changed": record.request.sent_body.is_some(),
        "cache": record.cache.as_ref().map(|c| json!({
            "summary": c.log_field(),
            "reason": c.reason.as_ref().map(ToString::to_string),
        })),
        "view": PromptView::of(&prompt, read_through.as_deref()),
    })
}

/// A `curl` that resends the stored body through promptgate: credentials are left
/// as the variables the SDKs read, never the captured (fingerprinted) values.
fn curl(record: &CaptureRecord, proxy: std::net::SocketAddr) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    let openai = record.provider.as_deref() == Some("openai");
    // A forwarded request named its host; through the reverse proxy OpenAI is under /openai.
    let path = if openai && record.mode == "forward" {
        format!("/openai{}", record.path)
    } else {
        record.path.clone()
    };
    let mut out = format!("curl -sS -N {}", quote(&format!("http://{proxy}{path}")));
    let keep = |name: &str| {
        let n = name.to_ascii_lowercase();
        n == "content-type" || n.starts_with("anthropic-") || n.starts_with("openai-")
    };
    for (name, value) in record.request.headers.iter().filter(|(n, _)| keep(n)) {
        out.push_str(&format!(" \\\n  -H {}", quote(&format!("{name}: {value}"))));
    }
    let key = if openai {
        "-H \"authorization: Bearer $OPENAI_API_KEY\""
    } else {
        "-H \"x-api-key: $ANTHROPIC_API_KEY\""
    };
    out.push_str(&format!(
        " \\\n  {key} \\\n  --data-binary @{}.json",
        record.id
    ));
    out
}

/// `/api/anatomy?conversation=KEY`: a conversation's anatomy, turn by turn (the key
/// in the query: keys may hold `/`).
fn conversation_anatomy(store: &Store, query: &str) -> Result<Value, (StatusCode, String)> {
    let key = filter(query)?.conversation.ok_or((
        StatusCode::BAD_REQUEST,
        "name the conversation: /api/anatomy?conversation=KEY".to_owned(),
    ))?;
    let (key, records) =
        crate::capture::anatomy::conversation_records(store, &key).map_err(store_error)?;
    serde_json::to_value(crate::capture::anatomy::conversation(&key, &records))
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// What the rules changed in a record: the body as received against the body as sent.
fn edits(store: &Store, id: &str) -> Result<Value, (StatusCode, String)> {
    let record = store.load(id).map_err(store_error)?;
    let entries: Vec<units::DiffEntry> = match &record.request.sent_body {
        Some(sent) => units::diff_bodies(&record.request.body.bytes, &sent.bytes)
            .map_err(|e| (StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?
            .into_iter()
            .filter(|e| e.change != units::Change::Same)
            .collect(),
        None => Vec::new(),
    };
    Ok(json!({"id": record.id, "entries": entries}))
}

/// `/api/budgets`: each budget of the live set, its scope, window and limits, and
/// what each of its scopes spent in the window now (most first), with when it resets.
pub(super) fn budgets(state: &AdminState) -> Value {
    let set = state.rules.snapshot();
    let budgets: Vec<Value> = set.budgets().map_or_else(Vec::new, |b| {
        b.report()
            .into_iter()
            .map(|b| {
                json!({
                    "name": b.name,
                    "scope": b.scope,
                    "window": b.window,
                    "limits": b.limits,
                    "scopes": b.scopes.iter().map(|s| json!({
                        "scope": state.live.redact(&s.scope),
                        "usd": s.spent.usd,
                        "input_tokens": s.spent.input_tokens,
                        "output_tokens": s.spent.output_tokens,
                        "requests": s.spent.requests,
                        "share": s.share,
                        "resets": s.resets,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect()
    });
    json!({ "budgets": budgets })
}

/// `/api/rules`: the live rule set, where it is read from, its last reload (with
/// the error's `file:line:col`), and how often each rule fired since the start.
pub(super) fn rules(state: &AdminState) -> Value {
    let set = state.rules.snapshot();
    let metrics = state.metrics.as_ref().map(|(m, _)| m);
    let rules: Vec<Value> = set
        .rules()
        .iter()
        .map(|r| {
            json!({
                "name": r.name,
                "description": r.description,
                "phase": r.phase.name(),
                "file": r.file,
                "line": r.line,
                "enabled": r.enabled,
                "enforce": r.enforce,
                "when": r.matcher_keys(),
                "actions": r.action_keys(),
                "fired": metrics.map(|m| m.rule_fires(&r.name, r.phase.name())),
            })
        })
        .collect();
    let hooks: Vec<Value> = set
        .hooks()
        .iter()
        .map(|h| {
            json!({
                "name": h.name,
                "phases": h.phases.iter().map(|p| p.name()).collect::<Vec<_>>(),
                "transport": h.transport_name(),
                "timeout_ms": u64::try_from(h.timeout.as_millis()).unwrap_or(u64::MAX),
                "on_error": h.on_error.name(),
                "enforce": h.enforce,
                "file": h.file,
                "line": h.line,
                "decisions": metrics.map(|m| m.policy_decisions(&h.name)),
            })
        })
        .collect();
    let scans: Vec<Value> = set.scanner().map_or_else(Vec::new, |s| {
        s.scans()
            .iter()
            .map(|scan| {
                json!({
                    "name": scan.name,
                    "selects": scan.selection(),
                    "action": scan.action.name(),
                })
            })
            .collect()
    });
    json!({
        "dir": state.rules_dir.display().to_string(),
        "state": state.rules.state(&state.rules_dir),
        "reloads": {"ok": state.rules.reloads().ok, "failed": state.rules.reloads().failed},
        "last_reload": state.rules.last_reload(),
        "rules": rules,
        "hooks": hooks,
        "scans": scans,
    })
}

/// The conversations list's rows with what the cache report knows of each: its hit
/// rate and input dollars, and a preview of its first user prompt (from the stored
/// body, redacted like everything the store holds).
fn conversation_rows(
    store: &Store,
    f: &Filter,
    rows: Vec<crate::capture::store::ConversationRow>,
    ignore: &[crate::cache::segment::IgnoreRule],
) -> Result<Vec<Value>, (StatusCode, String)> {
    let scope = Filter {
        since_ms: f.since_ms,
        until_ms: f.until_ms,
        ..Filter::default()
    };
    let report = crate::capture::cache_report::build(store, &scope, ignore).map_err(store_error)?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let mut v = serde_json::to_value(&row)
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        let key = row.conversation.as_deref().unwrap_or("-");
        if let Some(c) = report.conversations.iter().find(|c| c.conversation == key) {
            v["hit_rate"] = json!(c.summary.hit_rate);
            v["input_usd"] = if c.summary.priced {
                json!(c.summary.input_usd)
            } else {
                Value::Null
            };
            v["total_usd"] = if c.summary.priced {
                json!(c.summary.total_usd)
            } else {
                Value::Null
            };
            let first = c.timeline.first().and_then(|e| store.load(&e.id).ok());
            if let Some(record) = first {
                v["first_prompt"] = json!(first_user_prompt(&record.sent().bytes));
            }
        }
        out.push(v);
    }
    Ok(out)
}

/// The start of the first user text of a request (Anthropic or OpenAI messages,
/// Responses input), Claude Code's `<system-reminder>` blocks skipped.
fn first_user_prompt(body: &[u8]) -> Option<String> {
    const CHARS: usize = 140;
    let root: Value = serde_json::from_slice(body).ok()?;
    let items = root
        .get("messages")
        .or_else(|| root.get("input"))
        .and_then(Value::as_array)?;
    let texts = items
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .flat_map(|m| match m.get("content") {
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(blocks)) => blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect(),
            _ => Vec::new(),
        });
    let text = texts
        .map(str::trim)
        .find(|t| !t.is_empty() && !t.starts_with("<system-reminder>"))?;
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut preview: String = flat.chars().take(CHARS).collect();
    if preview.len() < flat.len() {
        preview.push('…');
    }
    Some(preview)
}

/// Where the cached prefix breaks between two requests, in cache order: the first
/// unit that differs, except the units the cache analysis ignores (the billing
/// header) and units only appended at the end (how a cache hit grows its prompt).
fn prefix_break(
    entries: &[units::DiffEntry],
    ignore: &[crate::cache::segment::IgnoreRule],
) -> Option<usize> {
    let ignored = |e: &units::DiffEntry| {
        [e.before.as_deref(), e.after.as_deref()]
            .into_iter()
            .flatten()
            .any(|text| {
                ignore
                    .iter()
                    .any(|r| r.region == e.section && r.text.is_match(text))
            })
    };
    let at = entries
        .iter()
        .position(|e| e.change != units::Change::Same && !ignored(e))?;
    let appended = entries[at..]
        .iter()
        .all(|e| e.change == units::Change::Added || ignored(e));
    (!appended).then_some(at)
}

fn store_error(e: StoreError) -> (StatusCode, String) {
    let status = match e {
        StoreError::NotFound(_) | StoreError::Missing(_) => StatusCode::NOT_FOUND,
        StoreError::Ambiguous(..) | StoreError::BadReference(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, e.to_string())
}

/// A [`Filter`] from the query: the filters of `captures list` (`since`, `until`,
/// `model`, `conversation`, `outcome`, `grep`, `provider`, `rule`, `verdict`, `tag`,
/// `path`, `mode`, `limit`, `offset`), `after` (a row's `seq`: what was stored
/// since) and `all`.
fn filter(query: &str) -> Result<Filter, (StatusCode, String)> {
    let mut f = Filter::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v);
        let bad = |m: String| (StatusCode::BAD_REQUEST, m);
        match k {
            "since" => {
                let now = timestamp::now_ms();
                f.since_ms = Some(timestamp::parse_since(&v, now).map_err(|e| bad(e.to_string()))?);
            }
            "until" => {
                let now = timestamp::now_ms();
                f.until_ms = Some(timestamp::parse_since(&v, now).map_err(|e| bad(e.to_string()))?);
            }
            "tag" => f.tag = Some(v),
            "path" => f.path = Some(v),
            "mode" => f.mode = Some(v),
            "all" => {}
            "after" => {
                f.after_seq = Some(
                    v.parse()
                        .map_err(|_| bad(format!("after {v:?} is not a row's seq")))?,
                )
            }
            "model" => f.model = Some(v),
            "conversation" => f.conversation = Some(v),
            "outcome" => f.outcome = Some(v),
            "grep" => f.grep = Some(v),
            "provider" => f.provider = Some(v),
            "rule" => f.rule = Some(v),
            "verdict" => f.verdict = Some(v),
            "offset" => {
                f.offset = Some(
                    v.parse()
                        .map_err(|_| bad(format!("offset {v:?} is not a number")))?,
                )
            }
            "limit" => {
                f.limit = Some(
                    v.parse()
                        .map_err(|_| bad(format!("limit {v:?} is not a number")))?,
                )
            }
            other => return Err(bad(format!("unknown parameter {other:?}"))),
        }
    }
    Ok(f)
}

fn percent_decode(text: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = match bytes[i] {
            b'%' if i + 2 < bytes.len() => hex(bytes[i + 1]).zip(hex(bytes[i + 2])),
            _ => None,
        };
        match (decoded, bytes[i]) {
            (Some((hi, lo)), _) => {
                out.push(hi << 4 | lo);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_parameters_decode() {
        assert_eq!(percent_decode("cc%3A54c1+x%2"), "cc:54c1 x%2");
        let f = filter("model=claude-*&limit=5&conversation=cc%3Aabc").unwrap();
        assert_eq!(f.model.as_deref(), Some("claude-*"));
        assert_eq!(f.limit, Some(5));
        assert_eq!(f.conversation.as_deref(), Some("cc:abc"));
        assert!(filter("colour=red").is_err());
    }
}

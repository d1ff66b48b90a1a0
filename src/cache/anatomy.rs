//! Prompt anatomy: each part of an agent's prompt named by where it came from, with
//! its estimated tokens, read off the cache units of one request.
//!
//! A unit is one part, except a `<system-reminder>` text that carries several
//! `# name` sections (Claude Code's context block: `claudeMd`, `gitStatus`,
//! `currentDate`, …) and a `claudeMd` section with several `Contents of PATH
//! (scope):` files: those are split, each section's tokens its share of the unit's
//! by bytes. What it cannot name it calls `other`, never a guess.

use serde::Serialize;

use super::segment::{Segments, Unit};
use crate::prompt::{Prompt, Region};
use crate::provider::Usage;
use crate::provider::price::Cost;

/// Where a part of the prompt came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Family {
    /// The system prompt: the base prompt, appended text, the billing header.
    System,
    /// Tool definitions: built-in, MCP (by server), custom, deferred.
    Tools,
    /// Memory files (CLAUDE.md and the like), by path and scope.
    Memory,
    /// Context the agent adds: environment, git status, date.
    Context,
    /// Runtime `<system-reminder>` blocks other than context and memory.
    Reminders,
    /// The conversation: user prompts, assistant text, thinking, tool calls and results.
    Conversation,
}

impl Family {
    /// Every family, in prompt order.
    pub(crate) const ALL: [Family; 6] = [
        Family::System,
        Family::Tools,
        Family::Memory,
        Family::Context,
        Family::Reminders,
        Family::Conversation,
    ];

    /// The name used in tables and JSON.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Family::System => "system",
            Family::Tools => "tools",
            Family::Memory => "memory",
            Family::Context => "context",
            Family::Reminders => "reminders",
            Family::Conversation => "conversation",
        }
    }
}

/// One named part of a prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Part {
    pub family: Family,
    /// What it is: `built-in Bash`, `MCP server github`, `/repo/CLAUDE.md (project)`,
    /// `git status`, `tool result of Read`, …
    pub name: String,
    /// The unit it is (or is in).
    pub unit: String,
    pub bytes: usize,
    /// Estimated tokens (the analysis' estimator).
    pub tokens: u64,
}

/// Claude Code's built-in tools (as of 2.x): anything else not `mcp__…` is custom.
const BUILT_IN: &[&str] = &[
    "Agent",
    "AskUserQuestion",
    "Bash",
    "BashOutput",
    "Edit",
    "EnterPlanMode",
    "ExitPlanMode",
    "Glob",
    "Grep",
    "KillShell",
    "ListMcpResourcesTool",
    "LSP",
    "MultiEdit",
    "NotebookEdit",
    "Read",
    "ReadMcpResourceTool",
    "ScheduleWakeup",
    "Skill",
    "SlashCommand",
    "Task",
    "TaskOutput",
    "TodoWrite",
    "ToolSearch",
    "WebFetch",
    "WebSearch",
    "Write",
];

/// The parts of `prompt`, whose cache units are `segs`, in prompt order.
pub(crate) fn anatomy(prompt: &Prompt, segs: &Segments) -> Vec<Part> {
    let mut parts = Vec::with_capacity(segs.units.len());
    let roles: Vec<String> = prompt
        .messages()
        .iter()
        .map(|m| {
            prompt
                .value(m.tok)
                .and_then(|v| v.get("role"))
                .and_then(|r| r.str().map(|s| s.into_owned()))
                .unwrap_or_default()
        })
        .collect();
    // Tool results name their tool through the call's id.
    let mut calls: Vec<(String, String)> = Vec::new();
    for unit in &segs.units {
        // Read through its tape, as the prompt is: a tree of the whole unit is not
        // needed for a few fields (serde_json's was ~90 % of naming a 200 KB prompt).
        let toks = crate::provider::json::tape(&unit.bytes).unwrap_or_default();
        let value = crate::prompt::Value::root_of(&unit.bytes, &toks);
        let field = |k: &str| {
            value
                .and_then(|v| v.get(k))
                .and_then(|v| v.str())
                .map(std::borrow::Cow::into_owned)
        };
        let text = value.and_then(|v| {
            let s = if v.is_string() {
                Some(v)
            } else {
                v.get("text")
            };
            s.and_then(|s| s.str()).map(std::borrow::Cow::into_owned)
        });
        let whole = |family, name: String| Part {
            family,
            name,
            unit: unit.path.to_string(),
            bytes: unit.bytes.len(),
            tokens: u64::from(unit.tokens),
        };
        match unit.path.region {
            Region::Tools => {
                let name = unit.tool_name().unwrap_or_default();
                let deferred = value
                    .and_then(|v| v.get("defer_loading"))
                    .is_some_and(|v| v.bytes() == b"true");
                parts.push(whole(Family::Tools, tool_part(&name, deferred)));
            }
            Region::System | Region::Instructions => {
                let t = text.as_deref().unwrap_or_default();
                let name = system_part(t, unit.path.region);
                parts.push(whole(Family::System, name.to_owned()));
            }
            Region::Messages | Region::Input => {
                let role = roles
                    .get(unit.path.index as usize)
                    .map_or("", String::as_str);
                match &*unit.kind {
                    "tool_use" => {
                        let name = field("name").unwrap_or_default();
                        if let Some(id) = field("id") {
                            calls.push((id, name.clone()));
                        }
                        parts.push(whole(Family::Conversation, format!("tool call {name}")));
                    }
                    "tool_result" => {
                        let id = field("tool_use_id").unwrap_or_default();
                        let name = calls
                            .iter()
                            .find(|(i, _)| *i == id)
                            .map_or("a tool", |(_, n)| n.as_str());
                        parts.push(whole(
                            Family::Conversation,
                            format!("tool result of {name}"),
                        ));
                    }
                    "thinking" | "redacted_thinking" => {
                        parts.push(whole(Family::Conversation, "thinking".into()));
                    }
                    "image" | "document" => {
                        parts.push(whole(Family::Conversation, (*unit.kind).to_owned()));
                    }
                    _ if role == "system" => {
                        parts.push(whole(Family::Context, "environment".into()));
                    }
                    _ => match text.as_deref() {
                        Some(t) if t.trim_start().starts_with("<system-reminder>") => {
                            split_reminder(unit, t, &mut parts);
                        }
                        _ if role == "assistant" => {
                            parts.push(whole(Family::Conversation, "assistant text".into()));
                        }
                        _ => parts.push(whole(Family::Conversation, "user prompt".into())),
                    },
                }
            }
        }
    }
    parts
}

/// What a system block (or OpenAI's instructions) holding `text` is.
fn system_part(text: &str, region: Region) -> &'static str {
    if text.starts_with("x-anthropic-billing-header:") {
        "billing header"
    } else if text.starts_with("You are ") {
        "base prompt"
    } else if region == Region::Instructions {
        "instructions"
    } else {
        "system text"
    }
}

fn tool_part(name: &str, deferred: bool) -> String {
    let kind = if let Some(rest) = name.strip_prefix("mcp__") {
        let server = rest.split("__").next().unwrap_or(rest);
        format!("MCP server {server}")
    } else if BUILT_IN.contains(&name) {
        format!("built-in {name}")
    } else {
        format!("custom {name}")
    };
    if deferred {
        format!("{kind} (deferred)")
    } else {
        kind
    }
}

/// A reminder's `# name` sections (and a claudeMd section's files), each a part.
fn split_reminder(unit: &Unit, text: &str, parts: &mut Vec<Part>) {
    let mut sections: Vec<(Family, String, usize)> = Vec::new();
    let mut current: Option<(Family, String)> = None;
    let mut size = 0usize;
    for line in text.split_inclusive('\n') {
        let heading = line.strip_prefix("# ").map(str::trim);
        let file = line
            .strip_prefix("Contents of ")
            .and_then(|rest| rest.trim_end().strip_suffix(':'));
        let next = match (heading, file) {
            (Some(h), _) => Some(section(h)),
            (None, Some(f)) => Some((Family::Memory, memory_file(f))),
            _ => None,
        };
        if let Some(next) = next {
            if let Some((family, name)) = current.take() {
                sections.push((family, name, size));
            } else if size > 0 {
                sections.push((Family::Reminders, "reminder".into(), size));
            }
            current = Some(next);
            size = 0;
        }
        size += line.len();
    }
    match current {
        Some((family, name)) => sections.push((family, name, size)),
        None => sections.push((Family::Reminders, "reminder".into(), size)),
    }
    let total = sections.iter().map(|s| s.2).sum::<usize>().max(1);
    let tokens = u64::from(unit.tokens);
    let mut given = 0u64;
    let n = sections.len();
    for (i, (family, name, size)) in sections.into_iter().enumerate() {
        // The last section takes the rounding, so the parts sum to the unit.
        let share = if i + 1 == n {
            tokens - given
        } else {
            tokens * size as u64 / total as u64
        };
        given += share;
        parts.push(Part {
            family,
            name,
            unit: unit.path.to_string(),
            bytes: size,
            tokens: share,
        });
    }
}

/// A `# name` section of a reminder.
fn section(name: &str) -> (Family, String) {
    match name {
        "claudeMd" => (Family::Memory, "memory files".into()),
        "gitStatus" => (Family::Context, "git status".into()),
        "currentDate" => (Family::Context, "date".into()),
        "userEmail" | "attachedProject" | "Environment" => (Family::Context, name.into()),
        "attribution" => (Family::Reminders, "attribution".into()),
        _ => (Family::Reminders, format!("reminder {name}")),
    }
}

/// `PATH (scope text)` of a memory file, as `PATH (scope)`: Claude Code writes
/// "project instructions, checked into the codebase", "user's private project
/// instructions, not checked in" (CLAUDE.local.md), "user's private global
/// instructions for all projects", and managed (organisation) memory.
fn memory_file(header: &str) -> String {
    let (path, said) = match header.rsplit_once(" (") {
        Some((p, s)) => (p, s.trim_end_matches(')')),
        None => (header, ""),
    };
    let scope = [
        ("not checked in", "local"),
        ("private global", "user"),
        ("project", "project"),
        ("managed", "managed"),
        ("organization", "managed"),
        ("policy", "managed"),
    ]
    .into_iter()
    .find(|(words, _)| said.contains(words))
    .map_or("other", |(_, scope)| scope);
    format!("{path} ({scope})")
}

/// Cuts `prompt` into its cache units and names their parts: how many parts (the
/// `prompt` bench times it; `None` for a body that is no prompt).
pub fn classify(prompt: &Prompt) -> Option<usize> {
    let segs =
        super::segment::segment(prompt, &[super::segment::IgnoreRule::billing_header()]).ok()?;
    Some(anatomy(prompt, &segs).len())
}

/// Cuts `prompt` into its cache units, as [`classify`] does first: how many (the
/// `prompt` bench times the naming as the difference).
pub fn cut(prompt: &Prompt) -> Option<usize> {
    let segs =
        super::segment::segment(prompt, &[super::segment::IgnoreRule::billing_header()]).ok()?;
    Some(segs.units.len())
}

/// Tokens per family, in [`Family::ALL`] order.
pub(crate) fn by_family(parts: &[Part]) -> Vec<(Family, u64)> {
    Family::ALL
        .iter()
        .map(|&f| {
            (
                f,
                parts
                    .iter()
                    .filter(|p| p.family == f)
                    .map(|p| p.tokens)
                    .sum(),
            )
        })
        .filter(|(_, t)| *t > 0)
        .collect()
}

/// How the provider billed one part's tokens in one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct Billed {
    /// Its tokens by the provider's count: the estimate scaled so that the parts
    /// sum to the provider's whole input.
    pub tokens: u64,
    /// Of them, read from the cache, written to it, and sent uncached.
    pub read: u64,
    pub write: u64,
    pub uncached: u64,
    /// What they cost, at the rates the record was priced at (`None`: unpriced).
    pub usd: Option<f64>,
}

impl Billed {
    /// Whether the whole part was inside the cached prefix the provider read.
    pub(crate) fn cached(&self) -> bool {
        self.tokens > 0 && self.read == self.tokens
    }
}

/// How the provider billed each of `parts` (in cache order) given its `usage`: the
/// estimates scaled to its count (largest remainders, so they sum exactly), then,
/// walking the prompt in order, the first `cache_read_tokens` read, the next
/// `cache_write_tokens` written, the rest uncached (the cache is a prefix). `cost`,
/// the record's own pricing, gives each kind's rate.
pub(crate) fn bill(parts: &[Part], usage: &Usage, cost: Option<&Cost>) -> Vec<Billed> {
    let total: u64 = parts.iter().map(|p| p.tokens).sum();
    let input = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens;
    let scaled = apportion(parts.iter().map(|p| p.tokens), total, input);
    let rate = |usd: f64, tokens: u64| {
        if tokens == 0 {
            0.0
        } else {
            usd / tokens as f64
        }
    };
    let rates = cost.map(|c| {
        (
            rate(c.read_usd, usage.cache_read_tokens),
            rate(c.write_usd, usage.cache_write_tokens),
            rate(c.input_usd - c.read_usd - c.write_usd, usage.input_tokens),
        )
    });
    let (mut read_left, mut write_left) = (usage.cache_read_tokens, usage.cache_write_tokens);
    scaled
        .into_iter()
        .map(|tokens| {
            let read = tokens.min(read_left);
            read_left -= read;
            let write = (tokens - read).min(write_left);
            write_left -= write;
            let uncached = tokens - read - write;
            Billed {
                tokens,
                read,
                write,
                uncached,
                usd: rates
                    .map(|(r, w, u)| r * read as f64 + w * write as f64 + u * uncached as f64),
            }
        })
        .collect()
}

/// `shares` (summing to `total`) scaled to sum to `to` exactly: each its floor, and
/// the units left over to the largest remainders.
fn apportion(shares: impl Iterator<Item = u64>, total: u64, to: u64) -> Vec<u64> {
    if total == 0 {
        return shares.map(|_| 0).collect();
    }
    let exact: Vec<(u64, u64)> = shares
        .map(|s| {
            let n = u128::from(s) * u128::from(to);
            let (q, r) = (n / u128::from(total), n % u128::from(total));
            (q as u64, r as u64)
        })
        .collect();
    let mut out: Vec<u64> = exact.iter().map(|(q, _)| *q).collect();
    let left = to.saturating_sub(out.iter().sum());
    let mut order: Vec<usize> = (0..exact.len()).collect();
    order.sort_by(|&a, &b| exact[b].1.cmp(&exact[a].1).then(a.cmp(&b)));
    for &i in order.iter().take(left as usize) {
        out[i] += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::segment::{IgnoreRule, segment};
    use crate::prompt::Format;

    fn parts(body: &str) -> Vec<Part> {
        let prompt = Prompt::read(
            bytes::Bytes::copy_from_slice(body.as_bytes()),
            Some(Format::AnthropicMessages),
        );
        let segs = segment(&prompt, &[IgnoreRule::billing_header()]).unwrap();
        let parts = anatomy(&prompt, &segs);
        let total: u64 = segs.units.iter().map(|u| u64::from(u.tokens)).sum();
        assert_eq!(
            parts.iter().map(|p| p.tokens).sum::<u64>(),
            total,
            "the parts sum to the prompt"
        );
        parts
    }

    #[test]
    fn a_claude_code_prompt_is_named_part_by_part() {
        let reminder = "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# claudeMd\nCodebase and user instructions are shown below.\n\nContents of /home/u/.claude/CLAUDE.md (user's private global instructions for all projects):\n\nBe brief.\n\nContents of /repo/CLAUDE.md (project instructions, checked into the codebase):\n\nUse tabs.\n\nContents of /repo/CLAUDE.local.md (user's private project instructions, not checked in):\n\nMy port is 3000.\n# currentDate\nToday's date is 2026-12-05.\n</system-reminder>\n";
        let body = serde_json::json!({
            "model": "claude-opus-5-5",
            "tools": [
                {"name": "Bash", "input_schema": {"type": "object"}},
                {"name": "mcp__github__create_issue", "input_schema": {"type": "object"}},
                {"name": "WebFetch", "defer_loading": true, "input_schema": {"type": "object"}},
                {"name": "deploy", "input_schema": {"type": "object"}}
            ],
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                {"type": "text", "text": "You are Claude Code, Anthropic's official CLI."}
            ],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": reminder},
                    {"type": "text", "text": "fix the build"}
                ]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "/repo/a.rs"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "fn main() {}"}
                ]}
            ]
        })
        .to_string();
        let parts = parts(&body);
        let names: Vec<(&str, &str)> = parts
            .iter()
            .map(|p| (p.family.name(), p.name.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("tools", "built-in Bash"),
                ("tools", "MCP server github"),
                ("tools", "built-in WebFetch (deferred)"),
                ("tools", "custom deploy"),
                ("system", "billing header"),
                ("system", "base prompt"),
                ("reminders", "reminder"),
                ("memory", "memory files"),
                ("memory", "/home/u/.claude/CLAUDE.md (user)"),
                ("memory", "/repo/CLAUDE.md (project)"),
                ("memory", "/repo/CLAUDE.local.md (local)"),
                ("context", "date"),
                ("conversation", "user prompt"),
                ("conversation", "thinking"),
                ("conversation", "tool call Read"),
                ("conversation", "tool result of Read"),
            ]
        );
        let families: Vec<&str> = by_family(&parts).iter().map(|(f, _)| f.name()).collect();
        assert_eq!(
            families,
            [
                "system",
                "tools",
                "memory",
                "context",
                "reminders",
                "conversation"
            ]
        );
    }

    #[test]
    fn parts_are_billed_in_cache_order_and_sum_to_the_providers_count() {
        let part = |tokens| Part {
            family: Family::System,
            name: String::new(),
            unit: String::new(),
            bytes: 0,
            tokens,
        };
        let parts = [part(100), part(50), part(50)];
        // 300 by the provider's count: 150 read, 90 written, 60 uncached.
        let usage = Usage {
            input_tokens: 60,
            cache_read_tokens: 150,
            cache_write_tokens: 90,
            ..Usage::default()
        };
        let cost = Cost {
            read_usd: 0.15,
            write_usd: 0.9,
            input_usd: 0.15 + 0.9 + 0.6,
            ..Cost::default()
        };
        let billed = bill(&parts, &usage, Some(&cost));
        let tokens: Vec<u64> = billed.iter().map(|b| b.tokens).collect();
        assert_eq!(tokens, [150, 75, 75]);
        assert_eq!(
            (billed[0].read, billed[0].write, billed[0].uncached),
            (150, 0, 0)
        );
        assert!(billed[0].cached() && !billed[1].cached());
        assert_eq!(
            (billed[1].read, billed[1].write, billed[1].uncached),
            (0, 75, 0)
        );
        assert_eq!(
            (billed[2].read, billed[2].write, billed[2].uncached),
            (0, 15, 60)
        );
        let usd: f64 = billed.iter().filter_map(|b| b.usd).sum();
        assert!((usd - cost.input_usd).abs() < 1e-9, "{usd}");
        // Remainders go to the largest: 1/3 each of 100 sums to 100.
        assert_eq!(apportion([1, 1, 1].into_iter(), 3, 100), [34, 33, 33]);
        assert!(bill(&parts, &usage, None).iter().all(|b| b.usd.is_none()));
    }
}

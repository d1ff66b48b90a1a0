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
        let value = serde_json::from_slice::<serde_json::Value>(&unit.bytes).ok();
        let field = |k: &str| {
            value
                .as_ref()
                .and_then(|v| v.get(k))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        };
        let text = value
            .as_ref()
            .and_then(|v| v.as_str().map(str::to_owned).or_else(|| field("text")));
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
                    .as_ref()
                    .and_then(|v| v.get("defer_loading"))
                    .and_then(serde_json::Value::as_bool)
                    == Some(true);
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
}

//! Which agent wrote a prompt, and its vocabulary: its built-in tools and the lines
//! that open each section of its system and context text. Recognised by the
//! prompt's own words (the opening of its system text), never by a header: a
//! stored body is read without its headers, and a proxy's rules may rewrite them.

use super::Family;

/// The agent whose request shape a prompt has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Agent {
    /// Claude Code (and the Agent SDK, which runs it), with the version its
    /// billing header names when it sends one.
    ClaudeCode { version: Option<String> },
    /// The pi coding agent.
    Pi,
    /// OpenAI's Codex CLI.
    Codex,
    /// opencode.
    OpenCode,
    /// A shape promptgate does not know: tools and text are named generically.
    Unknown,
}

/// The openings of Claude Code's own main prompts (2.1.x: `-p` and the SDK, the
/// interactive CLI).
const CLAUDE_CODE_PROMPTS: &[&str] = &[
    "You are an agent working with the user",
    "You are an interactive",
];

/// Claude Code's built-in tools (2.1.x): anything else not `mcp__…` is custom.
const CLAUDE_CODE_TOOLS: &[&str] = &[
    "Agent",
    "AskUserQuestion",
    "Bash",
    "BashOutput",
    "CronCreate",
    "CronDelete",
    "CronList",
    "DeferredToolPlaceholder",
    "Edit",
    "EnterPlanMode",
    "EnterWorktree",
    "ExitPlanMode",
    "ExitWorktree",
    "Glob",
    "Grep",
    "KillShell",
    "ListAgents",
    "ListMcpResourcesTool",
    "LSP",
    "Monitor",
    "MultiEdit",
    "NotebookEdit",
    "Read",
    "ReadMcpResourceTool",
    "ReportFindings",
    "ScheduleWakeup",
    "SendMessage",
    "Skill",
    "SlashCommand",
    "Task",
    "TaskOutput",
    "TaskStop",
    "TodoWrite",
    "ToolSearch",
    "WebFetch",
    "WebSearch",
    "Workflow",
    "Write",
];

/// pi's built-in tools (0.73).
const PI_TOOLS: &[&str] = &["read", "bash", "edit", "write", "grep", "find", "ls"];

/// Codex's built-in tools (0.171): function, freeform and hosted ones.
const CODEX_TOOLS: &[&str] = &[
    "exec_command",
    "write_stdin",
    "shell",
    "apply_patch",
    "update_plan",
    "request_user_input",
    "view_image",
    "get_goal",
    "create_goal",
    "update_goal",
    "tool_search",
    "web_search",
];

/// opencode's built-in tools (1.18).
const OPENCODE_TOOLS: &[&str] = &[
    "bash",
    "edit",
    "glob",
    "grep",
    "list",
    "lsp",
    "multiedit",
    "patch",
    "read",
    "skill",
    "task",
    "todoread",
    "todowrite",
    "webfetch",
    "websearch",
    "codesearch",
    "write",
];

impl Agent {
    /// The agent a system text (its first part) opens like, if any.
    pub(crate) fn from_opening(text: &str) -> Option<Agent> {
        if let Some(rest) = text.strip_prefix("x-anthropic-billing-header:") {
            let version = rest
                .split(';')
                .find_map(|kv| kv.trim().strip_prefix("cc_version="))
                // `2.1.332.1c9`: the version, then a per-prompt suffix.
                .map(|v| v.rsplit_once('.').map_or(v, |(head, _)| head).to_owned());
            return Some(Agent::ClaudeCode { version });
        }
        let openings: [(&str, Agent); 6] = [
            ("You are Claude Code", Agent::ClaudeCode { version: None }),
            (
                "You are a Claude agent, built on Anthropic's Claude Agent SDK",
                Agent::ClaudeCode { version: None },
            ),
            (
                "You are an expert coding assistant operating inside pi",
                Agent::Pi,
            ),
            ("You are Codex", Agent::Codex),
            ("You are OpenCode", Agent::OpenCode),
            // opencode's title call, a conversation of its own on a small model.
            (
                "You are a title generator. You output ONLY a thread title.",
                Agent::OpenCode,
            ),
        ];
        openings
            .into_iter()
            .find(|(opening, _)| text.starts_with(opening))
            .map(|(_, agent)| agent)
    }

    /// How tables and JSON name it: `Claude Code 2.1.332`, `pi`, `unknown`.
    pub(crate) fn label(&self) -> String {
        match self {
            Agent::ClaudeCode { version: Some(v) } => format!("Claude Code {v}"),
            Agent::ClaudeCode { version: None } => "Claude Code".into(),
            Agent::Pi => "pi".into(),
            Agent::Codex => "Codex".into(),
            Agent::OpenCode => "opencode".into(),
            Agent::Unknown => "unknown".into(),
        }
    }

    fn built_in(&self) -> Option<&'static [&'static str]> {
        match self {
            Agent::ClaudeCode { .. } => Some(CLAUDE_CODE_TOOLS),
            Agent::Pi => Some(PI_TOOLS),
            Agent::Codex => Some(CODEX_TOOLS),
            Agent::OpenCode => Some(OPENCODE_TOOLS),
            Agent::Unknown => None,
        }
    }

    /// A tool definition's part name: `built-in Bash`, `MCP server github`,
    /// `custom deploy`, or `tool deploy` when the agent is not known.
    pub(crate) fn tool(&self, name: &str, deferred: bool) -> String {
        let kind = if let Some(rest) = name.strip_prefix("mcp__") {
            // Claude Code's (and the MCP convention's) `mcp__server__tool`.
            let server = rest.split("__").next().unwrap_or(rest);
            format!("MCP server {server}")
        } else {
            match self.built_in() {
                Some(list) if list.contains(&name) => format!("built-in {name}"),
                Some(_) => format!("custom {name}"),
                None => format!("tool {name}"),
            }
        };
        if deferred {
            format!("{kind} (deferred)")
        } else {
            kind
        }
    }

    /// What a system text (a system block, OpenAI instructions, a system or
    /// developer message) opening with `text` is, before any section in it; `turn`:
    /// a system message among the messages (Claude Code's system turn).
    pub(crate) fn system_lead(&self, text: &str, turn: bool) -> (Family, String) {
        let text = text.trim_start();
        let claude_code = matches!(self, Agent::ClaudeCode { .. });
        if claude_code && turn {
            return (Family::Context, "system turn".into());
        }
        let name = if text.starts_with("x-anthropic-billing-header:") {
            "billing header"
        } else if text.starts_with("You are Claude Code")
            || text.starts_with("You are a Claude agent")
        {
            "identity"
        } else if text.starts_with("You are a title generator") {
            "title generator prompt"
        } else if claude_code {
            // Claude Code's own prompts open with its words (2.1.x: the main one,
            // the interactive one, a subagent's); anything else in their place is
            // what `--system-prompt` (or an agent definition) gave.
            if CLAUDE_CODE_PROMPTS.iter().any(|p| text.starts_with(p)) {
                "base prompt"
            } else if text.starts_with("You are an agent for Claude Code") {
                "subagent prompt"
            } else {
                "custom system prompt"
            }
        } else if text.starts_with("You are ") {
            "base prompt"
        } else {
            "system text"
        };
        (Family::System, name.into())
    }

    /// What a `<system-reminder>` whose first line (after the tag) is `line` is,
    /// when it has no `# name` heading: Claude Code's runtime reminders by their
    /// opening words, else `reminder`.
    pub(crate) fn reminder(&self, line: &str) -> (Family, String) {
        let line = line.trim();
        let known: [(&str, Family, &str); 8] = [
            (
                "Attribution for git commits",
                Family::Reminders,
                "attribution",
            ),
            (
                "Codebase and user instructions",
                Family::Memory,
                "memory files",
            ),
            ("Plan mode is active", Family::Reminders, "plan mode"),
            ("The TodoWrite tool", Family::Reminders, "todos"),
            ("Your todo list", Family::Reminders, "todos"),
            ("<new-diagnostics>", Family::Reminders, "diagnostics"),
            (
                "The user opened the file",
                Family::Reminders,
                "file attachment",
            ),
            ("Called the Read tool", Family::Reminders, "file attachment"),
        ];
        known
            .into_iter()
            .find(|(opening, _, _)| line.starts_with(opening))
            .map_or((Family::Reminders, "reminder".into()), |(_, f, n)| {
                (f, n.into())
            })
    }

    /// The first bytes of every line [`Agent::section`] accepts: the naming decodes
    /// only lines that start with one of them.
    pub(crate) const SECTION_STARTS: &'static [u8] = b"<#ACIYST";

    /// The section a line of system or context text opens, if it opens one
    /// (`turn`: in a system message among the messages, not a system block).
    pub(crate) fn section(&self, line: &str, turn: bool) -> Option<(Family, String)> {
        let line = line.trim_end();
        // Shared by every agent: the wrappers the runtimes put around context.
        if let Some(found) = context_tag(line) {
            return Some(found);
        }
        match self {
            Agent::ClaudeCode { .. } => claude_code_section(line, turn),
            Agent::Pi => {
                if line == "# Project Context" {
                    Some((Family::Memory, "project context".into()))
                } else if let Some(path) = line.strip_prefix("## ").filter(|p| p.starts_with('/')) {
                    Some((Family::Memory, format!("{path} (project)")))
                } else if line.starts_with("Current date:") {
                    Some((Family::Context, "date".into()))
                } else if line.starts_with("Current working directory:") {
                    Some((Family::Context, "working directory".into()))
                } else {
                    None
                }
            }
            Agent::OpenCode => {
                if let Some(path) = line.strip_prefix("Instructions from: ") {
                    Some((Family::Memory, format!("{path} (project)")))
                } else if line.starts_with("Skills provide specialized instructions") {
                    Some((Family::Context, "skills".into()))
                } else {
                    None
                }
            }
            Agent::Codex => line
                .strip_prefix("# AGENTS.md instructions for ")
                .map(|dir| (Family::Memory, format!("{dir}/AGENTS.md (project)"))),
            Agent::Unknown => None,
        }
    }
}

/// The XML-ish wrappers agents put context in (`<env>`, `<environment_context>`,
/// Codex's skills, permissions and deferred-tool lists).
fn context_tag(line: &str) -> Option<(Family, String)> {
    // Claude Code's system turn and opencode's system prompt name the model so.
    if line.starts_with("You are powered by the model named") {
        return Some((Family::Context, "model".into()));
    }
    let (family, name) = match line {
        "<env>" | "<environment_context>" => (Family::Context, "environment"),
        "<skills_instructions>" | "<available_skills>" => (Family::Context, "skills"),
        "<permissions instructions>" => (Family::System, "permissions"),
        "<tools>" => (Family::Tools, "deferred tool list"),
        _ => return None,
    };
    Some((family, name.into()))
}

/// Claude Code's sections. In its system prompt only the dynamic ones (its other
/// headings are the static prompt's own): `# Memory` (auto memory) and `# Session-
/// specific guidance`. In its system turn and its reminders: the context keys
/// (`# gitStatus`, camelCase, one word: a memory file's own `# Heading` is not
/// one), a memory file's `Contents of PATH (scope):`, `# Environment`, `# Memory`,
/// and the system turn's paragraphs (deferred tools, agent types, skills, date).
fn claude_code_section(line: &str, turn: bool) -> Option<(Family, String)> {
    // A date line is one wherever it is (older prompts carried it in `system`).
    if line.starts_with("Today's date is ") {
        return Some((Family::Context, "date".into()));
    }
    let heading = line.strip_prefix("# ");
    match heading {
        Some("Memory") => return Some((Family::Memory, "auto memory".into())),
        Some("Session-specific guidance") => {
            return Some((Family::System, "session-specific guidance".into()));
        }
        _ if !turn => return None,
        _ => {}
    }
    let paragraphs: [(&str, Family, &str); 3] = [
        (
            "The following deferred tools are now available",
            Family::Tools,
            "deferred tool list",
        ),
        ("Available agent types", Family::Context, "agent types"),
        (
            "The following skills are available",
            Family::Context,
            "skills",
        ),
    ];
    if let Some((_, family, name)) = paragraphs.iter().find(|(p, _, _)| line.starts_with(p)) {
        return Some((*family, (*name).into()));
    }
    if let Some(file) = line
        .strip_prefix("Contents of ")
        .and_then(|rest| rest.strip_suffix(':'))
    {
        return Some((Family::Memory, memory_file(file)));
    }
    let heading = heading?;
    let key = heading.chars().all(|c| c.is_ascii_alphanumeric())
        && heading.starts_with(|c: char| c.is_ascii_lowercase());
    Some(match heading {
        "claudeMd" => (Family::Memory, "memory files".into()),
        "gitStatus" => (Family::Context, "git status".into()),
        "currentDate" => (Family::Context, "date".into()),
        "userEmail" | "attachedProject" => (Family::Context, heading.into()),
        "Environment" => (Family::Context, "environment".into()),
        "attribution" => (Family::Reminders, "attribution".into()),
        _ if key => (Family::Reminders, format!("reminder {heading}")),
        _ => return None,
    })
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

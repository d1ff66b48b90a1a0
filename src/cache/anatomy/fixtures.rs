//! The anatomy of real agents' requests, recorded into tests/fixtures/anatomy.

use super::{Part, anatomy};
use crate::cache::segment::{IgnoreRule, segment};
use crate::prompt::{Format, Prompt};

/// The agent label and the parts of the recorded body `name`.
fn named(name: &str, format: Format) -> (String, Vec<Part>) {
    let path = format!(
        "{}/tests/fixtures/anatomy/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let body = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let prompt = Prompt::read(bytes::Bytes::from(body), Some(format));
    let segs = segment(&prompt, &[IgnoreRule::billing_header()]).expect("a prompt");
    let named = anatomy(&prompt, &segs);
    let total: u64 = segs.units.iter().map(|u| u64::from(u.tokens)).sum();
    assert_eq!(
        named.parts.iter().map(|p| p.tokens).sum::<u64>(),
        total,
        "{name}: the parts sum to the prompt"
    );
    (named.agent.label(), named.parts)
}

/// `family: name` of each part, in order.
fn names(parts: &[Part]) -> Vec<String> {
    parts
        .iter()
        .map(|p| format!("{}: {}", p.family.name(), p.name))
        .collect()
}

#[test]
fn pi_names_its_project_context_date_and_directory_inside_the_system_block() {
    let (agent, parts) = named("pi-tool-round-2.json", Format::AnthropicMessages);
    assert_eq!(agent, "pi");
    assert_eq!(
        names(&parts),
        [
            "tools: built-in read",
            "tools: built-in bash",
            "tools: built-in edit",
            "tools: built-in write",
            "system: base prompt",
            "memory: project context",
            "memory: /tmp/fx/project/AGENTS.md (project)",
            "context: date",
            "context: working directory",
            "conversation: user prompt",
            "conversation: tool call bash",
            "conversation: tool result of bash",
        ]
    );
    // Its OpenAI provider: the system prompt is a system message, the result a
    // tool message named through the assistant's tool_calls.
    let (agent, parts) = named("pi-openai-tool-round-2.json", Format::OpenAiChat);
    assert_eq!(agent, "pi");
    let listed = names(&parts);
    assert!(listed.contains(&"memory: /tmp/fx/project/AGENTS.md (project)".to_owned()));
    assert_eq!(
        listed.last().map(String::as_str),
        Some("conversation: tool result of bash")
    );
}

#[test]
fn codex_names_its_developer_items_agents_md_and_environment() {
    let (agent, parts) = named("codex-tool-round-2.json", Format::OpenAiResponses);
    assert_eq!(agent, "Codex");
    assert_eq!(
        names(&parts),
        [
            "tools: built-in exec_command",
            "tools: built-in write_stdin",
            "tools: built-in request_user_input",
            "tools: built-in apply_patch",
            "tools: built-in view_image",
            "tools: built-in get_goal",
            "tools: built-in create_goal",
            "tools: built-in update_goal",
            "tools: built-in tool_search",
            "tools: built-in web_search",
            "system: base prompt",
            "context: skills",
            "system: permissions",
            "tools: deferred tool list",
            "memory: /tmp/fx/project/AGENTS.md (project)",
            "context: environment",
            "conversation: user prompt",
            "conversation: tool call exec_command",
            "conversation: tool result of exec_command",
        ]
    );
    // The developer item's three parts share its tokens by their bytes.
    let skills = parts.iter().find(|p| p.name == "skills").map(|p| p.bytes);
    let permissions = parts
        .iter()
        .find(|p| p.name == "permissions")
        .map(|p| p.bytes);
    assert!(skills > permissions, "{skills:?} {permissions:?}");
}

#[test]
fn opencode_names_env_instructions_and_skills_and_its_title_call() {
    let (agent, parts) = named("opencode-tool-round-2.json", Format::AnthropicMessages);
    assert_eq!(agent, "opencode");
    let listed = names(&parts);
    assert_eq!(
        &listed[10..],
        [
            "system: base prompt",
            "context: model",
            "context: environment",
            "memory: /tmp/fx/project/AGENTS.md (project)",
            "context: skills",
            "conversation: user prompt",
            "conversation: tool call bash",
            "conversation: tool result of bash",
        ]
    );
    assert!(
        listed[..10]
            .iter()
            .all(|n| n.starts_with("tools: built-in "))
    );
    let (agent, parts) = named("opencode-title.json", Format::AnthropicMessages);
    assert_eq!(agent, "opencode");
    assert_eq!(names(&parts)[0], "system: title generator prompt");
}

#[test]
fn an_unknown_agent_is_called_unknown_and_its_tools_are_not_guessed() {
    let body = br#"{"model":"m","tools":[{"name":"bash","input_schema":{}}],"system":"Be helpful.","messages":[{"role":"user","content":"hi"}]}"#;
    let prompt = Prompt::read(
        bytes::Bytes::from_static(body),
        Some(Format::AnthropicMessages),
    );
    let segs = segment(&prompt, &[]).expect("a prompt");
    let named = anatomy(&prompt, &segs);
    assert_eq!(named.agent.label(), "unknown");
    assert_eq!(
        names(&named.parts),
        [
            "tools: tool bash",
            "system: system text",
            "conversation: user prompt"
        ]
    );
}

/// The parts of a recorded Claude Code body, less its tools: `family: name`.
fn claude_code(name: &str) -> Vec<String> {
    let (agent, parts) = named(name, Format::AnthropicMessages);
    assert_eq!(agent, "Claude Code 2.1.332", "{name}");
    names(&parts)
        .into_iter()
        .filter(|n| !n.starts_with("tools: built-in"))
        .collect()
}

/// What every Claude Code 2.1.332 `-p` turn carries after its system prompt.
const SYSTEM_TURN: [&str; 6] = [
    "context: environment",
    "context: model",
    "tools: deferred tool list",
    "context: agent types",
    "context: skills",
    "context: date",
];

fn with_turn(head: &[&str], tail: &[&str]) -> Vec<String> {
    head.iter()
        .chain(&SYSTEM_TURN)
        .chain(tail)
        .map(|s| (*s).to_owned())
        .collect()
}

#[test]
fn claude_code_default_names_its_system_blocks_reminders_and_system_turn() {
    assert_eq!(
        claude_code("claude-code-default.json"),
        with_turn(
            &[
                "system: billing header",
                "system: identity",
                "system: base prompt",
                "system: session-specific guidance",
                "memory: auto memory",
                "context: git status",
                "reminders: attribution",
                "conversation: user prompt",
            ],
            &[]
        )
    );
}

#[test]
fn claude_code_modes_change_the_parts_they_should() {
    // --system-prompt: its text in the main prompt's place; no git status.
    let custom = claude_code("claude-code-system-prompt.json");
    assert_eq!(custom[2], "system: custom system prompt");
    assert!(
        !custom.iter().any(|n| n.contains("git status")),
        "{custom:?}"
    );
    // --append-system-prompt: the identity says so; the last paragraph is it.
    let appended = claude_code("claude-code-append-system.json");
    assert_eq!(appended[5], "system: appended prompt", "{appended:?}");
    // --exclude-dynamic-system-prompt-sections: auto memory moves to a reminder
    // and the session guidance is gone from the system prompt.
    let excluded = claude_code("claude-code-exclude-dynamic.json");
    assert_eq!(
        &excluded[..6],
        [
            "system: billing header",
            "system: identity",
            "system: base prompt",
            "context: git status",
            "memory: auto memory",
            "reminders: attribution",
        ]
    );
    // Memory files by path and scope, .claude/rules included.
    let memory = claude_code("claude-code-memory.json");
    for file in [
        "memory: /tmp/cc-fixture/home/.claude/CLAUDE.md (user)",
        "memory: /tmp/cc-fixture/project/CLAUDE.md (project)",
        "memory: /tmp/cc-fixture/project/.claude/rules/testing.md (project)",
        "memory: /tmp/cc-fixture/project/CLAUDE.local.md (local)",
    ] {
        assert!(memory.contains(&file.to_owned()), "{file}: {memory:?}");
    }
    // MCP: with tool search the schemas stay out of `tools` (only the deferred list
    // names them); without it, each tool is its server's.
    let (_, parts) = named("claude-code-mcp-eager.json", Format::AnthropicMessages);
    let acme: Vec<&Part> = parts
        .iter()
        .filter(|p| p.name == "MCP server acme")
        .collect();
    assert_eq!(acme.len(), 2);
    let (_, parts) = named("claude-code-mcp.json", Format::AnthropicMessages);
    assert!(!parts.iter().any(|p| p.name.starts_with("MCP server")));
    // A tool round: the call and its result, named by the call's id.
    let round = claude_code("claude-code-tool-round-2.json");
    assert_eq!(
        &round[round.len() - 2..],
        [
            "conversation: tool call Bash",
            "conversation: tool result of Bash"
        ]
    );
}

#[test]
fn a_claude_code_subagent_has_its_own_prompt() {
    let sub = claude_code("claude-code-subagent-2.json");
    assert_eq!(sub[2], "system: subagent prompt", "{sub:?}");
    // Its system turn opens with the deferred tools.
    assert!(
        sub.iter().any(|n| n == "tools: deferred tool list"),
        "{sub:?}"
    );
    let main = claude_code("claude-code-subagent-3.json");
    assert_eq!(
        &main[main.len() - 2..],
        [
            "conversation: tool call Agent",
            "conversation: tool result of Agent"
        ]
    );
}

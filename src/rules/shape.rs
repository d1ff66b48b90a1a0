//! Where things sit in a Messages or Chat Completions body: system texts, messages,
//! content blocks, tools. Matchers and actions find their targets through here.
//!
//! Anthropic: `system` is a string or text blocks; `role:"system"` messages also hold
//! system text (Claude Code puts its environment there, CLIENTS.md §4). OpenAI chat:
//! the system prompt is a `role:"system"` (or `"developer"`) message.

use std::borrow::Cow;

use super::body::{Items, Node, Peek, ptr};
use super::load::{Cx, Val};

/// Which system text a system matcher or action works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The top-level `system` field.
    System,
    /// `role:"system"` (and `"developer"`) messages.
    Messages,
    Both,
}

pub(crate) fn compile_scope(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Scope> {
    match cx.str(v, "scope")? {
        "system" => Some(Scope::System),
        "messages" => Some(Scope::Messages),
        "both" => Some(Scope::Both),
        other => {
            cx.error(
                v.span(),
                format!("unknown scope {other:?} (known: system, messages, both)"),
            );
            None
        }
    }
}

/// Whether a message role carries system text.
pub(crate) fn is_system_role(role: &str) -> bool {
    role == "system" || role == "developer"
}

/// The pointer tokens of every system text string in `scope`, in document order:
/// `system` itself when it is a string, each text block's `text`, each system
/// message's string `content` or text blocks.
pub(crate) fn text_locations(root: &Node<'_>, scope: Scope) -> Vec<Vec<String>> {
    let root = root.peek();
    let mut out = Vec::new();
    if scope != Scope::Messages
        && let Some(system) = root.child("system")
    {
        collect_texts(system, || Vec::from(ptr!["system"]), &mut out);
    }
    if scope != Scope::System
        && let Some(messages) = root.child("messages")
    {
        for (i, m) in messages.items().enumerate() {
            if !role_is(m, is_system_role) {
                continue;
            }
            if let Some(content) = m.child("content") {
                collect_texts(
                    content,
                    || Vec::from(ptr!["messages", i, "content"]),
                    &mut out,
                );
            }
        }
    }
    out
}

/// A string, or the `text` of each text block of an array.
fn collect_texts(node: Peek<'_, '_>, at: impl Fn() -> Vec<String>, out: &mut Vec<Vec<String>>) {
    if node.is_string() {
        out.push(at());
        return;
    }
    for (j, block) in node.items().enumerate() {
        if is_text_block(block) {
            let mut loc = at();
            loc.push(j.to_string());
            loc.push("text".into());
            out.push(loc);
        }
    }
}

/// A `{"type":"text","text":"…"}` block.
pub(crate) fn is_text_block(block: Peek<'_, '_>) -> bool {
    block.is_object()
        && block.child("type").and_then(|t| t.as_str()).as_deref() == Some("text")
        && block.child("text").is_some_and(|t| t.is_string())
}

/// The tools of the body, in order.
pub(crate) fn tools<'n, 'a>(root: &'n Node<'a>) -> Items<'n, 'a> {
    match root.peek().child("tools") {
        Some(tools) => tools.items(),
        None => Items::None,
    }
}

/// A tool's name (`name`, or OpenAI's `function.name`).
pub(crate) fn tool_name<'n>(tool: Peek<'n, '_>) -> Option<Cow<'n, str>> {
    tool.child("name")
        .and_then(|n| n.as_str())
        .or_else(|| tool.child("function")?.child("name")?.as_str())
}

/// Whether a message's `role` (missing: "") passes `test`.
fn role_is(message: Peek<'_, '_>, test: impl Fn(&str) -> bool) -> bool {
    test(
        message
            .child("role")
            .and_then(|r| r.as_str())
            .as_deref()
            .unwrap_or_default(),
    )
}

/// The index of the first `role:"user"` message.
pub(crate) fn first_user_message(root: &Node<'_>) -> Option<usize> {
    root.peek()
        .child("messages")?
        .items()
        .position(is_user_message)
}

/// Whether a message is a `role:"user"` one.
pub(crate) fn is_user_message(message: Peek<'_, '_>) -> bool {
    role_is(message, |r| r == "user")
}

/// Whether a text is a `<system-reminder>` block (Claude Code's wrapper).
pub(crate) fn is_reminder(text: &str) -> bool {
    text.trim_start().starts_with("<system-reminder>")
}

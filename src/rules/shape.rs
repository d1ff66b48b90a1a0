//! Where things sit in a Messages or Chat Completions body: system texts, messages,
//! content blocks, tools. Matchers and actions find their targets through here.
//!
//! Anthropic: `system` is a string or text blocks; `role:"system"` messages also hold
//! system text (Claude Code puts its environment there, CLIENTS.md §4). OpenAI chat:
//! the system prompt is a `role:"system"` (or `"developer"`) message.

use super::body::{Node, ptr};
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
pub(crate) fn text_locations(root: &mut Node<'_>, scope: Scope) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    if scope != Scope::Messages
        && let Some(system) = root.child("system")
    {
        collect_texts(system, ptr!["system"].to_vec(), &mut out);
    }
    if scope != Scope::System
        && let Some(messages) = root.child("messages")
    {
        let n = messages.len().unwrap_or(0);
        for i in 0..n {
            let Some(m) = messages.child(&i.to_string()) else {
                continue;
            };
            let role = m.str_field("role").unwrap_or_default();
            if !is_system_role(&role) {
                continue;
            }
            if let Some(content) = m.child("content") {
                collect_texts(content, ptr!["messages", i, "content"].to_vec(), &mut out);
            }
        }
    }
    out
}

/// A string, or the `text` of each text block of an array.
fn collect_texts(node: &mut Node<'_>, at: Vec<String>, out: &mut Vec<Vec<String>>) {
    if node.is_string() {
        out.push(at);
        return;
    }
    let n = node.len().unwrap_or(0);
    for j in 0..n {
        let Some(block) = node.child(&j.to_string()) else {
            continue;
        };
        if is_text_block(block) {
            let mut loc = at.clone();
            loc.push(j.to_string());
            loc.push("text".into());
            out.push(loc);
        }
    }
}

/// A `{"type":"text","text":"…"}` block.
pub(crate) fn is_text_block(block: &mut Node<'_>) -> bool {
    block.is_object()
        && block.str_field("type").as_deref() == Some("text")
        && block.child("text").is_some_and(|t| t.is_string())
}

/// The names of the tools (`name`, or OpenAI's `function.name`).
pub(crate) fn tool_names(root: &mut Node<'_>) -> Vec<String> {
    let Some(tools) = root.child("tools") else {
        return Vec::new();
    };
    let n = tools.len().unwrap_or(0);
    (0..n)
        .filter_map(|i| tool_name(tools.child(&i.to_string())?))
        .collect()
}

pub(crate) fn tool_name(tool: &mut Node<'_>) -> Option<String> {
    tool.str_field("name")
        .or_else(|| tool.child("function")?.str_field("name"))
}

/// The index of the first `role:"user"` message.
pub(crate) fn first_user_message(root: &mut Node<'_>) -> Option<usize> {
    let messages = root.child("messages")?;
    let n = messages.len()?;
    (0..n).find(|i| {
        messages
            .child(&i.to_string())
            .and_then(|m| m.str_field("role"))
            .as_deref()
            == Some("user")
    })
}

/// The indices of the `role:"user"` messages.
pub(crate) fn user_messages(root: &mut Node<'_>) -> Vec<usize> {
    let Some(messages) = root.child("messages") else {
        return Vec::new();
    };
    let n = messages.len().unwrap_or(0);
    (0..n)
        .filter(|i| {
            messages
                .child(&i.to_string())
                .and_then(|m| m.str_field("role"))
                .as_deref()
                == Some("user")
        })
        .collect()
}

/// Whether a text is a `<system-reminder>` block (Claude Code's wrapper).
pub(crate) fn is_reminder(text: &str) -> bool {
    text.trim_start().starts_with("<system-reminder>")
}

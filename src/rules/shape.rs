//! Where things sit in a Messages or Chat Completions body: system texts, messages,
//! content blocks, tools. Matchers and actions find their targets through here.
//!
//! Anthropic: `system` is a string or text blocks; `role:"system"` messages also hold
//! system text (Claude Code puts its environment there). OpenAI chat:
//! the system prompt is a `role:"system"` (or `"developer"`) message.

use std::borrow::Cow;
use std::ops::ControlFlow;

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
    let mut out = Vec::new();
    // Never breaks: every location is kept.
    let _ = for_each_text(root.peek(), scope, |_, at| {
        out.push(at());
        ControlFlow::Continue(())
    });
    out
}

/// Whether `test` holds for any system text in `scope` (read where it lies: no
/// pointer is made, and the walk stops at the first text that passes).
pub(crate) fn any_text(root: &Node<'_>, scope: Scope, test: impl Fn(&str) -> bool) -> bool {
    let found = for_each_text(root.peek(), scope, |text, _| {
        if text.as_str().is_some_and(|t| test(&t)) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    found.is_break()
}

/// Calls `f` with each system text string in `scope`, in document order, and a
/// way to make its pointer tokens; stops when `f` breaks.
fn for_each_text<'n, 'a>(
    root: Peek<'n, 'a>,
    scope: Scope,
    mut f: impl FnMut(Peek<'n, 'a>, &dyn Fn() -> Vec<String>) -> ControlFlow<()>,
) -> ControlFlow<()> {
    if scope != Scope::Messages
        && let Some(system) = root.child("system")
    {
        texts_in(system, &|| Vec::from(ptr!["system"]), &mut f)?;
    }
    if scope != Scope::System
        && let Some(messages) = root.child("messages")
    {
        for (i, m) in messages.items().enumerate() {
            if !role_is(m, is_system_role) {
                continue;
            }
            if let Some(content) = m.child("content") {
                texts_in(
                    content,
                    &|| Vec::from(ptr!["messages", i, "content"]),
                    &mut f,
                )?;
            }
        }
    }
    ControlFlow::Continue(())
}

/// A string, or the `text` of each text block of an array.
fn texts_in<'n, 'a>(
    node: Peek<'n, 'a>,
    at: &dyn Fn() -> Vec<String>,
    f: &mut impl FnMut(Peek<'n, 'a>, &dyn Fn() -> Vec<String>) -> ControlFlow<()>,
) -> ControlFlow<()> {
    if node.is_string() {
        return f(node, at);
    }
    for (j, block) in node.items().enumerate() {
        if let Some(text) = text_of_block(block) {
            f(text, &|| {
                let mut loc = at();
                loc.extend(ptr![j, "text"]);
                loc
            })?;
        }
    }
    ControlFlow::Continue(())
}

/// A `{"type":"text","text":"…"}` block.
pub(crate) fn is_text_block(block: Peek<'_, '_>) -> bool {
    text_of_block(block).is_some()
}

/// The `text` of a `{"type":"text","text":"…"}` block.
fn text_of_block<'n, 'a>(block: Peek<'n, 'a>) -> Option<Peek<'n, 'a>> {
    if !block.is_object() || block.child("type")?.as_str().as_deref() != Some("text") {
        return None;
    }
    block.child("text").filter(|t| t.is_string())
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

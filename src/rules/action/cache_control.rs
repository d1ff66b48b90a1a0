//! `cache_control.*`: strip, place and re-time prompt-cache breakpoints
//! (Anthropic's prompt caching). Whatever they do, the limits policy (`limits.rs`) runs after
//! the request rules, so the body sent is one the provider accepts.

use super::ActionError;
use regex::Regex;
use serde_json::{Value, json};

use super::Action;
use crate::rules::body::{Node, Pointer, PointerError, ptr};
use crate::rules::limits::{self, Section};
use crate::rules::load::{Cx, Val};
use crate::rules::{Block, State};
use toml::de::DeValue;

pub(crate) use crate::prompt::Ttl;

/// A `cache_control` marker: `{"type":"ephemeral"}` plus the ttl, if one is given.
pub(crate) fn marker(ttl: Option<Ttl>) -> Value {
    match ttl {
        Some(t) => json!({"type": "ephemeral", "ttl": t.text()}),
        None => json!({"type": "ephemeral"}),
    }
}

pub(crate) fn compile_ttl_text(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Ttl> {
    match cx.str(v, "ttl")? {
        text if Ttl::from_text(text).is_some() => Ttl::from_text(text),
        other => {
            cx.error(
                v.span(),
                format!("unknown ttl {other:?} (the provider knows \"5m\" and \"1h\")"),
            );
            None
        }
    }
}

/// `cache = true | "5m" | "1h"`: a marker, with or without a ttl.
pub(crate) fn compile_cache_flag(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Option<Ttl>> {
    match v.get_ref() {
        DeValue::Boolean(true) => Some(None),
        DeValue::String(_) => compile_ttl_text(cx, v).map(Some),
        _ => {
            cx.error(v.span(), "cache must be true, \"5m\" or \"1h\"");
            None
        }
    }
}

// === cache_control.strip ===

#[derive(Debug)]
struct Strip {
    from: Vec<Section>,
}

impl Action for Strip {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        let mut changed = Vec::new();
        for m in limits::markers(root) {
            if self.from.contains(&m.section) {
                changed.extend(limits::remove_marker(root, &m.block));
            }
        }
        for p in changed {
            st.changed(p);
        }
        Ok(None)
    }
}

pub(super) fn compile_strip(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let all = vec![
        Section::Tools,
        Section::System,
        Section::Messages,
        Section::Top,
    ];
    let from = match v.get_ref() {
        DeValue::Boolean(true) => all,
        DeValue::Table(_) => {
            let t = cx.table(v, "cache_control.strip", &["from"])?;
            let Some(f) = t.get("from") else {
                cx.error(
                    v.span(),
                    "cache_control.strip needs from (e.g. { from = [\"messages\"] })",
                );
                return None;
            };
            let mut out = Vec::new();
            for (name, span) in cx.strings(f, "from")? {
                match Section::from_name(&name) {
                    Some(s) => out.push(s),
                    None => {
                        cx.error(
                            span,
                            format!(
                                "unknown section {name:?} (known: tools, system, messages, top)"
                            ),
                        );
                        return None;
                    }
                }
            }
            out
        }
        _ => {
            cx.error(v.span(), "cache_control.strip must be true or a table such as { from = [\"tools\", \"messages\"] }");
            return None;
        }
    };
    Some(Box::new(Strip { from }))
}

// === cache_control.set ===

#[derive(Debug)]
enum Target {
    LastTool,
    LastSystem,
    SystemIndex(i64),
    SystemMatch(Regex),
    /// The last block (that can carry a marker) of message `n` from the end.
    MessageFromEnd(usize),
}

#[derive(Debug)]
struct Set {
    target: Target,
    ttl: Option<Ttl>,
}

impl Set {
    /// The block the marker goes on.
    fn block(&self, root: &mut Node<'_>) -> Result<Vec<String>, ActionError> {
        match &self.target {
            Target::LastTool => {
                let n = root
                    .child("tools")
                    .and_then(|t| t.len())
                    .filter(|n| *n > 0)
                    .ok_or(ActionError::Missing("tools"))?;
                Ok(Vec::from(ptr!["tools", n - 1]))
            }
            Target::LastSystem | Target::SystemIndex(_) | Target::SystemMatch(_) => {
                if root.child("system").is_none_or(|s| s.is_string()) {
                    let text = root
                        .child("system")
                        .and_then(|s| s.as_str().map(|t| t.into_owned()))
                        .unwrap_or_default();
                    if text.is_empty() {
                        return Err(ActionError::Missing("system text"));
                    }
                    root.set_key(
                        "system",
                        Node::Value(json!([{"type": "text", "text": text}])),
                    );
                }
                let system = root.child("system").ok_or(ActionError::Missing("system"))?;
                let n = system.len().unwrap_or(0);
                let index = match &self.target {
                    Target::LastSystem => n.checked_sub(1),
                    Target::SystemIndex(i) if *i < 0 => n.checked_sub(i.unsigned_abs() as usize),
                    Target::SystemIndex(i) => Some(*i as usize).filter(|i| *i < n),
                    Target::SystemMatch(r) => (0..n).find(|j| {
                        system
                            .child(&j.to_string())
                            .and_then(|b| b.str_field("text"))
                            .is_some_and(|t| r.is_match(&t))
                    }),
                    _ => None,
                };
                let i = index.ok_or(ActionError::NoSystemBlock)?;
                Ok(Vec::from(ptr!["system", i]))
            }
            Target::MessageFromEnd(back) => {
                let n = root
                    .child("messages")
                    .and_then(|m| m.len())
                    .ok_or(ActionError::Missing("messages"))?;
                let i = n
                    .checked_sub(back + 1)
                    .ok_or(ActionError::NoMessageBack(*back))?;
                let content = ptr!["messages", i, "content"];
                super::system::content_as_blocks(root, &content)?;
                let blocks = root
                    .at(&content)
                    .ok_or_else(|| PointerError::Missing(Pointer::text(&content)))?;
                let count = blocks.len().unwrap_or(0);
                let j = (0..count)
                    .rev()
                    .find(|j| {
                        blocks
                            .child(&j.to_string())
                            .is_some_and(|b| limits::ineligible(b.peek()).is_none())
                    })
                    .ok_or(ActionError::NoCarrier(i))?;
                Ok(Vec::from(ptr!["messages", i, "content", j]))
            }
        }
    }
}

impl Action for Set {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        let block = self.block(root)?;
        let missing = || PointerError::Missing(Pointer::text(&block));
        let target = root.at(&block).ok_or_else(missing)?;
        if let Some(why) = limits::ineligible(target.peek()) {
            return Err(ActionError::CannotCarry {
                at: Pointer::text(&block),
                what: why,
            });
        }
        let want = marker(self.ttl);
        if target
            .child("cache_control")
            .is_some_and(|c| c.to_value() == want)
        {
            return Ok(None);
        }
        root.at_mut(&block)
            .ok_or_else(missing)?
            .set_key("cache_control", Node::Value(want));
        let mut p = block;
        p.push("cache_control".into());
        st.changed(Pointer::text(&p));
        Ok(None)
    }
}

pub(super) fn compile_set(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let t = cx.table(
        v,
        "cache_control.set",
        &["target", "index", "match", "from_end", "ttl"],
    )?;
    let Some(target) = t.get("target") else {
        cx.error(v.span(), "cache_control.set needs a target (last_tool, last_system, last_message, system, message)");
        return None;
    };
    let ttl = match t.get("ttl") {
        Some(x) => Some(compile_ttl_text(cx, x)?),
        None => None,
    };
    let name = cx.str(target, "target")?;
    let target = match name {
        "last_tool" => Target::LastTool,
        "last_system" => Target::LastSystem,
        "last_message" => Target::MessageFromEnd(0),
        "system" => match (t.get("index"), t.get("match")) {
            (Some(i), None) => Target::SystemIndex(cx.int(i, "index")?),
            (None, Some(m)) => Target::SystemMatch(cx.regex(m, "match")?),
            _ => {
                cx.error(
                    v.span(),
                    "target \"system\" needs index (0 first, -1 last) or match (a regex)",
                );
                return None;
            }
        },
        "message" => match t.get("from_end") {
            Some(n) => Target::MessageFromEnd(cx.count(n, "from_end", 0..100_000)? as usize),
            None => {
                cx.error(
                    v.span(),
                    "target \"message\" needs from_end (0 is the last message)",
                );
                return None;
            }
        },
        other => {
            cx.error(target.span(), format!("unknown target {other:?} (known: last_tool, last_system, last_message, system, message)"));
            return None;
        }
    };
    Some(Box::new(Set { target, ttl }))
}

// === cache_control.ttl ===

#[derive(Debug)]
struct SetTtl(Ttl);

impl Action for SetTtl {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        let mut changed = Vec::new();
        for m in limits::markers(root) {
            if m.ttl != Some(self.0.text().to_owned()) {
                changed.extend(limits::set_marker_ttl(root, &m.block, Some(self.0)));
            }
        }
        for p in changed {
            st.changed(p);
        }
        Ok(None)
    }
}

pub(super) fn compile_ttl(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    Some(Box::new(SetTtl(compile_ttl_text(cx, v)?)))
}

// === cache_control.max_breakpoints ===

#[derive(Debug)]
struct Max(usize);

impl Action for Max {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let max = st.effects.max_breakpoints.map_or(self.0, |m| m.min(self.0));
        st.effects.max_breakpoints = Some(max);
        Ok(None)
    }
}

pub(super) fn compile_max(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let n = cx.count(v, "cache_control.max_breakpoints", 0..5)?;
    Some(Box::new(Max(n as usize)))
}

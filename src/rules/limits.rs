//! The cache_control policy: whatever rules ask, the body sent is one the provider
//! accepts (at most 4 breakpoints; a 1h entry before a 5m one).
//!
//! Runs after the request rules whenever they changed the body. In processing order
//! (tools → system → messages, then top-level automatic caching, which uses a slot):
//! 1. a marker on a thinking, redacted_thinking or empty text block is removed;
//! 2. a `1h` marker after a `5m` one is lowered to 5m (its `ttl` removed: the cheaper
//!    reading of a request the provider would refuse);
//! 3. an explicit marker on the block automatic caching lands on is removed when
//!    their ttls differ (the provider refuses that);
//! 4. while there are more than 4 breakpoints (or the rule's `max_breakpoints`), the
//!    earliest explicit marker is removed: later breakpoints cover longer prefixes.
//!
//! Each fix is returned, and recorded on the exchange (log line and body diff).

use std::fmt;

use serde_json::Value;

use super::action::Ttl;
use super::body::{Node, Peek, Pointer, ptr};

/// The provider's limit on breakpoints per request.
pub(crate) const MAX_BREAKPOINTS: usize = 4;

/// Where a marker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    Tools,
    System,
    Messages,
    /// Top-level automatic caching.
    Top,
}

impl Section {
    pub(crate) fn from_name(name: &str) -> Option<Section> {
        match name {
            "tools" => Some(Section::Tools),
            "system" => Some(Section::System),
            "messages" => Some(Section::Messages),
            "top" => Some(Section::Top),
            _ => None,
        }
    }
}

/// One `cache_control` marker of a body.
#[derive(Debug, Clone)]
pub(crate) struct Marker {
    pub(crate) section: Section,
    /// The object carrying it (empty: the body itself, for top-level caching).
    pub(crate) block: Vec<String>,
    /// Its ttl as written (`None`: the 5m default).
    pub(crate) ttl: Option<String>,
    /// Why its block cannot carry a marker, if it cannot.
    pub(crate) ineligible: Option<&'static str>,
}

impl Marker {
    fn is_1h(&self) -> bool {
        self.ttl.as_deref() == Some("1h")
    }
}

/// Why a block cannot carry cache_control, if it cannot.
pub(crate) fn ineligible(block: Peek<'_, '_>) -> Option<&'static str> {
    match block.child("type").and_then(|t| t.as_str()).as_deref() {
        Some("thinking") => Some("a thinking block"),
        Some("redacted_thinking") => Some("a redacted_thinking block"),
        Some("text") if block.child("text").is_some_and(|t| t.is_empty_str()) => {
            Some("an empty text block")
        }
        _ => None,
    }
}

fn marker_at(
    node: Peek<'_, '_>,
    section: Section,
    block: impl FnOnce() -> Vec<String>,
) -> Option<Marker> {
    if !node.may_hold_cache_control() {
        return None;
    }
    // Keys compare decoded: `cache\u005fcontrol` is a breakpoint to the provider.
    let cc = node.child("cache_control")?;
    let ttl = cc
        .child("ttl")
        .and_then(|t| t.as_str().map(|s| s.into_owned()));
    let ineligible = if section == Section::Top {
        None
    } else {
        ineligible(node)
    };
    Some(Marker {
        section,
        block: block(),
        ttl,
        ineligible,
    })
}

/// Every marker, in processing order; top-level automatic caching last. Reads
/// through the body's index: nothing is opened or decoded but the markers.
pub(crate) fn markers(root: &Node<'_>) -> Vec<Marker> {
    let root = root.peek();
    let mut out = Vec::new();
    if let Some(tools) = root.child("tools") {
        for (i, tool) in tools.items().enumerate() {
            out.extend(marker_at(tool, Section::Tools, || {
                Vec::from(ptr!["tools", i])
            }));
        }
    }
    if let Some(system) = root.child("system") {
        for (i, block) in system.items().enumerate() {
            out.extend(marker_at(block, Section::System, || {
                Vec::from(ptr!["system", i])
            }));
        }
    }
    if let Some(messages) = root.child("messages") {
        for (i, message) in messages.items().enumerate() {
            if !message.may_hold_cache_control() {
                continue;
            }
            let Some(content) = message.child("content") else {
                continue;
            };
            for (j, block) in content.items().enumerate() {
                out.extend(marker_at(block, Section::Messages, || {
                    Vec::from(ptr!["messages", i, "content", j])
                }));
            }
        }
    }
    out.extend(marker_at(root, Section::Top, Vec::new));
    out
}

/// The block top-level automatic caching lands on: the last one that can carry a
/// marker, walking back through messages, then system, then tools.
fn last_cacheable(root: &Node<'_>) -> Option<Vec<String>> {
    let root = root.peek();
    if let Some(messages) = root.child("messages") {
        let messages: Vec<Peek<'_, '_>> = messages.items().collect();
        for (i, message) in messages.into_iter().enumerate().rev() {
            let Some(content) = message.child("content") else {
                continue;
            };
            // A string content has no block to carry a marker of its own.
            let blocks: Vec<Peek<'_, '_>> = content.items().collect();
            if let Some(j) = blocks.iter().rposition(|b| ineligible(*b).is_none()) {
                return Some(Vec::from(ptr!["messages", i, "content", j]));
            }
        }
    }
    if let Some(system) = root.child("system")
        && let Some(j) = system
            .items()
            .collect::<Vec<_>>()
            .iter()
            .rposition(|b| ineligible(*b).is_none())
    {
        return Some(Vec::from(ptr!["system", j]));
    }
    let n = root.child("tools")?.len()?;
    n.checked_sub(1).map(|i| Vec::from(ptr!["tools", i]))
}

/// Removes the marker of `block`; returns the pointer removed.
pub(crate) fn remove_marker(root: &mut Node<'_>, block: &[String]) -> Option<String> {
    root.at_mut(block)?.remove_key("cache_control").then(|| {
        let mut p = block.to_vec();
        p.push("cache_control".into());
        Pointer::text(&p)
    })
}

/// Sets (or, with `None`, removes) the ttl of the marker of `block`, keeping its
/// other fields (`scope`, …).
pub(crate) fn set_marker_ttl(
    root: &mut Node<'_>,
    block: &[String],
    ttl: Option<Ttl>,
) -> Option<String> {
    let mut p = block.to_vec();
    p.push("cache_control".into());
    let cc = root.at_mut(&p)?;
    match ttl {
        Some(t) => {
            cc.set_key("ttl", Node::Value(Value::String(t.text().into())));
        }
        None => {
            cc.remove_key("ttl");
        }
    }
    p.push("ttl".into());
    Some(Pointer::text(&p))
}

/// One change the policy made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fix {
    pub(crate) pointer: String,
    pub(crate) what: String,
}

impl fmt::Display for Fix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {}", self.what, self.pointer)
    }
}

/// Applies the policy; returns what it changed.
pub(crate) fn enforce(root: &mut Node<'_>, max: usize) -> Vec<Fix> {
    let mut fixes = Vec::new();
    let mut kept = Vec::new();
    for m in markers(root) {
        match m.ineligible {
            Some(why) => {
                if let Some(pointer) = remove_marker(root, &m.block) {
                    fixes.push(Fix {
                        pointer,
                        what: format!("removed cache_control from {why}"),
                    });
                }
            }
            None => kept.push(m),
        }
    }
    let mut seen_5m = false;
    for m in &mut kept {
        if m.is_1h() && seen_5m {
            if let Some(pointer) = set_marker_ttl(root, &m.block, None) {
                fixes.push(Fix {
                    pointer,
                    what: "lowered ttl 1h to 5m (a 1h breakpoint may not follow a 5m one)".into(),
                });
            }
            m.ttl = None;
        }
        if !m.is_1h() {
            seen_5m = true;
        }
    }
    // Automatic caching lands on the last cacheable block: an explicit marker there
    // with another ttl is refused. Automatic caching always counts as a slot.
    if let Some(top) = kept.iter().find(|m| m.section == Section::Top).cloned()
        && let Some(last) = last_cacheable(root)
        && let Some(at) = kept.iter().position(|m| m.block == last)
        && kept[at].ttl.as_deref().unwrap_or("5m") != top.ttl.as_deref().unwrap_or("5m")
    {
        if let Some(pointer) = remove_marker(root, &last) {
            fixes.push(Fix {
                pointer,
                what: "removed a breakpoint whose ttl differs from top-level automatic caching on the same block".into(),
            });
        }
        kept.remove(at);
    }
    let mut count = kept.len();
    let mut explicit = kept.iter().filter(|m| m.section != Section::Top);
    while count > max {
        let Some(m) = explicit
            .next()
            .or_else(|| kept.iter().find(|m| m.section == Section::Top))
        else {
            break;
        };
        if let Some(pointer) = remove_marker(root, &m.block) {
            fixes.push(Fix {
                pointer,
                what: format!("removed the earliest breakpoint (more than {max})"),
            });
        }
        count -= 1;
    }
    fixes
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::rules::body::{BodyStore, LazyBody};

    /// The blocks `markers` finds in `body`, with their ttl and why they are ineligible.
    fn found(body: &str) -> Vec<(Vec<String>, Option<String>, Option<&'static str>)> {
        let bytes = Bytes::copy_from_slice(body.as_bytes());
        let cell = crate::prompt::PromptCell::new(bytes.clone(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, &store);
        markers(lazy.root().expect("a JSON object"))
            .into_iter()
            .map(|m| (m.block, m.ttl, m.ineligible))
            .collect()
    }

    #[test]
    fn markers_are_found_through_the_model_and_a_malformed_body_has_none() {
        let body = r#"{"tools":[{"name":"a"},{"name":"b","cache_control":{"type":"ephemeral"}}],
            "system":[{"type":"text","text":"s","cache\u005fcontrol":{"type":"ephemeral"}},
                      {"type":"text","text":"says cache_control","cache\u005fcontrol":{"type":"ephemeral","ttl":"1h"}}],
            "messages":[{"role":"user","content":"plain"},
                        {"role":"assistant","content":[{"type":"thinking","thinking":"t","cache_control":{"type":"ephemeral"}},
                                                       {"type":"text","text":"","cache_control":{"type":"ephemeral","ttl":"5m"}}]}],
            "cache_control":{"type":"ephemeral"}"#;
        let want = vec![
            (Vec::from(ptr!["tools", 1]), None, None),
            // Spelt with an escape, the key is a marker all the same.
            (Vec::from(ptr!["system", 0]), None, None),
            (Vec::from(ptr!["system", 1]), Some("1h".into()), None),
            (
                Vec::from(ptr!["messages", 1, "content", 0]),
                None,
                Some("a thinking block"),
            ),
            (
                Vec::from(ptr!["messages", 1, "content", 1]),
                Some("5m".into()),
                Some("an empty text block"),
            ),
            (Vec::new(), None, None),
        ];
        assert_eq!(found(&format!("{body}}}")), want);
        // Malformed anywhere is not an object, to rules as to every other reader.
        let bytes = Bytes::from(format!(r#"{body},"x":[1}}}}"#));
        let cell = crate::prompt::PromptCell::new(bytes.clone(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, &store);
        let e = lazy.root().map(|_| ()).unwrap_err();
        assert!(
            matches!(e, crate::rules::body::BodyError::Malformed(_)),
            "{e}"
        );
    }
}

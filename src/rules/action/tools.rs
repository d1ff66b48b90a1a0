//! `tools.remove` and `tools.allow`: drop tool definitions by name glob.

use super::ActionError;
use globset::GlobSet;

use super::Action;
use crate::rules::body::{Node, ptr};
use crate::rules::load::{Cx, Val};
use crate::rules::shape;
use crate::rules::{Block, State};

#[derive(Debug)]
struct Tools {
    globs: GlobSet,
    /// true: keep only matches (allowlist); false: remove matches.
    keep_matches: bool,
}

impl Action for Tools {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        let mut n = 0;
        let mut drop = Vec::new();
        let mut last_marker = None;
        for (i, tool) in shape::tools(root).enumerate() {
            n = i + 1;
            let name = shape::tool_name(tool).unwrap_or_default();
            if self.globs.is_match(name.as_ref()) != self.keep_matches {
                if tool.may_hold_cache_control() {
                    last_marker = tool.child("cache_control").map(|c| c.to_value());
                }
                drop.push(i);
            }
        }
        if drop.is_empty() {
            return Ok(None);
        }
        // A breakpoint on the last tool caches all tools: keep it on the new last one.
        let moved = if drop.last() == Some(&(n - 1)) {
            last_marker
        } else {
            None
        };
        let tools = root
            .at_mut(&ptr!["tools"])
            .ok_or(ActionError::Missing("tools"))?;
        for i in drop.iter().rev() {
            tools.remove_index(*i);
        }
        let left = tools.len().unwrap_or(0);
        let mut changed: Vec<String> = drop.iter().map(|i| format!("/tools/{i}")).collect();
        if let (Some(marker), Some(last)) = (moved, left.checked_sub(1))
            && let Some(tool) = root.at_mut(&ptr!["tools", last])
            && !tool.has("cache_control")
        {
            tool.set_key("cache_control", Node::Value(marker));
            changed.push(format!("/tools/{last}/cache_control"));
        }
        for p in changed {
            st.changed(p);
        }
        Ok(None)
    }
}

fn compile(cx: &mut Cx<'_>, v: &Val<'_>, keep_matches: bool) -> Option<Box<dyn Action>> {
    let what = if keep_matches {
        "tools.allow"
    } else {
        "tools.remove"
    };
    let (globs, _) = cx.globs(v, what)?;
    if let Some(warning) = crate::rules::deferred::tools_edit_warning(&globs, keep_matches) {
        cx.warn(v.span(), warning);
    }
    Some(Box::new(Tools {
        globs,
        keep_matches,
    }))
}

pub(super) fn compile_remove(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    compile(cx, v, false)
}

pub(super) fn compile_allow(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    compile(cx, v, true)
}

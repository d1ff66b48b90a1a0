//! `json.set`, `json.remove`, `json.append`: edits at RFC 6901 pointers.

use super::ActionError;
use serde_json::Value;

use super::Action;
use crate::rules::body::{self, Pointer};
use crate::rules::load::{Cx, Val};
use crate::rules::{Block, State};

#[derive(Debug)]
enum Op {
    Set(Value),
    Remove,
    Append(Value),
}

#[derive(Debug)]
struct JsonEdit {
    pointer: Pointer,
    op: Op,
}

impl Action for JsonEdit {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        let tokens = &self.pointer.0;
        let changed = match &self.op {
            Op::Set(v) => body::set(root, tokens, v.clone()).map(|()| true)?,
            Op::Remove => body::remove(root, tokens)?,
            Op::Append(v) => body::append(root, tokens, v.clone()).map(|()| true)?,
        };
        if changed {
            st.changed(self.pointer.to_string());
        }
        Ok(None)
    }
}

fn pointer_and_value(cx: &mut Cx<'_>, v: &Val<'_>, what: &str) -> Option<(Pointer, Value)> {
    let t = cx.table(v, what, &["pointer", "value"])?;
    let Some(p) = t.get("pointer") else {
        cx.error(
            v.span(),
            format!(
                "{what} needs pointer and value (e.g. {{ pointer = \"/temperature\", value = 0 }})"
            ),
        );
        return None;
    };
    let Some(value) = t.get("value") else {
        cx.error(v.span(), format!("{what} needs a value"));
        return None;
    };
    let pointer = cx.pointer(p, "pointer")?;
    if pointer.0.is_empty() {
        cx.error(
            p.span(),
            "the pointer \"\" is the whole body; name a part of it (e.g. \"/temperature\")",
        );
        return None;
    }
    Some((pointer, cx.json(value)?))
}

pub(super) fn compile_set(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let (pointer, value) = pointer_and_value(cx, v, "json.set")?;
    Some(Box::new(JsonEdit {
        pointer,
        op: Op::Set(value),
    }))
}

pub(super) fn compile_append(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let (pointer, value) = pointer_and_value(cx, v, "json.append")?;
    Some(Box::new(JsonEdit {
        pointer,
        op: Op::Append(value),
    }))
}

pub(super) fn compile_remove(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let pointer = cx.pointer(v, "json.remove")?;
    if pointer.0.is_empty() {
        cx.error(
            v.span(),
            "the pointer \"\" is the whole body; name a part of it (e.g. \"/metadata\")",
        );
        return None;
    }
    Some(Box::new(JsonEdit {
        pointer,
        op: Op::Remove,
    }))
}

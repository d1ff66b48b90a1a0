//! `model.map`, `model.allow`, `max_tokens.clamp`, `metadata.user_id.*`: what is
//! asked of the model.

use super::ActionError;
use globset::GlobMatcher;
use serde_json::{Value, json};
use toml::de::DeValue;

use super::Action;
use crate::rules::body::{Node, ptr};
use crate::rules::load::{Cx, Val};
use crate::rules::{Block, State};

// === model.map ===

#[derive(Debug)]
struct Map(Vec<(GlobMatcher, String)>);

impl Action for Map {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let Some(current) = st.model.clone() else {
            return Ok(None);
        };
        let Some((_, to)) = self.0.iter().find(|(g, _)| g.is_match(&current)) else {
            return Ok(None);
        };
        if *to == current {
            return Ok(None);
        }
        let root = st.root()?;
        root.set_key("model", Node::Value(Value::String(to.clone())));
        st.model = Some(to.clone());
        st.changed("/model".into());
        Ok(None)
    }
}

pub(super) fn compile_map(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let DeValue::Table(t) = v.get_ref() else {
        cx.error(v.span(), "model.map is a table of glob = model, e.g. { \"claude-opus-*\" = \"claude-sonnet-5-5\" }");
        return None;
    };
    let mut out = Vec::new();
    for (k, to) in t.iter() {
        let glob = cx.glob_text(k.get_ref(), k.span())?;
        out.push((glob, cx.str(to, "the model to map to")?.to_owned()));
    }
    Some(Box::new(Map(out)))
}

// === model.allow ===

#[derive(Debug)]
struct Allow {
    globs: globset::GlobSet,
    texts: Vec<String>,
}

impl Action for Allow {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let model = st.model.clone().unwrap_or_default();
        if self.globs.is_match(&model) {
            return Ok(None);
        }
        Ok(Some(Block {
            status: crate::rules::BLOCK_STATUS,
            error_type: None,
            message: format!(
                "model {model:?} is not allowed here (allowed: {})",
                self.texts.join(", ")
            ),
            rule: st.rule.clone(),
            retry_after: None,
        }))
    }
}

pub(super) fn compile_allow(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let (globs, texts) = cx.globs(v, "model.allow")?;
    Some(Box::new(Allow { globs, texts }))
}

// === max_tokens.clamp ===

#[derive(Debug)]
struct Clamp(u64);

const TOKEN_FIELDS: &[&str] = &["max_tokens", "max_completion_tokens", "max_output_tokens"];

impl Action for Clamp {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        let mut changed = Vec::new();
        for field in TOKEN_FIELDS {
            let over = root
                .child(field)
                .and_then(|n| n.as_u64())
                .is_some_and(|n| n > self.0);
            if over {
                root.set_key(field, Node::Value(json!(self.0)));
                changed.push(format!("/{field}"));
            }
        }
        // Anthropic requires thinking.budget_tokens < max_tokens.
        let budget = ptr!["thinking", "budget_tokens"];
        let limit = self.0.saturating_sub(1);
        if !changed.is_empty()
            && root
                .at(&budget)
                .and_then(|n| n.as_u64())
                .is_some_and(|b| b > limit)
            && let Some(thinking) = root.at_mut(&ptr!["thinking"])
        {
            thinking.set_key("budget_tokens", Node::Value(json!(limit)));
            changed.push("/thinking/budget_tokens".into());
        }
        for p in changed {
            st.changed(p);
        }
        Ok(None)
    }
}

pub(super) fn compile_clamp(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    Some(Box::new(Clamp(cx.count(
        v,
        "max_tokens.clamp",
        1..i64::MAX,
    )?)))
}

// === metadata.user_id.set / remove ===

#[derive(Debug)]
struct UserId(Option<String>);

impl Action for UserId {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        match &self.0 {
            Some(id) => {
                let current = root
                    .at(&ptr!["metadata", "user_id"])
                    .and_then(|n| n.as_str().map(|s| s.into_owned()));
                if current.as_deref() == Some(id.as_str()) {
                    return Ok(None);
                }
                match root.child("metadata") {
                    Some(m) if m.is_object() => {
                        root.at_mut(&ptr!["metadata"])
                            .ok_or(ActionError::Missing("metadata"))?
                            .set_key("user_id", Node::Value(Value::String(id.clone())));
                    }
                    _ => {
                        root.set_key("metadata", Node::Value(json!({"user_id": id})));
                    }
                }
                st.changed("/metadata/user_id".into());
            }
            None => {
                if crate::rules::body::remove(root, &ptr!["metadata", "user_id"])? {
                    st.changed("/metadata/user_id".into());
                }
            }
        }
        Ok(None)
    }
}

pub(super) fn compile_user_id_set(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let (id, _) = cx.env_string(v, "metadata.user_id.set")?;
    Some(Box::new(UserId(Some(id))))
}

pub(super) fn compile_user_id_remove(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    if !cx.bool(v, "metadata.user_id.remove")? {
        cx.error(
            v.span(),
            "metadata.user_id.remove = false does nothing; write true or drop the action",
        );
        return None;
    }
    Some(Box::new(UserId(None)))
}

//! `system.*`: add, rewrite, remove and move system prompt text, in the `system`
//! field, in `role:"system"` messages, or both.

use super::ActionError;
use std::collections::HashMap;
use std::sync::Mutex;

use regex::Regex;
use serde_json::{Value, json};

use super::Action;
use super::cache_control::Ttl;
use crate::provider::Provider;
use crate::rules::body::{Node, Pointer, PointerError, ptr};
use crate::rules::load::{Cx, Val};
use crate::rules::shape::{self, Scope};
use crate::rules::{Block, State};

// === system.prepend / system.append ===

#[derive(Debug)]
struct Add {
    first: bool,
    text: String,
    cache: Option<Option<Ttl>>,
    scope: Scope,
}

impl Add {
    fn block(&self) -> Value {
        let mut block = json!({"type": "text", "text": self.text});
        if let Some(ttl) = self.cache {
            block["cache_control"] = super::cache_control::marker(ttl);
        }
        block
    }
}

impl Action for Add {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        // OpenAI chat bodies have no `system` field: their system prompt is a message.
        let scope = if st.info.provider == Provider::OpenAi {
            Scope::Messages
        } else {
            self.scope
        };
        let provider = st.info.provider;
        let root = st.root()?;
        let changed = match scope {
            Scope::Messages => add_to_system_message(root, provider, self)?,
            _ => {
                system_as_blocks(root);
                let system = root
                    .at_mut(&ptr!["system"])
                    .ok_or(ActionError::Missing("system"))?;
                let n = system.len().unwrap_or(0);
                let at = if self.first { 0 } else { n };
                system.insert(at, Node::Value(self.block()));
                format!("/system/{at}")
            }
        };
        st.changed(changed);
        Ok(None)
    }
}

/// Makes `system` an array of blocks: created when missing, a string wrapped in a
/// text block (an empty string becomes no block).
fn system_as_blocks(root: &mut Node<'_>) {
    match root.child("system") {
        Some(s) if s.is_array() => {}
        Some(s) => {
            let text = s.as_str().map(|t| t.into_owned()).unwrap_or_default();
            let blocks = if text.is_empty() {
                json!([])
            } else {
                json!([{"type": "text", "text": text}])
            };
            root.set_key("system", Node::Value(blocks));
        }
        None => {
            root.set_key("system", Node::Value(json!([])));
        }
    }
}

fn add_to_system_message(
    root: &mut Node<'_>,
    provider: Provider,
    add: &Add,
) -> Result<String, ActionError> {
    let found = {
        let messages = root
            .child("messages")
            .ok_or(ActionError::Missing("messages"))?;
        let n = messages
            .len()
            .ok_or_else(|| PointerError::NotArray("/messages".into()))?;
        (0..n).find(|i| {
            messages
                .child(&i.to_string())
                .and_then(|m| m.str_field("role"))
                .is_some_and(|r| shape::is_system_role(&r))
        })
    };
    let Some(i) = found else {
        if provider != Provider::OpenAi {
            return Err(ActionError::NoSystemMessage);
        }
        let messages = root
            .at_mut(&ptr!["messages"])
            .ok_or(ActionError::Missing("messages"))?;
        messages.insert(
            0,
            Node::Value(json!({"role": "system", "content": add.text})),
        );
        return Ok("/messages/0".into());
    };
    let content = ptr!["messages", i, "content"];
    content_as_blocks(root, &content)?;
    let missing = || PointerError::Missing(Pointer::text(&content));
    let node = root.at_mut(&content).ok_or_else(missing)?;
    let n = node.len().unwrap_or(0);
    let at = if add.first { 0 } else { n };
    let mut block = add.block();
    if provider == Provider::OpenAi {
        block.as_object_mut().map(|o| o.remove("cache_control"));
    }
    node.insert(at, Node::Value(block));
    Ok(format!("/messages/{i}/content/{at}"))
}

/// Makes a message's `content` an array of blocks (a string becomes one text block).
pub(super) fn content_as_blocks(
    root: &mut Node<'_>,
    content: &[String],
) -> Result<(), ActionError> {
    let node = root
        .at(content)
        .ok_or_else(|| PointerError::Missing(Pointer::text(content)))?;
    if node.is_array() {
        return Ok(());
    }
    let text = node
        .as_str()
        .ok_or_else(|| ActionError::NotContent(Pointer::text(content)))?
        .into_owned();
    let blocks = if text.is_empty() {
        json!([])
    } else {
        json!([{"type": "text", "text": text}])
    };
    let missing = || PointerError::Missing(Pointer::text(content));
    let (last, parent) = content.split_last().ok_or_else(missing)?;
    root.at_mut(parent)
        .ok_or_else(missing)?
        .set_key(last, Node::Value(blocks));
    Ok(())
}

fn compile_add(cx: &mut Cx<'_>, v: &Val<'_>, first: bool) -> Option<Box<dyn Action>> {
    let what = if first {
        "system.prepend"
    } else {
        "system.append"
    };
    let t = cx.table(v, what, &["text", "cache", "scope"])?;
    let Some(text) = t.get("text") else {
        cx.error(
            v.span(),
            format!("{what} needs text (e.g. {{ text = \"ACME policy: …\" }})"),
        );
        return None;
    };
    let text = cx.str(text, "text")?.to_owned();
    if text.is_empty() {
        cx.error(
            v.span(),
            "text must not be empty (an empty text block is refused by the provider)",
        );
        return None;
    }
    let cache = match t.get("cache") {
        None => None,
        Some(c) => Some(super::cache_control::compile_cache_flag(cx, c)?),
    };
    let scope = match t.get("scope") {
        Some(s) => shape::compile_scope(cx, s)?,
        None => Scope::System,
    };
    if scope == Scope::Both {
        cx.error(
            t.get("scope")?.span(),
            format!("{what} adds one block: scope must be \"system\" or \"messages\""),
        );
        return None;
    }
    Some(Box::new(Add {
        first,
        text,
        cache,
        scope,
    }))
}

pub(super) fn compile_prepend(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    compile_add(cx, v, true)
}

pub(super) fn compile_append(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    compile_add(cx, v, false)
}

// === removing a text and what holds it ===

/// Removes the text at `loc` together with its block; a system message left
/// without content goes too. Returns the pointer removed.
pub(super) fn remove_text_at(root: &mut Node<'_>, loc: &[String]) -> Option<String> {
    match loc {
        [system] if system == "system" => root
            .at_mut(&[])?
            .remove_key("system")
            .then(|| "/system".to_owned()),
        [system, j, _text] if system == "system" => {
            let i: usize = j.parse().ok()?;
            root.at_mut(&ptr!["system"])?
                .remove_index(i)
                .then(|| format!("/system/{i}"))
        }
        [messages, i, _content] if messages == "messages" => {
            let i: usize = i.parse().ok()?;
            root.at_mut(&ptr!["messages"])?
                .remove_index(i)
                .then(|| format!("/messages/{i}"))
        }
        [messages, i, content, j, _text] if messages == "messages" => {
            let (i, j): (usize, usize) = (i.parse().ok()?, j.parse().ok()?);
            let blocks = ptr!["messages", i, content];
            if root.at(&blocks)?.len() == Some(1) {
                return root
                    .at_mut(&ptr!["messages"])?
                    .remove_index(i)
                    .then(|| format!("/messages/{i}"));
            }
            root.at_mut(&blocks)?
                .remove_index(j)
                .then(|| format!("/messages/{i}/content/{j}"))
        }
        _ => None,
    }
}

/// Sets the text at `loc`, or removes its block when the new text is blank.
pub(super) fn set_text_at(root: &mut Node<'_>, loc: &[String], text: String) -> Option<String> {
    if text.trim().is_empty() {
        return remove_text_at(root, loc);
    }
    let (last, parent) = loc.split_last()?;
    root.at_mut(parent)?
        .set_key(last, Node::Value(Value::String(text)));
    Some(Pointer::text(loc))
}

/// Runs `edit` on every system text in `scope`; a `Some` result replaces the text
/// (blank: its block is removed). Records the changed pointers.
fn edit_texts(
    st: &mut State<'_, '_>,
    scope: Scope,
    memo: Option<&EditMemo>,
    edit: impl Fn(&str) -> Option<String>,
) -> Result<Option<Block>, ActionError> {
    let root = st.root()?;
    let mut changed = Vec::new();
    // Last first, so removing a block leaves earlier locations valid.
    for loc in shape::text_locations(root, scope).into_iter().rev() {
        let Some(node) = root.at(&loc) else {
            continue;
        };
        let decode_and_edit = || node.as_str().and_then(|t| edit(&t));
        let new = match (memo, node.raw_text()) {
            (Some(memo), Some(raw)) if raw.len() >= EditMemo::MIN_LEN => {
                memo.get_or_insert(raw, decode_and_edit)
            }
            _ => decode_and_edit(),
        };
        if let Some(new) = new {
            changed.extend(set_text_at(root, &loc, new));
        }
    }
    for p in changed.into_iter().rev() {
        st.changed(p);
    }
    Ok(None)
}

// === system.replace ===

#[derive(Debug)]
struct Replace {
    regex: Regex,
    with: String,
    scope: Scope,
    memo: EditMemo,
}

/// What an edit made of long texts it saw before, by their bytes as sent. Agents
/// resend their system prompt byte for byte on every request (that is what makes
/// it cacheable), so rewriting it decodes and searches it once, not per request.
/// Belongs to one compiled action: a reloaded rule starts empty.
#[derive(Debug, Default)]
pub(super) struct EditMemo(Mutex<Memo>);

#[derive(Debug, Default)]
struct Memo {
    done: HashMap<Box<[u8]>, Option<String>, foldhash::fast::RandomState>,
    /// Bytes held, texts and results.
    held: usize,
}

impl EditMemo {
    /// Shorter texts are decoded each time: hashing them costs about as much.
    const MIN_LEN: usize = 1024;
    /// Bytes kept at most; past that the memo starts again (a bound, not an LRU).
    const MAX_HELD: usize = 8 << 20;

    fn get_or_insert(&self, raw: &[u8], edit: impl FnOnce() -> Option<String>) -> Option<String> {
        // A panic elsewhere while holding it leaves at worst a complete entry.
        let lock = || self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(done) = lock().done.get(raw) {
            return done.clone();
        }
        let done = edit();
        let size = raw.len() + done.as_ref().map_or(0, String::len);
        if size > Self::MAX_HELD / 4 {
            return done;
        }
        let mut memo = lock();
        if memo.held + size > Self::MAX_HELD {
            memo.done.clear();
            memo.held = 0;
        }
        if memo.done.insert(raw.into(), done.clone()).is_none() {
            memo.held += size;
        }
        done
    }
}

impl Action for Replace {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        edit_texts(st, self.scope, Some(&self.memo), |text| {
            let new = self.regex.replace_all(text, self.with.as_str());
            (new != text).then(|| new.into_owned())
        })
    }
}

pub(super) fn compile_replace(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let t = cx.table(v, "system.replace", &["regex", "with", "scope"])?;
    let (Some(r), Some(w)) = (t.get("regex"), t.get("with")) else {
        cx.error(
            v.span(),
            "system.replace needs regex and with (e.g. { regex = \"cwd: .*\", with = \"\" })",
        );
        return None;
    };
    let regex = cx.regex(r, "regex")?;
    let with = cx.str(w, "with")?.to_owned();
    let scope = match t.get("scope") {
        Some(s) => shape::compile_scope(cx, s)?,
        None => Scope::System,
    };
    Some(Box::new(Replace {
        regex,
        with,
        scope,
        memo: EditMemo::default(),
    }))
}

// === system.remove ===

/// A text test given as `regex` or `contains`.
#[derive(Debug)]
pub(super) enum TextMatch {
    Regex(Regex),
    Contains(String),
}

impl TextMatch {
    pub(super) fn is_match(&self, text: &str) -> bool {
        match self {
            TextMatch::Regex(r) => r.is_match(text),
            TextMatch::Contains(c) => text.contains(c.as_str()),
        }
    }

    pub(super) fn compile(
        cx: &mut Cx<'_>,
        v: &Val<'_>,
        t: &toml::de::DeTable<'_>,
        what: &str,
    ) -> Option<TextMatch> {
        match (t.get("regex"), t.get("contains")) {
            (Some(r), None) => Some(TextMatch::Regex(cx.regex(r, "regex")?)),
            (None, Some(c)) => Some(TextMatch::Contains(cx.str(c, "contains")?.to_owned())),
            _ => {
                cx.error(
                    v.span(),
                    format!("{what} needs exactly one of regex or contains"),
                );
                None
            }
        }
    }
}

#[derive(Debug)]
struct Remove {
    test: TextMatch,
    scope: Scope,
}

impl Action for Remove {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        // An empty text removes its block (and an emptied system message).
        edit_texts(st, self.scope, None, |text| {
            self.test.is_match(text).then(String::new)
        })
    }
}

pub(super) fn compile_remove(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let t = cx.table(v, "system.remove", &["regex", "contains", "scope"])?;
    let test = TextMatch::compile(cx, v, t, "system.remove")?;
    let scope = match t.get("scope") {
        Some(s) => shape::compile_scope(cx, s)?,
        None => Scope::System,
    };
    Some(Box::new(Remove { test, scope }))
}

// === system.move_to_user ===

#[derive(Debug)]
struct Move {
    regex: Regex,
    scope: Scope,
}

impl Action for Move {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        let Some(user) = shape::first_user_message(root) else {
            return Err(ActionError::NoUserMessage);
        };
        let mut moved = Vec::new();
        let mut changed = Vec::new();
        let locations = shape::text_locations(root, self.scope);
        // Cut in document order (the reminder reads in the order the text was), apply last first.
        let mut cuts = Vec::new();
        for loc in &locations {
            let Some(text) = root
                .at(loc)
                .and_then(|n| n.as_str().map(|t| t.into_owned()))
            else {
                continue;
            };
            let found: Vec<String> = self
                .regex
                .find_iter(&text)
                .map(|m| m.as_str().to_owned())
                .filter(|m| !m.is_empty())
                .collect();
            if found.is_empty() {
                continue;
            }
            moved.extend(found);
            cuts.push((loc.clone(), self.regex.replace_all(&text, "").into_owned()));
        }
        if moved.is_empty() {
            return Ok(None);
        }
        // A system message before the first user message shifts its index if removed.
        let mut user = user;
        for (loc, rest) in cuts.into_iter().rev() {
            if let Some(p) = set_text_at(root, &loc, rest) {
                if loc.len() >= 3
                    && loc[0] == "messages"
                    && p == format!("/messages/{}", loc[1])
                    && loc[1].parse::<usize>().is_ok_and(|i| i < user)
                {
                    user -= 1;
                }
                changed.push(p);
            }
        }
        let content = ptr!["messages", user, "content"];
        content_as_blocks(root, &content)?;
        let text = format!(
            "<system-reminder>\n{}\n</system-reminder>",
            moved.join("\n")
        );
        root.at_mut(&content)
            .ok_or_else(|| PointerError::Missing(Pointer::text(&content)))?
            .insert(0, Node::Value(json!({"type": "text", "text": text})));
        for p in changed.into_iter().rev() {
            st.changed(p);
        }
        st.changed(format!("/messages/{user}/content/0"));
        Ok(None)
    }
}

pub(super) fn compile_move(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let t = cx.table(v, "system.move_to_user", &["regex", "scope"])?;
    let Some(r) = t.get("regex") else {
        cx.error(
            v.span(),
            "system.move_to_user needs a regex (e.g. { regex = \"(?m)^Current date: .*$\" })",
        );
        return None;
    };
    let regex = cx.regex(r, "regex")?;
    let scope = match t.get("scope") {
        Some(s) => shape::compile_scope(cx, s)?,
        None => Scope::System,
    };
    Some(Box::new(Move { regex, scope }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_edit_memo_answers_texts_it_saw_and_holds_a_bounded_number_of_bytes() {
        let memo = EditMemo::default();
        let text = vec![b'a'; 2048];
        assert_eq!(
            memo.get_or_insert(&text, || Some("b".into())),
            Some("b".into())
        );
        // Seen before: the edit is not run again.
        assert_eq!(
            memo.get_or_insert(&text, || unreachable!()),
            Some("b".into())
        );
        // Past the bound it starts again, never holding more than the bound.
        let big = EditMemo::MAX_HELD / 4 - 8;
        for i in 0..10u8 {
            let mut t = vec![b'x'; big];
            t[0] = i;
            memo.get_or_insert(&t, || None);
            assert!(memo.0.lock().unwrap().held <= EditMemo::MAX_HELD);
        }
        // A text too large to keep is edited each time.
        let huge = vec![b'y'; EditMemo::MAX_HELD / 4 + 1];
        let runs = std::cell::Cell::new(0);
        for _ in 0..2 {
            memo.get_or_insert(&huge, || {
                runs.set(runs.get() + 1);
                None
            });
        }
        assert_eq!(runs.get(), 2);
    }
}

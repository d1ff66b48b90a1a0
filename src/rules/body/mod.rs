//! The request body as rules see it: parsed only when asked, changed in place, and
//! written back touching only what changed.
//!
//! A [`Node`] is the exact bytes the client sent ([`Node::Raw`]), an object or array
//! opened because a rule looked inside it, or a value a rule wrote. Writing back
//! copies every untouched node's bytes as they were; only containers on the path to
//! a change are re-emitted (compact, key order kept). Deciding what to change is not
//! this module's job (see `action/`).
//!
//! The body's structure is the prompt model's tape ([`Index`]): opening a node
//! reads its children's spans instead of scanning its bytes again, however many
//! rules, actions and levels look inside.
//!
//! By part: `index` (the tape as rules read it), `peek` (reading without opening),
//! `pointer` (JSON pointers and json.set/remove/append), `writer` (writing a
//! changed body and its tape), `lazy` (one request's body, read on first use); the
//! node tree itself is here.

mod index;
mod lazy;
mod peek;
mod pointer;
mod writer;

use std::borrow::Cow;

use serde_json::Value;

pub(crate) use index::Index;
pub(crate) use lazy::{BodyError, BodyStore, LazyBody};
use peek::array_index;
pub(crate) use peek::{Items, Peek};
pub(crate) use pointer::{Pointer, PointerError, append, ptr, remove, set};
pub(crate) use writer::BodyWriter;

/// The keys and values of an object, in order.
pub(crate) type Entries<'a> = Vec<(Cow<'a, str>, Node<'a>)>;

/// One JSON value of the body.
#[derive(Debug, Clone)]
pub(crate) enum Node<'a> {
    /// Untouched, exactly as sent. Containers are split by a structural scan (quotes,
    /// brackets, commas), not parsed: a string is decoded (and its UTF-8 checked)
    /// only when a rule reads it.
    Raw(Raw<'a>),
    /// An opened object; `orig` is its text as sent while nothing in it changed.
    Object {
        orig: Option<&'a [u8]>,
        entries: Entries<'a>,
    },
    /// An opened array; `orig` as for objects.
    Array {
        orig: Option<&'a [u8]>,
        items: Vec<Node<'a>>,
    },
    /// A value a rule wrote.
    Value(Value),
}

/// An untouched value: its bytes as sent, and its token in the body's index.
#[derive(Clone, Copy)]
pub(crate) struct Raw<'a> {
    text: &'a [u8],
    at: (&'a Index<'a>, u32),
}

impl std::fmt::Debug for Raw<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Raw({})", String::from_utf8_lossy(self.text))
    }
}

impl<'a> Raw<'a> {
    /// The child named by one pointer token, as opening would find it.
    fn child(self, token: &str) -> Option<Raw<'a>> {
        let (index, t) = self.at;
        index.child(t as usize, token)
    }

    /// The opened object or array, children untouched; `None` for scalars.
    fn open(self) -> Option<Node<'a>> {
        let (index, t) = self.at;
        index.open(t)
    }
}

/// The structure of a whole body: the [`Prompt`]'s tape, so a node opens without
/// scanning its bytes again.
impl<'a> Node<'a> {
    /// Whether anything in this node differs from what was sent.
    pub(crate) fn is_dirty(&self) -> bool {
        match self {
            Node::Raw(_) => false,
            Node::Object { orig, .. } | Node::Array { orig, .. } => orig.is_none(),
            Node::Value(_) => true,
        }
    }

    /// A read-only look at this node that opens nothing.
    pub(crate) fn peek(&self) -> Peek<'_, 'a> {
        match self {
            Node::Raw(r) => Peek::Raw(*r),
            Node::Value(v) => Peek::Value(v),
            opened => Peek::Opened(opened),
        }
    }

    pub(crate) fn is_object(&self) -> bool {
        self.peek().is_object()
    }

    pub(crate) fn is_array(&self) -> bool {
        self.peek().is_array()
    }

    pub(crate) fn is_string(&self) -> bool {
        self.peek().is_string()
    }

    /// Opens a raw object or array (or one a rule wrote) so its children can be
    /// reached. Changes nothing that is written back. False for scalars.
    pub(crate) fn open(&mut self) -> bool {
        match self {
            Node::Object { .. } | Node::Array { .. } => true,
            Node::Raw(r) => match r.open() {
                Some(node) => {
                    *self = node;
                    true
                }
                None => false,
            },
            Node::Value(v @ (Value::Object(_) | Value::Array(_))) => {
                *self = match std::mem::take(v) {
                    Value::Object(m) => Node::Object {
                        orig: None,
                        entries: m
                            .into_iter()
                            .map(|(k, v)| (Cow::Owned(k), Node::Value(v)))
                            .collect(),
                    },
                    Value::Array(a) => Node::Array {
                        orig: None,
                        items: a.into_iter().map(Node::Value).collect(),
                    },
                    _ => unreachable!("matched an object or array above"),
                };
                true
            }
            Node::Value(_) => false,
        }
    }

    /// Marks this container as changed (its text will be re-emitted).
    pub(crate) fn touch(&mut self) {
        if let Node::Object { orig, .. } | Node::Array { orig, .. } = self {
            *orig = None;
        }
    }

    /// The child named by one pointer token, opening this node if needed.
    pub(crate) fn child(&mut self, token: &str) -> Option<&mut Node<'a>> {
        if !self.open() {
            return None;
        }
        match self {
            Node::Object { entries, .. } => {
                entries.iter_mut().find(|(k, _)| k == token).map(|(_, v)| v)
            }
            Node::Array { items, .. } => {
                let i = array_index(token)?;
                items.get_mut(i)
            }
            _ => None,
        }
    }

    /// The node at `tokens`, for reading.
    pub(crate) fn at(&mut self, tokens: &[String]) -> Option<&mut Node<'a>> {
        let mut node = self;
        for t in tokens {
            node = node.child(t)?;
        }
        Some(node)
    }

    /// The node at `tokens`, for changing: every container on the way is marked changed.
    pub(crate) fn at_mut(&mut self, tokens: &[String]) -> Option<&mut Node<'a>> {
        self.at(tokens)?;
        let mut node = self;
        node.touch();
        for t in tokens {
            node = node.child(t)?;
            node.touch();
        }
        Some(node)
    }

    /// The entries of an opened object.
    pub(crate) fn entries(&mut self) -> Option<&mut Entries<'a>> {
        if !self.open() {
            return None;
        }
        match self {
            Node::Object { entries, .. } => Some(entries),
            _ => None,
        }
    }

    /// The items of an opened array.
    pub(crate) fn items(&mut self) -> Option<&mut Vec<Node<'a>>> {
        if !self.open() {
            return None;
        }
        match self {
            Node::Array { items, .. } => Some(items),
            _ => None,
        }
    }

    /// The number of items, when this is an array.
    pub(crate) fn len(&mut self) -> Option<usize> {
        self.items().map(|i| i.len())
    }

    /// A string value, unescaped.
    pub(crate) fn as_str(&self) -> Option<Cow<'_, str>> {
        self.peek().as_str()
    }

    /// An untouched value's bytes as sent.
    pub(crate) fn raw_text(&self) -> Option<&'a [u8]> {
        match self {
            Node::Raw(r) => Some(r.text),
            _ => None,
        }
    }

    pub(crate) fn as_u64(&self) -> Option<u64> {
        self.peek().as_u64()
    }

    /// The string field `key` of an object node.
    pub(crate) fn str_field(&mut self, key: &str) -> Option<String> {
        self.child(key)?.as_str().map(Cow::into_owned)
    }

    /// Whether the object has `key`.
    pub(crate) fn has(&mut self, key: &str) -> bool {
        self.child(key).is_some()
    }

    /// The whole value (numbers as serde_json reads them).
    pub(crate) fn to_value(&self) -> Value {
        match self {
            Node::Raw(r) => serde_json::from_slice(r.text).unwrap_or(Value::Null),
            Node::Object { entries, .. } => Value::Object(
                entries
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_value()))
                    .collect(),
            ),
            Node::Array { items, .. } => Value::Array(items.iter().map(Node::to_value).collect()),
            Node::Value(v) => v.clone(),
        }
    }

    /// Sets `key` in an object (replacing it in place, or appending it). Marks the object changed.
    pub(crate) fn set_key(&mut self, key: &str, value: Node<'a>) -> bool {
        let Some(entries) = self.entries() else {
            return false;
        };
        match entries.iter_mut().find(|(k, _)| k == key) {
            Some((_, slot)) => *slot = value,
            None => entries.push((Cow::Owned(key.to_owned()), value)),
        }
        self.touch();
        true
    }

    /// Removes `key` from an object; true if it was there.
    pub(crate) fn remove_key(&mut self, key: &str) -> bool {
        let Some(entries) = self.entries() else {
            return false;
        };
        let before = entries.len();
        entries.retain(|(k, _)| k != key);
        let removed = entries.len() != before;
        if removed {
            self.touch();
        }
        removed
    }

    /// Inserts into an array at `index` (clamped to the end). Marks the array changed.
    pub(crate) fn insert(&mut self, index: usize, value: Node<'a>) -> bool {
        let Some(items) = self.items() else {
            return false;
        };
        let index = index.min(items.len());
        items.insert(index, value);
        self.touch();
        true
    }

    /// Removes an array item; true if it was there.
    pub(crate) fn remove_index(&mut self, index: usize) -> bool {
        let Some(items) = self.items() else {
            return false;
        };
        if index >= items.len() {
            return false;
        }
        items.remove(index);
        self.touch();
        true
    }

    /// Writes the node: untouched parts as the exact bytes sent (with their tokens
    /// of the received body's tape), changed ones compactly.
    pub(crate) fn write(&self, out: &mut BodyWriter<'_>) {
        match self {
            Node::Raw(r) => out.original(r.at.1),
            Node::Object {
                orig: Some(text), ..
            }
            | Node::Array {
                orig: Some(text), ..
            } => match out.token_of(text) {
                Some(t) => out.original(t),
                None => out.bytes(text),
            },
            Node::Object {
                orig: None,
                entries,
            } => {
                out.open(b'{');
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.separator(b',');
                    }
                    out.key(k);
                    out.separator(b':');
                    v.write(out);
                }
                out.close();
            }
            Node::Array { orig: None, items } => {
                out.open(b'[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.separator(b',');
                    }
                    v.write(out);
                }
                out.close();
            }
            Node::Value(v) => out.value(v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use serde_json::json;

    const BODY: &str = r#"{"model":"m","temperature":0.70,"system":[{"type":"text","text":"caf\u00e9"},{"type":"text","text":"b"}],"n":[1,2]}"#;

    fn with_root(body: &str, f: impl FnOnce(&mut Node<'_>)) -> String {
        let bytes = Bytes::copy_from_slice(body.as_bytes());
        let cell = crate::prompt::PromptCell::new(bytes.clone(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, &store);
        f(lazy.root().unwrap());
        match lazy.changed() {
            Some(b) => String::from_utf8(b.body().to_vec()).unwrap(),
            None => body.to_owned(),
        }
    }

    #[test]
    fn pointers_parse_and_print() {
        assert_eq!(Pointer::parse("").unwrap().0, Vec::<String>::new());
        assert_eq!(
            Pointer::parse("/a~1b/c~0d/0").unwrap().0,
            ["a/b", "c~d", "0"]
        );
        assert_eq!(
            Pointer::parse("/a~1b/c~0d").unwrap().to_string(),
            "/a~1b/c~0d"
        );
        assert!(
            Pointer::parse("a/b")
                .unwrap_err()
                .to_string()
                .contains("must start with")
        );
        assert!(Pointer::parse("/a~2").is_err());
    }

    #[test]
    fn reading_opens_but_changes_nothing() {
        let out = with_root(BODY, |root| {
            assert_eq!(
                root.at(&ptr!["system", 0, "text"])
                    .unwrap()
                    .as_str()
                    .unwrap(),
                "café"
            );
            assert_eq!(root.at(&ptr!["n", 1]).unwrap().as_u64(), Some(2));
            assert!(
                root.at(&ptr!["n", "01"]).is_none(),
                "leading zeros are not indices"
            );
            assert!(!root.is_dirty());
        });
        assert_eq!(out, BODY);
    }

    #[test]
    fn a_change_rewrites_only_its_path() {
        let out = with_root(BODY, |root| {
            set(root, &ptr!["system", 1, "text"], json!("B")).unwrap();
        });
        assert_eq!(
            out,
            r#"{"model":"m","temperature":0.70,"system":[{"type":"text","text":"caf\u00e9"},{"type":"text","text":"B"}],"n":[1,2]}"#,
            "the untouched block keeps its escape, the number its text"
        );
    }

    #[test]
    fn set_remove_append() {
        let out = with_root(BODY, |root| {
            set(root, &ptr!["n", "-"], json!(3)).unwrap();
            set(root, &ptr!["n", 0], json!(0)).unwrap();
            assert!(set(root, &ptr!["n", 9], json!(0)).is_err());
            assert!(
                set(root, &ptr!["missing", "x"], json!(0))
                    .unwrap_err()
                    .to_string()
                    .contains("does not exist")
            );
            assert!(remove(root, &ptr!["model"]).unwrap());
            assert!(!remove(root, &ptr!["model"]).unwrap());
            assert!(!remove(root, &ptr!["nope", "x"]).unwrap());
            append(root, &ptr!["stop"], json!("END")).unwrap();
            append(root, &ptr!["stop"], json!("FIN")).unwrap();
            assert!(append(root, &ptr!["temperature"], json!(1)).is_err());
        });
        assert_eq!(
            out,
            r#"{"temperature":0.70,"system":[{"type":"text","text":"caf\u00e9"},{"type":"text","text":"b"}],"n":[0,2,3],"stop":["END","FIN"]}"#
        );
    }

    #[test]
    fn pointers_find_keys_spelt_with_escapes_and_a_bom_stays() {
        let body = "\u{feff}{\"mod\\u0065l\":\"a\",\"met\\u0061data\":{\"user_id\":\"u\"},\"n\":1}";
        let out = with_root(body, |root| {
            assert_eq!(root.at(&ptr!["model"]).unwrap().as_str().unwrap(), "a");
            assert_eq!(root.peek().child("model").unwrap().as_str().unwrap(), "a");
            set(root, &ptr!["model"], json!("b")).unwrap();
            assert!(remove(root, &ptr!["metadata"]).unwrap());
            assert!(!remove(root, &ptr!["metadata"]).unwrap());
        });
        // Replaced where it was (no second `model` beside it), the mark kept.
        assert_eq!(out, "\u{feff}{\"model\":\"b\",\"n\":1}");
        // Unchanged, the body is left as sent, mark and escapes included.
        assert_eq!(with_root(body, |root| assert!(root.has("metadata"))), body);
    }

    #[test]
    fn values_written_by_rules_can_be_reached_into() {
        let out = with_root(r#"{"a":1}"#, |root| {
            set(root, &ptr!["meta"], json!({"x": {"y": 1}})).unwrap();
            set(root, &ptr!["meta", "x", "z"], json!(2)).unwrap();
        });
        assert_eq!(out, r#"{"a":1,"meta":{"x":{"y":1,"z":2}}}"#);
    }

    #[test]
    fn non_json_bodies_say_why() {
        let bytes = Bytes::from_static(b"not json");
        let cell = crate::prompt::PromptCell::new(bytes.clone(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, &store);
        assert!(matches!(lazy.root().unwrap_err(), BodyError::Malformed(_)));
        for bad in [
            &b"[1]"[..],
            b"{\"a\":1} x",
            b"{\"a\":",
            b"{\"a\" 1}",
            b"{a:1}",
            b"{\"a\":[1,{\"b\":2}}",
            b"",
        ] {
            let bytes = Bytes::copy_from_slice(bad);
            let cell = crate::prompt::PromptCell::new(bytes.clone(), None);
            let store = BodyStore::default();
            let mut lazy = LazyBody::new(&bytes, &cell, &store);
            let e = lazy.root().unwrap_err();
            assert!(
                e.to_string().starts_with("the body is not a JSON object"),
                "{e}"
            );
            assert!(lazy.changed().is_none());
        }
        // Whitespace around and inside is fine, and kept when nothing changes.
        let out = with_root(" {\n \"a\" : [ 1 , \"x\" ] ,\"b\":{ }}\n", |root| {
            assert_eq!(root.at(&ptr!["a", 1]).unwrap().as_str().unwrap(), "x");
            assert_eq!(root.at(&ptr!["b"]).unwrap().len(), None);
        });
        assert_eq!(out, " {\n \"a\" : [ 1 , \"x\" ] ,\"b\":{ }}\n");
    }

    #[test]
    fn a_changed_body_keeps_its_bytes_and_derives_its_model() {
        // Two long texts around the value a rule changes, and one after a new key.
        let long = "x".repeat(5000);
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}},{{"role":"user","content":[{{"type":"text","text":"b","cache_control":{{"type":"ephemeral"}}}}]}}],"system":"{long}","max_tokens":128000,"stream":true}}"#
        );
        let bytes = Bytes::from(body.clone());
        let cell = crate::prompt::PromptCell::new(bytes.clone(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, &store);
        let root = lazy.root().unwrap();
        let cc = root
            .at_mut(&ptr!["messages", 1, "content", 0, "cache_control"])
            .unwrap();
        cc.set_key("ttl", Node::Value(Value::String("1h".into())));
        root.set_key("max_tokens", Node::Value(Value::from(64000)));
        let out = lazy.changed().unwrap();
        let want = body
            .replace(r#""ephemeral"}"#, r#""ephemeral","ttl":"1h"}"#)
            .replace("128000", "64000");
        assert_eq!(std::str::from_utf8(out.body()).unwrap(), want);
        // The model of the body sent is derived, not read again: the same tape, marks
        // and key check as reading it afresh.
        let fresh = crate::prompt::Prompt::read(out.body().clone(), None);
        assert_eq!(out.tape(), fresh.tape());
        assert_eq!(out.cache_control_keys(), fresh.cache_control_keys());
        assert_eq!(out.keys(), fresh.keys());
        assert_eq!(out.cache_control_keys().len(), 1);
    }
}

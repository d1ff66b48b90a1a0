//! The request body as rules see it: parsed only when asked, changed in place, and
//! written back touching only what changed.
//!
//! A [`Node`] is the exact bytes the client sent ([`Node::Raw`]), an object or array
//! opened because a rule looked inside it, or a value a rule wrote. Writing back
//! copies every untouched node's bytes as they were; only containers on the path to
//! a change are re-emitted (compact, key order kept). Deciding what to change is not
//! this module's job (see `action/`).
//!
//! The body's structure is found once, in one pass ([`Index`]): opening a node then
//! reads its children's spans instead of scanning its bytes again, however many
//! rules, actions and levels look inside.

use std::borrow::Cow;
use std::cell::OnceCell;

use bytes::Bytes;
use serde_json::Value;

use crate::prompt::{KeyCheck, Prompt, Shape, key_is};
use crate::provider::json::{self, Tok, skip_ws};
use crate::record::{PromptCell, SentBody};

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
pub(crate) struct Index<'a> {
    body: &'a [u8],
    toks: &'a [Tok],
    /// The tokens of keys that may spell `cache_control`, in order: breakpoints
    /// are looked for only in values that hold one.
    cache_control_keys: &'a [u32],
    keys: &'a KeyCheck,
}

impl std::fmt::Debug for Index<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Index({} tokens)", self.toks.len())
    }
}

impl<'a> Index<'a> {
    /// The index of `prompt`; `None` when its body is not JSON. Keys are decoded
    /// when an object is opened: an object with a key that is not text cannot be
    /// opened (a lookup of a key before it still finds it).
    fn build(prompt: &'a Prompt) -> Option<Index<'a>> {
        Some(Index {
            body: prompt.body(),
            toks: prompt.tape()?,
            cache_control_keys: prompt.cache_control_keys(),
            keys: prompt.keys(),
        })
    }

    /// Whether a key repeats in one object.
    fn keys(&self) -> &KeyCheck {
        self.keys
    }

    /// Whether readers must take each key's last value (a body without repeats
    /// has one value per key, so the first is the last).
    fn last_wins(&self) -> bool {
        self.keys.repeated().is_some()
    }

    fn raw(&'a self, t: usize) -> Raw<'a> {
        Raw {
            text: self.toks[t].of(self.body),
            at: (self, t as u32),
        }
    }

    /// The tokens directly inside the container at token `t`, in order (for an
    /// object: key, value, key, value…): a hop per child.
    fn children(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        let end = self.toks[t].next as usize;
        let mut c = t + 1;
        std::iter::from_fn(move || {
            (c < end).then(|| {
                let at = c;
                c = self.toks[c].next as usize;
                at
            })
        })
    }

    /// The child of the container at token `t` named by `token`, as [`Index::open`]
    /// would find it: the key that matches (its last value when keys repeat).
    fn child(&'a self, t: usize, token: &str) -> Option<Raw<'a>> {
        match self.body[self.toks[t].start as usize] {
            b'{' => {
                let last_wins = self.last_wins();
                let mut found = None;
                let mut kids = self.children(t);
                while let (Some(k), Some(v)) = (kids.next(), kids.next()) {
                    if key_is(self.toks[k].of(self.body), token)? {
                        found = Some(self.raw(v));
                        if !last_wins {
                            break;
                        }
                    }
                }
                found
            }
            b'[' => self
                .children(t)
                .nth(array_index(token)?)
                .map(|c| self.raw(c)),
            _ => None,
        }
    }

    /// Opens the container at token `t` (a scalar: `None`).
    fn open(&'a self, t: u32) -> Option<Node<'a>> {
        let t = t as usize;
        let text = self.toks[t].of(self.body);
        match text.first() {
            Some(b'{') => {
                let mut entries = Vec::with_capacity(self.children(t).count() / 2);
                let last_wins = self.last_wins();
                let mut kids = self.children(t);
                while let (Some(k), Some(v)) = (kids.next(), kids.next()) {
                    let key = json::decode_str(self.toks[k].of(self.body))?;
                    if last_wins {
                        put_last(&mut entries, key, Node::Raw(self.raw(v)));
                    } else {
                        entries.push((key, Node::Raw(self.raw(v))));
                    }
                }
                Some(Node::Object {
                    orig: Some(text),
                    entries,
                })
            }
            Some(b'[') => {
                let mut items = Vec::with_capacity(self.children(t).count());
                items.extend(self.children(t).map(|c| Node::Raw(self.raw(c))));
                Some(Node::Array {
                    orig: Some(text),
                    items,
                })
            }
            _ => None,
        }
    }
}

/// An RFC 6901 JSON pointer, split into unescaped tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pointer(pub(crate) Vec<String>);

impl Pointer {
    /// Parses `""`, `"/a/0"`, `"/a~1b/c~0d"`.
    pub(crate) fn parse(text: &str) -> Result<Pointer, String> {
        if text.is_empty() {
            return Ok(Pointer(Vec::new()));
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!(
                "invalid JSON pointer {text:?}: it must start with \"/\" (expected e.g. \"/metadata/user_id\")"
            ));
        };
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    token.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => token.push('~'),
                    Some('1') => token.push('/'),
                    _ => {
                        return Err(format!(
                            "invalid JSON pointer {text:?}: \"~\" must be followed by 0 or 1 (\"~0\" is ~, \"~1\" is /)"
                        ));
                    }
                }
            }
            tokens.push(token);
        }
        Ok(Pointer(tokens))
    }

    /// The pointer text of `tokens`.
    pub(crate) fn text(tokens: &[String]) -> String {
        json::pointer_text(tokens)
    }
}

impl std::fmt::Display for Pointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&Pointer::text(&self.0))
    }
}

/// Pointer tokens from string and index parts: `ptr!["messages", 3, "content"]`
/// (an array; `Vec::from` makes it a list without copying the tokens).
macro_rules! ptr {
    ($($part:expr),* $(,)?) => { [$($part.to_string()),*] };
}
pub(crate) use ptr;

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

    /// Writes the node: untouched parts as the exact bytes sent, changed ones compactly.
    pub(crate) fn write(&self, out: &mut Splice<'_>) {
        match self {
            Node::Raw(r) => out.original(r.text),
            Node::Object {
                orig: Some(text), ..
            }
            | Node::Array {
                orig: Some(text), ..
            } => out.original(text),
            Node::Object {
                orig: None,
                entries,
            } => {
                out.literal(b"{");
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.literal(b",");
                    }
                    out.key(k);
                    out.literal(b":");
                    v.write(out);
                }
                out.literal(b"}");
            }
            Node::Array { orig: None, items } => {
                out.literal(b"[");
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.literal(b",");
                    }
                    v.write(out);
                }
                out.literal(b"]");
            }
            Node::Value(v) => out.value(v),
        }
    }
}

// === reading without opening ===

/// A read-only look at a value of the body. Reading through it opens (and
/// allocates) nothing: untouched containers are read through the body's index, so
/// a scan of every block (markers, system texts, tool names) costs no copies.
/// Reads agree with [`Node::child`] and friends.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Peek<'n, 'a> {
    Raw(Raw<'a>),
    /// An opened object or array.
    Opened(&'n Node<'a>),
    /// A value a rule wrote, or a value inside one.
    Value(&'n Value),
}

impl<'n, 'a: 'n> Peek<'n, 'a> {
    fn first_byte(self) -> Option<u8> {
        match self {
            Peek::Raw(r) => r.text.first().copied(),
            Peek::Opened(Node::Array { .. }) => Some(b'['),
            Peek::Opened(_) => Some(b'{'),
            Peek::Value(Value::Object(_)) => Some(b'{'),
            Peek::Value(Value::Array(_)) => Some(b'['),
            Peek::Value(Value::String(_)) => Some(b'"'),
            Peek::Value(_) => Some(b'0'),
        }
    }

    pub(crate) fn is_object(self) -> bool {
        self.first_byte() == Some(b'{')
    }

    pub(crate) fn is_array(self) -> bool {
        self.first_byte() == Some(b'[')
    }

    pub(crate) fn is_string(self) -> bool {
        self.first_byte() == Some(b'"')
    }

    /// The child named by one pointer token: an object's key, or an array's index.
    pub(crate) fn child(self, token: &str) -> Option<Peek<'n, 'a>> {
        match self {
            Peek::Raw(r) => r.child(token).map(Peek::Raw),
            Peek::Opened(Node::Object { entries, .. }) => entries
                .iter()
                .find(|(k, _)| k == token)
                .map(|(_, v)| v.peek()),
            Peek::Opened(Node::Array { items, .. }) => {
                items.get(array_index(token)?).map(Node::peek)
            }
            Peek::Opened(_) => None,
            Peek::Value(Value::Object(m)) => m.get(token).map(Peek::Value),
            Peek::Value(Value::Array(a)) => a.get(array_index(token)?).map(Peek::Value),
            Peek::Value(_) => None,
        }
    }

    /// The value at `tokens`.
    pub(crate) fn at(self, tokens: &[String]) -> Option<Peek<'n, 'a>> {
        let mut node = self;
        for t in tokens {
            node = node.child(t)?;
        }
        Some(node)
    }

    /// Whether a `cache_control` key may be anywhere inside. False only for an
    /// untouched value with no key that could spell it (noted when indexing), so a
    /// scan for breakpoints skips the messages that have none.
    pub(crate) fn may_hold_cache_control(self) -> bool {
        let Peek::Raw(Raw { at: (index, t), .. }) = self else {
            return true;
        };
        let end = index.toks[t as usize].next;
        let keys = index.cache_control_keys;
        keys.get(keys.partition_point(|&k| k < t))
            .is_some_and(|&k| k < end)
    }

    /// The items of an array, in order (nothing for anything else).
    pub(crate) fn items(self) -> Items<'n, 'a> {
        match self {
            Peek::Raw(Raw {
                at: (index, t),
                text,
            }) if text.first() == Some(&b'[') => Items::Indexed {
                index,
                at: t as usize + 1,
                end: index.toks[t as usize].next as usize,
            },
            Peek::Opened(Node::Array { items, .. }) => Items::Opened(items.iter()),
            Peek::Value(Value::Array(a)) => Items::Values(a.iter()),
            _ => Items::None,
        }
    }

    /// The number of items, when this is an array.
    pub(crate) fn len(self) -> Option<usize> {
        match self.items() {
            Items::None => None,
            items => Some(items.count()),
        }
    }

    /// A string value, unescaped.
    pub(crate) fn as_str(self) -> Option<Cow<'n, str>> {
        match self {
            Peek::Raw(r) if r.text.first() == Some(&b'"') => json::decode_str(r.text),
            Peek::Value(Value::String(s)) => Some(Cow::Borrowed(s)),
            _ => None,
        }
    }

    /// Whether this is the empty string (no decoding: `""` is its only spelling).
    pub(crate) fn is_empty_str(self) -> bool {
        match self {
            Peek::Raw(r) => r.text == b"\"\"",
            Peek::Value(Value::String(s)) => s.is_empty(),
            _ => false,
        }
    }

    pub(crate) fn as_bool(self) -> Option<bool> {
        match self {
            Peek::Raw(r) => match r.text {
                b"true" => Some(true),
                b"false" => Some(false),
                _ => None,
            },
            Peek::Value(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Peek::Raw(r) => std::str::from_utf8(r.text).ok()?.parse().ok(),
            Peek::Value(v) => v.as_u64(),
            Peek::Opened(_) => None,
        }
    }

    /// The whole value (numbers as serde_json reads them).
    pub(crate) fn to_value(self) -> Value {
        match self {
            Peek::Raw(r) => serde_json::from_slice(r.text).unwrap_or(Value::Null),
            Peek::Opened(n) => n.to_value(),
            Peek::Value(v) => v.clone(),
        }
    }

    /// Whether the value's text may contain `needle`: exact for untouched values,
    /// always true for changed ones. Lets a scan skip values without decoding them.
    pub(crate) fn may_contain(self, needle: &memchr::memmem::Finder<'_>) -> bool {
        let text = match self {
            Peek::Raw(r) => r.text,
            Peek::Opened(
                Node::Object { orig: Some(t), .. } | Node::Array { orig: Some(t), .. },
            ) => t,
            _ => return true,
        };
        needle.find(text).is_some()
    }
}

/// The items of an array seen through a [`Peek`].
pub(crate) enum Items<'n, 'a> {
    Indexed {
        index: &'a Index<'a>,
        at: usize,
        end: usize,
    },
    Opened(std::slice::Iter<'n, Node<'a>>),
    Values(std::slice::Iter<'n, Value>),
    None,
}

impl<'n, 'a: 'n> Iterator for Items<'n, 'a> {
    type Item = Peek<'n, 'a>;

    fn next(&mut self) -> Option<Peek<'n, 'a>> {
        match self {
            Items::Indexed { index, at, end } => {
                if *at >= *end {
                    return None;
                }
                let item = index.raw(*at);
                *at = index.toks[*at].next as usize;
                Some(Peek::Raw(item))
            }
            Items::Opened(items) => items.next().map(Node::peek),
            Items::Values(items) => items.next().map(Peek::Value),
            Items::None => None,
        }
    }
}

/// An array index token: digits only, no leading zero (RFC 6901 §4).
fn array_index(token: &str) -> Option<usize> {
    if token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    if !token.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    token.parse().ok()
}

// === pointer operations (json.set / json.remove / json.append) ===

/// Sets the value at `tokens` (RFC 6901; `-` or the length appends to an array).
/// The parent must exist.
pub(crate) fn set(root: &mut Node<'_>, tokens: &[String], value: Value) -> Result<(), String> {
    let Some((last, parent)) = tokens.split_last() else {
        return Err("cannot replace the whole body".into());
    };
    let Some(node) = root.at(parent) else {
        return Err(format!("{} does not exist", Pointer::text(parent)));
    };
    if node.is_object() {
        let node = root.at_mut(parent).expect("found just above");
        node.set_key(last, Node::Value(value));
        return Ok(());
    }
    let Some(len) = node.len() else {
        return Err(format!(
            "{} is not an object or array",
            Pointer::text(parent)
        ));
    };
    let index = if last == "-" {
        len
    } else {
        array_index(last)
            .filter(|i| *i <= len)
            .ok_or_else(|| format!("{} has no index {last:?}", Pointer::text(parent)))?
    };
    let node = root.at_mut(parent).expect("found just above");
    if index == len {
        node.insert(index, Node::Value(value));
    } else if let Some(items) = node.items() {
        items[index] = Node::Value(value);
    }
    Ok(())
}

/// Removes the value at `tokens`; `Ok(false)` when there was nothing to remove.
pub(crate) fn remove(root: &mut Node<'_>, tokens: &[String]) -> Result<bool, String> {
    let Some((last, parent)) = tokens.split_last() else {
        return Err("cannot remove the whole body".into());
    };
    let Some(node) = root.at(parent) else {
        return Ok(false);
    };
    if node.is_object() {
        if !node.has(last) {
            return Ok(false);
        }
        let node = root.at_mut(parent).expect("found just above");
        return Ok(node.remove_key(last));
    }
    match (node.len(), array_index(last)) {
        (Some(len), Some(i)) if i < len => {
            let node = root.at_mut(parent).expect("found just above");
            Ok(node.remove_index(i))
        }
        _ => Ok(false),
    }
}

/// Appends `value` to the array at `tokens`, creating `[value]` there when it is
/// missing and its parent is an object.
pub(crate) fn append(root: &mut Node<'_>, tokens: &[String], value: Value) -> Result<(), String> {
    match root.at(tokens) {
        Some(node) if node.is_array() => {
            let node = root.at_mut(tokens).expect("found just above");
            node.insert(usize::MAX, Node::Value(value));
            Ok(())
        }
        Some(_) => Err(format!("{} is not an array", Pointer::text(tokens))),
        None => set(root, tokens, Value::Array(vec![value])),
    }
}

// === writing back ===

/// Runs of the original shorter than this are copied: a piece costs more to send
/// than copying that much.
const MIN_SLICE: usize = 1024;

/// A changed body being written as pieces. The bytes of untouched values stay
/// slices of the body they came from (no copy); what rules wrote is copied into
/// one buffer. A separator or key that repeats the original bytes where it stands
/// joins the slice around it, so a few edits give a few pieces.
pub(crate) struct Splice<'o> {
    orig: &'o Bytes,
    pieces: Vec<Piece>,
    new: Vec<u8>,
    /// A run of the original not placed yet: `orig[start..end]`.
    run: Option<(usize, usize)>,
}

/// A byte range of the original or of the new bytes.
enum Piece {
    Orig(usize, usize),
    New(usize, usize),
}

impl<'o> Splice<'o> {
    pub(crate) fn new(orig: &'o Bytes) -> Splice<'o> {
        Splice {
            orig,
            pieces: Vec::new(),
            new: Vec::new(),
            run: None,
        }
    }

    /// Where `s` starts in the original, when it is a part of it.
    fn offset(&self, s: &[u8]) -> Option<usize> {
        let base = self.orig.as_ptr() as usize;
        let at = (s.as_ptr() as usize).checked_sub(base)?;
        (at + s.len() <= self.orig.len()).then_some(at)
    }

    /// Bytes of a value as sent (a slice of the original when it is one).
    fn original(&mut self, s: &[u8]) {
        match self.offset(s) {
            Some(at) => self.orig_range(at, at + s.len()),
            None => self.literal(s),
        }
    }

    fn orig_range(&mut self, mut start: usize, end: usize) {
        if let Some((a, b)) = self.run {
            if b == start {
                self.run = Some((a, end));
                return;
            }
            self.flush();
        }
        // New bytes just written that repeat the original before `start` join the run.
        if let Some(Piece::New(from, to)) = self.pieces.last_mut() {
            while *to > *from && start > 0 && self.new[*to - 1] == self.orig[start - 1] {
                *to -= 1;
                start -= 1;
            }
            self.new.truncate(*to);
            if from == to {
                self.pieces.pop();
            }
        }
        self.run = Some((start, end));
    }

    /// Syntax (`{`, `,`, `:`…): joins the run when the original goes on with it.
    fn literal(&mut self, s: &[u8]) {
        if let Some((a, b)) = self.run
            && self.orig.get(b..b + s.len()) == Some(s)
        {
            self.run = Some((a, b + s.len()));
            return;
        }
        self.flush();
        let from = self.new.len();
        self.new.extend_from_slice(s);
        self.extend_new(from);
    }

    /// An object key: its bytes as sent when it is borrowed from the body.
    fn key(&mut self, key: &str) {
        if let Some(at) = self.offset(key.as_bytes())
            && at > 0
            && self.orig[at - 1] == b'"'
            && self.orig.get(at + key.len()) == Some(&b'"')
        {
            // Borrowed keys have no escapes: the text between the quotes is the key.
            return self.orig_range(at - 1, at + key.len() + 1);
        }
        self.value(&Value::String(key.to_owned()));
    }

    /// A value a rule wrote, compact.
    fn value(&mut self, v: &Value) {
        self.flush();
        let from = self.new.len();
        // Writing a Value into a Vec cannot fail: no IO, and every key is a string.
        serde_json::to_writer(&mut self.new, v).expect("a JSON value serialises into memory");
        self.extend_new(from);
    }

    /// Records `new[from..]` as written after the last piece.
    fn extend_new(&mut self, from: usize) {
        let to = self.new.len();
        match self.pieces.last_mut() {
            Some(Piece::New(_, end)) if *end == from => *end = to,
            _ => self.pieces.push(Piece::New(from, to)),
        }
    }

    /// Places the pending run: a slice when it is long, a copy when short.
    fn flush(&mut self) {
        let Some((a, b)) = self.run.take() else {
            return;
        };
        if b - a >= MIN_SLICE {
            self.pieces.push(Piece::Orig(a, b));
        } else {
            let from = self.new.len();
            self.new.extend_from_slice(&self.orig[a..b]);
            self.extend_new(from);
        }
    }

    /// The body written, as pieces in order.
    pub(crate) fn finish(mut self) -> SentBody {
        self.flush();
        let new = Bytes::from(self.new);
        let pieces = self
            .pieces
            .iter()
            .map(|p| match *p {
                Piece::Orig(a, b) => self.orig.slice(a..b),
                Piece::New(a, b) => new.slice(a..b),
            })
            .collect();
        SentBody::from_pieces(pieces)
    }
}

// === the body of one request, parsed on first use ===

/// What the nodes of one request borrow: the decoded body and its index. The
/// caller makes it empty and keeps it for the whole run; it fills on first use.
#[derive(Default)]
pub(crate) struct BodyStore<'a> {
    index: OnceCell<Option<Index<'a>>>,
}

/// The body of one request: its bytes (decoded when compressed), parsed on first use.
pub(crate) struct LazyBody<'a> {
    sent: &'a Bytes,
    /// `sent` decoded (the same bytes when it came uncompressed): what rules read.
    plain: &'a Bytes,
    /// The model of `plain`, read on first use.
    prompt: &'a PromptCell,
    /// Whether `sent` came compressed (a changed body then goes on as identity).
    encoded: bool,
    store: &'a BodyStore<'a>,
    root: Option<Result<Node<'a>, String>>,
}

impl<'a> LazyBody<'a> {
    /// `sent` as received, `prompt` the model of its decoded bytes; `encoded`
    /// whether it came compressed.
    pub(crate) fn new(
        sent: &'a Bytes,
        prompt: &'a PromptCell,
        encoded: bool,
        store: &'a BodyStore<'a>,
    ) -> Self {
        LazyBody {
            sent,
            plain: prompt.body().bytes(),
            prompt,
            encoded,
            store,
            root: None,
        }
    }

    /// Whether a key occurs twice in one object of the body (`NotChecked` for a
    /// body that is no JSON object the structure pass follows). Looked for once;
    /// from then on every reader takes a repeated key's last value.
    pub(crate) fn key_check(&self) -> KeyCheck {
        let b: &'a [u8] = self.plain;
        if b.get(skip_ws(b, 0)) != Some(&b'{') {
            return KeyCheck::NotChecked;
        }
        match self
            .store
            .index
            .get_or_init(|| Index::build(self.prompt.get()))
        {
            Some(index) => index.keys().clone(),
            None => KeyCheck::NotChecked,
        }
    }

    /// Body size in bytes, as received (no parse).
    pub(crate) fn size(&self) -> u64 {
        self.sent.len() as u64
    }

    /// Whether the body was parsed (for tests of the no-parse rule).
    pub(crate) fn was_parsed(&self) -> bool {
        self.root.is_some()
    }

    /// The parsed body, or why it cannot be read as a JSON object.
    pub(crate) fn root(&mut self) -> Result<&mut Node<'a>, String> {
        if self.root.is_none() {
            let store = self.store;
            let parsed = parse_root(self.prompt, &store.index);
            self.root = Some(parsed);
        }
        match self.root.as_mut() {
            Some(Ok(node)) => Ok(node),
            Some(Err(e)) => Err(e.clone()),
            None => unreachable!("set just above"),
        }
    }

    /// The parsed body, if it was parsed and is JSON.
    pub(crate) fn root_if_parsed(&self) -> Option<&Node<'a>> {
        match &self.root {
            Some(Ok(node)) => Some(node),
            _ => None,
        }
    }

    /// The body to send when rules changed it (identity-encoded), else `None`.
    pub(crate) fn changed(&self) -> Option<SentBody> {
        match &self.root {
            Some(Ok(node)) if node.is_dirty() => {
                let mut out = Splice::new(self.plain);
                node.write(&mut out);
                Some(out.finish())
            }
            _ => None,
        }
    }

    /// Whether the received body was compressed (a changed body goes on as identity).
    pub(crate) fn was_encoded(&self) -> bool {
        self.encoded
    }
}

/// Reads the top level of a body that must be a JSON object.
///
/// The body is not validated whole (a serde_json pass plus a UTF-8 pass cost as
/// much as everything rules do): its structure is scanned once into `index`, and
/// each string is decoded and checked when a rule reads it. A body that scan
/// cannot follow is split level by level as rules reach into it: what cannot be
/// split is "not JSON"; anything subtler the provider will refuse, exactly as
/// without promptgate.
fn parse_root<'a>(
    prompt: &'a PromptCell,
    index: &'a OnceCell<Option<Index<'a>>>,
) -> Result<Node<'a>, String> {
    let prompt = prompt.get();
    match prompt.shape() {
        Shape::Object(_) => {}
        Shape::NotJson(at) => {
            return Err(format!(
                "the body is not a JSON object: it is malformed at byte {at}"
            ));
        }
        Shape::Empty | Shape::NotObject => return Err("the body is not a JSON object".into()),
    }
    match index.get_or_init(|| Index::build(prompt)) {
        Some(index) => match index.open(0) {
            Some(Node::Object { entries, .. }) => Ok(Node::Object {
                orig: Some(prompt.body()),
                entries,
            }),
            _ => Err("the body is not a JSON object: a key is not valid text".into()),
        },
        None => Err("the body is not a JSON object".into()),
    }
}

/// Adds a key to an object's entries as a last-wins parser does: a repeated key
/// keeps its first place and takes the new value.
fn put_last<'a>(entries: &mut Entries<'a>, key: Cow<'a, str>, value: Node<'a>) {
    match entries.iter_mut().find(|(k, _)| *k == key) {
        Some((_, v)) => *v = value,
        None => entries.push((key, value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const BODY: &str = r#"{"model":"m","temperature":0.70,"system":[{"type":"text","text":"caf\u00e9"},{"type":"text","text":"b"}],"n":[1,2]}"#;

    fn with_root(body: &str, f: impl FnOnce(&mut Node<'_>)) -> String {
        let bytes = Bytes::copy_from_slice(body.as_bytes());
        let cell = crate::record::PromptCell::new(bytes.clone().into(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, false, &store);
        f(lazy.root().unwrap());
        match lazy.changed() {
            Some(b) => String::from_utf8(b.bytes().to_vec()).unwrap(),
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
        let cell = crate::record::PromptCell::new(bytes.clone().into(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, false, &store);
        assert!(lazy.root().unwrap_err().contains("not a JSON object"));
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
            let cell = crate::record::PromptCell::new(bytes.clone().into(), None);
            let store = BodyStore::default();
            let mut lazy = LazyBody::new(&bytes, &cell, false, &store);
            let e = lazy.root().unwrap_err();
            assert!(e.starts_with("the body is not a JSON object"), "{e}");
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
    fn a_changed_body_is_sent_as_slices_of_the_received_one() {
        // Two long texts around the value a rule changes, and one after a new key.
        let long = "x".repeat(5000);
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}},{{"role":"user","content":[{{"type":"text","text":"b","cache_control":{{"type":"ephemeral"}}}}]}}],"system":"{long}","max_tokens":128000,"stream":true}}"#
        );
        let bytes = Bytes::from(body.clone());
        let cell = crate::record::PromptCell::new(bytes.clone().into(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, false, &store);
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
        assert_eq!(std::str::from_utf8(out.bytes()).unwrap(), want);
        // Long runs of untouched bytes point into the received body: not copied.
        let inside = |p: &Bytes| {
            let base = bytes.as_ptr() as usize;
            let at = p.as_ptr() as usize;
            at >= base && at + p.len() <= base + bytes.len()
        };
        let sliced: usize = out
            .pieces()
            .iter()
            .filter(|p| inside(p))
            .map(Bytes::len)
            .sum();
        assert!(sliced >= 10_000, "{sliced} bytes sliced of {}", out.len());
        // Separators and keys that repeat the original join its slices: one slice
        // before the first change, one between the two.
        assert!(out.pieces().len() <= 4, "{:?}", out);
    }
}

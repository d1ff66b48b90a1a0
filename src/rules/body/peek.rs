//! Reading a body without opening it.

use crate::provider::json;
use std::borrow::Cow;

use serde_json::Value;

use super::{Index, Node, Raw};

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
    pub(super) fn first_byte(self) -> Option<u8> {
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
pub(super) fn array_index(token: &str) -> Option<usize> {
    if token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    if !token.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    token.parse().ok()
}

//! Reading a body through its tape: a [`Value`] is a token of the one structure
//! pass, and every lookup is a hop over token indices, never a scan of bytes.

use std::borrow::Cow;

use crate::provider::json::{self, Span, Tok, key_is};

/// One JSON value of a [`Prompt`](super::Prompt)'s body.
#[derive(Clone, Copy)]
pub struct Value<'p> {
    pub(super) body: &'p [u8],
    pub(super) toks: &'p [Tok],
    /// Objects read a repeated key's last value, as the providers' parsers do.
    pub(super) last_wins: bool,
    pub(super) at: u32,
}

impl std::fmt::Debug for Value<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Value({})", String::from_utf8_lossy(self.bytes()))
    }
}

impl<'p> Value<'p> {
    fn tok(&self) -> Tok {
        self.toks[self.at as usize]
    }

    fn at(&self, t: usize) -> Value<'p> {
        Value {
            at: t as u32,
            ..*self
        }
    }

    /// Its token index in the tape.
    pub fn index(&self) -> u32 {
        self.at
    }

    /// Its bytes, exactly as sent.
    pub fn bytes(&self) -> &'p [u8] {
        self.tok().of(self.body)
    }

    /// Where it lies in the body.
    pub fn span(&self) -> Span {
        let t = self.tok();
        Span {
            start: t.start as usize,
            end: t.end as usize,
        }
    }

    fn first(&self) -> u8 {
        self.body[self.tok().start as usize]
    }

    pub fn is_object(&self) -> bool {
        self.first() == b'{'
    }

    pub fn is_array(&self) -> bool {
        self.first() == b'['
    }

    pub fn is_string(&self) -> bool {
        self.first() == b'"'
    }

    /// The tokens directly inside it (for an object: key, value, key, value…).
    fn children(&self) -> impl Iterator<Item = usize> + use<'p> {
        let toks = self.toks;
        let end = toks[self.at as usize].next as usize;
        let mut c = self.at as usize + 1;
        std::iter::from_fn(move || {
            (c < end).then(|| {
                let here = c;
                c = toks[c].next as usize;
                here
            })
        })
    }

    /// An array's items (nothing for anything else).
    pub fn items(&self) -> impl Iterator<Item = Value<'p>> + use<'p> {
        let this = *self;
        let array = self.is_array();
        self.children()
            .filter(move |_| array)
            .map(move |c| this.at(c))
    }

    /// An object's entries as (key with its quotes, value), in order, repeats
    /// included (nothing for anything else).
    pub fn entries(&self) -> impl Iterator<Item = (Value<'p>, Value<'p>)> + use<'p> {
        let this = *self;
        let mut kids = self.children();
        let object = self.is_object();
        std::iter::from_fn(move || {
            if !object {
                return None;
            }
            let (k, v) = (kids.next()?, kids.next()?);
            Some((this.at(k), this.at(v)))
        })
    }

    /// The value of `key` in an object (keys compare as decoded; the last one when
    /// the body repeats keys).
    pub fn get(&self, key: &str) -> Option<Value<'p>> {
        let mut found = None;
        for (k, v) in self.entries() {
            if key_is(k.bytes(), key) == Some(true) {
                found = Some(v);
                if !self.last_wins {
                    break;
                }
            }
        }
        found
    }

    /// The value an RFC 6901 JSON pointer names (`""` is this value itself).
    pub fn pointer(&self, pointer: &str) -> Option<Value<'p>> {
        if pointer.is_empty() {
            return Some(*self);
        }
        let mut at = *self;
        for token in pointer.strip_prefix('/')?.split('/') {
            let token = token.replace("~1", "/").replace("~0", "~");
            at = if at.is_array() {
                let i: usize = token.parse().ok().filter(|_| !token.starts_with('+'))?;
                at.items().nth(i)?
            } else {
                at.get(&token)?
            };
        }
        Some(at)
    }

    /// A string's text, unescaped (borrowed when it has no escapes); `None` for
    /// anything else or a string that is not valid.
    pub fn str(&self) -> Option<Cow<'p, str>> {
        if !self.is_string() {
            return None;
        }
        json::decode_str(self.bytes())
    }

    /// Whether it is the string `want`, written without escapes.
    pub fn is_str(&self, want: &str) -> bool {
        let raw = self.bytes();
        raw.len() == want.len() + 2 && raw[0] == b'"' && &raw[1..raw.len() - 1] == want.as_bytes()
    }
}

/// Whether a key (with its quotes) may spell `cache_control`: as it is, or with
/// escapes (then longer, up to six bytes a character, and with a backslash).
pub(crate) fn may_spell_cache_control(key: &[u8]) -> bool {
    match key.len() {
        15 => key == b"\"cache_control\"",
        16..=80 => key.contains(&b'\\'),
        _ => false,
    }
}

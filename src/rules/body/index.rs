//! The body's structure from the model's tape: where each key and value is.

use super::lazy::put_last;
use super::peek::array_index;
use super::{Node, Raw};
use crate::prompt::{KeyCheck, Prompt, key_is};
use crate::provider::json::{self, Tok};

pub(crate) struct Index<'a> {
    pub(super) body: &'a [u8],
    pub(super) toks: &'a [Tok],
    /// The tokens of keys that may spell `cache_control`, in order: breakpoints
    /// are looked for only in values that hold one.
    pub(super) cache_control_keys: &'a [u32],
    pub(super) keys: &'a KeyCheck,
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
    pub(super) fn build(prompt: &'a Prompt) -> Option<Index<'a>> {
        Some(Index {
            body: prompt.body(),
            toks: prompt.tape()?,
            cache_control_keys: prompt.cache_control_keys(),
            keys: prompt.keys(),
        })
    }

    /// Whether a key repeats in one object.
    pub(super) fn keys(&self) -> &KeyCheck {
        self.keys
    }

    /// Whether readers must take each key's last value (a body without repeats
    /// has one value per key, so the first is the last).
    pub(super) fn last_wins(&self) -> bool {
        self.keys.repeated().is_some()
    }

    pub(super) fn raw(&'a self, t: usize) -> Raw<'a> {
        Raw {
            text: self.toks[t].of(self.body),
            at: (self, t as u32),
        }
    }

    /// The tokens directly inside the container at token `t`, in order (for an
    /// object: key, value, key, value…): a hop per child.
    pub(super) fn children(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
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
    pub(super) fn child(&'a self, t: usize, token: &str) -> Option<Raw<'a>> {
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
    pub(super) fn open(&'a self, t: u32) -> Option<Node<'a>> {
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

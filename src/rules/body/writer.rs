//! Writing a changed body back, with its model: untouched values are copied as the
//! bytes sent together with their tokens of the received body's tape, so the model
//! of the body sent is derived from the received one (only what rules wrote is
//! scanned) and nothing reads the whole body again.

use bytes::Bytes;
use serde_json::Value;

use super::Index;
use crate::prompt::{Format, KeyCheck, Prompt, may_spell_cache_control};
use crate::provider::json::{self, Tok};

/// A changed body being written, with its tape.
pub(crate) struct BodyWriter<'o> {
    orig: &'o Index<'o>,
    out: Vec<u8>,
    toks: Vec<Tok>,
    /// Tokens of keys that may spell `cache_control`, in document order.
    noted: Vec<u32>,
    /// The containers this writer opened and has not closed: their token, and for
    /// an object the keys written into it (to tell whether one repeats).
    open: Vec<(usize, Option<Vec<String>>)>,
    /// A container this writer wrote repeats a key.
    repeated: bool,
    /// A value copied or written could not be scanned.
    broken: bool,
    /// What was copied from the received body: (where in this one, where in that
    /// one, length), in order.
    copied: Vec<(u32, u32, u32)>,
}

impl<'o> BodyWriter<'o> {
    /// A writer of a body made from `orig`'s, about `size` bytes long.
    pub(crate) fn new(orig: &'o Index<'o>, size: usize) -> BodyWriter<'o> {
        BodyWriter {
            orig,
            out: Vec::with_capacity(size),
            toks: Vec::with_capacity(orig.toks.len() + 16),
            noted: Vec::new(),
            open: Vec::new(),
            repeated: false,
            broken: false,
            copied: Vec::new(),
        }
    }

    /// Bytes before the top-level value that make no token (a byte order mark).
    pub(super) fn prefix(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    /// The value at token `t` of the received body, as it was sent, with its tokens.
    pub(super) fn original(&mut self, t: u32) {
        let t = t as usize;
        let toks = self.orig.toks;
        let end = toks[t].next as usize;
        let from = toks[t].start as usize;
        let to = toks[t].end as usize;
        // Offsets fit in u32: the body written is refused past 4 GiB in `finish`.
        let shift = self.out.len() as i64 - from as i64;
        let base = self.toks.len() as i64 - t as i64;
        self.copied
            .push((self.out.len() as u32, from as u32, (to - from) as u32));
        self.out.extend_from_slice(&self.orig.body[from..to]);
        self.toks.extend(toks[t..end].iter().map(|k| Tok {
            start: (k.start as i64 + shift) as u32,
            end: (k.end as i64 + shift) as u32,
            next: (k.next as i64 + base) as u32,
        }));
        let noted = self.orig.cache_control_keys;
        let first = noted.partition_point(|&n| (n as usize) < t);
        let last = noted.partition_point(|&n| (n as usize) < end);
        self.noted
            .extend(noted[first..last].iter().map(|&n| (n as i64 + base) as u32));
    }

    /// The token of an untouched value of the received body, from its bytes.
    pub(super) fn token_of(&self, text: &[u8]) -> Option<u32> {
        let base = self.orig.body.as_ptr() as usize;
        let at = (text.as_ptr() as usize).checked_sub(base)?;
        // Tokens are in document order and no two start at the same byte.
        let t = self.orig.toks.partition_point(|k| (k.start as usize) < at);
        let tok = self.orig.toks.get(t)?;
        (tok.start as usize == at && tok.end as usize == at + text.len()).then_some(t as u32)
    }

    /// Opens an object (`{`) or array (`[`) this writer writes itself.
    pub(super) fn open(&mut self, bracket: u8) {
        self.open
            .push((self.toks.len(), (bracket == b'{').then(Vec::new)));
        self.toks.push(Tok {
            start: self.out.len() as u32,
            end: 0,
            next: 0,
        });
        self.out.push(bracket);
    }

    /// Closes the container opened last.
    pub(super) fn close(&mut self) {
        let Some((t, keys)) = self.open.pop() else {
            return;
        };
        self.out.push(if keys.is_some() { b'}' } else { b']' });
        let (end, next) = (self.out.len() as u32, self.toks.len() as u32);
        self.toks[t].end = end;
        self.toks[t].next = next;
    }

    /// `,` or `:` between entries.
    pub(super) fn separator(&mut self, b: u8) {
        self.out.push(b);
    }

    /// An object key (into the object opened last).
    pub(super) fn key(&mut self, key: &str) {
        let start = self.out.len();
        // A key read from the body is written as sent; one a rule wrote, as JSON.
        match self.original_key(key) {
            Some(raw) => self.out.extend_from_slice(raw),
            None => {
                // Writing a string into a Vec cannot fail.
                serde_json::to_writer(&mut self.out, key).expect("a string serialises into memory");
            }
        }
        if may_spell_cache_control(&self.out[start..]) {
            self.noted.push(self.toks.len() as u32);
        }
        self.toks.push(Tok {
            start: start as u32,
            end: self.out.len() as u32,
            next: self.toks.len() as u32 + 1,
        });
        if let Some((_, Some(keys))) = self.open.last_mut() {
            self.repeated |= keys.iter().any(|k| k == key);
            keys.push(key.to_owned());
        }
    }

    /// The quoted bytes of `key` in the received body, when it was borrowed from it.
    fn original_key(&self, key: &str) -> Option<&'o [u8]> {
        let body = self.orig.body;
        let at = (key.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
        // Borrowed keys have no escapes: the text between the quotes is the key.
        (at > 0
            && at + key.len() < body.len()
            && body[at - 1] == b'"'
            && body[at + key.len()] == b'"')
            .then(|| &body[at - 1..at + key.len() + 1])
    }

    /// A value a rule wrote, compact, and its tokens.
    pub(super) fn value(&mut self, v: &Value) {
        let start = self.out.len();
        // Writing a Value into a Vec cannot fail: no IO, and every key is a string.
        serde_json::to_writer(&mut self.out, v).expect("a JSON value serialises into memory");
        self.scan_from(start);
    }

    /// Bytes of one JSON value, copied as they are, and their tokens.
    pub(super) fn bytes(&mut self, text: &[u8]) {
        let start = self.out.len();
        self.out.extend_from_slice(text);
        self.scan_from(start);
    }

    /// Adds the tokens of the value written from `start` on.
    fn scan_from(&mut self, start: usize) {
        let mut noted = Vec::new();
        let Ok(toks) = json::tape_noting(&self.out[start..], may_spell_cache_control, &mut noted)
        else {
            // Not JSON after all: `finish` reads the whole body afresh.
            self.broken = true;
            return;
        };
        let base = self.toks.len() as u32;
        self.noted.extend(noted.iter().map(|n| n + base));
        self.toks.extend(toks.iter().map(|k| Tok {
            start: k.start + start as u32,
            end: k.end + start as u32,
            next: k.next + base,
        }));
    }

    /// The body written, as a model of `format` whose tape was derived here; `orig`
    /// the received body's repeated-key check.
    pub(crate) fn finish(self, format: Option<Format>, orig: &KeyCheck) -> Prompt {
        let body = Bytes::from(self.out);
        if u32::try_from(body.len()).is_err() || !self.open.is_empty() || self.broken {
            return Prompt::read(body, format);
        }
        let keys = match orig {
            KeyCheck::Unique if !self.repeated => KeyCheck::Unique,
            _ => match json::duplicate_key(&body, &self.toks) {
                Some(pointer) => KeyCheck::Repeated(pointer),
                None => KeyCheck::Unique,
            },
        };
        let prompt = Prompt::derived(
            body,
            self.toks,
            self.noted,
            keys,
            format,
            self.copied,
            self.orig.body,
        );
        // Every debug build (the whole test suite) checks the derivation against a read.
        #[cfg(debug_assertions)]
        {
            let read = Prompt::read(prompt.body().clone(), format);
            debug_assert_eq!(prompt.tape(), read.tape(), "derived tape");
            debug_assert_eq!(prompt.cache_control_keys(), read.cache_control_keys());
            debug_assert_eq!(prompt.keys(), read.keys(), "derived key check");
        }
        prompt
    }
}

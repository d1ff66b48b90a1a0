//! Writing a changed body back as pieces of the original and what rules wrote.

use bytes::Bytes;
use serde_json::Value;

use crate::record::SentBody;

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
    pub(super) fn offset(&self, s: &[u8]) -> Option<usize> {
        let base = self.orig.as_ptr() as usize;
        let at = (s.as_ptr() as usize).checked_sub(base)?;
        (at + s.len() <= self.orig.len()).then_some(at)
    }

    /// Bytes of a value as sent (a slice of the original when it is one).
    pub(super) fn original(&mut self, s: &[u8]) {
        match self.offset(s) {
            Some(at) => self.orig_range(at, at + s.len()),
            None => self.literal(s),
        }
    }

    pub(super) fn orig_range(&mut self, mut start: usize, end: usize) {
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
    pub(super) fn literal(&mut self, s: &[u8]) {
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
    pub(super) fn key(&mut self, key: &str) {
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
    pub(super) fn value(&mut self, v: &Value) {
        self.flush();
        let from = self.new.len();
        // Writing a Value into a Vec cannot fail: no IO, and every key is a string.
        serde_json::to_writer(&mut self.new, v).expect("a JSON value serialises into memory");
        self.extend_new(from);
    }

    /// Records `new[from..]` as written after the last piece.
    pub(super) fn extend_new(&mut self, from: usize) {
        let to = self.new.len();
        match self.pieces.last_mut() {
            Some(Piece::New(_, end)) if *end == from => *end = to,
            _ => self.pieces.push(Piece::New(from, to)),
        }
    }

    /// Places the pending run: a slice when it is long, a copy when short.
    pub(super) fn flush(&mut self) {
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

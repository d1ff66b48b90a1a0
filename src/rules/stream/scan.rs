//! Scanning a streamed text as it grows, without rescanning all of it per event.
//!
//! [`TokenClass`] is the set of characters a regex can consume. A match still to
//! come can only lie in the text's trailing run of such characters, so all text
//! before that run is settled: every match touching it is already whole. The
//! [`Holdback`] lets masked text go only where no match can be split; [`TextScans`]
//! rescans only the tail of a block for `text` tests.

use std::cell::RefCell;

use regex::Regex;
use regex_syntax::hir::{Class, Hir, HirKind};

/// How far back a `text` regex is rescanned at most: a match longer than this that
/// lies in one run of characters the regex can match may be missed. It bounds each
/// event's cost when a regex's matches have no bounded length.
pub(crate) const TEXT_WINDOW: usize = 1024;

/// The characters a regex can consume (lookarounds such as `\b` consume none).
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenClass {
    /// Sorted, merged ranges.
    ranges: Vec<(char, char)>,
}

impl TokenClass {
    /// The class of `regex`; every character when its syntax cannot be read as text.
    pub(crate) fn of(regex: &Regex) -> TokenClass {
        let mut ranges = Vec::new();
        let read = regex_syntax::parse(regex.as_str()).is_ok_and(|h| collect(&h, &mut ranges));
        if !read {
            // Unknown: any character may be part of a match (the byte cap still bounds a hold).
            ranges = vec![('\0', char::MAX)];
        }
        let mut class = TokenClass { ranges };
        class.merge();
        class
    }

    /// Adds `other`'s characters.
    pub(crate) fn union(&mut self, other: &TokenClass) {
        self.ranges.extend_from_slice(&other.ranges);
        self.merge();
    }

    fn merge(&mut self) {
        self.ranges.sort_unstable();
        let mut out: Vec<(char, char)> = Vec::with_capacity(self.ranges.len());
        for &(a, b) in &self.ranges {
            match out.last_mut() {
                Some(last) if u32::from(a) <= u32::from(last.1).saturating_add(1) => {
                    last.1 = last.1.max(b);
                }
                _ => out.push((a, b)),
            }
        }
        self.ranges = out;
    }

    /// Whether a match may contain `c`.
    pub(crate) fn contains(&self, c: char) -> bool {
        let i = self.ranges.partition_point(|r| r.1 < c);
        self.ranges.get(i).is_some_and(|r| r.0 <= c)
    }

    /// Where the trailing run of class characters of `text` starts, looking only at
    /// `text[from..]`: `None` when all of it is in the class (the run began earlier).
    pub(crate) fn run_start(&self, text: &str, from: usize) -> Option<usize> {
        text.get(from..)?
            .char_indices()
            .rev()
            .find(|(_, c)| !self.contains(*c))
            .map(|(i, c)| from + i + c.len_utf8())
    }
}

/// Adds the characters `hir` can consume to `out`; false when some are not text.
fn collect(hir: &Hir, out: &mut Vec<(char, char)>) -> bool {
    match hir.kind() {
        HirKind::Empty | HirKind::Look(_) => true,
        HirKind::Literal(lit) => match std::str::from_utf8(&lit.0) {
            Ok(s) => {
                out.extend(s.chars().map(|c| (c, c)));
                true
            }
            Err(_) => false,
        },
        HirKind::Class(Class::Unicode(c)) => {
            out.extend(c.ranges().iter().map(|r| (r.start(), r.end())));
            true
        }
        HirKind::Class(Class::Bytes(c)) => c.ranges().iter().all(|r| {
            // Only ASCII bytes are characters of their own.
            let ascii = r.end().is_ascii();
            if ascii {
                out.push((char::from(r.start()), char::from(r.end())));
            }
            ascii
        }),
        HirKind::Repetition(r) => collect(&r.sub, out),
        HirKind::Capture(c) => collect(&c.sub, out),
        HirKind::Concat(v) | HirKind::Alternation(v) => v.iter().all(|h| collect(h, out)),
    }
}

/// A span of released text that a mask replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hit {
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// Where the whole match ends (past `end` when only part of it is released now).
    pub(crate) match_end: usize,
    /// Which of the regexes given to [`Holdback::take`].
    pub(crate) mask: usize,
    /// The match starts at `start`: its marker goes there. Otherwise the span only goes.
    pub(crate) marker: bool,
}

/// How far a growing text may be let go so that no match of a set of regexes is
/// split, and the matches in what goes.
///
/// Text before the trailing run of characters the regexes can match (their
/// [`TokenClass`]) is settled and may go at once, whatever the time. The run (a
/// token that may still become, or grow, a match) is held until a character that
/// cannot be in a match ends it, or the text ends ([`Holdback::close`]). A run longer
/// than `2 × cap` bytes is let go up to `cap` bytes before its end: a match is then
/// still caught whole if the regex matches it within its first `cap` bytes, and the
/// rest of the run after such a match goes with it (a key's tail is never released).
#[derive(Debug)]
pub(crate) struct Holdback {
    class: TokenClass,
    cap: usize,
    /// The text up to here has been let go.
    released: usize,
    /// Where the trailing run starts: no match still to come begins before it.
    run: usize,
    /// The text's length at the last push.
    len: usize,
    /// A settled match (its end and mask) that reaches past `released`.
    carry: Option<(usize, usize)>,
    /// A match the cap cut (its mask): the rest of its run goes too.
    open: Option<usize>,
}

impl Holdback {
    /// Holds the text from `at` on (what came before has gone).
    pub(crate) fn new(class: TokenClass, cap: usize, at: usize) -> Holdback {
        Holdback {
            class,
            cap,
            released: at,
            run: at,
            len: at,
            carry: None,
            open: None,
        }
    }

    /// Another regex applies from now: its characters join the class (the run is
    /// found again in the held text) and the larger cap holds.
    pub(crate) fn widen(&mut self, class: &TokenClass, cap: usize, text: &str) {
        self.class.union(class);
        self.cap = self.cap.max(cap);
        self.run = self
            .class
            .run_start(text, self.released)
            .unwrap_or(self.released);
        self.len = text.len();
    }

    /// The text grew to `text` (the old text is its prefix).
    pub(crate) fn push(&mut self, text: &str) {
        if let Some(run) = self.class.run_start(text, self.len) {
            self.run = run;
        }
        self.len = text.len();
    }

    /// The text ended: no match can grow any more, all of it is settled.
    pub(crate) fn close(&mut self) {
        self.run = self.len;
    }

    /// How far the text may go now (callers cut at their own boundaries below it).
    pub(crate) fn limit(&self) -> usize {
        let settled = self.run.max(self.released);
        if self.len - settled > self.cap.saturating_mul(2) {
            self.len - self.cap
        } else {
            settled
        }
    }

    /// Lets the text go up to `to` (at most [`Holdback::limit`]); returns the spans of
    /// the newly released text that `masks` replace, in order.
    pub(crate) fn take(&mut self, text: &str, to: usize, masks: &[&Regex]) -> Vec<Hit> {
        let mut hits = Vec::new();
        let mut at = self.released;
        if to <= at {
            return hits;
        }
        self.released = to;
        if let Some((end, mask)) = self.carry.take() {
            hits.push(Hit {
                start: at,
                end: end.min(to),
                match_end: end,
                mask,
                marker: false,
            });
            if end > to {
                self.carry = Some((end, mask));
                return hits;
            }
            at = end;
        }
        if let Some(mask) = self.open {
            // The cut match runs on through the class's characters.
            let stop = text[at..to]
                .char_indices()
                .find(|(_, c)| !self.class.contains(*c))
                .map_or(to, |(i, _)| at + i);
            if stop > at {
                hits.push(Hit {
                    start: at,
                    end: stop,
                    match_end: stop,
                    mask,
                    marker: false,
                });
            }
            if stop == to {
                return hits;
            }
            self.open = None;
            at = stop;
        }
        while at < to {
            count(text.len() - at);
            let Some((start, end, mask)) = leftmost(masks, text, at, to) else {
                break;
            };
            if start < self.run {
                // Settled: the match is whole.
                hits.push(Hit {
                    start,
                    end: end.min(to),
                    match_end: end,
                    mask,
                    marker: true,
                });
                if end > to {
                    self.carry = Some((end, mask));
                    break;
                }
                at = end;
            } else {
                // The cap cut a match in the run: it and the rest of the run go.
                hits.push(Hit {
                    start,
                    end: to,
                    match_end: end,
                    mask,
                    marker: true,
                });
                self.open = Some(mask);
                break;
            }
        }
        hits
    }
}

/// The leftmost non-empty match of any regex starting in `from..before` (the longest
/// on a tie): its start, end and regex.
fn leftmost(
    masks: &[&Regex],
    text: &str,
    from: usize,
    before: usize,
) -> Option<(usize, usize, usize)> {
    let mut best: Option<(usize, usize, usize)> = None;
    for (i, re) in masks.iter().enumerate() {
        let mut at = from;
        while at < before {
            let Some(m) = re.find_at(text, at) else {
                break;
            };
            if m.start() >= before {
                break;
            }
            if m.start() < m.end() {
                let better =
                    best.is_none_or(|b| m.start() < b.0 || (m.start() == b.0 && m.end() > b.1));
                if better {
                    best = Some((m.start(), m.end(), i));
                }
                break;
            }
            // An empty match: look again one character on.
            at = m.end() + text[m.end()..].chars().next().map_or(1, char::len_utf8);
        }
    }
    best
}

/// How a `text` regex is rescanned as its block grows: from the start of the run
/// of characters it can match, at most its longest match (or [`TEXT_WINDOW`]) back.
#[derive(Debug)]
pub(crate) struct Tail {
    class: TokenClass,
    window: usize,
}

impl Tail {
    pub(crate) fn of(regex: &Regex) -> Tail {
        let longest = regex_syntax::parse(regex.as_str())
            .ok()
            .and_then(|h| h.properties().maximum_len());
        Tail {
            class: TokenClass::of(regex),
            window: longest.map_or(TEXT_WINDOW, |n| n.min(TEXT_WINDOW)),
        }
    }
}

/// Where one `text` test stands in the current block.
#[derive(Debug, Default)]
struct TextState {
    /// The block's length at the last test.
    seen: usize,
    /// No match that may still be new starts before this.
    from: usize,
    /// Where the trailing run of the regex's characters starts.
    run: usize,
    /// A match was found that more text cannot undo.
    found: bool,
}

/// The `text` tests' state in one content block, keyed by the test's address (the
/// rule set outlives the block): each event costs the new text and a bounded tail,
/// not the whole block.
#[derive(Debug, Default)]
pub(crate) struct TextScans(RefCell<Vec<(usize, TextState)>>);

impl TextScans {
    fn with<T>(&self, key: usize, text: &str, f: impl FnOnce(&mut TextState) -> T) -> T {
        let mut all = self.0.borrow_mut();
        let i = match all.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                all.push((key, TextState::default()));
                all.len() - 1
            }
        };
        let st = &mut all[i].1;
        if text.len() < st.seen {
            // Not the text it saw grow: start over.
            *st = TextState::default();
        }
        f(st)
    }

    /// Whether the block's text so far contains `needle`.
    pub(crate) fn contains(&self, key: usize, needle: &str, text: &str) -> bool {
        self.with(key, text, |st| {
            if !st.found {
                let from = floor(text, st.seen.saturating_sub(needle.len().saturating_sub(1)));
                count(text.len() - from);
                st.found = text[from..].contains(needle);
                st.seen = text.len();
            }
            st.found
        })
    }

    /// Whether `regex` matches the block's text so far.
    pub(crate) fn regex(&self, key: usize, regex: &Regex, tail: &Tail, text: &str) -> bool {
        self.with(key, text, |st| {
            if st.found {
                return true;
            }
            count(text.len() - st.from);
            let hit = regex.find_at(text, st.from);
            if let Some(run) = tail.class.run_start(text, st.seen) {
                st.run = run;
            }
            st.seen = text.len();
            st.from = floor(text, st.run.max(text.len().saturating_sub(tail.window)));
            match hit {
                // A match that ends before the text does stays one whatever follows.
                Some(m) if m.end() < text.len() => {
                    st.found = true;
                    true
                }
                Some(_) => true,
                None => false,
            }
        })
    }
}

/// `at`, or the char boundary before it.
fn floor(text: &str, mut at: usize) -> usize {
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
thread_local! {
    /// Bytes the scans of this thread handed to a regex or substring search.
    pub(crate) static SCANNED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
fn count(n: usize) {
    SCANNED.with(|c| c.set(c.get() + n));
}

#[cfg(not(test))]
fn count(_: usize) {}

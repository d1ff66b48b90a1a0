//! The one JSON structure scanner: byte spans of values, read once, never copied.
//!
//! The prompt model ([`crate::prompt`]) and the model sniff need the parts of agent
//! bodies of hundreds of KB as the exact bytes sent. `serde_json`'s raw values check
//! UTF-8 again at every level they are asked about (profiled at ~40 % of a capture
//! writer's CPU); the [`tape`] jumps over string contents with `memchr` and keeps a
//! token per key and value. It does not validate what it skips: a body it cannot
//! follow is an error, never a guess; decoding happens only for the strings a
//! caller reads.

use std::borrow::Cow;

mod continued;

pub use continued::{Before, Moved, Reused, tape_continuing};

/// A byte range of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn of(self, body: &[u8]) -> &[u8] {
        &body[self.start..self.end]
    }
}

/// Why a body could not be scanned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed JSON at byte {0}")]
pub struct ScanError(pub usize);

/// The UTF-8 byte order mark.
pub const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Where a body's JSON text may start: past a leading UTF-8 byte order mark (3),
/// else 0. RFC 8259 lets a parser ignore one, and lenient parsers (the provider's,
/// Python's `json.loads` of bytes) do: every reader must, or a BOM hides the body.
pub fn skip_bom(b: &[u8]) -> usize {
    if b.starts_with(BOM) { BOM.len() } else { 0 }
}

/// Index of the first non-whitespace byte at or after `i`.
pub fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// `i` is at a string's opening quote; the index just past its closing quote. Only
/// quotes stop the search; a quote after an odd run of backslashes is escaped.
pub fn skip_string(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        let at = j + find_quote(b.get(j..)?)?;
        let escapes = b[i + 1..at]
            .iter()
            .rev()
            .take_while(|&&c| c == b'\\')
            .count();
        if escapes % 2 == 0 {
            return Some(at + 1);
        }
        j = at + 1;
    }
}

/// The first quote in `hay`. On x86-64 with AVX2 the searcher is made once: the
/// tape calls this ~2,000 times per 200 KB body (most calls find an escaped quote
/// a few bytes on), and `memchr::memchr` picks its implementation on every call.
fn find_quote(hay: &[u8]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if let Some(one) = &*QUOTE_AVX2 {
        return one.find(hay);
    }
    memchr::memchr(b'"', hay)
}

#[cfg(target_arch = "x86_64")]
static QUOTE_AVX2: std::sync::LazyLock<Option<memchr::arch::x86_64::avx2::memchr::One>> =
    std::sync::LazyLock::new(|| memchr::arch::x86_64::avx2::memchr::One::new(b'"'));

/// `i` is at the first byte of a value; the index just past it.
pub fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *b.get(j)? {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while let Some(&c) = b.get(j) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// One key or value of a [`tape`]: its byte range, and the index of the first token
/// after it (for a container, after everything inside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tok {
    /// Where the key or value starts in the body.
    pub start: u32,
    /// Just past its end.
    pub end: u32,
    /// The index of the token after it and everything inside it.
    pub next: u32,
}

impl Tok {
    /// Its bytes in `body` (the body the tape was made of).
    pub fn of(self, body: &[u8]) -> &[u8] {
        &body[self.start as usize..self.end as usize]
    }
}

/// Scans `body` as one JSON value, every level, in one pass: a token per value and
/// per object key, in document order. A container's children are the tokens from
/// its index + 1 up to its `next` (for an object: key, value, key, value…). Works
/// without recursion, so nesting depth costs no stack. It checks the structure at
/// every level, not what it skips (string contents are decoded where read); a body
/// of 4 GiB or more is refused. A leading byte order mark is read past ([`skip_bom`]).
pub fn tape(body: &[u8]) -> Result<Vec<Tok>, ScanError> {
    tape_noting(body, |_| false, &mut Vec::new())
}

/// [`tape`], also noting (in `noted`, in document order) the token of each object
/// key for which `note(key)` holds, `key` with its quotes: a reader looking for a
/// key then knows where it cannot be, while the key's bytes were at hand anyway.
pub fn tape_noting(
    body: &[u8],
    note: impl Fn(&[u8]) -> bool,
    noted: &mut Vec<u32>,
) -> Result<Vec<Tok>, ScanError> {
    scan(
        body,
        &note,
        noted,
        &mut Keys::default(),
        Start::fresh(body),
        &mut None,
    )
}

/// [`tape_noting`], also telling whether every object's keys are distinct, compared
/// on the way: `true` proves it, `false` means [`duplicate_key`] must decide (a key
/// came twice, was spelt with an escape, or an object had too many to compare
/// pairwise). Agent bodies are nearly always proven, which spares that second pass.
pub fn tape_checking(
    body: &[u8],
    note: impl Fn(&[u8]) -> bool,
    noted: &mut Vec<u32>,
) -> Result<(Vec<Tok>, bool), ScanError> {
    let mut keys = Keys::checking();
    let toks = scan(body, &note, noted, &mut keys, Start::fresh(body), &mut None)?;
    Ok((toks, !keys.unsure))
}

/// The repeated-key check [`tape_checking`] makes as it scans.
#[derive(Default)]
struct Keys {
    on: bool,
    /// The key tokens of the open objects, outermost first.
    open: Vec<u32>,
    /// The check cannot prove the keys distinct; it stops looking.
    unsure: bool,
}

impl Keys {
    /// A check that compares keys (the default does not).
    fn checking() -> Keys {
        Keys {
            on: true,
            ..Keys::default()
        }
    }

    /// Notes the key token `key` (`escaped`: spelt with an escape) of the object
    /// whose keys start at `base` in `open`.
    fn key(&mut self, body: &[u8], toks: &[Tok], base: usize, key: u32, escaped: bool) {
        if !self.on || self.unsure {
            return;
        }
        // Past this many keys a pairwise check costs more than `duplicate_key`'s set.
        const FEW: usize = 16;
        let mine = &self.open[base..];
        let raw = toks[key as usize].of(body);
        if escaped || mine.len() >= FEW || mine.iter().any(|&k| toks[k as usize].of(body) == raw) {
            self.unsure = true;
        } else {
            self.open.push(key);
        }
    }
}

/// Where [`scan`] begins: at the body's first value, or part way in, with the
/// tokens before taken from another body's tape ([`continued`]).
struct Start<'a> {
    toks: Vec<Tok>,
    /// The open containers: their token index, whether each is an object, and where
    /// its keys start in `keys.open`.
    open: Vec<(usize, bool, usize)>,
    i: usize,
    /// `i` is just past a value (else at one).
    after_value: bool,
    /// Another tape's end, to take over once the scan stands where it stood.
    tail: Option<continued::Tail<'a>>,
}

impl Start<'_> {
    fn fresh(body: &[u8]) -> Start<'static> {
        Start {
            // Bodies carry a key or value every ~100 bytes; reserving about that
            // avoids regrowth.
            toks: Vec::with_capacity(body.len() / 64 + 8),
            open: Vec::new(),
            i: skip_ws(body, skip_bom(body)),
            after_value: false,
            tail: None,
        }
    }
}

fn scan(
    body: &[u8],
    note: &impl Fn(&[u8]) -> bool,
    noted: &mut Vec<u32>,
    keys: &mut Keys,
    from: Start<'_>,
    taken: &mut Option<Moved>,
) -> Result<Vec<Tok>, ScanError> {
    if u32::try_from(body.len()).is_err() {
        return Err(ScanError(0));
    }
    let at = |i: usize| i as u32; // in range: the length fits in a u32
    let Start {
        mut toks,
        mut open,
        mut i,
        after_value,
        mut tail,
    } = from;
    // Where the other tape's end may be taken over; never for a fresh scan.
    let mut tail_from = tail.as_ref().map_or(usize::MAX, continued::Tail::from);
    let mut at_value = !after_value;
    'value: loop {
        if !at_value {
            at_value = true;
        } else {
            // `i` is at a value.
            let start = i;
            match body.get(i) {
                Some(&c @ (b'{' | b'[')) => {
                    toks.push(Tok {
                        start: at(i),
                        end: 0,
                        next: 0,
                    });
                    let base = keys.open.len();
                    open.push((toks.len() - 1, c == b'{', base));
                    i = skip_ws(body, i + 1);
                    let close = if c == b'{' { b'}' } else { b']' };
                    if body.get(i) != Some(&close) {
                        if c == b'{' {
                            i = tape_key(body, i, &mut toks, note, noted, keys, base)?;
                        }
                        continue 'value;
                    }
                    // Empty: closed just below.
                }
                Some(b'"') => {
                    i = skip_string(body, i).ok_or(ScanError(i))?;
                    toks.push(Tok {
                        start: at(start),
                        end: at(i),
                        next: at(toks.len() + 1),
                    });
                }
                Some(_) => {
                    i = skip_value(body, i).ok_or(ScanError(i))?;
                    toks.push(Tok {
                        start: at(start),
                        end: at(i),
                        next: at(toks.len() + 1),
                    });
                }
                None => return Err(ScanError(i)),
            }
        }
        // After a value (or at the close of an empty container): commas and closes.
        loop {
            if i >= tail_from
                && let Some(t) = tail.as_mut()
            {
                if let Some(moved) = t.take_over(body, &mut toks, &open, i, keys, noted) {
                    *taken = Some(moved);
                    return Ok(fitted(toks));
                }
                tail_from = t.from();
            }
            i = skip_ws(body, i);
            let Some(&(top, object, base)) = open.last() else {
                break 'value;
            };
            let close = if object { b'}' } else { b']' };
            match body.get(i) {
                Some(&c) if c == close => {
                    toks[top].end = at(i + 1);
                    toks[top].next = at(toks.len());
                    keys.open.truncate(base);
                    open.pop();
                    i += 1;
                }
                Some(b',') => {
                    i = skip_ws(body, i + 1);
                    if object {
                        i = tape_key(body, i, &mut toks, note, noted, keys, base)?;
                    }
                    continue 'value;
                }
                _ => return Err(ScanError(i)),
            }
        }
    }
    if i != body.len() {
        return Err(ScanError(i));
    }
    Ok(fitted(toks))
}

/// Reserved for dense bodies; agent bodies use about half (a tape of 1 MB kept ~90
/// KB it never used, 64 in flight ~6 MB). Shrinking in place copies nothing.
fn fitted(mut toks: Vec<Tok>) -> Vec<Tok> {
    if toks.capacity() - toks.len() > toks.len() / 4 {
        toks.shrink_to_fit();
    }
    toks
}

/// `i` is at a key of the object whose keys start at `base` in `keys.open`: pushes
/// it, and returns where its value starts.
fn tape_key(
    body: &[u8],
    i: usize,
    toks: &mut Vec<Tok>,
    note: &impl Fn(&[u8]) -> bool,
    noted: &mut Vec<u32>,
    keys: &mut Keys,
    base: usize,
) -> Result<usize, ScanError> {
    if body.get(i) != Some(&b'"') {
        return Err(ScanError(i));
    }
    let (end, escaped) = match short_key_end(body, i) {
        Some(end) => (end, false),
        None => {
            let end = skip_string(body, i).ok_or(ScanError(i))?;
            (end, memchr::memchr(b'\\', &body[i..end]).is_some())
        }
    };
    if note(&body[i..end]) {
        noted.push(toks.len() as u32);
    }
    toks.push(Tok {
        start: i as u32,
        end: end as u32,
        next: (toks.len() + 1) as u32,
    });
    keys.key(body, toks, base, (toks.len() - 1) as u32, escaped);
    let colon = skip_ws(body, end);
    if body.get(colon) != Some(&b':') {
        return Err(ScanError(colon));
    }
    Ok(skip_ws(body, colon + 1))
}

/// The JSON pointer of the first key that occurs a second time in one object of
/// `body` (`toks` its [`tape`]), at that second occurrence. Keys compare as decoded,
/// so `"mod\u0065l"` repeats `"model"`: a last-wins parser reads them as one key.
pub fn duplicate_key(body: &[u8], toks: &[Tok]) -> Option<String> {
    // Agent objects hold a handful of keys; past this many a set beats comparing all.
    const FEW: usize = 16;
    let mut seen: Vec<Cow<'_, [u8]>> = Vec::new();
    let mut many: std::collections::HashSet<Cow<'_, [u8]>> = std::collections::HashSet::new();
    for (t, tok) in toks.iter().enumerate() {
        if body.get(tok.start as usize) != Some(&b'{') {
            continue;
        }
        seen.clear();
        many.clear();
        let end = tok.next as usize;
        let mut k = t + 1;
        while k < end {
            let key = key_bytes(toks[k].of(body));
            let repeated = if seen.len() < FEW {
                let hit = seen.contains(&key);
                seen.push(key);
                hit
            } else {
                if many.is_empty() {
                    many.extend(seen.drain(..));
                }
                !many.insert(key)
            };
            if repeated {
                return Some(pointer_text(&path_to(body, toks, k)));
            }
            // The key's value follows it; the next key follows the value.
            k = toks.get(k + 1).map_or(end, |v| v.next as usize);
        }
    }
    None
}

/// A key's text as bytes, to compare: as written when it has no escape (nearly
/// every key: no decoding, no UTF-8 check), else decoded (as written when it is
/// not valid).
fn key_bytes(raw: &[u8]) -> Cow<'_, [u8]> {
    // Decoding every key cost 15-22 µs of a 200 KB body's check, this 6-12 (benches/prompt).
    let inner = &raw[1..raw.len() - 1];
    if memchr::memchr(b'\\', inner).is_none() {
        return Cow::Borrowed(inner);
    }
    match decode_str(raw) {
        Some(text) => Cow::Owned(text.into_owned().into_bytes()),
        None => Cow::Borrowed(raw),
    }
}

/// A key as text: decoded, or its bytes as written when it is not valid.
fn key_text(raw: &[u8]) -> Cow<'_, str> {
    decode_str(raw).unwrap_or_else(|| String::from_utf8_lossy(raw))
}

/// The pointer tokens from the root of a tape to its token `target` (a key: the
/// path ends with that key).
fn path_to(body: &[u8], toks: &[Tok], target: usize) -> Vec<String> {
    let mut path = Vec::new();
    let mut at = 0;
    'down: while at < target {
        let object = body.get(toks[at].start as usize) == Some(&b'{');
        for (index, (key, value)) in children(toks, at, object).enumerate() {
            if let Some(key) = key
                && key == target
            {
                path.push(key_text(toks[key].of(body)).into_owned());
                break 'down;
            }
            if (value..toks[value].next as usize).contains(&target) {
                path.push(match key {
                    Some(key) => key_text(toks[key].of(body)).into_owned(),
                    None => index.to_string(),
                });
                at = value;
                continue 'down;
            }
        }
        break;
    }
    path
}

/// The value tokens directly inside the container `c` (for an object, each key's
/// value, with the key), in order.
fn children(toks: &[Tok], c: usize, object: bool) -> impl Iterator<Item = (Option<usize>, usize)> {
    let end = toks[c].next as usize;
    let mut idx = c + 1;
    std::iter::from_fn(move || {
        if idx >= end {
            return None;
        }
        let (key, value) = if object {
            (Some(idx), idx + 1)
        } else {
            (None, idx)
        };
        idx = toks.get(value)?.next as usize;
        Some((key, value))
    })
}

/// The RFC 6901 text of pointer tokens (`~` and `/` escaped).
pub fn pointer_text(tokens: &[String]) -> String {
    let mut out = String::with_capacity(tokens.iter().map(|t| t.len() + 1).sum());
    for t in tokens {
        out.push('/');
        if t.contains(['~', '/']) {
            out.push_str(&t.replace('~', "~0").replace('/', "~1"));
        } else {
            out.push_str(t);
        }
    }
    out
}

/// A JSON string literal (with its quotes) as text: borrowed when it has no
/// escapes, else unescaped; `None` when it is not valid (a bad escape, a lone
/// surrogate, bytes that are not UTF-8). Strings are read where rules, capture
/// and the sniff look; serde_json would copy even the ones without escapes.
pub fn decode_str(raw: &[u8]) -> Option<Cow<'_, str>> {
    let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    let Some(first) = memchr::memchr(b'\\', inner) else {
        return std::str::from_utf8(inner).ok().map(Cow::Borrowed);
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut i = 0;
    let mut next = Some(first);
    while let Some(at) = next {
        out.extend_from_slice(&inner[i..at]);
        let (ch, len) = unescape(&inner[at..])?;
        let mut utf8 = [0u8; 4];
        out.extend_from_slice(ch.encode_utf8(&mut utf8).as_bytes());
        i = at + len;
        next = memchr::memchr(b'\\', &inner[i..]).map(|k| i + k);
    }
    out.extend_from_slice(&inner[i..]);
    String::from_utf8(out).ok().map(Cow::Owned)
}

/// The character of the escape `s` starts with (at its backslash), and the
/// escape's length.
fn unescape(s: &[u8]) -> Option<(char, usize)> {
    let c = match *s.get(1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let hi = hex4(s.get(2..6)?)?;
            if !(0xD800..0xE000).contains(&hi) {
                return Some((char::from_u32(hi)?, 6));
            }
            // A surrogate: only a high one followed by an escaped low one is a character.
            if hi >= 0xDC00 || s.get(6..8)? != b"\\u" {
                return None;
            }
            let lo = hex4(s.get(8..12)?)?;
            if !(0xDC00..0xE000).contains(&lo) {
                return None;
            }
            let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
            return Some((char::from_u32(c)?, 12));
        }
        _ => return None,
    };
    Some((c, 2))
}

/// Four hex digits.
fn hex4(s: &[u8]) -> Option<u32> {
    s.iter()
        .try_fold(0u32, |n, &b| Some(n * 16 + (b as char).to_digit(16)?))
}

/// Where a key of at most 15 bytes without escapes ends (just past its closing
/// quote); `None` for any other. Nearly every key is one: tested a word at a
/// time, they cost a fraction of a `memchr` call.
fn short_key_end(body: &[u8], i: usize) -> Option<usize> {
    let word = |at: usize| {
        body.get(at..at + 8)
            .and_then(|w| w.try_into().ok())
            .map(u64::from_le_bytes)
    };
    for at in [i + 1, i + 9] {
        let w = word(at)?;
        let quote = has_byte(w, b'"');
        let backslash = has_byte(w, b'\\');
        // The lowest flag of each test is exact (flags above a match may be false).
        if quote != 0 && (backslash == 0 || quote.trailing_zeros() < backslash.trailing_zeros()) {
            return Some(at + quote.trailing_zeros() as usize / 8 + 1);
        }
        if backslash != 0 {
            return None;
        }
    }
    None
}

/// The high bit of each byte of `word` equal to `b`, and maybe of bytes after one.
fn has_byte(word: u64, b: u8) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let x = word ^ (ONES * u64::from(b));
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// Whether a key (with its quotes) spells `want`; `None` when it does not decode.
pub(crate) fn key_is(key: &[u8], want: &str) -> Option<bool> {
    let inner = &key[1..key.len() - 1];
    // An escape is longer than the character it spells: a key spelled with escapes
    // is longer than its text, so only a longer key needs decoding.
    if inner.len() <= want.len() {
        return Some(inner == want.as_bytes() && !inner.contains(&b'\\'));
    }
    if !inner.contains(&b'\\') {
        return Some(false);
    }
    Some(decode_str(key)? == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dup(body: &str) -> Option<String> {
        let found = duplicate_key(body.as_bytes(), &tape(body.as_bytes()).unwrap());
        let (_, unique) = tape_checking(body.as_bytes(), |_| false, &mut Vec::new()).unwrap();
        assert!(!unique || found.is_none(), "proved distinct: {body}");
        found
    }

    #[test]
    fn the_scan_proves_distinct_keys_on_the_way_where_it_can() {
        let proved = |body: &str| {
            tape_checking(body.as_bytes(), |_| false, &mut Vec::new())
                .unwrap()
                .1
        };
        // Keys of closed objects are forgotten; the outer object's are kept.
        assert!(proved(r#"{"a":{"k":1,"x":[{"k":2}]},"k":{"k":3},"b":[]}"#));
        assert!(!proved(r#"{"a":{"x":1},"b":1,"a":2}"#));
        assert!(!proved(r#"[{"a":1},{"a":1,"b":{"c":[{"d":1,"d":2}]}}]"#));
        assert!(proved(r#"[{"a":1},{"a":1,"b":{"c":[{"d":1,"e":2}]}}]"#));
        // An escaped key or a wide object is left to `duplicate_key`.
        assert!(!proved(r#"{"model":"a","mod\u0065m":"b"}"#));
        let keys = |n: usize| -> String {
            let list: Vec<String> = (0..n).map(|i| format!("\"k{i}\":{i}")).collect();
            format!("{{{}}}", list.join(","))
        };
        assert!(proved(&keys(16)));
        assert!(!proved(&keys(17)));
    }

    #[test]
    fn duplicate_keys_are_found_where_they_are_and_however_spelt() {
        assert_eq!(
            dup(r#"{"model":"a","messages":[],"model":"b"}"#).as_deref(),
            Some("/model")
        );
        assert_eq!(
            dup(r#"{"model":"a","mod\u0065l":"b"}"#).as_deref(),
            Some("/model")
        );
        assert_eq!(
            dup(r#"{"messages":[{"role":"user","content":"x"},{"role":"user","content":[{"type":"text","text":"a","text":"b"}]}]}"#)
                .as_deref(),
            Some("/messages/1/content/0/text")
        );
        assert_eq!(
            dup(r#"{"a/b":{"x~":1,"x~":2}}"#).as_deref(),
            Some("/a~1b/x~0")
        );
        // The same key in different objects, or as a string value, is no duplicate.
        assert_eq!(
            dup(r#"{"a":{"k":1},"b":{"k":1},"k":"k","m":["k","k"]}"#),
            None
        );
        assert_eq!(dup(r#"{}"#), None);
        assert_eq!(
            dup(r#"[{"a":1},{"a":1,"b":{"c":[{"d":1,"d":2}]}}]"#).as_deref(),
            Some("/1/b/c/0/d")
        );
        // Objects with many keys switch to a set; the answer is the same.
        let mut wide = String::from("{");
        for i in 0..100 {
            wide.push_str(&format!("\"k{i}\":{i},"));
        }
        wide.push_str("\"k7\":0}");
        assert_eq!(dup(&wide).as_deref(), Some("/k7"));
        wide = wide.replace("\"k7\":0}", "\"z\":0}");
        assert_eq!(dup(&wide), None);
    }

    #[test]
    fn strings_end_at_their_first_unescaped_quote_short_or_long() {
        let long = "x".repeat(40);
        let cases: Vec<(String, Option<usize>)> = vec![
            (r#""""#.into(), Some(2)),
            (r#""type":1"#.into(), Some(6)),
            (r#""a\\"b""#.into(), Some(5)),
            (r#""a\"b","#.into(), Some(6)),
            (r#""\\\\\"""#.into(), Some(8)),
            (format!(r#""{long}","#), Some(42)),
            (format!(r#""{long}\"{long}""#), Some(84)),
            (format!(r#""{long}\\","#), Some(44)),
            (r#""cut short"#.into(), None),
            (r#""ends in an escape\""#.into(), None),
            ("\"".into(), None),
        ];
        for (text, want) in cases {
            assert_eq!(skip_string(text.as_bytes(), 0), want, "{text}");
        }
    }

    #[test]
    fn the_tape_follows_deep_nesting_without_recursion() {
        let depth = 200_000;
        let body = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let toks = tape(body.as_bytes()).unwrap();
        assert_eq!(toks.len(), depth);
        assert_eq!(toks[0].next as usize, depth);
        assert_eq!(toks[depth - 1].of(body.as_bytes()), b"[]");
    }

    #[test]
    fn malformed_bodies_are_errors() {
        for bad in [
            &b"{"[..],
            b"{\"a\":}",
            b"{\"a\":1,}",
            b"[1 2]",
            b"{\"a\":\"x}",
            b"{} x",
            b"",
        ] {
            assert!(tape(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        for bad in [
            &b"[1}"[..],
            b"{\"a\":[1,{\"b\":2}}",
            b"[1,]",
            b"[,1]",
            b"{\"a\" 1}",
            b"{a:1}",
        ] {
            assert!(tape(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(tape(b"[]").is_ok() && tape(b"{}").is_ok());
    }

    #[test]
    fn a_leading_byte_order_mark_is_read_past_and_only_there() {
        let body = b"\xEF\xBB\xBF {\"mod\\u0065l\":\"a\",\"model\":\"b\"}";
        let toks = tape(body).unwrap();
        assert_eq!(
            toks[0].start, 4,
            "the object starts past the mark and the space"
        );
        assert_eq!(toks[1].of(body), br#""mod\u0065l""#);
        assert_eq!(duplicate_key(body, &toks).as_deref(), Some("/model"));
        for bad in [
            &b" \xEF\xBB\xBF{}"[..],
            b"\xEF\xBB\xBF\xEF\xBB\xBF{}",
            b"\xEF\xBB{}",
            b"\xEF\xBB\xBF",
        ] {
            assert!(tape(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn strings_decode_as_serde_json_decodes_them() {
        let cases: &[&[u8]] = &[
            br#""""#,
            br#""plain""#,
            br#""caf\u00e9 \"q\" back\\slash \/ \b\f\n\r\t""#,
            "\"日本語 and \\u65e5\"".as_bytes(),
            br#""emoji \ud83d\ude42 pair""#,
            br#""\\""#,
            br#""ends with \n""#,
            br#""\u0000 nul""#,
            // Not strings serde_json accepts:
            br#""lone \ud83d high""#,
            br#""lone \ude42 low""#,
            br#""high then not low \ud83d\u0041""#,
            br#""bad \x escape""#,
            br#""short \u12""#,
            br#""not hex \u12g4""#,
            b"\"bad utf-8 \xff\"",
            b"\"bad utf-8 after an escape \\n \xc3\"",
            br#""cut \"#,
        ];
        for raw in cases {
            let ours = decode_str(raw).map(Cow::into_owned);
            let serde = serde_json::from_slice::<String>(raw).ok();
            assert_eq!(ours, serde, "{}", String::from_utf8_lossy(raw));
        }
        assert!(matches!(
            decode_str(br#""no escapes""#),
            Some(Cow::Borrowed(_))
        ));
        assert_eq!(decode_str(b"unquoted"), None);
    }

    #[test]
    fn short_keys_end_where_skip_string_says() {
        let keys: &[&[u8]] = &[
            br#""a":1"#,
            br#""type":"text""#,
            br#""cache_control":{}"#,
            br#""exactly_15_byte":1"#,
            br#""sixteen_bytes_k":1"#,
            br#""with\"quote":1"#,
            br#""esc\u0061ped":1"#,
            br#""\\":1"#,
            br#""a very long key that goes on and on":1"#,
            "\"caf\u{e9}\":1".as_bytes(),
            br#"""#,
            br#""unterminated"#,
        ];
        for key in keys {
            let want = skip_string(key, 0);
            // Padded too, so that every word is read whole.
            let padded = [*key, &[b' '; 24]].concat();
            for body in [key.to_vec(), padded] {
                if let Some(end) = short_key_end(&body, 0) {
                    assert_eq!(Some(end), want, "{}", String::from_utf8_lossy(key));
                    assert!(end <= 17, "{}", String::from_utf8_lossy(key));
                }
            }
        }
        assert_eq!(short_key_end(br#""type":"text"         "#, 0), Some(6));
        assert_eq!(short_key_end(br#""a\"b":1                "#, 0), None);
    }
}

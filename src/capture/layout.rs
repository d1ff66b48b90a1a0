//! A body as stored: a skeleton plus units. A JSON request is cut at its system
//! blocks, tools and messages (the exact bytes, from [`RequestView`]); the rest —
//! keys, commas, `max_tokens` — is the skeleton, and joining the units back at their
//! offsets gives the body byte for byte. Anything else is one unit.

use bytes::Bytes;

use crate::provider::json::{self, Node, Span};
use crate::provider::request::{RawObject, RequestView, decode_str, raw_array};

/// A body already cut, redacted and hashed (SHA-256 of each stored piece): the store
/// keeps these as they are instead of cutting the body again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parts {
    pub skeleton: (Bytes, [u8; 32]),
    /// Each unit with the skeleton offset it goes back in at.
    pub units: Vec<(usize, Bytes, [u8; 32])>,
}

/// Top-level keys whose elements are units (Anthropic and OpenAI request shapes).
const UNIT_KEYS: &[&str] = &["tools", "system", "messages", "input"];
/// A non-array value under a unit key is a unit of its own from this size on.
const SCALAR_UNIT_MIN: usize = 256;

/// A body cut into a skeleton and units.
#[derive(Debug, PartialEq, Eq)]
pub struct Split<'a> {
    pub skeleton: Vec<u8>,
    /// Each unit with the skeleton offset it goes back in at, in order.
    pub units: Vec<(usize, &'a [u8])>,
}

/// A request body read once: its top level (for the conversation key) and its cut.
#[derive(Debug)]
pub struct Cut<'a> {
    /// The top-level keys and raw values; `None` when the body is not a JSON object.
    pub view: Option<RequestView<'a>>,
    pub split: Split<'a>,
}

/// Cuts `body` into units; a body that is not a JSON object is all skeleton.
pub fn split(body: &[u8]) -> Split<'_> {
    cut(body).split
}

/// Whether [`split`] leaves `body` whole (all skeleton, no units), without copying it.
pub fn is_whole(body: &[u8]) -> bool {
    read(body).1.is_none_or(|spans| spans.is_empty())
}

/// Reads `body` once (its top level and, one level down, its unit arrays) and cuts it
/// into units.
pub fn cut(body: &[u8]) -> Cut<'_> {
    let (view, spans) = read(body);
    let Some(spans) = spans else {
        let split = Split {
            skeleton: body.to_vec(),
            units: Vec::new(),
        };
        return Cut { view, split };
    };
    let units_len: usize = spans.iter().map(|s| s.end - s.start).sum();
    let mut skeleton = Vec::with_capacity(body.len() - units_len);
    let mut units = Vec::with_capacity(spans.len());
    let mut at = 0;
    for span in spans {
        skeleton.extend_from_slice(&body[at..span.start]);
        units.push((skeleton.len(), span.of(body)));
        at = span.end;
    }
    skeleton.extend_from_slice(&body[at..]);
    // Sorted, disjoint spans of the body's own bytes: joined, the pieces are the body.
    Cut {
        view,
        split: Split { skeleton, units },
    }
}

/// `body`'s top level as [`RequestView::parse`] reads it, and its units' spans, sorted
/// and disjoint (`None`: the body stays whole).
fn read(body: &[u8]) -> (Option<RequestView<'_>>, Option<Vec<Span>>) {
    match scan_units(body) {
        Some((view, spans)) => (Some(view), disjoint(spans)),
        None => read_lenient(body),
    }
}

/// The fast path: one scan two levels deep. When it succeeds, every value it kept
/// is what the lenient path would find; a body it rejects goes the lenient way.
fn scan_units(body: &[u8]) -> Option<(RequestView<'_>, Vec<Span>)> {
    let Ok(Node::Object(_, entries)) = json::scan(body, 2) else {
        return None;
    };
    let mut top = RawObject {
        entries: Vec::with_capacity(entries.len()),
    };
    let mut spans = Vec::new();
    for (key, value) in &entries {
        let name = decode_str(key.of(body))?;
        if !bare_tokens_plain(body, value) {
            return None;
        }
        let raw = value.span();
        if UNIT_KEYS.contains(&name.as_ref()) {
            match value {
                Node::Array(_, items) => spans.extend(items.iter().map(Node::span)),
                _ if raw.end - raw.start >= SCALAR_UNIT_MIN => spans.push(raw),
                _ => {}
            }
        }
        top.entries.push((name, raw.of(body)));
    }
    Some((RequestView { top }, spans))
}

/// Whether no bare token (number, literal) among `value`'s children holds a quote or
/// a bracket. Only such a token (invalid JSON) makes the two-level scan see other
/// extents than the top-level scan, which skips the values below by counting brackets.
fn bare_tokens_plain(body: &[u8], value: &Node) -> bool {
    let special = |c: &u8| matches!(c, b'"' | b'{' | b'[');
    let plain = |child: &Node| {
        let raw = child.span().of(body);
        raw.first().is_some_and(special) || !raw.iter().any(special)
    };
    match value {
        Node::Object(_, entries) => entries.iter().all(|(_, v)| plain(v)),
        Node::Array(_, items) => items.iter().all(plain),
        Node::Leaf(_) => true,
    }
}

/// The top level alone, then each unit array on its own: a body malformed below the
/// top level (which the fast scan rejects) is cut as it always was.
fn read_lenient(body: &[u8]) -> (Option<RequestView<'_>>, Option<Vec<Span>>) {
    let Ok(view) = RequestView::parse(body) else {
        return (None, None);
    };
    let mut spans = Vec::new();
    for (key, raw) in &view.top.entries {
        if !UNIT_KEYS.contains(&key.as_ref()) {
            continue;
        }
        match raw_array(raw) {
            Some(items) => spans.extend(items.into_iter().filter_map(|i| span_in(body, i))),
            None if raw.len() >= SCALAR_UNIT_MIN => spans.extend(span_in(body, raw)),
            None => {}
        }
    }
    let spans = disjoint(spans);
    (Some(view), spans)
}

/// `spans` sorted, or `None` when two overlap.
fn disjoint(mut spans: Vec<Span>) -> Option<Vec<Span>> {
    spans.sort_unstable_by_key(|s| s.start);
    (!spans.windows(2).any(|w| w[0].end > w[1].start)).then_some(spans)
}

/// Where `part` (a slice of `body`'s memory) lies in `body`.
fn span_in(body: &[u8], part: &[u8]) -> Option<Span> {
    let base = body.as_ptr() as usize;
    let start = part.as_ptr() as usize;
    (start >= base && start + part.len() <= base + body.len()).then(|| Span {
        start: start - base,
        end: start - base + part.len(),
    })
}

/// The body from its skeleton and `(offset, unit)` pairs in order.
pub fn join<'u>(skeleton: &[u8], units: impl IntoIterator<Item = (usize, &'u [u8])>) -> Vec<u8> {
    let mut out = Vec::with_capacity(skeleton.len() * 4);
    let mut at = 0;
    for (offset, unit) in units {
        let offset = offset.clamp(at, skeleton.len());
        out.extend_from_slice(&skeleton[at..offset]);
        out.extend_from_slice(unit);
        at = offset;
    }
    out.extend_from_slice(&skeleton[at..]);
    out
}

/// The stored form of a split: the skeleton's unit id, then `(offset delta, unit id)`
/// per unit, as LEB128 varints.
pub fn encode(skeleton: i64, units: &[(usize, i64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + units.len() * 4);
    put(&mut out, skeleton as u64);
    put(&mut out, units.len() as u64);
    let mut last = 0;
    for (offset, id) in units {
        put(&mut out, (offset - last) as u64);
        put(&mut out, *id as u64);
        last = *offset;
    }
    out
}

/// Reads [`encode`]'s form back: (skeleton id, [(offset, unit id)]).
pub fn decode(bytes: &[u8]) -> Option<(i64, Vec<(usize, i64)>)> {
    let mut at = 0;
    let skeleton = get(bytes, &mut at)? as i64;
    let n = get(bytes, &mut at)? as usize;
    let mut units = Vec::with_capacity(n.min(1 << 16));
    let mut offset = 0usize;
    for _ in 0..n {
        offset = offset.checked_add(get(bytes, &mut at)? as usize)?;
        units.push((offset, get(bytes, &mut at)? as i64));
    }
    (at == bytes.len()).then_some((skeleton, units))
}

fn put(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn get(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*at)?;
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_bodies_split_at_blocks_and_join_exactly() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}, {"role":"assistant","content":"yo"}],"system":[{"type":"text","text":"s"}],"tools":[],"max_tokens":5}"#;
        let s = split(body);
        assert_eq!(s.units.len(), 3);
        assert_eq!(s.units[0].1, br#"{"role":"user","content":"hi"}"#);
        assert_eq!(
            String::from_utf8_lossy(&s.skeleton),
            r#"{"model":"m","messages":[, ],"system":[],"tools":[],"max_tokens":5}"#
        );
        assert_eq!(
            join(&s.skeleton, s.units.iter().map(|(o, u)| (*o, *u))),
            body
        );
    }

    #[test]
    fn other_bodies_are_whole() {
        for body in [&b"not json"[..], b"[1,2]", b"", b"{\"messages\":[1,"] {
            let s = split(body);
            assert!(s.units.is_empty());
            assert_eq!(s.skeleton, body);
        }
        let long = format!(r#"{{"system":"{}"}}"#, "x".repeat(300));
        assert_eq!(split(long.as_bytes()).units.len(), 1);
    }

    #[test]
    fn the_one_scan_reads_what_the_top_level_scan_reads() {
        let long = "x".repeat(300);
        let bodies = [
            format!(
                r#"{{"model":"m","metadata":{{"user_id":"u"}},"messages":[{{"role":"user","content":"{long}"}},{{"a":[1,{{"b":2}}]}}],"tools":[],"system":"{long}"}}"#
            ),
            // Malformed below the top level: the fast scan rejects these.
            format!(r#"{{"metadata":{{"a":x"y}},"messages":[{{"c":"{long}"}}]}}"#),
            format!(r#"{{"metadata":{{"a":x[y}}]}},"messages":[{{"c":"{long}"}}]}}"#),
            format!(r#"{{"messages":[{{"c":"{long}"}} {{"d":1}}],"model":"m"}}"#),
            format!(r#"{{"metadata":{{"a" 1}},"messages":[{{"c":"{long}"}}]}}"#),
            format!(r#"{{"system":{{"text":"{long}"}},"input":[1,tr"ue]}}"#),
            r#"{"messages":[1,2],"messages":[3]}"#.to_owned(),
            r#"{"aA":1,"messages":[{}]}"#.to_owned(),
            "[1]".to_owned(),
        ];
        for body in &bodies {
            let body = body.as_bytes();
            let (view, spans) = read(body);
            let (lenient_view, lenient_spans) = read_lenient(body);
            let text = String::from_utf8_lossy(body);
            assert_eq!(spans, lenient_spans, "{text}");
            assert_eq!(format!("{view:?}"), format!("{lenient_view:?}"), "{text}");
        }
        assert!(scan_units(bodies[0].as_bytes()).is_some());
        assert!(!is_whole(bodies[0].as_bytes()));
        assert!(is_whole(b"data: {}"));
    }

    #[test]
    fn layouts_round_trip() {
        let units = vec![(3usize, 7i64), (3, 300), (1000, 1 << 40)];
        let bytes = encode(12, &units);
        assert_eq!(decode(&bytes), Some((12, units)));
        assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
    }
}

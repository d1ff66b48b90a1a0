//! A body as stored: a skeleton plus units. A JSON request is cut at its system
//! blocks, tools and messages (the exact bytes, from [`RequestView`]); the rest —
//! keys, commas, `max_tokens` — is the skeleton, and joining the units back at their
//! offsets gives the body byte for byte. Anything else is one unit.

use bytes::Bytes;

use crate::provider::request::{RequestView, raw_array};

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

/// Cuts `body` into units; a body that is not a JSON object is all skeleton.
pub fn split(body: &[u8]) -> Split<'_> {
    let whole = || Split {
        skeleton: body.to_vec(),
        units: Vec::new(),
    };
    let Ok(view) = RequestView::parse(body) else {
        return whole();
    };
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for (key, raw) in &view.top.entries {
        if !UNIT_KEYS.contains(&key.as_ref()) {
            continue;
        }
        match raw_array(raw) {
            Some(items) => {
                for item in items {
                    if let Some(at) = offset_in(body, item) {
                        spans.push((at, at + item.len()));
                    }
                }
            }
            None if raw.len() >= SCALAR_UNIT_MIN => {
                if let Some(at) = offset_in(body, raw) {
                    spans.push((at, at + raw.len()));
                }
            }
            None => {}
        }
    }
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[0].1 > w[1].0) {
        return whole();
    }
    let mut skeleton = Vec::with_capacity(body.len() / 8);
    let mut units = Vec::with_capacity(spans.len());
    let mut at = 0;
    for (start, end) in spans {
        skeleton.extend_from_slice(&body[at..start]);
        units.push((skeleton.len(), &body[start..end]));
        at = end;
    }
    skeleton.extend_from_slice(&body[at..]);
    let split = Split { skeleton, units };
    // The cut must be lossless; if it is not (it always should be), keep the body whole.
    if !joins_to(&split, body) {
        return whole();
    }
    split
}

/// Whether the split's pieces, joined, are exactly `body` (without building it).
fn joins_to(split: &Split<'_>, body: &[u8]) -> bool {
    let mut rest = body;
    let mut at = 0;
    for (offset, unit) in &split.units {
        let Some(piece) = split.skeleton.get(at..*offset) else {
            return false;
        };
        let Some(after) = rest.strip_prefix(piece).and_then(|r| r.strip_prefix(*unit)) else {
            return false;
        };
        rest = after;
        at = *offset;
    }
    split.skeleton.get(at..) == Some(rest)
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

/// Where `part` (a slice of `body`'s memory) starts in `body`.
fn offset_in(body: &[u8], part: &[u8]) -> Option<usize> {
    let base = body.as_ptr() as usize;
    let start = part.as_ptr() as usize;
    (start >= base && start + part.len() <= base + body.len()).then(|| start - base)
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
    fn layouts_round_trip() {
        let units = vec![(3usize, 7i64), (3, 300), (1000, 1 << 40)];
        let bytes = encode(12, &units);
        assert_eq!(decode(&bytes), Some((12, units)));
        assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
    }
}

//! A body as stored: a skeleton plus units. A request body is cut at the units of
//! its [`Prompt`] (tools, system blocks, message content blocks: the exact bytes of
//! each [`Unit::stored`](crate::prompt::Unit::stored), a block less a trailing
//! `cache_control`); the rest — keys, commas, message roles, breakpoints,
//! `max_tokens` — is the skeleton, and joining the units back at their offsets
//! gives the body byte for byte. Anything else is one unit.

use bytes::Bytes;

use crate::prompt::Prompt;
use crate::provider::json::Span;

/// A body already cut, redacted and hashed (the content digest of each stored
/// piece): the store keeps these as they are instead of cutting the body again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parts {
    pub skeleton: (Bytes, [u8; 32]),
    /// Each unit with the skeleton offset it goes back in at.
    pub units: Vec<(usize, Bytes, [u8; 32])>,
}

impl Parts {
    /// Each stored piece's digest and bytes: the skeleton, then the units in order.
    pub(crate) fn pieces(&self) -> impl Iterator<Item = (&[u8; 32], &Bytes)> {
        std::iter::once((&self.skeleton.1, &self.skeleton.0))
            .chain(self.units.iter().map(|(_, bytes, hash)| (hash, bytes)))
    }
}

/// A body cut into a skeleton and units.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Split<'a> {
    pub skeleton: Vec<u8>,
    /// Each unit with the skeleton offset it goes back in at, in order.
    pub units: Vec<(usize, &'a [u8])>,
}

/// Cuts `prompt`'s body at its units; a body without units is all skeleton.
pub(crate) fn split(prompt: &Prompt) -> Split<'_> {
    split_at(
        prompt.body(),
        prompt.units().iter().map(|u| u.stored).collect(),
    )
}

/// The shortest run of bytes between two units that [`split_around`] stores as a
/// unit of its own: skeleton runs are keys and brackets, tens of bytes.
const GAP_UNIT: usize = 256;

/// Cuts `body` at `spans` (sorted, not overlapping), and keeps each run of at least
/// [`GAP_UNIT`] bytes between them as a unit too: a value rules changed in the body
/// sent is stored by its digest, once, not in every turn's skeleton (a 200 KB
/// conversation stored ~12.5 KB a turn with it in the skeleton, ~7.3 without).
pub(crate) fn split_around(body: &[u8], spans: impl IntoIterator<Item = Span>) -> Split<'_> {
    let mut all = Vec::new();
    let mut at = 0;
    for span in spans.into_iter().chain(std::iter::once(Span {
        start: body.len(),
        end: body.len(),
    })) {
        if span.start >= at + GAP_UNIT {
            all.push(Span {
                start: at,
                end: span.start,
            });
        }
        if span.end > span.start {
            all.push(span);
        }
        at = at.max(span.end);
    }
    split_at(body, all)
}

/// Cuts `body` at `spans` (any order); overlapping spans leave it all skeleton.
pub(crate) fn split_at(body: &[u8], mut spans: Vec<Span>) -> Split<'_> {
    // Units come in cache order; the body may hold `messages` before `tools`.
    spans.sort_unstable_by_key(|s| s.start);
    if spans.windows(2).any(|w| w[0].end > w[1].start)
        || spans.last().is_some_and(|s| s.end > body.len())
    {
        spans.clear();
    }
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
    Split { skeleton, units }
}

/// The body from its skeleton and `(offset, unit)` pairs in order.
pub(crate) fn join<'u>(
    skeleton: &[u8],
    units: impl IntoIterator<Item = (usize, &'u [u8])>,
) -> Vec<u8> {
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
pub(crate) fn encode(skeleton: i64, units: &[(usize, i64)]) -> Vec<u8> {
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

/// A body as its record's row holds it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stored<'a> {
    /// Put back together from units: the skeleton's unit id, then each unit's
    /// skeleton offset and id ([`encode`]).
    Units(i64, Vec<(usize, i64)>),
    /// Its zstd frame, in the row itself ([`encode_inline`]).
    Inline(&'a [u8]),
}

/// The stored form of a body kept in its record's row: a skeleton id of 0, which
/// no unit has, then `compressed`. For responses: no other record shares one, so a
/// unit of its own (a digest, an index entry, a row) was work for nothing.
// 200 KB conversations, full, c16: storing no response at all took the store thread
// 212–217 → 189–193 µs a record (three pairs); the row keeps all but the compression.
pub(crate) fn encode_inline(compressed: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(compressed.len() + 1);
    out.push(0);
    out.extend_from_slice(compressed);
    out
}

/// Reads a row's stored body: [`encode`]'s form or [`encode_inline`]'s.
pub(crate) fn read(bytes: &[u8]) -> Option<Stored<'_>> {
    match bytes.split_first() {
        Some((0, compressed)) => Some(Stored::Inline(compressed)),
        _ => decode(bytes).map(|(skeleton, units)| Stored::Units(skeleton, units)),
    }
}

/// Reads [`encode`]'s form back: (skeleton id, [(offset, unit id)]).
fn decode(bytes: &[u8]) -> Option<(i64, Vec<(usize, i64)>)> {
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

    use crate::prompt::Format;

    fn read(body: &[u8]) -> Prompt {
        Prompt::read(
            Bytes::copy_from_slice(body),
            Some(Format::AnthropicMessages),
        )
    }

    #[test]
    fn json_bodies_split_at_blocks_and_join_exactly() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}, {"role":"assistant","content":[{"type":"text","text":"yo"}]}],"system":[{"type":"text","text":"s"}],"tools":[],"max_tokens":5}"#;
        let prompt = read(body);
        let s = split(&prompt);
        assert_eq!(s.units.len(), 3);
        assert_eq!(s.units[0].1, br#""hi""#);
        assert_eq!(s.units[1].1, br#"{"type":"text","text":"yo""#);
        assert_eq!(
            String::from_utf8_lossy(&s.skeleton),
            r#"{"model":"m","messages":[{"role":"user","content":}, {"role":"assistant","content":[}]}],"system":[}],"tools":[],"max_tokens":5}"#
        );
        assert_eq!(
            join(&s.skeleton, s.units.iter().map(|(o, u)| (*o, *u))),
            body
        );
    }

    #[test]
    fn a_moving_breakpoint_leaves_the_stored_unit_alone() {
        let block = r#"{"type":"tool_result","tool_use_id":"t1","content":"ok"}"#;
        let bodies = [
            block.to_owned(),
            block.replace("}", r#","cache_control":{"type":"ephemeral"}}"#),
            block.replace(
                "}",
                r#", "cache_control" : {"type":"ephemeral","ttl":"1h"} }"#,
            ),
        ];
        let mut stored = Vec::new();
        for b in &bodies {
            let body = format!(r#"{{"messages":[{{"role":"user","content":[{b}]}}]}}"#);
            let prompt = read(body.as_bytes());
            let s = split(&prompt);
            assert_eq!(s.units.len(), 1);
            stored.push(s.units[0].1.to_vec());
            assert_eq!(
                join(&s.skeleton, s.units.iter().map(|(o, u)| (*o, *u))),
                body.as_bytes()
            );
        }
        assert!(stored.iter().all(|u| *u == stored[0]), "{stored:?}");
        assert_eq!(
            stored[0],
            br#"{"type":"tool_result","tool_use_id":"t1","content":"ok""#
        );
        // A breakpoint that is not last, or alone, stays inside the unit.
        for body in [
            r#"{"messages":[{"role":"user","content":[{"cache_control":{"type":"ephemeral"},"type":"text","text":"a"}]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"cache_control":{"type":"ephemeral"}}, {}]}]}"#,
        ] {
            let prompt = read(body.as_bytes());
            let s = split(&prompt);
            assert_eq!(
                join(&s.skeleton, s.units.iter().map(|(o, u)| (*o, *u))),
                body.as_bytes()
            );
        }
    }

    #[test]
    fn other_bodies_are_whole() {
        for body in [&b"not json"[..], b"[1,2]", b"", b"{\"messages\":[1,"] {
            let prompt = read(body);
            let s = split(&prompt);
            assert!(s.units.is_empty());
            assert_eq!(s.skeleton, body);
        }
        let long = format!(r#"{{"system":"{}"}}"#, "x".repeat(300));
        assert_eq!(split(&read(long.as_bytes())).units.len(), 1);
        let no_format = Prompt::read(Bytes::from(long), None);
        assert!(split(&no_format).units.is_empty());
    }

    #[test]
    fn layouts_round_trip() {
        let units = vec![(3usize, 7i64), (3, 300), (1000, 1 << 40)];
        let bytes = encode(12, &units);
        assert_eq!(decode(&bytes), Some((12, units.clone())));
        assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(super::read(&bytes), Some(Stored::Units(12, units)));
        // No unit has id 0: a body in the row reads as itself.
        assert_eq!(
            super::read(&encode_inline(b"frame")),
            Some(Stored::Inline(&b"frame"[..]))
        );
    }
}

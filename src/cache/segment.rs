//! A request cut into cache units, in the provider's cache order, with a running
//! prefix hash after every unit.
//!
//! Anthropic caches the prefix tools → system → messages. A unit is
//! one tool definition, one system block or one message content block, normalised as
//! the provider sees it: string content is one text block, `cache_control` is left
//! out, every other byte is as sent. OpenAI requests are cut the same way (tools,
//! instructions, messages or input items) for the stable-prefix view. This module
//! only describes one request; comparing requests is `explain`'s job.

use std::borrow::Cow;
use std::collections::HashMap;

use bytes::Bytes;
use regex::Regex;

use super::estimate;
use crate::digest::{self, Hasher};
use crate::prompt::{Format, Prompt, Region, Settings, Shape, Ttl, UnitPath, WrittenBody};
use crate::provider::json::ScanError;

/// A content digest (BLAKE3).
pub(crate) type Hash = digest::Digest;

/// A `cache_control` marker on a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Breakpoint {
    pub ttl: Ttl,
    /// Placed by top-level automatic caching (on the last cacheable block).
    pub automatic: bool,
}

/// One cache unit: a [`crate::prompt::Unit`] with its place in the prefix chain.
#[derive(Debug, Clone)]
pub(crate) struct Unit {
    pub path: UnitPath,
    /// The block type (`text`, `tool_use`, `tool_result`, `image`, …), `tool` for a
    /// tool definition, `item` for an OpenAI input item.
    pub kind: crate::prompt::Kind,
    /// The normalised bytes the provider caches (shares the body's bytes when the
    /// block is sent without `cache_control`).
    pub bytes: Bytes,
    /// The digest the prefix chains: of `bytes`, or for a unit sent in other bytes
    /// with the same JSON value, of the bytes it had before (see `digest_of_bytes`).
    pub hash: Hash,
    /// The running prefix hash: everything up to and including this unit, with the
    /// request-level inputs rendered into the prompt (model, settings, message roles).
    pub prefix: Hash,
    /// Lookback position: a run of consecutive `tool_use` (or `tool_result`) blocks
    /// shares one position in the prefix.
    pub position: u32,
    /// Estimated tokens (see `estimate`).
    pub tokens: u32,
    pub breakpoint: Option<Breakpoint>,
    /// Whether a breakpoint may sit here (not thinking, not an empty text block).
    pub cacheable: bool,
    /// Left out of the prefix hash by configuration (e.g. the billing header block).
    pub ignored: bool,
    /// Sent in other bytes than the earlier turn's unit at its place, with the same
    /// JSON value: it takes that unit's digest, since the provider caches the prompt
    /// the JSON renders, not the JSON text.
    pub respelled: bool,
    /// Whether `hash` is the content digest of `bytes`: not when the unit was
    /// respelled, nor when it is the same bytes as a unit whose was not. Only such a
    /// digest is lent to the prompt's unit, which a capture stores by it.
    pub digest_of_bytes: bool,
    /// Where in [`Segments::mixed`] the request-level bytes mixed into the prefix
    /// just before it are.
    mixed: (u32, u32),
}

/// The body units were cut from, kept to know a byte-identical resend.
#[derive(Debug, Clone)]
pub(crate) enum CutFrom {
    /// The body itself (its units share its bytes).
    Body(Bytes),
    /// A body rules wrote, as the body received and what rules wrote (its units
    /// share the body received): the body sent itself is let go.
    Written(WrittenBody),
}

impl CutFrom {
    /// How the cache stage holds `prompt`, the body sent: as rules wrote it, when
    /// they wrote it copying from `received`; else as itself.
    pub(crate) fn of(prompt: &Prompt, received: &Bytes) -> CutFrom {
        prompt
            .written_body(received)
            .map_or_else(|| CutFrom::Body(prompt.body().clone()), CutFrom::Written)
    }

    /// Whether both are the same bytes, compared as they are held (a body rules
    /// wrote is not put back together to be compared).
    pub(crate) fn same(&self, other: &CutFrom) -> bool {
        match (self, other) {
            (CutFrom::Written(a), CutFrom::Written(b)) => a.same(b),
            _ => crate::prompt::same_pieces(&self.pieces(), &other.pieces()),
        }
    }

    fn pieces(&self) -> Vec<&[u8]> {
        match self {
            CutFrom::Body(b) => vec![&b[..]],
            CutFrom::Written(w) => w.pieces(),
        }
    }
}

/// A request as cache units.
#[derive(Debug, Clone)]
pub(crate) struct Segments {
    /// The body the units were cut from.
    pub body: CutFrom,
    pub format: Format,
    pub units: Vec<Unit>,
    pub settings: Settings,
    /// Indices of the units that carry a breakpoint, in order.
    pub breakpoints: Vec<usize>,
    /// The request-level bytes (settings, message roles and fields) mixed into the
    /// prefix, each unit's before it, in order: what a later turn compares its own
    /// with to take a prefix as it was.
    mixed: Vec<u8>,
    /// Every object of the body has distinct keys, so two of its units that hold the
    /// same JSON value have the same [`value_size`].
    pub(crate) unique_keys: bool,
}

impl Unit {
    /// A tool definition's name (`name`, or OpenAI's `function.name`).
    pub(crate) fn tool_name(&self) -> Option<String> {
        if self.path.region != Region::Tools {
            return None;
        }
        let tool = Prompt::read(self.bytes.clone(), None);
        let root = tool.root()?;
        let name = root
            .get("name")
            .or_else(|| root.get("function").and_then(|f| f.get("name")))?;
        Some(name.str()?.into_owned())
    }
}

impl Segments {
    /// Estimated tokens of the whole prompt.
    pub(crate) fn total_tokens(&self) -> u64 {
        self.units.iter().map(|u| u64::from(u.tokens)).sum()
    }

    /// The first unit of `region`, if the request has one.
    pub(crate) fn region_start(&self, region: Region) -> Option<usize> {
        self.units.iter().position(|u| u.path.region == region)
    }

    /// Whether these are the units of `body` read as `format`: a byte-identical
    /// body is the same units.
    pub(crate) fn are_of(&self, format: Format, body: &CutFrom) -> bool {
        self.format == format && self.body.same(body)
    }
}

/// A unit the prefix hash leaves out: text blocks of a region whose text matches.
#[derive(Debug, Clone)]
pub struct IgnoreRule {
    pub region: Region,
    pub text: Regex,
}

impl IgnoreRule {
    /// Claude Code's `x-anthropic-billing-header` system block, which differs per
    /// conversation (and per request in first-party mode) yet evidently does not
    /// break Anthropic's cache (Claude Code puts its environment and the date there).
    pub fn billing_header() -> IgnoreRule {
        IgnoreRule {
            region: Region::System,
            text: Regex::new("^x-anthropic-billing-header:").expect("a valid literal pattern"),
        }
    }
}

/// Why a body could not be cut into units.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SegmentError {
    #[error("request body is not JSON: {0}")]
    NotJson(#[from] ScanError),
    #[error("request body is not a JSON object")]
    NotObject,
    #[error("not a request format cache analysis reads")]
    NoFormat,
}

/// Chains `prompt`'s units into cache units: each unit's digest (taken by the
/// model) and token estimate, the request-level inputs at their region.
pub(crate) fn segment(prompt: &Prompt, ignore: &[IgnoreRule]) -> Result<Segments, SegmentError> {
    segment_after(prompt, ignore, None)
}

/// [`segment`], where units byte-identical to `previous`'s at the same place (an
/// agent's earlier turn) take its digest, token estimate and ignore verdict instead;
/// `previous` must have been cut with the same `ignore` rules.
pub(crate) fn segment_after(
    prompt: &Prompt,
    ignore: &[IgnoreRule],
    previous: Option<&Segments>,
) -> Result<Segments, SegmentError> {
    segment_from(
        prompt,
        ignore,
        previous,
        CutFrom::Body(prompt.body().clone()),
    )
}

/// [`segment_after`], the segments keeping `body` as the prompt's body. A body rules
/// wrote ([`CutFrom::Written`]) keeps no part of the body sent: its units copied
/// unchanged share the body received's bytes, the others are copies of their own.
pub(crate) fn segment_from(
    prompt: &Prompt,
    ignore: &[IgnoreRule],
    previous: Option<&Segments>,
    body: CutFrom,
) -> Result<Segments, SegmentError> {
    let format = prompt.format().ok_or(SegmentError::NoFormat)?;
    match prompt.shape() {
        Shape::Object(_) => {}
        Shape::NotJson(at) => return Err(SegmentError::NotJson(ScanError(at))),
        Shape::Empty => return Err(SegmentError::NotJson(ScanError(0))),
        Shape::NotObject => return Err(SegmentError::NotObject),
    }
    let mut chain = Chain::new(prompt, format, ignore, previous);
    if let CutFrom::Written(w) = &body {
        chain.received = Some(w.received().clone());
    }
    let units = prompt.units();
    let region_end = |from: usize, region: Region| {
        from + units[from..]
            .iter()
            .take_while(|u| u.path.region == region)
            .count()
    };
    match format {
        Format::AnthropicMessages => {
            let tools = region_end(0, Region::Tools);
            let system = region_end(tools, Region::System);
            chain.units(0..tools);
            chain.mix_speed();
            chain.units(tools..system);
            chain.messages();
        }
        Format::OpenAiChat => {
            let tools = region_end(0, Region::Tools);
            chain.units(0..tools);
            chain.messages();
        }
        Format::OpenAiResponses => {
            let instructions = region_end(0, Region::Instructions);
            let tools = region_end(instructions, Region::Tools);
            chain.units(0..tools);
            chain.mix_settings();
            chain.units(tools..units.len());
        }
    }
    Ok(chain.finish(body))
}

// === impl Chain ===

/// Builds the cache unit list; owns the running prefix hash.
struct Chain<'p> {
    prompt: &'p Prompt,
    /// The body received, when rules wrote `prompt`'s copying from it.
    received: Option<Bytes>,
    previous: Option<&'p Segments>,
    format: Format,
    ignore: &'p [IgnoreRule],
    units: Vec<Unit>,
    prefix: Hash,
    /// Bytes to mix into the prefix before the next unit (settings at a region
    /// start, a message's role and fields).
    pending: Vec<u8>,
    settings: Settings,
    speed_mixed: bool,
    /// The earlier turn's units by their region and bytes, built on the first unit
    /// that differs at its place: when the earlier turns' messages moved (a dropped
    /// round, a context edit), the units that stayed are found where they went.
    moved: std::cell::OnceCell<ByBytes<'p>>,
    /// What becomes [`Segments::mixed`].
    mixed: Vec<u8>,
}

/// Units' places by their region and bytes.
type ByBytes<'p> = HashMap<(Region, &'p [u8]), usize, foldhash::fast::RandomState>;

const IGNORED: &[u8] = b"promptgate:ignored-unit";

impl<'p> Chain<'p> {
    fn new(
        prompt: &'p Prompt,
        format: Format,
        ignore: &'p [IgnoreRule],
        previous: Option<&'p Segments>,
    ) -> Chain<'p> {
        let settings = prompt.settings();
        let mut seed = Hasher::new();
        seed.update(b"promptgate-cache-v1\0");
        seed.update(format.provider().name().as_bytes());
        seed.update(b"\0");
        seed.update(settings.model.as_bytes());
        Chain {
            prompt,
            received: None,
            previous,
            format,
            ignore,
            units: Vec::with_capacity(prompt.units().len()),
            prefix: seed.finish(),
            pending: Vec::new(),
            settings,
            speed_mixed: false,
            moved: std::cell::OnceCell::new(),
            mixed: Vec::new(),
        }
    }

    /// Every object of the body has distinct keys (see [`Segments::unique_keys`]).
    fn unique_keys(&self) -> bool {
        *self.prompt.keys() == crate::prompt::KeyCheck::Unique
    }

    fn units(&mut self, range: std::ops::Range<usize>) {
        for i in range {
            self.push(i);
        }
    }

    /// The messages: the settings first, then each message's role and fields
    /// (Claude Code's role:"system" message carries output_config) before its blocks.
    fn messages(&mut self) {
        self.mix_settings();
        for m in self.prompt.messages() {
            self.pending.extend_from_slice(b"\0message{");
            if let Some(message) = self.prompt.value(m.tok) {
                // As the provider reads them: keys decoded and in order, values canonical.
                let mut fields: Vec<(Cow<'_, str>, Cow<'_, str>)> = message
                    .entries()
                    .filter(|(k, _)| crate::prompt::key_is(k.bytes(), "content") != Some(true))
                    .map(|(k, v)| {
                        let key = k
                            .str()
                            .unwrap_or_else(|| String::from_utf8_lossy(k.bytes()));
                        (key, crate::prompt::canonical(v.bytes()))
                    })
                    .collect();
                fields.sort_unstable();
                for (k, v) in fields {
                    self.pending.extend_from_slice(k.as_bytes());
                    self.pending.push(b':');
                    self.pending.extend_from_slice(v.as_bytes());
                    self.pending.push(b',');
                }
            }
            self.pending.push(b'}');
            self.units(m.units.clone());
        }
    }

    /// `speed` changes the system and messages caches, not the tools cache.
    fn mix_speed(&mut self) {
        if !self.speed_mixed {
            self.speed_mixed = true;
            self.pending.extend_from_slice(b"\0speed:");
            if let Some(s) = &self.settings.speed {
                self.pending.extend_from_slice(s.as_bytes());
            }
        }
    }

    /// tool_choice, thinking and effort (and images, see `finish`) change only the
    /// messages cache.
    fn mix_settings(&mut self) {
        self.mix_speed();
        let s = &self.settings;
        for (name, v) in [
            ("tool_choice", &s.tool_choice),
            ("thinking", &s.thinking),
            ("effort", &s.effort),
        ] {
            self.pending.push(0);
            self.pending.extend_from_slice(name.as_bytes());
            self.pending.push(b':');
            if let Some(v) = v {
                self.pending.extend_from_slice(v.as_bytes());
            }
        }
    }

    /// The digest, token estimate and ignore verdict: the earlier turn's when the
    /// same place held the same bytes (a memcmp is far cheaper than hashing,
    /// counting and decoding; the ignore rules are the stage's, fixed for its life),
    /// or another place of the same region did (the unit moved), or the same place
    /// held the same JSON value in other bytes (then `respelled`).
    fn measure(
        &self,
        unit: &crate::prompt::Unit,
        bytes: &[u8],
        counted: &[u8],
        text: Option<&[u8]>,
    ) -> Measured {
        if let Some(prev) = self.previous.and_then(|p| p.units.get(self.units.len()))
            && prev.path == unit.path
            && prev.bytes[..] == *bytes
        {
            return Measured::same_bytes(unit, prev);
        }
        // A unit past the earlier turn's last is new (an agent's new round): not looked for.
        if self
            .previous
            .is_some_and(|p| self.units.len() < p.units.len())
            && let Some(prev) = self.moved_from(unit.path.region, bytes)
        {
            return Measured::same_bytes(unit, prev);
        }
        if let Some(prev) = self.previous.and_then(|p| p.units.get(self.units.len()))
            && prev.path == unit.path
            // Only units that differ from the earlier turn's at their place are
            // parsed, a few a turn; the digest is not lent: it names other bytes.
            // Sized first: after a dropped round every new unit met an older one here
            // (conversations, 50 KB band, c16: the parse was 26 % of the record
            // pipeline; sized, the parse 4 % and the sizing 4 %).
            && same_value_sized(
                &prev.bytes,
                bytes,
                self.unique_keys() && self.previous.is_some_and(|p| p.unique_keys),
            )
        {
            return Measured {
                respelled: true,
                digest_of_bytes: false,
                ..Measured::of(prev)
            };
        }
        let tokens = estimate::tokens(self.format.provider(), counted) + estimate::BLOCK_OVERHEAD;
        let ignored = text.is_some_and(|t| self.is_ignored(unit.path.region, t));
        Measured {
            hash: unit.hash(self.prompt.body()),
            tokens,
            ignored,
            respelled: false,
            digest_of_bytes: true,
        }
    }

    /// The earlier turn's unit of the same region and bytes at another place.
    // A dropped round moved every later unit, each then parsed to compare values and
    // measured again: this lookup took full from 1,361 to 1,261 µs a request (200 KB band).
    fn moved_from(&self, region: Region, bytes: &[u8]) -> Option<&'p Unit> {
        let previous = self.previous?;
        let moved = self.moved.get_or_init(|| {
            previous
                .units
                .iter()
                .enumerate()
                .map(|(i, u)| ((u.path.region, &u.bytes[..]), i))
                .collect()
        });
        moved
            .get(&(region, bytes))
            .and_then(|&i| previous.units.get(i))
    }

    fn is_ignored(&self, region: Region, text: &[u8]) -> bool {
        if !self.ignore.iter().any(|r| r.region == region) {
            return false;
        }
        let Some(decoded) = crate::provider::json::decode_str(text) else {
            return false;
        };
        self.ignore
            .iter()
            .any(|r| r.region == region && r.text.is_match(&decoded))
    }

    fn push(&mut self, i: usize) {
        let body = self.prompt.body();
        let unit = &self.prompt.units()[i];
        let path = unit.path;
        let bytes = match &self.received {
            // Held from the body received, else a copy: never a slice of the body sent.
            Some(received) if unit.normalized.is_none() => {
                match self.prompt.received_at(unit.span, received) {
                    Some(at) => received.slice(at..at + unit.span.end - unit.span.start),
                    None => Bytes::copy_from_slice(&unit.bytes(body)),
                }
            }
            _ => unit.bytes(body),
        };
        let text = unit.text.map(|t| t.of(body));
        let counted = unit.content.map_or(&bytes[..], |c| c.of(body));
        let Measured {
            hash,
            tokens,
            ignored,
            respelled,
            digest_of_bytes,
        } = self.measure(unit, &bytes, counted, text);
        let cacheable = match &*unit.kind {
            "thinking" | "redacted_thinking" => false,
            "text" => text.is_some_and(|t| t.len() > 2),
            _ => true,
        };
        let breakpoint = unit.marker.as_ref().map(|m| Breakpoint {
            ttl: m.ttl,
            automatic: false,
        });
        self.prefix = match self.prefix_as_before(&hash, ignored) {
            Some(prefix) => prefix,
            None => {
                let mut chain = Hasher::new();
                chain.update(&self.prefix);
                chain.update(&self.pending);
                chain.update(if ignored { IGNORED } else { &hash });
                chain.finish()
            }
        };
        let from = self.mixed.len() as u32;
        self.mixed.extend_from_slice(&self.pending);
        let mixed = (from, self.mixed.len() as u32);
        self.pending.clear();
        let kind = unit.kind.clone();
        let position = match self.units.last() {
            Some(prev) if run_kind(&kind) && prev.kind == kind => prev.position,
            Some(prev) => prev.position + 1,
            None => 0,
        };
        self.units.push(Unit {
            path,
            kind,
            bytes,
            hash,
            prefix: self.prefix,
            position,
            tokens,
            breakpoint,
            cacheable,
            ignored,
            respelled,
            digest_of_bytes,
            mixed,
        });
    }

    /// The earlier turn's prefix through the unit about to be pushed, when it chained
    /// the same: the same prefix before it, the same bytes mixed in, the same unit.
    // The chain's small BLAKE3 per unit was ~13 % of the record pipeline's instructions
    // on 200 KB growing conversations (callgrind); this comparison is a few bytes.
    fn prefix_as_before(&self, hash: &Hash, ignored: bool) -> Option<Hash> {
        let previous = self.previous?;
        // Images rechain the messages' prefixes afterwards (`finish`).
        if self.settings.images || previous.settings.images {
            return None;
        }
        let n = self.units.len();
        let before = previous.units.get(n.checked_sub(1)?)?;
        let unit = previous.units.get(n)?;
        let mixed = previous
            .mixed
            .get(unit.mixed.0 as usize..unit.mixed.1 as usize)?;
        (before.prefix == self.prefix
            && unit.ignored == ignored
            && (ignored || unit.hash == *hash)
            && mixed == self.pending.as_slice())
        .then_some(unit.prefix)
    }

    fn finish(mut self, body: CutFrom) -> Segments {
        // Images are known only after the messages were read, so they are mixed in
        // afterwards: every message unit's prefix hash is rechained with the flag.
        if self.settings.images
            && let Some(first) = self
                .units
                .iter()
                .position(|u| matches!(u.path.region, Region::Messages | Region::Input))
        {
            let mut prev = if first == 0 {
                None
            } else {
                Some(self.units[first - 1].prefix)
            };
            for u in &mut self.units[first..] {
                let mut chain = Hasher::new();
                if let Some(p) = prev {
                    chain.update(&p);
                }
                chain.update(b"\0images:true");
                chain.update(&u.prefix);
                u.prefix = chain.finish();
                prev = Some(u.prefix);
            }
        }
        // Top-level automatic caching puts a breakpoint on the last cacheable block.
        if self.format == Format::AnthropicMessages
            && let Some(auto) = self.prompt.automatic_marker()
            && let Some(last) = self.units.iter_mut().rev().find(|u| u.cacheable)
            && last.breakpoint.is_none()
        {
            last.breakpoint = Some(Breakpoint {
                ttl: auto.ttl,
                automatic: true,
            });
        }
        let breakpoints = self
            .units
            .iter()
            .enumerate()
            .filter(|(_, u)| u.breakpoint.is_some())
            .map(|(i, _)| i)
            .collect();
        let unique_keys = self.unique_keys();
        Segments {
            body,
            format: self.format,
            units: self.units,
            settings: self.settings,
            breakpoints,
            mixed: self.mixed,
            unique_keys,
        }
    }
}

/// What [`Chain::measure`] found for one unit.
struct Measured {
    hash: Hash,
    tokens: u32,
    ignored: bool,
    respelled: bool,
    digest_of_bytes: bool,
}

impl Measured {
    /// An earlier turn's unit's measures, taken as they are.
    fn of(prev: &Unit) -> Measured {
        Measured {
            hash: prev.hash,
            tokens: prev.tokens,
            ignored: prev.ignored,
            respelled: false,
            digest_of_bytes: prev.digest_of_bytes,
        }
    }

    /// The measures of `unit`, the same bytes as the earlier turn's `prev`: its
    /// digest is lent to `unit` only when it is the digest of those bytes.
    fn same_bytes(unit: &crate::prompt::Unit, prev: &Unit) -> Measured {
        if prev.digest_of_bytes {
            unit.lend_hash(prev.hash);
        }
        Measured::of(prev)
    }
}

/// Whether two units are the same JSON value: key order, escapes and spacing
/// aside (objects compare as maps), values and their order the same.
pub(crate) fn same_value(a: &[u8], b: &[u8]) -> bool {
    let value = |bytes: &[u8]| serde_json::from_slice::<serde_json::Value>(bytes).ok();
    matches!((value(a), value(b)), (Some(x), Some(y)) if x == y)
}

/// [`same_value`], the sizes compared first when both units' bodies have distinct
/// keys (`sized`): a cheap no for most units that differ.
pub(crate) fn same_value_sized(a: &[u8], b: &[u8], sized: bool) -> bool {
    (!sized || value_size(a) == value_size(b)) && same_value(a, b)
}

/// A size every spelling of the same JSON value has, when its objects' keys are
/// distinct (a repeated key drops its earlier value from the value, not from the
/// bytes): the bytes of its strings decoded, and of its structure and literals.
/// Numbers are left out (`1.0` and `1.00` are one value) and so is whitespace.
fn value_size(bytes: &[u8]) -> usize {
    let mut size = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                // Inside a string: runs up to the next quote or escape at once.
                while let Some(k) = bytes.get(i..).and_then(|s| memchr::memchr2(b'"', b'\\', s)) {
                    size += k;
                    i += k;
                    if bytes[i] == b'"' {
                        break;
                    }
                    size += match bytes.get(i + 1) {
                        Some(b'u') => {
                            let hex = bytes
                                .get(i + 2..i + 6)
                                .and_then(|h| std::str::from_utf8(h).ok());
                            i += 6;
                            match hex.and_then(|h| u32::from_str_radix(h, 16).ok()) {
                                Some(0..0x80) => 1,
                                // Half of a surrogate pair: the pair is one 4-byte character.
                                Some(0x80..0x800 | 0xd800..0xe000) => 2,
                                _ => 3,
                            }
                        }
                        _ => {
                            i += 2;
                            1
                        }
                    };
                }
                i += 1;
            }
            b' ' | b'\n' | b'\r' | b'\t' | b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E' => i += 1,
            _ => {
                size += 1;
                i += 1;
            }
        }
    }
    size
}

/// Block types whose consecutive runs count as one lookback position.
fn run_kind(kind: &str) -> bool {
    kind == "tool_use" || kind == "tool_result"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: &Bytes, format: Format) -> Prompt {
        Prompt::read(body.clone(), Some(format))
    }

    fn cut(body: &str) -> Segments {
        segment(
            &read(
                &Bytes::copy_from_slice(body.as_bytes()),
                Format::AnthropicMessages,
            ),
            &[IgnoreRule::billing_header()],
        )
        .unwrap()
    }

    fn paths(s: &Segments) -> Vec<String> {
        s.units.iter().map(|u| u.path.to_string()).collect()
    }

    const TURN1: &str = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"system","content":[{"type":"text","text":"env","cache_control":{"type":"ephemeral"}}],"output_config":{"effort":"medium"}}],"system":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"You are","cache_control":{"type":"ephemeral","ttl":"1h"}}],"tools":[{"name":"Bash","input_schema":{"type":"object"}}]}"#;
    const TURN2: &str = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"system","content":"env","output_config":{"effort":"medium"}},{"role":"assistant","content":[{"type":"text","text":"ok"},{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"ls","description":"d"}},{"type":"tool_use","id":"t2","name":"Bash","input":{"command":"pwd"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a"},{"type":"tool_result","tool_use_id":"t2","content":"b","cache_control":{"type":"ephemeral"}}]}],"system":[{"type":"text","text":"x-anthropic-billing-header: cch=2;"},{"type":"text","text":"You are","cache_control":{"type":"ephemeral","ttl":"1h"}}],"tools":[{"name":"Bash","input_schema":{"type":"object"}}]}"#;

    #[test]
    fn units_that_moved_take_the_earlier_turns_measures_and_match_a_fresh_cut() {
        // The earlier turn's first round dropped (as a context edit does): every
        // later unit moved to another place.
        let before = cut(TURN2);
        let after = TURN2.replacen(
            r#"{"role":"user","content":[{"type":"text","text":"hi"}]},"#,
            "",
            1,
        );
        let prompt = read(&Bytes::from(after.clone()), Format::AnthropicMessages);
        let moved = segment_after(&prompt, &[IgnoreRule::billing_header()], Some(&before)).unwrap();
        let fresh = cut(&after);
        assert_eq!(moved.units.len(), before.units.len() - 1);
        for (m, f) in moved.units.iter().zip(&fresh.units) {
            assert_eq!(m.path, f.path);
            assert_eq!(
                (m.hash, m.tokens, m.ignored),
                (f.hash, f.tokens, f.ignored),
                "{}",
                m.path
            );
            assert_eq!(m.prefix, f.prefix, "{}", m.path);
            assert!(!m.respelled);
        }
    }

    #[test]
    fn every_spelling_of_a_value_has_its_size() {
        let spellings = [
            (
                r#"{"a":"x","b":[1.0,true,null]}"#,
                r#"{ "b" : [ 1.00 , true , null ] , "a" : "x" }"#,
            ),
            (
                r#""caf\u00e9 \n \/ \u4e2d \ud83d\ude42""#,
                "\"café \\n / 中 🙂\"",
            ),
            (r#"{"n":-1.50e2}"#, r#"{"n":-150.0}"#),
            (r#"{"s":"\"q\""}"#, r#"{"s":"\u0022q\u0022"}"#),
        ];
        for (a, b) in spellings {
            assert!(same_value(a.as_bytes(), b.as_bytes()), "{a} {b}");
            assert_eq!(
                value_size(a.as_bytes()),
                value_size(b.as_bytes()),
                "{a} {b}"
            );
        }
        // What the size tells apart: another text, and a cleared tool result.
        assert_ne!(value_size(br#"{"a":"xy"}"#), value_size(br#"{"a":"x"}"#));
        assert_ne!(
            value_size(br#"{"type":"tool_result","content":"fn main() {}"}"#),
            value_size(br#"{"type":"tool_result","content":"[cleared]"}"#)
        );
        // Cut short anywhere, it still answers.
        let s = r#"{"s":"a\u00e9\n","t":[true]}"#;
        for end in 0..s.len() {
            value_size(&s.as_bytes()[..end]);
        }
    }

    /// A JSON value of strings (any characters), numbers, literals, arrays and
    /// objects (distinct keys), a few levels deep.
    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i32>().prop_map(|n| serde_json::json!(n)),
            (-1e6f64..1e6).prop_map(|f| serde_json::json!(f)),
            any::<String>().prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                proptest::collection::btree_map(any::<String>(), inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// `v` written another way, chosen by `seed`: keys in reverse, spaces between
    /// tokens, characters escaped (`\uXXXX`, surrogate pairs, short escapes) or not,
    /// and a short float's trailing zero.
    fn respelled(v: &serde_json::Value, seed: &mut u64, out: &mut String) {
        use std::fmt::Write;
        fn coin(seed: &mut u64) -> u64 {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            *seed % 3
        }
        fn string(text: &str, seed: &mut u64, out: &mut String) {
            out.push('"');
            for c in text.chars() {
                match (c, coin(seed)) {
                    ('"', _) => out.push_str("\\u0022"),
                    ('\\', 0) => out.push_str("\\\\"),
                    ('\n', 0) => out.push_str("\\n"),
                    ('/', 0) => out.push_str("\\/"),
                    (c, 0 | 1) if c >= ' ' && c != '\\' => out.push(c),
                    (c, _) => {
                        let mut units = [0u16; 2];
                        for u in c.encode_utf16(&mut units) {
                            let _ = write!(out, "\\u{u:04x}");
                        }
                    }
                }
            }
            out.push('"');
        }
        match v {
            serde_json::Value::String(t) => string(t, seed, out),
            serde_json::Value::Array(items) => {
                out.push_str("[ ");
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(" ,\n");
                    }
                    respelled(item, seed, out);
                }
                out.push(']');
            }
            serde_json::Value::Object(map) => {
                out.push('{');
                for (i, (k, item)) in map.iter().rev().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    string(k, seed, out);
                    out.push_str(" :\t");
                    respelled(item, seed, out);
                }
                out.push_str(" }");
            }
            // Short ones only: serde_json reads long decimals to within an ulp.
            serde_json::Value::Number(n)
                if n.is_f64() && n.to_string().contains('.') && n.to_string().len() < 12 =>
            {
                let _ = write!(out, "{n}0");
            }
            other => out.push_str(&other.to_string()),
        }
    }

    proptest::proptest! {
        /// Every spelling of a value with distinct keys has its size.
        #[test]
        fn a_value_written_another_way_keeps_its_size(v in json_value(), mut seed in 1u64..) {
            let plain = serde_json::to_vec(&v).unwrap();
            let mut other = String::new();
            respelled(&v, &mut seed, &mut other);
            proptest::prop_assert!(same_value(&plain, other.as_bytes()), "{other}");
            proptest::prop_assert_eq!(value_size(&plain), value_size(other.as_bytes()), "{}", other);
        }
    }

    #[test]
    fn a_unit_respelled_with_a_repeated_key_is_still_found_respelled() {
        // The same value in more bytes: `text` given twice reads its last value, so
        // the sizes differ and only the parse can tell; a body with a repeated key is
        // not sized.
        let before = cut(TURN2);
        let body = TURN2.replacen(
            r#"{"type":"text","text":"ok"}"#,
            r#"{"type":"text","text":"a longer text, dropped","text":"ok"}"#,
            1,
        );
        let prompt = read(&Bytes::from(body), Format::AnthropicMessages);
        assert!(prompt.keys().repeated().is_some());
        let after = segment_after(&prompt, &[], Some(&before)).unwrap();
        let unit = after
            .units
            .iter()
            .find(|u| u.kind == "text" && u.path.region == Region::Messages && u.respelled);
        assert!(unit.is_some(), "{:?}", paths(&after));
    }

    #[test]
    fn a_turn_chained_after_another_has_the_prefixes_of_a_fresh_chain() {
        // Prefixes taken from the earlier turn where it chained the same; each variant
        // changes what goes into some prefix (a message's fields, a block, a tool,
        // the model), and every prefix must be what a chain of its own gives.
        let before = cut(TURN2);
        let variants = [
            TURN2.to_owned(),
            TURN2.replace(r#""effort":"medium""#, r#""effort":"high""#),
            TURN2.replace(
                r#"{"role":"assistant","content""#,
                r#"{"role":"assistant","name":"x","content""#,
            ),
            TURN2.replace(r#""content":"a""#, r#""content":"A""#),
            TURN2.replace(
                r#""name":"Bash","input_schema""#,
                r#""name":"Sh","input_schema""#,
            ),
            TURN2.replace(r#""model":"m""#, r#""model":"n""#),
            TURN2.replace("cch=2;", "cch=3;"),
        ];
        for body in &variants {
            let prompt = read(&Bytes::from(body.clone()), Format::AnthropicMessages);
            let after =
                segment_after(&prompt, &[IgnoreRule::billing_header()], Some(&before)).unwrap();
            let fresh = cut(body);
            let prefixes = |s: &Segments| s.units.iter().map(|u| u.prefix).collect::<Vec<_>>();
            assert_eq!(prefixes(&after), prefixes(&fresh), "{body}");
        }
        assert_ne!(
            cut(&variants[1]).units.last().unwrap().prefix,
            before.units.last().unwrap().prefix,
            "a message's fields are in the prefix"
        );
    }

    #[test]
    fn units_come_in_cache_order_with_paths() {
        let s = cut(TURN2);
        assert_eq!(
            paths(&s),
            [
                "tools[0]",
                "system[0]",
                "system[1]",
                "messages[0].content[0]",
                "messages[1].content",
                "messages[2].content[0]",
                "messages[2].content[1]",
                "messages[2].content[2]",
                "messages[3].content[0]",
                "messages[3].content[1]",
            ]
        );
        assert_eq!(s.units[0].kind, "tool");
        assert_eq!(&s.units[4].bytes[..], br#"{"type":"text","text":"env"}"#);
        assert_eq!(s.breakpoints, [2, 9]);
        assert_eq!(s.units[2].breakpoint.unwrap().ttl, Ttl::OneHour);
        assert_eq!(s.units[9].breakpoint.unwrap().ttl, Ttl::FiveMinutes);
        assert_eq!(s.settings.model, "m");
    }

    #[test]
    fn tool_runs_share_a_lookback_position() {
        let s = cut(TURN2);
        let pos: Vec<u32> = s.units.iter().map(|u| u.position).collect();
        assert_eq!(pos, [0, 1, 2, 3, 4, 5, 6, 6, 7, 7]);
    }

    #[test]
    fn string_content_and_cache_control_do_not_change_the_prefix() {
        // As Claude Code sends them: turn 1's units are all unchanged in turn 2, in cache order.
        let a = cut(TURN1);
        let b = cut(TURN2);
        assert_eq!(a.units.len(), 5);
        for i in 0..a.units.len() {
            assert_eq!(a.units[i].prefix, b.units[i].prefix, "unit {i}");
        }
        assert!(a.units[1].ignored && b.units[1].ignored);
        assert_ne!(
            a.units[1].hash, b.units[1].hash,
            "its own hash still differs"
        );
        // Not ignored: the billing text would break the prefix.
        let plain = |body: &str| {
            segment(
                &read(
                    &Bytes::copy_from_slice(body.as_bytes()),
                    Format::AnthropicMessages,
                ),
                &[],
            )
            .unwrap()
        };
        assert_ne!(plain(TURN1).units[2].prefix, plain(TURN2).units[2].prefix);
    }

    #[test]
    fn key_order_inside_tool_use_input_breaks_the_prefix() {
        let swapped = TURN2.replace(
            r#""input":{"command":"ls","description":"d"}"#,
            r#""input":{"description":"d","command":"ls"}"#,
        );
        let (a, b) = (cut(TURN2), cut(&swapped));
        assert_eq!(a.units[5].prefix, b.units[5].prefix);
        assert_ne!(a.units[6].prefix, b.units[6].prefix);
    }

    #[test]
    fn settings_enter_at_their_region() {
        let base = cut(TURN2);
        let choice = cut(&TURN2.replacen('{', r#"{"tool_choice":{"type":"any"},"#, 1));
        assert_eq!(base.units[2].prefix, choice.units[2].prefix, "system kept");
        assert_ne!(
            base.units[3].prefix, choice.units[3].prefix,
            "messages changed"
        );
        let speed = cut(&TURN2.replacen('{', r#"{"speed":"fast","#, 1));
        assert_eq!(base.units[0].prefix, speed.units[0].prefix, "tools kept");
        assert_ne!(
            base.units[1].prefix, speed.units[1].prefix,
            "system changed"
        );
        let model = cut(&TURN2.replace(r#""model":"m""#, r#""model":"n""#));
        assert_ne!(base.units[0].prefix, model.units[0].prefix);
        let image = TURN2.replace(
            r#"{"type":"text","text":"hi"}"#,
            r#"{"type":"text","text":"hi"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA=="}}"#,
        );
        let image = cut(&image);
        assert!(image.settings.images);
        assert_eq!(base.units[2].prefix, image.units[2].prefix);
        assert_ne!(base.units[3].prefix, image.units[3].prefix);
    }

    #[test]
    fn automatic_caching_lands_on_the_last_cacheable_block() {
        let body = r#"{"model":"m","cache_control":{"type":"ephemeral","ttl":"1h"},"messages":[{"role":"user","content":"q"},{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"thinking","thinking":"t","signature":"s"},{"type":"text","text":""}]}]}"#;
        let s = cut(body);
        assert_eq!(s.breakpoints, [1]);
        let bp = s.units[1].breakpoint.unwrap();
        assert!(bp.automatic && bp.ttl == Ttl::OneHour);
        assert!(!s.units[2].cacheable && !s.units[3].cacheable);
    }

    #[test]
    fn roles_are_part_of_the_prefix() {
        let a = cut(r#"{"model":"m","messages":[{"role":"user","content":"q"}]}"#);
        let b = cut(r#"{"model":"m","messages":[{"role":"assistant","content":"q"}]}"#);
        assert_eq!(a.units[0].hash, b.units[0].hash);
        assert_ne!(a.units[0].prefix, b.units[0].prefix);
    }

    #[test]
    fn openai_shapes() {
        let chat = r#"{"model":"gpt","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"tools":[{"type":"function","function":{"name":"bash"}}]}"#;
        let s = segment(
            &read(&Bytes::from_static(chat.as_bytes()), Format::OpenAiChat),
            &[],
        )
        .unwrap();
        assert_eq!(
            paths(&s),
            ["tools[0]", "messages[0].content", "messages[1].content[0]"]
        );
        let resp =
            r#"{"model":"gpt","instructions":"be brief","input":[{"role":"user","content":"hi"}]}"#;
        let s = segment(
            &read(
                &Bytes::from_static(resp.as_bytes()),
                Format::OpenAiResponses,
            ),
            &[],
        )
        .unwrap();
        assert_eq!(paths(&s), ["instructions", "input[0]"]);
        assert!(segment(&read(&Bytes::from_static(b"[1]"), Format::OpenAiChat), &[]).is_err());
    }

    #[test]
    fn an_earlier_turn_lends_its_hashes() {
        let a = cut(TURN1);
        let body = Bytes::copy_from_slice(TURN2.as_bytes());
        let ignore = [IgnoreRule::billing_header()];
        let fresh = segment_after(&read(&body, Format::AnthropicMessages), &ignore, None).unwrap();
        let lent =
            segment_after(&read(&body, Format::AnthropicMessages), &ignore, Some(&a)).unwrap();
        for (x, y) in fresh.units.iter().zip(&lent.units) {
            assert_eq!((x.hash, x.prefix, x.tokens), (y.hash, y.prefix, y.tokens));
        }
    }

    #[test]
    fn unchanged_blocks_share_the_body_bytes() {
        let body = Bytes::copy_from_slice(TURN2.as_bytes());
        let s = segment(&read(&body, Format::AnthropicMessages), &[]).unwrap();
        let tool = &s.units[0].bytes;
        let offset = tool.as_ptr() as usize - body.as_ptr() as usize;
        assert_eq!(&body[offset..offset + tool.len()], &tool[..]);
        assert!(s.units.iter().all(|u| u.tokens >= estimate::BLOCK_OVERHEAD));
    }
}

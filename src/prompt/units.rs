//! A request's units in the provider's cache order: tools → system → messages
//! (Anthropic's order), or tools → instructions → input for OpenAI Responses. A
//! unit is one tool definition, one system block, one message content block or
//! one OpenAI input item; string content is one unit of its own.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;
use std::sync::OnceLock;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::tree::Value;
use crate::digest::{self, Digest};
use crate::provider::json::key_is;
use crate::provider::json::{Reused, Span};

/// Which part of the prompt a unit belongs to, in cache order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Region {
    Tools,
    /// Anthropic `system`.
    System,
    /// OpenAI Responses `instructions`.
    Instructions,
    Messages,
    /// OpenAI Responses `input` items.
    Input,
}

impl Region {
    /// Its name in a request body.
    pub fn name(self) -> &'static str {
        match self {
            Region::Tools => "tools",
            Region::System => "system",
            Region::Instructions => "instructions",
            Region::Messages => "messages",
            Region::Input => "input",
        }
    }
}

/// Where a unit sits in the request body: `tools[3]`, `system[2]`,
/// `messages[4].content[1]`, `messages[1].content` (string content).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UnitPath {
    pub region: Region,
    pub index: u32,
    /// The block inside a message's content array; `None` for string content and
    /// for units that are not inside a message.
    pub block: Option<u32>,
    /// The unit is one string (normalised as one text block).
    pub string: bool,
}

impl fmt::Display for UnitPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.region == Region::Instructions {
            return f.write_str("instructions");
        }
        write!(f, "{}[{}]", self.region.name(), self.index)?;
        match (self.block, self.string) {
            (Some(b), _) => write!(f, ".content[{b}]"),
            (None, true) if matches!(self.region, Region::Messages | Region::Input) => {
                f.write_str(".content")
            }
            _ => Ok(()),
        }
    }
}

impl UnitPath {
    fn new(region: Region, index: usize, block: Option<usize>, string: bool) -> UnitPath {
        UnitPath {
            region,
            index: index as u32,
            block: block.map(|b| b as u32),
            string,
        }
    }
}

/// How long a cache entry lives after the request that wrote or read it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ttl {
    #[serde(rename = "5m")]
    FiveMinutes,
    #[serde(rename = "1h")]
    OneHour,
}

impl Ttl {
    /// The ttl as the provider spells it in a `cache_control` marker.
    pub fn text(self) -> &'static str {
        match self {
            Ttl::FiveMinutes => "5m",
            Ttl::OneHour => "1h",
        }
    }

    /// The ttl of a marker's `ttl` text (only these two exist).
    pub fn from_text(text: &str) -> Option<Ttl> {
        [Ttl::FiveMinutes, Ttl::OneHour]
            .into_iter()
            .find(|t| t.text() == text)
    }

    /// How long it lives, in seconds.
    pub fn secs(self) -> u64 {
        match self {
            Ttl::FiveMinutes => 300,
            Ttl::OneHour => 3600,
        }
    }
}

impl fmt::Display for Ttl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text())
    }
}

/// A block type; the common ones are static, not allocated per unit.
pub(crate) type Kind = Cow<'static, str>;

/// The types agents send every turn, by the hundred.
const KINDS: &[&str] = &[
    "text",
    "tool_use",
    "tool_result",
    "image",
    "document",
    "thinking",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
    "tool",
    "item",
    "message",
    "function",
    "function_call",
    "function_call_output",
    "input_text",
    "input_image",
    "output_text",
    "reasoning",
];

/// `name` as a [`Kind`].
fn kind(name: &str) -> Kind {
    match KINDS.iter().find(|k| **k == name) {
        Some(k) => Cow::Borrowed(k),
        None => Cow::Owned(name.to_owned()),
    }
}

/// A `cache_control` object: a breakpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    /// Its `type` (`ephemeral`), when it is a string.
    pub kind: Option<String>,
    pub ttl: Ttl,
    /// Its `scope` (`global`); absent for the organisation scope.
    pub scope: Option<String>,
}

impl Marker {
    /// The marker a `cache_control` value makes; `None` unless it is an object.
    pub(super) fn of(value: Value<'_>) -> Option<Marker> {
        if !value.is_object() {
            return None;
        }
        let text = |key: &str| value.get(key).and_then(|v| v.str()).map(|s| s.into_owned());
        Some(Marker {
            kind: text("type"),
            ttl: if value.get("ttl").is_some_and(|t| t.is_str("1h")) {
                Ttl::OneHour
            } else {
                Ttl::FiveMinutes
            },
            scope: text("scope"),
        })
    }
}

/// One unit of a request.
#[derive(Debug, Clone)]
pub struct Unit {
    pub path: UnitPath,
    /// The block type (`text`, `tool_use`, `tool_result`, `image`, …), `tool` for a
    /// tool definition, `item` for an OpenAI input item without a type.
    pub kind: Kind,
    /// Its exact bytes in the body: the block, or the string for string content.
    pub span: Span,
    /// Its token in the prompt's tape (read its fields through [`super::Prompt::value`]).
    pub tok: u32,
    /// The part of `span` a store keeps as the unit: a block less a trailing
    /// `cache_control` entry and its closing brace, so that the block with a
    /// breakpoint, with another ttl and without one is one stored unit (an agent
    /// moves its breakpoint every turn); the rest of the span stays in the skeleton.
    pub stored: Span,
    /// The text a reader of the prompt sees: a text block's `text`, a string unit
    /// itself, a tool result's `content`.
    pub content: Option<Span>,
    /// Its text, when it is a text block or a string: what ignore rules match.
    pub text: Option<Span>,
    /// Its `cache_control`, when that is an object.
    pub marker: Option<Marker>,
    /// Whether it carries a `cache_control` key at all (left out when normalised).
    pub has_cache_control: bool,
    /// It is an image, or a tool result holding one (images change the messages
    /// cache).
    pub image: bool,
    /// The bytes the provider caches, when they differ from the span: string
    /// content as one text block, a block less its `cache_control`.
    pub normalized: Option<Bytes>,
    /// The content digest of the normalised bytes: taken on first ask, or lent by
    /// an earlier turn that held the same bytes at the same place.
    hash: OnceLock<Digest>,
}

impl Unit {
    /// The content digest of the normalised bytes (`body`: the prompt's body).
    pub fn hash(&self, body: &Bytes) -> Digest {
        // Lazy: hashing every unit of a 200 KB body costs ~130 µs (113 units,
        // too small for BLAKE3's SIMD), memcmp with the last turn ~4 µs.
        *self.hash.get_or_init(|| match &self.normalized {
            Some(b) => digest::content(b),
            None => digest::content(&body[self.span.start..self.span.end]),
        })
    }

    /// The digest of its span, when somebody already took it (the cache stage takes
    /// every unit's) and the span is what was hashed. The span's bytes fix the
    /// `stored` bytes, so a store can find the unit by it without reading them.
    pub fn span_digest(&self) -> Option<Digest> {
        self.hash
            .get()
            .copied()
            .filter(|_| self.normalized.is_none())
    }

    /// Takes `hash` as the digest, known from an earlier unit of the same bytes.
    pub fn lend_hash(&self, hash: Digest) {
        let _ = self.hash.set(hash);
    }

    /// The normalised bytes (the body's own memory when they are the span).
    pub fn bytes(&self, body: &Bytes) -> Bytes {
        match &self.normalized {
            Some(b) => b.clone(),
            None => body.slice(self.span.start..self.span.end),
        }
    }
}

/// A message of `messages`: the fields rendered into the prompt around its blocks.
#[derive(Debug, Clone)]
pub struct Message {
    /// Its index in `messages`.
    pub index: u32,
    /// Its token in the tape (`role` and the other fields are read from it).
    pub tok: u32,
    /// Its units, as indices into the unit list.
    pub units: Range<usize>,
}

/// How far past its cursor [`find_by_place`] looks: a unit not found by place (new,
/// changed, or with a secret) does not move it.
const PLACES_AHEAD: usize = 8;

/// Where the unit that `is` stands among a turn's last units (`len` of them, in
/// order): at `cursor` or a few places on; the cursor moves past it. A turn sends
/// most of its last turn's units again in the same order, so this walk replaces a
/// lookup a unit (the cut's lent units, the capture writer's units, the store's ids).
fn find_by_place(len: usize, cursor: &mut usize, is: impl Fn(usize) -> bool) -> Option<usize> {
    let end = (*cursor + PLACES_AHEAD).min(len);
    let k = (*cursor..end).find(|&k| is(k))?;
    *cursor = k + 1;
    Some(k)
}

/// [`find_by_place`] over digests, and where that finds nothing while more than
/// [`PLACES_AHEAD`] of the last units are still ahead, a lookup of the digest among
/// them all (built on that first miss): a turn that dropped its oldest rounds moved
/// every later unit past where the cursor looks, and each was then sought in a
/// cold map or made again.
// Conversations at the 200 KB band drop ~10 rounds every ~10 turns (bench/conversations).
#[derive(Debug)]
pub(crate) struct DigestPlaces {
    /// Each last unit's digest, in order (`None`: found no way by digest).
    digests: Vec<Option<Digest>>,
    pub(super) lookup: std::cell::OnceCell<digest::DigestMap<usize>>,
}

impl DigestPlaces {
    pub(crate) fn new(digests: Vec<Option<Digest>>) -> DigestPlaces {
        DigestPlaces {
            digests,
            lookup: std::cell::OnceCell::new(),
        }
    }

    /// Where `digest` stands among the last units; the cursor moves past it.
    pub(crate) fn find(&self, cursor: &mut usize, digest: &Digest) -> Option<usize> {
        let len = self.digests.len();
        if let Some(k) = find_by_place(len, cursor, |k| self.digests[k] == Some(*digest)) {
            return Some(k);
        }
        // Past the last units' end a unit is new: no lookup, no map built.
        if *cursor + PLACES_AHEAD >= len {
            return None;
        }
        let lookup = self.lookup.get_or_init(|| {
            self.digests
                .iter()
                .enumerate()
                .filter_map(|(k, d)| Some(((*d)?, k)))
                .collect()
        });
        let k = *lookup.get(digest)?;
        *cursor = (*cursor).max(k + 1);
        Some(k)
    }
}

/// Units lent so far (tests count them).
#[cfg(test)]
pub(super) static LENT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The units of the turn a body continues, lent to its cut: a block whose tokens are
/// all that turn's ([`Reused`]) is that turn's unit, moved where the bytes moved.
pub(crate) struct Lender {
    /// That turn's model, read and cut; held until this body is cut.
    last: super::PromptCell,
    reused: Reused,
    /// Where the search for the next unit to lend starts in `last`'s units: both
    /// cuts go in the same order.
    cursor: usize,
}

impl Lender {
    pub(super) fn new(last: super::PromptCell, reused: Reused) -> Lender {
        Lender {
            last,
            reused,
            cursor: 0,
        }
    }

    /// The unit at `path` cut from the token `tok` (its subtree ending before
    /// `next`), when that turn cut the same bytes there.
    fn lend(&mut self, path: UnitPath, tok: u32, next: u32) -> Option<Unit> {
        let (old, shift) = if next <= self.reused.same_below {
            (tok, 0)
        } else {
            let moved = self.reused.moved.filter(|m| tok >= m.from)?;
            (
                u32::try_from(i64::from(tok) - moved.tokens).ok()?,
                moved.bytes,
            )
        };
        let units = self.last.if_read()?.units_if_cut();
        let unit = &units[find_by_place(units.len(), &mut self.cursor, |k| units[k].tok == old)?];
        // A block's unit depends on its region (a tool's kind) and on being a
        // string or not, besides its bytes.
        if unit.path.region != path.region || unit.path.string != path.string {
            return None;
        }
        let by = |s: Span| Span {
            start: (s.start as i64 + shift) as usize,
            end: (s.end as i64 + shift) as usize,
        };
        #[cfg(test)]
        LENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(Unit {
            path,
            tok,
            span: by(unit.span),
            stored: by(unit.stored),
            content: unit.content.map(by),
            text: unit.text.map(by),
            ..unit.clone()
        })
    }
}

/// Cuts the units of `root` for `format`, in cache order; the units `lender` holds
/// for the same bytes are taken from it.
pub(super) fn cut(
    root: Value<'_>,
    format: super::Format,
    lender: Option<Lender>,
) -> (Vec<Unit>, Vec<Message>) {
    let mut c = Cutter {
        // Claude Code's bodies hold a unit per ~15 tape tokens: reserved for one per 10,
        // the list does not regrow, and holds less than doubling would have left
        // (at 1 MB the regrowths were half the cut: 212 -> 92-115 µs).
        units: Vec::with_capacity(root.toks.len() / 10),
        messages: Vec::new(),
        lender,
    };
    use super::Format;
    match format {
        Format::AnthropicMessages => {
            c.tools(root);
            c.string_or_list(root.get("system"), Region::System, "");
            c.messages(root);
        }
        Format::OpenAiChat => {
            c.tools(root);
            c.messages(root);
        }
        Format::OpenAiResponses => {
            if let Some(text) = root.get("instructions").filter(Value::is_string) {
                c.string(UnitPath::new(Region::Instructions, 0, None, true), text);
            }
            c.tools(root);
            c.string_or_list(root.get("input"), Region::Input, "item");
        }
    }
    (c.units, c.messages)
}

struct Cutter {
    units: Vec<Unit>,
    messages: Vec<Message>,
    lender: Option<Lender>,
}

impl Cutter {
    /// The unit the turn continued cut from the same bytes, moved here.
    fn lent(&mut self, path: UnitPath, node: Value<'_>) -> Option<Unit> {
        let tok = node.index();
        let next = node.toks.get(tok as usize)?.next;
        self.lender.as_mut()?.lend(path, tok, next)
    }

    /// A region that is one string or a list of blocks (`system`, `input`).
    fn string_or_list(&mut self, value: Option<Value<'_>>, region: Region, default_kind: &str) {
        match value {
            Some(list) if list.is_array() => {
                for (i, item) in list.items().enumerate() {
                    self.block(UnitPath::new(region, i, None, false), item, default_kind);
                }
            }
            Some(text) if text.is_string() => {
                self.string(UnitPath::new(region, 0, None, true), text)
            }
            _ => {}
        }
    }

    fn tools(&mut self, root: Value<'_>) {
        if let Some(tools) = root.get("tools") {
            for (i, tool) in tools.items().enumerate() {
                self.block(UnitPath::new(Region::Tools, i, None, false), tool, "tool");
            }
        }
    }

    fn messages(&mut self, root: Value<'_>) {
        let Some(messages) = root.get("messages") else {
            return;
        };
        for (i, message) in messages.items().enumerate() {
            let first = self.units.len();
            match message.get("content") {
                Some(blocks) if blocks.is_array() => {
                    for (j, block) in blocks.items().enumerate() {
                        self.block(
                            UnitPath::new(Region::Messages, i, Some(j), false),
                            block,
                            "",
                        );
                    }
                }
                Some(text) if text.is_string() => {
                    self.string(UnitPath::new(Region::Messages, i, None, true), text)
                }
                _ => {}
            }
            self.messages.push(Message {
                index: i as u32,
                tok: message.index(),
                units: first..self.units.len(),
            });
        }
    }

    /// String content: one text block `{"type":"text","text":<string as sent>}`.
    fn string(&mut self, path: UnitPath, text: Value<'_>) {
        if let Some(unit) = self.lent(path, text) {
            self.units.push(unit);
            return;
        }
        let raw = text.bytes();
        let mut bytes = Vec::with_capacity(raw.len() + 24);
        bytes.extend_from_slice(b"{\"type\":\"text\",\"text\":");
        bytes.extend_from_slice(raw);
        bytes.push(b'}');
        self.units.push(Unit {
            path,
            kind: self::kind("text"),
            span: text.span(),
            tok: text.index(),
            content: Some(text.span()),
            text: Some(text.span()),
            marker: None,
            has_cache_control: false,
            image: false,
            hash: OnceLock::new(),
            normalized: Some(Bytes::from(bytes)),
            stored: text.span(),
        });
    }

    /// A block (or tool, or input item) as sent, less its `cache_control`.
    fn block(&mut self, path: UnitPath, node: Value<'_>, default_kind: &str) {
        if let Some(unit) = self.lent(path, node) {
            self.units.push(unit);
            return;
        }
        let span = node.span();
        // One pass over the entries; a repeated key reads its last value, as `get` does.
        let (mut declared, mut cache_control, mut text, mut content) = (None, None, None, None);
        let (mut last, mut before_last) = (None, None);
        for (k, v) in node.entries() {
            let key = k.bytes();
            let is = |name: &str| key_is(key, name) == Some(true);
            let is_cache_control = is("cache_control");
            if is_cache_control {
                cache_control = Some(v);
            } else if is("type") {
                declared = Some(v);
            } else if is("text") {
                text = Some(v);
            } else if is("content") {
                content = Some(v);
            }
            before_last = last;
            last = Some((v.span().end, is_cache_control));
        }
        let kind = declared
            .and_then(|t| t.str())
            .map_or_else(|| self::kind(default_kind), |t| self::kind(&t));
        // Client tools may omit `type` or say "custom"; server tools keep theirs.
        let kind = match (default_kind, declared) {
            ("tool", None) => self::kind("tool"),
            ("tool", Some(_)) if kind == "custom" => self::kind("tool"),
            _ => kind,
        };
        let normalized = cache_control.map(|_| {
            let mut out = Vec::with_capacity(span.end - span.start);
            out.push(b'{');
            for (k, v) in node.entries() {
                if key_is(k.bytes(), "cache_control") == Some(true) {
                    continue;
                }
                if out.len() > 1 {
                    out.push(b',');
                }
                out.extend_from_slice(k.bytes());
                out.push(b':');
                out.extend_from_slice(v.bytes());
            }
            out.push(b'}');
            Bytes::from(out)
        });
        let text = text.filter(|_| kind == "text").map(|t| t.span());
        let (content, image) = match &*kind {
            "text" => (text, false),
            "tool_result" => (content.map(|c| c.span()), content.is_some_and(holds_image)),
            "image" => (None, true),
            _ => (None, false),
        };
        // Stored less a trailing `cache_control` entry and the closing brace.
        let stored = match (last, before_last) {
            (Some((_, true)), Some((end, _))) | (Some((end, false)), _) => Span {
                start: span.start,
                end,
            },
            _ => span,
        };
        self.units.push(Unit {
            path,
            kind,
            span,
            tok: node.index(),
            stored,
            content,
            text,
            marker: cache_control.and_then(Marker::of),
            has_cache_control: cache_control.is_some(),
            image,
            normalized,
            hash: OnceLock::new(),
        });
    }
}

/// Whether a value holds an image block at any depth (a tool result's content).
fn holds_image(value: Value<'_>) -> bool {
    if value.is_array() {
        return value.items().any(holds_image);
    }
    value.entries().any(|(k, v)| {
        (key_is(k.bytes(), "type") == Some(true) && v.is_str("image"))
            || ((v.is_array() || v.is_object()) && holds_image(v))
    })
}

//! The cutter that read bodies with the recursive scanner, kept only until the
//! equivalence test below shows the model gives the same units (issue 15, item 6).
//!
//! (Its original description follows.) A request cut into cache units, in the provider's cache order, with a running
//! prefix hash after every unit.
//!
//! Anthropic caches the prefix tools → system → messages (PROTOCOL.md §B.4). A unit is
//! one tool definition, one system block or one message content block, normalised as
//! the provider sees it: string content is one text block, `cache_control` is left
//! out, every other byte is as sent. OpenAI requests are cut the same way (tools,
//! instructions, messages or input items) for the stable-prefix view. This module
//! only describes one request; comparing requests is `explain`'s job.

use std::fmt;

use bytes::Bytes;
use regex::Regex;
use serde::{Deserialize, Serialize};

use super::estimate;
use crate::digest::{self, Hasher};
use crate::provider::json::{self as scan, Node, ScanError, scan};
use crate::provider::{Api, Provider};

/// A content digest (BLAKE3).
pub type Hash = digest::Digest;

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
    fn name(self) -> &'static str {
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
    /// The message's content is one string (normalised as one text block).
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
    pub fn secs(self) -> u64 {
        match self {
            Ttl::FiveMinutes => 300,
            Ttl::OneHour => 3600,
        }
    }

    /// The ttl of a `cache_control` object (scanned again when it was kept as a leaf).
    fn of(body: &[u8], cache_control: &Node) -> Ttl {
        let span = cache_control.span();
        let is_1h = match cache_control {
            Node::Object(..) => cache_control
                .get(body, "ttl")
                .is_some_and(|t| t.is_str(body, "1h")),
            _ => scan::scan(span.of(body), 1).is_ok_and(|n| {
                n.get(span.of(body), "ttl")
                    .is_some_and(|t| t.is_str(span.of(body), "1h"))
            }),
        };
        if is_1h {
            Ttl::OneHour
        } else {
            Ttl::FiveMinutes
        }
    }
}

impl fmt::Display for Ttl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ttl::FiveMinutes => "5m",
            Ttl::OneHour => "1h",
        })
    }
}

/// A `cache_control` marker on a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Breakpoint {
    pub ttl: Ttl,
    /// Placed by top-level automatic caching (on the last cacheable block).
    pub automatic: bool,
}

/// One cache unit.
#[derive(Debug, Clone)]
pub struct Unit {
    pub path: UnitPath,
    /// The block type (`text`, `tool_use`, `tool_result`, `image`, …), `tool` for a
    /// tool definition, `item` for an OpenAI input item.
    pub kind: String,
    /// The normalised bytes the provider caches (shares the body's bytes when the
    /// block is sent without `cache_control`).
    pub bytes: Bytes,
    /// The content digest of `bytes`.
    pub hash: Hash,
    /// The running prefix hash: everything up to and including this unit, with the
    /// request-level inputs rendered into the prompt (model, settings, message roles).
    pub prefix: Hash,
    /// Lookback position: a run of consecutive `tool_use` (or `tool_result`) blocks
    /// shares one position (PROTOCOL.md §B.4).
    pub position: u32,
    /// Estimated tokens (see `estimate`).
    pub tokens: u32,
    pub breakpoint: Option<Breakpoint>,
    /// Whether a breakpoint may sit here (not thinking, not an empty text block).
    pub cacheable: bool,
    /// Left out of the prefix hash by configuration (e.g. the billing header block).
    pub ignored: bool,
}

/// The request-level inputs that are rendered into the prompt (PROTOCOL.md §B.6, §B.10).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Settings {
    pub model: String,
    /// Raw JSON as sent, when present.
    pub tool_choice: Option<String>,
    pub thinking: Option<String>,
    pub effort: Option<String>,
    pub speed: Option<String>,
    /// Any image anywhere in the messages.
    pub images: bool,
}

/// Which request grammar a body follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    AnthropicMessages,
    OpenAiChat,
    OpenAiResponses,
}

impl Format {
    /// The format of a provider API's request bodies, when it is one cache analysis reads.
    pub fn of(provider: Provider, api: Api) -> Option<Format> {
        match (provider, api) {
            (Provider::Anthropic, Api::Messages) => Some(Format::AnthropicMessages),
            (Provider::OpenAi, Api::ChatCompletions) => Some(Format::OpenAiChat),
            (Provider::OpenAi, Api::Responses) => Some(Format::OpenAiResponses),
            _ => None,
        }
    }

    pub fn provider(self) -> Provider {
        match self {
            Format::AnthropicMessages => Provider::Anthropic,
            _ => Provider::OpenAi,
        }
    }
}

/// A request as cache units.
#[derive(Debug, Clone)]
pub struct Segments {
    /// The body the units were cut from.
    pub body: Bytes,
    pub format: Format,
    pub units: Vec<Unit>,
    pub settings: Settings,
    /// Indices of the units that carry a breakpoint, in order.
    pub breakpoints: Vec<usize>,
    /// The digest over the tool units: the tool set.
    pub tools_hash: Hash,
}

impl Segments {
    /// Estimated tokens of units `0..=last`.
    pub fn tokens_through(&self, last: usize) -> u64 {
        self.units[..=last.min(self.units.len().saturating_sub(1))]
            .iter()
            .map(|u| u64::from(u.tokens))
            .sum()
    }

    /// Estimated tokens of the whole prompt.
    pub fn total_tokens(&self) -> u64 {
        self.units.iter().map(|u| u64::from(u.tokens)).sum()
    }

    /// The first unit of `region`, if the request has one.
    pub fn region_start(&self, region: Region) -> Option<usize> {
        self.units.iter().position(|u| u.path.region == region)
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
    /// break Anthropic's cache (CLIENTS.md §4, PROTOCOL.md §E.3).
    pub fn billing_header() -> IgnoreRule {
        IgnoreRule {
            region: Region::System,
            text: Regex::new("^x-anthropic-billing-header:").expect("a valid literal pattern"),
        }
    }
}

/// Why a body could not be cut into units.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error("request body is not JSON: {0}")]
    NotJson(#[from] ScanError),
    #[error("request body is not a JSON object")]
    NotObject,
}

/// Cuts `body` into cache units. One pass over the bytes finds the structure;
/// each unit is then normalised, hashed, estimated and chained into the prefix.
pub fn segment(
    body: &Bytes,
    format: Format,
    ignore: &[IgnoreRule],
) -> Result<Segments, SegmentError> {
    segment_after(body, format, ignore, None)
}

/// [`segment`], where units byte-identical to `previous`'s at the same place (an
/// agent's earlier turn) take its hash and token estimate instead of computing them.
pub fn segment_after(
    body: &Bytes,
    format: Format,
    ignore: &[IgnoreRule],
    previous: Option<&Segments>,
) -> Result<Segments, SegmentError> {
    // top → messages → message → content → block: five levels keep every unit.
    let top = scan(body, 5)?;
    if !matches!(top, Node::Object(..)) {
        return Err(SegmentError::NotObject);
    }
    let mut cut = Cutter::new(body, format, ignore, &top);
    cut.previous = previous;
    match format {
        Format::AnthropicMessages => cut.anthropic(&top),
        Format::OpenAiChat => cut.openai_chat(&top),
        Format::OpenAiResponses => cut.openai_responses(&top),
    }
    Ok(cut.finish(&top))
}

// === impl Cutter ===

/// Builds the unit list; owns the running prefix hash.
struct Cutter<'b> {
    body: &'b Bytes,
    previous: Option<&'b Segments>,
    format: Format,
    ignore: &'b [IgnoreRule],
    units: Vec<Unit>,
    prefix: Hash,
    /// Bytes to mix into the prefix before the next unit (settings at a region
    /// start, a message's role and fields).
    pending: Vec<u8>,
    settings: Settings,
    speed_mixed: bool,
    tools: Hasher,
}

const IGNORED: &[u8] = b"promptgate:ignored-unit";

/// The items of an array node (none for anything else).
fn items(node: Option<&Node>) -> &[Node] {
    match node {
        Some(Node::Array(_, items)) => items,
        _ => &[],
    }
}

impl<'b> Cutter<'b> {
    fn new(body: &'b Bytes, format: Format, ignore: &'b [IgnoreRule], top: &Node) -> Cutter<'b> {
        let b: &[u8] = body;
        let raw = |k: &str| {
            top.get(b, k)
                .map(|v| String::from_utf8_lossy(v.span().of(b)).into_owned())
        };
        let effort = top
            .get(b, "output_config")
            .and_then(|o| o.get(b, "effort"))
            .map(|v| String::from_utf8_lossy(v.span().of(b)).into_owned());
        let settings = Settings {
            model: top
                .get(b, "model")
                .and_then(|m| m.string(b))
                .unwrap_or_default(),
            tool_choice: raw("tool_choice"),
            thinking: raw("thinking").or_else(|| raw("reasoning")),
            effort: effort.or_else(|| raw("reasoning_effort")),
            speed: raw("speed"),
            images: false,
        };
        let mut seed = Hasher::new();
        seed.update(b"promptgate-cache-v1\0");
        seed.update(format.provider().name().as_bytes());
        seed.update(b"\0");
        seed.update(settings.model.as_bytes());
        Cutter {
            body,
            previous: None,
            format,
            ignore,
            units: Vec::new(),
            prefix: seed.finish(),
            pending: Vec::new(),
            settings,
            speed_mixed: false,
            tools: Hasher::new(),
        }
    }

    fn anthropic(&mut self, top: &Node) {
        let b: &[u8] = self.body;
        for (i, tool) in items(top.get(b, "tools")).iter().enumerate() {
            self.block(UnitPath::new(Region::Tools, i, None, false), tool, "tool");
        }
        self.mix_speed();
        match top.get(b, "system") {
            Some(Node::Array(_, blocks)) => {
                for (i, block) in blocks.iter().enumerate() {
                    self.block(UnitPath::new(Region::System, i, None, false), block, "");
                }
            }
            Some(text) if text.span().of(b).first() == Some(&b'"') => {
                self.string(UnitPath::new(Region::System, 0, None, true), text)
            }
            _ => {}
        }
        self.messages(top, Region::Messages);
    }

    fn openai_chat(&mut self, top: &Node) {
        let b: &[u8] = self.body;
        for (i, tool) in items(top.get(b, "tools")).iter().enumerate() {
            self.block(UnitPath::new(Region::Tools, i, None, false), tool, "tool");
        }
        self.messages(top, Region::Messages);
    }

    fn openai_responses(&mut self, top: &Node) {
        let b: &[u8] = self.body;
        if let Some(text) = top
            .get(b, "instructions")
            .filter(|v| v.span().of(b).first() == Some(&b'"'))
        {
            self.string(UnitPath::new(Region::Instructions, 0, None, true), text);
        }
        for (i, tool) in items(top.get(b, "tools")).iter().enumerate() {
            self.block(UnitPath::new(Region::Tools, i, None, false), tool, "tool");
        }
        self.mix_settings();
        match top.get(b, "input") {
            Some(Node::Array(_, list)) => {
                for (i, item) in list.iter().enumerate() {
                    self.block(UnitPath::new(Region::Input, i, None, false), item, "item");
                }
            }
            Some(text) if text.span().of(b).first() == Some(&b'"') => {
                self.string(UnitPath::new(Region::Input, 0, None, true), text)
            }
            _ => {}
        }
    }

    fn messages(&mut self, top: &Node, region: Region) {
        let b: &[u8] = self.body;
        self.mix_settings();
        for (i, message) in items(top.get(b, "messages")).iter().enumerate() {
            // The role and any message-level field (Claude Code's role:"system"
            // message carries output_config) are rendered into the prompt.
            self.pending.extend_from_slice(b"\0message{");
            if let Node::Object(_, entries) = message {
                for (k, v) in entries {
                    if !scan::is_key(b, *k, "content") {
                        self.pending.extend_from_slice(k.of(b));
                        self.pending.push(b':');
                        self.pending.extend_from_slice(v.span().of(b));
                        self.pending.push(b',');
                    }
                }
            }
            self.pending.push(b'}');
            match message.get(b, "content") {
                Some(Node::Array(_, blocks)) => {
                    for (j, block) in blocks.iter().enumerate() {
                        self.block(UnitPath::new(region, i, Some(j), false), block, "");
                    }
                }
                Some(text) if text.span().of(b).first() == Some(&b'"') => {
                    self.string(UnitPath::new(region, i, None, true), text)
                }
                _ => {}
            }
        }
    }

    /// `speed` changes the system and messages caches, not the tools cache (§B.6).
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
    /// messages cache (§B.6).
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

    /// A string content: one text block `{"type":"text","text":<string as sent>}`.
    fn string(&mut self, path: UnitPath, text: &Node) {
        let raw = text.span().of(self.body);
        let mut bytes = Vec::with_capacity(raw.len() + 24);
        bytes.extend_from_slice(b"{\"type\":\"text\",\"text\":");
        bytes.extend_from_slice(raw);
        bytes.push(b'}');
        let ignored = self.is_ignored(path.region, Some(text));
        let cacheable = raw.len() > 2;
        let measured = self.measure(&path, &bytes, raw);
        self.push(
            path,
            "text".into(),
            Bytes::from(bytes),
            measured,
            None,
            cacheable,
            ignored,
        );
    }

    /// A block (or tool, or input item) as sent, less its `cache_control`.
    fn block(&mut self, path: UnitPath, node: &Node, default_kind: &str) {
        let body = self.body;
        let b: &[u8] = body;
        let field = |k: &str| node.get(b, k);
        let kind = field("type")
            .and_then(|t| t.string(b))
            .unwrap_or_else(|| default_kind.to_owned());
        // Client tools may omit `type` or say "custom"; server tools keep theirs.
        let kind = match (default_kind, field("type")) {
            ("tool", None) => "tool".to_owned(),
            ("tool", Some(_)) if kind == "custom" => "tool".to_owned(),
            _ => kind,
        };
        let marker = field("cache_control");
        let span = node.span();
        let bytes = match (marker, node) {
            (Some(_), Node::Object(_, entries)) => {
                let mut out = Vec::with_capacity(span.end - span.start);
                out.push(b'{');
                for (k, v) in entries
                    .iter()
                    .filter(|(k, _)| !scan::is_key(b, *k, "cache_control"))
                {
                    if out.len() > 1 {
                        out.push(b',');
                    }
                    out.extend_from_slice(k.of(b));
                    out.push(b':');
                    out.extend_from_slice(v.span().of(b));
                }
                out.push(b'}');
                Bytes::from(out)
            }
            _ => body.slice(span.start..span.end),
        };
        let breakpoint = marker
            .filter(|m| m.span().of(b).first() == Some(&b'{'))
            .map(|m| Breakpoint {
                ttl: Ttl::of(b, m),
                automatic: false,
            });
        let text = (kind == "text").then(|| field("text")).flatten();
        let ignored = text.is_some() && self.is_ignored(path.region, text);
        // The rendered part of text and tool results is their content, not the JSON around it.
        let counted = match kind.as_str() {
            "text" => text.map(|t| t.span().of(b)),
            "tool_result" => field("content").map(|c| c.span().of(b)),
            _ => None,
        }
        .unwrap_or(&bytes);
        let measured = self.measure(&path, &bytes, counted);
        let cacheable = match kind.as_str() {
            "thinking" | "redacted_thinking" => false,
            "text" => text.is_some_and(|t| t.span().of(b).len() > 2),
            _ => true,
        };
        if path.region == Region::Messages
            && (kind == "image"
                || (kind == "tool_result"
                    && memchr::memmem::find(&bytes, b"\"type\":\"image\"").is_some()))
        {
            self.settings.images = true;
        }
        self.push(path, kind, bytes, measured, breakpoint, cacheable, ignored);
    }

    /// The unit's hash and token estimate: the earlier turn's when the same place
    /// held the same bytes (a memcmp is far cheaper than hashing and counting).
    fn measure(&self, path: &UnitPath, bytes: &[u8], counted: &[u8]) -> (Hash, u32) {
        if let Some(prev) = self.previous.and_then(|p| p.units.get(self.units.len()))
            && prev.path == *path
            && prev.bytes[..] == *bytes
        {
            return (prev.hash, prev.tokens);
        }
        let tokens = estimate::tokens(self.format.provider(), counted) + estimate::BLOCK_OVERHEAD;
        (digest::content(bytes), tokens)
    }

    fn is_ignored(&self, region: Region, text: Option<&Node>) -> bool {
        let Some(text) = text else { return false };
        if !self.ignore.iter().any(|r| r.region == region) {
            return false;
        }
        let Some(decoded) = text.string(self.body) else {
            return false;
        };
        self.ignore
            .iter()
            .any(|r| r.region == region && r.text.is_match(&decoded))
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        path: UnitPath,
        kind: String,
        bytes: Bytes,
        (hash, tokens): (Hash, u32),
        breakpoint: Option<Breakpoint>,
        cacheable: bool,
        ignored: bool,
    ) {
        if path.region == Region::Tools {
            self.tools.update(&hash);
        }
        let mut chain = Hasher::new();
        chain.update(&self.prefix);
        chain.update(&self.pending);
        self.pending.clear();
        chain.update(if ignored { IGNORED } else { &hash });
        self.prefix = chain.finish();
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
        });
    }

    fn finish(mut self, top: &Node) -> Segments {
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
        // Top-level automatic caching puts a breakpoint on the last cacheable block (§B.2).
        let b: &[u8] = self.body;
        if self.format == Format::AnthropicMessages
            && let Some(auto) = top
                .get(b, "cache_control")
                .filter(|v| v.span().of(b).first() == Some(&b'{'))
            && let Some(last) = self.units.iter_mut().rev().find(|u| u.cacheable)
            && last.breakpoint.is_none()
        {
            last.breakpoint = Some(Breakpoint {
                ttl: Ttl::of(b, auto),
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
        Segments {
            body: self.body.clone(),
            format: self.format,
            units: self.units,
            settings: self.settings,
            breakpoints,
            tools_hash: self.tools.finish(),
        }
    }
}

/// Block types whose consecutive runs count as one lookback position.
fn run_kind(kind: &str) -> bool {
    kind == "tool_use" || kind == "tool_result"
}

#[path = "../../tests/support/shapes.rs"]
mod shapes;

#[cfg(test)]
mod equivalence {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::shapes;

    use bytes::Bytes;

    use crate::prompt::Prompt;

    fn new_format(f: super::Format) -> crate::prompt::Format {
        match f {
            super::Format::AnthropicMessages => crate::prompt::Format::AnthropicMessages,
            super::Format::OpenAiChat => crate::prompt::Format::OpenAiChat,
            super::Format::OpenAiResponses => crate::prompt::Format::OpenAiResponses,
        }
    }

    /// Both cutters over `body`: the same units, hashes, prefixes, estimates and settings.
    fn same(body: &[u8], format: super::Format) {
        let bytes = Bytes::copy_from_slice(body);
        let ignore = [super::IgnoreRule::billing_header()];
        let new_ignore = [crate::cache::segment::IgnoreRule::billing_header()];
        let old = super::segment(&bytes, format, &ignore);
        let prompt = Prompt::read(bytes.clone(), Some(new_format(format)));
        let new = crate::cache::segment::segment(&prompt, &new_ignore);
        let text = String::from_utf8_lossy(body);
        let (old, new) = match (old, new) {
            (Ok(o), Ok(n)) => (o, n),
            (Err(_), Err(_)) => return,
            (o, n) => panic!(
                "one cut and one refused: {:?} / {:?}\n{text}",
                o.err(),
                n.err()
            ),
        };
        assert_eq!(old.units.len(), new.units.len(), "{text}");
        for (o, n) in old.units.iter().zip(&new.units) {
            let at = o.path.to_string();
            assert_eq!(at, n.path.to_string(), "{text}");
            assert_eq!(o.kind, n.kind, "{at}: {text}");
            assert_eq!(o.bytes, n.bytes, "{at}: {text}");
            assert_eq!(
                (
                    o.hash,
                    o.prefix,
                    o.position,
                    o.tokens,
                    o.cacheable,
                    o.ignored
                ),
                (
                    n.hash,
                    n.prefix,
                    n.position,
                    n.tokens,
                    n.cacheable,
                    n.ignored
                ),
                "{at}: {text}"
            );
            assert_eq!(
                o.breakpoint.map(|b| (b.ttl.to_string(), b.automatic)),
                n.breakpoint.map(|b| (b.ttl.to_string(), b.automatic)),
                "{at}: {text}"
            );
        }
        assert_eq!(old.breakpoints, new.breakpoints, "{text}");
        assert_eq!(old.tools_hash, new.tools_hash, "{text}");
        let s = &old.settings;
        assert_eq!(
            (
                &s.model,
                &s.tool_choice,
                &s.thinking,
                &s.effort,
                &s.speed,
                s.images
            ),
            (
                &new.settings.model,
                &new.settings.tool_choice,
                &new.settings.thinking,
                &new.settings.effort,
                &new.settings.speed,
                new.settings.images
            ),
            "{text}"
        );
    }

    const FIXED: &[&str] = &[
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"system","content":[{"type":"text","text":"env","cache_control":{"type":"ephemeral"}}],"output_config":{"effort":"medium"}}],"system":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"You are","cache_control":{"type":"ephemeral","ttl":"1h"}}],"tools":[{"name":"Bash","input_schema":{"type":"object"}}]}"#,
        r#"{"model":"m","cache_control":{"type":"ephemeral","ttl":"1h"},"messages":[{"role":"user","content":"q"},{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"thinking","thinking":"t","signature":"s"},{"type":"text","text":""}]}]}"#,
        r#"{"model":"gpt","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"tools":[{"type":"function","function":{"name":"bash"}}],"tool_choice":"auto","reasoning_effort":"low"}"#,
        r#"{"model":"gpt","instructions":"be brief","input":[{"role":"user","content":"hi"},{"type":"function_call_output","call_id":"c","output":"x"}],"tools":[{"type":"function","name":"f"}],"reasoning":{"effort":"high"}}"#,
        r#"{"model":"gpt","input":"just text","speed":"fast"}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA=="}},{"type":"tool_result","tool_use_id":"t","content":[{"type":"image","source":{}}],"cache_control":{"type":"ephemeral"}}]}],"tools":[{"type":"custom","name":"x"},{"type":"web_search_20250305","name":"web_search"}]}"#,
        r#" { "model" : "m" , "system" : "plain system" , "messages" : [ { "role" : "user" , "content" : "caf\u00e9 \"q\"" } , 5 , { "role" : "assistant" } ] } "#,
        r#"{"model":7,"messages":"nope","system":{"a":1},"tools":{}}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x","cache_control":"oops"},{"type":1,"text":"y"},{"text":"z"}]}]}"#,
        "[1]",
        "{\"a\":",
        "{} trailing",
        "",
    ];

    #[test]
    fn the_model_cuts_what_the_scanner_cut_on_fixed_bodies() {
        use super::Format::*;
        for body in FIXED {
            for format in [AnthropicMessages, OpenAiChat, OpenAiResponses] {
                same(body.as_bytes(), format);
            }
        }
        for rounds in [0, 1, 5, 20] {
            let v = shapes::claude_code_body(rounds, shapes::CC_SESSION);
            same(&shapes::to_bytes(&v), AnthropicMessages);
            same(&serde_json::to_vec_pretty(&v).unwrap(), AnthropicMessages);
        }
        for size in [50_000, 200_000] {
            same(&shapes::claude_code_body_of_size(size), AnthropicMessages);
        }
        for turns in [1, 3] {
            same(
                &shapes::to_bytes(&shapes::pi_body(turns)),
                AnthropicMessages,
            );
        }
        same(
            &shapes::to_bytes(&shapes::openai_chat_body(true)),
            OpenAiChat,
        );
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            "[ -~]{0,24}",
            "\\PC{0,8}",
            Just("x-anthropic-billing-header: cch=9;".to_owned())
        ]
    }

    fn cache_control() -> impl Strategy<Value = Option<Value>> {
        prop_oneof![
            3 => Just(None),
            1 => Just(Some(json!({"type": "ephemeral"}))),
            1 => Just(Some(json!({"type": "ephemeral", "ttl": "1h", "scope": "global"}))),
            1 => Just(Some(json!("not an object"))),
        ]
    }

    fn block() -> impl Strategy<Value = Value> {
        let kind = prop_oneof![
            Just("text"),
            Just("tool_use"),
            Just("tool_result"),
            Just("thinking"),
            Just("image"),
            Just("redacted_thinking"),
            Just("document")
        ];
        (kind, text(), cache_control(), any::<bool>()).prop_map(|(kind, t, cc, untyped)| {
            let mut b = match kind {
                "text" => json!({"type": "text", "text": t}),
                "tool_use" => {
                    json!({"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": t}})
                }
                "tool_result" => json!({"type": "tool_result", "tool_use_id": "t1", "content": t}),
                "thinking" => json!({"type": "thinking", "thinking": t, "signature": "s"}),
                "image" => json!({"type": "image", "source": {"type": "base64", "data": t}}),
                k => json!({"type": k, "data": t}),
            };
            if untyped {
                b.as_object_mut().unwrap().remove("type");
            }
            if let Some(cc) = cc {
                b["cache_control"] = cc;
            }
            b
        })
    }

    fn content() -> impl Strategy<Value = Value> {
        prop_oneof![
            text().prop_map(Value::String),
            prop::collection::vec(block(), 0..5).prop_map(Value::Array),
            Just(json!(null)),
        ]
    }

    fn body() -> impl Strategy<Value = (Vec<u8>, usize)> {
        let message = (
            prop_oneof![
                Just("user"),
                Just("assistant"),
                Just("system"),
                Just("developer")
            ],
            content(),
            any::<bool>(),
        )
            .prop_map(|(role, content, effort)| {
                let mut m = json!({"role": role, "content": content});
                if effort {
                    m["output_config"] = json!({"effort": "medium"});
                }
                m
            });
        let tool = (text(), cache_control(), 0..3u8).prop_map(|(name, cc, kind)| {
            let mut t = match kind {
                0 => json!({"name": name, "input_schema": {"type": "object"}}),
                1 => json!({"type": "custom", "name": name}),
                _ => json!({"type": "function", "function": {"name": name}}),
            };
            if let Some(cc) = cc {
                t["cache_control"] = cc;
            }
            t
        });
        (
            prop::collection::vec(message, 0..6),
            prop::collection::vec(tool, 0..3),
            prop_oneof![content(), prop::collection::vec(block(), 0..3).prop_map(Value::Array)],
            (any::<bool>(), any::<bool>(), any::<bool>(), cache_control()),
            (any::<bool>(), 0..3usize),
        )
            .prop_map(|(messages, tools, system, (choice, thinking, speed, auto), (pretty, format))| {
                let mut v = json!({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": messages, "tools": tools});
                // The same lists under the other formats' names.
                v["system"] = system.clone();
                v["instructions"] = system.clone();
                v["input"] = v["messages"].clone();
                if choice { v["tool_choice"] = json!({"type": "any"}); }
                if thinking { v["thinking"] = json!({"type": "enabled", "budget_tokens": 1024}); }
                if speed { v["speed"] = json!("fast"); }
                if let Some(auto) = auto { v["cache_control"] = auto; }
                let bytes = if pretty { serde_json::to_vec_pretty(&v) } else { serde_json::to_vec(&v) };
                (bytes.unwrap(), format)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROMPTGATE_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn the_model_cuts_what_the_scanner_cut_on_generated_bodies((body, format) in body()) {
            use super::Format::*;
            same(&body, [AnthropicMessages, OpenAiChat, OpenAiResponses][format]);
        }
    }
}

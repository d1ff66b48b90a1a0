//! A request cut into cache units, in the provider's cache order, with a running
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
use ring::digest::{Context, SHA256};
use serde::Serialize;
use serde_json::value::RawValue;

use super::estimate;
use crate::provider::request::{Content, RawObject, RequestView};
use crate::provider::{Api, Provider};

/// A SHA-256 digest.
pub type Hash = [u8; 32];

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

    fn of(cache_control: &RawValue) -> Ttl {
        match RawObject::of(cache_control).and_then(|o| o.str("ttl")) {
            Some(t) if t == "1h" => Ttl::OneHour,
            _ => Ttl::FiveMinutes,
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
    /// SHA-256 of `bytes`.
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
    pub format: Format,
    pub units: Vec<Unit>,
    pub settings: Settings,
    /// Indices of the units that carry a breakpoint, in order.
    pub breakpoints: Vec<usize>,
    /// SHA-256 over the tool units: the tool set.
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
    #[error("request body is not a JSON object: {0}")]
    NotJson(#[from] serde_json::Error),
}

/// Cuts `body` into cache units. One pass over the units: each is normalised,
/// hashed, estimated and chained into the prefix as it is met.
pub fn segment(
    body: &Bytes,
    format: Format,
    ignore: &[IgnoreRule],
) -> Result<Segments, SegmentError> {
    let view = RequestView::parse(body)?;
    segment_view(body, &view, format, ignore, None)
}

/// [`segment`] for a body already parsed into `view` (which must borrow `body`).
/// Units byte-identical to `previous`'s at the same place (an agent's earlier turn)
/// take its hash and token estimate instead of computing them again.
pub fn segment_view(
    body: &Bytes,
    view: &RequestView<'_>,
    format: Format,
    ignore: &[IgnoreRule],
    previous: Option<&Segments>,
) -> Result<Segments, SegmentError> {
    let mut cut = Cutter::new(body, format, ignore, view);
    cut.previous = previous;
    match format {
        Format::AnthropicMessages => cut.anthropic(view),
        Format::OpenAiChat => cut.openai_chat(view),
        Format::OpenAiResponses => cut.openai_responses(view),
    }
    Ok(cut.finish(view))
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
    tools: Context,
}

const IGNORED: &[u8] = b"promptgate:ignored-unit";

impl<'b> Cutter<'b> {
    fn new(
        body: &'b Bytes,
        format: Format,
        ignore: &'b [IgnoreRule],
        view: &RequestView<'_>,
    ) -> Cutter<'b> {
        let raw = |k: &str| view.top.get(k).map(|v| v.get().to_owned());
        let output_config = view.top.get("output_config").and_then(RawObject::of);
        let settings = Settings {
            model: view.model().map(|m| m.into_owned()).unwrap_or_default(),
            tool_choice: raw("tool_choice"),
            thinking: raw("thinking").or_else(|| raw("reasoning")),
            effort: output_config
                .and_then(|o| o.get("effort").map(|v| v.get().to_owned()))
                .or_else(|| raw("reasoning_effort")),
            speed: raw("speed"),
            images: false,
        };
        let mut seed = Context::new(&SHA256);
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
            prefix: digest(seed),
            pending: Vec::new(),
            settings,
            speed_mixed: false,
            tools: Context::new(&SHA256),
        }
    }

    fn anthropic(&mut self, view: &RequestView<'_>) {
        for (i, tool) in view.tools().into_iter().enumerate() {
            self.block(UnitPath::new(Region::Tools, i, None, false), tool, "tool");
        }
        self.mix_speed();
        match view.system() {
            Some(Content::Text(text)) => {
                self.string(UnitPath::new(Region::System, 0, None, true), text)
            }
            Some(Content::Blocks(blocks)) => {
                for (i, b) in blocks.into_iter().enumerate() {
                    self.block(UnitPath::new(Region::System, i, None, false), b, "");
                }
            }
            None => {}
        }
        self.messages(view, Region::Messages);
    }

    fn openai_chat(&mut self, view: &RequestView<'_>) {
        for (i, tool) in view.tools().into_iter().enumerate() {
            self.block(UnitPath::new(Region::Tools, i, None, false), tool, "tool");
        }
        self.messages(view, Region::Messages);
    }

    fn openai_responses(&mut self, view: &RequestView<'_>) {
        if let Some(text) = view
            .top
            .get("instructions")
            .filter(|v| v.get().starts_with('"'))
        {
            self.string(UnitPath::new(Region::Instructions, 0, None, true), text);
        }
        for (i, tool) in view.tools().into_iter().enumerate() {
            self.block(UnitPath::new(Region::Tools, i, None, false), tool, "tool");
        }
        self.mix_settings();
        match view.top.get("input").and_then(Content::of) {
            Some(Content::Text(text)) => {
                self.string(UnitPath::new(Region::Input, 0, None, true), text)
            }
            Some(Content::Blocks(items)) => {
                for (i, item) in items.into_iter().enumerate() {
                    self.block(UnitPath::new(Region::Input, i, None, false), item, "item");
                }
            }
            None => {}
        }
    }

    fn messages(&mut self, view: &RequestView<'_>, region: Region) {
        self.mix_settings();
        for (i, message) in view.messages().into_iter().enumerate() {
            // The role and any message-level field (Claude Code's role:"system"
            // message carries output_config) are rendered into the prompt.
            let object = RawObject::of(message.raw).unwrap_or_default();
            self.pending.extend_from_slice(b"\0message{");
            for (k, v) in &object.entries {
                if k != "content" {
                    self.pending.extend_from_slice(k.as_bytes());
                    self.pending.push(b':');
                    self.pending.extend_from_slice(v.get().as_bytes());
                    self.pending.push(b',');
                }
            }
            self.pending.push(b'}');
            match message.content {
                Some(Content::Text(text)) => {
                    self.string(UnitPath::new(region, i, None, true), text)
                }
                Some(Content::Blocks(blocks)) => {
                    for (j, b) in blocks.into_iter().enumerate() {
                        self.block(UnitPath::new(region, i, Some(j), false), b, "");
                    }
                }
                None => {}
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

    /// tool_choice, thinking, effort (and images, see `finish`) change only the
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
    fn string(&mut self, path: UnitPath, text: &RawValue) {
        let raw = text.get().as_bytes();
        let mut bytes = Vec::with_capacity(raw.len() + 24);
        bytes.extend_from_slice(b"{\"type\":\"text\",\"text\":");
        bytes.extend_from_slice(raw);
        bytes.push(b'}');
        let ignored = self.is_ignored(path.region, Some(text));
        let cacheable = raw.len() > 2;
        let (hash, tokens) = self.measure(&path, &bytes, raw);
        self.push(
            path,
            "text".into(),
            Bytes::from(bytes),
            (hash, tokens),
            None,
            cacheable,
            ignored,
        );
    }

    /// A block (or tool, or input item) as sent, less its `cache_control`.
    fn block(&mut self, path: UnitPath, raw: &RawValue, default_kind: &str) {
        let object = RawObject::of(raw).unwrap_or_default();
        let kind = object
            .str("type")
            .map(|t| t.into_owned())
            .unwrap_or_else(|| default_kind.to_owned());
        // Client tools may omit `type` or say "custom"; server tools keep theirs.
        let kind = match (default_kind, object.get("type")) {
            ("tool", None) => "tool".to_owned(),
            ("tool", Some(_)) if kind == "custom" => "tool".to_owned(),
            _ => kind,
        };
        let marker = object.get("cache_control");
        let bytes = match marker {
            None => self.slice(raw),
            Some(_) => {
                let mut out = Vec::with_capacity(raw.get().len());
                out.push(b'{');
                let mut first = true;
                for (k, v) in &object.entries {
                    if k == "cache_control" {
                        continue;
                    }
                    if !first {
                        out.push(b',');
                    }
                    first = false;
                    // Keys are re-quoted; their bytes are the client's unless it escaped them.
                    out.extend_from_slice(
                        serde_json::to_string(k.as_ref())
                            .unwrap_or_default()
                            .as_bytes(),
                    );
                    out.push(b':');
                    out.extend_from_slice(v.get().as_bytes());
                }
                out.push(b'}');
                Bytes::from(out)
            }
        };
        let breakpoint = marker
            .filter(|m| m.get().starts_with('{'))
            .map(|m| Breakpoint {
                ttl: Ttl::of(m),
                automatic: false,
            });
        let text = (kind == "text").then(|| object.get("text")).flatten();
        let ignored = text.is_some() && self.is_ignored(path.region, text);
        // The rendered part of text and tool results is their content, not the JSON around it.
        let counted = match kind.as_str() {
            "text" => text.map(|t| t.get().as_bytes()),
            "tool_result" => object.get("content").map(|c| c.get().as_bytes()),
            _ => None,
        }
        .unwrap_or(&bytes);
        let measured = self.measure(&path, &bytes, counted);
        let cacheable = match kind.as_str() {
            "thinking" | "redacted_thinking" => false,
            "text" => text.is_some_and(|t| t.get().len() > 2),
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
        (sha256(bytes), tokens)
    }

    /// The body's own bytes for `raw`, without a copy.
    fn slice(&self, raw: &RawValue) -> Bytes {
        let text = raw.get().as_bytes();
        let start = (text.as_ptr() as usize).wrapping_sub(self.body.as_ptr() as usize);
        if start <= self.body.len() && start + text.len() <= self.body.len() {
            self.body.slice(start..start + text.len())
        } else {
            // Not borrowed from the body (a key with escapes made serde copy): keep a copy.
            Bytes::copy_from_slice(text)
        }
    }

    fn is_ignored(&self, region: Region, text: Option<&RawValue>) -> bool {
        let Some(text) = text else { return false };
        let rules: Vec<&IgnoreRule> = self.ignore.iter().filter(|r| r.region == region).collect();
        if rules.is_empty() {
            return false;
        }
        let Ok(decoded) = serde_json::from_str::<std::borrow::Cow<'_, str>>(text.get()) else {
            return false;
        };
        rules.iter().any(|r| r.text.is_match(&decoded))
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
        let mut chain = Context::new(&SHA256);
        chain.update(&self.prefix);
        chain.update(&self.pending);
        self.pending.clear();
        chain.update(if ignored { IGNORED } else { &hash });
        self.prefix = digest(chain);
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

    fn finish(mut self, view: &RequestView<'_>) -> Segments {
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
                let mut chain = Context::new(&SHA256);
                if let Some(p) = prev {
                    chain.update(&p);
                }
                chain.update(b"\0images:true");
                chain.update(&u.prefix);
                u.prefix = digest(chain);
                prev = Some(u.prefix);
            }
        }
        // Top-level automatic caching puts a breakpoint on the last cacheable block (§B.2).
        if self.format == Format::AnthropicMessages
            && let Some(auto) = view
                .top
                .get("cache_control")
                .filter(|v| v.get().starts_with('{'))
            && let Some(last) = self.units.iter_mut().rev().find(|u| u.cacheable)
            && last.breakpoint.is_none()
        {
            last.breakpoint = Some(Breakpoint {
                ttl: Ttl::of(auto),
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
            format: self.format,
            units: self.units,
            settings: self.settings,
            breakpoints,
            tools_hash: digest(self.tools),
        }
    }
}

/// Block types whose consecutive runs count as one lookback position.
fn run_kind(kind: &str) -> bool {
    kind == "tool_use" || kind == "tool_result"
}

fn digest(ctx: Context) -> Hash {
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> Hash {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&SHA256, bytes).as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(body: &str) -> Segments {
        segment(
            &Bytes::copy_from_slice(body.as_bytes()),
            Format::AnthropicMessages,
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
        // CLIENTS.md §5: turn 1's units are all unchanged in turn 2, in cache order.
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
                &Bytes::copy_from_slice(body.as_bytes()),
                Format::AnthropicMessages,
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
            &Bytes::from_static(chat.as_bytes()),
            Format::OpenAiChat,
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
            &Bytes::from_static(resp.as_bytes()),
            Format::OpenAiResponses,
            &[],
        )
        .unwrap();
        assert_eq!(paths(&s), ["instructions", "input[0]"]);
        assert!(segment(&Bytes::from_static(b"[1]"), Format::OpenAiChat, &[]).is_err());
    }

    #[test]
    fn an_earlier_turn_lends_its_hashes() {
        let a = cut(TURN1);
        let body = Bytes::copy_from_slice(TURN2.as_bytes());
        let view = RequestView::parse(&body).unwrap();
        let ignore = [IgnoreRule::billing_header()];
        let fresh = segment_view(&body, &view, Format::AnthropicMessages, &ignore, None).unwrap();
        let lent =
            segment_view(&body, &view, Format::AnthropicMessages, &ignore, Some(&a)).unwrap();
        for (x, y) in fresh.units.iter().zip(&lent.units) {
            assert_eq!((x.hash, x.prefix, x.tokens), (y.hash, y.prefix, y.tokens));
        }
    }

    #[test]
    fn unchanged_blocks_share_the_body_bytes() {
        let body = Bytes::copy_from_slice(TURN2.as_bytes());
        let s = segment(&body, Format::AnthropicMessages, &[]).unwrap();
        let tool = &s.units[0].bytes;
        let offset = tool.as_ptr() as usize - body.as_ptr() as usize;
        assert_eq!(&body[offset..offset + tool.len()], &tool[..]);
        assert!(s.units.iter().all(|u| u.tokens >= estimate::BLOCK_OVERHEAD));
    }
}

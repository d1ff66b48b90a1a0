//! Naming each cache unit of a prompt: the walk over the units, reading their
//! fields through the prompt's own tape (no second structure pass), and the split
//! of a text that holds several sections.

use std::borrow::Cow;

use super::{Agent, Family, Part};
use crate::cache::segment::{Segments, Unit};
use crate::prompt::{Prompt, Region, Value};
use crate::provider::json;

/// A prompt's agent and its parts, in prompt (cache) order.
#[derive(Debug, Clone)]
pub(crate) struct Named {
    pub agent: Agent,
    pub parts: Vec<Part>,
}

/// The parts of `prompt`, whose cache units are `segs`, in prompt order.
pub(crate) fn anatomy(prompt: &Prompt, segs: &Segments) -> Named {
    // The cut's units are the prompt's, one for one and in order (segment pushes
    // each); their fields are read through the prompt's tape (~35 % of naming a
    // 200 KB prompt was a tape of each unit).
    let units = || segs.units.iter().zip(prompt.units());
    let mut walk = Walk {
        prompt,
        agent: Agent::Unknown,
        agent_known: false,
        roles: prompt
            .messages()
            .iter()
            .map(|m| {
                prompt
                    .value(m.tok)
                    .and_then(|v| v.get("role"))
                    .and_then(|r| r.str())
                    .map(Cow::into_owned)
                    .unwrap_or_default()
            })
            .collect(),
        calls: chat_calls(prompt),
        parts: Vec::with_capacity(segs.units.len()),
        origin: 0,
        appended: false,
    };
    // The agent first: tools come before the system text that names it.
    for (unit, own) in units() {
        if walk.agent_known {
            break;
        }
        let value = prompt.value(own.tok);
        if walk.is_system(unit, value) {
            for t in texts_of(value) {
                walk.recognise(&t.opening());
            }
        }
    }
    for (unit, own) in units() {
        // String content is normalised as `{"type":"text","text":` and the string.
        let wrapper = if own.path.string { 22 } else { 0 };
        walk.origin = own.span.start as isize - wrapper;
        walk.unit(unit, prompt.value(own.tok));
    }
    Named {
        agent: walk.agent,
        parts: walk.parts,
    }
}

/// Chat Completions' tool calls (inside assistant messages, not units): id → name.
fn chat_calls(prompt: &Prompt) -> Vec<(String, String)> {
    let mut calls = Vec::new();
    for m in prompt.messages() {
        let Some(list) = prompt.value(m.tok).and_then(|v| v.get("tool_calls")) else {
            continue;
        };
        for call in list.items() {
            let id = call.get("id").and_then(|v| v.str());
            let name = call
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(|v| v.str());
            if let (Some(id), Some(name)) = (id, name) {
                calls.push((id.into_owned(), name.into_owned()));
            }
        }
    }
    calls
}

/// A section of a unit's text, before its tokens are shared out.
struct Piece {
    family: Family,
    name: String,
    /// Where it starts in the unit's normalised bytes.
    at: usize,
    size: usize,
}

struct Walk<'p> {
    prompt: &'p Prompt,
    agent: Agent,
    /// The agent is decided by the first system text; later ones do not change it.
    agent_known: bool,
    roles: Vec<String>,
    /// Tool calls seen so far (id → tool name): a result names its tool by the id.
    calls: Vec<(String, String)>,
    parts: Vec<Part>,
    /// Where the current unit's normalised bytes begin in the body.
    origin: isize,
    /// Claude Code's identity block said a prompt was appended to its main one.
    appended: bool,
}

impl Walk<'_> {
    /// Where text `t` starts in the current unit's normalised bytes.
    fn at(&self, t: &Text<'_>) -> usize {
        usize::try_from(t.0.span().start as isize + 1 - self.origin).unwrap_or(0)
    }

    /// Whether `unit` is system text: a system block, instructions, or a system or
    /// developer message.
    fn is_system(&self, unit: &Unit, value: Option<Value<'_>>) -> bool {
        match unit.path.region {
            Region::System | Region::Instructions => true,
            Region::Tools => false,
            Region::Messages => self
                .roles
                .get(unit.path.index as usize)
                .is_some_and(|r| r == "system" || r == "developer"),
            Region::Input => value
                .and_then(|v| v.get("role"))
                .is_some_and(|r| r.is_str("system") || r.is_str("developer")),
        }
    }

    /// Learns the agent from a system text's opening: the first that names one
    /// decides (a billing header's version kept when the next block says more).
    fn recognise(&mut self, text: &str) {
        let Some(agent) = Agent::from_opening(text) else {
            return;
        };
        let billing = text.starts_with("x-anthropic-billing-header:");
        // Claude Code's identity block says so when a prompt was appended.
        if text.contains("running within the Claude Agent SDK") {
            self.appended = true;
        }
        // Claude Code's identity block after its billing header keeps the version.
        let keep = matches!(
            (&self.agent, &agent),
            (
                Agent::ClaudeCode { version: Some(_) },
                Agent::ClaudeCode { .. }
            )
        );
        if !keep {
            self.agent = agent;
        }
        // A billing header alone says Claude Code; the blocks after it may say more.
        self.agent_known = !billing;
    }

    fn unit(&mut self, unit: &Unit, value: Option<Value<'_>>) {
        let field = |k: &str| {
            value
                .and_then(|v| v.get(k))
                .and_then(|v| v.str())
                .map(Cow::into_owned)
        };
        match unit.path.region {
            Region::Tools => {
                // Hosted tools (Codex's `web_search`) have a type and no name.
                let name = field("name")
                    .or_else(|| {
                        value
                            .and_then(|v| v.get("function"))
                            .and_then(|f| f.get("name"))
                            .and_then(|v| v.str())
                            .map(Cow::into_owned)
                    })
                    .or_else(|| field("type"))
                    .unwrap_or_default();
                let deferred = value
                    .and_then(|v| v.get("defer_loading"))
                    .is_some_and(|v| v.bytes() == b"true");
                let name = self.agent.tool(&name, deferred);
                self.whole(unit, Family::Tools, name);
            }
            Region::System | Region::Instructions => {
                let texts = texts_of(value);
                self.system(unit, &texts, false);
            }
            Region::Messages | Region::Input => {
                let role = match unit.path.region {
                    Region::Input => field("role").unwrap_or_default(),
                    _ => self
                        .roles
                        .get(unit.path.index as usize)
                        .cloned()
                        .unwrap_or_default(),
                };
                self.message_unit(unit, value, &role);
            }
        }
    }

    fn message_unit(&mut self, unit: &Unit, value: Option<Value<'_>>, role: &str) {
        let field = |k: &str| {
            value
                .and_then(|v| v.get(k))
                .and_then(|v| v.str())
                .map(Cow::into_owned)
        };
        match &*unit.kind {
            "tool_use" | "function_call" | "custom_tool_call" => {
                let name = field("name").unwrap_or_default();
                // Anthropic's `id`; the Responses API's `call_id`.
                if let Some(id) = field("call_id").or_else(|| field("id")) {
                    self.calls.push((id, name.clone()));
                }
                self.whole(unit, Family::Conversation, format!("tool call {name}"));
            }
            "tool_result" | "function_call_output" | "custom_tool_call_output" => {
                let id = field("tool_use_id")
                    .or_else(|| field("call_id"))
                    .unwrap_or_default();
                let name = self.tool_named(&id);
                self.whole(unit, Family::Conversation, format!("tool result of {name}"));
            }
            "thinking" | "redacted_thinking" | "reasoning" => {
                self.whole(unit, Family::Conversation, "thinking".into());
            }
            "image" | "document" | "input_image" | "input_file" => {
                self.whole(unit, Family::Conversation, (*unit.kind).to_owned());
            }
            _ if role == "tool" => {
                // Chat Completions' tool message: a string (or parts) of one result.
                let id = self
                    .prompt
                    .messages()
                    .get(unit.path.index as usize)
                    .and_then(|m| self.prompt.value(m.tok))
                    .and_then(|m| m.get("tool_call_id"))
                    .and_then(|v| v.str())
                    .map(Cow::into_owned)
                    .unwrap_or_default();
                let name = self.tool_named(&id);
                self.whole(unit, Family::Conversation, format!("tool result of {name}"));
            }
            _ if role == "system" || role == "developer" => {
                let texts = texts_of(value);
                self.system(unit, &texts, true);
            }
            _ if role == "assistant" => {
                self.whole(unit, Family::Conversation, "assistant text".into());
            }
            _ => {
                let texts = texts_of(value);
                self.user(unit, &texts);
            }
        }
    }

    fn tool_named(&self, id: &str) -> String {
        self.calls
            .iter()
            .find(|(i, _)| i == id)
            .map_or_else(|| "a tool".to_owned(), |(_, n)| n.clone())
    }

    /// System text: the agent is known by the first; each text is its lead
    /// (billing header, identity, base prompt, …) and the sections in it.
    fn system(&mut self, unit: &Unit, texts: &[Text<'_>], turn: bool) {
        let mut pieces = Vec::new();
        for t in texts {
            let lead = self.agent.system_lead(&t.opening(), turn);
            let base = lead.1 == "base prompt";
            let at = self.at(t);
            let raw = t.inner();
            match appended_at(raw).filter(|_| base && self.appended) {
                // `--append-system-prompt` adds a paragraph at the end of the main
                // prompt: the last paragraph is taken for it.
                Some(cut) => {
                    sections(&self.agent, &raw[..cut], lead, at, turn, &mut pieces);
                    pieces.push(Piece {
                        family: Family::System,
                        name: "appended prompt".into(),
                        at: at + cut,
                        size: raw.len() - cut,
                    });
                }
                None => sections(&self.agent, raw, lead, at, turn, &mut pieces),
            }
        }
        self.pieces(unit, pieces);
    }

    /// A user's text: a reminder or context wrapper split into its sections, or the
    /// user's own prompt. Decoded only when its opening may be one of those.
    fn user(&mut self, unit: &Unit, texts: &[Text<'_>]) {
        let mut pieces = Vec::new();
        for t in texts {
            let conversation = |name: &str| Piece {
                family: Family::Conversation,
                name: name.to_owned(),
                at: self.at(t),
                size: t.len(),
            };
            if !t.may_open_a_section() {
                pieces.push(conversation("user prompt"));
                continue;
            }
            let opening = t.opening();
            let trimmed = opening.trim_start();
            let lead = if let Some(rest) = trimmed.strip_prefix("<system-reminder>") {
                let first = rest.trim_start().lines().next().unwrap_or_default();
                self.agent.reminder(first)
            } else {
                let first = trimmed.lines().next().unwrap_or_default();
                match self.agent.section(first, true) {
                    Some(section) => section,
                    None => (Family::Conversation, "user prompt".to_owned()),
                }
            };
            if lead.0 == Family::Conversation {
                pieces.push(conversation(&lead.1));
            } else {
                sections(&self.agent, t.inner(), lead, self.at(t), true, &mut pieces);
            }
        }
        self.pieces(unit, pieces);
    }

    fn whole(&mut self, unit: &Unit, family: Family, name: String) {
        self.parts.push(Part {
            family,
            name,
            unit: unit.path.to_string(),
            at: 0,
            bytes: unit.bytes.len(),
            tokens: u64::from(unit.tokens),
        });
    }

    /// A unit's sections as parts, its tokens shared by their bytes (exactly: the
    /// parts of a unit sum to it). Neighbours of one name are one part.
    fn pieces(&mut self, unit: &Unit, pieces: Vec<Piece>) {
        let mut merged: Vec<Piece> = Vec::with_capacity(pieces.len());
        for piece in pieces {
            match merged.last_mut() {
                Some(last) if last.family == piece.family && last.name == piece.name => {
                    last.size += piece.size;
                }
                _ => merged.push(piece),
            }
        }
        if merged.is_empty() {
            merged.push(Piece {
                family: Family::Conversation,
                name: "empty".into(),
                at: 0,
                size: 0,
            });
        }
        let total: u64 = merged.iter().map(|p| p.size as u64).sum();
        let tokens = if total == 0 {
            // Nothing to share by: the first takes all.
            let mut t = vec![0; merged.len()];
            t[0] = u64::from(unit.tokens);
            t
        } else {
            super::apportion(
                merged.iter().map(|p| p.size as u64),
                total,
                u64::from(unit.tokens),
            )
        };
        for (piece, tokens) in merged.into_iter().zip(tokens) {
            self.parts.push(Part {
                family: piece.family,
                name: piece.name,
                unit: unit.path.to_string(),
                at: piece.at,
                bytes: piece.size,
                tokens,
            });
        }
    }
}

/// One JSON string of a unit's text, read lazily.
struct Text<'p>(Value<'p>);

impl Text<'_> {
    fn decoded(&self) -> Cow<'_, str> {
        self.0.str().unwrap_or_default()
    }

    /// Its bytes as sent, less the quotes.
    fn inner(&self) -> &[u8] {
        let raw = self.0.bytes();
        raw.get(1..raw.len().saturating_sub(1)).unwrap_or_default()
    }

    /// Its first few hundred bytes, enough to know an agent by: not the whole text
    /// decoded (a 30 KB system prompt twice was a third of naming a prompt).
    fn opening(&self) -> Cow<'_, str> {
        let inner = self.inner();
        let head = &inner[..inner.len().min(256)];
        if head.contains(&b'\\') {
            return self.decoded();
        }
        match std::str::from_utf8(head) {
            Ok(s) => Cow::Borrowed(s),
            // Cut inside a character: up to it.
            Err(e) => {
                Cow::Borrowed(std::str::from_utf8(&head[..e.valid_up_to()]).unwrap_or_default())
            }
        }
    }

    /// Its length as sent, less the quotes.
    fn len(&self) -> usize {
        self.0.bytes().len().saturating_sub(2)
    }

    /// Whether it may open with a reminder, a context wrapper or a heading: `<` or
    /// `#` after leading white space (raw or escaped), or an escape there. A
    /// user's prompt rarely does, so most are never decoded.
    fn may_open_a_section(&self) -> bool {
        let raw = self.0.bytes();
        let mut rest = raw.get(1..).unwrap_or_default();
        loop {
            match rest {
                [b' ' | b'\t', tail @ ..] => rest = tail,
                [b'\\', b'n' | b't' | b'r', tail @ ..] => rest = tail,
                [b'<' | b'#' | b'\\', ..] => return true,
                _ => return false,
            }
        }
    }
}

/// The texts a unit holds: itself (a string), its `text`, or each text part of its
/// `content` (a Responses message item).
fn texts_of(value: Option<Value<'_>>) -> Vec<Text<'_>> {
    let Some(v) = value else {
        return Vec::new();
    };
    if v.is_string() {
        return vec![Text(v)];
    }
    if let Some(t) = v.get("text").filter(Value::is_string) {
        return vec![Text(t)];
    }
    match v.get("content") {
        Some(c) if c.is_string() => vec![Text(c)],
        Some(c) if c.is_array() => c
            .items()
            .filter_map(|p| p.get("text").filter(Value::is_string))
            .map(Text)
            .collect(),
        _ => Vec::new(),
    }
}

/// A JSON string's bytes as sent (`raw`, less its quotes) cut where the agent's
/// section lines open, the part before the first being `lead`; each with its size
/// in bytes as sent. Read on the escaped bytes: only a line that may open a
/// section is decoded (decoding whole system prompts was most of the naming).
fn sections(
    agent: &Agent,
    raw: &[u8],
    lead: (Family, String),
    base: usize,
    turn: bool,
    out: &mut Vec<Piece>,
) {
    let mut current = lead;
    let (mut at, mut size) = (base, 0usize);
    for line in raw_lines(raw) {
        let next = line
            .first()
            .filter(|b| Agent::SECTION_STARTS.contains(b))
            .and_then(|_| decode_line(line))
            .and_then(|text| agent.section(&text, turn));
        if let Some(next) = next {
            // A reminder's wrapper lines before its first section belong to it.
            let wrapper = at == base && current == (Family::Reminders, "reminder".into());
            if size > 0 && !wrapper {
                out.push(Piece {
                    family: current.0,
                    name: std::mem::take(&mut current.1),
                    at,
                    size,
                });
                at += size;
                size = 0;
            }
            current = next;
        }
        size += line.len();
    }
    out.push(Piece {
        family: current.0,
        name: current.1,
        at,
        size,
    });
}

/// Where the last paragraph of an escaped text begins (after its last blank line).
fn appended_at(raw: &[u8]) -> Option<usize> {
    memchr::memmem::rfind(raw, b"\\n\\n").map(|k| k + 4)
}

/// The lines of an escaped JSON string, each with its `\n` escape.
fn raw_lines(raw: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = raw;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut at = 0;
        while let Some(k) = memchr::memchr(b'\\', &rest[at..]) {
            let escape = at + k;
            // Every escape is at least two bytes; `\\` is one, so it is skipped whole.
            if rest.get(escape + 1) == Some(&b'n') {
                let (line, tail) = rest.split_at(escape + 2);
                rest = tail;
                return Some(line);
            }
            at = escape + 2;
            if at >= rest.len() {
                break;
            }
        }
        Some(std::mem::take(&mut rest))
    })
}

/// One escaped line, decoded (its `\n` dropped).
fn decode_line(line: &[u8]) -> Option<Cow<'_, str>> {
    let line = line.strip_suffix(b"\\n").unwrap_or(line);
    if !line.contains(&b'\\') {
        return std::str::from_utf8(line).ok().map(Cow::Borrowed);
    }
    let mut quoted = Vec::with_capacity(line.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(line);
    quoted.push(b'"');
    json::decode_str(&quoted).map(|s| Cow::Owned(s.into_owned()))
}

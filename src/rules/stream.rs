//! Per-event rules (`on = "provider_stream_event"`): each event of an SSE answer is
//! matched as it arrives. `tag` and `log` observe; `mask` rewrites text in what the
//! client receives; `drop_event` leaves an event out; `block` ends the stream.
//!
//! [`EventRules`] is the whole engine for one exchange and does no IO: the response
//! body feeds it raw events and sends on what it releases, so `rules test
//! --response` and unit tests drive the same code. An event goes out as the bytes
//! that came unless a rule changed it; a changed event is re-serialised compactly,
//! its keys in their order.
//!
//! Masking holds whole events of a content block back while their text ends in a
//! token that may still become or grow a match (see [`scan::Holdback`]), so a secret
//! split across deltas is seen whole before any part of it leaves, however slowly
//! the deltas come. The `text` matcher rescans only a block's tail per event
//! ([`scan::TextScans`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use regex::Regex;
use serde_json::Value;
use tokio::time::Instant;

use super::{Block, Decision, Effects, Info, Phase, RuleSet, State};
use crate::policy::EventPolicy;
pub(crate) use crate::policy::{EventEdit, StreamReport};
use crate::provider::SseDecoder;
use crate::provider::{Api, Provider};

/// A `mask` action, compiled: what it replaces and how much text it may hold.
#[derive(Debug)]
pub(crate) struct Mask {
    pub(crate) regex: Regex,
    pub(crate) with: MaskWith,
    /// The hold's cap ([`scan::Holdback`]): a token longer than twice this goes out
    /// up to this many bytes before its end.
    pub(crate) hold_bytes: usize,
    /// The characters a match can contain.
    pub(crate) class: scan::TokenClass,
}

/// What a mask puts where its regex matches.
#[derive(Debug)]
pub(crate) enum MaskWith {
    /// A fixed text (a `mask` rule's `with`).
    Text(String),
    /// The value each placeholder stands for (the outgoing-secrets scanner's
    /// `mask_and_restore`), by the placeholder.
    Restore(Arc<std::collections::HashMap<String, super::secrets::Original>>),
}

impl Mask {
    /// What replaces `matched`; `json` when it lies in JSON text (a tool call's
    /// input as it streams), where a restored value goes as the request's JSON had it.
    fn replacement<'m>(&'m self, matched: &'m str, json: bool) -> &'m str {
        match &self.with {
            MaskWith::Text(t) => t,
            MaskWith::Restore(values) => match values.get(matched) {
                Some(o) if json => &o.json,
                Some(o) => &o.text,
                None => matched,
            },
        }
    }

    /// The edit's action name in the record.
    fn action(&self) -> &'static str {
        match self.with {
            MaskWith::Text(_) => "mask",
            MaskWith::Restore(_) => "restore",
        }
    }
}

/// One event as per-event matchers read it.
#[derive(Debug)]
pub(crate) struct EventView<'a> {
    /// The SSE event type (`content_block_delta`, `response.output_text.delta`, …);
    /// for OpenAI chat chunks, which have none, `chunk` (and `done` for `[DONE]`).
    pub(crate) name: &'a str,
    /// The event's data, when it is JSON.
    pub(crate) data: Option<&'a Value>,
    /// The content block the event belongs to: its type and tool name.
    pub(crate) block_type: Option<&'a str>,
    pub(crate) tool: Option<&'a str>,
    /// The text of the current block so far, this event's delta included.
    pub(crate) text: &'a str,
    /// Tags set so far: by the request rules and by earlier events.
    pub(crate) tags: &'a [String],
    /// Where the `text` tests stand in this block.
    pub(crate) scans: &'a scan::TextScans,
}

/// What actions decided about the event being matched.
#[derive(Debug, Default)]
pub(crate) struct EventDecision {
    pub(crate) drop: bool,
    /// Mask rules that fired, with the rule's name.
    pub(crate) masks: Vec<(String, Arc<Mask>)>,
}

/// The request and response an answer belongs to, as per-event matchers see them.
#[derive(Debug, Clone)]
pub(crate) struct StreamContext {
    pub provider: Provider,
    pub api: Api,
    pub method: Method,
    pub host: Option<String>,
    pub path: String,
    pub model: Option<String>,
    pub request_headers: HeaderMap,
    pub status: StatusCode,
    pub response_headers: HeaderMap,
    /// Tags the request and response rules set; per-event rules add theirs.
    pub tags: Vec<String>,
}

impl StreamContext {
    /// The context of the answer whose head is `head`.
    pub(crate) fn of(
        facts: &crate::policy::Facts<'_>,
        head: &crate::policy::ResponseHead<'_>,
    ) -> StreamContext {
        StreamContext {
            provider: facts.provider,
            api: facts.api,
            method: facts.method.clone(),
            host: facts.host.map(str::to_owned),
            path: facts.path.to_owned(),
            model: facts.model.map(str::to_owned),
            request_headers: head.request_headers.clone(),
            status: head.status,
            response_headers: head.headers.clone(),
            tags: facts.tags.to_vec(),
        }
    }
}

/// Where the text of a delta sits in its event's data.
#[derive(Debug, Clone, Copy)]
enum Step {
    Key(&'static str),
    Index(usize),
}

/// The block an event opens, extends or closes, by the provider's grammar.
#[derive(Debug, Default)]
struct Grammar {
    opens: Option<(String, String, Option<String>)>,
    /// The text piece and where it sits.
    piece: Option<(String, Vec<Step>)>,
    closes: bool,
    /// A full-text event (OpenAI responses `*.done`, `response.completed`): masks
    /// apply to every `text` and `arguments` string in it.
    full_text: bool,
}

fn key(v: &Value, k: &str) -> Option<String> {
    match v.get(k)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn read_grammar(provider: Provider, api: Api, name: &str, data: Option<&Value>) -> Grammar {
    let mut g = Grammar::default();
    let Some(d) = data else {
        g.closes = name == "done";
        return g;
    };
    match (provider, api) {
        (Provider::Anthropic, _) => match name {
            "content_block_start" => {
                let block = d.get("content_block");
                let kind = block.and_then(|b| key(b, "type")).unwrap_or_default();
                let tool = block.and_then(|b| key(b, "name"));
                g.opens = Some((key(d, "index").unwrap_or_default(), kind, tool));
            }
            "content_block_delta" => {
                let delta = d.get("delta");
                let field = match delta.and_then(|x| key(x, "type")).as_deref() {
                    Some("text_delta") => Some("text"),
                    Some("input_json_delta") => Some("partial_json"),
                    _ => None,
                };
                if let Some(f) = field
                    && let Some(text) = delta.and_then(|x| x.get(f)).and_then(Value::as_str)
                {
                    g.piece = Some((text.to_owned(), vec![Step::Key("delta"), Step::Key(f)]));
                }
            }
            "content_block_stop" | "message_delta" | "message_stop" => g.closes = true,
            _ => {}
        },
        (Provider::OpenAi, Api::Responses) => match name {
            "response.output_item.added" => {
                let item = d.get("item");
                let kind = match item.and_then(|i| key(i, "type")).as_deref() {
                    Some("message") => "text".to_owned(),
                    Some("function_call") => "tool_use".to_owned(),
                    Some(other) => other.to_owned(),
                    None => String::new(),
                };
                let tool = item.and_then(|i| key(i, "name"));
                g.opens = Some((key(d, "output_index").unwrap_or_default(), kind, tool));
            }
            "response.output_text.delta" | "response.function_call_arguments.delta" => {
                if let Some(text) = d.get("delta").and_then(Value::as_str) {
                    g.piece = Some((text.to_owned(), vec![Step::Key("delta")]));
                }
            }
            "response.output_item.done" | "response.completed" => {
                g.closes = true;
                g.full_text = true;
            }
            n if n.ends_with(".done") => g.full_text = true,
            _ => {}
        },
        (Provider::OpenAi, _) => {
            let Some(choice) = d.get("choices").and_then(|c| c.get(0)) else {
                return g;
            };
            let delta = choice.get("delta");
            if let Some(text) = delta.and_then(|x| x.get("content")).and_then(Value::as_str) {
                g.opens = Some(("text".into(), "text".into(), None));
                let path = ["choices", "0", "delta", "content"];
                g.piece = Some((text.to_owned(), steps(&path)));
            } else if let Some(call) = delta
                .and_then(|x| x.get("tool_calls"))
                .and_then(|c| c.get(0))
            {
                let index = key(call, "index").unwrap_or_default();
                let tool = call.get("function").and_then(|f| key(f, "name"));
                g.opens = Some((format!("tool:{index}"), "tool_use".into(), tool));
                if let Some(args) = call
                    .get("function")
                    .and_then(|f| f.get("arguments"))
                    .and_then(Value::as_str)
                {
                    let path = [
                        "choices",
                        "0",
                        "delta",
                        "tool_calls",
                        "0",
                        "function",
                        "arguments",
                    ];
                    g.piece = Some((args.to_owned(), steps(&path)));
                }
            }
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
                g.closes = true;
            }
        }
    }
    g
}

/// The text a streamed event adds (a text delta, or a tool call's arguments), by
/// the same grammar the per-event rules read; for the live viewer.
pub(crate) fn delta_text(provider: Provider, api: Api, raw: &[u8]) -> Option<String> {
    let mut parsed: Option<(String, String)> = None;
    SseDecoder::default().feed(raw, &mut |name, data| {
        parsed = Some((name.to_owned(), data.to_owned()));
    });
    let (name, data) = parsed?;
    let data: Value = serde_json::from_str(&data).ok()?;
    let name = if name.is_empty() {
        "chunk".to_owned()
    } else {
        name
    };
    read_grammar(provider, api, &name, Some(&data))
        .piece
        .map(|(text, _)| text)
}

fn steps(path: &[&'static str]) -> Vec<Step> {
    path.iter()
        .map(|p| match p.parse() {
            Ok(i) => Step::Index(i),
            Err(_) => Step::Key(p),
        })
        .collect()
}

/// An event waiting behind a masked block's window.
#[derive(Debug)]
struct Held {
    raw: Bytes,
    index: u32,
    name: String,
    /// A delta of the masked block: its data and where its text lies in the block's.
    piece: Option<HeldPiece>,
}

#[derive(Debug)]
struct HeldPiece {
    data: Value,
    path: Vec<Step>,
    start: usize,
    end: usize,
}

/// The content block being streamed.
#[derive(Debug, Default)]
struct CurrentBlock {
    key: String,
    kind: Option<String>,
    tool: Option<String>,
    text: String,
    /// Mask rules that fired on this block's events.
    masks: Vec<(String, Arc<Mask>)>,
    /// How far the block's text may go under its masks; set when the first fires.
    hold: Option<scan::Holdback>,
    scans: scan::TextScans,
}

/// Per-event rules for one streamed answer. See the module docs.
pub(crate) struct EventRules {
    set: Arc<RuleSet>,
    cx: StreamContext,
    decoder: SseDecoder,
    block: CurrentBlock,
    held: VecDeque<Held>,
    /// Mask rules of the whole stream, for full-text events.
    seen_masks: Vec<(String, Arc<Mask>)>,
    events: u32,
    stopped: bool,
    report: Arc<Mutex<StreamReport>>,
    /// Masks that apply to every block from its first text, named (a policy's own,
    /// not a rule's).
    standing: Vec<(String, Arc<Mask>)>,
}

impl EventRules {
    /// The engine for one answer, or `None` when no per-event rule is loaded.
    pub(crate) fn new(set: Arc<RuleSet>, cx: StreamContext) -> Option<EventRules> {
        if !set.has_rules(Phase::ProviderStreamEvent) {
            return None;
        }
        Some(EventRules {
            set,
            cx,
            decoder: SseDecoder::default(),
            block: CurrentBlock::default(),
            held: VecDeque::new(),
            seen_masks: Vec::new(),
            events: 0,
            stopped: false,
            report: Arc::default(),
            standing: Vec::new(),
        })
    }

    /// An engine that applies `mask` (named `name`) to the text of every block and
    /// runs no rule: the outgoing-secrets scanner's restore.
    pub(crate) fn restoring(cx: StreamContext, name: &str, mask: Arc<Mask>) -> EventRules {
        let standing = vec![(name.to_owned(), mask)];
        EventRules {
            set: Arc::default(),
            cx,
            decoder: SseDecoder::default(),
            block: CurrentBlock::default(),
            held: VecDeque::new(),
            seen_masks: standing.clone(),
            events: 0,
            stopped: false,
            report: Arc::default(),
            standing,
        }
    }

    /// Whether rules may change or withhold events: then each event must be whole
    /// before any of it goes out. Observing rules (`tag`, `log`) let bytes through.
    pub(crate) fn may_change(&self) -> bool {
        !self.standing.is_empty()
            || self.set.active(Phase::ProviderStreamEvent).any(|r| {
                r.enforce
                    || r.actions
                        .iter()
                        .any(|a| matches!(a.key, "mask" | "drop_event" | "block"))
            })
    }

    /// What the rules did, shared: it fills as events pass.
    pub(crate) fn report(&self) -> Arc<Mutex<StreamReport>> {
        self.report.clone()
    }

    fn report_mut(&self) -> std::sync::MutexGuard<'_, StreamReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts or widens the current block's hold-back for the masks that apply to
    /// it (`piece_start`: where this event's piece begins in the block's text), and
    /// feeds it the text so far.
    fn hold_for(&mut self, masks: &[(String, Arc<Mask>)], piece_start: Option<usize>) {
        for m in masks {
            if !self.block.masks.iter().any(|(r, _)| r == &m.0) {
                self.block.masks.push(m.clone());
                let b = &mut self.block;
                match &mut b.hold {
                    Some(h) => h.widen(&m.1.class, m.1.hold_bytes, &b.text),
                    None => {
                        // This event's piece is held; what came before has gone.
                        let at = piece_start.unwrap_or(b.text.len());
                        let h = scan::Holdback::new(m.1.class.clone(), m.1.hold_bytes, at);
                        b.hold = Some(h);
                    }
                }
            }
            if !self.seen_masks.iter().any(|(r, _)| r == &m.0) {
                self.seen_masks.push(m.clone());
            }
        }
        if let Some(h) = &mut self.block.hold {
            h.push(&self.block.text);
        }
    }

    /// Takes one raw event (as [`crate::observer::EventSplitter`] cut it); what may go
    /// out now is appended to `out`. `Some(block)`: a rule ended the stream; what was
    /// held is released first, and nothing more is taken.
    pub(crate) fn push(
        &mut self,
        raw: Bytes,
        _now: Instant,
        out: &mut Vec<Bytes>,
    ) -> Option<Block> {
        if self.stopped {
            return None;
        }
        let mut parsed: Option<(String, String)> = None;
        self.decoder.feed(&raw, &mut |name, data| {
            parsed = Some((name.to_owned(), data.to_owned()));
        });
        let Some((name, data_text)) = parsed else {
            // Blank lines or comments only: nothing to match.
            self.queue(raw, String::new(), None, out);
            return None;
        };
        let index = self.events;
        self.events += 1;
        let data: Option<Value> = (data_text.starts_with('{') || data_text.starts_with('['))
            .then(|| serde_json::from_str(&data_text).ok())
            .flatten();
        let name = match (name.is_empty(), data_text.as_str()) {
            (false, _) => name,
            (true, "[DONE]") => "done".to_owned(),
            (true, _) => "chunk".to_owned(),
        };
        let g = read_grammar(self.cx.provider, self.cx.api, &name, data.as_ref());
        if let Some((key, kind, tool)) = g.opens
            && key != self.block.key
        {
            self.end_block(out);
            self.block = CurrentBlock {
                key,
                kind: Some(kind),
                tool,
                ..CurrentBlock::default()
            };
        }
        let piece_at = g.piece.as_ref().map(|(text, _)| {
            let start = self.block.text.len();
            self.block.text.push_str(text);
            (start, self.block.text.len())
        });
        let (verdict, mut decision, effects) = self.run(&name, data.as_ref());
        if piece_at.is_some() {
            decision.masks.extend(self.standing.iter().cloned());
        }
        self.note(&effects);
        self.hold_for(&decision.masks, piece_at.map(|(start, _)| start));
        if let Decision::Respond(block) = verdict {
            self.stopped = true;
            self.end_block(out);
            let mut report = self.report_mut();
            report.edits.push(EventEdit {
                index,
                event: name,
                rule: block.rule.clone(),
                action: "block".into(),
                sent: None,
            });
            report.blocked = Some(block.clone());
            return Some(block);
        }
        if decision.drop {
            let rule = effects.fired.last().cloned().unwrap_or_default();
            self.report_mut().edits.push(EventEdit {
                index,
                event: name,
                rule,
                action: "drop_event".into(),
                sent: None,
            });
            return None;
        }
        let (raw, data) = if g.full_text && !self.seen_masks.is_empty() {
            (self.mask_full_text(raw, index, &name, data), None)
        } else {
            (raw, data)
        };
        let piece = match (g.piece, piece_at, self.block.masks.is_empty()) {
            (Some((_, path)), Some((start, end)), false) => data.map(|data| HeldPiece {
                data,
                path,
                start,
                end,
            }),
            _ => None,
        };
        self.queue(raw, name, piece, out);
        if g.closes {
            self.end_block(out);
            // Events after a block's end belong to none.
            self.block = CurrentBlock::default();
        }
        None
    }

    /// Releases what may go by now. Held text goes by text, never by time: nothing
    /// is due.
    pub(crate) fn release_due(&mut self, _now: Instant, out: &mut Vec<Bytes>) {
        self.release(false, out);
    }

    /// When a held event must go out at the latest: never by the clock (a token
    /// that may be a key waits for its end, the block's, or the byte cap).
    pub(crate) fn next_release(&self) -> Option<Instant> {
        None
    }

    /// The stream ended: everything held goes out.
    pub(crate) fn finish(&mut self, out: &mut Vec<Bytes>) {
        self.end_block(out);
    }

    fn end_block(&mut self, out: &mut Vec<Bytes>) {
        self.release(true, out);
        self.block.masks.clear();
        self.block.hold = None;
    }

    fn queue(&mut self, raw: Bytes, name: String, piece: Option<HeldPiece>, out: &mut Vec<Bytes>) {
        if self.held.is_empty() && piece.is_none() {
            out.push(raw);
            return;
        }
        self.held.push_back(Held {
            raw,
            index: self.events.saturating_sub(1),
            name,
            piece,
        });
        self.release(false, out);
    }

    /// Sends held events from the front whose text the hold lets go (all of them
    /// when `all`: the block ended), masked.
    fn release(&mut self, all: bool, out: &mut Vec<Bytes>) {
        let b = &mut self.block;
        if all && let Some(h) = &mut b.hold {
            h.close();
        }
        let limit = b.hold.as_ref().map_or(usize::MAX, scan::Holdback::limit);
        // The events that may go, and how far their text reaches.
        let (mut n, mut to) = (0, None);
        for held in &self.held {
            match &held.piece {
                Some(p) if p.end > limit => break,
                Some(p) => to = Some(p.end),
                None => {}
            }
            n += 1;
        }
        let hits = match (to, &mut b.hold) {
            (Some(to), Some(h)) => {
                let regexes: Vec<&Regex> = b.masks.iter().map(|(_, m)| &m.regex).collect();
                h.take(&b.text, to, &regexes)
            }
            _ => Vec::new(),
        };
        for _ in 0..n {
            let Some(held) = self.held.pop_front() else {
                return;
            };
            let bytes = match held.piece {
                Some(piece) => self.masked(held.raw, held.index, &held.name, piece, &hits),
                None => held.raw,
            };
            out.push(bytes);
        }
    }

    /// The event with the `hits` in its piece replaced, or its bytes as they came.
    fn masked(
        &self,
        raw: Bytes,
        index: u32,
        name: &str,
        mut piece: HeldPiece,
        hits: &[scan::Hit],
    ) -> Bytes {
        let text = &self.block.text;
        let mut new = String::new();
        let mut at = piece.start;
        let mut rules: Vec<(&str, &'static str)> = Vec::new();
        for hit in hits
            .iter()
            .filter(|h| h.end > piece.start && h.start < piece.end)
        {
            let Some((rule, mask)) = self.block.masks.get(hit.mask) else {
                continue;
            };
            new.push_str(&text[at..hit.start.max(at)]);
            // The marker goes where the match starts; its other parts go.
            if hit.marker && hit.start >= piece.start {
                let json = self.block.kind.as_deref() == Some("tool_use");
                let matched = text.get(hit.start..hit.match_end).unwrap_or_default();
                new.push_str(mask.replacement(matched, json));
            }
            at = hit.end.min(piece.end);
            if !rules.contains(&(rule.as_str(), mask.action())) {
                rules.push((rule, mask.action()));
            }
        }
        if rules.is_empty() {
            return raw;
        }
        new.push_str(&text[at..piece.end]);
        set_at(&mut piece.data, &piece.path, Value::String(new));
        self.masked_event(index, name, &piece.data, &rules)
    }

    /// A masked event's bytes, with an edit per rule (and its action) that masked it.
    fn masked_event(
        &self,
        index: u32,
        name: &str,
        data: &Value,
        rules: &[(&str, &'static str)],
    ) -> Bytes {
        let data = data.to_string();
        let mut report = self.report_mut();
        for (rule, action) in rules {
            report.edits.push(EventEdit {
                index,
                event: name.to_owned(),
                rule: (*rule).to_owned(),
                action: (*action).into(),
                // A restored event carries the value the provider never saw: not kept.
                sent: (*action == "mask").then(|| data.clone()),
            });
        }
        event_bytes(name, &data)
    }

    /// A full-text event with every mask of the stream applied to its texts.
    fn mask_full_text(&self, raw: Bytes, index: u32, name: &str, data: Option<Value>) -> Bytes {
        let Some(mut data) = data else {
            return raw;
        };
        let mut rules: Vec<(&str, &'static str)> = Vec::new();
        mask_strings(&mut data, &self.seen_masks, &mut rules, None);
        if rules.is_empty() {
            return raw;
        }
        self.masked_event(index, name, &data, &rules)
    }

    /// Runs the phase's rules on one event.
    fn run(&mut self, name: &str, data: Option<&Value>) -> (Decision, EventDecision, Effects) {
        let mut effects = Effects::default();
        let mut decision = EventDecision::default();
        let (cx, block) = (&mut self.cx, &self.block);
        let view = EventView {
            name,
            data,
            block_type: block.kind.as_deref(),
            tool: block.tool.as_deref(),
            text: &block.text,
            tags: &cx.tags,
            scans: &block.scans,
        };
        let mut st = State {
            info: Info {
                provider: cx.provider,
                api: cx.api,
                method: &cx.method,
                host: cx.host.as_deref(),
                path: &cx.path,
                conversation: None,
            },
            // Lent for the run and put back: no copy per event.
            model: cx.model.take(),
            // No action of this phase sets headers (the loader refuses them).
            headers: &mut cx.response_headers,
            request_headers: Some(&cx.request_headers),
            status: Some(cx.status),
            body: None,
            effects: &mut effects,
            rule: String::new(),
            secrets: &self.set.secret_headers,
            event: Some(&view),
            decision: Some(&mut decision),
        };
        let verdict = self.set.run(Phase::ProviderStreamEvent, &mut st);
        let model = st.model.take();
        cx.model = model;
        (verdict, decision, effects)
    }

    fn note(&mut self, effects: &Effects) {
        if effects.fired.is_empty() {
            return;
        }
        for t in &effects.tags {
            if !self.cx.tags.contains(t) {
                self.cx.tags.push(t.clone());
            }
        }
        let mut report = self.report_mut();
        for f in &effects.fired {
            if !report.fired.contains(f) {
                report.fired.push(f.clone());
            }
        }
        for t in &effects.tags {
            if !report.tags.contains(t) {
                report.tags.push(t.clone());
            }
        }
        // A log line per rule, not per event: a rule firing on every delta says it once.
        for (rule, line) in &effects.logs {
            if !report.logs.iter().any(|(r, l)| r == rule && l == line) {
                report.logs.push((rule.clone(), line.clone()));
            }
        }
    }
}

/// Applies masks to every `text` and `arguments` string in `v` (`key`: the key of
/// `v` in its object; `arguments` is JSON text).
fn mask_strings<'m>(
    v: &mut Value,
    masks: &'m [(String, Arc<Mask>)],
    rules: &mut Vec<(&'m str, &'static str)>,
    key: Option<&str>,
) {
    match v {
        Value::String(s) if matches!(key, Some("text" | "arguments")) => {
            let json = key == Some("arguments");
            for (rule, m) in masks {
                if m.regex.is_match(s) {
                    *s = m
                        .regex
                        .replace_all(s, |c: &regex::Captures<'_>| {
                            m.replacement(&c[0], json).to_owned()
                        })
                        .into_owned();
                    if !rules.contains(&(rule.as_str(), m.action())) {
                        rules.push((rule, m.action()));
                    }
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                mask_strings(item, masks, rules, None);
            }
        }
        Value::Object(map) => {
            for (k, item) in map.iter_mut() {
                mask_strings(item, masks, rules, Some(k.as_str()));
            }
        }
        _ => {}
    }
}

fn set_at(v: &mut Value, path: &[Step], new: Value) {
    let mut at = v;
    for step in path {
        let next = match step {
            Step::Key(k) => at.get_mut(*k),
            Step::Index(i) => at.get_mut(*i),
        };
        match next {
            Some(n) => at = n,
            None => return,
        }
    }
    *at = new;
}

/// An event as promptgate writes one it changed.
fn event_bytes(name: &str, data: &str) -> Bytes {
    let text = match name {
        // OpenAI chat chunks carry no event type.
        "chunk" | "done" => format!("data: {data}\n\n"),
        _ => format!("event: {name}\ndata: {data}\n\n"),
    };
    Bytes::from(text)
}

impl EventPolicy for EventRules {
    fn may_change(&self) -> bool {
        EventRules::may_change(self)
    }

    fn push(&mut self, raw: Bytes, now: Instant, out: &mut Vec<Bytes>) -> Option<Block> {
        EventRules::push(self, raw, now, out)
    }

    fn release_due(&mut self, now: Instant, out: &mut Vec<Bytes>) {
        EventRules::release_due(self, now, out);
    }

    fn next_release(&self) -> Option<Instant> {
        EventRules::next_release(self)
    }

    fn finish(&mut self, out: &mut Vec<Bytes>) {
        EventRules::finish(self, out);
    }
}

pub(crate) mod scan;

#[cfg(test)]
mod tests;

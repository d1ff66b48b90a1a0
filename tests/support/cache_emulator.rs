//! A prompt cache that follows Anthropic's documented prompt-caching rules, for the
//! fake provider to answer with the usage it computes.
//!
//! Written apart from promptgate's own analysis (on `serde_json::Value`, with its own
//! token count) so the two can disagree: prefix order tools → system → messages;
//! writes only at breakpoints (explicit, or top-level automatic on the last cacheable
//! block); reads walk back at most 20 positions from each breakpoint (a run of
//! tool_use or tool_result blocks is one position); an entry lives for its ttl from
//! the start of the last request that wrote or read it and is readable only once the
//! writer's response began; nothing is cached under the model's minimum length.
//! The `x-anthropic-billing-header` system block is left out, as Anthropic evidently does.

#![allow(dead_code)]

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Usage numbers the emulator answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheUsage {
    pub input: u64,
    pub write: u64,
    pub read: u64,
}

struct Entry {
    available_at: u64,
    expires_at: u64,
}

#[derive(Clone)]
struct Unit {
    prefix: u64,
    /// The unit alone, without what came before it.
    content: u64,
    region: &'static str,
    tokens: u64,
    position: u32,
    breakpoint: Option<u64>, // ttl in ms
}

/// A request body as the emulator reads it: its model and its units in prefix order.
#[derive(Clone)]
pub struct Read {
    model: String,
    units: Vec<Unit>,
    /// It carries `diagnostics` (Anthropic's cache diagnosis beta).
    diagnosis_asked: bool,
}

impl Read {
    /// Reads a JSON request body; panics on one that is not JSON.
    pub fn of(body: &[u8]) -> Read {
        let request: Value = serde_json::from_slice(body).expect("a JSON request");
        Read {
            model: request["model"].as_str().unwrap_or("").to_owned(),
            units: units(&request),
            diagnosis_asked: request.get("diagnostics").is_some_and(Value::is_object),
        }
    }
}

/// The emulated cache. Time is milliseconds since it was made, plus what the test
/// added with [`CacheEmulator::advance`].
pub struct CacheEmulator {
    start: Instant,
    offset_ms: u64,
    entries: HashMap<u64, Entry>,
    /// Time from a request's arrival to its response beginning.
    pub response_delay: Duration,
    pub min_tokens: HashMap<String, u64>,
    /// Every request's answer, in arrival order.
    pub log: Vec<CacheUsage>,
    /// The last request, which the next one's diagnosis compares with.
    last: Option<(Read, CacheUsage)>,
    /// The last answer's `diagnostics.cache_miss_reason` (when it asked for one and
    /// missed): `(type, cache_missed_input_tokens)`.
    pub diagnosis: Option<(String, u64)>,
    /// A reason the next diagnosis gives whatever the requests say (a change on the
    /// provider's side).
    pub claim: Option<String>,
}

impl CacheEmulator {
    pub fn new() -> CacheEmulator {
        let min_tokens = [("claude-opus-5-5", 512), ("claude-sonnet-5-5", 1024)]
            .into_iter()
            .map(|(m, n)| (m.to_owned(), n))
            .collect();
        CacheEmulator {
            start: Instant::now(),
            offset_ms: 0,
            entries: HashMap::new(),
            response_delay: Duration::ZERO,
            min_tokens,
            log: Vec::new(),
            last: None,
            diagnosis: None,
            claim: None,
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64 + self.offset_ms
    }

    /// Moves the emulator's clock forward.
    pub fn advance(&mut self, by: Duration) {
        self.offset_ms += by.as_millis() as u64;
    }

    /// Drops every entry (server-side eviction the rules cannot know about).
    pub fn evict_all(&mut self) {
        self.entries.clear();
    }

    /// Answers one request body.
    pub fn respond(&mut self, body: &[u8]) -> CacheUsage {
        self.respond_read(&Read::of(body))
    }

    /// Answers one request read beforehand (without the emulator's lock).
    pub fn respond_read(&mut self, read: &Read) -> CacheUsage {
        let request = read;
        let now = self.now();
        let min = self.min_tokens.get(&read.model).copied().unwrap_or(1024);
        let units = &read.units;
        let total: u64 = units.iter().map(|u| u.tokens).sum();
        let through = |i: usize| units[..=i].iter().map(|u| u.tokens).sum::<u64>();
        let breakpoints: Vec<usize> = (0..units.len())
            .filter(|&i| units[i].breakpoint.is_some())
            .collect();
        // Reads: from each breakpoint, back through at most 20 positions.
        let mut hit: Option<usize> = None;
        for &b in &breakpoints {
            let floor = units[b].position.saturating_sub(19);
            for i in (0..=b).rev() {
                if units[i].position < floor {
                    break;
                }
                let alive = self
                    .entries
                    .get(&units[i].prefix)
                    .is_some_and(|e| e.available_at <= now && now < e.expires_at);
                if alive {
                    hit = hit.max(Some(i));
                    break;
                }
            }
        }
        let read = hit.map_or(0, through);
        // Writes (or refreshes) at every breakpoint that reaches the minimum.
        let mut write = 0;
        for &b in &breakpoints {
            let tokens = through(b);
            if tokens < min {
                continue;
            }
            let ttl = units[b].breakpoint.unwrap_or(300_000);
            let prefix = units[b].prefix;
            let alive = self
                .entries
                .get(&prefix)
                .is_some_and(|e| e.available_at <= now && now < e.expires_at);
            let available_at = if alive {
                now
            } else {
                now + self.response_delay.as_millis() as u64
            };
            self.entries.insert(
                prefix,
                Entry {
                    available_at,
                    expires_at: now + ttl,
                },
            );
            if hit.is_none_or(|h| b > h) {
                write = tokens - read;
            }
        }
        if let Some(h) = hit
            && let Some(e) = self.entries.get_mut(&units[h].prefix)
        {
            e.expires_at = e.expires_at.max(now + 300_000);
        }
        let usage = CacheUsage {
            input: total - read - write,
            write,
            read,
        };
        self.log.push(usage);
        self.diagnosis = if request.diagnosis_asked {
            self.diagnose(request, read)
        } else {
            None
        };
        self.last = Some((request.clone(), usage));
        usage
    }
}

impl CacheEmulator {
    /// Why `request`, which read `read` tokens, missed what the last request had
    /// cached: the first part that differs (model, tools, system, messages), as
    /// Anthropic's diagnosis names it; `None` when it read all of it.
    fn diagnose(&mut self, request: &Read, read: u64) -> Option<(String, u64)> {
        let (last, used) = self.last.as_ref()?;
        let cached = used.read + used.write;
        if let Some(claim) = self.claim.take() {
            return Some((claim, cached.saturating_sub(read)));
        }
        if read >= cached {
            return None;
        }
        let missed = cached - read;
        if last.model != request.model {
            return Some(("model_changed".into(), missed));
        }
        let region = last
            .units
            .iter()
            .zip(&request.units)
            .find(|(a, b)| a.content != b.content)
            .map_or("messages", |(a, _)| a.region);
        Some((format!("{region}_changed"), missed))
    }
}

/// The emulator's own token count: about four characters a token, plus framing.
fn count(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4) + 2
}

fn hash_of(parts: &[&str]) -> u64 {
    let mut h = DefaultHasher::new();
    for p in parts {
        p.hash(&mut h);
    }
    h.finish()
}

/// `v` with every object's keys in sorted order.
fn sorted(v: &Value) -> Value {
    match v {
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sorted(&o[k])))
                    .collect(),
            )
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

fn ttl_of(block: &Value) -> Option<u64> {
    let cc = block.get("cache_control")?;
    Some(if cc["ttl"] == "1h" {
        3_600_000
    } else {
        300_000
    })
}

fn units(request: &Value) -> Vec<Unit> {
    let mut out: Vec<Unit> = Vec::new();
    let mut prefix = hash_of(&["model", request["model"].as_str().unwrap_or("")]);
    let mut last_kind = String::new();
    let mut push = |out: &mut Vec<Unit>,
                    mix: String,
                    block: &Value,
                    kind: &str,
                    ignored: bool,
                    region: &'static str| {
        let ttl = ttl_of(block);
        let mut clean = block.clone();
        if let Some(o) = clean.as_object_mut() {
            o.remove("cache_control");
        }
        // The provider caches the prompt the JSON renders: key order, escapes and
        // spacing do not reach it.
        let text = sorted(&clean).to_string();
        let shown = if ignored { "ignored" } else { text.as_str() };
        prefix = hash_of(&[&prefix.to_string(), &mix, shown]);
        let tokens = match kind {
            "text" => count(clean["text"].as_str().unwrap_or("")),
            _ => count(&text),
        };
        let same_run = (kind == "tool_use" || kind == "tool_result") && kind == last_kind;
        let position = match out.last() {
            None => 0,
            Some(p) if same_run => p.position,
            Some(p) => p.position + 1,
        };
        last_kind = kind.to_owned();
        out.push(Unit {
            prefix,
            content: hash_of(&[&mix, shown]),
            region,
            tokens,
            position,
            breakpoint: ttl,
        });
    };
    for tool in request["tools"].as_array().into_iter().flatten() {
        push(&mut out, String::new(), tool, "tool", false, "tools");
    }
    let mut mix = format!("speed={}", request["speed"]);
    let system = match &request["system"] {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(a) => a.clone(),
        _ => vec![],
    };
    for block in &system {
        let ignored = block["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("x-anthropic-billing-header:"));
        push(
            &mut out,
            std::mem::take(&mut mix),
            block,
            "text",
            ignored,
            "system",
        );
    }
    let images = request.to_string().contains(r#""type":"image""#);
    mix.push_str(&format!(
        "tool_choice={} thinking={} effort={} images={images}",
        request["tool_choice"], request["thinking"], request["output_config"]["effort"]
    ));
    for message in request["messages"].as_array().into_iter().flatten() {
        let mut header = sorted(message);
        if let Some(o) = header.as_object_mut() {
            o.remove("content");
        }
        mix.push_str(&header.to_string());
        let blocks = match &message["content"] {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(a) => a.clone(),
            _ => vec![],
        };
        for block in &blocks {
            let kind = block["type"].as_str().unwrap_or("").to_owned();
            push(
                &mut out,
                std::mem::take(&mut mix),
                block,
                &kind,
                false,
                "messages",
            );
        }
    }
    // Top-level automatic caching: the last cacheable block.
    if let Some(cc) = request.get("cache_control") {
        let ttl = if cc["ttl"] == "1h" {
            3_600_000
        } else {
            300_000
        };
        if let Some(u) = out.last_mut()
            && u.breakpoint.is_none()
        {
            u.breakpoint = Some(ttl);
        }
    }
    out
}

/// An emulator shared between the fake provider's handler and the test.
pub type Shared = Arc<Mutex<CacheEmulator>>;

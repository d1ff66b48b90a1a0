//! The outgoing-secrets scanner: `[[scan]]` tables in the rules files say what to do
//! when a secret or personal data is found in what the model will read (block the
//! request, mask each value, mask it and put it back in the answer, tag or log it),
//! and `[[detector]]` tables add an organisation's own patterns.
//!
//! One scanner serves every scan of a set, as one policy at `before_provider_request`
//! that runs before the rules and hooks (so that a rule's `found` test can read what
//! it found). It reads each prompt unit (system, messages, tool results, tool
//! definitions, OpenAI input) once with the built-in detectors (the capture
//! redactor's own secret shapes, plus personal data with validators:
//! [`crate::redact::detect`]) and the admin's patterns. An agent resends its whole
//! conversation every turn: units seen clean before are known by a fast hash and
//! not read again.
//!
//! A masked value becomes a placeholder that is the same for the same value in the
//! same conversation (a keyed hash; the key lives in memory only), so every later
//! turn sends the same bytes and the cached prefix survives. For
//! `mask_and_restore` the placeholder's value is kept in memory (bounded, per
//! conversation, dropped after an hour unused) and put back where the answer
//! carries the placeholder ([`restore_engine`]).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::BLOCK_STATUS;
use super::load::{Cx, Val};
use crate::policy::{
    Block, Decision, Effects, EventPolicy, Facts, Finding, Outgoing, Phase, Policy, ResponseHead,
    SharedReport,
};
use crate::prompt::{Prompt, Region, Unit};
use crate::redact::{self, Confidence, DataKind};

/// What a `[[scan]]` does with what it selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Block,
    Mask,
    MaskAndRestore,
    Tag,
    Log,
}

impl Action {
    const ALL: [Action; 5] = [
        Action::Block,
        Action::Mask,
        Action::MaskAndRestore,
        Action::Tag,
        Action::Log,
    ];

    /// Its name in rule files and findings.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Action::Block => "block",
            Action::Mask => "mask",
            Action::MaskAndRestore => "mask_and_restore",
            Action::Tag => "tag",
            Action::Log => "log",
        }
    }

    fn masks(self) -> bool {
        matches!(self, Action::Mask | Action::MaskAndRestore)
    }
}

/// Every action name a finding may carry: the scans' and `found`.
pub(crate) const ACTIONS: &[&str] = &["block", "mask", "mask_and_restore", "tag", "log", "found"];

/// One compiled `[[scan]]`.
#[derive(Debug)]
pub(crate) struct Scan {
    pub(crate) name: String,
    /// Detector names it acts on (built-in or `[[detector]]`).
    detectors: Vec<String>,
    /// Kinds it acts on (every detector of the kind).
    kinds: Vec<DataKind>,
    min_confidence: Confidence,
    pub(crate) action: Action,
    /// The tag a `tag` scan sets (its name by default).
    tag: String,
}

impl Scan {
    /// What it selects, as written: `pem-private-key`, `kind secret`, …
    pub(crate) fn selection(&self) -> String {
        let mut parts: Vec<String> = self.detectors.clone();
        parts.extend(self.kinds.iter().map(|k| format!("kind {}", k.name())));
        let mut text = parts.join(", ");
        if self.min_confidence > Confidence::Low {
            text.push_str(&format!(" (confidence ≥ {})", self.min_confidence.name()));
        }
        text
    }

    fn selects(&self, detector: &str, kind: DataKind, confidence: Confidence) -> bool {
        confidence >= self.min_confidence
            && (self.kinds.contains(&kind) || self.detectors.iter().any(|d| d == detector))
    }
}

/// An organisation's own `[[detector]]`.
#[derive(Debug)]
pub(crate) struct OwnDetector {
    pub(crate) name: String,
    kind: DataKind,
    confidence: Confidence,
    regex: regex::Regex,
}

/// The keys of a `[[scan]]` table.
const SCAN_KEYS: &[&str] = &[
    "name",
    "detectors",
    "kinds",
    "min_confidence",
    "action",
    "tag",
];

/// The keys of a `[[detector]]` table.
const DETECTOR_KEYS: &[&str] = &["name", "kind", "pattern", "confidence"];

/// Compiles a `[[scan]]` table (`own`: the detectors declared so far).
pub(crate) fn compile_scan(
    cx: &mut Cx<'_>,
    item: &Val<'_>,
    own: &[OwnDetector],
    seen: &mut HashMap<String, String>,
) -> Option<Scan> {
    let errors_before = cx.errors.len();
    let table = cx.table(item, "a scan", SCAN_KEYS)?;
    let name = super::load::entry_name(cx, item, table, ("scan", "cloud-keys"), seen)
        .map(|(n, _)| n)
        .unwrap_or_default();
    let mut detectors = Vec::new();
    if let Some(v) = table.get("detectors") {
        for (text, span) in cx.strings(v, "detectors").unwrap_or_default() {
            if redact::detector(&text).is_none() && !own.iter().any(|d| d.name == text) {
                let known: Vec<&str> = redact::DETECTORS.iter().map(|d| d.name).collect();
                cx.error(
                    span,
                    format!(
                        "unknown detector {text:?} (built in: {}; or declare it with [[detector]] before this scan)",
                        known.join(", ")
                    ),
                );
            } else {
                detectors.push(text);
            }
        }
    }
    let mut kinds = Vec::new();
    if let Some(v) = table.get("kinds") {
        for (text, span) in cx.strings(v, "kinds").unwrap_or_default() {
            match DataKind::from_name(&text) {
                Some(k) => kinds.push(k),
                None => cx.error(span, format!("unknown kind {text:?} (known: secret, pii)")),
            }
        }
    }
    if table.get("detectors").is_none() && table.get("kinds").is_none() {
        cx.error(
            item.span(),
            "a scan needs `detectors` (e.g. [\"aws-access-key\"]) or `kinds` ([\"secret\"], [\"pii\"])",
        );
    }
    let min_confidence = match table.get("min_confidence") {
        Some(v) => confidence(cx, v, "min_confidence")?,
        None => Confidence::Low,
    };
    let action = match table.get("action") {
        Some(v) => {
            let text = cx.str(v, "action")?;
            match Action::ALL.into_iter().find(|a| a.name() == text) {
                Some(a) => Some(a),
                None => {
                    cx.error(
                        v.span(),
                        format!(
                            "unknown scan action {text:?} (known: block, mask, mask_and_restore, tag, log)"
                        ),
                    );
                    None
                }
            }
        }
        None => {
            cx.error(
                item.span(),
                "a scan needs `action`: block, mask, mask_and_restore, tag or log",
            );
            None
        }
    };
    let tag = match table.get("tag") {
        Some(v) => cx.str(v, "tag").map(str::to_owned),
        None => Some(name.clone()),
    };
    if cx.errors.len() > errors_before {
        return None;
    }
    Some(Scan {
        name,
        detectors,
        kinds,
        min_confidence,
        action: action?,
        tag: tag?,
    })
}

/// Compiles a `[[detector]]` table.
pub(crate) fn compile_detector(
    cx: &mut Cx<'_>,
    item: &Val<'_>,
    seen: &mut HashMap<String, String>,
) -> Option<OwnDetector> {
    let errors_before = cx.errors.len();
    let table = cx.table(item, "a detector", DETECTOR_KEYS)?;
    let name = super::load::entry_name(cx, item, table, ("detector", "employee-id"), seen)
        .map(|(n, _)| n)
        .unwrap_or_default();
    if redact::detector(&name).is_some() {
        cx.error(
            item.span(),
            format!("{name:?} is a built-in detector: give yours another name"),
        );
    }
    let kind = match table.get("kind") {
        Some(v) => {
            let text = cx.str(v, "kind")?;
            let kind = DataKind::from_name(text);
            if kind.is_none() {
                cx.error(
                    v.span(),
                    format!("unknown kind {text:?} (known: secret, pii)"),
                );
            }
            kind
        }
        None => Some(DataKind::Secret),
    };
    let regex = match table.get("pattern") {
        Some(v) => cx.regex(v, "pattern"),
        None => {
            cx.error(item.span(), "a detector needs `pattern` (a regex)");
            None
        }
    };
    let confidence = match table.get("confidence") {
        Some(v) => confidence(cx, v, "confidence"),
        None => Some(Confidence::Medium),
    };
    if cx.errors.len() > errors_before {
        return None;
    }
    Some(OwnDetector {
        name,
        kind: kind?,
        confidence: confidence?,
        regex: regex?,
    })
}

fn confidence(cx: &mut Cx<'_>, v: &Val<'_>, what: &str) -> Option<Confidence> {
    let text = cx.str(v, what)?;
    let c = Confidence::from_name(text);
    if c.is_none() {
        cx.error(
            v.span(),
            format!("{what} must be \"low\", \"medium\" or \"high\", found {text:?}"),
        );
    }
    c
}

/// How many unit hashes the scanner remembers as clean (16 bytes each).
const CLEAN_UNITS: usize = 65_536;

/// Units read before and found clean, by a fast hash of their bytes and their length.
#[derive(Debug, Default)]
struct CleanUnits {
    known: HashSet<(u64, usize)>,
    order: VecDeque<(u64, usize)>,
}

impl CleanUnits {
    fn insert(&mut self, key: (u64, usize)) {
        if self.known.insert(key) {
            self.order.push_back(key);
            if self.order.len() > CLEAN_UNITS
                && let Some(old) = self.order.pop_front()
            {
                self.known.remove(&old);
            }
        }
    }
}

/// The scanner of one rule set: its scans and detectors, as one policy.
#[derive(Debug)]
pub(crate) struct Scanner {
    scans: Vec<Scan>,
    own: Vec<OwnDetector>,
    /// Whether personal-data detectors run (a scan or a `found` test asks for them).
    pii: bool,
    /// Whether findings no scan acts on are kept (a rule's `found` test reads them).
    keep_all: bool,
    clean: Mutex<CleanUnits>,
    hasher: foldhash::fast::FixedState,
}

/// The name the scanner's turns have in the record and in metrics.
pub(crate) const SCANNER: &str = "secrets";

/// One value found in a unit: where in the body, by whom.
struct Hit<'s> {
    span: Range<usize>,
    detector: &'s str,
    kind: DataKind,
    confidence: Confidence,
}

impl Scanner {
    /// The scanner for `scans` and `own` detectors; `found` when a rule tests what it
    /// finds. `None` when there is nothing to scan for.
    pub(crate) fn new(scans: Vec<Scan>, own: Vec<OwnDetector>, found: bool) -> Option<Scanner> {
        if scans.is_empty() && !found {
            return None;
        }
        let pii = found
            || own.iter().any(|d| d.kind == DataKind::Pii)
            || scans.iter().any(|s| {
                s.kinds.contains(&DataKind::Pii)
                    || s.detectors
                        .iter()
                        .any(|d| redact::detector(d).is_some_and(|d| d.kind == DataKind::Pii))
            });
        Some(Scanner {
            scans,
            own,
            pii,
            keep_all: found,
            clean: Mutex::default(),
            hasher: foldhash::fast::FixedState::with_seed(0x5ec2e75),
        })
    }

    /// The scans, in load order.
    pub(crate) fn scans(&self) -> &[Scan] {
        &self.scans
    }

    /// The admin's detectors, in load order.
    pub(crate) fn own_detectors(&self) -> &[OwnDetector] {
        &self.own
    }

    fn restores(&self) -> bool {
        self.scans
            .iter()
            .any(|s| s.action == Action::MaskAndRestore)
    }

    /// The values in one unit's bytes (`at`: where they start in the body).
    fn read_unit<'s>(&'s self, bytes: &[u8], at: usize, out: &mut Vec<Hit<'s>>) {
        let mut found = Vec::new();
        redact::detect(bytes, self.pii, &mut found);
        redaction_markers(bytes, &mut found);
        for f in found {
            let Some(d) = redact::detector(f.detector) else {
                continue;
            };
            if redact::is_mask_placeholder(&bytes[f.start..f.end]) {
                continue;
            }
            out.push(Hit {
                span: at + f.start..at + f.end,
                detector: d.name,
                kind: d.kind,
                confidence: d.confidence,
            });
        }
        if !self.own.is_empty() {
            let text = String::from_utf8_lossy(bytes);
            if text.len() == bytes.len() {
                for d in &self.own {
                    for caps in d.regex.captures_iter(&text) {
                        let Some(m) = caps.name("s").or_else(|| caps.get(0)) else {
                            continue;
                        };
                        let span = at + m.start()..at + m.end();
                        let overlaps = out
                            .iter()
                            .any(|h| h.span.start < span.end && span.start < h.span.end);
                        if !m.is_empty()
                            && !overlaps
                            && !redact::is_mask_placeholder(m.as_str().as_bytes())
                        {
                            out.push(Hit {
                                span,
                                detector: &d.name,
                                kind: d.kind,
                                confidence: d.confidence,
                            });
                        }
                    }
                }
            }
        }
    }

    /// The first scan, in load order, that acts on a hit.
    fn scan_of(&self, hit: &Hit<'_>) -> Option<&Scan> {
        self.scans
            .iter()
            .find(|s| s.selects(hit.detector, hit.kind, hit.confidence))
    }

    /// Reads every unit of the payload: what was found, with the scan that acts on it.
    fn read<'s>(&'s self, prompt: &Prompt) -> Vec<(Hit<'s>, Option<&'s Scan>, usize)> {
        let body = prompt.body();
        let mut found = Vec::new();
        for (index, unit) in prompt.units().iter().enumerate() {
            if unit.image || matches!(unit.kind.as_ref(), "image" | "input_image") {
                continue;
            }
            let bytes = &body[unit.span.start..unit.span.end];
            let key = (self.hasher.hash_one(bytes), bytes.len());
            if self.clean_lock().known.contains(&key) {
                continue;
            }
            let mut hits = Vec::new();
            self.read_unit(bytes, unit.span.start, &mut hits);
            let mut any = false;
            for hit in hits {
                let scan = self.scan_of(&hit);
                if scan.is_some() || self.keep_all {
                    any = true;
                    found.push((hit, scan, index));
                }
            }
            if !any {
                self.clean_lock().insert(key);
            }
        }
        found
    }

    fn clean_lock(&self) -> std::sync::MutexGuard<'_, CleanUnits> {
        self.clean.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The scan phase: see the module docs.
    fn scan_request(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        let prompt = request.prompt.get();
        if prompt.format().is_none() {
            return Decision::Continue;
        }
        effects.parsed_body = true;
        let found = self.read(prompt);
        if found.is_empty() {
            return Decision::Continue;
        }
        let body = prompt.body().clone();
        let units = prompt.units();
        let conversation = facts.conversation.unwrap_or("");
        let mut blocked: Vec<(&str, String, &str)> = Vec::new();
        let mut masks: Vec<(Range<usize>, String)> = Vec::new();
        let mut kept: Vec<(String, Bytes)> = Vec::new();
        for (hit, scan, index) in &found {
            let unit = &units[*index];
            let location = location(prompt, unit);
            let value = body.slice(hit.span.clone());
            // Whatever was found stays out of the capture, the logs and the traces.
            if let Ok(re) = regex::Regex::new(&regex::escape(&String::from_utf8_lossy(&value))) {
                effects.redactions.push(re);
            }
            let action = scan.map_or("found", |s| s.action.name());
            effects.findings.push(Finding {
                detector: hit.detector.to_owned(),
                kind: hit.kind.name().to_owned(),
                location: location.clone(),
                action: action.to_owned(),
                scan: scan.map(|s| s.name.clone()),
            });
            let Some(scan) = scan else { continue };
            if !effects.fired.contains(&scan.name) {
                effects.fired.push(scan.name.clone());
            }
            match scan.action {
                Action::Block => blocked.push((&scan.name, location, hit.detector)),
                Action::Tag => {
                    if !effects.tags.contains(&scan.tag) {
                        effects.tags.push(scan.tag.clone());
                    }
                }
                Action::Log => effects.note(
                    &scan.name,
                    format!("found {} ({}) at {location}", hit.kind.name(), hit.detector),
                ),
                Action::Mask | Action::MaskAndRestore => {
                    let placeholder = placeholder(hit.detector, &value, conversation);
                    if scan.action == Action::MaskAndRestore {
                        kept.push((placeholder.clone(), value));
                    }
                    let pointer = unit_pointer(unit);
                    effects.edits.push((scan.name.clone(), pointer.clone()));
                    effects.changed(pointer);
                    masks.push((hit.span.clone(), placeholder));
                }
            }
        }
        if let Some((scan, _, _)) = blocked.first() {
            return Decision::Respond(Block {
                status: BLOCK_STATUS,
                error_type: None,
                message: block_message(&blocked),
                rule: (*scan).to_owned(),
                retry_after: None,
            });
        }
        if !kept.is_empty() {
            vault().keep(conversation, kept);
        }
        if masks.is_empty() {
            return Decision::Continue;
        }
        masks.sort_by_key(|(span, _)| span.start);
        let mut out = Vec::with_capacity(body.len());
        let mut at = 0;
        for (span, placeholder) in masks {
            if span.start < at {
                continue;
            }
            out.extend_from_slice(&body[at..span.start]);
            out.extend_from_slice(placeholder.as_bytes());
            at = span.end;
        }
        out.extend_from_slice(&body[at..]);
        let format = prompt.format();
        request.replace(Prompt::read(Bytes::from(out), format));
        Decision::Continue
    }
}

/// What a blocked request is answered with: the kinds and where, never a value.
fn block_message(blocked: &[(&str, String, &str)]) -> String {
    const SHOWN: usize = 8;
    let mut places: Vec<String> = blocked
        .iter()
        .take(SHOWN)
        .map(|(_, location, detector)| format!("{detector} at {location}"))
        .collect();
    if blocked.len() > SHOWN {
        places.push(format!("and {} more", blocked.len() - SHOWN));
    }
    // The answer adds "promptgate: " and the scan's name as the rule.
    format!(
        "the request carries data the policy keeps from the provider ({}). Remove it and send again.",
        places.join(", ")
    )
}

/// Where a unit is, as a reader finds it: `messages[3].content[1]`, with the tool a
/// tool result or a tool definition belongs to.
fn location(prompt: &Prompt, unit: &Unit) -> String {
    let path = unit.path.to_string();
    let tool = match (unit.path.region, unit.kind.as_ref()) {
        (Region::Tools, _) => unit_value(prompt, unit)
            .and_then(|v| {
                v.get("name")
                    .or_else(|| v.get("function").and_then(|f| f.get("name")))
            })
            .and_then(|n| n.str())
            .map(|n| format!("tool {n}")),
        (_, "tool_result" | "function_call_output") => {
            let value = unit_value(prompt, unit);
            let id = value
                .and_then(|v| v.get("tool_use_id").or_else(|| v.get("call_id")))
                .and_then(|v| v.str());
            id.and_then(|id| tool_of_call(prompt, &id))
                .map(|n| format!("{} of {n}", unit.kind))
        }
        (_, "tool_use" | "function_call") => unit_value(prompt, unit)
            .and_then(|v| v.get("name"))
            .and_then(|n| n.str())
            .map(|n| format!("{} of {n}", unit.kind)),
        _ => None,
    };
    match tool {
        Some(t) => format!("{path} ({t})"),
        None => path,
    }
}

/// The unit's JSON value in the prompt.
fn unit_value<'p>(prompt: &'p Prompt, unit: &Unit) -> Option<crate::prompt::Value<'p>> {
    let root = prompt.root()?;
    let region = root.get(unit.path.region.name())?;
    let item = if region.is_array() {
        region.items().nth(unit.path.index as usize)?
    } else {
        region
    };
    match unit.path.block {
        Some(b) => item.get("content")?.items().nth(b as usize),
        None => Some(item),
    }
}

/// The name of the tool the call `id` asked for, from the call in the prompt.
fn tool_of_call(prompt: &Prompt, id: &str) -> Option<String> {
    prompt
        .units()
        .iter()
        .filter(|u| matches!(u.kind.as_ref(), "tool_use" | "function_call"))
        .filter_map(|u| unit_value(prompt, u))
        .find(|v| {
            v.get("id")
                .or_else(|| v.get("call_id"))
                .is_some_and(|i| i.is_str(id))
        })
        .and_then(|v| v.get("name")?.str().map(Cow::into_owned))
}

/// The JSON pointer of a unit's node (what the record's edits name).
fn unit_pointer(unit: &Unit) -> String {
    let p = unit.path;
    if p.region == Region::Instructions {
        return "/instructions".into();
    }
    let mut out = format!("/{}/{}", p.region.name(), p.index);
    match (p.block, p.string) {
        (Some(b), _) => out.push_str(&format!("/content/{b}")),
        (None, true) if matches!(p.region, Region::Messages | Region::Input) => {
            out.push_str("/content");
        }
        _ => {}
    }
    out
}

/// The capture's redaction markers in `bytes` (`[REDACTED:aws-access-key:1a2b3c4d]`),
/// each as a value of its detector: a request replayed from the store carries its
/// secrets as markers, and a scan should treat it as it treated the secret.
fn redaction_markers(bytes: &[u8], out: &mut Vec<redact::Found>) {
    const OPEN: &[u8] = b"[REDACTED:";
    for at in memchr::memmem::find_iter(bytes, OPEN) {
        let rest = &bytes[at + OPEN.len()..];
        let Some(colon) = rest.iter().take(40).position(|b| *b == b':') else {
            continue;
        };
        let Some(close) = rest.iter().take(colon + 40).position(|b| *b == b']') else {
            continue;
        };
        let Some(d) = std::str::from_utf8(&rest[..colon])
            .ok()
            .and_then(redact::detector)
        else {
            continue;
        };
        let (start, end) = (at, at + OPEN.len() + close + 1);
        if !out.iter().any(|f| f.start < end && start < f.end) {
            out.push(redact::Found {
                start,
                end,
                detector: d.name,
            });
        }
    }
}

/// Token prefixes a placeholder keeps, so that it still says what it stands for.
const PREFIXES: &[&str] = &[
    "sk-ant-",
    "sk-proj-",
    "sk-svcacct-",
    "sk-admin-",
    "sk_live_",
    "sk_test_",
    "rk_live_",
    "rk_test_",
    "whsec_",
    "github_pat_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "glpat-",
    "xoxb-",
    "xoxp-",
    "xoxa-",
    "xoxr-",
    "xoxs-",
    "xoxe-",
    "npm_",
    "pypi-",
    "AIza",
    "AKIA",
    "ASIA",
    "eyJ",
    "sk-",
];

/// The per-process key of placeholders: in memory only, so nobody can test a guess
/// against a stored placeholder offline.
fn placeholder_key() -> &'static ring::hmac::Key {
    static KEY: OnceLock<ring::hmac::Key> = OnceLock::new();
    KEY.get_or_init(|| {
        let rng = ring::rand::SystemRandom::new();
        ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng)
            .unwrap_or_else(|_| ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[0x5e; 32]))
    })
}

/// The placeholder of `value` in `conversation`: the same for the same value there.
pub(crate) fn placeholder(detector: &str, value: &[u8], conversation: &str) -> String {
    let mut ctx = ring::hmac::Context::with_key(placeholder_key());
    for part in [conversation.as_bytes(), detector.as_bytes(), value] {
        ctx.update(&(part.len() as u64).to_le_bytes());
        ctx.update(part);
    }
    let tag = ctx.sign();
    let hex: String = tag.as_ref()[..5]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let prefix = PREFIXES
        .iter()
        .find(|p| value.starts_with(p.as_bytes()))
        .copied();
    match (detector, prefix) {
        ("aws-access-key", Some(p)) => format!("{p}MASKED{}", hex.to_ascii_uppercase()),
        ("email", _) => format!("MASKED{hex}@example.invalid"),
        (_, Some(p)) => format!("{p}MASKED{hex}"),
        (d, None) => format!("{d}-MASKED{hex}"),
    }
}

/// How long a conversation's masked values are kept without a request of it.
const VAULT_IDLE: Duration = Duration::from_secs(3600);
/// The most conversations whose values are kept (the least recently used go first).
const VAULT_CONVERSATIONS: usize = 1024;
/// The most values kept per conversation (the oldest go first).
const VAULT_VALUES: usize = 256;

/// A masked value as it is put back: as it was in the request's JSON (for JSON
/// text such as a tool call's input) and as text (for text deltas).
#[derive(Debug, Clone)]
pub(crate) struct Original {
    pub(crate) json: String,
    pub(crate) text: String,
}

/// One conversation's placeholders and the values they stand for.
#[derive(Debug, Default)]
struct Kept {
    used: Option<Instant>,
    values: HashMap<String, Original>,
    order: VecDeque<String>,
}

/// The values `mask_and_restore` put placeholders in for, per conversation, in
/// memory only: see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Vault {
    conversations: Mutex<HashMap<String, Kept>>,
}

/// The process's vault: it outlives a reload of the rules.
pub(crate) fn vault() -> &'static Vault {
    static VAULT: OnceLock<Vault> = OnceLock::new();
    VAULT.get_or_init(Vault::default)
}

impl Vault {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Kept>> {
        self.conversations.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn keep(&self, conversation: &str, values: Vec<(String, Bytes)>) {
        let now = Instant::now();
        let mut all = self.lock();
        all.retain(|_, k| k.used.is_some_and(|u| now.duration_since(u) < VAULT_IDLE));
        if !all.contains_key(conversation) && all.len() >= VAULT_CONVERSATIONS {
            let oldest = all
                .iter()
                .min_by_key(|(_, k)| k.used)
                .map(|(c, _)| c.clone());
            if let Some(c) = oldest {
                all.remove(&c);
            }
        }
        let kept = all.entry(conversation.to_owned()).or_default();
        kept.used = Some(now);
        for (placeholder, value) in values {
            if kept.values.contains_key(&placeholder) {
                continue;
            }
            let json = String::from_utf8_lossy(&value).into_owned();
            let text = serde_json::from_str::<String>(&format!("\"{json}\""))
                .unwrap_or_else(|_| json.clone());
            kept.values
                .insert(placeholder.clone(), Original { json, text });
            kept.order.push_back(placeholder);
            if kept.order.len() > VAULT_VALUES
                && let Some(old) = kept.order.pop_front()
            {
                kept.values.remove(&old);
            }
        }
    }

    /// The placeholders of `conversation` and their values, when it has any.
    pub(crate) fn of(&self, conversation: &str) -> Option<Arc<HashMap<String, Original>>> {
        let now = Instant::now();
        let mut all = self.lock();
        let kept = all.get_mut(conversation)?;
        if kept
            .used
            .is_none_or(|u| now.duration_since(u) >= VAULT_IDLE)
        {
            all.remove(conversation);
            return None;
        }
        kept.used = Some(now);
        (!kept.values.is_empty()).then(|| Arc::new(kept.values.clone()))
    }
}

impl Policy for Scanner {
    fn name(&self) -> &str {
        SCANNER
    }

    fn runs(&self, phase: Phase) -> bool {
        match phase {
            Phase::BeforeProviderRequest => true,
            Phase::ProviderStreamEvent => self.restores(),
            _ => false,
        }
    }

    fn reads_conversation(&self) -> bool {
        self.scans.iter().any(|s| s.action.masks())
    }

    fn before_provider_request(
        &self,
        facts: &Facts<'_>,
        request: &mut Outgoing,
        effects: &mut Effects,
    ) -> Decision {
        self.scan_request(facts, request, effects)
    }

    fn provider_stream_event(
        &self,
        facts: &Facts<'_>,
        head: &ResponseHead<'_>,
    ) -> Option<(Box<dyn EventPolicy>, SharedReport)> {
        let values = vault().of(facts.conversation.unwrap_or(""))?;
        restore_engine(facts, head, values)
    }

    fn provider_json_answer(
        &self,
        facts: &Facts<'_>,
        _head: &ResponseHead<'_>,
    ) -> Option<(Box<dyn EventPolicy>, SharedReport)> {
        if !self.restores() {
            return None;
        }
        let values = vault().of(facts.conversation.unwrap_or(""))?;
        let engine = JsonRestore {
            values,
            report: SharedReport::default(),
        };
        let report = engine.report.clone();
        Some((Box::new(engine), report))
    }
}

/// Puts masked values back where their placeholders are in a JSON answer, whole:
/// a placeholder lies in a JSON string, where the value goes as the request's JSON
/// had it.
struct JsonRestore {
    values: Arc<HashMap<String, Original>>,
    report: SharedReport,
}

impl EventPolicy for JsonRestore {
    fn may_change(&self) -> bool {
        true
    }

    fn push(
        &mut self,
        raw: Bytes,
        _now: tokio::time::Instant,
        out: &mut Vec<Bytes>,
    ) -> Option<Block> {
        let mut body = raw.to_vec();
        let mut restored = 0;
        for (placeholder, original) in self.values.iter() {
            let finder = memchr::memmem::Finder::new(placeholder.as_bytes());
            if finder.find(&body).is_none() {
                continue;
            }
            let mut next = Vec::with_capacity(body.len());
            let mut at = 0;
            for hit in finder.find_iter(&body) {
                next.extend_from_slice(&body[at..hit]);
                next.extend_from_slice(original.json.as_bytes());
                at = hit + placeholder.len();
                restored += 1;
            }
            next.extend_from_slice(&body[at..]);
            body = next;
        }
        if restored == 0 {
            out.push(raw);
            return None;
        }
        let mut report = self.report.lock().unwrap_or_else(|p| p.into_inner());
        report.edits.push(crate::policy::EventEdit {
            index: 0,
            event: "json".into(),
            rule: SCANNER.into(),
            action: "restore".into(),
            sent: None,
        });
        out.push(Bytes::from(body));
        None
    }

    fn release_due(&mut self, _now: tokio::time::Instant, _out: &mut Vec<Bytes>) {}

    fn next_release(&self) -> Option<tokio::time::Instant> {
        None
    }

    fn finish(&mut self, _out: &mut Vec<Bytes>) {}
}

/// The engine that puts masked values back where their placeholders come in a
/// streamed answer (split across deltas and events or not).
pub(crate) fn restore_engine(
    facts: &Facts<'_>,
    head: &ResponseHead<'_>,
    values: Arc<HashMap<String, Original>>,
) -> Option<(Box<dyn EventPolicy>, SharedReport)> {
    let mut placeholders: Vec<&String> = values.keys().collect();
    // Longest first: the alternation takes the first that matches.
    placeholders.sort_by_key(|p| std::cmp::Reverse(p.len()));
    let pattern = placeholders
        .iter()
        .map(|p| regex::escape(p))
        .collect::<Vec<_>>()
        .join("|");
    let regex = regex::Regex::new(&pattern).ok()?;
    let longest = placeholders.first().map_or(0, |p| p.len());
    let mask = super::stream::Mask {
        class: super::stream::scan::TokenClass::of(&regex),
        regex,
        with: super::stream::MaskWith::Restore(values),
        hold_bytes: longest.max(64),
    };
    let engine = super::stream::EventRules::restoring(
        super::stream::StreamContext::of(facts, head),
        SCANNER,
        Arc::new(mask),
    );
    let report = engine.report();
    Some((Box::new(engine), report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_keep_the_shape_and_are_the_same_per_conversation() {
        let id = b"AKIAIOSFODNN7EXAMPLE";
        let a = placeholder("aws-access-key", id, "cc:1");
        assert_eq!(a.len(), 20, "{a}");
        assert!(a.starts_with("AKIAMASKED"), "{a}");
        assert_eq!(a, placeholder("aws-access-key", id, "cc:1"));
        assert_ne!(a, placeholder("aws-access-key", id, "cc:2"));
        assert!(redact::is_mask_placeholder(a.as_bytes()));
        let e = placeholder("email", b"jane@example.com", "cc:1");
        assert!(
            e.starts_with("MASKED") && e.ends_with("@example.invalid"),
            "{e}"
        );
        let k = placeholder("anthropic", b"sk-ant-api03-abcdefghijklmnopqrstuv", "");
        assert!(k.starts_with("sk-ant-MASKED"), "{k}");
        let p = placeholder("pem-private-key", b"-----BEGIN", "");
        assert!(p.starts_with("pem-private-key-MASKED"), "{p}");
        assert!(!redact::is_mask_placeholder(b"MASKEDxyz"));
    }

    #[test]
    fn the_vault_keeps_values_per_conversation_and_bounded() {
        let vault = Vault::default();
        let values: Vec<(String, Bytes)> = (0..VAULT_VALUES + 10)
            .map(|i| (format!("p{i}"), Bytes::from(format!("v\\n{i}"))))
            .collect();
        vault.keep("a", values);
        let kept = vault.of("a").expect("kept");
        assert_eq!(kept.len(), VAULT_VALUES);
        assert!(!kept.contains_key("p0"), "the oldest went first");
        let last = &kept[&format!("p{}", VAULT_VALUES + 9)];
        assert_eq!(last.json, format!("v\\n{}", VAULT_VALUES + 9));
        assert_eq!(last.text, format!("v\n{}", VAULT_VALUES + 9));
        assert!(vault.of("b").is_none());
    }
}

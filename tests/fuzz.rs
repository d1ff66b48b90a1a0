//! Property-based fuzz targets, on stable Rust with `proptest` (random inputs,
//! shrinking to a minimal case, failures persisted under `fuzz/regressions/`).
//!
//! Targets (fuzz/README.md says more): `sse_*` the SSE decoder, `json_*` the JSON
//! structure pass and the rules' reading of a body by pointer, `redact_*` the
//! redactor and the capture's scrub of streamed secrets, `rules_*` the rule loader,
//! `decode_*` request decoding. `corpus_replays` replays `fuzz/corpus/` every run.
//!
//! `PROMPTGATE_FUZZ_CASES` sets the cases per property (default 256); `fuzz/run`
//! runs them longer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method};
use proptest::prelude::*;
use proptest::sample::{Index, select};
use proptest::test_runner::FileFailurePersistence;
use serde_json::Value;

use promptgate::CaptureRecord;
use promptgate::ExchangeId;
use promptgate::ExchangeRecord;
use promptgate::SseDecoder;
use promptgate::decode::{self, DecodeError};
use promptgate::json;
use promptgate::{Api, Provider};
use promptgate::{Decision, RequestCtx, RuleSet};
use promptgate::{Redactor, Summary};

// ===================================================================== setup

/// Cases per property when `PROMPTGATE_FUZZ_CASES` is unset: the suite stays
/// well under a minute in a debug build.
const DEFAULT_CASES: u32 = 256;

/// The config of one target: its own regression file, and the case count
/// divided by `cost` for properties whose cases are slow.
fn config(regressions: &'static str, cost: u32) -> ProptestConfig {
    let cases = std::env::var("PROMPTGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(DEFAULT_CASES);
    ProptestConfig {
        cases: (cases / cost).max(1),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(regressions))),
        ..ProptestConfig::default()
    }
}

/// Counts the heap bytes live on each thread, so a test can tell how much one
/// call allocated at its peak (Rust allocations only: zstd's C side is not seen).
struct CountingAlloc;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note_alloc(delta: isize) {
    // `try_with`: the allocator runs while thread-locals are torn down too.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note_alloc(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        note_alloc(-(layout.size() as isize));
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note_alloc(layout.size() as isize);
        }
        p
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note_alloc(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// `f`'s result and the most heap it held at once on this thread, in bytes.
fn peak_heap<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, (peak - base).max(0) as usize)
}

/// One random change to a byte string.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
}

/// Bytes that change JSON and TOML structure, inserted more often than chance would.
const STRUCTURAL: &[u8] = b"{}[]\",:\\ \n=.'#0tn-u";

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, bit)| Mutation::Flip(i, bit)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<Index>(), select(STRUCTURAL)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<Index>().prop_map(Mutation::Delete),
        any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    match m {
        Mutation::Flip(i, bit) if n > 0 => bytes[i.index(n)] ^= 1 << bit,
        Mutation::Insert(i, b) => bytes.insert(i.index(n + 1), *b),
        Mutation::Delete(i) if n > 0 => {
            bytes.remove(i.index(n));
        }
        Mutation::Truncate(i) => bytes.truncate(i.index(n + 1)),
        _ => {}
    }
}

fn corpus_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(kind)
}

/// The files of one corpus folder, sorted, as (name, bytes).
fn corpus(kind: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(kind);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

// ===================================================================== SSE

/// One line of an SSE stream, as the generator writes it.
#[derive(Debug, Clone)]
enum SseLine {
    /// `field:value`, with or without the one optional space after the colon.
    Field {
        name: &'static str,
        value: Vec<u8>,
        space: bool,
    },
    /// `data` or `event` alone, no colon: the field with an empty value.
    Bare(&'static str),
    /// `:comment`
    Comment(Vec<u8>),
}

/// A generated stream: its bytes and the events a WHATWG reader dispatches.
#[derive(Debug, Clone)]
struct SseStream {
    bytes: Vec<u8>,
    events: Vec<(String, String)>,
}

fn sse_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[^\r\n]{0,16}".prop_map(String::into_bytes),
        "[a-z{}\":, ]{0,12}".prop_map(String::into_bytes),
        // Not UTF-8 at all: the decoder reads lines lossily.
        prop::collection::vec(
            any::<u8>().prop_filter("no line end", |b| *b != b'\r' && *b != b'\n'),
            0..8
        ),
    ]
}

fn sse_line() -> impl Strategy<Value = SseLine> {
    prop_oneof![
        4 => (select(&["data", "event", "id", "retry", "x"][..]), sse_value(), any::<bool>())
            .prop_map(|(name, value, space)| SseLine::Field { name, value, space }),
        1 => select(&["data", "event"][..]).prop_map(SseLine::Bare),
        1 => sse_value().prop_map(SseLine::Comment),
    ]
}

/// Events of lines, each ended by a blank line; every line end picked from LF,
/// CRLF and CR; maybe a BOM first and an unterminated event last.
fn sse_stream() -> impl Strategy<Value = SseStream> {
    (
        any::<bool>(),
        prop::collection::vec(prop::collection::vec(sse_line(), 0..5), 0..6),
        prop::collection::vec(sse_line(), 0..3),
        prop::collection::vec(0usize..3, 64),
    )
        .prop_map(|(bom, events, unterminated, endings)| {
            let mut s = SseWriter {
                bytes: Vec::new(),
                endings,
                at: 0,
                after_cr: false,
            };
            if bom {
                s.bytes.extend_from_slice("\u{feff}".as_bytes());
            }
            let mut want = Vec::new();
            for lines in &events {
                let (mut name, mut data, mut has_data) = (String::new(), String::new(), false);
                for line in lines {
                    s.line(line);
                    match line {
                        SseLine::Field {
                            name: "event",
                            value,
                            space,
                        } => name = field_value(value, *space),
                        SseLine::Bare("event") => name.clear(),
                        SseLine::Field {
                            name: "data",
                            value,
                            space,
                        } => {
                            if has_data {
                                data.push('\n');
                            }
                            data.push_str(&field_value(value, *space));
                            has_data = true;
                        }
                        SseLine::Bare(_) => {
                            if has_data {
                                data.push('\n');
                            }
                            has_data = true;
                        }
                        _ => {}
                    }
                }
                s.end(b"");
                // The decoder also dispatches a named event without data, which a
                // WHATWG reader drops: what it does today (harmless to its readers).
                if has_data || !name.is_empty() {
                    want.push((name, data));
                }
            }
            for line in &unterminated {
                s.line(line);
            }
            SseStream {
                bytes: s.bytes,
                events: want,
            }
        })
}

/// A field's value as read: the one optional space after the colon dropped.
fn field_value(value: &[u8], space: bool) -> String {
    let text = String::from_utf8_lossy(value).into_owned();
    match (space, text.strip_prefix(' ')) {
        (false, Some(rest)) => rest.to_owned(),
        _ => text,
    }
}

struct SseWriter {
    bytes: Vec<u8>,
    endings: Vec<usize>,
    at: usize,
    after_cr: bool,
}

impl SseWriter {
    fn line(&mut self, line: &SseLine) {
        let text = match line {
            SseLine::Field { name, value, space } => {
                let mut t = format!("{name}:{}", if *space { " " } else { "" }).into_bytes();
                t.extend_from_slice(value);
                t
            }
            SseLine::Bare(name) => name.as_bytes().to_vec(),
            SseLine::Comment(c) => [&b":"[..], c].concat(),
        };
        self.end(&text);
    }

    fn end(&mut self, text: &[u8]) {
        let mut ending: &[u8] =
            [&b"\n"[..], b"\r\n", b"\r"][self.endings[self.at % self.endings.len()]];
        self.at += 1;
        // After a CR, an empty line ended by LF would read as that CR's CRLF.
        if self.after_cr && text.is_empty() && ending == b"\n" {
            ending = b"\r\n";
        }
        self.bytes.extend_from_slice(text);
        self.bytes.extend_from_slice(ending);
        self.after_cr = ending == b"\r";
    }
}

/// How a byte string is cut into feeds.
#[derive(Debug, Clone)]
enum Cuts {
    EveryByte,
    At(Vec<Index>),
}

fn cuts() -> impl Strategy<Value = Cuts> {
    prop_oneof![
        1 => Just(Cuts::EveryByte),
        4 => prop::collection::vec(any::<Index>(), 0..10).prop_map(Cuts::At),
    ]
}

fn pieces<'b>(bytes: &'b [u8], cuts: &Cuts) -> Vec<&'b [u8]> {
    match cuts {
        Cuts::EveryByte => bytes.chunks(1).collect(),
        Cuts::At(at) => {
            let mut points: Vec<usize> = at.iter().map(|i| i.index(bytes.len() + 1)).collect();
            points.sort_unstable();
            let mut out = Vec::new();
            let mut from = 0;
            for p in points.into_iter().chain([bytes.len()]) {
                out.push(&bytes[from..p]); // empty feeds too: they must change nothing
                from = p;
            }
            out
        }
    }
}

fn sse_events(feeds: &[&[u8]]) -> Vec<(String, String)> {
    let mut decoder = SseDecoder::default();
    let mut out = Vec::new();
    for feed in feeds {
        decoder.feed(feed, &mut |event, data| {
            out.push((event.to_owned(), data.to_owned()))
        });
    }
    out
}

fn check_sse_splits(bytes: &[u8], cuts: &Cuts) {
    let whole = sse_events(&[bytes]);
    let split = sse_events(&pieces(bytes, cuts));
    assert_eq!(
        split,
        whole,
        "split {cuts:?} of {:?}",
        String::from_utf8_lossy(bytes)
    );
}

proptest! {
    #![proptest_config(config("fuzz/regressions/sse.txt", 1))]

    #[test]
    fn sse_valid_streams_give_their_events_however_split(stream in sse_stream(), cuts in cuts()) {
        let whole = sse_events(&[&stream.bytes]);
        prop_assert_eq!(&whole, &stream.events, "{:?}", String::from_utf8_lossy(&stream.bytes));
        check_sse_splits(&stream.bytes, &cuts);
    }

    #[test]
    fn sse_random_bytes_never_panic_and_split_the_same(
        bytes in prop::collection::vec(prop_oneof![any::<u8>(), select(&b"\r\n:ade "[..])], 0..200),
        cuts in cuts(),
    ) {
        check_sse_splits(&bytes, &cuts);
    }
}

// ===================================================================== JSON

/// A JSON value as the generator writes it: objects may repeat keys.
#[derive(Debug, Clone)]
enum J {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

fn json_key() -> impl Strategy<Value = String> {
    prop_oneof![
        // A few keys, so objects repeat them; `/` and `~` need escaping in pointers.
        3 => select(&["model", "messages", "type", "text", "a", "a/b", "~0", "", "0"][..]).prop_map(str::to_owned),
        1 => "\\PC{0,6}",
        1 => "[\\x00-\\x1f\"\\\\/]{0,3}",
    ]
}

fn json_string() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,8}",
        ".{0,12}",
        "[\\x00-\\x1f\"\\\\/\u{7f}-\u{a0}\u{2028}\u{fffd}\u{1F600}]{0,6}",
    ]
}

fn json_tree() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        any::<i64>().prop_map(J::Int),
        (-1000i64..1000).prop_map(J::Int),
        (-1e6f64..1e6).prop_map(J::Float),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(J::Float),
        json_string().prop_map(J::Str),
    ];
    leaf.prop_recursive(6, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(J::Arr),
            prop::collection::vec((json_key(), inner), 0..6).prop_map(J::Obj),
        ]
    })
}

fn json_object() -> impl Strategy<Value = J> {
    prop::collection::vec((json_key(), json_tree()), 0..6).prop_map(J::Obj)
}

/// Choices the writer takes one by one: whitespace, and how to escape a character.
struct Noise<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Noise<'_> {
    fn next(&mut self) -> u8 {
        if self.bytes.is_empty() {
            return 0;
        }
        self.at += 1;
        self.bytes[(self.at - 1) % self.bytes.len()]
    }

    fn ws(&mut self, out: &mut String) {
        const WS: &[&str] = &["", "", "", " ", "\n", "\t", "\r\n  ", "  "];
        out.push_str(WS[self.next() as usize % WS.len()]);
    }
}

/// `j` as JSON text with the whitespace and escapes `noise` picks.
fn write_json(j: &J, noise: &mut Noise<'_>, out: &mut String) {
    match j {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Int(n) => out.push_str(&n.to_string()),
        J::Float(f) => out.push_str(&serde_json::to_string(f).unwrap()),
        J::Str(s) => write_json_string(s, noise, out),
        J::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                noise.ws(out);
                if i > 0 {
                    out.push(',');
                    noise.ws(out);
                }
                write_json(item, noise, out);
            }
            noise.ws(out);
            out.push(']');
        }
        J::Obj(entries) => {
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                noise.ws(out);
                if i > 0 {
                    out.push(',');
                    noise.ws(out);
                }
                write_json_string(k, noise, out);
                noise.ws(out);
                out.push(':');
                noise.ws(out);
                write_json(v, noise, out);
            }
            noise.ws(out);
            out.push('}');
        }
    }
}

fn write_json_string(s: &str, noise: &mut Noise<'_>, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let pick = noise.next();
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' if pick.is_multiple_of(2) => out.push_str("\\/"),
            '\n' if pick.is_multiple_of(2) => out.push_str("\\n"),
            c if (c as u32) < 0x20 || pick.is_multiple_of(7) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    // Both cases of hex digits are JSON.
                    if pick.is_multiple_of(3) {
                        out.push_str(&format!("\\u{u:04X}"));
                    } else {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_text(j: &J, noise: &[u8]) -> String {
    let mut out = String::new();
    let mut n = Noise {
        bytes: noise,
        at: 0,
    };
    n.ws(&mut out);
    write_json(j, &mut n, &mut out);
    n.ws(&mut out);
    out
}

/// A realistic Anthropic /v1/messages body.
fn anthropic_body() -> impl Strategy<Value = Vec<u8>> {
    let text = prop_oneof!["[ -~]{0,40}", "\\PC{0,12}"];
    let block = prop_oneof![
        (text.clone(), any::<bool>()).prop_map(|(t, cache)| {
            let mut b = serde_json::json!({"type": "text", "text": t});
            if cache {
                b["cache_control"] = serde_json::json!({"type": "ephemeral", "ttl": "1h"});
            }
            b
        }),
        text.clone().prop_map(|t| serde_json::json!({
            "type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": t}
        })),
        text.clone().prop_map(|t| serde_json::json!({
            "type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": t}]
        })),
    ];
    let message = (
        select(&["user", "assistant"][..]),
        prop_oneof![
            text.clone().prop_map(Value::String),
            prop::collection::vec(block, 1..4).prop_map(Value::Array)
        ],
    )
        .prop_map(|(role, content)| serde_json::json!({"role": role, "content": content}));
    (
        select(&["claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5"][..]),
        prop::collection::vec(message, 1..5),
        text,
        any::<bool>(),
        1u32..64000,
    )
        .prop_map(|(model, messages, system, stream, max_tokens)| {
            serde_json::to_vec(&serde_json::json!({
                "model": model,
                "max_tokens": max_tokens,
                "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                "messages": messages,
                "tools": [{"name": "Bash", "description": "Runs a command",
                           "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
                "metadata": {"user_id": "user_abc"},
                "stream": stream,
            }))
            .unwrap()
        })
}

/// Whether serde_json refused `body` only for its nesting (its limit is 128).
fn too_deep_for_serde(e: &serde_json::Error) -> bool {
    e.to_string().contains("recursion limit")
}

/// The value of the tape's token `t` (and the tape's own checks on the way):
/// containers from their children, leaves parsed from their spans.
fn value_of_tape(body: &[u8], toks: &[json::Tok], t: usize) -> Value {
    let tok = toks[t];
    let text = tok.of(body);
    let end = tok.next as usize;
    assert!(end > t && end <= toks.len(), "token {t}: next {end}");
    for child in &toks[t + 1..end] {
        assert!(
            child.start >= tok.start && child.end <= tok.end,
            "a child {child:?} outside its parent {tok:?}"
        );
    }
    match text.first() {
        Some(b'{') => {
            assert_eq!(
                text.last(),
                Some(&b'}'),
                "{}",
                String::from_utf8_lossy(text)
            );
            let mut map = serde_json::Map::new();
            let mut c = t + 1;
            while c < end {
                let key: String = serde_json::from_slice(toks[c].of(body)).unwrap_or_else(|e| {
                    panic!("key {:?}: {e}", String::from_utf8_lossy(toks[c].of(body)))
                });
                assert!(c + 1 < end, "a key without a value at token {c}");
                let value = value_of_tape(body, toks, c + 1);
                map.insert(key, value); // last wins, first place kept: as serde_json reads it
                c = toks[c + 1].next as usize;
            }
            assert_eq!(c, end);
            Value::Object(map)
        }
        Some(b'[') => {
            assert_eq!(
                text.last(),
                Some(&b']'),
                "{}",
                String::from_utf8_lossy(text)
            );
            let mut items = Vec::new();
            let mut c = t + 1;
            while c < end {
                items.push(value_of_tape(body, toks, c));
                c = toks[c].next as usize;
            }
            Value::Array(items)
        }
        _ => {
            assert_eq!(end, t + 1, "a leaf has no children");
            serde_json::from_slice(text).unwrap_or_else(|e| {
                panic!("leaf {:?} is not JSON: {e}", String::from_utf8_lossy(text))
            })
        }
    }
}

/// Whether some leaf or key of a tape is not JSON by itself: the tape does not
/// validate what it skips, and a body serde_json refuses may differ only there.
fn has_invalid_leaf(body: &[u8], toks: &[json::Tok]) -> bool {
    let mut keys = vec![false; toks.len()];
    for (t, tok) in toks.iter().enumerate() {
        if body[tok.start as usize] == b'{' {
            let mut c = t + 1;
            while c < tok.next as usize {
                keys[c] = true;
                c = toks
                    .get(c + 1)
                    .map_or(tok.next as usize, |v| v.next as usize);
            }
        }
    }
    toks.iter().enumerate().any(|(t, tok)| {
        let text = tok.of(body);
        if keys[t] {
            serde_json::from_slice::<String>(text).is_err()
        } else {
            !matches!(text.first(), Some(b'{' | b'['))
                && serde_json::from_slice::<Value>(text).is_err()
        }
    })
}

/// The first repeated key of the body, as pointer tokens: objects in document
/// order, keys compared decoded. Written from the tape's spans and serde_json's
/// decoding, independently of `json::duplicate_key`.
fn first_repeat(
    body: &[u8],
    toks: &[json::Tok],
    t: usize,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    let tok = toks[t];
    let end = tok.next as usize;
    match body[tok.start as usize] {
        b'{' => {
            let mut seen = Vec::new();
            let mut c = t + 1;
            while c < end {
                let key: String = serde_json::from_slice(toks[c].of(body)).unwrap();
                if seen.contains(&key) {
                    path.push(key);
                    return Some(path.clone());
                }
                seen.push(key);
                c = toks[c + 1].next as usize;
            }
            let mut c = t + 1;
            while c < end {
                path.push(serde_json::from_slice(toks[c].of(body)).unwrap());
                if let Some(found) = first_repeat(body, toks, c + 1, path) {
                    return Some(found);
                }
                path.pop();
                c = toks[c + 1].next as usize;
            }
            None
        }
        b'[' => {
            let (mut c, mut i) = (t + 1, 0);
            while c < end {
                path.push(i.to_string());
                if let Some(found) = first_repeat(body, toks, c, path) {
                    return Some(found);
                }
                path.pop();
                c = toks[c].next as usize;
                i += 1;
            }
            None
        }
        _ => None,
    }
}

/// The structure pass against serde_json on any bytes: never a panic; a body
/// serde_json reads is taped, every span slicing back to the value serde_json
/// reads there; a body it refuses is refused too, or differs only inside a leaf
/// (which the tape does not validate) or by nesting past serde_json's limit. A
/// leading byte order mark is read past, as the providers' parsers do.
fn check_json(body: &[u8]) {
    let serde = serde_json::from_slice::<Value>(&body[json::skip_bom(body)..]);
    let tape = json::tape(body);
    let Ok(toks) = tape else {
        assert!(
            serde.is_err(),
            "serde_json reads it, the tape refuses it ({:?}): {:?}",
            tape.err(),
            String::from_utf8_lossy(body)
        );
        return;
    };
    assert_eq!(toks[0].next as usize, toks.len());
    for tok in &toks {
        let _ = json::decode_str(tok.of(body)); // decoding any span never panics
    }
    let dup = json::duplicate_key(body, &toks);
    // The check made on the way proves distinct keys only where there are none, and
    // tapes the same.
    let (checked, unique) = json::tape_checking(body, |_| false, &mut Vec::new()).unwrap();
    assert_eq!(checked, toks);
    assert!(
        !unique || dup.is_none(),
        "{:?}",
        String::from_utf8_lossy(body)
    );
    match &serde {
        Ok(want) => {
            assert_eq!(
                &value_of_tape(body, &toks, 0),
                want,
                "{:?}",
                String::from_utf8_lossy(body)
            );
            // Every container span is a JSON text serde_json reads the same.
            for (t, tok) in toks.iter().enumerate() {
                let text = tok.of(body);
                if matches!(text.first(), Some(b'{' | b'[')) {
                    let v: Value = serde_json::from_slice(text).unwrap();
                    assert_eq!(v, value_of_tape(body, &toks, t));
                }
            }
            let want_dup = first_repeat(body, &toks, 0, &mut Vec::new());
            assert_eq!(dup, want_dup.as_deref().map(json::pointer_text));
            if let Some(pointer) = &dup {
                // Its ancestors repeat nothing, so a last-wins reader finds the key there.
                assert!(want.pointer(pointer).is_some(), "{pointer} not in {want}");
            }
        }
        Err(e) if too_deep_for_serde(e) => {}
        Err(e) => assert!(
            has_invalid_leaf(body, &toks),
            "taped, every leaf JSON, yet serde_json refuses it ({e}): {:?}",
            String::from_utf8_lossy(body)
        ),
    }
}

/// Rules that block when the body's value at `pointer` passes `test` (a TOML table).
fn probe_rules(pointer: &str, test: toml::Table) -> RuleSet {
    let mut body = toml::Table::new();
    body.insert(pointer.to_owned(), toml::Value::Table(test));
    let mut when = toml::Table::new();
    when.insert("body".into(), toml::Value::Table(body));
    let mut block = toml::Table::new();
    block.insert("block".into(), "hit".into());
    let mut rule = toml::Table::new();
    rule.insert("name".into(), "probe".into());
    rule.insert("on".into(), "before_provider_request".into());
    rule.insert("when".into(), toml::Value::Table(when));
    rule.insert(
        "actions".into(),
        toml::Value::Array(vec![toml::Value::Table(block)]),
    );
    let mut doc = toml::Table::new();
    doc.insert(
        "rule".into(),
        toml::Value::Array(vec![toml::Value::Table(rule)]),
    );
    let text = toml::to_string(&doc).unwrap();
    RuleSet::compile(&[("probe.toml".into(), text.clone())])
        .unwrap_or_else(|e| panic!("{text}\n{}", e[0]))
}

/// Whether `rules` block a /v1/messages request with `body`.
fn blocks(rules: &RuleSet, body: &[u8]) -> bool {
    let body = Bytes::copy_from_slice(body);
    let prompt =
        promptgate::PromptCell::new(body.clone(), Some(promptgate::Format::AnthropicMessages));
    let result = rules.apply_request(RequestCtx {
        id: None,
        provider: Provider::Anthropic,
        api: Api::Messages,
        method: &Method::POST,
        host: Some("127.0.0.1:8787"),
        path: "/v1/messages",
        model: None,
        conversation: None,
        headers: HeaderMap::new(),
        body: &body,
        prompt: &prompt,
    });
    matches!(result.verdict, Decision::Respond(_))
}

fn has_null(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(items) => items.iter().any(has_null),
        Value::Object(map) => map.values().any(has_null),
        _ => false,
    }
}

/// Pointer tokens into `v`: down through children `picks` chooses, then maybe one
/// token that names nothing (or an index serde_json does not read as one).
fn pick_path(v: &Value, picks: &[Index], tail: Option<&str>) -> Vec<String> {
    let mut at = v;
    let mut tokens = Vec::new();
    for pick in picks {
        match at {
            Value::Object(map) if !map.is_empty() => {
                let (k, next) = map.iter().nth(pick.index(map.len())).unwrap();
                tokens.push(k.clone());
                at = next;
            }
            Value::Array(items) if !items.is_empty() => {
                let i = pick.index(items.len());
                tokens.push(i.to_string());
                at = &items[i];
            }
            _ => break,
        }
    }
    tokens.extend(tail.map(str::to_owned));
    tokens
}

proptest! {
    #![proptest_config(config("fuzz/regressions/json.txt", 1))]

    #[test]
    fn json_random_values_tape_as_serde_reads_them(tree in json_tree(), noise in prop::collection::vec(any::<u8>(), 0..32)) {
        let text = json_text(&tree, &noise);
        prop_assert!(serde_json::from_str::<Value>(&text).is_ok(), "the generator wrote bad JSON: {}", text);
        check_json(text.as_bytes());
    }

    #[test]
    fn json_mutated_bodies_never_panic_and_agree_with_serde(
        body in prop_oneof![
            anthropic_body(),
            (json_tree(), prop::collection::vec(any::<u8>(), 0..16)).prop_map(|(t, n)| json_text(&t, &n).into_bytes()),
        ],
        mutations in prop::collection::vec(mutation(), 1..5),
    ) {
        let mut body = body;
        for m in &mutations {
            mutate(&mut body, m);
        }
        check_json(&body);
    }

    #[test]
    fn json_random_bytes_never_panic(bytes in prop::collection::vec(prop_oneof![any::<u8>(), select(STRUCTURAL)], 0..64)) {
        check_json(&bytes);
    }

    #[test]
    fn json_pointer_text_is_read_back_by_serde(tokens in prop::collection::vec(json_key(), 0..5)) {
        let pointer = json::pointer_text(&tokens);
        let mut v = Value::from("leaf");
        for t in tokens.iter().rev() {
            let mut map = serde_json::Map::new();
            map.insert(t.clone(), v);
            v = Value::Object(map);
        }
        prop_assert_eq!(v.pointer(&pointer), Some(&Value::from("leaf")), "{}", pointer);
    }
}

proptest! {
    // Each case compiles a rule file: fewer cases.
    #![proptest_config(config("fuzz/regressions/json-body-pointer.txt", 4))]

    #[test]
    fn json_body_pointer_reads_what_serde_pointer_reads(
        tree in json_object(),
        noise in prop::collection::vec(any::<u8>(), 0..16),
        picks in prop::collection::vec(any::<Index>(), 0..5),
        tail in prop::option::weighted(0.25, select(&["zz", "0", "01", "+1", "-", "1 ", "a/b"][..])),
        other in json_tree(),
        same in any::<bool>(),
    ) {
        let text = json_text(&tree, &noise);
        let want: Value = serde_json::from_str(&text).unwrap();
        let tokens = pick_path(&want, &picks, tail);
        let pointer = json::pointer_text(&tokens);
        let found = want.pointer(&pointer);
        // The value asked for: the one there, or another; TOML cannot write null.
        let candidate = match (same, found) {
            (true, Some(v)) => v.clone(),
            _ => serde_json::from_str(&json_text(&other, &[])).unwrap(),
        };
        let mut test = toml::Table::new();
        let fires = if has_null(&candidate) {
            test.insert("exists".into(), true.into());
            found.is_some()
        } else {
            test.insert("equals".into(), toml::Value::try_from(&candidate).unwrap());
            found == Some(&candidate)
        };
        let rules = probe_rules(&pointer, test);
        prop_assert_eq!(blocks(&rules, text.as_bytes()), fires, "{} at {:?} in {}", candidate, pointer, text);
    }
}

// ===================================================================== redaction

/// A secret planted in text: the text written around it (a keyword before, a
/// quote after) and the secret itself, what the redactor must remove.
#[derive(Debug, Clone)]
struct Plant {
    kind: &'static str,
    before: String,
    secret: String,
    after: String,
}

fn plant(kind: &'static str, before: impl Into<String>, secret: String, after: &str) -> Plant {
    Plant {
        kind,
        before: before.into(),
        secret,
        after: after.into(),
    }
}

/// Every shape the redactor lists, whole in its secret (no keyword around it).
fn bare_secret() -> BoxedStrategy<Plant> {
    prop_oneof![
        "sk-ant-(api03-)?[A-Za-z0-9_-]{16,48}".prop_map(|s| plant("anthropic", "", s, "")),
        "sk-(proj|svcacct|admin|None)-[A-Za-z0-9_-]{20,40}"
            .prop_map(|s| plant("openai", "", s, "")),
        "sk-[A-Za-z0-9]{32,48}".prop_map(|s| plant("openai", "", s, "")),
        "(sk|rk)_(live|test)_[A-Za-z0-9]{16,32}|whsec_[A-Za-z0-9]{16,32}"
            .prop_map(|s| plant("stripe", "", s, "")),
        "A(KIA|SIA|BIA|CCA)[A-Z0-9]{16}".prop_map(|s| plant("aws-access-key", "", s, "")),
        "AIza[0-9A-Za-z_-]{35}".prop_map(|s| plant("google-api-key", "", s, "")),
        "gh[pousr]_[A-Za-z0-9]{30,40}|github_pat_[A-Za-z0-9_]{22,40}"
            .prop_map(|s| plant("github", "", s, "")),
        "gl(pat|dt|rt|ptt|cbt|soat)-[A-Za-z0-9_-]{20,40}".prop_map(|s| plant("gitlab", "", s, "")),
        "xox[baprse]-[A-Za-z0-9-]{10,30}".prop_map(|s| plant("slack", "", s, "")),
        "hooks\\.slack\\.com/(services|workflows)/[A-Za-z0-9/_-]{20,40}"
            .prop_map(|s| plant("slack", "https://", s, "")),
        "eyJ[A-Za-z0-9_-]{8,20}\\.eyJ[A-Za-z0-9_-]{8,20}\\.[A-Za-z0-9_-]{0,30}"
            .prop_map(|s| plant("jwt", "", s, "")),
        (
            select(&["RSA ", "EC ", "OPENSSH ", ""][..]),
            prop::collection::vec("[A-Za-z0-9+/=]{16,64}", 1..4)
        )
            .prop_map(|(k, lines)| {
                let s = format!(
                    "-----BEGIN {k}PRIVATE KEY-----\n{}\n-----END {k}PRIVATE KEY-----",
                    lines.join("\n")
                );
                plant("pem-private-key", "", s, "")
            }),
    ]
    .boxed()
}

/// The shapes whose secret follows a keyword: only the value is the secret.
fn keyed_secret() -> BoxedStrategy<Plant> {
    prop_oneof![
        (
            select(
                &[
                    "aws_secret_access_key",
                    "AWS_SECRET_ACCESS_KEY",
                    "secret_access_key",
                    "SecretAccessKey"
                ][..]
            ),
            select(&[" = ", "=", ": ", ": \"", "=\""][..]),
            "[A-Za-z0-9/+=]{40}"
        )
            .prop_map(|(k, sep, s)| {
                let after = if sep.ends_with('"') { "\"" } else { "" };
                plant("aws-secret-key", format!("{k}{sep}"), s, after)
            }),
        "[0-9a-f]{40}".prop_map(|s| plant(
            "gcp-service-account",
            "\"private_key_id\": \"",
            s,
            "\""
        )),
        (
            select(&["Bearer ", "bearer ", "BEARER "][..]),
            "[A-Za-z0-9._~+/-]{16,40}={0,2}"
        )
            .prop_map(|(k, s)| plant("bearer", k, s, "")),
        (
            select(
                &[
                    "DB_PASSWORD",
                    "password",
                    "API_KEY",
                    "GITHUB_TOKEN",
                    "secret",
                    "Passwd",
                    "MY_CREDENTIAL",
                    "access_key",
                    "private_key"
                ][..]
            ),
            select(&["=", " = ", "=\""][..]),
            "[A-Za-z0-9][A-Za-z0-9!@#^+_.:/=-]{7,40}"
        )
            .prop_filter("not a placeholder", |(_, _, s)| !s
                .chars()
                .all(|c| c == 'x' || c == 'X'))
            .prop_map(|(k, sep, s)| {
                let after = if sep.ends_with('"') { "\"" } else { "" };
                plant("env-secret", format!("{k}{sep}"), s, after)
            }),
    ]
    .boxed()
}

fn any_secret() -> BoxedStrategy<Plant> {
    prop_oneof![bare_secret(), keyed_secret()].boxed()
}

/// The shapes whose secret may hold a `/`, with one put in: what `\/` escapes.
fn slashed_secret(kinds: &'static [&'static str]) -> BoxedStrategy<Plant> {
    (any_secret(), any::<Index>())
        .prop_filter_map("no `/` in this shape", move |(mut p, at)| {
            if !kinds.contains(&p.kind) {
                return None;
            }
            let can_hold_slash = matches!(
                p.kind,
                "aws-secret-key" | "bearer" | "env-secret" | "pem-private-key"
            ) || p.secret.starts_with("hooks.slack.com/");
            if !can_hold_slash {
                return None;
            }
            if !p.secret.contains('/') {
                // Inside the random part: a PEM's first body line, else past the first
                // character (no shape's fixed start holds a `/`).
                let (from, to) = match p.secret.find('\n') {
                    Some(nl) => (nl + 1, nl + 1 + p.secret[nl + 1..].find('\n').unwrap()),
                    None => (1, p.secret.len()),
                };
                let i = from + at.index(to - from);
                p.secret.replace_range(i..i + 1, "/");
            }
            Some(p)
        })
        .boxed()
}

/// Prose around a planted secret: words that share no character with a secret's
/// alphabet, so any piece of the secret found in the output is the secret's.
fn prose() -> impl Strategy<Value = String> {
    prop::collection::vec(
        select(&["·", "—", "日本語", "¿", "→", "…", "§", "!", "«»", "€"][..]),
        0..4,
    )
    .prop_map(|w| w.join(" "))
}

/// How a secret's characters are written inside a JSON string.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Escape {
    /// Only what JSON requires (a PEM's newlines as `\n`).
    Plain,
    /// Every `/` as `\/`.
    Slash,
    /// The characters `mask` picks as `\uXXXX` (at least one).
    Unicode,
}

/// A message body holding `prose plant prose` in one text block, the secret's
/// characters escaped as `escape` (picked by `mask`): the body, the text.
fn secret_body(p: &Plant, lead: &str, trail: &str, escape: Escape, mask: &[bool]) -> String {
    let plain = |s: &str| {
        let quoted = serde_json::to_string(s).unwrap();
        quoted[1..quoted.len() - 1].to_owned()
    };
    let mut inner = String::new();
    if !lead.is_empty() {
        inner.push_str(&plain(&format!("{lead} ")));
    }
    inner.push_str(&plain(&p.before));
    let mut any = false;
    for (i, c) in p.secret.chars().enumerate() {
        let pick = mask.get(i % mask.len().max(1)).copied().unwrap_or(false);
        match (escape, c) {
            (Escape::Slash, '/') => inner.push_str("\\/"),
            (Escape::Unicode, c) if c != '\n' && (pick || (!any && i + 1 == p.secret.len())) => {
                inner.push_str(&format!("\\u{:04x}", c as u32));
                any = true;
            }
            (_, c) => inner.push_str(&plain(&c.to_string())),
        }
    }
    inner.push_str(&plain(&p.after));
    if !trail.is_empty() {
        inner.push_str(&plain(&format!(" {trail}")));
    }
    format!(
        r#"{{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{{"role":"user","content":[{{"type":"text","text":"{inner}"}}]}}]}}"#
    )
}

fn redactor() -> Redactor {
    Redactor::new(&[], &[]).unwrap()
}

/// `text` without the redactor's markers: their kind names may spell part of a secret.
fn unmarked(text: &str) -> String {
    static MARKER: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"\[REDACTED:[a-z0-9-]+:[0-9a-f]{8}\]").unwrap()
    });
    MARKER.replace_all(text, "[R]").into_owned()
}

/// Pieces of `secret` long enough to tell it: any 12 characters of it (or all of
/// it, when shorter) left in `text`, out of the redactor's markers, are a leak.
fn leaked_piece<'s>(text: &str, secret: &'s str) -> Option<&'s str> {
    let text = unmarked(text);
    let chars: Vec<(usize, char)> = secret.char_indices().collect();
    let n = chars.len().min(12);
    (0..=chars.len() - n).find_map(|i| {
        let start = chars[i].0;
        let end = chars.get(i + n).map_or(secret.len(), |c| c.0);
        text.contains(&secret[start..end])
            .then(|| &secret[start..end])
    })
}

/// The redactor on a JSON body holding a planted secret: the output is still
/// JSON, and neither it nor the text it decodes to holds the secret.
fn check_redacts_json(body: &str, p: &Plant) {
    let mut summary = Summary::new();
    let out = redactor().redact(body.as_bytes(), &[], &mut summary);
    let out = std::str::from_utf8(&out).expect("redaction keeps UTF-8");
    let parsed: Value = serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let text = parsed["messages"][0]["content"][0]["text"]
        .as_str()
        .unwrap();
    if let Some(piece) = leaked_piece(text, &p.secret) {
        panic!(
            "{} secret {:?}: {piece:?} left in {text:?}\nbody {body}\nout  {out}",
            p.kind, p.secret
        );
    }
    assert!(!summary.is_empty(), "nothing counted for {out}");
}

/// An Anthropic message stream whose text deltas are `pieces`.
fn message_stream(pieces: &[String]) -> Vec<u8> {
    let mut s = String::from(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n\
         event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    );
    for piece in pieces {
        let delta = serde_json::json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}});
        s.push_str(&format!("event: content_block_delta\ndata: {delta}\n\n"));
    }
    s.push_str(
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
         event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":9}}\n\n\
         event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    s.into_bytes()
}

/// The capture of a streamed answer, through the observer and the capture record:
/// the stored events and the stored message.
fn capture_stream(sse: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    let observation = promptgate::observe(
        Provider::Anthropic,
        Api::Messages,
        &headers,
        &[Bytes::copy_from_slice(sse)],
        false,
        16 << 20,
        true, // the capture reads the message
    );
    let mut record =
        ExchangeRecord::begin(ExchangeId::new(), None, Method::POST, "/v1/messages".into());
    record.provider = Some(Provider::Anthropic);
    record.api = Some(Api::Messages);
    let body = Bytes::from_static(b"{\"model\":\"claude-sonnet-4-5\",\"messages\":[]}");
    record.set_request_body(body.clone(), body);
    record.status = Some(http::StatusCode::OK);
    record.response_headers = headers;
    record.observation = Some(observation);
    let stored = CaptureRecord::redacted(&record, &redactor());
    let message = stored
        .response
        .message
        .map(|m| m.bytes.to_vec())
        .unwrap_or_default();
    (stored.response.body.bytes.to_vec(), message)
}

/// `text` cut into pieces of at least 3 characters, as `lens` (cycled) says.
fn cut_text(text: &str, lens: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out: Vec<String> = Vec::new();
    let mut at = 0;
    for len in lens.iter().cycle() {
        if at >= chars.len() {
            break;
        }
        let end = (at + len).min(chars.len());
        let piece: String = chars[at..end].iter().collect();
        match out.last_mut() {
            // A short last piece joins the one before it.
            Some(last) if end - at < 3 => last.push_str(&piece),
            _ => out.push(piece),
        }
        at = end;
    }
    out
}

/// A secret streamed in deltas of at least 3 characters: `p` planted between
/// prose, cut as `lens` says, through [`check_scrubbed`].
fn check_scrubs_stream(p: &Plant, lead: &str, trail: &str, lens: &[usize]) {
    let lead = if lead.is_empty() {
        String::new()
    } else {
        format!("{lead} ")
    };
    let trail = if trail.is_empty() {
        String::new()
    } else {
        format!(" {trail}")
    };
    let text = format!("{lead}{}{}{}{trail}", p.before, p.secret, p.after);
    let sse = message_stream(&cut_text(&text, lens));
    check_scrubbed(&sse, &p.secret, lead.len() + p.before.len(), p.kind);
}

/// The text deltas of an Anthropic stream, in order.
fn text_deltas(sse: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut decoder = SseDecoder::default();
    decoder.feed(sse, &mut |name, data| {
        if name == "content_block_delta" {
            let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
            out.push(v["delta"]["text"].as_str().unwrap().to_owned());
        }
    });
    out
}

/// The capture of a stream whose deltas carry `secret` (at byte `secret_at` of
/// their joined text): the stored events keep no piece of 3 or more characters
/// of it that one delta carried, and neither they nor the stored message hold it.
fn check_scrubbed(sse: &[u8], secret: &str, secret_at: usize, kind: &str) {
    let pieces = text_deltas(sse);
    let text = pieces.concat();
    assert_eq!(&text[secret_at..secret_at + secret.len()], secret);
    let (events, message) = capture_stream(sse);
    let stored = text_deltas(&events);
    assert_eq!(
        stored.len(),
        pieces.len(),
        "{}",
        String::from_utf8_lossy(&events)
    );
    let mut at = 0;
    for (piece, kept) in pieces.iter().zip(&stored) {
        let (a, b) = (
            at.max(secret_at),
            (at + piece.len()).min(secret_at + secret.len()),
        );
        if b >= a + 3 {
            let part = &text[a..b];
            assert!(
                !unmarked(kept).contains(part),
                "{kind} secret {secret:?}: piece {part:?} of delta {piece:?} kept as {kept:?}; deltas {pieces:?}"
            );
        }
        at += piece.len();
    }
    let joined: String = stored.concat();
    assert!(
        !joined.contains(secret),
        "whole secret in the stored deltas {stored:?}"
    );
    let message = String::from_utf8_lossy(&message);
    assert!(message.contains("REDACTED"), "the message: {message}");
    assert!(
        leaked_piece(&message, secret).is_none(),
        "the message: {message}"
    );
    let events = String::from_utf8_lossy(&events);
    assert!(
        !events.contains(secret),
        "whole secret in the stored events {events}"
    );
}

proptest! {
    #![proptest_config(config("fuzz/regressions/redact.txt", 2))]

    #[test]
    fn redact_plain_json_secrets_are_found(p in any_secret(), lead in prose(), trail in prose()) {
        check_redacts_json(&secret_body(&p, &lead, &trail, Escape::Plain, &[]), &p);
    }

    #[test]
    fn redact_slash_escaped_pem_keys_are_found(p in slashed_secret(&["pem-private-key"]), lead in prose(), trail in prose()) {
        check_redacts_json(&secret_body(&p, &lead, &trail, Escape::Slash, &[]), &p);
    }

    // Found here: a `\/` escape hid AWS secret keys, bearer tokens, .env values and
    // Slack webhooks (fuzz/corpus/redact/*-slash.json); fixed with the \u escapes.
    #[test]
    fn redact_slash_escaped_secrets_are_found(
        p in slashed_secret(&["aws-secret-key", "bearer", "env-secret", "slack"]), lead in prose(), trail in prose(),
    ) {
        check_redacts_json(&secret_body(&p, &lead, &trail, Escape::Slash, &[]), &p);
    }

    #[test]
    fn redact_unicode_escaped_secrets_are_found(
        p in any_secret(), lead in prose(), trail in prose(), mask in prop::collection::vec(any::<bool>(), 1..16),
    ) {
        check_redacts_json(&secret_body(&p, &lead, &trail, Escape::Unicode, &mask), &p);
    }
}

proptest! {
    // Each case runs the observer and a whole capture record: fewer cases.
    #![proptest_config(config("fuzz/regressions/redact-stream.txt", 4))]

    #[test]
    fn redact_secrets_split_across_stream_deltas_are_scrubbed(
        p in bare_secret(), lead in prose(), trail in prose(), lens in prop::collection::vec(prop_oneof![3usize..12, 3usize..60], 1..8),
    ) {
        check_scrubs_stream(&p, &lead, &trail, &lens);
    }

    #[test]
    fn redact_keyed_secrets_split_across_short_deltas_are_scrubbed(
        p in keyed_secret(),
        lead in prose(),
        trail in prose(),
        // Shorter than any keyed secret (8 at least): no delta holds one whole
        // between other text, the case the ignored property below finds broken.
        lens in prop::collection::vec(3usize..8, 1..8),
    ) {
        check_scrubs_stream(&p, &lead, &trail, &lens);
    }

    // Found here: a keyword's secret streamed whole inside one delta, among other text,
    // stayed in the stored events (fuzz/corpus/sse/gcp-key-id-whole-in-one-delta.sse).
    #[test]
    fn redact_keyed_secrets_split_across_stream_deltas_are_scrubbed(
        p in keyed_secret(), lead in prose(), trail in prose(), lens in prop::collection::vec(prop_oneof![3usize..12, 3usize..60], 1..8),
    ) {
        check_scrubs_stream(&p, &lead, &trail, &lens);
    }
}

// ===================================================================== rule loader

const EXAMPLES: &[(&str, &str)] = &[
    (
        "10-org-policy.toml",
        include_str!("../rules/examples/10-org-policy.toml"),
    ),
    (
        "20-block-opus-for-batch.toml",
        include_str!("../rules/examples/20-block-opus-for-batch.toml"),
    ),
    (
        "30-strip-cache-control.toml",
        include_str!("../rules/examples/30-strip-cache-control.toml"),
    ),
    (
        "40-ttl-1h.toml",
        include_str!("../rules/examples/40-ttl-1h.toml"),
    ),
    (
        "50-move-dates.toml",
        include_str!("../rules/examples/50-move-dates.toml"),
    ),
    (
        "60-remove-tool.toml",
        include_str!("../rules/examples/60-remove-tool.toml"),
    ),
    (
        "70-note-429.toml",
        include_str!("../rules/examples/70-note-429.toml"),
    ),
];

/// Pieces of rule files, so random text reaches past the TOML parser into the
/// rule compiler.
const TOML_TOKENS: &[&str] = &[
    "[[rule]]\n",
    "[rule]\n",
    "name = ",
    "\"r\"",
    "on = ",
    "\"before_provider_request\"",
    "\"after_provider_response\"",
    "when = {",
    "}",
    "actions = [",
    "]",
    "{ block = \"no\" }",
    "{ block = { status = 999 } }",
    "enforce = true",
    "enabled = 1",
    "model = ",
    "\"claude-*\"",
    "header.\"x\" = ",
    "body.\"/a/0\" = { exists = true }",
    "body.\"a~2\" = 1",
    "{ json.set = { pointer = \"/a\", value = 1 } }",
    "{ system.move_to_user = { regex = \"(\" } }",
    "{ log = \"{nope}\" }",
    "\"${env:NOPE}\"",
    "{ model.allow = [] }",
    "status = 42",
    "\n",
    " ",
    "=",
    ",",
    "'",
    "\"\"\"",
    "#",
    "é",
    "\t",
    "\r\n",
    "[",
    "1",
    "1.5",
    "true",
    "[[rule]]\nname = \"r\"\non = \"before_provider_request\"\n",
];

fn rule_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,120}",
        any::<String>(),
        prop::collection::vec(select(TOML_TOKENS), 0..40).prop_map(|t| t.concat()),
        (select(EXAMPLES), prop::collection::vec(mutation(), 1..6)).prop_map(|((_, text), ms)| {
            let mut bytes = text.as_bytes().to_vec();
            for m in &ms {
                mutate(&mut bytes, m);
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }),
        (
            select(EXAMPLES),
            any::<Index>(),
            prop::collection::vec(select(TOML_TOKENS), 1..6)
        )
            .prop_map(|((_, text), at, tokens)| {
                let mut at = at.index(text.len() + 1);
                while !text.is_char_boundary(at) {
                    at -= 1;
                }
                format!("{}{}{}", &text[..at], tokens.concat(), &text[at..])
            }),
    ]
}

/// The loader on one file: never a panic, and every error at a `file:line:col`
/// inside it (line ≤ its lines, col ≤ that line's characters + 1).
fn check_rule_errors(name: &str, text: &str) {
    let Err(errors) = RuleSet::compile(&[(name.to_owned(), text.to_owned())]) else {
        return;
    };
    assert!(!errors.is_empty());
    let lines: Vec<&str> = text.split('\n').collect();
    for e in &errors {
        assert_eq!(e.file, name);
        assert!(
            e.line >= 1 && e.line <= lines.len(),
            "{e}: line {} of {} in {text:?}",
            e.line,
            lines.len()
        );
        let width = lines[e.line - 1].chars().count();
        assert!(
            e.col >= 1 && e.col <= width + 1,
            "{e}: col {} of {width} in {text:?}",
            e.col
        );
        assert!(
            e.to_string()
                .starts_with(&format!("{name}:{}:{}: ", e.line, e.col)),
            "{e}"
        );
    }
}

proptest! {
    #![proptest_config(config("fuzz/regressions/rules.txt", 1))]

    #[test]
    fn rules_random_toml_never_panics_and_errors_point_inside(text in rule_text()) {
        check_rule_errors("rules/fuzz.toml", &text);
    }
}

// ===================================================================== decoding

#[derive(Debug, Clone, Copy, PartialEq)]
enum Coding {
    Gzip,
    Zlib,
    RawDeflate,
    Brotli,
    Zstd,
}

impl Coding {
    const ALL: [Coding; 5] = [
        Coding::Gzip,
        Coding::Zlib,
        Coding::RawDeflate,
        Coding::Brotli,
        Coding::Zstd,
    ];

    /// The `Content-Encoding` that names it.
    fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Zlib | Coding::RawDeflate => "deflate",
            Coding::Brotli => "br",
            Coding::Zstd => "zstd",
        }
    }

    fn encode(self, data: &[u8]) -> Vec<u8> {
        let level = flate2::Compression::fast();
        match self {
            Coding::Gzip => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), level);
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            Coding::Zlib => {
                let mut e = flate2::write::ZlibEncoder::new(Vec::new(), level);
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            Coding::RawDeflate => {
                let mut e = flate2::write::DeflateEncoder::new(Vec::new(), level);
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            Coding::Brotli => {
                let mut out = Vec::new();
                let params = brotli::enc::BrotliEncoderParams {
                    quality: 1,
                    ..Default::default()
                };
                brotli::BrotliCompress(&mut &data[..], &mut out, &params).unwrap();
                out
            }
            Coding::Zstd => {
                // With the content checksum, as curl and browsers' zstd writers send it.
                let mut e = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
                e.include_checksum(true).unwrap();
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
        }
    }

    /// Whether the format checks its content, so a changed byte is an error or
    /// changes nothing (brotli and raw deflate carry no checksum; a zlib body that
    /// fails its check is tried again as raw deflate).
    fn checked(self) -> bool {
        matches!(self, Coding::Gzip | Coding::Zstd)
    }
}

fn coding() -> impl Strategy<Value = Coding> {
    select(&Coding::ALL[..])
}

fn plain_data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..2048),
        // Compressible: repeats, as real bodies are.
        (prop::collection::vec(any::<u8>(), 1..16), 1usize..400)
            .prop_map(|(unit, n)| unit.repeat(n)),
        anthropic_body(),
    ]
}

/// The decompression bombs: 32 MiB of zeros, a few KB compressed.
fn bomb(c: Coding) -> &'static [u8] {
    static BOMBS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    const MB: usize = 1 << 20;
    let bombs = BOMBS.get_or_init(|| {
        Coding::ALL
            .iter()
            .map(|c| match c {
                // Gzip members and zstd frames may follow one another: one made of
                // 1 MiB, repeated, is a bomb of many MiB made at the cost of 1.
                Coding::Gzip | Coding::Zstd => c.encode(&vec![0; MB]).repeat(32),
                _ => c.encode(&vec![0; 32 * MB]),
            })
            .collect()
    });
    &bombs[Coding::ALL.iter().position(|x| *x == c).unwrap()]
}

/// A bomb stops at the limit: `TooLarge`, having held at most twice the limit
/// (the output buffer's doubling) plus what the decoder needs for its window.
fn check_bomb(coding: Coding, body: &[u8], limit: u64) {
    let body = Bytes::copy_from_slice(body);
    let (result, peak) = peak_heap(|| decode::decode(coding.name(), body, limit));
    assert_eq!(result, Err(DecodeError::TooLarge { limit }), "{coding:?}");
    // Brotli's ring buffer is at most 16 MiB (its largest window); the others' state is small.
    let window = if coding == Coding::Brotli {
        16 << 20
    } else {
        1 << 20
    };
    let bound = 2 * limit as usize + window;
    assert!(
        peak <= bound,
        "{coding:?}: {peak} bytes held for a limit of {limit} (bound {bound})"
    );
}

proptest! {
    #![proptest_config(config("fuzz/regressions/decode.txt", 2))]

    #[test]
    fn decode_every_coding_round_trips_up_to_its_limit(data in plain_data(), c in coding(), stacked in prop::option::of(coding())) {
        let mut body = c.encode(&data);
        let mut name = c.name().to_owned();
        // Every stage's output must fit: the inner coding's bytes too.
        let mut limit = data.len() as u64;
        if let Some(outer) = stacked {
            limit = limit.max(body.len() as u64);
            body = outer.encode(&body);
            name = format!("{name}, {}", outer.name());
        }
        let want = Bytes::from(data.clone());
        prop_assert_eq!(decode::decode(&name, Bytes::from(body.clone()), limit), Ok(want.clone()));
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_ENCODING, HeaderValue::from_str(&name.to_uppercase()).unwrap());
        prop_assert_eq!(decode::request_plain(&headers, &Bytes::from(body.clone()), limit), Ok(want));
        if stacked.is_none() && limit > 0 {
            // One byte short of the limit: too large, whatever the coding.
            prop_assert_eq!(decode::decode(&name, Bytes::from(body), limit - 1), Err(DecodeError::TooLarge { limit: limit - 1 }));
        }
    }

    #[test]
    fn decode_corrupt_bodies_are_errors_never_panics(
        data in plain_data(), c in coding(), mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let good = c.encode(&data);
        let mut body = good.clone();
        for m in &mutations {
            mutate(&mut body, m);
        }
        let limit = 1 << 16;
        let got = decode::decode(c.name(), Bytes::from(body.clone()), limit);
        if let Ok(out) = &got {
            prop_assert!(out.len() as u64 <= limit);
            // A checksummed format reads a changed body as an error, or as the same data.
            if c.checked() && body != good && mutations.len() == 1 {
                prop_assert_eq!(&out[..], &data[..], "{:?} {:?}", c, mutations);
            }
        }
        // A body cut short is an error: never a shorter body taken for the whole.
        if !data.is_empty() && body.len() < good.len() && good.starts_with(&body) && !body.is_empty() {
            prop_assert!(got.is_err(), "{:?} cut to {} of {} bytes read as {:?}", c, body.len(), good.len(), got.map(|b| b.len()));
        }
    }

    #[test]
    fn decode_bombs_stop_at_the_limit(c in coding(), limit in 1u64..(1 << 20)) {
        check_bomb(c, bomb(c), limit);
    }
}

// ===================================================================== corpus

/// Every hand-picked or once-found input under `fuzz/corpus/`, through the checks
/// of its target: `json/` bodies, `sse/` streams, `rules/` files, `decode/<coding>.*`.
#[test]
fn corpus_replays() {
    let mut replayed = 0;
    for (_, bytes) in corpus("json") {
        check_json(&bytes);
        replayed += 1;
    }
    for (name, bytes) in corpus("sse") {
        for cuts in [Cuts::EveryByte, Cuts::At(Vec::new())] {
            check_sse_splits(&bytes, &cuts);
        }
        if bytes.starts_with(b": secret=") {
            check_sse_seed(&name, &bytes);
        }
        replayed += 1;
    }
    for (_, bytes) in corpus("redact") {
        check_redact_seed(&bytes);
        replayed += 1;
    }
    for (name, bytes) in corpus("rules") {
        check_rule_errors(&name, &String::from_utf8_lossy(&bytes));
        replayed += 1;
    }
    for (name, bytes) in corpus("decode") {
        let coding = Coding::ALL
            .into_iter()
            .find(|c| name.starts_with(c.name()))
            .unwrap_or_else(|| panic!("{name}: name a corpus file after its coding"));
        if name.contains("bomb") {
            check_bomb(coding, &bytes, 1 << 20);
        } else {
            let _ = decode::decode(coding.name(), Bytes::from(bytes), 1 << 20);
        }
        replayed += 1;
    }
    assert!(replayed >= 4, "the corpus is missing: {replayed} files");
}

/// A stream with a planted key, named in its first line `: secret=KEY`: the
/// capture scrubs it from the stored events.
fn check_sse_seed(name: &str, bytes: &[u8]) {
    let line = bytes.split(|b| *b == b'\n').next().unwrap();
    let secret = String::from_utf8_lossy(&line[b": secret=".len()..]).into_owned();
    let at = text_deltas(bytes)
        .concat()
        .find(&secret)
        .unwrap_or_else(|| panic!("{name}: no {secret} in its deltas"));
    check_scrubbed(bytes, &secret, at, name);
}

/// A redaction seed: `{"kind", "secret", "body"}`, the body holding the secret.
fn check_redact_seed(seed: &[u8]) {
    let seed: Value = serde_json::from_slice(seed).unwrap();
    let p = Plant {
        kind: "seed",
        before: String::new(),
        secret: seed["secret"].as_str().unwrap().to_owned(),
        after: String::new(),
    };
    check_redacts_json(seed["body"].as_str().unwrap(), &p);
}

/// The hand-picked seeds, and what each must give beyond its target's checks.
#[test]
fn corpus_seeds_say_what_they_are_for() {
    let deep = std::fs::read(corpus_dir("json").join("nested-200.json")).unwrap();
    let toks = json::tape(&deep).unwrap();
    assert!(
        serde_json::from_slice::<Value>(&deep).is_err(),
        "past serde_json's nesting limit"
    );
    let pointer = format!("{}/model", "/a".repeat(150));
    let rules = probe_rules(
        &pointer,
        [("exists".to_owned(), toml::Value::Boolean(true))]
            .into_iter()
            .collect(),
    );
    assert!(blocks(&rules, &deep), "a rule reads 150 levels down");
    assert_eq!(json::duplicate_key(&deep, &toks), None);

    let dup = std::fs::read(corpus_dir("json").join("duplicate-keys.json")).unwrap();
    let toks = json::tape(&dup).unwrap();
    assert_eq!(json::duplicate_key(&dup, &toks).as_deref(), Some("/model"));
    let last: toml::Table = [("equals".to_owned(), toml::Value::from("claude-opus-4-1"))]
        .into_iter()
        .collect();
    assert!(
        blocks(&probe_rules("/model", last), &dup),
        "rules read the last model"
    );

    // Issue 48: a byte order mark first and a key spelt with an escape hid the model.
    let bom = std::fs::read(corpus_dir("json").join("bom-escaped-model.json")).unwrap();
    assert!(bom.starts_with(b"\xEF\xBB\xBF{\"mod\\u0065l\""));
    let opus: toml::Table = [("equals".to_owned(), toml::Value::from("claude-opus-4-1"))]
        .into_iter()
        .collect();
    assert!(
        blocks(&probe_rules("/model", opus), &bom),
        "rules read the model"
    );
    assert_eq!(
        promptgate::sniff(&bom).model.as_deref(),
        Some("claude-opus-4-1")
    );

    // Found by `sse_valid_streams_give_their_events_however_split`: a BOM hid the first field.
    let bom = std::fs::read(corpus_dir("sse").join("bom-first.sse")).unwrap();
    assert_eq!(sse_events(&[&bom]), [(String::new(), String::new())]);

    let bomb = std::fs::read(corpus_dir("decode").join("gzip-bomb-8MiB.gz")).unwrap();
    assert!(bomb.len() < 16 << 10, "a bomb of a few KB");
    let whole = decode::decode("gzip", Bytes::from(bomb), 16 << 20).unwrap();
    assert!(whole.len() == 8 << 20 && whole.iter().all(|b| *b == 0));

    let examples = RuleSet::load_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/examples"));
    assert!(
        examples.is_ok(),
        "the examples the rule fuzzing mutates load"
    );
}
